"""Pure integer sharding math: expert placement, effective group size, column ranges.

Sharding is declared as a small table: gate/up are column-parallel (TP rank r
keeps output rows n in [r*I_p, (r+1)*I_p)), down is row-parallel (input rows k in
the same range). Groups are mapped to ranks through those column ranges, never
by dividing a group count.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .errors import ShardingError
from .names import Proj
from .parallel import ExpertPlacement, ParallelConfig

MIN_GROUP = 16


@dataclass(frozen=True)
class Span:
    """Half-open integer range [start, stop)."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for positive integers."""
    return -(-a // b)


def local_experts(num_experts: int, parallel: ParallelConfig) -> tuple[int, ...]:
    """Global ids of the experts owned by `parallel.ep_rank`, ascending."""
    ep, rank = parallel.ep_size, parallel.ep_rank
    if ep > num_experts:
        raise ShardingError(f"ep_size={ep} is larger than the expert count {num_experts}; every EP rank needs "
                            f"at least one expert. Use ep_size <= {num_experts}.")
    if parallel.expert_placement is ExpertPlacement.ROUND_ROBIN:
        return tuple(range(rank, num_experts, ep))
    base, extra = divmod(num_experts, ep)
    start = rank * base + min(rank, extra)
    return tuple(range(start, start + base + (1 if rank < extra else 0)))


def effective_group_size(group_size: int, part: int, *, tp_size: int, act_order: bool) -> int:
    """G_eff: G when tp = 1, act-order or part % G = 0, else the largest divisor of G dividing `part`.

    Returns -1 for channelwise, and 0 when no divisor >= 16 exists.
    """
    if group_size == -1 or tp_size == 1 or act_order or part % group_size == 0:
        return group_size
    g = group_size
    while g >= MIN_GROUP and part % g:
        g //= 2
    return g if g >= MIN_GROUP else 0


@dataclass(frozen=True)
class ProjectionSlice:
    """What one TP rank keeps of one projection W[N, K], in unpacked units.

    `groups[j]` is the checkpoint group (size G) whose scale/zero fills fused group
    j; `g_idx` is True when the rank's g_idx rows are kept (act-order).
    """

    proj: Proj
    n: Span
    k: Span
    groups: tuple[int, ...]
    g_idx: bool


@dataclass(frozen=True)
class LayerGeometry:
    """Sizes of one MoE layer on one rank, validated.

    | H      | hidden size          | I   | expert intermediate size |
    | I_p    | I / tp               | G   | checkpoint group size    |
    | G_eff  | fused group size     | P8  | values per byte (8 / b)  |
    """

    hidden: int
    intermediate: int
    num_experts: int
    bits: int
    group_size: int
    act_order: bool
    parallel: ParallelConfig

    def __post_init__(self) -> None:
        problem = layout_problem(self.hidden, self.intermediate, self.bits, self.group_size, self.act_order,
                                 self.parallel.tp_size)
        if problem:
            raise ShardingError(problem + " " + self.suggestion())

    def suggestion(self) -> str:
        """The TP sizes that would work for this layer."""
        valid = valid_tp_sizes(self.hidden, self.intermediate, self.bits, self.group_size, self.act_order)
        return f"TP sizes that work for this layer: {valid}."

    @property
    def part(self) -> int:
        """I_p: this rank's share of the intermediate dimension."""
        return self.intermediate // self.parallel.tp_size

    @cached_property
    def group_eff(self) -> int:
        """G_eff for the whole layer (-1 for channelwise)."""
        return effective_group_size(self.group_size, self.part, tp_size=self.parallel.tp_size,
                                    act_order=self.act_order)

    @cached_property
    def experts(self) -> tuple[int, ...]:
        """Global ids of this rank's experts."""
        return local_experts(self.num_experts, self.parallel)

    def fused_groups(self, k_len: int) -> int:
        """Number of fused groups along an input dim of `k_len` columns."""
        return 1 if self.group_eff == -1 else ceil_div(k_len, self.group_eff)

    @property
    def w2_groups(self) -> int:
        """Group count of w2 scales: all of I's groups with act-order, else the rank's."""
        if self.act_order:
            return ceil_div(self.intermediate, self.group_size)
        return self.fused_groups(self.part)

    def slice(self, proj: Proj) -> ProjectionSlice:
        """The rank's slice of `proj` (gate/up column-parallel, down row-parallel)."""
        return self._slices[proj]

    @cached_property
    def _slices(self) -> dict[Proj, ProjectionSlice]:
        return {proj: self._slice(proj) for proj in Proj}

    def _slice(self, proj: Proj) -> ProjectionSlice:
        own = Span(self.parallel.tp_rank * self.part, (self.parallel.tp_rank + 1) * self.part)
        if proj is Proj.DOWN:
            if self.act_order:
                return ProjectionSlice(proj, Span(0, self.hidden), own, tuple(range(self.w2_groups)), True)
            return ProjectionSlice(proj, Span(0, self.hidden), own, self._groups(own), False)
        full = Span(0, self.hidden)
        if self.act_order:
            return ProjectionSlice(proj, own, full, tuple(range(ceil_div(self.hidden, self.group_size))), True)
        return ProjectionSlice(proj, own, full, self._groups(full), False)

    def _groups(self, k: Span) -> tuple[int, ...]:
        """Checkpoint group of each fused group over columns `k`."""
        if self.group_eff == -1:
            return (0,)
        return tuple((k.start + j * self.group_eff) // self.group_size for j in range(self.fused_groups(len(k))))


def layout_problem(hidden: int, intermediate: int, bits: int, group_size: int, act_order: bool, tp: int) -> str:
    """Why `tp` cannot shard this layer, or '' when it can."""
    per_byte = 8 // bits
    if intermediate % tp:
        return f"tp_size={tp} does not divide the expert intermediate size I={intermediate}."
    part = intermediate // tp
    if part % per_byte or hidden % per_byte:
        return (f"{bits}-bit bytes hold {per_byte} values, but I/tp = {intermediate}/{tp} = {part} and "
                f"H = {hidden} must both be multiples of {per_byte}.")
    g_eff = effective_group_size(group_size, part, tp_size=tp, act_order=act_order)
    if g_eff == 0:
        return (f"tp_size={tp} leaves I/tp = {intermediate}/{tp} = {part} columns per rank, and no divisor of "
                f"group size {group_size} that is >= {MIN_GROUP} divides {part} (the effective group size "
                f"would fall below {MIN_GROUP}).")
    return ""


def valid_tp_sizes(hidden: int, intermediate: int, bits: int, group_size: int, act_order: bool,
                   *, limit: int = 64) -> list[int]:
    """Every tp <= `limit` that can shard the layer."""
    return [tp for tp in range(1, limit + 1)
            if not layout_problem(hidden, intermediate, bits, group_size, act_order, tp)]
