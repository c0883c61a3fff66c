"""Reading a `wna16-shard` output back: its manifest, and one rank's fused tensors with no conversion.

This is the read side only (below `loader`, which dispatches here for pre-sharded folders);
writing lives in the `preshard` package. A load reads a rank at the cost of reading its files:

| step                 | how                                                                          |
|----------------------|------------------------------------------------------------------------------|
| the rank's record    | `read_rank_manifest`: the manifest's head and that record, sliced by their   |
|                      | lines and parsed alone (not the other ranks, not the source account)         |
| where tensors lie    | `locate_rank`: each rank file's header parsed and every span checked          |
| each tensor          | `queued_param`: shape/dtype checked against the FusedSpec, then preads (on   |
|                      | worker threads, several at once) into the result (CPU) or a pinned buffer    |
|                      | and one non-blocking copy (GPU)                                              |

`read_rank` / `put_layer` (views of the file mappings, copied into existing parameters) serve
`load_model_experts`, which fills a model's modules in place.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from ..errors import CheckpointError, LayoutMismatchError
from ..logs import rank_logger
from ..parallel.config import MANIFEST_NAME, ParallelConfig
from ..storage.filemap import read_into
from ..storage.header import HeaderEntry, read_header
from ..storage.index import DTYPES, ITEMSIZES
from ..storage.readahead import ReadOptions, byte_view, pieces
from .device import DevicePolicy
from .fused import FusedExperts, FusedSpec, FusedWriter
from .results import LoadedExperts, LoadReport

SCHEMA_VERSION = 1


PLAN_NAME = ".wna16-plan.json"


def is_presharded(path: str | Path) -> bool:
    """Whether `path` is a finished pre-shard output folder (it holds wna16_manifest.json); an
    unfinished one (a plan but no manifest) is refused with the command that finishes it."""
    if (Path(path) / MANIFEST_NAME).is_file():
        return True
    if (Path(path) / PLAN_NAME).is_file():
        raise CheckpointError(f"{path}: an unfinished wna16-shard output ({PLAN_NAME} but no {MANIFEST_NAME}); "
                              f"finish it with wna16-shard SRC {path} ... --resume, or load the source checkpoint.")
    return False


def check_output_folder(out: str | Path) -> Path:
    """`out` as a Path when it is a finished wna16-shard output; else a CheckpointError saying which of
    "no such folder", "not a folder", "unfinished" or "not a wna16-shard output" it is, and the fix."""
    out = Path(out)
    if not out.exists():
        raise CheckpointError(f"{out}: no such folder; pass the OUT folder of a wna16-shard run.")
    if not out.is_dir():
        raise CheckpointError(f"{out}: not a folder (a file); pass the OUT folder of a wna16-shard run.")
    if not (out / MANIFEST_NAME).is_file():
        if (out / PLAN_NAME).is_file():
            raise CheckpointError(f"{out}: an unfinished wna16-shard output ({PLAN_NAME} but no {MANIFEST_NAME}); "
                                  f"finish it with wna16-shard SRC {out} ... --resume.")
        raise CheckpointError(f"{out}: not a wna16-shard output (no {MANIFEST_NAME}); pass the OUT folder of a "
                              f"wna16-shard run.")
    return out


def read_manifest(out: str | Path) -> dict[str, Any]:
    """OUT/wna16_manifest.json, checked for a known schema version."""
    path = check_output_folder(out) / MANIFEST_NAME
    return _checked(path, _parse(path, path.read_bytes()))


def _parse(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); re-run wna16-shard with --resume.") from None


def _checked(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(f"{path}: schema version {manifest.get('schema_version')!r}, this package reads "
                              f"{SCHEMA_VERSION}; re-shard the checkpoint with this version.")
    return manifest


def read_rank_manifest(out: str | Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The manifest's members before `ranks` (schema, params, parallel, source, ...) and the record of
    global `rank` (None when there is none), without parsing the other ranks' records or the source account.

    wna16-shard writes the manifest with indent 2, where a line's indent is its depth (a JSON string holds
    no raw newline): the `ranks` member starts at the line `  "ranks": [` and ends at `  ]`, each record
    spans `    {` .. `    }`, so the head and the rank's record are sliced from the mapped file and parsed
    alone. Any other text (compact, hand-edited, truncated) is parsed whole, with read_manifest's errors.
    """
    path = check_output_folder(out) / MANIFEST_NAME
    with open(path, "rb") as handle:
        empty = not os.fstat(handle.fileno()).st_size
        with nullcontext(b"") if empty else mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as raw:
            sliced = _slice_rank(raw, rank)
    if sliced is not None:
        return _checked(path, sliced[0]), sliced[1]
    manifest = read_manifest(out)
    head = dict(itertools.takewhile(lambda item: item[0] != "ranks", manifest.items()))
    return head, manifest["ranks"][rank] if 0 <= rank < len(manifest["ranks"]) else None


def _slice_rank(raw: bytes | mmap.mmap, rank: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(head, record of `rank`) parsed from their lines of an indent-2 manifest, or None when the text
    is not laid out so (or the slices do not parse, or the record is not `rank`'s)."""
    start = raw.find(b'\n  "ranks": [')
    end = raw.find(b"\n  ]", max(start, 0))
    if start < 0 or end < 0 or raw[-2:] != b"}\n":
        return None
    begin = start
    for _ in range(rank + 1):
        begin = raw.find(b"\n    {", begin + 1, end)
        if begin < 0:
            return None
    stop = raw.find(b"\n    }", begin, end)
    try:
        head = json.loads(raw[:start].rstrip().rstrip(b",") + b"\n}")
        record = json.loads(raw[begin:stop + 6]) if stop >= 0 else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(head, dict) or not isinstance(record, dict) or record.get("rank") != rank:
        return None
    return head, record


def output_prefixes(out: str | Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(decoder, MTP) experts prefixes of a wna16-shard output, in file order (every rank holds every MoE
    layer; rank 0's record is read, not the others')."""
    _, record = read_rank_manifest(out, 0)
    if record is None:
        raise CheckpointError(f"{Path(out) / MANIFEST_NAME}: no record of rank 0 in its ranks list; run "
                              f"`wna16-shard verify {out}` and re-shard.")
    mtp = mtp_layers(record)
    return tuple(p for p in record["layers"] if p not in mtp), tuple(p for p in record["layers"] if p in mtp)


def parallel_config(out: str | Path, *, rank: int) -> ParallelConfig:
    """The ParallelConfig of global `rank` in the layout `out` (a wna16-shard output) was written for: an alias
    of `ParallelConfig.from_manifest(out, rank=rank)`, the documented way."""
    return ParallelConfig.from_manifest(read_manifest(out), rank=rank)


def load_presharded(out: str | Path, parallel: ParallelConfig, *, device: torch.device | str = "cpu",
                    include_mtp: bool = False, reads: ReadOptions = ReadOptions()) -> LoadedExperts:
    """Load `parallel`'s fused tensors from a pre-shard output: no slicing, no conversion. Each tensor is
    located by its file's validated header and read (pread, in pieces of at most `reads.request_bytes`,
    `reads.threads` at once, `reads.ahead` layers beyond the one being finished) straight into its
    parameter on the CPU; for a GPU into a pinned buffer, then one non-blocking copy into the parameter
    allocated there (never DMA from a mapping). The load synchronises once, at its end. MTP layers only
    with `include_mtp`."""
    start = time.perf_counter()
    policy = DevicePolicy.of(device)
    rank = rank_record(out, parallel, include_mtp=include_mtp)
    located, nbytes = locate_rank(out, rank)
    result = read_layers(out, policy, rank_specs(rank, include_mtp=include_mtp), located, reads, mtp=mtp_layers(rank))
    policy.synchronize()
    result.report = LoadReport(layers=len(result), experts=sum(len(l.spec.experts) for l in result.values()),
                               tensors=len(located), bytes_read=nbytes, bytes_written=nbytes,
                               seconds=time.perf_counter() - start)
    rank_logger(parallel).info("loaded from the wna16-shard output %s: %s", out, result.report)
    return result


def read_layers(out: str | Path, policy: DevicePolicy, specs: dict[str, FusedSpec], located: dict[str, Located],
                reads: ReadOptions, *, mtp: frozenset[str]) -> LoadedExperts:
    """Every layer of `specs`, in order: each layer's preads queued on `reads.threads` workers (one when reads
    are disabled), at most `reads.ahead` layers queued beyond the one being finished (`finish_layer`)."""
    result = LoadedExperts()
    pending: list[tuple[str, FusedSpec, dict[str, QueuedParam]]] = []
    with ThreadPoolExecutor(reads.threads if reads.enabled else 1, thread_name_prefix="wna16-read") as workers:
        for prefix, spec in specs.items():
            with policy.scope():
                pending.append((prefix, spec, {name: queued_param(out, policy, f"{prefix}.{name}", shape, dtype,
                                                                  located.get(f"{prefix}.{name}"), workers, reads)
                                               for name, (shape, dtype) in spec.shapes().items()}))
            while len(pending) > reads.ahead:
                finish_layer(result, policy, *pending.pop(0), mtp=mtp)
        while pending:
            finish_layer(result, policy, *pending.pop(0), mtp=mtp)
    return result


class QueuedParam(NamedTuple):
    """A fused tensor's host memory and the reads that fill it."""

    host: torch.Tensor
    reads: list[Future[None]]


def finish_layer(result: LoadedExperts, policy: DevicePolicy, prefix: str, spec: FusedSpec,
                 queued: dict[str, QueuedParam], *, mtp: frozenset[str]) -> None:
    """Wait for a layer's reads; its tensors into `result` (on a GPU: each sent from its pinned buffer)."""
    tensors = {}
    with policy.scope():
        for name, param in queued.items():
            for read in param.reads:
                read.result()
            tensors[name] = policy.upload(param.host)
    result[prefix] = FusedExperts(prefix, spec, tensors, mtp=prefix in mtp)


Located = tuple[Path, HeaderEntry]


def locate_rank(out: str | Path, rank: dict[str, Any]) -> tuple[dict[str, Located], int]:
    """Where every tensor of a rank record's files lies (each file's header parsed and every span checked
    against its dtype, shape and the file size; nothing else read), and their bytes."""
    located: dict[str, Located] = {}
    for rec in rank["files"]:
        path = _rank_file(Path(out), rec)
        try:
            entries = read_header(path, ITEMSIZES)[1]
        except CheckpointError:
            raise damaged(out, path) from None
        located.update((name, (path, entry)) for name, entry in entries.items())
    return located, sum(entry.end - entry.begin for _, entry in located.values())


def damaged(out: str | Path, path: Path) -> CheckpointError:
    """The error for a rank file of an output whose header or size is wrong (truncated, overwritten): the file,
    and how to find and rewrite every damaged file."""
    return CheckpointError(f"{path}: truncated or corrupt ({path.stat().st_size} bytes on disk): a file of the "
                           f"wna16-shard output {out}. Run `wna16-shard verify {out}` to list every damaged file, then "
                           f"the wna16-shard command that wrote {out} again with --resume: it keeps the intact files "
                           f"and rewrites only the damaged ones.")


def read_param(out: str | Path, policy: DevicePolicy, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               located: Located | None) -> torch.Tensor:
    """The fused tensor `name` (checked against `shape`/`dtype`), read from its file into a new tensor on
    the policy's target: on the CPU, pread into the result; for a GPU, into a pinned host buffer, then one
    non-blocking copy into the result allocated there."""
    path, entry = checked_entry(out, name, shape, dtype, located)
    host = policy.host_buffer(shape, dtype)
    read_into(path, entry.begin, host)
    return policy.upload(host)


def queued_param(out: str | Path, policy: DevicePolicy, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 located: Located | None, workers: ThreadPoolExecutor, reads: ReadOptions) -> QueuedParam:
    """The fused tensor `name` (checked against `shape`/`dtype`): its host memory (the result on the CPU, a
    pinned buffer for a GPU) and the preads into it, queued on `workers` in pieces of at most
    `reads.request_bytes`."""
    path, entry = checked_entry(out, name, shape, dtype, located)
    host = policy.host_buffer(shape, dtype)
    flat = byte_view(host)
    return QueuedParam(host, [workers.submit(read_into, path, entry.begin + begin, flat[begin:end])
                              for begin, end in pieces(0, len(flat), reads.request_bytes)])


def checked_entry(out: str | Path, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  located: Located | None) -> Located:
    """Where fused tensor `name` lies, after checking it is there with `shape` and `dtype` (CheckpointError)."""
    entry = None if located is None else located[1]
    if located is None or entry.shape != shape or DTYPES.get(entry.dtype) != dtype:
        found = None if entry is None else (list(entry.shape), str(DTYPES.get(entry.dtype, entry.dtype)))
        raise wrong_tensor(out, name, shape, dtype, found)
    return located


def wrong_tensor(out: str | Path, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 found: tuple[list[int], str] | None) -> CheckpointError:
    """The error for fused tensor `name` of an output that is missing (`found` None) or of another shape/dtype."""
    return CheckpointError(f"{out}: tensor {name} should be {list(shape)} {dtype}, found {found}; "
                           f"run `wna16-shard verify {out}` and re-shard.")


def rank_record(out: str | Path, parallel: ParallelConfig, *, include_mtp: bool = False) -> dict[str, Any]:
    """The manifest's record of `parallel`'s rank (files, layers), after checking that the output is a
    fused one written for `parallel`'s layout (only the manifest's head and that record are parsed).
    `include_mtp`: warn when the output holds no fused MTP layer to load (see `warn_no_mtp`)."""
    manifest, record = read_rank_manifest(out, parallel.rank)
    if include_mtp:
        warn_no_mtp(out, manifest, parallel)
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
    if record is None:
        raise CheckpointError(f"{Path(out) / MANIFEST_NAME}: no record of rank {parallel.rank} in its ranks list; "
                              f"run `wna16-shard verify {out}` and re-shard.")
    return record


def warn_no_mtp(out: str | Path, manifest: dict[str, Any], parallel: ParallelConfig) -> None:
    """One warning when `include_mtp=True` asks for MTP layers that an output does not hold fused: written with
    --no-mtp (the MTP experts are in common/, unchanged), or from a source without MTP experts."""
    sharded = manifest.get("params", {}).get("mtp")  # recorded only for a source with MTP experts
    if sharded:
        return
    if sharded is False:
        what = ("was written with --no-mtp: its MTP experts were copied unchanged into common/, so no MTP layer is "
                "loaded from it. Load them from common/ with the engine's own loader, or re-shard without --no-mtp")
    else:
        what = "holds no MTP experts (its source had none): only the decoder's MoE layers are loaded"
    rank_logger(parallel).warning("include_mtp=True, but the wna16-shard output %s %s.", out, what)


def rank_specs(rank: dict[str, Any], *, include_mtp: bool = True) -> dict[str, FusedSpec]:
    """The layout of every layer of a rank record, in file order (MTP layers only with `include_mtp`)."""
    return {prefix: spec_from_record(rec) for prefix, rec in rank["layers"].items()
            if include_mtp or not rec.get("mtp", False)}


def mtp_layers(rank: dict[str, Any]) -> frozenset[str]:
    """The experts prefixes of a rank record's MTP layers (a layer record with `"mtp": true`)."""
    return frozenset(prefix for prefix, rec in rank["layers"].items() if rec.get("mtp", False))


def read_rank(out: str | Path, rank: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor of a rank record's files as a view of its file mapping (nothing copied), and their bytes."""
    return _read_rank_files(Path(out), rank["files"])


def _read_rank_files(out: Path, records: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], int]:
    tensors: dict[str, torch.Tensor] = {}
    for rec in records:
        path = _rank_file(out, rec)
        try:
            read_header(path, ITEMSIZES)  # every span checked: safetensors' own error would name no remedy
        except CheckpointError:
            raise damaged(out, path) from None
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors, sum(t.numel() * t.element_size() for t in tensors.values())


def _rank_file(out: Path, rec: dict[str, Any]) -> Path:
    path = out / rec["path"]
    if not path.is_file():
        raise CheckpointError(f"{path}: listed in {out / MANIFEST_NAME} but missing; re-run wna16-shard "
                              f"with --resume to rewrite it.")
    return path


def put_layer(out: str | Path, writer: FusedWriter, tensors: dict[str, torch.Tensor]) -> None:
    """Put one layer's fused tensors (views of the rank files' mappings), checked against the writer's
    spec, into its staging: `put_whole` copies each out of the mapping (through a pinned buffer and one
    non-blocking copy for a device): never DMA from a mapping."""
    prefix = writer.prefix
    for name, (shape, dtype) in writer.spec.shapes().items():
        tensor = tensors.get(f"{prefix}.{name}")
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            found = None if tensor is None else (list(tensor.shape), str(tensor.dtype))
            raise wrong_tensor(out, f"{prefix}.{name}", shape, dtype, found)
        writer.put_whole(name, tensor)


def spec_record(spec: FusedSpec) -> dict[str, Any]:
    """A FusedSpec as JSON."""
    return {**dataclasses.asdict(spec), "experts": list(spec.experts),
            "scale_dtype": str(spec.scale_dtype).removeprefix("torch.")}


def spec_from_record(rec: dict[str, Any]) -> FusedSpec:
    """The FusedSpec written by spec_record (keys that are not FusedSpec fields, e.g. the manifest's
    `padded_intermediate`, are records for readers, not part of the spec)."""
    names = {f.name for f in dataclasses.fields(FusedSpec)}
    fields = {**{k: v for k, v in rec.items() if k in names}, "experts": tuple(rec["experts"]),
              "scale_dtype": getattr(torch, rec["scale_dtype"])}
    return FusedSpec(**fields)
