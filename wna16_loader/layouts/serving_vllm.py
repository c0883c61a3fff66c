"""vLLM's serve declarations (layouts.serving): its quantization configs, as each tested version builds them on a
CUDA GPU, and how it is launched. Read from vLLM's quantization/{auto_gptq, auto_awq, moe_wna16}.py, inc/,
compressed_tensors/ and utils/{gptq_utils, marlin_utils}.py (0.32.0 and 0.34.0 alike); vLLM's CPU platform builds
INC's MoE layers unquantized (the vLLM tier pins that difference).

| config (--quantization) | picked with no flag for    | MoE method (row)                    | refuses                        |
|-------------------------|----------------------------|-------------------------------------|--------------------------------|
| gptq                    | quant_method gptq          | auto_gptq, moe_wna16 off Marlin     | act-order, asymmetric          |
| awq                     | quant_method awq           | auto_awq, moe_wna16 off Marlin      |                                |
| compressed-tensors      | compressed-tensors         | ct_wna16                            |                                |
| inc                     | auto-round                 | auto_gptq, moe_wna16 off Marlin     | `auto_round` packing           |
| moe_wna16               | (flag only: gptq, awq)     | moe_wna16 at the top-level spec     | act-order; asymmetric linears  |
"""

from __future__ import annotations

from .architectures import VLLM_0_32, VLLM_0_34
from .serving import Engine, EngineVersion, KeyRule, Launch, MarlinCheck, QuantConfigRow, SizeRule
from .vllm import AUTO_AWQ, AUTO_GPTQ, CT_WNA16, MOE_WNA16

DESC_ACT = KeyRule("desc_act", (False, None), False, "GPTQ group activation ordering (desc_act=True) is no longer "
                   "supported", exempt=("group_size", -1))
GPTQ_TYPES = KeyRule("sym", (True,), True, "Unsupported quantization config: bits={bits}, sym={sym}")
NOT_MOE_WNA16 = KeyRule("desc_act", (False, None), False, "Quantization method specified in the model config "
                        "({quant_method}) does not match the quantization method specified in the `quantization` "
                        "argument (moe_wna16)", exempt=("group_size", -1), at_start=True)  # is_moe_wna16_compatible
AUTO_ROUND_PACKING = KeyRule("packing_format", ("auto_round:auto_gptq", "auto_round:auto_awq"),
                             "auto_round:auto_gptq", "Unsupported packing_format: {packing_format}")
MARLIN = MarlinCheck()

CONFIGS = (
    QuantConfigRow("gptq", ("gptq",), AUTO_GPTQ, (DESC_ACT, GPTQ_TYPES), MARLIN, MOE_WNA16),
    QuantConfigRow("awq", ("awq",), AUTO_AWQ, (), MARLIN, MOE_WNA16),
    QuantConfigRow("compressed-tensors", ("compressed-tensors",), CT_WNA16),
    QuantConfigRow("inc", ("auto-round", "intel/auto-round"), AUTO_GPTQ, (AUTO_ROUND_PACKING,),
                   MarlinCheck(tile_padding=False, symmetric_only=True), MOE_WNA16),
    QuantConfigRow("moe_wna16", (), MOE_WNA16, (NOT_MOE_WNA16,), per_layer=False, takes=("gptq", "awq"),
                   linear_refusals=(GPTQ_TYPES,)),  # it hands a GPTQ model's linear layers to AutoGPTQ's config
)

SIZE_RULES = (SizeRule("heads", "world", "Total number of attention heads ({size}) must be divisible by tensor "
                                          "parallel size ({by})"),)  # config/model.py verify_with_parallel_config
# `-tp N` ranks; --enable-expert-parallel makes the MoE layers EP over all of them with MoE TP 1
VLLM = Engine("vLLM", "vllm", Launch("vllm serve {out} --load-format wna16", "-tp", "--enable-expert-parallel",
                                     expert_sized=False, tp_with_ep=False))
TESTED_VLLM = (EngineVersion(VLLM, "0.32.0", CONFIGS, VLLM_0_32, SIZE_RULES),
               EngineVersion(VLLM, "0.34.0", CONFIGS, VLLM_0_34, SIZE_RULES))
