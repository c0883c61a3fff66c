"""What every engine plugin does once it has found a model's MoE layers: match them to the checkpoint's experts
prefixes and fill each in place (`load.inplace.fill_layers`), then hand the engine the other tensors. Engine-neutral:
a plugin passes its layers, how one becomes a `LayerTarget`, and how a checkpoint prefix is named in the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..errors import ConfigError
from ..load.experts import read_moe_config
from ..load.inplace import FillReport, LayerTarget, fill_layers
from ..load.outputs import is_presharded
from ..load.shared import fill_shared
from ..parallel.config import Node, ParallelConfig
from ..preshard.plan import COMMON_DIR
from ..storage.index import CheckpointIndex
from ..storage.readahead import ReadOptions

Layer = TypeVar("Layer")


def moe_layers(model: torch.nn.Module, layer_type: type, engine: str) -> dict[str, Any]:
    """The engine's layer name -> every MoE layer (`layer_type`) of `model`; ConfigError when it has none."""
    layers = {m.layer_name: m for m in model.modules() if isinstance(m, layer_type)}
    if not layers:
        raise ConfigError(f"--load-format wna16 fills MoE expert parameters, but the model has no MoE layer; load it "
                          f"with {engine}'s default --load-format")
    return layers


def fill_model(folder: Path, engine: str, layers: Mapping[str, Layer], target_of: Callable[[Layer], LayerTarget],
               parallel: ParallelConfig, name_of: Callable[[str], str] = str, *,
               world_group: Any = None) -> FillReport:
    """Fill every MoE layer of a model (`layers`: the engine's name -> its layer) from `folder`, in place, in its
    method's layout. `name_of`: a checkpoint experts prefix -> the engine's layer name. A layer no prefix names
    raises ConfigError (naming `engine`, whose default loader is the fix). A layer whose engine fused shared
    experts into it (`LayerTarget.shared_slots`) has them filled too (`load.shared`), and their tensors are
    left out of the report's `ignored` (the engine's other tensors). `world_group`: the engine's CPU
    process group of every rank; the ranks of this host that fill the same layers read a checkpoint folder
    together (`Node.from_environment`)."""
    moe = read_moe_config(folder)
    prefixes = (*moe.experts_prefixes, *moe.mtp_prefixes)
    names = {prefix: name_of(prefix) for prefix in prefixes}
    targets = {prefix: target_of(layers[name]) for prefix, name in names.items() if name in layers}
    unfilled = sorted(set(layers) - {names[prefix] for prefix in targets})
    if unfilled:
        raise ConfigError(f"{engine}'s MoE layers {unfilled} match no experts prefix of {folder} (its prefixes: "
                          f"{list(prefixes)}); load this model with {engine}'s default --load-format")
    mtp = any(prefix in moe.mtp_prefixes for prefix in targets)
    routed = {prefix: target.routed() for prefix, target in targets.items()}
    report = fill_layers(folder, parallel, routed, include_mtp=mtp, reads=node_reads(world_group, parallel, targets))
    shared = fill_shared(moe, tensors_folder(folder), parallel, targets)
    return replace(report, ignored=tuple(sorted(set(report.ignored) - set(shared))), shared=shared)


def node_reads(world_group: Any, parallel: ParallelConfig, targets: Mapping[str, LayerTarget]) -> ReadOptions:
    """The read options of an engine's rank: its node (the ranks of `world_group` on this host filling the same
    layers: other pipeline stages are never one node), or alone without a group."""
    if world_group is None:
        return ReadOptions()
    return ReadOptions(node=Node.from_environment(world_group, rank=parallel.rank, load=",".join(sorted(targets))))


def tensors_folder(folder: Path) -> Path:
    """Where the non-expert tensors of `folder` are: a `wna16-shard` output's common/, else the folder."""
    return folder / COMMON_DIR if is_presharded(folder) else folder


def common_weights(folder: Path, ignored: tuple[str, ...],
                   shared: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every non-expert tensor the fill left to the engine, one at a time: a `wna16-shard` output's common/ files
    but the `shared` experts' tensors the fill took, or the tensors of a checkpoint folder that it left alone,
    `ignored` (nothing else is read)."""
    source = tensors_folder(folder)
    with CheckpointIndex(source) as index:
        names = sorted(set(index.refs) - set(shared)) if source != folder else ignored
        for name in names:
            yield name, index.read(index.refs[name])
