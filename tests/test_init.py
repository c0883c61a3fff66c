"""The public API (`wna16_loader/__init__.py`) as a newcomer meets it: the licence, `help(wna16_loader)`, one way to
a rank's config, every error class, the Python twin of the CLI, names that say which is which, reprs."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from sources import make_source, tree_bytes

import wna16_loader
import wna16_loader.errors as errors
from wna16_loader import (FusedExperts, FusedMoEExperts, FusedMoEModule, FusedTensors, ParallelConfig,
                          load_experts, load_model_experts, parallel_config, read_manifest, read_moe_config, shard)
from wna16_loader.cli import main

ROOT = Path(__file__).resolve().parent.parent
MIXED = ROOT / "tests" / "fixtures" / "gptq_dynamic_mixed" / "checkpoint"  # layers 4-bit g32, 8-bit g64, float16


def test_licence_is_apache_2_in_the_file_and_the_metadata() -> None:
    """A LICENSE file with the full Apache-2.0 text, and the package's metadata saying so."""
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for part in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "9. Accepting Warranty or Additional "
                 "Liability.", "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply the Apache License"):
        assert part in text, part
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    assert metadata.metadata("wna16_loader")["License-Expression"] == "Apache-2.0"


def test_help_opens_on_the_start_here_text() -> None:
    """`python -c "import wna16_loader; help(wna16_loader)"` opens on which call to make, for an engine, a
    script and a rank with only the output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGER": "cat", "MANPAGER": "cat", "TERM": "dumb"}
    run = subprocess.run([sys.executable, "-c", "import wna16_loader; help(wna16_loader)"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = [line.strip() for line in run.stdout.splitlines() if line.strip()]
    assert lines[:4] == ["Help on package wna16_loader:", "NAME", "wna16_loader - wna16_loader: load WNA16-quantized "
                         "MoE checkpoints into fused, TP/EP-sharded expert parameters.", "DESCRIPTION"]
    assert lines[4] == "Start here: which call"
    start = "\n".join(lines[5:20])
    for call in ("ParallelConfig.from_environment()", "load_experts(checkpoint, parallel", "shard(src, out, tp=4, ep=1)",
                 "ParallelConfig.from_manifest(OUT, rank=r)", "load_model_experts(model, ckpt, parallel)"):
        assert call in start, call


def test_every_error_class_is_exported() -> None:
    """DeviceError and PreshardError (and every other error class) come from `wna16_loader` itself."""
    classes = {name for name, obj in vars(errors).items() if inspect.isclass(obj) and obj.__module__ == errors.__name__}
    assert {"DeviceError", "PreshardError", "ShardInterrupted", "WNA16Error"} <= classes
    assert classes <= set(wna16_loader.__all__)
    assert all(getattr(wna16_loader, name) is getattr(errors, name) for name in classes)


def test_one_documented_way_to_a_rank_config_and_its_aliases(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`ParallelConfig.from_manifest(OUT, rank=r)` is what the docstring and the CLI print; the other two
    spellings give the same config."""
    out = tmp_path / "out"
    assert main([str(make_source(tmp_path / "src")), str(out), "--tp", "2", "--ep", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (f"load: load_experts({str(out)!r}, "
                                                        f"ParallelConfig.from_manifest({str(out)!r}, rank=RANK))")
    want = ParallelConfig(2, 1, 2, 1)
    assert ParallelConfig.from_manifest(out, rank=3) == want
    assert parallel_config(out, rank=3) == want == ParallelConfig.from_manifest(read_manifest(out), rank=3)
    assert "ParallelConfig.from_manifest(OUT,\nrank=r)" in wna16_loader.__doc__
    assert "`parallel_config(OUT, rank=r)` and `from_manifest(read_manifest(OUT), rank=r)` are aliases" in \
        " ".join(wna16_loader.__doc__.split())


def test_shard_is_the_python_twin_of_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`shard(src, out, tp=..., ep=...)` writes what `wna16-shard SRC OUT --tp --ep` writes, and returns the
    summary the CLI prints."""
    src = make_source(tmp_path / "src")
    summary = shard(src, tmp_path / "python", tp=2, ep=2, max_file_size=20_000, progress=False)
    assert main([str(src), str(tmp_path / "cli"), "--tp", "2", "--ep", "2", "--max-file-size", "20000"]) == 0
    printed = capsys.readouterr().out
    assert tree_bytes(tmp_path / "python") == tree_bytes(tmp_path / "cli")
    assert summary.table().splitlines()[:2] == printed.splitlines()[:2]
    assert [r.name for r in summary.ranks] == ["common"] + [f"rank-0000{r}-of-00004" for r in range(4)]
    assert shard(src, tmp_path / "python", tp=2, ep=2, max_file_size=20_000, progress=False).complete


def test_the_result_and_the_module_have_names_that_say_which_is_which(tmp_path: Path) -> None:
    """`load_experts` returns `FusedTensors` (plain tensors); `FusedMoEModule` is the nn.Module; the former
    names still work."""
    assert FusedExperts is FusedTensors and FusedMoEExperts is FusedMoEModule
    layers = load_experts(MIXED, ParallelConfig(2, 0))
    assert all(type(layer) is FusedTensors for layer in layers.values())
    moe = read_moe_config(MIXED)
    module = FusedMoEModule(moe, moe.experts_prefixes[0], ParallelConfig(2, 0))
    assert isinstance(module, torch.nn.Module) and not isinstance(layers[moe.experts_prefixes[0]], torch.nn.Module)


def test_reprs_name_bits_group_float_mtp_padding_and_loads_from_an_output_log_a_summary(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Printing a loaded layer (and a module) shows its spec; a load from an output logs the per-rank summary
    line that a load from a checkpoint logs."""
    out = tmp_path / "out"
    assert main([str(MIXED), str(out), "--tp", "2", "--quiet"]) == 0
    caplog.clear()  # (wna16-shard's own warning: no tested vLLM serves this asymmetric GPTQ output)
    parallel = ParallelConfig.from_manifest(out, rank=1)
    with caplog.at_level(logging.INFO, logger="wna16_loader"):
        layers = load_experts(out, parallel)
    assert [r.getMessage() for r in caplog.records] == [
        f"[rank 1 tp 1/2 ep 0/1] loaded from the wna16-shard output {out}: {layers.report}"]
    first, _, float_layer = layers.values()
    assert repr(first) == ("FusedTensors('model.layers.0.mlp.experts', 4-bit quantized, group 32, asymmetric, experts "
                           "0–3, I 128, I_p 64, padding 0, mtp=False; w13_qweight=[4, 128, 32], w2_qweight=[4, 64, 32], "
                           "w13_scales=[4, 128, 2], w2_scales=[4, 64, 2], w13_qzeros=[4, 64, 2], w2_qzeros=[4, 32, 2], "
                           "expert_ids=[4])")
    assert repr(float_layer) == ("FusedTensors('model.layers.2.mlp.experts', float fp16 (not quantized), experts 0–3, "
                                 "I 128, I_p 64, padding 0, mtp=False; w13_weight=[4, 128, 64], w2_weight=[4, 64, 64], "
                                 "expert_ids=[4])")
    moe = read_moe_config(out)
    model = torch.nn.ModuleList(FusedMoEModule(moe, prefix, parallel) for prefix in moe.experts_prefixes)
    load_model_experts(model, out, parallel)
    assert repr(model[2]).startswith("FusedMoEModule('model.layers.2.mlp.experts', float fp16 (not quantized), "
                                     "experts 0–3, I 128, I_p 64, padding 0, mtp=False, spec='not quantized")
