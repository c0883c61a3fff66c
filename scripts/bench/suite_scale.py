"""Real-scale suite: a Qwen3-30B-A3B-shaped GPTQ checkpoint (128 experts, H 2048, I 768, 4-bit, G 128), every
contender of contenders.py (ours, the read floors, the whole-tensor loader, Run:ai Model Streamer and
fastsafetensors) warm and cold, side by side in one run; then wna16-shard --tp 8 against a durable copy.

Usage: python scripts/bench [--size qwen3-30b | --quick] [--workdir /work/bench-work] [--reps 1] [--json out.json]

The checkpoint is written directly (constant words, finite constant scales; the load does the same work whatever
the values), one file per layer, its tensors in the order safetensors' own writer uses (wider dtypes first, then
by name: experts 0, 1, 10, 100, ... so a rank's experts are not evenly spaced in the file); it and the
wna16-shard --tp 8 output are kept in the workdir for the next run. Every contender runs in a fresh interpreter
with the imports and its name lists made before the clock. Warm: the files it reads are read into the page
cache first; cold: every file of the checkpoint and of the output is evicted first (os.sync, then
posix_fadvise(DONTNEED)), and what stayed resident is counted (mincore) and reported. Per run: seconds, µs per
expert tensor the rank reads, page faults (getrusage), the bytes it read from storage (/proc/self/io
read_bytes) and, cold, the pages of the files it brought into the cache.
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

from . import pages
from .baselines import SCALE_SIZES, suite_parser
from .contenders import BY_KEY, CONTENDERS, PRESHARDED_RANK, Contender, runnable
from .targets import SCALE_TARGETS, evaluate, targets_table

ROOT = Path(__file__).resolve().parents[2]
ENTRY = Path(__file__).resolve().parent  # python scripts/bench
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

def read_bytes() -> int:
    """Bytes this process has read from storage so far (/proc/self/io; 0 where there is none)."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except OSError:
        return 0
    return int(fields["read_bytes"])


def child_main(key: str, path: str) -> None:
    """One timed run of contender `key` on folder `path` (its environment set by the parent); prints JSON."""
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    from .baselines import expert_tensors
    from .contenders import scopes

    row, folder = BY_KEY[key], Path(path)
    call = row.prepare(folder)
    tensors = sum(len(v) for v in expert_tensors(folder, scopes()[row.scope]).values()) if row.scope else 0
    before, io = resource.getrusage(resource.RUSAGE_SELF), read_bytes()
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    after, io = resource.getrusage(resource.RUSAGE_SELF), read_bytes() - io
    del result
    print(json.dumps({"seconds": seconds, "tensors": tensors, "minflt": after.ru_minflt - before.ru_minflt,
                      "majflt": after.ru_majflt - before.ru_majflt, "read_bytes": io}))


def run_child(row: Contender, folder: Path) -> dict[str, Any]:
    env = {**os.environ, **dict(row.env)}
    done = subprocess.run([sys.executable, str(ENTRY), "--child", row.key, str(folder)], capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{row.key}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- parent

class Folders:
    """The checkpoint, its wna16-shard --tp 8 output, and which files each row reads."""

    def __init__(self, checkpoint: Path, presharded: Path) -> None:
        self.checkpoint, self.presharded = checkpoint, presharded

    def of(self, row: Contender) -> Path:
        return self.presharded if row.folder == "presharded" else self.checkpoint

    def read_by(self, row: Contender) -> list[Path]:
        """The files the row reads: the checkpoint's, or the pre-sharded rank's and common/."""
        if row.folder != "presharded":
            return pages.files_of(self.checkpoint)
        return pages.files_of(self.presharded / PRESHARDED_RANK) + pages.files_of(self.presharded / "common")

    def every_file(self) -> list[Path]:
        return pages.files_of(self.checkpoint) + pages.files_of(self.presharded)


def presharded(path: Path, workdir: Path) -> Path:
    """The wna16-shard --tp 8 output of `path`, written once and kept (a finished output is left untouched)."""
    out = workdir / f"{path.name}-tp8"
    subprocess.run([sys.executable, "-m", "wna16_loader.cli", str(path), str(out), "--tp", "8", "--quiet"],
                   check=True, cwd=ROOT)
    return out


def measure_once(row: Contender, folders: Folders, cold: bool) -> dict[str, Any]:
    """One run of `row`, warm or cold, with the residency of its files before and (cold) what it brought in."""
    read = folders.read_by(row)
    if cold:
        state = pages.make_cold(folders.every_file())
    else:
        state = pages.make_warm(read)
    before = pages.Residency.of(read)
    result = run_child(row, folders.of(row))
    result.update(resident_before=before.resident, files_bytes=before.total, evicted_resident=state.resident
                  if cold else None)
    if cold:
        result["brought_in"] = pages.Residency.of(read).resident - before.resident
    return result


def measure_contenders(rows: list[Contender], folders: Folders, reps: int, partial: Path | None = None,
                       conditions: tuple[str, ...] = ("warm", "cold")) -> dict[str, dict[str, list[dict]]]:
    """key -> {"warm": [runs], "cold": [runs]}: every row warm, then every row cold, in each repetition (the
    runs so far written to `partial` after each one, so that a run stopped early keeps what it measured)."""
    out: dict[str, dict[str, list[dict]]] = {row.key: {"warm": [], "cold": []} for row in rows}
    for rep in range(reps):
        for condition in conditions:
            for row in rows:
                result = measure_once(row, folders, condition == "cold")
                out[row.key][condition].append(result)
                print(f"rep {rep} {condition} {row.key}: {result['seconds']:.2f} s, read "
                      f"{result['read_bytes'] / 1e9:.2f} GB from storage", flush=True)
                if partial is not None:
                    partial.write_text(json.dumps(out, indent=1))
    return out


def timed_cli(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def measure_shard(path: Path, scratch: Path, reps: int, two_processes: bool) -> dict[str, list[float]]:
    """wna16-shard --tp 8 in one process (and over 2 torchrun processes with `two_processes`), timed from outside
    with the interpreter's start, against cp -r + fsync of every file; page cache warm for each."""
    from .baselines import durable_copy

    runs: dict[str, list[float]] = {"shard": [], "copy": []} | ({"shard2": []} if two_processes else {})
    cli = ["-m", "wna16_loader.cli", str(path)]
    for _ in range(reps):
        for label in [k for k in runs if k != "copy"]:
            target = scratch / label
            launcher = [sys.executable] + (["-m", "torch.distributed.run", "--nproc-per-node", "2"]
                                           if label == "shard2" else [])
            shutil.rmtree(target, ignore_errors=True)  # a finished output would be left untouched, not rewritten
            pages.warm(pages.files_of(path))
            runs[label].append(timed_cli(launcher + cli + [str(target), "--tp", "8", "--quiet"]))
            shutil.rmtree(target, ignore_errors=True)  # disk: the checkpoint's size each
        shutil.rmtree(scratch / "copy", ignore_errors=True)
        pages.warm(pages.files_of(path))
        runs["copy"].append(durable_copy(path, scratch / "copy"))
        shutil.rmtree(scratch / "copy", ignore_errors=True)
        print(f"shard: {', '.join(f'{k} {v[-1]:.2f} s' for k, v in runs.items())}", flush=True)
    return runs


def shard_rss(path: Path) -> dict[str, float]:
    """Peak anonymous RSS of wna16-shard --tp 8 (sampled in a child)."""
    from .baselines import run_child as rss_child

    pages.warm(pages.files_of(path))
    rss = rss_child("preshard", path, 8, 0)
    return {"peak_anon_gib": rss["peak_kib"] / 2**20, "file_peak_gib": rss["file_peak_kib"] / 2**20}


# ---------------------------------------------------------------- the summary

def medians(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict[str, float]]]:
    """key -> condition -> the median of every numeric field over the repetitions."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, conditions in runs.items():
        for condition, results in conditions.items():
            if results:
                fields = [k for k, v in results[0].items() if isinstance(v, (int, float))]
                out.setdefault(key, {})[condition] = {k: statistics.median(r[k] for r in results) for k in fields}
    return out


def seconds_of(m: dict[str, Any], shard: dict[str, list[float]], rss: dict[str, float]) -> dict[str, float]:
    """The flat "key condition" -> seconds map the targets are evaluated on ("best peer warm/cold" included)."""
    flat = {f"{key} {condition}": v["seconds"] for key, conditions in m.items() for condition, v in conditions.items()}
    for condition in ("warm", "cold"):
        ran = [flat[f"{key} {condition}"] for key in m if BY_KEY[key].peer is not None]
        if ran:
            flat[f"best peer {condition}"] = min(ran)
    flat.update({key: statistics.median(values) for key, values in shard.items() if values})
    flat.update({f"shard rss {k}": v for k, v in rss.items()})
    return flat


def contender_table(m: dict[str, Any], skipped: dict[str, str], flat: dict[str, float]) -> str:
    """One row per contender: warm and cold side by side, against the best peer of the same condition."""
    lines = ["| contender | warm s | cold s | warm ÷ best peer | cold ÷ best peer | GB read from storage, warm / cold | "
             "cold: GB of its files brought into the cache | µs / expert tensor (warm) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in CONTENDERS:
        if row.key in skipped:
            lines.append(f"| {row.label} | skipped: {skipped[row.key]} | | | | | | |")
            continue
        if row.key not in m:
            continue
        warm, cold = m[row.key].get("warm", {}), m[row.key].get("cold", {})
        cell = lambda v, f, scale=1.0: f"{v[f] / scale:.2f}" if f in v else ""  # noqa: E731
        ratio = lambda c, v: cell(v, "seconds", flat[f"best peer {c}"]) if f"best peer {c}" in flat else ""  # noqa: E731
        per = f"{warm['seconds'] / warm['tensors'] * 1e6:.1f}" if warm.get("tensors") else ""
        lines.append(f"| {row.label} | {cell(warm, 'seconds')} | {cell(cold, 'seconds')} | {ratio('warm', warm)} | "
                     f"{ratio('cold', cold)} | {cell(warm, 'read_bytes', 1e9)} / {cell(cold, 'read_bytes', 1e9)} | "
                     f"{cell(cold, 'brought_in', 1e9)} | {per} |")
    return "\n".join(lines)


def eviction_text(runs: dict[str, dict[str, list[dict]]], folders: Folders) -> str:
    """What the cold and warm conditions really were, over every run."""
    cold = [r for c in runs.values() for r in c["cold"]]
    warm = [r for c in runs.values() for r in c["warm"]]
    every = pages.Residency.of(folders.every_file())
    lines = [f"cold: before each of {len(cold)} cold runs, os.sync() + posix_fadvise(POSIX_FADV_DONTNEED) on all "
             f"{every.files} files ({every.total / 1e9:.2f} GB: the checkpoint and the wna16-shard output); "
             f"resident after the eviction (mincore): at most {max(r['evicted_resident'] for r in cold)} bytes"] \
        if cold else []
    if warm:
        least = min(warm, key=lambda r: r["resident_before"] / r["files_bytes"])
        lines.append(f"warm: before each of {len(warm)} warm runs its files were read; the least resident: "
                     f"{least['resident_before'] / 1e9:.2f} of {least['files_bytes'] / 1e9:.2f} GB")
    return "\n".join(lines)


def shard_text(shard: dict[str, list[float]], rss: dict[str, float]) -> str:
    parts = [f"{key} {statistics.median(v):.2f} s" for key, v in shard.items() if v]
    memory = (f"; peak anonymous RSS {rss['peak_anon_gib']:.2f} GiB, file-mapped {rss['file_peak_gib']:.2f} GiB"
              if rss else "")
    return f"wna16-shard --tp 8 (median): {', '.join(parts)}{memory}"


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    parser = suite_parser("scale", __doc__, sorted(SCALE_SIZES), "wna16-scale", 1)  # qwen3-30b first: 48 layers
    parser.add_argument("--skip", default="", help="comma-separated contender keys not to run")
    parser.add_argument("--conditions", default="warm,cold", help="warm,cold (default), or one of them")
    parser.add_argument("--no-shard", action="store_true", help="skip wna16-shard against a durable copy")
    parser.add_argument("--no-shard-rss", action="store_true", help="skip the peak RSS of wna16-shard (one more run)")
    parser.add_argument("--shard2", action="store_true", help="also time wna16-shard over 2 torchrun processes")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = build(args.workdir, args.size)
    folders = Folders(path, presharded(path, args.workdir))
    print(f"checkpoint {path} and its --tp 8 output ready in {time.perf_counter() - start:.1f} s", flush=True)
    wanted = tuple(r for r in CONTENDERS if (not args.only or r.key in args.only.split(","))
                   and r.key not in args.skip.split(","))
    rows, skipped = runnable(wanted, sum(f.stat().st_size for f in pages.files_of(path)))
    for key, why in skipped.items():
        print(f"{key}: skipped: {why}", flush=True)
    runs = measure_contenders(rows, folders, args.reps, args.json.with_suffix(".partial.json") if args.json else None,
                              tuple(args.conditions.split(",")))
    shard, rss = {}, {}
    if not args.no_shard:
        scratch = Path(tempfile.mkdtemp(dir=args.workdir))
        try:
            shard = measure_shard(path, scratch, args.reps, args.shard2)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        rss = {} if args.no_shard_rss else shard_rss(path)
    report(args, runs, skipped, folders, shard, rss, time.perf_counter() - start)


def report(args: argparse.Namespace, runs: dict[str, Any], skipped: dict[str, str], folders: Folders,
           shard: dict[str, list[float]], rss: dict[str, float], wall: float) -> None:
    """Print the tables and write the JSON."""
    m = medians(runs)
    flat = seconds_of(m, shard, rss)
    rows = evaluate(SCALE_TARGETS, flat)
    text = "\n\n".join([contender_table(m, skipped, flat), eviction_text(runs, folders), targets_table(rows)]
                        + ([shard_text(shard, rss)] if shard else []))
    print(f"\nsize={args.size} reps={args.reps} cpus={os.cpu_count()} threads={os.environ.get('BENCH_THREADS', '1')} "
          f"wall={wall:.0f} s\n{text}")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "reps": args.reps, "runs": runs, "medians": m,
                                         "skipped": skipped, "seconds": flat, "shard": shard, "shard_rss": rss,
                                         "targets": [t._asdict() for t in rows], "table": text, "wall_s": wall},
                                        indent=2))
