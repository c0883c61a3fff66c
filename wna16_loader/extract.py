"""Read one rank's slice of one expert projection into canonical unpacked form.

Slice first, then convert: only the int32 words, groups and rows that cover the
rank's columns are read; unpacking and reordering touch nothing else. The
result is format-free:

| qweight| [N_l, K_l/P8] uint8, the fused byte packing along K, or the same |
|        | bytes as int32 words [N_l, K_l/(4*P8)] (least significant first)  |
| scales | [N_l, nG]   stored scale dtype                   |
| zeros  | [N_l, nG]   uint8 true zero points, or None (sym) |
| g_idx  | [K_l]       int32 checkpoint group per row, or None |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checkpoint import CheckpointIndex, TensorRef
from .errors import FormatError
from .formats import Dim, QuantSpec, Role, TensorLayout
from .names import Proj, Source
from .packing import add_word_bias, pack_bytes, unpack_words
from .sharding import ProjectionSlice, Span, ceil_div

CANONICAL: dict[Role, tuple[Dim, ...]] = {
    Role.QWEIGHT: (Dim.N, Dim.K),
    Role.ZEROS: (Dim.N, Dim.GROUP),
    Role.SCALES: (Dim.N, Dim.GROUP),
    Role.G_IDX: (Dim.K,),
    Role.SHAPE: (Dim.PAIR,),
}


@dataclass(frozen=True)
class ProjectionShard:
    """One rank's slice of one projection, unpacked (see the module table)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None


@dataclass(frozen=True)
class SourceTensors:
    """The checkpoint tensors of one projection source.

    `expert_row` is the row of a tensor stacked over experts (None when per
    expert); `n_total`/`k_total` are the source's full logical sizes.
    """

    source: Source
    tensors: dict[Role, TensorRef]
    expert_row: int | None
    n_total: int
    k_total: int

    def n_offset(self, proj: Proj) -> int:
        """Where `proj` starts along N inside this source (up is the second half of gate_up)."""
        return self.source.projs.index(proj) * (self.n_total // len(self.source.projs))


def group_count(spec: QuantSpec, k_total: int) -> int:
    """Checkpoint groups along an input dim of `k_total` columns."""
    return 1 if spec.group_size == -1 else ceil_div(k_total, spec.group_size)


def expected_shape(layout: TensorLayout, spec: QuantSpec, src: SourceTensors, num_experts: int) -> tuple[int, ...]:
    """The storage shape the config implies for `layout` in `src` (leading E when stacked)."""
    sizes = {Dim.N: src.n_total, Dim.K: src.k_total, Dim.GROUP: group_count(spec, src.k_total), Dim.PAIR: 2}
    shape = tuple(ceil_div(sizes[d], spec.pack_factor) if d is layout.packed else sizes[d] for d in layout.dims)
    return shape if src.expert_row is None else (num_experts, *shape)


def check_header(ref: TensorRef, layout: TensorLayout, spec: QuantSpec, src: SourceTensors,
                 num_experts: int) -> None:
    """dtype and shape of `ref` must match the declared layout and the config."""
    if ref.dtype not in layout.dtypes:
        raise FormatError(f"{ref.name}: dtype {ref.dtype} but {spec.format_name} {layout.suffix} must be one of "
                          f"{[str(d) for d in layout.dtypes]}.")
    want = expected_shape(layout, spec, src, num_experts)
    if ref.shape != want:
        raise FormatError(f"{ref.name}: shape {list(ref.shape)} but the config (N={src.n_total}, K={src.k_total}, "
                          f"E={num_experts}, G={spec.group_size}, {spec.bits}-bit) implies {list(want)} for "
                          f"{spec.format_name} {layout.suffix} with dims {[d.value for d in layout.dims]}.")


def storage_index(layout: TensorLayout, spans: dict[Dim, Span], per_word: int,
                   row: int | None) -> tuple[tuple[slice | int, ...], dict[Dim, int]]:
    """Storage slices covering `spans`, and the offset to trim from each unpacked dim."""
    index: list[slice | int] = [] if row is None else [row]
    trims: dict[Dim, int] = {}
    for dim in layout.dims:
        span = spans[dim]
        if dim is layout.packed:
            index.append(slice(span.start // per_word, ceil_div(span.stop, per_word)))
            trims[dim] = span.start % per_word
        else:
            index.append(slice(span.start, span.stop))
    return tuple(index), trims


def read_role(index: CheckpointIndex, spec: QuantSpec, layout: TensorLayout, ref: TensorRef,
              spans: dict[Dim, Span], row: int | None) -> torch.Tensor:
    """Read the part of one role tensor covering `spans`, unpacked, in canonical dim order."""
    tensor = _read_values(index, spec, layout, ref, spans, row)
    order = [layout.dims.index(d) for d in CANONICAL[layout.role]]
    return tensor.permute(order) if len(order) > 1 else tensor


def _read_values(index: CheckpointIndex, spec: QuantSpec, layout: TensorLayout, ref: TensorRef,
                 spans: dict[Dim, Span], row: int | None) -> torch.Tensor:
    """Read the part of one role tensor covering `spans`, unpacked and trimmed, in storage dim order."""
    storage, trims = storage_index(layout, spans, spec.pack_factor, row)
    tensor = index.read(ref, storage)
    if layout.packed is not None:
        if spec.zero_word_bias and layout.role is Role.ZEROS:
            tensor = add_word_bias(tensor, spec.bits)
        axis = layout.dims.index(layout.packed)
        tensor = unpack_words(tensor, bits=spec.bits, dim=axis, slot_order=layout.slot_order)
        tensor = tensor.narrow(axis, trims[layout.packed], len(spans[layout.packed]))
    return tensor


def rank_spans(src: SourceTensors, cut: ProjectionSlice) -> tuple[dict[Dim, Span], torch.Tensor | None]:
    """Storage spans covering the rank's slice `cut` of `src`, and the read group of each fused group
    (None when the fused groups are exactly the groups read, in order)."""
    offset = src.n_offset(cut.proj)
    n = Span(cut.n.start + offset, cut.n.stop + offset)
    groups = Span(min(cut.groups), max(cut.groups) + 1)
    spans = {Dim.N: n, Dim.K: cut.k, Dim.GROUP: groups, Dim.PAIR: Span(0, 2)}
    if cut.groups == tuple(range(groups.start, groups.stop)):
        return spans, None
    return spans, torch.tensor(cut.groups, dtype=torch.long) - groups.start


def pick_groups(tensor: torch.Tensor, pick: torch.Tensor | None) -> torch.Tensor:
    """The fused groups (dim 1) of a canonical [N, groups read] tensor."""
    return tensor if pick is None else tensor.index_select(1, pick)


def check_dropped_role(index: CheckpointIndex, spec: QuantSpec, src: SourceTensors, cut: ProjectionSlice,
                       role: Role) -> None:
    """Validate one optional tensor that `read_projection` checks and drops (symmetric zero points,
    a plain g_idx, a shape record), for a tensor that arrives after its projection was written."""
    spans, pick = rank_spans(src, cut)
    tensor = read_role(index, spec, spec.layout(role), src.tensors[role], spans, src.expert_row)
    if role is Role.ZEROS and spec.symmetric:
        _check_symmetric_zeros(pick_groups(tensor, pick), spec, src.tensors[role])
    elif role is Role.G_IDX:
        _checked_g_idx(tensor, spec, src, cut)
    elif role is Role.SHAPE:
        _check_shape_tensor(tensor, src)


def read_projection(index: CheckpointIndex, spec: QuantSpec, src: SourceTensors, cut: ProjectionSlice,
                    *, allow_nonfinite: bool = False) -> ProjectionShard:
    """Read and validate the rank's slice `cut` of one projection of one expert."""
    spans, pick = rank_spans(src, cut)

    def role(r: Role) -> torch.Tensor | None:
        layout, ref = spec.layout(r), src.tensors.get(r)
        if layout is None or ref is None:
            return None
        return read_role(index, spec, layout, ref, spans, src.expert_row)

    _check_shape_tensor(role(Role.SHAPE), src)
    scales = pick_groups(role(Role.SCALES), pick)
    if not allow_nonfinite and not torch.isfinite(scales).all():
        bad = int((~torch.isfinite(scales)).sum())
        raise FormatError(f"{src.tensors[Role.SCALES].name}: {bad} NaN/Inf scale values in this rank's slice; "
                          f"the checkpoint is corrupt (pass allow_nonfinite_scales=True to load it anyway).")
    zeros = role(Role.ZEROS)
    zeros = None if zeros is None else pick_groups(zeros, pick)
    if spec.symmetric and zeros is not None:
        _check_symmetric_zeros(zeros, spec, src.tensors[Role.ZEROS])
        zeros = None
    g_idx = _checked_g_idx(role(Role.G_IDX), spec, src, cut)
    qweight = _read_qweight(index, spec, src, spans)
    return ProjectionShard(qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx)


def _read_qweight(index: CheckpointIndex, spec: QuantSpec, src: SourceTensors, spans: dict[Dim, Span]) -> torch.Tensor:
    """The rank's weights as fused bytes [N_l, K_l/P8] (or those bytes as int32 words).

    Words packed sequentially along K and cut on word boundaries already are the
    fused byte packing: they are returned as a transposed view of the words read, and
    the writer's single copy does the transpose. Anything else is unpacked, trimmed
    and repacked.
    """
    layout, ref = spec.layout(Role.QWEIGHT), src.tensors[Role.QWEIGHT]
    k, per_word = spans[Dim.K], spec.pack_factor
    if layout.packed is Dim.K and layout.slot_order is None and k.start % per_word == 0 and k.stop % per_word == 0:
        storage, _ = storage_index(layout, spans, per_word, src.expert_row)
        words = index.read(ref, storage)
        axis = layout.dims.index(Dim.K)
        order = [layout.dims.index(Dim.N), axis]
        return words.permute(order)  # int32 words whose little-endian bytes are the fused packing
    values = _read_values(index, spec, layout, ref, spans, src.expert_row)  # storage dim order
    packed = pack_bytes(values, bits=spec.bits, dim=layout.dims.index(Dim.K))  # pack before transposing
    return packed.permute([layout.dims.index(Dim.N), layout.dims.index(Dim.K)])


def _check_shape_tensor(shape: torch.Tensor | None, src: SourceTensors) -> None:
    if shape is None:
        return
    found = [int(v) for v in shape.reshape(-1)]
    if found != [src.n_total, src.k_total]:
        raise FormatError(f"{src.tensors[Role.SHAPE].name}: records shape {found} but the config implies "
                          f"[{src.n_total}, {src.k_total}] (N, K).")


def _check_symmetric_zeros(zeros: torch.Tensor, spec: QuantSpec, ref: TensorRef) -> None:
    bad = zeros != spec.implicit_zero
    if bad.any():
        values = sorted(set(zeros[bad].tolist()))[:8]
        raise FormatError(f"{ref.name}: the config is symmetric (z = {spec.implicit_zero}) but {int(bad.sum())} "
                          f"stored zero points decode to other values {values}; refusing to drop them. Set "
                          f"sym=false in the quantization config if the checkpoint is asymmetric.")


def _checked_g_idx(g_idx: torch.Tensor | None, spec: QuantSpec, src: SourceTensors,
                   cut: ProjectionSlice) -> torch.Tensor | None:
    """g_idx for act-order slices; a plain-grouping g_idx must equal k // G and is dropped."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int32)
    name = src.tensors[Role.G_IDX].name
    groups = group_count(spec, src.k_total)
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise FormatError(f"{name}: g_idx values span [{int(g_idx.min())}, {int(g_idx.max())}] but K = "
                          f"{src.k_total} with group size {spec.group_size} has groups 0..{groups - 1}.")
    if cut.g_idx:
        if len(cut.k) == src.k_total:
            _check_group_sizes(g_idx, spec.group_size, groups, name)
        return g_idx
    if spec.group_size != -1:
        plain = torch.arange(cut.k.start, cut.k.stop, dtype=torch.int32) // spec.group_size
        if not torch.equal(g_idx, plain):
            raise FormatError(f"{name}: g_idx permutes input rows (act-order) but the quantization config does "
                              f"not declare act-order (desc_act / actorder=group); refusing to drop it.")
    return None


def _check_group_sizes(g_idx: torch.Tensor, group_size: int, groups: int, name: str) -> None:
    """Every act-order group holds G rows (the last one the remainder)."""
    counts = torch.bincount(g_idx.to(torch.long), minlength=groups).tolist()
    want = [group_size] * (groups - 1) + [len(g_idx) - group_size * (groups - 1)]
    wrong = [f"group {g}: {c} rows (expected {w})" for g, (c, w) in enumerate(zip(counts, want)) if c != w]
    if wrong:
        raise FormatError(f"{name}: g_idx groups are not of the declared size {group_size}: "
                          f"{'; '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}.")
