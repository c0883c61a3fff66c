"""qweights: the weights of a rank slice in the fused byte packing, by every conversion path, in chunks.

Checkpoints are written with `write_checkpoint` and read through a planned layer. Expected weight bytes
are built from the stored int32 words with a reference unpacker written here (plain shifts and masks),
independent of `packing`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest
import torch
from layer_helpers import batch, dense, model, planned, write
from safetensors.torch import load_file

from wna16_loader.engine.hook import MEMORY_FILE, TensorStore
from wna16_loader.formats import Dim, QuantSpec, Role, TensorLayout
from wna16_loader.formats.packing import NibbleWords
from wna16_loader.formats.spec import FLOAT_DTYPES
from wna16_loader.load import qweights
from wna16_loader.load.params import SourceTensors, rank_spans
from wna16_loader.load.plan import LayerPlan
from wna16_loader.load.qweights import QweightPiece, read_qweights
from wna16_loader.models.names import Proj, Source
from wna16_loader.parallel.partition import Span
from wna16_loader.storage.index import TensorRef

# --- read_qweights ---------------------------------------------------------------------------------------------

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
    their little-endian bytes); every row must be covered exactly once. Call it while the reader is open
    (`NibbleWords` read the file mapping when written)."""
    experts, rows = max(p.experts.stop for p in pieces), max(p.n.stop for p in pieces)
    k_bytes = pieces[0].tensor.shape[2] * pieces[0].tensor.dtype.itemsize
    out = torch.zeros(experts, rows, k_bytes, dtype=torch.uint8)
    covered = torch.zeros(experts, rows, dtype=torch.int32)
    for p in pieces:
        out[p.experts, p.n.start:p.n.stop] = dense(p.tensor).view(torch.uint8)
        covered[p.experts, p.n.start:p.n.stop] += 1
    assert bool((covered == 1).all()), "pieces overlap or leave gaps"
    return out


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the conversions read_qweights calls (nibble transpose, as `NibbleWords`; byte packing)."""
    calls: list[str] = []
    for name in ("NibbleWords", "pack_bytes"):
        original = getattr(qweights, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(qweights, name, spy)
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
PATH_CALLS = {"view": [], "nibble": ["NibbleWords"], "generic": ["pack_bytes"]}


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
    """A small QWEIGHT_CHUNK_BYTES (NIBBLE_CHUNK_BYTES for the nibble path) splits the batch into several
    in-order chunks; the bytes do not change."""
    write(tmp_path, fmt, group=group, hidden=hidden, inter=inter, num_experts=7)
    small = experts_per_chunk * per_expert + per_expert // 2
    with planned(tmp_path, tp, rank) as (index, spec, plan):
        sources = batch(plan, proj)
        spans = rank_spans(sources[0], plan.geometry.slice(proj))[0]
        whole = list(read_qweights(index, spec, sources, spans))
        monkeypatch.setattr(qweights, "QWEIGHT_CHUNK_BYTES", small)
        monkeypatch.setattr(qweights, "NIBBLE_CHUNK_BYTES", small)
        chunks = list(read_qweights(index, spec, sources, spans))
        got, once = as_bytes(chunks), as_bytes(whole)  # while the index is open: NibbleWords read it
    assert len(whole) == 1 and len(sources) == 7
    assert len(chunks) == -(-7 // experts_per_chunk) > 1
    assert [e for c in chunks for e in range(7)[c.experts]] == list(range(7))
    assert all(c.experts.step in (None, 1) and 1 <= c.experts.stop - c.experts.start <= max(1, small // per_expert)
               for c in chunks)
    assert all(c.tensor.shape[0] == c.experts.stop - c.experts.start for c in chunks)
    assert torch.equal(got, once)
    assert torch.equal(got, expected_qweight(tmp_path, spec, plan, proj))


def test_nibble_chunks_follow_their_own_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nibble path converts NIBBLE_CHUNK_BYTES of experts at a time, whatever QWEIGHT_CHUNK_BYTES is."""
    write(tmp_path, "awq", hidden=64, inter=64, num_experts=7)
    monkeypatch.setattr(qweights, "QWEIGHT_CHUNK_BYTES", 1)
    monkeypatch.setattr(qweights, "NIBBLE_CHUNK_BYTES", 3 * 64 * 8 * 4)  # K 64 rows x 8 words: 3 experts
    with planned(tmp_path) as (index, spec, plan):
        sources = batch(plan, Proj.GATE)
        chunks = list(read_qweights(index, spec, sources, rank_spans(sources[0], plan.geometry.slice(Proj.GATE))[0]))
        assert [c.experts for c in chunks] == [slice(0, 3), slice(3, 6), slice(6, 7)]
        assert all(isinstance(c.tensor, NibbleWords) for c in chunks)
        assert torch.equal(as_bytes(chunks), expected_qweight(tmp_path, spec, plan, Proj.GATE))


def test_read_qweights_chunk_smaller_than_one_expert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget below one expert: the nibble path converts each expert in slabs of one N word (8 rows)."""
    write(tmp_path, "awq", hidden=64, inter=64, num_experts=3)
    monkeypatch.setattr(qweights, "NIBBLE_CHUNK_BYTES", 1)
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
    """Slabs hold whole words of about NIBBLE_CHUNK_BYTES; an N span starting inside a word (I = 72,
    tp 2: gate rows [36, 72)) gets a short first slab, then word-aligned ones."""
    write(tmp_path, "awq", hidden=64, inter=64 if tp == 1 else 72, group=-1 if tp == 2 else 32, num_experts=2)
    monkeypatch.setattr(qweights, "NIBBLE_CHUNK_BYTES", 64 * 4 * 2 + 100)  # K = H = 64 rows: 2 words per slab
    with planned(tmp_path, tp, rank) as (index, spec, plan):
        sources = batch(plan, Proj.GATE)
        chunks = list(read_qweights(index, spec, sources, rank_spans(sources[0], plan.geometry.slice(Proj.GATE))[0]))
        assert [(c.n.start, c.n.stop) for c in chunks] == slabs * 2
        assert torch.equal(as_bytes(chunks), expected_qweight(tmp_path, spec, plan, Proj.GATE))


@pytest.mark.parametrize("experts,chunk_bytes,pieces", [
    (12, 2 << 20, [slice(0, 12)]),  # ids 0, 1, 10, 11, 2, ... in the file: unevenly spaced, gathered (a copy)
    (4, 2 << 20, [slice(0, 4)]),  # evenly spaced: one strided view of the mapping
    (4, 8 * 32 * 4, [slice(e, e + 1) for e in range(4)]),  # a slice fills the chunk: one view per expert
])
def test_fused_words_batching(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, experts: int, chunk_bytes: int,
                              pieces: list[slice]) -> None:
    """Words that already hold the fused bytes come a chunk of experts at a time, whatever their file order."""
    write(tmp_path, "gptq", hidden=64, inter=64, num_experts=experts)
    monkeypatch.setattr(qweights, "QWEIGHT_CHUNK_BYTES", chunk_bytes)
    with planned(tmp_path, 2, 1) as (index, spec, plan):
        sources = batch(plan, Proj.GATE)  # K 64 rows: 8 words x N_l 32 per expert
        begins = [index.begin(src.tensors[Role.QWEIGHT].name) for src in sources]
        assert (len(set(b - a for a, b in zip(begins, begins[1:]))) > 1) == (experts > 10)
        chunks = list(read_qweights(index, spec, sources, rank_spans(sources[0], plan.geometry.slice(Proj.GATE))[0]))
        assert [c.experts for c in chunks] == pieces
        assert torch.equal(as_bytes(chunks), expected_qweight(tmp_path, spec, plan, Proj.GATE))


def test_gathered_chunks_reuse_the_index_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Words gathered a chunk at a time (a writer that sorts names stores expert 10 before expert 2) land in the
    index's `Scratch`: every gathered chunk in the same memory (its pages fault once), each placed before the next
    is asked for, and the bytes do not change. Closing the index frees it."""
    write(tmp_path, "gptq", hidden=64, inter=64, num_experts=12)
    monkeypatch.setattr(qweights, "QWEIGHT_CHUNK_BYTES", 3 * 8 * 32 * 4)  # K 64 rows: 8 words x N_l 32, 3 experts
    with planned(tmp_path, 2, 1) as (index, spec, plan):
        sources = batch(plan, Proj.GATE)
        placed, gathered = [], 0
        for piece in read_qweights(index, spec, sources, rank_spans(sources[0], plan.geometry.slice(Proj.GATE))[0]):
            gathered += piece.tensor.data_ptr() == index.scratch.buffer.data_ptr()
            placed.append(QweightPiece(piece.experts, piece.n, piece.tensor.clone()))  # placed before the next
        assert [p.experts for p in placed] == [slice(e, e + 3) for e in range(0, 12, 3)]
        assert gathered >= 2 and index.scratch.nbytes == 3 * 8 * 32 * 4
        assert torch.equal(as_bytes(placed), expected_qweight(tmp_path, spec, plan, Proj.GATE))
    assert index.scratch.nbytes == 0
