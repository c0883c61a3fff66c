"""Hugging Face repo ids wherever a checkpoint folder is accepted.

An existing local folder always wins. Otherwise a string that huggingface_hub accepts as an
`org/name` repo id resolves to a snapshot folder of the Hugging Face cache: the cached snapshot
first (no network, so it works with HF_HUB_OFFLINE=1), else a download of only what a rank reads.
The config files, the safetensors index and a `wna16-shard` manifest come first; then, for a
checkpoint, its `*.safetensors` files (never tokenizer or pickle files), and for a `wna16-shard`
output only the rank's own folder (and `common/` when asked). huggingface_hub itself decides the
cache folder (HF_HUB_CACHE) and offline mode.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from huggingface_hub import constants, snapshot_download
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import (
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    validate_repo_id,
)

from ..errors import CheckpointError
from ..parallel.config import MANIFEST_NAME

CONFIG_FILES = ("config.json", "quantize_config.json", "quant_config.json", "quantization_config.json")
CHECKPOINT_FILES = (*CONFIG_FILES, "model.safetensors.index.json", "*.safetensors")
HEAD_FILES = (*CONFIG_FILES, "model.safetensors.index.json", MANIFEST_NAME)  # a checkpoint, or an output?
COMMON_FOLDER = "common"


def resolve_checkpoint(path_or_repo: str | Path, *, revision: str | None = None, rank: int | None = None,
                       common: bool = False) -> Path:
    """The checkpoint folder for a local folder or a Hugging Face repo id (`org/name`, at `revision`).

    A repo holding a `wna16-shard` output gets its manifest and config files, then the folder of global
    `rank` (none when `rank` is None: enough for `read_moe_config` and `ParallelConfig.from_manifest`) and
    `common/` (the engine's other weights) when `common`."""
    local = Path(path_or_repo)
    if local.is_file():
        raise CheckpointError(f"{local}: a file, not a folder; pass the checkpoint folder holding config.json and "
                              f"the *.safetensors files (here {local.parent}).")
    if local.is_dir():
        if revision is not None:
            raise CheckpointError(f"{local}: a local folder, but revision={revision!r} was given; a revision "
                                  f"applies only to a Hugging Face repo id. Drop the revision.")
        return local
    repo_id = _repo_id(path_or_repo)
    head = _snapshot(repo_id, revision, HEAD_FILES, local_files_only=True)
    if head is not None:
        cached = _snapshot(repo_id, revision, _patterns(head, rank, common), local_files_only=True)
        if cached is not None and _usable(cached, rank, common):
            return cached
    head = _snapshot(repo_id, revision, HEAD_FILES, local_files_only=False)
    patterns = _patterns(head, rank, common)
    downloaded = _snapshot(repo_id, revision, patterns, local_files_only=False)
    if downloaded is None or not _usable(downloaded, rank, common):
        what = "no config.json or no *.safetensors file" if patterns == CHECKPOINT_FILES else \
            f"not every file its {MANIFEST_NAME} lists in {', '.join(_output_folders(head, rank, common))}"
        raise CheckpointError(_not_available(repo_id, revision, f"the cached snapshot has {what} and nothing more "
                                             f"could be downloaded", patterns))
    return downloaded


def _patterns(head: Path | None, rank: int | None, common: bool) -> tuple[str, ...]:
    """What to fetch once the head files are in `head`: a checkpoint's files, or an output's folders."""
    if head is None or not (head / MANIFEST_NAME).is_file():
        return CHECKPOINT_FILES
    return HEAD_FILES + tuple(f"{folder}/*" for folder in _output_folders(head, rank, common))


def _repo_id(path_or_repo: str | Path) -> str:
    """`path_or_repo` as a repo id, or CheckpointError when it is neither a folder nor an `org/name` id: the
    message names the part of the path that does not exist (no huggingface_hub validation text)."""
    if isinstance(path_or_repo, str) and "/" in path_or_repo:
        try:
            validate_repo_id(path_or_repo)
            return path_or_repo
        except HFValidationError:
            pass
    absolute = Path(os.path.abspath(Path(path_or_repo).expanduser()))
    existing = next(p for p in absolute.parents if p.is_dir())
    missing = absolute.relative_to(existing).parts[0]
    hint = "" if isinstance(path_or_repo, str) else f" (a repo id is passed as a str, not a {type(path_or_repo).__name__})"
    raise CheckpointError(f"{path_or_repo}: no such folder: {existing} has no {missing!r}{hint}. Pass an existing "
                          f"checkpoint folder (config.json and *.safetensors), or a Hugging Face repo id such as "
                          f"'org/name'.")


def _snapshot(repo_id: str, revision: str | None, patterns: tuple[str, ...], *,
              local_files_only: bool) -> Path | None:
    """The snapshot folder from huggingface_hub, with the files matching `patterns`; None when it is neither
    cached nor downloadable (offline, no connection) and `local_files_only`; CheckpointError for every other
    failure (its `hf download` fix names a checkpoint's files when only the head files were asked for)."""
    hint = CHECKPOINT_FILES if patterns == HEAD_FILES else patterns
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns),
                                      local_files_only=local_files_only))
    except LocalEntryNotFoundError as exc:  # also an incomplete cached snapshot
        if local_files_only:
            return None
        raise CheckpointError(_not_available(repo_id, revision, f"huggingface_hub: {exc}", hint)) from None
    except RevisionNotFoundError:
        raise CheckpointError(_not_available(repo_id, revision, "the Hub has no such revision", hint)) from None
    except RepositoryNotFoundError:
        raise CheckpointError(_not_available(repo_id, revision, "the Hub has no such repo, or it is private or "
                                             "gated and no accepted token was sent (`hf auth login`)",
                                             hint)) from None
    except HfHubHTTPError as exc:
        raise CheckpointError(_not_available(repo_id, revision, f"the Hub answered: {exc}", hint)) from None


def _usable(folder: Path, rank: int | None, common: bool) -> bool:
    """A snapshot a load can start from: config.json and at least one safetensors file (a snapshot
    that another tool cached with only config.json is not); for a wna16-shard output, config.json,
    the manifest and every file it lists in the folders asked for."""
    if not (folder / "config.json").is_file():
        return False
    if not (folder / MANIFEST_NAME).is_file():
        return any(folder.glob("*.safetensors"))
    manifest = _manifest(folder)
    listed = [rec.get("path") for rec in _folder_records(manifest, rank, common)]
    return all(isinstance(path, str) and (folder / path).is_file() for path in listed)


def _manifest(folder: Path) -> Any:
    """The output's manifest as JSON (None when it does not parse: the load that follows says why)."""
    try:
        return json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _folder_records(manifest: Any, rank: int | None, common: bool) -> list[Any]:
    """The file records of the manifest's rank `rank` (if any) and of common/ (when `common`)."""
    try:
        ranks = [manifest["ranks"][rank]] if rank is not None and 0 <= rank < len(manifest["ranks"]) else []
        return [rec for part in ranks + ([manifest["common"]] if common else []) for rec in part["files"]]
    except (KeyError, TypeError, IndexError):
        return []


def _output_folders(folder: Path, rank: int | None, common: bool) -> tuple[str, ...]:
    """The output folders to fetch: rank `rank`'s, as its manifest record names it, and common/."""
    manifest = _manifest(folder)
    try:
        ranks = (manifest["ranks"][rank]["folder"],) if rank is not None and 0 <= rank < len(manifest["ranks"]) \
            else ()
    except (KeyError, TypeError, IndexError):
        ranks = ()
    return tuple(f for f in ranks if isinstance(f, str)) + ((COMMON_FOLDER,) if common else ())


def _not_available(repo_id: str, revision: str | None, reason: str, patterns: tuple[str, ...]) -> str:
    """The message for a repo id that resolves to no usable folder: what was searched and the fix."""
    rev = revision or constants.DEFAULT_REVISION
    cache = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    include = " ".join(f"--include '{p}'" for p in patterns)
    return (f"{repo_id} (revision {rev!r}): no such local folder, no usable snapshot in the Hugging Face cache "
            f"{cache}, and none could be downloaded: {reason}. Fix: check the repo id and revision; with network "
            f"access set HF_HUB_OFFLINE=0 (or unset it), or fetch it first with `hf download {repo_id} "
            f"--revision {rev} {include}`, or pass a local checkpoint folder.")
