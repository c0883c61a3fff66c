"""Fuzzing: whole-space round trips, and byte-level mutation of headers, index and config files.

Properties:
- every combination the package accepts round-trips exactly; every one it rejects raises a WNA16Error;
- a mutated checkpoint either raises a WNA16Error or loads exactly what the intact one loads:
  no other exception type escapes and nothing corrupt loads as if it were intact.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wna16_loader import ParallelConfig, WNA16Error, load_experts
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _load_all(folder: Path, tp: int, ep: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    out = {}
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
        for prefix, layer in load_experts(folder, parallel).items():
            out[(parallel.rank, prefix)] = dict(layer.tensors)
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a.values(), b.values()))


@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("intact")
    write_checkpoint(folder, quant_config("gptq", bits=4, group_size=32, act_order=True), hidden=64,
                     intermediate=64, num_layers=2, files=2)
    return folder, _load_all(folder, 2, 2)


FORMATS = st.sampled_from(["gptq", "awq", "compressed-tensors", "auto-round"])


@FUZZ
@given(fmt=FORMATS, bits=st.sampled_from([4, 8]), group=st.sampled_from([16, 32, 64, -1, 24, 8]),
       sym=st.booleans(), act=st.booleans(), experts=st.integers(1, 6), hidden=st.sampled_from([32, 48, 64, 96]),
       inter=st.sampled_from([16, 32, 48, 96, 112]), tp=st.sampled_from([1, 2, 3, 4, 8]), ep=st.integers(1, 3))
def test_every_combination_round_trips_or_raises(tmp_path_factory: pytest.TempPathFactory, fmt: str, bits: int,
                                                 group: int, sym: bool, act: bool, experts: int, hidden: int,
                                                 inter: int, tp: int, ep: int) -> None:
    folder = tmp_path_factory.mktemp("combo")
    try:
        ckpt = write_checkpoint(folder, quant_config(fmt, bits=bits, group_size=group, symmetric=sym, act_order=act),
                                num_experts=experts, hidden=hidden, intermediate=inter)
    except WNA16Error:
        return  # the config itself is rejected (e.g. AWQ 8-bit, group 24) with a WNA16Error
    try:
        pieces = _load_all(folder, tp, ep)
    except WNA16Error:
        return
    for (rank, prefix), tensors in pieces.items():
        parallel = ParallelConfig.from_rank(rank, tp_size=tp, ep_size=ep)
        assert tensors["expert_ids"].tolist() == sorted(tensors["expert_ids"].tolist())
        for slot, expert in enumerate(tensors["expert_ids"].tolist()):
            layer = load_experts(folder, parallel)[prefix]
            part = layer.intermediate_size_per_partition
            real = part - layer.padding  # checkpoint columns; padding (zeros) follows them
            dq = layer.dequantize()
            lo = parallel.tp_rank * part
            assert torch.equal(dq.w13[slot, :real], ckpt.references[(prefix, expert, "gate")][lo:lo + real])
            assert torch.equal(dq.w13[slot, part:part + real], ckpt.references[(prefix, expert, "up")][lo:lo + real])
            assert torch.equal(dq.w2[slot, :, :real], ckpt.references[(prefix, expert, "down")][:, lo:lo + real])
            assert not dq.w13[slot, real:part].any() and not dq.w13[slot, part + real:].any()
            assert not dq.w2[slot, :, real:].any()


def _header_span(path: Path) -> tuple[int, int]:
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8, 8 + length


@FUZZ
@given(data=st.data())
def test_mutated_safetensors_header_never_escapes(intact: tuple[Path, dict], tmp_path_factory, data) -> None:
    folder, expected = intact
    copy = tmp_path_factory.mktemp("mut")
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    shard = sorted(copy.glob("*.safetensors"))[data.draw(st.integers(0, 1))]
    raw = bytearray(shard.read_bytes())
    start, stop = _header_span(shard)
    pos = data.draw(st.integers(0, stop - 1))
    raw[pos] = data.draw(st.integers(0, 255))
    shard.write_bytes(bytes(raw))
    _assert_raises_wna16_or_intact(copy, expected)


@FUZZ
@given(data=st.data(), which=st.sampled_from(["config.json", "model.safetensors.index.json"]))
def test_mutated_json_never_escapes(intact: tuple[Path, dict], tmp_path_factory, data, which: str) -> None:
    folder, expected = intact
    copy = tmp_path_factory.mktemp("mutjson")
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    raw = bytearray((copy / which).read_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    (copy / which).write_bytes(bytes(raw))
    _assert_raises_wna16_or_intact(copy, expected)


def _assert_raises_wna16_or_intact(folder: Path, expected: dict) -> None:
    try:
        got = _load_all(folder, 2, 2)
    except WNA16Error:
        return
    assert _same(got, expected), "a mutated checkpoint loaded different tensors without an error"


def test_truncated_file_is_a_wna16_error(intact: tuple[Path, dict], tmp_path: Path) -> None:
    folder, _ = intact
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(WNA16Error, match=shard.name):
        _load_all(tmp_path, 1, 1)


def test_header_length_beyond_file_is_a_wna16_error(intact: tuple[Path, dict], tmp_path: Path) -> None:
    folder, _ = intact
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", 200 * 2**20) + raw[8:])
    with pytest.raises(WNA16Error, match=shard.name):
        _load_all(tmp_path, 1, 1)


def test_config_mutation_of_sizes_is_caught(intact: tuple[Path, dict], tmp_path: Path) -> None:
    folder, _ = intact
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WNA16Error, match="implies"):
        _load_all(tmp_path, 1, 1)
