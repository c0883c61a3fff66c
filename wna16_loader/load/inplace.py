"""Fill an engine's own MoE parameters in place, a layer at a time, in the layout its MoE method declares
(`layouts.MethodLayout`): no second set of fused tensors.

| the layer's method layout             | how its rank's slices arrive                                          |
|---------------------------------------|-----------------------------------------------------------------------|
| `fused_as_is` (moe_wna16, unquantized) | written straight into the engine's parameters (they are the staging) |
| every parameter the checkpoint's own storage (auto_gptq of GPTQ v1, auto_awq of AWQ, ct_wna16 of pack-quantized) | each expert's checkpoint words copied into its rows (`load.direct`), from a checkpoint folder |
| any other                             | one layer's fused tensors as scratch, re-laid into the parameters `EXPERT_CHUNK` experts at a time, then freed |

Works from a checkpoint folder (each rank reads only its slices) and from a `wna16-shard --layout fused`
output (each rank reads only its own files). A re-laid layer adds one layer's fused tensors plus one
expert chunk's conversion temporaries over the parameters, a copied one nothing (scripts/bench --suite inplace
measures it). From a checkpoint folder every layer's planned byte ranges are brought into the page cache ahead
of its reads (`posix_fadvise`: no buffers of the read-ahead's own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import torch

from ..errors import ConfigError, LayoutMismatchError
from ..layouts.relayout import fill_param
from ..layouts.spec import (Half, MethodLayout, ParamDecl, Sizes, allocated_groups, allocated_shape,
                            leaves_partial_group, shape_of)
from ..models.config import MoEConfig, read_config_files
from ..parallel.config import ParallelConfig
from ..storage.bulk import paused_gc_call
from ..storage.filemap import read_into
from ..storage.index import CheckpointIndex
from ..storage.readahead import ReadOptions
from .direct import copy_direct, direct_copies, made_from_sizes
from .experts import load_layer, planned
from .fused import FusedSpec
from .plan import LayerPlan
from .reads import load_groups
from .outputs import is_presharded, rank_record, rank_specs
from .presharded import Located, checked_entry, locate_rank, read_param
from .device import DevicePolicy


@dataclass(frozen=True)
class LayerTarget:
    """An engine layer to fill: its method's layout, its parameters by name, the global expert id of each
    routed slot (ascending, as the engine placed them), and `shared_slots`: the slots after those that hold
    the family's shared experts (`families.SharedExperts`), where the engine fused them into the layer.

    | slots (dim 0 of every parameter)            | hold                                        |
    |---------------------------------------------|---------------------------------------------|
    | [0, len(experts))                           | the routed experts `experts`, in order      |
    | [len(experts), len(experts) + shared_slots) | shared expert 0, 1, ... (`shared()`)        |
    """

    layout: MethodLayout
    params: Mapping[str, torch.Tensor]
    experts: tuple[int, ...]
    shared_slots: int = 0

    def routed(self) -> "LayerTarget":
        """This layer's routed slots alone (every parameter's first len(experts) slots)."""
        return self._slots(0, len(self.experts), self.experts)

    def shared(self) -> "LayerTarget":
        """This layer's shared slots alone, as a layer whose experts are shared experts 0, 1, ..."""
        return self._slots(len(self.experts), self.shared_slots, tuple(range(self.shared_slots)))

    def _slots(self, start: int, count: int, experts: tuple[int, ...]) -> "LayerTarget":
        if not self.shared_slots:
            return self
        return LayerTarget(self.layout, {name: p[start:start + count] for name, p in self.params.items()}, experts)

    @property
    def device(self) -> torch.device:
        """Where the engine's parameters live (the first one's device)."""
        return next(iter(self.params.values())).device

    @classmethod
    def of(cls, layout: MethodLayout, layer: torch.nn.Module, local_slot: Callable[[int], int],
           experts: int, shared_slots: int = 0) -> "LayerTarget":
        """An engine `layer` filled in `layout`: its own parameters, its routed slots' experts from
        `local_slot(global expert id)` over `experts` routed ids (negative: not on this rank), which must be
        its first slots, and `shared_slots` after them."""
        slots = sorted((slot, expert) for expert in range(experts) if (slot := local_slot(expert)) >= 0)
        assert not shared_slots or [slot for slot, _ in slots] == list(range(len(slots))), \
            f"routed slots {slots} are not the first {len(slots)}: the shared slots' place is unknown"
        return cls(layout, dict(layer.named_parameters(recurse=False)), tuple(e for _, e in slots), shared_slots)


@dataclass(frozen=True)
class FillReport:
    """What `fill_layers` did: the layers filled (prefix -> method row name), the non-expert tensors it
    left for the engine (checkpoint folders only), the most scratch one layer held (bytes), and the layers
    whose checkpoint words were copied as they are (`load.direct`); `shared`: the shared-expert tensors the fill
    took into fused shared slots (`load.shared`); `window_bytes`: the shared memory a node's
    read used (0: the rank read alone); `buffer_bytes`: the memory of the rank's own read-ahead buffers."""

    layers: dict[str, str]
    ignored: tuple[str, ...]
    scratch_bytes: int
    copied: tuple[str, ...] = ()
    window_bytes: int = 0
    buffer_bytes: int = 0
    shared: tuple[str, ...] = ()  # the shared-expert tensors filled into shared slots (not the engine's to load)


def layer_sizes(spec: FusedSpec, group_size: int) -> Sizes:
    """The shape symbols of a fused layer whose checkpoint group size is `group_size` (-1 channelwise): GH, GI and
    GI_all as engines allocate them (`allocated_groups`, floor), GH_eff and GI_eff the fused layer's (ceil)."""
    return Sizes(E=len(spec.experts), N13=spec.w13_rows, H=spec.hidden, I=spec.intermediate, I_p=spec.part,
                 bits=spec.bits, GH=allocated_groups(spec.hidden, group_size),
                 GI=allocated_groups(spec.part, group_size), GH_eff=spec.w13_groups, GI_eff=spec.w2_groups,
                 GI_all=allocated_groups(spec.intermediate, group_size))


def fused_name(decl: ParamDecl) -> str:
    """The fused tensor a declared parameter is made from (w13_qweight, w2_scales, ...)."""
    return f"{decl.half.value}_{decl.source.value}"


def check_target(prefix: str, target: LayerTarget, spec: FusedSpec, group_size: int) -> tuple[ParamDecl, ...]:
    """The declared parameters the layer fills, after checking the engine's experts and shapes against the
    rank's fused layer (LayoutMismatchError naming every difference)."""
    if target.experts != spec.experts:
        raise LayoutMismatchError(f"{prefix}: the engine holds experts {list(target.experts)} on this rank, the "
                                  f"load places {list(spec.experts)}; use the same --expert-placement-strategy "
                                  f"and EP size as the wna16-shard output (or load the checkpoint folder)")
    if spec.quantized != target.layout.quantized:
        raise LayoutMismatchError(f"{prefix}: the engine's MoE method is {target.layout.name} but the checkpoint's "
                                  f"experts here are {'quantized' if spec.quantized else 'float'}; load it with the "
                                  f"engine's own loader (the engine and this checkpoint disagree on which layers "
                                  f"are quantized)")
    if spec.act_order and not target.layout.act_order:
        raise LayoutMismatchError(f"{prefix}: the checkpoint's experts here are act-order (g_idx orders their "
                                  f"groups) but the engine's {target.layout.name} parameters have no place for g_idx; "
                                  f"load it with the engine's own loader")
    decls, sizes = target.layout.filled(spec.has_zero_point), layer_sizes(spec, group_size)
    wrong = [f"{d.name} {list(target.params[d.name].shape)} (declared {list(d.allocated or d.shape)} = "
             f"{list(allocated_shape(d, sizes))})" for d in decls
             if d.name in target.params and tuple(target.params[d.name].shape) != allocated_shape(d, sizes)]
    missing = [d.name for d in decls if d.name not in target.params]
    if wrong or missing:
        raise LayoutMismatchError(f"{prefix}: the engine's {target.layout.name} parameters do not fit this rank's "
                                  f"layer ({sizes}): {'; '.join(wrong + [f'{m} missing' for m in missing])}; load "
                                  f"it with the engine's own loader or shard it for the engine's TP/EP sizes")
    _check_whole_groups(prefix, target.layout, decls, sizes, group_size, spec.group_size)
    _check_reduced_groups(prefix, target.layout, sizes, group_size, spec.group_size)
    return decls


def _check_reduced_groups(prefix: str, layout: MethodLayout, sizes: Sizes, group_size: int, g_eff: int) -> None:
    """Refuse a method row without `reduced_groups` (its scales hold groups of the checkpoint's G) for a layer
    written at a G_eff below G: a TP cut that G does not divide, so this rank's I_p columns are not whole groups of
    G, and a group-G parameter would give some of them another group's scale (taking every G / G_eff-th of the
    fused layer's groups keeps the first group's scale for the columns of the next)."""
    if layout.reduced_groups or not 0 < g_eff < group_size:
        return
    keep = [1] + [t for t in range(2, 65) if sizes.I % t == 0 and (sizes.I // t) % group_size == 0]
    raise LayoutMismatchError(
        f"{prefix}: the engine's {layout.name} parameters hold groups of the checkpoint's group size {group_size}, "
        f"but this rank's {sizes.I_p} columns of I {sizes.I} are not whole groups of {group_size} (the layer is "
        f"written at G_eff {g_eff}), so some columns would take another group's scale; serve it with moe_wna16 "
        f"(SGLang and vLLM: --quantization moe_wna16), which holds G_eff, or at a TP size that keeps group size "
        f"{group_size}: {keep}")


def _check_whole_groups(prefix: str, layout: MethodLayout, decls: tuple[ParamDecl, ...], sizes: Sizes,
                        group_size: int, g_eff: int) -> None:
    """Refuse a method row without `partial_groups` (its scales sized by the engine's H // G, I_p // G) for a
    layer whose G leaves a last, partial group (`leaves_partial_group`): those columns' scales would have no
    place (and where the counts divide each other, a regrouping would keep the wrong ones). A layer whose
    G_eff is below G (a TP cut) is `relayout`'s to accept or refuse."""
    if layout.partial_groups or not leaves_partial_group(group_size, g_eff, sizes.H, sizes.I_p):
        return
    stored = replace(sizes, GH=-(-sizes.H // group_size), GI=-(-sizes.I_p // group_size))
    short = [d.name for d in decls if shape_of(d, sizes) != shape_of(d, stored)]
    raise LayoutMismatchError(
        f"{prefix}: the engine's {layout.name} parameters {', '.join(short)} hold {sizes.GH} groups along H "
        f"(H {sizes.H} // G {group_size}) and {sizes.GI} along I ({sizes.I_p} // {group_size}), but the "
        f"checkpoint stores {stored.GH} and {stored.GI} (G {group_size} does not divide "
        f"{' or '.join(f'{k} {v}' for k, v in (('H', sizes.H), ('I', sizes.I_p)) if v % group_size)}: its "
        f"last group is partial), so its last columns' scales have no place; serve it with moe_wna16 "
        f"(--quantization moe_wna16), which holds every group")


def staging_of(target: LayerTarget, spec: FusedSpec, decls: tuple[ParamDecl, ...]) -> dict[str, torch.Tensor] | None:
    """The engine's parameters as the fused writer's staging (every one a fused tensor as it is), or None."""
    if not target.layout.fused_as_is:
        return None
    staging = {fused_name(d): target.params[d.name] for d in decls}
    staging["expert_ids"] = torch.empty(len(spec.experts), dtype=torch.int32, device=target.device)
    return staging


def relay(prefix: str, target: LayerTarget, decls: tuple[ParamDecl, ...], spec: FusedSpec,
          tensors: Mapping[str, torch.Tensor], sizes: Sizes) -> None:
    """Re-lay one layer's fused `tensors` into the engine's `decls` (a parameter whose fused tensor is absent:
    made from the sizes, e.g. a symmetric layer's zero points or a SHAPE record)."""
    nk = {Half.W13: (spec.intermediate, spec.hidden), Half.W2: (spec.hidden, spec.intermediate)}
    with torch.no_grad():
        for decl in decls:
            fill_param(rank_view(target.params[decl.name], decl, sizes), decl, tensors.get(fused_name(decl)),
                       bits=spec.bits, shape_nk=nk[decl.half], label=prefix)


def rank_view(param: torch.Tensor, decl: ParamDecl, sizes: Sizes) -> torch.Tensor:
    """The part of `param` the rank's values fill: all of it, or where the engine allocates more
    (`decl.allocated`), its head, the rest zeroed (as the engine's own loader leaves it)."""
    if decl.allocated is None:
        return param
    with torch.no_grad():
        param.zero_()
    return param[tuple(slice(0, n) for n in shape_of(decl, sizes))]


def fill_layers(path: str | Path, parallel: ParallelConfig, targets: Mapping[str, LayerTarget], *,
                include_mtp: bool = False, copy_words: bool = True, reads: ReadOptions = ReadOptions()) -> FillReport:
    """Fill every target layer (by the source's experts prefix) from a checkpoint folder or a `wna16-shard`
    output at `path`; a target the source has not raises ConfigError. `include_mtp`: MTP layers are layers
    of the source too (else their expert tensors are non-expert tensors, left for the engine).
    `copy_words=False`: every layer whose method is not the fused layout is re-laid from fused scratch, even
    where the checkpoint's words could be copied as they are (the reference the copies are tested against).
    `reads`: the read-ahead's knobs; from a checkpoint folder a rank alone sends every planned range to the page
    cache only (`load_groups(cached=True)`), so the parameters stay the load's only memory; with `reads.node` of
    several ranks (each filling the same layers) the node reads the target layers together through its window, or,
    where its ranks share no pages (EP ranks), each rank reads its own ranges direct into buffers of
    `reads.node_ahead` + 1 layers of its share (the memory a node's load is given, as a window is)."""
    if is_presharded(path):
        return _fill_presharded(Path(path), parallel, targets, include_mtp)
    return _fill_checkpoint(path, parallel, targets, include_mtp, copy_words, reads)


@paused_gc_call  # the index, scan and plans are freed before the GC is back on: see storage/bulk.py
def _fill_checkpoint(path: str | Path, parallel: ParallelConfig, targets: Mapping[str, LayerTarget],
                     include_mtp: bool, copy_words: bool, reads: ReadOptions) -> FillReport:
    """`fill_layers` from a checkpoint folder."""
    done: list[Filled] = []
    with planned(path, parallel, include_mtp=include_mtp) as (moe, index, scan, plans):
        _same_layers(path, [plan.prefix for plan in plans], targets)
        alone = reads.node is None or reads.node.size == 1
        own, together = load_groups(index, moe, parallel, scan, plans, reads, cached=alone, only=targets.keys())
        with index.reading_ahead(own, reads, node_windows=together, node_cold=True) as ahead:
            for number, plan in enumerate(plans):
                ahead.start(number)
                if plan.prefix in targets:
                    done.append(Filled(plan.prefix, *fill_layer(index, moe, plan, targets[plan.prefix], copy_words)))
        return replace(_report(done, targets, scan.others), window_bytes=ahead.window_bytes,
                       buffer_bytes=ahead.buffer_bytes)


@dataclass(frozen=True)
class Filled:
    """One filled layer: its experts prefix, the scratch it held (bytes) and whether its checkpoint words were
    copied as they are."""

    prefix: str
    scratch: int
    copied: bool = False


def _report(done: list[Filled], targets: Mapping[str, LayerTarget], ignored: tuple[str, ...]) -> FillReport:
    """The FillReport of the layers filled, in order, leaving `ignored` tensors for the engine."""
    return FillReport({f.prefix: targets[f.prefix].layout.name for f in done}, ignored,
                      max((f.scratch for f in done), default=0), tuple(f.prefix for f in done if f.copied))


# Writes one layer's fused tensors into the staging it is given (the engine's parameters, held as they are), or
# returns them as new tensors (scratch) when given None.
FusedReader = Callable[[dict[str, torch.Tensor] | None], Mapping[str, torch.Tensor]]


def _through_fused(prefix: str, target: LayerTarget, spec: FusedSpec, decls: tuple[ParamDecl, ...],
                   read: FusedReader, sizes: Sizes) -> int:
    """One layer through its fused tensors, from a checkpoint or an output alike: read straight into the
    engine's parameters where its method holds them as they are, else read as one layer's scratch and re-laid
    into them; the scratch's bytes (0 for the former; the scratch is freed on return)."""
    staging = staging_of(target, spec, decls)
    tensors = read(staging)
    if staging is not None:
        return 0
    relay(prefix, target, decls, spec, tensors, sizes)
    return spec.nbytes


def fill_layer(index: CheckpointIndex, moe: MoEConfig, plan: LayerPlan, target: LayerTarget,
               copy_words: bool) -> tuple[int, bool]:
    """One layer: its checkpoint words copied where its method holds them as they are, else through the
    fused writer; the scratch it held (bytes) and whether it was copied."""
    decls = check_target(plan.prefix, target, plan.fused, plan.moe.quant.group_size)
    sizes = layer_sizes(plan.fused, plan.moe.quant.group_size)
    views = {d.name: rank_view(target.params[d.name], d, sizes) for d in decls}
    copies = direct_copies(plan, decls, views) if copy_words and not target.layout.fused_as_is else None
    if copies is None:
        read = partial(_loaded_fused, index, moe, plan, target.device)
        return _through_fused(plan.prefix, target, plan.fused, decls, read, sizes), False
    copy_direct(index, plan, copies, views)
    relay(plan.prefix, target, tuple(d for d in decls if made_from_sizes(d, plan.moe.quant.symmetric)),
          plan.fused, {}, sizes)
    return 0, True


def _loaded_fused(index: CheckpointIndex, moe: MoEConfig, plan: LayerPlan, device: torch.device,
                  staging: dict[str, torch.Tensor] | None) -> Mapping[str, torch.Tensor]:
    """A `FusedReader` of a checkpoint: the layer through the fused writer (the loader's own path)."""
    with torch.no_grad():
        fused, _, _ = load_layer(index, moe, plan, device, False, staging=staging)
    return fused.tensors


def _output_fused(out: Path, policy: DevicePolicy, located: dict[str, Located], prefix: str, spec: FusedSpec,
                  staging: dict[str, torch.Tensor] | None) -> Mapping[str, torch.Tensor]:
    """A `FusedReader` of a wna16-shard output: each fused tensor pread from the rank's files, into its staging
    parameter or a new tensor."""
    shapes = spec.shapes()
    if staging is None:
        return {name: read_param(out, policy, f"{prefix}.{name}", shape, dtype, located.get(f"{prefix}.{name}"))
                for name, (shape, dtype) in shapes.items()}
    for name, tensor in staging.items():
        if name != "expert_ids":
            _read_into_param(out, policy, f"{prefix}.{name}", shapes[name], located, tensor)
    return staging


def _read_into_param(out: Path, policy: DevicePolicy, name: str, shape: tuple[tuple[int, ...], torch.dtype],
                     located: dict[str, Located], param: torch.Tensor) -> None:
    """One fused tensor of an output straight into an engine parameter holding it as it is (pread on the
    CPU; through a host buffer for a device)."""
    if param.device.type != "cpu":
        param.copy_(read_param(out, policy, name, *shape, located.get(name)))
        return
    path, entry = checked_entry(out, name, *shape, located.get(name))
    read_into(path, entry.begin, param)


def _same_layers(path: str | Path, prefixes: list[str], targets: Mapping[str, LayerTarget]) -> None:
    """Every target layer is a layer of the source (a source layer with no target is left alone: e.g. the
    MTP layer, loaded with the engine's draft model)."""
    if not set(targets) <= set(prefixes):
        raise ConfigError(f"{path}: the engine's MoE layers {sorted(set(targets) - set(prefixes))} are not among "
                          f"its experts prefixes {sorted(prefixes)}; load this model with the engine's own loader")


def _fill_presharded(out: Path, parallel: ParallelConfig, targets: Mapping[str, LayerTarget],
                     include_mtp: bool) -> FillReport:
    """`fill_layers` of a `wna16-shard` output: each fused tensor read (pread) straight into the engine's
    parameter where the method holds it as it is, else into one layer's scratch and re-laid."""
    rank, moe = rank_record(out, parallel, include_mtp=include_mtp), read_config_files(out)
    located, _ = locate_rank(out, rank)
    specs = rank_specs(rank, include_mtp=include_mtp)
    _same_layers(out, list(specs), targets)
    policy, done = DevicePolicy.of("cpu"), []
    for prefix, spec in ((p, s) for p, s in specs.items() if p in targets):
        group_size = moe.spec_of(prefix).spec.group_size
        decls = check_target(prefix, targets[prefix], spec, group_size)
        read = partial(_output_fused, out, policy, located, prefix, spec)
        sizes = layer_sizes(spec, group_size)
        done.append(Filled(prefix, _through_fused(prefix, targets[prefix], spec, decls, read, sizes)))
    return _report(done, targets, ())
