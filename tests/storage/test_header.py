"""safetensors headers: the whole-header check (a few passes in C) refuses exactly what safetensors' own open
refuses, with a message that names the tensor, its span and the rule it breaks."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from wna16_loader import CheckpointError
from wna16_loader.storage.header import read_checked_header, read_header
from wna16_loader.storage.index import ITEMSIZES, CheckpointIndex


def rewritten(path: Path, change) -> Path:  # noqa: ANN001 (a function of the header dict)
    """`path`'s header changed in place by `change` (padded to its old length, so the data stays put)."""
    blob = path.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + length])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    path.write_bytes(blob[:8] + text.ljust(length) + blob[8 + length:])
    return path


def two_tensors(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(4, dtype=torch.int32), "b": torch.arange(4, dtype=torch.int32)}, str(path))
    return path


@pytest.mark.parametrize("change,why", [
    (lambda h: h["b"].update(data_offsets=[8, 24]),
     "tensor 'b' spans bytes [8, 24) of the data section, which overlaps the tensor before it (ending at byte 16); "
     "the file is corrupt."),
    (lambda h: h["b"].update(shape=[3]),
     "tensor 'b' spans bytes [16, 32) of the data section, but I32 [3] needs 12 bytes and the data section holds "
     "32; the file is corrupt or truncated."),
    (lambda h: h["a"].update(shape=[3], data_offsets=[0, 12]),
     "tensor 'b' spans bytes [16, 32) of the data section, which leaves a gap after the tensor before it (ending "
     "at byte 12); the file is corrupt."),
])
def test_bad_spans_are_refused_by_name_when_indexed(tmp_path, change, why):
    """The index keeps header entries as parsed: its whole-header check refuses spans that overlap, leave gaps or
    disagree with the shape, as safetensors' open does."""
    path = rewritten(two_tensors(tmp_path), change)
    with pytest.raises(CheckpointError) as exc:
        CheckpointIndex(tmp_path)
    assert str(exc.value) == f"{path}: {why}"
    with pytest.raises(Exception):  # noqa: B017 (safetensors raises its own error types)
        safe_open(str(path), framework="pt")


def test_trailing_bytes_are_refused(tmp_path):
    path = two_tensors(tmp_path)
    path.write_bytes(path.read_bytes() + bytes(8))
    with pytest.raises(CheckpointError) as exc:
        read_checked_header(path, ITEMSIZES)
    assert str(exc.value) == (f"{path}: the tensors cover 32 bytes of the data section but it holds 40; the file is "
                              f"corrupt or was written with trailing bytes.")


def test_a_good_header_is_kept_as_parsed(tmp_path):
    path = two_tensors(tmp_path)
    metadata, entries = read_checked_header(path, ITEMSIZES)
    _, one_by_one = read_header(path, ITEMSIZES)
    assert metadata == {} and dict(entries.items()) == dict(one_by_one)
    assert entries.uniform(["a", "b"], (4,)) == "I32" and entries.uniform(["a", "b"], (3,)) is None
    assert entries.begins(["b", "a"]) == [one_by_one["b"].begin, one_by_one["a"].begin]


def test_an_unknown_dtype_is_left_to_the_caller(tmp_path):
    """An entry of a dtype outside `itemsizes` passes the span checks it can and is kept, for the index to refuse
    by name (`CheckpointIndex`: `has dtype 'F4', which this loader does not know`)."""
    rewritten(two_tensors(tmp_path), lambda h: h["a"].update(dtype="F4"))
    with pytest.raises(CheckpointError, match=r"tensor 'a' has dtype 'F4', which this loader does not know"):
        CheckpointIndex(tmp_path)


SIZES = {"I32": 4, "F16": 2, "U8": 1}
TENSOR = st.tuples(st.sampled_from(sorted(SIZES)), st.lists(st.integers(0, 3), max_size=2))
BREAK = st.sampled_from([None, "begin", "end", "dim", "trailing", "short"])


def tiled(tensors: list[tuple[str, list[int]]]) -> tuple[dict, int]:
    """A header whose spans tile the data section in order, and the data section's length."""
    header, at = {}, 0
    for i, (dtype, shape) in enumerate(tensors):
        length = SIZES[dtype] * (shape[0] if shape else 1) * (shape[1] if len(shape) > 1 else 1)
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + length]}
        at += length
    return header, at


@settings(max_examples=80, deadline=None)
@given(tensors=st.lists(TENSOR, min_size=1, max_size=3), broken=BREAK, which=st.integers(0, 2), by=st.integers(-3, 3),
       order=st.permutations(range(3)))
def test_the_whole_header_check_accepts_what_safetensors_accepts(tmp_path_factory, tensors, broken, which, by, order):
    """Headers that tile their data section, in any key order, some broken in one place (an offset, a dim, the
    data's length): `read_checked_header` accepts one exactly when safetensors' own open does, and then every
    entry agrees with the entry-by-entry reader's."""
    header, data = tiled(tensors)
    entry = header[f"t{which % len(tensors)}"]
    if broken in ("begin", "end"):
        entry["data_offsets"][broken == "end"] = max(0, entry["data_offsets"][broken == "end"] + by)
    elif broken == "dim" and entry["shape"]:
        entry["shape"][0] = max(0, entry["shape"][0] + by)
    data += {"trailing": abs(by), "short": -min(abs(by), data)}.get(broken, 0)
    keys = [f"t{i}" for i in order if i < len(tensors)]
    path = tmp_path_factory.mktemp("h") / "x.safetensors"
    blob = json.dumps({key: header[key] for key in keys}).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(data))
    try:
        safe_open(str(path), framework="pt")
        accepted = True
    except Exception:  # noqa: BLE001 (safetensors raises its own error types)
        accepted = False
    try:
        _, entries_read = read_checked_header(path, ITEMSIZES)
    except CheckpointError:
        assert not accepted, header
        return
    assert accepted, header
    assert dict(entries_read.items()) == dict(read_header(path, ITEMSIZES)[1])
