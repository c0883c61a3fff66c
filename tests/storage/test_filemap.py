"""Reads by header offsets (filemap + CheckpointIndex.view/read/gather) pinned to safetensors' own reads.

Every slice read through one mapping per file must hold exactly the bytes `safe_open(...).get_slice`
returns, and a whole load through the offset path must be byte-identical to a load whose every read
goes through safetensors (the read path before the mapping).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from wna16_loader import CheckpointError, ParallelConfig, load_experts
from wna16_loader.storage.filemap import MappedFile, gather, grid_view
from wna16_loader.storage.index import ITEMSIZES, CheckpointIndex
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


class SafetensorsReader:
    """The reference reader: every slice through safetensors' get_slice (no mapping of ours)."""

    def __init__(self, index: CheckpointIndex) -> None:
        self.handles = {f: safe_open(str(index.folder / f), framework="pt") for f in index.files}

    def view(self, ref, index=()):
        view = self.handles[ref.file].get_slice(ref.name)
        return view[index] if index else view[:]

    def gather(self, refs, indices, *, pin=False, scratch=False):
        return torch.stack([self.view(r, i) for r, i in zip(refs, indices)])


def _mixed_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes (odd byte sizes first, so later tensors sit at unaligned offsets)."""
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "a.u8": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=gen),
        "b.f16": torch.randn(5, 3, generator=gen).to(torch.float16),
        "c.i32": torch.randint(-2**31, 2**31 - 1, (6, 10), dtype=torch.int32, generator=gen),
        "d.bf16": torch.randn(2, 3, 4, generator=gen).to(torch.bfloat16),
        "e.i32": torch.randint(-2**31, 2**31 - 1, (6, 10), dtype=torch.int32, generator=gen),
        "f.f32": torch.randn(9, generator=gen),
    }
    save_file(tensors, str(path))
    return tensors


def test_views_equal_the_stored_tensors(tmp_path):
    tensors = _mixed_file(tmp_path / "model.safetensors")
    with CheckpointIndex(tmp_path) as index:
        for name, want in tensors.items():
            ref = index.refs[name]
            assert (ref.shape, ref.dtype) == (tuple(want.shape), want.dtype)
            assert torch.equal(index.view(ref), want) and torch.equal(index.read(ref), want)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_slices_equal_get_slice(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("slices")
    _mixed_file(folder / "model.safetensors")
    with CheckpointIndex(folder) as index, safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        ref = index.refs[data.draw(st.sampled_from(sorted(index.refs)))]
        key = []
        for i, size in enumerate(ref.shape):
            if i == 0 and len(ref.shape) > 1 and data.draw(st.booleans()):
                key.append(data.draw(st.integers(0, size - 1)))
                continue
            start = data.draw(st.integers(0, size))
            key.append(slice(start, data.draw(st.integers(start, size))))
        key = tuple(key)
        want = handle.get_slice(ref.name)[key]
        assert torch.equal(index.read(ref, key), want)
        assert torch.equal(index.gather([ref, ref], [key, key])[1], want)


def test_gather_even_and_uneven_offsets(tmp_path):
    tensors = _mixed_file(tmp_path / "model.safetensors")
    with CheckpointIndex(tmp_path) as index:
        c, e = index.refs["c.i32"], index.refs["e.i32"]
        key = (slice(1, 4), slice(2, 9))
        both = index.gather([c, e, c], [key] * 3)  # uneven: e, then back to c
        assert torch.equal(both, torch.stack([tensors["c.i32"][key], tensors["e.i32"][key], tensors["c.i32"][key]]))
        rows = index.gather([c] * 3, [(4, slice(3, 7)), (5, slice(3, 7)), (0, slice(3, 7))])
        assert torch.equal(rows, tensors["c.i32"][[4, 5, 0], 3:7])
        assert index.bytes_read == both.numel() * 4 + rows.numel() * 4
    mapped = MappedFile(tmp_path / "model.safetensors", ITEMSIZES)
    begin = mapped.entries["c.i32"].begin
    even = gather(mapped, [begin, begin + 40, begin + 80], (10,), torch.int32, (slice(2, 5),))
    assert torch.equal(even, tensors["c.i32"][0:3, 2:5]) and even.is_contiguous()


def test_read_is_a_copy_and_view_is_file_memory(tmp_path):
    _mixed_file(tmp_path / "model.safetensors")
    with CheckpointIndex(tmp_path) as index:
        ref = index.refs["c.i32"]
        view, copy = index.view(ref), index.read(ref)
        assert copy.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
        kept = index.gather([ref], [()])
    assert torch.equal(view, copy) and torch.equal(kept[0], copy)  # views outlive close(): they hold the map


@pytest.mark.parametrize("entry,why", [
    ({"dtype": "I32", "shape": [4], "data_offsets": [0, 12]}, "needs 16 bytes"),
    ({"dtype": "I32", "shape": [4]}, "malformed header entry"),
])
def test_mapped_file_refuses_bad_spans(tmp_path, entry, why):
    import json
    import struct
    blob = json.dumps({"a": entry}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(16))
    with pytest.raises(CheckpointError, match=why):
        MappedFile(tmp_path / "x.safetensors", ITEMSIZES)


CASES = [  # (format, bits, group, symmetric, act_order, stacked, tp, ep)
    ("gptq", 4, 32, False, False, False, 2, 1),
    ("gptq", 4, 32, True, True, False, 4, 1),
    ("gptq", 8, 32, False, False, True, 2, 2),
    ("awq", 4, 32, False, False, False, 4, 1),
    ("awq", 4, -1, False, False, True, 1, 2),
    ("compressed-tensors", 4, 32, False, True, False, 3, 1),
    ("compressed-tensors", 8, 32, True, False, True, 2, 1),
    ("auto-round", 4, 32, False, False, False, 2, 2),
]


def read_through_safetensors(patch: pytest.MonkeyPatch) -> None:
    """Make every CheckpointIndex read go through safetensors' own slicing (the reference for byte identity)."""
    readers: dict[int, SafetensorsReader] = {}

    def reader(index: CheckpointIndex) -> SafetensorsReader:
        return readers.setdefault(id(index), SafetensorsReader(index))

    patch.setattr(CheckpointIndex, "view", lambda self, ref, index=(): reader(self).view(ref, index))
    patch.setattr(CheckpointIndex, "gather",
                  lambda self, refs, indices, pin=False, scratch=False: reader(self).gather(refs, indices))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_load_is_byte_identical_to_safetensors_reads(tmp_path, monkeypatch, case):
    fmt, bits, group, symmetric, act_order, stacked, tp, ep = case
    write_checkpoint(tmp_path, quant_config(fmt, bits=bits, group_size=group, symmetric=symmetric,
                                            act_order=act_order), num_experts=4, hidden=128, intermediate=192,
                     num_layers=2, files=2, stacked=stacked, references=False)
    for rank in range(tp * ep):
        parallel = ParallelConfig(tp_size=tp, tp_rank=rank % tp, ep_size=ep, ep_rank=rank // tp)
        ours = load_experts(tmp_path, parallel)
        with monkeypatch.context() as patch:
            read_through_safetensors(patch)
            theirs = load_experts(tmp_path, parallel)
        assert list(ours) == list(theirs)
        for prefix in ours:
            for name, tensor in ours[prefix].tensors.items():
                other = theirs[prefix].tensors[name]
                assert tensor.dtype == other.dtype and torch.equal(tensor.view(torch.uint8), other.view(torch.uint8)), \
                    (prefix, name)


@pytest.mark.parametrize("layout", ("fused", "checkpoint"))
def test_preshard_is_byte_identical_to_safetensors_reads(tmp_path, monkeypatch, layout):
    from wna16_loader.load.presharded import read_manifest
    from wna16_loader.preshard import preshard_checkpoint

    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", bits=4, group_size=32, symmetric=False), num_experts=4, hidden=128,
                     intermediate=128, num_layers=2, files=2, references=False)
    preshard_checkpoint(src, tmp_path / "ours", tp_size=2, ep_size=2, layout=layout, progress=False)
    with monkeypatch.context() as patch:
        read_through_safetensors(patch)
        preshard_checkpoint(src, tmp_path / "theirs", tp_size=2, ep_size=2, layout=layout, progress=False)
    hashes = lambda out: {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
                          for p in sorted(out.rglob("*.safetensors"))}
    assert hashes(tmp_path / "ours") == hashes(tmp_path / "theirs") and len(hashes(tmp_path / "ours")) > 4
    assert read_manifest(tmp_path / "ours") == read_manifest(tmp_path / "theirs")


def test_gather_of_tensors_evenly_spaced_in_file_order(tmp_path, monkeypatch):
    """A writer that sorts names stores expert 10 before expert 2: the offsets of experts 0..11, in expert
    order, are a permutation of evenly spaced ones, read through one strided view in file order."""
    tensors = {f"experts.{e}.w": torch.arange(12, dtype=torch.int32).reshape(3, 4) + 100 * e for e in range(12)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    mapped = MappedFile(tmp_path / "model.safetensors", ITEMSIZES)
    names = list(tensors)
    begins = [mapped.entries[name].begin for name in names]
    assert begins != sorted(begins)  # expert order is not file order
    strided = []
    monkeypatch.setattr("wna16_loader.storage.filemap._same_views", lambda *a: strided.append(a) or [])
    got = gather(mapped, begins, (3, 4), torch.int32, (slice(1, 3), slice(0, 2)))
    assert not strided and torch.equal(got, torch.stack([t[1:3, 0:2] for t in tensors.values()]))


def test_gather_of_a_run_of_experts_lying_out_of_order_with_gaps(tmp_path, monkeypatch):
    """Experts 0..4 of 12 in a file whose writer sorted the names (0, 1, 10, 11, 2, 3, 4, ...): their offsets
    are neither evenly spaced nor a permutation of evenly spaced ones, but lie on the grid of one expert's
    bytes: one strided view over the grid, each expert's row picked (no view per expert)."""
    tensors = {f"experts.{e}.w": torch.arange(12, dtype=torch.int32).reshape(3, 4) + 100 * e for e in range(12)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    mapped = MappedFile(tmp_path / "model.safetensors", ITEMSIZES)
    names = [f"experts.{e}.w" for e in range(5)]
    begins = [mapped.entries[name].begin for name in names]
    view, rows = grid_view(mapped, begins, (3, 4), torch.int32, (slice(1, 3),))
    assert rows.tolist() == [0, 1, 4, 5, 6] and view.shape == (7, 2, 4)
    assert view.untyped_storage().data_ptr() == mapped.flat(torch.uint8, 0).data_ptr()  # file memory
    strided = []
    monkeypatch.setattr("wna16_loader.storage.filemap._same_views", lambda *a: strided.append(a) or [])
    got = gather(mapped, begins, (3, 4), torch.int32, (slice(1, 3), slice(0, 2)))
    assert not strided and torch.equal(got, torch.stack([tensors[name][1:3, 0:2] for name in names]))


def test_grid_view_refuses_offsets_between_elements(tmp_path):
    """Offsets 2 bytes apart put int32 tensors on two element phases: no grid of whole elements holds both."""
    tensors = _mixed_file(tmp_path / "model.safetensors")
    mapped = MappedFile(tmp_path / "model.safetensors", ITEMSIZES)
    begin = mapped.entries["c.i32"].begin
    assert grid_view(mapped, [begin, begin + 6], (4,), torch.int32) is None
    assert torch.equal(gather(mapped, [begin, begin + 8, begin + 24], (2,), torch.int32),
                       tensors["c.i32"].flatten()[[0, 1, 2, 3, 6, 7]].reshape(3, 2))
