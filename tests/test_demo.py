"""The demo script: a synthetic checkpoint loaded per rank and reassembled, on the CPU or a (stand-in) GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wna16_loader.demo import main
from wna16_loader.standin import StandIn


def test_demo_reassembles_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--group-size", "64"]) == 0
    assert "reassembly: 48/48 expert projections identical" in capsys.readouterr().out


def test_demo_on_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with StandIn(count=2):
        assert main(["--out", str(tmp_path), "--device", "cuda:1", "--act-order", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "loaded to cuda:1" in out and "reassembly: 48/48 expert projections identical" in out


def test_demo_refuses_a_gpu_from_a_cpu_only_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--out", str(tmp_path), "--device", "cuda:0"]) == 2
    assert "error: device 'cuda:0': this PyTorch" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # refused before writing anything


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_demo_on_the_last_real_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    device = f"cuda:{torch.cuda.device_count() - 1}"
    assert main(["--out", str(tmp_path), "--device", device, "--act-order"]) == 0
    assert "reassembly: 48/48 expert projections identical" in capsys.readouterr().out
