"""`wna16-shard SRC --plan`: every layout's cost before anything is written.

For TP sizes 1, 2, 4, 8, 16 (and the requested one) x the requested EP size: I', I_p, G_eff,
the padding of every TP rank, and the bytes one rank holds of one MoE layer (the largest rank)
with the part of them that is padding. Computed from config.json and the safetensors headers
(for the scale dtype); nothing is read or written. The last two columns say whether each tested vLLM and SGLang
serves that layout's output with `--load-format wna16` (layouts.serving): with no flag, with `--quantization
moe_wna16`, or not at all, and why (one line per engine and TP size after the table).

The same verdicts, before anything is written (`check_served`, `warn_unserved`): `--for ENGINE` refuses a split
the engine will not serve, naming a split that it would serve (`serving_split`); without it, a warning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import PreshardError, WNA16Error
from ..formats import QuantSpec
from ..layouts.engines import ENGINES, command, of_engine, refusing, serve_lines, short_verdict, versions_for
from ..layouts.serving import EngineVersion, LayerKind, Serve, Split, verdict
from ..load.experts import planned
from ..load.fused import FusedSpec
from ..load.outputs import OutputLayout
from ..load.padfill import padding_bytes
from ..load.plan import LayerPlan, layer_geometry
from ..logs import log
from ..models.config import MoEConfig, load_json, read_qconfig, text_config
from ..parallel.config import ParallelConfig
from .plan import ShardPlan, check_source_folder

PLAN_TP_SIZES = (1, 2, 4, 8, 16)
HEADER = (" tp  ep      I'    I_p G_eff    bytes/rank padding bytes  experts/EP rank  padding columns per TP rank"
          "   --load-format wna16: " + " | ".join(engine.name for engine in ENGINES))
CANDIDATES = (1, 2, 4, 8, 16)  # the TP and EP sizes a refused split's alternatives are sought among


@dataclass(frozen=True)
class LayoutCost:
    """One TP x EP layout of one MoE layer: sizes, padding per TP rank, bytes per rank (the largest rank)."""

    tp: int
    ep: int
    padded_intermediate: int  # I'
    part: int  # I_p
    group_eff: int
    padding: tuple[int, ...]  # columns of padding of TP rank 0, 1, ...
    rank_bytes: int
    padding_bytes: int
    experts: tuple[int, ...] = ()  # routed experts of EP rank 0, 1, ...


def layout_cost(moe: MoEConfig, scale_dtype: torch.dtype, tp: int, ep: int, placement: str,
                layer: int | None = None) -> LayoutCost:
    """The cost of one layout of MoE layer `layer` (None: the first) under `moe.quant` (raises a WNA16Error
    subclass when it is impossible)."""
    specs = []
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep, expert_placement=placement):
        specs.append(FusedSpec.of(layer_geometry(moe, parallel, layer), moe.quant, scale_dtype))
    first = layer_geometry(moe, ParallelConfig(tp, 0, ep, 0, expert_placement=placement), layer)
    return LayoutCost(tp=tp, ep=ep, padded_intermediate=first.padded_intermediate, part=first.part,
                      group_eff=first.group_eff, padding=tuple(spec.padding for spec in specs[:tp]),
                      rank_bytes=max(spec.nbytes for spec in specs),
                      padding_bytes=max(padding_bytes(spec) for spec in specs),
                      experts=tuple(len(spec.experts) for spec in specs[::tp]))


def runs(values: tuple[int, ...]) -> str:
    """'0 x7, 64' for (0, 0, 0, 0, 0, 0, 0, 64)."""
    out: list[tuple[int, int]] = []
    for v in values:
        out[-1:] = [(v, out[-1][1] + 1)] if out and out[-1][0] == v else out[-1:] + [(v, 1)]
    return ", ".join(f"{v} x{n}" if n > 1 else str(v) for v, n in out)


def describe_layouts(src: str | Path, *, tp_size: int | None = None, ep_size: int = 1,
                     placement: str = "linear") -> str:
    """The planning view of `src` (see the module docstring); layers of different specs get a block each."""
    with planned(check_source_folder(src), ParallelConfig(1, 0)) as (moe, _, _, plans):
        groups: dict[QuantSpec, list[LayerPlan]] = {}
        for plan in plans:
            groups.setdefault(plan.moe.quant, []).append(plan)
    tps = sorted(set(PLAN_TP_SIZES) | ({tp_size} if tp_size else set()))
    folder = check_source_folder(src)
    splits = {tp: plan_split(folder, moe, groups.values(), tp, ep_size, placement) for tp in tps}
    q = moe.quant
    kind = (f"{q.format_name} {q.bits}-bit, G={q.group_size}, {'sym' if q.symmetric else 'asym'}, "
            f"act_order={q.act_order}") if len(groups) <= 1 else f"{len(groups)} specs, one block each"
    lines = [f"source: {src}",
             f"MoE layers: {len(plans)}, H={moe.hidden_size}, I={moe.intermediate_size}, {moe.num_experts} experts; "
             f"{kind}",
             "bytes: one rank's fused tensors of one MoE layer (the largest rank), and how many of them are padding"]
    for group in groups.values():
        if len(groups) > 1:
            lines.append(f"{len(group)} layer(s) {group[0].spec.describe()}: {', '.join(p.prefix for p in group)}")
        for dtype in sorted({plan.fused.scale_dtype for plan in group}, key=str):
            lines.append(f"{'scales' if group[0].moe.quant.quantized else 'weights'} "
                         f"{str(dtype).removeprefix('torch.')}:")
            lines.append("  " + HEADER)
            lines += [_row(group[0].moe, dtype, tp, ep_size, placement, mark=tp == tp_size, layer=group[0].layer,
                           serve=_column(splits[tp])) for tp in tps]
    lines.append("vLLM and SGLang, by TP size (the declarations of layouts/serving_*.py, checked by the engine tiers):")
    return "\n".join(lines + ["  " + line for tp in tps if splits[tp] for line in serve_lines(splits[tp])])


def _column(split: Split | None) -> str:
    """The serve column of a --plan row: each engine's short verdict."""
    return " | ".join(short_verdict(split, of_engine(engine)) for engine in ENGINES) if split else "-"


def output_split(plan: ShardPlan) -> Split:
    """The serve question (layouts.serving) of a shard plan's output: every layer of every rank as written."""
    layers = tuple(LayerKind(p.prefix, p.moe.quant, p.fused.hidden, p.fused.part, p.fused.group_size,
                             bool(p.fused.padding)) for rank in plan.ranks for p in rank.plans.values())
    return _split(plan.source, plan.moe, plan.params["tp"], plan.params["ep"], layers)


def _split(src: Path, moe: MoEConfig, tp: int, ep: int, layers: tuple[LayerKind, ...]) -> Split:
    """The serve question of `layers` at TP `tp` x EP `ep`, with the source's quantization_config and model."""
    config = load_json(src / "config.json")
    text = text_config(config)
    heads = int(text.get("num_attention_heads") or 0)
    head_dim = int(text.get("head_dim") or (moe.hidden_size // heads if heads else 0))
    return Split(read_qconfig(src, config)[0] or {}, moe.quant, tp, ep, layers,
                 tuple(config.get("architectures") or ()), moe.num_experts, moe.intermediate_size, heads,
                 heads * head_dim)


def warn_unserved(plan: ShardPlan, out: Path) -> None:
    """Before anything is written: one warning (on stderr, --quiet included) per engine none of whose tested
    versions serves the fused output, with why and a split that it would serve."""
    if plan.layout is OutputLayout.FUSED:
        split = output_split(plan)
        for engine in ENGINES:
            versions = of_engine(engine)
            if refusing(split, versions) == versions:
                log.warning("%s: no tested %s serves this output with --load-format wna16: %s", out, engine.name,
                            refusal_words(plan, split, versions, str(out)))


def check_served(plan: ShardPlan, serve_for: str | None, out: Path) -> None:
    """`--for ENGINE` (`serve_for`, as `versions_for` reads it; None: no check): a PreshardError, before anything
    is written, when one of the versions it names does not serve the fused output, saying why and naming a split
    that it would serve. An output in the checkpoint's own layout is the engine's own loader's to judge."""
    if serve_for is None or plan.layout is not OutputLayout.FUSED:
        return
    versions, split = versions_for(serve_for), output_split(plan)
    refused = refusing(split, versions)
    if refused:
        raise PreshardError(f"{labels(refused)} will not serve {shard_flags(split)} with --load-format wna16: "
                            f"{refusal_words(plan, split, refused, str(out))}; nothing was written.")


def labels(versions: tuple[EngineVersion, ...]) -> str:
    """`vLLM 0.32.0, 0.34.0; SGLang 0.5.23`."""
    return "; ".join(f"{engine.name} {', '.join(v.version for v in of_engine(engine, versions))}"
                     for engine in ENGINES if of_engine(engine, versions))


def shard_flags(split: Split) -> str:
    """wna16-shard's flags of a split: `--tp 8`, `--ep 8`, `--tp 2 --ep 4`."""
    return " ".join([f"--tp {split.tp}"] * (split.tp > 1 or split.ep == 1) + [f"--ep {split.ep}"] * (split.ep > 1))


def refusal_words(plan: ShardPlan, split: Split, versions: tuple[EngineVersion, ...], out: str) -> str:
    """Why the first of `versions` refuses `split`, and the split it would serve (or that none would)."""
    version = versions[0]
    why = verdict(version, split).why
    other = serving_split(plan, version)
    if other is None:
        return f"{why}; no TP or EP size up to {CANDIDATES[-1]} would serve it"
    served = verdict(version, other)
    return f"{why}: {shard_flags(other)} would serve ({command(version.engine, other, out, served.flag)})"


def serving_split(plan: ShardPlan, version: EngineVersion) -> Split | None:
    """The first split `version` serves among: the sizes given, each alone as EP and as TP, then every size of
    CANDIDATES, largest first, as the kind given first (EP where --ep was given), one rank last (None: none)."""
    tp, ep = plan.params["tp"], plan.params["ep"]
    sizes = [(1, ep), (tp, 1), (1, tp), (ep, 1), (1, tp * ep), (tp * ep, 1)]
    for n in reversed(CANDIDATES):
        sizes += [(1, n), (n, 1)] if ep > 1 else [(n, 1), (1, n)]
    groups = _spec_groups(plan)
    order = [s for s in sizes if s not in ((tp, ep), (1, 1))] + [(1, 1)] * ((tp, ep) != (1, 1))
    for size in dict.fromkeys(order):
        split = plan_split(plan.source, plan.moe, groups, *size, plan.params["placement"])
        if split is not None and verdict(version, split).serve is not Serve.NEVER:
            return split
    return None


def _spec_groups(plan: ShardPlan) -> list[list[LayerPlan]]:
    """The plan's first rank's layer plans, grouped by spec (plan_split's `groups`)."""
    groups: dict[QuantSpec, list[LayerPlan]] = {}
    for layer in plan.ranks[0].plans.values():
        groups.setdefault(layer.moe.quant, []).append(layer)
    return list(groups.values())


def plan_split(src: Path, moe: MoEConfig, groups: Iterable[list[LayerPlan]], tp: int, ep: int,
               placement: str) -> Split | None:
    """The serve question of `--plan`'s row TP `tp` x EP `ep`: the first layer of each spec group on every
    rank; None where the layout is impossible."""
    layers = []
    for group in groups:
        plan = group[0]
        try:
            cost = layout_cost(plan.moe, plan.fused.scale_dtype, tp, ep, placement, plan.layer)
        except WNA16Error:
            return None
        layers += [LayerKind(plan.prefix, plan.moe.quant, plan.fused.hidden, cost.part, cost.group_eff, bool(pad))
                   for pad in cost.padding]
    return _split(src, moe, tp, ep, tuple(layers))


def _row(moe: MoEConfig, dtype: torch.dtype, tp: int, ep: int, placement: str, *, mark: bool,
         layer: int | None = None, serve: str = "-") -> str:
    head = f"{'*' if mark else ' '} {tp:>3} {ep:>3}"
    try:
        c = layout_cost(moe, dtype, tp, ep, placement, layer)
    except WNA16Error as exc:
        return f"{head}  impossible: {exc}"
    group = c.group_eff if moe.quant.quantized else "float"  # float experts have no groups
    return (f"{head} {c.padded_intermediate:>7} {c.part:>6} {group:>5}  {c.rank_bytes:>12} "
            f"{c.padding_bytes:>13}  {runs(c.experts):<15}  {runs(c.padding):<27}  {serve}")
