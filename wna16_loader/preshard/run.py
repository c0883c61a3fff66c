"""preshard_checkpoint: plan, lock, write every folder, copy the small files, write the manifest last."""

from __future__ import annotations

from pathlib import Path

from ..errors import PreshardError
from ..presharded import MANIFEST_NAME
from .journal import JOURNAL_NAME, check_existing, start
from .manifest import build_manifest
from .planning import make_plan
from .progress import ShardSummary
from .safefiles import copy_file, make_dir, output_lock, write_json_atomic
from .verify import verify_output
from .writing import write_all


def preshard_checkpoint(src: str | Path, out: str | Path, *, tp_size: int, ep_size: int = 1,
                        placement: str = "linear", max_file_size: int = 4 * 2**30, resume: bool = False,
                        verify: bool = False, dry_run: bool = False, progress: bool = True,
                        layout: str = "fused", workers: int = 1) -> ShardSummary:
    """Write every rank's expert tensors of `src` into `out` (see the module docstring).

    layout: "fused" (load_experts' tensors) or "checkpoint" (source tensors sliced per rank, source names
    and format). dry_run: plan only, write nothing. resume: keep journaled files whose sha256 still matches.
    verify: re-read the output and compare it with the source; problems land in the summary.
    workers: folders written in parallel processes (output identical to workers=1).
    Raises a WNA16Error subclass on bad input, a locked or foreign `out`, changed parameters or a failed write.
    """
    out = Path(out)
    check_out_not_in_source(Path(src), out)
    if workers < 1:
        raise PreshardError(f"workers={workers}: must be at least 1, e.g. --workers 4.")
    plan = make_plan(src, tp_size=tp_size, ep_size=ep_size, placement=placement, max_file_size=max_file_size,
                     layout=layout)
    if dry_run:
        return ShardSummary(out=out, plan=plan, ranks=(), dry_run=True)
    make_dir(out)
    with output_lock(out):
        check_existing(out, plan)
        journal = start(out, plan, resume)
        summaries = write_all(out, plan, journal, progress, workers)
        records = {rec["path"]: rec for rec in journal.values()}
        for name in plan.copied:
            copy_file(plan.source / name, out / name)
        write_json_atomic(out / MANIFEST_NAME, build_manifest(plan, records))
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    problems = tuple(verify_output(out, source=plan.source)) if verify else ()
    return ShardSummary(out=out, plan=plan, ranks=summaries, problems=problems)


def check_out_not_in_source(src: Path, out: Path) -> None:
    """OUT must not lie inside SRC (its files would be read back as checkpoint shards)."""
    if out.resolve() == src.resolve() or out.resolve().is_relative_to(src.resolve()):
        raise PreshardError(f"{out}: the output folder is inside the source folder {src}; its safetensors files "
                            f"would be mistaken for checkpoint shards. Choose an output folder outside {src}.")
