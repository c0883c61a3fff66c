"""wna16-shard: pre-shard a WNA16 MoE checkpoint per TP/EP rank, or verify such an output.

Exit codes: 0 ok, 1 a failed check (verify problems), 2 bad usage or bad input, 130 interrupted (Ctrl-C).

This module imports nothing heavy at its top (the package's names are imported on first use): torch and the
writer are imported inside `main`, after its Ctrl-C guard, so that a Ctrl-C at any moment, start-up included,
is one line and exit 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .errors import CheckpointError, ShardInterrupted, WNA16Error
from .logs import log
from .usage import LazyChoices, Parser, Spelling, check_not_shadowed, subcommand_typo
from .version import __version__

if TYPE_CHECKING:
    from .preshard import ShardSummary
    from .preshard.verify import VerifyReport

USAGE = """\
wna16-shard SRC OUT [--tp N] [--ep M] [--for ENGINE] [options]   pre-shard SRC into OUT
       wna16-shard verify OUT [--source SRC]             re-check an output
       wna16-shard SRC --plan [--tp N] [--ep M]          compare TP layouts: G_eff, padding, bytes per rank
       wna16-shard --version | --help"""

UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
         "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}

SHARD_EPILOG = """\
examples:
  wna16-shard ./Qwen3-30B-A3B-GPTQ ./out-tp4 --tp 4
  wna16-shard ./Mixtral-AWQ ./out --tp 2 --ep 4 --placement round_robin --max-file-size 2GB
  wna16-shard ./ckpt --plan --ep 2                 # G_eff, padding, bytes per rank of TP 1..16
  wna16-shard ./ckpt ./out --ep 8                  # EP only (--tp defaults to 1)
  wna16-shard ./ckpt ./out --tp 8 --for sglang     # refused, nothing written, unless SGLang serves TP 8
  wna16-shard ./ckpt ./out --tp 2 --dry-run        # print the plan and how the config resolved, write nothing
  wna16-shard ./ckpt ./out --tp 2 --resume         # finish an interrupted run
  wna16-shard ./ckpt ./out --tp 2                  # again: re-check every file, rewrite only damaged ones
  wna16-shard ./ckpt ./out --tp 2 --force          # rewrite every file of a complete output
  wna16-shard ./ckpt ./out --tp 8 --workers 4      # write 4 ranks at a time
  wna16-shard ./ckpt ./out --tp 2 --layout checkpoint  # source-format tensors, sliced per rank
  wna16-shard ./ckpt ./out --tp 2 --no-mtp         # MTP layers' tensors copied unchanged into common/
  wna16-shard org/Model-GPTQ ./out --tp 2 --revision v1  # a Hugging Face repo id (cache first, else download)
  wna16-shard verify ./out --source ./ckpt         # re-check hashes and reassembly
  torchrun --nproc-per-node 4 -m wna16_loader.cli ./ckpt ./out --tp 8   # 4 processes, 2 ranks each

Load a rank with load_experts(OUT, ParallelConfig.from_manifest(OUT, rank=R)).
exit codes: 0 ok, 1 verify found problems, 2 bad usage or bad input, 130 interrupted (re-run with --resume).
"""

VERIFY_EPILOG = """\
examples:
  wna16-shard verify ./out                    # every file's sha256 vs the manifest
  wna16-shard verify ./out --source ./ckpt    # also: every tensor equals a fresh conversion, common/ identical
  wna16-shard verify ./out --source ./ckpt --reassemble   # also: dequantised experts stitched over TP (slow)
exit codes: 0 no problems, 1 problems found (listed on stderr), 2 bad usage.
"""


def parse_size(text: str) -> int:
    """'4GB', '512MiB', '1000' -> bytes (K/M/G/T are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 4GB, 512MB, 1048576 (bytes)")
    value = int(float(match.group(1)) * UNITS[match.group(2).upper()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be at least 1 byte")
    return value


# the engines' own spellings of the split: a did-you-mean for each (the output's sizes are the MoE layers')
ENGINE_SPELLINGS = {
    "--tensor-parallel-size": Spelling("--tp", note=" (with vLLM's --enable-expert-parallel its MoE layers are EP "
                                                    "over those ranks: --ep N, --tp 1)"),
    "--tp-size": Spelling("--tp", note=" (SGLang's --tp-size counts every rank: with --ep-size E, --tp N/E --ep E)"),
    "--ep-size": Spelling("--ep"), "--expert-parallel-size": Spelling("--ep"),
    "--enable-expert-parallel": Spelling("--ep", valued=False, note=" (vLLM's --enable-expert-parallel runs the MoE "
                                         "layers EP over all its -tp ranks: --ep with that count, --tp 1)"),
}


def shard_parser() -> argparse.ArgumentParser:
    """The parser of `wna16-shard SRC OUT ...`."""
    from .parallel.config import ExpertPlacement
    p = Parser(prog="wna16-shard", formatter_class=argparse.RawDescriptionHelpFormatter, usage=USAGE,
               spellings=ENGINE_SPELLINGS,
                                description="Pre-shard a WNA16 MoE checkpoint: write every TP/EP rank's fused expert "
                                            "tensors to OUT/rank-RRRRR-of-WWWWW/, the other tensors to OUT/common/, "
                                            "and OUT/wna16_manifest.json. Also: `wna16-shard verify OUT`.",
                                epilog=SHARD_EPILOG)
    p.add_argument("src", metavar="SRC", help="source checkpoint folder (safetensors + config.json), or a Hugging "
                                              "Face repo id org/name (cached snapshot first, else only configs, "
                                              "index and *.safetensors are downloaded)")
    add_revision(p, "SRC")
    p.add_argument("out", metavar="OUT", nargs="?", help="output folder (created; must be empty or a run with the "
                                                         "same parameters); not needed with --plan")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default 1), e.g. --tp 4")
    p.add_argument("--ep", type=int, default=1, metavar="M", help="expert-parallel size (default 1), e.g. --ep 2")
    p.add_argument("--for", dest="serve_for", metavar="ENGINE",
                   help="the engine that will serve OUT with --load-format wna16: vllm or sglang, or a tested "
                        "version (vllm==0.34.0, sglang==0.5.23); a split it would refuse is an error (exit 2) "
                        "before anything is written, naming a split it serves. Without it: a warning before the "
                        "write; --dry-run and --plan show both engines")
    p.add_argument("--placement", choices=[p.value for p in ExpertPlacement], default="linear",
                   help="how experts are dealt to EP ranks: linear = consecutive blocks, round_robin = id %% ep "
                        "(default linear)")
    p.add_argument("--max-file-size", type=parse_size, default=4 * 2**30, metavar="SIZE",
                   help="largest output file, split by tensor, e.g. 4GB (default), 512MB, 1000000")
    p.add_argument("--layout", choices=LazyChoices("wna16_loader.preshard", "LAYOUTS"), metavar="LAYOUT",
                   help="output layout: fused (default; load_experts reads it) or checkpoint (every source expert "
                        "tensor keeps its name, dtype and format, sliced for the rank; only when the cuts fall on "
                        "int32-word and group boundaries)")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave the MTP (multi-token-prediction) layers unsharded: their expert tensors are copied "
                        "unchanged into OUT/common/ with the other non-expert tensors (default: sharded like "
                        "every MoE layer; for an engine that loads its draft layer from the original names)")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="write K folders (ranks, common/) in parallel processes (default 1); output is identical")
    p.add_argument("--distributed", action="store_true",
                   help="rank-parallel: run under torchrun (or with torch.distributed's env:// variables set); "
                        "each process writes the output ranks r with r %% K == its rank, process 0 also common/ "
                        "and the manifest; the output is identical. Implied when torchrun starts several "
                        "processes. On several machines OUT must be one shared filesystem.")
    redo = p.add_mutually_exclusive_group()
    redo.add_argument("--resume", action="store_true", help="keep finished files whose size and sha256 match and "
                                                             "redo the rest of an interrupted run (a finished OUT "
                                                             "is always re-checked so: only damaged files are "
                                                             "rewritten)")
    redo.add_argument("--force", action="store_true", help="rewrite every file even when OUT already holds this "
                                                            "output (by default: every file is re-checked, size "
                                                            "then sha256, and only those that differ rewritten)")
    p.add_argument("--verify", action="store_true", help="after writing, re-read everything and compare it with "
                                                          "the source (exit 1 on problems)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (ranks, files, bytes, G_eff) and how each "
                                                           "model config value resolved (key, rule, families-table "
                                                           "row); write nothing")
    p.add_argument("--plan", action="store_true", help="print, for TP 1, 2, 4, 8, 16 (and --tp) x --ep: I' (I padded "
                                                        "where groups would break), I_p, G_eff, the padding of every "
                                                        "TP rank and the bytes per rank of each MoE layer; read "
                                                        "nothing but config and headers, write nothing (also "
                                                        "--dry-run with no OUT)")
    p.add_argument("--quiet", action="store_true", help="no progress and no summary table")
    p.add_argument("--version", action="version", version=f"wna16-shard (wna16_loader) {__version__}")
    return p


def verify_parser() -> argparse.ArgumentParser:
    """The parser of `wna16-shard verify OUT [--source SRC]`."""
    p = Parser(prog="wna16-shard verify", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Re-read every file of a wna16-shard output and check every sha256 "
                                            "against its manifest.", epilog=VERIFY_EPILOG)
    p.add_argument("out", metavar="OUT", help="a wna16-shard output folder")
    p.add_argument("--source", metavar="SRC", help="the source checkpoint: also check that the experts reassemble "
                                                   "exactly and that common/ is byte-identical (a folder or "
                                                   "a Hugging Face repo id org/name)")
    add_revision(p, "--source")
    p.add_argument("--reassemble", action="store_true", help="with --source, also dequantise every rank's fused "
                                                             "experts and compare them, stitched over TP, with a "
                                                             "TP 1 load of SRC (float32 of the whole model: slow)")
    return p


def add_revision(p: argparse.ArgumentParser, what: str) -> None:
    """The --revision option of a repo-id argument."""
    p.add_argument("--revision", metavar="REV", help=f"branch, tag or commit when {what} is a Hugging Face repo id "
                                                     f"(default: main); not allowed with a local folder")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `wna16-shard` console script; returns the exit code.

    Every error is one line on stderr (exit 2); a closed stdout (`| head`) ends quietly."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _log_warnings_to_stderr()
        check_not_shadowed()
        typo = subcommand_typo(argv)
        if typo is not None:
            print(f"wna16-shard: error: {typo}", file=sys.stderr)
            return 2
        if argv[:1] == ["verify"]:
            code = _verify(verify_parser().parse_args(argv[1:]))
        else:
            parser = shard_parser()
            code = _shard(parser, parser.parse_args(argv))
        sys.stdout.flush()
        return code
    except WNA16Error as exc:
        print(f"wna16-shard: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C: one line saying how far it got (ShardInterrupted) and how to go on
        print(f"wna16-shard: {exc}" if isinstance(exc, ShardInterrupted) else interrupted_line(argv), file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop writing, no traceback
        _to_devnull(sys.stdout)
        return 0


INTERRUPTED = "wna16-shard: interrupted; re-run the same command (with --resume when it had started writing)"


def interrupted_line(argv: list[str]) -> str:
    """The line a Ctrl-C prints for the command `argv` (verify only reads; a shard run may resume)."""
    if argv[:1] == ["verify"]:
        return "wna16-shard verify: interrupted (it only reads: nothing changed); re-run it"
    return INTERRUPTED


def _to_devnull(stream: IO[str]) -> None:
    """Point `stream`'s file descriptor at /dev/null (its reader went away: later writes and flushes must not fail)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def run() -> None:
    """The console script (and `python -m wna16_loader.cli`): `main()`, then exit. A Ctrl-C as `main`
    returns gives main's one line and exit 130 too; after it, SIGINT is ignored, so no interrupt can land in
    the interpreter's teardown (torch, threads, a worker pool's finalizers), where it would kill the process
    by the signal with no line at all. The teardown itself still runs: a pool's semaphores are released."""
    code = 130
    try:
        try:
            code = main()
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        print(interrupted_line(sys.argv[1:]), file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError):  # the reader went away: nothing more to say, and the
            _to_devnull(stream)  # interpreter's last flush must not fail
    sys.exit(code)


class _StderrLines(logging.Handler):
    """A log record as one line on the `sys.stderr` of the moment it is emitted (so a caller that redirects
    stderr around `main()` gets the warnings too; a `StreamHandler` keeps the stream it was made with)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:  # logging's own contract: a failing handler reports, never raises
            self.handleError(record)


def _log_warnings_to_stderr() -> None:
    """Package warnings (e.g. a reduced group size) as `wna16-shard: warning: ...` lines on stderr."""
    if not any(getattr(h, "wna16_cli", False) for h in log.handlers):
        handler = _StderrLines()
        handler.setFormatter(logging.Formatter("wna16-shard: warning: %(message)s"))
        handler.setLevel(logging.WARNING)
        handler.wna16_cli = True  # type: ignore[attr-defined]
        log.addHandler(handler)


def _verify(args: argparse.Namespace) -> int:
    from .preshard.verify import verify_report
    from .storage.hub import resolve_checkpoint
    if args.source is None and args.revision is not None:
        raise CheckpointError(f"--revision {args.revision} names a revision of --source, but no --source was given; "
                              f"pass --source org/name or drop --revision.")
    if args.source is None and args.reassemble:
        raise CheckpointError("--reassemble compares the output with its source; pass --source SRC too.")
    source = None if args.source is None else resolve_checkpoint(args.source, revision=args.revision)
    return _print_verify(verify_report(args.out, source=source, reassemble=args.reassemble))


def _print_verify(report: VerifyReport) -> int:
    for problem in report.problems:
        print(f"wna16-shard verify: {problem}", file=sys.stderr)
    if report.problems:
        print(f"wna16-shard verify: {len(report.problems)} problems in {report.out}", file=sys.stderr)
        return 1
    print(f"wna16-shard verify: {report.text()}")
    if report.source is None:
        print(f"next: wna16-shard verify {report.out} --source SRC   # also compare every tensor with the source")
    else:
        print(f"next: {_load_hint(report.out)}")
    return 0


def _load_hint(out: object) -> str:
    return f"load_experts({str(out)!r}, ParallelConfig.from_manifest({str(out)!r}, rank=RANK))"


def _shard(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .parallel.config import ShardJob
    from .preshard import describe_layouts, describe_plan, preshard_checkpoint
    from .preshard import OutputLayout
    from .storage.hub import resolve_checkpoint
    from .layouts.engines import versions_for
    args.layout = OutputLayout.FUSED.value if args.layout is None else args.layout
    if args.serve_for is not None:
        versions_for(args.serve_for)  # a name no tested engine has: exit 2 before anything is read
    src = resolve_checkpoint(args.src, revision=args.revision)
    if args.plan or (args.dry_run and args.out is None):
        print(describe_layouts(src, tp_size=args.tp, ep_size=args.ep, placement=args.placement))
        return 0
    if args.out is None:
        parser.error("OUT is required to write an output (or pass --plan to compare layouts), e.g. "
                     "wna16-shard ./ckpt ./out --tp 4")
    if (args.distributed or ShardJob.from_environment().processes > 1) and not args.dry_run:
        return _shard_distributed(args, src)  # one process: the same run, no process group needed
    summary = preshard_checkpoint(src, args.out, tp_size=args.tp, ep_size=args.ep, placement=args.placement,
                                  max_file_size=args.max_file_size, resume=args.resume, verify=args.verify,
                                  dry_run=args.dry_run, progress=not args.quiet, layout=args.layout,
                                  workers=args.workers, force=args.force, mtp=not args.no_mtp,
                                  serve_for=args.serve_for)
    if args.dry_run:
        print(describe_plan(summary.plan))
        return 0
    for problem in summary.problems:
        print(f"wna16-shard verify: {problem}", file=sys.stderr)
    if not args.quiet:
        print(_shard_text(summary, args))
    return 1 if summary.problems else 0


def _shard_text(summary: ShardSummary, args: argparse.Namespace) -> str:
    """The summary table (or 'already complete'), what --verify checked, and the next command."""
    if summary.complete:
        lines = [f"wna16-shard: {summary.out}: already complete: nothing to do (the manifest matches SRC and the "
                 f"parameters; every file has the size and sha256 it records). --force rewrites every file."]
    else:
        lines = [summary.table()]
    if summary.verified:
        lines.append(f"verified: {summary.verified}")
    if summary.problems:
        return "\n".join(lines)
    if not args.verify:
        lines.append(f"next: wna16-shard verify {summary.out} --source {args.src}")
    lines.append(f"load: {_load_hint(summary.out)}")
    return "\n".join(lines)


def _shard_distributed(args: argparse.Namespace, src: str | Path) -> int:
    """One process of a rank-parallel run (joining torchrun's rendezvous with gloo when needed)."""
    from .parallel.config import ShardJob
    from .preshard import preshard_distributed
    from .preshard.verify import verify_report
    with ShardJob.joined() as job:
        summary = preshard_distributed(src, args.out, job, tp_size=args.tp, ep_size=args.ep,
                                       placement=args.placement, max_file_size=args.max_file_size,
                                       resume=args.resume, layout=args.layout, mtp=not args.no_mtp,
                                       serve_for=args.serve_for)
    if job.process != 0:
        return 0
    if not args.quiet:
        print(summary.table())
    return _print_verify(verify_report(args.out, source=src)) if args.verify else 0


if __name__ == "__main__":
    run()
