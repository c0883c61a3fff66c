"""What every engine plugin does once it has found a model's MoE layers: match them to the checkpoint's experts
prefixes and fill each in place (`load.inplace.fill_layers`), then hand the engine the other tensors. Engine-neutral:
a plugin passes its layers, how one becomes a `LayerTarget`, and how a checkpoint prefix is named in the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import torch

from ..errors import ConfigError
from ..load.experts import read_moe_config
from ..load.inplace import FillReport, LayerTarget, fill_layers
from ..load.outputs import is_presharded
from ..parallel.config import ParallelConfig
from ..preshard.plan import COMMON_DIR
from ..storage.index import CheckpointIndex

Layer = TypeVar("Layer")


def fill_model(folder: Path, engine: str, layers: Mapping[str, Layer], target_of: Callable[[Layer], LayerTarget],
               parallel: ParallelConfig, name_of: Callable[[str], str] = str) -> FillReport:
    """Fill every MoE layer of a model (`layers`: the engine's name -> its layer) from `folder`, in place, in its
    method's layout. `name_of`: a checkpoint experts prefix -> the engine's layer name. A layer no prefix names
    raises ConfigError (naming `engine`, whose default loader is the fix)."""
    moe = read_moe_config(folder)
    prefixes = (*moe.experts_prefixes, *moe.mtp_prefixes)
    names = {prefix: name_of(prefix) for prefix in prefixes}
    targets = {prefix: target_of(layers[name]) for prefix, name in names.items() if name in layers}
    unfilled = sorted(set(layers) - {names[prefix] for prefix in targets})
    if unfilled:
        raise ConfigError(f"{engine}'s MoE layers {unfilled} match no experts prefix of {folder} (its prefixes: "
                          f"{list(prefixes)}); load this model with {engine}'s default --load-format")
    mtp = any(prefix in moe.mtp_prefixes for prefix in targets)
    return fill_layers(folder, parallel, targets, include_mtp=mtp)


def common_weights(folder: Path, ignored: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every non-expert tensor, one at a time: a `wna16-shard` output's common/ files, or the tensors of a
    checkpoint folder that the expert load left alone (nothing else is read)."""
    source = folder / COMMON_DIR if is_presharded(folder) else folder
    with CheckpointIndex(source) as index:
        names = sorted(index.refs) if source != folder else ignored
        for name in names:
            yield name, index.read(index.refs[name])
