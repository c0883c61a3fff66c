"""`--layout checkpoint`: each rank's slice of every source expert tensor, in the source's own format.

Every per-expert tensor keeps its source name, dtype and storage layout; it is cut to the rank's
columns with the same storage index computation as the loader (`extract.storage_index`), from
the format's `TensorLayout` declarations only. A shape record (Dim.PAIR) is rewritten as the
rank's [N_l, K_l]. A stacked tensor keeps the rows of the rank's experts (ascending id); a stacked
gate_up keeps [gate rows; up rows] of the rank. Non-local experts are dropped (EP).

Slicing is only exact when the cuts fall on int32-word boundaries of every packed dim and on
group boundaries with G_eff == G; otherwise `slice_layer` raises before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PreshardError
from ..formats import Dim, QuantSpec, TensorLayout
from ..load.params import SourceTensors, checkpoint_groups, rank_spans, storage_index
from ..load.plan import LayerPlan
from ..models.names import Proj
from ..parallel.partition import LayerGeometry, ProjectionSlice, Span, valid_tp_sizes
from ..storage.index import CheckpointIndex, TensorRef, nbytes_of


@dataclass(frozen=True)
class Piece:
    """One storage read: `ref[index]`."""

    ref: TensorRef
    index: tuple[slice | int, ...]


@dataclass(frozen=True)
class SlicedTensor:
    """One output tensor: per expert row, the pieces concatenated along `axis` (or a fixed `value`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    rows: tuple[tuple[Piece, ...], ...]
    axis: int | None
    stacked: bool
    value: tuple[int, ...] | None = None  # a shape record: the rank's [N_l, K_l]

    @property
    def nbytes(self) -> int:
        """Bytes of the output tensor."""
        return nbytes_of(self.shape, self.dtype)


def slice_layer(quant: QuantSpec, plan: LayerPlan) -> dict[str, SlicedTensor]:
    """Every output tensor of one layer on the plan's rank (raises PreshardError when misaligned)."""
    if plan.geometry.partition.is_padded:
        _refuse(plan.geometry, quant, f"tp={plan.geometry.parallel.tp_size} needs I padded to "
                                      f"I'={plan.geometry.padded_intermediate} (I_p'={plan.geometry.part}), and a "
                                      f"checkpoint-layout output cannot carry padding")
    rows: dict[str, dict[int | None, dict[Proj, tuple[Piece, tuple[int, int]]]]] = {}
    layouts: dict[str, TensorLayout] = {}
    for (expert, proj), src in sorted(plan.sources.items(), key=lambda kv: (kv[0][0], list(Proj).index(kv[0][1]))):
        cut = plan.geometry.slice(proj)
        spans, _ = rank_spans(src, cut)
        _check_aligned(quant, plan.geometry, src, cut, spans)
        for role, ref in src.tensors.items():
            layouts[ref.name] = quant.layout(role)
            storage = storage_index(layouts[ref.name], spans, quant.pack_factor, src.expert_row)
            per_row = rows.setdefault(ref.name, {}).setdefault(src.expert_row, {})
            per_row.setdefault(proj, (Piece(ref, storage), (len(spans[Dim.N]), len(spans[Dim.K]))))
    return {name: _sliced(layouts[name], name, by_row) for name, by_row in rows.items()}


def _sliced(layout: TensorLayout, name: str, by_row: dict) -> SlicedTensor:
    """Assemble one output tensor's description from its pieces (rows ascending, projs in N order)."""
    first = next(iter(next(iter(by_row.values())).values()))[0].ref
    axis = layout.dims.index(Dim.N) if Dim.N in layout.dims else None
    value = None
    if Dim.PAIR in layout.dims:
        sizes = list(next(iter(by_row.values())).values())
        value = (sum(nk[0] for _, nk in sizes), sizes[0][1][1])
    ordered = [by_row[row] for row in sorted(by_row, key=lambda r: -1 if r is None else r)]
    pieces = tuple(tuple(p for p, _ in projs.values()) if axis is not None else (next(iter(projs.values()))[0],)
                   for projs in ordered)
    row_shape = _row_shape(pieces[0], axis)
    stacked = None not in by_row
    shape = (len(pieces), *row_shape) if stacked else row_shape
    return SlicedTensor(name, first.dtype, shape, pieces, axis, stacked, value)


def _row_shape(pieces: tuple[Piece, ...], axis: int | None) -> tuple[int, ...]:
    shapes = []
    for piece in pieces:
        shapes.append([min(s.stop, d) - s.start for d, s in zip(piece.ref.shape, piece.index) if isinstance(s, slice)])
    shape = shapes[0]
    if axis is not None:
        shape[axis] = sum(s[axis] for s in shapes)
    return tuple(shape)


def _check_aligned(quant: QuantSpec, geometry: LayerGeometry, src: SourceTensors, cut: ProjectionSlice,
                   spans: dict[Dim, Span]) -> None:
    """The rank's cut must fall on word boundaries of every packed dim and on group boundaries."""
    per_word, g = quant.pack_factor, quant.group_size
    full = {Dim.N: src.n_total, Dim.K: src.k_total, Dim.GROUP: checkpoint_groups(quant, src.k_total)}
    for role, ref in src.tensors.items():
        layout = quant.layout(role)
        span = spans[layout.packed] if layout.packed is not None else None
        if span is not None and (span.start % per_word or (span.stop % per_word and span.stop != full[layout.packed])):
            _refuse(geometry, quant, f"{ref.name}: the rank's {layout.packed.value} range [{span.start}, {span.stop}) "
                                     f"does not fall on {per_word}-value int32 word boundaries")
    k = cut.k
    if g != -1 and not cut.g_idx and (k.start % g or (k.stop % g and k.stop != src.k_total)):
        _refuse(geometry, quant, f"{src.tensors[next(iter(src.tensors))].name}: the rank's K range "
                                 f"[{k.start}, {k.stop}) does not fall on group boundaries of G={g} "
                                 f"(G_eff would be {geometry.group_eff})")


def checkpoint_tp_sizes(geometry: LayerGeometry, quant: QuantSpec, limit: int = 64) -> list[int]:
    """TP sizes whose cuts fall on word and group boundaries for this layer."""
    good = []
    for tp in valid_tp_sizes(geometry.hidden, geometry.intermediate, geometry.bits, geometry.group_size,
                             geometry.act_order, limit=limit, allow_padding=False):
        part = geometry.intermediate // tp
        whole = tp == 1  # one rank keeps whole rows: a partial last word or group is the source's own
        if whole or part % quant.pack_factor == 0 and (quant.group_size == -1 or quant.act_order
                                                       or part % quant.group_size == 0):
            good.append(tp)
    return good


def _refuse(geometry: LayerGeometry, quant: QuantSpec, why: str) -> None:
    tp = geometry.parallel.tp_size
    share = f"{geometry.intermediate}/{tp}" + (f" = {geometry.intermediate // tp}" if not
                                                geometry.intermediate % tp else " is not whole")
    raise PreshardError(f"--layout checkpoint cannot slice at tp={tp} (I={geometry.intermediate}, I/tp = {share}, "
                        f"{quant.bits}-bit, G={quant.group_size}): {why}; nothing was "
                        f"written. Use --layout fused (it pads I where a cut would break groups and loads at every "
                        f"TP size), or a TP size that keeps the cuts aligned: {checkpoint_tp_sizes(geometry, quant)}.")


def materialize(index: CheckpointIndex, tensor: SlicedTensor) -> torch.Tensor:
    """Read one output tensor (only the storage words, groups and rows it covers); a tensor that is one
    contiguous piece of a source file is a view of its mapping (the writer streams it to disk)."""
    rows = [_row(index, tensor, pieces) for pieces in tensor.rows]
    return torch.stack(rows) if tensor.stacked else rows[0]


def _row(index: CheckpointIndex, tensor: SlicedTensor, pieces: tuple[Piece, ...]) -> torch.Tensor:
    if tensor.value is not None:
        return torch.tensor(tensor.value, dtype=tensor.dtype)
    parts = [index.view(p.ref, p.index) for p in pieces]  # one copy below (stack, cat or the writer's)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=tensor.axis)
