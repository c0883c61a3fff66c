"""SGLang 0.5.23's serve declarations (layouts.serving): its quantization configs as it builds them on a CUDA GPU,
its MoE layers' size checks, and how it is launched. Read from sglang/srt/configs/model_config.py
(`_verify_quantization`: each config's `override_quantization_method` picks gptq_marlin, awq_marlin or, named by
the flag, moe_wna16), layers/quantization/{gptq/gptq.py, awq/awq.py, moe_wna16.py, auto_round.py, marlin_utils.py}
and layers/moe/fused_moe_triton/layer.py. On a CPU, SGLang's AWQ config builds no Marlin method (`_is_cuda`) and
compressed-tensors cannot ask the device's capability: the SGLang tier answers both as on a GPU (serve_rank.py).

| config (--quantization) | picked with no flag for            | MoE method (row)                       | refuses           |
|-------------------------|------------------------------------|----------------------------------------|-------------------|
| gptq_marlin             | GPTQ 4/8-bit symmetric, Marlin's G | gptq_marlin                            | other GPTQ (no gptq config) |
| awq_marlin              | AWQ                                | auto_awq, moe_wna16 off Marlin         | attention input per rank not a multiple of 128 |
| compressed-tensors      | compressed-tensors                 | ct_wna16_k_major                       | format other than pack-quantized |
| auto-round              | auto-round                         | gptq_marlin, moe_wna16 off Marlin      | `auto_round` packing |
| moe_wna16               | (flag only: gptq, awq)             | moe_wna16 at the top-level spec        | act-order; non-Marlin GPTQ linears |

With `--tp-size T --ep-size E` SGLang's MoE layers run TP T/E inside each of E expert groups: this package's TP t x
EP e is `--tp-size t·e --ep-size e`.
"""

from __future__ import annotations

from .architectures import SGLANG_0_5_23
from .serving import Engine, EngineVersion, KeyRule, Launch, MarlinCheck, QuantConfigRow, SizeRule
from .sglang import CT_WNA16_K_MAJOR, GPTQ_MARLIN
from .vllm import AUTO_AWQ, MOE_WNA16

NO_GPTQ = "Unknown quantization method: {quant_method}"  # gptq is no QUANTIZATION_METHODS entry (ModelConfig)


def marlin_only(words: str, exempt: tuple[str, str] | None = None, at_start: bool = False) -> tuple[KeyRule, ...]:
    """GPTQMarlinConfig.is_gptq_marlin_compatible: 4/8-bit, symmetric, a Marlin group size, desc_act given."""
    return tuple(KeyRule(key, allowed, None, words, exempt, at_start) for key, allowed in (
        ("bits", (4, 8)), ("sym", (True,)), ("group_size", (-1, 32, 64, 128)), ("desc_act", (True, False))))


# moe_wna16 builds a GPTQ model's linear layers with gptq_marlin where compatible, else with gptq's linear scheme,
# whose kernel 0.5.23 removed (gptq/schemes/gptq_linear.py); AWQ models' with awq
NO_GPTQ_LINEAR = marlin_only("The non-Marlin GPTQ CUDA kernel has been removed", exempt=("quant_method", "awq"))
# AWQ Marlin's linear scheme checks the attention output projection's input per rank (awq_marlin.py
# create_weights, verify_marlin_supports_shape); its get_quant_method asked with the whole input, so no fallback
MARLIN_LINEAR_K = SizeRule("attention_part", 128, "Weight input_size_per_partition = {size} is not divisible by "
                                                  "min_thread_k = {by}")
NOT_MOE_WNA16 = KeyRule("desc_act", (False, None), None, "Quantization method specified in the model config "
                        "({quant_method}) does not match the quantization method specified in the `quantization` "
                        "argument (moe_wna16)", at_start=True)  # MoeWNA16Config.is_moe_wna16_compatible
AUTO_ROUND_PACKING = KeyRule("packing_format", ("auto_round:auto_gptq", "auto_round:auto_awq"),
                             "auto_round:auto_gptq", "Unsupported packing_format: {packing_format}")
MOE_MARLIN = MarlinCheck(tile_padding=False)  # check_moe_marlin_supports_layer, no tile padding
# CompressedTensorsWNA16MoE.__init__: the checkpoint's top-level format (a `mixed-precision` one is refused; SGLang
# raises its ValueError with four arguments, which print as a tuple)
CT_PACKED = KeyRule("format", ("pack-quantized",), None, "('For Fused MoE layers, only ', 'pack-quantized ', 'is "
                                                         "supported for the following bits: ', '[4, 8]')")

CONFIGS = (
    QuantConfigRow("gptq_marlin", ("gptq",), GPTQ_MARLIN, marlin_only(NO_GPTQ, at_start=True), per_layer=False),
    QuantConfigRow("awq_marlin", ("awq",), AUTO_AWQ, (), MOE_MARLIN, MOE_WNA16, linear_sizes=(MARLIN_LINEAR_K,)),
    QuantConfigRow("compressed-tensors", ("compressed-tensors",), CT_WNA16_K_MAJOR, (CT_PACKED,)),
    QuantConfigRow("auto-round", ("auto-round",), GPTQ_MARLIN, (AUTO_ROUND_PACKING,),
                   MarlinCheck(tile_padding=False, symmetric_only=True), MOE_WNA16),
    QuantConfigRow("moe_wna16", (), MOE_WNA16, (NOT_MOE_WNA16,), per_layer=False, takes=("gptq", "awq"),
                   linear_refusals=NO_GPTQ_LINEAR),
)
SIZE_RULES = (  # the attention of its models (qwen3_moe.py, ...: attention TP is --tp-size), FusedMoE.__init__
    SizeRule("heads", "world", "assert self.total_num_heads % attn_tp_size == 0"),
    SizeRule("experts", "ep", "assert self._num_global_routed % storage_ep_size == 0"),
    SizeRule("intermediate", "tp", "assert intermediate_size % self.moe_tp_size == 0"),
)

SGLANG = Engine("SGLang", "sglang", Launch("sglang serve --model-path {out} --load-format wna16", "--tp-size",
                                           "--ep-size", expert_sized=True, tp_with_ep=True))
TESTED_SGLANG = (EngineVersion(SGLANG, "0.5.23", CONFIGS, SGLANG_0_5_23, SIZE_RULES),)
