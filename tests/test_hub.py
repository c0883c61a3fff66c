"""resolve_checkpoint: local folders as they are, Hugging Face repo ids through the hub cache, offline.

Every test runs with HF_HUB_OFFLINE=1 against a cache laid out in tmp_path the way huggingface_hub
lays it out: models--org--name/refs/<branch> holds a commit sha, snapshots/<sha>/<file> are
symlinks to ../../blobs/<hash>.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from conftest import assert_exact, load_all_ranks, stitch
from wna16_loader import CheckpointError
from wna16_loader.hub import CHECKPOINT_FILES, resolve_checkpoint
from wna16_loader.synthetic import quant_config, write_checkpoint

REPO = "test-org/tiny-moe-w4"
SHA_MAIN = "1" * 40
SHA_V2 = "2" * 40


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache in tmp_path, offline (constants are read once at import, so they are patched too)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: Path, repo_id: str, files: dict[str, bytes], *, sha: str, refs: tuple[str, ...] = ("main",)
               ) -> Path:
    """Put `files` into the cache as commit `sha` of `repo_id`, pointed to by each branch in `refs`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / sha
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / name)
    for ref in refs:
        (repo / "refs" / ref).write_text(sha)  # no newline: huggingface_hub reads the file as it is
    return snapshot


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def tiny_files(marker: str) -> dict[str, bytes]:
    """A config and a (not loadable) safetensors stand-in, told apart by `marker`."""
    return {"config.json": f'{{"marker": "{marker}"}}'.encode(), "model.safetensors": marker.encode()}


def test_main_resolves_to_the_cached_snapshot(hf_cache):
    snapshot = cache_repo(hf_cache, REPO, tiny_files("main"), sha=SHA_MAIN)
    got = resolve_checkpoint(REPO)
    assert got.resolve() == snapshot.resolve()
    assert (got / "config.json").read_text() == '{"marker": "main"}'


def test_named_revision_branch_and_commit(hf_cache):
    cache_repo(hf_cache, REPO, tiny_files("main"), sha=SHA_MAIN)
    v2 = cache_repo(hf_cache, REPO, tiny_files("v2"), sha=SHA_V2, refs=("v2",))
    assert resolve_checkpoint(REPO, revision="v2").resolve() == v2.resolve()
    assert resolve_checkpoint(REPO, revision=SHA_V2).resolve() == v2.resolve()
    assert (resolve_checkpoint(REPO, revision=SHA_MAIN) / "config.json").read_text() == '{"marker": "main"}'


def test_missing_repo_offline(hf_cache):
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("test-org/no-such-repo")
    text = str(err.value)
    assert text.startswith("test-org/no-such-repo (revision 'main'): no such local folder, no usable snapshot in "
                           f"the Hugging Face cache {hf_cache / 'models--test-org--no-such-repo'}")
    assert "HF_HUB_OFFLINE=0" in text
    assert "`hf download test-org/no-such-repo --revision main --include 'config.json'" in text
    assert "--include '*.safetensors'`" in text


def test_missing_revision_offline(hf_cache):
    cache_repo(hf_cache, REPO, tiny_files("main"), sha=SHA_MAIN)
    with pytest.raises(CheckpointError, match=rf"^{REPO} \(revision 'v9'\): no such local folder, no usable "
                                              rf"snapshot in the Hugging Face cache {hf_cache}/models--test-org--"
                                              rf"tiny-moe-w4, .* `hf download {REPO} --revision v9 "):
        resolve_checkpoint(REPO, revision="v9")


def test_cached_snapshot_with_only_config_is_not_used(hf_cache):
    """Another tool cached just config.json; offline nothing more can come, so the error says what is missing."""
    cache_repo(hf_cache, REPO, {"config.json": b"{}"}, sha=SHA_MAIN)
    with pytest.raises(CheckpointError, match=r"the cached snapshot has no config.json or no \*.safetensors file "
                                              r"and nothing more could be downloaded\. Fix: "):
        resolve_checkpoint(REPO)


def test_local_folder_wins_over_repo_id(hf_cache, tmp_path, monkeypatch):
    cache_repo(hf_cache, REPO, tiny_files("cached"), sha=SHA_MAIN)
    monkeypatch.chdir(tmp_path)
    local = Path(REPO)
    local.mkdir(parents=True)
    assert resolve_checkpoint(REPO) == local
    assert resolve_checkpoint(tmp_path / REPO) == tmp_path / REPO


def test_revision_with_a_local_folder_refused(tmp_path):
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}: a local folder, but revision='v2' was given; a "
                                              r"revision applies only to a Hugging Face repo id\. Drop the revision\.$"):
        resolve_checkpoint(tmp_path, revision="v2")


@pytest.mark.parametrize("arg,problem", [
    ("./no-such-folder", "Repo id must use alphanumeric chars, '-', '_' or '.'"),
    ("no-such-folder", "a repo id has the form 'org/name'"),
    ("a/b/c", "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"),
    ("org/bad--name", "Cannot have -- or .. in repo_id"),
    (Path("test-org/tiny-moe-w4"), "a repo id is passed as a str, not a PosixPath"),
])
def test_neither_folder_nor_repo_id(hf_cache, arg, problem):
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(arg)
    text = str(err.value)
    assert text.startswith(f"{arg}: no such folder, and not a Hugging Face repo id (")
    assert problem in text
    assert text.endswith("Pass an existing checkpoint folder or a repo id such as 'org/name'.")


def test_download_patterns_take_only_what_a_rank_reads():
    repo_files = ["config.json", "generation_config.json", "quantize_config.json", "quant_config.json",
                  "quantization_config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                  "model-00002-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "pytorch_model.bin", "pytorch_model.bin.index.json", "README.md", "merges.txt", "vocab.json"]
    assert list(filter_repo_objects(repo_files, allow_patterns=list(CHECKPOINT_FILES))) == [
        "config.json", "quantize_config.json", "quant_config.json", "quantization_config.json",
        "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("files", (1, 2))
def test_load_experts_from_a_cached_repo(hf_cache, tmp_path, files):
    """A synthetic checkpoint (with an index when files=2) placed into the cache loads exactly, at tp=2 x ep=2."""
    ckpt = write_checkpoint(tmp_path / "src", quant_config("gptq", bits=4, group_size=32), num_experts=4,
                            hidden=64, intermediate=64, num_layers=2, files=files)
    cache_repo(hf_cache, REPO, folder_files(ckpt.folder), sha=SHA_MAIN)
    folder = resolve_checkpoint(REPO)
    assert folder.parent.name == "snapshots" and (folder / "config.json").is_symlink()
    loads = load_all_ranks(folder, tp=2, ep=2)
    assert all(list(loaded) == list(ckpt.prefixes) for loaded in loads.values())
    weights, _ = stitch(loads, tp=2)
    assert_exact(weights, ckpt.references)
