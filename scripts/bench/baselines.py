"""What the suites share: the baselines (the read floors, our load, the whole-tensor loader), child processes
that sample peak RSS, a durable copy, and the conversion rates. Imports no suite.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.formats import Role
from wna16_loader.formats.packing import add_word_bias, pack_bytes, unpack_words
from wna16_loader.load.copies import copy_transposing
from wna16_loader.load.ledger import Ledger
from wna16_loader.load.params import CANONICAL
from wna16_loader.load.plan import LayerPlan, plan_layers
from wna16_loader.models.config import read_config_files
from wna16_loader.models.names import Proj
from wna16_loader.storage.index import CheckpointIndex

SCALE_SIZES = {"qwen3-30b": 48, "qwen3-30b-8l": 8, "qwen3-30b-16l": 16}  # suite_scale: MoE layers of each real-scale size
# suite_names: DeepSeek-V3's tensor list at tiny sizes (decoder layers, dense ones, experts, H, I, G)
NAME_SIZES = {"deepseek-names": {"layers": 61, "dense": 3, "experts": 256, "hidden": 64, "inter": 256, "group": 32}}


def suite_parser(suite: str, doc: str, sizes: list[str], workdir: str, reps: int) -> argparse.ArgumentParser:
    """The options every suite with a contender list takes: --size, --workdir, --reps, --only, --json."""
    parser = argparse.ArgumentParser(prog=f"scripts/bench --suite {suite}", description=doc.split("\n")[0])
    parser.add_argument("--size", choices=sizes, default=sizes[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / workdir)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    parser.add_argument("--json", type=Path)
    return parser


def plans_for(path: Path, parallel: ParallelConfig) -> tuple[Any, list[LayerPlan]]:
    """(MoEConfig, layer plans) of `parallel`'s rank; reads headers only."""
    moe = read_config_files(path)
    with CheckpointIndex(path) as index:
        return moe, plan_layers(index, moe, parallel, Ledger())


def expert_tensors(path: Path, parallel: ParallelConfig | None = None) -> dict[str, list[str]]:
    """file -> names of the expert tensors `parallel`'s rank reads (every expert at TP=1 by default)."""
    _, plans = plans_for(path, parallel or ParallelConfig(1, 0))
    out: dict[str, list[str]] = {}
    for plan in plans:
        for src in plan.sources.values():
            for ref in src.tensors.values():
                out.setdefault(ref.file, []).append(ref.name)
    return out


def expert_bytes(path: Path, parallel: ParallelConfig) -> int:
    """Bytes of the expert tensors of the rank's experts, divided by tp: the rank's share."""
    _, plans = plans_for(path, parallel)
    total = sum(ref.nbytes for plan in plans for src in plan.sources.values() for ref in src.tensors.values())
    return total // parallel.tp_size


def fused_bytes(path: Path, parallel: ParallelConfig) -> int:
    """Bytes of the fused output of `parallel`'s rank."""
    _, plans = plans_for(path, parallel)
    return sum(plan.fused.nbytes for plan in plans)


def run_floor(path: Path, tensors: dict[str, list[str]]) -> list[torch.Tensor]:
    """Read every expert tensor (`tensors`: file -> names, from `expert_tensors`, computed outside the timing)
    with get_tensor, then copy it (touches every byte)."""
    out = []
    for file, names in tensors.items():
        with safe_open(str(path / file), framework="pt") as handle:
            for name in names:
                out.append(handle.get_tensor(name).clone())
    return out


def run_floor_transposed(path: Path, tensors: dict[str, list[str]]) -> list[torch.Tensor]:
    """The floor, except that every 2-D qweight is copied transposed ([K/P, N] words -> [N, K/P], the
    package's tiled copy) into a fresh tensor: the least a GPTQ load to the fused layout must do."""
    out = []
    for file, names in tensors.items():
        with safe_open(str(path / file), framework="pt") as handle:
            for name in names:
                tensor = handle.get_tensor(name)
                if name.endswith(".qweight") and tensor.dim() == 2:
                    fresh = torch.empty(tensor.shape[1], tensor.shape[0], dtype=tensor.dtype)
                    copy_transposing(fresh, tensor.t())
                    out.append(fresh)
                else:
                    out.append(tensor.clone())
    return out


def run_ours(path: Path, parallel: ParallelConfig) -> Any:
    """The loader under test."""
    return load_experts(path, parallel)


def whole_to_fused(spec: Any, role: Role, tensor: torch.Tensor) -> torch.Tensor:
    """Convert one whole checkpoint tensor to canonical fused form (engine-style, no slicing)."""
    layout = spec.layout(role)
    if layout.packed is not None:
        if spec.zero_word_bias and role is Role.ZEROS:
            tensor = add_word_bias(tensor, spec.bits)
        tensor = unpack_words(tensor, bits=spec.bits, dim=layout.dims.index(layout.packed),
                              slot_order=layout.slot_order)
    tensor = tensor.permute([layout.dims.index(d) for d in CANONICAL[role]])
    if role is Role.QWEIGHT:
        return pack_bytes(tensor, bits=spec.bits, dim=1).contiguous()  # [N, K/2]
    if role is Role.ZEROS:
        return pack_bytes(tensor, bits=spec.bits, dim=0).contiguous()  # [N/2, nG]
    return tensor.contiguous()  # scales [N, nG]


def whole_projection(spec: Any, handles: dict[str, Any], src: Any) -> dict[Role, torch.Tensor]:
    """Every role of one projection read whole and converted whole."""
    out = {}
    for role in (Role.QWEIGHT, Role.SCALES, Role.ZEROS):
        ref = src.tensors.get(role)
        if ref is not None and not (role is Role.ZEROS and spec.symmetric):
            tensor = handles[ref.file].get_tensor(ref.name)
            tensor = tensor[src.expert_row] if src.expert_row is not None else tensor
            out[role] = whole_to_fused(spec, role, tensor)
    return out


def narrow_into(buffers: dict[str, torch.Tensor], slot: int, proj: Proj, part: int, cut: Any,
                offset: int, whole: dict[Role, torch.Tensor], bits: int) -> None:
    """Narrow the converted whole tensors to the rank's slice and copy them into the fused buffers."""
    per_byte = 8 // bits
    name = "w2" if proj is Proj.DOWN else "w13"
    half = 0 if proj in (Proj.GATE, Proj.DOWN) else 1
    rows = slice(half * part, (half + 1) * part) if proj is not Proj.DOWN else slice(None)
    n0, n1, groups = cut.n.start + offset, cut.n.stop + offset, torch.tensor(cut.groups)
    q = whole[Role.QWEIGHT][n0:n1, cut.k.start // per_byte:cut.k.stop // per_byte]
    buffers[f"{name}_qweight"][slot, rows].copy_(q)
    buffers[f"{name}_scales"][slot, rows].copy_(whole[Role.SCALES][n0:n1].index_select(1, groups))
    if Role.ZEROS in whole:
        zrows = slice(rows.start // per_byte, rows.stop // per_byte) if rows.start is not None else slice(None)
        z = whole[Role.ZEROS][n0 // per_byte:n1 // per_byte].index_select(1, groups)
        buffers[f"{name}_qzeros"][slot, zrows].copy_(z)


def run_whole(path: Path, parallel: ParallelConfig) -> list[dict[str, torch.Tensor]]:
    """Whole-tensor loader for one rank (baseline; act-order g_idx is not handled)."""
    moe, plans = plans_for(path, parallel)
    handles = {file: safe_open(str(path / file), framework="pt") for file in {
        ref.file for plan in plans for src in plan.sources.values() for ref in src.tensors.values()}}
    out = []
    for plan in plans:
        buffers = {n: torch.empty(s, dtype=d) for n, (s, d) in plan.fused.shapes().items()}
        buffers["expert_ids"].copy_(torch.tensor(plan.fused.experts, dtype=torch.int32))
        for slot, expert in enumerate(plan.fused.experts):
            for proj in Proj:
                src = plan.sources[(expert, proj)]
                whole = whole_projection(moe.quant, handles, src)
                narrow_into(buffers, slot, proj, plan.geometry.part, plan.geometry.slice(proj),
                            src.n_offset(proj), whole, moe.quant.bits)
        out.append(buffers)
    return out


def release_freed_memory() -> None:
    """Collect garbage, then hand glibc's freed heap pages back to the OS (malloc_trim).

    Without it, contenders made of many small allocations (the floor) reuse pages an earlier
    repetition already faulted in, while large allocations (the fused parameters) always get
    fresh pages: a real load starts with neither, so every timed run starts without recycled memory.
    """
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc: nothing is recycled the same way
        pass


CHILD = """
import json, sys, threading, time
sys.path[:0] = [{here!r}, {root!r}]
from bench import baselines as bench
peaks = {{"RssAnon": 0, "RssFile": 0}}
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {{k: int(fields[k].split()[0]) for k in ("RssAnon", "RssFile", "VmHWM")}}
def sample(stop):
    while not stop.is_set():
        now = status()
        for key in peaks:
            peaks[key] = max(peaks[key], now[key])
        time.sleep(0.002)
stop = threading.Event()
before = status()
thread = threading.Thread(target=sample, args=(stop,), daemon=True)
thread.start()
result = bench.child_task({mode!r}, {path!r}, {tp}, {rank}, {ep}, {ep_rank})
stop.set(); thread.join()
after = status()
print(json.dumps({{"before_kib": before["RssAnon"], "peak_kib": max(peaks["RssAnon"], after["RssAnon"]),
                  "file_peak_kib": peaks["RssFile"], "hwm_kib": after["VmHWM"]}}))
"""


def child_task(mode: str, path: str, tp: int, rank: int, ep: int, ep_rank: int) -> Any:
    """What a measuring subprocess runs."""
    cfg = ParallelConfig(tp_size=tp, tp_rank=rank, ep_size=ep, ep_rank=ep_rank)
    if mode == "floor":
        return run_floor(Path(path), expert_tensors(Path(path)))  # RSS only: planning adds no memory to speak of
    if mode == "whole":
        return run_whole(Path(path), cfg)
    if mode == "preshard":
        return run_preshard(Path(path), tp)
    return run_ours(Path(path), cfg)


def run_preshard(path: Path, tp: int) -> None:
    """wna16-shard of `path` at TP=`tp` into a scratch folder next to it (removed afterwards)."""
    from wna16_loader.preshard import preshard_checkpoint

    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        preshard_checkpoint(path, Path(tmp) / "out", tp_size=tp, progress=False)


def run_child(mode: str, path: Path, tp: int = 1, rank: int = 0, ep: int = 1, ep_rank: int = 0) -> dict[str, int]:
    """Run one load in a fresh interpreter; its RSS just before the load and its ru_maxrss after, in KiB."""
    code = CHILD.format(here=str(Path(__file__).resolve().parent.parent), root=str(Path(__file__).resolve().parents[2]),
                        mode=mode, path=str(path), tp=tp, rank=rank, ep=ep,
                        ep_rank=ep_rank)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def durable_copy(src: Path, dst: Path) -> float:
    """cp -r, then fsync every file and folder: what a durable copy costs."""
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    for root, _, names in os.walk(dst):
        for name in names:
            fd = os.open(Path(root) / name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


# ---------------------------------------------------------------- conversions: GB/s against a plain copy

CONVERSION_SHAPE = (64, 2048, 768)  # experts, K, N of one projection (Qwen3-30B-A3B's gate: H 2048, I 768)


def _best_rate(fn: Any, nbytes: int, reps: int = 5) -> float:
    """GB/s of the fastest of `reps` runs of `fn` over `nbytes` bytes."""
    fn()  # warm: page faults of the outputs, caches of the kernels
    best = min(_time_once(fn) for _ in range(reps))
    return nbytes / best / 1e9


def _time_once(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def conversion_cases(shape: tuple[int, int, int] = CONVERSION_SHAPE) -> dict[str, tuple[Any, int]]:
    """label -> (zero-argument conversion, bytes it moves) on 4-bit words of `shape` (E, K, N), a chunk of
    experts at a time as the loader converts them (about QWEIGHT_CHUNK_BYTES of words; NIBBLE_CHUNK_BYTES for
    the nibble transpose, written straight into the output as the writer does), outputs allocated once (what is
    measured is the conversion, not page faults)."""
    import hashlib

    from wna16_loader.formats.packing import transpose_nibble_words
    from wna16_loader.load.qweights import NIBBLE_CHUNK_BYTES, QWEIGHT_CHUNK_BYTES

    e, k, n = shape
    gptq = torch.randint(-2**31, 2**31 - 1, (e, k // 8, n), dtype=torch.int32)  # qweight [K/8, N]
    awq = torch.randint(-2**31, 2**31 - 1, (e, k, n // 8), dtype=torch.int32)  # qweight [K, N/8]
    out = torch.empty((e, n, k // 8), dtype=torch.int32)  # fused [N, K/2] bytes as words
    plain = torch.empty_like(gptq)
    nbytes, step = gptq.numel() * 4, max(1, QWEIGHT_CHUNK_BYTES // (gptq[0].numel() * 4))
    chunks = [slice(i, min(i + step, e)) for i in range(0, e, step)]
    nibble_step = max(1, NIBBLE_CHUNK_BYTES // (awq[0].numel() * 4))
    nibble_chunks = [slice(i, min(i + nibble_step, e)) for i in range(0, e, nibble_step)]
    data = memoryview(gptq.reshape(-1).view(torch.uint8).numpy())
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's slot order

    def each(fn: Any) -> Any:
        return lambda: [fn(c) for c in chunks]

    return {
        "plain copy": (each(lambda c: plain[c].copy_(gptq[c])), nbytes),
        "GPTQ qweight transpose [K/8, N] -> [N, K/8]": (
            each(lambda c: copy_transposing(out[c], gptq[c].transpose(1, 2))), nbytes),
        "AWQ nibble transpose [K, N/8] -> [N, K/8]": (
            lambda: [transpose_nibble_words(awq[c], slot_order=order, out=out[c]) for c in nibble_chunks], nbytes),
        "sha256 (wna16-shard hashes every byte once)": (lambda: hashlib.sha256(data).digest(), nbytes),
    }


def conversion_rates(threads: tuple[int, ...] = (1, 2)) -> dict[str, dict[str, float]]:
    """label -> {'1 thread': GB/s, '2 threads': GB/s, 'x copy (1 thread)': ratio} of every conversion case."""
    before = torch.get_num_threads()
    cases = conversion_cases()
    out: dict[str, dict[str, float]] = {label: {} for label in cases}
    try:
        for count in threads:
            torch.set_num_threads(count)
            for label, (fn, nbytes) in cases.items():
                out[label][f"{count} thread{'s' if count > 1 else ''}"] = _best_rate(fn, nbytes)
    finally:
        torch.set_num_threads(before)
    copy = out["plain copy"]
    for label, rates in out.items():
        rates.update({f"÷ copy, {key}": copy[key] / value for key, value in list(rates.items())})
    return out


def conversion_table(rates: dict[str, dict[str, float]]) -> str:
    """A markdown table of `conversion_rates`."""
    keys = [k for k in next(iter(rates.values())) if not k.startswith("÷")]
    e, k, n = CONVERSION_SHAPE
    lines = [f"| conversion ({e} experts × K {k} × N {n}, 4-bit, {e * k * n // 2 / 1e6:.0f} MB of words) | "
             + " | ".join(f"GB/s, {k}" for k in keys) + " | " + " | ".join(f"time ÷ copy, {k}" for k in keys) + " |",
             "|---|" + "---|" * (2 * len(keys))]
    for label, r in rates.items():
        lines.append(f"| {label} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " | "
                     + " | ".join(f"{r['÷ copy, ' + k]:.2f}" for k in keys) + " |")
    return "\n".join(lines)
