"""Checkpoint formats as data, and detection from a `quantization_config`.

Adding a format means adding a module that declares its `FORMAT` and listing it
in `FORMATS`; no other code changes.
"""

from __future__ import annotations

import difflib
from typing import Any

from ..errors import ConfigError
from . import autoround, awq, compressed_tensors, gptq
from .rules import ModuleRules, ModuleSpec
from .spec import Dim, FormatDecl, Need, QuantSpec, Role, TensorLayout, unquantized_spec

FORMATS: tuple[FormatDecl, ...] = (awq.FORMAT, gptq.FORMAT, compressed_tensors.FORMAT, autoround.FORMAT)


def accepted_formats() -> str:
    """The registered formats and the `quant_method` values each answers to, for error messages."""
    return "; ".join(f"{decl.name} (quant_method {' or '.join(repr(m) for m in decl.quant_methods)})"
                     for decl in FORMATS)


def resolve_quant_spec(qconfig: dict[str, Any]) -> QuantSpec:
    """Detect the format from `quant_method` and parse the rest of the config (its top-level spec)."""
    return format_of(qconfig).parse(qconfig)


def resolve_module_rules(qconfig: dict[str, Any]) -> ModuleRules:
    """The format's per-module rules of `qconfig` (which spec each module was written with)."""
    decl = format_of(qconfig)
    return decl.rules(qconfig, decl.parse(qconfig))


def format_of(qconfig: dict[str, Any], *, where: str = "quantization_config") -> FormatDecl:
    """The declaration whose `quant_method` values include the config's; `where` names the config in errors
    (e.g. `ckpt/config.json: quantization_config`)."""
    if not isinstance(qconfig, dict):
        raise ConfigError(f"{where} must be a JSON object, found {type(qconfig).__name__}.")
    method = qconfig.get("quant_method")
    for decl in FORMATS:
        if method in decl.quant_methods:
            return decl
    known = [m for decl in FORMATS for m in decl.quant_methods]
    close = difflib.get_close_matches(str(method).lower(), known, n=1, cutoff=0.6) if method is not None else []
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"{where}: quant_method={method!r} is not a WNA16 format this package loads; {hint}"
                      f"expected one of {known}.")


__all__ = ["FORMATS", "accepted_formats", "Dim", "FormatDecl", "ModuleRules", "ModuleSpec", "Need", "QuantSpec", "Role",
           "TensorLayout", "format_of", "resolve_module_rules", "resolve_quant_spec", "unquantized_spec"]
