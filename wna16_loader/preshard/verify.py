"""Verifying a pre-shard output: every file against its manifest sha256 (one digest per byte) and, with the
source, every tensor against the source: common bytes, and every rank tensor's bytes against a fresh
conversion of the source by the writer's own path (one layer at a time: about the cost of writing); optionally
(`reassemble=True`) the fused experts dequantised and stitched over TP against a TP 1 load."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import CheckpointError, WNA16Error
from ..load.experts import load_experts
from ..load.fused import FusedExperts
from ..load.outputs import OutputLayout, output_layout, read_manifest, rerun_command
from ..load.presharded import load_presharded
from ..parallel.config import ParallelConfig
from ..storage.index import CheckpointIndex
from ..storage.readahead import byte_view
from .manifest import tensor_record
from .plan import fingerprint_differences, make_plan, source_fingerprint
from .progress import human_size
from .safefiles import sha256_file
from .writing import TensorSource, tensor_source


@dataclass(frozen=True)
class VerifyReport:
    """What a verification checked and every problem it found.

    files, tensors, nbytes: the files checked against the manifest's sha256s; experts: (layer, expert) pairs
    compared with the source (0 without a source); common: common tensors compared byte for byte.
    """

    out: Path
    layout: OutputLayout
    files: int
    tensors: int
    nbytes: int
    experts: int = 0
    layers: int = 0
    common: int = 0
    source: Path | None = None
    problems: tuple[str, ...] = ()
    reassembled: bool = False  # the fused experts were also dequantised and stitched over TP

    def text(self) -> str:
        """One line saying what was checked, e.g. `ok: 18 files (1.2 MiB on disk, 42 tensors) match the manifest's
        sha256`."""
        line = (f"{self.out}: ok: {self.files} files ({human_size(self.nbytes)} on disk, {self.tensors} tensors) "
                f"match the manifest's sha256")
        if self.source is not None:
            how = "converted afresh from" if self.layout is OutputLayout.FUSED else "sliced afresh from"
            line += (f"; {self.experts} experts in {self.layers} layer(s) equal their tensors {how} {self.source}"
                     f"{' and reassemble over TP exactly' if self.reassembled else ''}, {self.common} common "
                     f"tensors byte-identical")
        return line


def verify_output(out: str | Path, source: str | Path | None = None) -> list[str]:
    """Every problem with a pre-shard output: missing files, files whose sha256 differs from the manifest's;
    with `source`, also each rank tensor that differs from a fresh conversion (named), expert weights that do
    not reassemble exactly and common tensors that differ from the source.
    An unreadable output or a source it was not written from is one problem."""
    try:
        return list(verify_report(out, source).problems)
    except WNA16Error as exc:
        return [str(exc)]


def verify_report(out: str | Path, source: str | Path | None = None, *, reassemble: bool = False) -> VerifyReport:
    """verify_output's checks and what they covered. Raises CheckpointError when `out` is not a finished
    wna16-shard output, or when `source` is not the checkpoint it was written from: its fingerprint (file
    sizes and headers, config.json) differs from the recorded one (checked before any tensor is compared),
    or a common tensor differs from the source's. reassemble: also dequantise every rank's fused experts and
    compare them, stitched over TP, with a TP 1 load of the source (float32 of the whole model: slow)."""
    out = Path(out)
    manifest = read_manifest(out)
    if source is not None:
        check_source_matches(out, manifest, Path(source))
    common, ranks = manifest["common"]["files"], [rec for rank in manifest["ranks"] for rec in rank["files"]]
    records = common + ranks
    fix = rerun_command(out, manifest)
    common_problems = [p for rec in common for p in _verify_file(out, rec, fix)]
    problems = common_problems + [p for rec in ranks for p in _verify_file(out, rec, fix)]
    layout = output_layout(out, manifest)
    report = VerifyReport(out, layout, len(records), sum(len(rec["tensors"]) for rec in records),
                          sum((out / rec["path"]).stat().st_size for rec in records if (out / rec["path"]).is_file()))
    if source is None:
        return replace(report, problems=tuple(problems))
    if not common_problems:  # (a damaged common/ file is named above, not blamed on SRC)
        _check_common(out, manifest, Path(source))
    problems += verify_mtp(manifest)
    problems += _verify_converted(out, manifest, Path(source))
    reassemble = reassemble and layout is OutputLayout.FUSED
    if reassemble and not problems:
        problems += _verify_experts(out, manifest, Path(source))
    experts = {p: set() for rank in manifest["ranks"] for p in rank["layers"]}
    for rank in manifest["ranks"]:
        for prefix, rec in rank["layers"].items():
            experts[prefix].update(rec["experts"])
    return replace(report, source=Path(source), problems=tuple(problems), layers=len(experts), reassembled=reassemble,
                 experts=sum(len(e) for e in experts.values()),
                 common=sum(len(rec["tensors"]) for rec in manifest["common"]["files"]))


def check_source_matches(out: Path, manifest: dict[str, Any], source: Path) -> None:
    """The source's fingerprint (file names, sizes, header hashes, config.json) must be the recorded one."""
    if not source.is_dir():
        raise CheckpointError(f"--source {source}: no such folder; pass the checkpoint folder {out} was "
                              f"written from.")
    with CheckpointIndex(source) as index:
        current = source_fingerprint(source, index.files)
    diffs = fingerprint_differences(manifest.get("source", {}), current)
    if diffs:
        more = f" (and {len(diffs) - 2} more)" if len(diffs) > 2 else ""
        raise CheckpointError(f"--source {source} is not the checkpoint {out} was written from: "
                              f"{'; '.join(diffs[:2])}{more}. Pass {_original(manifest)}, or re-shard.")


def _original(manifest: dict[str, Any]) -> str:
    """The source folder the manifest records, in words (`the original source folder` for an older one)."""
    path = manifest.get("source", {}).get("path")
    return "the original source folder" if path is None else f"the original source folder {path}"


def _verify_file(out: Path, rec: dict[str, Any], fix: str) -> list[str]:
    """The file is there and its sha256 is the manifest's (the file is named; `verify --source` names the tensor);
    `fix`: the command that wrote OUT, which rewrites exactly the damaged files when run again."""
    path = out / rec["path"]
    if not path.is_file():
        return [f"{rec['path']}: missing; `{fix}` rewrites it (and only the damaged files)"]
    if sha256_file(path) == rec["sha256"]:
        return []
    return [f"{rec['path']}: sha256 differs from the manifest (`wna16-shard verify OUT --source SRC` names the tensors "
            f"that differ); `{fix}` rewrites it (and only the damaged files)"]


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaNs and signed zeros compared as bytes, not as numbers)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(*(byte_view(t.detach().cpu().contiguous()) for t in (a, b)))


def _check_common(out: Path, manifest: dict[str, Any], source: Path) -> None:
    """Every common/ tensor must equal the source's, byte for byte. Called once every output file matches its
    manifest hash, so a difference means the source is not the checkpoint that was written: one error."""
    differ = []
    with CheckpointIndex(source) as index:
        for rec in manifest["common"]["files"]:
            with safe_open(str(out / rec["path"]), framework="pt") as handle:
                for name in handle.keys():
                    ref = index.refs.get(name)
                    if ref is None or not same_tensor(index.read(ref), handle.get_tensor(name)):
                        differ.append(name)
    if differ:
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise CheckpointError(f"--source {source} is not the checkpoint {out} was written from: tensor {differ[0]} "
                              f"differs from its copy in common/{more}. Pass {_original(manifest)}, or re-shard.")


def _verify_converted(out: Path, manifest: dict[str, Any], source: Path) -> list[str]:
    """Every rank tensor equals, byte for byte, the one the writer makes from the source now (fused layers
    through the loader's per-layer path, one at a time, or --layout checkpoint slices), and its manifest
    record (shape, dtype) is that tensor's. The files were checked against the manifest's sha256s already."""
    p = manifest["params"]
    plan = make_plan(source, tp_size=p["tp"], ep_size=p["ep"], placement=p["placement"],
                     max_file_size=p["max_file_size"], layout=output_layout(out, manifest), mtp=p.get("mtp", True),
                     warn=False)
    made = "slice" if plan.layout is OutputLayout.CHECKPOINT else "conversion"
    fix = f"`{rerun_command(out, manifest)}` rewrites it"
    problems = []
    with CheckpointIndex(source) as index:
        for rank, rec in zip(plan.ranks, manifest["ranks"]):
            fresh = tensor_source(plan, rank, index)
            for file_rec in rec["files"]:
                problems += _differing_tensors(out, file_rec, fresh, made, fix)
    return problems


def _differing_tensors(out: Path, file_rec: dict[str, Any], fresh: TensorSource, made: str, fix: str) -> list[str]:
    """A problem naming each tensor of one output file that differs from its fresh make (none for a missing
    file, which the file check names); `fix` says how to rewrite the file."""
    path = out / file_rec["path"]
    if not path.is_file():
        return []
    try:
        opened = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own types for corrupt files
        return [f"{file_rec['path']}: unreadable ({exc}); {fix}"]
    with opened as handle:
        held = set(handle.keys())
        return [f"{file_rec['path']}: tensor {name} differs from a fresh {made} of the source; {fix}"
                for name, want in file_rec["tensors"].items()
                if name not in held or not _matches_fresh(fresh, name, want, handle)]


def _matches_fresh(source: TensorSource, name: str, want: dict[str, Any], handle: Any) -> bool:
    """Whether tensor `name` of the open output file `handle` equals its fresh make, which `want` describes."""
    try:
        made = source.fetch(name)
    except KeyError:  # the plan has no such tensor
        return False
    described = tensor_record(tuple(made.shape), made.dtype) == {"shape": want["shape"], "dtype": want["dtype"]}
    return described and same_tensor(made, handle.get_tensor(name))


def _verify_experts(out: Path, manifest: dict[str, Any], source: Path) -> list[str]:
    """Stitch every rank's dequantised experts over TP and compare with a tp=1 ep=1 load of the source."""
    par, mtp = manifest["parallel"], manifest["params"].get("mtp", False)
    reference = load_experts(source, ParallelConfig(1, 0), include_mtp=mtp)
    loads = {r.rank: load_presharded(out, r, include_mtp=mtp) for r in ParallelConfig.all_ranks(
        tp_size=par["tp"], ep_size=par["ep"], expert_placement=par["placement"])}
    problems = []
    for prefix, ref_layer in reference.items():
        ref = ref_layer.dequantize()
        for ep_rank in range(par["ep"]):
            ranks = [loads[ep_rank * par["tp"] + t] for t in range(par["tp"])]
            problems += _compare_stitched(prefix, ep_rank, [r[prefix] for r in ranks], ref_layer, ref)
    return problems


def verify_mtp(manifest: dict[str, Any]) -> list[str]:
    """The MTP layers the manifest records are where it says: every rank holds each as a layer marked
    `"mtp": true` when sharded, none of them when copied to common/ (where `_check_common` compares them)."""
    record = manifest.get("mtp")
    if record is None:
        return []
    wanted = set(record["layers"]) if record["sharded"] else set()
    problems = []
    for rank in manifest["ranks"]:
        found = {p for p, rec in rank["layers"].items() if rec.get("mtp", False)}
        if found != wanted:
            problems.append(f"rank {rank['rank']}: MTP layers {sorted(found)} in its files, but the manifest "
                            f"records {sorted(record['layers'])} as {record['where']}; re-shard the source")
    return problems


def _compare_stitched(prefix: str, ep_rank: int, layers: list[FusedExperts], ref_layer: FusedExperts,
                      ref: Any) -> list[str]:
    """The real columns of the TP ranks stitched together equal the reference; padding is exactly 0."""
    deq = [layer.dequantize() for layer in layers]
    part, halves = layers[0].spec.part, len(layers[0].spec.projections) - 1  # gate and up, or up only
    real = [layer.spec.real for layer in layers]
    w13 = torch.cat([torch.cat([d.w13[:, h * part:h * part + r] for d, r in zip(deq, real)], dim=1)
                     for h in range(halves)], dim=1)
    w2 = torch.cat([d.w2[:, :, :r] for d, r in zip(deq, real)], dim=2)
    index = [list(ref_layer.spec.experts).index(e) for e in layers[0].spec.experts]
    problems = [f"{prefix}: ep rank {ep_rank} tp rank {t}: the {layer.padding} padding columns do not dequantise to "
                f"exactly 0; re-shard the source" for t, (layer, d, r) in enumerate(zip(layers, deq, real))
                if any(d.w13[:, h * part + r:(h + 1) * part].any() for h in range(halves)) or d.w2[:, :, r:].any()]
    if not torch.equal(w13, ref.w13[index]):
        problems.append(f"{prefix}: ep rank {ep_rank}: w13 does not reassemble to the source's dequantised weights")
    if not torch.equal(w2, ref.w2[index]):
        problems.append(f"{prefix}: ep rank {ep_rank}: w2 does not reassemble to the source's dequantised weights")
    return problems
