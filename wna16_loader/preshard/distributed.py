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
|  (a fresh run, a rank |            | the node's window (`storage/node.py`): |
|  folder per process:  |            | each rank's layers in step             |
|  read as a node)      |            |                                        |
| small files, manifest | process 0  | barrier                                |
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import PreshardError
from ..load.outputs import MANIFEST_NAME, OutputLayout
from ..load.reads import node_groups, planned_ranges
from ..parallel.config import Node, ShardJob
from ..storage.index import CheckpointIndex
from ..storage.readahead import ReadOptions
from ..storage.windows import windows_of
from .journal import JOURNAL_NAME, check_existing, recheck, start
from .layouts import check_served
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
                         layout: str | OutputLayout = OutputLayout.FUSED, mtp: bool = True,
                         reads: ReadOptions | None = None, serve_for: str | None = None) -> ShardSummary:
    """`preshard_checkpoint` split over the processes of `job` (every process calls it with the same
    arguments; torch.distributed must be initialised when there are several). Process 0's summary lists
    every folder. A fresh fused run with one rank folder per process reads as a node: the processes of each
    host read every source byte once, together (`reads`: the read options, default `ReadOptions()`). `serve_for`:
    as `preshard_checkpoint`'s, checked by every process before anything is written."""
    out = Path(out)
    check_out_not_in_source(Path(src), out)
    lead = job.process == 0
    plan = make_plan(src, tp_size=tp_size, ep_size=ep_size, placement=placement, max_file_size=max_file_size,
                     layout=layout, mtp=mtp, warn=lead)  # one warning per run, not one per process
    check_served(plan, serve_for, out)
    if lead:
        make_dir(out)
    with output_lock(out) if lead else nullcontext():
        journal = _started(out, plan, resume, job)
        node = job.node(str(plan.source)) if _together(plan, journal, job) else None  # (every process decides alike)
        mine = [g for g in [*range(len(plan.ranks)), None] if owner(g, job.processes) == job.process]
        try:
            with CheckpointIndex(plan.source) as index:  # one mapping per source file for all owned folders
                done: Any = [(g, *_write_owned(out, plan, g, journal, index, node, reads or ReadOptions()))
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


def _together(plan: ShardPlan, journal: dict[str, dict[str, Any]], job: ShardJob) -> bool:
    """Whether the processes read as a node: several, one fused rank folder each (process p writes rank p), and
    nothing of those folders written yet (a resumed run's processes would not walk the layers in step)."""
    ranks = plan.ranks
    return 1 < job.processes == len(ranks) and all(r.parallel.rank == i and r.plans and not r.sliced
                                                   for i, r in enumerate(ranks)) and \
        not any(f.path in journal for r in ranks for f in r.files)


def _write_owned(out: Path, plan: ShardPlan, group: int | None, journal: dict[str, dict[str, Any]],
                 index: CheckpointIndex, node: Node | None, reads: ReadOptions) -> tuple[Any, Any]:
    """`write_group` of one owned folder; a rank folder's layers read with the node, when there is one."""
    state = {"written": 0, "kill_after": 0}
    if node is None or group is None:
        return write_group(out, plan, group, journal, state, index=index)
    with _read_with_node(index, plan, group, node, reads) as (start, ahead):
        summary, records = write_group(out, plan, group, journal, state, index=index, on_layer=start)
    return replace(summary, window_bytes=ahead.window_bytes), records


@contextmanager
def _read_with_node(index: CheckpointIndex, plan: ShardPlan, group: int, node: Node, reads: ReadOptions
                    ) -> Iterator[tuple[Callable[[str], None], Any]]:
    """Rank `group`'s layers, in the order its files take them (sorted names: a layer's tensors together),
    read ahead with the node's ranks (each process of the node writes the rank of its number); yields the
    `start(prefix)` the writer calls before loading each layer, and the read."""
    rank, options = plan.ranks[group], replace(reads, node=node)
    order = list(dict.fromkeys(name.rpartition(".")[0] for f in rank.files for name in f.tensors))
    paths: dict[str, Path] = {}
    own = [planned_ranges(index, rank.plans[p], min_tensor_bytes=options.min_tensor_bytes, paths=paths) for p in order]
    together = node_groups(index, [[plan.ranks[r].plans[p] for p in order] for r in node.ranks], options, paths)
    position = {prefix: i for i, prefix in enumerate(order)}
    windows = None if together is None else windows_of(together, node.window_bytes, options.gap_bytes)
    with index.reading_ahead(own, options, node_windows=windows) as ahead:
        last = [-1]

        def start(prefix: str) -> None:
            assert position[prefix] > last[0], f"{prefix}: layers must be loaded in file order, once each"
            last[0] = position[prefix]
            ahead.start(position[prefix])
        yield start, ahead


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
