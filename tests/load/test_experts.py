"""load_experts end to end on synthetic checkpoints written by the package's own packers.

The matrix: format x bits x group x symmetry x act-order, each checkpoint written once (module-scoped)
and loaded at tp in {1, 2, 4, 8} x ep in {1, 2}; the reassembled weights must equal the float32
references exactly and every expert must sit on the rank the placement rule names.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from conftest import assert_exact, assert_owners, expected_experts, load_all_ranks, reassemble, stitch
from safetensors.torch import load_file

from wna16_loader import FUSED_NAMES, FusedExperts, LoadReport, ParallelConfig, load_experts, read_moe_config
from wna16_loader.errors import CompletenessError
from wna16_loader.storage.index import CheckpointIndex
from wna16_loader.testing.synthetic import WRITER_MODELS, quant_config, write_checkpoint

H = I = 128
E = 4


def _matrix() -> list[tuple[str, int, int, bool, bool]]:
    combos = []
    for fmt in ("gptq", "awq", "compressed-tensors", "auto-round"):
        for bits in ((4,) if fmt == "awq" else (4, 8)):
            for group in (32, 128, -1):
                for symmetric in (True, False):
                    orders = (False, True) if fmt in ("gptq", "compressed-tensors") and group != -1 else (False,)
                    for act_order in orders:
                        combos.append((fmt, bits, group, symmetric, act_order))
    return combos


MATRIX = _matrix()


def _combo_id(c: tuple[str, int, int, bool, bool]) -> str:
    fmt, bits, group, symmetric, act_order = c
    return f"{fmt}-w{bits}-g{group}-{'sym' if symmetric else 'asym'}{'-actorder' if act_order else ''}"


def test_matrix_covers_the_spec():
    assert len(MATRIX) == 58
    assert {c[0] for c in MATRIX} == {"gptq", "awq", "compressed-tensors", "auto-round"}
    assert not [c for c in MATRIX if c[4] and (c[2] == -1 or c[0] in ("awq", "auto-round"))]
    assert not [c for c in MATRIX if c[0] == "awq" and c[1] != 4]


@pytest.fixture(scope="module", params=MATRIX, ids=_combo_id)
def matrix_checkpoint(request, tmp_path_factory):
    fmt, bits, group, symmetric, act_order = request.param
    folder = tmp_path_factory.mktemp(_combo_id(request.param))
    qc = quant_config(fmt, bits=bits, group_size=group, symmetric=symmetric, act_order=act_order)
    return write_checkpoint(folder, qc, family="qwen3_moe", num_experts=E, hidden=H, intermediate=I,
                            num_layers=1)


@pytest.mark.parametrize("ep", (1, 2))
@pytest.mark.parametrize("tp", (1, 2, 4, 8))
def test_matrix_exact(matrix_checkpoint, tp, ep):
    ckpt = matrix_checkpoint
    loads = load_all_ranks(ckpt.folder, tp, ep)
    for (tp_rank, ep_rank), loaded in loads.items():
        assert list(loaded) == list(ckpt.prefixes)
        layer = loaded[ckpt.prefixes[0]]
        assert layer.expert_ids.tolist() == expected_experts(E, ep, ep_rank)
        assert layer.bits == ckpt.spec.bits
        assert layer.has_zero_point == (not ckpt.spec.symmetric)
        assert layer.act_order == ckpt.spec.act_order
    weights, owners = stitch(loads, tp)
    assert_owners(owners, ckpt.prefixes, E, tp, ep)
    assert_exact(weights, ckpt.references)


# --- layouts and variants -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,bits,group,symmetric,act_order", [
    ("gptq", 4, 32, False, True), ("gptq", 8, 32, True, False), ("awq", 4, 32, False, False),
    ("compressed-tensors", 4, 32, False, True), ("compressed-tensors", 8, -1, True, False),
    ("auto-round", 4, 128, False, False),
])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (4, 1)])
def test_stacked_tensors(tmp_path, fmt, bits, group, symmetric, act_order, tp, ep):
    ckpt = write_checkpoint(tmp_path, quant_config(fmt, bits=bits, group_size=group, symmetric=symmetric,
                                                   act_order=act_order),
                            num_experts=E, hidden=H, intermediate=I, stacked=True)
    with CheckpointIndex(tmp_path) as index:
        stacked = [n for n in index.refs if ".experts.gate_up_proj." in n or ".experts.down_proj." in n]
        assert stacked and all(index.refs[n].shape[0] == E for n in stacked)
        assert not [n for n in index.refs if re.search(r"\.experts\.\d+\.", n)]
    weights, owners = reassemble(tmp_path, tp, ep)
    assert_owners(owners, ckpt.prefixes, E, tp, ep)
    assert_exact(weights, ckpt.references)


def test_stacked_reads_only_local_rows(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, act_order=True), num_experts=E,
                     hidden=H, intermediate=I, stacked=True)
    rows = []
    original = CheckpointIndex.locate

    def recording(self, ref, index=()):
        if ".experts." in ref.name:
            assert index and isinstance(index[0], int), (ref.name, index)
            rows.append(index[0])
        return original(self, ref, index)

    monkeypatch.setattr(CheckpointIndex, "locate", recording)
    load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=1))
    assert rows and set(rows) == {2, 3}


@pytest.mark.parametrize("fmt", ("gptq", "compressed-tensors"))
def test_multiple_files_with_index(tmp_path, fmt):
    ckpt = write_checkpoint(tmp_path, quant_config(fmt, bits=4, group_size=32, symmetric=False, act_order=True),
                            num_experts=E, hidden=H, intermediate=I, num_layers=3, files=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert len(ckpt.prefixes) == 3
    for tp, ep in ((1, 1), (2, 2)):
        weights, owners = reassemble(tmp_path, tp, ep)
        assert_owners(owners, ckpt.prefixes, E, tp, ep)
        assert_exact(weights, ckpt.references)
    assert read_moe_config(tmp_path).experts_prefixes == ckpt.prefixes


@pytest.mark.parametrize("fmt", ("gptq", "awq", "compressed-tensors", "auto-round"))
def test_bf16_scales_keep_bf16(tmp_path, fmt):
    ckpt = write_checkpoint(tmp_path, quant_config(fmt, bits=4, group_size=32, symmetric=False), num_experts=E,
                            hidden=H, intermediate=I, scale_dtype=torch.bfloat16)
    layer = load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=1))[ckpt.prefixes[0]]
    assert layer.w13_scales.dtype == torch.bfloat16
    assert layer.w2_scales.dtype == torch.bfloat16
    weights, _ = reassemble(tmp_path, 2, 1)
    assert_exact(weights, ckpt.references)


@pytest.mark.parametrize("fmt", ("gptq", "compressed-tensors", "auto-round"))
def test_eight_bit_layout_shapes(tmp_path, fmt):
    ckpt = write_checkpoint(tmp_path, quant_config(fmt, bits=8, group_size=32, symmetric=False), num_experts=E,
                            hidden=H, intermediate=I)
    layer = load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=0, ep_size=2, ep_rank=1))[ckpt.prefixes[0]]
    part = I // 2
    assert layer.w13_qweight.shape == (2, 2 * part, H) and layer.w13_qweight.dtype == torch.uint8
    assert layer.w2_qweight.shape == (2, H, part) and layer.w2_qweight.dtype == torch.uint8
    assert layer.w13_scales.shape == (2, 2 * part, H // 32)
    assert layer.w2_scales.shape == (2, H, part // 32)
    assert layer.w13_qzeros.shape == (2, 2 * part, H // 32) and layer.w13_qzeros.dtype == torch.uint8
    assert layer.w2_qzeros.shape == (2, H, part // 32)
    assert layer.expert_ids.tolist() == [2, 3]


# --- families --------------------------------------------------------------------------------------------

FAMILY_PREFIXES = {
    "mixtral": ("model.layers.0.block_sparse_moe.experts", "model.layers.1.block_sparse_moe.experts"),
    "qwen2_moe": ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"),
    "qwen3_moe": ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"),
    "deepseek_v3": ("model.layers.1.mlp.experts",),  # layer 0 is dense (first_k_dense_replace=1)
    "gemma4": ("model.language_model.layers.0.experts", "model.language_model.layers.1.experts"),
    "olmoe": ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"),
    "glm4_moe": ("model.layers.1.mlp.experts",),
}


def test_every_family_is_covered():
    assert set(FAMILY_PREFIXES) == set(WRITER_MODELS)


@pytest.mark.parametrize("family", sorted(WRITER_MODELS))
def test_family_loads(tmp_path, family):
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, symmetric=False),
                            family=family, num_experts=E, hidden=H, intermediate=I, num_layers=2)
    assert ckpt.prefixes == FAMILY_PREFIXES[family]
    loaded = load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0))
    assert tuple(loaded) == ckpt.prefixes
    assert loaded.report.layers == len(ckpt.prefixes)
    moe = read_moe_config(tmp_path)
    assert moe.experts_prefixes == ckpt.prefixes
    assert moe.num_experts == E and moe.hidden_size == H and moe.intermediate_size == I
    weights, owners = reassemble(tmp_path, 2, 2)
    assert_owners(owners, ckpt.prefixes, E, 2, 2)
    assert_exact(weights, ckpt.references)


def test_gemma4_nested_config(tmp_path):
    write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32), family="gemma4", num_experts=E,
                     hidden=H, intermediate=I)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" in config and "num_experts" not in config
    moe = read_moe_config(tmp_path)
    assert moe.experts_prefixes == ("model.language_model.layers.0.experts",)
    assert moe.model_type == "gemma4_text"


@pytest.mark.parametrize("fmt,symmetric,act_order", [("gptq", False, False), ("gptq", True, True),
                                                     ("awq", False, False), ("compressed-tensors", True, False),
                                                     ("auto-round", False, False)])
def test_gemma4_like_sizes(tmp_path, fmt, symmetric, act_order):
    """I = 704 with G = 128: TP slices cut groups (G_eff 32 at tp 2, 16 at tp 4), still exact."""
    ckpt = write_checkpoint(tmp_path, quant_config(fmt, bits=4, group_size=128, symmetric=symmetric,
                                                   act_order=act_order),
                            family="gemma4", num_experts=4, hidden=256, intermediate=704)
    expected_g_eff = {1: 128, 2: 32 if not act_order else 128, 4: 16 if not act_order else 128}
    for tp in (1, 2, 4):
        loads = load_all_ranks(tmp_path, tp, 1)
        assert {layer.group_size for loaded in loads.values() for layer in loaded.values()} == {expected_g_eff[tp]}
        weights, owners = stitch(loads, tp)
        assert_owners(owners, ckpt.prefixes, 4, tp, 1)
        assert_exact(weights, ckpt.references)


# --- expert parallelism --------------------------------------------------------------------------------------

@pytest.mark.parametrize("placement", ("linear", "round_robin"))
def test_uneven_ep(tmp_path, placement):
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, symmetric=False, act_order=True),
                            num_experts=6, hidden=H, intermediate=I)
    want = {"linear": [[0, 1], [2, 3], [4], [5]], "round_robin": [[0, 4], [1, 5], [2], [3]]}[placement]
    loads = load_all_ranks(tmp_path, 1, 4, placement)
    for (_, ep_rank), loaded in loads.items():
        layer = loaded[ckpt.prefixes[0]]
        assert layer.expert_ids.tolist() == want[ep_rank]
        assert layer.w13_qweight.shape[0] == len(want[ep_rank])
        assert loaded.report.experts == len(want[ep_rank])
    weights, owners = stitch(loads, 1)
    assert_owners(owners, ckpt.prefixes, 6, 1, 4, placement)
    assert_exact(weights, ckpt.references)


def test_round_robin_with_tp(tmp_path):
    ckpt = write_checkpoint(tmp_path, quant_config("compressed-tensors", bits=4, group_size=32, symmetric=False),
                            num_experts=E, hidden=H, intermediate=I)
    weights, owners = reassemble(tmp_path, 2, 2, "round_robin")
    assert_owners(owners, ckpt.prefixes, E, 2, 2, "round_robin")
    assert_exact(weights, ckpt.references)


def test_tp_times_ep(tmp_path):
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, symmetric=False, act_order=True),
                            num_experts=E, hidden=H, intermediate=I, num_layers=2)
    loads = load_all_ranks(tmp_path, 2, 2)
    assert sorted(loads) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (tp_rank, ep_rank), loaded in loads.items():
        for layer in loaded.values():
            assert layer.expert_ids.tolist() == [2 * ep_rank, 2 * ep_rank + 1]
            assert layer.w13_qweight.shape == (2, 2 * (I // 2), H // 2)
    # ranks that share an EP rank hold the same experts but different I columns
    a = loads[(0, 0)][ckpt.prefixes[0]].w13_qweight
    b = loads[(1, 0)][ckpt.prefixes[0]].w13_qweight
    assert not torch.equal(a, b)
    weights, owners = stitch(loads, 2)
    assert_owners(owners, ckpt.prefixes, E, 2, 2)
    assert_exact(weights, ckpt.references)


def test_parallel_config_from_rank_matches_grid(tmp_path):
    """Global rank r = ep_rank * tp + tp_rank loads the same shard as the explicit config."""
    write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32), num_experts=E, hidden=H,
                     intermediate=I)
    for rank in range(4):
        via_rank = load_experts(tmp_path, ParallelConfig.from_rank(rank, tp_size=2, ep_size=2))
        explicit = load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=rank % 2, ep_size=2, ep_rank=rank // 2))
        for prefix in explicit:
            for name, tensor in explicit[prefix].tensors.items():
                assert torch.equal(via_rank[prefix].tensors[name], tensor), (rank, name)


# --- the fused layout table ---------------------------------------------------------------------------------

def test_fused_shapes_act_order(tmp_path):
    """gptq 4-bit G=32 asymmetric act-order, H=I=128, tp 2 x ep 2, rank (tp 1, ep 1): the docstring table."""
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, symmetric=False, act_order=True),
                            num_experts=E, hidden=H, intermediate=I)
    layer = load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=1, ep_size=2, ep_rank=1))[ckpt.prefixes[0]]
    assert isinstance(layer, FusedExperts)
    e_l, i_p, p8 = 2, I // 2, 2
    want = {
        "w13_qweight": ((e_l, 2 * i_p, H // p8), torch.uint8),
        "w2_qweight": ((e_l, H, i_p // p8), torch.uint8),
        "w13_scales": ((e_l, 2 * i_p, H // 32), torch.float16),
        "w2_scales": ((e_l, H, I // 32), torch.float16),  # act-order: ceil(I/G), all of I's groups
        "w13_qzeros": ((e_l, 2 * i_p // p8, H // 32), torch.uint8),
        "w2_qzeros": ((e_l, H // p8, I // 32), torch.uint8),
        "w13_g_idx": ((e_l, H), torch.int32),
        "w2_g_idx": ((e_l, i_p), torch.int32),
        "expert_ids": ((e_l,), torch.int32),
    }
    assert set(layer.tensors) == set(want) == set(FUSED_NAMES) - {"w13_weight", "w2_weight"}  # those: float experts
    for name, (shape, dtype) in want.items():
        tensor = getattr(layer, name)
        assert tuple(tensor.shape) == shape, name
        assert tensor.dtype == dtype, name
        assert tensor.device.type == "cpu"
    assert layer.expert_ids.tolist() == [2, 3]
    assert (layer.group_size, layer.bits, layer.has_zero_point, layer.act_order) == (32, 4, True, True)
    assert {name: (tuple(s), d) for name, (s, d) in layer.spec.shapes().items()} == want


def test_fused_shapes_symmetric_plain(tmp_path):
    """Symmetric, no act-order: no qzeros, no g_idx; w2 scales cover only the rank's I_p columns."""
    ckpt = write_checkpoint(tmp_path, quant_config("awq", bits=4, group_size=32, symmetric=True), num_experts=E,
                            hidden=H, intermediate=I)
    layer = load_experts(tmp_path, ParallelConfig(tp_size=4, tp_rank=3))[ckpt.prefixes[0]]
    i_p = I // 4
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in layer.tensors.items()}
    assert shapes == {
        "w13_qweight": ((E, 2 * i_p, H // 2), torch.uint8),
        "w2_qweight": ((E, H, i_p // 2), torch.uint8),
        "w13_scales": ((E, 2 * i_p, H // 32), torch.float16),
        "w2_scales": ((E, H, i_p // 32), torch.float16),
        "expert_ids": ((E,), torch.int32),
    }
    assert layer.w13_qzeros is None and layer.w2_g_idx is None
    assert layer.expert_ids.tolist() == [0, 1, 2, 3]


def test_fused_byte_packing(tmp_path):
    """4-bit byte j holds q[2j] + 16 * q[2j+1] along K; fused qzeros pack along N."""
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, symmetric=False), num_experts=2,
                            hidden=H, intermediate=I)
    layer = load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0))[ckpt.prefixes[0]]
    w = layer.w13_qweight
    low, high = (w & 0xF).float(), (w >> 4).float()
    s = layer.w13_scales.float().repeat_interleave(32, dim=2)
    zb = layer.w13_qzeros
    z = torch.stack((zb & 0xF, zb >> 4), dim=2).reshape(2, 2 * I, H // 32).float().repeat_interleave(32, dim=2)
    deq = torch.empty(2, 2 * I, H)
    deq[:, :, 0::2] = (low - z[:, :, 0::2]) * s[:, :, 0::2]
    deq[:, :, 1::2] = (high - z[:, :, 1::2]) * s[:, :, 1::2]
    for e in range(2):
        assert torch.equal(deq[e, :I], ckpt.references[(ckpt.prefixes[0], e, "gate")])
        assert torch.equal(deq[e, I:], ckpt.references[(ckpt.prefixes[0], e, "up")])


# --- report and config ---------------------------------------------------------------------------------------

def test_load_report(tmp_path):
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, symmetric=False, act_order=True),
                            num_experts=E, hidden=H, intermediate=I, num_layers=2)
    full = load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0)).report
    half = load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=0)).report
    assert isinstance(full, LoadReport)
    assert (full.layers, full.experts) == (2, 2 * E)
    assert (half.layers, half.experts) == (2, 2 * 2)
    assert full.tensors == 2 * E * 3 * 4  # layers x experts x projections x (qweight, qzeros, scales, g_idx)
    assert half.tensors == full.tensors // 2
    assert half.bytes_read == pytest.approx(full.bytes_read / 2, rel=0.02)
    assert full.bytes_read > 0 and full.bytes_written > 0 and full.seconds >= 0
    # every quantized byte of every expert is read once at tp 1 (no whole-file loads, no re-reads)
    per_expert = (2 * I * H + H * I) // 2 + 3 * (I * H // 32) * 2 + (2 * I + H) * (H // 32) // 2 + (2 * H + I) * 4
    assert full.bytes_read == 2 * E * per_expert
    text = str(full)
    assert "2 layers" in text and f"{2 * E} local experts" in text and "MiB read" in text
    assert ckpt.prefixes == tuple(load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0)))


def test_tp_reads_less(tmp_path):
    write_checkpoint(tmp_path, quant_config("compressed-tensors", bits=4, group_size=32, symmetric=False),
                     num_experts=E, hidden=H, intermediate=I)
    one = load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0)).report.bytes_read
    four = load_experts(tmp_path, ParallelConfig(tp_size=4, tp_rank=2)).report.bytes_read
    assert four < one / 2


def test_read_moe_config(tmp_path):
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=8, group_size=128, symmetric=True),
                            family="deepseek_v3", num_experts=8, hidden=H, intermediate=256, num_layers=3, top_k=3)
    moe = read_moe_config(tmp_path)
    assert moe.experts_prefixes == ckpt.prefixes == ("model.layers.1.mlp.experts", "model.layers.2.mlp.experts")
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size) == (8, 3, H, 256)
    assert moe.num_layers == 3 and moe.moe_layers == (1, 2)
    assert moe.model_type == "deepseek_v3"
    assert (moe.quant.format_name, moe.quant.bits, moe.quant.group_size, moe.quant.symmetric,
            moe.quant.act_order) == ("gptq", 8, 128, True, False)


# --- what the loader must leave alone, and must never read ---------------------------------------------------

def _record_reads(monkeypatch) -> list[tuple[str, tuple]]:
    reads: list[tuple[str, tuple]] = []
    original, original_run = CheckpointIndex.locate, CheckpointIndex.locate_run  # every read passes one of them

    def recording(self, ref, index=()):
        reads.append((ref.name, index))
        return original(self, ref, index)

    def recording_run(self, refs, indices):
        begins = original_run(self, refs, indices)
        reads.extend((ref.name, index) for ref, index in zip(refs, indices) if begins is not None)
        return begins

    monkeypatch.setattr(CheckpointIndex, "locate", recording)
    monkeypatch.setattr(CheckpointIndex, "locate_run", recording_run)
    return reads


def test_shared_experts_router_dense_left_alone(tmp_path, monkeypatch):
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, symmetric=False),
                            family="deepseek_v3", num_experts=E, hidden=H, intermediate=I, num_layers=3)
    with CheckpointIndex(tmp_path) as index:
        names = set(index.refs)
    others = {"model.layers.0.mlp.gate_proj.qweight", "model.layers.1.mlp.shared_experts.gate_proj.qweight",
              "model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.weight", "model.embed_tokens.weight"}
    assert others <= names
    reads = _record_reads(monkeypatch)
    loaded = load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0))
    assert tuple(loaded) == ckpt.prefixes == ("model.layers.1.mlp.experts", "model.layers.2.mlp.experts")
    read_names = {name for name, _ in reads}
    assert read_names and all(re.match(r"model\.layers\.[12]\.mlp\.experts\.\d+\.", n) for n in read_names)
    assert not read_names & others
    non_expert = {n for n in names if ".experts." not in n or ".shared_experts." in n}
    assert set(loaded.ignored) == non_expert and others <= set(loaded.ignored)
    assert loaded.report.ignored == len(non_expert)
    assert f"{len(non_expert)} non-expert tensors left alone" in str(loaded.report)


EP_FILTER_CASES = [("gptq", 4, 32, False, True), ("compressed-tensors", 4, 32, False, True),
                   ("awq", 4, 32, False, False), ("auto-round", 8, 32, False, False),
                   ("compressed-tensors", 8, -1, True, False)]


@pytest.mark.parametrize("fmt,bits,group,symmetric,act_order", EP_FILTER_CASES,
                         ids=[_combo_id(c) for c in EP_FILTER_CASES])
@pytest.mark.parametrize("placement", ("linear", "round_robin"))
def test_ep_filter_never_reads_other_experts(tmp_path, monkeypatch, fmt, bits, group, symmetric, act_order,
                                             placement):
    write_checkpoint(tmp_path, quant_config(fmt, bits=bits, group_size=group, symmetric=symmetric,
                                            act_order=act_order),
                     num_experts=6, hidden=H, intermediate=I, num_layers=2)
    with CheckpointIndex(tmp_path) as index:
        suffixes = {n.rsplit(".", 1)[1] for n in index.refs if ".experts." in n}
    reads = _record_reads(monkeypatch)
    for ep_rank in range(3):
        reads.clear()
        load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=ep_rank % 2, ep_size=3, ep_rank=ep_rank,
                                              expert_placement=placement))
        local = set(expected_experts(6, 3, ep_rank, placement))
        seen: dict[int, set[str]] = {}
        for name, _ in reads:
            match = re.match(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.\w+\.(\w+)$", name)
            assert match, f"read a non-expert tensor {name}"
            seen.setdefault(int(match.group(1)), set()).add(match.group(2))
        assert set(seen) == local, f"rank {ep_rank} read experts {sorted(seen)}, owns {sorted(local)}"
        for expert, got in seen.items():
            assert got == suffixes, (expert, got, suffixes)


def test_reduced_group_size_warned_per_rank(tmp_path, caplog):
    write_checkpoint(tmp_path, quant_config("gptq", group_size=32), hidden=64, intermediate=128)
    with caplog.at_level(logging.WARNING, logger="wna16_loader"):
        layers = load_experts(tmp_path, ParallelConfig(tp_size=8, tp_rank=5))
    assert layers["model.layers.0.mlp.experts"].group_size == 16
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["[rank 5 tp 5/8 ep 0/1] tp=8: group size 32 becomes G_eff 16 in 1 layer(s) "
                        "(model.layers.0.mlp.experts): I/tp = 128/8 is not a multiple of 32, so each scale and zero "
                        "point is repeated; kernels that accept only some group sizes may refuse it. TP sizes that "
                        "keep group size 32: [1, 2, 4]."]


# ---------------------------------------------------------------------- MTP layers

MTP_NAMES = ("deepseek_v3", "glm4_moe_lite-flash", "qwen3_5_moe-mtp", "qwen3_next")  # appended x 2, mtp.layers x 2


@pytest.mark.parametrize("name", MTP_NAMES)
def test_mtp_layers_load_only_when_asked(tmp_path, name):
    """Present MTP experts (quantized like the rest): left alone by default (non-expert tensors, never an
    error), loaded exactly at every TP x EP with include_mtp=True, each layer marked mtp."""
    from sources import mtp_checkpoint
    ckpt = mtp_checkpoint(tmp_path, name)
    moe = read_moe_config(tmp_path)
    mtp_prefix = ckpt.prefixes[-1]
    assert moe.mtp_prefixes == (mtp_prefix,) and moe.experts_prefixes == ckpt.prefixes[:-1]
    main_refs = {k: v for k, v in ckpt.references.items() if k[0] != mtp_prefix}
    default = load_experts(tmp_path, ParallelConfig(1, 0))
    assert sorted(default) == sorted(moe.experts_prefixes) and not any(layer.mtp for layer in default.values())
    mtp_tensors = [n for n in default.ignored if n.startswith(f"{mtp_prefix}.")]
    assert len(mtp_tensors) == E * 3 * 4  # 4 experts x 3 projections x (qweight, qzeros, scales, g_idx)
    with_mtp = load_experts(tmp_path, ParallelConfig(1, 0), include_mtp=True)
    assert [p for p, layer in with_mtp.items() if layer.mtp] == [mtp_prefix]
    assert not set(with_mtp.ignored) & set(mtp_tensors)
    assert_exact(reassemble(tmp_path, 1, 1)[0], main_refs)
    for tp, ep in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 2)):
        weights, owners = reassemble(tmp_path, tp, ep, include_mtp=True)
        assert_owners(owners, ckpt.prefixes, E, tp, ep)
        assert_exact(weights, ckpt.references)


@pytest.mark.parametrize("name", MTP_NAMES)
def test_declared_mtp_layers_without_tensors_are_normal(tmp_path, name):
    from sources import mtp_checkpoint
    ckpt = mtp_checkpoint(tmp_path, name, mtp=False)
    assert read_moe_config(tmp_path).mtp.count == 1 and read_moe_config(tmp_path).mtp_prefixes == ()
    for include_mtp in (False, True):
        weights, _ = reassemble(tmp_path, 2, 2, include_mtp=include_mtp)
        assert_exact(weights, ckpt.references)


@pytest.mark.parametrize("name", ("deepseek_v3", "qwen3_5_moe-mtp"))
def test_bf16_mtp_experts(tmp_path, name):
    """Official Qwen3.5 GPTQ-Int4 releases: MTP experts in bf16, the rest 4-bit. Left alone they are
    non-expert tensors; asked for, the MTP layer loads into the float fused layout (the tensors decide its
    spec), exactly, at every split."""
    from sources import mtp_checkpoint
    ckpt = mtp_checkpoint(tmp_path, name, mtp_dtype=torch.bfloat16)
    prefix = ckpt.prefixes[-1]
    weights, _ = reassemble(tmp_path, 2, 1)
    assert_exact(weights, ckpt.references)
    assert sum(n.startswith(f"{prefix}.") and n.endswith("_proj.weight") for n in
               load_experts(tmp_path, ParallelConfig(1, 0)).ignored) == E * 3
    stored = {name: t for file in tmp_path.glob("*.safetensors") for name, t in load_file(file).items()}
    float_refs = {(prefix, e, kind): stored[f"{prefix}.{e}.{kind}_proj.weight"].float()
                  for e in range(E) for kind in ("gate", "up", "down")}
    for tp, ep in ((1, 1), (2, 2), (4, 1)):
        weights, _ = reassemble(tmp_path, tp, ep, include_mtp=True)
        assert_exact(weights, {**ckpt.references, **float_refs})
    layer = load_experts(tmp_path, ParallelConfig(2, 1), include_mtp=True)[prefix]
    assert layer.mtp and not layer.quantized and layer.w13_weight.dtype == torch.bfloat16
    assert set(layer.tensors) == {"w13_weight", "w2_weight", "expert_ids"}


def test_undeclared_mtp_layer_is_unexpected_only_when_asked(tmp_path):
    """An mtp.layers tree beyond the declared count: unexpected with include_mtp=True (each tensor named, with
    the count's source and the fix), left alone without."""
    from sources import mtp_checkpoint
    mtp_checkpoint(tmp_path / "qwen", "qwen3_next", mtp_num_hidden_layers=2)
    config = json.loads((tmp_path / "qwen" / "config.json").read_text())
    (tmp_path / "qwen" / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    assert len(load_experts(tmp_path / "qwen", ParallelConfig(1, 0))) == 2
    with pytest.raises(CompletenessError) as error:
        load_experts(tmp_path / "qwen", ParallelConfig(1, 0), include_mtp=True)
    assert "48 problems" in str(error.value)
    assert ("unexpected tensor: mtp.layers.1.mlp.experts.0.down_proj.g_idx (MTP layer 1, but config.json declares "
            "1 MTP layer(s) (mtp_num_hidden_layers=1 (row qwen3_next)); load with include_mtp=False (wna16-shard "
            "--no-mtp) to keep them as non-expert tensors)") in str(error.value)


def test_an_output_is_self_contained(tmp_path):
    """A rank that has only the wna16-shard output (the source is gone) reads the model config from it and builds
    its modules from that alone, as the README's "Load a rank" section shows."""
    from wna16_loader import FusedMoEExperts, load_model_experts
    from wna16_loader.preshard import preshard_checkpoint

    src, out = tmp_path / "src", tmp_path / "out"
    write_checkpoint(src, quant_config("gptq"), hidden=64, intermediate=128, num_layers=2)
    expected = read_moe_config(src)
    preshard_checkpoint(src, out, tp_size=2, progress=False)
    reference = load_experts(src, ParallelConfig(2, 1))
    for path in src.iterdir():
        path.unlink()
    src.rmdir()
    moe = read_moe_config(out)
    assert moe == expected and moe.experts_prefixes == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    parallel = ParallelConfig.from_manifest(out, rank=1)
    model = torch.nn.ModuleList(FusedMoEExperts(moe, prefix, parallel) for prefix in moe.experts_prefixes)
    load_model_experts(model, out, parallel)
    for module in model:
        for name, tensor in reference[module.prefix].tensors.items():
            assert torch.equal(getattr(module, name), tensor), (module.prefix, name)
