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
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .spec import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    Dim,
    FormatDecl,
    ModuleFilter,
    Need,
    QuantSpec,
    Role,
    TensorLayout,
    str_tuple,
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
    """QuantSpec of a compressed-tensors `quantization_config` with one weight scheme."""
    fmt = qconfig.get("format")
    groups = qconfig.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("quantization_config: compressed-tensors config has no config_groups; "
                          "expected at least one group with a `weights` scheme.")
    schemes = {name: _scheme(name, group, fmt) for name, group in groups.items()}
    distinct = set(s for s, _ in schemes.values())
    if len(distinct) != 1:
        raise ConfigError(f"quantization_config: compressed-tensors config_groups {sorted(schemes)} use "
                          f"different weight schemes {sorted(map(str, distinct))}; routed experts need one.")
    (bits, group_size, symmetric, act_order), = distinct
    targets = tuple(t for _, group_targets in schemes.values() for t in group_targets)
    return QuantSpec(format_name="compressed-tensors", bits=bits, group_size=group_size, symmetric=symmetric,
                     act_order=act_order and group_size != -1, layouts=LAYOUTS, checkpoint_format="pack-quantized",
                     modules=ModuleFilter(targets=targets, ignore=str_tuple(qconfig.get("ignore"))))


def _scheme(name: str, group: dict[str, Any], top_format: Any) -> tuple[tuple[int, int, bool, bool], tuple[str, ...]]:
    """((bits, group_size, symmetric, act_order), targets) of one config group."""
    fmt = group.get("format") or top_format
    if fmt != "pack-quantized":
        raise ConfigError(f"quantization_config: compressed-tensors group {name!r} has format={fmt!r}; "
                          f"only 'pack-quantized' integer weights are WNA16.")
    weights = group.get("weights") or {}
    if weights.get("type", "int") != "int":
        raise ConfigError(f"quantization_config: compressed-tensors group {name!r} weights type="
                          f"{weights.get('type')!r}; expected 'int'.")
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
    scheme = (weights["num_bits"], group_size, weights.get("symmetric") is not False, ACT_ORDER_VALUES[actorder])
    return scheme, str_tuple(group.get("targets"))


def to_config(bits: int, group_size: int, symmetric: bool, act_order: bool, **extra: Any) -> dict[str, Any]:
    """A compressed-tensors `quantization_config` (for writers of checkpoints)."""
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"], **extra}


FORMAT = FormatDecl(name="compressed-tensors", quant_methods=("compressed-tensors",), parse=parse,
                    to_config=to_config)
