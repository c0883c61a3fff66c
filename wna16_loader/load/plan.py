"""Plan a load: which checkpoint tensors feed which fused slots on this rank.

Works from tensor names and headers only: nothing is read here. Experts that are
not local to the rank are dropped before any read, for every suffix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from ..errors import CheckpointError, FormatError, format_ranges
from ..formats import Role
from ..models.config import TABLE, MoEConfig
from ..models.families import family_of
from ..models.layer_specs import LayerSpec
from ..models.names import LayerNames, Proj, expert_like, prefix_at_layer
from ..parallel.config import ParallelConfig
from ..parallel.partition import LayerGeometry
from ..storage.bulk import gc_paused
from ..storage.index import CheckpointIndex
from .fused import FusedSpec
from .ledger import Block, Ledger, Slot
from .params import SourceTensors
from .scan import CheckpointScan
from .tables import LayerTables, required_roles

SHOWN_NAMES = 5  # names quoted in a message


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


def plan_layers(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, ledger: Ledger,
                scan: CheckpointScan | None = None, tables: LayerTables | None = None) -> list[LayerPlan]:
    """Plan every MoE layer of the checkpoint for `parallel`'s rank. Plans of several ranks of one
    checkpoint share one `tables` (built from `index` and `moe`), so that what does not depend on the
    rank is worked out once."""
    scan = scan or CheckpointScan.of(index)
    tables = tables or LayerTables(index, moe)
    if not scan.layers:
        raise no_experts_error(index.folder, moe, scan.others)
    report_missing_layers(moe, scan, ledger)
    ledger.names = CheckpointNames(moe, scan)
    plans = []
    with gc_paused():  # tables, slots and sources per tensor: see bulk.py
        for prefix, names in scan.layers.items():
            if moe.mtp.index(prefix) is not None:
                plans += plan_mtp_layer(index, moe, parallel, names, ledger, tables)
                continue
            if names.layer not in moe.moe_layers:
                for name in names.names:
                    ledger.reject(name, f"layer {names.layer} is not a MoE layer per config.json")
                continue
            plans.append(plan_layer(index, moe, parallel, names, ledger, tables))
    return plans


def no_experts_error(folder: Path, moe: MoEConfig, names: Sequence[str]) -> CheckpointError:
    """The error for a checkpoint none of whose tensor names parses as a routed-expert tensor: the family
    row, the names it looked for, the first names that look like experts, and the row to extend."""
    row = family_of(moe.family)
    shown, count = expert_like(names, SHOWN_NAMES)
    found = (f"its first names that look like experts ({count} of its {len(names)} tensors): {shown}" if count else
             f"none of its {len(names)} tensor names looks like an expert tensor (first: {list(names[:SHOWN_NAMES])})")
    return CheckpointError(f"{folder}: no routed-expert tensor found. config.json resolves to the {row.name!r} "
                           f"row of the families table ({TABLE}), which looks for {list(row.patterns())}; {found}. "
                           f"If these are this model's experts, extend the {row.name!r} row (its roots, modules "
                           f"or projections) to name them; if the checkpoint has no routed experts, it is not a "
                           f"MoE checkpoint this package loads.")


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
        present = {prefix: sorted({e for (_, stacked, _), cell in names.cells.items() if not stacked for e in cell})
                   for prefix, names in self.scan.layers.items() if prefix in lacking}
        counts = {prefix: self.moe.layer(self.scan.layers[prefix].layer).num_experts for prefix in present}
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
    found = {names.layer: prefix for prefix, names in scan.layers.items() if moe.mtp.index(prefix) is None}
    example = next(iter(found.values()), None)
    why = "every layer" if moe.resolution is None else moe.resolution["MoE layers"].source
    for layer in moe.moe_layers:
        if layer not in found and example is not None:
            ledger.lack(f"{prefix_at_layer(example, layer)} (all experts of layer {layer})",
                        f"the config makes layer {layer} a MoE layer ({why}) but the checkpoint has no expert "
                        f"tensors for it")


MTP_FIX = "load with include_mtp=False (wna16-shard --no-mtp) to keep them as non-expert tensors"


def plan_mtp_layer(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, names: LayerNames,
                   ledger: Ledger, tables: LayerTables) -> list[LayerPlan]:
    """The plan of an MTP layer's experts ([] when the config declares no such MTP layer: each tensor is
    then unexpected). Its spec is resolved like any layer's: 16-bit `.weight` experts (official Qwen3.5
    GPTQ-Int4 releases) load into the unquantized fused layout."""
    problem = moe.mtp.problem(names.prefix)
    if problem is not None:
        for name in names.names:
            ledger.reject(name, f"{problem}; {MTP_FIX}")
        return []
    return [replace(plan_layer(index, moe, parallel, names, ledger, tables), mtp=True)]


def plan_layer(index: CheckpointIndex, moe: MoEConfig, parallel: ParallelConfig, names: LayerNames,
               ledger: Ledger, tables: LayerTables | None = None) -> LayerPlan:
    """Plan one layer: its spec, EP filter, header checks, ledger entries."""
    table = (tables or LayerTables(index, moe)).layer(names)
    prefix = names.prefix
    moe = table.moe  # the layer's own spec from here on
    geometry = layer_geometry(moe, parallel, names.layer)
    for name, why in table.rejects:
        ledger.reject(name, why)
    slots = table.slots(tuple(sorted(set(geometry.experts))))
    for key, experts in slots.expected:
        ledger.expect_block(key, experts)
    ledger.record_blocks(slots.records)
    table.check_headers(slots.checks, geometry.num_experts)  # each tensor's own error before cross-tensor checks
    fused = FusedSpec.of(geometry, moe.quant, _scale_dtype(prefix, slots.scales), gated=moe.gated,
                         activation=moe.activation)
    return LayerPlan(prefix=prefix, layer=names.layer, geometry=geometry, fused=fused, sources=slots.sources,
                     moe=moe, spec=table.spec, records=slots.records)


def for_rank(plan: LayerPlan, parallel: ParallelConfig) -> LayerPlan:
    """`plan` as the rank of `parallel` plans it, where that rank holds the same experts (the same EP rank of the
    same sizes): its geometry and fused spec made for that rank, the sources and checks shared (the same tensors,
    already checked). What a node's local rank 0 needs of its TP peers, without planning each again."""
    geometry = replace(plan.geometry, parallel=parallel)
    assert geometry.experts == plan.geometry.experts, (plan.prefix, parallel, plan.geometry.parallel)
    fused = FusedSpec.of(geometry, plan.moe.quant, plan.fused.scale_dtype, gated=plan.moe.gated,
                         activation=plan.moe.activation)
    return replace(plan, geometry=geometry, fused=fused)


def layer_geometry(moe: MoEConfig, parallel: ParallelConfig, layer: int | None = None) -> LayerGeometry:
    """The validated sizes of MoE layer `layer` of `moe` on `parallel`'s rank (None: the first MoE layer's)."""
    values = moe.layer(layer) if layer is not None else moe.layer(moe.moe_layers[0] if moe.moe_layers else 0)
    return LayerGeometry(hidden=moe.hidden_size, intermediate=values.intermediate_size, num_experts=values.num_experts,
                         bits=moe.quant.bits, group_size=moe.quant.group_size, act_order=moe.quant.act_order,
                         parallel=parallel)


def expect_projection(ledger: Ledger, moe: MoEConfig, prefix: str, expert: int, proj: Proj) -> None:
    """Declare every role the format requires for one projection of one local expert."""
    ledger.expect_slots(Slot.of(prefix, expert, proj, role) for role in required_roles(moe))


def _scale_dtype(prefix: str, found: dict[torch.dtype, str]) -> torch.dtype:
    """The one dtype of a layer's scales (`found`: dtype -> a tensor of that dtype; float16 when none)."""
    if len(found) > 1:
        raise FormatError(f"{prefix}: scales use several dtypes {[(str(d), n) for d, n in found.items()]}; one "
                          f"layer's fused scales need one dtype.")
    return next(iter(found), torch.float16)
