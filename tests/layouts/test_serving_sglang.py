"""layouts.serving_sglang: SGLang 0.5.23's verdict on every real fixture's `wna16-shard` output at TP 1, TP 2 and
EP 2 (the SGLang tier, tests_sglang/integrations/test_serve_verdict.py, builds each with SGLang and checks it), its
split flags (`--tp-size t·e --ep-size e`: MoE TP inside EP) and its size checks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wna16_loader.layouts.engines import serve_lines
from wna16_loader.layouts.serving import Serve, Verdict, verdict
from wna16_loader.layouts.serving_sglang import TESTED_SGLANG
from wna16_loader.preshard.layouts import output_split
from wna16_loader.preshard.run import preshard_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
(SGLANG,) = TESTED_SGLANG
SPLITS = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (1, 2)}
HEADS = 'SGLang stops at 2 ranks: "assert self.total_num_heads % attn_tp_size == 0"'  # 1 attention head, 2 ranks
NO_GPTQ = 'with no flag, SGLang\'s gptq_marlin config refuses it: "Unknown quantization method: gptq"'
NO_GPTQ_LINEAR = ('with --quantization moe_wna16, SGLang\'s moe_wna16 config refuses it for the model\'s linear '
                  'layers: "The non-Marlin GPTQ CUDA kernel has been removed"')
AWQ_LINEAR = ('SGLang\'s awq_marlin config refuses the model\'s linear layers at 2 ranks: "Weight '
              'input_size_per_partition = 64 is not divisible by min_thread_k = 128"')  # 2 heads x 64 over 2 ranks
CT_MIXED = ('with no flag, SGLang\'s compressed-tensors config refuses it: "(\'For Fused MoE layers, only \', '
            '\'pack-quantized \', \'is supported for the following bits: \', \'[4, 8]\')"')
# fixture -> split -> the verdict (every split the same where one is given)
EXPECTED = {
    "awq_w4_g32": {"tp1": Verdict(Serve.NO_FLAG, ("auto_awq",)),
                   "tp2": Verdict(Serve.FLAG, ("moe_wna16",), "moe_wna16", f"{AWQ_LINEAR}"),
                   "ep2": Verdict(Serve.FLAG, ("moe_wna16",), "moe_wna16", f"{AWQ_LINEAR}")},
    "ct_w4_g32_asym": Verdict(Serve.NO_FLAG, ("ct_wna16_k_major",)),
    "ct_w8_channel_sym": Verdict(Serve.NO_FLAG, ("ct_wna16_k_major",)),
    "autoround_layer_config_mixed": {"tp1": Verdict(Serve.NO_FLAG, ("moe_wna16", "unquantized")),
                                     "tp2": Verdict(Serve.NEVER, why=f"with no flag, {HEADS}"),
                                     "ep2": Verdict(Serve.NEVER, why=f"with no flag, {HEADS}")},
    "ct_multigroup_mixed": {"tp1": Verdict(Serve.NEVER, why=CT_MIXED),  # the attention is built first
                            "tp2": Verdict(Serve.NEVER, why=f"with no flag, {HEADS}"),
                            "ep2": Verdict(Serve.NEVER, why=f"with no flag, {HEADS}")},
    "autoround_w8_g64_asym": Verdict(Serve.NEVER, why='with no flag, SGLang\'s auto-round config refuses it: '
                                                     '"Unsupported packing_format: auto_round"'),
    "gptq_w4_g32_zero_edge": Verdict(Serve.NEVER, why=f"{NO_GPTQ}; {NO_GPTQ_LINEAR}"),
    "gptq_dynamic_mixed": {"tp1": Verdict(Serve.NEVER, why=f"{NO_GPTQ}; {NO_GPTQ_LINEAR}"),
                           "tp2": Verdict(Serve.NEVER, why=f"{NO_GPTQ}; with --quantization moe_wna16, {HEADS}"),
                           "ep2": Verdict(Serve.NEVER, why=f"{NO_GPTQ}; with --quantization moe_wna16, {HEADS}")},
    "gptq_w4_g32_actorder_asym": Verdict(
        Serve.NEVER, why=f"{NO_GPTQ}; with --quantization moe_wna16, SGLang's moe_wna16 config refuses it: "
                         f"\"Quantization method specified in the model config (gptq) does not match the quantization "
                         f"method specified in the `quantization` argument (moe_wna16)\""),
}


def split(name: str, tmp_path: Path, tp: int = 1, ep: int = 1, heads: int | None = None):
    """The serve question of the fixture's output at TP x EP (`heads`: its attention heads and the output
    projection's input replaced, e.g. by Qwen3-30B-A3B's 32 x 128, to ask about more ranks than the fixture's 1 or
    2 heads allow)."""
    summary = preshard_checkpoint(FIXTURES / name / "checkpoint", tmp_path / name, tp_size=tp, ep_size=ep,
                                  dry_run=True, progress=False)
    question = output_split(summary.plan)
    return question if heads is None else replace(question, heads=heads, attention=heads * 128)


def test_every_fixture_has_its_verdicts():
    assert sorted(EXPECTED) == sorted(p.name for p in FIXTURES.iterdir() if (p / "checkpoint").is_dir())


@pytest.mark.parametrize("where", SPLITS)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_verdict_of_every_fixture_and_split(name, where, tmp_path):
    expected = EXPECTED[name][where] if isinstance(EXPECTED[name], dict) else EXPECTED[name]
    got = verdict(SGLANG, split(name, tmp_path, *SPLITS[where]))
    assert (got.serve, got.methods, got.flag, got.why) == (expected.serve, expected.methods, expected.flag,
                                                            expected.why)


def test_the_words_of_each_try_are_sglangs(tmp_path):
    """What the tier finds in SGLang's trace, one per flag tried."""
    assert verdict(SGLANG, split("gptq_w4_g32_zero_edge", tmp_path)).words == (
        "Unknown quantization method: gptq", "The non-Marlin GPTQ CUDA kernel has been removed")


def test_asymmetric_gptq_needs_a_marlin_linear_kernel_sglang_removed(tmp_path):
    """A lenient SGLang whose moe_wna16 built GPTQ linear layers would serve asymmetric GPTQ with the flag."""
    lenient = replace(SGLANG, configs=tuple(replace(row, linear_refusals=()) for row in SGLANG.configs))
    (line,) = serve_lines(split("gptq_w4_g32_zero_edge", tmp_path, tp=2), "OUT", (lenient,))
    assert line == ("SGLang 0.5.23 at TP 2: yes, with --quantization moe_wna16: sglang serve --model-path OUT "
                    "--load-format wna16 --quantization moe_wna16 --tp-size 2 (MoE method moe_wna16; with no flag "
                    "SGLang's gptq_marlin config refuses it: \"Unknown quantization method: gptq\")")


def test_moe_tp_inside_ep_is_one_sglang_launch(tmp_path):
    """TP 2 x EP 2 (vLLM refuses it) is `--tp-size 4 --ep-size 2`; EP 2 alone `--tp-size 2 --ep-size 2`."""
    (both,) = serve_lines(split("awq_w4_g32", tmp_path, tp=2, ep=2, heads=32), "OUT", TESTED_SGLANG)
    assert both == ("SGLang 0.5.23 at TP 2 x EP 2: yes: sglang serve --model-path OUT --load-format wna16 --tp-size 4 "
                    "--ep-size 2 (MoE method auto_awq, no --quantization flag)")
    (ep,) = serve_lines(split("awq_w4_g32", tmp_path, ep=2, heads=32), "OUT", TESTED_SGLANG)
    assert ep == ("SGLang 0.5.23 at EP 2: yes: sglang serve --model-path OUT --load-format wna16 --tp-size 2 "
                  "--ep-size 2 (MoE method auto_awq, no --quantization flag)")


def test_marlin_falls_back_to_moe_wna16_where_its_shape_check_fails(tmp_path):
    """AWQ at TP 4: I_p 32 is no multiple of max(64, G) (check_moe_marlin_supports_layer): moe_wna16."""
    assert verdict(SGLANG, split("awq_w4_g32", tmp_path, tp=4, heads=32)) == Verdict(Serve.NO_FLAG, ("moe_wna16",))


def test_the_size_checks(tmp_path):
    """The attention asserts that --tp-size divides the heads, FusedMoE that EP divides the routed experts and MoE
    TP divides I: the verdict names the assert, once for every flag."""
    (heads,) = serve_lines(split("awq_w4_g32", tmp_path, tp=4), "OUT", TESTED_SGLANG)  # 2 heads / 4
    assert heads == ('SGLang 0.5.23 at TP 4: no: SGLang stops at 4 ranks: "assert self.total_num_heads % attn_tp_size '
                     '== 0" (with no flag and with --quantization moe_wna16)')
    (padded,) = serve_lines(split("awq_w4_g32", tmp_path, tp=3, heads=33), "OUT", TESTED_SGLANG)  # I 128 / 3
    assert padded == ('SGLang 0.5.23 at TP 3: no: SGLang stops at 3 ranks: "assert intermediate_size % '
                      'self.moe_tp_size == 0" (with no flag and with --quantization moe_wna16)')
    (uneven,) = serve_lines(split("awq_w4_g32", tmp_path, ep=3, heads=33), "OUT", TESTED_SGLANG)  # 4 experts / 3
    assert uneven == ('SGLang 0.5.23 at EP 3: no: SGLang stops at 3 ranks: "assert self._num_global_routed % '
                      'storage_ep_size == 0" (with no flag and with --quantization moe_wna16)')
