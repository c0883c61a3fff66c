"""Read one rank's slice of one projection's scales, zero points and g_idx, for a batch of experts,
into canonical form, and check their contents (the weights: `qweights.py`).

Slice first, then convert: only the int32 words, groups and rows that cover the rank's columns are
read; unpacking and reordering touch nothing else. Every role of every expert in a batch is stacked
and converted once (`read_params`). The results are format-free:

| scales  | [E_b, N_l, nG]   stored scale dtype                     |
| zeros   | [E_b, N_l, nG]   uint8 true zero points, or None (sym)  |
| g_idx   | [E_b, K_l]       int32 checkpoint group per row, or None |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import torch

from ..errors import FormatError
from ..formats import Dim, QuantSpec, Role, TensorLayout
from ..formats.packing import add_word_bias, unpack_words
from ..models.names import Proj, Source
from ..parallel.partition import ProjectionSlice, Span, ceil_div
from ..storage.index import TensorRef

CANONICAL: dict[Role, tuple[Dim, ...]] = {
    Role.QWEIGHT: (Dim.N, Dim.K),
    Role.ZEROS: (Dim.N, Dim.GROUP),
    Role.SCALES: (Dim.N, Dim.GROUP),
    Role.G_IDX: (Dim.K,),
    Role.SHAPE: (Dim.PAIR,),
    Role.WEIGHT: (Dim.N, Dim.K),
}


class TensorReader(Protocol):
    """What the readers here need (a CheckpointIndex, or the hook's store of tensors handed over by an
    engine): `view(ref, index)` -> `tensor[index]` on the CPU, possibly file pages (copied before it is
    kept or sent to a device); `gather(refs, indices, pin=)` -> those slices stacked into fresh memory, or with
    `scratch=True` into the reader's reused buffer (valid until the thread's next scratch gather)."""

    def view(self, ref: TensorRef, index: tuple[slice | int, ...] = ()) -> torch.Tensor: ...

    def gather(self, refs: Sequence[TensorRef], indices: Sequence[tuple[slice | int, ...]], *,
               pin: bool = False, scratch: bool = False) -> torch.Tensor: ...

    def view_stacked(self, refs: Sequence[TensorRef],
                     indices: Sequence[tuple[slice | int, ...]]) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class ProjectionParams:
    """Scales, zero points and g_idx of one projection's rank slice for E_b experts (module table)."""

    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None


class SourceTensors(NamedTuple):
    """The checkpoint tensors of one projection source (a named tuple: a plan makes one per local expert and
    projection, hundreds of thousands at DeepSeek scale).

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


def checkpoint_groups(spec: QuantSpec, k_total: int) -> int:
    """Groups a checkpoint stores along an input dim of `k_total` columns: ceil(K / G), the last, partial group
    with a scale of its own (1 channelwise). Not an engine's allocation (`layouts.spec.allocated_groups`, K // G,
    vLLM's): the two differ where G does not divide K."""
    return 1 if spec.group_size == -1 else ceil_div(k_total, spec.group_size)


def expected_shape(layout: TensorLayout, spec: QuantSpec, src: SourceTensors, num_experts: int) -> tuple[int, ...]:
    """The storage shape the config implies for `layout` in `src` (leading E when stacked)."""
    return storage_shape(layout, spec, src.n_total, src.k_total, num_experts if src.expert_row is not None else None)


def storage_shape(layout: TensorLayout, spec: QuantSpec, n_total: int, k_total: int,
                  stacked: int | None) -> tuple[int, ...]:
    """The storage shape of `layout` for a source of N = `n_total`, K = `k_total` (leading E = `stacked` when
    stacked over experts)."""
    sizes = {Dim.N: n_total, Dim.K: k_total, Dim.GROUP: checkpoint_groups(spec, k_total), Dim.PAIR: 2}
    shape = tuple(ceil_div(sizes[d], spec.pack_factor) if d is layout.packed else sizes[d] for d in layout.dims)
    return shape if stacked is None else (stacked, *shape)


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
                  row: int | None) -> tuple[slice | int, ...]:
    """Storage slices covering `spans` (whole words along the packed dim; unpacking trims
    `span.start % per_word` values from its front)."""
    index: list[slice | int] = [] if row is None else [row]
    for dim in layout.dims:
        span = spans[dim]
        packed = dim is layout.packed
        index.append(slice(span.start // per_word, ceil_div(span.stop, per_word)) if packed else
                      slice(span.start, span.stop))
    return tuple(index)


def storage_indices(layout: TensorLayout, spans: dict[Dim, Span], per_word: int,
                    sources: Sequence[SourceTensors]) -> list[tuple[slice | int, ...]]:
    """`storage_index` of every source of a batch (one computation; stacked sources get their row first)."""
    index = storage_index(layout, spans, per_word, None)
    return [index if src.expert_row is None else (src.expert_row, *index) for src in sources]


def read_role(reader: TensorReader, spec: QuantSpec, layout: TensorLayout, sources: Sequence[SourceTensors],
              spans: dict[Dim, Span], pick: torch.Tensor | None = None) -> torch.Tensor:
    """The part of one role tensor of every source covering `spans`, unpacked, stacked over the
    sources and in canonical dim order (leading E_b). `pick` selects fused groups along GROUP.

    One stack copies every source's slice out of the file mapping; the conversion then runs
    once for the whole batch.
    """
    storage = storage_indices(layout, spans, spec.pack_factor, sources)
    raw = reader.gather([src.tensors[layout.role] for src in sources], storage)
    tensor = unpacked(raw, spec, layout, spans, lead=1)
    if pick is not None and Dim.GROUP in layout.dims:
        axis = 1 + layout.dims.index(Dim.GROUP)  # selected next to the expert dim: rows, not a last-dim gather
        tensor = tensor.movedim(axis, 1).index_select(1, pick).movedim(1, axis)
    return tensor.permute([0] + [1 + layout.dims.index(d) for d in CANONICAL[layout.role]])


def unpacked(tensor: torch.Tensor, spec: QuantSpec, layout: TensorLayout, spans: dict[Dim, Span], *,
              lead: int) -> torch.Tensor:
    """Words unpacked along the layout's packed dim and trimmed to `spans` (storage dim order after
    `lead` leading dims); unpacked layouts pass through."""
    if layout.packed is None:
        return tensor
    if spec.zero_word_bias and layout.role is Role.ZEROS:
        tensor = add_word_bias(tensor, spec.bits)
    axis = lead + layout.dims.index(layout.packed)
    span = spans[layout.packed]
    tensor = unpack_words(tensor, bits=spec.bits, dim=axis, slot_order=layout.slot_order)
    return tensor.narrow(axis, span.start % spec.pack_factor, len(span))


def rank_spans(src: SourceTensors, cut: ProjectionSlice) -> tuple[dict[Dim, Span], torch.Tensor | None]:
    """Storage spans covering the rank's slice `cut` of `src`, and the read group of each fused group
    (None when the fused groups are exactly the groups read, in order)."""
    offset = src.n_offset(cut.proj)
    n = Span(cut.n.start + offset, cut.n.stop + offset)
    groups = Span(min(cut.groups), max(cut.groups) + 1) if cut.groups else Span(0, 0)  # () on an all-padding rank
    spans = {Dim.N: n, Dim.K: cut.k, Dim.GROUP: groups, Dim.PAIR: Span(0, 2)}
    if cut.groups == tuple(range(groups.start, groups.stop)):
        return spans, None
    return spans, torch.tensor(cut.groups, dtype=torch.long) - groups.start


def check_dropped_role(reader: TensorReader, spec: QuantSpec, src: SourceTensors, cut: ProjectionSlice,
                       role: Role) -> None:
    """Validate one optional tensor that `read_params` checks and drops (symmetric zero points,
    a plain g_idx, a shape record), for a tensor that arrives after its projection was written."""
    spans, pick = rank_spans(src, cut)
    tensor = read_role(reader, spec, spec.layout(role), [src], spans, pick)
    if role is Role.ZEROS and spec.symmetric:
        _check_symmetric_zeros(tensor, spec, [src])
    elif role is Role.G_IDX:
        _checked_g_idx(tensor, spec, [src], cut)
    elif role is Role.SHAPE:
        _check_shape_tensor(tensor, [src])


def read_params(reader: TensorReader, spec: QuantSpec, sources: Sequence[SourceTensors], cut: ProjectionSlice,
                *, allow_nonfinite: bool = False) -> ProjectionParams:
    """Read and validate the scales, zero points and g_idx of the rank's slice `cut` of one projection,
    for a batch of experts whose sources share one kind and one set of roles."""
    assert len({(src.source, frozenset(src.tensors)) for src in sources}) == 1, "a batch mixes sources"
    spans, pick = rank_spans(sources[0], cut)

    def role(r: Role) -> torch.Tensor | None:
        layout = spec.layout(r)
        if layout is None or r not in sources[0].tensors:
            return None
        return read_role(reader, spec, layout, sources, spans, pick)

    _check_shape_tensor(role(Role.SHAPE), sources)
    scales = role(Role.SCALES)
    assert scales is not None, "scales are required by every format"
    if not allow_nonfinite:
        _check_finite(scales, sources)
    if spec.symmetric and Role.ZEROS in sources[0].tensors and \
            _zeros_are_implicit(reader, spec, spec.layout(Role.ZEROS), sources, spans):
        zeros = None  # stored, and every word decodes to z = 2^(b-1) (the common case, checked on the words)
    else:
        zeros = role(Role.ZEROS)
    if spec.symmetric and zeros is not None:
        _check_symmetric_zeros(zeros, spec, sources)
        zeros = None
    g_idx = _checked_g_idx(role(Role.G_IDX), spec, sources, cut)
    return ProjectionParams(scales=scales, zeros=zeros, g_idx=g_idx)


def _zeros_are_implicit(reader: TensorReader, spec: QuantSpec, layout: TensorLayout,
                        sources: Sequence[SourceTensors], spans: dict[Dim, Span]) -> bool:
    """Whether every stored word of the batch's zero points (the words covering `spans`) is one word that
    decodes to z = 2^(b-1) in every field: the symmetric check on raw words, with nothing unpacked. False
    says only "look closer" (`_check_symmetric_zeros` on the unpacked values then decides)."""
    if layout.packed is None:
        return False
    raw = reader.gather([src.tensors[Role.ZEROS] for src in sources],
                        storage_indices(layout, spans, spec.pack_factor, sources))
    if not raw.numel():
        return True
    word = raw.reshape(-1)[:1]
    if spec.zero_word_bias:
        word = add_word_bias(word, spec.bits)
    fields = unpack_words(word, bits=spec.bits, dim=0, slot_order=layout.slot_order)
    return bool((fields == spec.implicit_zero).all()) and bool((raw == raw.reshape(-1)[0]).all())


def in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """The same elements with the dims permuted into memory order (descending strides): a permuted
    contiguous tensor becomes contiguous again, so whole-tensor reductions run over it at memory speed."""
    return tensor.permute(sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)))


def _first(bad: torch.Tensor) -> int:
    """Index of the first expert flagged in a [E_b] bool tensor."""
    return int(bad.nonzero()[0, 0])


def _check_finite(scales: torch.Tensor, sources: Sequence[SourceTensors]) -> None:
    """One min/max pass (NaN and +-Inf propagate into it); the per-expert count only on failure."""
    if not scales.numel() or bool(torch.isfinite(torch.stack(torch.aminmax(in_memory_order(scales)))).all()):
        return
    bad = (~torch.isfinite(scales)).flatten(1).sum(1)
    i = _first(bad > 0)
    raise FormatError(f"{sources[i].tensors[Role.SCALES].name}: {int(bad[i])} NaN/Inf scale values in this rank's "
                      f"slice; the checkpoint is corrupt (pass allow_nonfinite_scales=True to load it anyway).")


def _check_shape_tensor(shape: torch.Tensor | None, sources: Sequence[SourceTensors]) -> None:
    """Every recorded [N, K] must match the config."""
    if shape is None:
        return
    want = torch.tensor([sources[0].n_total, sources[0].k_total], dtype=shape.dtype)
    bad = (shape.reshape(len(sources), -1) != want).any(1)
    if bool(bad.any()):
        i = _first(bad)
        raise FormatError(f"{sources[i].tensors[Role.SHAPE].name}: records shape {shape[i].tolist()} but the config "
                          f"implies {want.tolist()} (N, K).")


def _check_symmetric_zeros(zeros: torch.Tensor, spec: QuantSpec, sources: Sequence[SourceTensors]) -> None:
    bad = zeros != spec.implicit_zero
    if not bool(bad.any()):
        return
    i = _first(bad.flatten(1).any(1))
    values = sorted(set(zeros[i][bad[i]].tolist()))[:8]
    raise FormatError(f"{sources[i].tensors[Role.ZEROS].name}: the config is symmetric (z = {spec.implicit_zero}) "
                      f"but {int(bad[i].sum())} stored zero points decode to other values {values}; refusing to "
                      f"drop them. Set sym=false in the quantization config if the checkpoint is asymmetric.")


def _checked_g_idx(g_idx: torch.Tensor | None, spec: QuantSpec, sources: Sequence[SourceTensors],
                   cut: ProjectionSlice) -> torch.Tensor | None:
    """g_idx [E_b, K_l] for act-order slices; a plain-grouping g_idx must equal k // G and is dropped."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int32)
    groups = checkpoint_groups(spec, sources[0].k_total)
    _check_g_idx_range(g_idx, groups, spec, sources)
    if cut.g_idx:
        if len(cut.k) == sources[0].k_total:
            _check_group_sizes(g_idx, spec.group_size, groups, sources)
        return g_idx
    if spec.group_size != -1:
        plain = torch.arange(cut.k.start, cut.k.stop, dtype=torch.int32) // spec.group_size
        bad = (g_idx != plain).any(1)
        if bool(bad.any()):
            raise FormatError(f"{sources[_first(bad)].tensors[Role.G_IDX].name}: g_idx permutes input rows "
                              f"(act-order) but the quantization config does not declare act-order (desc_act / "
                              f"actorder=group); refusing to drop it.")
    return None


def _check_g_idx_range(g_idx: torch.Tensor, groups: int, spec: QuantSpec, sources: Sequence[SourceTensors]) -> None:
    if not g_idx.numel():
        return
    low, high = g_idx.amin(1), g_idx.amax(1)
    bad = (low < 0) | (high >= groups)
    if bool(bad.any()):
        i = _first(bad)
        raise FormatError(f"{sources[i].tensors[Role.G_IDX].name}: g_idx values span [{int(low[i])}, {int(high[i])}] "
                          f"but K = {sources[i].k_total} with group size {spec.group_size} has groups "
                          f"0..{groups - 1}.")


def _check_group_sizes(g_idx: torch.Tensor, group_size: int, groups: int, sources: Sequence[SourceTensors]) -> None:
    """Every act-order group holds G rows (the last one the remainder), for every expert."""
    rows = g_idx.shape[1]
    offsets = torch.arange(len(sources), dtype=torch.long).unsqueeze(1) * groups
    counts = torch.bincount((g_idx.to(torch.long) + offsets).reshape(-1), minlength=len(sources) * groups)
    want = torch.full((groups,), group_size, dtype=torch.long)
    want[-1] = rows - group_size * (groups - 1)
    bad = (counts.view(len(sources), groups) != want).any(1)
    if not bool(bad.any()):
        return
    i = _first(bad)
    found = counts.view(len(sources), groups)[i].tolist()
    wrong = [f"group {g}: {c} rows (expected {w})" for g, (c, w) in enumerate(zip(found, want.tolist())) if c != w]
    raise FormatError(f"{sources[i].tensors[Role.G_IDX].name}: g_idx groups are not of the declared size "
                      f"{group_size}: {'; '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}.")
