"""A layer's checkpoint words copied straight into an engine's parameters, expert by expert, where the
method's row declares the checkpoint's own storage (`ParamDecl.storage == WordLayout.of(role layout)`):
no fused layer, no scratch.

| parameter                                   | filled from                                             |
|---------------------------------------------|---------------------------------------------------------|
| storage equal to the checkpoint role's      | each local expert's rank slice of that role, copied into its rows (w13: gate, then up, along N) |
| SHAPE, or zero points of a symmetric layer  | `relayout.fill_param` from the sizes (the midpoint), as the fused route makes them |

`direct_copies` returns None, and the layer takes the fused route, where anything differs: act-order, padded
I, reduced groups (G_eff < G), another storage (GPTQ v2 zero points in an offset-1 row, AWQ words in a K-words
row), another dtype, a role a source lacks, or a cut not on whole words. The rank's slices are validated
as the fused route validates them (`params.read_params`: finite scales, symmetric zero points).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..formats import Dim
from ..layouts.spec import Half, ParamDecl, Source, WordLayout
from ..models.names import Proj
from ..storage.index import CheckpointIndex, TensorRef
from .layer import plan_runs
from ..parallel.partition import Span
from .params import rank_spans, read_params, storage_index
from .plan import LayerPlan

Index = tuple[slice | int, ...]


@dataclass(frozen=True)
class Copy:
    """One expert's rank slice of one checkpoint tensor into `param[slot][into]`."""

    param: str
    slot: int
    into: Index
    ref: TensorRef
    index: Index


def half_projections(plan: LayerPlan, half: Half) -> list[Proj]:
    """The layer's projections whose rows `half` holds, in row order (w13: gate, then up)."""
    return [proj for proj in plan.fused.projections if Half.of(proj) is half]


def made_from_sizes(decl: ParamDecl, symmetric: bool) -> bool:
    """Whether `decl` is made without checkpoint values: a SHAPE record, or a symmetric layer's zero points."""
    return decl.source is Source.SHAPE or (decl.source is Source.ZEROS and symmetric)


def direct_copies(plan: LayerPlan, decls: Sequence[ParamDecl],
                  params: Mapping[str, torch.Tensor]) -> list[Copy] | None:
    """Every copy that fills `decls` of `plan`'s layer from the checkpoint's words, or None when some
    parameter's layout differs from the checkpoint's (module docstring)."""
    geometry, quant = plan.geometry, plan.moe.quant
    if not quant.quantized or quant.act_order or geometry.padding or geometry.group_eff != quant.group_size:
        return None
    copies: list[Copy] = []
    for decl in decls:
        if made_from_sizes(decl, quant.symmetric):
            continue
        layout = quant.layout(decl.storage.role) if decl.storage is not None else None
        if layout is None or WordLayout.of(layout, quant) != decl.storage:
            return None
        for proj in half_projections(plan, decl.half):
            found = _proj_copies(plan, decl, proj, params[decl.name])
            if found is None:
                return None
            copies += found
    return copies


def _proj_copies(plan: LayerPlan, decl: ParamDecl, proj: Proj, param: torch.Tensor) -> list[Copy] | None:
    """The copies of one projection's rows of `decl` for every local expert, or None (see `direct_copies`)."""
    quant, storage, cut = plan.moe.quant, decl.storage, plan.geometry.slice(proj)
    assert storage is not None, "made_from_sizes parameters are not copied"
    layout, out = quant.layout(storage.role), []
    row = half_projections(plan, decl.half).index(proj) * len(cut.n)
    for slot, expert in enumerate(plan.fused.experts):
        src = plan.sources[(expert, proj)]
        ref = src.tensors.get(storage.role)
        spans, pick = rank_spans(src, cut)
        if ref is None or pick is not None or ref.dtype != param.dtype or \
                not _whole_words(storage, spans, quant.pack_factor):
            return None
        index = storage_index(layout, spans, quant.pack_factor, src.expert_row)
        into = _rows(storage, row, _sliced_shape(ref.shape, index), quant.pack_factor)
        if into is None or _sliced_shape(param.shape[1:], into) != _sliced_shape(ref.shape, index):
            return None
        out.append(Copy(decl.name, slot, into, ref, index))
    return out


def _whole_words(storage: WordLayout, spans: Mapping[Dim, Span], per_word: int) -> bool:
    """Whether the span along the packed dim starts and ends on a word boundary."""
    if storage.packed is None:
        return True
    span = spans[storage.packed]
    return span.start % per_word == 0 and span.stop % per_word == 0


def _rows(storage: WordLayout, row: int, shape: tuple[int, ...], per_word: int) -> Index | None:
    """Where in one expert's parameter a checkpoint slice of `shape` (its storage dims) lands:
    `row` values along N (in words where N is packed), everything else whole; None off a word boundary."""
    if storage.packed is Dim.N and row % per_word:
        return None
    start = row // per_word if storage.packed is Dim.N else row
    axis = storage.dims.index(Dim.N)
    return tuple(slice(start, start + shape[axis]) if i == axis else slice(None) for i in range(len(shape)))


def _sliced_shape(shape: Sequence[int], index: Index) -> tuple[int, ...]:
    """The shape of `tensor[index]` for a tensor of `shape` (ints drop their dim)."""
    out = [len(range(*part.indices(size))) for part, size in zip(index, shape) if isinstance(part, slice)]
    return tuple(out) + tuple(shape[len(index):])


def copy_direct(index: CheckpointIndex, plan: LayerPlan, copies: Sequence[Copy],
                params: Mapping[str, torch.Tensor], *, allow_nonfinite: bool = False) -> None:
    """Validate the layer's rank slices as the fused route does, then copy each expert's words into its
    parameter rows (from the file mapping on the CPU; through ordinary memory for a device)."""
    for proj in plan.fused.projections:
        for _, sources in plan_runs(plan, proj):
            read_params(index, plan.moe.quant, sources, plan.geometry.slice(proj), allow_nonfinite=allow_nonfinite)
    with torch.no_grad():
        for copy in copies:
            target = params[copy.param][copy.slot][copy.into]
            on_cpu = target.device.type == "cpu"  # a device copies from ordinary memory, never from the mapping
            target.copy_(index.view(copy.ref, copy.index) if on_cpu else index.read(copy.ref, copy.index))
