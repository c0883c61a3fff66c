"""Plan a load: which checkpoint tensors feed which fused slots on this rank.

Works from tensor names and headers only: nothing is read here. Experts that are
not local to the rank are dropped before any read, for every suffix.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch

from .checkpoint import CheckpointIndex, TensorRef
from .errors import CheckpointError, FormatError
from .extract import SourceTensors, check_header, expected_shape
from .formats import Role
from .fused import FusedSpec, layer_projections
from .ledger import Ledger
from .modelconfig import MoEConfig
from .names import ExpertTensorKey, Proj, Source, parse_expert_name, prefix_at_layer
from .parallel import ParallelConfig
from .sharding import LayerGeometry

STACKED_SOURCES = (Source.GATE_UP, Source.DOWN)


@dataclass(frozen=True)
class LayerPlan:
    """Everything needed to load one MoE layer on one rank."""

    prefix: str
    layer: int
    geometry: LayerGeometry
    fused: FusedSpec
    sources: dict[tuple[int, Proj], SourceTensors]


@dataclass(frozen=True)
class CheckpointScan:
    """A checkpoint's tensor names split into routed-expert layers and the rest."""

    layers: dict[str, list[ExpertTensorKey]]
    others: tuple[str, ...]

    @classmethod
    def of(cls, index: CheckpointIndex) -> "CheckpointScan":
        """Parse every name once."""
        layers: dict[str, list[ExpertTensorKey]] = defaultdict(list)
        others = []
        for name in index.refs:
            key = parse_expert_name(name)
            if key is None:
                others.append(name)
            else:
                layers[key.experts_prefix].append(key)
        return cls(dict(sorted(layers.items(), key=lambda kv: kv[1][0].layer)), tuple(sorted(others)))


def plan_layers(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, ledger: Ledger,
                scan: CheckpointScan | None = None) -> list[LayerPlan]:
    """Plan every MoE layer of the checkpoint for `parallel`'s rank."""
    scan = scan or CheckpointScan.of(index)
    if not scan.layers:
        raise CheckpointError(f"{index.folder}: no routed-expert tensors found (names like "
                              f"model.layers.L.mlp.experts.E.gate_proj.qweight); {len(scan.others)} other tensors.")
    report_missing_layers(moe, scan, ledger)
    plans = []
    for prefix, keys in scan.layers.items():
        layer = keys[0].layer
        if layer not in moe.moe_layers:
            for key in keys:
                ledger.reject(key.name, f"layer {layer} is not a MoE layer per config.json")
            continue
        plans.append(plan_layer(index, moe, parallel, prefix, keys, ledger))
    return plans


def report_missing_layers(moe: MoEConfig, scan: CheckpointScan, ledger: Ledger) -> None:
    """Every MoE layer of the config without expert tensors in the checkpoint, as a *missing* entry."""
    found = {keys[0].layer: prefix for prefix, keys in scan.layers.items()}
    example = next(iter(found.values()), None)
    why = "every layer" if moe.resolution is None else moe.resolution["MoE layers"].source
    for layer in moe.moe_layers:
        if layer not in found and example is not None:
            ledger.lack(f"{prefix_at_layer(example, layer)} (all experts of layer {layer})",
                        f"the config makes layer {layer} a MoE layer ({why}) but the checkpoint has no expert "
                        f"tensors for it")


def plan_layer(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, prefix: str,
               keys: list[ExpertTensorKey], ledger: Ledger) -> LayerPlan:
    """Plan one layer: EP filter, header checks, ledger entries."""
    layer = keys[0].layer
    geometry = layer_geometry(moe, parallel, layer)
    local = set(geometry.experts)
    entries = _group_entries(index, moe, keys, local, ledger)
    sources: dict[tuple[int, Proj], SourceTensors] = {}
    for expert in sorted(local):
        for proj in layer_projections(moe.gated):
            candidates = [_source(geometry, entries[ek], ek, expert) for ek in _candidates(entries, expert, proj)]
            _record(ledger, moe, prefix, expert, proj, candidates)
            if candidates:
                sources[(expert, proj)] = candidates[0]
    check_headers(moe, sources.values(), geometry.num_experts)  # each tensor's own error before cross-tensor checks
    fused = FusedSpec.of(geometry, moe.quant, _scale_dtype(prefix, sources), gated=moe.gated,
                         activation=moe.activation)
    return LayerPlan(prefix=prefix, layer=keys[0].layer, geometry=geometry, fused=fused, sources=sources)


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
    n_one = hidden if source is Source.DOWN else intermediate
    k_total = intermediate if source is Source.DOWN else hidden
    return SourceTensors(source=source, tensors=tensors, expert_row=expert_row, n_total=n_one * len(source.projs),
                         k_total=k_total)


def expect_projection(ledger: Ledger, moe: MoEConfig, prefix: str, expert: int, proj: Proj) -> None:
    """Declare every role the format requires for one projection of one local expert."""
    for layout in moe.quant.layouts:
        if moe.quant.required(layout):
            ledger.expect(prefix, expert, proj, layout.role)


EntryKey = tuple[int | None, Source]


def _group_entries(index: CheckpointIndex, moe: MoEConfig, keys: list[ExpertTensorKey], local: set[int],
                   ledger: Ledger) -> dict[EntryKey, dict]:
    """(expert or None, source) -> {role: ref}, for local experts and stacked tensors only."""
    entries: dict[EntryKey, dict] = defaultdict(dict)
    for key in keys:
        problem = expert_key_problem(moe, key)
        if problem is not None:
            ledger.reject(key.name, problem)
        elif key.expert is None or key.expert in local:
            layout = moe.quant.layout_for_suffix(key.suffix)
            assert layout is not None, "expert_key_problem checks the suffix"
            entries[(key.expert, key.source)][layout.role] = index.refs[key.name]
    return entries


def expert_key_problem(moe: MoEConfig, key: ExpertTensorKey) -> str | None:
    """Why routed-expert tensor `key` feeds no fused slot under `moe` (None when it does): the one rule
    shared by the planner, the engine hook and the name mapping."""
    if moe.quant.layout_for_suffix(key.suffix) is None:
        return f"suffix {key.suffix!r} is not a {moe.quant.format_name} expert tensor"
    if not moe.gated and Proj.GATE in key.source.projs:
        return f"a {key.source.value} tensor, but {moe.family} experts are not gated (up and down projections only)"
    if key.expert is None and key.source not in STACKED_SOURCES:
        return f"a stacked {key.source.value} tensor; only gate_up_proj and down_proj stack"
    count = moe.layer(key.layer).num_experts
    if key.expert is not None and key.expert >= count:
        return f"expert id {key.expert} >= expert count {count}"
    if not moe.quant.modules.covers(key.module_name):
        return "its module is excluded by the quantization config (targets/ignore)"
    return None


SOURCES_OF: dict[Proj, tuple[Source, ...]] = {proj: tuple(s for s in Source if proj in s.projs) for proj in Proj}


def _candidates(entries: dict[EntryKey, dict], expert: int, proj: Proj) -> list[EntryKey]:
    """Entries that hold `proj` of `expert`: its own per-expert sources, then stacked ones (O(1) lookups)."""
    return [ek for source in SOURCES_OF[proj] for ek in ((expert, source), (None, source)) if ek in entries]


def _source(geometry: LayerGeometry, tensors: dict, entry: EntryKey, expert: int) -> SourceTensors:
    return sizes_source_tensors(geometry.hidden, geometry.intermediate, entry[1], tensors,
                                expert if entry[0] is None else None)


def _record(ledger: Ledger, moe: MoEConfig, prefix: str, expert: int, proj: Proj,
            candidates: list[SourceTensors]) -> None:
    expect_projection(ledger, moe, prefix, expert, proj)
    for src in candidates:
        for role, ref in src.tensors.items():
            ledger.record(prefix, expert, proj, role, ref.name)


def _scale_dtype(prefix: str, sources: dict[tuple[int, Proj], SourceTensors]) -> torch.dtype:
    found = {src.tensors[Role.SCALES].dtype: src.tensors[Role.SCALES].name
             for src in sources.values() if Role.SCALES in src.tensors}
    if len(found) > 1:
        raise FormatError(f"{prefix}: scales use several dtypes {[(str(d), n) for d, n in found.items()]}; one "
                          f"layer's fused scales need one dtype.")
    return next(iter(found), torch.float16)
