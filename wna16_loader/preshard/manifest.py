"""The manifest of a pre-shard output (written last): versions, source, quantization, layout, every
file's sha256 (the Hub's LFS object id of the file) and tensor records, and where each source tensor went."""

from __future__ import annotations

from typing import Any

import torch

from ..load.outputs import SCHEMA_VERSION, OutputLayout, spec_record
from ..models.families import family_of
from ..models.names import shared_prefix
from ..version import __version__
from .plan import RankPlan, ShardPlan


# 2: one digest per byte, each file's sha256 (taken while the file is written); tensor records hold shape and
# dtype only. 1 (no "manifest_version" key): each tensor record also held the sha256 of the tensor's bytes.
# What a loader reads (SCHEMA_VERSION: layers, files, params) is the same in both.
MANIFEST_VERSION = 2


def tensor_record(shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Any]:
    """A tensor's manifest record: shape and dtype (its bytes are vouched for by its file's sha256)."""
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}


def manifest_version(manifest: dict[str, Any]) -> int:
    """The manifest's version: 1 for outputs written before the key existed."""
    return int(manifest.get("manifest_version", 1))


def without_tensor_digests(record: dict[str, Any]) -> dict[str, Any]:
    """A file record of any version as this version writes it (a version 1 record's tensor sha256s dropped)."""
    tensors = {name: {"shape": t["shape"], "dtype": t["dtype"]} for name, t in record["tensors"].items()}
    return {**record, "tensors": tensors}


def _layers_record(plan: ShardPlan, rank: RankPlan) -> dict[str, Any]:
    """Fused specs per layer (I as `intermediate`, I_p as `part`, the rank's `padding`, plus I' as
    `padded_intermediate`); for --layout checkpoint only the local experts (the tensors keep the source format)."""
    mtp = {p: {"mtp": True} if lp.mtp else {} for p, lp in rank.plans.items()}  # only MTP layers say so
    if plan.layout is OutputLayout.CHECKPOINT:
        return {p: {"experts": list(s.experts), **mtp[p]} for p, s in rank.layers.items()}
    return {p: {**spec_record(s), "padded_intermediate": s.part * plan.params["tp"], **mtp[p]}
            for p, s in rank.layers.items()}


def build_manifest(plan: ShardPlan, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest: versions, source, quantization, layout, per-rank files and hashes, source account."""
    account: dict[str, Any] = {}
    for fp in plan.common:
        account.update({name: {"common": fp.path} for name in fp.tensors})
    account.update({name: {"ranks": list(ranks)} for name, ranks in plan.expert_sources.items()})
    ranks = [{"rank": r.parallel.rank, "tp_rank": r.parallel.tp_rank, "ep_rank": r.parallel.ep_rank,
              "folder": r.folder, "layers": _layers_record(plan, r),
              "files": [records[f.path] for f in r.files]} for r in plan.ranks]
    return {"schema_version": SCHEMA_VERSION, "manifest_version": MANIFEST_VERSION, "package_version": __version__,
            "params": plan.params,
            "parallel": {"tp": plan.params["tp"], "ep": plan.params["ep"], "placement": plan.params["placement"]},
            "source": plan.fingerprint, "quantization": plan.quant,
            "common": {"files": [records[f.path] for f in plan.common]}, "ranks": ranks,
            "source_tensors": dict(sorted(account.items())), "copied": list(plan.copied), **_mtp_record(plan),
            **_shared_record(plan)}


def _mtp_record(plan: ShardPlan) -> dict[str, Any]:
    """`"mtp"`: the source's MTP layers and whether they were sharded or copied to common/ (only for a source
    with MTP experts: other outputs stay as they were)."""
    if not plan.mtp_layers:
        return {}
    return {"mtp": {"layers": list(plan.mtp_layers), "sharded": plan.params["mtp"],
                    "where": "the ranks' files" if plan.params["mtp"] else "common/ (--no-mtp), unchanged"}}


def _shared_record(plan: ShardPlan) -> dict[str, Any]:
    """`"shared_experts"`: the source's shared-expert modules (its family's `SharedExperts`) and where they are:
    common/, in the source's names and format, whole (an engine that keeps them apart loads them as any common
    tensor; one that fuses them into its MoE layers reads each rank's TP slice there). Only for a source with
    some: other outputs stay as they were."""
    declared = family_of(plan.moe.family).shared
    if declared is None or not plan.moe.shared_experts:
        return {}
    common = {name for fp in plan.common for name in fp.tensors}
    modules = sorted({shared_prefix(prefix, declared.module) for prefix in plan.ranks[0].plans} &
                     {name.rsplit(".", 2)[0] for name in common})
    if not modules:
        return {}
    return {"shared_experts": {"modules": modules, "count": plan.moe.shared_experts,
                               "where": "common/, as the source holds them"}}
