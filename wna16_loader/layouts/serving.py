"""Whether an engine serves a `wna16-shard` output with `--load-format wna16`, per tested engine version, as data:
which of the engine's quantization configs a checkpoint gets with no --quantization flag (`QuantConfigRow.picked_for`,
its quantization_config's quant_method), what that config refuses before any loader runs (`KeyRule`s over the
quantization_config, in the engine's words), which MoE method it builds each layer with (`method`, or `fallback`
where the layer fails its Marlin shape check), whether that method's row (layouts.vllm, layouts.sglang: the rows
the plugins fill) holds the layer as written, whether the engine runs the split at all (`Launch`, `SizeRule`) and
whether it has the model class config.json names (`EngineVersion.architectures`). The rows are the engines':
layouts/serving_vllm.py and layouts/serving_sglang.py; each engine tier builds every fixture's model and checks
the verdict against what the engine did.

| verdict  | meaning                                                                                       |
|----------|-----------------------------------------------------------------------------------------------|
| NO_FLAG  | the engine's serve command with `--load-format wna16` and the split's flags loads it          |
| FLAG     | it loads with `--quantization NAME` added (with no flag the engine refuses it: `why`)          |
| NEVER    | no flag of the version loads it (`why`: each try's reason)                                     |

The choices are those of a GPU, where users serve. Nothing here branches on an engine's, a method's or a format's
name: rows are looked up by the values they declare.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..formats.spec import QuantSpec
from .spec import MethodLayout, leaves_partial_group
from .vllm import UNQUANTIZED


@dataclass(frozen=True)
class KeyRule:
    """A quantization_config key a config checks when it is built: a value outside `allowed` (`default` when
    absent) is refused with `words` (formatted with the quantization_config), unless `exempt` (key, value) holds.
    `at_start`: the engine checks it as it reads its configuration, before its size checks (SizeRule); else as it
    builds the model's layers, after them."""

    key: str
    allowed: tuple[Any, ...]
    default: Any
    words: str
    exempt: tuple[str, Any] | None = None
    at_start: bool = False

    def refuses(self, split: "Split") -> str | None:
        """The engine's words for the split's quantization_config, or None where it passes."""
        qconfig = split.qconfig
        if self.exempt is not None and qconfig.get(self.exempt[0]) == self.exempt[1]:
            return None
        if qconfig.get(self.key, self.default) in self.allowed:
            return None
        return self.words.format_map({**qconfig, self.key: qconfig.get(self.key, self.default)})


@dataclass(frozen=True)
class MarlinCheck:
    """The engine's MoE Marlin shape check: H a multiple of `hidden_multiple`, G in `group_sizes`, and G dividing
    I_p (`tile_padding`: the engine pads I_p to the tile) or max(64, G) dividing it; `symmetric_only`: the
    (bits, sym) pair must be symmetric too."""

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
    """One quantization config of an engine (`name`: its --quantization value; see the module docstring).
    `per_layer` False: it builds every MoE layer at the top-level spec (it ignores per-layer rules);
    `takes`: the quant_methods it accepts when named by the flag; `linear_refusals`, `linear_sizes`: rules of the
    config it builds the model's linear layers (attention) with, over the quantization_config and the split."""

    name: str
    picked_for: tuple[str, ...]
    method: MethodLayout
    refusals: tuple[KeyRule, ...] = ()
    marlin: MarlinCheck | None = None
    fallback: MethodLayout | None = None
    per_layer: bool = True
    takes: tuple[str, ...] = ()
    linear_refusals: tuple[KeyRule, ...] = ()
    linear_sizes: tuple[SizeRule, ...] = ()


@dataclass(frozen=True)
class SizeRule:
    """An engine's check of a split's sizes when it starts or builds the model: the Split field `size` must be a
    multiple of `by` (a Split field, or a number), else the engine stops with `words` (formatted with both)."""

    size: str
    by: str | int
    words: str

    def refuses(self, split: "Split") -> str | None:
        size, by = getattr(split, self.size), self.by if isinstance(self.by, int) else getattr(split, self.by)
        return self.words.format(size=size, by=by) if by and size % by else None


@dataclass(frozen=True)
class Launch:
    """How an engine is started on a split's ranks: `command` (formatted with `out`), `world` the flag of its
    rank count, `expert` the flag that turns on expert parallelism (`expert_sized`: it takes the EP size;
    else EP spans every rank), `tp_with_ep`: whether its MoE layers run TP inside each EP group."""

    command: str
    world: str
    expert: str
    expert_sized: bool
    tp_with_ep: bool

    def flags(self, tp: int, ep: int) -> str:
        """The flags of TP `tp` x EP `ep` (world tp·ep ranks), '' for one rank."""
        world = tp * ep
        expert = "" if ep == 1 else f" {self.expert} {ep}" if self.expert_sized else f" {self.expert}"
        return (f" {self.world} {world}" if world > 1 else "") + expert


@dataclass(frozen=True)
class Engine:
    """A serving engine: its name as users write it, its `--for` and pip name, and how it is launched."""

    name: str
    key: str
    launch: Launch


@dataclass(frozen=True)
class EngineVersion:
    """A release of an engine its tier tests: its quantization configs, size checks and model classes."""

    engine: Engine
    version: str
    configs: tuple[QuantConfigRow, ...]
    architectures: frozenset[str]
    size_rules: tuple[SizeRule, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.engine.name} {self.version}"


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
    """What one engine version does with an output (see the module table); `methods`: the MoE methods its layers
    get where it loads; `flag`: the --quantization value it needs."""

    serve: Serve
    methods: tuple[str, ...] = ()
    flag: str | None = None
    why: str = ""
    words: tuple[str, ...] = ()  # the engine's words of each refusal met on the way (no flag first)


@dataclass(frozen=True)
class Split:
    """What a verdict is asked about: the checkpoint's quantization_config and top-level spec, the TP and EP
    sizes, every MoE layer of every rank, and config.json's `architectures`, routed experts, I, attention heads
    and the attention output projection's input (heads x head_dim). `world`: the ranks, TP x EP; `attention_part`:
    that input per rank (attention runs TP over every rank)."""

    qconfig: dict[str, Any]
    top: QuantSpec
    tp: int
    ep: int
    layers: tuple[LayerKind, ...]
    architectures: tuple[str, ...] = ()
    experts: int = 0
    intermediate: int = 0
    heads: int = 0
    attention: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.ep

    @property
    def attention_part(self) -> int:
        return self.attention // self.world


def verdict(version: EngineVersion, split: Split) -> Verdict:
    """What `version` does with `split`: with no flag, else with the first flag whose config takes it."""
    refused = launch_refusal(version, split)
    if refused:
        return Verdict(Serve.NEVER, why=refused)
    method = str(split.qconfig.get("quant_method", "")).lower()
    default = next((row for row in version.configs if method in row.picked_for), None)
    name = version.engine.name
    methods, why, said = attempt(version, default, split) if default else \
        (None, f"no {name} config reads quant_method {method!r}", "")
    if methods is not None:
        return Verdict(Serve.NO_FLAG, methods)
    tries, words = {"no flag": why}, [said] if said else []
    for row in (row for row in version.configs if method in row.takes):
        methods, flagged, said = attempt(version, row, split)
        if methods is not None:
            return Verdict(Serve.FLAG, methods, row.name, why, tuple(words))
        tries[f"--quantization {row.name}"] = flagged
        words += [said] if said else []
    return Verdict(Serve.NEVER, why=tried(tries), words=tuple(words))


def tried(tries: dict[str, str]) -> str:
    """Each try's reason, `with no flag, A; with --quantization X, B`; one reason for them all said once."""
    if len(tries) > 1 and len(set(tries.values())) == 1:
        return f"{next(iter(tries.values()))} (with {' and with '.join(tries)})"
    return "; ".join(f"with {flag}, {why}" for flag, why in tries.items())


def launch_refusal(version: EngineVersion, split: Split) -> str:
    """Why `version` does not run the split's model whatever its flags ('' where it may): no model class of
    config.json's `architectures`, or MoE TP with EP where it runs only one of them."""
    name, launch = version.engine.name, version.engine.launch
    if split.architectures and not set(split.architectures) & version.architectures:
        return f"{version.label} has no model class {' or '.join(split.architectures)} (config.json's architectures)"
    if split.tp > 1 and split.ep > 1 and not launch.tp_with_ep:
        return (f"{name} runs MoE layers at TP or at EP, not both (TP {split.tp} x EP {split.ep}; with "
                f"{launch.expert} its MoE TP is 1)")
    return ""


def attempt(version: EngineVersion, row: QuantConfigRow, split: Split) -> tuple[tuple[str, ...] | None, str, str]:
    """The MoE methods `row`'s config gives the split's layers, or None, why it cannot serve them and the engine's
    words ('' where the engine would build a method the plugin's row does not hold). In the engine's order: the
    config's checks made at start, the engine's size checks, the config's other checks, its linear layers' size
    checks, then each MoE layer."""
    engine = version.engine.name
    keys = row.refusals + row.linear_refusals
    for check in (*(r for r in keys if r.at_start), *version.size_rules, *(r for r in keys if not r.at_start),
                  *row.linear_sizes):
        words = check.refuses(split)
        if words is not None:
            return None, refusal_text(engine, row, check, split, words), words
    picked: dict[str, None] = {}
    for layer in split.layers:
        method, why = layer_method(row, split.top, layer, engine)
        if why:
            return None, f"{layer.prefix}: {why}", ""
        picked[method.name] = None
    return tuple(picked), "", ""


def refusal_text(engine: str, row: QuantConfigRow, check: KeyRule | SizeRule, split: Split, words: str) -> str:
    """One refusal in words: whose check it is and the engine's words."""
    if check in row.refusals:
        return f"{engine}'s {row.name} config refuses it: \"{words}\""
    if check in row.linear_refusals:
        return f"{engine}'s {row.name} config refuses it for the model's linear layers: \"{words}\""
    if check in row.linear_sizes:
        return f"{engine}'s {row.name} config refuses the model's linear layers at {split.world} ranks: \"{words}\""
    return f"{engine} stops at {split.world} ranks: \"{words}\""  # one of the engine's own size checks


def layer_method(row: QuantConfigRow, top: QuantSpec, layer: LayerKind, engine: str) -> tuple[MethodLayout, str]:
    """The MoE method `row` builds `layer` with, and why its row cannot hold the layer as written ('' if it can)."""
    spec = layer.spec if row.per_layer else top
    method = (UNQUANTIZED if not spec.quantized else
              row.fallback if row.marlin and row.fallback and not row.marlin.passes(spec, layer.hidden, layer.part)
              else row.method)
    if spec != layer.spec:
        return method, (f"{engine}'s {row.name} config builds it as {spec.describe()} (it ignores the per-layer "
                        f"rules), the output holds {layer.spec.describe()}")
    q = spec.quantized
    reason = method.refusal(quantized=q, padded=layer.padded, asymmetric=q and not spec.symmetric,
                            reduced=q and layer.group_eff not in (spec.group_size, -1), group_eff=layer.group_eff,
                            partial=q and leaves_partial_group(spec.group_size, layer.group_eff, layer.hidden,
                                                               layer.part), act_order=q and spec.act_order)
    return method, reason or ""
