"""The device path: pinned staging and one copy per fused parameter (CUDA or ROCm; skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.fused import FusedWriter
from wna16_loader.synthetic import quant_config, write_checkpoint

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("device")
    write_checkpoint(path, quant_config("gptq", bits=4, group_size=32, act_order=True), hidden=128,
                     intermediate=128, num_layers=2)
    return path


def test_cpu_target_stages_in_ordinary_memory(folder: Path) -> None:
    layer = next(iter(load_experts(folder, ParallelConfig(2, 1)).values()))
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in layer.tensors.values())


@GPU
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_gpu_load_equals_cpu_load(folder: Path, tp: int, ep: int) -> None:
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
        on_cpu = load_experts(folder, parallel)
        on_gpu = load_experts(folder, parallel, device="cuda:0")
        for prefix, layer in on_cpu.items():
            for name, tensor in layer.tensors.items():
                moved = on_gpu[prefix].tensors[name]
                assert moved.device.type == "cuda"
                assert torch.equal(moved.cpu(), tensor), (prefix, name)


@GPU
def test_gpu_staging_is_pinned(folder: Path) -> None:
    from wna16_loader.checkpoint import CheckpointIndex
    from wna16_loader.fused import Ledger
    from wna16_loader.modelconfig import read_config_files
    from wna16_loader.plan import plan_layers

    with CheckpointIndex(folder) as index:
        plan = plan_layers(index, read_config_files(folder), ParallelConfig(1, 0), Ledger())[0]
    writer = FusedWriter(plan.prefix, plan.fused, "cuda:0")
    assert all(buf.is_pinned() for buf in writer.staging.values())
