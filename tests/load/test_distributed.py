"""Real multi-process runs: 2 and 4 CPU processes over torch.distributed (gloo).

Each process builds its ParallelConfig from the process group, loads its share
with `load_experts` and with `load_model_experts`, from the original checkpoint and
from a wna16-shard output of it, runs the reference forward on the same tokens, and
checks that all_reduce(sum) equals the unsharded forward.
One spawn per topology; every spawn tests AWQ, GPTQ with act-order and
compressed-tensors (hidden 64, intermediate 64, 4 experts). One 8-process spawn loads
the Gemma-4 shape (I = 704, G = 128) at TP 8, which pads I to 768.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import start_ranks
from torch import nn

from wna16_loader import (
    Activation,
    FusedMoEExperts,
    ParallelConfig,
    load_experts,
    load_model_experts,
    read_moe_config,
    reference_forward,
)
from wna16_loader.preshard import preshard_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

CONFIGS = {
    "awq": (quant_config("awq"), Activation.SILU),
    "gptq_act_order": (quant_config("gptq", act_order=True), Activation.GELU_TANH),
    "compressed_tensors": (quant_config("compressed-tensors"), Activation.SILU),
}


@dataclass(frozen=True)
class Case:
    """One checkpoint, the tokens, and the unsharded output every rank's all_reduce must reproduce."""

    name: str
    folder: str
    activation: Activation
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expected: torch.Tensor


def experts_model(folder: str, parallel: ParallelConfig, activation: Activation) -> nn.Module:
    """model.layers.0.mlp.experts as a FusedMoEExperts, like a transformers model tree."""
    moe = read_moe_config(folder)
    (prefix,) = moe.experts_prefixes
    root = nn.Module()
    parent = root
    for part in prefix.split(".")[:-1]:
        parent.add_module(part, nn.Module())
        parent = parent._modules[part]
    parent.add_module("experts", FusedMoEExperts(moe, prefix, parallel, activation=activation))
    return root


def worker(rank: int, world: int, init_file: str, tp: int, ep: int, cases: list[Case], log_dir: str,
           sharded: dict[str, str]) -> None:
    """One rank: load twice, forward, all_reduce, compare (runs in a spawned process)."""
    torch.set_num_threads(1)
    handler = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
    logging.getLogger("wna16_loader").addHandler(handler)
    logging.getLogger("wna16_loader").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        parallel = ParallelConfig.from_environment(ep_size=ep)
        assert parallel == ParallelConfig.from_process_group(tp_size=tp, ep_size=ep, process_group=dist.group.WORLD)
        assert (parallel.rank, parallel.tp_size, parallel.ep_size) == (rank, tp, ep)
        for case in cases:
            check_case(case, parallel)
            check_presharded(case, sharded[case.name], parallel)
    finally:
        dist.destroy_process_group()
        handler.close()


def check_case(case: Case, parallel: ParallelConfig) -> None:
    layer = next(iter(load_experts(case.folder, parallel).values()))
    partial = reference_forward(layer.dequantize(), layer.spec.experts, case.hidden, case.topk_ids,
                                case.topk_weights, case.activation)
    model = experts_model(case.folder, parallel, case.activation)
    load_model_experts(model, case.folder, parallel)
    module = next(m for m in model.modules() if isinstance(m, FusedMoEExperts))
    assert torch.equal(module(case.hidden, case.topk_ids, case.topk_weights), partial), case.name
    total = partial.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    torch.testing.assert_close(total, case.expected, rtol=1e-5, atol=tolerance(case),
                               msg=lambda m: f"{case.name} rank {parallel.rank}: {m}")


def tolerance(case: Case) -> float:
    """1e-5, scaled up for outputs larger than 1 (float32 sums over I in another order per rank)."""
    return 1e-5 * max(1.0, float(case.expected.abs().max()))


def check_presharded(case: Case, folder: str, parallel: ParallelConfig) -> None:
    """The rank's share read back from a wna16-shard output equals the share read from the source."""
    direct = next(iter(load_experts(case.folder, parallel).values()))
    sharded = next(iter(load_experts(folder, parallel).values()))
    for name, tensor in direct.tensors.items():
        assert torch.equal(sharded.tensors[name], tensor), (case.name, name)
    model = experts_model(case.folder, parallel, case.activation)
    load_model_experts(model, folder, parallel)
    module = next(m for m in model.modules() if isinstance(m, FusedMoEExperts))
    total = module(case.hidden, case.topk_ids, case.topk_weights)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    torch.testing.assert_close(total, case.expected, rtol=1e-5, atol=tolerance(case))


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[Case]:
    """Three small checkpoints and their unsharded forward, computed in this process."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(32, 64, generator=gen) / 8
    topk_weights, topk_ids = torch.rand(32, 4, generator=gen).softmax(-1).topk(2)
    out = []
    for name, (qconfig, activation) in CONFIGS.items():
        folder = str(write_checkpoint(tmp_path_factory.mktemp(name), qconfig, num_experts=4, hidden=64,
                                      intermediate=64).folder)
        layer = next(iter(load_experts(folder, ParallelConfig(1, 0)).values()))
        expected = reference_forward(layer.dequantize(), layer.spec.experts, hidden, topk_ids, topk_weights,
                                     activation)
        out.append(Case(name, folder, activation, hidden, topk_ids, topk_weights, expected))
    return out


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "ep2", "tp2xep2"])
def test_all_reduce_of_ranks_equals_unsharded(cases: list[Case], tmp_path: Path, tp: int, ep: int) -> None:
    world = tp * ep
    sharded = {case.name: str(tmp_path / f"sharded-{case.name}") for case in cases}
    for case in cases:
        preshard_checkpoint(case.folder, sharded[case.name], tp_size=tp, ep_size=ep, progress=False)
    start_ranks(worker, args=(world, str(tmp_path / "init"), tp, ep, cases, str(tmp_path), sharded), nprocs=world)
    for rank in range(world):
        lines = (tmp_path / f"rank{rank}.log").read_text().splitlines()
        summaries = [line for line in lines if "loaded into the model:" in line]
        assert len(summaries) == len(cases), lines  # one summary per rank and load
        assert all(line.startswith(f"[rank {rank} tp {rank % tp}/{tp} ep {rank // tp}/{ep}]") for line in summaries)


def test_gemma4_shape_tp8_padded_all_reduce(tmp_path: Path) -> None:
    """8 processes, TP 8: I = 704 with G = 128 pads to I' = 768 (I_p' = 96, G_eff = 32; rank 7 holds 32 real
    columns and 64 of padding) through load_experts, load_model_experts and a wna16-shard output."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(16, 64, generator=gen) / 8
    topk_weights, topk_ids = torch.rand(16, 4, generator=gen).softmax(-1).topk(2)
    folder = str(write_checkpoint(tmp_path / "gemma4", quant_config("gptq", group_size=128), family="gemma4",
                                  num_experts=4, hidden=64, intermediate=704).folder)
    layer = next(iter(load_experts(folder, ParallelConfig(1, 0)).values()))
    expected = reference_forward(layer.dequantize(), layer.spec.experts, hidden, topk_ids, topk_weights,
                                 Activation.GELU_TANH)
    case = Case("gemma4_tp8", folder, Activation.GELU_TANH, hidden, topk_ids, topk_weights, expected)
    sharded = {case.name: str(tmp_path / "sharded")}
    preshard_checkpoint(folder, sharded[case.name], tp_size=8, progress=False)
    start_ranks(worker, args=(8, str(tmp_path / "init"), 8, 1, [case], str(tmp_path), sharded), nprocs=8)
    last = next(iter(load_experts(sharded[case.name], ParallelConfig(8, 7)).values()))
    assert (last.intermediate_size, last.intermediate_size_per_partition, last.padding) == (704, 96, 64)
