"""What a pre-shard run tells its user: the plan in words, progress while writing, the summary table."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .planning import COMMON_DIR, ShardPlan


def describe_plan(plan: ShardPlan) -> str:
    """A human-readable plan: layout, G_eff per layer, files and bytes per rank."""
    p = plan.params
    lines = [f"source: {plan.source}",
             f"layout: {p['layout']}, tp={p['tp']} ep={p['ep']} placement={p['placement']} -> {len(plan.ranks)} ranks, "
             f"max file size {p['max_file_size']} bytes",
             f"quantization: {plan.quant['format']} {plan.quant['bits']}-bit group {plan.quant['group_size']} "
             f"sym={plan.quant['sym']} act_order={plan.quant['act_order']}"]
    lines += [f"  G_eff {prefix}: {g}" for prefix, g in plan.quant["group_size_eff"].items()]
    if plan.moe.resolution is not None:  # how every model value was found: the first thing to read when a model fails
        lines += ["model config: " + line.strip() if i == 0 else line
                  for i, line in enumerate(plan.moe.resolution.describe().splitlines())]
    groups = [(COMMON_DIR, plan.common)] + [(r.folder, r.files) for r in plan.ranks]
    for folder, files in groups:
        total = sum(f.nbytes for f in files)
        lines.append(f"{folder}: {len(files)} files, {sum(len(f.tensors) for f in files)} tensors, {total} bytes")
        lines += [f"    {f.name}: {len(f.tensors)} tensors, {f.nbytes} bytes" for f in files]
    lines.append(f"copied: {', '.join(plan.copied) or '(none)'}")
    return "\n".join(lines)


class Progress:
    """Bytes written: a tqdm bar on a TTY, plain lines every few seconds otherwise, nothing when disabled."""

    def __init__(self, total: int, enabled: bool, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.done, self.enabled, self.last = total, 0, enabled, 0.0
        self.bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="B", unit_scale=True, file=self.stream, desc="wna16-shard")
            except ImportError:  # tqdm is optional at runtime; fall back to lines
                self.bar = None

    def advance(self, nbytes: int, label: str) -> None:
        """Count `nbytes` more bytes done, `label` being the file just finished."""
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.enabled and (time.monotonic() - self.last > 2.0 or self.done >= self.total):
            self.last = time.monotonic()
            pct = 100.0 * self.done / max(self.total, 1)
            print(f"wna16-shard: {self.done}/{self.total} bytes ({pct:.0f}%), last {label}", file=self.stream)

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


@dataclass(frozen=True)
class ShardSummary:
    """The result of preshard_checkpoint."""

    out: Path
    plan: ShardPlan
    ranks: tuple[RankSummary, ...]
    dry_run: bool = False
    problems: tuple[str, ...] = ()

    def table(self) -> str:
        """One row per folder: files, tensors, bytes, seconds (and files kept by resume)."""
        rows = [f"{'folder':<24} {'files':>5} {'tensors':>7} {'bytes':>14} {'kept':>4} {'seconds':>8}"]
        rows += [f"{r.name:<24} {r.files:>5} {r.tensors:>7} {r.bytes:>14} {r.kept:>4} {r.seconds:>8.2f}"
                 for r in self.ranks]
        return "\n".join(rows)
