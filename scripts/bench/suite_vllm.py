"""Suite vllm: vLLM's model load with its default loader against `--load-format wna16`, per rank, in one run.

Runs in a vLLM tier venv (CPU ranks over gloo) or, with --device cuda, in a CUDA vLLM environment:
    ./scripts/test_vllm [--only 0.34] --python scripts/bench --suite vllm [--size qwen3-30b|deepseek-v3-shaped]
        [--layers 8] [--inter I] [--layouts tp4,tp8,ep4,ep8] [--states cold,warm] [--reps 2] [--json OUT.json]
        [--workdir DIR] [--process] [--device cpu|cuda]

The model (vllm_model.py) is built by vLLM with no --quantization flag (AutoGPTQ's MoE method, or its moe_wna16
fallback where a layer fails the Marlin shape check). Every contender row (contenders.VLLM_CONTENDERS: vLLM's
default loader as is, with --enable-ep-weight-filter at EP, with --safetensors-load-strategy prefetch;
--load-format wna16 from the checkpoint and from a wna16-shard output of the layout's split) runs at every
layout (tpN: -tp N; epN: -tp N --enable-expert-parallel) as one group of fresh rank processes
(vllm_rank.py), cold (the folder's files evicted from the page cache first) and then warm (right after, the
files cached). Per rank: load_weights seconds, bytes from storage (/proc/self/io read_bytes), memory the load
adds (anonymous RSS peak over its start, as a multiple of the parameters' bytes; on CUDA also
torch.cuda.max_memory_allocated). vLLM's process_weights_after_loading (its kernel repack, the same for every
loader) is skipped unless --process. The targets are targets.VLLM_TARGETS.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .contenders import VLLM_CONTENDERS, VllmContender
from .targets import VLLM_TARGETS, Target, evaluate, targets_table
from .vllm_model import SIZES, expert_bytes, write_model

RANK_SCRIPT = Path(__file__).with_name("vllm_rank.py")
GIB = 1 << 30


def layout(name: str) -> tuple[int, bool]:
    """'tp4' -> (4, False); 'ep8' -> (8, True): the ranks and whether expert parallelism is on."""
    if name[:2] not in ("tp", "ep") or not name[2:].isdigit():
        raise SystemExit(f"--layouts: {name!r} is not tpN or epN")
    return int(name[2:]), name.startswith("ep")


def missing(row: VllmContender, ep: bool) -> str | None:
    """Why `row` does not run at a layout (EP only, or a field this vLLM lacks), or None."""
    from vllm.config import LoadConfig, ParallelConfig

    if row.ep_only and not ep:
        return "only with expert parallelism"
    for cls, fields in ((LoadConfig, row.load), (ParallelConfig, row.parallel)):
        lacking = [name for name, _ in fields if name not in cls.__dataclass_fields__]
        if lacking:
            return f"this vLLM's {cls.__name__} has no {', '.join(lacking)}"
    return None


def evict(folder: Path) -> None:
    """Drop every file of `folder` from the page cache."""
    for file in folder.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(row: VllmContender, folder: Path, ranks: int, ep: bool, out: Path, args: argparse.Namespace,
              cold: bool) -> list[dict]:
    """One vLLM group of `ranks` processes loading `folder`; each rank's measurements."""
    spec = {"ranks": ranks, "ep": ep, "folder": str(folder), "load_format": row.load_format, "load": dict(row.load),
            "parallel": dict(row.parallel), "process": args.process, "device": args.device}
    return start_group(RANK_SCRIPT, spec, out, cold=cold)


def start_group(script: Path, spec: dict, out: Path, *, cold: bool) -> list[dict]:
    """`spec["ranks"]` processes of a rank script (its SPEC.json: `spec`, the group's address and OUT), the
    folder's files evicted first when `cold`; each rank's OUT/rank{R}.json. A rank that fails stops the run."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(out), "init_method": f"tcp://127.0.0.1:{free_port()}"}
    (out / "spec.json").write_text(json.dumps(spec))
    if cold:
        evict(Path(spec["folder"]))
    logs = [out / f"rank{r}.log" for r in range(spec["ranks"])]
    procs = [subprocess.Popen([sys.executable, str(script), str(out / "spec.json"), str(r)],
                              stdout=log.open("w"), stderr=subprocess.STDOUT) for r, log in enumerate(logs)]
    for proc, log in zip(procs, logs):
        if proc.wait() != 0:
            raise SystemExit(f"{log} (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(spec["ranks"])]


def shard(source: Path, workdir: Path, name: str) -> Path:
    """A `wna16-shard` output of `source` for layout `name` (kept between runs)."""
    from wna16_loader.preshard.run import preshard_checkpoint

    ranks, ep = layout(name)
    out = workdir / f"{source.name}-shard-{name}"
    if not (out / "wna16_manifest.json").exists():
        preshard_checkpoint(source, out, tp_size=1 if ep else ranks, ep_size=ranks if ep else 1, progress=False)
    return out


def measure(args: argparse.Namespace, source: Path) -> tuple[list[dict], dict[str, str]]:
    """Every runnable row at every layout and state, --reps times; (runs, row -> why skipped)."""
    runs, skipped = [], {}
    shards = {name: shard(source, args.workdir, name) for name in args.layouts}
    for rep in range(args.reps):
        for name in args.layouts:
            ranks, ep = layout(name)
            for row in VLLM_CONTENDERS:
                why = missing(row, ep)
                if why is not None:
                    skipped[f"{row.key} {name}"] = why
                    continue
                folder = source if row.folder == "checkpoint" else shards[name]
                for state in args.states:
                    out = args.workdir / "runs" / f"rep{rep}-{name}-{row.key.replace(' ', '_')}-{state}"
                    found = run_group(row, folder, ranks, ep, out, args, cold=state == "cold")
                    runs.append({"row": row.key, "layout": name, "state": state, "rep": rep, "ranks": found})
                    print(f"rep {rep} {name} {row.key} {state}: slowest rank {slowest(found):.1f} s, "
                          f"{max(m['read_bytes'] for m in found) / GIB:.2f} GiB read", flush=True)
    return runs, skipped


def slowest(ranks: list[dict]) -> float:
    return max(m["load_weights_s"] for m in ranks)


def added(ranks: list[dict]) -> float:
    return max(m["anon_added"] / m["param_bytes"] for m in ranks)


def gpu_added(runs: list[dict]) -> str:
    """The largest rank's torch.cuda.max_memory_allocated growth during load_weights, GiB ('-': not on CUDA)."""
    found = [max(m.get("cuda_added", -1) for m in r["ranks"]) for r in runs]
    return f"{statistics.median(found) / GIB:.2f}" if min(found) >= 0 else "-"


def values(runs: list[dict]) -> dict[str, float]:
    """The targets' values: "ROW LAYOUT STATE" (median slowest rank) and "ROW LAYOUT added" (largest rank)."""
    out: dict[str, list[float]] = {}
    for run in runs:
        out.setdefault(f"{run['row']} {run['layout']} {run['state']}", []).append(slowest(run["ranks"]))
        out.setdefault(f"{run['row']} {run['layout']} added", []).append(added(run["ranks"]))
    return {key: statistics.median(v) for key, v in out.items()}


def table(runs: list[dict]) -> str:
    """One row per contender, layout and state: per-rank medians 'r0 / r1 / ...'."""
    head = ("| contender | layout | state | load_weights s (slowest) | per rank s | read_bytes GiB per rank "
            "| memory added × params (largest) | GPU added GiB (largest) |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for key in dict.fromkeys((r["layout"], r["row"], r["state"]) for r in runs):
        mine = [r for r in runs if (r["layout"], r["row"], r["state"]) == key]
        per_rank = lambda field, scale: " / ".join(  # noqa: E731
            f"{statistics.median(r['ranks'][n][field] for r in mine) / scale:.{1 if scale == 1 else 2}f}"
            for n in range(len(mine[0]["ranks"])))
        rows.append(f"| {key[1]} | {key[0]} | {key[2]} | {statistics.median(slowest(r['ranks']) for r in mine):.1f} "
                    f"| {per_rank('load_weights_s', 1)} | {per_rank('read_bytes', GIB)} "
                    f"| {statistics.median(added(r['ranks']) for r in mine):.2f} | {gpu_added(mine)} |")
    return "\n".join([head, *rows])


def engine_parser(engine: str, doc: str, layouts: list[str]) -> argparse.ArgumentParser:
    """The options an engine suite (vllm, sglang) shares: the model written, its layouts, states and repetitions."""
    parser = argparse.ArgumentParser(prog=f"scripts/bench --suite {engine}", description=doc.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="qwen3-30b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--inter", type=int, help="the experts' I (default: the size's)")
    parser.add_argument("--layouts", type=lambda s: s.split(","), default=layouts)
    parser.add_argument("--states", type=lambda s: s.split(","), default=["cold", "warm"])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path(f"/tmp/wna16-bench-{engine}"))
    parser.add_argument("--json", type=Path, help="write every run, the table and the targets here")
    return parser


def source_of(args: argparse.Namespace) -> Path:
    """The suite's GPTQ checkpoint (written once per size, layers and I), announced with its expert bytes."""
    start = time.perf_counter()
    source = write_model(args.workdir / f"{args.size}-{args.layers}l-i{args.inter or 'default'}-gptq", args.size,
                         args.layers, args.inter)
    print(f"checkpoint {source}: {expert_bytes(source) / GIB:.2f} GiB of experts, {args.layers} layers "
          f"(ready in {time.perf_counter() - start:.0f} s)", flush=True)
    return source


def parse(argv: list[str]) -> argparse.Namespace:
    parser = engine_parser("vllm", __doc__, ["tp4", "tp8", "ep4", "ep8"])
    parser.add_argument("--process", action="store_true", help="also run vLLM's process_weights_after_loading")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parsed(parser, argv)


def parsed(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """An engine suite's arguments, every --layouts name checked (`layout` raises on one it does not know)."""
    args = parser.parse_args(argv)
    for name in args.layouts:
        layout(name)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    source = source_of(args)
    runs, skipped = measure(args, source)
    report(args, source, runs, VLLM_TARGETS, skipped)
    return 0


def report(args: argparse.Namespace, source: Path, runs: list[dict], targets: tuple[Target, ...],
           skipped: dict[str, str] | None = None) -> None:
    """An engine suite's table and target verdicts, printed, and with --json every run written too."""
    text, verdicts = table(runs), targets_table(evaluate(targets, values(runs)))
    print(f"\nmedian of {args.reps} run(s); per rank 'rank 0 / rank 1 / ...'\n{text}\n\n{verdicts}")
    for key, why in (skipped or {}).items():
        print(f"skipped: {key}: {why}")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "layers": args.layers, "inter": args.inter,
                                         "expert_bytes": expert_bytes(source), "reps": args.reps, "runs": runs,
                                         "skipped": skipped or {}, "table": text, "targets": verdicts}, indent=1))
