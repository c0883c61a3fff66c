"""extract: batched reads of scales / zero points / g_idx, their content checks, rank spans.

Checkpoints are written with `write_checkpoint` and corrupted with `rewrite`; the readers are called
directly on a planned layer. Expected weight bytes are built from the stored int32 words with a
reference unpacker written here (plain shifts and masks), independent of `packing`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import rewrite
from layer_helpers import TP1, H, I, P, batch, model, planned, write
from safetensors.torch import load_file

from wna16_loader import FormatError, ParallelConfig
from wna16_loader.formats import Dim
from wna16_loader.load import params as extract
from wna16_loader.load.params import SourceTensors, rank_spans, read_params
from wna16_loader.models.names import Proj, Source
from wna16_loader.parallel.partition import LayerGeometry, Span


def params_of(folder: Path, proj: Proj, tp: int = 1, rank: int = 0, **kwargs) -> extract.ProjectionParams:
    with planned(folder, tp, rank) as (index, spec, plan):
        return read_params(index, spec, batch(plan, proj), plan.geometry.slice(proj), **kwargs)


# --- 1. a batch equals its singles ---------------------------------------------------------------------------

BATCH_CASES = [  # fmt, bits, group, symmetric, act_order, stacked
    ("gptq", 4, 32, False, False, False),
    ("gptq", 4, 32, False, True, False),
    ("gptq", 8, 32, True, False, False),
    ("awq", 4, 32, False, False, False),
    ("awq", 4, 32, True, False, True),
    ("compressed-tensors", 4, 32, False, True, False),
    ("compressed-tensors", 8, -1, False, False, False),
    ("compressed-tensors", 8, 32, True, True, True),
]


@pytest.mark.parametrize("tp,rank", [TP1, (2, 1)], ids=["tp1", "tp2r1"])
@pytest.mark.parametrize("fmt,bits,group,symmetric,act_order,stacked", BATCH_CASES,
                         ids=[f"{c[0]}-{c[1]}b-g{c[2]}{'-sym' if c[3] else ''}{'-act' if c[4] else ''}"
                              f"{'-stacked' if c[5] else ''}" for c in BATCH_CASES])
def test_read_params_batch_equals_singles(tmp_path: Path, fmt: str, bits: int, group: int, symmetric: bool,
                                          act_order: bool, stacked: bool, tp: int, rank: int) -> None:
    """read_params on all local experts at once == the per-expert reads stacked, for every role."""
    write(tmp_path, fmt, bits=bits, group=group, symmetric=symmetric, act_order=act_order, stacked=stacked,
          hidden=64, inter=64)
    with planned(tmp_path, tp, rank) as (index, spec, plan):
        for proj in Proj:
            sources, cut = batch(plan, proj), plan.geometry.slice(proj)
            together = read_params(index, spec, sources, cut)
            singles = [read_params(index, spec, [src], cut) for src in sources]
            assert len(sources) == 4 and together.scales.shape[0] == 4
            assert not torch.equal(together.scales[1], together.scales[2]), "experts must be distinguishable"
            assert torch.equal(together.scales, torch.cat([s.scales for s in singles])), proj
            if symmetric:
                assert together.zeros is None and all(s.zeros is None for s in singles)
            else:
                assert together.zeros.dtype == torch.uint8
                assert torch.equal(together.zeros, torch.cat([s.zeros for s in singles])), proj
            if act_order:
                assert together.g_idx.dtype == torch.int32
                assert torch.equal(together.g_idx, torch.cat([s.g_idx for s in singles])), proj
            else:
                assert together.g_idx is None and all(s.g_idx is None for s in singles)


# --- 2. validation errors name the offending expert of the batch -----------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "+inf", "-inf"])
def test_nonfinite_scale_names_middle_expert(tmp_path: Path, bad: float) -> None:
    write(tmp_path, "gptq")
    name = f"{P}.2.gate_proj.scales"

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[name][1, 5] = bad

    rewrite(model(tmp_path), poison)
    with pytest.raises(FormatError, match=re.escape(f"{name}: 1 NaN/Inf scale values in this rank's slice")):
        params_of(tmp_path, Proj.GATE)


def test_nonfinite_scales_counted_for_first_bad_expert(tmp_path: Path) -> None:
    """Two bad experts (2 and 3): the message names expert 2 and counts only its values."""
    write(tmp_path, "compressed-tensors")

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[f"{P}.2.down_proj.weight_scale"][[0, 7, 9], 1] = float("nan")
        t[f"{P}.3.down_proj.weight_scale"][0, 0] = float("inf")

    rewrite(model(tmp_path), poison)
    with pytest.raises(FormatError, match=re.escape(f"{P}.2.down_proj.weight_scale: 3 NaN/Inf scale values")):
        params_of(tmp_path, Proj.DOWN)


def test_allow_nonfinite_lets_nan_through(tmp_path: Path) -> None:
    write(tmp_path, "gptq")
    name = f"{P}.2.up_proj.scales"

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[name][1, 5] = float("nan")

    rewrite(model(tmp_path), poison)
    params = params_of(tmp_path, Proj.UP, allow_nonfinite=True)
    bad = ~torch.isfinite(params.scales)
    assert bad.nonzero().tolist() == [[2, 5, 1]]  # scales [E, N, nG] from storage [nG, N]


def test_nonfinite_scale_outside_rank_slice_not_seen(tmp_path: Path) -> None:
    """A NaN in rank 0's rows of gate is not in rank 1's slice."""
    write(tmp_path, "gptq")

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[f"{P}.2.gate_proj.scales"][0, 3] = float("nan")  # column N=3 < I_p

    rewrite(model(tmp_path), poison)
    assert torch.isfinite(params_of(tmp_path, Proj.GATE, 2, 1).scales).all()
    with pytest.raises(FormatError, match=re.escape(f"{P}.2.gate_proj.scales: 1 NaN/Inf")):
        params_of(tmp_path, Proj.GATE, 2, 0)


def test_symmetric_zeros_differ_names_middle_expert(tmp_path: Path) -> None:
    """Symmetric GPTQ v1 with stored qzeros: z - 1 = 7 everywhere is accepted; one field of 8 in expert 2 is not."""
    write(tmp_path, "gptq", symmetric=True)
    name = f"{P}.2.down_proj.qzeros"

    def add_zeros(t: dict[str, torch.Tensor]) -> None:
        for e in range(4):
            t[f"{P}.{e}.down_proj.qzeros"] = torch.full((I // 32, H // 8), 0x77777777, dtype=torch.int32)
        t[name][1, 3] = 0x77777778  # field 0 decodes to z = 9

    rewrite(model(tmp_path), add_zeros)
    with pytest.raises(FormatError, match=re.escape(f"{name}: the config is symmetric (z = 8) but 1 stored zero "
                                                    f"points decode to other values [9]; refusing to drop them")):
        params_of(tmp_path, Proj.DOWN)


def test_g_idx_range_names_middle_expert(tmp_path: Path) -> None:
    write(tmp_path, "gptq", act_order=True)
    name = f"{P}.2.gate_proj.g_idx"

    def corrupt(t: dict[str, torch.Tensor]) -> None:
        t[name][7] = 99

    rewrite(model(tmp_path), corrupt)
    with pytest.raises(FormatError, match=re.escape(f"{name}: g_idx values span [0, 99] but K = 128 with group "
                                                    f"size 32 has groups 0..3")):
        params_of(tmp_path, Proj.GATE)


def test_g_idx_group_sizes_name_middle_expert(tmp_path: Path) -> None:
    write(tmp_path, "compressed-tensors", act_order=True)
    name = f"{P}.2.up_proj.weight_g_idx"
    g_idx = torch.tensor([0] * 40 + [1] * 24 + [2] * 32 + [3] * 32, dtype=torch.int32)  # 40 and 24 rows, not 32
    rewrite(model(tmp_path), lambda t: t.update({name: g_idx}))
    with pytest.raises(FormatError, match=re.escape(f"{name}: g_idx groups are not of the declared size 32: "
                                                    f"group 0: 40 rows (expected 32); group 1: 24 rows "
                                                    f"(expected 32).")):
        params_of(tmp_path, Proj.UP)


def test_permuting_g_idx_without_act_order_names_middle_expert(tmp_path: Path) -> None:
    write(tmp_path, "gptq")
    plain = (torch.arange(I) // 32).to(torch.int32)

    def add_g_idx(t: dict[str, torch.Tensor]) -> None:
        for e in range(4):
            t[f"{P}.{e}.down_proj.g_idx"] = plain.clone()
            t[f"{P}.{e}.gate_proj.g_idx"] = plain.clone()
        t[f"{P}.2.down_proj.g_idx"] = plain.flip(0).contiguous()

    rewrite(model(tmp_path), add_g_idx)
    with pytest.raises(FormatError, match=re.escape(f"{P}.2.down_proj.g_idx: g_idx permutes input rows")):
        params_of(tmp_path, Proj.DOWN, 2, 1)
    assert params_of(tmp_path, Proj.GATE, 2, 1).g_idx is None  # plain (k // G) g_idx is accepted and dropped


def test_weight_shape_mismatch_names_middle_expert(tmp_path: Path) -> None:
    write(tmp_path, "compressed-tensors")
    name = f"{P}.2.up_proj.weight_shape"
    rewrite(model(tmp_path), lambda t: t.update({name: torch.tensor([I, 2 * H], dtype=torch.int64)}))
    with pytest.raises(FormatError, match=re.escape(f"{name}: records shape [128, 256] but the config implies "
                                                    f"[128, 128] (N, K).")):
        params_of(tmp_path, Proj.UP)


# --- 4. rank_spans ---------------------------------------------------------------------------------------------

def geometry(hidden: int, inter: int, group: int, tp: int, rank: int, act_order: bool = False) -> LayerGeometry:
    return LayerGeometry(hidden=hidden, intermediate=inter, num_experts=4, bits=4, group_size=group,
                         act_order=act_order, parallel=ParallelConfig(tp_size=tp, tp_rank=rank))


def source(kind: Source, hidden: int, inter: int) -> SourceTensors:
    n_one, k = (hidden, inter) if kind is Source.DOWN else (inter, hidden)
    return SourceTensors(kind, {}, None, n_total=n_one * len(kind.projs), k_total=k)


@pytest.mark.parametrize("tp,rank,inter", [(1, 0, 192), (2, 1, 256), (4, 3, 512)])
def test_rank_spans_no_pick_when_groups_are_read_in_order(tp: int, rank: int, inter: int) -> None:
    geo = geometry(256, inter, 128, tp, rank)
    part = inter // tp
    spans, pick = rank_spans(source(Source.DOWN, 256, inter), geo.slice(Proj.DOWN))
    assert pick is None
    assert spans[Dim.K] == Span(rank * part, (rank + 1) * part) and spans[Dim.N] == Span(0, 256)
    assert spans[Dim.GROUP] == Span(rank * part // 128, -(-(rank + 1) * part // 128))
    spans, pick = rank_spans(source(Source.GATE, 256, inter), geo.slice(Proj.GATE))
    assert pick is None and spans[Dim.GROUP] == Span(0, 2) and spans[Dim.N] == Span(rank * part, (rank + 1) * part)


def test_rank_spans_pick_when_group_size_shrinks() -> None:
    """G = 128, I_p = 96: G_eff = 32, so fused groups repeat read groups and pick lists their offsets."""
    geo = geometry(256, 192, 128, 2, 1)
    assert geo.group_eff == 32
    spans, pick = rank_spans(source(Source.DOWN, 256, 192), geo.slice(Proj.DOWN))
    assert spans[Dim.K] == Span(96, 192) and spans[Dim.GROUP] == Span(0, 2)
    assert pick.dtype == torch.long and pick.tolist() == [0, 1, 1]  # columns 96, 128, 160 -> groups 0, 1, 1
    spans, pick = rank_spans(source(Source.GATE, 256, 192), geo.slice(Proj.GATE))
    assert spans[Dim.GROUP] == Span(0, 2) and pick.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_rank_spans_up_in_gate_up_is_offset() -> None:
    """up is the second half of a gate_up source along N."""
    geo = geometry(64, 64, 32, 2, 1)
    spans, _ = rank_spans(source(Source.GATE_UP, 64, 64), geo.slice(Proj.UP))
    assert spans[Dim.N] == Span(64 + 32, 128)
    spans, _ = rank_spans(source(Source.GATE_UP, 64, 64), geo.slice(Proj.GATE))
    assert spans[Dim.N] == Span(32, 64)


def test_read_params_applies_the_pick(tmp_path: Path) -> None:
    """Down scales of tp rank 1 with I_p = 96, G = 128: the stored groups repeated as [0, 1, 1]."""
    write(tmp_path, "gptq", group=128, hidden=256, inter=192)
    tensors = load_file(str(model(tmp_path)))
    params = params_of(tmp_path, Proj.DOWN, 2, 1)
    for e in range(4):
        stored = tensors[f"{P}.{e}.down_proj.scales"]  # [I/G = 2, H]
        assert torch.equal(params.scales[e], stored.t()[:, [0, 1, 1]])
    assert params.zeros.shape == (4, 256, 3)
