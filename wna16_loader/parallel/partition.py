"""Pure integer sharding math: expert placement, effective group size, column ranges, padding.

Sharding is declared as a small table: gate/up are column-parallel (TP rank r
keeps output rows n in [r*I_p, (r+1)*I_p)), down is row-parallel (input rows k in
the same range). Groups are mapped to ranks through those column ranges, never
by dividing a group count.

Padding: where that split would fail (tp does not divide I, I/tp is not byte
aligned, or no group size >= 16 fits I/tp), I is padded at its end to
I' = the smallest multiple of tp*16 >= I; every rank holds I_p' = I'/tp columns,
the checkpoint's [r*I_p', min((r+1)*I_p', I)) followed by zeros, and
G_eff = gcd(G, I_p') (the largest divisor of G dividing I_p'). Layouts the
unpadded rule accepts are never padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import gcd

from ..errors import ShardingError
from ..models.names import Proj
from .config import ExpertPlacement, ParallelConfig

MIN_GROUP = 16


@dataclass(frozen=True)
class Span:
    """Half-open integer range [start, stop)."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def values_per_byte(bits: int) -> int:
    """Values a byte holds (8 / bits; 1 for 8-bit and wider, e.g. the 16-bit float weights of unquantized
    experts, which any column count cuts)."""
    return max(1, 8 // bits)


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
class Partition:
    """How `tp_size` ranks split the expert intermediate dimension (integer math only).

    | I     | intermediate | the model's intermediate size               |
    | I'    | padded       | tp * I_p (== I when the layout is unpadded) |
    | I_p   | part         | columns per rank, padding included          |
    | G_eff | group_eff    | fused group size (-1 channelwise)           |

    Rank r holds checkpoint columns `real(r)` = [r*I_p, min((r+1)*I_p, I)), then
    `padding(r)` columns of zeros; every rank has the same I_p.
    """

    intermediate: int
    padded: int
    part: int
    group_eff: int
    tp_size: int

    @property
    def is_padded(self) -> bool:
        """Whether I' > I."""
        return self.padded != self.intermediate

    def real(self, tp_rank: int) -> Span:
        """The checkpoint columns of rank `tp_rank` (empty for a rank past I)."""
        return Span(min(tp_rank * self.part, self.intermediate), min((tp_rank + 1) * self.part, self.intermediate))

    def padding(self, tp_rank: int) -> int:
        """Columns of rank `tp_rank` that are padding (zeros at the end of its slice)."""
        return self.part - len(self.real(tp_rank))


def padded_partition(intermediate: int, group_size: int, act_order: bool, tp: int) -> Partition | str:
    """The padded split of I over `tp` ranks (see the module docstring), or why none exists."""
    unit = tp * MIN_GROUP
    padded = ceil_div(intermediate, unit) * unit
    part = padded // tp
    if group_size == -1 or act_order:
        return Partition(intermediate, padded, part, group_size, tp)
    g_eff = gcd(group_size, part)
    if g_eff < MIN_GROUP:
        return (f"tp_size={tp}: padding I={intermediate} to I'={padded} gives I'/tp = {padded}/{tp} = {part} "
                f"columns per rank, and the largest divisor of group size {group_size} dividing {part} is {g_eff} "
                f"< {MIN_GROUP} (G={group_size} is not a multiple of {MIN_GROUP} and cannot be re-expressed).")
    return Partition(intermediate, padded, part, g_eff, tp)


def plan_partition(hidden: int, intermediate: int, bits: int, group_size: int, act_order: bool,
                   tp: int) -> Partition | str:
    """The split of I over `tp` ranks: unpadded wherever `unpadded_problem` finds none, else padded;
    a str says why neither exists."""
    if not unpadded_problem(hidden, intermediate, bits, group_size, act_order, tp):
        part = intermediate // tp
        g_eff = effective_group_size(group_size, part, tp_size=tp, act_order=act_order)
        return Partition(intermediate, intermediate, part, g_eff, tp)
    per_byte = values_per_byte(bits)
    if hidden % per_byte or intermediate % per_byte:
        return (f"{bits}-bit bytes hold {per_byte} values, but H = {hidden} and I = {intermediate} must both be "
                f"multiples of {per_byte} at any TP size (a rank's columns must end on a byte).")
    return padded_partition(intermediate, group_size, act_order, tp)


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

    | H      | hidden size          | I   | expert intermediate size          |
    | I_p    | I / tp, or I'/tp     | G   | checkpoint group size             |
    | G_eff  | fused group size     | P8  | values per byte (8 / b)           |
    | I'     | padded I (see Partition; == I when unpadded)                     |
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

    @cached_property
    def partition(self) -> Partition:
        """The split of I over the TP ranks (padded where the unpadded rule fails)."""
        found = plan_partition(self.hidden, self.intermediate, self.bits, self.group_size, self.act_order,
                               self.parallel.tp_size)
        assert isinstance(found, Partition), "__post_init__ checks the layout"
        return found

    def suggestion(self) -> str:
        """The TP sizes that would work for this layer."""
        valid = valid_tp_sizes(self.hidden, self.intermediate, self.bits, self.group_size, self.act_order)
        return f"TP sizes that work for this layer: {valid}." if valid else "No TP size works for this layer."

    @property
    def part(self) -> int:
        """I_p: this rank's share of the intermediate dimension, padding included (I'/tp)."""
        return self.partition.part

    @property
    def padded_intermediate(self) -> int:
        """I': I plus the padding of every rank (== I when unpadded)."""
        return self.partition.padded

    @property
    def real(self) -> Span:
        """The checkpoint columns of I this rank holds (the first len(real) of its I_p)."""
        return self.partition.real(self.parallel.tp_rank)

    @property
    def padding(self) -> int:
        """Columns of this rank's I_p that are padding."""
        return self.partition.padding(self.parallel.tp_rank)

    @property
    def group_eff(self) -> int:
        """G_eff for the whole layer (-1 for channelwise)."""
        return self.partition.group_eff

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
        own = self.real  # checkpoint columns only: padding is written by the fused writer
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


def layout_problem(hidden: int, intermediate: int, bits: int, group_size: int, act_order: bool, tp: int, *,
                   allow_padding: bool = True) -> str:
    """Why `tp` cannot shard this layer, or '' when it can (`allow_padding=False`: without padding I)."""
    if not allow_padding:
        return unpadded_problem(hidden, intermediate, bits, group_size, act_order, tp)
    found = plan_partition(hidden, intermediate, bits, group_size, act_order, tp)
    return found if isinstance(found, str) else ""


def unpadded_problem(hidden: int, intermediate: int, bits: int, group_size: int, act_order: bool, tp: int) -> str:
    """Why `tp` cannot shard this layer with I/tp columns per rank and no padding, or '' when it can."""
    per_byte = values_per_byte(bits)
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
                   *, limit: int = 64, allow_padding: bool = True) -> list[int]:
    """Every tp <= `limit` that can shard the layer (`allow_padding=False`: without padding I)."""
    return [tp for tp in range(1, limit + 1)
            if not layout_problem(hidden, intermediate, bits, group_size, act_order, tp, allow_padding=allow_padding)]
