"""GPTQ (AutoGPTQ / GPTQModel), checkpoint_format `gptq` (v1, z-1 stored) or `gptq_v2`.

| tensor  | storage        | packing                            |
|---------|----------------|------------------------------------|
| qweight | [K/P, N] int32 | along K, least significant first   |
| qzeros  | [K/G, N/P]     | along N; v1 holds z-1 word-wise    |
| scales  | [K/G, N]       | fp16 / bf16                        |
| g_idx   | [K] int32      | group of each input row            |
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .rules import Match, ModuleRules, Rule, literal_pattern, not_quantized
from .spec import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
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

LAYOUTS = (
    TensorLayout(Role.QWEIGHT, "qweight", (Dim.K, Dim.N), packed=Dim.K),
    TensorLayout(Role.ZEROS, "qzeros", (Dim.GROUP, Dim.N), need=Need.ASYMMETRIC, packed=Dim.N),
    TensorLayout(Role.SCALES, "scales", (Dim.GROUP, Dim.N), dtypes=FLOAT_DTYPES),
    TensorLayout(Role.G_IDX, "g_idx", (Dim.K,), need=Need.ACT_ORDER, dtypes=INDEX_DTYPES),
)

CHECKPOINT_FORMATS = {"gptq": True, "gptq_v2": False}  # value: zeros stored as z - 1, word-wise


def parse(qconfig: dict[str, Any]) -> QuantSpec:
    """QuantSpec of a GPTQ `quantization_config`."""
    checkpoint_format = qconfig.get("checkpoint_format") or "gptq"
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ConfigError(f"quantization_config: GPTQ checkpoint_format={checkpoint_format!r} is not "
                          f"supported; expected one of {sorted(CHECKPOINT_FORMATS)}.")
    group_size = int_key(qconfig, ("group_size",), -1)
    return QuantSpec(
        format_name="gptq",
        bits=int_key(qconfig, ("bits",)),
        group_size=group_size,
        symmetric=bool_key(qconfig, "sym", True),
        act_order=bool_key(qconfig, "desc_act", False) and group_size != -1,
        layouts=LAYOUTS,
        zero_word_bias=CHECKPOINT_FORMATS[checkpoint_format],
        checkpoint_format=checkpoint_format,
    )


OVERRIDES = {"bits": "bits", "group_size": "group_size", "sym": "sym", "desc_act": "desc_act"}  # dynamic key -> config key


def rules(qconfig: dict[str, Any], base: QuantSpec) -> ModuleRules:
    """`modules_to_not_convert` (substrings: float), then GPTQModel's `dynamic`, in its order.

    As GPTQModel resolves `dynamic` (gptqmodel/quantization/config.py, `_resolve_dynamic_override`): the
    first rule that matches wins, in the JSON's order; `-:p` leaves the module in float, `+:p` or a bare `p`
    overrides bits, group_size, sym and desc_act; a pattern is matched with re.match (anchored at the
    start), and one without regex syntax names one module exactly.
    """
    skip = tuple(not_quantized(Match.CONTAINS, name, f"modules_to_not_convert entry {name!r}")
                 for name in str_tuple(qconfig.get("modules_to_not_convert")))
    return ModuleRules(base=base, rules=skip + tuple(dynamic_rule(qconfig, key, value)
                                                     for key, value in _dynamic(qconfig).items()))


def _dynamic(qconfig: dict[str, Any]) -> dict[str, Any]:
    dynamic = qconfig.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ConfigError(f"quantization_config: dynamic={dynamic!r} must be an object mapping module-name "
                          f"patterns to overrides.")
    return dynamic


def dynamic_rule(qconfig: dict[str, Any], key: str, overrides: Any) -> Rule:
    """One `dynamic` entry as a Rule (GPTQModel's matching; see `rules`)."""
    pattern = key[2:] if key.startswith(("-:", "+:")) else key
    literal = literal_pattern(pattern)
    match, text = (Match.EXACT, literal) if literal is not None else (Match.START, pattern)
    origin = f"dynamic rule {key!r}"
    if key.startswith("-:"):
        return not_quantized(match, text, origin)
    if not isinstance(overrides, dict):
        raise ConfigError(f"quantization_config: dynamic[{key!r}]={overrides!r} must be an object of overrides "
                          f"({sorted(OVERRIDES)}).")
    merged = {**qconfig, **{OVERRIDES[k]: v for k, v in overrides.items() if k in OVERRIDES}}
    return Rule(match, text, parse(merged), f"{origin} {overrides}")


def to_config(bits: int, group_size: int, symmetric: bool, act_order: bool, **extra: Any) -> dict[str, Any]:
    """A GPTQ `quantization_config` (for writers of checkpoints); `extra` overrides keys."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": symmetric,
            "desc_act": act_order, "checkpoint_format": "gptq", **extra}


FORMAT = FormatDecl(name="gptq", quant_methods=("gptq",), parse=parse, to_config=to_config, rules=rules)
