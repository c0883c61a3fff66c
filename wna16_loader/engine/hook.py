"""The engine-style load hook: whole per-expert checkpoint tensors in, this rank's fused slice out.

An engine walks the checkpoint and hands every routed-expert tensor, whole, to
`weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)` (vLLM's
calling convention). `ExpertLoadHook` keeps what the rank needs of the tensors of one
(expert, projection) in a `Stage` (engine/staging.py) until every role the format requires
has arrived, then reads the rank's slice through the same `LayerLoad.write` as `load_experts`
(which passes whole runs of experts at once) and the same `FusedWriter`. Tensors of non-local
experts are refused before anything is kept or converted.

| shard_id | projection | fused rows                        |
|----------|------------|-----------------------------------|
| "w1"     | gate       | w13 rows [0, I_p)                 |
| "w3"     | up         | w13 rows [I_p, 2*I_p)             |
| "w2"     | down       | w2, row-parallel along I          |

Non-gated experts (e.g. Nemotron-H) have no "w1": "w3" fills w13 rows [0, I_p).

Per call the hook costs about a dict lookup and one small copy: the name is classified in O(1)
(split at its last dots and looked up in the module's table of (stem, alias, suffix, projection);
stacked names and the first of each kind go through `ExpertNameParser`), the kind-level checks
(suffix, source, header shape and dtype) are worked out once per kind (`engine/kinds.py`) and then
compared, and a non-local expert returns before anything is kept. The
storage slice of a per-expert tensor that covers the rank's part is copied into its stage's buffer
and the engine's tensor is let go at once (see staging.py for why nothing per tensor may stay alive);
stacked tensors are held as they are. A stage covers a chunk of consecutive local slots of one
projection and source kind (as many as fit HOOK_BATCH_BYTES of staged bytes: every local expert at
small sizes); it is written once every slot of it is complete (the engine's usual order: a layer's
tensors one after the other), or at `flush()` (which every reader of the module's parameters or
ledger calls first), a run of consecutive slots at a time, exactly as `load_experts` does.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import FormatError
from ..formats import Role
from ..load.fused import FusedWriter, layer_projections
from ..load.keys import KeyRules
from ..load.layer import LayerLoad
from ..load.ledger import Ledger
from ..load.params import SourceTensors, check_dropped_role, check_header, expected_shape
from ..load.plan import LayerPlan
from ..load.tables import sizes_source_tensors
from ..models.config import MoEConfig
from ..models.names import (
    SHAPE_RULE,
    ExpertNameParser,
    ExpertTensorKey,
    Proj,
    Source,
    name_shape,
    parse_expert_name,
)
from ..parallel.partition import LayerGeometry
from ..storage.bulk import gc_paused
from ..storage.index import CheckpointIndex, TensorRef
from .kinds import Kind, resolve, staged_kind
from .mapping import ShardId, default_alias
from .staging import MEMORY_FILE, Stage, TensorStore

__all__ = ["ExpertLoadHook", "HOOK_BATCH_BYTES", "MEMORY_FILE", "TensorStore"]

HOOK_BATCH_BYTES = 64 << 20  # staged bytes of one stage (a chunk of slots of one projection) at most


_SHARD_PROJS: dict[str | ShardId, Proj] = {**{s.value: s.proj for s in ShardId}, **{s: s.proj for s in ShardId}}

# What is left of a written (expert, projection), kept for the module's life: (source value, expert row,
# role values). A plain tuple of strings and ints, which the garbage collector stops tracking (named tuples
# and objects stay tracked; see `Ledger`'s note).
Written = tuple[str, "int | None", tuple[str, ...]]
StageKey = tuple[str, str, bool, int]  # (projection value, source value, stacked, chunk number): plain, untracked


class ExpertLoadHook(LayerLoad):
    """Collects whole checkpoint tensors of one layer and writes this rank's slice of each projection.

    The ledger records every (expert, projection, role) slot filled, so `Ledger.check`
    reports what is missing or duplicated. `accept` takes a writer factory, called
    only for tensors this rank keeps. Tensors wait in their `Stage` (`pending`) until its
    slots are complete (see the module docstring); `flush()` writes every complete one now.
    """

    def __init__(self, prefix: str, moe: MoEConfig, geometry: LayerGeometry, ledger: Ledger, *,
                 allow_nonfinite: bool = False) -> None:
        super().__init__(prefix, moe, geometry, allow_nonfinite=allow_nonfinite)
        self.ledger = ledger
        self.roles = tuple(dict.fromkeys(lay.role for lay in moe.quant.layouts))  # role i has bit 1 << i
        self.required = sum(1 << i for i, role in enumerate(self.roles)
                            if any(moe.quant.required(lay) for lay in moe.quant.layouts if lay.role is role))
        self.local = frozenset(geometry.experts)
        self.store = TensorStore()  # tensors held whole (stacked ones)
        self.pending: dict[StageKey, Stage] = {}
        self.written: dict[Proj, dict[int, Written]] = {proj: {} for proj in Proj}
        self.aliases: dict[Proj, tuple[str, bool]] = {}  # proj -> (checkpoint module name, stacked)
        self._origins: dict[Proj, list[tuple[str, bool] | None]] = {p: [None] * len(geometry.experts) for p in Proj}
        self._parse = ExpertNameParser()
        self._rules = KeyRules(moe)
        self._kinds: dict[tuple[str, str, bool, Proj], Kind] = {}
        self._table: dict[tuple[str, str, str, Proj | None], tuple[Kind, int]] = {}  # (stem, alias, suffix, proj)
        self._slots = {expert: i for i, expert in enumerate(geometry.experts)}
        self._writer: Callable[[], FusedWriter] | None = None

    @property
    def ready(self) -> dict[Proj, list[int]]:
        """The experts of each projection that are complete but not written yet (waiting for their stage)."""
        out: dict[Proj, list[int]] = {}
        for (proj, *_), stage in self.pending.items():
            for i, have in enumerate(stage.roles):
                if have != -1 and have & self.required == self.required:
                    out.setdefault(Proj(proj), []).append(self.geometry.experts[stage.first + i])
        return out

    def accept(self, writer: Callable[[], FusedWriter], loaded: torch.Tensor, weight_name: str,
               shard_id: str | ShardId, expert_id: int | None) -> bool:
        """Take one whole checkpoint tensor; False (nothing kept or converted) when no local expert needs it.

        A per-expert name of a (stem, alias, suffix, projection) whose kind passed every check before is
        classified by one lookup in the module's name table; anything else takes `_accept_parsed`."""
        proj = _SHARD_PROJS.get(shard_id) if isinstance(shard_id, (str, ShardId)) else None
        stem, number, alias, suffix = name_shape(weight_name)
        entry = self._table.get((stem, alias, suffix, proj))
        if entry is None or not number.isdecimal():
            return self._accept_parsed(writer, loaded, weight_name, shard_id, expert_id, proj)
        kind, count = entry
        expert = int(number)
        if expert >= count or (expert_id is not None and expert_id != expert):
            return self._accept_checked(writer, loaded, weight_name, shard_id, expert_id)
        if expert not in self.local:
            return False
        if loaded.shape != kind.shape or loaded.dtype not in kind.dtypes:
            return self._accept_checked(writer, loaded, weight_name, shard_id, expert_id)
        writer()  # fails early when the parameters are not materialised
        self._writer = writer
        self._arrive(kind, proj, expert, loaded, weight_name)
        self.tensors += 1
        return True

    def _accept_parsed(self, writer: Callable[[], FusedWriter], loaded: torch.Tensor, weight_name: str,
                       shard_id: str | ShardId, expert_id: int | None, proj: Proj | None) -> bool:
        """`accept` for a name the table does not hold (stacked tensors, the first of each kind): the name
        parsed (`ExpertNameParser`), its kind looked up, or else every check (`_accept_checked`)."""
        key = self._parse(weight_name) if proj is not None else None
        kind = None if key is None else self._kind_of(key, weight_name, proj, expert_id)
        if kind is None:  # anything unusual: the checked path (which raises the error, if any)
            return self._accept_checked(writer, loaded, weight_name, shard_id, expert_id)
        if key.expert is not None and key.expert not in self.local:
            return False
        if loaded.shape != kind.shape or loaded.dtype not in kind.dtypes:
            return self._accept_checked(writer, loaded, weight_name, shard_id, expert_id)
        writer()  # fails early when the parameters are not materialised
        self._writer = writer
        if key.expert is None:
            self.aliases[proj] = (weight_name.rsplit(".", 2)[-2], True)
            for expert in self.geometry.experts:
                self._arrive(kind, proj, expert, loaded, weight_name)
        else:
            self.aliases[proj] = (weight_name.rsplit(".", 2)[-2], False)
            self._arrive(kind, proj, key.expert, loaded, weight_name)
        self.tensors += 1
        return True

    def _kind_of(self, key: ExpertTensorKey, weight_name: str, proj: Proj, expert_id: int | None) -> Kind | None:
        """The tensor's kind when every check of `kinds.resolve` is known to pass for it (its kind passed
        before, its expert id is consistent and in range, the planner's rule accepts it); else None."""
        alias = weight_name.rsplit(".", 2)[-2]
        kind = self._kinds.get((alias, key.suffix, key.expert is None, proj))
        if kind is None or (expert_id is not None and expert_id != key.expert):
            return None
        if key.expert is not None and key.expert >= self.geometry.num_experts:
            return None
        return kind if self._rules.problem(key) is None else None

    def _accept_checked(self, writer: Callable[[], FusedWriter], loaded: torch.Tensor, weight_name: str,
                        shard_id: str | ShardId, expert_id: int | None) -> bool:
        """`accept` with every check spelled out (each failure raises its own error); remembers the kind
        of a named tensor that passes, so that the next of its kind takes the fast path."""
        proj = ShardId.parse(shard_id, weight_name).proj
        if proj not in self.projections:
            raise FormatError(f"{weight_name}: shard_id {ShardId.of_proj(proj).value!r} means {proj.value}, but "
                              f"{self.moe.family} experts are not gated; their tensors come with shard_id "
                              f"{[ShardId.of_proj(p).value for p in self.projections]}.")
        arrival = resolve(self.moe, self.geometry, weight_name, proj, expert_id)
        ref = TensorRef(weight_name, MEMORY_FILE, tuple(loaded.shape), loaded.dtype)
        src = self._source(arrival.source, {arrival.role: ref}, None if arrival.expert is not None else 0)
        layout = self.moe.quant.layout(arrival.role)
        shape = expected_shape(layout, self.moe.quant, src, self.geometry.num_experts)
        kind = staged_kind(self.moe, self.geometry, arrival, proj, src, shape, self.roles, HOOK_BATCH_BYTES)
        key = parse_expert_name(weight_name)
        if key is not None:  # the kind's checks of the name passed: its next tensors take the fast path
            self._kinds[(arrival.alias, weight_name.rpartition(".")[2], arrival.expert is None, proj)] = kind
            self._remember(key, weight_name, proj, kind)
        experts = self.geometry.experts if arrival.expert is None else \
            ((arrival.expert,) if arrival.expert in self.local else ())
        if not experts:
            return False  # nothing of it is kept, so its header is not looked at (the fast path compares it)
        writer()  # fails early when the parameters are not materialised
        self._writer = writer
        check_header(ref, layout, self.moe.quant, src, self.geometry.num_experts)
        self.aliases[proj] = (arrival.alias, arrival.expert is None)
        for expert in experts:
            self._arrive(kind, proj, expert, loaded, weight_name)
        self.tensors += 1
        return True

    def _remember(self, key: ExpertTensorKey, weight_name: str, proj: Proj, kind: Kind) -> None:
        """Put a checked per-expert name's (stem, alias, suffix, projection) into the name table, with the
        layer's expert count, when every name of that shape parses alike (`SHAPE_RULE`)."""
        stem, number, alias, suffix = name_shape(weight_name)
        if SHAPE_RULE and key.expert is not None and number.isdecimal() and int(number) == key.expert and \
                suffix == key.suffix and self._rules.problem(key) is None:
            count = min(self.geometry.num_experts, self.moe.layer(key.layer).num_experts)
            self._table[(stem, alias, suffix, proj)] = (kind, count)

    @property
    def projections(self) -> tuple[Proj, ...]:
        """The projections of this layer's experts (no gate for non-gated experts)."""
        return layer_projections(self.moe.gated)

    def _source(self, source: Source, refs: dict[Role, TensorRef], row: int | None) -> SourceTensors:
        """SourceTensors at this layer's own sizes."""
        return sizes_source_tensors(self.geometry.hidden, self.geometry.intermediate, source, refs, row)

    def _arrive(self, kind: Kind, proj: Proj, expert: int, loaded: torch.Tensor, name: str) -> None:
        """Record one role of (expert, proj) and stage it; a stage whose slots are all complete is written."""
        self.ledger.record(self.prefix, expert, proj, kind.role, name)
        done = self.written[proj].get(expert)
        if done is not None:
            self._late(done, loaded, TensorRef(name, MEMORY_FILE, tuple(loaded.shape), loaded.dtype), expert, proj,
                       kind.role)
            return
        slot = self._slots[expert]
        origins = self._origins[proj]
        if origins[slot] is None:
            origins[slot] = kind.origin
        elif origins[slot] != kind.origin:
            self._mixed_sources(name, proj, expert, origins[slot])
        key, stage = self._stage(kind, proj, slot)
        i = slot - stage.first
        have = stage.roles[i]
        if have & kind.bit and have & self.required == self.required:
            return  # a duplicate of a complete projection: the first stays (the ledger reports it)
        stage.take(kind.value, kind.index, i, loaded, name)  # a duplicate of an incomplete one: the newest stays
        stage.roles[i] = have | kind.bit
        if have & self.required != self.required and (have | kind.bit) & self.required == self.required:
            stage.ready += 1
            if stage.ready + stage.written == stage.count:
                self._write_stage(key)

    def _stage(self, kind: Kind, proj: Proj, slot: int) -> tuple[StageKey, Stage]:
        """The stage of `slot` of `proj` for tensors of `kind` (made at the first of them)."""
        key = (proj._value_, kind.origin[0], kind.origin[1], slot // kind.chunk)
        stage = self.pending.get(key)
        if stage is None:
            first = key[3] * kind.chunk
            count = min(kind.chunk, len(self.geometry.experts) - first)
            stage = self.pending[key] = Stage(first, count, kind.source, kind.origin[1], self.store)
        return key, stage

    def _mixed_sources(self, name: str, proj: Proj, expert: int, origin: tuple[str, bool]) -> None:
        """FormatError: (expert, proj) already has tensors from another source kind."""
        slot = self._slots[expert]
        held = [stage.names[role][slot - stage.first] for (p, *where), stage in self.pending.items()
                if p == proj._value_ and tuple(where[:2]) == origin and 0 <= slot - stage.first < stage.count
                for role in stage.names]
        raise FormatError(f"{name}: {self.prefix} expert {expert} {proj.value} already has tensors from "
                          f"{sorted(n for n in held if n is not None)}; one projection must come from one "
                          f"source ({origin[0]} {'stacked' if origin[1] else ''}).")

    def flush(self) -> None:
        """Write every complete projection not written yet (a run of consecutive slots at a time)."""
        for key in list(self.pending):
            self._write_stage(key)

    def _write_stage(self, key: StageKey) -> None:
        """Write the complete slots of one stage, a run of consecutive slots with one set of roles at a time;
        the stage goes once every slot of it is written."""
        stage = self.pending[key]
        if stage.ready:
            assert self._writer is not None, "a projection is ready, so a tensor was accepted"
            writer, proj = self._writer(), Proj(key[0])
            with torch.no_grad():
                for run in self._runs(stage):
                    self._write_run(stage, writer, proj, run)
        if stage.written == stage.count:
            del self.pending[key]

    def _write_run(self, stage: Stage, writer: FusedWriter, proj: Proj, run: list[int]) -> None:
        """Read and write slots `run` (consecutive, complete, one set of roles) of `stage`, then release them."""
        have = stage.roles[run[0]]
        roles = [(role, role._value_) for i, role in enumerate(self.roles) if have >> i & 1]
        experts = tuple(self.geometry.experts[stage.first + i] for i in run)
        sources = tuple(self._source(stage.source, {role: stage.ref(value, i) for role, value in roles},
                                     expert if stage.stacked else None) for i, expert in zip(run, experts))
        self.write(stage, writer, experts, proj, sources)
        values = tuple(value for _, value in roles)
        written = self.written[proj]
        for i, expert in zip(run, experts):
            stage.release(i)
            written[expert] = (stage.source._value_, expert if stage.stacked else None, values)
        stage.ready -= len(run)

    def _runs(self, stage: Stage) -> list[list[int]]:
        """The complete, unwritten slots of `stage` cut into runs of consecutive slots with one set of roles."""
        runs: list[list[int]] = []
        last = None
        for i, have in enumerate(stage.roles):
            if have == -1 or have & self.required != self.required:
                last = None
                continue
            if have == last:
                runs[-1].append(i)
            else:
                runs.append([i])
            last = have
        return runs

    def _late(self, done: Written, loaded: torch.Tensor, ref: TensorRef, expert: int, proj: Proj,
              role: Role) -> None:
        """A role for a written projection: a duplicate (the ledger reports it) or an optional tensor to check."""
        source, row, roles = done
        if role._value_ in roles:
            return
        src = self._source(Source(source), {role: ref}, row)
        check_dropped_role(TensorStore.of(ref, loaded), self.moe.quant, src, self.geometry.slice(proj), role)
        self.written[proj][expert] = (source, row, (*roles, role._value_))

    def load_plan(self, index: CheckpointIndex, writer: FusedWriter, plan: LayerPlan) -> None:
        """`LayerLoad.load_plan`, with every slot recorded in this hook's ledger (a module that loads a
        plan and may later take tensors through `weight_loader` too)."""
        with gc_paused():  # a record per tensor: see storage/bulk.py
            self.ledger.record_blocks(plan.records)
            values: dict[tuple[Role, ...], tuple[str, ...]] = {}  # the role values of each set of roles, made once
            for proj in plan.fused.projections:
                written = self.written[proj]
                for expert in plan.fused.experts:
                    src = plan.sources[(expert, proj)]
                    roles = tuple(src.tensors)
                    if roles not in values:
                        values[roles] = tuple(role._value_ for role in roles)
                    written[expert] = (src.source._value_, src.expert_row, values[roles])
        super().load_plan(index, writer, plan)

    def missing_names(self, prefix: str) -> list[str]:
        """Checkpoint names (under `prefix`, e.g. 'model.layers.0.mlp.experts.') of the slots still missing."""
        names = set()
        for slot in self.ledger.missing():
            if slot.prefix != self.prefix:
                continue
            proj = Proj(slot.proj)
            alias, stacked = self.aliases.get(proj, (default_alias(proj), False))
            suffix = self.moe.quant.layout(Role(slot.role)).suffix
            names.add(f"{prefix}{alias}.{suffix}" if stacked else f"{prefix}{slot.expert}.{alias}.{suffix}")
        return sorted(names)
