"""Checkpoint formats as data, and detection from a `quantization_config`.

Adding a format means adding a module that declares its `FORMAT` and listing it
in `FORMATS`; no other code changes.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from . import autoround, awq, compressed_tensors, gptq
from .spec import Dim, FormatDecl, ModuleFilter, Need, QuantSpec, Role, TensorLayout

FORMATS: tuple[FormatDecl, ...] = (awq.FORMAT, gptq.FORMAT, compressed_tensors.FORMAT, autoround.FORMAT)


def accepted_formats() -> str:
    """The registered formats and the `quant_method` values each answers to, for error messages."""
    return "; ".join(f"{decl.name} (quant_method {' or '.join(repr(m) for m in decl.quant_methods)})"
                     for decl in FORMATS)


def resolve_quant_spec(qconfig: dict[str, Any]) -> QuantSpec:
    """Detect the format from `quant_method` and parse the rest of the config."""
    if not isinstance(qconfig, dict):
        raise ConfigError(f"quantization_config must be a JSON object, found {type(qconfig).__name__}.")
    method = qconfig.get("quant_method")
    for decl in FORMATS:
        if method in decl.quant_methods:
            return decl.parse(qconfig)
    known = [m for decl in FORMATS for m in decl.quant_methods]
    raise ConfigError(f"quantization_config: quant_method={method!r} is not a WNA16 format this package "
                      f"loads; expected one of {known}.")


__all__ = ["FORMATS", "accepted_formats", "Dim", "FormatDecl", "ModuleFilter", "Need", "QuantSpec", "Role", "TensorLayout",
           "resolve_quant_spec"]
