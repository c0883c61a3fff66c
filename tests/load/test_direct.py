"""load.direct: which layers' checkpoint words are copied as they are, and where each expert's slice lands
(the values against the fused route: tests/load/test_inplace.py)."""

from __future__ import annotations

import pytest
import torch

from wna16_loader import ParallelConfig, load_experts
from wna16_loader.layouts import AUTO_AWQ, AUTO_GPTQ, CT_WNA16, MOE_WNA16, shape_of
from wna16_loader.load.direct import direct_copies
from wna16_loader.load.experts import planned
from wna16_loader.load.inplace import layer_sizes
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


def copies_of(tmp_path, config: dict, row, parallel: ParallelConfig, intermediate: int = 128):
    folder = write_checkpoint(tmp_path / "ckpt", config, num_experts=4, hidden=64, intermediate=intermediate).folder
    layer = next(iter(load_experts(folder, parallel).values()))
    decls = row.filled(layer.has_zero_point)
    params = {d.name: torch.zeros(shape_of(d, layer_sizes(layer.spec, 32)), dtype=d.dtype or torch.float16)
              for d in decls}
    with planned(folder, parallel) as (_, _, _, plans):
        return direct_copies(plans[0], decls, params)


def test_each_expert_lands_in_its_slot_gate_then_up_along_n(tmp_path):
    copies = copies_of(tmp_path, quant_config("gptq", bits=4, symmetric=True), AUTO_GPTQ,
                       ParallelConfig(tp_size=2, tp_rank=1, ep_size=1))
    up = [c for c in copies if c.param == "w13_qweight" and c.ref.name.endswith("3.up_proj.qweight")]
    assert [(c.slot, c.into, c.index) for c in up] == [(3, (slice(None), slice(64, 128)),
                                                        (slice(0, 8), slice(64, 128)))]
    down = [c for c in copies if c.param == "w2_qweight" and c.slot == 0]
    assert [(c.into, c.index) for c in down] == [((slice(None), slice(0, 64)), (slice(8, 16), slice(0, 64)))]
    assert {c.param for c in copies} == {"w13_qweight", "w2_qweight", "w13_scales", "w2_scales"}  # z: the midpoint


@pytest.mark.parametrize("config, row", [
    (quant_config("gptq", bits=4, symmetric=False, checkpoint_format="gptq_v2"), AUTO_GPTQ),  # z without offset 1
    (quant_config("gptq", bits=4, symmetric=True, act_order=True), AUTO_GPTQ),
    (quant_config("awq", bits=4, symmetric=False), AUTO_GPTQ),  # AWQ's N words in a K-words row
    (quant_config("gptq", bits=4, symmetric=True), AUTO_AWQ),
    (quant_config("compressed-tensors", bits=4, symmetric=True), AUTO_GPTQ),  # N-major words in a K-major row
])
def test_a_layer_whose_words_differ_is_not_copied(tmp_path, config, row):
    assert copies_of(tmp_path, config, row, ParallelConfig(tp_size=2, tp_rank=0)) is None


def test_a_padded_rank_and_the_fused_bytes_are_not_copied(tmp_path):
    config = quant_config("gptq", bits=4, symmetric=True, group_size=32)
    assert copies_of(tmp_path / "a", config, AUTO_GPTQ, ParallelConfig(tp_size=4, tp_rank=3), 112) is None
    assert copies_of(tmp_path / "b", config, MOE_WNA16, ParallelConfig(tp_size=1, tp_rank=0)) is None
    assert copies_of(tmp_path / "c", quant_config("compressed-tensors", bits=8, symmetric=False), CT_WNA16,
                     ParallelConfig(tp_size=1, tp_rank=0)) is not None
    assert copies_of(tmp_path / "d", quant_config("awq", bits=4), AUTO_AWQ, ParallelConfig(tp_size=4, tp_rank=1)) \
        is not None
