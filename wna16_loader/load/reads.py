"""The byte ranges a layer plan reads, for `storage.readahead`: every local source's role tensors, cut as
`LayerLoad` cuts them (`rank_spans`, `storage_index`), each as the span of file bytes it touches.

| planned_ranges(index, plan) | [PlannedRange]: one per tensor slice the plan reads; `shared` when the span |
|                             | holds more bytes than the slice (a column cut: other ranks' columns share  |
|                             | its pages), else the rank's own bytes                                      |
| load_groups(...)            | what a load from a checkpoint folder reads ahead: its own groups, and with |
|                             | a node of several ranks the windows of the node's (each tensor any rank    |
|                             | cuts, once: the hull of the ranks' cuts, layer by layer), planned by local |
|                             | rank 0 and handed to the others                                            |
| node_groups(...)            | the node's groups from every rank's plans (a pre-shard run's too)          |
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Collection, NamedTuple

from ..errors import ShardingError
from ..formats import Role
from ..models.config import MoEConfig
from ..models.names import Proj
from ..parallel.config import Node, ParallelConfig
from ..storage.index import CheckpointIndex, TensorRef
from ..storage.node_plan import node_windows
from ..storage.windows import WindowPlan, placed
from ..storage.readahead import PlannedRange, ReadOptions, span_of
from .ledger import Ledger
from .params import SourceTensors, rank_spans, storage_index
from .plan import LayerPlan, for_rank, plan_layers
from .scan import CheckpointScan
from .tables import LayerTables

Groups = list[list[PlannedRange]]
SHARED_AT = 0.05  # ranks whose ranges overlap by less than this fraction of their bytes read alone


def planned_ranges(index: CheckpointIndex, plan: LayerPlan, *, min_tensor_bytes: int = 0,
                   paths: dict[str, Path] | None = None, shared: bool | None = None) -> list[PlannedRange]:
    """The file byte ranges `plan`'s load reads (see the module table), in plan order; none when the layer's
    first source holds no tensor of `min_tensor_bytes` (tiny experts: working out a range per tensor would
    cost more than the mapping's reads of them). `paths`: file name -> path, shared by the plans of one load
    (one `Path` per file: a dict finds it by identity); `shared`: every range's mark, where the load decides it
    (None: as the module table says)."""
    return _hull_ranges(index, [plan], min_tensor_bytes, {} if paths is None else paths, shared)


def node_ranges(index: CheckpointIndex, plans: list[LayerPlan], *, min_tensor_bytes: int = 0,
                paths: dict[str, Path] | None = None) -> list[PlannedRange]:
    """What the ranks of a node read of one layer (`plans`: its plan of each rank): one range per tensor, the
    hull of the cuts of the ranks that hold its expert (each tensor once, however many ranks cut it)."""
    same: dict[tuple[int, ...], list[LayerPlan]] = {}  # ranks of one EP rank hold the same experts
    for plan in plans:
        same.setdefault(tuple(plan.fused.experts), []).append(plan)
    paths = {} if paths is None else paths
    return [r for group in same.values() for r in _hull_ranges(index, group, min_tensor_bytes, paths, None)]


def _hull_ranges(index: CheckpointIndex, plans: list[LayerPlan], min_tensor_bytes: int,
                 paths: dict[str, Path], shared: bool | None) -> list[PlannedRange]:
    """`planned_ranges` of plans of one layer whose ranks hold the same experts: per tensor, the hull of their
    cuts (`shared` where it holds more bytes than the cut, or where several ranks cut it; or as given). Runs once
    per tensor of the layer (hundreds of thousands at DeepSeek scale): the hull is worked out once per kind of
    tensor (`_hull`), found by a key of the members' ids (an enum's own hash is Python code), and each range is
    made by the C-level tuple constructor."""
    first = next(iter(plans[0].sources.values()), None)
    if first is None or max(ref.nbytes for ref in first.tensors.values()) < min_tensor_bytes:
        return []
    hulls: dict[tuple, tuple[int, int, bool]] = {}  # one per (projection, source, row, role, shape, dtype)
    out: list[PlannedRange] = []
    for (_, proj), src in plans[0].sources.items():
        for role, ref in src.tensors.items():
            key = (id(proj), id(src.source), src.expert_row, id(role), ref.shape, ref.dtype)
            hull = hulls.get(key)
            if hull is None:
                hull = hulls[key] = _hull(plans, proj, src, role, ref, shared)
            low, high, mark = hull
            if high > low:
                begin = index.first_byte(ref)
                path = paths.get(ref.file) or paths.setdefault(ref.file, index.folder / ref.file)
                out.append(_range((path, begin + low, begin + high, mark)))
    return out


def _hull(plans: list[LayerPlan], proj: Proj, src: SourceTensors, role: Role, ref: TensorRef,
          shared: bool | None) -> tuple[int, int, bool]:
    """(low, high, shared) of tensor `ref` (`role` of `src`, for projection `proj`): the bytes of it the ranks of
    `plans` cut, from the first to the last, relative to its first byte; (0, 0, False) where none cuts any."""
    quant = plans[0].moe.quant
    cuts = [span_of(0, ref.shape, ref.dtype.itemsize,
                    storage_index(quant.layout(role), rank_spans(src, plan.geometry.slice(proj))[0],
                                  quant.pack_factor, src.expert_row)) for plan in plans]
    cuts = [cut for cut in cuts if cut[2]]
    if not cuts:
        return 0, 0, False
    mark = shared if shared is not None else len(cuts) > 1 or cuts[0][1] - cuts[0][0] > cuts[0][2]
    return min(c[0] for c in cuts), max(c[1] for c in cuts), mark


# A range from a tuple of its fields: the C-level tuple constructor (the named tuple's own __new__ is Python).
_range = partial(tuple.__new__, PlannedRange)


class LoadGroups(NamedTuple):
    """What a load reads: `own`, this rank's groups; `together`, the windows of the node's (None: each rank reads
    alone), planned by local rank 0 only once it found the page cache cold (`node_windows`; so
    `reading_ahead(node_cold=True)`: not looked at again)."""

    own: Groups
    together: WindowPlan | None = None


Together = Callable[[Node, list[Path], Callable[[], Groups | None], int], WindowPlan | None]


def load_groups(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, scan: CheckpointScan,
                plans: list[LayerPlan], reads: ReadOptions, *, cached: bool = False,
                together: Together = node_windows, only: Collection[str] | None = None) -> LoadGroups:
    """This rank's groups, and the node's windows (see `LoadGroups`): a layer each. A rank reads its groups
    itself, every byte as its own (direct: no other rank shares its pages; `cached`: every byte marked shared
    instead, read into the page cache for the mapping's views); with `reads.node` of several ranks, each group
    of the node's is that layer's `node_ranges`, planned on local rank 0 only (`together(node, files, plan,
    gap)`: `node_windows` hands its windows to every rank; planning every rank's layers on every rank cost
    O(ranks²)). None where the node's ranks share no pages: ranks of different EP ranks each (disjoint experts:
    known from the configs, nothing planned), a warm page cache (local rank 0 finds this rank's files cached),
    or ranges that overlap too little (`node_groups`); where the node reads together, this rank's own groups are
    not planned (empty). `only`: the experts prefixes whose layers are read (the others' groups empty, on every
    rank alike; None: all)."""
    paths: dict[str, Path] = {}

    def own() -> Groups:
        return _kept(plans, only, [planned_ranges(index, plan, min_tensor_bytes=reads.min_tensor_bytes, paths=paths,
                                                  shared=cached) for plan in plans])
    node = reads.node
    if node is None or node.size == 1:
        return LoadGroups(own())
    members = node_members(node, parallel)
    if disjoint_experts(members):
        return LoadGroups(own())

    def plan() -> Groups | None:
        tables = LayerTables(index, moe)
        member_plans = [_member_plans(plans, parallel, member, lambda m: plan_layers(index, moe, m, Ledger(), scan,
                                                                                     tables)) for member in members]
        return _kept(plans, only, node_groups(index, member_plans, reads, paths))
    names = {ref.file for layer in plans for src in layer.sources.values() for ref in src.tensors.values()}
    windows = together(node, [index.folder / name for name in sorted(names)], plan, reads.gap_bytes)
    return LoadGroups(own() if windows is None else [], windows)


def _member_plans(plans: list[LayerPlan], mine: ParallelConfig, member: ParallelConfig,
                  planned: Callable[[ParallelConfig], list[LayerPlan]]) -> list[LayerPlan]:
    """The layer plans of the node's rank `member` (`plans`: this rank's, of `mine`): these, made for it where it
    holds the same experts (`for_rank`: a TP peer), else `planned(member)`."""
    if member == mine:
        return plans
    return [for_rank(plan, member) for plan in plans] if mine.same_experts(member) else planned(member)


def _kept(plans: list[LayerPlan], only: Collection[str] | None, groups: Groups | None) -> Groups | None:
    """`groups` (a layer each, or None) with the layers of prefixes not in `only` emptied (None: all kept)."""
    if groups is None or only is None:
        return groups
    return [group if plan.prefix in only else [] for plan, group in zip(plans, groups)]


def node_groups(index: CheckpointIndex, members: list[list[LayerPlan]], reads: ReadOptions,
                paths: dict[str, Path] | None = None) -> Groups | None:
    """The node's groups (`members`: every rank's plans, layer by layer in use order): each layer's
    `node_ranges`; None where the ranks share too few pages (`shares_pages`, judged on the first layer that
    reads anything: the layers of one checkpoint are cut alike, and a wrong guess costs time, never bytes)."""
    paths = {} if paths is None else paths
    together = [node_ranges(index, list(layer), min_tensor_bytes=reads.min_tensor_bytes, paths=paths)
                for layer in zip(*members)]
    number = next((i for i, group in enumerate(together) if group), None)
    if number is None or not shares_pages([planned_ranges(index, plans[number], paths=paths) for plans in members],
                                          together[number], reads.gap_bytes):
        return None
    return together


def disjoint_experts(members: list[ParallelConfig]) -> bool:
    """Whether every rank of the node holds other experts (an EP rank each): then no page is shared."""
    return len({parallel.ep_rank for parallel in members}) == len(members)


def shares_pages(ranks: list[list[PlannedRange]], together: list[PlannedRange], gap: int) -> bool:
    """Whether the ranks of a node (`ranks`: each rank's ranges of one layer; `together`: the node's) need more
    than `SHARED_AT` of their bytes twice, as they are read (coalesced, page-aligned): ranks of disjoint bytes
    (EP ranks, whole experts each) gain nothing from reading together, and each reads its own alone (no waits)."""
    return sum(placed(group, gap)[1] for group in ranks) > (1 + SHARED_AT) * placed(together, gap)[1]


def node_members(node: Node, parallel: ParallelConfig) -> list[ParallelConfig]:
    """The parallel config of every rank of `node`, in local order (checked against `parallel`)."""
    world = parallel.world_size
    if node.rank != parallel.rank or max(node.ranks) >= world:
        raise ShardingError(f"Node: ranks {list(node.ranks)} with this process at local rank {node.local_rank} "
                            f"(global rank {node.rank}) do not fit ParallelConfig rank {parallel.rank} of "
                            f"{world} (tp {parallel.tp_size} x ep {parallel.ep_size}); build both from the same "
                            f"process group (ParallelConfig.from_environment, Node.from_environment).")
    return [ParallelConfig.from_rank(rank, tp_size=parallel.tp_size, ep_size=parallel.ep_size,
                                     expert_placement=parallel.expert_placement) for rank in node.ranks]
