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

import re
from typing import Any

from ..errors import ConfigError
from . import awq, gptq
from .rules import Match, ModuleRules, Rule, not_quantized
from .spec import FormatDecl, QuantSpec, bool_key, int_key, str_tuple

GPTQ_PACKINGS = ("auto_gptq", "auto_round:auto_gptq", "auto_round:gptqmodel")
AWQ_PACKINGS = ("auto_awq", "auto_round:auto_awq")
OWN_PACKINGS = ("auto_round",)  # GPTQ layout, zero points stored as they are


def parse(qconfig: dict[str, Any]) -> QuantSpec:
    """QuantSpec of an AutoRound `quantization_config`."""
    return _spec(qconfig, int_key(qconfig, ("bits",)), int_key(qconfig, ("group_size",)),
                 bool_key(qconfig, "sym", True))


def _spec(qconfig: dict[str, Any], bits: int, group_size: int, symmetric: bool) -> QuantSpec:
    packing = qconfig.get("packing_format")
    if packing in AWQ_PACKINGS:
        return awq.spec_from(bits=bits, group_size=group_size, zero_point=not symmetric)
    if packing in GPTQ_PACKINGS + OWN_PACKINGS:
        return QuantSpec(format_name="gptq", bits=bits, group_size=group_size, symmetric=symmetric, act_order=False,
                         layouts=gptq.LAYOUTS, zero_word_bias=packing in GPTQ_PACKINGS, checkpoint_format=packing)
    raise ConfigError(f"quantization_config: AutoRound packing_format={packing!r} is not supported; expected "
                      f"one of {list(GPTQ_PACKINGS + AWQ_PACKINGS + OWN_PACKINGS)}.")


FLOAT_BITS = 16  # auto-round quantizes a module only when its bits are <= 8 (`check_to_quantized`)


def rules(qconfig: dict[str, Any], base: QuantSpec) -> ModuleRules:
    """The layer configs auto-round's own loader builds (auto_round/inference/convert_model.py,
    `get_layer_config`), in its precedence: `modules_to_not_convert` (re.search: float) overrides
    everything; then an `extra_config` key equal to the module name; then modules outside
    `block_name_to_quantize` (float); then `extra_config` regex keys (re.search, in order; a key that is
    another module's name is not a regex); then the top-level scheme. An entry's bits 16 (or more) means
    float; unset fields take the top-level values."""
    extra = qconfig.get("extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"quantization_config: extra_config={extra!r} must be an object mapping module names "
                          f"(or regexes) to their bits, group_size, sym, data_type.")
    skip = tuple(not_quantized(Match.SEARCH, name, f"modules_to_not_convert entry {name!r}")
                 for name in str_tuple(qconfig.get("modules_to_not_convert")))
    exact = tuple(_entry(qconfig, Match.EXACT, key, value) for key, value in extra.items())
    blocks = str_tuple(qconfig.get("block_name_to_quantize", qconfig.get("to_quant_block_names")))
    outside = (not_quantized(Match.OUTSIDE, ",".join(b for v in blocks for b in v.split(",")),
                             f"block_name_to_quantize {list(blocks)} (modules outside it stay in float)"),) \
        if blocks else ()
    regex = tuple(_entry(qconfig, Match.SEARCH, key, value) for key, value in extra.items()
                  if value != {} and _compiles(key))  # auto-round skips keys that are not valid regexes
    return ModuleRules(base=base, rules=skip + exact + outside + regex)


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _entry(qconfig: dict[str, Any], match: Match, key: str, entry: Any) -> Rule:
    """One extra_config entry as a rule: float at 16 bits, else the entry's scheme over the defaults."""
    if not isinstance(entry, dict):
        raise ConfigError(f"quantization_config: extra_config[{key!r}]={entry!r} must be an object.")
    merged = {**qconfig, **entry}
    origin = f"extra_config[{key!r}] = {entry}"
    more = {"unless_module": True} if match is Match.SEARCH else {}
    bits = int_key(merged, ("bits",))
    if bits >= FLOAT_BITS:
        return not_quantized(match, key, origin, **more)
    data_type = merged.get("data_type", "int")
    if not str(data_type).startswith("int"):
        return Rule(match, key, None, origin, refusal=f"data_type={data_type!r} at {bits} bits is a float "
                    f"format, not WNA16 integer weights", **more)
    spec = _spec(qconfig, bits, int_key(merged, ("group_size",)), bool_key(merged, "sym", True))
    return Rule(match, key, spec, origin, **more)


def to_config(bits: int, group_size: int, symmetric: bool, act_order: bool, **extra: Any) -> dict[str, Any]:
    """An AutoRound `quantization_config`; `packing_format` defaults to GPTQ packing."""
    if act_order:
        raise ConfigError("AutoRound exports have no act-order variant.")
    return {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": bits,
            "group_size": group_size, "sym": symmetric, "data_type": "int", **extra}


FORMAT = FormatDecl(name="auto-round", quant_methods=("auto-round", "intel/auto-round"), parse=parse,
                    to_config=to_config, rules=rules)
