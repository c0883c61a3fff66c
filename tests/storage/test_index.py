"""Checkpoint IO errors: index files, shard headers, unsafe paths, corrupt and pickle-only folders."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wna16_loader import CheckpointError, ParallelConfig, WNA16Error, load_experts
from wna16_loader.storage.index import INDEX_FILE, CheckpointIndex
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

TP1 = ParallelConfig(tp_size=1, tp_rank=0)
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def sharded(folder: Path) -> dict:
    """A 3-file checkpoint with an index; returns the parsed index."""
    write_checkpoint(folder, quant_config("gptq", bits=4, group_size=32, symmetric=False), num_experts=4,
                     hidden=64, intermediate=64, num_layers=3, files=3)
    assert sorted(p.name for p in folder.glob("*.safetensors")) == SHARDS
    return json.loads((folder / INDEX_FILE).read_text())


def write_index(folder: Path, index: dict) -> None:
    (folder / INDEX_FILE).write_text(json.dumps(index))


def single(folder: Path) -> None:
    write_checkpoint(folder, quant_config("gptq", bits=4, group_size=32), num_experts=4, hidden=64,
                     intermediate=64)


def test_sharded_checkpoint_loads(tmp_path):
    sharded(tmp_path)
    with CheckpointIndex(tmp_path) as index:
        assert index.files == SHARDS
        assert {ref.file for ref in index.refs.values()} == set(SHARDS)
        assert index.bytes_read == 0  # building the index reads headers only
    assert len(load_experts(tmp_path, TP1)) == 3


def test_index_names_missing_file(tmp_path):
    index = sharded(tmp_path)
    name = next(n for n, f in index["weight_map"].items() if f == SHARDS[2])
    index["weight_map"][name] = "model-00009-of-00003.safetensors"
    write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=r"names 'model-00009-of-00003\.safetensors', which does not exist"):
        load_experts(tmp_path, TP1)


@pytest.mark.parametrize("entry", ("../x.safetensors", "sub/../../x.safetensors"))
def test_index_entry_outside_folder_refused(tmp_path, entry):
    folder = tmp_path / "ckpt"
    index = sharded(folder)
    save_file({"a": torch.zeros(1)}, str(tmp_path / "x.safetensors"))  # the target exists, and is still refused
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = entry
    write_index(folder, index)
    with pytest.raises(CheckpointError, match=r"entry '.*x\.safetensors' points outside the checkpoint folder"):
        load_experts(folder, TP1)


def test_index_absolute_entry_refused(tmp_path):
    index = sharded(tmp_path)
    name = next(n for n, f in index["weight_map"].items() if f == SHARDS[0])
    index["weight_map"][name] = str(tmp_path / SHARDS[0])  # absolute, even though it points inside
    write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=r"points outside the checkpoint folder.*refusing to read it"):
        load_experts(tmp_path, TP1)


def hub_snapshot(tmp_path: Path, src: Path) -> Path:
    """The Hugging Face hub cache layout of `src`: snapshots/<rev>/<file> symlinks to ../../blobs/<sha>."""
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(src.iterdir())):
        (blobs / f"sha{i}").write_bytes(path.read_bytes())
        os.symlink(f"../../blobs/sha{i}", snapshot / path.name)
    return snapshot


def test_hub_cache_layout_with_index_loads(tmp_path):
    """Index entries are plain file names whose symlinks point into the cache's blobs/: allowed."""
    src = tmp_path / "src"
    sharded(src)
    snapshot = hub_snapshot(tmp_path, src)
    want = load_experts(src, TP1)
    got = load_experts(snapshot, TP1)
    assert list(got) == list(want)
    for prefix in want:
        for name, tensor in want[prefix].tensors.items():
            assert torch.equal(got[prefix].tensors[name], tensor)


def test_hub_cache_layout_without_index_loads(tmp_path):
    src = tmp_path / "src"
    single(src)
    assert list(load_experts(hub_snapshot(tmp_path, src), TP1)) == list(load_experts(src, TP1))


def test_symlink_outside_the_folder_refused(tmp_path):
    """A shard that is a symlink to a file outside the folder (not a hub blob) is refused."""
    src, ckpt = tmp_path / "src", tmp_path / "ckpt"
    single(src)
    ckpt.mkdir()
    for path in src.iterdir():
        os.symlink(path, ckpt / path.name)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load_experts(ckpt, TP1)


def test_tensor_in_two_files(tmp_path):
    single(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2, dtype=torch.float16)},
              str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.embed_tokens\.weight' is stored twice, in "
                                              r"extra\.safetensors and weights\.safetensors"):
        load_experts(tmp_path, TP1)


def test_stray_safetensors_beside_model_safetensors_is_not_read(tmp_path):
    """Hugging Face rule: without an index, model.safetensors alone when it exists. A reference dump with
    expert-like names (and a duplicate of a model tensor) beside it must not enter the load."""
    single(tmp_path)
    save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(64, 64),
               "model.embed_tokens.weight": torch.zeros(2, 2, dtype=torch.float16)},
              str(tmp_path / "reference.safetensors"))
    with CheckpointIndex(tmp_path) as index:
        assert index.files == ["model.safetensors"]
        assert not any(ref.file == "reference.safetensors" for ref in index.refs.values())
    assert len(load_experts(tmp_path, TP1)) == 1


def test_every_safetensors_without_index_or_model_safetensors(tmp_path):
    index = sharded(tmp_path)
    (tmp_path / INDEX_FILE).unlink()
    with CheckpointIndex(tmp_path) as ckpt:
        assert ckpt.files == SHARDS
        assert set(ckpt.refs) == set(index["weight_map"])
    assert len(load_experts(tmp_path, TP1)) == 3


def test_index_wins_over_model_safetensors(tmp_path):
    sharded(tmp_path)
    save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(64, 64)},
              str(tmp_path / "model.safetensors"))
    with CheckpointIndex(tmp_path) as index:
        assert index.files == SHARDS
    assert len(load_experts(tmp_path, TP1)) == 3


def test_tensor_in_two_indexed_files(tmp_path):
    index = sharded(tmp_path)
    name = next(n for n, f in index["weight_map"].items() if f == SHARDS[1] and n.endswith(".qweight"))
    from safetensors.torch import load_file
    moved = load_file(str(tmp_path / SHARDS[1]))[name]
    rest = load_file(str(tmp_path / SHARDS[2]))
    rest[name] = moved
    save_file(rest, str(tmp_path / SHARDS[2]))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is stored twice"):
        load_experts(tmp_path, TP1)


def test_index_and_header_disagree_on_file(tmp_path):
    index = sharded(tmp_path)
    name = next(n for n, f in index["weight_map"].items() if f == SHARDS[1])
    index["weight_map"][name] = SHARDS[0]
    write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=rf"disagrees with the shard headers for 1 tensors:\n.*{name}: "
                                              rf"index says {SHARDS[0]}, header says {SHARDS[1]}"):
        load_experts(tmp_path, TP1)


def test_index_lacks_a_tensor(tmp_path):
    index = sharded(tmp_path)
    name = next(n for n, f in index["weight_map"].items() if f == SHARDS[2])
    del index["weight_map"][name]
    write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=rf"{name}: in {SHARDS[2]} but not in the index"):
        load_experts(tmp_path, TP1)


def test_index_names_tensor_no_header_has(tmp_path):
    index = sharded(tmp_path)
    index["weight_map"]["model.layers.0.mlp.experts.0.gate_proj.ghost"] = SHARDS[0]
    write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.ghost: index says .*, header says nowhere"):
        load_experts(tmp_path, TP1)


@pytest.mark.parametrize("text", ("{not json", json.dumps({"metadata": {}}), json.dumps({"weight_map": {"a": 3}})))
def test_malformed_index(tmp_path, text):
    sharded(tmp_path)
    (tmp_path / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: (not valid JSON|expected an "
                                              r"object with a `weight_map`)"):
        load_experts(tmp_path, TP1)


@pytest.mark.parametrize("keep", (0.5, 0.98, 5 / 10**6))
def test_truncated_file(tmp_path, keep):
    single(tmp_path)
    path = tmp_path / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(max(5, int(size * keep)))
    with pytest.raises(CheckpointError) as exc:
        load_experts(tmp_path, TP1)
    if size * keep < 8:  # not even the length prefix: nothing tells truncation from garbage
        assert str(exc.value).startswith(f"{path}: not a readable safetensors file")
    else:
        assert str(exc.value) == (f"{path}: truncated: {int(size * keep)} of {size} bytes (the size its header "
                                  f"implies); re-download it (an interrupted download or copy).")


def test_truncated_inside_the_header(tmp_path):
    single(tmp_path)
    path = tmp_path / "model.safetensors"
    length = int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError) as exc:
        load_experts(tmp_path, TP1)
    assert str(exc.value) == (f"{path}: truncated: 100 of more than {8 + length} bytes (its header alone is {length} "
                              f"bytes); re-download it (an interrupted download or copy).")


def test_garbage_file(tmp_path):
    single(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file"):
        load_experts(tmp_path, TP1)


@pytest.mark.parametrize("suffix", (".bin", ".pt", ".pth", ".ckpt"))
def test_pickle_only_folder_refused(tmp_path, monkeypatch, suffix):
    single(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, tmp_path / f"pytorch_model{suffix}")
    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(("torch.load", a)))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: calls.append(("pickle.load", a)))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append(("pickle.loads", a)))
    with pytest.raises(CheckpointError, match=rf"holds only pickle checkpoints \['pytorch_model\{suffix}'\]; "
                                              r"they can run code when loaded and are refused"):
        load_experts(tmp_path, TP1)
    assert calls == []


def test_pickle_next_to_safetensors_is_ignored(tmp_path, monkeypatch):
    single(tmp_path)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a))
    assert len(load_experts(tmp_path, TP1)) == 1
    assert calls == []


def test_folder_without_safetensors(tmp_path):
    single(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "README.md").write_text("nothing here")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files and no model\.safetensors\.index\.json"):
        load_experts(tmp_path, TP1)


def test_not_a_folder(tmp_path):
    with pytest.raises(CheckpointError, match=r"not a checkpoint folder \(no such directory\)"):
        CheckpointIndex(tmp_path / "missing")


def test_unknown_dtype(tmp_path):
    single(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    save_file({"model.extra": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.extra' has dtype 'C64'"):
        CheckpointIndex(tmp_path)


def test_slice_reads_count_bytes(tmp_path):
    single(tmp_path)
    with CheckpointIndex(tmp_path) as index:
        ref = index.refs["model.layers.0.mlp.experts.0.gate_proj.qweight"]
        part = index.read(ref, (slice(0, 2), slice(0, 8)))
        assert part.shape == (2, 8) and part.dtype == torch.int32
        assert index.bytes_read == 2 * 8 * 4
        whole = index.read(ref)
        assert whole.shape == ref.shape and ref.nbytes == whole.numel() * 4
        assert torch.equal(whole[:2, :8], part)


def test_errors_are_value_errors():
    assert issubclass(CheckpointError, WNA16Error) and issubclass(WNA16Error, ValueError)


def _raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    """Write a safetensors file by hand (8-byte little-endian header length, JSON header, data)."""
    import json as _json
    import struct as _struct

    blob = _json.dumps(header).encode()
    path.write_bytes(_struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("header,why", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}, "offsets beyond the file"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, "overlapping offsets"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, "shape x itemsize != byte span"),
])
def test_hand_made_bad_headers_are_checkpoint_errors(tmp_path: Path, header: dict, why: str) -> None:
    _raw_safetensors(tmp_path / "model.safetensors", header, bytes(32))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        CheckpointIndex(tmp_path)


def test_a_ref_without_its_begin_is_located_by_name(tmp_path):
    """A ref carries the first byte its index read from the header; one without (begin -1, e.g. made by hand)
    is located by its name, alone or in a run, to the same bytes."""
    write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32), num_experts=4)
    with CheckpointIndex(tmp_path) as index:
        refs = [index.refs[f"model.layers.0.mlp.experts.{e}.down_proj.qweight"] for e in range(4)]
        assert all(ref.begin == index.begin(ref.name) for ref in refs)
        bare = [ref._replace(begin=-1) for ref in refs]
        assert torch.equal(index.read(bare[2], (slice(1, 3),)), index.read(refs[2], (slice(1, 3),)))
        assert torch.equal(index.gather(bare, [()] * 4), index.gather(refs, [()] * 4))
        assert index.locate_run(bare, [()] * 4) == [ref.begin for ref in refs]
