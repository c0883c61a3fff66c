"""layouts.spec: shape expressions, the rows' derived facts (fused as is, parameters filled, the storage a
parameter declares against a checkpoint role's)."""

from __future__ import annotations

import pytest

from wna16_loader import LayoutMismatchError
from wna16_loader.formats import Dim, Role, awq, compressed_tensors, gptq, resolve_quant_spec
from wna16_loader.layouts import (AUTO_AWQ, AUTO_GPTQ, CT_WNA16, MOE_WNA16, UNQUANTIZED, VLLM_LAYOUTS, Need, Sizes,
                                  allocated_groups, evaluate, shape_of)
from wna16_loader.layouts.spec import WordLayout
from wna16_loader.load.params import checkpoint_groups
from wna16_loader.testing.synthetic import quant_config

SIZES = Sizes(E=3, N13=2 * 96, H=128, I=192, I_p=96, bits=4, GH=4, GI=3, GH_eff=4, GI_eff=3, GI_all=6)


@pytest.mark.parametrize("expr, value", [("E", 3), ("2", 2), ("N13/P", 24), ("H/P8", 64), ("2*I_p/P", 24),
                                         ("I_p / P", 12), ("GI_eff", 3)])
def test_expressions_evaluate_left_to_right(expr, value):
    assert evaluate(expr, SIZES) == value


def test_a_division_with_a_remainder_raises_with_every_number():
    with pytest.raises(LayoutMismatchError, match=r"shape expression 'I_p/64': 96 is not divisible by 64 = 64"):
        evaluate("I_p/64", SIZES)


@pytest.mark.parametrize("k, group_size, allocated, stored", [
    (64, 32, 2, 2), (96, 32, 3, 3),  # G divides K: one count
    (80, 32, 2, 3), (48, 32, 1, 2), (48, 128, 0, 1),  # it does not: vLLM allocates floor, the checkpoint holds ceil
    (80, -1, 1, 1),  # channelwise: one group either way
])
def test_an_engine_allocates_floor_groups_where_a_checkpoint_stores_ceil(k, group_size, allocated, stored):
    """vLLM's create_weights sizes scales K // G (gptq_marlin: `hidden_size // group_size`); a checkpoint stores
    ceil(K / G), its last partial group with its own scale: the two counts differ exactly where G does not divide K."""
    spec = resolve_quant_spec(quant_config("gptq", group_size=group_size))
    assert allocated_groups(k, group_size) == allocated and checkpoint_groups(spec, k) == stored
    assert (allocated == stored) == (group_size == -1 or k % group_size == 0)


def test_auto_gptq_is_k_major_words():
    assert [shape_of(p, SIZES) for p in AUTO_GPTQ.params] == [
        (3, 16, 192), (3, 12, 128), (3, 4, 192), (3, 3, 128), (3, 4, 24), (3, 3, 16)]


def test_only_the_fused_rows_take_an_output_as_it_is():
    assert {row.name for row in VLLM_LAYOUTS if row.fused_as_is} == {MOE_WNA16.name, UNQUANTIZED.name}


@pytest.mark.parametrize("row, symmetric", [(MOE_WNA16, 4), (AUTO_GPTQ, 6), (AUTO_AWQ, 4), (CT_WNA16, 6),
                                            (UNQUANTIZED, 2)])
def test_zero_points_are_filled_as_declared(row, symmetric):
    """A symmetric layer fills AutoGPTQ's qzeros (with the midpoint) but not moe_wna16's or CT's."""
    assert len(row.filled(has_zero_point=False)) == symmetric
    assert len(row.filled(has_zero_point=True)) == len(row.params)
    assert all(p.need is Need.ZERO_POINTS_ALWAYS for p in AUTO_GPTQ.params if p.name.endswith("qzeros"))


def test_every_row_names_its_tp_dim_on_the_I_p_dimension():
    """The TP cut splits the dim holding I_p (N13 of w13, I_p of w2); the EP cut dim 0."""
    for row in VLLM_LAYOUTS:
        for param in row.params:
            if param.tp_dim is not None:
                assert any(s in param.shape[param.tp_dim] for s in ("N13", "I_p", "GI")), (row.name, param)
            assert param.ep_dim == 0 and param.shape[0] == "E"


@pytest.mark.parametrize("kind, text", [
    (dict(quantized=True, padded=False, reduced=False, asymmetric=True), "auto_gptq does not hold zero points"),
    (dict(quantized=True, padded=True, reduced=True, asymmetric=False),
     "auto_gptq does not hold padding columns (an I that TP does not split evenly) or a G_eff below the checkpoint's G"),
    (dict(quantized=False, padded=False, reduced=False, asymmetric=False),
     "auto_gptq holds quantized experts, the layer's are not"),
    (dict(quantized=True, padded=False, reduced=False, asymmetric=False, partial=True),
     "auto_gptq does not hold a partial last group"),
    (dict(quantized=True, padded=False, reduced=False, asymmetric=False), None),
])
def test_a_row_says_why_it_cannot_hold_a_layer(kind, text):
    """`MethodLayout.refusal`, derived from the row's declared fields (the serve line's per-layer answer)."""
    assert AUTO_GPTQ.refusal(**{"partial": False, "group_eff": 32, **kind}) == text


def test_moe_wna16_needs_g_32():
    assert MOE_WNA16.refusal(quantized=True, padded=False, reduced=True, asymmetric=True, partial=False,
                             group_eff=16) == "moe_wna16 does not hold G_eff 16 (it needs G >= 32)"


def _checkpoint_storage(config: dict) -> dict:
    spec = resolve_quant_spec(config)
    return {lay.role: WordLayout.of(lay, spec) for lay in spec.layouts}


@pytest.mark.parametrize("row, config, same", [
    (AUTO_GPTQ, gptq.to_config(4, 128, True, False), {"qweight", "scales", "qzeros"}),
    (AUTO_GPTQ, gptq.to_config(8, 128, False, False, checkpoint_format="gptq_v2"), {"qweight", "scales"}),
    (AUTO_AWQ, awq.to_config(4, 128, False, False), {"qweight", "scales", "qzeros"}),
    (CT_WNA16, compressed_tensors.to_config(4, 128, False, False), {"qweight", "scales", "qzeros"}),
    (AUTO_AWQ, gptq.to_config(4, 128, True, False), {"scales"}),  # GPTQ words are packed along K
    (MOE_WNA16, gptq.to_config(4, 128, True, False), set()),  # the fused bytes: no checkpoint's storage
])
def test_a_row_holds_a_checkpoints_own_words_where_the_storages_are_equal(row, config, same):
    storage = _checkpoint_storage(config)
    equal = {d.source.value for d in row.params if d.storage is not None and storage.get(d.storage.role) == d.storage}
    assert equal == same
    assert [d.storage for d in CT_WNA16.params if d.source.value == "shape"] == [None, None]


def test_gptq_v1_zero_points_carry_the_offset_the_auto_gptq_row_declares():
    v1 = _checkpoint_storage(gptq.to_config(4, 128, False, False))[Role.ZEROS]
    assert (v1.zero_offset, AUTO_GPTQ.params[4].storage.zero_offset) == (1, 1)
    assert WordLayout(Role.ZEROS, (Dim.GROUP, Dim.N), Dim.N, None, 1) == v1


def test_only_rows_sized_by_the_fused_group_counts_hold_a_partial_group():
    """`partial_groups` is derived from the declared shapes: the rows whose scales take GH_eff/GI_eff (the
    checkpoint's ceil) hold a G that leaves a partial group; those sized by vLLM's K // G do not."""
    assert {row.name: row.partial_groups for row in VLLM_LAYOUTS} == {
        "moe_wna16": True, "auto_gptq": False, "auto_awq": False, "ct_wna16": False, "unquantized": True}
