"""load_experts: read this rank's share of every MoE layer into fused parameters."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from ..logs import RankLogger, rank_logger
from ..models.config import MoEConfig, read_config_files
from ..parallel.config import ParallelConfig
from ..storage.bulk import paused_gc_call
from ..storage.hub import resolve_checkpoint
from ..storage.index import CheckpointIndex
from ..storage.readahead import ReadOptions
from .device import DevicePolicy
from .fused import FusedExperts, FusedWriter
from .layer import LayerLoad
from .ledger import Ledger
from .plan import LayerPlan, plan_layers
from .reads import load_groups
from .presharded import is_presharded, load_presharded, output_prefixes
from .results import LoadedExperts, LoadReport
from .scan import CheckpointScan
from .specs import warn_reduced_groups_by_spec
from .tables import LayerTables


def read_moe_config(path: str | Path, *, revision: str | None = None) -> MoEConfig:
    """The resolved description of a checkpoint: config keys, quantization and experts prefixes (those of
    the decoder's MoE layers in `experts_prefixes`, those of MTP layers in `mtp_prefixes`; `mtp` says how
    many MTP layers the config declares and where that came from).
    `path`: a folder or a Hugging Face repo id (`org/name`, at `revision`; see `hub.resolve_checkpoint`), or a
    `wna16-shard` output (self-contained: its copied config.json, and the experts prefixes of its manifest)."""
    path = resolve_checkpoint(path, revision=revision)
    moe = read_config_files(path)
    if is_presharded(path):
        decoder, mtp = output_prefixes(path)
        return replace(moe, experts_prefixes=decoder, mtp_prefixes=mtp)
    with CheckpointIndex(path) as index:
        scan = CheckpointScan.of(index)
        mtp = scan.mtp_prefixes(moe.mtp)
        tables = LayerTables(index, moe)
        specs = tuple((prefix, tables.layer(names).spec) for prefix, names in scan.layers.items()
                      if names.layer in moe.moe_layers or prefix in mtp)
    return replace(moe, experts_prefixes=tuple(p for p in scan.layers if p not in mtp), mtp_prefixes=mtp,
                   layer_specs=specs)


def load_experts(path: str | Path, parallel: ParallelConfig, *, revision: str | None = None,
                 device: torch.device | str = "cpu", allow_nonfinite_scales: bool = False,
                 convert_on_device: bool = True, include_mtp: bool = False,
                 reads: ReadOptions = ReadOptions()) -> LoadedExperts:
    """Load `parallel`'s share of every routed-expert layer of the checkpoint at `path`.

    Tensors of non-local experts are never read; each local projection is read as
    the slice covering the rank's columns, converted, and written once into the
    fused layout on `device` ("cpu", "cuda" or "cuda:N"; ROCm devices are "cuda" in PyTorch too).
    On a GPU the weights' raw words go up in large pinned chunks and are converted there
    (`convert_on_device=False`: converted on the host, then copied); the load synchronises the
    device once, at its end. Raises a WNA16Error subclass on any bad input (DeviceError for a
    device this PyTorch cannot drive).
    A `wna16-shard` output folder (with wna16_manifest.json) is loaded directly
    from the rank's pre-sharded files; its layout must equal `parallel`'s.
    `path` may be a Hugging Face repo id (`org/name`, at `revision`): see `hub.resolve_checkpoint`.
    MTP (multi-token-prediction) layers are left alone by default, their expert tensors counted as
    non-expert tensors (an engine loads its draft layer separately); `include_mtp=True` loads them too,
    each with `mtp=True`.
    `reads`: how the planned bytes are read ahead of their conversion (`storage.readahead.ReadOptions`:
    threads, request size, direct I/O; `ReadOptions(enabled=False)` reads through the file mappings alone).
    """
    policy = DevicePolicy.of(device, convert_on_device=convert_on_device)
    path = resolve_checkpoint(path, revision=revision, rank=parallel.rank)
    if is_presharded(path):
        return load_presharded(path, parallel, device=device, include_mtp=include_mtp, reads=reads)
    return _load_checkpoint(path, parallel, policy, device, allow_nonfinite_scales, convert_on_device, include_mtp,
                            reads)


@paused_gc_call  # the index, scan and plans are freed before the GC is back on: see storage/bulk.py
def _load_checkpoint(path: Path, parallel: ParallelConfig, policy: DevicePolicy, device: torch.device | str,
                     allow_nonfinite: bool, convert_on_device: bool, include_mtp: bool,
                     reads: ReadOptions) -> LoadedExperts:
    """`load_experts` of a checkpoint folder (not pre-sharded): layer by layer, each layer's bytes read
    ahead while earlier layers convert (`storage.readahead`)."""
    start = time.perf_counter()
    with planned(path, parallel, include_mtp=include_mtp) as (moe, index, scan, plans):
        own, together = load_groups(index, moe, parallel, scan, plans, reads)
        with index.reading_ahead(own, reads, pin=policy.gpu, node_windows=together,
                                 node_cold=True) as ahead:
            result = LoadedExperts()
            written = tensors = 0
            for number, plan in enumerate(plans):
                ahead.start(number)
                layer, count, nbytes = load_layer(index, moe, plan, device, allow_nonfinite,
                                                  convert_on_device=convert_on_device)
                result[plan.prefix] = layer
                tensors += count
                written += nbytes
            policy.synchronize()
        result.report = LoadReport.of(plans, scan, tensors=tensors, bytes_read=index.bytes_read,
                                      bytes_written=written, start=start, window_bytes=ahead.window_bytes,
                                      buffer_bytes=ahead.buffer_bytes)
        result.ignored = scan.others
    rank_logger(parallel).info("loaded: %s", result.report)
    return result


@contextmanager
def planned(path: str | Path, parallel: ParallelConfig, *, include_mtp: bool = False) -> Iterator[
        tuple[MoEConfig, CheckpointIndex, CheckpointScan, list[LayerPlan]]]:
    """The checkpoint's resolved config, its open index, its name scan and `parallel`'s layer plans,
    with the ledger checked (missing, duplicated or unexpected tensors raise before any read). Without
    `include_mtp` the MTP layers' expert tensors are non-expert tensors of the scan."""
    moe, ledger = read_config_files(path), Ledger()
    with CheckpointIndex(path) as index:
        scan = scan_for(index, moe, include_mtp)
        if include_mtp:
            warn_no_mtp(rank_logger(parallel), Path(path), moe, scan)
        plans = plan_layers(index, moe, parallel, ledger, scan)
        ledger.check()
        warn_reduced_groups_by_spec(rank_logger(parallel), tp_size=parallel.tp_size,
                                    effective={p.prefix: (p.moe.quant.group_size, p.fused.group_size) for p in plans},
                                    intermediate=moe.intermediate_size)
        yield moe, index, scan, plans


def scan_for(index: CheckpointIndex, moe: MoEConfig, include_mtp: bool) -> CheckpointScan:
    """The checkpoint's name scan, its MTP layers' expert tensors moved to the non-expert tensors unless
    `include_mtp`."""
    scan = CheckpointScan.of(index)
    return scan if include_mtp else scan.without(scan.mtp_prefixes(moe.mtp))


def warn_no_mtp(logger: RankLogger, folder: Path, moe: MoEConfig, scan: CheckpointScan) -> None:
    """One warning when `include_mtp=True` finds no MTP experts to load in a checkpoint: none declared (the
    family's row, or a dense MTP block), or declared but without tensors (quantizers often drop the layer)."""
    if scan.mtp_prefixes(moe.mtp):
        return
    if moe.mtp.count and moe.mtp.routed:
        what = (f"declares {moe.mtp.count} MTP layer(s) ({moe.mtp.source}) but holds no tensors of their experts "
                f"(quantizers often drop the layer)")
    else:
        what = f"has no MTP experts ({moe.mtp.source})"
    logger.warning("include_mtp=True, but %s %s: only the decoder's MoE layers are loaded.", folder, what)


def load_layer(index: CheckpointIndex, moe: MoEConfig, plan: LayerPlan, device: torch.device | str,
               allow_nonfinite: bool, *, convert_on_device: bool = True,
               staging: dict[str, torch.Tensor] | None = None,
               huge_results: bool = True) -> tuple[FusedExperts, int, int]:
    """Read, convert and write every local projection of one layer (the hook's own write path); device
    copies are queued, not waited for (the caller synchronises once). `staging`: existing tensors to
    write into (see FusedWriter), e.g. an engine's parameters; `huge_results`: as `DevicePolicy.of` takes it."""
    writer = FusedWriter(plan.prefix, plan.fused, device, convert_on_device=convert_on_device, staging=staging,
                         huge_results=huge_results)
    layer = LayerLoad(plan.prefix, plan.moe, plan.geometry, allow_nonfinite=allow_nonfinite)
    layer.load_plan(index, writer, plan)
    return writer.finish(mtp=plan.mtp), layer.tensors, writer.bytes_written
