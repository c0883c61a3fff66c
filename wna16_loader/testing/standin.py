"""A GPU stand-in for tests: `cuda:N` tensors that live on the CPU, and the checks a real device would make.

Inside `with StandIn(count=4) as gpu:` the load paths run unchanged with a target `cuda:N`:

| what the code does                        | what the stand-in does                                        |
|-------------------------------------------|---------------------------------------------------------------|
| `torch.empty(..., device="cuda:N")`, `.to` | a CPU tensor of class `DeviceTensor` whose `.device` is cuda:N |
| an op mixing a device and a host tensor    | RuntimeError "Expected all tensors to be on the same device"  |
| any copy onto the device from a tensor in  | `MappedCopyError` (never DMA from a safetensors file mapping) |
| a mapped *.safetensors file                |                                                               |
| `pin_memory=True`, `.pin_memory()`         | an ordinary tensor, recorded with the current device          |
| `torch.cuda.device(N)`, `current_device`,  | simulated: a current-device index, per-device allocations    |
| `synchronize`, `memory_allocated`, ...     | (live bytes), a log of synchronisations                       |
| `max_memory_allocated`, `reset_peak_...`   | the most live bytes at any allocation since the last reset     |

Host tensors, 0-dim tensors and index tensors used for indexing may meet device tensors, as on a GPU.
Modules must be built on the stand-in device (`device="cuda:N"` or meta + `materialize`); `.to()` of an
existing CPU module keeps plain parameters (torch assigns `.data` in place).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

MAPS = "/proc/self/maps"


class MappedCopyError(AssertionError):
    """A copy onto the (stand-in) device read from a file mapping: the loader's rule is never to DMA from one."""


def mapped_ranges(suffix: str = ".safetensors") -> list[tuple[int, int, str]]:
    """(start, end, path) of every mapping of this process backed by a file named `*suffix`."""
    out = []
    with open(MAPS, encoding="utf-8") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            path = parts[5].strip().removesuffix(" (deleted)") if len(parts) == 6 else ""
            if path.endswith(suffix):
                start, end = parts[0].split("-")
                out.append((int(start, 16), int(end, 16), path))
    return out


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The *.safetensors file whose mapping holds `tensor`'s storage, or None."""
    storage = tensor.untyped_storage()
    low, high = storage.data_ptr(), storage.data_ptr() + max(storage.nbytes(), 1)
    return next((path for start, end, path in mapped_ranges() if low < end and start < high), None)


class DeviceTensor(torch.Tensor):
    """A tensor on a stand-in GPU: CPU memory, `.device` == cuda:N (see the module table)."""

    sim_index: int

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.sim_index)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        sim = _active()
        sims = [t for t in _tensors((args, kwargs)) if isinstance(t, DeviceTensor)]
        index = sims[0].sim_index if sims else sim.current
        if func in (torch.Tensor.cpu, torch.Tensor.numpy):
            return _plain(args[0]).clone()
        if func is torch.Tensor.to:
            return sim.to(args[0], args[1:], kwargs)
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
            source = args[1] if func is torch.Tensor.copy_ else args[2]
            if isinstance(args[0], DeviceTensor) and isinstance(source, torch.Tensor) \
                    and not isinstance(source, DeviceTensor):
                sim.check_source(source, f"{func.__name__} onto cuda:{args[0].sim_index}")
        elif func is not torch.Tensor.__getitem__:
            _same_device(func, sims, [t for t in _tensors((args, kwargs)) if not isinstance(t, DeviceTensor)])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return out if func is torch.Tensor.__setitem__ else _wrap(out, index)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _same_device(func: Callable, sims: list[DeviceTensor], host: list[torch.Tensor]) -> None:
    devices = {f"cuda:{t.sim_index}" for t in sims} | {"cpu" for t in host if t.dim() > 0}
    if len(devices) > 1:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{' and '.join(sorted(devices))}! (GPU stand-in, in {getattr(func, '__name__', func)})")


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _wrap(out: Any, index: int) -> Any:
    """Tensors in `out` as DeviceTensors of device `index` (the same object when already one)."""
    if isinstance(out, DeviceTensor):
        return out
    if isinstance(out, torch.Tensor) and not isinstance(out, torch.nn.Parameter):
        with torch._C.DisableTorchFunctionSubclass():
            wrapped = out.as_subclass(DeviceTensor)
        wrapped.sim_index = index
        if _ACTIVE is not None:
            _ACTIVE.device_tensors.add(wrapped)
        return wrapped
    if isinstance(out, (list, tuple)) and any(isinstance(o, torch.Tensor) for o in out):
        items = [_wrap(o, index) for o in out]
        return type(out)(items) if type(out) in (list, tuple) else type(out)(*items)
    return out


@dataclass
class StandIn:
    """`count` simulated GPUs (see the module table); a context manager, one at a time.

    `allocations[i]`: bytes of every device allocation on cuda:i; `memory_allocated(i)`: bytes of the live
    storages on cuda:i; `peaks[i]`: the most live bytes on cuda:i right after any allocation since the
    last `reset_peak_memory_stats` (what `max_memory_allocated` reports); `pinned`: (bytes, current device) of every pinned host allocation; `peak_host`: the
    most bytes of host tensors made by factory calls (empty, zeros, ...) alive at once; `syncs`: the device
    of every synchronize; `forbid_mapped`: raise MappedCopyError on a copy onto a device from a file
    mapping (on by default; off, such copies are only listed in `mapped_copies`).
    """

    count: int = 2
    forbid_mapped: bool = True
    current: int = 0
    allocations: dict[int, list[int]] = field(default_factory=dict)
    peaks: dict[int, int] = field(default_factory=dict)
    pinned: list[tuple[int, int]] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    mapped_copies: list[str] = field(default_factory=list)
    peak_host: int = 0
    device_tensors: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    host_tensors: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    _saved: dict[str, Any] = field(default_factory=dict)
    _mode: Any = None

    # ------------------------------------------------------------------ devices

    def index_of(self, device: torch.device | str | int | None) -> int:
        """The simulated index `device` names (the current one for a bare `cuda`)."""
        if isinstance(device, int):
            return device
        device = torch.device(device) if device is not None else torch.device("cuda")
        assert device.type == "cuda", f"not a stand-in device: {device}"
        index = self.current if device.index is None else device.index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (GPU stand-in with {self.count} devices)")
        return index

    def allocated(self, tensor: torch.Tensor, index: int) -> DeviceTensor:
        """Record a new device tensor (live bytes until it is collected) and return it as a DeviceTensor."""
        self.allocations.setdefault(index, []).append(tensor.untyped_storage().nbytes())
        wrapped = _wrap(_plain(tensor), index)
        self.peaks[index] = max(self.peaks.get(index, 0), self.memory_allocated(index))
        return wrapped

    def memory_allocated(self, device: Any = None) -> int:
        """Bytes of the distinct storages of the live tensors on `device`."""
        index = self.index_of(device)
        return _storage_bytes(t for t in list(self.device_tensors) if t.sim_index == index)

    def max_memory_allocated(self, device: Any = None) -> int:
        """The most live bytes on `device` at any allocation since the last `reset_peak_memory_stats`."""
        index = self.index_of(device)
        return max(self.peaks.get(index, 0), self.memory_allocated(index))

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """Start the peak of `device` again from its live bytes now."""
        self.peaks[self.index_of(device)] = self.memory_allocated(device)

    def host_allocated(self, tensor: torch.Tensor) -> None:
        """Track a new host tensor and the peak of the live ones."""
        self.host_tensors.add(tensor)
        self.peak_host = max(self.peak_host, _storage_bytes(list(self.host_tensors)))

    def check_source(self, source: torch.Tensor, what: str) -> None:
        """Refuse (or record) a device copy whose host source lies in a *.safetensors mapping."""
        path = mapped_file(source)
        if path is None:
            return
        self.mapped_copies.append(f"{what} from {path}")
        if self.forbid_mapped:
            raise MappedCopyError(f"{what}: the source {list(source.shape)} {source.dtype} lies in the file mapping "
                                  f"of {path}; copy it into ordinary (pinned) host memory first.")

    def to(self, tensor: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """`tensor.to(*args, **kwargs)` with stand-in devices on either side."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        on_device = isinstance(tensor, DeviceTensor)
        with torch._C.DisableTorchFunctionSubclass():
            plain = tensor.as_subclass(torch.Tensor)
            if device is None or (device.type == "cuda" and on_device and self.index_of(device) == tensor.sim_index):
                return _wrap(plain.to(dtype) if dtype is not None else plain, tensor.sim_index) if on_device else \
                    plain.to(*args, **kwargs)
            moved = plain.to(dtype=dtype or plain.dtype, copy=True)
        if device.type == "cpu":
            return moved
        if not on_device:
            self.check_source(tensor, f".to({device})")
        return self.allocated(moved, self.index_of(device))

    # ------------------------------------------------------------------ torch.cuda

    @contextmanager
    def _device(self, device: Any) -> Iterator[None]:
        before = self.current
        self.current = self.index_of(device)
        try:
            yield
        finally:
            self.current = before

    def _synchronize(self, device: Any = None) -> None:
        self.syncs.append(self.index_of(device))

    def _set_device(self, device: Any) -> None:
        self.current = self.index_of(device)

    def _cuda_api(self) -> dict[str, Any]:
        return {
            "is_available": lambda: True, "device_count": lambda: self.count, "current_device": lambda: self.current,
            "set_device": self._set_device, "device": self._device, "synchronize": self._synchronize,
            "memory_allocated": self.memory_allocated, "max_memory_allocated": self.max_memory_allocated,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "get_device_name": lambda device=None: f"GPU stand-in {self.index_of(device)}",
            "empty_cache": lambda: None,
        }

    def __enter__(self) -> "StandIn":
        global _ACTIVE
        assert _ACTIVE is None, "one StandIn at a time"
        _ACTIVE = self
        for name, fn in self._cuda_api().items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, fn)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        self._mode.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(torch.cuda, name, fn)
        self._saved.clear()
        _ACTIVE = None


_ACTIVE: StandIn | None = None
HOST_FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_like, torch.zeros_like,
                  torch.empty_strided)


def _storage_bytes(tensors: Any) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _active() -> StandIn:
    assert _ACTIVE is not None, "a stand-in device tensor used outside its StandIn"
    return _ACTIVE


class _Mode(TorchFunctionMode):
    """Routes factory calls with a cuda device, `.to(cuda)`, `.cuda()` and pinning through the stand-in."""

    def __init__(self, sim: StandIn) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        sim = self.sim
        if func is torch.Tensor.to and not isinstance(args[0], DeviceTensor):
            return sim.to(args[0], args[1:], kwargs)
        if func is torch.Tensor.cuda:
            return sim.to(args[0], (args[1] if len(args) > 1 else kwargs.get("device", "cuda"),), {})
        if func is torch.Tensor.pin_memory:
            sim.pinned.append((args[0].untyped_storage().nbytes(), sim.current))
            return _plain(args[0]).clone()
        pinned = kwargs.pop("pin_memory", False)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            index = sim.index_of(device)
            kwargs["device"] = "cpu"
            return sim.allocated(func(*args, **kwargs), index)
        out = func(*args, **kwargs)
        if pinned:
            sim.pinned.append((out.untyped_storage().nbytes(), sim.current))
        if func in HOST_FACTORIES and isinstance(out, torch.Tensor) and not isinstance(out, DeviceTensor):
            sim.host_allocated(out)
        return out
