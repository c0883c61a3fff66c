"""The engine-style load hook: whole per-expert checkpoint tensors in, this rank's fused slice out.

An engine walks the checkpoint and hands every routed-expert tensor, whole, to
`weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)` (vLLM's
calling convention). `ExpertLoadHook` keeps the tensors of one (expert,
projection) in a `TensorStore` until every role the format requires has
arrived, then reads the rank's slice through the same `ExpertLoadHook.write` as
`load_experts` (which passes whole runs of experts at once) and the same `FusedWriter`. Tensors of non-local
experts are refused before anything is kept or converted.

| shard_id | projection | fused rows                        |
|----------|------------|-----------------------------------|
| "w1"     | gate       | w13 rows [0, I_p)                 |
| "w3"     | up         | w13 rows [I_p, 2*I_p)             |
| "w2"     | down       | w2, row-parallel along I          |

Non-gated experts (e.g. Nemotron-H) have no "w1": "w3" fills w13 rows [0, I_p).

Per call the hook costs about a dict lookup: the name is classified in O(1) (`ExpertNameParser`: the
regex runs once per name shape, then split and dict lookups), the kind-level checks (suffix, source,
header shape and dtype) are worked out once per (suffix, source, stacked, shard id) and then compared,
and a non-local expert returns before anything is kept. The tensor is held as it is (a reference: no
copy, no conversion). Complete projections are written in batches: a projection's batch is written
once every local expert of the layer has it (the engine's usual order: a layer's tensors one after the
other), or once HOOK_BATCH_BYTES are held, or at `flush()` (which every reader of the module's
parameters or ledger calls first); a batch is read and written through `LayerLoad.write`, a run of
consecutive slots at a time, exactly as `load_experts` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from ..errors import FormatError
from ..formats import Role
from ..load.fused import FusedWriter, layer_projections
from ..load.keys import STACKED_SOURCES, KeyRules, expert_key_problem
from ..load.layer import LayerLoad
from ..load.ledger import Ledger
from ..load.params import SourceTensors, check_dropped_role, check_header, expected_shape
from ..load.plan import LayerPlan, sizes_source_tensors
from ..models.config import MoEConfig
from ..models.names import ExpertNameParser, ExpertTensorKey, Proj, Source, parse_expert_name
from ..parallel.partition import LayerGeometry
from ..storage.bulk import gc_paused
from ..storage.index import CheckpointIndex, TensorRef
from .mapping import ShardId, default_alias

MEMORY_FILE = "<memory>"  # TensorRef.file of a tensor handed over by an engine
HOOK_BATCH_BYTES = 64 << 20  # complete projections held before they are written (bounds the hook's memory)


class TensorStore:
    """Whole in-memory tensors, read like a CheckpointIndex: `read(ref, index)` is `tensor[index]` on the CPU.

    Each `hold` of a name is matched by one `release`; the tensor is dropped at the last one. `nbytes`: the
    bytes of the tensors held.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._holds: dict[str, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._tensors)

    def hold(self, ref: TensorRef, tensor: torch.Tensor) -> TensorRef:
        """Keep `tensor` under `ref.name` until released."""
        holds = self._holds.get(ref.name, 0)
        if not holds:
            self.nbytes += tensor.numel() * tensor.element_size()
        self._tensors[ref.name] = tensor
        self._holds[ref.name] = holds + 1
        return ref

    def release(self, ref: TensorRef) -> None:
        """Drop one hold of `ref`; the tensor goes with the last."""
        self._holds[ref.name] -= 1
        if not self._holds[ref.name]:
            tensor = self._tensors.pop(ref.name)
            self.nbytes -= tensor.numel() * tensor.element_size()
            del self._holds[ref.name]

    def read(self, ref: TensorRef, index: tuple[slice | int, ...] = ()) -> torch.Tensor:
        """`tensor[index]` (basic slices and ints), on the CPU."""
        tensor = self._tensors[ref.name]
        out = (tensor[index] if index else tensor).to("cpu")
        return out

    view = read  # the TensorReader name: the held tensor is the caller's, so a view is as safe as it

    def gather(self, refs: Sequence[TensorRef], indices: Sequence[tuple[slice | int, ...]], *,
               pin: bool = False) -> torch.Tensor:
        """`[view(ref, index) ...]` stacked into fresh CPU memory (pinned with `pin`)."""
        views = [self.view(ref, index) for ref, index in zip(refs, indices)]
        return torch.stack(views, out=torch.empty((len(views), *views[0].shape), dtype=views[0].dtype,
                                                  pin_memory=pin))

    def view_stacked(self, refs: Sequence[TensorRef], indices: Sequence[tuple[slice | int, ...]]) -> None:
        """Held tensors are separate objects, never one strided view: None (the reader then gathers)."""
        return None

    @classmethod
    def of(cls, ref: TensorRef, tensor: torch.Tensor) -> "TensorStore":
        """A store holding one tensor."""
        store = cls()
        store.hold(ref, tensor)
        return store


class Arrival(NamedTuple):
    """What one weight_loader call delivers, resolved from its name and arguments (a named tuple: one per call)."""

    source: Source
    role: Role
    expert: int | None  # None: stacked over experts
    alias: str  # checkpoint module name of the projection, e.g. gate_proj


class Kind(NamedTuple):
    """What every tensor of one (alias, suffix, stacked, projection) shares once one of them passed every
    check: its source and role, and the header the config implies (allowed dtypes, shape)."""

    source: Source
    role: Role
    dtypes: tuple[torch.dtype, ...]
    shape: tuple[int, ...]


_SHARD_PROJS: dict[str | ShardId, Proj] = {**{s.value: s.proj for s in ShardId}, **{s: s.proj for s in ShardId}}


@dataclass
class Collected:
    """The tensors of one (expert, projection) received so far."""

    source: Source
    expert_row: int | None
    refs: dict[Role, TensorRef]


# What is left of a written (expert, projection), kept for the module's life: (source value, expert row,
# role values). A plain tuple of strings and ints, which the garbage collector stops tracking (named tuples
# and objects stay tracked; see `Ledger`'s note).
Written = tuple[str, "int | None", tuple[str, ...]]


def written_record(entry: Collected) -> Written:
    """The record of a written `Collected`."""
    return entry.source._value_, entry.expert_row, tuple(role._value_ for role in entry.refs)


class ExpertLoadHook(LayerLoad):
    """Collects whole checkpoint tensors of one layer and writes this rank's slice of each projection.

    The ledger records every (expert, projection, role) slot filled, so `Ledger.check`
    reports what is missing or duplicated. `accept` takes a writer factory, called
    only for tensors this rank keeps. Complete projections wait in `ready` until their batch
    is written (see the module docstring); `flush()` writes every one of them now.
    """

    def __init__(self, prefix: str, moe: MoEConfig, geometry: LayerGeometry, ledger: Ledger, *,
                 allow_nonfinite: bool = False) -> None:
        super().__init__(prefix, moe, geometry, allow_nonfinite=allow_nonfinite)
        self.ledger = ledger
        self.required = frozenset(lay.role for lay in moe.quant.layouts if moe.quant.required(lay))
        self.local = frozenset(geometry.experts)
        self.store = TensorStore()
        self.pending: dict[tuple[int, Proj], Collected] = {}
        self.written: dict[Proj, dict[int, Written]] = {proj: {} for proj in Proj}
        self.ready: dict[Proj, dict[int, None]] = {}  # complete, not written yet (insertion-ordered sets)
        self.done: dict[Proj, int] = {}  # experts written per projection
        self.aliases: dict[Proj, tuple[str, bool]] = {}  # proj -> (checkpoint module name, stacked)
        self._parse = ExpertNameParser()
        self._rules = KeyRules(moe)
        self._kinds: dict[tuple[str, str, bool, Proj], Kind] = {}
        self._slots = {expert: i for i, expert in enumerate(geometry.experts)}
        self._writer: Callable[[], FusedWriter] | None = None

    def accept(self, writer: Callable[[], FusedWriter], loaded: torch.Tensor, weight_name: str,
               shard_id: str | ShardId, expert_id: int | None) -> bool:
        """Take one whole checkpoint tensor; False (nothing kept or converted) when no local expert needs it."""
        proj = _SHARD_PROJS.get(shard_id) if isinstance(shard_id, (str, ShardId)) else None
        key = self._parse(weight_name) if proj is not None else None
        kind = None if key is None else self._kind_of(key, weight_name, proj, expert_id)
        if kind is None:  # anything unusual: the checked path (which raises the error, if any)
            return self._accept_checked(writer, loaded, weight_name, shard_id, expert_id)
        if key.expert is not None and key.expert not in self.local:
            return False
        if loaded.shape != kind.shape or loaded.dtype not in kind.dtypes:
            return self._accept_checked(writer, loaded, weight_name, shard_id, expert_id)
        fused = writer()  # fails early when the parameters are not materialised
        self._writer = writer
        ref = TensorRef(weight_name, MEMORY_FILE, kind.shape, loaded.dtype)
        arrival = Arrival(kind.source, kind.role, key.expert, weight_name.rsplit(".", 2)[-2])
        self.aliases[proj] = (arrival.alias, key.expert is None)
        for expert in self.geometry.experts if key.expert is None else (key.expert,):
            self._arrive(fused, loaded, ref, expert, proj, arrival)
        self.tensors += 1
        return True

    def _kind_of(self, key: ExpertTensorKey, weight_name: str, proj: Proj, expert_id: int | None) -> Kind | None:
        """The tensor's kind when every check of `_resolve` is known to pass for it (its kind passed
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
        arrival = self._resolve(weight_name, proj, expert_id)
        experts = self.geometry.experts if arrival.expert is None else \
            ((arrival.expert,) if arrival.expert in self.local else ())
        if not experts:
            return False
        fused = writer()  # fails early when the parameters are not materialised
        self._writer = writer
        ref = TensorRef(weight_name, MEMORY_FILE, tuple(loaded.shape), loaded.dtype)
        row = None if arrival.expert is not None else experts[0]
        layout = self.moe.quant.layout(arrival.role)
        src = self._source(arrival.source, {arrival.role: ref}, row)
        check_header(ref, layout, self.moe.quant, src, self.geometry.num_experts)
        if parse_expert_name(weight_name) is not None:
            self._kinds[(arrival.alias, weight_name.rpartition(".")[2], arrival.expert is None, proj)] = Kind(
                arrival.source, arrival.role, layout.dtypes,
                expected_shape(layout, self.moe.quant, src, self.geometry.num_experts))
        self.aliases[proj] = (arrival.alias, arrival.expert is None)
        for expert in experts:
            self._arrive(fused, loaded, ref, expert, proj, arrival)
        self.tensors += 1
        return True

    def _resolve(self, weight_name: str, proj: Proj, expert_id: int | None) -> Arrival:
        """Source, role and expert of a tensor, from its checkpoint name (or a bare suffix and expert_id)."""
        key = parse_expert_name(weight_name)
        if key is None:
            suffix, source, expert, alias = weight_name.rsplit(".", 1)[-1], Source(proj.value), expert_id, None
        else:
            suffix, source, expert = key.suffix, key.source, key.expert
            alias = key.module_name.rsplit(".", 1)[-1]
            if expert_id is not None and expert_id != key.expert:
                raise FormatError(f"{weight_name}: expert_id={expert_id} but the name says expert {key.expert} "
                                  f"(None: stacked over experts); pass the id the name carries.")
        layout = self.moe.quant.layout_for_suffix(suffix)
        if layout is None:
            raise FormatError(f"{weight_name}: suffix {suffix!r} is not a {self.moe.quant.format_name} expert "
                              f"tensor; expected one of {sorted(lay.suffix for lay in self.moe.quant.layouts)}. "
                              f"Pass the checkpoint tensor's own name as weight_name.")
        self._check_ids(weight_name, proj, source, expert)
        problem = None if key is None else expert_key_problem(self.moe, key)
        if problem is not None:
            raise FormatError(f"{weight_name}: {problem}; no fused parameter takes it.")
        return Arrival(source, layout.role, expert, alias or default_alias(proj))

    def _check_ids(self, weight_name: str, proj: Proj, source: Source, expert: int | None) -> None:
        if proj not in source.projs:
            raise FormatError(f"{weight_name}: shard_id {ShardId.of_proj(proj).value!r} means {proj.value}, but the "
                              f"tensor holds {[p.value for p in source.projs]}; use shard_id "
                              f"{[ShardId.of_proj(p).value for p in source.projs]}.")
        count = self.geometry.num_experts
        if expert is None and source not in STACKED_SOURCES:
            raise FormatError(f"{weight_name}: no expert id, and only gate_up_proj and down_proj tensors stack "
                              f"over experts; pass expert_id (0..{count - 1}).")
        if expert is not None and not 0 <= expert < count:
            raise FormatError(f"{weight_name}: expert id {expert} is outside 0..{count - 1} "
                              f"(the config declares {count} experts).")

    @property
    def projections(self) -> tuple[Proj, ...]:
        """The projections of this layer's experts (no gate for non-gated experts)."""
        return layer_projections(self.moe.gated)

    def _source(self, source: Source, refs: dict[Role, TensorRef], row: int | None) -> SourceTensors:
        """SourceTensors at this layer's own sizes."""
        return sizes_source_tensors(self.geometry.hidden, self.geometry.intermediate, source, refs, row)

    def _arrive(self, writer: FusedWriter, loaded: torch.Tensor, ref: TensorRef, expert: int, proj: Proj,
                arrival: Arrival) -> None:
        """Record one role of (expert, proj); once every required role is here the projection is ready,
        and its batch is written when complete (or when HOOK_BATCH_BYTES are held)."""
        self.ledger.record(self.prefix, expert, proj, arrival.role, ref.name)
        key, row = (expert, proj), (expert if arrival.expert is None else None)
        done = self.written[proj].get(expert)
        if done is not None:
            self._late(done, loaded, ref, expert, proj, arrival.role)
            return
        entry = self.pending.get(key)
        if entry is None:
            entry = self.pending[key] = Collected(arrival.source, row, {})
        elif (entry.source, entry.expert_row) != (arrival.source, row):
            raise FormatError(f"{ref.name}: {self.prefix} expert {expert} {proj.value} already has tensors from "
                              f"{sorted(r.name for r in entry.refs.values())}; one projection must come from one "
                              f"source ({entry.source.value} {'stacked' if entry.expert_row is not None else ''}).")
        ready = self.ready.setdefault(proj, {})
        if arrival.role in entry.refs:
            if expert in ready:  # a duplicate of a complete projection: the first stays (the ledger reports it)
                return
            self.store.release(entry.refs[arrival.role])  # a duplicate: the ledger reports it; keep the newest
        entry.refs[arrival.role] = self.store.hold(ref, loaded)
        if expert not in ready and self.required <= entry.refs.keys():
            ready[expert] = None
            if len(ready) + self.done.get(proj, 0) >= len(self.local):
                self._flush(proj)
            elif self.store.nbytes >= HOOK_BATCH_BYTES:
                self.flush()

    def flush(self) -> None:
        """Write every complete projection not written yet (a run of consecutive slots at a time)."""
        for proj in list(self.ready):
            self._flush(proj)

    def _flush(self, proj: Proj) -> None:
        ready = self.ready.get(proj)
        if not ready:
            return
        assert self._writer is not None, "a projection is ready, so a tensor was accepted"
        writer = self._writer()
        for run in self._runs(sorted(ready, key=self._slots.__getitem__), proj):
            entries = [self.pending[(expert, proj)] for expert in run]
            self.write(self.store, writer, run, proj,
                       tuple(self._source(e.source, e.refs, e.expert_row) for e in entries))
            for expert, entry in zip(run, entries):
                for held in entry.refs.values():
                    self.store.release(held)
                self.written[proj][expert] = written_record(self.pending.pop((expert, proj)))
                del ready[expert]
            self.done[proj] = self.done.get(proj, 0) + len(run)
        del self.ready[proj]

    def _runs(self, experts: list[int], proj: Proj) -> list[tuple[int, ...]]:
        """`experts` (in slot order) cut into runs of consecutive slots whose `proj` comes from one source
        kind with one set of roles: each run is one `write`."""
        runs: list[list[int]] = []
        last = None
        for expert in experts:
            entry = self.pending[(expert, proj)]
            shape = (entry.source, entry.expert_row is None, entry.refs.keys())
            if runs and shape == last[1] and self._slots[expert] == self._slots[last[0]] + 1:
                runs[-1].append(expert)
            else:
                runs.append([expert])
            last = (expert, shape)
        return [tuple(run) for run in runs]

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
            self.ledger.record_slots(plan.records)
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
