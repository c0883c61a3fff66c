"""Model-level loading: find every FusedMoEExperts of a model, hook `load_state_dict`, fill them all from
a checkpoint (or a wna16-shard output) and check that every ledger is complete."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

from torch import nn

from ..errors import CompletenessError, LayoutMismatchError, format_offenders
from ..load.experts import planned
from ..load.plan import LayerPlan
from ..load.reads import load_groups
from ..load.outputs import is_presharded, rank_record, rank_specs
from ..load.presharded import read_rank
from ..load.results import LoadReport
from ..logs import rank_logger
from ..parallel.config import ParallelConfig
from ..storage.bulk import paused_gc_call
from ..storage.hub import resolve_checkpoint
from ..storage.readahead import ReadOptions
from .module import FusedMoEExperts


def experts_modules(model: nn.Module) -> dict[str, FusedMoEExperts]:
    """Every FusedMoEExperts of `model`, by experts prefix (error when a prefix repeats)."""
    found: dict[str, FusedMoEExperts] = {}
    for path, module in model.named_modules():
        if isinstance(module, FusedMoEExperts):
            if module.prefix in found:
                raise LayoutMismatchError(f"{path}: a second FusedMoEExperts for experts prefix {module.prefix!r}; "
                                          f"each layer needs one module with its own prefix.")
            found[module.prefix] = module
    return found


SYNC_HOOK = "_wna16_sync_hook"  # the handle of the model's post-hook that synchronises once per load_state_dict


def install_load_hook(model: nn.Module) -> list[FusedMoEExperts]:
    """Let `model.load_state_dict(sd, strict=False)` take per-expert checkpoint names.

    Afterwards keys like `model.layers.0.mlp.experts.3.gate_proj.qweight` fill the
    fused parameters through the weight loader, and the returned missing/unexpected
    keys name checkpoint tensors: missing = this rank's slots still unfilled,
    unexpected = keys no parameter takes. Tensors of non-local experts are consumed. The model
    synchronises the experts' devices once, after the whole state dict is in.
    """
    modules = list(experts_modules(model).values())
    if not modules:
        raise CompletenessError(f"{type(model).__name__}: no FusedMoEExperts modules to hook; build them first.")
    for module in modules:
        module.install_load_hook()
    if not isinstance(model, FusedMoEExperts) and SYNC_HOOK not in model.__dict__:  # its own hook syncs a module
        model.__dict__[SYNC_HOOK] = model.register_load_state_dict_post_hook(
            lambda root, _: synchronize(experts_modules(root).values()))
    return modules


def check_model_complete(model: nn.Module) -> None:
    """Check every FusedMoEExperts ledger after an engine-driven load; one summary log line per rank."""
    modules = list(experts_modules(model).values())
    synchronize(modules)
    problems = [item for module in modules for item in module.ledger_report()]
    if problems:
        raise CompletenessError(f"the expert load is incomplete or inconsistent: {len(problems)} problems\n"
                                f"{format_offenders(problems)}")
    if modules:
        written = sum(m.hook.bytes_written for m in modules)
        rank_logger(modules[0].parallel).info(
            "complete: %d layers, %d local experts, %d tensors taken, %.1f MiB written", len(modules),
            sum(len(m.spec.experts) for m in modules), sum(m.hook.tensors for m in modules), written / 2**20)


def load_model_experts(model: nn.Module, checkpoint_folder: str | Path, parallel: ParallelConfig, *,
                       revision: str | None = None, include_mtp: bool = False,
                       reads: ReadOptions = ReadOptions()) -> LoadReport:
    """Fill every FusedMoEExperts of `model` with `parallel`'s share of the checkpoint.

    The same plan and slice reads as `load_experts`: non-local experts are never
    read, each local projection is read as the slice covering the rank's columns
    and written straight into the module's parameters. Every module's ledger must
    end complete; call `reset_load()` on the modules to load them a second time.
    `checkpoint_folder` may be a Hugging Face repo id (`org/name`, at `revision`): see `hub.resolve_checkpoint`.
    MTP layers are loaded only with `include_mtp=True` (then the model needs a FusedMoEExperts for each, by
    its experts prefix, e.g. `mtp.layers.0.mlp.experts`); by default they are left to the engine.
    `reads`: as `load_experts`' (with `node=`, the ranks of this machine read the checkpoint together).
    """
    start = time.perf_counter()
    checkpoint_folder = resolve_checkpoint(checkpoint_folder, revision=revision, rank=parallel.rank)
    modules = experts_modules(model)
    _check_parallel(modules, parallel)
    _check_not_loaded(modules)
    if is_presharded(checkpoint_folder):
        return _load_presharded_into(modules, checkpoint_folder, parallel, include_mtp)
    return _load_checkpoint_into(modules, checkpoint_folder, parallel, include_mtp, start, reads)


@paused_gc_call  # the index, scan and plans are freed before the GC is back on: see storage/bulk.py
def _load_checkpoint_into(modules: dict[str, FusedMoEExperts], folder: Path, parallel: ParallelConfig,
                          include_mtp: bool, start: float, reads: ReadOptions) -> LoadReport:
    """`load_model_experts` of a checkpoint folder (not pre-sharded), each layer's bytes read ahead."""
    with planned(folder, parallel, include_mtp=include_mtp) as (moe, index, scan, plans):
        _check_coverage(modules, plans)
        before = {prefix: (m.hook.tensors, m.hook.bytes_written) for prefix, m in modules.items()}
        own, together = load_groups(index, moe, parallel, scan, plans, reads)
        with index.reading_ahead(own, reads, node_windows=together, node_cold=True) as ahead:
            for number, plan in enumerate(plans):
                ahead.start(number)
                modules[plan.prefix].load_plan(index, plan)
            synchronize(modules.values())
        for module in modules.values():
            module.check_complete()
        report = LoadReport.of(plans, scan, tensors=sum(m.hook.tensors - before[p][0] for p, m in modules.items()),
                               bytes_read=index.bytes_read, start=start,
                               bytes_written=sum(m.hook.bytes_written - before[p][1] for p, m in modules.items()))
    rank_logger(parallel).info("loaded into the model: %s", report)
    return report


def _load_presharded_into(modules: dict[str, FusedMoEExperts], folder: str | Path,
                          parallel: ParallelConfig, include_mtp: bool) -> LoadReport:
    """Fill the modules from a wna16-shard output, layer by layer: each fused tensor is copied from the rank
    file's mapping into its parameter (nothing of the rank is held in host memory besides one tensor)."""
    start = time.perf_counter()
    rank = rank_record(folder, parallel, include_mtp=include_mtp)
    specs = rank_specs(rank, include_mtp=include_mtp)
    problems = [f"output layer {p} has no FusedMoEExperts in the model" for p in sorted(set(specs) - set(modules))]
    problems += [f"module {p} is not in the pre-sharded output" for p in sorted(set(modules) - set(specs))]
    if problems:
        raise CompletenessError(f"{folder}: the model's FusedMoEExperts and the output's MoE layers differ:\n"
                                f"{format_offenders(problems)}")
    tensors, nbytes = read_rank(folder, rank)
    for prefix, spec in specs.items():
        modules[prefix].load_fused(spec, tensors, source=str(folder))
    synchronize(modules.values())
    for module in modules.values():
        module.check_complete()
    report = LoadReport(layers=len(specs), experts=sum(len(s.experts) for s in specs.values()), tensors=len(tensors),
                        bytes_read=nbytes, bytes_written=nbytes, seconds=time.perf_counter() - start)
    rank_logger(parallel).info("loaded pre-sharded output into the model: %s", report)
    return report


def synchronize(modules: Iterable[FusedMoEExperts]) -> None:
    """Wait once for the device work queued by loads into `modules` (once per device they live on)."""
    for module in {str(m.expert_ids.device): m for m in modules}.values():
        module.synchronize()


def _check_not_loaded(modules: dict[str, FusedMoEExperts]) -> None:
    """A module that already holds a load would get every slot twice: one line saying so, and the fix."""
    loaded = [prefix for prefix, m in modules.items() if m.ledger.written]
    if loaded:
        more = f" and {len(loaded) - 1} more" if len(loaded) > 1 else ""
        raise CompletenessError(f"{len(loaded)} of {len(modules)} FusedMoEExperts already hold a load ({loaded[0]}"
                                f"{more}); loading again would write every slot twice. Call reset_load() on each "
                                f"module first (for m in model.modules(): if isinstance(m, FusedMoEExperts): "
                                f"m.reset_load()), then load.")


def _check_parallel(modules: dict[str, FusedMoEExperts], parallel: ParallelConfig) -> None:
    wrong = [f"{prefix}: {m.parallel}" for prefix, m in modules.items() if m.parallel != parallel]
    if wrong:
        raise LayoutMismatchError(f"FusedMoEExperts built for another parallel layout than {parallel}:\n"
                                  f"{format_offenders(wrong)}\nBuild every module with the ParallelConfig you load.")


def _check_coverage(modules: dict[str, FusedMoEExperts], plans: list[LayerPlan]) -> None:
    planned = {plan.prefix for plan in plans}
    problems = [f"checkpoint layer {p} has no FusedMoEExperts in the model" for p in sorted(planned - set(modules))]
    problems += [f"module {p} has no expert tensors in the checkpoint" for p in sorted(set(modules) - planned)]
    if problems:
        raise CompletenessError(f"the model's FusedMoEExperts and the checkpoint's MoE layers differ:\n"
                                f"{format_offenders(problems)}")
