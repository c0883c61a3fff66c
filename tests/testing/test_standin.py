"""The GPU stand-in: cuda:N tensors on the CPU that fail where a GPU would, plus the mapped-copy check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wna16_loader.testing.standin import DeviceTensor, MappedCopyError, StandIn, mapped_file

REAL_CUDA = torch.cuda.is_available()


def test_stand_in_catches_what_a_gpu_would(tmp_path: Path) -> None:
    """The stand-in's own checks: mixed devices, copies from a mapping, other devices."""
    save_file({"w": torch.arange(64, dtype=torch.int32)}, str(tmp_path / "x.safetensors"))
    mapped = safe_open(str(tmp_path / "x.safetensors"), framework="pt").get_tensor("w")
    with StandIn(count=2) as sim:
        on = torch.zeros(64, dtype=torch.int32, device="cuda:1")
        with pytest.raises(RuntimeError, match="same device"):
            on + torch.ones(64, dtype=torch.int32)
        assert (on + torch.tensor(1)).device == torch.device("cuda", 1)  # 0-dim host tensors may meet
        with pytest.raises(MappedCopyError, match="x.safetensors"):
            on.copy_(mapped)
        with pytest.raises(MappedCopyError, match="x.safetensors"):
            mapped.to("cuda:1")
        on.copy_(mapped.clone())
        assert torch.equal(on.cpu(), mapped) and on.cpu().device == torch.device("cpu")
        with torch.cuda.device(1):
            torch.empty(8, pin_memory=True)
            torch.empty(8, device="cuda")
        assert sim.pinned == [(32, 1)] and set(sim.allocations) == {1}
        assert torch.cuda.memory_allocated(1) >= 64 * 4 and torch.cuda.memory_allocated(0) == 0
        live = torch.cuda.memory_allocated(1)
        torch.cuda.reset_peak_memory_stats(1)
        scratch = torch.empty(1024, dtype=torch.uint8, device="cuda:1")
        del scratch
        assert torch.cuda.memory_allocated(1) == live and torch.cuda.max_memory_allocated(1) == live + 1024
        torch.cuda.reset_peak_memory_stats(1)
        assert torch.cuda.max_memory_allocated(1) == live
        torch.cuda.synchronize(torch.device("cuda", 1))
        assert sim.syncs == [1]
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.empty(1, device="cuda:2")
    assert torch.cuda.is_available() == REAL_CUDA  # the real torch.cuda is back


def test_mapped_file_names_the_mapping(tmp_path: Path) -> None:
    save_file({"w": torch.arange(4096, dtype=torch.int32)}, str(tmp_path / "y.safetensors"))
    view = safe_open(str(tmp_path / "y.safetensors"), framework="pt").get_slice("w")[100:200]
    assert mapped_file(view) == str(tmp_path / "y.safetensors")
    assert mapped_file(view.clone()) is None


def test_device_tensors_keep_their_device_through_ops() -> None:
    with StandIn(count=4):
        x = torch.arange(16, dtype=torch.int32, device="cuda:2").view(4, 4)
        for y in (x.t(), x.view(torch.uint8), x[1:3], torch.stack([x, x]), x.to(torch.int64), x + 1,
                  torch.arange(4, device=x.device)):
            assert isinstance(y, DeviceTensor) and y.device == torch.device("cuda", 2)
        assert torch.equal(x.t().cpu(), torch.arange(16, dtype=torch.int32).view(4, 4).t())
        assert type(x.to("cpu")) is torch.Tensor
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.zeros(4, 4, dtype=torch.int32, device="cuda:1")
