"""`wna16-shard SRC --plan`: every layout's cost before anything is written.

For TP sizes 1, 2, 4, 8, 16 (and the requested one) x the requested EP size: I', I_p, G_eff,
the padding of every TP rank, and the bytes one rank holds of one MoE layer (the largest rank)
with the part of them that is padding. Computed from config.json and the safetensors headers
(for the scale dtype); nothing is read or written. The last column says which of vLLM 0.32's MoE methods
(layouts.vllm) take that layout's output: as it is (read straight into their parameters) or re-laid on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import WNA16Error
from ..formats import QuantSpec
from ..layouts.spec import accepting, leaves_partial_group
from ..layouts.vllm import VLLM_LAYOUTS
from ..load.experts import planned
from ..load.fused import FusedSpec
from ..load.padfill import padding_bytes
from ..load.plan import LayerPlan, layer_geometry
from ..models.config import MoEConfig
from ..parallel.config import ParallelConfig
from .plan import check_source_folder

PLAN_TP_SIZES = (1, 2, 4, 8, 16)
HEADER = (" tp  ep      I'    I_p G_eff    bytes/rank padding bytes  experts/EP rank  padding columns per TP rank"
          "   vLLM 0.32 methods that take it")


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
            lines += [_row(group[0].moe, dtype, tp, ep_size, placement, mark=tp == tp_size, layer=group[0].layer)
                      for tp in tps]
    return "\n".join(lines)


def vllm_methods(quant: QuantSpec, *, group_eff: int, padded: bool, hidden: int, part: int) -> str:
    """Which of vLLM 0.32's MoE methods take a fused layer of source spec `quant` written with `group_eff`
    (and padding, when `padded`) for H `hidden` and I_p `part`: as it is, or re-laid on load; `none (why)` when
    none does."""
    return accepting(VLLM_LAYOUTS, quantized=quant.quantized, padded=padded,
                     reduced=quant.quantized and group_eff not in (quant.group_size, -1),
                     asymmetric=quant.quantized and not quant.symmetric,
                     partial=quant.quantized and leaves_partial_group(quant.group_size, group_eff, hidden, part))


def method_lines(ranks: Iterable[tuple[str, Iterable[LayerPlan]]]) -> list[str]:
    """`vLLM 0.32 methods: auto_gptq (re-laid), moe_wna16 (as is): every layer of every rank`, one line per
    distinct answer over the (rank name, layer plans) given, naming the layers and ranks where they differ."""
    where: dict[str, dict[str, list[str]]] = {}
    ranks = list(ranks)
    for rank, plans in ranks:
        for plan in plans:
            answer = vllm_methods(plan.moe.quant, group_eff=plan.fused.group_size, padded=bool(plan.fused.padding),
                                  hidden=plan.fused.hidden, part=plan.fused.part)
            where.setdefault(answer, {}).setdefault(plan.prefix, []).append(rank)
    if len(where) == 1:
        return [f"vLLM 0.32 methods that take this output: {next(iter(where))}: every layer of every rank"]
    return [f"vLLM 0.32 methods that take this output: {answer}: "
            + "; ".join(f"{prefix} on {'every rank' if len(on) == len(ranks) else ', '.join(on)}"
                        for prefix, on in layers.items())
            for answer, layers in where.items()]


def _row(moe: MoEConfig, dtype: torch.dtype, tp: int, ep: int, placement: str, *, mark: bool,
         layer: int | None = None) -> str:
    head = f"{'*' if mark else ' '} {tp:>3} {ep:>3}"
    try:
        c = layout_cost(moe, dtype, tp, ep, placement, layer)
    except WNA16Error as exc:
        return f"{head}  impossible: {exc}"
    group = c.group_eff if moe.quant.quantized else "float"  # float experts have no groups
    methods = vllm_methods(moe.quant, group_eff=c.group_eff, padded=any(c.padding), hidden=moe.hidden_size,
                           part=c.part)
    return (f"{head} {c.padded_intermediate:>7} {c.part:>6} {group:>5}  {c.rank_bytes:>12} "
            f"{c.padding_bytes:>13}  {runs(c.experts):<15}  {runs(c.padding):<27}  {methods}")
