"""Run an engine's ranks as processes (gloo) and read back what they loaded. See vllm_rank.py (the SGLang tier
runs sglang_rank.py through the same functions)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

RANK_SCRIPT = Path(__file__).with_name("vllm_rank.py")
TIMEOUT_S = 600
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"  # the real quantizers' checkpoints
REAL = sorted(p.name for p in FIXTURES.iterdir() if (p / "checkpoint" / "config.json").is_file())


def fixture_outputs(root: Path, sizes: dict[str, tuple[int, int]]) -> dict[tuple[str, str], tuple[Path, Any]]:
    """(fixture, group) -> the `wna16-shard` output of every real fixture at each group's (TP, EP) of `sizes`,
    under `root`, with the serve question wna16-shard asked when it wrote it (`output_split`)."""
    from wna16_loader.preshard.layouts import output_split
    from wna16_loader.preshard.run import preshard_checkpoint

    out = {}
    for group, (tp, ep) in sizes.items():
        for name in REAL:
            folder = root / f"{name}-{group}"
            summary = preshard_checkpoint(FIXTURES / name / "checkpoint", folder, tp_size=tp, ep_size=ep,
                                          progress=False)
            out[(name, group)] = (folder, output_split(summary.plan))
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(tp: int, jobs: list[dict], out: Path, *, ep: bool = False, script: Path = RANK_SCRIPT,
              settings: dict | None = None) -> None:
    """Start `tp` ranks of `script` (vLLM's by default) over `jobs` and wait for all of them; a rank that dies fails
    with its log. `ep`: the MoE layers EP `tp`-way, MoE TP 1 (vLLM's enable_expert_parallel). `settings`: more
    entries of JOBS.json for the rank script (what it reads: see the script)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"tp": tp, "ep": ep, "init_method": f"tcp://127.0.0.1:{free_port()}", "out": str(out), "jobs": jobs,
            **(settings or {})}
    jobs_file = out / f"jobs-tp{tp}{'-ep' if ep else ''}.json"
    jobs_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), *sys.path])}
    logs = [out / f"tp{tp}-rank{r}.log" for r in range(tp)]
    procs = [subprocess.Popen([sys.executable, str(script), str(jobs_file), str(r)], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT) for r, log in enumerate(logs)]
    codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
    for code, log in zip(codes, logs):
        assert code == 0, f"{log.name} exited {code}:\n{log.read_text()[-4000:]}"


def run_job(job: dict, out: Path, rank: int, load: Callable[[dict], dict[str, torch.Tensor]]) -> None:
    """Run one job in a rank process: OUT/NAME/rank{R}.safetensors holds what `load(job)` returns, or
    OUT/NAME/rank{R}.json the engine's error (a refusal is a result the tests pin)."""
    folder = out / job["name"]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        tensors = load(job)
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()[-3000:]}
        (folder / f"rank{rank}.json").write_text(json.dumps(error))
        return
    if job["kind"] == "serve":  # the methods the engine picked, as JSON
        (folder / f"rank{rank}.json").write_text(json.dumps({"methods": tensors}))
        return
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / f"rank{rank}.safetensors"))


def result(out: Path, name: str, rank: int) -> dict[str, torch.Tensor] | dict[str, str]:
    """What rank `rank` loaded for job `name`: its tensors, or the engine's error {"type", "message", "trace"}."""
    folder = out / name
    if (folder / f"rank{rank}.json").exists():
        return json.loads((folder / f"rank{rank}.json").read_text())
    return load_file(str(folder / f"rank{rank}.safetensors"))
