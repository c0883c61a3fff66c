"""resolve_checkpoint: local folders as they are, Hugging Face repo ids through the hub cache, offline.

The cache tests run with HF_HUB_OFFLINE=1 against a cache laid out in tmp_path the way huggingface_hub
lays it out: models--org--name/refs/<branch> holds a commit sha, snapshots/<sha>/<file> are
symlinks to ../../blobs/<hash>. The download tests talk to a small Hub stand-in on 127.0.0.1 that
answers the four requests snapshot_download makes (repo info, file tree, HEAD and GET of a file)
and records every request.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
from conftest import assert_exact, load_all_ranks, stitch
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from wna16_loader import (
    CheckpointError,
    FusedMoEExperts,
    LoadedExperts,
    ParallelConfig,
    load_experts,
    load_model_experts,
    read_moe_config,
)
from wna16_loader.cli import main
from wna16_loader.storage.hub import CHECKPOINT_FILES, resolve_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

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
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}: a local folder, but revision='v2' was given; a revision "
                                              r"applies only to a Hugging Face repo id\. Drop the revision\.$"):
        resolve_checkpoint(tmp_path, revision="v2")


@pytest.mark.parametrize("arg,missing,hint", [
    ("./no-such-folder", "no-such-folder", ""),
    ("no-such-folder", "no-such-folder", ""),
    ("a/b/c", "a", ""),
    ("org/bad--name", "org", ""),
    (Path("test-org/tiny-moe-w4"), "test-org", " (a repo id is passed as a str, not a PosixPath)"),
])
def test_neither_folder_nor_repo_id(hf_cache, arg, missing, hint):
    """The true cause (the first part of the path that does not exist), not huggingface_hub's validation text."""
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(arg)
    assert str(err.value) == (f"{arg}: no such folder: {Path.cwd()} has no {missing!r}{hint}. Pass an existing "
                              f"checkpoint folder (config.json and *.safetensors), or a Hugging Face repo id such as "
                              f"'org/name'.")


def test_download_patterns_take_only_what_a_rank_reads():
    repo_files = ["config.json", "generation_config.json", "quantize_config.json", "quant_config.json",
                  "quantization_config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                  "model-00002-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "README.md",
                  "merges.txt", "vocab.json"]
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


# --- the public functions and wna16-shard, given a repo id ------------------------------------------------

@pytest.fixture
def two_revisions(hf_cache: Path, tmp_path: Path) -> tuple[Path, Path]:
    """REPO in the cache: main = a GPTQ checkpoint, branch v2 (commit SHA_V2) = another one (other seed);
    returns their source folders."""
    qc = quant_config("gptq", bits=4, group_size=32)
    main_src = write_checkpoint(tmp_path / "main", qc, num_experts=4, hidden=64, intermediate=64, num_layers=2).folder
    v2_src = write_checkpoint(tmp_path / "v2", qc, num_experts=4, hidden=64, intermediate=64, num_layers=2,
                              seed=1).folder
    cache_repo(hf_cache, REPO, folder_files(main_src), sha=SHA_MAIN)
    cache_repo(hf_cache, REPO, folder_files(v2_src), sha=SHA_V2, refs=("v2",))
    return main_src, v2_src


def assert_same_load(got: LoadedExperts, want: LoadedExperts) -> None:
    assert list(got) == list(want)
    for prefix, layer in want.items():
        assert all(torch.equal(got[prefix].tensors[name], tensor) for name, tensor in layer.tensors.items())


TP2 = ParallelConfig(tp_size=2, tp_rank=1)


def test_load_experts_and_read_moe_config_take_a_repo_id(two_revisions):
    main_src, v2_src = two_revisions
    assert read_moe_config(REPO) == read_moe_config(main_src)
    assert read_moe_config(REPO, revision="v2") == read_moe_config(v2_src)
    assert_same_load(load_experts(REPO, TP2), load_experts(main_src, TP2))
    v2, prefix = load_experts(REPO, TP2, revision=SHA_V2), read_moe_config(v2_src).experts_prefixes[0]
    assert_same_load(v2, load_experts(v2_src, TP2))
    other = load_experts(main_src, TP2)[prefix].tensors["w13_qweight"]
    assert not torch.equal(v2[prefix].tensors["w13_qweight"], other)
    with pytest.raises(CheckpointError, match=r"a local folder, but revision='v2' was given"):
        load_experts(main_src, TP2, revision="v2")


def test_load_model_experts_takes_a_repo_id(two_revisions):
    _, v2_src = two_revisions
    moe = read_moe_config(REPO, revision="v2")
    model = torch.nn.ModuleList([FusedMoEExperts(moe, prefix, TP2) for prefix in moe.experts_prefixes])
    load_model_experts(model, REPO, TP2, revision="v2")
    want = load_experts(v2_src, TP2)
    for module in model:
        params = dict(module.named_parameters())
        assert all(torch.equal(params[name], tensor) for name, tensor in want[module.prefix].tensors.items())


def test_wna16_shard_takes_a_repo_id(two_revisions, tmp_path, capsys):
    main_src, v2_src = two_revisions
    out = tmp_path / "out"
    assert main([REPO, str(out), "--tp", "2", "--revision", "v2", "--quiet"]) == 0
    assert_same_load(load_experts(out, TP2), load_experts(v2_src, TP2))
    assert main(["verify", str(out), "--source", REPO, "--revision", "v2"]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--source", REPO]) == 2  # main is another checkpoint: refused as bad input
    assert "is not the checkpoint" in capsys.readouterr().err
    assert main(["verify", str(out), "--revision", "v2"]) == 2
    assert capsys.readouterr().err == ("wna16-shard: error: --revision v2 names a revision of --source, but no "
                                       "--source was given; pass --source org/name or drop --revision.\n")
    assert main([str(main_src), str(tmp_path / "o2"), "--tp", "2", "--revision", "v2"]) == 2
    assert "a local folder, but revision='v2' was given" in capsys.readouterr().err
    assert main(["test-org/missing", str(tmp_path / "o3"), "--tp", "2"]) == 2
    assert capsys.readouterr().err.startswith("wna16-shard: error: test-org/missing (revision 'main'): no such local "
                                              "folder, no usable snapshot in the Hugging Face cache ")


# --- downloads, against a Hub stand-in on 127.0.0.1 ---------------------------------------------------

@dataclass
class FakeHub:
    """One repo (REPO at commit SHA_MAIN, branch main) with `files`; `requests` lists (method, path);
    `references` are the float32 weights of the synthetic checkpoint among the files."""

    files: dict[str, bytes]
    references: dict[tuple[str, int, str], torch.Tensor]
    requests: list[tuple[str, str]] = field(default_factory=list)

    def fetched(self) -> set[str]:
        """Names of the files whose content was requested."""
        prefix = f"/{REPO}/resolve/{SHA_MAIN}/"
        return {path[len(prefix):] for method, path in self.requests if method == "GET" and path.startswith(prefix)}


def hub_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    api = f"/api/models/{REPO}/"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            path = urlparse(self.path).path
            hub.requests.append((self.command, path))
            if path.startswith("/api/models/") and not path.startswith(api):
                self.send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            elif path.startswith(api + "revision/"):
                if path.removeprefix(api + "revision/") in ("main", SHA_MAIN):
                    self.send(200, json.dumps({"id": REPO, "sha": SHA_MAIN}).encode())
                else:
                    self.send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
            elif path == api + f"tree/{SHA_MAIN}":
                self.send(200, json.dumps([{"type": "file", "path": name, "size": len(data), "oid": etag(data)}
                                           for name, data in hub.files.items()]).encode())
            elif path.startswith(f"/{REPO}/resolve/{SHA_MAIN}/"):
                data = hub.files[path.removeprefix(f"/{REPO}/resolve/{SHA_MAIN}/")]
                self.send(200, data, {"X-Repo-Commit": SHA_MAIN, "ETag": f'"{etag(data)}"'})
            else:
                self.send(404, b"{}")

        def send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

    return Handler


def etag(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def online(hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The Hub stand-in serving a synthetic checkpoint plus files a rank must never fetch; online mode."""
    ckpt = write_checkpoint(tmp_path / "src", quant_config("awq", bits=4, group_size=32), num_experts=4, hidden=64,
                            intermediate=64, num_layers=2, files=2)
    extra = {"tokenizer.json": b"{}", "generation_config.json": b"{}", "pytorch_model.bin": b"pickle",
             "original/consolidated.pt": b"pickle"}
    yield from serve(FakeHub({**folder_files(ckpt.folder), **extra}, ckpt.references), monkeypatch)


def serve(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """Run the Hub stand-in for `hub` while the test runs, huggingface_hub pointed at it, online."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), hub_handler(hub))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    yield hub
    server.shutdown()
    server.server_close()


def test_download_fetches_only_configs_index_and_safetensors_then_loads(online):
    folder = resolve_checkpoint(REPO)
    assert online.fetched() == {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                "model-00002-of-00002.safetensors"}
    assert sorted(p.name for p in folder.iterdir()) == sorted(online.fetched())
    weights, _ = stitch(load_all_ranks(folder, tp=2, ep=2), tp=2)
    assert_exact(weights, online.references)


def test_cached_snapshot_is_used_without_asking_the_hub(online):
    first = resolve_checkpoint(REPO)
    online.requests.clear()
    assert resolve_checkpoint(REPO) == first
    assert online.requests == []


def test_snapshot_with_only_config_is_completed_by_a_download(online, hf_cache):
    cache_repo(hf_cache, REPO, {"config.json": online.files["config.json"]}, sha=SHA_MAIN)
    folder = resolve_checkpoint(REPO)
    assert "model-00002-of-00002.safetensors" in online.fetched()
    name = "model-00002-of-00002.safetensors"
    assert (folder / name).read_bytes() == online.files[name]


def test_repo_missing_on_the_hub(online, hf_cache):
    with pytest.raises(CheckpointError, match=r"^test-org/other \(revision 'main'\): no such local folder, no "
                                              rf"usable snapshot in the Hugging Face cache {hf_cache}/models--test-"
                                              r"org--other, "
                                              r"and none could be downloaded: the Hub has no such repo, or it is "
                                              r"private or gated and no accepted token was sent \(`hf auth login`\)\. "
                                              r"Fix: check the repo id and revision"):
        resolve_checkpoint("test-org/other")


def test_revision_missing_on_the_hub(online):
    with pytest.raises(CheckpointError, match=rf"^{REPO} \(revision 'v9'\): .* none could be downloaded: the Hub "
                                              rf"has no such revision\. Fix: .* `hf download {REPO} --revision v9 "):
        resolve_checkpoint(REPO, revision="v9")


# --- a wna16-shard output pushed to the Hub ------------------------------------------------------------------

@pytest.fixture
def online_output(hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The Hub stand-in serving a wna16-shard output (tp 2, two files per rank) of a synthetic checkpoint;
    `references` is unused (the local output is at tmp_path/out)."""
    from wna16_loader.preshard import preshard_checkpoint

    ckpt = write_checkpoint(tmp_path / "src", quant_config("gptq", bits=4, group_size=32), num_experts=4, hidden=64,
                            intermediate=64, num_layers=2)
    (ckpt.folder / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    preshard_checkpoint(ckpt.folder, out, tp_size=2, max_file_size=20_000, progress=False)
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    yield from serve(FakeHub(files, {}), monkeypatch)


def test_an_output_on_the_hub_loads_by_repo_id(online_output, tmp_path):
    """The manifest first, then only the rank's own folder; read_moe_config needs the manifest and config alone."""
    hub, out = online_output, tmp_path / "out"
    rank_files = {name for name in hub.files if name.startswith("rank-00001-of-00002/")}
    assert len(rank_files) >= 2 and any(name.startswith("rank-00000-of-00002/") for name in hub.files)
    assert read_moe_config(REPO) == read_moe_config(out)
    assert hub.fetched() == {"config.json", "wna16_manifest.json"}
    assert_same_load(load_experts(REPO, TP2), load_experts(out, TP2))
    assert hub.fetched() == {"config.json", "wna16_manifest.json"} | rank_files
    hub.requests.clear()
    assert_same_load(load_experts(REPO, TP2), load_experts(out, TP2))  # cached: the Hub is not asked
    assert hub.requests == []
    folder = resolve_checkpoint(REPO, rank=0, common=True)  # the engine's other weights too
    snapshot = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert snapshot == {"config.json", "wna16_manifest.json"} | rank_files | {
        n for n in hub.files if n.startswith(("rank-00000-of-00002/", "common/"))}  # no tokenizer.json
    rank0 = ParallelConfig.from_manifest(folder, rank=0)
    assert_same_load(load_experts(folder, rank0), load_experts(out, rank0))


def test_cached_output_without_the_rank_folder_offline(hf_cache, tmp_path):
    from wna16_loader.preshard import preshard_checkpoint

    src = write_checkpoint(tmp_path / "src", quant_config("gptq"), hidden=64, intermediate=64, num_layers=1).folder
    preshard_checkpoint(src, tmp_path / "out", tp_size=2, progress=False)
    cache_repo(hf_cache, REPO, {name: (tmp_path / "out" / name).read_bytes()
                                for name in ("config.json", "wna16_manifest.json")}, sha=SHA_MAIN)
    assert read_moe_config(REPO) == read_moe_config(tmp_path / "out")  # the manifest and config.json suffice
    with pytest.raises(CheckpointError) as err:
        load_experts(REPO, TP2)
    assert ("none could be downloaded: the cached snapshot has not every file its wna16_manifest.json lists in "
            "rank-00001-of-00002 and nothing more could be downloaded. Fix: ") in str(err.value)
    assert "--include 'wna16_manifest.json' --include 'rank-00001-of-00002/*'`" in str(err.value)
