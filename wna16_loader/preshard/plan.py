"""The pre-shard plan, from headers only: which tensors each rank's files hold, file size caps, the source
fingerprint and the small files copied along."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CompletenessError, PreshardError, format_offenders, format_ranges
from ..load.fused import FusedSpec
from ..load.ledger import Ledger
from ..load.plan import LayerPlan, plan_layers
from ..load.outputs import MANIFEST_NAME, PLAN_NAME, SCHEMA_VERSION, OutputLayout
from ..load.scan import CheckpointScan
from ..load.specs import warn_reduced_groups_by_spec
from ..load.tables import LayerTables
from ..logs import log
from ..models.config import MoEConfig, read_config_files
from ..parallel.config import ParallelConfig
from ..parallel.partition import valid_tp_sizes
from ..storage.bulk import gc_paused
from ..storage.index import INDEX_FILE, PICKLE_SUFFIXES, CheckpointIndex, nbytes_of
from .slices import SlicedTensor, slice_layer

COMMON_DIR = "common"


HEADER_BYTES_PER_TENSOR = 256  # safetensors JSON header estimate per tensor, for the file-size cap


COPY_LIMIT = 64 * 2**20  # non-safetensors files up to this size are copied to OUT


LAYOUTS = tuple(layout.value for layout in OutputLayout)  # ("fused", "checkpoint"): the --layout choices


def layout_of(layout: str | OutputLayout) -> OutputLayout:
    """The `layout=` argument of the public calls (a member, or its value: "fused", "checkpoint") as an
    OutputLayout; anything else raises PreshardError naming the accepted values."""
    try:
        return OutputLayout(layout)
    except ValueError:
        raise PreshardError(f"layout={layout!r}: unknown; use one of {list(LAYOUTS)}.") from None


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
    """One rank's parallel config, layer plans and output files (and, for --layout checkpoint,
    the sliced source tensors of every file, by name)."""

    parallel: ParallelConfig
    plans: dict[str, LayerPlan]
    files: tuple[FilePlan, ...]
    sliced: dict[str, SlicedTensor] = field(default_factory=dict)

    @property
    def layers(self) -> dict[str, FusedSpec]:
        """experts prefix -> the rank's fused layout of that layer."""
        return {prefix: plan.fused for prefix, plan in self.plans.items()}

    @property
    def folder(self) -> str:
        """rank-{r:05d}-of-{W:05d}."""
        return rank_folder(self.parallel.rank, self.parallel.world_size)


@dataclass(frozen=True)
class ShardPlan:
    """Everything a pre-shard run will write, computed from headers only."""

    source: Path
    moe: MoEConfig
    params: dict[str, Any]
    fingerprint: dict[str, Any]
    quant: dict[str, Any]
    ranks: tuple[RankPlan, ...]
    common: tuple[FilePlan, ...]
    expert_sources: dict[str, tuple[int, ...]]  # source tensor -> ranks whose fused tensors it feeds
    copied: tuple[str, ...]
    mtp_layers: tuple[str, ...] = ()  # the source's MTP experts prefixes (sharded when params["mtp"], else in common/)

    @property
    def layout(self) -> OutputLayout:
        """What the rank files hold (`params["layout"]`, the manifest's plain string, as an OutputLayout)."""
        return OutputLayout(self.params["layout"])

    def all_files(self) -> list[FilePlan]:
        """Common files first, then every rank's, in rank order."""
        return list(self.common) + [f for rank in self.ranks for f in rank.files]


@dataclass(frozen=True)
class Padding:
    """How I is padded at the plan's TP size in some layers: I, I_p' (columns per TP rank) and each TP rank's
    padding columns (the last ones of its slice); `empty` are the TP ranks holding padding only."""

    intermediate: int
    part: int
    layers: tuple[str, ...]
    per_tp_rank: tuple[int, ...]

    @property
    def empty(self) -> list[int]:
        """TP ranks whose columns are all padding."""
        return [t for t, pad in enumerate(self.per_tp_rank) if pad == self.part]


def paddings(plan: ShardPlan) -> list[Padding]:
    """Every distinct padding of I in the plan (none when tp divides I into valid groups everywhere)."""
    tp = plan.params["tp"]
    found: dict[tuple[int, int], tuple[dict[str, None], dict[int, int]]] = {}
    for rank in plan.ranks:
        for prefix, spec in rank.layers.items():
            if spec.part * tp > spec.intermediate:
                layers, pads = found.setdefault((spec.intermediate, spec.part), ({}, {}))
                layers[prefix] = None  # an ordered set
                pads[rank.parallel.tp_rank] = spec.padding
    return [Padding(i, part, tuple(layers), tuple(pads.get(t, 0) for t in range(tp)))
            for (i, part), (layers, pads) in found.items()]


def warn_padding(plan: ShardPlan) -> None:
    """One warning when some TP ranks hold nothing but padding: their memory and compute are spent on zeros.
    Names them and the TP sizes that need no padding."""
    q, tp = plan.moe.quant, plan.params["tp"]
    for pad in paddings(plan):
        if pad.empty:
            unpadded = valid_tp_sizes(plan.moe.hidden_size, pad.intermediate, q.bits, q.group_size, q.act_order,
                                      allow_padding=False)
            log.warning("tp=%d: I = %d is padded to I' = %d (%d columns per TP rank) in %d layer(s): TP ranks %s hold "
                        "only padding (their experts are all zeros: memory and compute spent on nothing). TP sizes "
                        "that need no padding: %s.", tp, pad.intermediate, pad.part * tp, pad.part, len(pad.layers),
                        format_ranges(pad.empty), unpadded)


def rank_folder(rank: int, world: int) -> str:
    """The folder name of global rank `rank` in a `world`-rank layout."""
    return f"rank-{rank:05d}-of-{world:05d}"


def make_plan(src: str | Path, *, tp_size: int, ep_size: int = 1, placement: str = "linear",
              max_file_size: int = 4 * 2**30, layout: str | OutputLayout = OutputLayout.FUSED, mtp: bool = True,
              warn: bool = True) -> ShardPlan:
    """Plan a pre-shard of `src`: files, tensors and bytes per rank; nothing is read but headers.
    `mtp`: shard the MTP layers' experts like the others (else their tensors go to common/ unchanged; a
    source without MTP experts is planned, and recorded, exactly as before).

    `layout`: an OutputLayout or its value ("fused", "checkpoint"; PreshardError for any other). Layout
    checkpoint raises PreshardError here, before anything is written, when a rank's cut does not
    fall on word and group boundaries. warn: log the reduced-group-size warning (once per run: a
    rank-parallel run's other processes plan with warn=False).
    """
    src = check_source_folder(src)
    for flag, size in (("--tp", tp_size), ("--ep", ep_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise PreshardError(f"{flag} must be >= 1, got {size!r}; e.g. {flag} 2.")
    if max_file_size < 1:
        raise PreshardError(f"max_file_size={max_file_size}: must be a positive number of bytes, e.g. 4GB.")
    layout = layout_of(layout)
    placement = ParallelConfig(1, 0, expert_placement=placement).expert_placement.value
    moe = read_config_files(src)
    with CheckpointIndex(src) as index:
        scan = CheckpointScan.of(index)
        mtp_layers = scan.mtp_prefixes(moe.mtp)
        scan = scan if mtp else scan.without(mtp_layers)
        ranks, expert_sources = _plan_ranks(index, moe, scan, (tp_size, ep_size, placement), max_file_size, layout)
        common_sizes = {name: index.refs[name].nbytes for name in scan.others}
        _check_account(index, scan, expert_sources)
        fingerprint = source_fingerprint(src, index.files)
    params = {"layout": layout.value, "tp": tp_size, "ep": ep_size, "placement": placement,
              "max_file_size": max_file_size, "schema_version": SCHEMA_VERSION, **({"mtp": mtp} if mtp_layers else {})}
    quant = _quant_summary(moe, ranks)
    plan = ShardPlan(source=src, moe=moe, params=params, fingerprint=fingerprint, quant=quant,
                     ranks=ranks, common=split_files(COMMON_DIR, common_sizes, max_file_size),
                     expert_sources=expert_sources, copied=_copied_files(src), mtp_layers=mtp_layers)
    if warn:
        warn_plan(plan)
    return plan


def warn_plan(plan: ShardPlan) -> None:
    """The plan's warnings (a reduced group size, TP ranks holding only padding): logged by the run that writes."""
    warn_reduced_groups_by_spec(log, tp_size=plan.params["tp"], intermediate=plan.moe.intermediate_size, effective={
        prefix: (p.moe.quant.group_size, p.fused.group_size) for prefix, p in plan.ranks[0].plans.items()})
    warn_padding(plan)


def check_source_folder(src: str | Path) -> Path:
    """`src` as a Path when it is a folder; else a CheckpointError naming what it is."""
    src = Path(src)
    if not src.is_dir():
        what = "a file, not a folder" if src.exists() else "no such folder"
        hint = f" (use its folder, {src.parent})" if src.is_file() else ""
        raise CheckpointError(f"{src}: {what}; SRC must be the checkpoint folder holding config.json and the "
                              f"*.safetensors files{hint}.")
    if (src / MANIFEST_NAME).is_file() or (src / PLAN_NAME).is_file():
        raise CheckpointError(f"{src}: this is a wna16-shard output, not a checkpoint: load it (load_experts("
                              f"{str(src)!r}, ParallelConfig.from_manifest({str(src)!r}, rank=R))) or verify it "
                              f"(wna16-shard verify {src}); to shard again, pass the original checkpoint as SRC.")
    return src


def _plan_ranks(index: CheckpointIndex, moe: MoEConfig, scan: CheckpointScan, grid: tuple[int, int, str],
                max_file_size: int, layout: OutputLayout) -> tuple[tuple[RankPlan, ...], dict[str, tuple[int, ...]]]:
    """Plan every rank with plan_layers (sharing one LayerTables: what does not depend on the rank is
    worked out once); note which source tensors feed which ranks."""
    ranks = []
    feeds: dict[int, tuple[dict, list[int]]] = {}  # id of a source's tensors dict -> (that dict, ranks)
    tp, ep, placement = grid
    tables = LayerTables(index, moe)
    with gc_paused():  # every rank's plans, files and feeds: see bulk.py
        for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep, expert_placement=placement):
            ranks.append(_plan_rank(index, moe, scan, tables, parallel, feeds, max_file_size, layout))
        expert_sources = {ref.name: tuple(fed) for tensors, fed in feeds.values() for ref in tensors.values()}
    return tuple(ranks), dict(sorted(expert_sources.items()))


def _plan_rank(index: CheckpointIndex, moe: MoEConfig, scan: CheckpointScan, tables: LayerTables,
               parallel: ParallelConfig, feeds: dict[int, tuple[dict, list[int]]], max_file_size: int,
               layout: OutputLayout) -> RankPlan:
    """One rank's plan (its ledger checked) and files; the tensors it reads noted in `feeds`."""
    ledger = Ledger()
    plans = plan_layers(index, moe, parallel, ledger, scan, tables)
    ledger.check()
    sizes: dict[str, int] = {}
    sliced: dict[str, SlicedTensor] = {}
    for plan in plans:
        if layout is OutputLayout.CHECKPOINT:
            sliced.update(slice_layer(plan.moe.quant, plan))
        else:
            sizes.update({f"{plan.prefix}.{name}": nbytes_of(shape, dtype)
                          for name, (shape, dtype) in plan.fused.shapes().items()})
        _note_feeds(feeds, plan, parallel.rank)
    sizes.update({name: t.nbytes for name, t in sliced.items()})
    folder = rank_folder(parallel.rank, parallel.world_size)
    return RankPlan(parallel, {p.prefix: p for p in plans}, split_files(folder, sizes, max_file_size), sliced)


def _note_feeds(feeds: dict[int, tuple[dict, list[int]]], plan: LayerPlan, rank: int) -> None:
    """Note that the tensors of every source of `plan` feed `rank` (ranks come in increasing order). Sources
    are noted by their tensors dict, which the plans of all ranks share (a stacked tensor's, every row's)."""
    for src in plan.sources.values():
        _, fed = feeds.setdefault(id(src.tensors), (src.tensors, []))
        if not fed or fed[-1] != rank:
            fed.append(rank)


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
    """Name, size and sha256 of the header (first 8 + N bytes) of every source safetensors file, the sha256 of
    config.json, and the folder's absolute path (said, never compared: a source may move)."""
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
    return {"files": entries, "config_sha256": config_hash, "path": str(src.resolve())}


def changed_files(recorded: dict[str, Any],
                  current: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """A recorded source fingerprint's file entries and the current one's, by name, and the names (sorted) whose
    entries differ or that only one side has."""
    old = {e["name"]: e for e in recorded.get("files", [])}
    new = {e["name"]: e for e in current["files"]}
    return old, new, [name for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]


def fingerprint_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between a recorded source fingerprint and the source's current one, file by file."""
    old, new, names = changed_files(recorded, current)
    diffs = [f"source file {name}: written {old.get(name)}, now {new.get(name)}" for name in names]
    if recorded.get("config_sha256") != current["config_sha256"]:
        diffs.append("source config.json changed since the output was written")
    return diffs


def source_change(recorded: dict[str, Any], current: dict[str, Any]) -> tuple[str, str] | None:
    """(the recorded source, the current one) in words, over what differs between them, e.g.
    `model.safetensors (483288 bytes, header sha256 004e9a4ab7c8)`; None when nothing differs."""
    old, new, names = changed_files(recorded, current)
    config = recorded.get("config_sha256") != current["config_sha256"]
    if not names and not config:
        return None

    def words(files: dict[str, Any], config_sha: str | None) -> str:  # the side's own files among those that differ
        present = [n for n in names if n in files]
        parts = [f"{n} ({files[n]['size']} bytes, header sha256 {files[n]['header_sha256'][:12]})" for n in present[:2]]
        parts += [f"and {len(present) - 2} more"] if len(present) > 2 else []
        parts += [f"config.json sha256 {str(config_sha)[:12]}"] if config else []
        return ", ".join(parts) or f"no {', '.join(names[:2])}"
    return words(old, recorded.get("config_sha256")), words(new, current["config_sha256"])


def _quant_summary(moe: MoEConfig, ranks: tuple[RankPlan, ...]) -> dict[str, Any]:
    """The manifest's `quantization`: the top-level spec, G_eff per layer, and, only when some layer has a spec of
    its own, `layers`: each layer's spec and the rule it came from."""
    q = moe.quant
    summary = {"format": q.format_name, "bits": q.bits, "group_size": q.group_size, "sym": q.symmetric,
               "act_order": q.act_order, "checkpoint_format": q.checkpoint_format,
               "group_size_eff": {prefix: spec.group_size if spec.quantized else spec.group_label
                                  for prefix, spec in ranks[0].layers.items()}}  # float layers: "float bf16"
    plans = ranks[0].plans
    if any(plan.moe.quant != q for plan in plans.values()):
        summary["layers"] = {prefix: spec_summary(plan) for prefix, plan in plans.items()}
    return summary


def spec_summary(plan: LayerPlan) -> dict[str, Any]:
    """One layer's spec as the manifest records it."""
    q = plan.moe.quant
    return {"quantized": q.quantized, "format": q.format_name, "bits": q.bits, "group_size": q.group_size,
            "sym": q.symmetric, "act_order": q.act_order, "checkpoint_format": q.checkpoint_format,
            "spec": q.describe(), "rule": plan.spec.rule, **({"found": plan.spec.found} if plan.spec.found else {})}


def _copied_files(src: Path) -> tuple[str, ...]:
    """Small top-level non-weight files (config.json, generation_config.json, tokenizer*, ...)."""
    keep = []
    for path in sorted(src.iterdir()):
        skip = path.suffix == ".safetensors" or path.name == INDEX_FILE or path.suffix in PICKLE_SUFFIXES
        if path.is_file() and not skip and path.stat().st_size <= COPY_LIMIT:
            keep.append(path.name)
    return tuple(keep)


def plan_record(plan: ShardPlan) -> dict[str, Any]:
    """What .wna16-plan.json holds: parameters, source fingerprint and the planned files."""
    return {"schema_version": SCHEMA_VERSION, "params": plan.params, "source": plan.fingerprint,
            "files": {f.path: list(f.tensors) for f in plan.all_files()}}
