"""wna16-shard: --help, exit codes 0/1/2 and messages (through subprocess), plus in-process checks."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wna16_loader.cli import main, parse_size
from wna16_loader.preshard import MANIFEST_NAME
from wna16_loader.synthetic import quant_config, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter (module, or the scripts/ wrapper)."""
    entry = [str(ROOT / "scripts" / "shard_checkpoint.py")] if script else ["-m", "wna16_loader.cli"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *entry, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    write_checkpoint(folder, quant_config("awq"), hidden=64, intermediate=64, num_layers=1)
    return folder


def test_help_explains_every_option() -> None:
    run = cli("--help", script=True)
    assert run.returncode == 0
    for option in ("--tp", "--ep", "--placement", "--max-file-size", "--resume", "--verify", "--dry-run",
                   "--quiet", "--layout", "--workers", "examples:", "wna16-shard verify"):
        assert option in run.stdout, option


def test_shard_then_verify_exit_codes(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = cli(str(source), str(out), "--tp", "2", "--ep", "2", "--verify")
    assert run.returncode == 0, run.stderr
    assert "rank-00003-of-00004" in run.stdout and "tensors" in run.stdout
    assert (out / MANIFEST_NAME).is_file()
    victim = out / "rank-00002-of-00004" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    run = cli("verify", str(out))
    assert run.returncode == 1
    assert "rank-00002-of-00004/model.safetensors: sha256 differs" in run.stderr


def test_bad_input_and_bad_usage_exit_2(tmp_path: Path) -> None:
    run = cli(str(tmp_path / "missing"), str(tmp_path / "out"), "--tp", "2")
    assert run.returncode == 2
    assert run.stderr.startswith("wna16-shard: error: ") and "missing" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_bad_usage_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's own exit 2, in-process to save an interpreter start
        main([str(tmp_path)])
    assert exc.value.code == 2 and "OUT" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), str(tmp_path / "out"), "--tp", "two"])
    assert exc.value.code == 2 and "--tp" in capsys.readouterr().err


def test_ep_only_run_needs_no_tp(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([str(source), str(out), "--ep", "2", "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("rank-")) == [
        "rank-00000-of-00002", "rank-00001-of-00002"]
    assert '"tp": 1' in (out / MANIFEST_NAME).read_text()


def test_dry_run_prints_how_the_config_resolved(source: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(source), str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model config: family row: qwen3_moe (wna16_loader/families.py); decoder config: top level" in out
    assert "  routed expert count       = 4  <- num_experts (row qwen3_moe)" in out
    assert "  MoE layers                = [0]  <- rule decoder_sparse_step: decoder_sparse_step=1, " in out


def test_in_process_codes(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([str(source), str(out), "--tp", "4", "--layout", "checkpoint"]) == 2  # I/tp = 16 < G = 32
    assert "--layout checkpoint cannot slice at tp=4" in capsys.readouterr().err and not out.exists()
    assert main([str(source), str(out), "--tp", "2", "--dry-run"]) == 0
    assert "G_eff" in capsys.readouterr().out and not out.exists()
    assert main([str(source), str(out), "--tp", "3"]) == 2
    assert "tp_size=3" in capsys.readouterr().err
    assert main([str(source), str(out), "--tp", "2", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert main([str(source), str(out), "--tp", "1"]) == 2
    assert "tp: written 2, requested 1" in capsys.readouterr().err
    assert main(["verify", str(out), "--source", str(source)]) == 0
    (out / "common" / "model.safetensors").unlink()
    assert main(["verify", str(out)]) == 1
    assert "missing" in capsys.readouterr().err


def test_parse_size() -> None:
    assert parse_size("4GB") == 4 * 2**30 and parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_checkpoint_layout_with_workers(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([str(source), str(out), "--tp", "2", "--ep", "2", "--layout", "checkpoint", "--workers", "2",
                 "--quiet", "--verify"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["verify", str(out), "--source", str(source)]) == 0
    assert main([str(source), str(tmp_path / "o2"), "--tp", "2", "--workers", "0"]) == 2
    assert "workers=0: must be at least 1" in capsys.readouterr().err
