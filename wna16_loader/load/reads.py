"""The byte ranges a layer plan reads, for `storage.readahead`: every local source's role tensors, cut as
`LayerLoad` cuts them (`rank_spans`, `storage_index`), each as the span of file bytes it touches.

| planned_ranges(index, plan) | [PlannedRange]: one per tensor slice the plan reads; `shared` when the span |
|                             | holds more bytes than the slice (a column cut: other ranks' columns share  |
|                             | its pages), else the rank's own bytes                                      |
| load_groups(...)            | what a load from a checkpoint folder reads ahead: its own groups, and with |
|                             | a node of several ranks the node's (every rank's ranges, layer by layer)   |
|                             | and every rank's plans (for `load.exchange`)                               |
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from ..errors import ShardingError
from ..models.config import MoEConfig
from ..parallel.config import Node, ParallelConfig
from ..storage.index import CheckpointIndex
from ..storage.windows import placed
from ..storage.readahead import PlannedRange, ReadOptions, span_of
from .ledger import Ledger
from .params import rank_spans, storage_index
from .plan import LayerPlan, plan_layers
from .scan import CheckpointScan
from .tables import LayerTables

Groups = list[list[PlannedRange]]
SHARED_AT = 0.05  # ranks whose ranges overlap by less than this fraction of their bytes read alone


def planned_ranges(index: CheckpointIndex, plan: LayerPlan, *, min_tensor_bytes: int = 0) -> list[PlannedRange]:
    """The file byte ranges `plan`'s load reads (see the module table), in plan order; none when the layer's
    first source holds no tensor of `min_tensor_bytes` (tiny experts: working out a range per tensor would
    cost more than the mapping's reads of them)."""
    quant, out = plan.moe.quant, []
    first = next(iter(plan.sources.values()), None)
    if first is None or max(ref.nbytes for ref in first.tensors.values()) < min_tensor_bytes:
        return []
    spans: dict[tuple, tuple[int, int, int]] = {}  # one cut per (projection, source, role, header): experts share it
    paths: dict[str, Path] = {}
    for (_, proj), src in plan.sources.items():
        for role, ref in src.tensors.items():
            key = (proj, src.source, src.expert_row, role, ref.shape, ref.dtype)
            if key not in spans:
                cut = storage_index(quant.layout(role), rank_spans(src, plan.geometry.slice(proj))[0],
                                    quant.pack_factor, src.expert_row)
                spans[key] = span_of(0, ref.shape, ref.dtype.itemsize, cut)
            low, high, nbytes = spans[key]
            if nbytes:
                begin = index.first_byte(ref)
                path = paths.get(ref.file) or paths.setdefault(ref.file, index.folder / ref.file)
                out.append(PlannedRange(path, begin + low, begin + high, high - low > nbytes))
    return out


class LoadGroups(NamedTuple):
    """What a load reads: `own`, this rank's groups; `together`, the node's (None: each rank reads alone);
    `members`, with `together`, every rank's plans in local rank order."""

    own: Groups
    together: Groups | None = None
    members: list[list[LayerPlan]] | None = None


def load_groups(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, scan: CheckpointScan,
                plans: list[LayerPlan], reads: ReadOptions) -> LoadGroups:
    """This rank's groups, and the node's with every rank's plans (see `LoadGroups`): a layer each. A rank
    reads its groups itself, every byte as its own (direct: no other rank shares its pages); with `reads.node`
    of several ranks, each group of the node's is that layer's ranges of every rank of the node, the same on
    each of them. None where the node's ranks share no pages: ranks of different EP ranks each (disjoint
    experts: known from the configs, nothing planned), or ranges that overlap too little (`shares_pages`)."""
    own = [[r._replace(shared=False) for r in planned_ranges(index, plan, min_tensor_bytes=reads.min_tensor_bytes)]
           for plan in plans]
    node = reads.node
    if node is None or node.size == 1:
        return LoadGroups(own)
    members = node_members(node, parallel)
    if disjoint_experts(members):
        return LoadGroups(own)
    tables = LayerTables(index, moe)
    member_plans = [plans if member == parallel else plan_layers(index, moe, member, Ledger(), scan, tables)
                    for member in members]
    ranks = [own if member == parallel else [planned_ranges(index, plan, min_tensor_bytes=reads.min_tensor_bytes)
                                             for plan in member_plans[i]]
             for i, member in enumerate(members)]  # (this rank's own groups as they are: planned once)
    together = [[r for rank in ranks for r in rank[number]] for number in range(len(plans))]
    if not shares_pages(ranks, together, reads.gap_bytes):
        return LoadGroups(own)
    return LoadGroups(own, together, member_plans)


def disjoint_experts(members: list[ParallelConfig]) -> bool:
    """Whether every rank of the node holds other experts (an EP rank each): then no page is shared."""
    return len({parallel.ep_rank for parallel in members}) == len(members)


def shares_pages(ranks: list[Groups], together: Groups, gap: int) -> bool:
    """Whether the node's ranks (`ranks`: each rank's groups; `together`: their union per group) need more than
    `SHARED_AT` of their bytes twice, as they are read (coalesced, page-aligned): ranks of disjoint bytes (EP
    ranks, whole experts each) gain nothing from reading together, and each reads its own alone (no waits)."""
    each = sum(placed(group, gap)[1] for rank in ranks for group in rank)
    return each > (1 + SHARED_AT) * sum(placed(group, gap)[1] for group in together)


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
