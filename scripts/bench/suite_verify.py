"""Suite verify: `wna16-shard verify OUT --source SRC` against writing the same output (target: verify / write <= 1.5).

Usage: python scripts/bench --suite verify [--workdir /tmp/wna16-bench-verify] [--experts 64] [--layers 2] [--tp 4]
       [--reps 2] [--json out.json]

A synthetic Qwen3-MoE-shaped GPTQ 4-bit G 128 checkpoint (H 2048, I 768) is written once into the workdir.
Each repetition writes the output afresh (`preshard_checkpoint`, what `wna16-shard SRC OUT --tp N` runs) and
then verifies it against the source (`verify_report(OUT, source=SRC)`, what `wna16-shard verify OUT --source
SRC` runs), page cache warm for both. The best of the repetitions is reported for each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

from wna16_loader.preshard import preshard_checkpoint
from wna16_loader.preshard.progress import human_size
from wna16_loader.preshard.verify import verify_report
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


def build(folder: Path, experts: int, layers: int) -> Path:
    """The source checkpoint, written once (kept across runs of this script)."""
    done = folder / ".complete"
    if not done.is_file():
        write_checkpoint(folder, quant_config("gptq", bits=4, group_size=128), family="qwen3_moe", references=False,
                         num_experts=experts, hidden=2048, intermediate=768, num_layers=layers, files=2)
        done.write_text("ok\n")
    return folder


def timed(fn) -> tuple[float, object]:  # noqa: ANN001
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench --suite verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/wna16-bench-verify"))
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("wna16_loader").setLevel(logging.ERROR)  # the reduced-group warning of every write
    src = build(args.workdir / f"src-e{args.experts}-l{args.layers}", args.experts, args.layers)
    out = args.workdir / f"out-tp{args.tp}"
    writes, verifies = [], []
    for _ in range(args.reps):
        shutil.rmtree(out, ignore_errors=True)
        seconds, _ = timed(lambda: preshard_checkpoint(src, out, tp_size=args.tp, progress=False))
        writes.append(seconds)
        seconds, report = timed(lambda: verify_report(out, source=src))
        assert not report.problems, report.problems
        verifies.append(seconds)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    result = {"output_bytes": size, "tp": args.tp, "experts": args.experts, "layers": args.layers,
              "write_s": min(writes), "verify_s": min(verifies), "ratio": min(verifies) / min(writes), "target": 1.5}
    print(f"output {human_size(size)} at tp {args.tp}: write {result['write_s']:.2f} s, verify --source "
          f"{result['verify_s']:.2f} s, ratio {result['ratio']:.2f} (target <= 1.5)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0

