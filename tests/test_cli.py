"""wna16-shard: --help, exit codes 0/1/2 and messages (through subprocess), plus in-process checks."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wna16_loader import __version__
from wna16_loader.cli import main, parse_size
from wna16_loader.formats import FORMATS
from wna16_loader.preshard import MANIFEST_NAME
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

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
    for option in ("--tp", "--ep", "--placement", "--max-file-size", "--resume", "--verify", "--dry-run", "--plan",
                   "--quiet", "--layout", "--workers", "--no-mtp", "examples:", "wna16-shard verify"):
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
    assert one_error_line(run) == (f"wna16-shard: error: {tmp_path / 'missing'}: no such folder: {tmp_path} has no "
                                   f"'missing'. Pass an existing checkpoint folder (config.json and *.safetensors), "
                                   f"or a Hugging Face repo id such as 'org/name'.")  # no huggingface_hub text


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
    assert "model config: family row: qwen3_moe (wna16_loader/models/families.py); decoder config: top level" in out
    assert "  routed expert count       = 4  <- num_experts (row qwen3_moe)" in out
    assert "  MoE layers                = [0]  <- rule decoder_sparse_step: decoder_sparse_step=1, " in out


def test_in_process_codes(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([str(source), str(out), "--tp", "4", "--layout", "checkpoint"]) == 2  # I/tp = 16 < G = 32
    assert "--layout checkpoint cannot slice at tp=4" in capsys.readouterr().err and not out.exists()
    assert main([str(source), str(out), "--tp", "2", "--dry-run"]) == 0
    assert "G_eff" in capsys.readouterr().out and not out.exists()
    assert main([str(source), str(out), "--tp", "1", "--ep", "8"]) == 2  # 4 experts
    assert "ep_size=8 is larger than the expert count 4" in capsys.readouterr().err and not out.exists()
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


def test_plan_view_without_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma-4 shape (I = 704, G = 128; H = 64, 2 experts): TP 8 pads to I' = 768, rank 7 holds 64 padding columns.
    Bytes at TP 8, by hand: w13_qweight 2*192*32 + w2_qweight 2*64*48 + w13_scales 2*192*2*2 + w2_scales 2*64*3*2
    + w13_qzeros 2*96*2 + w2_qzeros 2*32*3 + expert_ids 8 = 21320; padding of rank 7 per expert: w13 rows
    2*64*(32 + 2*2) + zero rows 64*2, w2 columns 64*32 + 2 groups of scales 64*2*2 and zeros 32*2 -> 2 * 7104."""
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", group_size=128), hidden=64, intermediate=704, num_experts=2)
    assert main([str(src), "--plan", "--tp", "3"]) == 0
    out = capsys.readouterr().out
    rows = {}  # tp -> (marked as requested, fields)
    for line in out.splitlines():
        fields = line.replace("*", " ").split()
        if fields and fields[0].isdigit():
            rows[int(fields[0])] = (line.startswith("*"), fields)
    assert sorted(rows) == [1, 2, 3, 4, 8, 16]
    assert rows[8] == (False, ["8", "1", "768", "96", "32", "21320", "14208", "0", "x7,", "64"])
    assert rows[3] == (True, ["3", "1", "720", "240", "16", "60488", "4032", "0", "x2,", "16"])
    assert rows[4][1][2:8] == ["704", "176", "16", "44360", "0", "0"]  # unpadded: the old rule
    assert rows[16][1][-3:] == ["x14,", "16,", "48"]
    assert main([str(src), "--dry-run"]) == 0 and "padding columns per TP rank" in capsys.readouterr().out
    assert main([str(src), "--plan", "--ep", "4"]) == 0
    assert "impossible: ep_size=4 is larger than the expert count 2" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exc:
        main([str(src), "--tp", "2"])
    assert exc.value.code == 2 and "OUT is required" in capsys.readouterr().err


# One test per row of the first-hour table (issue 15): exit code, exactly one line on stderr, no traceback.

def one_error_line(run: subprocess.CompletedProcess, code: int = 2) -> str:
    """The single stderr line of a failed run (asserting the exit code and that nothing else was printed)."""
    assert run.returncode == code, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flag", ["--tp", "--ep"])
def test_zero_tp_or_ep_is_bad_usage(source: Path, tmp_path: Path, flag: str) -> None:
    args = ["--tp", "2", "--ep", "1"]
    args[args.index(flag) + 1] = "0"
    line = one_error_line(cli(str(source), str(tmp_path / "out"), *args))
    assert line == f"wna16-shard: error: {flag} must be >= 1, got 0; e.g. {flag} 2."
    assert not (tmp_path / "out").exists()


def test_source_that_is_a_file(source: Path, tmp_path: Path) -> None:
    line = one_error_line(cli(str(source / "config.json"), str(tmp_path / "out"), "--tp", "2"))
    assert line == (f"wna16-shard: error: {source / 'config.json'}: a file, not a folder; pass the checkpoint "
                    f"folder holding config.json and the *.safetensors files (here {source}).")


def test_verify_something_that_is_no_output(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    assert one_error_line(cli("verify", str(missing))) == (f"wna16-shard: error: {missing}: no such folder; pass "
                                                          f"the OUT folder of a wna16-shard run.")
    line = one_error_line(cli("verify", str(tmp_path)))
    assert line.endswith(f"{tmp_path}: not a wna16-shard output (no wna16_manifest.json); pass the OUT folder of a "
                         f"wna16-shard run.")


def test_verify_with_the_wrong_source_says_so_first(source: Path, tmp_path: Path) -> None:
    out, other = tmp_path / "out", tmp_path / "other"
    assert main([str(source), str(out), "--tp", "2", "--quiet"]) == 0
    write_checkpoint(other, quant_config("awq"), hidden=64, intermediate=64, num_layers=1, seed=7)
    line = one_error_line(cli("verify", str(out), "--source", str(other)))  # same shapes, other values
    assert line == (f"wna16-shard: error: --source {other} is not the checkpoint {out} was written from: tensor "
                    f"model.embed_tokens.weight differs from its copy in common/ (and 2 more). Pass the original "
                    f"source folder, or re-shard.")
    write_checkpoint(other, quant_config("awq"), hidden=64, intermediate=64, num_layers=1, num_experts=8)
    line = one_error_line(cli("verify", str(out), "--source", str(other)))  # another size: caught by the fingerprint
    assert line.startswith(f"wna16-shard: error: --source {other} is not the checkpoint {out} was written from: "
                           f"source file model.safetensors: written ")
    assert line.endswith("Pass the original source folder, or re-shard.")


def test_second_identical_run_has_nothing_to_do(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main([str(source), str(out), "--tp", "2", "--quiet"]) == 0
    before = mtimes(out)
    run = cli(str(source), str(out), "--tp", "2")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.startswith(f"wna16-shard: {out}: already complete: nothing to do")
    assert mtimes(out) == before  # not one file rewritten (manifest and plan included)
    forced = cli(str(source), str(out), "--tp", "2", "--force", "--quiet")
    assert forced.returncode == 0 and forced.stdout == "" and forced.stderr == ""
    after = mtimes(out)
    assert set(after) == set(before) and all(after[p] > before[p] for p in before if p.endswith(".safetensors"))


def test_reduced_group_size_is_warned_and_shown(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", group_size=32), hidden=64, intermediate=128, num_layers=1)
    run = cli(str(src), str(tmp_path / "out"), "--tp", "8", "--quiet")
    line = one_error_line(run, code=0)
    assert line == ("wna16-shard: warning: tp=8: group size 32 becomes G_eff 16 in 1 layer(s) "
                    "(model.layers.0.mlp.experts): I/tp = 128/8 is not a multiple of 32, so each scale and zero "
                    "point is repeated; kernels that accept only some group sizes may refuse it. TP sizes that keep "
                    "group size 32: [1, 2, 4].")


def test_summary_and_verify_say_what_they_did(source: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([str(source), str(out), "--tp", "2", "--verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "format: awq 4-bit, group 32, asymmetric; layout fused"
    assert lines[1].split() == ["folder", "files", "tensors", "size", "group", "kept", "seconds"]
    assert lines[3].split()[:6] == ["rank-00000-of-00002", "1", "7", "13.9", "KiB", "32"]
    assert lines[5].split()[:5] == ["total", "3", "19", "40.9", "KiB"]
    assert lines[6].startswith(f"verified: {out}: ok: 3 files (") and lines[6].endswith(
        f"19 tensors) match the manifest's sha256; 4 experts in 1 layer(s) equal their tensors converted afresh from "
        f"{source}, 5 common tensors byte-identical")
    assert lines[7] == f"load: load_experts({str(out)!r}, ParallelConfig.from_manifest(read_manifest({str(out)!r}), rank=RANK))"
    assert main(["verify", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "ok: 3 files (" in lines[0] and "KiB on disk, 19 tensors) match" in lines[0]
    assert lines[1].startswith(f"next: wna16-shard verify {out} --source SRC")
    assert main(["verify", str(out), "--source", str(source), "--reassemble"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(
        f"4 experts in 1 layer(s) equal their tensors converted afresh from {source} and reassemble over TP exactly, "
        f"5 common tensors byte-identical")
    assert main(["verify", str(out), "--reassemble"]) == 2
    assert capsys.readouterr().err == ("wna16-shard: error: --reassemble compares the output with its source; pass "
                                       "--source SRC too.\n")


def test_no_quantization_config_names_folder_and_formats(source: Path, tmp_path: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (source / "config.json").write_text(json.dumps(config))
    line = one_error_line(cli(str(source), str(tmp_path / "out"), "--tp", "2"))
    accepted = "; ".join(f"{d.name} (quant_method {' or '.join(repr(m) for m in d.quant_methods)})" for d in FORMATS)
    assert line == (f"wna16-shard: error: {source}: config.json has no quantization_config, and the folder has no "
                    f"quantize_config.json or quant_config.json; this is not a WNA16-quantized checkpoint. Accepted "
                    f"formats: {accepted}.")
    assert "compressed-tensors (quant_method 'compressed-tensors')" in line


def test_version_usage_and_closed_pipe(source: Path, tmp_path: Path) -> None:
    run = cli("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"wna16-shard (wna16_loader) {__version__}"
    run = cli()
    assert run.returncode == 2 and "wna16-shard verify OUT [--source SRC]" in run.stderr.splitlines()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "wna16_loader.cli", str(source), str(tmp_path / "out"), "--tp",
                             "2", "--dry-run"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` that has already exited: every write gets EPIPE
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and stderr == ""


def test_no_mtp_flag_dry_run_and_bf16_mtp_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run says where the MTP layers go and where their count came from; official-Qwen3.5-style bf16 MTP
    experts shard (float fused layout) by default and are copied into common/ with --no-mtp, both verified."""
    import torch
    from sources import mtp_checkpoint
    mtp_checkpoint(tmp_path / "src", "qwen3_5_moe-mtp", mtp_dtype=torch.bfloat16)
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    assert main([src, out, "--tp", "2", "--dry-run", "--no-mtp"]) == 0
    text = capsys.readouterr().out
    assert "MTP layers: mtp.layers.0.mlp.experts: copied unchanged into common/ (--no-mtp)" in text
    assert "MTP layers                = 1: mtp.layers.{0..0}  <- mtp_num_hidden_layers=1 (row qwen3_5_moe)" in text
    assert main([src, out, "--tp", "2", "--no-mtp", "--verify", "--quiet"]) == 0
    assert json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["mtp"]["sharded"] is False
    assert main([src, str(tmp_path / "sharded"), "--tp", "2", "--verify", "--quiet"]) == 0
    assert json.loads((tmp_path / "sharded" / MANIFEST_NAME).read_text())["mtp"]["sharded"] is True


def test_padding_is_reported_per_rank_and_empty_ranks_warned(tmp_path: Path) -> None:
    """The demo's I = 768: --tp 5 pads to I' = 800 (TP rank 4: 32 padding columns of 160); --tp 32 pads to 1024 and
    TP ranks 24-31 hold nothing but padding, which the run warns about."""
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", group_size=128), hidden=64, intermediate=768, num_experts=2,
                     num_layers=2)
    run = cli(str(src), str(tmp_path / "tp5"), "--tp", "5")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert ("padding: I = 768 is padded to I' = 800 (160 columns per TP rank) in 2 layer(s); TP rank 4: 32 of 160 "
            "columns") in run.stdout.splitlines()
    assert "hold only padding" not in run.stderr
    run = cli(str(src), str(tmp_path / "tp32"), "--tp", "32", "--quiet")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    warnings = [line for line in run.stderr.splitlines() if "padded" in line]
    assert warnings == ["wna16-shard: warning: tp=32: I = 768 is padded to I' = 1024 (32 columns per TP rank) in 2 "
                        "layer(s): TP ranks 24–31 hold only padding (their experts are all zeros: memory and compute "
                        "spent on nothing). TP sizes that need no padding: [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]."]
    summary = cli(str(src), str(tmp_path / "tp32b"), "--tp", "32").stdout.splitlines()
    assert ("padding: I = 768 is padded to I' = 1024 (32 columns per TP rank) in 2 layer(s); TP ranks 24–31: 32 of 32 "
            "columns (only padding)") in summary
