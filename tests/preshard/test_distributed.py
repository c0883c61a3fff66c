"""Rank-parallel wna16-shard over torch.distributed (gloo, 2 and 4 CPU processes): the output is byte-identical
to a single-process run, for both layouts, through the CLI's code path and read as a node (a rank folder per
process); errors reach every process."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from processes import evicted, start_ranks

from wna16_loader import cli
from wna16_loader.errors import ShardingError
from wna16_loader.parallel.config import ShardJob
from wna16_loader.preshard import preshard_checkpoint, preshard_distributed
from wna16_loader.preshard.distributed import owner
from wna16_loader.storage.readahead import ALIGN, ReadOptions
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


def file_hashes(out: Path) -> dict[str, str]:
    """sha256 of every file of a pre-shard output (manifest and copied files included)."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def worker(process: int, processes: int, init_file: str, src: str, outs: dict[str, str]) -> None:
    """One process: the library call for each layout, then the CLI entry point (spawned)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=process, world_size=processes,
                            timeout=timedelta(seconds=60))
    try:
        job = ShardJob.from_environment()
        assert job == ShardJob(process, processes)
        for layout in ("fused", "checkpoint"):
            summary = preshard_distributed(src, outs[layout], job, tp_size=2, ep_size=2, layout=layout)
            if process == 0:
                assert len(summary.ranks) == 5  # common/ and 4 ranks, gathered from both processes
        assert cli.main([src, outs["cli"], "--tp", "2", "--ep", "2", "--distributed", "--quiet"]) == 0
        try:
            preshard_distributed(src, outs["cli"], job, tp_size=4, ep_size=1)  # other parameters: refused
        except Exception as exc:  # noqa: BLE001 - the same refusal must reach both processes
            Path(outs["cli"] + f".error{process}").write_text(str(exc))
    finally:
        dist.destroy_process_group()


def test_two_processes_write_the_single_process_output(tmp_path):
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", bits=4, group_size=32, symmetric=False), num_experts=4, hidden=128,
                     intermediate=128, num_layers=2, files=2, references=False)
    single = {layout: tmp_path / f"single-{layout}" for layout in ("fused", "checkpoint")}
    for layout, out in single.items():
        preshard_checkpoint(src, out, tp_size=2, ep_size=2, layout=layout, progress=False)
    outs = {"fused": str(tmp_path / "dist-fused"), "checkpoint": str(tmp_path / "dist-checkpoint"),
            "cli": str(tmp_path / "dist-cli")}
    mp.spawn(worker, args=(2, str(tmp_path / "init"), str(src), outs), nprocs=2, join=True)
    for layout, out in single.items():
        assert file_hashes(Path(outs[layout])) == file_hashes(out) and len(file_hashes(out)) > 6
    assert file_hashes(Path(outs["cli"])) == file_hashes(single["fused"])
    errors = [Path(outs["cli"] + f".error{p}").read_text() for p in (0, 1)]
    assert errors[0] == errors[1] and "was written with other parameters" in errors[0]


def test_owner_deals_ranks_round_robin():
    assert [owner(g, 3) for g in (None, 0, 1, 2, 3, 4)] == [0, 0, 1, 2, 0, 1]


def test_shard_job_checks_its_index():
    with pytest.raises(ShardingError, match=r"process 2 outside 0\.\.1"):
        ShardJob(2, 2)
    assert ShardJob.from_environment() == ShardJob(0, 1)


def test_reduced_group_warning_once_per_run_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m wna16_loader.cli SRC OUT --tp 8` on G 32, I 128: one warning, not one per
    process; the output is the single-process one."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", group_size=32), hidden=64, intermediate=128, num_layers=1)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "wna16_loader.cli", str(src), str(tmp_path / "out"), "--tp", "8", "--quiet"],
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if "wna16-shard: warning:" in line]
    assert len(warnings) == 1 and "tp=8: group size 32 becomes G_eff 16" in warnings[0], run.stderr
    preshard_checkpoint(src, tmp_path / "single", tp_size=8, progress=False)
    assert file_hashes(tmp_path / "out") == file_hashes(tmp_path / "single")


def node_worker(process: int, processes: int, init_file: str, src: str, out: str) -> None:
    """One of 4 processes writing a TP 4 output, one rank folder each: they read as a node (spawned)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=process, world_size=processes,
                            timeout=timedelta(seconds=120))
    try:
        reads = ReadOptions(min_bytes=0, min_tensor_bytes=0, request_bytes=4 * ALIGN)
        summary = preshard_distributed(src, out, ShardJob.from_environment(), tp_size=4, reads=reads)
        if process == 0:
            windows = {rank.name: rank.window_bytes for rank in summary.ranks}
            Path(out + ".windows.json").write_text(json.dumps(windows))
    finally:
        dist.destroy_process_group()


def test_one_rank_folder_per_process_reads_as_a_node(tmp_path):
    """A fresh fused run with as many processes as output ranks: each rank folder's layers are read with the
    node's shared window (reported per folder), and the output is byte-identical to a single-process run."""
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", bits=4, group_size=32, symmetric=False), num_experts=4, hidden=256,
                     intermediate=512, num_layers=3, files=2, references=False)
    single = tmp_path / "single"
    preshard_checkpoint(src, single, tp_size=4, progress=False)
    out = str(tmp_path / "dist")
    cold = not evicted(sorted(src.glob("*.safetensors")))  # (a file system that keeps the pages: a warm node)
    start_ranks(node_worker, (4, str(tmp_path / "init"), str(src), out), 4)
    assert file_hashes(Path(out)) == file_hashes(single)
    windows = json.loads(Path(out + ".windows.json").read_text())
    assert windows.pop("common") == 0 and len(windows) == 4, windows
    assert all((nbytes > 0) == cold for nbytes in windows.values()), windows  # cold: read into the node's window
