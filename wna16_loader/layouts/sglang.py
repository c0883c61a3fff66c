"""SGLang 0.5.23's routed-expert MoE methods, one `MethodLayout` row each, as each method's `create_weights`
allocates its parameters and SGLang's `FusedMoE.weight_loader` fills them (before the method's own
`process_weights_after_loading`). Read from sglang/srt/layers/quantization/{moe_wna16.py, gptq/schemes/
gptq_moe.py, awq/schemes/awq_moe.py, compressed_tensors/schemes/compressed_tensors_wNa16_moe.py, unquant.py}.

| row             | SGLang class (layer.scheme, else layer.quant_method) | picked for (no --quantization flag)  |
|-----------------|------------------------------------------------------|--------------------------------------|
| moe_wna16       | MoeWNA16Method (vLLM's row: the same parameters)     | GPTQ asymmetric, `--quantization moe_wna16` |
| gptq_marlin     | GPTQMarlinMoEScheme                                  | GPTQ symmetric (Marlin-compatible)   |
| auto_awq        | AWQMoEScheme (vLLM's row: the same parameters)        | AWQ GEMM 4-bit                       |
| ct_wna16_k_major| CompressedTensorsWNA16MoE / ...TritonMoE              | compressed-tensors pack-quantized    |
| unquantized     | UnquantizedFusedMoEMethod (vLLM's row)               | float expert layers                  |

gptq_marlin differs from vLLM's auto_gptq in three ways: its scales are float16 whatever the model's dtype;
without act-order its w2 scales are allocated for the whole model's I (`I * moe_tp_size // G` groups), the
rank's groups first and zeros after them, as SGLang's loader leaves them (the rest holds GPTQ v1's own words and
scales, which load.direct copies from a checkpoint); and its qzeros (allocated in the
model's dtype, unread by the Marlin kernel, which holds symmetric layers only) and g_idx are not declared: the
fill leaves them as SGLang allocated them, and refuses an act-order layer (whose g_idx it would drop) for this row
and ct_wna16_k_major (`act_order=False`). ct_wna16_k_major is compressed-tensors' words transposed to
K-major (SGLang transposes every tensor but the zero points on load, `layer.py` `_weight_loader_impl`).
"""

from __future__ import annotations

import torch

from .spec import Half, MethodLayout, Need, Order, Packing, ParamDecl, Source
from .vllm import AUTO_AWQ, MOE_WNA16, UNQUANTIZED

W13, W2 = Half.W13, Half.W2
K_MAJOR = Order.K_MAJOR


def _k_major(name: str, half: Half, source: Source, shape: tuple[str, ...], dtype: torch.dtype | None, *,
             packing: Packing = Packing.NONE, need: Need = Need.ALWAYS,
             allocated: tuple[str, ...] | None = None) -> ParamDecl:
    """A parameter in the K-major orientation [E, X, N] (TP cut: N of w13, X of w2)."""
    return ParamDecl(name, half, source, shape, dtype, order=K_MAJOR, packing=packing, need=need,
                     allocated=allocated)


GPTQ_MARLIN = MethodLayout("gptq_marlin", ("sglang",), (
    _k_major("w13_qweight", W13, Source.QWEIGHT, ("E", "H/P", "N13"), torch.int32, packing=Packing.K_WORDS),
    _k_major("w2_qweight", W2, Source.QWEIGHT, ("E", "I_p/P", "H"), torch.int32, packing=Packing.K_WORDS),
    _k_major("w13_scales", W13, Source.SCALES, ("E", "GH", "N13"), torch.float16),
    _k_major("w2_scales", W2, Source.SCALES, ("E", "GI", "H"), torch.float16, allocated=("E", "GI_all", "H")),
), notes="GPTQ v1 words stacked over experts, float16 scales, w2 scales allocated for the whole I (the rank's "
         "first); qzeros and g_idx left as allocated (symmetric only)", asymmetric=False, act_order=False)

CT_WNA16_K_MAJOR = MethodLayout("ct_wna16_k_major", ("sglang",), (
    _k_major("w13_weight_packed", W13, Source.QWEIGHT, ("E", "H/P", "N13"), torch.int32, packing=Packing.K_WORDS),
    _k_major("w2_weight_packed", W2, Source.QWEIGHT, ("E", "I_p/P", "H"), torch.int32, packing=Packing.K_WORDS),
    _k_major("w13_weight_scale", W13, Source.SCALES, ("E", "GH", "N13"), None),
    _k_major("w2_weight_scale", W2, Source.SCALES, ("E", "GI", "H"), None),
    _k_major("w13_weight_zero_point", W13, Source.ZEROS, ("E", "GH", "N13/P"), torch.int32,
             packing=Packing.N_WORDS, need=Need.ZERO_POINTS),
    _k_major("w2_weight_zero_point", W2, Source.ZEROS, ("E", "GI", "H/P"), torch.int32, packing=Packing.N_WORDS,
             need=Need.ZERO_POINTS),
    ParamDecl("w13_weight_shape", W13, Source.SHAPE, ("E", "2"), torch.float32),
    ParamDecl("w2_weight_shape", W2, Source.SHAPE, ("E", "2"), torch.float32),
), notes="compressed-tensors' int32 words transposed to K-major (SGLang's Marlin and Triton schemes)",
   act_order=False)

SGLANG_LAYOUTS = (MOE_WNA16, GPTQ_MARLIN, AUTO_AWQ, CT_WNA16_K_MAJOR, UNQUANTIZED)
