"""The demo (./scripts/demo): exact reassembly on the CPU or a (stand-in) GPU, no temporary folder left behind,
--keep, --format choices."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from wna16_loader.testing import demo
from wna16_loader.testing.demo import main
from wna16_loader.testing.standin import StandIn
from wna16_loader.testing.synthetic import write_checkpoint


def test_demo_reassembles_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--group-size", "64"]) == 0
    assert "reassembly: 48/48 expert projections identical" in capsys.readouterr().out


def test_demo_on_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with StandIn(count=2):
        assert main(["--out", str(tmp_path), "--device", "cuda:1", "--act-order", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "loaded to cuda:1" in out and "reassembly: 48/48 expert projections identical" in out


def test_demo_refuses_a_gpu_from_a_cpu_only_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--out", str(tmp_path), "--device", "cuda:0"]) == 2
    assert capsys.readouterr().err.startswith("wna16-demo: error: device 'cuda:0': this PyTorch")
    assert not any(tmp_path.iterdir())  # refused before writing anything


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_demo_on_the_last_real_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    device = f"cuda:{torch.cuda.device_count() - 1}"
    assert main(["--out", str(tmp_path), "--device", device, "--act-order"]) == 0
    assert "reassembly: 48/48 expert projections identical" in capsys.readouterr().out


@pytest.fixture()
def small(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Demo checkpoints at test size, and the temporary directory moved to `tmp_path/tmp`."""
    monkeypatch.setattr(demo, "write_checkpoint",
                        lambda folder, qc, **kw: write_checkpoint(folder, qc, **{**kw, "hidden": 64,
                                                                                  "intermediate": 128}))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


def test_demo_leaves_no_temporary_folder(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--group-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "reassembly: 48/48 expert projections identical" in out
    assert out.splitlines()[0].startswith("checkpoint: a temporary folder (removed at the end; --keep keeps it) (")
    assert str(small) not in out  # no path that is gone when the demo ends
    assert out.splitlines()[1].split() == ["rank", "tp", "ep", "experts", "w13_qweight", "w2_scales", "MiB", "read"]
    assert out.splitlines()[2].split()[:4] == ["0", "0", "0", "0-7"]
    assert list(small.iterdir()) == []


def test_keep_prints_the_folder_and_the_next_command(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--group-size", "32", "--tp", "1", "--ep", "4", "--keep", "--format", "awq"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (kept,) = small.iterdir()
    assert kept.name.startswith("wna16-demo-") and (kept / "config.json").is_file()
    assert lines[0].startswith(f"checkpoint: {kept} (awq, 4-bit")
    assert lines[-2:] == [f"kept: {kept}", f"next: {demo.shard_command()} {kept} {kept}-tp1 --tp 1 --ep 4"]


def test_the_printed_next_command_runs_as_printed(tmp_path: Path) -> None:
    """`./scripts/demo --keep` prints `next: ...`: that line, run by a shell as it is (PATH without the venv's
    bin/), writes the output."""
    import os
    import shlex
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if Path(p).resolve() != Path(sys.executable).parent.resolve())
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-m", "wna16_loader.testing.demo", "--out", str(tmp_path / "ckpt"),
                          "--tp", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    line = run.stdout.splitlines()[-1]
    script = Path(sys.executable).parent / "wna16-shard"  # pip install -e . put it there; else `python -m`
    words = shlex.split(line)
    expected = ["wna16-shard"] if script.is_file() else [sys.executable, "-m", "wna16_loader.cli"]
    assert line.startswith("next: ") and words[1].endswith(expected[0]), line
    assert words[2:len(expected) + 1] == expected[1:], line
    shard = subprocess.run(line.removeprefix("next: ") + " --quiet", shell=True, cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert shard.returncode == 0, shard.stderr
    assert (tmp_path / "ckpt-tp2" / "wna16_manifest.json").is_file()


def test_unknown_format_is_refused_before_anything_is_written(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--format", "foo"])
    assert exc.value.code == 2
    assert "invalid choice: 'foo' (choose from 'awq', 'gptq', 'compressed-tensors', 'auto-round')" in capsys.readouterr().err
    assert list(small.iterdir()) == []


def test_bad_combination_is_one_line(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--format", "auto-round", "--act-order"]) == 2
    assert capsys.readouterr().err == "wna16-demo: error: AutoRound exports have no act-order variant.\n"
    assert list(small.iterdir()) == []


def test_expert_ids_and_table() -> None:
    assert demo.expert_ids((0, 1, 2, 3)) == "0-3" and demo.expert_ids((1, 3, 5)) == "1,3,5"
    assert demo.table(("a", "num"), [("xyz", "1.5"), ("b", "10.25")]).splitlines() == ["a     num", "xyz   1.5",
                                                                                       "b   10.25"]


def test_the_readme_says_when_the_demo_prints_next(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's demo paragraph promises `next:` only with --out or --keep, as the demo does."""
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert ("with `--out DIR` or `--keep`, which keep the checkpoint, the demo ends with its `next:` command spelled "
            "that way; without them it removes its temporary checkpoint and prints no `next:`") in readme
    assert demo.main(["--group-size", "32"]) == 0
    assert not any(line.startswith("next:") for line in capsys.readouterr().out.splitlines())
    assert demo.main(["--group-size", "32", "--out", str(small / "kept")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("next: ")
