"""Suite bounds: lower bounds of the name-scale targets: what `load_experts` would take at TP 8 and EP 8 if the
checkpoint index's JSON parse, its parse and tiling check, or the whole index cost nothing (a native reader).

Usage: python scripts/bench --suite bounds --workdir /tmp/wna16-names --reps 3 --json out.json

The checkpoint is suite names (DeepSeek-V3's tensor list at tiny sizes, 178,176 expert tensors).
A free parse: every `json.loads` of a load (61 headers and the index file's weight map) is made before the
clock and handed over in call order; the parsed objects stay referenced until the next run is prepared, so
their freeing is outside the clock too. A free check: `header._tiles` (the whole-header span check) answers
True. A free index: the whole `CheckpointIndex` (parse, check, weight map, name -> file map)
built before the clock, so that what is left is the name scan, planning, reads and freeing. Everything
else of the load runs as shipped. Contenders alternate within each repetition in one process, one torch
thread, freed heap returned to the OS before each; CPU seconds, median of the repetitions.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.load import experts
from wna16_loader.storage import header, index

from .baselines import expert_tensors, release_freed_memory, run_floor
from .suite_names import build, run_headers
from .targets import NAME_TARGETS


class HandedOver:
    """A stand-in for the `json` module of storage/header.py and storage/index.py: until the first `prepare`
    it parses and keeps the texts of a load, `prepare` parses them all (outside the clock), and `loads` then
    hands the next one over."""

    JSONDecodeError = json.JSONDecodeError

    def __init__(self) -> None:
        self.texts: list[Any] = []
        self.ready: list[Any] = []
        self.given: list[Any] = []
        self.recording = True

    def loads(self, text: Any) -> Any:
        if self.recording:
            self.texts.append(text)
            return json.loads(text)
        parsed = self.ready.pop()
        self.given.append(parsed)  # freed at the next `prepare`, outside the clock
        return parsed

    def prepare(self) -> None:
        self.recording = False
        self.given.clear()
        self.ready = [json.loads(text) for text in reversed(self.texts)]
        gc.collect()


class Prebuilt:
    """A stand-in for the `CheckpointIndex` class that load/experts.py opens: `prepare` builds the index of
    `path` outside the clock, the load then gets it; its mapped files stay referenced until the next
    `prepare`, so that their parsed headers are freed outside the clock too (as with `HandedOver`)."""

    def __init__(self, path: Path) -> None:
        self.path, self.built, self.kept = path, None, []

    def prepare(self) -> None:
        self.built, self.kept = None, []
        gc.collect()
        self.built = index.CheckpointIndex(self.path)
        self.kept = list(self.built._maps.values())

    def __call__(self, path: Path) -> index.CheckpointIndex:
        built, self.built = self.built, None
        assert built is not None, "the index was not prepared"
        return built


FREE = ("parse", "parse+check", "index")  # what a contender gets for nothing, cumulative


@contextmanager
def free_work(what: str | None, parse: HandedOver, prebuilt: Prebuilt) -> Iterator[None]:
    """Meanwhile `what` of FREE costs nothing: the JSON parse handed over, also the tiling check, or the
    whole index built before (None: everything real)."""
    tiles = header._tiles
    if what in ("parse", "parse+check"):
        header.json = index.json = parse  # type: ignore[assignment]
    if what == "parse+check":
        header._tiles = lambda *_: True
    if what == "index":
        experts.CheckpointIndex = prebuilt  # type: ignore[assignment]
    try:
        yield
    finally:
        header.json = index.json = json
        header._tiles, experts.CheckpointIndex = tiles, index.CheckpointIndex


def contenders(path: Path, parse: HandedOver, prebuilt: Prebuilt) -> dict[str, Callable[[], Any]]:
    """label -> the run; for a label 'RANK free WHAT', what to prepare before it: `preparations`."""
    tensors = expert_tensors(path)
    ranks = {"tp8": ParallelConfig(8, 0), "ep8": ParallelConfig(1, 0, 8, 0)}

    def load(rank: str, what: str | None) -> Callable[[], Any]:
        def run() -> Any:
            with free_work(what, parse, prebuilt):
                return load_experts(path, ranks[rank])
        return run

    tasks: dict[str, Callable[[], Any]] = {"floor": lambda: run_floor(path, tensors),
                                           "headers": lambda: run_headers(path, tensors)}
    for rank in ranks:
        tasks[rank] = load(rank, None)
        tasks.update({f"{rank} free {what}": load(rank, what) for what in FREE})
    return tasks


def preparation(label: str, parse: HandedOver, prebuilt: Prebuilt) -> Callable[[], None] | None:
    """What to run before contender `label`, outside the clock."""
    what = label.partition(" free ")[2]
    return prebuilt.prepare if what == "index" else parse.prepare if what else None


def measure(tasks: dict[str, Callable[[], Any]], parse: HandedOver, prebuilt: Prebuilt,
            reps: int) -> dict[str, list[float]]:
    """CPU seconds of every contender in every repetition (order reversed every other one)."""
    cpu: dict[str, list[float]] = {label: [] for label in tasks}
    for rep in range(reps):
        for label in list(tasks) if rep % 2 == 0 else list(tasks)[::-1]:
            prepare = preparation(label, parse, prebuilt)
            if prepare is not None:
                prepare()
            release_freed_memory()
            start = time.process_time()
            result = tasks[label]()
            cpu[label].append(time.process_time() - start)
            del result
            if parse.ready or prebuilt.built is not None:  # prepared but not asked for: not the bound it says
                raise SystemExit(f"{label}: what was made free before the clock was not used by the load")
    return cpu


def report(cpu: dict[str, list[float]]) -> str:
    """The table: CPU s, ÷ floor, ÷ headers, and each target's pass or fail."""
    med = {label: statistics.median(values) for label, values in cpu.items()}
    lines = ["| contender | CPU s (median) | min | ÷ floor | ÷ headers | target | pass? |",
             "|---|---|---|---|---|---|---|"]
    for label, seconds in med.items():
        checks = list(NAME_TARGETS.get(label.split()[0], ())) if label not in ("floor", "headers") else []
        text = "; ".join(f"≤ {limit}× {base}" for base, limit in checks)
        ok = "" if not checks else "PASS" if all(seconds / med[b] <= limit for b, limit in checks) else "FAIL"
        lines.append(f"| {label} | {seconds:.3f} | {min(cpu[label]):.3f} | {seconds / med['floor']:.3f} | "
                     f"{seconds / med['headers']:.2f} | {text} | {ok} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench --suite bounds", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wna16-names")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = build(args.workdir, "deepseek-names")
    for file in path.glob("*.safetensors"):
        file.read_bytes()  # into the page cache
    parse = HandedOver()
    prebuilt = Prebuilt(path)
    with free_work("parse", parse, prebuilt):  # records the texts a load parses (every rank parses the same)
        load_experts(path, ParallelConfig(8, 0))
    if not parse.texts:
        raise SystemExit("the index parsed no JSON through storage/header.py or storage/index.py: nothing to hand over")
    cpu = measure(contenders(path, parse, prebuilt), parse, prebuilt, args.reps)
    print(f"reps={args.reps} recorded json.loads calls={len(parse.texts)}\n{report(cpu)}")
    if args.json:
        args.json.write_text(json.dumps({"reps": args.reps, "cpu": cpu, "table": report(cpu)}, indent=2))

