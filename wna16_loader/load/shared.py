"""Fill an engine's fused shared-expert slots in place (`LayerTarget.shared_slots`): a family's shared experts
(`families.SharedExperts`, e.g. DeepSeek-V3's `mlp.shared_experts`) read as the experts of a layer of their own,
shared expert i as expert i, and filled through `inplace.fill_layer` like any routed layer, in the layout of the
layer's method.

| what                | how                                                                                 |
|---------------------|-------------------------------------------------------------------------------------|
| the TP cut          | a routed expert's: w13's N and w2's K split over the layer's TP ranks                |
| the EP cut          | none: every rank holds every shared slot (the engine's per-rank or global slots)     |
| their tensors       | a checkpoint folder's own; a `wna16-shard` output's common/ (the caller's `source`), |
|                     | which holds them as the checkpoint does: each rank reads its TP slice of them       |

A shared-expert module holds `MoEConfig.shared_experts` experts' columns in one MLP; an engine fuses it into one
slot only where that count is 1 (its I a routed expert's), as SGLang does. Nothing here names an engine or a
family: the family row says where the tensors are, the engine's layer how many slots it holds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Mapping

from ..errors import ConfigError
from ..models.config import MoEConfig
from ..models.families import SharedExperts, family_of
from ..models.names import ExpertTensorKey, LayerNames, layer_of_prefix, shared_expert_key, shared_prefix
from ..parallel.config import ParallelConfig
from ..storage.index import CheckpointIndex
from .inplace import LayerTarget, fill_layer
from .ledger import Ledger
from .plan import plan_layers
from .scan import CheckpointScan


def fill_shared(moe: MoEConfig, source: Path, parallel: ParallelConfig,
                targets: Mapping[str, LayerTarget]) -> tuple[str, ...]:
    """Fill the shared slots of every target with some (by experts prefix) from the shared-expert tensors in
    `source` (see the module table), `parallel`'s TP rank's slice of each; the names of the tensors taken
    (which the engine must not load again). ConfigError where the family declares no shared experts, the
    engine holds other than one slot per shared-expert module, or `source` lacks a layer's."""
    fused = {prefix: target for prefix, target in targets.items() if target.shared_slots}
    if not fused:
        return ()
    declared, wanted = shared_experts_of(moe, fused), {prefix: target.shared() for prefix, target in fused.items()}
    with CheckpointIndex(source) as index:
        scan = shared_scan(index, declared, wanted)
        layers = tuple(sorted({names.layer for prefix, names in scan.layers.items() if moe.mtp.index(prefix) is None}))
        one = replace(moe, num_experts=1, per_layer=(), zero_experts=0, moe_layers=layers)
        ledger = Ledger()
        plans = plan_layers(index, one, ParallelConfig(tp_size=parallel.tp_size, tp_rank=parallel.tp_rank),
                            ledger, scan)
        ledger.check()
        for plan in plans:
            fill_layer(index, one, plan, wanted[plan.prefix], copy_words=True)
    return tuple(name for names in scan.layers.values() for name in names.names)


def shared_experts_of(moe: MoEConfig, fused: Mapping[str, LayerTarget]) -> SharedExperts:
    """The family's shared experts, checked against the slots the engine holds for them (`fused`: the layers
    with shared slots)."""
    declared, (prefix, target) = family_of(moe.family).shared, next(iter(fused.items()))
    if declared is None:
        raise ConfigError(f"{prefix}: the engine holds {target.shared_slots} fused shared-expert slot(s), but the "
                          f"families table's row {moe.family!r} declares no shared experts (Family.shared); add them "
                          f"to the row, or serve the model with the engine's shared-expert fusion off")
    if moe.shared_experts != 1 or any(t.shared_slots != 1 for t in fused.values()):
        raise ConfigError(f"{prefix}: the engine holds {target.shared_slots} fused shared-expert slot(s), the "
                          f"config counts {moe.shared_experts} shared experts in one {declared.module} module "
                          f"({'/'.join(declared.count)}); one slot holds one module of a routed expert's size, so "
                          f"only a count of 1 fuses: serve the model with the engine's shared-expert fusion off")
    return declared


def shared_scan(index: CheckpointIndex, declared: SharedExperts, wanted: Mapping[str, LayerTarget]) -> CheckpointScan:
    """The shared-expert tensors of the `wanted` layers as a name scan: each layer's module as expert 0 of its
    experts prefix (the tensors keep their own names). ConfigError naming a layer whose module has none."""
    beside = {shared_prefix(prefix, declared.module): prefix for prefix in wanted}
    keys: dict[str, list[ExpertTensorKey]] = {prefix: [] for prefix in wanted}
    for name in index.refs:
        prefix = beside.get(name.rsplit(".", 2)[0])
        key = None if prefix is None else shared_expert_key(name, prefix, declared.module, 0)
        if key is not None:
            keys[prefix].append(key)
    layers = {prefix: LayerNames.of_keys(prefix, _layer(prefix), found) for prefix, found in keys.items()}
    empty = [shared_prefix(prefix, declared.module) for prefix, names in layers.items() if not names.names]
    if empty:
        raise ConfigError(f"{index.folder}: the engine fused shared experts into {len(wanted)} MoE layers, but "
                          f"{empty} hold no tensors here (expected e.g. {empty[0]}.gate_proj.qweight); load this "
                          f"model with the engine's shared-expert fusion off, or from a folder that holds them")
    return CheckpointScan(dict(sorted(layers.items(), key=lambda kv: kv[1].layer)), ())


def _layer(prefix: str) -> int:
    layer = layer_of_prefix(prefix)
    assert layer is not None, f"{prefix!r} is not an experts prefix"
    return layer
