"""The byte ranges a plan reads (load/reads.py), and loads that read them ahead.

- `planned_ranges`: an EP rank's ranges are its experts' whole tensors (its own bytes), a TP rank's column
  cuts of w13 are shared and its row cuts of w2 its own; every range lies inside its tensor.
- A load that reads ahead (any request size, gap, thread count, direct or not) is byte-identical to one
  through the file mappings alone.
- `load_groups`: a lone rank reads all its ranges as its own (or, `cached`, through the page cache); with a
  node, each layer's group holds every rank's ranges (the node's read of several processes is tested in
  tests/storage/test_node.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.errors import ShardingError
from wna16_loader.load.experts import planned
from wna16_loader.load.ledger import Ledger
from wna16_loader.load.plan import plan_layers
from wna16_loader.storage.readahead import coalesced
from wna16_loader.load.reads import Together, load_groups, node_members, planned_ranges, shares_pages
from wna16_loader.parallel.config import Node
from wna16_loader.storage.readahead import PlannedRange, ReadOptions
from wna16_loader.storage.windows import WindowPlan, windows_of
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



def cold(seen: list[list[list[PlannedRange]] | None] | None = None) -> Together:
    """`node_windows` where the node's rank 0 found nothing cached (no other process here: it plans), each plan
    kept in `seen`."""
    def together(node: Node, files: list[Path], plan: Callable[[], list | None], gap: int) -> WindowPlan | None:
        groups = plan()
        (seen if seen is not None else []).append(groups)
        return None if groups is None else windows_of(groups, node.window_bytes, gap)
    return together


def WARM(node: Node, files: list[Path], plan: Callable[[], list | None], gap: int) -> None:
    """`node_windows` where it found every file cached (nothing planned)."""


def test_load_groups_of_a_lone_rank_and_of_a_node(tmp_path) -> None:
    folder = write_checkpoint(tmp_path, quant_config("gptq"), num_experts=4, hidden=128, intermediate=256,
                              num_layers=2, references=False).folder
    parallel = ParallelConfig(2, 1, 2, 0)
    node = Node((0, 1, 2, 3), 1, "k")
    with planned(folder, parallel) as (moe, index, scan, plans):
        own, none = load_groups(index, moe, parallel, scan, plans, EVERY_READ_AHEAD)
        assert none is None and not any(r.shared for group in own for r in group)
        assert [len(g) for g in own] == [len(planned_ranges(index, plan)) for plan in plans]
        cached, _ = load_groups(index, moe, parallel, scan, plans, EVERY_READ_AHEAD, cached=True)
        assert [[r._replace(shared=False) for r in g] for g in cached] == own
        assert all(r.shared for g in cached for r in g)
        seen: list = []
        again, together = load_groups(index, moe, parallel, scan, plans, replace(EVERY_READ_AHEAD, node=node),
                                      together=cold(seen))
        assert again == [] and together == windows_of(seen[0], node.window_bytes, EVERY_READ_AHEAD.gap_bytes)
        for number, group in enumerate(seen[0]):
            every = [r for rank in node.ranks for r in planned_ranges(
                index, plan_layers(index, moe, ParallelConfig.from_rank(rank, tp_size=2, ep_size=2), Ledger(),
                                   scan)[number])]
            covered = lambda ranges: {path: coalesced([r[1:3] for r in ranges if r.file == path], 1)  # noqa: E731
                                      for path in {r.file for r in ranges}}
            assert covered(group) == covered(every)  # the bytes of every rank, each tensor once (2 TP ranks cut each)
            assert len(group) == len(every) // 2 and len({r[:2] for r in group}) == len(group)


def test_load_groups_only_of_the_layers_asked_for(tmp_path) -> None:
    """`only` (an in-place fill's targets): the other layers' groups are empty, this rank's and the node's alike."""
    folder = write_checkpoint(tmp_path, quant_config("gptq"), num_experts=4, hidden=128, intermediate=256,
                              num_layers=2, references=False).folder
    parallel, node = ParallelConfig(2, 1), Node((0, 1), 1, "k")
    with planned(folder, parallel) as (moe, index, scan, plans):
        seen: list = []
        own, together = load_groups(index, moe, parallel, scan, plans, replace(EVERY_READ_AHEAD, node=node),
                                    together=cold(seen), only={plans[1].prefix})
    assert own == [] and seen[0][0] == [] and seen[0][1]  # (reading together: no own groups planned)
    assert [(w.first, w.stop) for w in together.windows] == [(0, 2)]


def test_a_node_that_does_not_hold_the_rank_is_refused() -> None:
    with pytest.raises(ShardingError, match=r"Node: ranks \[0, 1\] with this process at local rank 1 \(global rank "
                                            r"1\) do not fit ParallelConfig rank 2 of 4 \(tp 2 x ep 2\); build both "
                                            r"from the same process group"):
        node_members(Node((0, 1), 1, "k"), ParallelConfig(2, 0, 2, 1))


def test_ranks_of_disjoint_bytes_read_alone_and_tp_ranks_together(tmp_path) -> None:
    folder = write_checkpoint(tmp_path, quant_config("gptq"), num_experts=4, hidden=512, intermediate=1024,
                              references=False).folder
    reads = replace(EVERY_READ_AHEAD, gap_bytes=0)
    for parallel, shared in ((ParallelConfig(1, 0, 4, 2), False), (ParallelConfig(4, 2), True)):
        with planned(folder, parallel) as (moe, index, scan, plans):
            node = Node((0, 1, 2, 3), 2, "k")
            _, together = load_groups(index, moe, parallel, scan, plans, replace(reads, node=node), together=cold())
            _, warm = load_groups(index, moe, parallel, scan, plans, replace(reads, node=node), together=WARM)
        assert (together is not None) == shared and warm is None, parallel  # warm: each reads its mappings


def test_shares_pages_counts_the_bytes_two_ranks_read() -> None:
    file = Path("/f/model.safetensors")
    a = [[PlannedRange(file, 0, 40960, False)]]
    b = [[PlannedRange(file, 40960, 81920, False)]]
    c = [[PlannedRange(file, 4096, 45056, False)]]
    assert not shares_pages([a[0], b[0]], a[0] + b[0], gap=0)  # disjoint: each reads its own
    assert shares_pages([a[0], c[0]], a[0] + c[0], gap=0)  # 36 of 44 KiB read twice
