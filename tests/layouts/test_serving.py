"""layouts.serving with vLLM's rows (layouts.serving_vllm): the serve line of every real fixture's `wna16-shard`
output, one test per kind (served with no flag, needs --quantization moe_wna16, cannot be served), and what stops
an engine before any config (no model class, MoE TP with EP, a size check); the vLLM tier checks the same verdicts
against vLLM (tests_vllm/integrations/test_serve_line.py). SGLang's rows: test_serving_sglang.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wna16_loader.layouts.engines import serve_lines
from wna16_loader.layouts.serving import EngineVersion, Serve, SizeRule, Verdict, verdict
from wna16_loader.layouts.serving_vllm import CONFIGS, TESTED_VLLM, VLLM
from wna16_loader.layouts.architectures import VLLM_0_32
from wna16_loader.preshard.layouts import output_split
from wna16_loader.preshard.run import preshard_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def split(name: str, tmp_path: Path, tp: int = 1, ep: int = 1):
    summary = preshard_checkpoint(FIXTURES / name / "checkpoint", tmp_path / name, tp_size=tp, ep_size=ep,
                                  dry_run=True, progress=False)
    return output_split(summary.plan)


SERVED = {"awq_w4_g32": ("auto_awq",), "ct_w4_g32_asym": ("ct_wna16",), "ct_w8_channel_sym": ("ct_wna16",),
          "ct_multigroup_mixed": ("ct_wna16", "unquantized"), "autoround_layer_config_mixed": ("moe_wna16", "unquantized")}
NEVER = {
    "gptq_w4_g32_zero_edge": 'with no flag, vLLM\'s gptq config refuses it: "Unsupported quantization config: bits=4, '
                             'sym=False"; with --quantization moe_wna16, vLLM\'s moe_wna16 config refuses it for the '
                             'model\'s linear layers: "Unsupported quantization config: bits=4, sym=False"',
    "gptq_dynamic_mixed": 'with no flag, vLLM\'s gptq config refuses it: "Unsupported quantization config: bits=4, '
                          'sym=False"; with --quantization moe_wna16, vLLM\'s moe_wna16 config refuses it for the '
                          'model\'s linear layers: "Unsupported quantization config: bits=4, sym=False"',
    "gptq_w4_g32_actorder_asym": 'with no flag, vLLM\'s gptq config refuses it: "GPTQ group activation ordering '
                                 '(desc_act=True) is no longer supported"; with --quantization moe_wna16, vLLM\'s '
                                 'moe_wna16 config refuses it: "Quantization method specified in the model config '
                                 '(gptq) does not match the quantization method specified in the `quantization` '
                                 'argument (moe_wna16)"',
    "autoround_w8_g64_asym": 'with no flag, vLLM\'s inc config refuses it: "Unsupported packing_format: auto_round"',
}


def test_every_fixture_has_a_kind():
    assert sorted([*SERVED, *NEVER]) == sorted(p.name for p in FIXTURES.iterdir() if (p / "checkpoint").is_dir())


@pytest.mark.parametrize("name", sorted(SERVED))
def test_served_with_no_flag(name, tmp_path):
    for version in TESTED_VLLM:
        v = verdict(version, split(name, tmp_path))
        assert (v.serve, v.methods) == (Serve.NO_FLAG, SERVED[name])
    assert serve_lines(split(name, tmp_path), "OUT", TESTED_VLLM) == [
        f"vLLM 0.32.0, 0.34.0 at TP 1: yes: vllm serve OUT --load-format wna16 (MoE method {', '.join(SERVED[name])}, "
        f"no --quantization flag)"]


@pytest.mark.parametrize("name", sorted(NEVER))
def test_cannot_be_served(name, tmp_path):
    (line,) = serve_lines(split(name, tmp_path), "OUT", TESTED_VLLM)
    assert line == f"vLLM 0.32.0, 0.34.0 at TP 1: no: {NEVER[name]}"


@pytest.mark.parametrize("name", ["gptq_w4_g32_zero_edge", "gptq_dynamic_mixed"])
def test_needs_the_flag_where_moe_wna16_builds_the_linear_layers_without_refusing(name, tmp_path):
    """The flag kind: a vLLM whose moe_wna16 config did not hand GPTQ linear layers to AutoGPTQ's (the refusal
    both tested versions make) would serve the 4-bit asymmetric GPTQ fixture with it, but not the mixed one,
    whose 8-bit and float layers moe_wna16 would build at the top-level 4-bit g32."""
    lenient = EngineVersion(VLLM, "lenient", tuple(replace(row, linear_refusals=()) for row in CONFIGS), VLLM_0_32)
    v = verdict(lenient, split(name, tmp_path))
    if name == "gptq_w4_g32_zero_edge":
        assert (v.serve, v.flag, v.methods) == (Serve.FLAG, "moe_wna16", ("moe_wna16",))
        assert v.why == 'vLLM\'s gptq config refuses it: "Unsupported quantization config: bits=4, sym=False"'
    else:
        assert v.serve is Serve.NEVER and v.why.endswith(
            "with --quantization moe_wna16, model.layers.1.mlp.experts: vLLM's moe_wna16 config builds it as gptq "
            "4-bit g32 asym (it ignores the per-layer rules), the output holds gptq 8-bit g64 asym")


def test_padding_tp_times_ep_and_g_below_32_cannot_be_served(tmp_path):
    (padded,) = serve_lines(replace(split("awq_w4_g32", tmp_path, tp=3), heads=33), "OUT", TESTED_VLLM)  # 33 heads
    assert padded == ("vLLM 0.32.0, 0.34.0 at TP 3: no: model.layers.0.mlp.experts: moe_wna16 does not hold G_eff 16 "
                      "(it needs G >= 32) (with no flag and with --quantization moe_wna16)")  # I 128 / 3: G 32 -> 16
    (both,) = serve_lines(split("awq_w4_g32", tmp_path, tp=2, ep=2), "OUT", TESTED_VLLM)
    assert both == ("vLLM 0.32.0, 0.34.0 at TP 2 x EP 2: no: vLLM runs MoE layers at TP or at EP, not both (TP 2 x "
                    "EP 2; with --enable-expert-parallel its MoE TP is 1)")
    (ep,) = serve_lines(split("awq_w4_g32", tmp_path, ep=2), "OUT", TESTED_VLLM)
    assert ep == ("vLLM 0.32.0, 0.34.0 at EP 2: yes: vllm serve OUT --load-format wna16 -tp 2 "
                  "--enable-expert-parallel (MoE method auto_awq, no --quantization flag)")


def test_a_model_class_the_version_lacks_cannot_be_served(tmp_path):
    """A "yes" means the whole model loads: config.json's architectures must name a class vLLM has. The fixture's
    real Qwen3MoeForCausalLM is in both versions' registries; a class of another engine's only is not."""
    question = split("awq_w4_g32", tmp_path)
    assert question.architectures == ("Qwen3MoeForCausalLM",)
    renamed = replace(question, architectures=("Qwen3MoeForCausalLMX",))
    for version in TESTED_VLLM:
        assert verdict(version, renamed) == Verdict(Serve.NEVER, why=f"vLLM {version.version} has no model class "
                                                    f"Qwen3MoeForCausalLMX (config.json's architectures)")
    assert verdict(TESTED_VLLM[0], replace(question, architectures=("Foo", "Qwen3MoeForCausalLM"))).serve is \
        Serve.NO_FLAG  # vLLM tries each name in turn


def test_a_size_rule_names_the_engines_words(tmp_path):
    """An engine's size check (SGLang's: routed experts a multiple of EP) stops it before any config; a version
    with the rule refuses the split that breaks it, in its words. vLLM's own: the attention heads a multiple of
    -tp (the fixture has 2)."""
    (heads,) = serve_lines(split("awq_w4_g32", tmp_path, tp=4), "OUT", TESTED_VLLM)
    assert heads == ('vLLM 0.32.0, 0.34.0 at TP 4: no: vLLM stops at 4 ranks: "Total number of attention heads (2) '
                     'must be divisible by tensor parallel size (4)" (with no flag and with --quantization moe_wna16)')
    question = replace(split("awq_w4_g32", tmp_path, ep=2), experts=5)
    strict = EngineVersion(VLLM, "strict", CONFIGS, VLLM_0_32, (SizeRule("experts", "ep", "experts % ep"),))
    assert verdict(strict, question) == Verdict(Serve.NEVER, why='vLLM stops at 2 ranks: "experts % ep" (with no flag '
                                                'and with --quantization moe_wna16)', words=("experts % ep",) * 2)
    assert verdict(strict, replace(question, experts=4)).serve is Serve.NO_FLAG
