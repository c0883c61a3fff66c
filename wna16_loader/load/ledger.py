"""The completeness ledger: every (layer, expert, projection, role) slot a load must fill, and what filled it.

A load declares the slots it expects, records each tensor that fills one, and rejects tensors that have
none; `check` raises one CompletenessError naming every missing, duplicated or unexpected entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Protocol

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


SlotKey = tuple[str, int, str, str]  # a `Slot` as the plain tuple the ledger keeps (prefix, expert, proj, role)


def slot_key(prefix: str, expert: int, proj: Proj, role: Role) -> SlotKey:
    """The plain-tuple key of one slot (equal to, and hashed as, its `Slot`; untracked by the collector)."""
    return (prefix, expert, proj._value_, role._value_)


@dataclass
class Ledger:
    """Records every slot written; `check` raises one error naming every offender."""

    # Slots are kept as plain tuples of strings and ints, names as tuples of strings: the garbage collector
    # stops tracking those (not named tuples or lists), and a load records hundreds of thousands of them,
    # which every full collection of a long-lived module's ledger would scan again. They compare and hash
    # as the `Slot`s they were made from; `missing()` and `offenders()` give `Slot`s back.
    expected: set[tuple[str, int, str, str]] = field(default_factory=set)
    written: dict[tuple[str, int, str, str], tuple[str, ...]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # whole parts (e.g. MoE layers) the checkpoint lacks
    names: SlotNames | None = None  # the checkpoint's own tensor names for the offenders (set by the planner)

    def expect(self, prefix: str, expert: int, proj: Proj, role: Role) -> None:
        """Declare a slot that must be written exactly once."""
        self.expected.add((prefix, expert, proj._value_, role._value_))

    def expect_slots(self, slots: Iterable[Slot]) -> None:
        """Declare many slots at once (as `expect` for each)."""
        self.expected.update(map(tuple, slots))

    def record(self, prefix: str, expert: int, proj: Proj, role: Role, name: str) -> None:
        """Note that tensor `name` fills a slot."""
        slot = (prefix, expert, proj._value_, role._value_)
        self.written[slot] = self.written.get(slot, ()) + (name,)

    def record_slot(self, slot: Slot, name: str) -> None:
        """Note that `name` (a tensor, or a whole pre-sharded layer) fills `slot`."""
        key = tuple(slot)
        self.written[key] = self.written.get(key, ()) + (name,)

    def record_slots(self, records: Iterable[tuple[Slot, str]]) -> None:
        """Note many (slot, name) writes at once, in order (as `record_slot` for each)."""
        written = self.written
        for slot, name in records:
            key = tuple(slot)
            written[key] = written.get(key, ()) + (name,)

    def clear_records(self) -> None:
        """Forget every write and rejection (the expected slots stay)."""
        self.written.clear()
        self.unexpected.clear()
        self.absent.clear()

    def reject(self, name: str, why: str) -> None:
        """Note a tensor that has no slot."""
        self.unexpected.append(f"{name} ({why})")

    def lack(self, what: str, why: str) -> None:
        """Note a whole part the load needs and the checkpoint does not have (reported as missing)."""
        self.absent.append(f"{what} ({why})")

    def missing(self) -> list[Slot]:
        """Expected slots not written yet, sorted."""
        return [Slot._make(slot) for slot in sorted(self.expected.difference(self.written))]

    def offenders(self) -> list[str]:
        """Every missing, duplicated or unexpected entry, in a stable order."""
        name = str if self.names is None else self.names.name
        missing = [f"missing: {what}" for what in self.absent] + [f"missing: {name(slot)}" for slot in self.missing()]
        dups = [f"written {len(names)} times: {Slot._make(slot)} from {list(names)}"
                for slot, names in sorted(item for item in self.written.items() if len(item[1]) > 1)]
        return missing + dups + [f"unexpected tensor: {u}" for u in self.unexpected]

    def check(self) -> None:
        """Raise CompletenessError listing the first 20 offenders and a count."""
        problems = self.offenders()
        if problems:
            summary = None if self.names is None else self.names.summary(self.missing())
            head = f"{summary}; " if summary else "the load is incomplete or inconsistent: "
            raise CompletenessError(f"{head}{len(problems)} problems\n{format_offenders(problems)}")
