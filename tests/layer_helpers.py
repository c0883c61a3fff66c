"""Shared by tests/load/test_params.py, test_qweights.py and test_device.py: a tiny one-layer checkpoint
written in `tmp_path`, planned for one TP rank; a weight piece as a plain tensor."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from wna16_loader import ParallelConfig
from wna16_loader.formats import QuantSpec
from wna16_loader.formats.packing import NibbleWords
from wna16_loader.load.ledger import Ledger
from wna16_loader.load.params import SourceTensors
from wna16_loader.load.plan import LayerPlan, plan_layers
from wna16_loader.models.config import read_config_files
from wna16_loader.models.names import Proj
from wna16_loader.storage.index import CheckpointIndex
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

P = "model.layers.0.mlp.experts"
H = I = 128
TP1 = (1, 0)


def write(folder: Path, fmt: str, *, bits: int = 4, group: int = 32, symmetric: bool = False,
          act_order: bool = False, hidden: int = H, inter: int = I, **kwargs) -> None:
    write_checkpoint(folder, quant_config(fmt, bits=bits, group_size=group, symmetric=symmetric, act_order=act_order),
                     num_experts=kwargs.pop("num_experts", 4), hidden=hidden, intermediate=inter, **kwargs)


@contextmanager
def planned(folder: Path, tp: int = 1, rank: int = 0) -> Iterator[tuple[CheckpointIndex, QuantSpec, LayerPlan]]:
    """(open index, quant spec, plan of the only layer) for TP rank `rank` of `tp`."""
    moe = read_config_files(folder)
    with CheckpointIndex(folder) as index:
        plan = plan_layers(index, moe, ParallelConfig(tp_size=tp, tp_rank=rank), Ledger())[0]
        yield index, moe.quant, plan


def batch(plan: LayerPlan, proj: Proj) -> list[SourceTensors]:
    """The sources of `proj` for every local expert, in slot order."""
    return [plan.sources[(e, proj)] for e in plan.fused.experts]


def model(folder: Path) -> Path:
    """The one safetensors file `write` makes."""
    return folder / "model.safetensors"


def dense(tensor: torch.Tensor | NibbleWords) -> torch.Tensor:
    """A weight piece's tensor as a row-major tensor on its device (`NibbleWords` written into a fresh one,
    while their reader is open)."""
    if isinstance(tensor, NibbleWords):
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        tensor.write(out)
        return out
    return tensor.clone(memory_format=torch.contiguous_format)
