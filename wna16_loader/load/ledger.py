"""The completeness ledger: every (layer, expert, projection, role) slot a load must fill, and what filled it.

A load declares the slots it expects, records each tensor that fills one, and rejects tensors that have
none; `check` raises one CompletenessError naming every missing, duplicated or unexpected entry.
Slots are kept in blocks, one per (layer, projection, role), each a set of expected experts and a dict
of expert -> the names that filled it: a planner declares and records a whole block of experts at once
(`expect_block`, `record_block`), with no object per slot; one slot at a time works too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Protocol

from ..errors import CompletenessError, format_offenders
from ..formats import Role
from ..models.names import Proj


class Slot(NamedTuple):
    """One (layer, expert, projection, role) cell of the fused layout (a named tuple: every load
    records thousands, so hashing and ordering run as tuple operations in C)."""

    prefix: str
    expert: int
    proj: str
    role: str

    def __str__(self) -> str:
        return f"{self.prefix}.{self.expert}.{self.proj}.{self.role}"

    @classmethod
    def of(cls, prefix: str, expert: int, proj: Proj, role: Role) -> "Slot":
        """The slot of one (layer, expert, projection, role); `_value_` is the member's value, read as a plain
        attribute (`.value` is a Python-level descriptor, and a load makes thousands of slots)."""
        return cls(prefix, expert, proj._value_, role._value_)


class SlotNames(Protocol):
    """What a checkpoint tells about its slots, asked only when a check fails: the checkpoint tensor name of a
    slot, and one line summing up the missing slots (e.g. config.json counting more experts than it has)."""

    def name(self, slot: Slot) -> str: ...
    def summary(self, missing: list[Slot]) -> str | None: ...


BlockKey = tuple[str, str, str]  # (experts prefix, projection value, role value): one block of slots


class Block(NamedTuple):
    """Names recorded for one block of slots: (prefix, projection value, role value) and expert -> name,
    in the order recorded (the plans' records of a layer: `Ledger.record_block` of each)."""

    key: BlockKey
    names: Mapping[int, str]


@dataclass
class Ledger:
    """Records every slot written; `check` raises one error naming every offender."""

    # Plain sets and dicts of ints and strings, per block: the garbage collector does not track those, and a
    # load records hundreds of thousands of slots, which every full collection of a long-lived module's
    # ledger would scan again. `written` keeps the first name of each slot, `repeats` the later names of a
    # slot filled more than once (so a block is recorded by one dict update). `missing()` and `offenders()`
    # give `Slot`s back.
    expected: dict[BlockKey, set[int]] = field(default_factory=dict)
    written: dict[BlockKey, dict[int, str]] = field(default_factory=dict)
    repeats: dict[BlockKey, dict[int, tuple[str, ...]]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # whole parts (e.g. MoE layers) the checkpoint lacks
    names: SlotNames | None = None  # the checkpoint's own tensor names for the offenders (set by the planner)

    def expect(self, prefix: str, expert: int, proj: Proj, role: Role) -> None:
        """Declare a slot that must be written exactly once."""
        self.expected.setdefault((prefix, proj._value_, role._value_), set()).add(expert)

    def expect_slots(self, slots: Iterable[Slot]) -> None:
        """Declare many slots at once (as `expect` for each)."""
        expected = self.expected
        for prefix, expert, proj, role in slots:
            expected.setdefault((prefix, proj, role), set()).add(expert)

    def expect_block(self, key: BlockKey, experts: Iterable[int]) -> None:
        """Declare the slots of `experts` in one block (as `expect` for each)."""
        self.expected.setdefault(key, set()).update(experts)

    def record(self, prefix: str, expert: int, proj: Proj, role: Role, name: str) -> None:
        """Note that tensor `name` fills a slot."""
        self._record((prefix, proj._value_, role._value_), expert, name)

    def record_slot(self, slot: Slot, name: str) -> None:
        """Note that `name` (a tensor, or a whole pre-sharded layer) fills `slot`."""
        self._record((slot.prefix, slot.proj, slot.role), slot.expert, name)

    def _record(self, key: BlockKey, expert: int, name: str) -> None:
        """Note that `name` fills the slot of `expert` in block `key` (a repeat when it is filled already)."""
        block = self.written.setdefault(key, {})
        if expert in block:
            later = self.repeats.setdefault(key, {})
            later[expert] = later.get(expert, ()) + (name,)
        else:
            block[expert] = name

    def record_slots(self, records: Iterable[tuple[Slot, str]]) -> None:
        """Note many (slot, name) writes at once, in order (as `record_slot` for each)."""
        for (prefix, expert, proj, role), name in records:
            self._record((prefix, proj, role), expert, name)

    def record_block(self, block: Block) -> None:
        """Note that `block.names[e]` fills the slot of expert e in `block.key`, for every e (as `record` for
        each; one dict update when none of them is written yet)."""
        written = self.written.setdefault(block.key, {})
        if written.keys().isdisjoint(block.names):
            written.update(block.names)
            return
        for expert, name in block.names.items():
            self._record(block.key, expert, name)

    def record_blocks(self, blocks: Iterable[Block]) -> None:
        """`record_block` of each, in order."""
        for block in blocks:
            self.record_block(block)

    def clear_records(self) -> None:
        """Forget every write and rejection (the expected slots stay)."""
        self.written.clear()
        self.repeats.clear()
        self.unexpected.clear()
        self.absent.clear()

    def reject(self, name: str, why: str) -> None:
        """Note a tensor that has no slot."""
        self.unexpected.append(f"{name} ({why})")

    def lack(self, what: str, why: str) -> None:
        """Note a whole part the load needs and the checkpoint does not have (reported as missing)."""
        self.absent.append(f"{what} ({why})")

    def expected_count(self) -> int:
        """How many slots are expected."""
        return sum(map(len, self.expected.values()))

    def missing(self) -> list[Slot]:
        """Expected slots not written yet, sorted."""
        written, empty = self.written, {}
        return sorted(Slot(prefix, expert, proj, role) for (prefix, proj, role), experts in self.expected.items()
                      for expert in experts.difference(written.get((prefix, proj, role), empty)))

    def offenders(self) -> list[str]:
        """Every missing, duplicated or unexpected entry, in a stable order."""
        name = str if self.names is None else self.names.name
        missing = [f"missing: {what}" for what in self.absent] + [f"missing: {name(slot)}" for slot in self.missing()]
        dups = sorted((Slot(prefix, expert, proj, role), (self.written[prefix, proj, role][expert], *later))
                      for (prefix, proj, role), block in self.repeats.items() for expert, later in block.items())
        return missing + [f"written {len(names)} times: {slot} from {list(names)}" for slot, names in dups] + \
            [f"unexpected tensor: {u}" for u in self.unexpected]

    def check(self) -> None:
        """Raise CompletenessError listing the first 20 offenders and a count."""
        problems = self.offenders()
        if problems:
            summary = None if self.names is None else self.names.summary(self.missing())
            head = f"{summary}; " if summary else "the load is incomplete or inconsistent: "
            raise CompletenessError(f"{head}{len(problems)} problems\n{format_offenders(problems)}")
