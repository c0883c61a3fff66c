"""What a checkpoint's MoE layers hold, rank by rank the same: each layer's tensors as columns (source kind,
stacked) -> {role: {expert: name}}, the tensors that feed no slot, and the sources, header checks and ledger
blocks of each set of local experts, worked out once (`LayerTables`: the plans of every rank share them).

| LayerTables(index, moe).layer(names)        | the layer's `LayerTable` (its spec resolved once)          |
| LayerTable.slots(experts)                   | `LayerSlots`: sources, checks, expected and written blocks |
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from itertools import repeat
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch

from ..formats import Role
from ..models.config import MoEConfig
from ..models.layer_specs import LayerSpec
from ..models.names import LayerNames, Proj, Source
from ..storage.index import CheckpointIndex, TensorRef
from .fused import layer_projections
from .keys import KeyRules
from .ledger import Block, BlockKey
from .params import SourceTensors, check_header, expected_shape, storage_shape
from .scan import CheckpointScan
from .specs import checked_layer_spec

# A source from a tuple of its fields: the C-level tuple constructor (the named tuple's own __new__ is Python).
_make_source = partial(tuple.__new__, SourceTensors)
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

    def __init__(self, index: CheckpointIndex, moe: MoEConfig, names: LayerNames, rules: KeyRules,
                 spec: LayerSpec | None = None) -> None:
        self.moe, self.prefix = moe, names.prefix
        self.spec = spec or LayerSpec(moe.quant, "the top-level quantization_config")
        self.columns: dict[Column, dict[Role, dict[int | None, str]]] = {}
        self._refs = index.refs
        self.passed: set[EntryKey] = set()
        self._slots: dict[tuple[int, ...], LayerSlots] = {}
        cells, self.rejects = rules.sort_out(names)
        columns, roles = self.columns, rules.roles
        for (source, stacked, suffix), cell in cells.items():  # the scan's cells, shared (never written)
            by_role, role = columns.setdefault((source, stacked), {}), roles[suffix]
            by_role[role] = {**by_role[role], **cell} if role in by_role else cell
        values = moe.layer(names.layer)
        hidden, intermediate, self.num_experts = moe.hidden_size, values.intermediate_size, values.num_experts
        self._sizes = {source: source_sizes(hidden, intermediate, source) for source in Source}
        self._present = {column: frozenset().union(*by_role.values()) for column, by_role in columns.items()}
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
        sources, checks, dtypes, made, whole = {}, [], set(), {}, {}
        refs, role = self._checked_refs(experts), self.moe.quant.dtype_role
        for order, (proj, _, _, columns) in enumerate(self._projections):
            if columns and columns[0] not in whole:
                whole[columns[0]] = self._whole_column(columns[0], experts, refs)
            if columns and whole[columns[0]] is not None:  # every expert's from one column: made in bulk
                sources.update(zip(zip(experts, repeat(proj)), whole[columns[0]]))
                dtypes.update(src.tensors[role].dtype for src in whole[columns[0]][:1] if role in src.tensors)
                continue
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

    def _whole_column(self, column: Column, experts: tuple[int, ...],
                      refs: dict[Column, dict[Role, dict[int | None, TensorRef]]] | None) -> list[SourceTensors] | None:
        """The sources of all `experts` from per-expert `column` when it holds every role it has for every one of
        them and their refs are checked (one dtype per role: `TensorRefs.uniform`); None otherwise."""
        if refs is None or column[1] or not experts:
            return None
        by_role = refs[column]
        if not by_role or any(len(found) != len(experts) for found in by_role.values()):
            return None
        roles, (source, _), (n_total, k_total) = list(by_role), column, self._sizes[column[0]]
        tensors = map(dict, map(partial(zip, roles), zip(*(found.values() for found in by_role.values()))))
        return list(map(_make_source, zip(repeat(source), tensors, repeat(None), repeat(n_total), repeat(k_total))))

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

    def _scales(self, sources: dict[tuple[int, Proj], SourceTensors],
                dtypes: set[torch.dtype]) -> dict[torch.dtype, str]:
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

    def layer(self, names: LayerNames) -> LayerTable:
        """The table of the layer whose routed-expert tensors (all of them, from the scan) are `names`."""
        prefix = names.prefix
        if prefix not in self._layers:
            spec = checked_layer_spec(self.moe, names, self.index.refs, self._known())
            moe = self.moe if spec.spec == self.moe.quant else replace(self.moe, quant=spec.spec)
            rules = self._rules.setdefault(spec.spec, KeyRules(moe))
            self._layers[prefix] = LayerTable(self.index, moe, names, rules, spec)
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


SOURCES_OF: dict[Proj, tuple[Source, ...]] = {proj: tuple(s for s in Source if proj in s.projs) for proj in Proj}
