"""Suite small: load_experts against a read floor and a whole-tensor loader, every format, up to the 550 MB shape.

Usage: python scripts/bench --size small|full|full8|mixtral --workdir /tmp/wna16-bench --reps 5 --json out.json
       [--png out.png] [--profile] [--shard-rss]

Contenders (page cache warm, alternated within every repetition, freed heap returned to the OS
before each run so that no contender reuses pages an earlier run faulted in):
  floor      safetensors get_tensor of every expert tensor + a copy touching every byte
  floor + transpose  (checkpoints storing qweight [K/P, N]) the floor, with each qweight copied
             transposed into a fresh [N, K/P] tensor: the least a load to the fused layout must do
  ours       wna16_loader.load_experts, TP=1 and each rank alone at TP=2,4,8
  whole      a whole-tensor loader per rank: an honest re-implementation of what engines do
             today (read each expert tensor whole, convert it whole to the fused layout, narrow)
Also: peak RSS in subprocesses, source pages touched per rank (mincore), and, when
wna16_loader.preshard exists, the pre-sharded load and the sharding script vs a durable copy (cp -r, then fsync).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.formats import Dim, Role
from wna16_loader.models.config import read_config_files
from wna16_loader.parallel.partition import layout_problem
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

from . import targets as table
from .pages import evict, resident_bytes
from .baselines import (
    durable_copy,
    expert_bytes,
    expert_tensors,
    fused_bytes,
    release_freed_memory,
    run_child,
    run_floor,
    run_floor_transposed,
    run_ours,
    run_whole,
)

SIZES: dict[str, dict[str, int]] = {
    "small": {"num_experts": 16, "hidden": 1024, "intermediate": 704, "num_layers": 2, "files": 2},
    "full": {"num_experts": 64, "hidden": 2048, "intermediate": 1408, "num_layers": 4, "files": 4},
    "full8": {"num_experts": 64, "hidden": 2048, "intermediate": 1408, "num_layers": 8, "files": 8},
    # Mixtral-8x7B-shaped experts (2 of its 32 layers): about as many bytes as "full" in 1/21 of the tensors
    "mixtral": {"num_experts": 8, "hidden": 4096, "intermediate": 14336, "num_layers": 2, "files": 4},
}
FORMAT_NAMES = {"gptq": "gptq", "awq": "awq", "ct": "compressed-tensors"}
TP_SIZES = (2, 4, 8)
Timing = dict[str, float]


# ---------------------------------------------------------------- checkpoints

def build_checkpoint(workdir: Path, fmt: str, size: str) -> Path:
    """The cached checkpoint of `fmt` at `size`, written once."""
    folder = workdir / f"{size}-{fmt}-int4-g128"
    done = folder / ".complete"
    if done.is_file():
        return folder
    start = time.perf_counter()
    write_checkpoint(folder, quant_config(FORMAT_NAMES[fmt], bits=4, group_size=128), references=False,
                     **SIZES[size])
    done.write_text("ok\n")
    print(f"built {folder} in {time.perf_counter() - start:.1f} s", flush=True)
    return folder


# ---------------------------------------------------------------- contenders


# ---------------------------------------------------------------- timing

def valid_tps(path: Path) -> list[int]:
    """The TP sizes of TP_SIZES this checkpoint can be sharded to without padding (the whole-tensor
    baseline slices unpadded layouts only)."""
    moe = read_config_files(path)
    q = moe.quant
    return [tp for tp in TP_SIZES if not layout_problem(moe.hidden_size, moe.intermediate_size, q.bits,
                                                         q.group_size, q.act_order, tp, allow_padding=False)]


def contenders(path: Path) -> dict[str, Callable[[], Any]]:
    """label -> zero-argument callable, for one checkpoint."""
    names = expert_tensors(path)
    tasks: dict[str, Callable[[], Any]] = {"floor": lambda: run_floor(path, names),
                                           "ours tp1": lambda: run_ours(path, ParallelConfig(1, 0))}
    qweight = read_config_files(path).quant.layout(Role.QWEIGHT)
    if qweight.dims == (Dim.K, Dim.N) and qweight.packed is Dim.K:  # stored [K/P, N]: the layout needs a transpose
        tasks["floor + transpose"] = lambda: run_floor_transposed(path, names)
    for tp in valid_tps(path):
        for rank in range(tp):
            cfg = ParallelConfig(tp, rank)
            tasks[f"ours tp{tp} r{rank}"] = lambda cfg=cfg: run_ours(path, cfg)
            tasks[f"whole tp{tp} r{rank}"] = lambda cfg=cfg: run_whole(path, cfg)
    return tasks


def time_alternating(tasks: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Run every task once per repetition, rotating the order each time; seconds per run."""
    labels = list(tasks)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(reps):
        shift = (rep * max(1, len(labels) // reps + 1)) % len(labels)
        order = labels[shift:] + labels[:shift]
        order = order if rep % 2 == 0 else order[::-1]
        for label in order:
            release_freed_memory()
            start = time.perf_counter()
            result = tasks[label]()
            times[label].append(time.perf_counter() - start)
            del result
    return times


def stats(values: list[float]) -> Timing:
    """median / min / max of a list of seconds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(times: dict[str, list[float]]) -> dict[str, Any]:
    """Per contender stats, with per-TP rank aggregates (median rank and max rank)."""
    out: dict[str, Any] = {label: stats(v) for label, v in times.items() if " r" not in label}
    groups: dict[str, list[float]] = {}
    for label, values in times.items():
        if " r" in label:
            groups.setdefault(label.rsplit(" r", 1)[0], []).append(statistics.median(values))
    for key, medians in groups.items():
        out[key] = {"median_rank": statistics.median(medians), "max_rank": max(medians),
                    "min_rank": min(medians), "ranks": len(medians)}
    return out


# ---------------------------------------------------------------- memory and pages

# ru_maxrss is inherited across fork+exec on Linux (a child of a large parent reports the parent's peak),
# so the child samples its own /proc/self/status: anonymous memory (what the load allocates) and
# file-backed pages (the safetensors mapping) separately.


def shard_rss(workdir: Path) -> dict[str, Any]:
    """Peak anonymous RSS of wna16-shard (GPTQ, TP=4) on the 4-layer and the 8-layer full checkpoint."""
    out = {}
    for size in ("full", "full8"):
        path = build_checkpoint(workdir, "gptq", size)
        rss = run_child("preshard", path, 4, 0)
        layers = SIZES[size]["num_layers"]
        out[f"{layers} layers"] = {"peak_anon_mib": rss["peak_kib"] / 1024,
                                   "growth_mib": (rss["peak_kib"] - rss["before_kib"]) / 1024,
                                   "checkpoint_mib": sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20}
    return out


def measure_rss(path: Path) -> dict[str, Any]:
    """Peak anonymous RSS of ours at TP=1 and TP=4 (rank 1) and of the floor, vs the fused output bytes."""
    out = {}
    for label, mode, tp, rank in (("ours tp1", "ours", 1, 0), ("ours tp4 r1", "ours", 4, 1), ("floor", "floor", 1, 0)):
        rss = run_child(mode, path, tp, rank)
        fused = fused_bytes(path, ParallelConfig(tp, rank))
        growth = (rss["peak_kib"] - rss["before_kib"]) * 1024
        out[label] = {"peak_mib": rss["peak_kib"] / 1024, "growth_mib": growth / 2**20,
                      "fused_mib": fused / 2**20, "excess_mib": (growth - fused) / 2**20,
                      "file_mapped_peak_mib": rss["file_peak_kib"] / 1024, "hwm_mib": rss["hwm_kib"] / 1024}
    return out


def measure_pages(path: Path) -> dict[str, Any]:
    """Evict, load one rank in a subprocess, count resident source pages vs the rank's share."""
    files = sorted(path.glob("*.safetensors"))
    out = {}
    for label, tp, rank, ep, ep_rank in (("tp4 r1", 4, 1, 1, 0), ("ep2 r1", 1, 0, 2, 1)):
        evict(files)
        cold = sum(resident_bytes(f) for f in files)
        start = time.perf_counter()
        run_child("ours", path, tp, rank, ep, ep_rank)
        seconds = time.perf_counter() - start
        touched = sum(resident_bytes(f) for f in files) - cold
        share = expert_bytes(path, ParallelConfig(tp_size=tp, tp_rank=rank, ep_size=ep, ep_rank=ep_rank))
        out[label] = {"touched_mib": touched / 2**20, "share_mib": share / 2**20, "ratio": touched / share,
                      "resident_after_evict_mib": cold / 2**20, "cold_load_s": seconds}
    for file in files:  # warm the cache again for whatever follows
        file.read_bytes()
    return out


# ---------------------------------------------------------------- pre-sharding (optional)

def measure_preshard(path: Path, reps: int) -> dict[str, Any]:
    """(4) and (5): wna16-shard (both layouts, TP=4) against a durable copy, and loading one pre-sharded rank."""
    try:
        from wna16_loader.preshard import preshard_checkpoint
    except ImportError:
        return {"status": "not available (wna16_loader.preshard is not importable)"}
    out: dict[str, Any] = {"status": "ok"}
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        # --layout checkpoint needs cuts on group boundaries: I = 704 / 1408 with G = 128 allows none at
        # TP > 1, so it is timed as pure expert parallelism (TP = 1, EP = 2).
        times: dict[str, list[float]] = {"preshard fused tp4": [], "preshard checkpoint ep2": [], "durable copy": []}
        for rep in range(reps):
            times["preshard fused tp4"].append(_timed(lambda: preshard_checkpoint(
                path, Path(tmp) / f"fused{rep}", tp_size=4, progress=False)))
            times["preshard checkpoint ep2"].append(_timed(lambda: preshard_checkpoint(
                path, Path(tmp) / f"checkpoint{rep}", tp_size=1, ep_size=2, layout="checkpoint", progress=False)))
            times["durable copy"].append(durable_copy(path, Path(tmp) / f"c{rep}"))  # cp -r, then fsync every file
        out.update({k: stats(v) for k, v in times.items()})
        out["load"] = preshard_load(Path(tmp) / "fused0", reps)
        out["pages"] = presharded_pages(Path(tmp) / "fused0")
    return out


def preshard_load(folder: Path, reps: int) -> dict[str, Any]:
    """TP=4 rank 1 loading the pre-sharded output (load_experts detects it) vs reading its files,
    alternated, with at least 9 repetitions (each takes tens of milliseconds)."""
    files = sorted((folder / "rank-00001-of-00004").glob("*.safetensors"))
    times = time_alternating({"load": lambda: load_experts(folder, ParallelConfig(4, 1)),
                              "read files": lambda: [f.read_bytes() for f in files]}, max(reps, 9))
    return {"load": stats(times["load"]), "read files": stats(times["read files"]),
            "ratio": statistics.median(times["load"]) / statistics.median(times["read files"])}


def presharded_pages(folder: Path) -> dict[str, Any]:
    """Pages of the whole output touched by a cold load of TP=4 rank 1, against that rank's file bytes."""
    files = sorted(folder.rglob("*.safetensors"))
    own = sum(f.stat().st_size for f in (folder / "rank-00001-of-00004").glob("*.safetensors"))
    evict(files)
    cold = sum(resident_bytes(f) for f in files)
    run_child("ours", folder, 4, 1)
    touched = sum(resident_bytes(f) for f in files) - cold
    return {"touched_mib": touched / 2**20, "rank_files_mib": own / 2**20, "ratio": touched / own}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------- report

def targets(fmt: str, timing: dict[str, Any], rss: dict[str, Any],
            preshard: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    """(target, value, limit, pass) for one format (source pages per rank are reported, not targeted)."""
    floor, ours1 = timing["floor"]["median"], timing["ours tp1"]["median"]
    limit = table.SMALL_TP1_FLOOR[fmt]
    rows = [(f"TP=1 / floor <= {limit}", ours1 / floor, limit)]
    if "ours tp4" in timing:
        tp4, whole4 = timing["ours tp4"]["median_rank"], timing["whole tp4"]["median_rank"]
        rows += [(f"whole-tensor / ours at TP=4 >= {table.SMALL_WHOLE_TP4:g}", whole4 / tp4, table.SMALL_WHOLE_TP4)]
        if preshard.get("status") == "ok":
            pre = preshard["load"]["load"]["median"]
            rows += [(f"TP=4 rank (median) / the pre-sharded TP=4 rank <= {table.SMALL_TP4_PRESHARDED:g}", tp4 / pre,
                      table.SMALL_TP4_PRESHARDED),
                     ("TP=4 rank (median) / TP=1 (reported, not judged)", tp4 / ours1, float("inf"))]
    rows += [(f"RSS growth {k} - fused <= 256 MiB", v["excess_mib"], 256.0) for k, v in rss.items() if k != "floor"]
    if preshard.get("status") == "ok":
        rows += [("pre-sharded rank load / reading its files <= 1.1", preshard["load"]["ratio"], 1.1),
                 ("pre-sharded pages touched / its bytes <= 1.05", preshard["pages"]["ratio"], 1.05),
                 ("wna16-shard --layout checkpoint / durable copy <= 2", preshard["preshard checkpoint ep2"]["median"]
                  / preshard["durable copy"]["median"], 2.0),
                 ("wna16-shard --layout fused / durable copy <= 3", preshard["preshard fused tp4"]["median"]
                  / preshard["durable copy"]["median"], 3.0)]
    return [(name, value, lim, value >= lim if ">=" in name else value <= lim) for name, value, lim in rows]


def timing_table(results: dict[str, Any]) -> str:
    """A markdown table of the timings of every format."""
    lines = ["| format | contender | median s | min s | max s | x floor |", "|---|---|---|---|---|---|"]
    for fmt, res in results.items():
        floor = res["timing"]["floor"]["median"]
        for label, s in res["timing"].items():
            if "median" in s:
                lines.append(f"| {fmt} | {label} | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} | "
                             f"{s['median'] / floor:.2f} |")
            else:
                lines.append(f"| {fmt} | {label} (per rank, {s['ranks']} ranks) | median rank {s['median_rank']:.3f}"
                             f" | min rank {s['min_rank']:.3f} | max rank {s['max_rank']:.3f} | "
                             f"{s['median_rank'] / floor:.2f} |")
    return "\n".join(lines)


def other_tables(results: dict[str, Any]) -> str:
    """Markdown tables: RSS, pages, pre-sharding, targets."""
    lines = ["| format | load | peak anon RSS MiB | growth MiB | fused MiB | growth - fused MiB | peak file-mapped MiB |",
             "|---|---|---|---|---|---|---|"]
    for fmt, res in results.items():
        for k, v in res["rss"].items():
            lines.append(f"| {fmt} | {k} | {v['peak_mib']:.0f} | {v['growth_mib']:.0f} | {v['fused_mib']:.0f} | "
                         f"{v['excess_mib']:.0f} | {v['file_mapped_peak_mib']:.0f} |")
    lines += ["", "| format | rank | pages touched MiB | rank share MiB | ratio |", "|---|---|---|---|---|"]
    for fmt, res in results.items():
        for k, v in res["pages"].items():
            lines.append(f"| {fmt} | {k} | {v['touched_mib']:.1f} | {v['share_mib']:.1f} | {v['ratio']:.3f} |")
    lines += ["", "| format | target | value | PASS/FAIL |", "|---|---|---|---|"]
    for fmt, res in results.items():
        for name, value, _, ok in res["targets"]:
            lines.append(f"| {fmt} | {name} | {value:.3f} | {'PASS' if ok else 'FAIL'} |")
    lines += ["", "pre-sharding (items 4, 5): " + json.dumps({f: r["preshard"] for f, r in results.items()})]
    return "\n".join(lines)


def draw(results: dict[str, Any], png: Path) -> None:
    """Bar chart of median seconds per contender and format (skipped without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the chart (pip install '.[bench]')")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (fmt, res) in zip(axes[0], results.items()):
        labels = list(res["timing"])
        values = [s.get("median", s.get("median_rank")) for s in res["timing"].values()]
        ax.barh(labels, values)
        ax.set_title(f"{fmt}: median s (per rank for TP>1)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


# ---------------------------------------------------------------- profile and main

def profile(path: Path, top: int = 12) -> str:
    """cProfile of ours at TP=1, the top functions by internal time."""
    prof = cProfile.Profile()
    prof.enable()
    run_ours(path, ParallelConfig(1, 0))
    prof.disable()
    out = tempfile.SpooledTemporaryFile(mode="w+")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    out.seek(0)
    return out.read()


def bench_format(workdir: Path, fmt: str, size: str, reps: int, do_profile: bool) -> dict[str, Any]:
    """Everything for one format."""
    path = build_checkpoint(workdir, fmt, size)
    run_ours(path, ParallelConfig(1, 0))  # warm the page cache and the imports
    run_floor(path, expert_tensors(path))
    timing = summarise(time_alternating(contenders(path), reps))
    rss, pages = measure_rss(path), measure_pages(path)
    result = {"checkpoint": str(path), "timing": timing, "rss": rss, "pages": pages,
              "preshard": measure_preshard(path, min(reps, 3))}
    result["targets"] = targets(fmt, timing, rss, result["preshard"])
    if do_profile:
        result["profile"] = profile(path)
        print(f"---- cProfile, ours TP=1, {fmt}\n{result['profile']}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench --suite small", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wna16-bench")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--formats", default="gptq,awq,ct", help="comma-separated subset of gptq,awq,ct")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--profile", action="store_true", help="cProfile ours at TP=1 per format")
    parser.add_argument("--shard-rss", action="store_true",
                        help="only: peak RSS of wna16-shard on the 4- and 8-layer full GPTQ checkpoints")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.shard_rss:
        print(json.dumps(shard_rss(args.workdir), indent=2))
        return
    results = {fmt: bench_format(args.workdir, fmt, args.size, args.reps, args.profile)
               for fmt in args.formats.split(",")}
    print(f"\nsize={args.size} reps={args.reps} torch threads={torch.get_num_threads()} cpus={os.cpu_count()}")
    print(timing_table(results) + "\n\n" + other_tables(results))
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "reps": args.reps, "results": results}, indent=2))
    if args.png:
        draw(results, args.png)

