"""wna16-shard: --help, exit codes 0/1/2 and messages, run as the console script runs `main` (in this
interpreter; in a fresh one where the process itself is what is tested: the wrapper, a closed pipe, signals)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import sigint_default

from wna16_loader import ParallelConfig, __version__, load_experts
from wna16_loader.cli import interrupted_line, main, parse_size
from wna16_loader.errors import CheckpointError
from wna16_loader.formats import FORMATS
from wna16_loader.preshard import MANIFEST_NAME
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, process: bool = False, script: bool = False) -> subprocess.CompletedProcess:
    """Run the CLI as the console script does (`main`, its exit code, stdout and stderr): in this interpreter
    with both streams captured, or with `process` (or `script`: the scripts/ wrapper) in a fresh one."""
    if process or script:
        entry = [str(ROOT / "scripts" / "shard_checkpoint.py")] if script else ["-m", "wna16_loader.cli"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, *entry, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's --help, --version and usage errors
            code = exc.code
    return subprocess.CompletedProcess(["wna16-shard", *args], code, out.getvalue(), err.getvalue())


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
    rows, methods = {}, {}  # tp -> (marked as requested, fields); tp -> what vLLM and SGLang say of it
    for line in out.splitlines():
        body, _, taken = line.rpartition("  ")
        fields = body.replace("*", " ").split()
        if fields and fields[0].isdigit():
            rows[int(fields[0])], methods[int(fields[0])] = (line.startswith("*"), fields), taken
    assert sorted(rows) == [1, 2, 3, 4, 8, 16]
    assert rows[8] == (False, ["8", "1", "768", "96", "32", "21320", "14208", "2", "0", "x7,", "64"])
    assert rows[3] == (True, ["3", "1", "720", "240", "16", "60488", "4032", "2", "0", "x2,", "16"])
    assert rows[4][1][2:9] == ["704", "176", "16", "44360", "0", "2", "0"]  # unpadded: the old rule
    assert rows[16][1][-3:] == ["x14,", "16,", "48"]
    assert set(methods.values()) == {"no | no"}  # asymmetric GPTQ: refused by vLLM's and SGLang's configs
    assert ('  SGLang 0.5.23 at TP 3: no: with no flag, SGLang\'s gptq_marlin config refuses it: "Unknown '
            'quantization method: gptq"; with --quantization moe_wna16, SGLang stops at 3 ranks: "assert '
            'intermediate_size % self.moe_tp_size == 0"') in out.splitlines()
    assert ("  vLLM 0.32.0, 0.34.0 at TP 8: no: with no flag, vLLM's gptq config refuses it: \"Unsupported "
            "quantization config: bits=4, sym=False\"; with --quantization moe_wna16, vLLM's moe_wna16 config refuses "
            "it for the model's linear layers: \"Unsupported quantization config: bits=4, sym=False\"") in out
    assert main([str(src), "--dry-run"]) == 0 and "padding columns per TP rank" in capsys.readouterr().out
    assert main([str(src), "--plan", "--ep", "4"]) == 0
    assert "impossible: ep_size=4 is larger than the expert count 2" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exc:
        main([str(src), "--tp", "2"])
    assert exc.value.code == 2 and "OUT is required" in capsys.readouterr().err


# What a new user tries in the first hour, one test each: exit code, exactly one line on stderr, no traceback.

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
                    f"source folder {source}, or re-shard.")
    write_checkpoint(other, quant_config("awq"), hidden=64, intermediate=64, num_layers=1, num_experts=8)
    line = one_error_line(cli("verify", str(out), "--source", str(other)))  # another size: caught by the fingerprint
    assert line.startswith(f"wna16-shard: error: --source {other} is not the checkpoint {out} was written from: "
                           f"source file model.safetensors: written ")
    assert line.endswith(f"Pass the original source folder {source}, or re-shard.")


def test_second_identical_run_has_nothing_to_do(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main([str(source), str(out), "--tp", "2", "--quiet"]) == 0
    before = mtimes(out)
    run = cli(str(source), str(out), "--tp", "2")
    assert run.returncode == 0 and run.stderr == "", run.stderr  # (a check under 2 s prints no progress line)
    assert run.stdout.startswith(f"wna16-shard: {out}: already complete: nothing to do (the manifest matches SRC and "
                                 f"the parameters; every file has the size and sha256 it records).")
    assert mtimes(out) == before  # not one file rewritten (manifest and plan included)
    forced = cli(str(source), str(out), "--tp", "2", "--force", "--quiet")
    assert forced.returncode == 0 and forced.stdout == "" and forced.stderr == ""
    after = mtimes(out)
    assert set(after) == set(before) and all(after[p] > before[p] for p in before if p.endswith(".safetensors"))


def test_reduced_group_size_is_warned_and_shown(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", group_size=32), hidden=64, intermediate=128, num_layers=1)
    run = cli(str(src), str(tmp_path / "out"), "--tp", "8", "--quiet")
    assert run.returncode == 0 and run.stdout == "" and "Traceback" not in run.stderr
    line, vllm, sglang = run.stderr.splitlines()  # then: no vLLM, no SGLang serves it (--quiet included)
    assert vllm.startswith(f"wna16-shard: warning: {tmp_path / 'out'}: no tested vLLM serves this output")
    assert sglang == (f"wna16-shard: warning: {tmp_path / 'out'}: no tested SGLang serves this output with "
                      f"--load-format wna16: with no flag, SGLang's gptq_marlin config refuses it: \"Unknown "
                      f"quantization method: gptq\"; with --quantization moe_wna16, SGLang's moe_wna16 config refuses "
                      f"it for the model's linear layers: \"The non-Marlin GPTQ CUDA kernel has been removed\"; no TP "
                      f"or EP size up to 16 would serve it")  # asymmetric GPTQ
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
    assert lines[1].split() == ["folder", "files", "tensors", "size", "group", "kept", "seconds", "experts"]
    assert lines[3].split()[:6] == ["rank-00000-of-00002", "1", "7", "13.9", "KiB", "32"]
    assert lines[5].split()[:5] == ["total", "3", "19", "40.9", "KiB"]
    assert lines[6] == (f"vLLM 0.32.0, 0.34.0 at TP 2: yes: vllm serve {out} --load-format wna16 -tp 2 (MoE method "
                        f"moe_wna16, no --quantization flag)")  # H 64: not a Marlin shape, auto_awq falls back
    assert lines[7] == (f"SGLang 0.5.23 at TP 2: yes: sglang serve --model-path {out} --load-format wna16 --tp-size 2 "
                        f"(MoE method moe_wna16, no --quantization flag)")
    lines = lines[:7] + lines[8:]
    assert lines[7].startswith(f"verified: {out}: ok: 3 files (") and lines[7].endswith(
        f"19 tensors) match the manifest's sha256; 4 experts in 1 layer(s) equal their tensors converted afresh from "
        f"{source}, 5 common tensors byte-identical")
    assert lines[8] == f"load: load_experts({str(out)!r}, ParallelConfig.from_manifest({str(out)!r}, rank=RANK))"
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
    run = cli("--version", process=True)
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


# More of what a new user tries on the first day (one test each; CLI cases as subprocesses).

INTERRUPT_AT = {  # where the Ctrl-C lands: a hook that sends this process SIGINT there, then runs the console script
    "after the manifest": "import wna16_loader.preshard.run as m; real = m.write_json_atomic; "
                          "m.write_json_atomic = lambda *a: (real(*a), os.kill(os.getpid(), signal.SIGINT))",
    "after the run": "import wna16_loader.preshard as p; real = p.preshard_checkpoint; "
                     "p.preshard_checkpoint = lambda *a, **k: (real(*a, **k), os.kill(os.getpid(), signal.SIGINT))[0]",
    "as main returns": "real = c.main; c.main = lambda: (real(), os.kill(os.getpid(), signal.SIGINT))[0]",
}


@pytest.mark.parametrize("point", list(INTERRUPT_AT))
def test_ctrl_c_after_the_last_file_is_one_line_and_exit_130(source: Path, tmp_path: Path, point: str) -> None:
    """A Ctrl-C just after the last file is written (and later, up to the process's exit) gives one line
    and exit 130, never a death by the signal; the output is complete or finished by --resume."""
    out = tmp_path / "out"
    code = f"import os, signal, sys; import wna16_loader.cli as c; {INTERRUPT_AT[point]}; c.run()"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code, str(source), str(out), "--tp", "2", "--quiet"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120,
                         preexec_fn=sigint_default)
    line = one_error_line(run, code=130)
    if point == "after the manifest":
        assert line == "wna16-shard: interrupted after 3 of 3 files; re-run with --resume"
    else:
        assert line == ("wna16-shard: interrupted; re-run the same command (with --resume when it had started "
                        "writing)")
    again = cli(str(source), str(out), "--tp", "2", "--resume")
    assert again.returncode == 0 and again.stderr == "", again.stderr
    assert again.stdout.startswith(f"wna16-shard: {out}: already complete: nothing to do")


def test_the_interrupted_line_of_a_verify_says_nothing_changed_wherever_the_ctrl_c_lands() -> None:
    """Main's own Ctrl-C line and run()'s (a Ctrl-C as main returns) are one answer: verify only reads."""
    assert interrupted_line(["verify", "out"]) == ("wna16-shard verify: interrupted (it only reads: nothing "
                                                   "changed); re-run it")
    assert interrupted_line(["src", "out", "--tp", "2"]) == ("wna16-shard: interrupted; re-run the same command "
                                                             "(with --resume when it had started writing)")


MIXED = ROOT / "tests" / "fixtures" / "gptq_dynamic_mixed" / "checkpoint"  # layers 4-bit g32, 8-bit g64, float16


def edited_mixed(tmp_path: Path, edit) -> Path:
    """A copy of the GPTQModel mixed fixture whose quantization_config `edit` changed in place."""
    import shutil
    folder = tmp_path / "edited"
    shutil.copytree(MIXED, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_the_summary_says_whether_vllm_serves_the_output(tmp_path: Path) -> None:
    """The summary's serve line (layouts.serving): the AWQ fixture at --tp 2 serves with no flag (auto_awq); the
    asymmetric GPTQ fixture at --tp 3 cannot be served (its 2 attention heads at 3 ranks), and says why."""
    awq = ROOT / "tests" / "fixtures" / "awq_w4_g32" / "checkpoint"
    served = cli(str(awq), str(tmp_path / "awq"), "--tp", "2")
    assert served.returncode == 0 and "warning" not in served.stderr, served.stderr
    assert [line for line in served.stdout.splitlines() if line.startswith("vLLM ")] == [
        f"vLLM 0.32.0, 0.34.0 at TP 2: yes: vllm serve {tmp_path / 'awq'} --load-format wna16 -tp 2 (MoE method "
        f"auto_awq, no --quantization flag)"]
    edge = ROOT / "tests" / "fixtures" / "gptq_w4_g32_zero_edge" / "checkpoint"
    padded = cli(str(edge), str(tmp_path / "tp3"), "--tp", "3")
    assert padded.returncode == 0, padded.stderr
    assert [line for line in padded.stdout.splitlines() if line.startswith(("vLLM ", "SGLang "))] == [
        'vLLM 0.32.0, 0.34.0 at TP 3: no: vLLM stops at 3 ranks: "Total number of attention heads (2) must be '
        'divisible by tensor parallel size (3)" (with no flag and with --quantization moe_wna16)',
        'SGLang 0.5.23 at TP 3: no: with no flag, SGLang\'s gptq_marlin config refuses it: "Unknown quantization '
        'method: gptq"; with --quantization moe_wna16, SGLang stops at 3 ranks: "assert self.total_num_heads % '
        'attn_tp_size == 0"']


FIXTURES = ROOT / "tests" / "fixtures"
AWQ = FIXTURES / "awq_w4_g32" / "checkpoint"  # 2 attention heads, 4 experts, I 128, G 32


@pytest.mark.parametrize(("args", "line"), [
    (["--tp", "2", "--ep", "2", "--for", "vllm"],
     "vLLM 0.32.0, 0.34.0 will not serve --tp 2 --ep 2 with --load-format wna16: vLLM runs MoE layers at TP or at EP, "
     "not both (TP 2 x EP 2; with --enable-expert-parallel its MoE TP is 1): --ep 2 would serve (vllm serve {out} "
     "--load-format wna16 -tp 2 --enable-expert-parallel); nothing was written."),
    (["--tp", "4", "--for", "sglang==0.5.23"],
     'SGLang 0.5.23 will not serve --tp 4 with --load-format wna16: SGLang stops at 4 ranks: "assert '
     'self.total_num_heads % attn_tp_size == 0" (with no flag and with --quantization moe_wna16): --tp 2 would '
     'serve (sglang serve --model-path {out} --load-format wna16 --quantization moe_wna16 --tp-size 2); nothing '
     'was written.'),  # 2 attention heads; at 2 ranks AWQ Marlin's attention refuses, moe_wna16 serves
    (["--tp", "2", "--for", "vllm"], None),
])
def test_for_an_engine_refuses_what_it_will_not_serve_before_writing(tmp_path: Path, args: list[str],
                                                                     line: str | None) -> None:
    """`--for ENGINE`: a split the engine refuses is one line naming why and the split that would serve, exit 2,
    nothing written (not even OUT); a split it serves is written, with no warning."""
    out = tmp_path / "out"
    run = cli(str(AWQ), str(out), *args, "--quiet")
    if line is None:
        assert run.returncode == 0 and run.stderr == "" and (out / MANIFEST_NAME).is_file()
    else:
        assert one_error_line(run) == "wna16-shard: error: " + line.format(out=out)
        assert not out.exists()


def test_for_with_an_unserved_quantization_says_no_split_serves_it(tmp_path: Path) -> None:
    """Asymmetric GPTQ: no vLLM config takes it at any split; --dry-run refuses too (and writes nothing)."""
    edge = FIXTURES / "gptq_w4_g32_zero_edge" / "checkpoint"
    line = one_error_line(cli(str(edge), str(tmp_path / "out"), "--for", "vllm", "--dry-run"))
    assert line == ("wna16-shard: error: vLLM 0.32.0, 0.34.0 will not serve --tp 1 with --load-format wna16: with no "
                    "flag, vLLM's gptq config refuses it: \"Unsupported quantization config: bits=4, sym=False\"; with "
                    "--quantization moe_wna16, vLLM's moe_wna16 config refuses it for the model's linear layers: "
                    "\"Unsupported quantization config: bits=4, sym=False\"; no TP or EP size up to 16 would serve it; "
                    "nothing was written.")
    assert one_error_line(cli(str(edge), str(tmp_path / "out"), "--for", "vllm==0.33.0")) == (
        "wna16-shard: error: --for vllm==0.33.0: no tested engine version of that name; use one of vllm, sglang, "
        "vllm==0.32.0, vllm==0.34.0, sglang==0.5.23.")
    assert not (tmp_path / "out").exists()


def test_without_for_the_warning_comes_before_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """No --for: each engine that serves no such output is warned about before any file is written (a write
    that fails at its first file has already warned), once per engine."""
    from wna16_loader.preshard import run as preshard_run

    def no_write(*args: object, **kwargs: object) -> None:
        raise OSError("the disk is full")

    monkeypatch.setattr(preshard_run, "write_all", no_write)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="the disk is full"):
        main([str(AWQ), str(out), "--tp", "2", "--ep", "2", "--quiet"])
    assert [w for w in capsys.readouterr().err.splitlines() if "warning" in w] == [
        f"wna16-shard: warning: {out}: no tested vLLM serves this output with --load-format wna16: vLLM runs MoE "
        f"layers at TP or at EP, not both (TP 2 x EP 2; with --enable-expert-parallel its MoE TP is 1): --ep 2 would "
        f"serve (vllm serve {out} --load-format wna16 -tp 2 --enable-expert-parallel)",
        f'wna16-shard: warning: {out}: no tested SGLang serves this output with --load-format wna16: SGLang stops at 4 '
        f'ranks: "assert self.total_num_heads % attn_tp_size == 0" (with no flag and with --quantization moe_wna16): '
        f'--ep 2 would serve (sglang serve --model-path {out} --load-format wna16 --quantization moe_wna16 '
        f'--tp-size 2 --ep-size 2)']


def test_dry_run_and_plan_show_both_engines(tmp_path: Path) -> None:
    dry = cli(str(AWQ), str(tmp_path / "out"), "--tp", "2", "--dry-run")
    assert [line for line in dry.stdout.splitlines() if line.startswith(("vLLM ", "SGLang "))] == [
        "vLLM 0.32.0, 0.34.0 at TP 2: yes: vllm serve OUT --load-format wna16 -tp 2 (MoE method auto_awq, no "
        "--quantization flag)",
        "SGLang 0.5.23 at TP 2: yes, with --quantization moe_wna16: sglang serve --model-path OUT --load-format wna16 "
        "--quantization moe_wna16 --tp-size 2 (MoE method moe_wna16; with no flag SGLang's awq_marlin config refuses "
        "the model's linear layers at 2 ranks: \"Weight input_size_per_partition = 64 is not divisible by "
        "min_thread_k = 128\")"]  # the fixture's attention: 2 heads x 64 over 2 ranks
    assert not (tmp_path / "out").exists()
    plan = cli(str(AWQ), "--plan", "--ep", "2").stdout.splitlines()
    assert plan[4].endswith("--load-format wna16: vLLM | SGLang")
    assert plan[5].endswith("yes (auto_awq) | --quantization moe_wna16") and plan[6].endswith("no | no")  # EP 2; TP 2
    assert "  SGLang 0.5.23 at TP 2 x EP 2: no: SGLang stops at 4 ranks: \"assert self.total_num_heads % " \
           "attn_tp_size == 0\" (with no flag and with --quantization moe_wna16)" in plan


def test_a_safetensors_file_as_source_is_told_to_pass_its_folder(tmp_path: Path) -> None:
    file = AWQ / "model.safetensors"
    assert one_error_line(cli(str(file), str(tmp_path / "out"), "--tp", "2", process=True)) == (
        f"wna16-shard: error: {file}: a file, not a folder; pass the checkpoint folder holding config.json and the "
        f"*.safetensors files (here {AWQ}).")
    assert not (tmp_path / "out").exists()


def test_float_layers_say_float_and_each_rank_its_experts(tmp_path: Path) -> None:
    """The mixed fixture (its layer 2 in float16, 4 experts) at --ep 3: the summary's group column
    says `float fp16` (not `chan`), --plan's G_eff column `float` (not -1), --dry-run and the manifest `float fp16`;
    the summary and --plan give each rank's experts (2, 1, 1)."""
    out = tmp_path / "out"
    run = cli(str(MIXED), str(out), "--ep", "3")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert [line for line in run.stderr.splitlines() if "warning" in line] == [  # (1 attention head, 3 ranks)
        f'wna16-shard: warning: {out}: no tested vLLM serves this output with --load-format wna16: vLLM stops at 3 '
        f'ranks: "Total number of attention heads (1) must be divisible by tensor parallel size (3)" (with no flag and '
        f'with --quantization moe_wna16); no TP or EP size up to 16 would serve it',
        f'wna16-shard: warning: {out}: no tested SGLang serves this output with --load-format wna16: with no flag, '
        f'SGLang\'s gptq_marlin config refuses it: "Unknown quantization method: gptq"; with --quantization '
        f'moe_wna16, SGLang stops at 3 ranks: "assert self.total_num_heads % attn_tp_size == 0"; no TP or EP size '
        f'up to 16 would serve it']
    rows = {line.split()[0]: line for line in run.stdout.splitlines()[2:6]}
    fields = rows["rank-00000-of-00003"].split()
    assert fields[5:8] == ["32,64,float", "fp16", "0"] and fields[-2:] == ["2:", "0–1"]
    assert rows["rank-00002-of-00003"].split()[-2:] == ["1:", "3"] and rows["common"].split()[-1] == "-"
    assert run.stdout.splitlines()[1].split()[-1] == "experts"
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["quantization"]["group_size_eff"] == {"model.layers.0.mlp.experts": 32,
                                                          "model.layers.1.mlp.experts": 64,
                                                          "model.layers.2.mlp.experts": "float fp16"}
    dry = cli(str(MIXED), str(tmp_path / "dry"), "--ep", "3", "--dry-run")
    assert "  G_eff model.layers.2.mlp.experts: float fp16" in dry.stdout.splitlines()
    plan = cli(str(MIXED), "--plan", "--ep", "3").stdout.splitlines()
    float_block = plan[plan.index("weights float16:") + 1:]
    assert float_block[0].split()[6:9] == ["padding", "bytes", "experts/EP"]
    assert float_block[1].split() == ["*", "1", "3", "128", "128", "float", "98312", "0", "2,", "1", "x2", "0",
                                      "no", "|", "no"]
    assert "-1" not in "\n".join(plan)


def test_include_mtp_on_an_output_written_with_no_mtp(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`include_mtp=True` on a --no-mtp output names where the MTP experts went (once); on a model without MTP
    it says so once."""
    import logging

    from sources import mtp_checkpoint

    mtp_checkpoint(tmp_path / "src", "qwen3_5_moe-mtp")
    out = tmp_path / "out"
    assert main([str(tmp_path / "src"), str(out), "--tp", "2", "--no-mtp", "--quiet"]) == 0
    caplog.clear()  # (wna16-shard's own warnings)
    with caplog.at_level(logging.WARNING, logger="wna16_loader"):
        layers = load_experts(out, ParallelConfig(2, 1), include_mtp=True)
    assert not any(layer.mtp for layer in layers.values())
    assert [r.getMessage() for r in caplog.records] == [
        f"[rank 1 tp 1/2 ep 0/1] include_mtp=True, but the wna16-shard output {out} was written with --no-mtp: its MTP "
        f"experts were copied unchanged into common/, so no MTP layer is loaded from it. Load them from common/ with the engine's own loader, or re-shard without --no-mtp."]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wna16_loader"):
        load_experts(MIXED, ParallelConfig(1, 0), include_mtp=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"[rank 0 tp 0/1 ep 0/1] include_mtp=True, but {MIXED} has no MTP experts (the family's row has no MTP "
        f"layers): only the decoder's MoE layers are loaded."]


def test_an_output_passed_as_the_source(tmp_path: Path) -> None:
    """A wna16-shard output as SRC (to shard or to --plan) is named as one, with what to do with it."""
    out = tmp_path / "out"
    assert main([str(MIXED), str(out), "--tp", "2", "--quiet"]) == 0
    want = (f"wna16-shard: error: {out}: this is a wna16-shard output, not a checkpoint: load it (load_experts("
            f"{str(out)!r}, ParallelConfig.from_manifest({str(out)!r}, rank=R))) or verify it (wna16-shard verify "
            f"{out}); to shard again, pass the original checkpoint as SRC.")
    assert one_error_line(cli(str(out), str(tmp_path / "again"), "--tp", "2")) == want
    assert one_error_line(cli(str(out), "--plan")) == want


def test_the_parent_of_the_checkpoint_folder(tmp_path: Path) -> None:
    """Pointing at the folder above the checkpoint asks "did you mean .../NAME?"."""
    import shutil
    shutil.copytree(MIXED, tmp_path / "models" / "Qwen3-MoE-GPTQ")
    (tmp_path / "models" / "notes").mkdir()
    line = one_error_line(cli(str(tmp_path / "models"), str(tmp_path / "out"), "--tp", "2"))
    assert line == (f"wna16-shard: error: {tmp_path / 'models' / 'config.json'}: file not found; a checkpoint folder "
                    f"needs a config.json. Did you mean {tmp_path / 'models' / 'Qwen3-MoE-GPTQ'}? (it holds a "
                    f"config.json)")


def test_a_misspelt_quant_method(tmp_path: Path) -> None:
    """`quant_method: "gtpq"`: a did-you-mean and the file's path."""
    folder = edited_mixed(tmp_path, lambda q: q.update(quant_method="gtpq"))
    line = one_error_line(cli(str(folder), str(tmp_path / "out"), "--tp", "2"))
    assert line == (f"wna16-shard: error: {folder / 'config.json'}: quantization_config: quant_method='gtpq' is not "
                    f"a WNA16 format this package loads; did you mean 'gptq'? expected one of ['awq', 'gptq', "
                    f"'compressed-tensors', 'auto-round', 'intel/auto-round'].")


def test_a_dynamic_rule_that_is_not_a_regex(tmp_path: Path) -> None:
    """A GPTQModel `dynamic` key that is no valid regex is a ConfigError naming the rule, the position and
    the fix (not a `re.error` traceback)."""
    def edit(q: dict) -> None:
        q["dynamic"] = {"+:model\\.layers\\.(1\\.mlp": {"bits": 8}}
    line = one_error_line(cli(str(edited_mixed(tmp_path, edit)), str(tmp_path / "out"), "--tp", "2"))
    assert line == ("wna16-shard: error: quantization_config: dynamic rule '+:model\\\\.layers\\\\.(1\\\\.mlp' "
                    "{'bits': 8}: 'model\\\\.layers\\\\.(1\\\\.mlp' is not a valid regular expression (missing ), "
                    "unterminated subpattern at position 15, after 'model\\\\.layers\\\\.'); fix the pattern in the "
                    "config (escape a literal character with a backslash, e.g. \\. \\( \\[), or remove the rule.")


def test_a_truncated_file_inside_an_output(source: Path, tmp_path: Path) -> None:
    """A truncated rank file: loading names the file, `verify` and the command that wrote the output; that
    command, run again, says which file it rewrites (one warning line) and rewrites only that file."""
    out = tmp_path / "out"
    assert main([str(source), str(out), "--tp", "2", "--quiet"]) == 0
    victim = out / "rank-00001-of-00002" / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as raised:
        load_experts(out, ParallelConfig.from_manifest(out, rank=1))
    assert str(raised.value) == (
        f"{victim}: truncated or corrupt (1000 bytes on disk): a file of the wna16-shard output {out}. Run "
        f"`wna16-shard verify {out}` to list every damaged file; re-running `wna16-shard {source} {out} --tp 2` "
        f"re-checks every file and rewrites only the damaged ones.")
    assert f"{victim.relative_to(out)}: " in cli("verify", str(out)).stderr  # what the message says to run
    before = mtimes(out)
    rerun = cli(str(source), str(out), "--tp", "2", "--quiet")
    assert one_error_line(rerun, code=0) == (
        f"wna16-shard: warning: {out}: 1 of 3 files to rewrite (rank-00001-of-00002/model.safetensors: truncated or "
        f"overwritten (1000 bytes, not what its header and the manifest say)); keeping the other 2 untouched")
    assert changed_since(out, before) == ["rank-00001-of-00002/model.safetensors"]
    assert cli("verify", str(out)).returncode == 0


def changed_since(out: Path, before: dict[str, int]) -> list[str]:
    """The files of `out` written (or created, or removed) since `before` = mtimes(out)."""
    after = mtimes(out)
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


def test_another_source_into_an_existing_output(source: Path, tmp_path: Path) -> None:
    """The refusal names the path the output was written from and both sources in words, not raw sha256 dicts;
    an output whose manifest predates the path says so."""
    out, other = tmp_path / "out", tmp_path / "other"
    assert main([str(source), str(out), "--tp", "2", "--quiet"]) == 0
    write_checkpoint(other, quant_config("awq"), hidden=64, intermediate=64, num_layers=1, num_experts=8)
    written = json.loads((out / MANIFEST_NAME).read_text())["source"]["files"][0]
    now = (other / "model.safetensors").stat().st_size
    line = one_error_line(cli(str(other), str(out), "--tp", "2"))
    assert line.startswith(f"wna16-shard: error: {out} was written from {source} (model.safetensors "
                           f"({written['size']} bytes, header sha256 {written['header_sha256'][:12]}), config.json "
                           f"sha256 ")
    assert f"; this run's source is {other} (model.safetensors ({now} bytes, header sha256 " in line
    assert line.endswith(f". Pass {source} as SRC, or use a new output folder (or delete {out} first).")
    assert "None" not in line and "{" not in line
    for name in (MANIFEST_NAME, ".wna16-plan.json"):  # as an older version wrote them: no source path
        record = json.loads((out / name).read_text())
        del record["source"]["path"]
        (out / name).write_text(json.dumps(record, indent=2))
    line = one_error_line(cli(str(other), str(out), "--tp", "2"))
    assert line.startswith(f"wna16-shard: error: {out} was written from another source (model.safetensors (")
    assert "; its manifest, from an older version, does not record the path); this run's source is " in line
    assert line.endswith(f". Pass the source {out} was written from, or use a new output folder (or delete {out} "
                         f"first).")


def test_a_rerun_without_resume_after_an_interrupted_run(source: Path, tmp_path: Path) -> None:
    """Re-running without --resume after a run was stopped says it starts over, and what --resume keeps."""
    out = tmp_path / "out"
    code = ("import sys, wna16_loader.preshard.writing as p; p.KILL_AFTER_FILES = 2; from wna16_loader.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    killed = subprocess.run([sys.executable, "-c", code, str(source), str(out), "--tp", "2", "--quiet"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9
    line = one_error_line(cli(str(source), str(out), "--tp", "2", "--quiet"), code=0)
    assert line == (f"wna16-shard: warning: {out}: found a partial output (2 of 3 files intact): starting over, every "
                    f"file is rewritten (use --resume to keep 2 files)")
    assert cli(str(source), str(tmp_path / "fresh"), "--tp", "2", "--quiet").stderr == ""  # a new OUT: no warning


def test_warnings_only_when_something_is_written(tmp_path: Path) -> None:
    """The G_eff warning comes with the run that writes, not with a no-op re-run ("already complete") nor
    before an unrelated error."""
    src, out = tmp_path / "src", tmp_path / "out"
    write_checkpoint(src, quant_config("gptq", group_size=32), hidden=64, intermediate=128, num_layers=1)
    first = cli(str(src), str(out), "--tp", "8", "--quiet")
    assert first.returncode == 0 and first.stderr.startswith("wna16-shard: warning: tp=8: group size 32 becomes G_eff 16")
    assert first.stderr.splitlines()[1].startswith(f"wna16-shard: warning: {out}: no tested vLLM serves this output")
    again = cli(str(src), str(out), "--tp", "8")
    assert again.returncode == 0 and again.stderr == "" and "already complete: nothing to do" in again.stdout
    other = one_error_line(cli(str(src), str(out), "--tp", "8", "--ep", "2"))
    assert other.startswith(f"wna16-shard: error: {out} was written with other parameters (ep: written 1, "
                            f"requested 2)")


# What a new user did on the first day, replayed (CLI rows as subprocesses).


def test_a_flipped_byte_is_repaired_by_the_command_verify_names(source: Path, tmp_path: Path) -> None:
    """One flipped byte in a rank file: loading stays unchecked (no hash: the flipped byte is loaded);
    `verify` names the file and the command that wrote the output; that command (and with --resume) re-checks
    every file and rewrites exactly the damaged one, every other file keeping its mtime."""
    import shlex

    out = tmp_path / "out"
    assert main([str(source), str(out), "--tp", "2", "--ep", "2", "--quiet"]) == 0
    victim = out / "rank-00002-of-00004" / "model.safetensors"
    intact = load_experts(out, ParallelConfig.from_manifest(out, rank=2))
    for extra in ([], ["--resume"]):
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0x01
        victim.write_bytes(bytes(data))
        loaded = load_experts(out, ParallelConfig.from_manifest(out, rank=2))  # fast: headers and sizes only
        assert any(not torch.equal(t, intact[p].tensors[n]) for p, layer in loaded.items()
                   for n, t in layer.tensors.items())
        verify = cli("verify", str(out))
        assert verify.returncode == 1 and "Traceback" not in verify.stderr
        line = verify.stderr.splitlines()[0]
        assert line == (f"wna16-shard verify: rank-00002-of-00004/model.safetensors: sha256 differs from the manifest "
                        f"(`wna16-shard verify OUT --source SRC` names the tensors that differ); `wna16-shard {source} "
                        f"{out} --tp 2 --ep 2` rewrites it (and only the damaged files)")
        command = shlex.split(line.split("`")[3])
        before = mtimes(out)
        rerun = cli(*command[1:], *extra, "--quiet", process=not extra)  # as the user runs it (once: it costs)
        assert rerun.returncode == 0 and "Traceback" not in rerun.stderr
        assert rerun.stderr.splitlines()[0] == (  # (then the serve line's warning: vLLM serves no TP x EP output)
            f"wna16-shard: warning: {out}: 1 of 5 files to rewrite (rank-00002-of-00004/model.safetensors: sha256 "
            f"differs from the manifest); keeping the other 4 untouched")
        assert changed_since(out, before) == ["rank-00002-of-00004/model.safetensors"]
        assert cli("verify", str(out)).returncode == 0


SIGINT_AT_IMPORT = """\
import os, signal, sys
class SigintAtImport:  # sends this process SIGINT as the module named in WNA16_TEST_SIGINT_AT starts importing
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == os.environ["WNA16_TEST_SIGINT_AT"]:
            sys.meta_path.remove(SigintAtImport)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, SigintAtImport)
"""


@pytest.mark.parametrize(("module", "command"), [("torch", "shard"), ("wna16_loader.preshard.run", "shard"),
                                                 ("torch", "verify")])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(source: Path, tmp_path: Path, module: str,
                                                         command: str) -> None:
    """A Ctrl-C while the console script starts (torch importing, and the package's modules) is the one
    line and exit 130, not a KeyboardInterrupt traceback: the entry imports nothing heavy before its guard."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SIGINT_AT_IMPORT)
    script = Path(sys.executable).parent / "wna16-shard"  # the console script pip wrote, else its equivalent
    entry = [str(script)] if script.is_file() else [sys.executable, "-c", "import sys; from wna16_loader.cli import "
                                                                          "run; sys.exit(run())"]
    args = ["verify", str(tmp_path / "out")] if command == "verify" else [str(source), str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "WNA16_TEST_SIGINT_AT": module}
    run = subprocess.run([*entry, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                         preexec_fn=sigint_default)
    assert one_error_line(run, code=130) == interrupted_line(args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("typed", "meant"), [
    (["--tp2"], "unrecognized argument --tp2; did you mean --tp 2?"),
    (["-tp", "2"], "unrecognized argument -tp; did you mean --tp 2?"),
    (["--t", "2"], "unrecognized argument --t; did you mean --tp 2?"),  # never taken as --tp 2 (no abbreviations)
    (["--layot", "checkpoint"], "unrecognized argument --layot; did you mean --layout checkpoint?"),
    (["--quite"], "unrecognized argument --quite; did you mean --quiet?"),
    (["--tensor-parallel-size", "4"], "unrecognized argument --tensor-parallel-size; did you mean --tp 4? (with vLLM's "
                                      "--enable-expert-parallel its MoE layers are EP over those ranks: --ep N, --tp 1)"),
    (["--tp-size=8"], "unrecognized argument --tp-size=8; did you mean --tp 8? (SGLang's --tp-size counts every rank: "
                      "with --ep-size E, --tp N/E --ep E)"),
    (["--ep-size", "8"], "unrecognized argument --ep-size; did you mean --ep 8?"),
    (["--expert-parallel-size", "2"], "unrecognized argument --expert-parallel-size; did you mean --ep 2?"),
    (["--enable-expert-parallel"], "unrecognized argument --enable-expert-parallel; did you mean --ep N? (vLLM's "
                                   "--enable-expert-parallel runs the MoE layers EP over all its -tp ranks: --ep with "
                                   "that count, --tp 1)"),
])
def test_a_mistyped_flag_gets_a_did_you_mean(source: Path, tmp_path: Path, typed: list[str], meant: str) -> None:
    """A mistyped flag is one line with what it probably meant, exit 2, nothing written."""
    line = one_error_line(cli(str(source), str(tmp_path / "out"), *typed, process=True))
    assert line == f"wna16-shard: error: {meant}"
    assert not (tmp_path / "out").exists()


def test_a_mistyped_subcommand_gets_a_did_you_mean(source: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`verfy OUT` (no such folder) asks "did you mean verify"; a verify flag typo too; a folder that is
    really named `verfy` is a source as before."""
    out = tmp_path / "out"
    line = one_error_line(cli("verfy", str(out), process=True))
    assert line == (f"wna16-shard: error: 'verfy' is no folder and no subcommand; did you mean `wna16-shard verify "
                    f"{out}`?")
    line = one_error_line(cli("verify", str(out), "--sorce", str(source)))
    assert line == f"wna16-shard verify: error: unrecognized argument --sorce; did you mean --source {source}?"
    (tmp_path / "verfy").mkdir()
    monkeypatch.chdir(tmp_path)
    line = one_error_line(cli("verfy", str(out)))
    assert line == "wna16-shard: error: verfy/config.json: file not found; a checkpoint folder needs a config.json."


@pytest.mark.parametrize("script", ["test", "test_vllm", "test_sglang"])
def test_the_test_scripts_help_installs_nothing(tmp_path: Path, script: str) -> None:
    """`./scripts/test --help`, `./scripts/test_vllm --help` and `./scripts/test_sglang --help` print their own
    usage (saying that other arguments go to pytest), exit 0 and install nothing: run from a copy with no .venv
    and an empty cache."""
    import shutil

    shutil.copytree(ROOT / "scripts", tmp_path / "scripts", ignore=shutil.ignore_patterns("bench", "__pycache__"))
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "WNA16_VLLM_VENV": str(tmp_path / "vllm-venv"),
           "WNA16_SGLANG_VENV": str(tmp_path / "sglang-venv")}
    env.pop("WNA16_PYTHON", None)
    run = subprocess.run([str(tmp_path / "scripts" / script), "--help"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.startswith(f"usage: ./scripts/{script} [PYTEST ARGS...]")
    assert "Every other argument goes to pytest" in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requirements", "scripts"]  # no .venv, cache nor venv


def test_a_folder_named_like_the_package_is_named_as_the_cause(tmp_path: Path) -> None:
    """The README's Python run from the folder holding the clone, itself named wna16_loader: the error says
    that the clone shadows the package (not "cannot import name ... (unknown location)"); an empty folder of that
    name (a namespace package, where no code of ours runs on `import`) is named by the CLI."""
    from importlib import metadata

    (tmp_path / "clone").mkdir()
    (tmp_path / "clone" / "wna16_loader").symlink_to(ROOT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user runs it: the installed package
    run = subprocess.run([sys.executable, "-c", "from wna16_loader import ParallelConfig"], cwd=tmp_path / "clone",
                         env=env, capture_output=True, text=True, timeout=60)
    clone = tmp_path / "clone" / "wna16_loader"
    assert run.returncode == 1 and run.stderr.splitlines()[-1] == (
        f"ImportError: {clone} is a clone of the wna16_loader repository, not the package (that is its folder "
        f"{clone / 'wna16_loader'}): Python imported it because it was started in {tmp_path / 'clone'}, the folder "
        f"holding the clone, and looks there first. Start Python in another folder (e.g. cd {clone}), or rename the "
        f"clone.")
    try:
        metadata.distribution("wna16_loader")
    except metadata.PackageNotFoundError:
        pytest.skip("wna16_loader is not installed: an empty folder of its name hides nothing")
    (tmp_path / "empty" / "wna16_loader").mkdir(parents=True)
    run = subprocess.run([sys.executable, "-m", "wna16_loader.cli", "--version"], cwd=tmp_path / "empty", env=env,
                         capture_output=True, text=True, timeout=60)
    assert one_error_line(run) == (f"wna16-shard: error: {tmp_path / 'empty' / 'wna16_loader'}: a folder named "
                                   f"wna16_loader, imported instead of the installed package (Python looks in the "
                                   f"current folder first); run from another folder, or rename that folder.")
