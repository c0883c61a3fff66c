"""layouts.serving: the serve line of every real fixture's `wna16-shard` output, one test per kind (served with
no flag, needs --quantization moe_wna16, cannot be served); the vLLM tier checks the same verdicts against vLLM
(tests_vllm/integrations/test_serve_line.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wna16_loader.layouts.serving import CONFIGS, TESTED_VLLM, Serve, VllmVersion, serve_lines, verdict
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
    assert serve_lines(split(name, tmp_path), "OUT") == [
        f"vLLM 0.32.0, 0.34.0 at TP 1: yes: vllm serve OUT --load-format wna16 (MoE method {', '.join(SERVED[name])}, "
        f"no --quantization flag)"]


@pytest.mark.parametrize("name", sorted(NEVER))
def test_cannot_be_served(name, tmp_path):
    (line,) = serve_lines(split(name, tmp_path), "OUT")
    assert line == f"vLLM 0.32.0, 0.34.0 at TP 1: no: {NEVER[name]}"


@pytest.mark.parametrize("name", ["gptq_w4_g32_zero_edge", "gptq_dynamic_mixed"])
def test_needs_the_flag_where_moe_wna16_builds_the_linear_layers_without_refusing(name, tmp_path):
    """The flag kind: a vLLM whose moe_wna16 config did not hand GPTQ linear layers to AutoGPTQ's (the refusal
    both tested versions make) would serve the 4-bit asymmetric GPTQ fixture with it, but not the mixed one,
    whose 8-bit and float layers moe_wna16 would build at the top-level 4-bit g32."""
    lenient = VllmVersion("lenient", tuple(replace(row, linear_refusals=()) for row in CONFIGS))
    v = verdict(lenient, split(name, tmp_path))
    if name == "gptq_w4_g32_zero_edge":
        assert (v.serve, v.flag, v.methods) == (Serve.FLAG, "moe_wna16", ("moe_wna16",))
        assert v.why == 'vLLM\'s gptq config refuses it: "Unsupported quantization config: bits=4, sym=False"'
    else:
        assert v.serve is Serve.NEVER and v.why.endswith(
            "with --quantization moe_wna16, model.layers.1.mlp.experts: vLLM's moe_wna16 config builds it as gptq "
            "4-bit g32 asym (it ignores the per-layer rules), the output holds gptq 8-bit g64 asym")


def test_padding_tp_times_ep_and_g_below_32_cannot_be_served(tmp_path):
    (padded,) = serve_lines(split("awq_w4_g32", tmp_path, tp=3), "OUT")
    assert padded == ("vLLM 0.32.0, 0.34.0 at TP 3: no: with no flag, model.layers.0.mlp.experts: moe_wna16 does "
                      "not hold G_eff 16 (it needs G >= 32); with --quantization moe_wna16, model.layers.0.mlp.experts: "
                      "moe_wna16 does not hold G_eff 16 (it needs G >= 32)")  # I 128 / 3: G 32 becomes 16
    (both,) = serve_lines(split("awq_w4_g32", tmp_path, tp=2, ep=2), "OUT")
    assert both == ("vLLM 0.32.0, 0.34.0 at TP 2 x EP 2: no: vLLM runs MoE layers at TP or at EP, not both (TP 2 x "
                    "EP 2; with --enable-expert-parallel its MoE TP is 1)")
    (ep,) = serve_lines(split("awq_w4_g32", tmp_path, ep=2), "OUT")
    assert ep == ("vLLM 0.32.0, 0.34.0 at EP 2: yes: vllm serve OUT --load-format wna16 -tp 2 "
                  "--enable-expert-parallel (MoE method auto_awq, no --quantization flag)")
