"""preshard_checkpoint: plan, lock, write every folder, copy the small files, write the manifest last."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import PreshardError
from ..load.outputs import MANIFEST_NAME, OutputLayout
from ..storage.hub import resolve_checkpoint
from .journal import (JOURNAL_NAME, Recheck, check_existing, interrupted, recheck, start, warn_repairing,
                      warn_starting_over)
from .manifest import build_manifest
from .layouts import check_served, warn_unserved
from .plan import COMMON_DIR, ShardPlan, make_plan, warn_plan
from .progress import RankSummary, ShardSummary
from .safefiles import copy_file, locked_by_another, make_dir, output_lock, write_json_atomic
from .verify import verify_report
from .writing import write_all


def shard(src: str | Path, out: str | Path, *, tp: int = 1, ep: int = 1, placement: str = "linear",
          revision: str | None = None, layout: str | OutputLayout = OutputLayout.FUSED, max_file_size: int = 4 * 2**30,
          resume: bool = False, force: bool = False, verify: bool = False, dry_run: bool = False,
          workers: int = 1, mtp: bool = True, progress: bool = True, serve_for: str | None = None) -> ShardSummary:
    """The Python twin of `wna16-shard SRC OUT --tp TP --ep EP [...]`, option for option (`mtp=False` is
    `--no-mtp`, `serve_for="sglang"` is `--for sglang`; named `shard`, as `preshard` is this package's folder): pre-shard `src` (a folder, or a Hugging Face repo id at `revision`) into `out`, and return
    the summary the CLI prints (`summary.table()`; `summary.complete` when `out` already held it). Then
    `load_experts(out, ParallelConfig.from_manifest(out, rank=r))` loads rank r."""
    return preshard_checkpoint(resolve_checkpoint(src, revision=revision), out, tp_size=tp, ep_size=ep,
                               placement=placement, max_file_size=max_file_size, resume=resume, verify=verify,
                               dry_run=dry_run, progress=progress, layout=layout, workers=workers, force=force,
                               mtp=mtp, serve_for=serve_for)


def preshard_checkpoint(src: str | Path, out: str | Path, *, tp_size: int, ep_size: int = 1,
                        placement: str = "linear", max_file_size: int = 4 * 2**30, resume: bool = False,
                        verify: bool = False, dry_run: bool = False, progress: bool = True,
                        layout: str | OutputLayout = OutputLayout.FUSED, workers: int = 1, force: bool = False,
                        mtp: bool = True, serve_for: str | None = None) -> ShardSummary:
    """Write every rank's expert tensors of `src` into `out` (see the module docstring).

    layout: OutputLayout.FUSED, "fused" (load_experts' tensors) or OutputLayout.CHECKPOINT, "checkpoint" (source
    tensors sliced per rank, source names and format). dry_run: plan only, write nothing. resume: keep the
    journaled files of an interrupted run whose size and sha256 still match.
    verify: re-read the output and compare it with the source; problems land in the summary.
    workers: folders written in parallel processes (output identical to workers=1).
    mtp: shard the MTP layers' experts (default); False copies their tensors unchanged into common/.
    serve_for: an engine (`"vllm"`, `"sglang"`, `"sglang==0.5.23"`: layouts.engines.versions_for) that must serve
    the fused output: a split it refuses raises PreshardError before anything is written, naming a split it
    would serve. Without it, each engine that serves no such output is warned about before the write.
    An `out` that already holds this plan's finished output (same parameters and source) is re-checked, file
    by file, against its manifest (size, then sha256; progress shown): exactly the files that differ, are
    truncated or are missing are rewritten, the others are left untouched (their mtime too); when none
    differs, nothing is written and the summary says `complete`. force=True rewrites every file.
    Raises a WNA16Error subclass on bad input, a locked or foreign `out`, changed parameters or a failed write.
    """
    out = Path(out)
    check_out_not_in_source(Path(src), out)
    if workers < 1:
        raise PreshardError(f"workers={workers}: must be at least 1, e.g. --workers 4.")
    plan = make_plan(src, tp_size=tp_size, ep_size=ep_size, placement=placement, max_file_size=max_file_size,
                     layout=layout, mtp=mtp, warn=False)  # warned below, only when something is written
    check_served(plan, serve_for, out)
    if dry_run:
        warn_plan(plan)
        return ShardSummary(out=out, plan=plan, ranks=(), dry_run=True)
    found = None
    if not force and out.is_dir() and not locked_by_another(out):  # before anything is written (read-only OUT)
        found = _existing(out, plan, resume, progress)
        if found is not None and found.intact and (out / MANIFEST_NAME).is_file():
            return _complete(out, plan, verify)
    make_dir(out)
    with output_lock(out):
        check_existing(out, plan)
        if found is None and (resume or not force):  # OUT was locked by another run at first, or force + resume
            found = _existing(out, plan, resume, progress)
        if found is None and not force:
            warn_starting_over(out, plan)
        warn_plan(plan)
        if serve_for is None:
            warn_unserved(plan, out)
        journal: dict[str, dict[str, Any]] = {}
        try:
            journal = start(out, plan, None if found is None else found.kept)
            summaries = write_all(out, plan, journal, progress, workers)
            records = {rec["path"]: rec for rec in journal.values()}
            for name in plan.copied:
                copy_file(plan.source / name, out / name)
            write_json_atomic(out / MANIFEST_NAME, build_manifest(plan, records))
        except KeyboardInterrupt:
            raise interrupted(out, plan, journal) from None
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    return replace(ShardSummary(out=out, plan=plan, ranks=summaries), **_verified(out, plan, verify))


def _existing(out: Path, plan: ShardPlan, resume: bool, progress: bool) -> Recheck | None:
    """Refuse a foreign OUT; re-check the files of a finished output (a re-run repairs it) or, with `resume`,
    of an interrupted run (warning which files a repair rewrites). None: nothing to keep (start over)."""
    check_existing(out, plan)
    finished = (out / MANIFEST_NAME).is_file()
    if not finished and not resume:
        return None
    found = recheck(out, plan, progress)
    if finished and not found.intact:
        warn_repairing(out, found)
    return found


def _complete(out: Path, plan: ShardPlan, verify: bool) -> ShardSummary:
    """The summary of an output that was already complete (nothing written)."""
    ranks = [RankSummary(COMMON_DIR, len(plan.common), sum(len(f.tensors) for f in plan.common),
                         sum(f.nbytes for f in plan.common), 0.0, kept=len(plan.common))]
    ranks += [RankSummary(r.folder, len(r.files), sum(len(f.tensors) for f in r.files), sum(f.nbytes for f in r.files),
                          0.0, kept=len(r.files)) for r in plan.ranks]
    return replace(ShardSummary(out=out, plan=plan, ranks=tuple(ranks), complete=True), **_verified(out, plan, verify))


def _verified(out: Path, plan: ShardPlan, verify: bool) -> dict[str, Any]:
    """The summary's `problems` and `verified` fields after verify_report against the source (if asked)."""
    if not verify:
        return {}
    report = verify_report(out, source=plan.source)
    return {"problems": report.problems, "verified": "" if report.problems else report.text()}


def check_out_not_in_source(src: Path, out: Path) -> None:
    """OUT must not lie inside SRC (its files would be read back as checkpoint shards)."""
    if out.resolve() == src.resolve() or out.resolve().is_relative_to(src.resolve()):
        raise PreshardError(f"{out}: the output folder is inside the source folder {src}; its safetensors files "
                            f"would be mistaken for checkpoint shards. Choose an output folder outside {src}.")
