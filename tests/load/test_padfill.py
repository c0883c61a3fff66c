"""padfill: what padded columns hold (hand-computed), and padded layouts end to end.

Unit tests fill a writer's sentinel staging through `write_params` and compare every padded
byte with values written out by hand. End-to-end tests load synthetic checkpoints of real
shapes (Gemma 4: I = 704, G = 128; I = 1408, G = 128) at TP sizes the unpadded rule refuses:
every rank's real columns stitch back to the quantizer's reference bit for bit, padding
dequantises to exactly 0, and the sum of every rank's reference forward equals the
unsharded forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_exact, load_all_ranks, stitch

from wna16_loader import Activation, ParallelConfig, load_experts, reference_forward
from wna16_loader.formats.packing import unpack_bytes
from wna16_loader.load.fused import FusedSpec, FusedWriter
from wna16_loader.load.padfill import fill_padding, pad_byte, pad_value, padding_bytes, real_groups
from wna16_loader.load.params import ProjectionParams
from wna16_loader.models.names import Proj
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

P = "model.layers.0.mlp.experts"
HID, PART, G_EFF = 32, 48, 16


def padded_spec(real: int, *, zero: bool = True, act_order: bool = False, groups: int = 3) -> FusedSpec:
    """Two experts, H = 32, I_p' = 48 of which the first `real` columns are the checkpoint's."""
    return FusedSpec(experts=(0, 1), hidden=HID, part=PART, intermediate=104, bits=4,
                     group_size=32 if act_order else G_EFF, w13_groups=HID // G_EFF, w2_groups=groups,
                     has_zero_point=zero, act_order=act_order, scale_dtype=torch.float16, padding=PART - real)


def sentinel_writer(spec: FusedSpec) -> FusedWriter:
    staging = {name: (torch.full(shape, -1, dtype=dtype) if dtype != torch.uint8 else
                      torch.full(shape, 0xEE, dtype=dtype)) for name, (shape, dtype) in spec.shapes().items()}
    return FusedWriter(P, spec, "cpu", staging=staging)


def nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    return unpack_bytes(packed, bits=4, dim=dim)


def test_pad_values_and_bytes() -> None:
    assert [pad_value(4, True), pad_value(4, False), pad_value(8, False)] == [0, 8, 128]
    assert [pad_byte(0, 4), pad_byte(8, 4), pad_byte(128, 8), pad_byte(3, 4)] == [0, 0x88, 0x80, 0x33]


def test_spec_real_columns_and_groups() -> None:
    spec = padded_spec(8)
    assert (spec.intermediate_size, spec.intermediate_size_per_partition, spec.padding, spec.real) == (104, 48, 40, 8)
    assert (real_groups(spec, "w13"), real_groups(spec, "w2")) == (2, 1)  # w2 columns 0..7 sit in fused group 0
    assert real_groups(padded_spec(0), "w2") == 0 and real_groups(padded_spec(48), "w2") == 3
    assert real_groups(padded_spec(8, act_order=True, groups=4), "w2") == 4  # act-order: every group of I


def test_gate_padding_rows_asymmetric() -> None:
    """Gate of a rank with 8 real rows of 48: rows 8..47 get scale 1, zero point 0, weights 0."""
    writer = sentinel_writer(padded_spec(8))
    scales = torch.full((2, 8, 2), 0.5, dtype=torch.float16)
    zeros = torch.full((2, 8, 2), 5, dtype=torch.uint8)
    writer.write_params((0, 1), Proj.GATE, ProjectionParams(scales, zeros, None), labels=["g0", "g1"])
    s = writer.staging
    assert (s["w13_scales"][:, :8] == 0.5).all() and (s["w13_scales"][:, 8:48] == 1).all()
    assert (nibbles(s["w13_qzeros"], 1)[:, :8] == 5).all() and (s["w13_qzeros"][:, 4:24] == 0).all()
    assert (s["w13_qweight"][:, 8:48] == 0).all()
    assert (s["w13_qweight"][:, :8] == 0xEE).all(), "real rows are left to write_qweight"
    assert (s["w13_scales"][:, 48:] == -1).all() and (s["w13_qweight"][:, 48:] == 0xEE).all(), "up untouched"


def test_up_padding_rows_symmetric() -> None:
    """Symmetric: padded weights hold the implicit zero 8 (bytes 0x88); no zero points are stored."""
    writer = sentinel_writer(padded_spec(8, zero=False))
    writer.write_params((0, 1), Proj.UP, ProjectionParams(torch.ones(2, 8, 2, dtype=torch.float16), None, None),
                        labels=["u0", "u1"])
    s = writer.staging
    assert (s["w13_qweight"][:, 56:] == 0x88).all() and (s["w13_scales"][:, 56:] == 1).all()
    assert (s["w13_qweight"][:, :56] == 0xEE).all()


def test_down_padding_in_a_real_group_takes_its_zero_point() -> None:
    """w2 with 8 real columns, G_eff = 16: columns 8..15 share fused group 0 with real ones (its real scale
    and zero point stay, padded weights = that zero point); columns 16..47 are groups 1, 2 of padding."""
    writer = sentinel_writer(padded_spec(8))
    z = torch.arange(2 * HID, dtype=torch.int64).view(2, HID, 1).remainder(16).to(torch.uint8)
    writer.write_params((0, 1), Proj.DOWN, ProjectionParams(torch.full((2, HID, 1), 0.25, dtype=torch.float16), z,
                                                            None), labels=["d0", "d1"])
    s = writer.staging
    assert (s["w2_scales"][:, :, 0] == 0.25).all() and (s["w2_scales"][:, :, 1:] == 1).all()
    zeros = nibbles(s["w2_qzeros"], 1)
    assert torch.equal(zeros[:, :, 0:1], z) and (zeros[:, :, 1:] == 0).all()
    weights = nibbles(s["w2_qweight"], 2)
    for e in range(2):
        for n in range(HID):
            assert weights[e, n, 8:16].tolist() == [int(z[e, n, 0])] * 8
            assert weights[e, n, 16:].tolist() == [0] * 32
    assert (s["w2_qweight"][:, :, :4] == 0xEE).all(), "real columns are left to write_qweight"


def test_down_padding_act_order_points_at_group_0() -> None:
    """Act-order w2 keeps every group of I; padded g_idx rows are 0 and padded weights = z of group 0."""
    writer = sentinel_writer(padded_spec(8, act_order=True, groups=4))
    z = (torch.arange(2 * HID * 4, dtype=torch.int64).view(2, HID, 4) % 13 + 1).to(torch.uint8)
    g_idx = torch.tensor([[3, 1, 0, 2, 2, 0, 1, 3]] * 2, dtype=torch.int32)
    scales = torch.full((2, HID, 4), 0.5, dtype=torch.float16)
    writer.write_params((0, 1), Proj.DOWN, ProjectionParams(scales, z, g_idx), labels=["d0", "d1"])
    s = writer.staging
    assert torch.equal(s["w2_g_idx"][:, :8], g_idx) and (s["w2_g_idx"][:, 8:] == 0).all()
    assert (s["w2_scales"] == 0.5).all() and torch.equal(nibbles(s["w2_qzeros"], 1), z)
    weights = nibbles(s["w2_qweight"], 2)
    assert torch.equal(weights[:, :, 8:], z[:, :, :1].expand(2, HID, 40))


def test_all_padding_rank_reads_nothing_and_dequantises_to_zero(tmp_path: Path) -> None:
    """Gemma-4 shape at TP 16: rank 15 starts at 720 > I = 704 and holds only padding."""
    write_checkpoint(tmp_path, quant_config("gptq", group_size=128), hidden=128, intermediate=704, num_experts=2)
    loaded = load_experts(tmp_path, ParallelConfig(tp_size=16, tp_rank=15))
    layer = loaded[P]
    assert (layer.intermediate_size, layer.intermediate_size_per_partition, layer.padding) == (704, 48, 48)
    deq = layer.dequantize()
    assert deq.w13.shape == (2, 96, 128) and deq.w2.shape == (2, 128, 48)
    assert not deq.w13.any() and not deq.w2.any()
    assert loaded.report.bytes_read == 0


@pytest.mark.parametrize("real,zero,act_order,groups", [(8, True, False, 3), (0, True, False, 3),
                                                        (8, False, False, 3), (8, True, True, 4), (40, True, False, 3)])
def test_padding_bytes_counts_what_fill_padding_writes(real: int, zero: bool, act_order: bool, groups: int) -> None:
    """Every byte `fill_padding` writes, found by filling from two different sentinels, is counted once."""
    spec = padded_spec(real, zero=zero, act_order=act_order, groups=groups)
    written: dict[str, torch.Tensor] = {}
    for sentinel in (0x11, 0x77):
        staging = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in spec.shapes().items()}
        for tensor in staging.values():
            tensor.view(torch.uint8).fill_(sentinel)
        writer = FusedWriter(P, spec, "cpu", staging=staging)  # writes expert_ids
        before = {name: tensor.view(torch.uint8).clone() for name, tensor in staging.items()}
        for proj in Proj:
            zeros = torch.full((2, HID, real_groups(spec, "w2")) if proj is Proj.DOWN else (2, real, 2), 3,
                               dtype=torch.uint8)
            fill_padding(staging, spec, slice(0, 2), writer.rows(proj), zeros if zero else None)
        for name, tensor in staging.items():
            changed = tensor.view(torch.uint8) != before[name]
            written[name] = written[name] | changed if name in written else changed
    assert sum(int(mask.sum()) for mask in written.values()) == padding_bytes(spec)


# --- end to end: real shapes at padded TP sizes ----------------------------------------------------------------

CASES = [  # (format config, I, tp, ep): Gemma 4 at TP 8 and 16, I = 1408 at TP 3, 5, 6, act-order GPTQ at TP 3
    ("gptq", {}, 704, 8, 1),
    ("awq", {}, 704, 16, 1),
    ("compressed-tensors", {}, 1408, 3, 2),
    ("compressed-tensors", {"symmetric": True}, 1408, 5, 1),
    ("auto-round", {}, 1408, 6, 1),
    ("gptq", {"act_order": True}, 704, 3, 1),
    ("gptq", {"act_order": True, "bits": 8}, 1408, 3, 1),
]


def forward_inputs(hidden: int, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, hidden, generator=gen) / 8
    weights, ids = torch.rand(16, experts, generator=gen).softmax(-1).topk(2)
    return x, ids, weights


@pytest.mark.parametrize("fmt,extra,inter,tp,ep", CASES, ids=[f"{c[0]}{c[1]}-I{c[2]}-tp{c[3]}-ep{c[4]}" for c in CASES])
def test_padded_layout_end_to_end(tmp_path: Path, fmt: str, extra: dict, inter: int, tp: int, ep: int) -> None:
    ckpt = write_checkpoint(tmp_path, quant_config(fmt, group_size=128, **extra), hidden=128, intermediate=inter,
                            num_experts=4)
    loads = load_all_ranks(tmp_path, tp, ep)
    layers = [loaded[P] for loaded in loads.values()]
    part = -(-inter // (16 * tp)) * 16  # I'/tp, I' the smallest multiple of 16 tp >= I
    assert {layer.intermediate_size_per_partition for layer in layers} == {part}
    assert {tuple(t.shape[1:]) for layer in layers for t in layer.tensors.values() if t.dim() > 1} == \
        {tuple(t.shape[1:]) for t in layers[0].tensors.values() if t.dim() > 1}, "uniform shapes over ranks"
    assert sum(layer.padding for layer in layers) == ep * (tp * part - inter)
    weights, _ = stitch(loads, tp)  # checks that every rank's padding dequantises to exactly 0
    assert_exact(weights, ckpt.references)
    x, ids, topk = forward_inputs(128, 4)
    unsharded = load_experts(tmp_path, ParallelConfig(1, 0))[P]
    expected = reference_forward(unsharded.dequantize(), unsharded.spec.experts, x, ids, topk, Activation.GELU_TANH)
    total = sum(reference_forward(layer.dequantize(), layer.spec.experts, x, ids, topk, Activation.GELU_TANH)
                for layer in layers)
    scale = float(expected.abs().max())  # float32 sums over 704..1408 products, in another order per rank
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("tp", [3, 5])
def test_non_gated_experts_pad(tmp_path: Path, tp: int) -> None:
    """Nemotron-H's up-only experts (relu2, I = 64) at tp 3 / 5: I' = 96 / 80; relu2(0) = 0 keeps padding exact."""
    from sources import nemotron_checkpoint

    ckpt = nemotron_checkpoint(tmp_path)
    loads = load_all_ranks(ckpt.folder, tp, 1)
    weights, _ = stitch(loads, tp)
    assert_exact(weights, ckpt.references)
    x, ids, topk = forward_inputs(64, 4)
    for prefix in ckpt.prefixes:
        whole = load_experts(ckpt.folder, ParallelConfig(1, 0))[prefix]
        expected = reference_forward(whole.dequantize(), whole.spec.experts, x, ids, topk, Activation.RELU2)
        total = sum(reference_forward(loaded[prefix].dequantize(), loaded[prefix].spec.experts, x, ids, topk,
                                      Activation.RELU2) for loaded in loads.values())
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
