"""Suite sglang: SGLang's model load with its default loader against `--load-format wna16`, per rank, in one run.

Runs in the SGLang tier's venv (CPU ranks over gloo):
    ./scripts/test_sglang --python scripts/bench --suite sglang [--size qwen3-30b] [--layers 8] [--inter I]
        [--layouts tp4,ep4,tp8,ep8] [--states cold,warm] [--reps 2] [--json OUT.json] [--workdir DIR]

The model is the vLLM suite's (vllm_model.py: a whole Qwen3-MoE, GPTQ 4-bit G 128 symmetric, one file per decoder
layer), which SGLang builds with no --quantization flag (GPTQ Marlin's MoE method). Every contender row
(contenders.SGLANG_CONTENDERS: SGLang's default loader; --load-format wna16 from the checkpoint and from a
wna16-shard output of the layout's split) runs at every layout (tpN: --tp-size N; epN: --tp-size N --ep-size N) as
one group of fresh rank processes (sglang_rank.py), cold (the folder's files evicted from the page cache first) and
then warm, with the --quantization flag wna16-shard's SGLang verdict names for that split (`flag_of`: e.g.
moe_wna16 where GPTQ Marlin would not hold the rank's groups), the same for every row. Per rank: the load's seconds
once the parameters exist, bytes from storage, memory the load adds (anonymous RSS peak ÷ the parameters' bytes).
SGLang's process_weights_after_loading (its Marlin repack, the same for every loader) is left out. The targets are
targets.SGLANG_TARGETS; the table and verdicts print as the vLLM suite's do.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .contenders import SGLANG_CONTENDERS
from .suite_vllm import GIB, engine_parser, layout, parsed, report, shard, slowest, source_of, start_group
from .targets import SGLANG_TARGETS

RANK_SCRIPT = Path(__file__).with_name("sglang_rank.py")


def flag_of(source: Path, name: str) -> str | None:
    """The --quantization flag SGLang needs to serve layout `name`'s output (wna16-shard's verdict; None: none)."""
    from wna16_loader.layouts.serving import Serve, verdict
    from wna16_loader.layouts.serving_sglang import TESTED_SGLANG
    from wna16_loader.preshard.layouts import output_split
    from wna16_loader.preshard.plan import make_plan

    ranks, ep = layout(name)
    plan = make_plan(source, tp_size=1 if ep else ranks, ep_size=ranks if ep else 1, warn=False)
    said = verdict(TESTED_SGLANG[-1], output_split(plan))
    if said.serve is Serve.NEVER:
        raise SystemExit(f"--layouts {name}: SGLang {TESTED_SGLANG[-1].version} does not serve it: {said.why}")
    return said.flag


def measure(args: argparse.Namespace, source: Path) -> list[dict]:
    """Every row at every layout and state, --reps times."""
    runs = []
    shards = {name: shard(source, args.workdir, name) for name in args.layouts}
    flags = {name: flag_of(source, name) for name in args.layouts}
    for rep in range(args.reps):
        for name in args.layouts:
            ranks, ep = layout(name)
            for row in SGLANG_CONTENDERS:
                folder = source if row.folder == "checkpoint" else shards[name]
                for state in args.states:
                    out = args.workdir / "runs" / f"rep{rep}-{name}-{row.key.replace(' ', '_')}-{state}"
                    spec = {"ranks": ranks, "ep": ep, "folder": str(folder), "load_format": row.load_format,
                            "quantization": flags[name]}
                    found = start_group(RANK_SCRIPT, spec, out, cold=state == "cold")
                    runs.append({"row": row.key, "layout": name, "state": state, "rep": rep, "ranks": found,
                                 "quantization": flags[name]})
                    print(f"rep {rep} {name} {row.key} {state} (--quantization {flags[name]}): slowest rank "
                          f"{slowest(found):.1f} s, "
                          f"{max(m['read_bytes'] for m in found) / GIB:.2f} GiB read", flush=True)
    return runs


def parse(argv: list[str]) -> argparse.Namespace:
    return parsed(engine_parser("sglang", __doc__, ["tp4", "ep4", "tp8", "ep8"]), argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    source = source_of(args)
    report(args, source, measure(args, source), SGLANG_TARGETS)
    return 0
