"""Whether `vllm serve OUT --load-format wna16` serves an output, per tested vLLM version, as data: which of
vLLM's quantization configs a checkpoint gets with no --quantization flag (`QuantConfigRow.picked_for`, its
quantization_config's quant_method), what that config refuses before any loader runs (`KeyRule`s over the
quantization_config, with vLLM's words), which MoE method it builds each layer with (`method`, or `fallback`
where the layer fails its Marlin shape check), and whether that method's row (layouts.vllm, the rows the
plugin fills) holds the layer as written. The vLLM tier (tests_vllm/integrations/test_serve_line.py) builds
every fixture's model with each tested vLLM and checks the verdict against what vLLM did.

| verdict  | meaning                                                                                       |
|----------|-----------------------------------------------------------------------------------------------|
| NO_FLAG  | `vllm serve OUT --load-format wna16 -tp N` loads it                                            |
| FLAG     | it loads with `--quantization NAME` added (with no flag vLLM refuses it: `why`)               |
| NEVER    | no flag of a tested version loads it (`why`: each try's reason)                                |

Read from vLLM's quantization/{auto_gptq, auto_awq, moe_wna16}.py, inc/, compressed_tensors/ and
utils/{gptq_utils, marlin_utils}.py (0.32.0 and 0.34.0 alike); the choices are those of a CUDA GPU, where users
serve (vLLM's CPU platform builds INC's MoE layers unquantized; the tier pins that difference). Nothing here
branches on a method's or format's name: rows are looked up by the values they declare.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..formats.spec import QuantSpec
from .spec import MethodLayout, leaves_partial_group
from .vllm import AUTO_AWQ, AUTO_GPTQ, CT_WNA16, MOE_WNA16, UNQUANTIZED


@dataclass(frozen=True)
class KeyRule:
    """A quantization_config key a vLLM config checks when it is built: a value outside `allowed` (`default`
    when absent) is refused with `words` (formatted with the quantization_config), unless `exempt` (key, value)
    holds."""

    key: str
    allowed: tuple[Any, ...]
    default: Any
    words: str
    exempt: tuple[str, Any] | None = None

    def refuses(self, qconfig: dict[str, Any]) -> str | None:
        """vLLM's words for `qconfig`, or None where it passes."""
        if self.exempt is not None and qconfig.get(self.exempt[0]) == self.exempt[1]:
            return None
        if qconfig.get(self.key, self.default) in self.allowed:
            return None
        return self.words.format_map({**qconfig, self.key: qconfig.get(self.key, self.default)})


@dataclass(frozen=True)
class MarlinCheck:
    """vLLM's `check_moe_marlin_supports_config`: H a multiple of `hidden_multiple`, G in `group_sizes`, and G
    dividing I_p (`tile_padding`: vLLM pads I_p to the tile) or max(64, G) dividing it; `symmetric_only`: the
    (bits, sym) pair must be symmetric too (INC's GPTQ scheme)."""

    hidden_multiple: int = 128
    group_sizes: tuple[int, ...] = (-1, 32, 64, 128)
    tile_padding: bool = True
    symmetric_only: bool = False

    def passes(self, spec: QuantSpec, hidden: int, part: int) -> bool:
        g = spec.group_size
        divides = g <= 0 or part % (g if self.tile_padding else max(64, g)) == 0
        return (hidden % self.hidden_multiple == 0 and g in self.group_sizes and divides
                and (spec.symmetric or not self.symmetric_only))


@dataclass(frozen=True)
class QuantConfigRow:
    """One vLLM quantization config (`name`: its --quantization value; see the module docstring).
    `per_layer` False: it builds every MoE layer at the top-level spec (moe_wna16 ignores GPTQ's `dynamic`);
    `takes`: the quant_methods it accepts when named by the flag; `linear_refusals`: rules of the config it
    builds the model's linear layers (attention) with (moe_wna16 hands a GPTQ model's to AutoGPTQ's config,
    which refuses sym=False: asymmetric GPTQ is refused with the flag too)."""

    name: str
    picked_for: tuple[str, ...]
    method: MethodLayout
    refusals: tuple[KeyRule, ...] = ()
    marlin: MarlinCheck | None = None
    fallback: MethodLayout | None = None
    per_layer: bool = True
    takes: tuple[str, ...] = ()
    linear_refusals: tuple[KeyRule, ...] = ()


DESC_ACT = KeyRule("desc_act", (False, None), False, "GPTQ group activation ordering (desc_act=True) is no longer "
                   "supported", exempt=("group_size", -1))
GPTQ_TYPES = KeyRule("sym", (True,), True, "Unsupported quantization config: bits={bits}, sym={sym}")
NOT_MOE_WNA16 = KeyRule("desc_act", (False, None), False, "Quantization method specified in the model config "
                        "({quant_method}) does not match the quantization method specified in the `quantization` "
                        "argument (moe_wna16)", exempt=("group_size", -1))  # is_moe_wna16_compatible: no act-order
AUTO_ROUND_PACKING = KeyRule("packing_format", ("auto_round:auto_gptq", "auto_round:auto_awq"),
                             "auto_round:auto_gptq", "Unsupported packing_format: {packing_format}")
MARLIN = MarlinCheck()

CONFIGS = (
    QuantConfigRow("gptq", ("gptq",), AUTO_GPTQ, (DESC_ACT, GPTQ_TYPES), MARLIN, MOE_WNA16),
    QuantConfigRow("awq", ("awq",), AUTO_AWQ, (), MARLIN, MOE_WNA16),
    QuantConfigRow("compressed-tensors", ("compressed-tensors",), CT_WNA16),
    QuantConfigRow("inc", ("auto-round", "intel/auto-round"), AUTO_GPTQ, (AUTO_ROUND_PACKING,),
                   MarlinCheck(tile_padding=False, symmetric_only=True), MOE_WNA16),
    QuantConfigRow("moe_wna16", (), MOE_WNA16, (NOT_MOE_WNA16,), per_layer=False, takes=("gptq", "awq"),
                   linear_refusals=(GPTQ_TYPES,)),
)


@dataclass(frozen=True)
class VllmVersion:
    """A vLLM release the tier tests, and its quantization configs."""

    version: str
    configs: tuple[QuantConfigRow, ...]


TESTED_VLLM = (VllmVersion("0.32.0", CONFIGS), VllmVersion("0.34.0", CONFIGS))


class Serve(enum.Enum):
    NO_FLAG = "serves with no flag"
    FLAG = "needs --quantization"
    NEVER = "cannot be served"


@dataclass(frozen=True)
class LayerKind:
    """One MoE layer of one rank as written: its spec, H, I_p, G_eff and whether it holds padding columns."""

    prefix: str
    spec: QuantSpec
    hidden: int
    part: int
    group_eff: int
    padded: bool


@dataclass(frozen=True)
class Verdict:
    """What one vLLM version does with an output (see the module table); `methods`: the MoE methods its layers
    get where it loads; `flag`: the --quantization value it needs."""

    serve: Serve
    methods: tuple[str, ...] = ()
    flag: str | None = None
    why: str = ""
    words: tuple[str, ...] = ()  # vLLM's words of each config refusal met on the way (no flag first)


@dataclass(frozen=True)
class Split:
    """What a verdict is asked about: the checkpoint's quantization_config and top-level spec, the TP and EP
    sizes, and every MoE layer of every rank."""

    qconfig: dict[str, Any]
    top: QuantSpec
    tp: int
    ep: int
    layers: tuple[LayerKind, ...]


def verdict(version: VllmVersion, split: Split) -> Verdict:
    """What `version` does with `split`: with no flag, else with the first flag whose config takes it."""
    if split.tp > 1 and split.ep > 1:
        return Verdict(Serve.NEVER, why=f"vLLM runs MoE layers at TP or at EP, not both (TP {split.tp} x EP "
                                        f"{split.ep}; with --enable-expert-parallel its MoE TP is 1)")
    method = str(split.qconfig.get("quant_method", "")).lower()
    default = next((row for row in version.configs if method in row.picked_for), None)
    methods, why = attempt(default, split) if default else (None, f"no vLLM config reads quant_method {method!r}")
    if methods is not None:
        return Verdict(Serve.NO_FLAG, methods)
    tries, words = [f"with no flag, {why}"], [w for w in [refused(default, split)] if w]
    for row in (row for row in version.configs if method in row.takes):
        methods, flagged = attempt(row, split)
        if methods is not None:
            return Verdict(Serve.FLAG, methods, row.name, why, tuple(words))
        tries.append(f"with --quantization {row.name}, {flagged}")
        words += [w for w in [refused(row, split)] if w]
    return Verdict(Serve.NEVER, why="; ".join(tries), words=tuple(words))


def refused(row: QuantConfigRow | None, split: Split) -> str | None:
    """vLLM's words where `row`'s config refuses the split's quantization_config (None: it does not)."""
    rules = row.refusals + row.linear_refusals if row else ()
    return next((words for rule in rules if (words := rule.refuses(split.qconfig)) is not None), None)


def attempt(row: QuantConfigRow, split: Split) -> tuple[tuple[str, ...] | None, str]:
    """The MoE methods `row`'s config gives the split's layers, or None and why it cannot serve them."""
    for rule in row.refusals + row.linear_refusals:
        words = rule.refuses(split.qconfig)
        if words is not None:
            where = "" if rule in row.refusals else " for the model's linear layers"
            return None, f"vLLM's {row.name} config refuses it{where}: \"{words}\""
    picked: dict[str, None] = {}
    for layer in split.layers:
        method, why = layer_method(row, split.top, layer)
        if why:
            return None, f"{layer.prefix}: {why}"
        picked[method.name] = None
    return tuple(picked), ""


def layer_method(row: QuantConfigRow, top: QuantSpec, layer: LayerKind) -> tuple[MethodLayout, str]:
    """The MoE method `row` builds `layer` with, and why its row cannot hold the layer as written ('' if it can)."""
    spec = layer.spec if row.per_layer else top
    method = (UNQUANTIZED if not spec.quantized else
              row.fallback if row.marlin and row.fallback and not row.marlin.passes(spec, layer.hidden, layer.part)
              else row.method)
    if spec != layer.spec:
        return method, (f"vLLM's {row.name} config builds it as {spec.describe()} (it ignores the per-layer rules), "
                        f"the output holds {layer.spec.describe()}")
    q = spec.quantized
    reason = method.refusal(quantized=q, padded=layer.padded, asymmetric=q and not spec.symmetric,
                            reduced=q and layer.group_eff not in (spec.group_size, -1), group_eff=layer.group_eff,
                            partial=q and leaves_partial_group(spec.group_size, layer.group_eff, layer.hidden,
                                                               layer.part))
    return method, reason or ""


def serve_lines(split: Split, out: str = "OUT") -> list[str]:
    """One line per distinct verdict over the tested vLLM versions (see the module table)."""
    verdicts: dict[Verdict, list[str]] = {}
    for version in TESTED_VLLM:
        verdicts.setdefault(verdict(version, split), []).append(version.version)
    where = f"TP {split.tp}" if split.ep == 1 else f"EP {split.ep}" if split.tp == 1 else \
        f"TP {split.tp} x EP {split.ep}"
    flags = f" -tp {split.tp}" if split.ep == 1 and split.tp > 1 else (
        f" -tp {split.ep} --enable-expert-parallel" if split.ep > 1 else "")
    return [f"vLLM {', '.join(versions)} at {where}: {_say(v, out, flags)}" for v, versions in verdicts.items()]


def _say(v: Verdict, out: str, flags: str) -> str:
    command = f"vllm serve {out} --load-format wna16" + (f" --quantization {v.flag}" if v.flag else "") + flags
    if v.serve is Serve.NO_FLAG:
        return f"yes: {command} (MoE method {', '.join(v.methods)}, no --quantization flag)"
    if v.serve is Serve.FLAG:
        return f"yes, with --quantization {v.flag}: {command} (MoE method {', '.join(v.methods)}; with no flag " \
               f"{v.why})"
    return f"no: {v.why}"


def short_verdict(split: Split) -> str:
    """`--plan`'s column: `yes (auto_gptq)`, `--quantization moe_wna16` or `no`, prefixed by the versions when
    they differ."""
    said: dict[str, list[str]] = {}
    for version in TESTED_VLLM:
        v = verdict(version, split)
        text = {Serve.NO_FLAG: f"yes ({', '.join(v.methods)})", Serve.FLAG: f"--quantization {v.flag}",
                Serve.NEVER: "no"}[v.serve]
        said.setdefault(text, []).append(version.version)
    return text if len(said) == 1 else "; ".join(f"{', '.join(on)}: {text}" for text, on in said.items())


def unserved(split: Split) -> bool:
    """Whether no tested vLLM version serves `split` with any flag."""
    return all(verdict(version, split).serve is Serve.NEVER for version in TESTED_VLLM)
