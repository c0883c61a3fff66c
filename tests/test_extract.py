"""extract: batched reads of scales / zero points / g_idx, batched weight conversion, rank spans.

Checkpoints are written with `write_checkpoint` and corrupted with `rewrite`; the readers are called
directly on a planned layer. Expected weight bytes are built from the stored int32 words with a
reference unpacker written here (plain shifts and masks), independent of `packing`.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import torch
from safetensors.torch import load_file

from conftest import rewrite
from wna16_loader import FormatError, ParallelConfig
from wna16_loader import extract
from wna16_loader.checkpoint import CheckpointIndex, TensorRef
from wna16_loader.extract import QweightPiece, SourceTensors, rank_spans, read_params, read_qweights
from wna16_loader.formats import Dim, QuantSpec, Role, TensorLayout
from wna16_loader.formats.spec import FLOAT_DTYPES
from wna16_loader.hook import MEMORY_FILE, TensorStore
from wna16_loader.ledger import Ledger
from wna16_loader.modelconfig import read_config_files
from wna16_loader.names import Proj, Source
from wna16_loader.plan import LayerPlan, plan_layers
from wna16_loader.sharding import LayerGeometry, Span
from wna16_loader.synthetic import quant_config, write_checkpoint

P = "model.layers.0.mlp.experts"
H = I = 128
TP1 = (1, 0)


def write(folder: Path, fmt: str, *, bits: int = 4, group: int = 32, symmetric: bool = False,
          act_order: bool = False, hidden: int = H, inter: int = I, **kwargs) -> None:
    write_checkpoint(folder, quant_config(fmt, bits=bits, group_size=group, symmetric=symmetric, act_order=act_order),
                     num_experts=kwargs.pop("num_experts", 4), hidden=hidden, intermediate=inter, **kwargs)


@contextmanager
def planned(folder: Path, tp: int = 1, rank: int = 0) -> Iterator[tuple[CheckpointIndex, QuantSpec, LayerPlan]]:
    """(open index, quant spec, plan of the only layer) for TP rank `rank` of `tp`."""
    moe = read_config_files(folder)
    with CheckpointIndex(folder) as index:
        plan = plan_layers(index, moe, ParallelConfig(tp_size=tp, tp_rank=rank), Ledger())[0]
        yield index, moe.quant, plan


def batch(plan: LayerPlan, proj: Proj) -> list[SourceTensors]:
    """The sources of `proj` for every local expert, in slot order."""
    return [plan.sources[(e, proj)] for e in plan.fused.experts]


def params_of(folder: Path, proj: Proj, tp: int = 1, rank: int = 0, **kwargs) -> extract.ProjectionParams:
    with planned(folder, tp, rank) as (index, spec, plan):
        return read_params(index, spec, batch(plan, proj), plan.geometry.slice(proj), **kwargs)


def model(folder: Path) -> Path:
    return folder / "model.safetensors"


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


# --- 3. read_qweights ---------------------------------------------------------------------------------------------

def unpack_reference(words: torch.Tensor, bits: int, dim: int, slot_order: Sequence[int] | None) -> torch.Tensor:
    """int32 words -> uint8 values along `dim`, by shifts and masks; slot s holds position slot_order[s]."""
    per = 32 // bits
    wide = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    slots = torch.stack([(wide >> (bits * s)) & ((1 << bits) - 1) for s in range(per)], dim=-1)
    values = torch.empty_like(slots)
    values[..., list(slot_order or range(per))] = slots
    return values.reshape(*wide.shape[:-1], -1).movedim(-1, dim).to(torch.uint8)


def pack_reference(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[.., K] values -> fused bytes along the last dim: 4-bit byte j = v[2j] | v[2j+1] << 4."""
    if bits == 8:
        return values.to(torch.uint8)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).to(torch.uint8)


def expected_qweight(folder: Path, spec: QuantSpec, plan: LayerPlan, proj: Proj) -> torch.Tensor:
    """[E, N_l, K_l*b/8] uint8 from the whole stored tensors, sliced by the geometry's cut."""
    tensors = load_file(str(model(folder)))
    layout, cut = spec.layout(Role.QWEIGHT), plan.geometry.slice(proj)
    out = []
    for expert in plan.fused.experts:
        src = plan.sources[(expert, proj)]
        stored = tensors[src.tensors[Role.QWEIGHT].name]
        stored = stored if src.expert_row is None else stored[src.expert_row]
        values = unpack_reference(stored, spec.bits, layout.dims.index(layout.packed), layout.slot_order)
        values = values.permute([layout.dims.index(Dim.N), layout.dims.index(Dim.K)])  # [N, K]
        offset = 0 if proj is not Proj.UP or src.source is not Source.GATE_UP else src.n_total // 2
        values = values[offset + cut.n.start:offset + cut.n.stop, cut.k.start:cut.k.stop]
        out.append(pack_reference(values, spec.bits))
    return torch.stack(out)


def as_bytes(pieces: list[QweightPiece]) -> torch.Tensor:
    """The pieces placed at their experts and N rows, as uint8 [E, N_l, K_l*b/8] (int32 words read as
    their little-endian bytes); every row must be covered exactly once."""
    experts, rows = max(p.experts.stop for p in pieces), max(p.n.stop for p in pieces)
    k_bytes = pieces[0].tensor.shape[2] * pieces[0].tensor.element_size()
    out = torch.zeros(experts, rows, k_bytes, dtype=torch.uint8)
    covered = torch.zeros(experts, rows, dtype=torch.int32)
    for p in pieces:
        out[p.experts, p.n.start:p.n.stop] = p.tensor.clone(memory_format=torch.contiguous_format).view(torch.uint8)
        covered[p.experts, p.n.start:p.n.stop] += 1
    assert bool((covered == 1).all()), "pieces overlap or leave gaps"
    return out


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the conversions read_qweights calls (nibble transpose, byte packing)."""
    calls: list[str] = []
    for name in ("transpose_nibble_words", "pack_bytes"):
        original = getattr(extract, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(extract, name, spy)
    return calls


QWEIGHT_CASES = [  # id, fmt, bits, group, hidden, inter, tp, rank, stacked, {proj: path}
    ("gptq-4b-words-along-K", "gptq", 4, 32, 64, 64, 2, 1, False,
     {Proj.GATE: "view", Proj.UP: "view", Proj.DOWN: "view"}),
    ("ct-8b-words-along-K", "compressed-tensors", 8, 32, 64, 64, 2, 1, False,
     {Proj.GATE: "view", Proj.UP: "view", Proj.DOWN: "view"}),
    ("awq-4b-along-N", "awq", 4, 32, 64, 64, 2, 1, False,
     {Proj.GATE: "nibble", Proj.UP: "nibble", Proj.DOWN: "nibble"}),
    ("awq-4b-along-N-stacked", "awq", 4, 32, 64, 64, 2, 1, True,
     {Proj.GATE: "nibble", Proj.UP: "nibble", Proj.DOWN: "nibble"}),
    # channelwise, I = 24, tp 2: I_p = 12, so down's K span [12, 24) starts 4 rows into a word (4 mod 8)
    ("awq-4b-K-span-4-mod-8", "awq", 4, -1, 64, 24, 2, 1, False,
     {Proj.GATE: "nibble", Proj.UP: "nibble", Proj.DOWN: "generic"}),
    ("gptq-4b-K-span-4-mod-8", "gptq", 4, -1, 64, 24, 2, 1, False,
     {Proj.GATE: "view", Proj.UP: "view", Proj.DOWN: "generic"}),
    ("gptq-4b-K-span-4-mod-8-rank0", "gptq", 4, -1, 64, 24, 2, 0, False,
     {Proj.GATE: "view", Proj.UP: "view", Proj.DOWN: "generic"}),
]
PATH_CALLS = {"view": [], "nibble": ["transpose_nibble_words"], "generic": ["pack_bytes"]}


@pytest.mark.parametrize("fmt,bits,group,hidden,inter,tp,rank,stacked,paths", [c[1:] for c in QWEIGHT_CASES],
                         ids=[c[0] for c in QWEIGHT_CASES])
def test_read_qweights_paths(tmp_path: Path, conversions: list[str], fmt: str, bits: int, group: int,
                             hidden: int, inter: int, tp: int, rank: int, stacked: bool,
                             paths: dict[Proj, str]) -> None:
    """Each conversion path yields the fused bytes of the rank's slice, expert by expert, in order."""
    write(tmp_path, fmt, bits=bits, group=group, hidden=hidden, inter=inter, stacked=stacked)
    with planned(tmp_path, tp, rank) as (index, spec, plan):
        for proj in Proj:
            sources = batch(plan, proj)
            conversions.clear()
            chunks = list(read_qweights(index, spec, sources, rank_spans(sources[0], plan.geometry.slice(proj))[0]))
            assert sorted(set(conversions)) == PATH_CALLS[paths[proj]], proj
            if paths[proj] == "view":  # tiny experts evenly spaced in the file: one strided view of all
                assert [c.experts for c in chunks] == [slice(0, len(sources))]
            assert [e for c in chunks for e in range(len(sources))[c.experts]] == list(range(len(sources)))
            got, want = as_bytes(chunks), expected_qweight(tmp_path, spec, plan, proj)
            assert got.shape == want.shape, proj
            assert torch.equal(got, want), proj


def test_read_qweights_8_bit_along_n_is_generic(conversions: list[str]) -> None:
    """8-bit words packed along N (4 per word), an unaligned N and K span: unpacked, trimmed and repacked."""
    spec = QuantSpec(format_name="test", bits=8, group_size=32, symmetric=True, act_order=False, layouts=(
        TensorLayout(Role.QWEIGHT, "qweight", (Dim.K, Dim.N), packed=Dim.N),
        TensorLayout(Role.SCALES, "scales", (Dim.GROUP, Dim.N), dtypes=FLOAT_DTYPES)))
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (3, 24, 40), generator=gen, dtype=torch.int64)  # [E, N, K]
    shifted = q.view(3, 6, 4, 40) << torch.tensor([0, 8, 16, 24]).view(1, 1, 4, 1)
    wide = shifted.sum(2)  # [E, N/4, K]: byte s of word w holds n = 4w + s
    words = torch.where(wide >= 1 << 31, wide - (1 << 32), wide).to(torch.int32).transpose(1, 2).contiguous()
    store, sources = TensorStore(), []
    for e in range(3):
        ref = store.hold(TensorRef(f"x.{e}.down_proj.qweight", MEMORY_FILE, (40, 6), torch.int32), words[e])
        sources.append(SourceTensors(Source.DOWN, {Role.QWEIGHT: ref}, None, n_total=24, k_total=40))
    spans = {Dim.N: Span(5, 18), Dim.K: Span(12, 36)}
    got = as_bytes(list(read_qweights(store, spec, sources, spans)))
    assert conversions == ["pack_bytes"]
    assert torch.equal(got, q[:, 5:18, 12:36].to(torch.uint8))


CHUNK_CASES = [  # fmt, group, hidden, inter, proj, tp, rank, bytes of words per expert (K rows x N words x 4)
    ("awq", 32, 64, 64, Proj.GATE, 1, 0, 64 * 8 * 4),
    ("awq", -1, 64, 24, Proj.DOWN, 2, 1, 12 * 8 * 4),  # generic path: K [12, 24), N = H = 64
]


@pytest.mark.parametrize("fmt,group,hidden,inter,proj,tp,rank,per_expert", CHUNK_CASES, ids=["nibble", "generic"])
@pytest.mark.parametrize("experts_per_chunk", [1, 2, 3])
def test_read_qweights_chunking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, group: int, hidden: int,
                                inter: int, proj: Proj, tp: int, rank: int, per_expert: int,
                                experts_per_chunk: int) -> None:
    """A small QWEIGHT_CHUNK_BYTES splits the batch into several in-order chunks; the bytes do not change."""
    write(tmp_path, fmt, group=group, hidden=hidden, inter=inter, num_experts=7)
    small = experts_per_chunk * per_expert + per_expert // 2
    with planned(tmp_path, tp, rank) as (index, spec, plan):
        sources = batch(plan, proj)
        spans = rank_spans(sources[0], plan.geometry.slice(proj))[0]
        whole = list(read_qweights(index, spec, sources, spans))
        monkeypatch.setattr(extract, "QWEIGHT_CHUNK_BYTES", small)
        chunks = list(read_qweights(index, spec, sources, spans))
    assert len(whole) == 1 and len(sources) == 7
    assert len(chunks) == -(-7 // experts_per_chunk) > 1
    assert [e for c in chunks for e in range(7)[c.experts]] == list(range(7))
    assert all(c.experts.step in (None, 1) and 1 <= c.experts.stop - c.experts.start <= max(1, small // per_expert)
               for c in chunks)
    assert all(c.tensor.shape[0] == c.experts.stop - c.experts.start for c in chunks)
    assert torch.equal(as_bytes(chunks), as_bytes(whole))
    assert torch.equal(as_bytes(chunks), expected_qweight(tmp_path, spec, plan, proj))


def test_read_qweights_chunk_smaller_than_one_expert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget below one expert: the nibble path converts each expert in slabs of one N word (8 rows)."""
    write(tmp_path, "awq", hidden=64, inter=64, num_experts=3)
    monkeypatch.setattr(extract, "QWEIGHT_CHUNK_BYTES", 1)
    with planned(tmp_path) as (index, spec, plan):
        sources = batch(plan, Proj.DOWN)
        chunks = list(read_qweights(index, spec, sources, rank_spans(sources[0], plan.geometry.slice(Proj.DOWN))[0]))
        assert [(c.experts, c.n) for c in chunks] == [(slice(e, e + 1), Span(n, n + 8)) for e in range(3)
                                                      for n in range(0, 64, 8)]
        assert torch.equal(as_bytes(chunks), expected_qweight(tmp_path, spec, plan, Proj.DOWN))


@pytest.mark.parametrize("tp,rank,slabs", [(1, 0, [(0, 16), (16, 32), (32, 48), (48, 64)]),
                                           (2, 1, [(0, 12), (12, 28), (28, 36)])])
def test_read_qweights_large_expert_slabs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, rank: int,
                                          slabs: list[tuple[int, int]]) -> None:
    """Slabs hold whole words of about QWEIGHT_CHUNK_BYTES; an N span starting inside a word (I = 72,
    tp 2: gate rows [36, 72)) gets a short first slab, then word-aligned ones."""
    write(tmp_path, "awq", hidden=64, inter=64 if tp == 1 else 72, group=-1 if tp == 2 else 32, num_experts=2)
    monkeypatch.setattr(extract, "QWEIGHT_CHUNK_BYTES", 64 * 4 * 2 + 100)  # K = H = 64 rows: 2 words per slab
    with planned(tmp_path, tp, rank) as (index, spec, plan):
        sources = batch(plan, Proj.GATE)
        chunks = list(read_qweights(index, spec, sources, rank_spans(sources[0], plan.geometry.slice(Proj.GATE))[0]))
        assert [(c.n.start, c.n.stop) for c in chunks] == slabs * 2
        assert torch.equal(as_bytes(chunks), expected_qweight(tmp_path, spec, plan, Proj.GATE))


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


@pytest.mark.parametrize("experts,chunk_bytes,pieces", [
    (12, 2 << 20, [slice(0, 12)]),  # ids 0, 1, 10, 11, 2, ... in the file: unevenly spaced, gathered (a copy)
    (4, 2 << 20, [slice(0, 4)]),  # evenly spaced: one strided view of the mapping
    (4, 8 * 32 * 4, [slice(e, e + 1) for e in range(4)]),  # a slice fills the chunk: one view per expert
])
def test_fused_words_batching(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, experts: int, chunk_bytes: int,
                              pieces: list[slice]) -> None:
    """Words that already hold the fused bytes come a chunk of experts at a time, whatever their file order."""
    write(tmp_path, "gptq", hidden=64, inter=64, num_experts=experts)
    monkeypatch.setattr(extract, "QWEIGHT_CHUNK_BYTES", chunk_bytes)
    with planned(tmp_path, 2, 1) as (index, spec, plan):
        sources = batch(plan, Proj.GATE)  # K 64 rows: 8 words x N_l 32 per expert
        begins = [index.begins[src.tensors[Role.QWEIGHT].name] for src in sources]
        assert (len(set(b - a for a, b in zip(begins, begins[1:]))) > 1) == (experts > 10)
        chunks = list(read_qweights(index, spec, sources, rank_spans(sources[0], plan.geometry.slice(Proj.GATE))[0]))
        assert [c.experts for c in chunks] == pieces
        assert torch.equal(as_bytes(chunks), expected_qweight(tmp_path, spec, plan, Proj.GATE))
