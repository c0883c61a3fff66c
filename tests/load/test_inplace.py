"""load.inplace: an engine's parameters filled in place, layer by layer, from a checkpoint folder and from a
`wna16-shard` output, in each row's layout: equal to the row made from `load_experts`' fused layer (whose
maths tests/layouts/test_relayout.py checks against the checkpoint's own tensors); refusals name the layer."""

from __future__ import annotations

import pytest
import torch

from wna16_loader import ConfigError, LayoutMismatchError, ParallelConfig, load_experts
from wna16_loader.layouts import AUTO_GPTQ, MOE_WNA16, UNQUANTIZED, shape_of
from wna16_loader.layouts.relayout import fill_param
from wna16_loader.load.inplace import LayerTarget, fill_layers, fused_name, layer_sizes
from wna16_loader.preshard.run import preshard_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

PREFIXES = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("inplace")
    folder = write_checkpoint(root / "ckpt", quant_config("gptq", bits=4, group_size=32, symmetric=False),
                              num_experts=4, hidden=64, intermediate=128, num_layers=2, seed=3).folder
    shard = root / "shard"
    preshard_checkpoint(folder, shard, tp_size=2, progress=False)
    return folder, shard


def targets(fused: dict, row) -> dict[str, LayerTarget]:
    """Sentinel-filled parameters of `row` for every layer of a `load_experts` result."""
    out = {}
    for prefix, layer in fused.items():
        sizes = layer_sizes(layer.spec, 32)
        params = {d.name: torch.full(shape_of(d, sizes), 7, dtype=d.dtype or torch.float16)
                  for d in row.filled(layer.has_zero_point)}
        out[prefix] = LayerTarget(row, params, layer.spec.experts)
    return out


@pytest.mark.parametrize("row", [MOE_WNA16, AUTO_GPTQ])
@pytest.mark.parametrize("from_shard", [False, True])
def test_every_layer_is_filled_as_the_row_makes_it(source, row, from_shard):
    folder, shard = source
    config = ParallelConfig(tp_size=2, tp_rank=1)
    fused = load_experts(folder, config)
    want, got = targets(fused, row), targets(fused, row)
    for prefix, layer in fused.items():
        for decl in row.filled(layer.has_zero_point):
            fill_param(want[prefix].params[decl.name], decl, layer.tensors.get(fused_name(decl)), bits=4)
    report = fill_layers(shard if from_shard else folder, config, got)
    assert report.layers == {prefix: row.name for prefix in PREFIXES}
    assert (report.scratch_bytes == 0) == row.fused_as_is
    for prefix in PREFIXES:
        for name, param in want[prefix].params.items():
            assert torch.equal(got[prefix].params[name], param), f"{prefix}.{name}"
    assert bool(report.ignored) != from_shard  # a checkpoint's non-expert tensors go back to the engine


def test_a_layer_without_a_target_is_left_alone(source):
    folder, _ = source
    config = ParallelConfig(tp_size=1, tp_rank=0)
    only = {PREFIXES[1]: targets(load_experts(folder, config), MOE_WNA16)[PREFIXES[1]]}
    assert fill_layers(folder, config, only).layers == {PREFIXES[1]: "moe_wna16"}


def test_a_target_the_source_has_not_is_refused(source):
    folder, _ = source
    config = ParallelConfig(tp_size=1, tp_rank=0)
    some = targets(load_experts(folder, config), MOE_WNA16)
    with pytest.raises(ConfigError, match=r"the engine's MoE layers \['model\.layers\.7\.mlp\.experts'\] are not "
                       r"among its experts prefixes"):
        fill_layers(folder, config, {"model.layers.7.mlp.experts": some[PREFIXES[0]]})


def test_other_experts_or_shapes_are_refused_by_name(source):
    folder, _ = source
    config = ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=1)
    good = targets(load_experts(folder, config), AUTO_GPTQ)
    placed = {p: LayerTarget(t.layout, t.params, (0, 1)) for p, t in good.items()}
    with pytest.raises(LayoutMismatchError, match=r"model\.layers\.0\.mlp\.experts: the engine holds experts \[0, 1\] "
                       r"on this rank, the load places \[2, 3\]"):
        fill_layers(folder, config, placed)
    wrong = {p: LayerTarget(t.layout, {**t.params, "w2_scales": torch.zeros(2, 2, 64)}, t.experts)
             for p, t in good.items()}
    with pytest.raises(LayoutMismatchError, match=r"the engine's auto_gptq parameters do not fit this rank's layer "
                       r".*w2_scales \[2, 2, 64\] \(declared \['E', 'GI', 'H'\] = \[2, 4, 64\]\)"):
        fill_layers(folder, config, wrong)
    floats = {p: LayerTarget(UNQUANTIZED, t.params, t.experts) for p, t in good.items()}
    with pytest.raises(LayoutMismatchError, match=r"the engine's MoE method is unquantized but the checkpoint's "
                       r"experts here are quantized; load it with the engine's own loader"):
        fill_layers(folder, config, floats)
