"""AutoRound checkpoints: GPTQ or AWQ packing, or AutoRound's own `auto_round` packing.

`packing_format` says which. GPTQ packings are exactly `gptq.py` (zeros stored as
z-1, word-wise); AWQ packings are `awq.py`. AutoRound's own packing (auto-round
0.15 writes it for asymmetric schemes it does not route to AWQ, e.g. 8-bit) has
the GPTQ layout with the zero points stored as they are:

| tensor  | storage        | packing                          |
|---------|----------------|----------------------------------|
| qweight | [K/P, N] int32 | along K, least significant first |
| qzeros  | [K/G, N/P]     | along N, true zero points        |
| scales  | [K/G, N]       | fp16 / bf16                      |
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from . import awq, gptq
from .spec import FormatDecl, ModuleFilter, QuantSpec, bool_key, int_key, str_tuple

GPTQ_PACKINGS = ("auto_gptq", "auto_round:auto_gptq", "auto_round:gptqmodel")
AWQ_PACKINGS = ("auto_awq", "auto_round:auto_awq")
OWN_PACKINGS = ("auto_round",)  # GPTQ layout, zero points stored as they are


def parse(qconfig: dict[str, Any]) -> QuantSpec:
    """QuantSpec of an AutoRound `quantization_config`."""
    packing = qconfig.get("packing_format")
    bits = int_key(qconfig, ("bits",))
    group_size = int_key(qconfig, ("group_size",))
    symmetric = bool_key(qconfig, "sym", True)
    modules = ModuleFilter(ignore=str_tuple(qconfig.get("modules_to_not_convert")))
    if packing in AWQ_PACKINGS:
        return awq.spec_from(bits=bits, group_size=group_size, zero_point=not symmetric, modules=modules)
    if packing in GPTQ_PACKINGS + OWN_PACKINGS:
        return QuantSpec(format_name="gptq", bits=bits, group_size=group_size, symmetric=symmetric, act_order=False,
                         layouts=gptq.LAYOUTS, zero_word_bias=packing in GPTQ_PACKINGS, checkpoint_format=packing,
                         modules=modules)
    raise ConfigError(f"quantization_config: AutoRound packing_format={packing!r} is not supported; expected "
                      f"one of {list(GPTQ_PACKINGS + AWQ_PACKINGS + OWN_PACKINGS)}.")


def to_config(bits: int, group_size: int, symmetric: bool, act_order: bool, **extra: Any) -> dict[str, Any]:
    """An AutoRound `quantization_config`; `packing_format` defaults to GPTQ packing."""
    if act_order:
        raise ConfigError("AutoRound exports have no act-order variant.")
    return {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": bits,
            "group_size": group_size, "sym": symmetric, "data_type": "int", **extra}


FORMAT = FormatDecl(name="auto-round", quant_methods=("auto-round", "intel/auto-round"), parse=parse,
                    to_config=to_config)
