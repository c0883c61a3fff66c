"""Suite device: host-to-device bandwidth and per-rank device loads (CUDA or ROCm), each checked exact.

Usage: python scripts/bench --suite device --workdir /tmp/wna16-bench --size small --reps 3 --json device.json

Measures, on one checkpoint per format (the ones suite small builds), on one device (default: the
last visible GPU, cuda:{count-1}):
  h2d        GB/s of sending every expert tensor of the checkpoint to the device,
             (a) staged: one copy out of the file mapping into pinned host memory, then the transfer
                 (what the loader does; both parts timed, and the transfer alone) and
             (b) directly from the safetensors mapping (pageable memory: the driver stages it itself);
  load       load_experts(device=...) for EVERY rank at TP = 1, 2, 4, 8, weights converted on the device
             (the default) and on the host, and the rank's wna16-shard output at the largest TP: median
             and slowest rank; every rank's device load is checked bit-identical to its CPU load.
Device and pinned-host caches are emptied before every repetition; the bytes allocated on any other
GPU are recorded (must be 0). With `--tests-junit`, the pass/fail counts of a pytest run are added.
`--device cpu` runs every step on the CPU, `--stand-in` on the GPU stand-in of the tests (cuda:N tensors on
the CPU, with its checks): the numbers then mean nothing; both check the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from wna16_loader import LoadedExperts, ParallelConfig, load_experts
from wna16_loader.load.device import DevicePolicy
from wna16_loader.preshard import preshard_checkpoint
from wna16_loader.testing.standin import StandIn

from . import suite_small as bench
from .baselines import expert_tensors, release_freed_memory


def empty_caches(policy: DevicePolicy) -> None:
    """Free what earlier repetitions left: Python garbage, glibc's heap, the device and pinned-host caches."""
    release_freed_memory()
    if policy.gpu:
        policy.synchronize()
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # the pinned-memory cache (recent PyTorch)
        if host_empty is not None:
            host_empty()


def timed(fn: Callable[[], Any], policy: DevicePolicy, reps: int) -> tuple[dict[str, float], Any]:
    """(median / min seconds of `fn` over `reps` runs with device work included, the last run's result)."""
    seconds, result = [], None
    for _ in range(reps):
        result = None
        empty_caches(policy)
        start = time.perf_counter()
        result = fn()
        policy.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"median": statistics.median(seconds), "min": min(seconds)}, result


def mapped_tensors(path: Path) -> list[torch.Tensor]:
    """Every expert tensor of the checkpoint as a view of its file mapping."""
    out = []
    for file, names in expert_tensors(path).items():
        handle = safe_open(str(path / file), framework="pt")
        out += [handle.get_tensor(name) for name in names]
    return out


def h2d(path: Path, policy: DevicePolicy, reps: int) -> dict[str, Any]:
    """Transfer bandwidth of the expert bytes: pinned staging against a direct copy from the mapping."""
    tensors = mapped_tensors(path)
    total = sum(t.numel() * t.element_size() for t in tensors)
    with policy.scope():
        pinned = [policy.host_buffer(tuple(t.shape), t.dtype) for t in tensors]

    def stage() -> None:
        for src, dst in zip(tensors, pinned):
            dst.copy_(src)

    def staged_send() -> list[torch.Tensor]:
        stage()
        return [policy.upload(buf) for buf in pinned]

    def send_pinned() -> list[torch.Tensor]:
        return [policy.upload(buf) for buf in pinned]

    def send_mapped() -> list[torch.Tensor]:
        return [t.to(policy.target) for t in tensors]  # what the loader never does: measured for comparison

    out: dict[str, Any] = {"bytes": total}
    for label, fn in (("mapped -> pinned -> device", staged_send), ("pinned -> device", send_pinned),
                      ("mapped -> device (direct)", send_mapped)):
        with policy.scope():
            t, _ = timed(fn, policy, reps)
        out[label] = {**t, "gb_per_s": total / t["median"] / 1e9}
    return out


def check_equal(cpu: LoadedExperts, loaded: LoadedExperts, policy: DevicePolicy, what: str) -> None:
    """Every tensor of `loaded` lies on the full target device and equals the CPU load bit for bit."""
    assert sorted(cpu) == sorted(loaded), what
    for prefix, layer in cpu.items():
        for name, tensor in layer.tensors.items():
            moved = loaded[prefix].tensors[name]
            if moved.device != policy.target or not torch.equal(moved.cpu(), tensor):
                raise SystemExit(f"MISMATCH {what} {prefix}.{name}: on {moved.device}, target {policy.target}")


class CpuLoads(dict[tuple[int, int], LoadedExperts]):
    """The CPU load of each (TP, rank) of one checkpoint, made once: the reference of every device load."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def __missing__(self, key: tuple[int, int]) -> LoadedExperts:
        self[key] = load_experts(self.path, ParallelConfig(*key))
        return self[key]


def ranks(cpu: CpuLoads, tp: int, policy: DevicePolicy, reps: int, load: Callable[..., LoadedExperts],
          what: str) -> dict[str, Any]:
    """Time `load(parallel)` for every rank of TP `tp`; each rank's result checked against its CPU load."""
    medians = []
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=1):
        t, result = timed(lambda: load(parallel), policy, reps)
        medians.append(t["median"])
        check_equal(cpu[(tp, parallel.rank)], result, policy, f"{what} rank {parallel.rank}")
    return {"median_rank_s": statistics.median(medians), "max_rank_s": max(medians), "ranks": tp, "checked": tp}


def loads(path: Path, policy: DevicePolicy, reps: int, workdir: Path, deadline: float) -> dict[str, Any]:
    """Per-rank device loads at every TP, both conversions, and from a wna16-shard output (what does not
    start before `deadline`, a perf_counter time, is recorded as skipped)."""
    out: dict[str, Any] = {}
    cpu, tps = CpuLoads(path), [1] + bench.valid_tps(path)
    for tp in tps:
        for convert in (True, False):
            key = f"tp{tp} {'device' if convert else 'host'} conversion"
            out[key] = {"skipped": "time budget"} if time.perf_counter() > deadline else \
                ranks(cpu, tp, policy, reps, lambda p, c=convert: load_experts(
                    path, p, device=policy.target, convert_on_device=c), f"{path.name} {key}")
    sharded = workdir / f"{path.name}-tp{tps[-1]}"
    if time.perf_counter() > deadline:
        out[f"tp{tps[-1]} pre-sharded"] = {"skipped": "time budget"}
        return out
    if not (sharded / "wna16_manifest.json").is_file():
        preshard_checkpoint(path, sharded, tp_size=tps[-1], progress=False)
    out[f"tp{tps[-1]} pre-sharded"] = ranks(cpu, tps[-1], policy, reps, lambda p: load_experts(
        sharded, p, device=policy.target), f"{sharded.name}")
    return out


def other_devices(policy: DevicePolicy) -> dict[str, int]:
    """Bytes the caching allocator holds on every GPU but the target (the loader must leave them alone)."""
    if not policy.gpu:
        return {}
    return {f"cuda:{i}": torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())
            if i != policy.target.index}


def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped of a pytest --junitxml file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, f"{path}: no testsuite"
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def table(results: dict[str, Any]) -> str:
    """A short plain-text summary of the JSON."""
    lines = [f"device {results['device']} ({results['runtime']}, target {results['target']}), size {results['size']}"]
    if "tests" in results:
        t = results["tests"]
        lines.append(f"GPU tests: {t['tests'] - t['failures'] - t['errors'] - t['skipped']} passed, "
                     f"{t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped")
    lines.append(f"other GPUs: {results['other_devices'] or 'none'}")
    for fmt, res in results["formats"].items():
        lines.append(f"[{fmt}] H2D GB/s: " + ", ".join(f"{k} {v['gb_per_s']:.1f}" for k, v in res["h2d"].items()
                                                     if isinstance(v, dict)))
        for key, v in res["load"].items():
            if "skipped" in v:
                lines.append(f"[{fmt}] {key:<26} skipped ({v['skipped']})")
                continue
            lines.append(f"[{fmt}] {key:<26} median rank {v['median_rank_s'] * 1e3:8.1f} ms, slowest "
                         f"{v['max_rank_s'] * 1e3:8.1f} ms, {v['checked']}/{v['ranks']} ranks exact")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench --suite device", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/wna16-bench"))
    parser.add_argument("--size", choices=sorted(bench.SIZES), default="small")
    parser.add_argument("--formats", default="gptq,awq,ct", help="comma-separated subset of gptq,awq,ct")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default=None, help="cuda:N (also ROCm; default: the last GPU) or cpu (dry run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tests-junit", type=Path, help="a pytest --junitxml file to include in the summary")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new TP size after this many seconds (the rest is recorded as skipped)")
    parser.add_argument("--stand-in", action="store_true", help="dry run on 2 simulated GPUs (no GPU needed)")
    args = parser.parse_args(argv)
    if args.stand_in:
        with StandIn(count=2, forbid_mapped=False):  # the benchmark measures a direct copy from the mapping
            run(args)
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    """The benchmark for parsed `args`."""
    if args.device is None and not torch.cuda.is_available():
        raise SystemExit("no CUDA or ROCm device is visible: nothing to measure (use --device cpu for a dry run)")
    policy = DevicePolicy.of(args.device or f"cuda:{torch.cuda.device_count() - 1}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    runtime = "CPU" if not policy.gpu else f"HIP {torch.version.hip}" if torch.version.hip else \
        f"CUDA {torch.version.cuda}"
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(policy.target) if policy.gpu else "cpu",
                               "runtime": runtime, "target": str(policy.target), "torch": torch.__version__,
                               "size": args.size, "reps": args.reps, "formats": {}}
    if args.tests_junit:
        results["tests"] = junit_counts(args.tests_junit)
    deadline = time.perf_counter() + args.budget_s
    for fmt in args.formats.split(","):
        path = bench.build_checkpoint(args.workdir, fmt, args.size)
        load_experts(path, ParallelConfig(1, 0), device=policy.target)  # warm the page cache and the kernels
        results["formats"][fmt] = {"h2d": h2d(path, policy, args.reps),
                                   "load": loads(path, policy, args.reps, args.workdir, deadline)}
        print(json.dumps({fmt: results["formats"][fmt]}, indent=1), flush=True)
    results["other_devices"] = {k: v for k, v in other_devices(policy).items() if v}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(table(results))
    if results["other_devices"]:
        raise SystemExit(f"memory allocated on other GPUs than {policy.target}: {results['other_devices']}")

