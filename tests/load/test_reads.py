"""The byte ranges a plan reads (load/reads.py), and loads that read them ahead.

- `planned_ranges`: an EP rank's ranges are its experts' whole tensors (its own bytes), a TP rank's column
  cuts of w13 are shared and its row cuts of w2 its own; every range lies inside its tensor.
- A load that reads ahead (any request size, gap, thread count, direct or not) is byte-identical to one
  through the file mappings alone.
- A node reads each byte once: 4 TP ranks (gloo processes) loading one checkpoint cold together read its
  expert bytes from storage about once between them (`/proc/self/io` read_bytes), since the pages that
  TP ranks share go through the page cache. No rank waits on another: each reads its own planned
  ranges ahead itself (there is no coordination between ranks to wait on); where two ranks want one
  page, the second waits only for that page's read already in flight, which it would otherwise issue.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import start_ranks

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.load.experts import planned
from wna16_loader.load.reads import planned_ranges
from wna16_loader.storage.readahead import ReadOptions
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

EVERY_READ_AHEAD = ReadOptions(min_bytes=0, min_tensor_bytes=0)  # whatever the size (the default skips small loads)


@pytest.fixture(scope="module")
def gptq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("gptq"), quant_config("gptq"), num_experts=4, hidden=128,
                            intermediate=128, num_layers=2, files=2, references=False).folder


def ranges_of(folder: Path, parallel: ParallelConfig):
    with planned(folder, parallel) as (_, index, _, plans):
        spans = {name: (index.refs[name].begin, index.refs[name].begin + index.refs[name].nbytes, index.refs[name])
                 for name in index.refs}
        return [planned_ranges(index, plan) for plan in plans], spans, plans


def test_an_ep_rank_reads_its_experts_whole_tensors_as_its_own(gptq) -> None:
    groups, spans, plans = ranges_of(gptq, ParallelConfig(1, 0, 2, 1))
    local = {name for plan in plans for src in plan.sources.values() for name in
             (ref.name for ref in src.tensors.values())}
    assert local and all(".experts.2." in n or ".experts.3." in n for n in local)
    got = sorted((r.file.name, r.begin, r.end) for group in groups for r in group)
    want = sorted((spans[n][2].file, spans[n][0], spans[n][1]) for n in local)
    assert got == want
    assert not any(r.shared for group in groups for r in group)


def test_layers_of_tiny_tensors_plan_no_ranges(gptq) -> None:
    """Experts whose largest tensor (the 128 x 128 4-bit qweight: 8 KiB) is under `min_tensor_bytes`."""
    with planned(gptq, ParallelConfig(1, 0)) as (_, index, _, plans):
        assert all(planned_ranges(index, plan, min_tensor_bytes=8192) for plan in plans)
        assert not any(planned_ranges(index, plan, min_tensor_bytes=8193) for plan in plans)


def test_a_tp_rank_shares_w13_column_cuts_and_owns_w2_rows(gptq) -> None:
    groups, spans, _ = ranges_of(gptq, ParallelConfig(2, 1))
    shared: dict[tuple[str, str], set[bool]] = {}  # (projection, suffix) -> the `shared` flags of its ranges
    for name, (begin, end, ref) in spans.items():
        for r in (r for group in groups for r in group if r.file.name == ref.file and begin <= r.begin < end):
            assert r.end <= end, (name, r)
            shared.setdefault(tuple(name.split(".")[-2:]), set()).add(r.shared)
    assert shared[("gate_proj", "qweight")] == shared[("up_proj", "qweight")] == {True}  # N cut of [K/8, N] rows
    assert shared[("down_proj", "qweight")] == {False}  # K cut: whole rows of [K/8, N]


@settings(max_examples=6, deadline=None)
@given(parallel=st.sampled_from([ParallelConfig(1, 0), ParallelConfig(2, 1), ParallelConfig(1, 0, 2, 1),
                                 ParallelConfig(2, 0, 2, 1)]),
       request=st.integers(1, 8), gap=st.sampled_from([0, 1 << 20]), threads=st.integers(1, 3),
       direct=st.booleans())
def test_read_ahead_loads_are_byte_identical(gptq, parallel, request, gap, threads, direct) -> None:
    before = load_experts(gptq, parallel, reads=ReadOptions(enabled=False))
    options = ReadOptions(min_bytes=0, min_tensor_bytes=0, request_bytes=4096 * request, gap_bytes=gap,
                          threads=threads, direct=direct, ahead=1)
    after = load_experts(gptq, parallel, reads=options)
    assert before.keys() == after.keys()
    for prefix, layer in before.items():
        for name, tensor in layer.tensors.items():
            assert torch.equal(tensor, after[prefix].tensors[name]), (prefix, name)


@pytest.mark.parametrize("fmt", ["awq", "compressed-tensors"])
def test_other_formats_read_ahead_byte_identical(tmp_path, fmt) -> None:
    folder = write_checkpoint(tmp_path, quant_config(fmt), num_experts=4, hidden=128, intermediate=128,
                              references=False).folder
    for parallel in (ParallelConfig(2, 1), ParallelConfig(1, 0, 2, 0)):
        before = load_experts(folder, parallel, reads=ReadOptions(enabled=False))
        after = load_experts(folder, parallel, reads=EVERY_READ_AHEAD)
        for prefix, layer in before.items():
            for name, tensor in layer.tensors.items():
                assert torch.equal(tensor, after[prefix].tensors[name]), (fmt, parallel, name)


# ---------------------------------------------------------------- a node reads each byte once (gloo, cold)

def read_bytes() -> int | None:
    """This process's bytes fetched from storage so far (/proc/self/io read_bytes; None without it)."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in lines if line.startswith("read_bytes:")), None)


def evicted(files: list[Path]) -> int:
    """Write back, drop every file's pages from the page cache, and return the bytes still resident."""
    os.sync()
    libc, left = ctypes.CDLL(None, use_errno=True), 0
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        anchor = ctypes.c_char.from_buffer(mapped)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector)
        del anchor
        mapped.close()
        left += size if rc else sum(v & 1 for v in vector) * mmap.PAGESIZE
    return left


def node_rank(rank: int, world: int, folder: str, init_file: str, out: str) -> None:
    """One TP rank: wait for all, load cold, report the bytes it read from storage (a spawned process)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        dist.barrier()
        before = read_bytes()
        load_experts(folder, ParallelConfig.from_process_group(tp_size=world, process_group=dist.group.WORLD),
                     reads=EVERY_READ_AHEAD)
        counts = [None] * world
        dist.all_gather_object(counts, read_bytes() - before)
        if rank == 0:
            Path(out).write_text(json.dumps(counts))
    finally:
        dist.destroy_process_group()


def test_four_tp_ranks_read_the_expert_bytes_about_once(tmp_path) -> None:
    if read_bytes() is None:
        pytest.skip("no /proc/self/io on this system: read_bytes cannot be counted")
    folder = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", group_size=128), num_experts=8, hidden=1024,
                              intermediate=1024, references=False).folder
    files = sorted(folder.glob("*.safetensors"))
    with planned(folder, ParallelConfig(1, 0)) as (_, index, _, plans):
        names = {ref.name for plan in plans for src in plan.sources.values() for ref in src.tensors.values()}
        expert_bytes = sum(index.refs[name].nbytes for name in names)
    if evicted(files) > expert_bytes // 10:
        pytest.skip("this file system keeps the checkpoint's pages after POSIX_FADV_DONTNEED (tmpfs?): no cold read")
    start_ranks(node_rank, args=(4, str(folder), str(tmp_path / "init"), str(tmp_path / "counts.json")), nprocs=4)
    counts = json.loads((tmp_path / "counts.json").read_text())
    if not sum(counts):
        pytest.skip("the file system reports no read_bytes for these reads (no block-device accounting)")
    ratio = sum(counts) / expert_bytes
    assert 0.75 <= ratio <= 1.6, (f"4 TP ranks read {sum(counts)} bytes from storage for {expert_bytes} expert "
                                  f"bytes ({ratio:.2f}x; per rank {counts})")
