"""Real third-party checkpoints (GPTQModel, AutoAWQ packing, llm-compressor, auto-round) against their tools'
own dequantisation, at every TP/EP split. See tests/fixtures/README.md."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from conftest import FIXTURES, assert_owners, load_all_ranks, reassemble
from safetensors.torch import load_file

from wna16_loader import Activation, ParallelConfig, load_experts, read_moe_config, reference_forward

NAMES = ("gptq_w4_g32_actorder_asym", "awq_w4_g32", "ct_w4_g32_asym", "ct_w8_channel_sym", "gptq_w4_g32_zero_edge",
         "autoround_w8_g64_asym")
# auto-round saves its quantization config twice: inside config.json and as quantization_config.json
EXTRA_FILES = {"autoround_w8_g64_asym": ["quantization_config.json"]}
PREFIX = "model.layers.0.mlp.experts"
PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
NUM_EXPERTS = 4
SPLITS = [(tp, ep, placement) for tp in (1, 2, 4)
          for ep, placement in ((1, "linear"), (2, "linear"), (2, "round_robin"))]
SPLITS += [(3, 1, "linear"), (6, 2, "round_robin")]  # padded: I = 128 -> I' = 144 (I_p' = 48) and 192 (I_p' = 32)


def checkpoint(name: str):
    return FIXTURES / name / "checkpoint"


def references(name: str) -> dict[tuple[str, int, str], torch.Tensor]:
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    out = {(PREFIX, e, proj): ref[f"{PREFIX}.{e}.{tensor}.weight"]
           for e in range(NUM_EXPERTS) for proj, tensor in PROJ_NAMES.items()}
    if name in OVERFLOWING_PACKER:
        tensors = load_file(str(checkpoint(name) / "model.safetensors"))
        out = {key: _as_packed(tensors, f"{key[0]}.{key[1]}.{PROJ_NAMES[key[2]]}", w) for key, w in out.items()}
    return out


# auto-round 0.15.1 packs q = round(W/s + z) without clamping, as sum(q_i << 8i) mod 2^32: a q of 256 carries
# into the next field of its word. Its reference holds the unclamped q; what the file (and every kernel) holds is
# that q packed by the same arithmetic. The expected weights are the reference's q put through that packing.
OVERFLOWING_PACKER = {"autoround_w8_g64_asym": 64}  # name: group size


def _unpack_bytes(words: torch.Tensor, dim: int) -> torch.Tensor:
    wide = words.to(torch.int64) & 0xFFFFFFFF
    moved = wide.movedim(dim, -1)
    fields = (moved.unsqueeze(-1) >> torch.arange(0, 32, 8)) & 0xFF
    return fields.reshape(*moved.shape[:-1], moved.shape[-1] * 4).movedim(-1, dim)


def _reference_q(tensors: dict, module: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] int64 as the reference implies, z and s expanded to [N, K]) of one 8-bit auto_round module."""
    zeros, scales = _unpack_bytes(tensors[f"{module}.qzeros"], 1).T, tensors[f"{module}.scales"].float().T
    groups = torch.arange(weight.shape[1]) // OVERFLOWING_PACKER["autoround_w8_g64_asym"]
    z, s = zeros[:, groups].float(), scales[:, groups]
    q = weight / s + z
    assert torch.equal(q, q.round()), f"{module}: the reference is not (q - z) * s with integer q"
    return q.to(torch.int64), z, s


def _as_packed(tensors: dict, module: str, weight: torch.Tensor) -> torch.Tensor:
    """The reference weight after auto-round's packing arithmetic (4 fields of 8 bits per int32 word along K)."""
    q, z, s = _reference_q(tensors, module, weight)
    n, k = q.shape
    words = (q.T.reshape(k // 4, 4, n) << (torch.arange(4) * 8).view(1, 4, 1)).sum(1) & 0xFFFFFFFF
    assert torch.equal(words, tensors[f"{module}.qweight"].to(torch.int64) & 0xFFFFFFFF), module
    return (_unpack_bytes(words, 0).T.float() - z) * s


def test_fixture_layout():
    """Each fixture: checkpoint/ holds only config + model; the reference sits beside it."""
    assert (FIXTURES / "README.md").is_file()
    for name in NAMES:
        assert sorted(p.name for p in checkpoint(name).iterdir()) == sorted(
            ["config.json", "model.safetensors", *EXTRA_FILES.get(name, [])])
        assert (FIXTURES / name / "reference.safetensors").is_file()
        assert json.loads((FIXTURES / name / "provenance.json").read_text())["args"]["experts"] == NUM_EXPERTS


@pytest.mark.parametrize("name", NAMES)
def test_fixture_checksums(name):
    sums = json.loads((FIXTURES / name / "provenance.json").read_text())["sha256"]
    for file, path in (("model.safetensors", checkpoint(name) / "model.safetensors"),
                       ("reference.safetensors", FIXTURES / name / "reference.safetensors")):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sums[file], path


@pytest.mark.parametrize("name", NAMES)
def test_fixture_config(name):
    moe = read_moe_config(checkpoint(name))
    assert moe.experts_prefixes == (PREFIX,)
    assert (moe.num_experts, moe.hidden_size, moe.intermediate_size, moe.top_k) == (4, 128, 128, 2)


@pytest.mark.parametrize("tp,ep,placement", SPLITS, ids=[f"tp{t}-ep{e}-{p}" for t, e, p in SPLITS])
@pytest.mark.parametrize("name", NAMES)
def test_fixture_matches_tool_reference(name, tp, ep, placement):
    weights, owners = reassemble(checkpoint(name), tp, ep, placement)
    assert_owners(owners, (PREFIX,), NUM_EXPERTS, tp, ep, placement)
    refs = references(name)
    assert sorted(weights) == sorted(refs)
    for key, ref in refs.items():
        assert ref.dtype == torch.float32
        assert torch.equal(weights[key], ref), f"{name} tp={tp} ep={ep} {placement}: {key} differs"


def test_autoround_fixture_overflows_in_four_projections():
    """Where the loader and auto-round's reference part: exactly the unclamped q = 256 of four expert projections
    and the field each carried into; everywhere else the reference itself is matched exactly."""
    name = "autoround_w8_g64_asym"
    tensors = load_file(str(checkpoint(name) / "model.safetensors"))
    raw = load_file(str(FIXTURES / name / "reference.safetensors"))
    layer = load_experts(checkpoint(name), ParallelConfig(tp_size=1, tp_rank=0))[PREFIX].dequantize()
    loaded = {"gate": lambda e: layer.w13[e, :128], "up": lambda e: layer.w13[e, 128:], "down": lambda e: layer.w2[e]}
    found = []
    for e in range(NUM_EXPERTS):
        for proj, tensor in PROJ_NAMES.items():
            module = f"{PREFIX}.{e}.{tensor}"
            q = _reference_q(tensors, module, raw[f"{module}.weight"])[0]
            differs = (loaded[proj](e) != raw[f"{module}.weight"]).nonzero().tolist()
            for n, k in (q > 255).nonzero().tolist():
                found.append((e, proj, n, k))
                assert [n, k] in differs and [n, k + 1] in differs  # the overflowed field and its carry
            assert len(differs) == 2 * int((q > 255).sum()) and int((q < 0).sum()) == 0
    assert [(e, proj) for e, proj, _, _ in found] == [(1, "gate"), (3, "gate"), (3, "up"), (3, "down")]


def test_autoround_own_packing_stores_true_zero_points():
    """The auto_round fixture decodes exactly with its zero points as stored; read as GPTQ v1 (z - 1 stored,
    word-wise) every weight would be off by one scale."""
    moe = read_moe_config(checkpoint("autoround_w8_g64_asym"))
    assert (moe.quant.format_name, moe.quant.checkpoint_format, moe.quant.bits, moe.quant.group_size) == (
        "gptq", "auto_round", 8, 64)
    assert moe.quant.zero_word_bias is False and moe.quant.symmetric is False


# --- the zero-edge fixture: GPTQ v1 zero points must be decoded word-wise ---------------------------------

def _unpack_nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> 8 nibbles each, least significant first, along `dim` (int64 values 0..15)."""
    wide = words.to(torch.int64) & 0xFFFFFFFF
    moved = wide.movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nib = (moved.unsqueeze(-1) >> shifts) & 0xF
    return nib.reshape(*moved.shape[:-1], moved.shape[-1] * 8).movedim(-1, dim)


def _dequant_gptq(tensors: dict[str, torch.Tensor], name: str, word_wise: bool) -> torch.Tensor:
    """W[N, K] of one GPTQ v1 module, decoding zero points word-wise or field by field (+1 per nibble)."""
    qweight, qzeros = tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"]
    scales, g_idx = tensors[f"{name}.scales"].float(), tensors[f"{name}.g_idx"].long()
    q = _unpack_nibbles(qweight, 0).T  # [N, K]
    if word_wise:
        z = _unpack_nibbles(((qzeros.to(torch.int64) & 0xFFFFFFFF) + 0x11111111) & 0xFFFFFFFF, 1)  # [nG, N]
    else:
        z = _unpack_nibbles(qzeros, 1) + 1
    return (q.float() - z.float().T[:, g_idx]) * scales.T[:, g_idx]


def test_zero_edge_needs_word_wise_decoding():
    name = "gptq_w4_g32_zero_edge"
    tensors = load_file(str(checkpoint(name) / "model.safetensors"))
    refs = references(name)
    per_field_wrong = 0
    for (prefix, e, proj), ref in refs.items():
        module = f"{prefix}.{e}.{PROJ_NAMES[proj]}"
        assert torch.equal(_dequant_gptq(tensors, module, word_wise=True), ref), module
        per_field_wrong += int(not torch.equal(_dequant_gptq(tensors, module, word_wise=False), ref))
    # the point of the fixture: field-by-field decoding is off wherever a zero point of 0 borrowed
    assert per_field_wrong > 0
    # ... while the loader is exact
    layer = load_experts(checkpoint(name), ParallelConfig(tp_size=1, tp_rank=0))[PREFIX].dequantize()
    for e in range(NUM_EXPERTS):
        assert torch.equal(layer.w13[e, :128], refs[(PREFIX, e, "gate")])
        assert torch.equal(layer.w13[e, 128:], refs[(PREFIX, e, "up")])
        assert torch.equal(layer.w2[e], refs[(PREFIX, e, "down")])


def test_zero_edge_fixture_has_zero_points_at_both_edges():
    """Sanity of the fixture itself: true zero points of 0 and 15 occur."""
    tensors = load_file(str(checkpoint("gptq_w4_g32_zero_edge") / "model.safetensors"))
    zs = [_unpack_nibbles(((v.to(torch.int64) & 0xFFFFFFFF) + 0x11111111) & 0xFFFFFFFF, 1)
          for k, v in tensors.items() if k.startswith(PREFIX) and k.endswith(".qzeros")]
    values = torch.cat([z.reshape(-1) for z in zs])
    assert (values == 0).any() and (values == 15).any()


@pytest.mark.parametrize("tp", [3, 5])
@pytest.mark.parametrize("name", NAMES)
def test_fixture_padded_forward_sums_to_unsharded(name, tp):
    """I = 128 at TP 3 / 5 pads to I' = 144 / 160: the ranks' reference forwards add up to the unsharded one."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 128, generator=gen) / 8
    weights, ids = torch.rand(12, NUM_EXPERTS, generator=gen).softmax(-1).topk(2)
    whole = load_experts(checkpoint(name), ParallelConfig(1, 0))[PREFIX]
    expected = reference_forward(whole.dequantize(), whole.spec.experts, x, ids, weights, Activation.SILU)
    layers = [loaded[PREFIX] for loaded in load_all_ranks(checkpoint(name), tp, 1).values()]
    assert [layer.padding for layer in layers] == {3: [0, 0, 16], 5: [0, 0, 0, 0, 32]}[tp]  # last rank: 128 -> end
    total = sum(reference_forward(layer.dequantize(), layer.spec.experts, x, ids, weights, Activation.SILU)
                for layer in layers)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
