"""presharded: one rank's tensors of a wna16-shard output read by header offsets (the manifest's tests are
test_outputs.py; the output and its damageable copy are conftest.py's fixtures)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from wna16_loader.errors import CheckpointError
from wna16_loader.load.presharded import load_presharded, read_manifest, rerun_command
from wna16_loader.parallel.config import ParallelConfig
from wna16_loader.testing.standin import StandIn

RANKS = list(ParallelConfig.all_ranks(tp_size=2, ep_size=2))


def file_tensors(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor of a rank's files, read by safetensors."""
    tensors = {}
    for rec in read_manifest(out)["ranks"][rank]["files"]:
        with safe_open(str(out / rec["path"]), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


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
    command = rerun_command(copy, read_manifest(copy))  # the command that wrote it (SRC OUT and its flags)
    assert command.startswith("wna16-shard /") and f" {copy} --tp " in command
    assert str(exc.value) == (f"{path}: truncated or corrupt ({len(data) - 1} bytes on disk): a file of the "
                              f"wna16-shard output {copy}. Run `wna16-shard verify {copy}` to list every damaged "
                              f"file; re-running `{command}` re-checks every file and rewrites only the damaged ones.")
    path.unlink()
    with pytest.raises(CheckpointError) as exc:
        load_presharded(copy, RANKS[3])
    assert str(exc.value) == (f"{path}: listed in {copy / 'wna16_manifest.json'} but missing; re-running `{command}` "
                              f"rewrites it (and only the damaged files).")


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
