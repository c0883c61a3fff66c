"""Pre-shard a checkpoint once into every rank's fused tensors; load them back with no conversion.

Output folder OUT (W = tp * ep ranks, rank r = ep_rank * tp + tp_rank):

| path                                   | content                                             |
|----------------------------------------|-----------------------------------------------------|
| .wna16-plan.json                       | parameters + source fingerprint (written first)     |
| rank-{r:05d}-of-{W:05d}/*.safetensors  | `{experts_prefix}.{fused name}` of rank r's load    |
|                                        | (--layout checkpoint: source tensors, sliced)       |
| common/*.safetensors                   | every non-routed-expert tensor, bytes unchanged     |
| config.json, tokenizer*, ...           | small non-safetensors files of the source, copied   |
| wna16_manifest.json                    | hashes, layout, source account (written last)       |

Every file is written under a temporary name, fsynced and renamed; `.wna16-done.jsonl`
journals finished files so `resume=True` redoes only the rest. Output is deterministic
(sorted tensors, fixed metadata, no timestamps), so a resumed run is byte-identical to a
clean one. Fused rank tensors come from the loader's own per-layer path (`loader.load_layer`), one
layer at a time, so memory does not grow with the layer count; --layout checkpoint slices come from
`presliced` (the loader's storage index computation). `workers` > 1 writes folders in a process pool.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import dataclasses
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open

from .checkpoint import DTYPES, INDEX_FILE, PICKLE_SUFFIXES, CheckpointIndex, nbytes_of
from .errors import CheckpointError, CompletenessError, LayoutMismatchError, PreshardError, WNA16Error, format_offenders
from .fused import FusedExperts, FusedSpec, FusedWriter, Ledger
from .loader import LoadedExperts, LoadReport, load_layer, load_experts
from .modelconfig import MoEConfig, read_config_files
from .parallel import ParallelConfig
from .plan import CheckpointScan, LayerPlan, plan_layers
from .presliced import SlicedTensor, materialize, slice_layer

SCHEMA_VERSION = 1
MANIFEST_NAME = "wna16_manifest.json"
PLAN_NAME = ".wna16-plan.json"
JOURNAL_NAME = ".wna16-done.jsonl"
LOCK_NAME = ".wna16-shard.lock"
COMMON_DIR = "common"
HEADER_BYTES_PER_TENSOR = 256  # safetensors JSON header estimate per tensor, for the file-size cap
COPY_LIMIT = 64 * 2**20  # non-safetensors files up to this size are copied to OUT
KILL_AFTER_FILES = 0  # test hook: when > 0, SIGKILL this process after that many files (simulates kill -9)
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
LAYOUTS = ("fused", "checkpoint")
ERRNO_FIXES = {errno.ENOSPC: "free disk space or choose an output folder on a larger disk, then re-run with --resume",
               errno.EDQUOT: "raise the disk quota or free space, then re-run with --resume",
               errno.EFBIG: "raise the file size limit (ulimit -f) or use a smaller --max-file-size, then re-run "
                            "with --resume",
               errno.EACCES: "make the output folder writable (chmod u+w) or choose another one",
               errno.EPERM: "make the output folder writable (chmod u+w) or choose another one",
               errno.EROFS: "the file system is read-only; choose an output folder on a writable one"}


# ---------------------------------------------------------------- plan (headers only)

@dataclass(frozen=True)
class FilePlan:
    """One output safetensors file: its folder (relative to OUT), name and tensors."""

    folder: str
    name: str
    tensors: tuple[str, ...]
    nbytes: int

    @property
    def path(self) -> str:
        """Path relative to OUT."""
        return f"{self.folder}/{self.name}"


@dataclass(frozen=True)
class RankPlan:
    """One rank's parallel config, layer plans and output files (and, for --layout checkpoint,
    the sliced source tensors of every file, by name)."""

    parallel: ParallelConfig
    plans: dict[str, LayerPlan]
    files: tuple[FilePlan, ...]
    sliced: dict[str, SlicedTensor] = field(default_factory=dict)

    @property
    def layers(self) -> dict[str, FusedSpec]:
        """experts prefix -> the rank's fused layout of that layer."""
        return {prefix: plan.fused for prefix, plan in self.plans.items()}

    @property
    def folder(self) -> str:
        """rank-{r:05d}-of-{W:05d}."""
        return rank_folder(self.parallel.rank, self.parallel.world_size)


@dataclass(frozen=True)
class ShardPlan:
    """Everything a pre-shard run will write, computed from headers only."""

    source: Path
    moe: MoEConfig
    params: dict[str, Any]
    fingerprint: dict[str, Any]
    quant: dict[str, Any]
    ranks: tuple[RankPlan, ...]
    common: tuple[FilePlan, ...]
    expert_sources: dict[str, tuple[int, ...]]  # source tensor -> ranks whose fused tensors it feeds
    copied: tuple[str, ...]

    def all_files(self) -> list[FilePlan]:
        """Common files first, then every rank's, in rank order."""
        return list(self.common) + [f for rank in self.ranks for f in rank.files]


def rank_folder(rank: int, world: int) -> str:
    """The folder name of global rank `rank` in a `world`-rank layout."""
    return f"rank-{rank:05d}-of-{world:05d}"


def make_plan(src: str | Path, *, tp_size: int, ep_size: int = 1, placement: str = "linear",
              max_file_size: int = 4 * 2**30, layout: str = "fused") -> ShardPlan:
    """Plan a pre-shard of `src`: files, tensors and bytes per rank; nothing is read but headers.

    layout "checkpoint" raises PreshardError here, before anything is written, when a rank's cut does not
    fall on word and group boundaries.
    """
    src = Path(src)
    if max_file_size < 1:
        raise PreshardError(f"max_file_size={max_file_size}: must be a positive number of bytes, e.g. 4GB.")
    if layout not in LAYOUTS:
        raise PreshardError(f"layout={layout!r}: unknown; use one of {list(LAYOUTS)}.")
    placement = ParallelConfig(1, 0, expert_placement=placement).expert_placement.value
    moe = read_config_files(src)
    with CheckpointIndex(src) as index:
        scan = CheckpointScan.of(index)
        ranks, expert_sources = _plan_ranks(index, moe, scan, (tp_size, ep_size, placement), max_file_size, layout)
        common_sizes = {name: index.refs[name].nbytes for name in scan.others}
        _check_account(index, scan, expert_sources)
        fingerprint = source_fingerprint(src, index.files)
    params = {"layout": layout, "tp": tp_size, "ep": ep_size, "placement": placement,
              "max_file_size": max_file_size, "schema_version": SCHEMA_VERSION}
    return ShardPlan(source=src, moe=moe, params=params, fingerprint=fingerprint, quant=_quant_summary(moe, ranks),
                     ranks=ranks, common=split_files(COMMON_DIR, common_sizes, max_file_size),
                     expert_sources=expert_sources, copied=_copied_files(src))


def _plan_ranks(index: CheckpointIndex, moe: MoEConfig, scan: CheckpointScan, grid: tuple[int, int, str],
                max_file_size: int, layout: str) -> tuple[tuple[RankPlan, ...], dict[str, tuple[int, ...]]]:
    """Plan every rank with plan_layers; note which source tensors feed which ranks."""
    ranks, feeds = [], {}
    tp, ep, placement = grid
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep, expert_placement=placement):
        ledger = Ledger()
        plans = plan_layers(index, moe, parallel, ledger, scan)
        ledger.check()
        sizes: dict[str, int] = {}
        sliced: dict[str, SlicedTensor] = {}
        for plan in plans:
            if layout == "checkpoint":
                sliced.update(slice_layer(moe.quant, plan))
            else:
                sizes.update({f"{plan.prefix}.{name}": nbytes_of(shape, dtype)
                              for name, (shape, dtype) in plan.fused.shapes().items()})
            for src in plan.sources.values():
                for ref in src.tensors.values():
                    feeds.setdefault(ref.name, set()).add(parallel.rank)
        sizes.update({name: t.nbytes for name, t in sliced.items()})
        folder = rank_folder(parallel.rank, parallel.world_size)
        ranks.append(RankPlan(parallel, {p.prefix: p for p in plans},
                              split_files(folder, sizes, max_file_size), sliced))
    return tuple(ranks), {name: tuple(sorted(r)) for name, r in sorted(feeds.items())}


def _check_account(index: CheckpointIndex, scan: CheckpointScan, expert_sources: dict[str, Any]) -> None:
    """Every source tensor must go to common/ or to some rank's fused tensors."""
    placed = set(scan.others) | set(expert_sources)
    lost = sorted(set(index.refs) - placed)
    if lost:
        raise CompletenessError(f"{index.folder}: {len(lost)} source tensors would go to no output file (neither "
                                f"common/ nor any rank's fused tensors); fix the checkpoint or its config.json:\n"
                                f"{format_offenders(lost)}")


def split_files(folder: str, sizes: dict[str, int], max_file_size: int) -> tuple[FilePlan, ...]:
    """Pack tensors (sorted by name) greedily into files of at most `max_file_size` bytes.

    A single tensor larger than the cap gets a file of its own (safetensors cannot split a tensor).
    """
    groups: list[list[str]] = []
    totals: list[int] = []
    for name in sorted(sizes):
        cost = sizes[name] + HEADER_BYTES_PER_TENSOR
        if not groups or totals[-1] + cost > max_file_size - 8:
            groups.append([])
            totals.append(0)
        groups[-1].append(name)
        totals[-1] += cost
    count = len(groups)
    return tuple(FilePlan(folder, "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors",
                          tuple(group), sum(sizes[n] for n in group)) for i, group in enumerate(groups))


def source_fingerprint(src: Path, files: list[str]) -> dict[str, Any]:
    """Name, size and sha256 of the header (first 8 + N bytes) of every source safetensors file."""
    entries = []
    for name in files:
        path = src / name
        with open(path, "rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = head + handle.read(length)
        entries.append({"name": name, "size": path.stat().st_size, "header_sha256": hashlib.sha256(header).hexdigest()})
    config = src / "config.json"
    config_hash = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    return {"files": entries, "config_sha256": config_hash}


def _quant_summary(moe: MoEConfig, ranks: tuple[RankPlan, ...]) -> dict[str, Any]:
    q = moe.quant
    return {"format": q.format_name, "bits": q.bits, "group_size": q.group_size, "sym": q.symmetric,
            "act_order": q.act_order, "checkpoint_format": q.checkpoint_format,
            "group_size_eff": {prefix: spec.group_size for prefix, spec in ranks[0].layers.items()}}


def _copied_files(src: Path) -> tuple[str, ...]:
    """Small top-level non-weight files (config.json, generation_config.json, tokenizer*, ...)."""
    keep = []
    for path in sorted(src.iterdir()):
        skip = path.suffix == ".safetensors" or path.name == INDEX_FILE or path.suffix in PICKLE_SUFFIXES
        if path.is_file() and not skip and path.stat().st_size <= COPY_LIMIT:
            keep.append(path.name)
    return tuple(keep)


def describe_plan(plan: ShardPlan) -> str:
    """A human-readable plan: layout, G_eff per layer, files and bytes per rank."""
    p = plan.params
    lines = [f"source: {plan.source}",
             f"layout: {p['layout']}, tp={p['tp']} ep={p['ep']} placement={p['placement']} -> {len(plan.ranks)} ranks, "
             f"max file size {p['max_file_size']} bytes",
             f"quantization: {plan.quant['format']} {plan.quant['bits']}-bit group {plan.quant['group_size']} "
             f"sym={plan.quant['sym']} act_order={plan.quant['act_order']}"]
    lines += [f"  G_eff {prefix}: {g}" for prefix, g in plan.quant["group_size_eff"].items()]
    groups = [(COMMON_DIR, plan.common)] + [(r.folder, r.files) for r in plan.ranks]
    for folder, files in groups:
        total = sum(f.nbytes for f in files)
        lines.append(f"{folder}: {len(files)} files, {sum(len(f.tensors) for f in files)} tensors, {total} bytes")
        lines += [f"    {f.name}: {len(f.tensors)} tensors, {f.nbytes} bytes" for f in files]
    lines.append(f"copied: {', '.join(plan.copied) or '(none)'}")
    return "\n".join(lines)


# ---------------------------------------------------------------- atomic IO and locking

def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    """fsync `tmp`, rename it over `final`, fsync the folder."""
    with open(tmp, "rb+") as handle:
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON (stable formatting) through a temporary file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with _writing(path, tmp):
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        _commit(tmp, path)


def sha256_file(path: Path) -> str:
    """sha256 of a whole file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(16 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def tensor_record(tensor: torch.Tensor) -> dict[str, Any]:
    """shape, dtype and sha256 of a tensor's raw bytes."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(raw.tobytes()).hexdigest()}


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """OUT/.wna16-shard.lock (O_CREAT|O_EXCL, holding the pid); a live holder refuses, a dead one is taken over."""
    path = out / LOCK_NAME
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            holder = _lock_holder(path)
            if holder is not None and _alive(holder):
                raise PreshardError(f"{path}: another wna16-shard run (pid {holder}) is writing into {out}; wait "
                                    f"for it to finish, or delete the lock file if that process is gone.") from None
            path.unlink(missing_ok=True)  # stale: its process died (e.g. killed); resume is safe
        except OSError as exc:
            raise write_error(path, exc) from None
    else:
        raise PreshardError(f"{path}: could not create the lock file; delete it and retry.")
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _lock_holder(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- progress and summary

class Progress:
    """Bytes written: a tqdm bar on a TTY, plain lines every few seconds otherwise, nothing when disabled."""

    def __init__(self, total: int, enabled: bool, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.done, self.enabled, self.last = total, 0, enabled, 0.0
        self.bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="B", unit_scale=True, file=self.stream, desc="wna16-shard")
            except ImportError:  # tqdm is optional at runtime; fall back to lines
                self.bar = None

    def advance(self, nbytes: int, label: str) -> None:
        """Count `nbytes` more bytes done, `label` being the file just finished."""
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.enabled and (time.monotonic() - self.last > 2.0 or self.done >= self.total):
            self.last = time.monotonic()
            pct = 100.0 * self.done / max(self.total, 1)
            print(f"wna16-shard: {self.done}/{self.total} bytes ({pct:.0f}%), last {label}", file=self.stream)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


@dataclass(frozen=True)
class RankSummary:
    """What was written for one folder (a rank, or common/)."""

    name: str
    files: int
    tensors: int
    bytes: int
    seconds: float
    kept: int = 0


@dataclass(frozen=True)
class ShardSummary:
    """The result of preshard_checkpoint."""

    out: Path
    plan: ShardPlan
    ranks: tuple[RankSummary, ...]
    dry_run: bool = False
    problems: tuple[str, ...] = ()

    def table(self) -> str:
        """One row per folder: files, tensors, bytes, seconds (and files kept by resume)."""
        rows = [f"{'folder':<24} {'files':>5} {'tensors':>7} {'bytes':>14} {'kept':>4} {'seconds':>8}"]
        rows += [f"{r.name:<24} {r.files:>5} {r.tensors:>7} {r.bytes:>14} {r.kept:>4} {r.seconds:>8.2f}"
                 for r in self.ranks]
        return "\n".join(rows)


# ---------------------------------------------------------------- writing

def preshard_checkpoint(src: str | Path, out: str | Path, *, tp_size: int, ep_size: int = 1,
                        placement: str = "linear", max_file_size: int = 4 * 2**30, resume: bool = False,
                        verify: bool = False, dry_run: bool = False, progress: bool = True,
                        layout: str = "fused", workers: int = 1) -> ShardSummary:
    """Write every rank's expert tensors of `src` into `out` (see the module docstring).

    layout: "fused" (load_experts' tensors) or "checkpoint" (source tensors sliced per rank, source names
    and format). dry_run: plan only, write nothing. resume: keep journaled files whose sha256 still matches.
    verify: re-read the output and compare it with the source; problems land in the summary.
    workers: folders written in parallel processes (output identical to workers=1).
    Raises a WNA16Error subclass on bad input, a locked or foreign `out`, changed parameters or a failed write.
    """
    out = Path(out)
    _check_out_not_in_source(Path(src), out)
    if workers < 1:
        raise PreshardError(f"workers={workers}: must be at least 1, e.g. --workers 4.")
    plan = make_plan(src, tp_size=tp_size, ep_size=ep_size, placement=placement, max_file_size=max_file_size,
                     layout=layout)
    if dry_run:
        return ShardSummary(out=out, plan=plan, ranks=(), dry_run=True)
    _make_dir(out)
    with output_lock(out):
        _check_existing(out, plan)
        journal = _start(out, plan, resume)
        summaries = _write_all(out, plan, journal, progress, workers)
        records = {rec["path"]: rec for rec in journal.values()}
        for name in plan.copied:
            _copy_file(plan.source / name, out / name)
        write_json_atomic(out / MANIFEST_NAME, build_manifest(plan, records))
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    problems = tuple(verify_output(out, source=plan.source)) if verify else ()
    return ShardSummary(out=out, plan=plan, ranks=summaries, problems=problems)


def _check_out_not_in_source(src: Path, out: Path) -> None:
    """OUT must not lie inside SRC (its files would be read back as checkpoint shards)."""
    if out.resolve() == src.resolve() or out.resolve().is_relative_to(src.resolve()):
        raise PreshardError(f"{out}: the output folder is inside the source folder {src}; its safetensors files "
                            f"would be mistaken for checkpoint shards. Choose an output folder outside {src}.")


def _make_dir(folder: Path) -> None:
    with _writing(folder):
        folder.mkdir(parents=True, exist_ok=True)


@contextmanager
def _writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """Turn an OSError while writing `path` into a PreshardError naming it, its errno and the fix
    (the temporary file `tmp` is removed)."""
    try:
        yield
    except OSError as exc:
        if tmp is not None:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        raise write_error(path, exc) from None


def write_error(path: Path, exc: OSError) -> PreshardError:
    """The PreshardError for an OSError while writing `path`: errno text and the fix."""
    fix = ERRNO_FIXES.get(exc.errno, "check the output folder and disk, then re-run with --resume")
    name = errno.errorcode.get(exc.errno, "?") if exc.errno else "?"
    return PreshardError(f"{path}: write failed: {exc.strerror or exc} ({name}); {fix}. No manifest was "
                         f"written, so the output is marked unfinished.")


def _read_json(path: Path) -> Any:
    """A JSON file of OUT, or a PreshardError saying it is corrupt and what to do."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PreshardError(f"{path}: corrupt ({type(exc).__name__}: {exc}); it cannot be trusted to resume "
                            f"from. Delete {path.parent} and run wna16-shard again without --resume.") from None


def plan_record(plan: ShardPlan) -> dict[str, Any]:
    """What .wna16-plan.json holds: parameters, source fingerprint and the planned files."""
    return {"schema_version": SCHEMA_VERSION, "params": plan.params, "source": plan.fingerprint,
            "files": {f.path: list(f.tensors) for f in plan.all_files()}}


def _check_existing(out: Path, plan: ShardPlan) -> None:
    """Refuse a foreign non-empty OUT, or one written with other parameters or from a changed source."""
    entries = [p.name for p in out.iterdir() if p.name != LOCK_NAME]
    if not entries:
        return
    recorded = None
    for name in (PLAN_NAME, MANIFEST_NAME):
        if (out / name).is_file():
            recorded = _read_json(out / name)
            break
    if recorded is None:
        raise PreshardError(f"{out}: not empty ({sorted(entries)[:5]}) and holds no {PLAN_NAME} or {MANIFEST_NAME}; "
                            f"refusing to write into it. Choose an empty or new output folder.")
    diffs = _differences(recorded, plan)
    if diffs:
        raise PreshardError(f"{out} was written with other parameters or from a changed source; refusing to mix "
                            f"them. Use a new output folder, or delete {out} first. Differences:\n"
                            f"{format_offenders(diffs)}")


def _differences(recorded: dict[str, Any], plan: ShardPlan) -> list[str]:
    params = recorded.get("params", {})
    diffs = [f"{key}: written {params.get(key)!r}, requested {value!r}"
             for key, value in plan.params.items() if params.get(key) != value]
    old = {e["name"]: e for e in recorded.get("source", {}).get("files", [])}
    new = {e["name"]: e for e in plan.fingerprint["files"]}
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            diffs.append(f"source file {name}: written {old.get(name)}, now {new.get(name)}")
    if recorded.get("source", {}).get("config_sha256") != plan.fingerprint["config_sha256"]:
        diffs.append("source config.json changed since the output was written")
    return diffs


def _start(out: Path, plan: ShardPlan, resume: bool) -> dict[str, dict[str, Any]]:
    """Write the plan, drop the manifest and stray temporaries; the journal of files to keep on resume."""
    journal = _read_journal(out, plan) if resume else {}
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for tmp in out.rglob(".*.tmp"):
        tmp.unlink()
    if not resume:
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    write_json_atomic(out / PLAN_NAME, plan_record(plan))
    return journal


def _read_journal(out: Path, plan: ShardPlan) -> dict[str, dict[str, Any]]:
    """path -> record of finished files whose tensors match the plan and whose sha256 still matches."""
    path = out / JOURNAL_NAME
    planned = {f.path: sorted(f.tensors) for f in plan.all_files()}
    kept: dict[str, dict[str, Any]] = {}
    records = [_journal_record(line) for line in path.read_text(encoding="utf-8").splitlines()] \
        if path.is_file() else []
    if (out / MANIFEST_NAME).is_file():  # a finished run: its manifest records every file
        manifest = _read_json(out / MANIFEST_NAME)
        try:
            files = manifest["common"]["files"] + [f for rank in manifest["ranks"] for f in rank["files"]]
        except (KeyError, TypeError):
            raise PreshardError(f"{out / MANIFEST_NAME}: corrupt (no common/ranks file lists); delete {out} and run "
                                f"wna16-shard again without --resume.") from None
        records += files
    for rec in records:
        try:
            path, tensors, digest = rec["path"], sorted(rec["tensors"]), rec["sha256"]
        except (KeyError, TypeError):  # a line cut short by a kill, or a corrupt record: redo that file
            continue
        file = out / path
        if planned.get(path) == tensors and file.is_file() and sha256_file(file) == digest:
            kept[path] = rec
    return kept


def _journal_record(line: str) -> Any:
    """One journal line as JSON; None for a line cut short by a kill."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _append_journal(out: Path, record: dict[str, Any]) -> None:
    """One line per finished file, in one O_APPEND write (whole lines even with --workers)."""
    with _writing(out / JOURNAL_NAME):
        fd = os.open(out / JOURNAL_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_all(out: Path, plan: ShardPlan, journal: dict[str, dict[str, Any]], progress: bool,
               workers: int = 1) -> tuple[RankSummary, ...]:
    """Write common/ then every rank (in `workers` processes when > 1); journaled files are kept."""
    meter = Progress(sum(f.nbytes for f in plan.all_files()), progress)
    groups = [None] + list(range(len(plan.ranks)))
    try:
        if workers <= 1:
            state = {"written": 0, "kill_after": KILL_AFTER_FILES}
            results = [_write_group(out, plan, g, journal, state, meter.advance) for g in groups]
        else:
            results = _write_parallel(out, plan, groups, journal, workers)
            for summary, _ in results:
                meter.advance(summary.bytes, summary.name)
        summaries = []
        for summary, records in results:
            journal.update({rec["path"]: rec for rec in records})
            summaries.append(summary)
    finally:
        meter.close()
    return tuple(summaries)


def _write_parallel(out: Path, plan: ShardPlan, groups: list[int | None], journal: dict[str, dict[str, Any]],
                    workers: int) -> list[tuple[RankSummary, list[dict[str, Any]]]]:
    """One job per folder in a 'spawn' process pool; results in folder order."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(groups)), mp_context=context) as pool:
        futures = [pool.submit(_write_group, out, plan, g, journal, {"written": 0, "kill_after": 0}) for g in groups]
        return [future.result() for future in futures]


def _write_group(out: Path, plan: ShardPlan, group: int | None, journal: dict[str, dict[str, Any]],
                 state: dict[str, int], advance: Callable[[int, str], None] | None = None
                 ) -> tuple[RankSummary, list[dict[str, Any]]]:
    """Write one folder's files (common/ when `group` is None, else rank `group`), one file at a time;
    `advance(bytes, path)` is called after each file (kept ones included)."""
    start = time.perf_counter()
    rank = None if group is None else plan.ranks[group]
    folder, files = (COMMON_DIR, plan.common) if rank is None else (rank.folder, rank.files)
    _make_dir(out / folder)
    todo = [f for f in files if f.path not in journal]
    metadata = file_metadata(plan, "common" if rank is None else str(rank.parallel.rank))
    records = []
    if todo:
        with CheckpointIndex(plan.source) as index:
            source = _tensor_source(plan, rank, index)
            for fp in todo:
                record = write_safetensors(out, fp, source, metadata)
                _append_journal(out, record)
                records.append(record)
                _maybe_kill(state)
                if advance is not None:
                    advance(fp.nbytes, fp.path)
    kept = [fp for fp in files if fp.path in journal]
    if advance is not None and kept:
        advance(sum(fp.nbytes for fp in kept), f"{folder} ({len(kept)} files kept)")
    if len(files) > 1:
        weight_map = {name: f.name for f in files for name in f.tensors}
        write_json_atomic(out / folder / INDEX_FILE, {"metadata": {"total_size": sum(f.nbytes for f in files)},
                                                       "weight_map": dict(sorted(weight_map.items()))})
    summary = RankSummary(folder, len(files), sum(len(f.tensors) for f in files), sum(f.nbytes for f in files),
                          time.perf_counter() - start, kept=len(files) - len(todo))
    return summary, records


def _maybe_kill(state: dict[str, int]) -> None:
    """Test hook (KILL_AFTER_FILES = N): die like `kill -9` after N files."""
    state["written"] += 1
    if state["kill_after"] and state["written"] >= state["kill_after"]:
        os.kill(os.getpid(), signal.SIGKILL)


class TensorSource:
    """Where one output folder's tensors come from: `meta(name)` gives (shape, dtype) without reading,
    `fetch(name)` produces the tensor. Files are written header first, then one tensor at a time."""

    def __init__(self, meta: Callable[[str], tuple[tuple[int, ...], torch.dtype]],
                 fetch: Callable[[str], torch.Tensor]) -> None:
        self.meta, self.fetch = meta, fetch


def _tensor_source(plan: ShardPlan, rank: RankPlan | None, index: CheckpointIndex) -> TensorSource:
    """Raw common reads, checkpoint-layout slices, or fused layers (one layer in memory at a time)."""
    if rank is None:
        return TensorSource(lambda n: (index.refs[n].shape, index.refs[n].dtype),
                            lambda n: index.read(index.refs[n]))
    if rank.sliced:
        return TensorSource(lambda n: (rank.sliced[n].shape, rank.sliced[n].dtype),
                            lambda n: materialize(index, rank.sliced[n]))
    layers = FusedLayers(plan, rank, index)
    return TensorSource(layers.meta, layers.fetch)


class FusedLayers:
    """Fused tensors of one rank, loaded one layer at a time (the last layer is kept for the next file).

    Files are written one tensor at a time in sorted order, which keeps each layer's tensors together,
    so peak memory is about one fused layer, whatever the number of layers or the file size.
    """

    def __init__(self, plan: ShardPlan, rank: RankPlan, index: CheckpointIndex) -> None:
        self.index, self.moe, self.plans = index, plan.moe, rank.plans
        self.cached: tuple[str, FusedExperts] | None = None

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of fused tensor `name`, from the plan (nothing is read)."""
        prefix, _, field_name = name.rpartition(".")
        return self.plans[prefix].fused.shapes()[field_name]

    def fetch(self, name: str) -> torch.Tensor:
        """Fused tensor `name` (loads its layer unless it is the cached one)."""
        prefix, _, field_name = name.rpartition(".")
        return self.layer(prefix).tensors[field_name]

    def layer(self, prefix: str) -> FusedExperts:
        """The fused layer `prefix` (loading it drops the previous one first)."""
        if self.cached is None or self.cached[0] != prefix:
            self.cached = None
            layer, _, _ = load_layer(self.index, self.moe, self.plans[prefix], "cpu", False)
            self.cached = (prefix, layer)
        return self.cached[1]


def file_metadata(plan: ShardPlan, rank: str) -> dict[str, str]:
    """The fixed safetensors metadata of every output file."""
    return {"format": "pt", "layout": plan.params["layout"], "tp": str(plan.params["tp"]), "ep": str(plan.params["ep"]),
            "rank": rank, "wna16_manifest_schema": str(SCHEMA_VERSION)}


def write_safetensors(out: Path, fp: FilePlan, source: TensorSource, metadata: dict[str, str]) -> dict[str, Any]:
    """Write one file atomically (tmp, fsync, rename), streaming its tensors; its record for the manifest."""
    final = out / fp.folder / fp.name
    tmp = final.with_name(f".{fp.name}.tmp")
    metas = {name: source.meta(name) for name in sorted(fp.tensors)}
    with _writing(final, tmp):
        with open(tmp, "wb") as handle:
            records, digest = _serialize(handle, metas, source.fetch, metadata)
        _commit(tmp, final)
    return {"path": fp.path, "sha256": digest, "tensors": records}


def _serialize(handle: Any, metas: dict[str, tuple[tuple[int, ...], torch.dtype]],
               fetch: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> tuple[dict[str, dict[str, Any]], str]:
    """Write the safetensors format: a sorted, byte-stable header computed from `metas` (safetensors' own
    writer orders metadata keys differently from process to process), then each tensor as it is fetched.
    Returns each tensor's manifest record and the sha256 of the bytes written."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, (shape, dtype) in metas.items():
        nbytes = nbytes_of(tuple(shape), dtype)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    for chunk in (len(text).to_bytes(8, "little"), text):
        handle.write(chunk)
        digest.update(chunk)
    records = {}
    for name, (shape, dtype) in metas.items():
        tensor = fetch(name).detach().cpu().contiguous()
        assert (tuple(tensor.shape), tensor.dtype) == (tuple(shape), dtype), f"{name}: planned {shape} {dtype}"
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        handle.write(data)
        digest.update(data)
        records[name] = tensor_record(tensor)
    return records, digest.hexdigest()


def _copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    with _writing(dst, tmp):
        shutil.copyfile(src, tmp)
        _commit(tmp, dst)


def spec_record(spec: FusedSpec) -> dict[str, Any]:
    """A FusedSpec as JSON."""
    return {**dataclasses.asdict(spec), "experts": list(spec.experts),
            "scale_dtype": str(spec.scale_dtype).removeprefix("torch.")}


def spec_from_record(rec: dict[str, Any]) -> FusedSpec:
    """The FusedSpec written by spec_record."""
    fields = {**rec, "experts": tuple(rec["experts"]), "scale_dtype": getattr(torch, rec["scale_dtype"])}
    return FusedSpec(**fields)


def _layers_record(plan: ShardPlan, rank: RankPlan) -> dict[str, Any]:
    """Fused specs per layer; for --layout checkpoint only the local experts (the tensors keep the source format)."""
    if plan.params["layout"] == "checkpoint":
        return {p: {"experts": list(s.experts)} for p, s in rank.layers.items()}
    return {p: spec_record(s) for p, s in rank.layers.items()}


def build_manifest(plan: ShardPlan, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest: versions, source, quantization, layout, per-rank files and hashes, source account."""
    from . import __version__

    account: dict[str, Any] = {}
    for fp in plan.common:
        account.update({name: {"common": fp.path} for name in fp.tensors})
    account.update({name: {"ranks": list(ranks)} for name, ranks in plan.expert_sources.items()})
    ranks = [{"rank": r.parallel.rank, "tp_rank": r.parallel.tp_rank, "ep_rank": r.parallel.ep_rank,
              "folder": r.folder, "layers": _layers_record(plan, r),
              "files": [records[f.path] for f in r.files]} for r in plan.ranks]
    return {"schema_version": SCHEMA_VERSION, "package_version": __version__, "params": plan.params,
            "parallel": {"tp": plan.params["tp"], "ep": plan.params["ep"], "placement": plan.params["placement"]},
            "source": plan.fingerprint, "quantization": plan.quant,
            "common": {"files": [records[f.path] for f in plan.common]}, "ranks": ranks,
            "source_tensors": dict(sorted(account.items())), "copied": list(plan.copied)}


# ---------------------------------------------------------------- loading back

def is_presharded(path: str | Path) -> bool:
    """Whether `path` is a finished pre-shard output folder (it holds wna16_manifest.json); an
    unfinished one (a plan but no manifest) is refused with the command that finishes it."""
    if (Path(path) / MANIFEST_NAME).is_file():
        return True
    if (Path(path) / PLAN_NAME).is_file():
        raise CheckpointError(f"{path}: an unfinished wna16-shard output ({PLAN_NAME} but no {MANIFEST_NAME}); "
                              f"finish it with wna16-shard SRC {path} ... --resume, or load the source checkpoint.")
    return False


def read_manifest(out: str | Path) -> dict[str, Any]:
    """OUT/wna16_manifest.json, checked for a known schema version."""
    path = Path(out) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no manifest; {out} is not a finished wna16-shard output (re-run "
                              f"wna16-shard with --resume to finish it).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); re-run wna16-shard with --resume.") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(f"{path}: schema version {manifest.get('schema_version')!r}, this package reads "
                              f"{SCHEMA_VERSION}; re-shard the checkpoint with this version.")
    return manifest


def load_presharded(out: str | Path, parallel: ParallelConfig, *, device: torch.device | str = "cpu") -> LoadedExperts:
    """Load `parallel`'s fused tensors from a pre-shard output: no slicing, no conversion."""
    start = time.perf_counter()
    manifest = read_manifest(out)
    if manifest["params"].get("layout", "fused") != "fused":
        raise LayoutMismatchError(f"{Path(out) / MANIFEST_NAME}: written with --layout {manifest['params']['layout']} "
                                  f"(per-expert source tensors sliced per rank, for an engine that reads pre-sliced "
                                  f"checkpoints); load_experts reads only --layout fused outputs. Load it with such "
                                  f"an engine, or re-shard the source with wna16-shard --layout fused.")
    written = manifest["parallel"]
    requested = {"tp": parallel.tp_size, "ep": parallel.ep_size, "placement": parallel.expert_placement.value}
    if written != requested:
        raise LayoutMismatchError(f"{Path(out) / MANIFEST_NAME}: written for layout {written}, but loaded with "
                                  f"{requested}; load with the written layout, or re-shard the source with "
                                  f"wna16-shard --tp {parallel.tp_size} --ep {parallel.ep_size} "
                                  f"--placement {requested['placement']}.")
    rank = manifest["ranks"][parallel.rank]
    tensors, nbytes = _read_rank_files(Path(out), rank["files"])
    result = LoadedExperts()
    for prefix, rec in rank["layers"].items():
        spec = spec_from_record(rec)
        result[prefix] = FusedExperts(prefix, spec, _layer_tensors(out, prefix, spec, tensors, device))
    result.report = LoadReport(layers=len(result), experts=sum(len(l.spec.experts) for l in result.values()),
                               tensors=len(tensors), bytes_read=nbytes, bytes_written=nbytes,
                               seconds=time.perf_counter() - start)
    return result


def _read_rank_files(out: Path, records: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], int]:
    tensors: dict[str, torch.Tensor] = {}
    for rec in records:
        path = out / rec["path"]
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {out / MANIFEST_NAME} but missing; re-run wna16-shard "
                                  f"with --resume to rewrite it.")
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors, sum(t.numel() * t.element_size() for t in tensors.values())


def _layer_tensors(out: str | Path, prefix: str, spec: FusedSpec, tensors: dict[str, torch.Tensor],
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """The layer's fused tensors, checked against the spec's shapes and dtypes, on `device`.

    Each tensor is copied out of the file mapping into the writer's staging buffer
    (pinned for a GPU) and moved in one copy per parameter: never DMA from a mapping.
    """
    writer = FusedWriter(prefix, spec, device)
    for name, (shape, dtype) in spec.shapes().items():
        tensor = tensors.get(f"{prefix}.{name}")
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            found = None if tensor is None else (list(tensor.shape), str(tensor.dtype))
            raise CheckpointError(f"{out}: tensor {prefix}.{name} should be {list(shape)} {dtype}, found {found}; "
                                  f"run `wna16-shard verify {out}` and re-shard.")
        writer.put_whole(name, tensor)
    return writer.finish().tensors


# ---------------------------------------------------------------- verify

def verify_output(out: str | Path, source: str | Path | None = None) -> list[str]:
    """Every problem with a pre-shard output: missing files, hash mismatches; with `source`, also
    expert weights that do not reassemble exactly and common tensors that differ from the source."""
    out = Path(out)
    try:
        manifest = read_manifest(out)
    except WNA16Error as exc:
        return [str(exc)]
    records = manifest["common"]["files"] + [rec for rank in manifest["ranks"] for rec in rank["files"]]
    problems = [p for rec in records for p in _verify_file(out, rec)]
    if source is not None and not problems:
        problems += _verify_common(out, manifest, Path(source))
        if manifest["params"].get("layout", "fused") == "checkpoint":
            problems += _verify_sliced(out, manifest, Path(source))
        else:
            problems += _verify_experts(out, manifest, Path(source))
    return problems


def _verify_file(out: Path, rec: dict[str, Any]) -> list[str]:
    path = out / rec["path"]
    if not path.is_file():
        return [f"{rec['path']}: missing (re-run wna16-shard with --resume to rewrite it)"]
    if sha256_file(path) == rec["sha256"]:
        return []
    try:
        with safe_open(str(path), framework="pt") as handle:
            found = {name: tensor_record(handle.get_tensor(name)) for name in handle.keys()}
    except Exception as exc:  # safetensors raises its own types for corrupt files
        return [f"{rec['path']}: sha256 differs from the manifest and the file is unreadable ({exc})"]
    bad = [name for name, want in rec["tensors"].items() if found.get(name) != want]
    detail = f"tensors differ: {bad[:5]}" if bad else "header or padding bytes differ"
    return [f"{rec['path']}: sha256 differs from the manifest ({detail}); re-shard to repair it"]


def _verify_common(out: Path, manifest: dict[str, Any], source: Path) -> list[str]:
    problems = []
    with CheckpointIndex(source) as index:
        for rec in manifest["common"]["files"]:
            with safe_open(str(out / rec["path"]), framework="pt") as handle:
                for name in handle.keys():
                    ref = index.refs.get(name)
                    if ref is None or tensor_record(index.read(ref)) != tensor_record(handle.get_tensor(name)):
                        problems.append(f"{rec['path']}: tensor {name} is not byte-identical to the source")
    return problems


def _verify_sliced(out: Path, manifest: dict[str, Any], source: Path) -> list[str]:
    """--layout checkpoint: every tensor equals the rank's slice of the source, re-read from the source."""
    p = manifest["params"]
    plan = make_plan(source, tp_size=p["tp"], ep_size=p["ep"], placement=p["placement"],
                     max_file_size=p["max_file_size"], layout="checkpoint")
    problems = []
    with CheckpointIndex(source) as index:
        for rank, rec in zip(plan.ranks, manifest["ranks"]):
            for file_rec in rec["files"]:
                for name, want in file_rec["tensors"].items():
                    sliced = rank.sliced.get(name)
                    if sliced is None or tensor_record(materialize(index, sliced)) != want:
                        problems.append(f"{file_rec['path']}: tensor {name} is not the rank's slice of the source")
    return problems


def _verify_experts(out: Path, manifest: dict[str, Any], source: Path) -> list[str]:
    """Stitch every rank's dequantised experts over TP and compare with a tp=1 ep=1 load of the source."""
    par = manifest["parallel"]
    reference = load_experts(source, ParallelConfig(1, 0))
    loads = {r.rank: load_presharded(out, r) for r in ParallelConfig.all_ranks(
        tp_size=par["tp"], ep_size=par["ep"], expert_placement=par["placement"])}
    problems = []
    for prefix, ref_layer in reference.items():
        ref = ref_layer.dequantize()
        for ep_rank in range(par["ep"]):
            ranks = [loads[ep_rank * par["tp"] + t] for t in range(par["tp"])]
            problems += _compare_stitched(prefix, ep_rank, [r[prefix] for r in ranks], ref_layer, ref)
    return problems


def _compare_stitched(prefix: str, ep_rank: int, layers: list[FusedExperts], ref_layer: FusedExperts,
                      ref: Any) -> list[str]:
    deq = [layer.dequantize() for layer in layers]
    part = layers[0].spec.part
    gate = torch.cat([d.w13[:, :part] for d in deq], dim=1)
    up = torch.cat([d.w13[:, part:] for d in deq], dim=1)
    w2 = torch.cat([d.w2 for d in deq], dim=2)
    index = [list(ref_layer.spec.experts).index(e) for e in layers[0].spec.experts]
    problems = []
    if not torch.equal(torch.cat([gate, up], dim=1), ref.w13[index]):
        problems.append(f"{prefix}: ep rank {ep_rank}: w13 does not reassemble to the source's dequantised weights")
    if not torch.equal(w2, ref.w2[index]):
        problems.append(f"{prefix}: ep rank {ep_rank}: w2 does not reassemble to the source's dequantised weights")
    return problems
