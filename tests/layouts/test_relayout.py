"""layouts.relayout: each vLLM row made from this package's fused layer equals what vLLM's default loader
puts in that method's parameters: the checkpoint's own tensors, cut for the rank on the row's TP dim and
stacked over experts (gate then up for w13), read here straight from a synthetic checkpoint's file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from wna16_loader import LayoutMismatchError, ParallelConfig, load_experts
from wna16_loader.formats.packing import word_bias
from wna16_loader.layouts import AUTO_AWQ, AUTO_GPTQ, CT_WNA16, MOE_WNA16, ParamDecl, shape_of
from wna16_loader.layouts.relayout import fill_param
from wna16_loader.layouts.spec import Half, Source
from wna16_loader.load.inplace import fused_name, layer_sizes
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

PREFIX = "model.layers.0.mlp.experts"
E, H, I = 4, 64, 128
SUFFIXES = {"gptq": {Source.QWEIGHT: "qweight", Source.SCALES: "scales", Source.ZEROS: "qzeros"},
            "awq": {Source.QWEIGHT: "qweight", Source.SCALES: "scales", Source.ZEROS: "qzeros"},
            "compressed-tensors": {Source.QWEIGHT: "weight_packed", Source.SCALES: "weight_scale",
                                   Source.ZEROS: "weight_zero_point", Source.SHAPE: "weight_shape"}}
CASES = [  # (format, bits, group, symmetric, row)
    ("gptq", 4, 32, True, AUTO_GPTQ), ("gptq", 4, 32, False, AUTO_GPTQ), ("gptq", 8, 32, False, AUTO_GPTQ),
    ("gptq", 8, -1, True, AUTO_GPTQ), ("awq", 4, 32, False, AUTO_AWQ), ("compressed-tensors", 4, 32, False, CT_WNA16),
    ("compressed-tensors", 8, 64, True, CT_WNA16), ("gptq", 4, 32, False, MOE_WNA16),
]


def vllm_param(tensors: dict, decl: ParamDecl, fmt: str, group: int, tp: int, rank: int) -> torch.Tensor:
    """The parameter as vLLM's loader fills it: each checkpoint tensor cut on `decl.tp_dim` (a channelwise
    w2 scale whole, a shape whole), gate then up concatenated there, stacked over experts."""
    projs = ("gate_proj", "up_proj") if decl.half is Half.W13 else ("down_proj",)
    dim, whole = decl.tp_dim - 1 if decl.tp_dim else 0, decl.source is Source.SHAPE or \
        (group == -1 and decl.half is Half.W2 and decl.source in (Source.SCALES, Source.ZEROS))
    experts = []
    for x in range(E):
        parts = [tensors[f"{PREFIX}.{x}.{p}.{SUFFIXES[fmt][decl.source]}"] for p in projs]
        if not whole:
            parts = [t.narrow(dim, rank * t.shape[dim] // tp, t.shape[dim] // tp) for t in parts]
        experts.append(parts[-1] if decl.source is Source.SHAPE else torch.cat(parts, dim=dim))
    return torch.stack(experts)


@pytest.mark.parametrize("fmt, bits, group, symmetric, row", CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_each_row_equals_the_checkpoint_as_vllm_stacks_it(tmp_path, fmt, bits, group, symmetric, row, tp):
    config = quant_config(fmt, bits=bits, group_size=group, symmetric=symmetric)
    written = write_checkpoint(tmp_path / "ckpt", config, num_experts=E, hidden=H, intermediate=I, seed=5)
    tensors = load_file(str(written.folder / "model.safetensors"))
    for rank in range(tp):
        fused = load_experts(written.folder, ParallelConfig(tp_size=tp, tp_rank=rank))[PREFIX]
        sizes = layer_sizes(fused.spec, group)
        for decl in row.filled(fused.has_zero_point):
            if row is MOE_WNA16:  # the fused layout itself
                assert fused.tensors[fused_name(decl)].shape == shape_of(decl, sizes)
                continue
            param = torch.empty(shape_of(decl, sizes), dtype=decl.dtype or torch.float16)
            nk = (I, H) if decl.half is Half.W13 else (H, I)
            fill_param(param, decl, fused.tensors.get(fused_name(decl)), bits=bits, shape_nk=nk)
            if decl.source is Source.ZEROS and symmetric:  # GPTQModel's qzeros of a symmetric layer: z - 1
                want = torch.full(param.shape, ((1 << (bits - 1)) - 1) * word_bias(bits), dtype=torch.int32)
            else:
                want = vllm_param(tensors, decl, fmt, group, tp, rank)
            assert torch.equal(param, want.to(param.dtype)), f"{row.name} {decl.name} tp{tp} rank{rank}"


def test_a_param_of_another_shape_is_refused_with_both_shapes(tmp_path):
    written = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", bits=4, group_size=32, symmetric=True),
                               num_experts=E, hidden=H, intermediate=I)
    fused = load_experts(written.folder, ParallelConfig(tp_size=1, tp_rank=0))[PREFIX]
    decl = AUTO_GPTQ.params[0]
    with pytest.raises(LayoutMismatchError, match=r"layer\.w13_qweight: the engine's parameter holds \[4, 8, 128\] "
                       r"per 4 experts, the rank's slice re-laid as \('E', 'H/P', 'N13'\) is \[4, 8, 256\]"):
        fill_param(torch.empty(4, 8, 128, dtype=torch.int32), decl, fused.w13_qweight, bits=4, label="layer")


def test_reduced_groups_are_taken_back_to_the_checkpoint_group_size():
    """A fused G_eff of G/2 repeats each group twice: the parameter at G takes every second one."""
    decl = AUTO_GPTQ.params[2]  # w13_scales [E, GH, N13]
    fused = torch.arange(2 * 4 * 6, dtype=torch.float16).reshape(2, 4, 6).repeat_interleave(2, dim=2)
    param = torch.empty(2, 6, 4, dtype=torch.float16)
    fill_param(param, decl, fused, bits=4)
    assert torch.equal(param, fused[..., ::2].transpose(1, 2))
    with pytest.raises(LayoutMismatchError, match=r"^layer\.w13_scales: the fused layer has 12 groups, the engine's "
                       r"parameter 5; 12 is not a multiple of 5"):
        fill_param(torch.empty(2, 5, 4, dtype=torch.float16), decl, fused, bits=4, label="layer")
