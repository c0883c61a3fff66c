"""Load a checkpoint across torch.distributed ranks and check the sharded forward.

    python -m torch.distributed.run --nproc-per-node 2 scripts/distributed_demo.py [--ep 1] [--checkpoint DIR]

Every rank builds its ParallelConfig from the process group, loads its share,
runs the reference forward on the same tokens; the all_reduce(sum) of the rank
outputs must equal the unsharded forward, which rank 0 checks and prints.
Without --checkpoint, rank 0 writes a small synthetic GPTQ act-order checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from wna16_loader import Activation, ParallelConfig, load_experts, read_moe_config, reference_forward
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


def _checkpoint(arg: Path | None) -> Path:
    """The checkpoint folder: the argument, or a synthetic one written by rank 0 and shared."""
    holder = [str(arg) if arg else None]
    if arg is None and dist.get_rank() == 0:
        holder[0] = tempfile.mkdtemp(prefix="wna16-dist-")
        write_checkpoint(holder[0], quant_config("gptq", bits=4, group_size=32, act_order=True), num_experts=8,
                         hidden=128, intermediate=128, num_layers=2)
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (tp = world size / ep)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")
    folder = _checkpoint(args.checkpoint)
    parallel = ParallelConfig.from_process_group(ep_size=args.ep)
    moe = read_moe_config(folder)
    tokens = torch.randn(16, moe.hidden_size, generator=torch.Generator().manual_seed(0))
    topk = torch.randint(0, moe.num_experts, (16, moe.top_k), generator=torch.Generator().manual_seed(1))
    weights = torch.full((16, moe.top_k), 1.0 / moe.top_k)
    ok = True
    for prefix, layer in load_experts(folder, parallel).items():
        out = reference_forward(layer.dequantize(), layer.spec.experts, tokens, topk, weights, Activation.SILU)
        dist.all_reduce(out)
        if dist.get_rank() == 0:
            full = load_experts(folder, ParallelConfig(1, 0))[prefix]
            expect = reference_forward(full.dequantize(), full.spec.experts, tokens, topk, weights, Activation.SILU)
            same = torch.allclose(out, expect, rtol=1e-4, atol=1e-5 * float(expect.abs().max()))  # float32 sum order
            ok &= same
            print(f"{prefix}: all_reduce of {parallel.world_size} ranks vs unsharded: "
                  f"max |diff| = {(out - expect).abs().max().item():.2e} of max |out| {expect.abs().max().item():.2e} -> {'OK' if same else 'MISMATCH'}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
