"""Verifying a pre-shard output: every file against its manifest hash and, with the source, every
tensor against the source (common bytes, checkpoint-layout slices, fused experts reassembled over TP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..checkpoint import CheckpointIndex
from ..errors import WNA16Error
from ..fused import FusedExperts
from ..loader import load_experts
from ..parallel import ParallelConfig
from ..presharded import load_presharded, read_manifest
from ..presliced import materialize
from .manifest import tensor_record
from .planning import make_plan
from .safefiles import sha256_file


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
    part, halves = layers[0].spec.part, len(layers[0].spec.projections) - 1  # gate and up, or up only
    w13 = torch.cat([torch.cat([d.w13[:, h * part:(h + 1) * part] for d in deq], dim=1) for h in range(halves)], dim=1)
    w2 = torch.cat([d.w2 for d in deq], dim=2)
    index = [list(ref_layer.spec.experts).index(e) for e in layers[0].spec.experts]
    problems = []
    if not torch.equal(w13, ref.w13[index]):
        problems.append(f"{prefix}: ep rank {ep_rank}: w13 does not reassemble to the source's dequantised weights")
    if not torch.equal(w2, ref.w2[index]):
        problems.append(f"{prefix}: ep rank {ep_rank}: w2 does not reassemble to the source's dequantised weights")
    return problems
