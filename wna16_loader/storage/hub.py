"""Hugging Face repo ids wherever a checkpoint folder is accepted.

An existing local folder always wins. Otherwise a string that huggingface_hub accepts as an
`org/name` repo id resolves to a snapshot folder of the Hugging Face cache: the cached snapshot
first (no network, so it works with HF_HUB_OFFLINE=1), else a download of only what a rank reads
(the config files, the safetensors index and the `*.safetensors` files; never tokenizer or
pickle files). huggingface_hub itself decides the cache folder (HF_HUB_CACHE) and offline mode.
"""

from __future__ import annotations

from pathlib import Path

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

CHECKPOINT_FILES = ("config.json", "quantize_config.json", "quant_config.json", "quantization_config.json",
                    "model.safetensors.index.json", "*.safetensors")


def resolve_checkpoint(path_or_repo: str | Path, *, revision: str | None = None) -> Path:
    """The checkpoint folder for a local folder or a Hugging Face repo id (`org/name`, at `revision`)."""
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
    cached = _snapshot(repo_id, revision, local_files_only=True)
    if cached is not None and _usable(cached):
        return cached
    downloaded = _snapshot(repo_id, revision, local_files_only=False)
    if downloaded is None or not _usable(downloaded):
        raise CheckpointError(_not_available(repo_id, revision, "the cached snapshot has no config.json or "
                                             "no *.safetensors file and nothing more could be downloaded"))
    return downloaded


def _repo_id(path_or_repo: str | Path) -> str:
    """`path_or_repo` as a repo id, or CheckpointError when it is neither a folder nor an `org/name` id."""
    if not isinstance(path_or_repo, str):
        problem = f"a repo id is passed as a str, not a {type(path_or_repo).__name__}"
    elif "/" not in path_or_repo:
        problem = "a repo id has the form 'org/name'"
    else:
        try:
            validate_repo_id(path_or_repo)
            return path_or_repo
        except HFValidationError as exc:
            problem = str(exc).rstrip(".")
    raise CheckpointError(f"{path_or_repo}: no such folder, and not a Hugging Face repo id ({problem}). "
                          f"Pass an existing checkpoint folder or a repo id such as 'org/name'.")


def _snapshot(repo_id: str, revision: str | None, *, local_files_only: bool) -> Path | None:
    """The snapshot folder from huggingface_hub; None when it is neither cached nor downloadable
    (offline, no connection) and `local_files_only`; CheckpointError for every other failure."""
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(CHECKPOINT_FILES),
                                      local_files_only=local_files_only))
    except LocalEntryNotFoundError as exc:  # also an incomplete cached snapshot
        if local_files_only:
            return None
        raise CheckpointError(_not_available(repo_id, revision, f"huggingface_hub: {exc}")) from None
    except RevisionNotFoundError:
        raise CheckpointError(_not_available(repo_id, revision, "the Hub has no such revision")) from None
    except RepositoryNotFoundError:
        raise CheckpointError(_not_available(repo_id, revision, "the Hub has no such repo, or it is private or "
                                             "gated and no accepted token was sent (`hf auth login`)")) from None
    except HfHubHTTPError as exc:
        raise CheckpointError(_not_available(repo_id, revision, f"the Hub answered: {exc}")) from None


def _usable(folder: Path) -> bool:
    """A snapshot a load can start from: config.json and at least one safetensors file (a snapshot
    that another tool cached with only config.json is not)."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _not_available(repo_id: str, revision: str | None, reason: str) -> str:
    """The message for a repo id that resolves to no usable folder: what was searched and the fix."""
    rev = revision or constants.DEFAULT_REVISION
    cache = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    include = " ".join(f"--include '{p}'" for p in CHECKPOINT_FILES)
    return (f"{repo_id} (revision {rev!r}): no such local folder, no usable snapshot in the Hugging Face cache "
            f"{cache}, and none could be downloaded: {reason}. Fix: check the repo id and revision; with network "
            f"access set HF_HUB_OFFLINE=0 (or unset it), or fetch it first with `hf download {repo_id} "
            f"--revision {rev} {include}`, or pass a local checkpoint folder.")
