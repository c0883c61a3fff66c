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
from safetensors import safe_open

from .device import DevicePolicy
from .errors import CheckpointError, LayoutMismatchError
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
    """Load `parallel`'s fused tensors from a pre-shard output: no slicing, no conversion. On a GPU each
    parameter is allocated there and filled through a pinned buffer in one non-blocking copy; the load
    synchronises once, at its end."""
    start = time.perf_counter()
    policy = DevicePolicy.of(device)
    rank = rank_record(out, parallel)
    tensors, nbytes = read_rank(out, rank)
    result = LoadedExperts()
    for prefix, spec in rank_specs(rank).items():
        with policy.scope():
            staging = {name: policy.empty(shape, dtype) for name, (shape, dtype) in spec.shapes().items()}
        writer = FusedWriter(prefix, spec, policy.target, staging=staging)
        put_layer(out, writer, tensors)
        result[prefix] = FusedExperts(prefix, spec, writer.staging)
    policy.synchronize()
    result.report = LoadReport(layers=len(result), experts=sum(len(l.spec.experts) for l in result.values()),
                               tensors=len(tensors), bytes_read=nbytes, bytes_written=nbytes,
                               seconds=time.perf_counter() - start)
    return result


def rank_record(out: str | Path, parallel: ParallelConfig) -> dict[str, Any]:
    """The manifest's record of `parallel`'s rank (files, layers), after checking that the output is a
    fused one written for `parallel`'s layout."""
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
    return manifest["ranks"][parallel.rank]


def rank_specs(rank: dict[str, Any]) -> dict[str, FusedSpec]:
    """The layout of every layer of a rank record, in file order."""
    return {prefix: spec_from_record(rec) for prefix, rec in rank["layers"].items()}


def read_rank(out: str | Path, rank: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor of a rank record's files as a view of its file mapping (nothing copied), and their bytes."""
    return _read_rank_files(Path(out), rank["files"])


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


def put_layer(out: str | Path, writer: FusedWriter, tensors: dict[str, torch.Tensor]) -> None:
    """Put one layer's fused tensors (views of the rank files' mappings), checked against the writer's
    spec, into its staging: `put_whole` copies each out of the mapping (through a pinned buffer and one
    non-blocking copy for a device): never DMA from a mapping."""
    prefix = writer.prefix
    for name, (shape, dtype) in writer.spec.shapes().items():
        tensor = tensors.get(f"{prefix}.{name}")
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            found = None if tensor is None else (list(tensor.shape), str(tensor.dtype))
            raise CheckpointError(f"{out}: tensor {prefix}.{name} should be {list(shape)} {dtype}, found {found}; "
                                  f"run `wna16-shard verify {out}` and re-shard.")
        writer.put_whole(name, tensor)


def spec_record(spec: FusedSpec) -> dict[str, Any]:
    """A FusedSpec as JSON."""
    return {**dataclasses.asdict(spec), "experts": list(spec.experts),
            "scale_dtype": str(spec.scale_dtype).removeprefix("torch.")}


def spec_from_record(rec: dict[str, Any]) -> FusedSpec:
    """The FusedSpec written by spec_record."""
    fields = {**rec, "experts": tuple(rec["experts"]), "scale_dtype": getattr(torch, rec["scale_dtype"])}
    return FusedSpec(**fields)
