"""Plan a load: which checkpoint tensors feed which fused slots on this rank.

Works from tensor names and headers only: nothing is read here. Experts that are
not local to the rank are dropped before any read, for every suffix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import repeat
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch

from ..errors import CheckpointError, FormatError, format_ranges
from ..formats import Role
from ..models.config import MoEConfig
from ..models.layer_specs import LayerSpec
from ..models.mtp import MTPLayers
from ..models.names import ExpertNameParser, ExpertTensorKey, Proj, Source, prefix_at_layer
from ..parallel.config import ParallelConfig
from ..parallel.partition import LayerGeometry
from ..storage.bulk import gc_paused
from ..storage.index import CheckpointIndex, TensorRef
from .fused import FusedSpec, layer_projections
from .keys import KeyRules
from .ledger import Block, BlockKey, Ledger, Slot
from .params import SourceTensors, check_header, expected_shape, storage_shape
from .specs import checked_layer_spec


@dataclass(frozen=True)
class LayerPlan:
    """Everything needed to load one MoE layer on one rank; `moe` is the config as this layer sees it
    (`quant`: the layer's own spec, `spec` says which rule gave it)."""

    prefix: str
    layer: int
    geometry: LayerGeometry
    fused: FusedSpec
    sources: dict[tuple[int, Proj], SourceTensors]
    moe: MoEConfig
    spec: LayerSpec
    mtp: bool = False  # an MTP (multi-token-prediction) layer
    records: tuple[Block, ...] = ()  # the names of every source of the local experts, by block of slots


@dataclass(frozen=True)
class CheckpointScan:
    """A checkpoint's tensor names split into routed-expert layers and the rest."""

    layers: dict[str, list[ExpertTensorKey]]
    others: tuple[str, ...]

    @property
    def module_names(self) -> frozenset[str]:
        """Every module name of the checkpoint (its tensor names without the last component)."""
        return frozenset([name.rpartition(".")[0] for name in self.others] +
                         [key.module_name for keys in self.layers.values() for key in keys])

    @classmethod
    def of(cls, index: CheckpointIndex) -> "CheckpointScan":
        """Parse every name once (the name regex once per name shape: `ExpertNameParser`)."""
        with gc_paused():  # one key per name: see bulk.py
            layers, others = ExpertNameParser().split(index.refs)
        return cls(dict(sorted(layers.items(), key=lambda kv: kv[1][0].layer)), tuple(sorted(others)))

    def mtp_prefixes(self, mtp: MTPLayers) -> tuple[str, ...]:
        """The experts prefixes of the scan that belong to MTP layers (declared by the config or not)."""
        return tuple(prefix for prefix in self.layers if mtp.index(prefix) is not None)

    def without(self, prefixes: tuple[str, ...]) -> "CheckpointScan":
        """This scan with the expert tensors of `prefixes` counted as non-expert tensors (`others`)."""
        if not prefixes:
            return self
        moved = [key.name for prefix in prefixes for key in self.layers[prefix]]
        return CheckpointScan({p: keys for p, keys in self.layers.items() if p not in prefixes},
                              tuple(sorted((*self.others, *moved))))


def plan_layers(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, ledger: Ledger,
                scan: CheckpointScan | None = None, tables: LayerTables | None = None) -> list[LayerPlan]:
    """Plan every MoE layer of the checkpoint for `parallel`'s rank. Plans of several ranks of one
    checkpoint share one `tables` (built from `index` and `moe`), so that what does not depend on the
    rank is worked out once."""
    scan = scan or CheckpointScan.of(index)
    tables = tables or LayerTables(index, moe)
    if not scan.layers:
        raise CheckpointError(f"{index.folder}: no routed-expert tensors found (names like "
                              f"model.layers.L.mlp.experts.E.gate_proj.qweight); {len(scan.others)} other tensors.")
    report_missing_layers(moe, scan, ledger)
    ledger.names = CheckpointNames(moe, scan)
    plans = []
    with gc_paused():  # tables, slots and sources per tensor: see bulk.py
        for prefix, keys in scan.layers.items():
            layer = keys[0].layer
            if moe.mtp.index(prefix) is not None:
                plans += plan_mtp_layer(index, moe, parallel, prefix, keys, ledger, tables)
                continue
            if layer not in moe.moe_layers:
                for key in keys:
                    ledger.reject(key.name, f"layer {layer} is not a MoE layer per config.json")
                continue
            plans.append(plan_layer(index, moe, parallel, prefix, keys, ledger, tables))
    return plans


class CheckpointNames:
    """The ledger's `SlotNames` for a checkpoint: a slot named as the checkpoint names that projection's
    tensors (module name taken from another expert of the layer, suffix from the format), and the summary of
    whole experts that config.json counts and the checkpoint lacks. Worked out only when a check fails."""

    def __init__(self, moe: MoEConfig, scan: CheckpointScan) -> None:
        self.moe, self.scan = moe, scan
        self._modules: dict[tuple[str, str], str] = {}

    def name(self, slot: Slot) -> str:
        """e.g. `model.layers.0.mlp.experts.8.down_proj.qzeros` (the slot's own text when the layer has no
        per-expert tensor of that projection to take the module name from)."""
        if not self._modules:
            self._modules = {(key.experts_prefix, key.source.value): key.module_name.rpartition(".")[2]
                             for keys in self.scan.layers.values() for key in keys
                             if key.expert is not None and len(key.source.projs) == 1}
        module = self._modules.get((slot.prefix, slot.proj))
        layout = self.moe.at_layer(slot.prefix).quant.layout(Role(slot.role))
        if module is None or layout is None:
            return str(slot)
        return f"{slot.prefix}.{slot.expert}.{module}.{layout.suffix}"

    def summary(self, missing: list[Slot]) -> str | None:
        """`config.json says 16 experts (num_experts), the checkpoint has experts 0–7 ...` when whole experts
        that the config counts have no tensor at all in some MoE layer; None otherwise."""
        lacking = {slot.prefix for slot in missing}
        present = {prefix: sorted({k.expert for k in keys if k.expert is not None})
                   for prefix, keys in self.scan.layers.items() if prefix in lacking}
        counts = {prefix: self.moe.layer(self.scan.layers[prefix][0].layer).num_experts for prefix in present}
        short = {prefix: ids for prefix, ids in present.items() if ids and len(ids) < counts[prefix]}
        if not short:
            return None
        prefix, ids = next(iter(short.items()))
        resolved = self.moe.resolution["routed expert count"] if self.moe.resolution is not None else None
        key = f" ({resolved.key})" if resolved is not None and resolved.key else ""
        where = f"in all {len(short)} MoE layers" if len(set(map(tuple, short.values()))) == 1 and len(short) > 1 \
            else f"in {prefix}" + (f" (and {len(short) - 1} more layers lack experts)" if len(short) > 1 else "")
        return (f"config.json says {counts[prefix]} experts{key}, the checkpoint has experts {format_ranges(ids)} "
                f"{where}: fix the expert count in config.json, or restore the missing expert tensors")


def report_missing_layers(moe: MoEConfig, scan: CheckpointScan, ledger: Ledger) -> None:
    """Every MoE layer of the config without expert tensors in the checkpoint, as a *missing* entry."""
    found = {keys[0].layer: prefix for prefix, keys in scan.layers.items() if moe.mtp.index(prefix) is None}
    example = next(iter(found.values()), None)
    why = "every layer" if moe.resolution is None else moe.resolution["MoE layers"].source
    for layer in moe.moe_layers:
        if layer not in found and example is not None:
            ledger.lack(f"{prefix_at_layer(example, layer)} (all experts of layer {layer})",
                        f"the config makes layer {layer} a MoE layer ({why}) but the checkpoint has no expert "
                        f"tensors for it")


MTP_FIX = "load with include_mtp=False (wna16-shard --no-mtp) to keep them as non-expert tensors"


def plan_mtp_layer(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, prefix: str,
                   keys: list[ExpertTensorKey], ledger: Ledger, tables: LayerTables) -> list[LayerPlan]:
    """The plan of an MTP layer's experts ([] when the config declares no such MTP layer: each tensor is
    then unexpected). Its spec is resolved like any layer's: 16-bit `.weight` experts (official Qwen3.5
    GPTQ-Int4 releases) load into the unquantized fused layout."""
    problem = moe.mtp.problem(prefix)
    if problem is not None:
        for key in keys:
            ledger.reject(key.name, f"{problem}; {MTP_FIX}")
        return []
    return [replace(plan_layer(index, moe, parallel, prefix, keys, ledger, tables), mtp=True)]


def plan_layer(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, prefix: str,
               keys: list[ExpertTensorKey], ledger: Ledger, tables: LayerTables | None = None) -> LayerPlan:
    """Plan one layer: its spec, EP filter, header checks, ledger entries."""
    table = (tables or LayerTables(index, moe)).layer(prefix, keys)
    moe = table.moe  # the layer's own spec from here on
    geometry = layer_geometry(moe, parallel, keys[0].layer)
    for name, why in table.rejects:
        ledger.reject(name, why)
    slots = table.slots(tuple(sorted(set(geometry.experts))))
    for key, experts in slots.expected:
        ledger.expect_block(key, experts)
    ledger.record_blocks(slots.records)
    table.check_headers(slots.checks, geometry.num_experts)  # each tensor's own error before cross-tensor checks
    fused = FusedSpec.of(geometry, moe.quant, _scale_dtype(prefix, slots.scales), gated=moe.gated,
                         activation=moe.activation)
    return LayerPlan(prefix=prefix, layer=keys[0].layer, geometry=geometry, fused=fused, sources=slots.sources,
                     moe=moe, spec=table.spec, records=slots.records)


EntryKey = tuple[int | None, Source]  # (expert, or None for a tensor stacked over experts; its source)
Column = tuple[Source, bool]  # a source kind, stacked over experts or not: one column of a layer's tensors


class LayerSlots(NamedTuple):
    """One layer's share for a set of local experts, for any rank that holds them: the first source of
    each (expert, projection), the (entry, source) pairs whose headers to check, the slots each
    block must fill, the names of every source found by block, and the scale dtypes found (dtype -> a
    tensor of that dtype)."""

    sources: dict[tuple[int, Proj], SourceTensors]
    checks: tuple[tuple[EntryKey, SourceTensors], ...]
    expected: tuple[tuple[BlockKey, tuple[int, ...]], ...]
    records: tuple[Block, ...]
    scales: dict[torch.dtype, str]


class LayerTable:
    """One layer's routed-expert tensors under one config, rank by rank the same: the tensors that feed no
    slot (name, why), the columns (source kind, stacked) -> {role: {expert or None: tensor name}} of the
    others, the `LayerSlots` of each set of local experts asked (refs made only for those experts: an EP
    rank's own) and the entries whose headers passed `check_headers`."""

    def __init__(self, index: CheckpointIndex, moe: MoEConfig, prefix: str, keys: list[ExpertTensorKey],
                 rules: KeyRules, spec: LayerSpec | None = None) -> None:
        self.moe, self.prefix = moe, prefix
        self.spec = spec or LayerSpec(moe.quant, "the top-level quantization_config")
        self.columns: dict[Column, dict[Role, dict[int | None, str]]] = {}
        self._refs = index.refs
        self.passed: set[EntryKey] = set()
        self._slots: dict[tuple[int, ...], LayerSlots] = {}
        cells, self.rejects = rules.sort_out(keys)
        columns, roles = self.columns, rules.roles
        for (source, stacked, suffix), names in cells.items():
            columns.setdefault((source, stacked), {}).setdefault(roles[suffix], {}).update(names)
        values = moe.layer(keys[0].layer)
        hidden, intermediate, self.num_experts = moe.hidden_size, values.intermediate_size, values.num_experts
        self._sizes = {source: source_sizes(hidden, intermediate, source) for source in Source}
        self._present = {column: frozenset().union(*names.values()) for column, names in columns.items()}
        required = tuple(role._value_ for role in required_roles(moe))
        self._projections = tuple((proj, proj._value_, required, self._columns_of(proj))
                                  for proj in layer_projections(moe.gated))
        self._proj_order = {proj: order for order, (proj, *_) in enumerate(self._projections)}

    def _columns_of(self, proj: Proj) -> tuple[Column, ...]:
        """The columns that hold `proj`, in the order they are tried: per expert, then stacked, by source."""
        return tuple(column for source in SOURCES_OF[proj] for column in ((source, False), (source, True))
                     if column in self.columns)

    def slots(self, experts: tuple[int, ...]) -> LayerSlots:
        """The `LayerSlots` of local `experts` (sorted), made when first asked."""
        if experts not in self._slots:
            sources, checks, dtypes = self._sources(experts)
            self._slots[experts] = LayerSlots(sources, tuple(checks), self._expected(experts),
                                              self._records(experts), self._scales(sources, dtypes))
        return self._slots[experts]

    def _sources(self, experts: tuple[int, ...]) -> tuple[dict[tuple[int, Proj], SourceTensors],
                                                          list[tuple[EntryKey, SourceTensors]], set[torch.dtype]]:
        """The first source of every (expert, projection) that has one, the (entry, source) header checks
        still to do, in expert order (none when every header matched in bulk: `_checked_refs`), and the
        dtypes of its scales. Gate and up of one gate_up source share it."""
        sources, checks, dtypes, made = {}, [], set(), {}
        refs, role = self._checked_refs(experts), self.moe.quant.dtype_role
        for order, (proj, _, _, columns) in enumerate(self._projections):
            for expert, column in self._first_columns(experts, columns):
                src = made.get((expert, column))
                if src is None:
                    src = made[(expert, column)] = self._source(column, expert, refs)
                    if refs is None:
                        checks.append((expert, order, (None if column[1] else expert, column[0]), src))
                    if role in src.tensors:
                        dtypes.add(src.tensors[role].dtype)
                sources[(expert, proj)] = src
        return sources, [(entry, src) for *_, entry, src in sorted(checks, key=lambda c: c[:2])], dtypes

    def _first_columns(self, experts: tuple[int, ...], columns: tuple[Column, ...]) -> Iterator[tuple[int, Column]]:
        """(expert, the first of `columns` that holds it) for each of `experts` that one holds (a stacked
        column holds every expert)."""
        rest: Sequence[int] = experts
        for column in columns:
            have = self._present[column]
            if column[1] or have.issuperset(rest):
                yield from zip(rest, repeat(column))
                return
            yield from ((expert, column) for expert in rest if expert in have)
            rest = [expert for expert in rest if expert not in have]

    def _checked_refs(self, experts: tuple[int, ...]) -> dict[Column, dict[Role, dict[int | None, TensorRef]]] | None:
        """The refs of every tensor of `experts` (and every stacked one), column by column and role by role,
        when each has the header the config implies (one bulk pass over each column: `TensorRefs.uniform`);
        None when any has not (then each source is checked alone, for that tensor's own error)."""
        out: dict[Column, dict[Role, dict[int | None, TensorRef]]] = {}
        quant, count = self.moe.quant, self.num_experts
        for column, roles in self.columns.items():
            (source, stacked), by_role = column, out.setdefault(column, {})
            for role, names in roles.items():
                at = [None] if stacked else [expert for expert in experts if expert in names]
                if not at:
                    continue
                layout = quant.layout(role)
                shape = storage_shape(layout, quant, *self._sizes[source], count if stacked else None)
                refs = self._refs.uniform([names[a] for a in at], shape, layout.dtypes)
                if refs is None:
                    return None
                by_role[role] = dict(zip(at, refs))
        return out

    def _source(self, column: Column, expert: int,
                refs: dict[Column, dict[Role, dict[int | None, TensorRef]]] | None) -> SourceTensors:
        (source, stacked), at = column, None if column[1] else expert
        if refs is None:
            tensors = {role: self._refs[names[at]] for role, names in self.columns[column].items() if at in names}
        else:
            tensors = {role: found[at] for role, found in refs[column].items() if at in found}
        return SourceTensors(source, tensors, expert if stacked else None, *self._sizes[source])

    def _expected(self, experts: tuple[int, ...]) -> tuple[tuple[BlockKey, tuple[int, ...]], ...]:
        """(block, experts) of every required slot of the local experts."""
        prefix = self.prefix
        return tuple(((prefix, value, role), experts) for _, value, required, _ in self._projections
                     for role in required)

    def _records(self, experts: tuple[int, ...]) -> tuple[Block, ...]:
        """The names of every source of the local experts, one `Block` per (projection, column, role),
        in the order the columns are tried (a slot filled twice lists its names in that order)."""
        blocks = []
        for _, value, _, columns in self._projections:
            for column in columns:
                for role, names in self.columns[column].items():
                    found = dict.fromkeys(experts, names[None]) if column[1] else \
                        {expert: names[expert] for expert in experts if expert in names}
                    if found:
                        blocks.append(Block((self.prefix, value, role._value_), found))
        return tuple(blocks)

    def _scales(self, sources: dict[tuple[int, Proj], SourceTensors], dtypes: set[torch.dtype]) -> dict[torch.dtype, str]:
        """Scale dtype -> the last scales tensor of that dtype (in expert, then projection order)."""
        role = self.moe.quant.dtype_role
        if len(dtypes) <= 1:
            last = next((src for src in reversed(sources.values()) if role in src.tensors), None)
            return {} if last is None else {last.tensors[role].dtype: last.tensors[role].name}
        ordered = sorted(sources.items(), key=lambda item: (item[0][0], self._proj_order[item[0][1]]))
        return {src.tensors[role].dtype: src.tensors[role].name for _, src in ordered if role in src.tensors}

    def check_headers(self, checks: Iterable[tuple[EntryKey, SourceTensors]], num_experts: int) -> None:
        """`check_headers` of the sources whose entries have not passed it yet (in order)."""
        todo = [(entry, src) for entry, src in checks if entry not in self.passed]
        check_headers(self.moe, [src for _, src in todo], num_experts)
        self.passed.update(entry for entry, _ in todo)


class LayerTables:
    """Every layer's `LayerTable` of one checkpoint (`index`) under one config (`moe`), made when first
    planned: the plans of all ranks (`wna16-shard`) share one, so 8 ranks cost little more than 1. Each
    layer's spec is resolved here, once (`specs.checked_layer_spec`); layers of one spec share KeyRules."""

    def __init__(self, index: CheckpointIndex, moe: MoEConfig, modules: frozenset[str] | None = None) -> None:
        self.index, self.moe, self.rules = index, moe, KeyRules(moe)
        self._layers: dict[str, LayerTable] = {}
        self._rules = {moe.quant: self.rules}
        self._modules = modules

    def layer(self, prefix: str, keys: list[ExpertTensorKey]) -> LayerTable:
        """The table of the layer whose keys (all of them, from the scan) are `keys`."""
        if prefix not in self._layers:
            spec = checked_layer_spec(self.moe, prefix, keys, self.index.refs, self._known())
            moe = self.moe if spec.spec == self.moe.quant else replace(self.moe, quant=spec.spec)
            rules = self._rules.setdefault(spec.spec, KeyRules(moe))
            self._layers[prefix] = LayerTable(self.index, moe, prefix, keys, rules, spec)
        return self._layers[prefix]

    def _known(self) -> frozenset[str]:
        """The checkpoint's module names, worked out only for rules that need them."""
        if self._modules is None:
            needed = self.moe.rules is not None and self.moe.rules.needs_modules
            self._modules = CheckpointScan.of(self.index).module_names if needed else frozenset()
        return self._modules


def check_headers(moe: MoEConfig, sources: Iterable[SourceTensors], num_experts: int) -> None:
    """dtype and shape of every tensor of `sources` against the layout and config: the expected shape of
    each (source kind, stacked or not, role) is computed once for the batch and compared with the
    header table; a mismatch raises `check_header`'s own error for that tensor."""
    wanted: dict[tuple[Source, bool, Role], tuple[tuple[torch.dtype, ...], tuple[int, ...]]] = {}
    for src in sources:
        for role, ref in src.tensors.items():
            key = (src.source, src.expert_row is None, role)
            if key not in wanted:
                layout = moe.quant.layout(role)
                wanted[key] = (layout.dtypes, expected_shape(layout, moe.quant, src, num_experts))
            dtypes, shape = wanted[key]
            if ref.shape != shape or ref.dtype not in dtypes:
                check_header(ref, moe.quant.layout(role), moe.quant, src, num_experts)


def layer_geometry(moe: MoEConfig, parallel: ParallelConfig, layer: int | None = None) -> LayerGeometry:
    """The validated sizes of MoE layer `layer` of `moe` on `parallel`'s rank (None: the first MoE layer's)."""
    values = moe.layer(layer) if layer is not None else moe.layer(moe.moe_layers[0] if moe.moe_layers else 0)
    return LayerGeometry(hidden=moe.hidden_size, intermediate=values.intermediate_size, num_experts=values.num_experts,
                         bits=moe.quant.bits, group_size=moe.quant.group_size, act_order=moe.quant.act_order,
                         parallel=parallel)


def sizes_source_tensors(hidden: int, intermediate: int, source: Source, tensors: dict[Role, TensorRef],
                         expert_row: int | None) -> SourceTensors:
    """SourceTensors of one checkpoint source of a layer with sizes H = `hidden`, I = `intermediate`."""
    return SourceTensors(source, tensors, expert_row, *source_sizes(hidden, intermediate, source))


def source_sizes(hidden: int, intermediate: int, source: Source) -> tuple[int, int]:
    """(N, K) of a whole `source` tensor of a layer with sizes H = `hidden`, I = `intermediate`."""
    n_one = hidden if source is Source.DOWN else intermediate
    return n_one * len(source.projs), intermediate if source is Source.DOWN else hidden


def required_roles(moe: MoEConfig) -> list[Role]:
    """The roles the format requires of every projection (e.g. qweight, scales; qzeros when asymmetric)."""
    return list(dict.fromkeys(layout.role for layout in moe.quant.layouts if moe.quant.required(layout)))


def expect_projection(ledger: Ledger, moe: MoEConfig, prefix: str, expert: int, proj: Proj) -> None:
    """Declare every role the format requires for one projection of one local expert."""
    ledger.expect_slots(Slot.of(prefix, expert, proj, role) for role in required_roles(moe))


SOURCES_OF: dict[Proj, tuple[Source, ...]] = {proj: tuple(s for s in Source if proj in s.projs) for proj in Proj}


def _scale_dtype(prefix: str, found: dict[torch.dtype, str]) -> torch.dtype:
    """The one dtype of a layer's scales (`found`: dtype -> a tensor of that dtype; float16 when none)."""
    if len(found) > 1:
        raise FormatError(f"{prefix}: scales use several dtypes {[(str(d), n) for d, n in found.items()]}; one "
                          f"layer's fused scales need one dtype.")
    return next(iter(found), torch.float16)
