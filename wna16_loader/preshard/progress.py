"""What a pre-shard run tells its user: the plan in words, progress while writing, the summary table."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import format_ranges
from ..formats.spec import group_words
from ..load.outputs import OutputLayout
from ..layouts.engines import serve_lines
from .layouts import output_split
from .plan import COMMON_DIR, RankPlan, ShardPlan, paddings


def human_size(nbytes: int) -> str:
    """1536 -> '1.5 KiB' (powers of 1024; bytes below 1 KiB)."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value, unit = float(nbytes), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


def quant_line(plan: ShardPlan) -> str:
    """e.g. `gptq 4-bit, group 32 (G_eff 16 in 2 layers), asymmetric, act-order`; with layers of their own specs,
    each spec and its layer count (`per layer: gptq 4-bit g32 asym x1, not quantized (float weights) x1`)."""
    if "layers" in plan.quant:
        counts: dict[str, int] = {}
        for layer in plan.quant["layers"].values():
            counts[layer["spec"]] = counts.get(layer["spec"], 0) + 1
        return "per layer: " + ", ".join(f"{spec} x{n}" for spec, n in counts.items())
    q = plan.quant
    reduced = [g for g in q["group_size_eff"].values() if g != q["group_size"]]
    group = group_words(q["group_size"])
    if reduced:
        group += f" (G_eff {', '.join(str(g) for g in sorted(set(reduced)))} in {len(reduced)} layer(s))"
    return (f"{q['format']} {q['bits']}-bit, {group}, {'symmetric' if q['sym'] else 'asymmetric'}"
            f"{', act-order' if q['act_order'] else ''}")


def describe_plan(plan: ShardPlan) -> str:
    """A human-readable plan: layout, G_eff per layer, files and sizes per rank, totals."""
    p = plan.params
    lines = [f"source: {plan.source}",
             f"layout: {p['layout']}, tp={p['tp']} ep={p['ep']} placement={p['placement']} -> {len(plan.ranks)} ranks, "
             f"max file size {human_size(p['max_file_size'])}",
             f"quantization: {quant_line(plan)}"]
    lines += [f"  G_eff {prefix}: {g}" for prefix, g in plan.quant["group_size_eff"].items()]
    lines += [f"  spec {prefix}: {layer.spec.describe()}" for prefix, layer in plan.ranks[0].plans.items()]
    if plan.moe.resolution is not None:  # how every model value was found: the first thing to read when a model fails
        lines += ["model config: " + line.strip() if i == 0 else line
                  for i, line in enumerate(plan.moe.resolution.describe().splitlines())]
    if plan.mtp_layers:
        where = "sharded like the MoE layers" if plan.params["mtp"] else "copied unchanged into common/ (--no-mtp)"
        lines.append(f"MTP layers: {', '.join(plan.mtp_layers)}: {where}")
    groups = [(COMMON_DIR, plan.common)] + [(r.folder, r.files) for r in plan.ranks]
    for folder, files in groups:
        total = sum(f.nbytes for f in files)
        lines.append(f"{folder}: {len(files)} files, {sum(len(f.tensors) for f in files)} tensors, "
                     f"{human_size(total)}")
        lines += [f"    {f.name}: {len(f.tensors)} tensors, {human_size(f.nbytes)}" for f in files]
    files = plan.all_files()
    lines.append(f"total: {len(files)} files, {sum(len(f.tensors) for f in files)} tensors, "
                 f"{human_size(sum(f.nbytes for f in files))}")
    lines.append(f"copied: {', '.join(plan.copied) or '(none)'}")
    serve = serve_lines(output_split(plan)) if plan.layout is OutputLayout.FUSED else []
    return "\n".join(lines + padding_lines(plan) + serve)


def padding_lines(plan: ShardPlan) -> list[str]:
    """`padding: I = 768 is padded to I' = 800 (160 columns per TP rank) in 2 layer(s); TP rank 4: 32 of 160
    columns` (per TP rank, the same on every EP rank), one line per distinct padding; none without padding."""
    lines = []
    for pad in paddings(plan):
        by_amount: dict[int, list[int]] = {}
        for t, amount in enumerate(pad.per_tp_rank):
            if amount:
                by_amount.setdefault(amount, []).append(t)
        ranks = "; ".join(f"TP rank{'s' if len(ts) > 1 else ''} {format_ranges(ts)}: {amount} of {pad.part} columns"
                          + (" (only padding)" if amount == pad.part else "") for amount, ts in by_amount.items())
        lines.append(f"padding: I = {pad.intermediate} is padded to I' = {pad.part * plan.params['tp']} ({pad.part} "
                     f"columns per TP rank) in {len(pad.layers)} layer(s); {ranks}")
    return lines


class Progress:
    """Bytes written (or, with an `action` such as `checking OUT: `, checked): a tqdm bar on a TTY, plain lines
    every few seconds otherwise (from `after` seconds on: a quick pass prints none), nothing when disabled."""

    def __init__(self, total: int, enabled: bool, stream: Any = None, action: str = "", after: float = 0.0) -> None:
        self.stream = stream or sys.stderr
        self.total, self.done, self.enabled, self.last, self.action = total, 0, enabled, 0.0, action
        self.quiet_until = time.monotonic() + after
        self.lock = threading.Lock()  # advanced by the writer thread (tensor bytes) and the main one (kept files)
        self.bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="B", unit_scale=True, file=self.stream,
                                desc=f"wna16-shard {action.rstrip(': ')}".rstrip())
            except ImportError:  # tqdm is optional at runtime; fall back to lines
                self.bar = None

    def advance(self, nbytes: int, label: str) -> None:
        """Count `nbytes` more bytes done (written within a file, or files kept), `label` being that file."""
        with self.lock:
            self.done += nbytes
            if self.bar is not None:
                self.bar.update(nbytes)
            elif self.enabled and time.monotonic() >= self.quiet_until and (
                    time.monotonic() - self.last > 2.0 or self.done >= self.total):
                self.last = time.monotonic()
                pct = 100.0 * self.done / max(self.total, 1)
                print(f"wna16-shard: {self.action}{human_size(self.done)} of {human_size(self.total)} ({pct:.0f}%), "
                      f"{label}", file=self.stream)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


@dataclass(frozen=True)
class RankSummary:
    """What was written for one folder (a rank, or common/)."""

    name: str
    files: int
    tensors: int
    bytes: int
    seconds: float
    kept: int = 0
    window_bytes: int = 0  # the shared window of the node that read this folder's layers together (0: none)


@dataclass(frozen=True)
class ShardSummary:
    """The result of preshard_checkpoint."""

    out: Path
    plan: ShardPlan
    ranks: tuple[RankSummary, ...]
    dry_run: bool = False
    problems: tuple[str, ...] = ()

    complete: bool = False  # the output was already complete: nothing was written
    verified: str = ""  # what verify checked (VerifyReport.text()), when asked and without problems

    def table(self) -> str:
        """The format line, then one row per folder: files, tensors, size, group size (G_eff; `float bf16` for
        float layers), files kept by resume, seconds and the rank's experts; and a total row."""
        groups = {r.folder: _group_sizes(r) for r in self.plan.ranks}
        experts = {r.folder: rank_experts(r) for r in self.plan.ranks}
        width = max([6] + [len(g) for g in groups.values()])
        rows = [f"format: {quant_line(self.plan)}; layout {self.plan.params['layout']}",
                f"{'folder':<24} {'files':>5} {'tensors':>7} {'size':>10} {'group':>{width}} {'kept':>4} "
                f"{'seconds':>8}  experts"]
        rows += [f"{r.name:<24} {r.files:>5} {r.tensors:>7} {human_size(r.bytes):>10} "
                 f"{groups.get(r.name, '-'):>{width}} {r.kept:>4} {r.seconds:>8.2f}  {experts.get(r.name, '-')}"
                 for r in self.ranks]
        rows.append(f"{'total':<24} {sum(r.files for r in self.ranks):>5} {sum(r.tensors for r in self.ranks):>7} "
                    f"{human_size(sum(r.bytes for r in self.ranks)):>10} {'':>{width}} "
                    f"{sum(r.kept for r in self.ranks):>4} {sum(r.seconds for r in self.ranks):>8.2f}")
        return "\n".join(rows + padding_lines(self.plan) + self._methods())

    def _methods(self) -> list[str]:
        """Whether each tested vLLM and SGLang serves the output (a fused one; --layout checkpoint holds source
        tensors)."""
        if self.plan.layout is not OutputLayout.FUSED:
            return []
        return serve_lines(output_split(self.plan), str(self.out))


def _group_sizes(rank: RankPlan) -> str:
    """The group sizes of a rank's layers as written: G_eff for fused, the source's G for checkpoint slices;
    `chan` for channelwise, `float bf16` for float layers."""
    sizes = sorted({spec.group_size for spec in rank.layers.values() if spec.quantized})
    floats = sorted({spec.group_label for spec in rank.layers.values() if not spec.quantized})
    return ",".join(["chan" if g == -1 else str(g) for g in sizes] + floats) or "-"


def rank_experts(rank: RankPlan) -> str:
    """The routed experts a rank holds (every MoE layer holds the same ones): `3: 0–2`, `2: 6, 7`."""
    ids = next(iter(rank.layers.values())).experts if rank.layers else ()
    text = format_ranges(list(ids))
    return f"{len(ids)}: {text if len(text) <= 40 else text[:37] + '...'}"
