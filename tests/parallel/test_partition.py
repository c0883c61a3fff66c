"""Sharding math: expert placement, effective group size, and rank column spans / group maps."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from wna16_loader.errors import ShardingError
from wna16_loader.models.names import Proj
from wna16_loader.parallel.config import ParallelConfig
from wna16_loader.parallel.partition import (
    LayerGeometry,
    Span,
    ceil_div,
    effective_group_size,
    layout_problem,
    local_experts,
    unpadded_problem,
    valid_tp_sizes,
)

# Gemma 4 26B-A4B: H = 2816, I = 704 (= 5.5 groups of 128), 128 experts
H, I, G, E = 2816, 704, 128, 128


def geometry(tp: int = 1, rank: int = 0, *, hidden: int = H, intermediate: int = I, group_size: int = G,
             act_order: bool = False, bits: int = 4, num_experts: int = E, ep: int = 1,
             ep_rank: int = 0) -> LayerGeometry:
    return LayerGeometry(hidden=hidden, intermediate=intermediate, num_experts=num_experts, bits=bits,
                         group_size=group_size, act_order=act_order,
                         parallel=ParallelConfig(tp_size=tp, tp_rank=rank, ep_size=ep, ep_rank=ep_rank))


# ---------------------------------------------------------------- expert placement


def test_local_experts_linear_6_on_4() -> None:
    got = [local_experts(6, ParallelConfig(tp_size=1, tp_rank=0, ep_size=4, ep_rank=r)) for r in range(4)]
    assert got == [(0, 1), (2, 3), (4,), (5,)]


@pytest.mark.parametrize("num_experts,ep", [(8, 1), (8, 2), (8, 3), (7, 3), (128, 6), (5, 5), (60, 8)])
def test_local_experts_linear_first_remainder_ranks_get_one_more(num_experts: int, ep: int) -> None:
    parts = [local_experts(num_experts, ParallelConfig(tp_size=1, tp_rank=0, ep_size=ep, ep_rank=r))
             for r in range(ep)]
    base, extra = divmod(num_experts, ep)
    assert [len(p) for p in parts] == [base + 1] * extra + [base] * (ep - extra)
    assert [e for p in parts for e in p] == list(range(num_experts))  # consecutive blocks, in order
    assert all(list(p) == list(range(p[0], p[0] + len(p))) for p in parts)


def test_local_experts_round_robin_6_on_4() -> None:
    got = [local_experts(6, ParallelConfig(tp_size=1, tp_rank=0, ep_size=4, ep_rank=r,
                                           expert_placement="round_robin")) for r in range(4)]
    assert got == [(0, 4), (1, 5), (2,), (3,)]


@pytest.mark.parametrize("num_experts,ep", [(8, 3), (128, 5), (4, 4)])
def test_local_experts_round_robin_partition(num_experts: int, ep: int) -> None:
    parts = [local_experts(num_experts, ParallelConfig(tp_size=1, tp_rank=0, ep_size=ep, ep_rank=r,
                                                       expert_placement="round_robin")) for r in range(ep)]
    assert sorted(e for p in parts for e in p) == list(range(num_experts))
    assert all(e % ep == r for r, p in enumerate(parts) for e in p)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_ep_larger_than_expert_count(placement: str) -> None:
    pc = ParallelConfig(tp_size=1, tp_rank=0, ep_size=8, ep_rank=7, expert_placement=placement)
    with pytest.raises(ShardingError, match=r"ep_size=8 is larger than the expert count 6; every EP rank needs at "
                                            r"least one expert\. Use ep_size <= 6\."):
        local_experts(6, pc)


def test_geometry_experts_uses_ep_rank() -> None:
    assert geometry(num_experts=6, ep=4, ep_rank=1).experts == (2, 3)
    assert geometry(tp=2, rank=1, num_experts=6, ep=4, ep_rank=3).experts == (5,)


# ---------------------------------------------------------------- effective group size


@pytest.mark.parametrize("group_size,part,tp,act_order,expected", [
    (128, 704, 1, False, 128),  # tp = 1 keeps G even though 704 % 128 != 0
    (128, 352, 2, False, 32),
    (128, 176, 4, False, 16),
    (128, 88, 8, False, 0),  # would need 8 < 16
    (128, 256, 2, False, 128),  # part % G == 0
    (128, 352, 2, True, 128),  # act-order keeps G
    (-1, 88, 8, False, -1),  # channelwise
    (64, 96, 2, False, 32),
    (32, 48, 4, False, 16),
    (16, 24, 2, False, 0),
])
def test_effective_group_size(group_size: int, part: int, tp: int, act_order: bool, expected: int) -> None:
    assert effective_group_size(group_size, part, tp_size=tp, act_order=act_order) == expected


def test_ceil_div() -> None:
    assert [ceil_div(a, 128) for a in (1, 127, 128, 129, 704)] == [1, 1, 1, 2, 6]


# ---------------------------------------------------------------- Gemma-4-like layer (I = 704, G = 128)


def test_gemma4_tp1() -> None:
    g = geometry(tp=1)
    assert (g.part, g.group_eff) == (704, 128)
    assert g.w2_groups == 6  # ceil(704 / 128): the last group is half full
    down = g.slice(Proj.DOWN)
    assert down.n == Span(0, H) and down.k == Span(0, 704)
    assert down.groups == (0, 1, 2, 3, 4, 5)
    assert down.g_idx is False
    gate = g.slice(Proj.GATE)
    assert gate.n == Span(0, 704) and gate.k == Span(0, H)
    assert gate.groups == tuple(range(22))


def test_gemma4_tp2_group_eff_and_rank1_groups_map_through_columns() -> None:
    g0, g1 = geometry(tp=2, rank=0), geometry(tp=2, rank=1)
    assert (g1.part, g1.group_eff, g1.w2_groups) == (352, 32, 11)
    down1 = g1.slice(Proj.DOWN)
    assert down1.k == Span(352, 704)
    # first fused group of rank 1 covers columns 352..383, which sit in checkpoint group 352 // 128 = 2.
    # Splitting the 6 checkpoint groups by count (3 per rank) would wrongly say group 3.
    assert down1.groups[0] == 2
    assert down1.groups[0] != 6 // 2
    assert down1.groups == (2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5)
    assert g0.slice(Proj.DOWN).groups == (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2)
    assert g0.slice(Proj.DOWN).k == Span(0, 352)
    # gate/up: column-parallel rows, full K, fused groups of 32 over H
    for proj in (Proj.GATE, Proj.UP):
        s = g1.slice(proj)
        assert s.n == Span(352, 704) and s.k == Span(0, H)
        assert s.groups == tuple(j * 32 // 128 for j in range(H // 32))


def test_gemma4_tp4() -> None:
    g = geometry(tp=4, rank=3)
    assert (g.part, g.group_eff, g.w2_groups) == (176, 16, 11)
    down = g.slice(Proj.DOWN)
    assert down.k == Span(528, 704)
    assert down.groups == tuple((528 + 16 * j) // 128 for j in range(11))
    assert down.groups == (4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5)


def test_gemma4_unpadded_tp_sizes_are_the_old_rule_and_padding_takes_every_other() -> None:
    assert valid_tp_sizes(H, I, 4, G, False, allow_padding=False) == [1, 2, 4, 11, 22, 44]
    assert valid_tp_sizes(H, I, 4, G, False) == list(range(1, 65))
    assert "no divisor of group size 128 that is >= 16 divides 88" in layout_problem(H, I, 4, G, False, 8,
                                                                                      allow_padding=False)
    assert "does not divide the expert intermediate size I=704" in unpadded_problem(H, I, 4, G, False, 3)


def test_gemma4_tp8_pads_to_768() -> None:
    # I_p = 88 leaves no group size >= 16: I' = 768 (smallest multiple of 8*16 >= 704), I_p' = 96, G_eff = 32
    ranks = [geometry(tp=8, rank=r) for r in range(8)]
    assert {(g.part, g.padded_intermediate, g.group_eff, g.w2_groups) for g in ranks} == {(96, 768, 32, 3)}
    assert [g.real for g in ranks] == [Span(96 * r, 96 * r + 96) for r in range(7)] + [Span(672, 704)]
    assert [g.padding for g in ranks] == [0] * 7 + [64]
    last = ranks[7]
    assert last.slice(Proj.DOWN).k == Span(672, 704) and last.slice(Proj.DOWN).groups == (5,)
    assert last.slice(Proj.GATE).n == last.slice(Proj.UP).n == Span(672, 704)
    assert ranks[1].slice(Proj.DOWN).groups == (0, 1, 1)  # columns 96..191 in groups of 32


def test_gemma4_tp16_last_rank_is_all_padding() -> None:
    ranks = [geometry(tp=16, rank=r) for r in range(16)]
    assert {(g.part, g.padded_intermediate, g.group_eff) for g in ranks} == {(48, 768, 16)}
    assert ranks[14].real == Span(672, 704) and ranks[14].padding == 16
    assert ranks[15].real == Span(704, 704) and ranks[15].padding == 48
    assert ranks[15].slice(Proj.DOWN).groups == () and ranks[15].w2_groups == 3


@pytest.mark.parametrize("tp,padded,part,g_eff", [(3, 720, 240, 16), (5, 720, 144, 16), (6, 768, 128, 128),
                                                  (7, 784, 112, 16)])
def test_tp_not_dividing_intermediate_pads(tp: int, padded: int, part: int, g_eff: int) -> None:
    g = geometry(tp=tp, rank=tp - 1)
    assert (g.padded_intermediate, g.part, g.group_eff) == (padded, part, g_eff)
    assert g.real == Span(min((tp - 1) * part, I), I) and g.padding == padded - I


@pytest.mark.parametrize("intermediate,tp,padded,part,g_eff", [(1408, 3, 1440, 480, 32), (1408, 5, 1440, 288, 32),
                                                               (1408, 6, 1440, 240, 16), (1408, 8, 1408, 176, 16)])
def test_intermediate_1408(intermediate: int, tp: int, padded: int, part: int, g_eff: int) -> None:
    g = geometry(tp=tp, rank=0, intermediate=intermediate)
    assert (g.padded_intermediate, g.part, g.group_eff) == (padded, part, g_eff)


def test_odd_part_for_4_bit_bytes_pads() -> None:
    # I = 66, tp = 2: I/tp = 33 values cannot be byte-packed at 4 bits, so I pads to 96
    assert "must both be multiples of 2" in layout_problem(64, 66, 4, -1, False, 2, allow_padding=False)
    g = geometry(tp=2, rank=1, hidden=64, intermediate=66, group_size=-1)
    assert (g.part, g.real, g.padding, g.group_eff) == (48, Span(48, 66), 30, -1)
    assert layout_problem(64, 66, 8, -1, False, 2) == ""
    assert geometry(tp=2, hidden=64, intermediate=66, group_size=-1, bits=8).padded_intermediate == 66


def test_truly_impossible_layouts_name_the_sizes_that_work() -> None:
    # I = 65 at 4 bits: no rank's columns could end on a byte
    with pytest.raises(ShardingError, match=r"4-bit bytes hold 2 values, but H = 64 and I = 65 must both be multiples "
                                            r"of 2 at any TP size \(a rank's columns must end on a byte\)\. No TP size "
                                            r"works for this layer\."):
        geometry(tp=2, hidden=64, intermediate=65, group_size=-1)
    # G = 24: I'/tp = 112/7 = 16 and gcd(24, 16) = 8 < 16; tp = 2 (I_p = 48, G_eff = 24) works unpadded,
    # and tp = 4 too (I_p = 24 = G); tp = 3 would pad to I' = 96, I_p' = 32 and gcd(24, 32) = 8
    with pytest.raises(ShardingError, match=r"tp_size=7: padding I=96 to I'=112 gives I'/tp = 112/7 = 16 columns per rank, and "
                                            r"the largest divisor of group size 24 dividing 16 is 8 < 16 \(G=24 is not "
                                            r"a multiple of 16 and cannot be re-expressed\)\. TP sizes that work for "
                                            r"this layer: \[1, 2, 4\]\."):
        geometry(tp=7, hidden=64, intermediate=96, group_size=24)
    with pytest.raises(ShardingError, match=r"H = 63 and I = 96 must both be multiples of 2"):
        geometry(tp=3, hidden=63, intermediate=96, group_size=-1)


def test_act_order_keeps_g_and_all_groups() -> None:
    for tp in (1, 2, 4):
        for rank in range(tp):
            g = geometry(tp=tp, rank=rank, act_order=True)
            assert g.group_eff == 128
            assert g.w2_groups == 6  # ceil(I / G), not the rank's share
            down = g.slice(Proj.DOWN)
            assert down.groups == (0, 1, 2, 3, 4, 5)
            assert down.g_idx is True
            assert down.k == Span(rank * 704 // tp, (rank + 1) * 704 // tp)
            gate = g.slice(Proj.GATE)
            assert gate.groups == tuple(range(22)) and gate.g_idx is True


def test_act_order_tp8_accepted() -> None:
    # act-order keeps G and reads every group through g_idx, so I/tp = 88 is fine
    assert layout_problem(H, I, 4, G, True, 8) == ""
    assert geometry(tp=8, rank=7, act_order=True).slice(Proj.DOWN).groups == tuple(range(6))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_channelwise(tp: int) -> None:
    for rank in range(tp):
        g = geometry(tp=tp, rank=rank, group_size=-1)
        assert g.group_eff == -1
        assert g.w2_groups == 1
        for proj in Proj:
            s = g.slice(proj)
            assert s.groups == (0,)
            assert s.g_idx is False


def test_geometry_is_validated_for_tp1_even_with_partial_group() -> None:
    g = geometry(tp=1, hidden=64, intermediate=48, group_size=128)
    assert g.group_eff == 128 and g.w2_groups == 1 and g.slice(Proj.DOWN).groups == (0,)


# ---------------------------------------------------------------- properties


@settings(max_examples=300, deadline=None)
@given(hidden=st.integers(1, 96).map(lambda x: 16 * x), intermediate=st.integers(1, 96).map(lambda x: 16 * x),
       group_size=st.sampled_from([16, 32, 64, 128, -1]), tp=st.integers(1, 8), bits=st.sampled_from([4, 8]))
def test_rank_spans_tile_and_fused_groups_map_through_columns(hidden: int, intermediate: int, group_size: int,
                                                               tp: int, bits: int) -> None:
    problem = layout_problem(hidden, intermediate, bits, group_size, False, tp, allow_padding=False)
    assume(problem == "")
    part = intermediate // tp
    down_cover, gate_cover = [], []
    for rank in range(tp):
        g = geometry(tp=tp, rank=rank, hidden=hidden, intermediate=intermediate, group_size=group_size, bits=bits,
                     num_experts=4)
        assert g.part == part and g.padded_intermediate == intermediate and g.padding == 0
        g_eff = g.group_eff
        down, gate, up = g.slice(Proj.DOWN), g.slice(Proj.GATE), g.slice(Proj.UP)
        assert down.n == Span(0, hidden) and gate.k == Span(0, hidden) and up.k == Span(0, hidden)
        assert gate.n == up.n == down.k
        down_cover.append(down.k)
        gate_cover.append(gate.n)
        if group_size == -1:
            assert g_eff == -1 and down.groups == gate.groups == (0,)
            continue
        assert g_eff >= 16 and group_size % g_eff == 0
        if tp > 1:
            assert part % g_eff == 0
        assert len(down.groups) == g.w2_groups == ceil_div(part, g_eff)
        for j, grp in enumerate(down.groups):
            first = rank * part + j * g_eff
            last = min(first + g_eff, (rank + 1) * part) - 1
            assert grp == (rank * part + j * g_eff) // group_size
            assert first // group_size == last // group_size == grp, "fused group straddles checkpoint groups"
        assert len(gate.groups) == ceil_div(hidden, g_eff)
        for j, grp in enumerate(gate.groups):
            first, last = j * g_eff, min((j + 1) * g_eff, hidden) - 1
            assert first // group_size == last // group_size == grp
    for cover in (down_cover, gate_cover):
        assert cover[0].start == 0 and cover[-1].stop == intermediate
        assert all(a.stop == b.start for a, b in zip(cover, cover[1:]))
        assert sum(len(s) for s in cover) == intermediate


@settings(max_examples=200, deadline=None)
@given(hidden=st.integers(1, 64).map(lambda x: 16 * x), intermediate=st.integers(1, 64).map(lambda x: 16 * x),
       group_size=st.sampled_from([16, 32, 64, 128, -1]), tp=st.integers(1, 8), act_order=st.booleans())
def test_layout_problem_agrees_with_geometry(hidden: int, intermediate: int, group_size: int, tp: int,
                                             act_order: bool) -> None:
    act_order = act_order and group_size != -1
    problem = layout_problem(hidden, intermediate, 4, group_size, act_order, tp)
    valid = valid_tp_sizes(hidden, intermediate, 4, group_size, act_order)
    assert (problem == "") == (tp in valid)
    assert 1 in valid
    if problem:
        with pytest.raises(ShardingError, match=r"TP sizes that work for this layer: \[1"):
            geometry(tp=tp, hidden=hidden, intermediate=intermediate, group_size=group_size, act_order=act_order,
                     num_experts=4)
    else:
        geometry(tp=tp, rank=tp - 1, hidden=hidden, intermediate=intermediate, group_size=group_size,
                 act_order=act_order, num_experts=4)


def _largest_divisor_dividing(group_size: int, part: int) -> int:
    return max(d for d in range(1, group_size + 1) if group_size % d == 0 and part % d == 0)


@settings(max_examples=400, deadline=None)
@given(units=st.integers(1, 1600), group_size=st.sampled_from([16, 32, 48, 64, 128, -1]), tp=st.integers(1, 16),
       bits=st.sampled_from([4, 8]), act_order=st.booleans())
def test_padding_rule(units: int, group_size: int, tp: int, bits: int, act_order: bool) -> None:
    """Every TP size 1..16 works; unpadded layouts are the old rule's; padded ones are uniform, cover every
    real column once, keep G_eff >= 16 and never let a fused group straddle two checkpoint groups."""
    intermediate = units * (8 // bits)  # any multiple of the values per byte
    act_order = act_order and group_size != -1
    hidden = 64
    ranks = [geometry(tp=tp, rank=r, hidden=hidden, intermediate=intermediate, group_size=group_size, bits=bits,
                      act_order=act_order, num_experts=4) for r in range(tp)]
    first = ranks[0]
    if not unpadded_problem(hidden, intermediate, bits, group_size, act_order, tp):  # the old rule, unchanged
        assert (first.part, first.padded_intermediate) == (intermediate // tp, intermediate)
        assert first.group_eff == effective_group_size(group_size, intermediate // tp, tp_size=tp,
                                                       act_order=act_order)
    else:
        unit = 16 * tp
        assert first.padded_intermediate == -(-intermediate // unit) * unit
        assert first.part == first.padded_intermediate // tp
        if group_size != -1 and not act_order:
            assert first.group_eff == _largest_divisor_dividing(group_size, first.part)
    assert len({(g.part, g.padded_intermediate, g.group_eff, g.w2_groups) for g in ranks}) == 1  # uniform shapes
    covered = []
    for rank, g in enumerate(ranks):
        real = g.real
        assert len(real) + g.padding == g.part and g.padding >= 0
        assert len(real) % (8 // bits) == 0
        if len(real):
            assert real.start == rank * g.part
        covered.extend(range(real.start, real.stop))
        down, gate = g.slice(Proj.DOWN), g.slice(Proj.GATE)
        assert down.k == gate.n == g.slice(Proj.UP).n == real
        if group_size == -1:
            assert g.group_eff == -1
            continue
        if act_order:
            assert g.group_eff == group_size and down.groups == tuple(range(ceil_div(intermediate, group_size)))
            continue
        g_eff = g.group_eff
        assert g_eff >= 16 and group_size % g_eff == 0
        if tp > 1:
            assert g.part % g_eff == 0
        assert len(down.groups) == ceil_div(len(real), g_eff) <= g.w2_groups
        for j, grp in enumerate(down.groups):
            lo = rank * g.part + j * g_eff
            hi = min(lo + g_eff, real.stop) - 1
            assert lo // group_size == hi // group_size == grp, "fused group straddles checkpoint groups"
    assert covered == list(range(intermediate)), "real columns covered exactly once, in order"
