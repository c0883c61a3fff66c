"""Starting and resuming a pre-shard run: the plan file written first, the journal of finished files,
and the refusal of an output written with other parameters or from a changed source."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PreshardError, ShardInterrupted
from ..load.outputs import MANIFEST_NAME, PLAN_NAME
from ..logs import log
from ..storage.index import DTYPES
from .manifest import without_tensor_digests
from .plan import ShardPlan, fingerprint_differences, plan_record, source_change
from .progress import Progress
from .safefiles import LOCK_NAME, read_json, same_bytes, sha256_file, write_json_atomic, writing

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
        raise another_source(out, recorded.get("source", {}).get("path"), plan, change)
    diffs = _differences(recorded, plan)
    if diffs:
        raise PreshardError(f"{out} was written with other parameters ({'; '.join(diffs)}); refusing to mix them. "
                            f"Re-run with the written parameters, or use a new output folder (or delete {out} first).")


def another_source(out: Path, written_from: str | None, plan: ShardPlan, change: tuple[str, str]) -> PreshardError:
    """The refusal of a run whose source is not the one `out` was written from: the path it was written from
    (`written_from`, None in a manifest written before it was recorded), this run's, and what differs."""
    fresh = f"use a new output folder (or delete {out} first)"
    if written_from is None:
        return PreshardError(f"{out} was written from another source ({change[0]}; its manifest, from an older "
                             f"version, does not record the path); this run's source is {plan.source} ({change[1]}). "
                             f"Pass the source {out} was written from, or {fresh}.")
    if Path(written_from) == Path(plan.source).resolve():
        return PreshardError(f"{out} was written from {written_from}, which has changed since: it held {change[0]}; "
                             f"it now holds {change[1]}. Restore that source, or {fresh}.")
    return PreshardError(f"{out} was written from {written_from} ({change[0]}); this run's source is {plan.source} "
                         f"({change[1]}). Pass {written_from} as SRC, or {fresh}.")


def planned_tensors(plan: ShardPlan) -> dict[str, list[str]]:
    """Path -> the sorted tensor names of every file the plan writes (what a journal or manifest record must list)."""
    return {f.path: sorted(f.tensors) for f in plan.all_files()}


def _differences(recorded: dict[str, Any], plan: ShardPlan) -> list[str]:
    params = recorded.get("params", {})
    diffs = [f"{key}: written {params.get(key)!r}, requested {value!r}"
             for key, value in plan.params.items() if params.get(key) != value]
    return diffs + fingerprint_differences(recorded.get("source", {}), plan.fingerprint)


def start(out: Path, plan: ShardPlan, kept: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Write the plan (left untouched when it holds the same), drop stray temporaries; the journal, starting
    with the records of the files `kept` (a `recheck`'s). `kept` None starts over: the manifest and the
    journal are dropped. A repair (a manifest, files kept) keeps the manifest until the new one replaces
    it: an interrupted repair is still a finished output, which the next run re-checks and repairs."""
    if kept is None:
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    for tmp in out.rglob(".*.tmp"):
        tmp.unlink()
    write_json_atomic(out / PLAN_NAME, plan_record(plan))
    return dict(kept or {})


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
    """A run without --resume into an OUT that holds an unfinished output of this plan (a plan, no manifest)
    starts over: one warning saying so, and how many files --resume would keep (those present with the header
    and size they were written with; --resume also checks their sha256)."""
    if not (out / PLAN_NAME).is_file() or (out / MANIFEST_NAME).is_file():
        return
    planned = planned_tensors(plan)
    try:
        records = [rec for rec in _recorded_files(out) if isinstance(rec, dict)]
    except PreshardError:
        records = []
    intact = {rec.get("path") for rec in records if planned.get(rec.get("path")) == sorted(rec.get("tensors", {}))
              and _header_matches(out / rec["path"], rec["tensors"])}
    keep = f"use --resume to keep {len(intact)} files" if intact else "none of its files can be kept"
    log.warning("%s: found a partial output (%d of %d files intact): starting over, every file is rewritten (%s)",
                out, len(intact), len(planned), keep)


@dataclass(frozen=True)
class Recheck:
    """What re-checking an output's finished files against their records found: `kept`, path -> record of
    every intact file (in this version's form); `damaged`, `path: why` of every other planned file;
    `copied`, the small files missing or differing from the source's."""

    kept: dict[str, dict[str, Any]]
    damaged: tuple[str, ...]
    copied: tuple[str, ...]

    @property
    def intact(self) -> bool:
        """Whether nothing needs to be written."""
        return not self.damaged and not self.copied


def recheck(out: Path, plan: ShardPlan, progress: bool = False) -> Recheck:
    """Every planned file against the latest record of it (the manifest's, else the journal's): the tensors it
    should hold, then its header and size (cheap: a truncated file is never hashed), then its sha256, in one
    pass over the files with `progress` shown; and the copied small files against the source's."""
    planned = planned_tensors(plan)
    records = {rec["path"]: rec for rec in _recorded_files(out) if isinstance(rec, dict) and "path" in rec}
    meter = Progress(sum(f.nbytes for f in plan.all_files()), progress, action=f"checking {out}: ", after=2.0)
    kept, damaged = {}, []
    try:
        for fp in plan.all_files():
            why = _damage(out, fp.path, records.get(fp.path), planned[fp.path])
            meter.advance(fp.nbytes, fp.path)
            if why is None:
                kept[fp.path] = without_tensor_digests(records[fp.path])
            else:
                damaged.append(f"{fp.path}: {why}")
    finally:
        meter.close()
    copied = tuple(f"{name}: differs from the source's" for name in plan.copied
                   if not same_bytes(plan.source / name, out / name))
    return Recheck(kept, tuple(damaged), copied)


def _damage(out: Path, path: str, record: Any, tensors: list[str]) -> str | None:
    """Why the file `path` of OUT cannot be kept (None: it is intact): no usable record of it, missing, its
    header or size not the recorded ones, or its sha256 not the recorded one."""
    try:
        recorded, digest = record["tensors"], record["sha256"]
    except (KeyError, TypeError):  # no record, or one cut short by a kill, or corrupt
        return "not finished"
    file = out / path
    if not isinstance(recorded, dict) or sorted(recorded) != tensors:
        return "not finished"
    if not file.is_file():
        return "missing"
    if not _header_matches(file, recorded):
        return f"truncated or overwritten ({file.stat().st_size} bytes, not what its header and the manifest say)"
    if sha256_file(file) != digest:
        return "sha256 differs from the manifest"
    return None


def warn_repairing(out: Path, found: Recheck) -> None:
    """One warning: which files a re-run rewrites (the damaged, truncated or missing ones), and that it keeps
    the others untouched."""
    bad = found.damaged + found.copied
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    log.warning("%s: %d of %d files to rewrite (%s%s); keeping the other %d untouched", out, len(bad),
                len(found.kept) + len(bad), "; ".join(bad[:3]), more, len(found.kept))


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
