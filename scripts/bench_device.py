#!/usr/bin/env python3
"""Device benchmark: host-to-device bandwidth and per-rank load time on a GPU (CUDA or ROCm).

Usage: python scripts/bench_device.py --workdir /tmp/wna16-bench --size full --reps 3 --json device.json

Measures, on one checkpoint per format (the same ones scripts/bench.py builds):
  h2d        GB/s of sending every expert tensor of the checkpoint to the device,
             (a) from pinned host memory (the loader's staging: one copy out of the file mapping, then
                 the transfer; both parts timed) and
             (b) directly from the safetensors mapping (pageable memory: the driver stages it itself);
  load       load_experts(device=...) for every rank at TP = 1, 2, 4, 8, with the weights converted on
             the device (the default) and on the host, each checked equal to the CPU load.

`--device cpu` runs every step on the CPU (the numbers then mean nothing; it checks the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import bench  # noqa: E402  (the checkpoint builder and contenders of the CPU benchmark)
from wna16_loader import ParallelConfig, load_experts  # noqa: E402


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int) -> dict[str, float]:
    """median / min seconds of `fn` over `reps` runs, device work included."""
    seconds = []
    for _ in range(reps):
        bench.release_freed_memory()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return {"median": statistics.median(seconds), "min": min(seconds)}


def mapped_tensors(path: Path) -> list[torch.Tensor]:
    """Every expert tensor of the checkpoint as a view of its file mapping."""
    out = []
    for file, names in bench.expert_tensors(path).items():
        handle = safe_open(str(path / file), framework="pt")
        out += [handle.get_tensor(name) for name in names]
    return out


def h2d(path: Path, device: torch.device, reps: int) -> dict[str, Any]:
    """Transfer bandwidth of the expert bytes: pinned staging against a direct copy from the mapping."""
    tensors = mapped_tensors(path)
    total = sum(t.numel() * t.element_size() for t in tensors)
    pin = device.type == "cuda"
    pinned = [torch.empty_like(t, pin_memory=pin) for t in tensors]

    def stage() -> None:
        for src, dst in zip(tensors, pinned):
            dst.copy_(src)

    def send_pinned() -> None:
        for buf in pinned:
            buf.to(device, non_blocking=True)

    def send_mapped() -> None:
        for t in tensors:
            t.to(device)

    out: dict[str, Any] = {"bytes": total}
    for label, fn in (("stage into pinned", stage), ("pinned -> device", send_pinned),
                      ("mapped -> device (direct)", send_mapped)):
        t = timed(fn, device, reps)
        out[label] = {**t, "gb_per_s": total / t["median"] / 1e9}
    return out


def loads(path: Path, device: torch.device, reps: int) -> dict[str, Any]:
    """Per-rank load time on `device`, weights converted there and on the host; checked against the CPU."""
    out: dict[str, Any] = {}
    for tp in [1] + bench.valid_tps(path):
        for convert_on_device in (True, False):
            medians = []
            for rank in range(tp):
                cfg = ParallelConfig(tp, rank)
                t = timed(lambda: load_experts(path, cfg, device=device, convert_on_device=convert_on_device),
                          device, reps)
                medians.append(t["median"])
            check_equal(path, ParallelConfig(tp, tp - 1), device, convert_on_device)
            key = f"tp{tp} {'device' if convert_on_device else 'host'} conversion"
            out[key] = {"median_rank": statistics.median(medians), "max_rank": max(medians), "ranks": tp}
    return out


def check_equal(path: Path, cfg: ParallelConfig, device: torch.device, convert_on_device: bool) -> None:
    """The device load must be bit-identical to the CPU load."""
    on_cpu = load_experts(path, cfg)
    on_device = load_experts(path, cfg, device=device, convert_on_device=convert_on_device)
    for prefix, layer in on_cpu.items():
        for name, tensor in layer.tensors.items():
            moved = on_device[prefix].tensors[name]
            if moved.device.type != device.type or not torch.equal(moved.cpu(), tensor):
                raise SystemExit(f"MISMATCH {path.name} {cfg} {prefix}.{name} (convert_on_device={convert_on_device})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/wna16-bench"))
    parser.add_argument("--size", choices=sorted(bench.SIZES), default="small")
    parser.add_argument("--formats", default="gptq,awq,ct", help="comma-separated subset of gptq,awq,ct")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda (also ROCm), cuda:N, or cpu for a dry run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA or ROCm device is visible: nothing to measure (use --device cpu for a dry run)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    runtime = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    results: dict[str, Any] = {"device": name, "runtime": runtime, "size": args.size, "formats": {}}
    for fmt in args.formats.split(","):
        path = bench.build_checkpoint(args.workdir, fmt, args.size)
        load_experts(path, ParallelConfig(1, 0), device=device)  # warm the page cache, the kernels, the allocator
        results["formats"][fmt] = {"h2d": h2d(path, device, args.reps), "load": loads(path, device, args.reps)}
        print(json.dumps({fmt: results["formats"][fmt]}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
