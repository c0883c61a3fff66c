"""The one entry point: picks the suite (by --suite, or by --size), applies --quick, hands the rest over.

  python scripts/bench                          the real-scale run, 48 layers (14.5 GB), peers included
  python scripts/bench --quick                  the same at 8 layers (2.4 GB), one repetition
  python scripts/bench --size full --reps 3     the 550 MB shape, every format (suite small)
  python scripts/bench --size deepseek-names    the name scale (suite names)
  python scripts/bench --suite node --size qwen3-30b-16l --ranks 8   N ranks of one machine started together
  python scripts/bench --suite bounds|reads|verify|device|inplace [options]
  ./scripts/test_vllm --python scripts/bench --suite vllm [options]   (in a vLLM tier venv)
  ./scripts/test_sglang --python scripts/bench --suite sglang [options]   (in the SGLang tier's venv)
Every suite takes --help.
"""

from __future__ import annotations

import argparse
import importlib

from .baselines import NAME_SIZES, SCALE_SIZES

SUITES = ("scale", "small", "names", "bounds", "reads", "verify", "device", "inplace", "vllm", "sglang", "node")
SMALL_SIZES = ("small", "full", "full8", "mixtral")
SIZED = ("scale", "small", "names", "device", "node")  # the suites that take --size
QUICK = {"scale": ["--size", "qwen3-30b-8l", "--reps", "1", "--skip", "whole,floortr,owntr", "--no-shard"], "small": ["--size", "small", "--reps", "2"],
         "names": ["--reps", "1", "--no-conversions"], "bounds": ["--reps", "1"], "reads": ["--reps", "2"],
         "verify": ["--reps", "1", "--experts", "16"], "device": ["--reps", "1"],
         "inplace": ["--experts", "16", "--layers", "2"], "vllm": ["--layers", "2", "--layouts", "tp2", "--reps", "1"],
         "sglang": ["--layers", "2", "--layouts", "tp2", "--reps", "1"],
         "node": ["--size", "qwen3-30b-8l", "--reps", "1"]}


def suite_of(suite: str | None, size: str | None) -> str:
    """The suite to run: --suite if given, else the one whose sizes hold --size, else scale."""
    if suite is not None:
        return suite
    if size in SCALE_SIZES or size is None:
        return "scale"
    if size in NAME_SIZES:
        return "names"
    if size in SMALL_SIZES:
        return "small"
    raise SystemExit(f"--size {size}: not a size of any suite; choose from "
                     f"{sorted(SCALE_SIZES) + sorted(NAME_SIZES) + list(SMALL_SIZES)}")


def suite_argv(suite: str, size: str | None, quick: bool, rest: list[str]) -> list[str]:
    """The arguments the suite gets: --quick's first (the user's own come after and win), then --size."""
    argv = list(QUICK[suite]) if quick else []
    if size is not None and suite in SIZED:
        argv += ["--size", size]
    return argv + rest


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n")[0], add_help=False)
    parser.add_argument("--suite", choices=SUITES)
    parser.add_argument("--size")
    parser.add_argument("--quick", action="store_true", help="a short run of the suite (see QUICK)")
    parser.add_argument("--child", nargs=2, metavar=("KEY", "PATH"), help=argparse.SUPPRESS)
    known, rest = parser.parse_known_args(argv)
    if known.child:
        from .suite_scale import child_main
        child_main(*known.child)
        return
    suite = suite_of(known.suite, known.size)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
    module = importlib.import_module(f"bench.suite_{suite}")
    status = module.main(suite_argv(suite, known.size, known.quick, rest))
    if status:
        raise SystemExit(status)
