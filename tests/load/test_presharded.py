"""presharded: one rank's manifest record read from its lines, and its tensors read by header offsets.

One tiny wna16-shard output (GPTQ act-order, TP 2 x EP 2, several files per rank) serves every test; the
tests that damage it work on a copy.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from wna16_loader.errors import CheckpointError, LayoutMismatchError
from wna16_loader.load import presharded
from wna16_loader.load.presharded import load_presharded, read_manifest, read_rank_manifest
from wna16_loader.parallel.config import ParallelConfig
from wna16_loader.preshard import MANIFEST_NAME, preshard_checkpoint
from wna16_loader.testing.standin import StandIn
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

RANKS = list(ParallelConfig.all_ranks(tp_size=2, ep_size=2))


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 4-expert GPTQ act-order checkpoint (H 64, I 128) pre-sharded for TP 2 x EP 2, files of
    at most 24 kB (several per rank)."""
    root = tmp_path_factory.mktemp("presharded")
    write_checkpoint(root / "src", quant_config("gptq", act_order=True), hidden=64, intermediate=128,
                     num_layers=2, files=2, seed=3)
    preshard_checkpoint(root / "src", root / "out", tp_size=2, ep_size=2, max_file_size=24_000, progress=False)
    return root / "out"


@pytest.fixture
def copy(output: Path, tmp_path: Path) -> Path:
    """A copy of the output to damage."""
    return Path(shutil.copytree(output, tmp_path / "out"))


def head_and_records(out: Path) -> tuple[dict, list[dict]]:
    """The manifest's members before `ranks`, and every rank record, from a whole parse."""
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    keys = list(manifest)
    return {k: manifest[k] for k in keys[:keys.index("ranks")]}, manifest["ranks"]


def file_tensors(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor of a rank's files, read by safetensors."""
    tensors = {}
    for rec in read_manifest(out)["ranks"][rank]["files"]:
        with safe_open(str(out / rec["path"]), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def test_every_rank_record_is_read_from_its_lines_alone(output: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wna16-shard's manifest is laid out as the reader slices it: no rank needs the whole parse."""
    head, records = head_and_records(output)
    assert len(records) == 4 and [len(r["files"]) for r in records] >= [2] * 4
    monkeypatch.setattr(presharded, "read_manifest", lambda out: pytest.fail("parsed the whole manifest"))
    for rank, record in enumerate(records):
        assert read_rank_manifest(output, rank) == (head, record)


@pytest.mark.parametrize("indent", [None, 4, "\t"])
def test_other_layouts_of_the_text_are_parsed_whole(copy: Path, indent: int | str | None) -> None:
    head, records = head_and_records(copy)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest, indent=indent) + "\n")
    for rank, record in enumerate(records):
        assert read_rank_manifest(copy, rank) == (head, record)


def test_truncated_manifest_is_not_valid_json(copy: Path) -> None:
    text = (copy / MANIFEST_NAME).read_text()
    (copy / MANIFEST_NAME).write_text(text[:len(text) // 2])
    with pytest.raises(CheckpointError, match=r"wna16_manifest\.json: not valid JSON \(.*\); re-run wna16-shard "
                                              r"with --resume"):
        read_rank_manifest(copy, 1)
    (copy / MANIFEST_NAME).write_text("")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_rank_manifest(copy, 1)


def test_schema_version_checked_on_the_sliced_head(copy: Path) -> None:
    text = (copy / MANIFEST_NAME).read_text()
    assert text.startswith('{\n  "schema_version": 1,\n')
    (copy / MANIFEST_NAME).write_text(text.replace('"schema_version": 1,', '"schema_version": 2,', 1))
    with pytest.raises(CheckpointError, match=r"schema version 2, this package reads 1; re-shard"):
        read_rank_manifest(copy, 0)


def test_a_record_of_another_rank_in_its_place_falls_back_to_the_whole_parse(copy: Path) -> None:
    """The slice is trusted only when the record it finds says it is the rank asked for."""
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["ranks"][2]["rank"] = 7
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    assert read_rank_manifest(copy, 2)[1]["rank"] == 7
    assert read_rank_manifest(copy, 3)[1] == manifest["ranks"][3]


def test_rank_beyond_the_written_ranks(copy: Path) -> None:
    """Another layout is refused as such even when its rank has no record; a record missing from a
    manifest of the right layout is named."""
    with pytest.raises(LayoutMismatchError, match=r"written for layout \{'tp': 2, 'ep': 2, 'placement': 'linear'\}, "
                                                  r"but loaded with \{'tp': 8, 'ep': 1"):
        load_presharded(copy, ParallelConfig(8, 7))
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    del manifest["ranks"][3]
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    assert read_rank_manifest(copy, 3)[1] is None
    with pytest.raises(CheckpointError, match=r"wna16_manifest\.json: no record of rank 3 in its ranks list; run "
                                              r"`wna16-shard verify .*` and re-shard\."):
        load_presharded(copy, RANKS[3])


@pytest.mark.parametrize("parallel", RANKS, ids=str)
def test_load_is_byte_identical_to_the_rank_files(output: Path, parallel: ParallelConfig) -> None:
    loaded = load_presharded(output, parallel)
    want = file_tensors(output, parallel.rank)
    got = {f"{prefix}.{name}": t for prefix, layer in loaded.items() for name, t in layer.tensors.items()}
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
        assert got[name].is_contiguous() and not got[name].is_pinned()
    assert loaded.report.tensors == len(want)
    assert loaded.report.bytes_read == sum(t.numel() * t.element_size() for t in want.values())


def rewrite(path: Path, change) -> None:  # noqa: ANN001 (a function of the tensors dict)
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def file_holding(out: Path, rank: int, name: str) -> Path:
    for rec in read_manifest(out)["ranks"][rank]["files"]:
        with safe_open(str(out / rec["path"]), framework="pt") as handle:
            if name in handle.keys():
                return out / rec["path"]
    raise AssertionError(name)


def test_tensor_of_another_dtype_or_shape_or_missing_is_refused(copy: Path) -> None:
    name = "model.layers.1.mlp.experts.w13_scales"
    path = file_holding(copy, 1, name)
    shape = list(load_file(str(path))[name].shape)
    rewrite(path, lambda t: t.update({name: t[name].float()}))
    want = re.escape(f"out: tensor {name} should be {shape} torch.float16, found ({shape}, 'torch.float32'); "
                     f"run `wna16-shard verify {copy}` and re-shard.")
    with pytest.raises(CheckpointError, match=want):
        load_presharded(copy, RANKS[1])
    rewrite(path, lambda t: t.update({name: t[name].half()[:, :, :-1].contiguous()}))
    cut = [*shape[:-1], shape[-1] - 1]
    with pytest.raises(CheckpointError, match=re.escape(f"should be {shape} torch.float16, found ({cut}, "
                                                        f"'torch.float16')")):
        load_presharded(copy, RANKS[1])
    rewrite(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"tensor {name} should be .* found None"):
        load_presharded(copy, RANKS[1])
    load_presharded(copy, RANKS[0])  # the other ranks' files are not read


def test_missing_or_truncated_rank_file_is_refused(copy: Path) -> None:
    path = file_holding(copy, 3, "model.layers.0.mlp.experts.w2_qweight")
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(CheckpointError) as exc:
        load_presharded(copy, RANKS[3])
    assert str(exc.value) == (f"{path}: truncated or corrupt ({len(data) - 1} bytes on disk): a file of the "
                              f"wna16-shard output {copy}. Run `wna16-shard verify {copy}` to list every damaged "
                              f"file, then the wna16-shard command that wrote {copy} again with --resume: it keeps "
                              f"the intact files and rewrites only the damaged ones.")
    path.unlink()
    with pytest.raises(CheckpointError, match=rf"{path.name}: listed in .*wna16_manifest\.json but missing; re-run "
                                              rf"wna16-shard with --resume"):
        load_presharded(copy, RANKS[3])


def test_gpu_target_reads_into_pinned_buffers_on_its_context(output: Path) -> None:
    """On a GPU (the stand-in's cuda:3, cuda:0 current) every tensor lands in pinned host memory pinned in
    cuda:3's context, then goes up in one copy; nothing is copied from a file mapping; one synchronise."""
    want = load_presharded(output, RANKS[2])
    target = torch.device("cuda", 3)
    with StandIn(count=4) as sim:
        got = load_presharded(output, RANKS[2], device=target)
        for prefix, layer in want.items():
            for name, tensor in layer.tensors.items():
                assert got[prefix].tensors[name].device == target
                assert torch.equal(got[prefix].tensors[name].cpu(), tensor), (prefix, name)
    assert not sim.mapped_copies and sim.syncs == [3]
    assert {current for _, current in sim.pinned} == {3}
    assert sum(nbytes for nbytes, _ in sim.pinned) == got.report.bytes_read
    assert sum(sim.allocations[3]) == got.report.bytes_read and set(sim.allocations) == {3}
