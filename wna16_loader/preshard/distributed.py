"""Rank-parallel pre-sharding over torch.distributed (gloo is enough: only small objects travel).

Process p of K (a `ShardJob`) writes the output ranks r with r % K == p; process 0 also holds the
output lock, checks and starts the output (plan file, journal), writes common/, and after every
process has finished copies the small files and writes the manifest. Every file is the one a
single-process run writes (same plan, same serialisation), so the output is byte-identical. On
several machines, OUT must be one shared filesystem seen at the same path by every process.

| step                  | who        | sync                                   |
|-----------------------|------------|----------------------------------------|
| lock, check, journal  | process 0  | broadcast: the journal, or the error   |
|                       |            | (a finished OUT: its intact files)     |
| write owned folders   | everyone   | all_gather: summaries and records      |
| small files, manifest | process 0  | barrier                                |
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ..errors import PreshardError
from ..load.outputs import MANIFEST_NAME, OutputLayout
from ..parallel.config import ShardJob
from ..storage.index import CheckpointIndex
from .journal import JOURNAL_NAME, check_existing, recheck, start
from .manifest import build_manifest
from .plan import ShardPlan, make_plan
from .progress import ShardSummary
from .run import check_out_not_in_source
from .safefiles import copy_file, make_dir, output_lock, write_json_atomic
from .writing import write_group


def owner(group: int | None, processes: int) -> int:
    """The process that writes folder `group` (None: common/)."""
    return 0 if group is None else group % processes


def preshard_distributed(src: str | Path, out: str | Path, job: ShardJob, *, tp_size: int, ep_size: int = 1,
                         placement: str = "linear", max_file_size: int = 4 * 2**30, resume: bool = False,
                         layout: str | OutputLayout = OutputLayout.FUSED, mtp: bool = True) -> ShardSummary:
    """`preshard_checkpoint` split over the processes of `job` (every process calls it with the same
    arguments; torch.distributed must be initialised when there are several). Process 0's summary lists
    every folder."""
    out = Path(out)
    check_out_not_in_source(Path(src), out)
    lead = job.process == 0
    plan = make_plan(src, tp_size=tp_size, ep_size=ep_size, placement=placement, max_file_size=max_file_size,
                     layout=layout, mtp=mtp, warn=lead)  # one warning per run, not one per process
    if lead:
        make_dir(out)
    with output_lock(out) if lead else nullcontext():
        journal = _started(out, plan, resume, job)
        mine = [g for g in [None, *range(len(plan.ranks))] if owner(g, job.processes) == job.process]
        try:
            with CheckpointIndex(plan.source) as index:  # one mapping per source file for all owned folders
                done: Any = [(g, *write_group(out, plan, g, journal, {"written": 0, "kill_after": 0}, index=index))
                             for g in mine]
        except Exception as exc:  # every process must reach the gather, or the others wait forever
            done = f"process {job.process}: {type(exc).__name__}: {exc}"
        gathered = job.all_gather(done)
        failed = [item for item in gathered if isinstance(item, str)]
        if failed:
            raise PreshardError("rank-parallel wna16-shard failed; no manifest was written (re-run with --resume):\n"
                                + "\n".join(failed))
        results = sorted((item for items in gathered for item in items), key=lambda r: -1 if r[0] is None else r[0])
        if lead:
            journal.update({rec["path"]: rec for _, _, records in results for rec in records})
            for name in plan.copied:
                copy_file(plan.source / name, out / name)
            write_json_atomic(out / MANIFEST_NAME, build_manifest(plan, journal))
            (out / JOURNAL_NAME).unlink(missing_ok=True)
        job.barrier()
    return ShardSummary(out=out, plan=plan, ranks=tuple(summary for _, summary, _ in results))


def _started(out: Path, plan: ShardPlan, resume: bool, job: ShardJob) -> dict[str, dict[str, Any]]:
    """Process 0 checks and starts the output; everyone gets its journal (or its error)."""
    journal: Any = None
    if job.process == 0:
        try:
            check_existing(out, plan)
            repair = (out / MANIFEST_NAME).is_file()  # a finished output: rewrite only the files that differ
            journal = start(out, plan, recheck(out, plan).kept if resume or repair else None)
        except PreshardError as exc:
            journal = str(exc)
    journal = job.broadcast(journal)
    if isinstance(journal, str):
        raise PreshardError(journal)
    return journal
