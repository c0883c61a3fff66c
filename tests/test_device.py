"""The device path: weights converted on the device after one pinned copy of their raw words, the rest
staged in pinned memory and copied once per parameter (CUDA or ROCm; the GPU tests skip without one).

The conversion on the device runs the same tensor operations as on the host; the CPU tests here run
that path with the CPU standing in for the device, so its logic is covered without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wna16_loader import ParallelConfig, load_experts
from wna16_loader import extract
from wna16_loader.checkpoint import CheckpointIndex
from wna16_loader.extract import rank_spans, read_qweights
from wna16_loader.fused import FusedWriter, Ledger
from wna16_loader.modelconfig import read_config_files
from wna16_loader.formats import Dim
from wna16_loader.names import Proj
from wna16_loader.sharding import Span
from wna16_loader.plan import LayerPlan, plan_layers
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
@pytest.mark.parametrize("convert_on_device", [True, False])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_gpu_load_equals_cpu_load(folder: Path, tp: int, ep: int, convert_on_device: bool) -> None:
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
        on_cpu = load_experts(folder, parallel)
        on_gpu = load_experts(folder, parallel, device="cuda:0", convert_on_device=convert_on_device)
        for prefix, layer in on_cpu.items():
            for name, tensor in layer.tensors.items():
                moved = on_gpu[prefix].tensors[name]
                assert moved.device.type == "cuda"
                assert torch.equal(moved.cpu(), tensor), (prefix, name)


def first_plan(folder: Path, parallel: ParallelConfig) -> LayerPlan:
    with CheckpointIndex(folder) as index:
        return plan_layers(index, read_config_files(folder), parallel, Ledger())[0]


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("gptq", 8), ("awq", 4), ("compressed-tensors", 4)])
@pytest.mark.parametrize("tp,rank,intermediate,group", [(1, 0, 96, 32), (2, 1, 96, 32), (2, 1, 40, -1)])
def test_upload_path_equals_host_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, bits: int,
                                      tp: int, rank: int, intermediate: int, group: int) -> None:
    """Raw words stacked, sent to the (stand-in) device in chunks and converted there == host conversion
    (I = 40 at TP 2 cuts K of down at row 20: the generic unpack-and-repack path)."""
    write_checkpoint(tmp_path, quant_config(fmt, bits=bits, group_size=group), hidden=64, intermediate=intermediate,
                     num_experts=6, num_layers=1)
    moe, plan = read_config_files(tmp_path), first_plan(tmp_path, ParallelConfig(tp, rank))
    monkeypatch.setattr(extract, "UPLOAD_CHUNK_BYTES", 1)  # one expert per upload: several chunks
    with CheckpointIndex(tmp_path) as index:
        for proj in Proj:
            sources = [plan.sources[(e, proj)] for e in plan.fused.experts]
            spans, _ = rank_spans(sources[0], plan.geometry.slice(proj))
            host = list(read_qweights(index, moe.quant, sources, spans))
            uploaded = list(read_qweights(index, moe.quant, sources, spans, upload_to=torch.device("cpu")))
            assert [p.experts for p in uploaded] == [slice(i, i + 1) for i in range(len(sources))]
            assert {p.n for p in host + uploaded} == {Span(0, len(spans[Dim.N]))}
            assert torch.equal(torch.cat([p.tensor for p in host]), torch.cat([p.tensor for p in uploaded])), proj


def test_cpu_writer_converts_on_the_host(folder: Path) -> None:
    plan = first_plan(folder, ParallelConfig(1, 0))
    assert FusedWriter(plan.prefix, plan.fused, "cpu").upload_to is None


@GPU
@pytest.mark.parametrize("convert_on_device", [True, False])
def test_gpu_staging(folder: Path, convert_on_device: bool) -> None:
    plan = first_plan(folder, ParallelConfig(1, 0))
    writer = FusedWriter(plan.prefix, plan.fused, "cuda:0", convert_on_device=convert_on_device)
    for name, buf in writer.staging.items():
        on_device = convert_on_device and name.endswith("_qweight")
        assert (buf.device.type == "cuda") == on_device, name
        assert on_device or buf.is_pinned(), name
    assert (writer.upload_to is not None) == convert_on_device
