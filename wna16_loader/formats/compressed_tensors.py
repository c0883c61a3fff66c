"""compressed-tensors `pack-quantized` (llm-compressor).

| tensor            | storage          | packing                                   |
|-------------------|------------------|-------------------------------------------|
| weight_packed     | [N, K/P] int32   | along K, least significant first, q+2^(b-1) |
| weight_scale      | [N, K/G]         | fp16 / bf16                               |
| weight_zero_point | [N/P, K/G] int32 | along N (asymmetric only)                 |
| weight_g_idx      | [K] int32        | actorder "group" only                     |
| weight_shape      | [2]              | the unpacked [N, K]                       |

Stored values carry the same 2^(b-1) offset for weights and zero points, so the
unsigned stored values dequantise as (q - z) * s like every other format.

Several config groups may give layers different integer schemes (`rules`); groups of other schemes
(FP8 `float-quantized`, W8A8 `int-quantized`, ...) are accepted as long as they cover no routed expert.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .rules import Match, ModuleRules, ModuleSpec, Rule, not_quantized
from .spec import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    Dim,
    FormatDecl,
    Need,
    QuantSpec,
    Role,
    TensorLayout,
    str_tuple,
    unquantized_spec,
)

LAYOUTS = (
    TensorLayout(Role.QWEIGHT, "weight_packed", (Dim.N, Dim.K), packed=Dim.K),
    TensorLayout(Role.SCALES, "weight_scale", (Dim.N, Dim.GROUP), dtypes=FLOAT_DTYPES),
    TensorLayout(Role.ZEROS, "weight_zero_point", (Dim.N, Dim.GROUP), need=Need.ASYMMETRIC, packed=Dim.N),
    TensorLayout(Role.G_IDX, "weight_g_idx", (Dim.K,), need=Need.ACT_ORDER, dtypes=INDEX_DTYPES),
    TensorLayout(Role.SHAPE, "weight_shape", (Dim.PAIR,), dtypes=INDEX_DTYPES),
)

STRATEGY_GROUP_SIZE = {"group": None, "channel": -1}  # None: read weights.group_size
ACT_ORDER_VALUES = {None: False, "group": True, "weight": False, "static": False}


def parse(qconfig: dict[str, Any]) -> QuantSpec:
    """The top-level QuantSpec of a compressed-tensors config: the scheme of its WNA16 group that targets
    `Linear`, else of its first WNA16 group (`rules` gives each module its own group's scheme)."""
    schemes = _schemes(qconfig)
    wna16 = [(name, spec) for name, (spec, _) in schemes.items() if isinstance(spec, QuantSpec)]
    if not wna16:
        raise ConfigError(f"quantization_config: {next(spec for spec, _ in schemes.values())}.")
    linear = [spec for name, spec in wna16 if CLASS_TARGET in schemes[name][1]]
    return (linear or [spec for _, spec in wna16])[0]


CLASS_TARGET = "Linear"  # a class-name target: every Linear module (routed experts are Linear modules)


def _schemes(qconfig: dict[str, Any]) -> dict[str, tuple[QuantSpec | str, tuple[str, ...]]]:
    """group name -> (its QuantSpec, or why it is not WNA16; its targets)."""
    groups = qconfig.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("quantization_config: compressed-tensors config has no config_groups; "
                          "expected at least one group with a `weights` scheme.")
    return {name: (_scheme(name, group, qconfig.get("format")), str_tuple(group.get("targets")))
            for name, group in groups.items()}


def rules(qconfig: dict[str, Any], base: QuantSpec) -> ModuleRules:
    """compressed-tensors' own matching (compressed_tensors/utils/match.py, `match_named_modules`,
    `match_targets`; quantization/lifecycle/apply.py): an `ignore` entry (exact name or `re:` re.match)
    leaves a module in float; otherwise the first matching target in the order exact names (sorted),
    `re:` regexes (sorted), then the class `Linear`, gives its group's scheme (a target listed by two
    groups belongs to the later one); a module no target matches stays in float."""
    ignore = tuple(not_quantized(*_target(entry), f"ignore entry {entry!r}")
                   for entry in str_tuple(qconfig.get("ignore")))
    owner: dict[str, tuple[str, QuantSpec | str]] = {}
    for name, (spec, targets) in _schemes(qconfig).items():
        owner.update({target: (name, spec) for target in targets})
    ordered = sorted((t for t in owner if t != CLASS_TARGET), key=lambda t: (t.startswith("re:"), t))
    ordered += [CLASS_TARGET] if CLASS_TARGET in owner else []
    return ModuleRules(base=base, rules=ignore + tuple(_group_rule(t, *owner[t]) for t in ordered),
                       default=ModuleSpec(unquantized_spec(), "no config_groups target matches it"))


def _target(target: str) -> tuple[Match, str]:
    if target == CLASS_TARGET:
        return Match.ANY, target
    return (Match.START, target[3:]) if target.startswith("re:") else (Match.EXACT, target)


def _group_rule(target: str, group: str, spec: QuantSpec | str) -> Rule:
    origin = f"config_groups[{group!r}] target {target!r}"
    if isinstance(spec, str):
        return Rule(*_target(target), None, origin, refusal=spec)
    return Rule(*_target(target), spec, origin)


def _scheme(name: str, group: dict[str, Any], top_format: Any) -> QuantSpec | str:
    """The QuantSpec of one config group, or why its scheme is not WNA16 (a str)."""
    fmt = group.get("format") or top_format
    weights = group.get("weights") or {}
    if fmt != "pack-quantized":
        return (f"compressed-tensors group {name!r} has format={fmt!r}; only 'pack-quantized' integer weights "
                f"are WNA16")
    if weights.get("type", "int") != "int":
        return f"compressed-tensors group {name!r} weights type={weights.get('type')!r}; expected 'int'"
    activations = group.get("input_activations")
    if activations:
        return (f"compressed-tensors group {name!r} quantizes input activations ({activations.get('num_bits')}-bit "
                f"{activations.get('type')}); WNA16 keeps activations in 16 bits")
    return _weight_spec(name, weights)


def _weight_spec(name: str, weights: dict[str, Any]) -> QuantSpec:
    strategy = weights.get("strategy", "group")
    if strategy not in STRATEGY_GROUP_SIZE:
        raise ConfigError(f"quantization_config: compressed-tensors group {name!r} strategy={strategy!r} is "
                          f"not supported; expected one of {sorted(STRATEGY_GROUP_SIZE)}.")
    group_size = STRATEGY_GROUP_SIZE[strategy] or weights.get("group_size")
    actorder = weights.get("actorder")
    if actorder not in ACT_ORDER_VALUES:
        raise ConfigError(f"quantization_config: compressed-tensors group {name!r} actorder={actorder!r} is "
                          f"unknown; expected one of {list(ACT_ORDER_VALUES)}.")
    if not isinstance(group_size, int) or not isinstance(weights.get("num_bits"), int):
        raise ConfigError(f"quantization_config: compressed-tensors group {name!r} needs integer num_bits and "
                          f"group_size, found num_bits={weights.get('num_bits')!r}, group_size={group_size!r}.")
    return QuantSpec(format_name="compressed-tensors", bits=weights["num_bits"], group_size=group_size,
                     symmetric=weights.get("symmetric") is not False,
                     act_order=ACT_ORDER_VALUES[actorder] and group_size != -1, layouts=LAYOUTS,
                     checkpoint_format="pack-quantized")


def to_config(bits: int, group_size: int, symmetric: bool, act_order: bool, **extra: Any) -> dict[str, Any]:
    """A compressed-tensors `quantization_config` (for writers of checkpoints)."""
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"], **extra}


FORMAT = FormatDecl(name="compressed-tensors", quant_methods=("compressed-tensors",), parse=parse,
                    to_config=to_config, rules=rules)
