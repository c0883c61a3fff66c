"""Every device decision of a load, in one place: `DevicePolicy`.

| decision                           | CPU target     | GPU target (CUDA or ROCm: torch.cuda drives both)       |
|------------------------------------|----------------|---------------------------------------------------------|
| weights converted on the device    | never          | `convert_on_device` (default on)                         |
| staging of the weights             | the result (*) | on the device (converted there), else ordinary host     |
| staging of scales, zeros, g_idx    | the result (*) | pinned host memory, one non-blocking copy per parameter |
| upload chunks, pre-sharded params  | -              | pinned host buffers, one non-blocking copy each          |
| a host tensor for a device copy    | as it is       | copied into memory of our own first (never a file map)  |
| current device while staging       | -              | the target (`scope`): pinned memory and kernels use its  |
|                                    |                | context, never GPU 0's                                   |
| synchronise                        | -              | once, at the end of every load (`synchronize`)           |

(*) From 2 MiB, in memory advised huge pages (`storage.buffers.host_tensor`: a kept result's pages are all fresh,
and a huge page faults and is charged once per 2 MiB), unless `huge_results=False`: a caller that drops each layer
once written (`wna16-shard`) takes `torch.empty`, whose freed layers the C heap hands back without a fault.

Host-converted weights stay in ordinary memory: the pinned allocator keeps what it once held, and a
layer of weights pinned per load would stay pinned for the process's life. The package never reads the
environment for any of this; a device string from the caller is all it takes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from ..errors import DeviceError
from ..storage.buffers import host_tensor


@dataclass(frozen=True)
class DevicePolicy:
    """The device decisions of one load onto `target` (see the module table)."""

    target: torch.device
    convert_on_device: bool = True
    huge_results: bool = True

    @classmethod
    def of(cls, device: torch.device | str, *, convert_on_device: bool = True,
           huge_results: bool = True) -> "DevicePolicy":
        """The policy for `device` ("cpu", "cuda", "cuda:N"); a bare "cuda" means the current device.
        `huge_results`: CPU results from 2 MiB in huge-page advised memory (module table)."""
        target = torch.device(device)
        if target.type == "cpu":
            return cls(target, convert_on_device=False, huge_results=huge_results)
        if target.type != "cuda":
            raise DeviceError(f"device {str(device)!r}: this loader writes to cpu or cuda[:N] (CUDA or ROCm, both "
                              f"named cuda in PyTorch); pass one of those.")
        if not torch.cuda.is_available():
            raise DeviceError(f"device {str(device)!r}: this PyTorch ({torch.__version__}) sees no CUDA or ROCm "
                              f"device{' (a CPU-only build)' if not (torch.version.cuda or torch.version.hip) else ''}"
                              f"; install a CUDA or ROCm build of torch on a machine with a GPU, or load to cpu.")
        index = torch.cuda.current_device() if target.index is None else target.index
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device {str(device)!r}: only {torch.cuda.device_count()} GPUs are visible "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); check CUDA_VISIBLE_DEVICES / "
                              f"HIP_VISIBLE_DEVICES or pass another index.")
        return cls(torch.device("cuda", index), convert_on_device=convert_on_device)

    @property
    def gpu(self) -> bool:
        """Whether the target is a GPU."""
        return self.target.type != "cpu"

    @property
    def upload_to(self) -> torch.device | None:
        """Where raw weight words go to be converted (None: converted on the host)."""
        return self.target if self.gpu and self.convert_on_device else None

    def on_device(self, packed: bool) -> bool:
        """Whether a fused parameter is staged on the device: the `packed` weights, where they are converted
        there."""
        return self.upload_to is not None and packed

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, *, packed: bool) -> torch.Tensor:
        """An empty staging tensor for a fused parameter (`packed`: a weight unpacked from the checkpoint's
        words): on the device, in pinned host memory (small parameters for a GPU), or in ordinary host memory
        (CPU targets, host-converted weights)."""
        if self.on_device(packed):
            return torch.empty(shape, dtype=dtype, device=self.target)
        return self._host(shape, dtype) if packed else self.host_buffer(shape, dtype)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory a device copy reads from (pinned for a GPU; for the CPU, the result: `host_tensor`)."""
        return torch.empty(shape, dtype=dtype, pin_memory=True) if self.gpu else self._host(shape, dtype)

    def _host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Ordinary host memory (module table, (*))."""
        return host_tensor(shape, dtype) if self.huge_results else torch.empty(shape, dtype=dtype)

    def host_copy(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (e.g. a view of a file mapping) copied into a `host_buffer`: the only kind of host tensor
        a device copy may read."""
        host = self.host_buffer(tuple(value.shape), value.dtype)
        host.copy_(value)
        return host

    def send(self, target: torch.Tensor, host: torch.Tensor) -> None:
        """Copy a `host_buffer` into `target` on the device, without waiting."""
        target.copy_(host, non_blocking=True)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A `host_buffer` (or host staging) as a new tensor on the target, without waiting."""
        return host.to(self.target, non_blocking=True)

    def scope(self) -> AbstractContextManager[object]:
        """Make the target the current device (pinned memory and kernels then use its context)."""
        return torch.cuda.device(self.target) if self.gpu else nullcontext()

    def synchronize(self) -> None:
        """Wait for the work queued on the target (the end of a load)."""
        if self.gpu:
            torch.cuda.synchronize(self.target)
