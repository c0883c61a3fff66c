"""Node suite: N processes started together, as the ranks of one GPU server load a model, cold and warm.

Usage: python scripts/bench --suite node [--size qwen3-30b-16l] [--ranks 8] [--reps 2] [--only tp,ep] [--json F]

The checkpoint is suite scale's (a Qwen3-30B-A3B-shaped GPTQ cut). Each contender row starts its ranks as fresh
interpreters; each makes its imports and plans nothing before the clock, says it is ready, and waits for one
`go` that the suite gives once every rank is ready and the page cache is set: cold, every file evicted (os.sync,
then posix_fadvise(DONTNEED), what stayed resident counted and shown); warm, every file read in first. The
node's time runs from `go` to the last rank's finish. Per row: that time (best of --reps), the bytes the ranks
read from storage (the sum of each rank's /proc/self/io read_bytes) over the checkpoint's size, the CPU seconds
of all ranks together (user + system: on a machine with fewer cores than ranks, what the node's time is made
of), and the largest peak RSS of a rank. Every rank runs with one torch thread (on a GPU server each rank has its own cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import pages
from .baselines import SCALE_SIZES, suite_parser
from .peers import RUNAI, Peer, runai_env
from .targets import NODE_TARGETS, evaluate, targets_table

ENTRY = Path(__file__).resolve().parent  # python scripts/bench


@dataclass(frozen=True)
class NodeRow:
    """One contender: `prepare(folder, rank, ranks)` runs in each rank before the clock and returns its timed
    call; `ranks`: 1 for a single reader, else the suite's --ranks."""

    key: str
    label: str
    prepare: Callable[[Path, int, int], Callable[[], Any]]
    single: bool = False
    peer: Peer | None = None
    env: tuple[tuple[str, str], ...] = ()


def _ours(ep: bool, together: bool) -> Callable[[Path, int, int], Callable[[], Any]]:
    def prepare(folder: Path, rank: int, ranks: int) -> Callable[[], Any]:
        from wna16_loader import ParallelConfig, ReadOptions, load_experts
        from wna16_loader.parallel import Node

        parallel = ParallelConfig(1, 0, ranks, rank) if ep else ParallelConfig(ranks, rank)
        node = Node(tuple(range(ranks)), rank, f"bench-{os.getppid()}-{ranks}") if together else None
        return lambda: load_experts(folder, parallel, reads=ReadOptions(node=node))
    return prepare


def _hook(ep: bool) -> Callable[[Path, int, int], Callable[[], Any]]:
    """The engine hook's path: vLLM's moe_wna16 parameters of every layer made (and touched) before the clock, as
    an engine makes its parameters at model init, then filled in place (`fill_layers`), the node reading together."""
    def prepare(folder: Path, rank: int, ranks: int) -> Callable[[], Any]:
        from wna16_loader import ParallelConfig, ReadOptions
        from wna16_loader.layouts import MOE_WNA16
        from wna16_loader.load.inplace import fill_layers
        from wna16_loader.parallel import Node

        from .suite_inplace import targets_for

        parallel = ParallelConfig(1, 0, ranks, rank) if ep else ParallelConfig(ranks, rank)
        targets = targets_for(folder, parallel, MOE_WNA16.name)[0]
        node = Node(tuple(range(ranks)), rank, f"bench-{os.getppid()}-{ranks}")
        return lambda: fill_layers(folder, parallel, targets, reads=ReadOptions(node=node))
    return prepare


def _runai(folder: Path, rank: int, ranks: int) -> Callable[[], Any]:
    from .peers import runai_read

    return runai_read(folder)


def _runai_distributed(folder: Path, rank: int, ranks: int) -> Callable[[], Any]:
    """Run:ai's distributed streaming: the ranks join a gloo group (before the clock), then stream together."""
    import torch.distributed as dist

    from .peers import runai_read

    scratch = Path(os.environ["WNA16_NODE_SCRATCH"])  # (child_main's: emptied before every run)
    dist.init_process_group("gloo", init_method=f"file://{scratch / 'gloo-init'}", rank=rank, world_size=ranks)
    return runai_read(folder, distributed=True)


def _prefetch(folder: Path, rank: int, ranks: int) -> Callable[[], Any]:
    """vLLM's prefetch strategy with its default loader: a thread reads files[rank::ranks] into the page cache
    while the rank takes every tensor of every file whole (safetensors `get_tensor`, as vLLM's default iterator
    does) and copies the rank's 1/ranks of its last dimension out of it (a weight_loader's TP slice; its
    conversion into the engine's layout is left out)."""
    from safetensors import safe_open

    files = pages.files_of(folder)

    def run() -> int:
        fetch = threading.Thread(target=pages.warm, args=(files[rank::ranks],))
        fetch.start()
        delivered = 0
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    whole = handle.get_tensor(name)
                    width = whole.shape[-1] // ranks
                    delivered += whole.narrow(-1, rank * width, width).clone().nbytes if width else 0
        fetch.join()
        return delivered
    return run


ROWS: tuple[NodeRow, ...] = (
    NodeRow("floor", "one reader fetching the checkpoint once (Run:ai, direct)", _runai, single=True, peer=RUNAI,
            env=tuple(runai_env("direct").items())),
    NodeRow("tp", "`load_experts` TP N, the node reading together", _ours(ep=False, together=True)),
    NodeRow("ep", "`load_experts` EP N, the node reading together", _ours(ep=True, together=True)),
    NodeRow("hook-tp", "the engine hook TP N (`fill_layers` into moe_wna16 parameters made before the clock), "
                       "the node reading together", _hook(ep=False)),
    NodeRow("hook-ep", "the engine hook EP N, the node reading together", _hook(ep=True)),
    NodeRow("tp-alone", "`load_experts` TP N, each rank alone", _ours(ep=False, together=False)),
    NodeRow("ep-alone", "`load_experts` EP N, each rank alone", _ours(ep=True, together=False)),
    NodeRow("runai", "Run:ai streamer on every rank (its default, direct)", _runai, peer=RUNAI,
            env=tuple(runai_env("direct").items())),
    NodeRow("runai-buffered", "Run:ai streamer on every rank (buffered)", _runai, peer=RUNAI,
            env=tuple(runai_env("buffered").items())),
    NodeRow("runai-dist", "Run:ai distributed streaming (gloo: each rank reads a part, every part is broadcast to "
                          "every rank)", _runai_distributed, peer=RUNAI,
            env=(*runai_env("direct").items(), ("RUNAI_STREAMER_DIST", "1"))),
    NodeRow("prefetch", "vLLM's prefetch + default loader (emulated: files[rank::N] into the page cache while "
                        "every tensor is taken whole and the rank's columns copied out)", _prefetch),
)
PEERS = ("runai", "runai-buffered", "runai-dist", "prefetch")
BY_KEY = {row.key: row for row in ROWS}


def read_bytes() -> int:
    lines = Path("/proc/self/io").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith("read_bytes:"))


def child_main(key: str, folder: str, rank: int, ranks: int, go: str, out: str) -> None:
    """One rank of a row: prepare, say ready, wait for `go`, run, write its numbers to `out`."""
    import torch

    torch.set_num_threads(1)
    os.environ.update(dict(BY_KEY[key].env), WNA16_NODE_SCRATCH=str(Path(go).parent))
    call = BY_KEY[key].prepare(Path(folder), rank, ranks)
    Path(f"{out}.ready").touch()
    while not os.path.exists(go):
        time.sleep(0.001)
    before, start = read_bytes(), resource.getrusage(resource.RUSAGE_SELF)
    cpu = start.ru_utime + start.ru_stime
    call()
    end = time.time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_text(json.dumps({"end": end, "storage": read_bytes() - before, "rss": usage.ru_maxrss << 10,
                                     "cpu": usage.ru_utime + usage.ru_stime - cpu}))


def run_node(row: NodeRow, folder: Path, ranks: int, cold: bool, scratch: Path) -> dict[str, Any]:
    """One run of `row`: its ranks started, the page cache set, `go`, every rank waited for."""
    count = 1 if row.single else ranks
    scratch.mkdir(parents=True, exist_ok=True)
    for old in scratch.iterdir():
        old.unlink()
    go, outs = scratch / "go", [scratch / f"rank{r}.json" for r in range(count)]
    procs = [subprocess.Popen([sys.executable, str(ENTRY), "--suite", "node", "--rank-child", row.key, str(folder),
                               str(r), str(count), str(go), str(out)]) for r, out in enumerate(outs)]
    while not all(Path(f"{out}.ready").exists() for out in outs):
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"{row.key}: a rank failed before it was ready")
        time.sleep(0.01)
    files = pages.files_of(folder)
    residency = pages.make_cold(files) if cold else pages.make_warm(files)
    start = time.time()
    go.touch()
    if any(p.wait() for p in procs):
        raise SystemExit(f"{row.key}: a rank failed (exit codes {[p.returncode for p in procs]})")
    done = [json.loads(out.read_text()) for out in outs]
    return {"seconds": max(d["end"] for d in done) - start, "storage": sum(d["storage"] for d in done),
            "rss": max(d["rss"] for d in done), "cpu": sum(d["cpu"] for d in done), "residency": residency.text()}


def measure(rows: list[NodeRow], folder: Path, ranks: int, reps: int, scratch: Path) -> dict[str, dict[str, Any]]:
    """Best of `reps` per row and condition (the rows interleaved, so that drift hits each alike)."""
    runs: dict[str, dict[str, Any]] = {}
    for _ in range(reps):
        for cold in (True, False):
            for row in rows:
                run = run_node(row, folder, ranks, cold, scratch)
                name = f"{row.key} {'cold' if cold else 'warm'}"
                print(f"{name}: {run['seconds']:.2f} s, CPU {run['cpu']:.1f} s, storage {run['storage'] / 1e9:.2f} GB "
                      f"({run['residency']})", flush=True)
                if name not in runs or run["seconds"] < runs[name]["seconds"]:
                    runs[name] = run
    return runs


def values_of(runs: dict[str, dict[str, Any]], checkpoint: int) -> dict[str, float]:
    """The numbers the targets name: "KEY cold|warm" seconds, "best peer COND", "KEY storage" ÷ checkpoint."""
    values = {name: run["seconds"] for name, run in runs.items()}
    for cond in ("cold", "warm"):
        peers = [values[f"{key} {cond}"] for key in PEERS if f"{key} {cond}" in values]
        if peers:
            values[f"best peer {cond}"] = min(peers)
    for name, run in runs.items():
        if name.endswith(" cold"):
            values[f"{name.removesuffix(' cold')} storage"] = run["storage"] / checkpoint
    return values


def table(rows: list[NodeRow], runs: dict[str, dict[str, Any]], checkpoint: int, ranks: int) -> str:
    lines = [f"| contender, {ranks} ranks at once | node s, cold | node s, warm | ÷ one reader, cold | "
             f"CPU s of all ranks, cold / warm | storage ÷ checkpoint | peak RSS of a rank, GB |",
             "|---|---|---|---|---|---|---|"]
    floor = runs.get("floor cold", {}).get("seconds")
    for row in rows:
        cold, warm = runs.get(f"{row.key} cold"), runs.get(f"{row.key} warm")
        if cold is None or warm is None:
            continue
        ratio = f"{cold['seconds'] / floor:.2f}" if floor else ""
        lines.append(f"| {row.label.replace('N', str(ranks))} | {cold['seconds']:.2f} | {warm['seconds']:.2f} | "
                     f"{ratio} | {cold['cpu']:.1f} / {warm['cpu']:.1f} | {cold['storage'] / checkpoint:.2f} | "
                     f"{max(cold['rss'], warm['rss']) / 1e9:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank-child"]:
        key, folder, rank, ranks, go, out = argv[1:7]
        child_main(key, folder, int(rank), int(ranks), go, out)
        return 0
    parser = suite_parser("node", __doc__, sorted(SCALE_SIZES, key=SCALE_SIZES.get), "wna16-bench", 2)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args(argv)
    from .suite_scale import build

    folder = build(args.workdir, args.size)
    only = [k for k in args.only.split(",") if k]
    rows = [row for row in ROWS if not only or row.key in only]
    skipped = {row.key: why for row in rows if row.peer is not None and (why := row.peer.missing())}
    rows = [row for row in rows if row.key not in skipped]
    runs = measure(rows, folder, args.ranks, args.reps, args.workdir / "node-run")
    checkpoint = sum(f.stat().st_size for f in pages.files_of(folder))
    text = "\n\n".join([table(rows, runs, checkpoint, args.ranks),
                        targets_table(evaluate(NODE_TARGETS, values_of(runs, checkpoint)))] +
                       [f"skipped {key}: {why}" for key, why in skipped.items()])
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "ranks": args.ranks, "runs": runs, "text": text},
                                        indent=1))
    return 0
