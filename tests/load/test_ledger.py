"""ledger: expected, written, duplicated and unexpected slots, the offenders' text, and the bulk calls
(`expect_slots`, `record_slots`) agreeing with the one-at-a-time ones."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wna16_loader import CompletenessError
from wna16_loader.formats import Role
from wna16_loader.load.ledger import Block, Ledger, Slot
from wna16_loader.models.names import Proj

P = "model.layers.0.mlp.experts"


def test_ledger_offenders_text() -> None:
    ledger = Ledger()
    for expert in (10, 2):
        for role in (Role.QWEIGHT, Role.SCALES):
            ledger.expect(P, expert, Proj.DOWN, role)
    ledger.expect(P, 2, Proj.GATE, Role.QWEIGHT)
    ledger.record(P, 2, Proj.DOWN, Role.QWEIGHT, "a.qweight")
    ledger.record(P, 2, Proj.DOWN, Role.QWEIGHT, "b.qweight")
    ledger.record(P, 2, Proj.GATE, Role.QWEIGHT, "c.qweight")
    ledger.record(P, 10, Proj.DOWN, Role.QWEIGHT, "d.qweight")
    ledger.reject("x.bias", "not a gptq tensor")
    assert [str(s) for s in ledger.missing()] == [f"{P}.2.down.scales", f"{P}.10.down.scales"]
    assert ledger.offenders() == [
        f"missing: {P}.2.down.scales",
        f"missing: {P}.10.down.scales",
        f"written 2 times: {P}.2.down.qweight from ['a.qweight', 'b.qweight']",
        "unexpected tensor: x.bias (not a gptq tensor)",
    ]
    with pytest.raises(CompletenessError, match=re.escape(f"4 problems\n  - missing: {P}.2.down.scales\n")):
        ledger.check()


def test_ledger_complete_passes_and_many_offenders_are_counted() -> None:
    ledger = Ledger()
    ledger.expect(P, 0, Proj.UP, Role.SCALES)
    ledger.record(P, 0, Proj.UP, Role.SCALES, "s")
    ledger.check()
    assert ledger.offenders() == []
    for e in range(25):
        ledger.expect(P, e + 1, Proj.UP, Role.ZEROS)
    with pytest.raises(CompletenessError, match=r"25 problems\n(  - missing: .*\n){20}  \.\.\. and 5 more "
                                                r"\(25 in all\)$"):
        ledger.check()


def test_slot_of_spells_the_values() -> None:
    assert Slot.of(P, 3, Proj.GATE, Role.ZEROS) == Slot(P, 3, "gate", "zeros")
    assert str(Slot.of(P, 3, Proj.GATE, Role.ZEROS)) == f"{P}.3.gate.zeros"


CELLS = st.tuples(st.integers(0, 3), st.sampled_from(list(Proj)), st.sampled_from(list(Role)))


@given(expected=st.lists(CELLS, max_size=12), writes=st.lists(st.tuples(CELLS, st.sampled_from("abc")), max_size=12))
def test_bulk_calls_equal_one_at_a_time(expected: list, writes: list) -> None:
    one, bulk = Ledger(), Ledger()
    for expert, proj, role in expected:
        one.expect(P, expert, proj, role)
    for (expert, proj, role), name in writes:
        one.record(P, expert, proj, role, name)
    bulk.expect_slots(Slot.of(P, *cell) for cell in expected)
    bulk.record_slots((Slot.of(P, *cell), name) for cell, name in writes)
    assert (bulk.expected, bulk.written, bulk.repeats) == (one.expected, one.written, one.repeats)
    assert bulk.offenders() == one.offenders()


@given(expected=st.lists(CELLS, max_size=12), writes=st.lists(st.tuples(CELLS, st.sampled_from("abc")), max_size=12))
def test_blocks_equal_one_slot_at_a_time(expected: list, writes: list) -> None:
    """`expect_block` / `record_block` (a planner's calls: one block of experts per (projection, role)) leave the
    ledger as one call per slot does, duplicates and their order included."""
    one, bulk = Ledger(), Ledger()
    for expert, proj, role in expected:
        one.expect(P, expert, proj, role)
        bulk.expect_block((P, proj.value, role.value), [expert])
    for (expert, proj, role), name in writes:
        one.record(P, expert, proj, role, name)
        bulk.record_block(Block((P, proj.value, role.value), {expert: name}))
    assert (bulk.expected, bulk.written, bulk.repeats) == (one.expected, one.written, one.repeats)
    assert bulk.offenders() == one.offenders() and bulk.expected_count() == len({*expected})


def test_a_block_of_many_experts_at_once() -> None:
    ledger = Ledger()
    ledger.expect_block((P, "down", "qweight"), range(4))
    ledger.record_block(Block((P, "down", "qweight"), {0: "a", 1: "b", 2: "c"}))
    ledger.record_block(Block((P, "down", "qweight"), {2: "d"}))
    assert [str(slot) for slot in ledger.missing()] == [f"{P}.3.down.qweight"]
    assert ledger.offenders()[1] == f"written 2 times: {P}.2.down.qweight from ['c', 'd']"
