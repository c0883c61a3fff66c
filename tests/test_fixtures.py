"""Real third-party checkpoints (GPTQModel, AutoAWQ packing, llm-compressor) against their tools' own
dequantisation, at every TP/EP split. See tests/fixtures/README.md."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURES, assert_owners, load_all_ranks, reassemble
from wna16_loader import Activation, load_experts, read_moe_config, reference_forward, ParallelConfig

NAMES = ("gptq_w4_g32_actorder_asym", "awq_w4_g32", "ct_w4_g32_asym", "ct_w8_channel_sym", "gptq_w4_g32_zero_edge")
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
    return {(PREFIX, e, proj): ref[f"{PREFIX}.{e}.{tensor}.weight"]
            for e in range(NUM_EXPERTS) for proj, tensor in PROJ_NAMES.items()}


def test_fixture_layout():
    """Each fixture: checkpoint/ holds only config + model; the reference sits beside it."""
    assert (FIXTURES / "README.md").is_file()
    for name in NAMES:
        assert sorted(p.name for p in checkpoint(name).iterdir()) == ["config.json", "model.safetensors"]
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
