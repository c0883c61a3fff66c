"""Run SGLang ranks as processes (gloo) and read back what they loaded. See sglang_rank.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

RANK_SCRIPT = Path(__file__).with_name("sglang_rank.py")
TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(tp: int, jobs: list[dict], out: Path, *, ep: bool = False) -> None:
    """Start `tp` SGLang ranks over `jobs` and wait for all of them; a rank that dies fails with its log.
    `ep`: the MoE layers EP `tp`-way, MoE TP 1."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"tp": tp, "ep": ep, "init_method": f"tcp://127.0.0.1:{free_port()}", "out": str(out), "jobs": jobs}
    jobs_file = out / f"jobs-tp{tp}{'-ep' if ep else ''}.json"
    jobs_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(RANK_SCRIPT.parent), *sys.path])}
    logs = [out / f"tp{tp}-rank{r}.log" for r in range(tp)]
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(jobs_file), str(r)], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT) for r, log in enumerate(logs)]
    codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
    for code, log in zip(codes, logs):
        assert code == 0, f"{log.name} exited {code}:\n{log.read_text()[-4000:]}"


def result(out: Path, name: str, rank: int) -> dict[str, torch.Tensor] | dict[str, str]:
    """What rank `rank` loaded for job `name`: its tensors, or SGLang's error {"type", "message", "trace"}."""
    folder = out / name
    if (folder / f"rank{rank}.json").exists():
        return json.loads((folder / f"rank{rank}.json").read_text())
    return load_file(str(folder / f"rank{rank}.safetensors"))
