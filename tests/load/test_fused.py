"""fused: the writer's slots and rows (tensors and `NibbleWords`), the layout table, dequantisation.

Expected values are written by hand or come from plain torch (`Tensor.copy_`), never from the
function under test.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import random_tensor

from wna16_loader import FormatError, ParallelConfig
from wna16_loader.formats import resolve_quant_spec
from wna16_loader.formats.awq import AWQ_ORDER
from wna16_loader.formats.packing import NibbleWords, transpose_nibble_words
from wna16_loader.load.fused import FusedExperts, FusedSpec, FusedWriter, dequantize
from wna16_loader.load.padfill import real_groups
from wna16_loader.load.params import ProjectionParams
from wna16_loader.models.names import Proj
from wna16_loader.parallel.partition import LayerGeometry, Span
from wna16_loader.testing.synthetic import quant_config

P = "model.layers.0.mlp.experts"


# --- FusedWriter ------------------------------------------------------------------------------------------------

EXPERTS = (4, 5, 6, 7)
HID, INTER, PART, GROUP = 32, 32, 16, 16  # tp 2: I_p = 16, two groups along H, one along I_p


def spec(bits: int = 4, *, act_order: bool = True, zero: bool = True) -> FusedSpec:
    return FusedSpec(experts=EXPERTS, hidden=HID, part=PART, intermediate=INTER, bits=bits, group_size=GROUP,
                     w13_groups=HID // GROUP, w2_groups=INTER // GROUP if act_order else PART // GROUP,
                     has_zero_point=zero, act_order=act_order, scale_dtype=torch.float16)


def sentinel_writer(fused: FusedSpec) -> FusedWriter:
    """A writer over staging buffers filled with a sentinel (0xEE bytes, -1 scales / g_idx)."""
    staging = {name: (torch.full(shape, -1, dtype=dtype) if dtype != torch.uint8 else
                      torch.full(shape, 0xEE, dtype=dtype)) for name, (shape, dtype) in fused.shapes().items()}
    return FusedWriter(P, fused, "cpu", staging=staging)


def params(experts: tuple[int, ...], rows: int, groups: int, k: int, tag: int) -> ProjectionParams:
    """Scales e + tag/8 + row/1000, zeros (e + row + tag) % 16, g_idx a per-expert roll of k // G."""
    e = torch.tensor(experts, dtype=torch.float32).view(-1, 1, 1)
    r = torch.arange(rows, dtype=torch.float32).view(1, -1, 1)
    scales = (e + tag / 8 + r / 1000 + torch.zeros(1, 1, groups)).to(torch.float16)
    zeros = ((e + r + tag + torch.zeros(1, 1, groups)).to(torch.int64) % 16).to(torch.uint8)
    g_idx = torch.stack([torch.roll(torch.arange(k) // GROUP, x) for x in experts]).to(torch.int32)
    return ProjectionParams(scales=scales, zeros=zeros, g_idx=g_idx)


def pack_rows(zeros: torch.Tensor) -> torch.Tensor:
    """4-bit zero points packed along N (dim 1) by hand: byte r = z[2r] | z[2r+1] << 4."""
    return zeros[:, 0::2] | (zeros[:, 1::2] << 4)


def labels(experts: tuple[int, ...], proj: Proj) -> list[str]:
    return [f"{P}.{e}.{proj.value}" for e in experts]


def test_writer_rows_and_slots() -> None:
    writer = sentinel_writer(spec())
    assert writer.rows(Proj.GATE) == ("w13", slice(0, 16), slice(0, 8))
    assert writer.rows(Proj.UP) == ("w13", slice(16, 32), slice(8, 16))
    assert writer.rows(Proj.DOWN) == ("w2", slice(None), slice(None))
    assert writer.slots([5, 6, 7]) == slice(1, 4)
    assert sentinel_writer(spec(8)).rows(Proj.UP) == ("w13", slice(16, 32), slice(16, 32))
    assert writer.staging["expert_ids"].tolist() == list(EXPERTS)


def test_write_params_lands_in_its_slots_and_rows() -> None:
    """gate/up/down params of experts 5, 6 fill slots 1, 2 only; gate rows [0, I_p), up [I_p, 2 I_p)."""
    writer, run = sentinel_writer(spec()), (5, 6)
    gate, up = params(run, PART, 2, HID, tag=1), params(run, PART, 2, HID, tag=2)
    up = ProjectionParams(up.scales, up.zeros, gate.g_idx)  # gate and up share w13_g_idx
    down = params(run, HID, 2, PART, tag=3)
    for proj, p in ((Proj.GATE, gate), (Proj.UP, up), (Proj.DOWN, down)):
        writer.write_params(run, proj, p, labels=labels(run, proj))
    s = writer.staging
    assert torch.equal(s["w13_scales"][1:3], torch.cat([gate.scales, up.scales], dim=1))
    assert torch.equal(s["w13_qzeros"][1:3], torch.cat([pack_rows(gate.zeros), pack_rows(up.zeros)], dim=1))
    assert torch.equal(s["w13_g_idx"][1:3], gate.g_idx)
    assert torch.equal(s["w2_scales"][1:3], down.scales) and torch.equal(s["w2_g_idx"][1:3], down.g_idx)
    assert torch.equal(s["w2_qzeros"][1:3], pack_rows(down.zeros))
    for name in ("w13_scales", "w2_scales", "w13_g_idx", "w2_g_idx"):
        assert (s[name][[0, 3]] == -1).all(), name
    for name in ("w13_qzeros", "w2_qzeros", "w13_qweight", "w2_qweight"):
        assert (s[name][[0, 3]] == 0xEE).all(), name


def test_write_params_symmetric_writes_only_scales() -> None:
    """Without zero points or g_idx only scales are written, for up of experts 4..7."""
    writer = sentinel_writer(spec(act_order=False, zero=False))
    up = params(EXPERTS, PART, 2, HID, tag=5)
    writer.write_params(EXPERTS, Proj.UP, ProjectionParams(up.scales, None, None), labels=labels(EXPERTS, Proj.UP))
    assert torch.equal(writer.staging["w13_scales"][:, PART:], up.scales)
    assert (writer.staging["w13_scales"][:, :PART] == -1).all()
    assert "w13_qzeros" not in writer.staging and "w13_g_idx" not in writer.staging


def test_write_qweight_lands_in_its_slots_and_rows() -> None:
    """uint8 bytes for gate, int32 words (a transposed view) for up, uint8 for down."""
    writer, run = sentinel_writer(spec()), (6, 7)
    gate = (torch.tensor(run, dtype=torch.uint8).view(2, 1, 1) * 16 + torch.zeros(2, PART, HID // 2,
                                                                                   dtype=torch.uint8))
    up_words = random_tensor((2, HID // 8, PART), torch.int32, seed=9).transpose(1, 2)  # [2, I_p, H/8] words
    down = random_tensor((2, HID, PART // 2), torch.uint8, seed=10)
    writer.write_qweight(run, Proj.GATE, gate)
    writer.write_qweight(run, Proj.UP, up_words)
    writer.write_qweight(run, Proj.DOWN, down)
    s = writer.staging
    assert torch.equal(s["w13_qweight"][2:4, :PART], gate)
    assert torch.equal(s["w13_qweight"][2:4, PART:], up_words.contiguous().view(torch.uint8))
    assert torch.equal(s["w2_qweight"][2:4], down)
    assert (s["w13_qweight"][:2] == 0xEE).all() and (s["w2_qweight"][:2] == 0xEE).all()


@pytest.mark.parametrize("proj", [Proj.GATE, Proj.UP, Proj.DOWN])
def test_write_qweight_nibble_words_land_like_their_transpose(proj: Proj) -> None:
    """`NibbleWords` (4-bit words packed along N, AWQ slot order) are transposed straight into their rows:
    the same bytes as writing their fresh transpose, the bytes counted, nothing else touched."""
    rows, k = (HID, PART) if proj is Proj.DOWN else (PART, HID)
    words = random_tensor((2, k, rows // 8), torch.int32, seed=12) * 21474837  # [E, K, N/8]
    lazy, fresh = sentinel_writer(spec()), sentinel_writer(spec())
    lazy.write_qweight((6, 7), proj, NibbleWords(words, AWQ_ORDER, 0, rows))
    fresh.write_qweight((6, 7), proj, transpose_nibble_words(words, slot_order=AWQ_ORDER))
    name = "w2_qweight" if proj is Proj.DOWN else "w13_qweight"
    assert torch.equal(lazy.staging[name], fresh.staging[name])
    assert lazy.bytes_written == fresh.bytes_written == 2 * rows * k // 2
    assert (lazy.staging[name][:2] == 0xEE).all() and (lazy.staging[name][2:4] != 0xEE).any()


@pytest.mark.parametrize("proj", [Proj.UP, Proj.DOWN])
def test_write_qweight_n_slabs_land_at_their_rows(proj: Proj) -> None:
    """Two slabs of rows ([0, 8) as int32 words, then [8, N_l)) fill the same bytes as one write."""
    rows = HID if proj is Proj.DOWN else PART
    cols = (PART if proj is Proj.DOWN else HID) // 2
    whole = random_tensor((2, rows, cols), torch.uint8, seed=11)
    sliced, once = sentinel_writer(spec()), sentinel_writer(spec())
    once.write_qweight((6, 7), proj, whole)
    sliced.write_qweight((6, 7), proj, whole[:, 8:], n=Span(8, rows))
    sliced.write_qweight((6, 7), proj, whole[:, :8].view(torch.int32), n=Span(0, 8))
    name = "w2_qweight" if proj is Proj.DOWN else "w13_qweight"
    assert torch.equal(sliced.staging[name], once.staging[name])
    assert (sliced.staging[name][:2] == 0xEE).all()


@pytest.mark.parametrize("run", [(4, 6), (6, 5), (5, 5)])
def test_writer_refuses_non_consecutive_experts(run: tuple[int, int]) -> None:
    writer = sentinel_writer(spec())
    with pytest.raises(AssertionError, match="are not consecutive slots"):
        writer.write_params(run, Proj.GATE, params(run, PART, 2, HID, tag=0), labels=labels(run, Proj.GATE))
    with pytest.raises(AssertionError, match="are not consecutive slots"):
        writer.write_qweight(run, Proj.DOWN, torch.zeros(2, HID, PART // 2, dtype=torch.uint8))


def test_gate_then_up_same_g_idx_is_accepted() -> None:
    writer = sentinel_writer(spec())
    p = params(EXPERTS, PART, 2, HID, tag=0)
    writer.write_params(EXPERTS, Proj.GATE, p, labels=labels(EXPERTS, Proj.GATE))
    writer.write_params(EXPERTS, Proj.UP, p, labels=labels(EXPERTS, Proj.UP))
    assert torch.equal(writer.staging["w13_g_idx"], p.g_idx)


def test_up_g_idx_differing_in_third_expert_names_it() -> None:
    writer = sentinel_writer(spec())
    gate = params(EXPERTS, PART, 2, HID, tag=0)
    writer.write_params(EXPERTS, Proj.GATE, gate, labels=labels(EXPERTS, Proj.GATE))
    g_idx = gate.g_idx.clone()
    g_idx[2] = torch.arange(HID) // GROUP  # expert 6 (3rd of the batch)
    g_idx[3] = torch.arange(HID).flip(0) // GROUP  # expert 7 differs too; the first one is reported
    with pytest.raises(FormatError, match=re.escape(f"{P}.6.up: its g_idx differs from that of {P}.6.gate; gate "
                                                    f"and up of one expert share w13_g_idx")):
        writer.write_params(EXPERTS, Proj.UP, ProjectionParams(gate.scales, gate.zeros, g_idx),
                            labels=labels(EXPERTS, Proj.UP))


def test_mixed_run_of_owned_and_new_g_idx() -> None:
    """gate wrote expert 5 only; up for 4, 5, 6 takes 4 and 6 and is checked against 5's owner."""
    writer = sentinel_writer(spec())
    full = params(EXPERTS, PART, 2, HID, tag=0)
    writer.write_params((5,), Proj.GATE, ProjectionParams(full.scales[1:2], full.zeros[1:2], full.g_idx[1:2]),
                        labels=labels((5,), Proj.GATE))
    writer.write_params((4, 5, 6), Proj.UP, ProjectionParams(full.scales[:3], full.zeros[:3], full.g_idx[:3]),
                        labels=labels((4, 5, 6), Proj.UP))
    assert torch.equal(writer.staging["w13_g_idx"][:3], full.g_idx[:3])
    assert (writer.staging["w13_g_idx"][3] == -1).all()
    other = full.g_idx[:3].clone()
    other[0] = torch.arange(HID) // GROUP
    with pytest.raises(FormatError, match=re.escape(f"{P}.4.gate: its g_idx differs from that of {P}.4.up;")):
        writer.write_params((4, 5, 6, 7), Proj.GATE,
                            ProjectionParams(full.scales, full.zeros, torch.cat([other, full.g_idx[3:]])),
                            labels=labels(EXPERTS, Proj.GATE))


def test_mixed_run_disagreement_names_owned_expert() -> None:
    writer = sentinel_writer(spec())
    full = params(EXPERTS, PART, 2, HID, tag=0)
    writer.write_params((6,), Proj.UP, ProjectionParams(full.scales[2:3], full.zeros[2:3], full.g_idx[2:3]),
                        labels=labels((6,), Proj.UP))
    bad = full.g_idx.clone()
    bad[2] = torch.arange(HID) // GROUP
    with pytest.raises(FormatError, match=re.escape(f"{P}.6.gate: its g_idx differs from that of {P}.6.up;")):
        writer.write_params(EXPERTS, Proj.GATE, ProjectionParams(full.scales, full.zeros, bad),
                            labels=labels(EXPERTS, Proj.GATE))


# --- FusedSpec.shapes ---------------------------------------------------------------------------------------------

def fused_spec(fmt: str, *, symmetric: bool, act_order: bool, tp: int = 2, bits: int = 4) -> FusedSpec:
    """H = 128, I = 192, G = 128 at tp 2 rank 1 of 2 EP ranks (experts 2, 3 of 4): I_p = 96, G_eff = 32."""
    quant = resolve_quant_spec(quant_config(fmt, bits=bits, group_size=128, symmetric=symmetric,
                                            act_order=act_order))
    geo = LayerGeometry(hidden=128, intermediate=192, num_experts=4, bits=bits, group_size=128, act_order=act_order,
                        parallel=ParallelConfig(tp_size=tp, tp_rank=tp - 1, ep_size=2, ep_rank=1))
    return FusedSpec.of(geo, quant, torch.bfloat16)


def test_shapes_symmetric() -> None:
    assert fused_spec("awq", symmetric=True, act_order=False).shapes() == {
        "w13_qweight": ((2, 192, 64), torch.uint8),
        "w2_qweight": ((2, 128, 48), torch.uint8),
        "w13_scales": ((2, 192, 4), torch.bfloat16),  # H / G_eff = 128 / 32
        "w2_scales": ((2, 128, 3), torch.bfloat16),  # I_p / G_eff = 96 / 32
        "expert_ids": ((2,), torch.int32),
    }


def test_shapes_asymmetric_8_bit() -> None:
    shapes = fused_spec("gptq", symmetric=False, act_order=False, bits=8).shapes()
    assert shapes == {
        "w13_qweight": ((2, 192, 128), torch.uint8),
        "w2_qweight": ((2, 128, 96), torch.uint8),
        "w13_scales": ((2, 192, 4), torch.bfloat16),
        "w2_scales": ((2, 128, 3), torch.bfloat16),
        "w13_qzeros": ((2, 192, 4), torch.uint8),
        "w2_qzeros": ((2, 128, 3), torch.uint8),
        "expert_ids": ((2,), torch.int32),
    }


def test_shapes_act_order() -> None:
    """Act-order keeps G (no G_eff), w2 scales cover all of I's groups, g_idx rows per expert."""
    assert fused_spec("compressed-tensors", symmetric=False, act_order=True).shapes() == {
        "w13_qweight": ((2, 192, 64), torch.uint8),
        "w2_qweight": ((2, 128, 48), torch.uint8),
        "w13_scales": ((2, 192, 1), torch.bfloat16),
        "w2_scales": ((2, 128, 2), torch.bfloat16),  # ceil(192 / 128)
        "w13_qzeros": ((2, 96, 1), torch.uint8),
        "w2_qzeros": ((2, 64, 2), torch.uint8),
        "w13_g_idx": ((2, 128), torch.int32),
        "w2_g_idx": ((2, 96), torch.int32),
        "expert_ids": ((2,), torch.int32),
    }


def test_padded_spec_gemma4_tp8_shapes_are_uniform_and_report_padding() -> None:
    """I = 704, G = 128 at TP 8 pads to I' = 768: every rank I_p' = 96 columns, G_eff = 32; rank 7 holds
    checkpoint columns 672..703 and 64 of padding."""
    quant = resolve_quant_spec(quant_config("gptq", group_size=128))
    specs = [FusedSpec.of(LayerGeometry(hidden=128, intermediate=704, num_experts=4, bits=4, group_size=128,
                                        act_order=False, parallel=ParallelConfig(tp_size=8, tp_rank=r)),
                          quant, torch.float16) for r in range(8)]
    assert all(spec.shapes() == specs[0].shapes() for spec in specs)
    assert specs[0].shapes()["w2_scales"] == ((4, 128, 3), torch.float16)  # 96 / 32
    assert specs[0].shapes()["w13_qweight"] == ((4, 192, 64), torch.uint8)
    assert [spec.padding for spec in specs] == [0] * 7 + [64]
    last = specs[7]
    assert (last.intermediate_size, last.intermediate_size_per_partition, last.real) == (704, 96, 32)
    assert (real_groups(last, "w2"), real_groups(specs[0], "w2")) == (1, 3)
    tensors = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in last.shapes().items()}
    layer = FusedExperts(P, last, tensors)
    assert (layer.intermediate_size, layer.intermediate_size_per_partition, layer.padding) == (704, 96, 64)


# --- dequantize ---------------------------------------------------------------------------------------------------

Q = [[1, 2, 3, 4], [5, 6, 7, 8]]  # [N = 2, K = 4], group size 2
QW = torch.tensor([[[1 | 2 << 4, 3 | 4 << 4], [5 | 6 << 4, 7 | 8 << 4]]], dtype=torch.uint8)  # packed along K
SCALES = torch.tensor([[[0.5, 1.0], [2.0, 0.25]]], dtype=torch.float16)  # [1, N, nG]
ZEROS = torch.tensor([[[1 | 3 << 4, 2 | 4 << 4]]], dtype=torch.uint8)  # z = [[1, 2], [3, 4]] packed along N


def test_dequantize_with_zeros() -> None:
    out = dequantize(QW, SCALES, ZEROS, None, bits=4, group_size=2)
    assert out.dtype == torch.float32
    assert out.tolist() == [[[0.0, 0.5, 1.0, 2.0], [4.0, 6.0, 0.75, 1.0]]]


def test_dequantize_with_g_idx() -> None:
    g_idx = torch.tensor([[1, 0, 1, 0]], dtype=torch.int32)
    out = dequantize(QW, SCALES, ZEROS, g_idx, bits=4, group_size=2)
    assert out.tolist() == [[[-1.0, 0.5, 1.0, 1.5], [0.25, 6.0, 0.75, 10.0]]]


def test_dequantize_symmetric_and_channelwise() -> None:
    """No zero points: z = 2^(b-1) = 8; channelwise: every column uses group 0."""
    out = dequantize(QW, SCALES, None, None, bits=4, group_size=2)
    assert out.tolist() == [[[-3.5, -3.0, -5.0, -4.0], [-6.0, -4.0, -0.25, 0.0]]]
    out = dequantize(QW, SCALES[:, :, :1], ZEROS[:, :, :1], None, bits=4, group_size=-1)
    assert out.tolist() == [[[0.0, 0.5, 1.0, 1.5], [4.0, 6.0, 8.0, 10.0]]]


def test_dequantize_8_bit() -> None:
    q = torch.tensor([[[200, 10]]], dtype=torch.uint8)
    out = dequantize(q, torch.tensor([[[0.5]]]), torch.tensor([[[100]]], dtype=torch.uint8), None, bits=8,
                     group_size=-1)
    assert out.tolist() == [[[50.0, -45.0]]]
