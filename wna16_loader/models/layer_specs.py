"""One quantization spec per MoE layer, from the format's per-module rules (`formats.rules`).

Every routed-expert module of a layer (each expert's gate, up and down) is resolved by the rules its
quantizer wrote; a fused layer holds one spec, so modules of one layer that resolve differently are an
error naming them, their specs and the rules. The layer is found by its experts prefix (any naming the
families table parses), so every kind of layer resolves through `resolve_layer_spec`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Container, Sequence

import torch

from ..errors import ConfigError
from ..formats import ModuleRules, ModuleSpec, QuantSpec
from .families import Family

SHOWN = 4  # modules listed per spec in an error


@dataclass(frozen=True)
class LayerSpec:
    """The spec of one MoE layer and the rule it came from; `dtype`: the stored dtype of float weights
    (from the tensors' headers; None when only the config was read); `found`: what the tensors showed
    when they overrode the config (None when they agree)."""

    spec: QuantSpec
    rule: str
    dtype: torch.dtype | None = None
    found: str | None = None

    def describe(self) -> str:
        """e.g. `gptq 8-bit g64 asym  <- dynamic rule '+:...' {'bits': 8}`."""
        dtype = f" {str(self.dtype).removeprefix('torch.')}" if self.dtype is not None and not self.spec.quantized \
            else ""
        found = f" [tensors decide: {self.found}]" if self.found else ""
        return f"{self.spec.describe()}{dtype}  <- {self.rule}{found}"


def resolve_layer_spec(rules: ModuleRules, prefix: str, modules: Sequence[str],
                       known: Container[str] = ()) -> LayerSpec:
    """The one spec of the layer whose routed-expert modules are `modules` (`known`: every module name of
    the checkpoint, for rules that need them)."""
    resolved = {module: rules.resolve(module, known) for module in modules}
    refused = [(module, found) for module, found in resolved.items() if found.refusal is not None]
    if refused:
        module, found = refused[0]
        raise ConfigError(f"{prefix}: routed expert {module} is covered by {found.origin}: {found.refusal}. "
                          f"{len(refused)} of the layer's {len(modules)} expert modules are, so its experts are "
                          f"not WNA16 (4- or 8-bit integer weights, 16-bit activations); this package cannot load "
                          f"them. Quantize the experts with a WNA16 scheme, or change the rule.")
    by_spec: dict[QuantSpec, list[tuple[str, ModuleSpec]]] = defaultdict(list)
    for module, found in resolved.items():
        by_spec[found.spec].append((module, found))
    if len(by_spec) > 1:
        raise ConfigError(f"{prefix}: the expert modules of this MoE layer resolve to {len(by_spec)} different "
                          f"quantization specs, but one fused layer holds one spec:\n{_groups(by_spec)}\n"
                          f"Fix the config's rules so that every expert and projection of the layer gets the same "
                          f"spec (bits, group size, symmetry, act-order, or float).")
    (spec, entries), = by_spec.items()
    return LayerSpec(spec, _origin([found.origin for _, found in entries]))


def _groups(by_spec: dict[QuantSpec, list[tuple[str, ModuleSpec]]]) -> str:
    lines = []
    for spec, entries in by_spec.items():
        names = [module for module, _ in entries]
        more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
        lines.append(f"  - {spec.describe()} ({len(names)} modules, by {_origin([f.origin for _, f in entries])}): "
                     f"{', '.join(names[:SHOWN])}{more}")
    return "\n".join(lines)


def _origin(origins: list[str]) -> str:
    distinct = list(dict.fromkeys(origins))
    return distinct[0] if len(distinct) == 1 else f"{distinct[0]} (and {len(distinct) - 1} more entries like it)"


def expert_modules(prefix: str, num_experts: int, family: Family, gated: bool) -> list[str]:
    """The per-expert module names of a layer in the family's naming (first name of each projection), for a
    layer resolved from the config alone."""
    names: dict[str, str] = {}
    for name, kind in family.projections:
        if kind in ("gate", "up", "down") and (gated or kind != "gate"):
            names.setdefault(kind, name)
    return [f"{prefix}.{e}.{name}" for e in range(num_experts) for name in names.values()]
