"""preshard_checkpoint / load_presharded / verify_output on tiny synthetic checkpoints."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from sources import FORMATS, make_source, nemotron_checkpoint, tree_bytes

from wna16_loader import LayoutMismatchError, ParallelConfig, load_experts, parallel_config
from wna16_loader.errors import PreshardError, ShardingError
from wna16_loader.preshard import LOCK_NAME, MANIFEST_NAME, PLAN_NAME, preshard_checkpoint, read_manifest, verify_output

ROOT = Path(__file__).resolve().parents[2]

def raw_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes) of every tensor of every safetensors file below `folder`."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                t = handle.get_tensor(name)
                out[name] = (str(t.dtype), list(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


CASES = ([(fmt, tp, ep) for fmt in FORMATS for tp, ep in ((1, 1), (2, 2), (4, 2))]
         + [("gptq_actorder", tp, ep) for tp, ep in ((2, 1), (4, 1), (1, 2))])


@pytest.mark.parametrize("fmt,tp,ep", CASES)
def test_round_trip_equals_direct_load(tmp_path: Path, fmt: str, tp: int, ep: int) -> None:
    src = make_source(tmp_path / "src", fmt)
    out = tmp_path / "out"
    summary = preshard_checkpoint(src, out, tp_size=tp, ep_size=ep, max_file_size=24_000, progress=False)
    assert [r.name for r in summary.ranks][1:] == [f"rank-{r:05d}-of-{tp * ep:05d}" for r in range(tp * ep)]
    for pc in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
        fast, direct = load_experts(out, pc), load_experts(src, pc)
        assert list(fast) == list(direct)
        for prefix, layer in direct.items():
            assert fast[prefix].spec == layer.spec
            assert set(fast[prefix].tensors) == set(layer.tensors)
            for name, tensor in layer.tensors.items():
                assert torch.equal(fast[prefix].tensors[name], tensor), (prefix, name)
    common = raw_tensors(out / "common")
    source = raw_tensors(src)
    assert common == {name: value for name, value in source.items() if ".experts." not in name}
    if tp * ep == 4:  # the full source check reloads every rank: once per format is enough
        assert verify_output(out, source=src) == []


def test_output_layout_manifest_and_file_cap(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, ep_size=2, placement="round_robin", max_file_size=20_000,
                        progress=False)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["parallel"] == {"tp": 2, "ep": 2, "placement": "round_robin"}
    assert manifest["quantization"]["act_order"] is True
    assert set(manifest["quantization"]["group_size_eff"]) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    with safe_open(str(src / "model-00001-of-00002.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) <= set(manifest["source_tensors"])
    assert all(v.get("ranks") or v.get("common") for v in manifest["source_tensors"].values())
    for path in out.rglob("*.safetensors"):
        assert path.stat().st_size <= 20_000, path
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
        assert meta["layout"] == "fused" and meta["tp"] == "2" and meta["ep"] == "2" and "rank" in meta
    rank0 = out / "rank-00000-of-00004"
    assert (rank0 / "model.safetensors.index.json").is_file()
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert (out / "generation_config.json").is_file()
    assert not (out / LOCK_NAME).exists()


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    summary = preshard_checkpoint(src, tmp_path / "out", tp_size=2, dry_run=True, progress=False)
    assert summary.dry_run and len(summary.plan.ranks) == 2
    assert not (tmp_path / "out").exists()


def test_early_writeback_changes_no_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking the kernel to start writeback after every tensor (a speed hint) writes the same files."""
    from wna16_loader.preshard import writing

    src = make_source(tmp_path / "src")
    preshard_checkpoint(src, tmp_path / "plain", tp_size=2, ep_size=2, progress=False)
    real, hinted = writing.start_writeback, []
    monkeypatch.setattr(writing, "WRITEBACK_BYTES", 0)
    monkeypatch.setattr(writing, "start_writeback", lambda handle: (hinted.append(handle.name), real(handle)))
    preshard_checkpoint(src, tmp_path / "hinted", tp_size=2, ep_size=2, progress=False)
    assert len(hinted) > 10
    assert tree_bytes(tmp_path / "hinted") == tree_bytes(tmp_path / "plain")
    assert verify_output(tmp_path / "hinted", source=src) == []


def test_killed_run_then_resume_is_byte_identical(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    preshard_checkpoint(src, clean, tp_size=2, ep_size=2, max_file_size=20_000, progress=False)
    code = ("import sys, wna16_loader.preshard.writing as p; p.KILL_AFTER_FILES = 4; from wna16_loader.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    args = [sys.executable, "-c", code, str(src), str(killed), "--tp", "2", "--ep", "2", "--max-file-size", "20000",
            "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    assert (killed / LOCK_NAME).exists() and (killed / PLAN_NAME).exists()
    assert not (killed / MANIFEST_NAME).exists()
    summary = preshard_checkpoint(src, killed, tp_size=2, ep_size=2, max_file_size=20_000, resume=True,
                                  progress=False)
    assert sum(r.kept for r in summary.ranks) == 4
    assert tree_bytes(killed) == tree_bytes(clean)


def test_verify_catches_flipped_byte_and_missing_file(tmp_path: Path) -> None:
    """`verify` names the file whose sha256 differs; `verify --source` also names the tensor holding the byte."""
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, max_file_size=20_000, progress=False)
    assert verify_output(out) == []
    victim = sorted((out / "rank-00001-of-00002").glob("*.safetensors"))[0]
    with safe_open(str(victim), framework="pt") as handle:
        last = sorted(handle.keys())[-1]  # the writer's order: the file's last bytes are its last tensor's
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    path = f"rank-00001-of-00002/{victim.name}"
    command = f"wna16-shard {src} {out} --tp 2 --max-file-size 20000"  # the command that wrote OUT: it repairs
    file_problem = (f"{path}: sha256 differs from the manifest (`wna16-shard verify OUT --source SRC` names the "
                    f"tensors that differ); `{command}` rewrites it (and only the damaged files)")
    assert verify_output(out) == [file_problem]
    assert verify_output(out, source=src) == [
        file_problem, f"{path}: tensor {last} differs from a fresh conversion of the source; `{command}` rewrites it"]
    gone = sorted((out / "common").glob("*.safetensors"))[-1]
    gone.unlink()
    problems = verify_output(out, source=src)
    assert f"common/{gone.name}: missing; `{command}` rewrites it (and only the damaged files)" in problems


def test_verify_source_names_a_file_it_cannot_read(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, progress=False)
    victim = out / "rank-00000-of-00002" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")  # a header longer than the file
    victim.write_bytes(bytes(data))
    problems = verify_output(out, source=src)
    assert problems[0].startswith("rank-00000-of-00002/model.safetensors: sha256 differs from the manifest (")
    assert problems[1].startswith("rank-00000-of-00002/model.safetensors: unreadable (")
    assert problems[1].endswith(f"); `wna16-shard {src} {out} --tp 2` rewrites it") and len(problems) == 2


def test_manifest_holds_one_digest_per_file(tmp_path: Path) -> None:
    """Manifest version 2: each file's sha256 (of the bytes as written, the Hub's LFS object id), tensor
    records with shape and dtype only."""
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, ep_size=2, max_file_size=20_000, progress=False)
    manifest = read_manifest(out)
    assert manifest["manifest_version"] == 2 and manifest["schema_version"] == 1
    records = manifest["common"]["files"] + [rec for rank in manifest["ranks"] for rec in rank["files"]]
    assert len(records) == len(list(out.rglob("*.safetensors"))) > 5
    for rec in records:
        assert rec["sha256"] == hashlib.sha256((out / rec["path"]).read_bytes()).hexdigest(), rec["path"]
        with safe_open(str(out / rec["path"]), framework="pt") as handle:
            assert rec["tensors"] == {name: {"shape": list(handle.get_slice(name).get_shape()),
                                             "dtype": str(handle.get_tensor(name).dtype).removeprefix("torch.")}
                                      for name in handle.keys()}


def as_version_1(out: Path) -> None:
    """Rewrite OUT's manifest as manifest version 1 wrote it (commit 624795d and before): no
    "manifest_version" key, and every tensor record with the sha256 of the tensor's raw bytes. The files
    themselves are the same in both versions."""
    text = (out / MANIFEST_NAME).read_text()
    manifest = json.loads(text)
    del manifest["manifest_version"]
    for rec in manifest["common"]["files"] + [rec for rank in manifest["ranks"] for rec in rank["files"]]:
        with safe_open(str(out / rec["path"]), framework="pt") as handle:
            for name, tensor_rec in rec["tensors"].items():
                raw = handle.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy()
                tensor_rec["sha256"] = hashlib.sha256(memoryview(raw)).hexdigest()
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def test_version_1_output_verifies_loads_and_resumes(tmp_path: Path) -> None:
    """An output written by manifest version 1 (per-tensor sha256s) verifies, with and without the source,
    loads, and on `--force --resume` keeps every file and gets a version 2 manifest."""
    src = make_source(tmp_path / "src", "awq")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, ep_size=2, progress=False)
    files = tree_bytes(out)
    as_version_1(out)
    assert "manifest_version" not in read_manifest(out)
    assert verify_output(out) == [] and verify_output(out, source=src) == []
    for pc in ParallelConfig.all_ranks(tp_size=2, ep_size=2):
        loaded, direct = load_experts(out, pc), load_experts(src, pc)
        assert all(torch.equal(loaded[p].tensors[n], t) for p, layer in direct.items() for n, t in layer.tensors.items())
    summary = preshard_checkpoint(src, out, tp_size=2, ep_size=2, progress=False, force=True, resume=True)
    assert all(r.kept == r.files for r in summary.ranks)
    manifest = read_manifest(out)
    assert manifest["manifest_version"] == 2
    assert not any("sha256" in t for rank in manifest["ranks"] for rec in rank["files"] for t in rec["tensors"].values())
    assert tree_bytes(out) == files


@pytest.mark.parametrize("layout", ["fused", "checkpoint"])
def test_verify_compares_every_rank_tensor_with_a_fresh_conversion(tmp_path: Path, layout: str) -> None:
    """verify --source re-makes every rank tensor through the writer's path and compares its bytes with the
    file's, and its shape and dtype with the manifest's record: a tensor or record that differs is named."""
    from wna16_loader.preshard.verify import _verify_converted

    src = make_source(tmp_path / "src", "awq")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, progress=False, layout=layout)
    manifest = read_manifest(out)
    assert _verify_converted(out, manifest, src) == []
    file_rec = manifest["ranks"][1]["files"][0]
    name = sorted(file_rec["tensors"])[1]
    file_rec["tensors"][name]["shape"] = [1] + file_rec["tensors"][name]["shape"]
    made = "conversion" if layout == "fused" else "slice"
    flags = "--tp 2" if layout == "fused" else "--tp 2 --layout checkpoint"
    assert _verify_converted(out, manifest, src) == [
        f"{file_rec['path']}: tensor {name} differs from a fresh {made} of the source; `wna16-shard {src} {out} "
        f"{flags}` rewrites it"]


def test_other_parameters_or_changed_source_refused(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, progress=False)
    with pytest.raises(PreshardError, match=r"tp: written 2, requested 1"):
        preshard_checkpoint(src, out, tp_size=1, progress=False, resume=True)
    changed = make_source(tmp_path / "changed", files=1)  # the fingerprint covers names, sizes and headers
    with pytest.raises(PreshardError, match=rf"^{out} was written from {src} \(model-00001-of-00002"
                                            rf"\.safetensors \(\d+ bytes, header sha256 [0-9a-f]{{12}}\), "
                                            rf"model-00002-of-00002\.safetensors \(.*\)\); this run's source is "
                                            rf"{changed} \(model\.safetensors \(\d+ bytes, header sha256 "
                                            rf"[0-9a-f]{{12}}\)\)\. Pass {src} as SRC, or use a new output folder"):
        preshard_checkpoint(changed, out, tp_size=2, progress=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(PreshardError, match="not empty"):
        preshard_checkpoint(src, foreign, tp_size=2, progress=False)


def test_concurrent_run_refused(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(f"{os.getpid()}\n")
    with pytest.raises(PreshardError, match=f"pid {os.getpid()}"):
        preshard_checkpoint(src, out, tp_size=2, progress=False)
    assert (out / LOCK_NAME).exists()


def test_load_with_other_layout_raises(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, ep_size=2, progress=False)
    with pytest.raises(LayoutMismatchError, match=r"'tp': 2, 'ep': 2.*'tp': 4, 'ep': 1"):
        load_experts(out, ParallelConfig(tp_size=4, tp_rank=0))
    with pytest.raises(LayoutMismatchError, match="round_robin"):
        load_experts(out, ParallelConfig(2, 0, 2, 0, expert_placement="round_robin"))


def test_padded_layout_round_trip_manifest_and_verify(tmp_path: Path) -> None:
    """I = 128 at tp 3 pads to I' = 144 (I_p' = 48; tp rank 2 holds 32 real columns and 16 of padding): the output
    loads back with the same specs and tensors, the manifest records I, I' and each rank's padding, and verify
    reassembles the real columns and checks that the padding is exactly 0."""
    from wna16_loader.preshard.verify import _compare_stitched

    src = make_source(tmp_path / "src", "awq")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=3, ep_size=2, progress=False)
    loads = {pc.rank: load_experts(out, pc) for pc in ParallelConfig.all_ranks(tp_size=3, ep_size=2)}
    for pc in ParallelConfig.all_ranks(tp_size=3, ep_size=2):
        for prefix, layer in load_experts(src, pc).items():
            assert loads[pc.rank][prefix].spec == layer.spec
            assert all(torch.equal(loads[pc.rank][prefix].tensors[n], t) for n, t in layer.tensors.items())
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    for rank in manifest["ranks"]:
        for rec in rank["layers"].values():
            assert (rec["intermediate"], rec["padded_intermediate"], rec["part"]) == (128, 144, 48)
            assert rec["padding"] == (16 if rank["tp_rank"] == 2 else 0)
    assert verify_output(out, source=src) == []
    prefix = next(iter(loads[0]))
    reference = load_experts(src, ParallelConfig(1, 0))[prefix]
    layers = [loads[t][prefix] for t in range(3)]
    assert _compare_stitched(prefix, 0, layers, reference, reference.dequantize()) == []
    layers[2].tensors["w13_qweight"][0, 40] = 0x11  # a padded gate row of tp rank 2 (rows 32..47)
    assert _compare_stitched(prefix, 0, layers, reference, reference.dequantize()) == [
        f"{prefix}: ep rank 0 tp rank 2: the 16 padding columns do not dequantise to exactly 0; re-shard the source"]


def test_parallel_config_from_manifest_round_trip(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, ep_size=2, placement="round_robin", progress=False)
    manifest = read_manifest(out)
    for expected in ParallelConfig.all_ranks(tp_size=2, ep_size=2, expert_placement="round_robin"):
        config = ParallelConfig.from_manifest(manifest, rank=expected.rank)
        assert config == expected and parallel_config(out, rank=expected.rank) == expected
        loaded, direct = load_experts(out, config), load_experts(src, expected)
        for prefix, layer in direct.items():
            assert loaded[prefix].spec.experts == layer.spec.experts
            assert torch.equal(loaded[prefix].w13_qweight, layer.w13_qweight)
    with pytest.raises(ShardingError, match=r"rank 4 is out of range for tp_size=2 x ep_size=2 = 4 ranks"):
        ParallelConfig.from_manifest(manifest, rank=4)


def test_reduced_group_size_warned_once_by_the_plan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = make_source(tmp_path / "src", "awq")  # G = 32, I = 128: tp 8 leaves 16 columns per rank
    with caplog.at_level(logging.WARNING, logger="wna16_loader"):
        summary = preshard_checkpoint(src, tmp_path / "out", tp_size=8, dry_run=True, progress=False)
    assert [r.getMessage() for r in caplog.records] == [
        "tp=8: group size 32 becomes G_eff 16 in 2 layer(s) (model.layers.0.mlp.experts, model.layers.1.mlp.experts): "
        "I/tp = 128/8 is not a multiple of 32, so each scale and zero point is repeated; kernels that accept only some "
        "group sizes may refuse it. TP sizes that keep group size 32: [1, 2, 4]."]
    assert summary.plan.quant["group_size_eff"] == {"model.layers.0.mlp.experts": 16, "model.layers.1.mlp.experts": 16}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wna16_loader"):
        preshard_checkpoint(src, tmp_path / "out", tp_size=4, dry_run=True, progress=False)
    assert caplog.records == []


def mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("resume", [False, True])
def test_a_rerun_rewrites_exactly_the_damaged_files(tmp_path: Path, resume: bool,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A re-run (or --resume) into a finished output re-checks every file against the manifest (size, then
    sha256) and rewrites exactly those that differ (one flipped byte: same size, caught by the sha256), are
    truncated or are missing, and a copied small file that differs from the source's; every other file, the
    manifest and the plan keep their bytes and mtime. With nothing damaged, nothing is written."""
    src = make_source(tmp_path / "src")
    out = tmp_path / "out"
    args = {"tp_size": 2, "max_file_size": 20_000, "progress": False, "resume": resume}
    preshard_checkpoint(src, out, **args)
    reference, before = tree_bytes(out), mtimes(out)
    again = preshard_checkpoint(src, out, **args)
    assert again.complete and [r.kept for r in again.ranks] == [r.files for r in again.ranks] and mtimes(out) == before
    flipped, short = sorted((out / "rank-00001-of-00002").glob("*.safetensors"))[:2]
    gone = sorted((out / "common").glob("*.safetensors"))[-1]
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0x01
    flipped.write_bytes(bytes(data))
    short.write_bytes(short.read_bytes()[:-1])
    gone.unlink()
    (out / "generation_config.json").write_text("{}")
    damaged = {str(p.relative_to(out)) for p in (flipped, short, gone)} | {"generation_config.json"}
    before = mtimes(out)
    with caplog.at_level(logging.WARNING, logger="wna16_loader"):
        redo = preshard_checkpoint(src, out, **args)
    assert not redo.complete and tree_bytes(out) == reference
    after = mtimes(out)
    assert {p for p in set(before) | set(after) if before.get(p) != after.get(p)} == damaged
    assert sum(r.kept for r in redo.ranks) == sum(r.files for r in redo.ranks) - 3
    total = sum(r.files for r in redo.ranks)
    assert [r.getMessage() for r in caplog.records if r.module == "journal"] == [  # (layouts: the serve line's)
        f"{out}: 4 of {total + 1} files to rewrite ({gone.relative_to(out)}: missing; {flipped.relative_to(out)}: "
        f"sha256 differs from the manifest; {short.relative_to(out)}: truncated or overwritten "
        f"({short.stat().st_size - 1} bytes, not what its header and the manifest say) and 1 more); keeping the other "
        f"{total - 3} untouched"]


def test_the_recheck_shows_its_progress(tmp_path: Path) -> None:
    """The re-check's progress lines say what they count (`checking OUT:`); a pass quicker than `after` seconds
    prints none."""
    import io

    from wna16_loader.preshard.progress import Progress
    lines = io.StringIO()
    meter = Progress(2048, True, stream=lines, action=f"checking {tmp_path}: ")
    meter.advance(2048, "common/model.safetensors")
    assert lines.getvalue() == f"wna16-shard: checking {tmp_path}: 2.0 KiB of 2.0 KiB (100%), common/model.safetensors\n"
    quick = io.StringIO()
    Progress(2048, True, stream=quick, action="checking: ", after=60.0).advance(2048, "x")
    assert quick.getvalue() == ""


def test_non_gated_round_trip_and_verify(tmp_path: Path) -> None:
    """Nemotron-H's non-gated experts (w13 = up rows only) through wna16-shard, both layouts, and verify."""

    src = nemotron_checkpoint(tmp_path / "src").folder
    for layout in ("fused", "checkpoint"):
        out = tmp_path / layout
        preshard_checkpoint(src, out, tp_size=2, ep_size=2, progress=False, layout=layout)
        for pc in ParallelConfig.all_ranks(tp_size=2, ep_size=2) if layout == "fused" else ():
            fast, direct = load_experts(out, pc), load_experts(src, pc)
            assert list(fast) == list(direct) == ["backbone.layers.1.mixer.experts", "backbone.layers.4.mixer.experts"]
            for prefix, layer in direct.items():
                assert fast[prefix].spec == layer.spec and layer.spec.gated is False
                assert layer.spec.activation == "relu2"
                assert all(torch.equal(fast[prefix].tensors[n], t) for n, t in layer.tensors.items())
        assert verify_output(out, source=src) == []
    manifest = json.loads((tmp_path / "fused" / MANIFEST_NAME).read_text())
    assert "'gated': False" in repr(manifest) or '"gated": false' in json.dumps(manifest)


# ---------------------------------------------------------------------- MTP layers

@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_5_moe-mtp"])  # appended model.layers.L / mtp.layers.0
def test_mtp_layers_sharded_or_copied(tmp_path: Path, name: str) -> None:
    """By default the MTP layer is sharded like the others (marked in the manifest, loaded with include_mtp);
    --no-mtp copies its tensors unchanged into common/. verify passes both ways; nothing of the source is lost."""
    from sources import mtp_checkpoint
    ckpt = mtp_checkpoint(tmp_path / "src", name)
    mtp_prefix, source = ckpt.prefixes[-1], raw_tensors(tmp_path / "src")
    mtp_names = sorted(n for n in source if n.startswith(f"{mtp_prefix}."))
    for shard, out in ((True, tmp_path / "sharded"), (False, tmp_path / "copied")):
        summary = preshard_checkpoint(tmp_path / "src", out, tp_size=2, ep_size=2, progress=False, mtp=shard,
                                      verify=True)
        assert summary.problems == ()
        assert f"experts in {3 if shard else 2} layer(s) equal their tensors converted afresh" in summary.verified
        manifest = read_manifest(out)
        assert manifest["params"]["mtp"] is shard
        assert manifest["mtp"] == {"layers": [mtp_prefix], "sharded": shard, "where": "the ranks' files"
                                   if shard else "common/ (--no-mtp), unchanged"}
        assert all(bool(rank["layers"].get(mtp_prefix, {}).get("mtp")) is shard for rank in manifest["ranks"])
        common = raw_tensors(out / "common")
        assert {n: common[n] for n in mtp_names if n in common} == ({} if shard else {n: source[n] for n in mtp_names})
        assert {n: common[n] for n in common if n not in mtp_names} == \
            {n: source[n] for n in source if n in common and n not in mtp_names}  # the rest of common/ as before
        assert set(manifest["source_tensors"]) == set(source)  # every source tensor accounted for
        for parallel in ParallelConfig.all_ranks(tp_size=2, ep_size=2):
            assert sorted(load_experts(out, parallel)) == sorted(ckpt.prefixes[:-1])
            with_mtp = load_experts(out, parallel, include_mtp=True)
            direct = load_experts(tmp_path / "src", parallel, include_mtp=shard)
            assert sorted(with_mtp) == sorted(direct) and [p for p, l in with_mtp.items() if l.mtp] == \
                ([mtp_prefix] if shard else [])
            for prefix, layer in direct.items():
                assert all(torch.equal(t, with_mtp[prefix].tensors[k]) for k, t in layer.tensors.items())


def test_bf16_mtp_experts_shard_with_and_without_no_mtp(tmp_path: Path) -> None:
    """Official Qwen3.5 GPTQ-Int4 layout (bf16 MTP experts): by default the MTP layer is sharded in the float
    fused layout and verifies; --no-mtp copies its tensors unchanged into common/ and verifies."""
    from sources import mtp_checkpoint
    mtp_checkpoint(tmp_path / "src", "qwen3_5_moe-mtp", mtp_dtype=torch.bfloat16)
    summary = preshard_checkpoint(tmp_path / "src", tmp_path / "out", tp_size=2, progress=False, mtp=False,
                                  verify=True)
    assert summary.problems == ()
    source, common = raw_tensors(tmp_path / "src"), raw_tensors(tmp_path / "out" / "common")
    assert all(common[n] == source[n] for n in source if n.startswith("mtp."))
    summary = preshard_checkpoint(tmp_path / "src", tmp_path / "default", tp_size=2, progress=False, verify=True)
    assert summary.problems == ()
    parallel = ParallelConfig(tp_size=2, tp_rank=1)
    want = load_experts(tmp_path / "src", parallel, include_mtp=True)["mtp.layers.0.mlp.experts"]
    got = load_experts(tmp_path / "default", parallel, include_mtp=True)["mtp.layers.0.mlp.experts"]
    assert not got.quantized and got.mtp
    assert all(torch.equal(got.tensors[name], tensor) for name, tensor in want.tensors.items())


def test_sources_without_mtp_record_nothing_new(tmp_path: Path) -> None:
    """No MTP experts in the source: the manifest and plan have no MTP key, with or without --no-mtp, so
    their outputs are byte-identical to each other (and to what earlier versions wrote)."""
    from sources import mtp_checkpoint
    make_source(tmp_path / "src")
    preshard_checkpoint(tmp_path / "src", tmp_path / "a", tp_size=2, progress=False)
    preshard_checkpoint(tmp_path / "src", tmp_path / "b", tp_size=2, progress=False, mtp=False)
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    manifest = read_manifest(tmp_path / "a")
    assert "mtp" not in manifest and "mtp" not in manifest["params"]
    mtp_checkpoint(tmp_path / "declared", "deepseek_v3", mtp=False)  # declared, absent: also nothing recorded
    preshard_checkpoint(tmp_path / "declared", tmp_path / "c", tp_size=2, progress=False)
    assert "mtp" not in read_manifest(tmp_path / "c")


def test_verify_names_misplaced_mtp_layers(tmp_path: Path) -> None:
    from sources import mtp_checkpoint

    from wna16_loader.preshard.verify import verify_mtp
    mtp_checkpoint(tmp_path / "src", "deepseek_v3")
    preshard_checkpoint(tmp_path / "src", tmp_path / "out", tp_size=2, progress=False)
    manifest = read_manifest(tmp_path / "out")
    assert verify_mtp(manifest) == []
    manifest["mtp"]["sharded"] = False
    manifest["mtp"]["where"] = "common/ (--no-mtp), unchanged"
    assert verify_mtp(manifest) == [
        f"rank {r}: MTP layers ['model.layers.3.mlp.experts'] in its files, but the manifest records "
        f"['model.layers.3.mlp.experts'] as common/ (--no-mtp), unchanged; re-shard the source" for r in (0, 1)]


def test_progress_moves_by_bytes_within_a_file_in_one_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard of one large file per folder: the bar (one per run, on a terminal) moves as the tensor
    bytes are written, many times within each file and within a large tensor, and ends at the total."""
    import io

    import tqdm

    import wna16_loader.preshard.writing as writing
    src = make_source(tmp_path / "src", files=1)
    monkeypatch.setattr(writing, "PROGRESS_BYTES", 4096)  # what a large tensor is, at this size
    bars, updates = [], []

    class Bar(tqdm.tqdm):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            bars.append(self)

        def update(self, n: float | None = 1) -> bool | None:
            updates.append(n)
            return super().update(n)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    monkeypatch.setattr(sys, "stderr", Terminal())
    summary = preshard_checkpoint(src, tmp_path / "out", tp_size=2)
    files = summary.plan.all_files()
    assert len(bars) == 1 and len(files) == 3
    assert sum(updates) == bars[0].total == sum(f.nbytes for f in files)
    assert max(updates) <= 4096 and len(updates) > 3 * max(len(f.tensors) for f in files)
    bars.clear()
    updates.clear()
    assert preshard_checkpoint(src, tmp_path / "out", tp_size=2).complete  # the re-check has its own bar
    assert len(bars) == 1 and bars[0].desc == f"wna16-shard checking {tmp_path / 'out'}"
    assert sum(updates) == bars[0].total == sum(f.nbytes for f in files)
