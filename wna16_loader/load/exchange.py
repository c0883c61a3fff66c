"""The node's exchange: the ranks of a node that read together also convert together. Rank j of S converts
one block of slots of every rank's layer, for that rank, into a shared mailbox; each rank then takes its
own layer out whole.

A TP rank alone converts a column cut of every expert, and each 4 KiB page of a w13 row holds every rank's
columns: eight TP ranks each walk ~70 % of the checkpoint's pages. Through the mailbox, rank j converts
slots [j*E_l/S, (j+1)*E_l/S) of each rank's layer: whole rows of a few experts, read once (what an EP rank
reads), and every rank copies its finished layer out in one contiguous pass per tensor.

| mailbox slot (layer % 2) | each rank's tensors of the layer, in local rank order, in `FusedSpec.shapes()` |
|                          | order, MAIL_ALIGN-aligned: [E_l, ...] as the fused layout (see `fused.py`)       |

Per layer: every rank waits until all have taken layer - 2 out (TAKEN: its slot is free), converts its
blocks (CONVERTED), waits until every rank has converted the layer, and takes its own tensors (TAKEN).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from ..storage.index import CheckpointIndex
from ..storage.node import NodeRead, Word
from .fused import FusedExperts, FusedWriter
from .layer import LayerLoad, plan_runs
from .plan import LayerPlan

MAIL_ALIGN = 64  # bytes: every tensor of a slot starts on a cache line


class Placement(NamedTuple):
    """Where one tensor of one rank's layer lies in a mailbox slot."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def mail_layout(plans: Sequence[LayerPlan]) -> tuple[list[dict[str, Placement]], int]:
    """Each rank's tensors of one layer (`plans`: that layer's plan of every rank of the node, in local
    order) laid back to back in a mailbox slot: their placements per rank, and the bytes they take."""
    placements, at = [], 0
    for plan in plans:
        placed = {}
        for name, (shape, dtype) in plan.fused.shapes().items():
            placed[name] = Placement(at, tuple(shape), dtype)
            at += -(-math.prod(shape) * dtype.itemsize // MAIL_ALIGN) * MAIL_ALIGN
        placements.append(placed)
    return placements, at


def mail_bytes(members: Sequence[Sequence[LayerPlan]]) -> int:
    """The bytes of one mailbox slot: the largest layer of the node (`members`: every rank's plans)."""
    return max((mail_layout(layer)[1] for layer in zip(*members)), default=0)


def block(count: int, rank: int, ranks: int) -> slice:
    """Rank `rank`'s share of `count` slots: the `rank`-th of `ranks` near-equal consecutive blocks."""
    return slice(rank * count // ranks, (rank + 1) * count // ranks)


class Exchange:
    """Converts this rank's blocks of every rank's layer into the mailbox of `read` (a `NodeRead`), and takes
    this rank's own layer out. `members`: every rank's plans, in local rank order (the same on every rank)."""

    def __init__(self, read: NodeRead, members: Sequence[Sequence[LayerPlan]]) -> None:
        prefixes = {tuple(plan.prefix for plan in plans) for plans in members}
        assert len(prefixes) == 1, f"the node's ranks planned different layers: {sorted(prefixes)}"
        self.read, self.members = read, members
        self.local_rank, self.ranks = read.node.local_rank, read.node.size

    def convert(self, index: CheckpointIndex, number: int, *, allow_nonfinite: bool) -> None:
        """This rank's block of every rank's layer `number`, converted into its mailbox slot (once every rank
        has taken layer `number - 2` out of that slot)."""
        self.read.wait_all(Word.TAKEN, number - 1, f"taking layer {number - 2} out of the mailbox")
        plans = [plans[number] for plans in self.members]
        placements, _ = mail_layout(plans)
        for plan, placed in zip(plans, placements):
            staging = self._tensors(number, placed)
            writer = FusedWriter(plan.prefix, plan.fused, "cpu", staging=staging)
            layer = LayerLoad(plan.prefix, plan.moe, plan.geometry, allow_nonfinite=allow_nonfinite)
            mine = block(len(plan.fused.experts), self.local_rank, self.ranks)
            for proj in plan.fused.projections:
                first = 0
                for experts, sources in plan_runs(plan, proj):
                    low, high = max(mine.start - first, 0), min(mine.stop - first, len(experts))
                    if low < high:
                        layer.write(index, writer, experts[low:high], proj, sources[low:high])
                    first += len(experts)
        self.read.set(Word.CONVERTED, number + 1)

    def take(self, number: int, writer: FusedWriter) -> FusedExperts:
        """This rank's layer `number` out of the mailbox into `writer` (once every rank has converted it),
        finished (device copies queued, as `FusedWriter.finish`)."""
        self.read.wait_all(Word.CONVERTED, number + 1, f"converting layer {number}")
        placed = mail_layout([plans[number] for plans in self.members])[0][self.local_rank]
        for name, value in self._tensors(number, placed).items():
            writer.put_whole(name, value)
        layer = writer.finish(mtp=self.members[self.local_rank][number].mtp)
        self.read.set(Word.TAKEN, number + 1)
        return layer

    def _tensors(self, number: int, placed: dict[str, Placement]) -> dict[str, torch.Tensor]:
        """One rank's tensors of layer `number` in the mailbox (views of the shared memory)."""
        slot = self.read.mail(number)
        return {name: slot[p.offset:p.offset + math.prod(p.shape) * p.dtype.itemsize].view(p.dtype).view(p.shape)
                for name, p in placed.items()}
