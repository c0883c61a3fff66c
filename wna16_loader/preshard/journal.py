"""Starting and resuming a pre-shard run: the plan file written first, the journal of finished files,
and the refusal of an output written with other parameters or from a changed source."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import PreshardError, ShardInterrupted
from ..load.outputs import MANIFEST_NAME, PLAN_NAME
from ..logs import log
from ..storage.index import DTYPES
from .manifest import without_tensor_digests
from .plan import ShardPlan, fingerprint_differences, plan_record, source_change
from .safefiles import LOCK_NAME, read_json, sha256_file, write_json_atomic, writing

JOURNAL_NAME = ".wna16-done.jsonl"


DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for code, dtype in DTYPES.items()}  # "I32" -> "int32"


def check_existing(out: Path, plan: ShardPlan) -> None:
    """Refuse a foreign non-empty OUT, or one written with other parameters or from a changed source."""
    entries = [p.name for p in out.iterdir() if p.name != LOCK_NAME]
    if not entries:
        return
    recorded = None
    for name in (PLAN_NAME, MANIFEST_NAME):
        if (out / name).is_file():
            recorded = read_json(out / name)
            break
    if recorded is None:
        raise PreshardError(f"{out}: not empty ({sorted(entries)[:5]}) and holds no {PLAN_NAME} or {MANIFEST_NAME}; "
                            f"refusing to write into it. Choose an empty or new output folder.")
    change = source_change(recorded.get("source", {}), plan.fingerprint)
    if change is not None:
        raise PreshardError(f"{out} was written from another source: {change[0]}; this run's source is {plan.source}: "
                            f"{change[1]}. Pass the source {out} was written from, or use a new output folder (or "
                            f"delete {out} first).")
    diffs = _differences(recorded, plan)
    if diffs:
        raise PreshardError(f"{out} was written with other parameters ({'; '.join(diffs)}); refusing to mix them. "
                            f"Re-run with the written parameters, or use a new output folder (or delete {out} first).")


def planned_tensors(plan: ShardPlan) -> dict[str, list[str]]:
    """Path -> the sorted tensor names of every file the plan writes (what a journal or manifest record must list)."""
    return {f.path: sorted(f.tensors) for f in plan.all_files()}


def _differences(recorded: dict[str, Any], plan: ShardPlan) -> list[str]:
    params = recorded.get("params", {})
    diffs = [f"{key}: written {params.get(key)!r}, requested {value!r}"
             for key, value in plan.params.items() if params.get(key) != value]
    return diffs + fingerprint_differences(recorded.get("source", {}), plan.fingerprint)


def start(out: Path, plan: ShardPlan, resume: bool) -> dict[str, dict[str, Any]]:
    """Write the plan, drop the manifest and stray temporaries; the journal of files to keep on resume."""
    journal = _read_journal(out, plan) if resume else {}
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for tmp in out.rglob(".*.tmp"):
        tmp.unlink()
    if not resume:
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    write_json_atomic(out / PLAN_NAME, plan_record(plan))
    return journal


def _recorded_files(out: Path) -> list[Any]:
    """The records of the files earlier runs finished: the journal's lines (None for one cut short by a kill) and,
    after a finished run, its manifest's file lists."""
    path = out / JOURNAL_NAME
    records = [_journal_record(line) for line in path.read_text(encoding="utf-8").splitlines()] \
        if path.is_file() else []
    if (out / MANIFEST_NAME).is_file():  # a finished run: its manifest records every file
        manifest = read_json(out / MANIFEST_NAME)
        try:
            files = manifest["common"]["files"] + [f for rank in manifest["ranks"] for f in rank["files"]]
        except (KeyError, TypeError):
            raise PreshardError(f"{out / MANIFEST_NAME}: corrupt (no common/ranks file lists); delete {out} and run "
                                f"wna16-shard again without --resume.") from None
        records += files
    return records


def warn_starting_over(out: Path, plan: ShardPlan) -> None:
    """A run without --resume into an OUT that holds an unfinished or damaged output of this plan starts over:
    one warning saying so, and how many files --resume would keep (those present with the header and size they
    were written with; --resume also checks their sha256)."""
    if not (out / PLAN_NAME).is_file() and not (out / MANIFEST_NAME).is_file():
        return
    planned = planned_tensors(plan)
    try:
        records = [rec for rec in _recorded_files(out) if isinstance(rec, dict)]
    except PreshardError:
        records = []
    intact = {rec.get("path") for rec in records if planned.get(rec.get("path")) == sorted(rec.get("tensors", {}))
              and _header_matches(out / rec["path"], rec["tensors"])}
    what = "a damaged output" if (out / MANIFEST_NAME).is_file() else "a partial output"
    keep = f"use --resume to keep {len(intact)} files" if intact else "none of its files can be kept"
    log.warning("%s: found %s (%d of %d files intact): starting over, every file is rewritten (%s)", out, what,
                len(intact), len(planned), keep)


def _read_journal(out: Path, plan: ShardPlan) -> dict[str, dict[str, Any]]:
    """path -> record of finished files whose tensors match the plan and whose sha256 still matches (in this
    version's form: a record an earlier version journaled keeps its file's sha256, not its tensors')."""
    planned = planned_tensors(plan)
    kept: dict[str, dict[str, Any]] = {}
    records = _recorded_files(out)
    for rec in records:
        try:
            path, tensors, digest = rec["path"], sorted(rec["tensors"]), rec["sha256"]
        except (KeyError, TypeError):  # a line cut short by a kill, or a corrupt record: redo that file
            continue
        file = out / path
        if planned.get(path) == tensors and file.is_file() and sha256_file(file) == digest:
            kept[path] = without_tensor_digests(rec)
    return kept


def _journal_record(line: str) -> Any:
    """One journal line as JSON; None for a line cut short by a kill."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def append_journal(out: Path, record: dict[str, Any]) -> None:
    """One line per finished file, in one O_APPEND write (whole lines even with --workers)."""
    with writing(out / JOURNAL_NAME):
        fd = os.open(out / JOURNAL_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def output_complete(out: Path, plan: ShardPlan) -> bool:
    """Whether OUT already holds this plan's finished output, checked cheaply (nothing is hashed): a
    manifest with the same parameters and source fingerprint (see check_existing), listing the planned
    files, each present with the tensor names, dtypes and shapes it records in its header and the size
    they imply, and every copied file present."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return False
    manifest = read_json(path)
    if _differences(manifest, plan):
        return False
    try:
        records = manifest["common"]["files"] + [f for rank in manifest["ranks"] for f in rank["files"]]
        listed = {rec["path"]: rec["tensors"] for rec in records}
    except (KeyError, TypeError):
        return False
    planned = planned_tensors(plan)
    if {p: sorted(t) for p, t in listed.items()} != planned:
        return False
    return all(_header_matches(out / p, t) for p, t in listed.items()) and all(
        (out / name).is_file() for name in plan.copied)


def _header_matches(path: Path, tensors: dict[str, Any]) -> bool:
    """The safetensors header of `path` lists exactly `tensors` (dtype, shape) and the file has the size
    the header implies."""
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        size = path.stat().st_size
    except (OSError, ValueError):
        return False
    try:
        header.pop("__metadata__", None)
        found = {name: (DTYPE_NAMES.get(rec["dtype"]), rec["shape"]) for name, rec in header.items()}
        want = {name: (rec["dtype"], rec["shape"]) for name, rec in tensors.items()}
        end = max((rec["data_offsets"][1] for rec in header.values()), default=0)
    except (AttributeError, KeyError, TypeError, IndexError):
        return False
    return found == want and size == 8 + length + end


def interrupted(out: Path, plan: ShardPlan, kept: dict[str, dict[str, Any]]) -> ShardInterrupted:
    """After Ctrl-C: the temporaries of the files being written are removed (nothing half-written is left);
    how many planned files are finished (journaled now or kept from before) of how many."""
    for tmp in out.rglob(".*.tmp"):
        tmp.unlink(missing_ok=True)
    path = out / JOURNAL_NAME
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    done = set(kept) | {rec.get("path") for rec in map(_journal_record, lines) if isinstance(rec, dict)}
    planned = {f.path for f in plan.all_files()}
    return ShardInterrupted(len(done & planned), len(planned))
