"""Suite inplace: peak memory that filling an engine's MoE parameters in place adds over the parameters.

    python scripts/bench --suite inplace [--experts 64] [--hidden 1024] [--inter 768] [--layers 4] [--device D]
                                         [--engine sglang]

Writes a synthetic GPTQ 4-bit g128 symmetric checkpoint and a `wna16-shard --layout fused` output of it
(TP 2) in a scratch folder, then, in one fresh process per row: allocates (and touches) the parameters of
one method row (layouts.vllm; `--engine sglang`: layouts.sglang's GPTQ Marlin row, SGLang's pick for this
checkpoint) for every MoE layer as the engine would, samples the process's anonymous RSS
(/proc/self/status RssAnon, every 2 ms: torch's CPU allocations are invisible to tracemalloc) while
`load.inplace.fill_layers` fills them, and reports the peak over the baseline next to the parameters'
bytes and one layer's fused bytes. "copy" is the previous plugin path (load_experts builds every layer's
fused tensors, then copies them in). Timings and RSS on a shared machine are noisy.

`--device cuda:N` puts the parameters on that GPU and reports what the load adds to
`torch.cuda.max_memory_allocated` over the parameters (scripts/gpu_check runs it); `--device stand-in`
is a dry run of that path on the tests' GPU stand-in (its numbers are the stand-in's bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.layouts import AUTO_GPTQ, GPTQ_MARLIN, MOE_WNA16, SGLANG_LAYOUTS, VLLM_LAYOUTS, allocated_shape
from wna16_loader.load.experts import planned
from wna16_loader.load.inplace import LayerTarget, fill_layers, fused_name, layer_sizes
from wna16_loader.testing.standin import StandIn
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

ROWS = {row.name: row for row in (*VLLM_LAYOUTS, *SGLANG_LAYOUTS)}
# (from, row, TP) measured for each engine
RUNS = {"vllm": [("copy", MOE_WNA16.name, 1), ("checkpoint", MOE_WNA16.name, 1), ("checkpoint", AUTO_GPTQ.name, 1),
                 ("checkpoint", MOE_WNA16.name, 2), ("checkpoint", AUTO_GPTQ.name, 2), ("shard", MOE_WNA16.name, 2),
                 ("shard", AUTO_GPTQ.name, 2)],
        "sglang": [("checkpoint", GPTQ_MARLIN.name, 1), ("checkpoint", GPTQ_MARLIN.name, 2),
                   ("shard", GPTQ_MARLIN.name, 2), ("checkpoint", MOE_WNA16.name, 2)]}


def anon_kib() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["RssAnon"].split()[0])


def targets_for(src: Path, parallel: ParallelConfig, row_name: str,
                device: str = "cpu") -> tuple[dict[str, LayerTarget], int, int]:
    """Touched parameters of `row_name` for every layer on `device`, their bytes and one layer's fused bytes."""
    row, targets, params_bytes, layer_bytes = ROWS[row_name], {}, 0, 0
    with planned(src, parallel) as (_, _, _, plans):
        for plan in plans:
            sizes = layer_sizes(plan.fused, plan.moe.quant.group_size)
            params = {d.name: torch.zeros(allocated_shape(d, sizes), dtype=d.dtype or plan.fused.scale_dtype,
                                          device=device)
                      for d in row.filled(plan.fused.has_zero_point)}
            targets[plan.prefix] = LayerTarget(row, params, plan.fused.experts)
            params_bytes += sum(t.numel() * t.element_size() for t in params.values())
            layer_bytes = max(layer_bytes, plan.fused.nbytes)
    return targets, params_bytes, layer_bytes


def rss_added(run: Callable[[], None]) -> int:
    """The most anonymous RSS `run` adds over the process's before it (sampled every 2 ms), in bytes."""
    peak, stop, before = [0], threading.Event(), anon_kib()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon_kib())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    run()
    stop.set()
    thread.join()
    return (max(peak[0], anon_kib()) - before) * 1024


def device_added(device: str) -> Callable[[Callable[[], None]], int]:
    """What `run` adds to `torch.cuda.max_memory_allocated(device)` over the bytes allocated before it."""
    def measure(run: Callable[[], None]) -> int:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return measure


def child(mode: str, row: str, source: str, tp: int, device: str) -> dict:
    """One row, in this process: the parameters on `device` ("stand-in": cuda:0 of the GPU stand-in), then
    the load that fills them, and what it added at its peak."""
    if device == "stand-in":
        with StandIn(count=1):
            return measured(mode, row, source, tp, "cuda:0")
    return measured(mode, row, source, tp, device)


def measured(mode: str, row: str, source: str, tp: int, device: str) -> dict:
    parallel = ParallelConfig(tp_size=tp, tp_rank=0)
    targets, params_bytes, layer_bytes = targets_for(Path(json.loads(source)["checkpoint"]), parallel, row, device)
    folder = json.loads(source)[mode if mode != "copy" else "checkpoint"]

    def run() -> None:
        if mode != "copy":
            fill_layers(folder, parallel, targets)
            return
        for prefix, experts in load_experts(folder, parallel, device=device).items():
            for decl in targets[prefix].layout.filled(experts.has_zero_point):
                targets[prefix].params[decl.name].copy_(experts.tensors[fused_name(decl)])

    start = time.perf_counter()
    added = (rss_added if device == "cpu" else device_added(device))(run)
    return {"params": params_bytes, "layer": layer_bytes, "added": added, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="cpu (anonymous RSS), cuda:N (torch.cuda.max_memory_allocated) "
                                                        "or stand-in (a dry run of the cuda path)")
    parser.add_argument("--engine", choices=sorted(RUNS), default="vllm", help="whose method rows to fill")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.child[2], int(args.child[3]), args.child[4])))
        return 0
    from wna16_loader.preshard.run import preshard_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(Path(tmp) / "ckpt", quant_config("gptq", bits=4, group_size=128, symmetric=True),
                               num_experts=args.experts, hidden=args.hidden, intermediate=args.inter,
                               num_layers=args.layers, references=False).folder
        shard = Path(tmp) / "shard"
        preshard_checkpoint(src, shard, tp_size=2, progress=False)
        sources = json.dumps({"checkpoint": str(src), "shard": str(shard)})
        what = "anonymous RSS" if args.device == "cpu" else f"torch.cuda.max_memory_allocated on {args.device}"
        print(f"{args.layers} layers x {args.experts} experts, H {args.hidden}, I {args.inter}, GPTQ 4-bit g128; "
              f"added peak: {what}\n")
        print("| method row | from | TP (rank 0) | parameters MiB | one layer fused MiB | added peak MiB | added / parameters |")
        print("|---|---|---|---|---|---|---|")
        for mode, row, tp in RUNS[args.engine]:
            out = subprocess.run([sys.executable, __file__, "--child", mode, row, sources, str(tp), args.device],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            label = "previous path (load_experts, then copy)" if mode == "copy" else mode
            print(f"| {row} | {label} | {tp} | {r['params'] / 2**20:.1f} | {r['layer'] / 2**20:.1f} | "
                  f"{r['added'] / 2**20:.1f} | {r['added'] / r['params']:.2f} |")
    return 0


if __name__ == "__main__":  # the per-row child process
    main(sys.argv[1:])
