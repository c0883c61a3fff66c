"""layouts.sglang: SGLang 0.5.23's MoE method rows (shapes as its create_weights allocates them, the rows it
shares with vLLM, what each holds)."""

from __future__ import annotations

import pytest
import torch

from wna16_loader.formats import compressed_tensors, gptq, resolve_quant_spec
from wna16_loader.layouts import (AUTO_AWQ, CT_WNA16, CT_WNA16_K_MAJOR, GPTQ_MARLIN, MOE_WNA16, SGLANG_LAYOUTS,
                                  UNQUANTIZED, VLLM_LAYOUTS, Sizes, allocated_shape, shape_of)
from wna16_loader.layouts.spec import WordLayout

# TP 2 of a layer with H 128, I 192, G 32: I_p 96
SIZES = Sizes(E=3, N13=2 * 96, H=128, I=192, I_p=96, bits=4, GH=4, GI=3, GH_eff=4, GI_eff=3, GI_all=6)


def test_the_rows_sglang_shares_with_vllm_are_vllms_rows():
    """moe_wna16, AWQ Marlin MoE and unquantized allocate vLLM's parameters: one row each, both engines'."""
    shared = [row for row in SGLANG_LAYOUTS if row in VLLM_LAYOUTS]
    assert shared == [MOE_WNA16, AUTO_AWQ, UNQUANTIZED]
    assert all("sglang" in row.engines for row in SGLANG_LAYOUTS)
    assert [row.name for row in VLLM_LAYOUTS if "sglang" not in row.engines] == ["auto_gptq", "ct_wna16"]


def test_gptq_marlin_allocates_w2_scales_for_the_whole_intermediate_size():
    """GPTQMarlinMoEScheme.create_weights without act-order: w2 scales [E, I·tp // G, H], float16; the rank's
    GI groups are its values, allocated_shape what SGLang allocates."""
    assert [shape_of(p, SIZES) for p in GPTQ_MARLIN.params] == [(3, 16, 192), (3, 12, 128), (3, 4, 192), (3, 3, 128)]
    assert [allocated_shape(p, SIZES) for p in GPTQ_MARLIN.params][3] == (3, 6, 128)
    assert {p.dtype for p in GPTQ_MARLIN.params if p.source.value == "scales"} == {torch.float16}


def test_ct_k_major_is_vllms_ct_row_transposed():
    """SGLang transposes compressed-tensors' packed weights and scales (and allocates its zero points so):
    every parameter of the K-major row is the N-major row's with its last two dims swapped."""
    n_major = {p.name: shape_of(p, SIZES) for p in CT_WNA16.params}
    for param in CT_WNA16_K_MAJOR.params:
        shape = n_major[param.name]
        assert shape_of(param, SIZES) == (shape if param.source.value == "shape" else (shape[0], shape[2], shape[1]))


def test_ct_k_major_holds_no_checkpoints_own_words():
    spec = resolve_quant_spec(compressed_tensors.to_config(4, 128, False, False))
    storage = {WordLayout.of(lay, spec) for lay in spec.layouts}
    assert [p.name for p in CT_WNA16_K_MAJOR.params if p.storage in storage] == []


def test_gptq_marlin_holds_the_checkpoints_words():
    """GPTQ v1's words and scales as they are (w2 scales in the head of their whole-I allocation): copied."""
    spec = resolve_quant_spec(gptq.to_config(4, 128, True, False))
    storage = {WordLayout.of(lay, spec) for lay in spec.layouts}
    assert [p.name for p in GPTQ_MARLIN.params if p.storage in storage] == ["w13_qweight", "w2_qweight",
                                                                              "w13_scales", "w2_scales"]


@pytest.mark.parametrize("kind, names", [
    (dict(quantized=True, padded=False, reduced=False, asymmetric=False),
     ["moe_wna16", "gptq_marlin", "auto_awq", "ct_wna16_k_major"]),
    (dict(quantized=True, padded=False, reduced=False, asymmetric=True), ["moe_wna16", "auto_awq", "ct_wna16_k_major"]),
    (dict(quantized=True, padded=False, reduced=False, asymmetric=False, partial=True), ["moe_wna16"]),
    (dict(quantized=False, padded=False, reduced=False, asymmetric=False), ["unquantized"]),
])
def test_which_sglang_methods_take_a_fused_layer(kind, names):
    """The rows whose `refusal` is None for a fused layer of this kind."""
    assert [row.name for row in SGLANG_LAYOUTS if row.refusal(**{"partial": False, "group_eff": 32, **kind}) is None] \
        == names
