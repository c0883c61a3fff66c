"""Writing the output files: safetensors serialised with a byte-stable header and streamed one tensor
at a time (each file's sha256 taken while it is written), fused layers produced one at a time, folders in parallel processes."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..load.experts import load_layer
from ..load.fused import FusedExperts
from ..load.outputs import SCHEMA_VERSION
from ..storage.index import DTYPES, INDEX_FILE, CheckpointIndex, nbytes_of
from ..storage.readahead import byte_view
from .journal import append_journal
from .manifest import tensor_record
from .plan import COMMON_DIR, FilePlan, RankPlan, ShardPlan
from .progress import Progress, RankSummary
from .safefiles import commit, make_dir, write_json_atomic, writing
from .slices import materialize

KILL_AFTER_FILES = 0  # test hook: when > 0, SIGKILL this process after that many files (simulates kill -9)


DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_all(out: Path, plan: ShardPlan, journal: dict[str, dict[str, Any]], progress: bool,
               workers: int = 1) -> tuple[RankSummary, ...]:
    """Write common/ then every rank (in `workers` processes when > 1); journaled files are kept."""
    meter = Progress(sum(f.nbytes for f in plan.all_files()), progress)
    groups = [None] + list(range(len(plan.ranks)))
    try:
        if workers <= 1:
            with torch_threads_beside_writers():
                results = _write_serial(out, plan, groups, journal, meter)
        else:
            results = _write_parallel(out, plan, groups, journal, workers)
            for summary, _ in results:
                meter.advance(summary.bytes, summary.name)
        summaries = []
        for summary, records in results:
            journal.update({rec["path"]: rec for rec in records})
            summaries.append(summary)
    finally:
        meter.close()
    return tuple(summaries)


def _write_serial(out: Path, plan: ShardPlan, groups: list[int | None], journal: dict[str, dict[str, Any]],
                  meter: Progress) -> list[tuple[RankSummary, list[dict[str, Any]]]]:
    """Every folder in this process, one after another; results in folder order."""
    state = {"written": 0, "kill_after": KILL_AFTER_FILES}
    # one mapping per source file for every folder; one committer, so that a folder's last fsync
    # overlaps the next folder's work
    with CheckpointIndex(plan.source) as index, ThreadPoolExecutor(1, "wna16-commit") as commits:
        try:
            pending = [write_folder(out, plan, g, journal, state, meter.advance, index=index, commits=commits)
                       for g in groups]
        except KeyboardInterrupt:  # Ctrl-C: finish the commit under way, drop the queued ones
            commits.shutdown(wait=True, cancel_futures=True)
            raise
    return [(summary, [future.result() for future in futures]) for summary, futures in pending]


HASHING_THREADS = 1  # per file being written: the file's sha256 (see _Pipeline)


@contextmanager
def torch_threads_beside_writers() -> Iterator[None]:
    """torch's intra-op threads limited to the cores the hashing threads leave (at least one) meanwhile.
    The fused layers are converted while the previous ones are written and hashed: an intra-op pool as
    large as the machine would then spin at its barriers against the hashing threads (measured: 3.5x the
    conversion's CPU time on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before - HASHING_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_parallel(out: Path, plan: ShardPlan, groups: list[int | None], journal: dict[str, dict[str, Any]],
                    workers: int) -> list[tuple[RankSummary, list[dict[str, Any]]]]:
    """One job per folder in a 'spawn' process pool; results in folder order."""
    context = multiprocessing.get_context("spawn")
    before = set(multiprocessing.active_children())
    with ProcessPoolExecutor(max_workers=min(workers, len(groups)), mp_context=context) as pool:
        try:
            with _sigint_ignored():  # the workers, started by submit, inherit it: Ctrl-C is the parent's alone
                futures = [pool.submit(write_group, out, plan, g, journal, {"written": 0, "kill_after": 0})
                           for g in groups]
            return [future.result() for future in futures]
        except KeyboardInterrupt:  # Ctrl-C: stop the workers; their unfinished files stay temporaries
            pool.shutdown(wait=False, cancel_futures=True)
            _stop([child for child in multiprocessing.active_children() if child not in before])
            raise


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored meanwhile (in the main thread; elsewhere signals cannot be set and nothing changes).
    A process started meanwhile ignores it from its first instruction (an ignored signal survives exec),
    so a Ctrl-C from a terminal, sent to every process of the group, prints no traceback in a worker."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop(workers: list[multiprocessing.process.BaseProcess]) -> None:
    """Terminate the pool's workers (a file they were writing stays a temporary, removed by the caller)."""
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join()


def write_group(out: Path, plan: ShardPlan, group: int | None, journal: dict[str, dict[str, Any]],
                state: dict[str, int], advance: Callable[[int, str], None] | None = None, *,
                index: CheckpointIndex | None = None, on_layer: Callable[[str], None] | None = None
                ) -> tuple[RankSummary, list[dict[str, Any]]]:
    """Write one folder's files (common/ when `group` is None, else rank `group`) and wait for them to be
    committed; their journal records. `advance(bytes, path)` is called after each file (kept ones included).
    `index`: the source, already open (folders written one after another share its mappings and the pages
    they faulted in). `on_layer(prefix)`: called before each fused layer is loaded (a read ahead's `start`)."""
    with ThreadPoolExecutor(1, "wna16-commit") as commits, torch_threads_beside_writers():
        summary, futures = write_folder(out, plan, group, journal, state, advance, index=index, commits=commits,
                                        on_layer=on_layer)
    return summary, [future.result() for future in futures]


def write_folder(out: Path, plan: ShardPlan, group: int | None, journal: dict[str, dict[str, Any]],
                 state: dict[str, int], advance: Callable[[int, str], None] | None, *,
                 index: CheckpointIndex | None, commits: Executor, on_layer: Callable[[str], None] | None = None
                 ) -> tuple[RankSummary, list[Future[dict[str, Any]]]]:
    """`write_group`, except that each file, once written to its temporary name, is handed to `commits`
    (one thread: fsync, rename, journal, in order) while the next one is produced; the futures of those
    commits are returned, not waited for."""
    start = time.perf_counter()
    rank = None if group is None else plan.ranks[group]
    folder, files = (COMMON_DIR, plan.common) if rank is None else (rank.folder, rank.files)
    make_dir(out / folder)
    todo = [f for f in files if f.path not in journal]
    metadata = file_metadata(plan, "common" if rank is None else str(rank.parallel.rank))
    futures = []
    if todo:
        with nullcontext(index) if index is not None else CheckpointIndex(plan.source) as source_index:
            source = tensor_source(plan, rank, source_index, on_layer)
            for fp in todo:
                written = write_temporary(out, fp, source, metadata, advance)
                futures.append(commits.submit(_commit_file, out, fp, written, state))
    kept = [fp for fp in files if fp.path in journal]
    if advance is not None and kept:
        advance(sum(fp.nbytes for fp in kept), f"{folder} ({len(kept)} files kept)")
    if len(files) > 1:
        weight_map = {name: f.name for f in files for name in f.tensors}
        write_json_atomic(out / folder / INDEX_FILE, {"metadata": {"total_size": sum(f.nbytes for f in files)},
                                                       "weight_map": dict(sorted(weight_map.items()))})
    summary = RankSummary(folder, len(files), sum(len(f.tensors) for f in files), sum(f.nbytes for f in files),
                          time.perf_counter() - start, kept=len(files) - len(todo))
    return summary, futures


def _commit_file(out: Path, fp: FilePlan, record: dict[str, Any], state: dict[str, int]) -> dict[str, Any]:
    """Make one written file durable under its final name (fsync, rename, fsync the folder), then journal it."""
    final, tmp = _paths(out, fp)
    with writing(final, tmp):
        commit(tmp, final)
    append_journal(out, record)
    _maybe_kill(state)
    return record


def _paths(out: Path, fp: FilePlan) -> tuple[Path, Path]:
    """(final path, temporary path `.NAME.tmp` next to it) of one output file."""
    final = out / fp.folder / fp.name
    return final, final.with_name(f".{fp.name}.tmp")


def _maybe_kill(state: dict[str, int]) -> None:
    """Test hook (KILL_AFTER_FILES = N): die like `kill -9` after N files."""
    state["written"] += 1
    if state["kill_after"] and state["written"] >= state["kill_after"]:
        os.kill(os.getpid(), signal.SIGKILL)


class TensorSource:
    """Where one output folder's tensors come from: `meta(name)` gives (shape, dtype) without reading,
    `fetch(name)` produces the tensor. Files are written header first, then one tensor at a time."""

    def __init__(self, meta: Callable[[str], tuple[tuple[int, ...], torch.dtype]],
                 fetch: Callable[[str], torch.Tensor]) -> None:
        self.meta, self.fetch = meta, fetch


def tensor_source(plan: ShardPlan, rank: RankPlan | None, index: CheckpointIndex,
                  on_layer: Callable[[str], None] | None = None) -> TensorSource:
    """Raw common reads, checkpoint-layout slices, or fused layers (one layer in memory at a time; `on_layer(prefix)`
    called before each is loaded)."""
    if rank is None:
        return TensorSource(lambda n: (index.refs[n].shape, index.refs[n].dtype),
                            lambda n: index.view(index.refs[n]))  # written straight from the mapping
    if rank.sliced:
        return TensorSource(lambda n: (rank.sliced[n].shape, rank.sliced[n].dtype),
                            lambda n: materialize(index, rank.sliced[n]))
    layers = FusedLayers(plan, rank, index, on_layer)
    return TensorSource(layers.meta, layers.fetch)


class FusedLayers:
    """Fused tensors of one rank, loaded one layer at a time (the last layer is kept for the next file).

    Files are written one tensor at a time in sorted order, which keeps each layer's tensors together,
    so peak memory is about one fused layer, whatever the number of layers or the file size.
    """

    def __init__(self, plan: ShardPlan, rank: RankPlan, index: CheckpointIndex,
                 on_layer: Callable[[str], None] | None = None) -> None:
        self.index, self.moe, self.plans, self.on_layer = index, plan.moe, rank.plans, on_layer
        self.cached: tuple[str, FusedExperts] | None = None

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of fused tensor `name`, from the plan (nothing is read)."""
        prefix, _, field_name = name.rpartition(".")
        return self.plans[prefix].fused.shapes()[field_name]

    def fetch(self, name: str) -> torch.Tensor:
        """Fused tensor `name` (loads its layer unless it is the cached one)."""
        prefix, _, field_name = name.rpartition(".")
        return self.layer(prefix).tensors[field_name]

    def layer(self, prefix: str) -> FusedExperts:
        """The fused layer `prefix` (loading it drops the previous one first)."""
        if self.cached is None or self.cached[0] != prefix:
            self.cached = None
            if self.on_layer is not None:
                self.on_layer(prefix)
            # (written out, then dropped: memory the C heap reuses, `DevicePolicy`)
            layer, _, _ = load_layer(self.index, self.moe, self.plans[prefix], "cpu", False, huge_results=False)
            self.cached = (prefix, layer)
        return self.cached[1]


def file_metadata(plan: ShardPlan, rank: str) -> dict[str, str]:
    """The fixed safetensors metadata of every output file."""
    return {"format": "pt", "layout": plan.params["layout"], "tp": str(plan.params["tp"]), "ep": str(plan.params["ep"]),
            "rank": rank, "wna16_manifest_schema": str(SCHEMA_VERSION)}


def write_temporary(out: Path, fp: FilePlan, source: TensorSource, metadata: dict[str, str],
                    advance: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """Write one file under its temporary name (`.NAME.tmp`, next to it), streaming its tensors; its
    record for the manifest. `_commit_file` then makes it durable under its name. `advance(bytes, path)` is
    called as the tensor bytes are written (progress within the file)."""
    final, tmp = _paths(out, fp)
    metas = {name: source.meta(name) for name in sorted(fp.tensors)}
    written = None if advance is None else (lambda nbytes: advance(nbytes, fp.path))
    with writing(final, tmp):
        with open(tmp, "wb") as handle:
            records, digest = _serialize(handle, metas, source.fetch, metadata, written)
    return {"path": fp.path, "sha256": digest, "tensors": records}


def _serialize(handle: Any, metas: dict[str, tuple[tuple[int, ...], torch.dtype]],
               fetch: Callable[[str], torch.Tensor], metadata: dict[str, str],
               written: Callable[[int], None] | None = None) -> tuple[dict[str, dict[str, Any]], str]:
    """Write the safetensors format: a sorted, byte-stable header computed from `metas` (safetensors' own
    writer orders metadata keys differently from process to process), then each tensor as it is fetched.
    Returns each tensor's manifest record and the sha256 of the bytes written (taken as they are written)."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, (shape, dtype) in metas.items():
        nbytes = nbytes_of(tuple(shape), dtype)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    for chunk in (len(text).to_bytes(8, "little"), text):
        handle.write(chunk)
        digest.update(chunk)
    with _Pipeline(handle, digest, written) as pipeline:
        for name, (shape, dtype) in metas.items():
            tensor = fetch(name).detach().cpu().contiguous()  # a whole source tensor stays a view of its mapping
            assert (tuple(tensor.shape), tensor.dtype) == (tuple(shape), dtype), f"{name}: planned {shape} {dtype}"
            pipeline.submit(tensor)
        pipeline.drain()
    return {name: tensor_record(shape, dtype) for name, (shape, dtype) in metas.items()}, digest.hexdigest()


IN_FLIGHT_BYTES = 96 << 20  # tensors fetched but not yet written and hashed: bounds the writer's extra memory


class _Pipeline:
    """The two consumers of each fetched tensor, one thread each and both in order, so that the caller
    produces the next tensors (the next fused layer) meanwhile: the file write and the file's running
    sha256, the one digest of every byte the manifest records. File writes and sha256 release the GIL.
    At most IN_FLIGHT_BYTES (or one tensor) are held; errors surface in order."""

    def __init__(self, handle: Any, digest: Any, written: Callable[[int], None] | None = None) -> None:
        self.handle, self.digest, self.written = handle, digest, written
        self.pools = [ThreadPoolExecutor(1, f"wna16-{job}") for job in ("write", "digest")]
        self.pending: deque[tuple[int, tuple[Future[Any], ...]]] = deque()
        self.held = 0

    def submit(self, tensor: torch.Tensor) -> None:
        """Hand one tensor to both threads (after waiting for older ones while too much is held)."""
        nbytes = tensor.numel() * tensor.element_size()
        while self.pending and self.held + nbytes > IN_FLIGHT_BYTES:
            self._retire()
        data = memoryview(byte_view(tensor).numpy())
        writer, digester = self.pools
        jobs = (writer.submit(_emit, self.handle, data, self.written), digester.submit(self.digest.update, data))
        self.pending.append((nbytes, jobs))
        self.held += nbytes

    def _retire(self) -> None:
        nbytes, jobs = self.pending.popleft()
        for job in jobs:
            job.result()
        self.held -= nbytes

    def drain(self) -> None:
        """Wait until every tensor handed over is written and hashed."""
        while self.pending:
            self._retire()

    def __enter__(self) -> _Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)


WRITEBACK_BYTES = 16 << 20  # after a tensor at least this large, the kernel is asked to start writing back


def start_writeback(handle: Any) -> None:
    """Ask the kernel to start writing the file's dirty pages to disk now, without waiting (POSIX_FADV_DONTNEED
    starts writeback of dirty pages on Linux), so the disk works while the next tensors are produced and
    the fsync at commit finds little left to do. Durability still comes from that fsync alone."""
    if hasattr(os, "posix_fadvise"):
        handle.flush()
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


PROGRESS_BYTES = 16 << 20  # a tensor is written (and its progress counted) this many bytes at a time


def _emit(handle: Any, data: memoryview, written: Callable[[int], None] | None = None) -> None:
    """Write one tensor's bytes, on the writer thread (its hint to start writeback included); `written(bytes)`
    after every PROGRESS_BYTES of them, so that progress moves within a large tensor too."""
    for begin in range(0, len(data), PROGRESS_BYTES):
        chunk = data[begin:begin + PROGRESS_BYTES]
        handle.write(chunk)
        if written is not None:
            written(len(chunk))
    if len(data) >= WRITEBACK_BYTES:
        start_writeback(handle)
