"""AWQ GEMM (AutoAWQ), 4-bit.

| tensor  | storage        | packing                                             |
|---------|----------------|-----------------------------------------------------|
| qweight | [K, N/8] int32 | along N; slot i of word c holds column 8c+ORDER[i]  |
| qzeros  | [K/G, N/8]     | same packing, true zero point                       |
| scales  | [K/G, N]       | fp16 / bf16                                         |

ORDER = (0, 2, 4, 6, 1, 3, 5, 7).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .rules import Match, ModuleRules, not_quantized
from .spec import (
    FLOAT_DTYPES,
    Dim,
    FormatDecl,
    Need,
    QuantSpec,
    Role,
    TensorLayout,
    bool_key,
    int_key,
    str_tuple,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

LAYOUTS = (
    TensorLayout(Role.QWEIGHT, "qweight", (Dim.K, Dim.N), packed=Dim.N, slot_order=AWQ_ORDER),
    TensorLayout(Role.ZEROS, "qzeros", (Dim.GROUP, Dim.N), need=Need.ASYMMETRIC, packed=Dim.N,
                 slot_order=AWQ_ORDER),
    TensorLayout(Role.SCALES, "scales", (Dim.GROUP, Dim.N), dtypes=FLOAT_DTYPES),
)

SUPPORTED_VERSIONS = ("gemm",)


def spec_from(*, bits: int, group_size: int, zero_point: bool) -> QuantSpec:
    """QuantSpec of AWQ-packed experts (shared with AutoRound's auto_awq packing)."""
    if bits != 4:
        raise ConfigError(f"quantization_config: AWQ packing with bits={bits} is not supported; the AWQ "
                          f"GEMM bit order is defined for 4-bit weights only.")
    return QuantSpec(format_name="awq", bits=bits, group_size=group_size, symmetric=not zero_point,
                     act_order=False, layouts=LAYOUTS, checkpoint_format="gemm")


def parse(qconfig: dict[str, Any]) -> QuantSpec:
    """QuantSpec of an AWQ `quantization_config` (keys bits|w_bit, group_size|q_group_size)."""
    version = str(qconfig.get("version", "gemm")).lower()
    if version not in SUPPORTED_VERSIONS:
        raise ConfigError(f"quantization_config: AWQ version={version!r} is not supported; only "
                          f"{list(SUPPORTED_VERSIONS)} packing is.")
    return spec_from(
        bits=int_key(qconfig, ("bits", "w_bit")),
        group_size=int_key(qconfig, ("group_size", "q_group_size")),
        zero_point=bool_key(qconfig, "zero_point", True),
    )


def rules(qconfig: dict[str, Any], base: QuantSpec) -> ModuleRules:
    """`modules_to_not_convert`: a module whose name contains an entry stays in float (AutoAWQ's and
    transformers' substring test); every other module has the base spec."""
    return ModuleRules(base=base, rules=tuple(
        not_quantized(Match.CONTAINS, name, f"modules_to_not_convert entry {name!r}")
        for name in str_tuple(qconfig.get("modules_to_not_convert"))))


def to_config(bits: int, group_size: int, symmetric: bool, act_order: bool, **extra: Any) -> dict[str, Any]:
    """An AWQ `quantization_config` (for writers of checkpoints); AWQ has no act-order."""
    if act_order:
        raise ConfigError("AWQ has no act-order variant.")
    return {"quant_method": "awq", "version": "gemm", "bits": bits, "group_size": group_size,
            "zero_point": not symmetric, **extra}


FORMAT = FormatDecl(name="awq", quant_methods=("awq",), parse=parse, to_config=to_config, rules=rules)
