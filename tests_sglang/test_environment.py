"""The tier's venv holds no CUDA build: CPU torch, and no nvidia-*, CUDA, triton or GPU-kernel package."""

from importlib.metadata import distributions

import torch

GPU_PREFIXES = ("nvidia", "cuda", "triton", "flashinfer", "sgl-kernel", "sglang-kernel", "cupy")


def test_no_cuda_package_is_installed():
    names = sorted({(d.metadata["Name"] or "").lower() for d in distributions()})
    assert [n for n in names if n.startswith(GPU_PREFIXES)] == []
    assert torch.version.cuda is None and "sglang" in names
