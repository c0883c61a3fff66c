"""Reading a `wna16-shard` output back: its manifest, and one rank's fused tensors with no conversion.

This is the read side only (below `loader`, which dispatches here for pre-sharded folders);
writing lives in the `preshard` package.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from .checkpoint import DTYPES, ITEMSIZES
from .errors import CheckpointError, LayoutMismatchError
from .filemap import HeaderEntry, read_header, read_into
from .fused import FusedExperts, FusedSpec, FusedWriter
from .parallel import ParallelConfig
from .results import LoadedExperts, LoadReport


SCHEMA_VERSION = 1


MANIFEST_NAME = "wna16_manifest.json"


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


def _read_rank_files(out: Path, records: list[dict[str, Any]]) -> tuple[dict[str, tuple[Path, HeaderEntry]], int]:
    """Where every tensor of the rank's files lies (each header parsed and its spans checked); nothing read."""
    located: dict[str, tuple[Path, HeaderEntry]] = {}
    for rec in records:
        path = out / rec["path"]
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {out / MANIFEST_NAME} but missing; re-run wna16-shard "
                                  f"with --resume to rewrite it.")
        located.update((name, (path, entry)) for name, entry in read_header(path, ITEMSIZES)[1].items())
    return located, sum(entry.end - entry.begin for _, entry in located.values())


def _layer_tensors(out: str | Path, prefix: str, spec: FusedSpec, located: dict[str, tuple[Path, HeaderEntry]],
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """The layer's fused tensors, checked against the spec's shapes and dtypes, on `device`.

    Each tensor's bytes are read (pread, straight from the page cache) into the writer's staging
    buffer, pinned for a GPU, or into a pinned buffer first for a parameter that lives on the device:
    never DMA from a mapping. The writer then moves each in one copy.
    """
    writer = FusedWriter(prefix, spec, device)
    for name, (shape, dtype) in spec.shapes().items():
        path, entry = located.get(f"{prefix}.{name}", (None, None))
        if entry is None or entry.shape != shape or DTYPES.get(entry.dtype) != dtype:
            found = None if entry is None else (list(entry.shape), str(DTYPES.get(entry.dtype, entry.dtype)))
            raise CheckpointError(f"{out}: tensor {prefix}.{name} should be {list(shape)} {dtype}, found {found}; "
                                  f"run `wna16-shard verify {out}` and re-shard.")
        target = writer.staging[name]
        direct = target.device.type == "cpu" and target.is_contiguous()
        host = target if direct else torch.empty(shape, dtype=dtype, pin_memory=target.device.type == "cuda")
        read_into(path, entry.begin, host)
        if direct:
            writer.bytes_written += host.numel() * host.element_size()
        else:
            writer.put_whole(name, host)
    return writer.finish().tensors


def spec_record(spec: FusedSpec) -> dict[str, Any]:
    """A FusedSpec as JSON."""
    return {**dataclasses.asdict(spec), "experts": list(spec.experts),
            "scale_dtype": str(spec.scale_dtype).removeprefix("torch.")}


def spec_from_record(rec: dict[str, Any]) -> FusedSpec:
    """The FusedSpec written by spec_record."""
    fields = {**rec, "experts": tuple(rec["experts"]), "scale_dtype": getattr(torch, rec["scale_dtype"])}
    return FusedSpec(**fields)
