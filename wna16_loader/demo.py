"""Demo: write a synthetic checkpoint, load it at TP = 2, show each rank and check the reassembly.

Run `./scripts/demo` (or `python -m wna16_loader.demo --help`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from .device import DevicePolicy
from .errors import WNA16Error
from .loader import load_experts
from .parallel import ParallelConfig
from .synthetic import write_checkpoint, quant_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="gptq", help="gptq, awq, compressed-tensors or auto-round")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--act-order", action="store_true")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: a temp folder)")
    parser.add_argument("--device", default="cpu", help="where the fused parameters go: cpu, cuda or cuda:N "
                                                        "(ROCm GPUs are cuda:N too)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every rank's shard reassembles exactly, 2 on a device it cannot use."""
    args = _parser().parse_args(argv)
    try:
        DevicePolicy.of(args.device)
    except WNA16Error as exc:
        print(f"error: {exc}")
        return 2
    folder = args.out or Path(tempfile.mkdtemp(prefix="wna16-demo-"))
    qc = quant_config(args.format, bits=args.bits, group_size=args.group_size, symmetric=False,
                      act_order=args.act_order)
    ckpt = write_checkpoint(folder, qc, family="qwen3_moe", num_experts=8, hidden=512, intermediate=768,
                            num_layers=2, files=2)
    print(f"checkpoint: {folder} ({args.format}, {args.bits}-bit, group {args.group_size}, 8 experts, "
          f"H 512, I 768, 2 layers), loaded to {args.device}")
    print(f"{'rank':>4} {'tp':>3} {'ep':>3} {'experts':<12} {'w13_qweight':<16} {'w2_scales':<14} {'MiB read':>8}")
    pieces: dict[tuple[str, int, str], dict[int, torch.Tensor]] = {}
    for parallel in ParallelConfig.all_ranks(tp_size=args.tp, ep_size=args.ep):
        layers = load_experts(folder, parallel, device=args.device)
        first = next(iter(layers.values()))
        print(f"{parallel.rank:>4} {parallel.tp_rank:>3} {parallel.ep_rank:>3} {str(list(first.spec.experts)):<12} "
              f"{str(list(first.w13_qweight.shape)):<16} {str(list(first.w2_scales.shape)):<14} "
              f"{layers.report.bytes_read / 2**20:>8.2f}")
        _collect(layers, parallel, pieces)
    return _report(ckpt.references, pieces, args.tp)


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
