"""Reading one rank's fused tensors of a `wna16-shard` output back, with no conversion (the output's folder and
manifest are `outputs`' job).

This is the read side only (below `loader`, which dispatches here for pre-sharded folders);
writing lives in the `preshard` package. A load reads a rank at the cost of reading its files:

| step                 | how                                                                          |
|----------------------|------------------------------------------------------------------------------|
| the rank's record    | `outputs.rank_record`: the manifest's head and that record, parsed alone and |
|                      | checked against the ParallelConfig                                           |
| where tensors lie    | `locate_rank`: each rank file's header parsed and every span checked          |
| each tensor          | `queued_param`: shape/dtype checked against the FusedSpec, then preads (on   |
|                      | worker threads, several at once) into the result (CPU) or a pinned buffer    |
|                      | and one non-blocking copy (GPU)                                              |

`read_rank` / `put_layer` (views of the file mappings, copied into existing parameters) serve
`load_model_experts`, which fills a model's modules in place.

The manifest's names (`read_manifest`, `rank_record`, `SCHEMA_VERSION`, ...) stay importable from here, as
before `outputs` was split off.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..logs import rank_logger
from ..parallel.config import MANIFEST_NAME, ParallelConfig
from ..storage.filemap import read_into
from ..storage.header import HeaderEntry, read_header
from ..storage.index import DTYPES, ITEMSIZES
from ..storage.readahead import ReadOptions, byte_view, pieces
from .device import DevicePolicy
from .fused import FusedExperts, FusedSpec, FusedWriter
from .outputs import (PLAN_NAME, SCHEMA_VERSION, check_output_folder, is_presharded, mtp_layers, output_prefixes,
                      parallel_config, rank_record, rank_specs, read_manifest, read_rank_manifest, rerun_command,
                      spec_from_record, spec_record, warn_no_mtp)
from .results import LoadedExperts, LoadReport

__all__ = [  # this module's own names, then the manifest's (defined in `outputs`)
    "Located", "QueuedParam", "checked_entry", "damaged", "finish_layer", "load_presharded", "locate_rank",
    "put_layer", "queued_param", "read_layers", "read_param", "read_rank", "wrong_tensor",
    "MANIFEST_NAME", "PLAN_NAME", "SCHEMA_VERSION", "check_output_folder", "is_presharded", "mtp_layers",
    "output_prefixes", "parallel_config", "rank_record", "rank_specs", "read_manifest", "read_rank_manifest",
    "rerun_command", "spec_from_record", "spec_record", "warn_no_mtp",
]


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
    and the command that rewrites every damaged file (the one that wrote the output, run again)."""
    return CheckpointError(f"{path}: truncated or corrupt ({path.stat().st_size} bytes on disk): a file of the "
                           f"wna16-shard output {out}. Run `wna16-shard verify {out}` to list every damaged file; "
                           f"re-running `{_writer(out)}` re-checks every file and rewrites only the damaged ones.")


def _writer(out: str | Path) -> str:
    """The command that wrote `out` (from its manifest's head), or that command in words."""
    try:
        return rerun_command(out, read_rank_manifest(out, 0)[0])
    except (CheckpointError, OSError, AttributeError):  # the manifest is damaged too
        return f"wna16-shard SRC {out} ... (the command that wrote it)"


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
        raise CheckpointError(f"{path}: listed in {out / MANIFEST_NAME} but missing; re-running `{_writer(out)}` "
                              f"rewrites it (and only the damaged files).")
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
