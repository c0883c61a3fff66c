"""Demo: write a synthetic checkpoint, load it at TP = 2, show each rank and check the reassembly.

Run `./scripts/demo` (or `python -m wna16_loader.testing.demo --help`). The checkpoint goes to a temporary folder
that is removed at the end, unless --keep (or --out) keeps it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import WNA16Error
from ..formats import FORMATS
from ..load.device import DevicePolicy
from ..load.experts import load_experts
from ..parallel.config import ParallelConfig
from .synthetic import quant_config, write_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="gptq", choices=[decl.name for decl in FORMATS],
                        help="checkpoint format (default gptq)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--act-order", action="store_true")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="checkpoint folder, kept (default: a temporary "
                                                                "folder, removed at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary checkpoint folder and print the "
                                                            "command that pre-shards it")
    parser.add_argument("--device", default="cpu", help="where the fused parameters go: cpu, cuda or cuda:N "
                                                        "(ROCm GPUs are cuda:N too)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every rank's shard reassembles exactly (2: bad arguments, or a device it
    cannot use; refused before anything is written)."""
    args = _parser().parse_args(argv)
    try:
        DevicePolicy.of(args.device)
        if args.out is not None or args.keep:
            folder = args.out or Path(tempfile.mkdtemp(prefix="wna16-demo-"))
            code = run(folder, args)
            print(f"kept: {folder}\nnext: {shard_command()} {folder} {folder}-tp{args.tp} --tp {args.tp} "
                  f"--ep {args.ep}")
            return code
        with tempfile.TemporaryDirectory(prefix="wna16-demo-") as tmp:
            return run(Path(tmp), args, temporary=True)
    except WNA16Error as exc:
        print(f"wna16-demo: error: {exc}", file=sys.stderr)
        return 2


def shard_command() -> str:
    """How to run wna16-shard from this interpreter, as a command that works as printed: `wna16-shard` when
    that is the one on PATH, else the console script's full path (e.g. `.venv/bin/wna16-shard`, which
    `pip install -e .` put next to the interpreter), else `python -m wna16_loader.cli`."""
    script = Path(sys.executable).parent / "wna16-shard"
    on_path = shutil.which("wna16-shard")
    if on_path is not None and (not script.is_file() or Path(on_path).resolve() == script.resolve()):
        return "wna16-shard"
    return str(script) if script.is_file() else f"{sys.executable} -m wna16_loader.cli"


def run(folder: Path, args: argparse.Namespace, *, temporary: bool = False) -> int:
    """Write the checkpoint to `folder`, load every rank, print the table and check the reassembly.
    temporary: `folder` is removed at the end, so its path is not printed."""
    qc = quant_config(args.format, bits=args.bits, group_size=args.group_size, symmetric=False,
                      act_order=args.act_order)
    ckpt = write_checkpoint(folder, qc, family="qwen3_moe", num_experts=8, hidden=512, intermediate=768,
                            num_layers=2, files=2)
    where = "a temporary folder (removed at the end; --keep keeps it)" if temporary else str(folder)
    print(f"checkpoint: {where} ({args.format}, {args.bits}-bit, group {args.group_size}, 8 experts, "
          f"H 512, I 768, 2 layers), loaded to {args.device}")
    rows, pieces = [], {}
    for parallel in ParallelConfig.all_ranks(tp_size=args.tp, ep_size=args.ep):
        layers = load_experts(folder, parallel, device=args.device)
        first = next(iter(layers.values()))
        rows.append((str(parallel.rank), str(parallel.tp_rank), str(parallel.ep_rank), expert_ids(first.spec.experts),
                     str(list(first.w13_qweight.shape)), str(list(first.w2_scales.shape)),
                     f"{layers.report.bytes_read / 2**20:.2f}"))
        _collect(layers, parallel, pieces)
    print(table(("rank", "tp", "ep", "experts", "w13_qweight", "w2_scales", "MiB read"), rows))
    return _report(ckpt.references, pieces, args.tp)


def expert_ids(ids: tuple[int, ...]) -> str:
    """(0, 1, 2, 3) -> '0-3'; (0, 2, 4) -> '0,2,4'."""
    if len(ids) > 2 and list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(str(i) for i in ids)


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns as wide as their widest cell; text left-aligned, numbers right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    right = [all(row[i].replace(".", "").isdigit() for row in rows) for i in range(len(header))]
    lines = [" ".join(cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right)).rstrip()
             for row in (header, *rows)]
    return "\n".join(lines)


def _collect(layers: dict, parallel: ParallelConfig, pieces: dict) -> None:
    for prefix, moe in layers.items():
        dq, part = moe.dequantize(), moe.spec.part
        for slot, expert in enumerate(moe.spec.experts):
            for name, tensor in (("gate", dq.w13[slot, :part]), ("up", dq.w13[slot, part:]), ("down", dq.w2[slot])):
                pieces.setdefault((prefix, expert, name), {})[parallel.tp_rank] = tensor.cpu()


def _report(references: dict, pieces: dict, tp: int) -> int:
    bad = []
    for key, ref in references.items():
        parts = [pieces[key][r] for r in range(tp)]
        whole = torch.cat(parts, dim=1 if key[2] == "down" else 0)
        if not torch.equal(whole, ref):
            bad.append(key)
    print(f"reassembly: {len(references) - len(bad)}/{len(references)} expert projections identical to the "
          f"full dequantised weights" + ("" if not bad else f"; MISMATCH: {bad[:5]}"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
