"""Pre-shard a checkpoint once into every rank's fused tensors; load them back with no conversion.

Output folder OUT (W = tp * ep ranks, rank r = ep_rank * tp + tp_rank):

| path                                   | content                                             |
|----------------------------------------|-----------------------------------------------------|
| .wna16-plan.json                       | parameters + source fingerprint (written first)     |
| rank-{r:05d}-of-{W:05d}/*.safetensors  | `{experts_prefix}.{fused name}` of rank r's load    |
| common/*.safetensors                   | every non-routed-expert tensor, bytes unchanged     |
| config.json, tokenizer*, ...           | small non-safetensors files of the source, copied   |
| wna16_manifest.json                    | hashes, layout, source account (written last)       |

Every file is written under a temporary name, fsynced and renamed; `.wna16-done.jsonl`
journals finished files so `resume=True` redoes only the rest. Output is deterministic
(sorted tensors, fixed metadata, no timestamps), so a resumed run is byte-identical to a
clean one. Rank tensors come from `load_experts` itself: no conversion is re-implemented.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from .checkpoint import DTYPES, INDEX_FILE, PICKLE_SUFFIXES, CheckpointIndex
from .errors import CheckpointError, CompletenessError, LayoutMismatchError, PreshardError, WNA16Error, format_offenders
from .fused import FusedExperts, FusedSpec, Ledger
from .loader import LoadedExperts, LoadReport, load_experts
from .modelconfig import MoEConfig, read_config_files
from .parallel import ParallelConfig
from .plan import CheckpointScan, plan_layers

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
    """One rank's parallel config, fused layer specs and output files."""

    parallel: ParallelConfig
    layers: dict[str, FusedSpec]
    files: tuple[FilePlan, ...]

    @property
    def folder(self) -> str:
        """rank-{r:05d}-of-{W:05d}."""
        return rank_folder(self.parallel.rank, self.parallel.world_size)


@dataclass(frozen=True)
class ShardPlan:
    """Everything a pre-shard run will write, computed from headers only."""

    source: Path
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
              max_file_size: int = 4 * 2**30) -> ShardPlan:
    """Plan a pre-shard of `src`: files, tensors and bytes per rank; nothing is read but headers."""
    src = Path(src)
    if max_file_size < 1:
        raise PreshardError(f"max_file_size={max_file_size}: must be a positive number of bytes, e.g. 4GB.")
    placement = ParallelConfig(1, 0, expert_placement=placement).expert_placement.value
    moe = read_config_files(src)
    with CheckpointIndex(src) as index:
        scan = CheckpointScan.of(index)
        ranks, expert_sources = _plan_ranks(index, moe, tp_size, ep_size, placement, max_file_size)
        common_sizes = {name: index.refs[name].nbytes for name in scan.others}
        _check_account(index, scan, expert_sources)
        fingerprint = source_fingerprint(src, index.files)
    params = {"layout": "fused", "tp": tp_size, "ep": ep_size, "placement": placement,
              "max_file_size": max_file_size, "schema_version": SCHEMA_VERSION}
    return ShardPlan(source=src, params=params, fingerprint=fingerprint, quant=_quant_summary(moe, ranks),
                     ranks=ranks, common=split_files(COMMON_DIR, common_sizes, max_file_size),
                     expert_sources=expert_sources, copied=_copied_files(src))


def _plan_ranks(index: CheckpointIndex, moe: MoEConfig, tp: int, ep: int, placement: str,
                max_file_size: int) -> tuple[tuple[RankPlan, ...], dict[str, tuple[int, ...]]]:
    """Plan every rank with plan_layers; note which source tensors feed which ranks."""
    ranks, feeds = [], {}
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep, expert_placement=placement):
        ledger = Ledger()
        plans = plan_layers(index, moe, parallel, ledger)
        ledger.check()
        sizes: dict[str, int] = {}
        for plan in plans:
            for name, (shape, dtype) in plan.fused.shapes().items():
                sizes[f"{plan.prefix}.{name}"] = _numel(shape) * dtype.itemsize
            for src in plan.sources.values():
                for ref in src.tensors.values():
                    feeds.setdefault(ref.name, set()).add(parallel.rank)
        folder = rank_folder(parallel.rank, parallel.world_size)
        ranks.append(RankPlan(parallel, {p.prefix: p.fused for p in plans},
                              split_files(folder, sizes, max_file_size)))
    return tuple(ranks), {name: tuple(sorted(r)) for name, r in sorted(feeds.items())}


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


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
             f"layout: fused, tp={p['tp']} ep={p['ep']} placement={p['placement']} -> {len(plan.ranks)} ranks, "
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
                        verify: bool = False, dry_run: bool = False, progress: bool = True) -> ShardSummary:
    """Write every rank's fused expert tensors of `src` into `out` (see the module docstring).

    dry_run: plan only, write nothing. resume: keep journaled files whose sha256 still matches.
    verify: re-read the output and compare it with the source; problems land in the summary.
    Raises a WNA16Error subclass on bad input, a locked or foreign `out`, or changed parameters.
    """
    plan = make_plan(src, tp_size=tp_size, ep_size=ep_size, placement=placement, max_file_size=max_file_size)
    out = Path(out)
    if dry_run:
        return ShardSummary(out=out, plan=plan, ranks=(), dry_run=True)
    out.mkdir(parents=True, exist_ok=True)
    with output_lock(out):
        _check_existing(out, plan)
        journal = _start(out, plan, resume)
        summaries = _write_all(out, plan, journal, progress)
        records = {rec["path"]: rec for rec in journal.values()}
        for name in plan.copied:
            _copy_file(plan.source / name, out / name)
        write_json_atomic(out / MANIFEST_NAME, build_manifest(plan, records))
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    problems = tuple(verify_output(out, source=plan.source)) if verify else ()
    return ShardSummary(out=out, plan=plan, ranks=summaries, problems=problems)


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
            recorded = json.loads((out / name).read_text(encoding="utf-8"))
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
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    if (out / MANIFEST_NAME).is_file():  # a finished run: its manifest records every file
        manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        files = manifest["common"]["files"] + [f for rank in manifest["ranks"] for f in rank["files"]]
        lines += [json.dumps(rec) for rec in files]
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        file = out / rec["path"]
        if planned.get(rec["path"]) == sorted(rec["tensors"]) and file.is_file() and sha256_file(file) == rec["sha256"]:
            kept[rec["path"]] = rec
    return kept


def _append_journal(out: Path, record: dict[str, Any]) -> None:
    with open(out / JOURNAL_NAME, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _write_all(out: Path, plan: ShardPlan, journal: dict[str, dict[str, Any]],
               progress: bool) -> tuple[RankSummary, ...]:
    """Write common/ then every rank; journaled files are kept."""
    meter = Progress(sum(f.nbytes for f in plan.all_files()), progress)
    state = {"written": 0, "kill_after": KILL_AFTER_FILES}
    try:
        summaries = [_write_group(out, plan, COMMON_DIR, plan.common, None, journal, meter, state)]
        for rank in plan.ranks:
            summaries.append(_write_group(out, plan, rank.folder, rank.files, rank.parallel, journal, meter, state))
    finally:
        meter.close()
    return tuple(summaries)


def _write_group(out: Path, plan: ShardPlan, folder: str, files: tuple[FilePlan, ...], parallel: ParallelConfig | None,
                 journal: dict[str, dict[str, Any]], meter: Progress, state: dict[str, int]) -> RankSummary:
    """Write one folder's files; tensors come from load_experts (ranks) or raw source reads (common)."""
    start = time.perf_counter()
    (out / folder).mkdir(parents=True, exist_ok=True)
    todo = [f for f in files if f.path not in journal]
    tensors = _source_tensors(plan, parallel, todo)
    metadata = file_metadata(plan, "common" if parallel is None else str(parallel.rank))
    for fp in files:
        if fp.path not in journal:
            record = write_safetensors(out, fp, {n: tensors[n] for n in fp.tensors}, metadata)
            _append_journal(out, record)
            journal[fp.path] = record
            _maybe_kill(state)
        meter.advance(fp.nbytes, fp.path)
    if len(files) > 1:
        weight_map = {name: f.name for f in files for name in f.tensors}
        write_json_atomic(out / folder / INDEX_FILE, {"metadata": {"total_size": sum(f.nbytes for f in files)},
                                                       "weight_map": dict(sorted(weight_map.items()))})
    return RankSummary(folder, len(files), sum(len(f.tensors) for f in files), sum(f.nbytes for f in files),
                       time.perf_counter() - start, kept=len(files) - len(todo))


def _maybe_kill(state: dict[str, int]) -> None:
    """Test hook (KILL_AFTER_FILES = N): die like `kill -9` after N files."""
    state["written"] += 1
    if state["kill_after"] and state["written"] >= state["kill_after"]:
        os.kill(os.getpid(), signal.SIGKILL)


def _source_tensors(plan: ShardPlan, parallel: ParallelConfig | None, todo: list[FilePlan]) -> dict[str, torch.Tensor]:
    """The tensors the files in `todo` need: the rank's load_experts output, or common tensors read raw."""
    if not todo:
        return {}
    if parallel is not None:
        loaded = load_experts(plan.source, parallel)
        return {f"{prefix}.{name}": t for prefix, layer in loaded.items() for name, t in layer.tensors.items()}
    names = [n for f in todo for n in f.tensors]
    with CheckpointIndex(plan.source) as index:
        return {name: index.read(index.refs[name]) for name in names}


def file_metadata(plan: ShardPlan, rank: str) -> dict[str, str]:
    """The fixed safetensors metadata of every output file."""
    return {"format": "pt", "layout": "fused", "tp": str(plan.params["tp"]), "ep": str(plan.params["ep"]),
            "rank": rank, "wna16_manifest_schema": str(SCHEMA_VERSION)}


def write_safetensors(out: Path, fp: FilePlan, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write one file atomically (tmp, fsync, rename); its record for the manifest."""
    final = out / fp.folder / fp.name
    tmp = final.with_name(f".{fp.name}.tmp")
    ordered = {name: tensors[name].detach().cpu().contiguous() for name in sorted(tensors)}
    with open(tmp, "wb") as handle:
        _serialize(handle, ordered, metadata)
    _commit(tmp, final)
    return {"path": fp.path, "sha256": sha256_file(final),
            "tensors": {name: tensor_record(t) for name, t in ordered.items()}}


def _serialize(handle: Any, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write the safetensors format with a sorted, byte-stable header (safetensors' own writer orders
    metadata keys differently from process to process)."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    handle.write(len(text).to_bytes(8, "little") + text)
    for tensor in tensors.values():
        handle.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def _copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    _commit(tmp, dst)


def spec_record(spec: FusedSpec) -> dict[str, Any]:
    """A FusedSpec as JSON."""
    return {"experts": list(spec.experts), "hidden": spec.hidden, "part": spec.part,
            "intermediate": spec.intermediate, "bits": spec.bits, "group_size": spec.group_size,
            "w13_groups": spec.w13_groups, "w2_groups": spec.w2_groups, "has_zero_point": spec.has_zero_point,
            "act_order": spec.act_order, "scale_dtype": str(spec.scale_dtype).removeprefix("torch.")}


def spec_from_record(rec: dict[str, Any]) -> FusedSpec:
    """The FusedSpec written by spec_record."""
    fields = {**rec, "experts": tuple(rec["experts"]), "scale_dtype": getattr(torch, rec["scale_dtype"])}
    return FusedSpec(**fields)


def build_manifest(plan: ShardPlan, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest: versions, source, quantization, layout, per-rank files and hashes, source account."""
    from . import __version__

    account: dict[str, Any] = {}
    for fp in plan.common:
        account.update({name: {"common": fp.path} for name in fp.tensors})
    account.update({name: {"ranks": list(ranks)} for name, ranks in plan.expert_sources.items()})
    ranks = [{"rank": r.parallel.rank, "tp_rank": r.parallel.tp_rank, "ep_rank": r.parallel.ep_rank,
              "folder": r.folder, "layers": {p: spec_record(s) for p, s in r.layers.items()},
              "files": [records[f.path] for f in r.files]} for r in plan.ranks]
    return {"schema_version": SCHEMA_VERSION, "package_version": __version__, "params": plan.params,
            "parallel": {"tp": plan.params["tp"], "ep": plan.params["ep"], "placement": plan.params["placement"]},
            "source": plan.fingerprint, "quantization": plan.quant,
            "common": {"files": [records[f.path] for f in plan.common]}, "ranks": ranks,
            "source_tensors": dict(sorted(account.items())), "copied": list(plan.copied)}


# ---------------------------------------------------------------- loading back

def is_presharded(path: str | Path) -> bool:
    """Whether `path` is a pre-shard output folder (it holds wna16_manifest.json)."""
    return (Path(path) / MANIFEST_NAME).is_file()


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
    """The layer's fused tensors, checked against the spec's shapes and dtypes, on `device`."""
    layer = {}
    for name, (shape, dtype) in spec.shapes().items():
        tensor = tensors.get(f"{prefix}.{name}")
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            found = None if tensor is None else (list(tensor.shape), str(tensor.dtype))
            raise CheckpointError(f"{out}: tensor {prefix}.{name} should be {list(shape)} {dtype}, found {found}; "
                                  f"run `wna16-shard verify {out}` and re-shard.")
        layer[name] = tensor.to(device)
    return layer


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
