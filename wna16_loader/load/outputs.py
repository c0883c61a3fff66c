"""A `wna16-shard` output's folder and manifest, read and checked (the rank's tensors are `presharded`'s).

| what                  | how                                                                            |
|-----------------------|--------------------------------------------------------------------------------|
| the folder            | `is_presharded` / `check_output_folder`: finished, unfinished, or not an output |
| the whole manifest    | `read_manifest`: parsed and checked for a known schema version                 |
| one rank's record     | `read_rank_manifest`: the manifest's head and that record, sliced by their     |
|                       | lines and parsed alone (not the other ranks, not the source account)           |
| the record for a load | `rank_record`: checked against the `ParallelConfig` it is loaded with          |
| the layers            | `rank_specs` / `mtp_layers`: each layer's FusedSpec (`spec_from_record`)       |
| what the files hold   | `OutputLayout` (`--layout`), as the manifest records it (`output_layout`)      |

`OutputLayout` is declared here, below both of its users: this read side (a load refuses a checkpoint-layout
output) and the writer (`preshard`, which converts the `layout=` argument to it).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import mmap
import os
import shlex
from contextlib import nullcontext
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, LayoutMismatchError
from ..logs import rank_logger
from ..parallel.config import MANIFEST_NAME, ParallelConfig
from .fused import FusedSpec

SCHEMA_VERSION = 1


PLAN_NAME = ".wna16-plan.json"


class OutputLayout(str, Enum):
    """What a wna16-shard output's rank files hold: `--layout`, recorded as its value in the manifest's
    `params.layout` (a str, so a member equals its value and is written as it)."""

    FUSED = "fused"  # load_experts' fused tensors (the default)
    CHECKPOINT = "checkpoint"  # every source expert tensor sliced per rank, in the source's names and format

    def __str__(self) -> str:
        return self.value


def output_layout(out: str | Path, manifest: dict[str, Any]) -> OutputLayout:
    """The layout a manifest (or its head) records; "fused" for outputs written before it was recorded. A value
    that is no OutputLayout's raises CheckpointError naming it."""
    value = manifest["params"].get("layout", OutputLayout.FUSED.value)
    try:
        return OutputLayout(value)
    except ValueError:
        raise CheckpointError(f"{Path(out) / MANIFEST_NAME}: params.layout is {value!r}, none of "
                              f"{[layout.value for layout in OutputLayout]} (a newer wna16-shard's, or an edit); "
                              f"re-shard the source with this version's wna16-shard.") from None


def is_presharded(path: str | Path) -> bool:
    """Whether `path` is a finished pre-shard output folder (it holds wna16_manifest.json); an
    unfinished one (a plan but no manifest) is refused with the command that finishes it."""
    if (Path(path) / MANIFEST_NAME).is_file():
        return True
    if (Path(path) / PLAN_NAME).is_file():
        raise CheckpointError(f"{path}: an unfinished wna16-shard output ({PLAN_NAME} but no {MANIFEST_NAME}); "
                              f"finish it with wna16-shard SRC {path} ... --resume, or load the source checkpoint.")
    return False


# A wna16-shard run's parameters when their flag is not given (left out of the command `rerun_command` names).
DEFAULT_PARAMS = {"tp": 1, "ep": 1, "placement": "linear", "max_file_size": 4 * 2**30, "layout": "fused"}


def rerun_command(out: str | Path, manifest: dict[str, Any]) -> str:
    """The wna16-shard command that wrote `out`, from its manifest (or its head): the source path it records
    (`SRC` in a manifest written before the path was recorded) and every parameter not at its default. Run
    again, it re-checks every file (size, then sha256) and rewrites exactly the damaged or missing ones."""
    params = manifest.get("params", {})
    source = manifest.get("source", {}).get("path", "SRC")
    flags = [f"--{key.replace('_', '-')} {params[key]}" for key, default in DEFAULT_PARAMS.items()
             if params.get(key, default) != default]
    flags += ["--no-mtp"] if params.get("mtp") is False else []
    return " ".join(["wna16-shard", shlex.quote(str(source)), shlex.quote(str(out)), *flags])


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


def rank_record(out: str | Path, parallel: ParallelConfig, *, include_mtp: bool = False) -> dict[str, Any]:
    """The manifest's record of `parallel`'s rank (files, layers), after checking that the output is a
    fused one written for `parallel`'s layout (only the manifest's head and that record are parsed).
    `include_mtp`: warn when the output holds no fused MTP layer to load (see `warn_no_mtp`)."""
    manifest, record = read_rank_manifest(out, parallel.rank)
    if include_mtp:
        warn_no_mtp(out, manifest, parallel)
    layout = output_layout(out, manifest)
    if layout is not OutputLayout.FUSED:
        raise LayoutMismatchError(f"{Path(out) / MANIFEST_NAME}: written with --layout {layout.value} "
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
