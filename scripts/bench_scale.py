#!/usr/bin/env python3
"""Real-scale benchmark: a Qwen3-30B-A3B-shaped GPTQ checkpoint (128 experts, H 2048, I 768, 4-bit, G 128).

Usage: python scripts/bench_scale.py --size qwen3-30b-8l --workdir /tmp/wna16-scale --reps 2 --json out.json
       (also reached as `scripts/bench.py --size qwen3-30b[-8l]`)

The checkpoint is written directly (constant words, finite constant scales; the load does the same work
whatever the values), one file per layer, its tensors in the order safetensors' own writer uses (wider dtypes
first, then by name: experts 0, 1, 10, 100, ... so a rank's experts are not evenly spaced in the file). Every measurement runs in a fresh interpreter with the imports
done before the clock starts, alternated within each repetition, warm (files read back into the page
cache first) and cold (every file evicted with posix_fadvise(DONTNEED) first). Per run: seconds, µs per
expert tensor the rank reads, minor/major page faults of the process (getrusage), and for cold runs the
source pages the run brought into the page cache (mincore). Contenders:

  floor      every expert tensor read once (get_tensor + clone, file by file)
  floortr    the floor with every qweight copied transposed ([K/8, N] -> [N, K/8], the fused layout's
             order): the least a TP 1 load must do
  own        the expert tensors of EP 8 rank 7 only (its own bytes); owntr: the same, qweights transposed
  tp1        load_experts, TP 1 (per-tensor overhead = (tp1 - floortr) / expert tensors)
  tp8 / ep8  load_experts, TP 8 rank 7 / EP 8 rank 7
  whole      the whole-tensor loader of scripts/bench.py, TP 8 rank 7
  pre        load_experts of a wna16-shard --tp 8 output, rank 7; prefiles: reading that rank's files
  shard      wna16-shard --tp 8 (fused) in one process; shard2: the same over 2 torchrun processes
             (both timed from outside, interpreter start included); copy: cp -r + fsync of every file
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_common import SCALE_SIZES  # noqa: E402  (MoE layers per size)

TP1_MAX_BYTES = 4 << 30  # TP 1 holds the whole fused model: only where it and the checkpoint fit the page cache
EXPERTS, HIDDEN, INTER, GROUP = 128, 2048, 768, 128


def build(workdir: Path, size: str) -> Path:
    """Write the checkpoint once: header, then constant bytes per tensor (no packing, no randomness)."""
    import torch

    from wna16_loader.formats import Role, resolve_quant_spec
    from wna16_loader.load.params import SourceTensors, expected_shape
    from wna16_loader.models.names import Source
    from wna16_loader.testing.synthetic import WRITER_MODELS, model_config, quant_config

    folder = workdir / f"{size}-gptq-int4-g{GROUP}"
    if (folder / ".complete").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    qc = quant_config("gptq", bits=4, group_size=GROUP, symmetric=True)
    spec, layers = resolve_quant_spec(qc), SCALE_SIZES[size]
    config = model_config(WRITER_MODELS["qwen3_moe"], qc, num_experts=EXPERTS, hidden=HIDDEN, intermediate=INTER,
                          num_layers=layers, top_k=8)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    fill = {Role.QWEIGHT: (torch.int32, 0x76543210), Role.ZEROS: (torch.int32, 0x77777777),
            Role.SCALES: (torch.float16, 0.0125)}
    names = {"I32": torch.int32, "F16": torch.float16}
    dtype_name = {v: k for k, v in names.items()}
    weight_map = {}
    for layer in range(layers):
        tensors = {}  # name -> (dtype, shape, bytes)
        for expert in range(EXPERTS):
            for proj in ("down_proj", "gate_proj", "up_proj"):
                source = Source.DOWN if proj == "down_proj" else Source(proj.removesuffix("_proj"))
                n, k = (HIDDEN, INTER) if proj == "down_proj" else (INTER, HIDDEN)
                src = SourceTensors(source, {}, None, n, k)
                for role, (dtype, value) in fill.items():
                    layout = spec.layout(role)
                    shape = expected_shape(layout, spec, src, EXPERTS)
                    name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.{layout.suffix}"
                    tensors[name] = (dtype, shape, torch.full(shape, value, dtype=dtype).numpy().tobytes())
        entries, blobs, offset = {}, [], 0
        for name in sorted(tensors, key=lambda t: (-tensors[t][0].itemsize, t)):  # safetensors' writer order
            dtype, shape, blob = tensors[name]
            entries[name] = {"dtype": dtype_name[dtype], "shape": list(shape),
                             "data_offsets": [offset, offset + len(blob)]}
            blobs.append(blob)
            offset += len(blob)
        file = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(folder / file, "wb") as handle:
            handle.write(len(header).to_bytes(8, "little") + header)
            for blob in blobs:
                handle.write(blob)
        weight_map.update(dict.fromkeys(entries, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / ".complete").write_text("ok\n")
    return folder


# ---------------------------------------------------------------- children (one run per interpreter)

def child(mode: str, path: str, extra: str) -> dict[str, Any]:
    """One timed run; imports and planning of the name lists happen before the clock."""
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))

    from bench_common import expert_tensors, run_floor, run_floor_transposed, run_whole

    from wna16_loader import ParallelConfig, load_experts

    folder = Path(path)
    tp1, tp8, ep8 = ParallelConfig(1, 0), ParallelConfig(8, 7), ParallelConfig(1, 0, 8, 7)
    hold = sum(f.stat().st_size for f in files_of(folder)) < TP1_MAX_BYTES  # keep every copy, as a load does
    floor = run_floor if hold else lambda path, t: per_file(run_floor, path, t)
    floortr = run_floor_transposed if hold else lambda path, t: per_file(run_floor_transposed, path, t)
    prepared = {
        "floor": lambda: (lambda t: lambda: floor(folder, t))(expert_tensors(folder)),
        "floortr": lambda: (lambda t: lambda: floortr(folder, t))(expert_tensors(folder)),
        "own": lambda: (lambda t: lambda: run_floor(folder, t))(expert_tensors(folder, ep8)),  # a rank's share fits
        "owntr": lambda: (lambda t: lambda: run_floor_transposed(folder, t))(expert_tensors(folder, ep8)),
        "tp1": lambda: lambda: load_experts(folder, tp1),
        "tp8": lambda: lambda: load_experts(folder, tp8),
        "ep8": lambda: lambda: load_experts(folder, ep8),
        "whole": lambda: lambda: run_whole(folder, tp8),
        "pre": lambda: lambda: load_experts(folder, tp8),
        "prefiles": lambda: (lambda fs: lambda: [f.read_bytes() for f in fs])(
            sorted((folder / "rank-00007-of-00008").glob("*.safetensors"))),
    }[mode]()
    scope = {"tp8": tp8, "whole": tp8, "ep8": ep8, "own": ep8, "owntr": ep8, "tp1": None, "floor": None,
             "floortr": None}
    tensors = sum(len(v) for v in expert_tensors(folder, scope[mode]).values()) if mode in scope else 0
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    result = prepared()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    del result
    return {"seconds": seconds, "tensors": tensors, "minflt": after.ru_minflt - before.ru_minflt,
            "majflt": after.ru_majflt - before.ru_majflt}


def per_file(floor: Any, folder: Path, tensors: dict[str, list[str]]) -> None:
    """A floor read file by file, each file's copies dropped before the next: for checkpoints over
    TP1_MAX_BYTES, where holding every copy would push the checkpoint itself out of the page cache of a
    24 GiB machine (the copies then reuse freed memory: fewer page faults than a load that keeps its output)."""
    for file, names in tensors.items():
        floor(folder, {file: names})


def run_child(mode: str, path: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--child", mode, str(path)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{mode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- parent

def files_of(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.safetensors"))


def warm(folder: Path) -> None:
    for file in files_of(folder):
        with open(file, "rb") as handle:
            while handle.read(64 << 20):
                pass


def timed_cli(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True)
    return time.perf_counter() - start


def measure(path: Path, reps: int, scratch: Path) -> dict[str, Any]:
    from bench_common import durable_copy, evict, resident_bytes
    from bench_common import run_child as bench_child

    out: dict[str, list[dict[str, Any]]] = {}
    pre = scratch / "pre"
    subprocess.run([sys.executable, "-m", "wna16_loader.cli", str(path), str(pre), "--tp", "8", "--quiet"],
                   check=True, cwd=HERE.parent)
    whole_model = ("tp1",) if sum(f.stat().st_size for f in files_of(path)) < TP1_MAX_BYTES else ()
    loads = [(m, path) for m in ("floor", "floortr", *whole_model, "own", "owntr", "tp8", "ep8", "whole")]
    loads += [("pre", pre), ("prefiles", pre)]
    for rep in range(reps):
        for cold in (False, True):
            for mode, folder in loads:
                files = files_of(path) + files_of(pre)
                if cold:
                    evict(files)
                else:
                    warm(folder)
                resident = sum(resident_bytes(f) for f in files) if cold else 0
                result = run_child(mode, folder)
                if cold:
                    result["touched_mib"] = (sum(resident_bytes(f) for f in files) - resident) / 2**20
                out.setdefault(f"{mode} {'cold' if cold else 'warm'}", []).append(result)
                print(f"rep {rep} {mode} {'cold' if cold else 'warm'}: {result}", flush=True)
        cli = [sys.executable, "-m", "wna16_loader.cli", str(path)]
        for label, target, args in (
                ("shard", scratch / "s1", cli + [str(scratch / "s1"), "--tp", "8", "--quiet"]),
                ("shard2", scratch / "s2", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                            "-m", "wna16_loader.cli", str(path), str(scratch / "s2"), "--tp", "8",
                                            "--quiet"])):
            shutil.rmtree(target, ignore_errors=True)  # a finished output would be left untouched, not rewritten
            warm(path)
            seconds = timed_cli(args)
            shutil.rmtree(target, ignore_errors=True)  # disk: 15 GB each at full size
            out.setdefault(label, []).append({"seconds": seconds})
            print(f"rep {rep} {label}: {seconds:.2f} s", flush=True)
        shutil.rmtree(scratch / "copy", ignore_errors=True)
        warm(path)
        out.setdefault("copy", []).append({"seconds": durable_copy(path, scratch / "copy")})
        shutil.rmtree(scratch / "copy", ignore_errors=True)
    warm(path)
    rss = bench_child("preshard", path, 8, 0)  # peak anonymous RSS of wna16-shard --tp 8 (sampled in the child)
    out["shard rss"] = [{"seconds": 0.0, "peak_anon_mib": rss["peak_kib"] / 1024,
                         "file_peak_mib": rss["file_peak_kib"] / 1024}]
    return {key: {"seconds": statistics.median(r["seconds"] for r in runs),
                  **{k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "seconds"}}
            for key, runs in out.items()}


def report(m: dict[str, Any]) -> str:
    """The targets of issue 13, each ratio from medians of the same run."""

    s = lambda k: m[k]["seconds"]  # noqa: E731
    rows = [("TP 8 rank ÷ all-experts floor (warm)", s("tp8 warm") / s("floor warm"), "<= 1.5"),
            ("whole-tensor ÷ ours, TP 8 rank (warm)", s("whole warm") / s("tp8 warm"), ">= 5"),
            ("EP 8 rank ÷ reading its own bytes (warm)", s("ep8 warm") / s("own warm"), "<= 1.2"),
            ("EP 8 rank ÷ its own bytes with qweights transposed (warm)", s("ep8 warm") / s("owntr warm"), "(bound)"),
            ("all-experts floor with qweights transposed ÷ floor (warm)", s("floortr warm") / s("floor warm"),
             "(the transpose)"),
            ("pre-sharded rank ÷ reading its files (warm)", s("pre warm") / s("prefiles warm"), "<= 1.2"),
            ("wna16-shard --tp 8 fused ÷ durable copy", s("shard") / s("copy"), "<= 3"),
            ("2-process wna16-shard ÷ 1 process", s("shard2") / s("shard"), "<= 0.6"),
            ("peak anonymous RSS of wna16-shard --tp 8, GiB", m["shard rss"]["peak_anon_mib"] / 1024, "<= 1"),
            ("TP 8 rank ÷ floor (cold)", s("tp8 cold") / s("floor cold"), "(cold view)"),
            ("EP 8 rank ÷ own bytes (cold)", s("ep8 cold") / s("own cold"), "(cold view)")]
    if "tp1 warm" in m:  # sizes where the whole fused model and the checkpoint fit the page cache
        rows[4:4] = [
            ("TP 1 ÷ all-experts floor (warm)", s("tp1 warm") / s("floor warm"), "<= 1.5"),
            ("TP 1 ÷ floor with qweights transposed (warm)", s("tp1 warm") / s("floortr warm"), "(bound)"),
            ("TP 8 rank ÷ TP 1 (warm)", s("tp8 warm") / s("tp1 warm"), "<= 0.35"),
            ("per-tensor overhead, µs: (TP 1 - floor transposed) / tensors",
             1e6 * (s("tp1 warm") - s("floortr warm")) / m["tp1 warm"]["tensors"], "<= 15")]
    lines = ["| measure | ratio | target |", "|---|---|---|"]
    lines += [f"| {name} | {value:.2f} | {target} |" for name, value, target in rows]
    lines += ["", "| run | seconds | µs / expert tensor | minor faults | pages touched cold (MiB) |", "|---|---|---|---|---|"]
    for key, v in m.items():
        if key == "shard rss":
            continue
        per = f"{v['seconds'] / v['tensors'] * 1e6:.1f}" if v.get("tensors") else ""
        lines.append(f"| {key} | {v['seconds']:.3f} | {per} | {v.get('minflt', '')} | "
                     f"{v.get('touched_mib', ''):.1f} |" if "touched_mib" in v else
                     f"| {key} | {v['seconds']:.3f} | {per} | {v.get('minflt', '')} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SCALE_SIZES), default="qwen3-30b-8l")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wna16-scale")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (outputs are always removed)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, "")))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = build(args.workdir, args.size)
    print(f"checkpoint {path} ready in {time.perf_counter() - start:.1f} s", flush=True)
    scratch = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        measured = measure(path, args.reps, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    text = report(measured)
    print(f"\nsize={args.size} reps={args.reps} cpus={os.cpu_count()} threads={os.environ.get('BENCH_THREADS', '1')}")
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "reps": args.reps, "measured": measured,
                                         "table": text}, indent=2))


if __name__ == "__main__":
    main()
