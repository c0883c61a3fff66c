"""Read one rank's slice of one projection, for a batch of experts, into canonical form.

Slice first, then convert: only the int32 words, groups and rows that cover the
rank's columns are read; unpacking and reordering touch nothing else. Scales,
zero points and g_idx of every expert in a batch are stacked and converted
once (`read_params`); weights are read a bounded chunk of experts at a time
(`read_qweights`), so a batch never holds a whole layer's converted weights.
The results are format-free:

| qweight | [E_c, N_c, K_l/P8] uint8 pieces (a chunk of experts, a block of rows), |
|         | the fused byte packing along K, or the same bytes as int32 words       |
| scales  | [E_b, N_l, nG]   stored scale dtype                   |
| zeros   | [E_b, N_l, nG]   uint8 true zero points, or None (sym) |
| g_idx   | [E_b, K_l]       int32 checkpoint group per row, or None |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import torch

from .checkpoint import TensorRef
from .device import DevicePolicy
from .errors import FormatError
from .formats import Dim, QuantSpec, Role, TensorLayout
from .names import Proj, Source
from .packing import add_word_bias, pack_bytes, transpose_nibble_words, unpack_words
from .sharding import ProjectionSlice, Span, ceil_div

CANONICAL: dict[Role, tuple[Dim, ...]] = {
    Role.QWEIGHT: (Dim.N, Dim.K),
    Role.ZEROS: (Dim.N, Dim.GROUP),
    Role.SCALES: (Dim.N, Dim.GROUP),
    Role.G_IDX: (Dim.K,),
    Role.SHAPE: (Dim.PAIR,),
}


class TensorReader(Protocol):
    """What the readers here need (a CheckpointIndex, or the hook's store of tensors handed over by an
    engine): `view(ref, index)` -> `tensor[index]` on the CPU, possibly file pages (copied before it is
    kept or sent to a device); `gather(refs, indices, pin=)` -> those slices stacked into fresh memory."""

    def view(self, ref: TensorRef, index: tuple[slice | int, ...] = ()) -> torch.Tensor: ...

    def gather(self, refs: Sequence[TensorRef], indices: Sequence[tuple[slice | int, ...]], *,
               pin: bool = False) -> torch.Tensor: ...

    def view_stacked(self, refs: Sequence[TensorRef],
                     indices: Sequence[tuple[slice | int, ...]]) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class ProjectionParams:
    """Scales, zero points and g_idx of one projection's rank slice for E_b experts (module table)."""

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
    tensor = _unpacked(raw, spec, layout, spans, lead=1)
    if pick is not None and Dim.GROUP in layout.dims:
        axis = 1 + layout.dims.index(Dim.GROUP)  # selected next to the expert dim: rows, not a last-dim gather
        tensor = tensor.movedim(axis, 1).index_select(1, pick).movedim(1, axis)
    return tensor.permute([0] + [1 + layout.dims.index(d) for d in CANONICAL[layout.role]])


def _unpacked(tensor: torch.Tensor, spec: QuantSpec, layout: TensorLayout, spans: dict[Dim, Span], *,
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
    zeros = role(Role.ZEROS)
    if spec.symmetric and zeros is not None:
        _check_symmetric_zeros(zeros, spec, sources)
        zeros = None
    g_idx = _checked_g_idx(role(Role.G_IDX), spec, sources, cut)
    return ProjectionParams(scales=scales, zeros=zeros, g_idx=g_idx)


QWEIGHT_CHUNK_BYTES = 2 << 20  # words converted at once on the host: amortises per-op cost, stays in cache
UPLOAD_CHUNK_BYTES = 64 << 20  # words staged and sent to a device at once
PAGE_BYTES = 4096  # rows a multiple of this apart all fall into the same cache sets (see fused.copy_transposing)


@dataclass(frozen=True)
class QweightPiece:
    """Weights of `sources[experts]` for the rows `n` of the rank's N slice (0-based inside it), in the
    fused byte packing [E_c, len(n), K_l/P8] uint8, or the same bytes as int32 words."""

    experts: slice
    n: Span
    tensor: torch.Tensor


def read_qweights(reader: TensorReader, spec: QuantSpec, sources: Sequence[SourceTensors], spans: dict[Dim, Span],
                  *, upload: DevicePolicy | None = None) -> Iterator[QweightPiece]:
    """The weights of a batch of experts in the fused byte packing, piece by piece.

    | words packed along K, cut on word boundaries | already the fused packing: a view of the words    |
    |                                              | (the writer's copy does the transpose)             |
    | 4-bit words packed along N, K cut on 8 rows  | an 8x8 nibble transpose of every word block        |
    | anything else                                | unpacked, trimmed and repacked                     |

    On the host, views come one expert at a time and conversions work on about QWEIGHT_CHUNK_BYTES
    of words (several experts, or slabs of N words of one large expert). With `upload` (the policy of a GPU
    that converts weights), the raw words of UPLOAD_CHUNK_BYTES of experts are copied out of the file
    mapping into one pinned host buffer, sent in one non-blocking copy, and converted on the device by
    the same tensor operations.
    """
    if not len(spans[Dim.N]) or not len(spans[Dim.K]):
        return  # a rank whose slice is all padding reads no weights
    layout = spec.layout(Role.QWEIGHT)
    fused, whole = _words_are_fused(layout, spec, spans), Span(0, len(spans[Dim.N]))
    if upload is None and fused:
        yield from _fused_views(reader, spec, layout, sources, spans)
        return
    words = _words_per_expert(layout, spec, spans)
    if upload is None and _nibble_path(layout, spec, spans) and 4 * words > QWEIGHT_CHUNK_BYTES:
        yield from _nibble_slabs(reader, spec, layout, sources, spans)
        return
    step = max(1, (QWEIGHT_CHUNK_BYTES if upload is None else UPLOAD_CHUNK_BYTES) // (4 * words))
    for start in range(0, len(sources), step):
        chunk = slice(start, min(start + step, len(sources)))
        refs = [src.tensors[Role.QWEIGHT] for src in sources[chunk]]
        indices = storage_indices(layout, spans, spec.pack_factor, sources[chunk])
        raw = reader.gather(refs, indices) if upload is None else \
            _stacked([reader.view(ref, index) for ref, index in zip(refs, indices)], upload)
        yield QweightPiece(chunk, whole, _as_fused(raw, layout) if fused else
                           _converted_qweight(raw, spec, layout, spans))


def _fused_views(reader: TensorReader, spec: QuantSpec, layout: TensorLayout, sources: Sequence[SourceTensors],
                 spans: dict[Dim, Span]) -> Iterator[QweightPiece]:
    """Words that already hold the fused bytes, about QWEIGHT_CHUNK_BYTES of experts at a time: one
    strided view of the chunk when its slices are evenly spaced in one file (no copy here); else one view
    per expert when a slice fills half a chunk, and small slices gathered into one buffer (one copy, in
    cache: per-expert Python work would cost more than the bytes)."""
    whole = Span(0, len(spans[Dim.N]))
    step = max(1, QWEIGHT_CHUNK_BYTES // (4 * _words_per_expert(layout, spec, spans)))
    for start in range(0, len(sources), step):
        chunk = slice(start, min(start + step, len(sources)))
        refs = [src.tensors[Role.QWEIGHT] for src in sources[chunk]]
        indices = storage_indices(layout, spans, spec.pack_factor, sources[chunk])
        words = reader.view_stacked(refs, indices) if len(refs) > 1 else None
        if words is not None or step > 2:
            words = reader.gather(refs, indices) if words is None else words
            yield QweightPiece(chunk, whole, _as_fused(words, layout))
            continue
        for i, (ref, index) in enumerate(zip(refs, indices)):
            yield QweightPiece(slice(start + i, start + i + 1), whole, _as_fused(reader.view(ref, index)[None], layout))


def _words_per_expert(layout: TensorLayout, spec: QuantSpec, spans: dict[Dim, Span]) -> int:
    """int32 words of one expert's storage slice covering `spans`."""
    index = storage_index(layout, spans, spec.pack_factor, None)
    return math.prod(s.stop - s.start for s in index if isinstance(s, slice))


def _nibble_slabs(reader: TensorReader, spec: QuantSpec, layout: TensorLayout, sources: Sequence[SourceTensors],
                  spans: dict[Dim, Span]) -> Iterator[QweightPiece]:
    """The nibble path for experts larger than a chunk: one expert at a time, in slabs of N words
    (all K rows) holding about QWEIGHT_CHUNK_BYTES each; a slab fills a block of output rows."""
    n, per_word = spans[Dim.N], spec.pack_factor
    words = max(1, QWEIGHT_CHUNK_BYTES // (4 * len(spans[Dim.K])))
    words -= words > 1 and 4 * per_word * words % PAGE_BYTES == 0  # converted rows must not alias
    width = per_word * words  # N values per slab
    cuts = [n.start] + list(range(n.start // per_word * per_word + width, n.stop, width)) + [n.stop]
    for i, src in enumerate(sources):
        for start, stop in zip(cuts, cuts[1:]):
            part = {**spans, Dim.N: Span(start, stop)}
            index = storage_index(layout, part, per_word, src.expert_row)
            raw = _stacked([reader.view(src.tensors[Role.QWEIGHT], index)], None)
            yield QweightPiece(slice(i, i + 1), Span(start - n.start, stop - n.start),
                               _converted_qweight(raw, spec, layout, part))


def _stacked(slices: list[torch.Tensor], upload: DevicePolicy | None) -> torch.Tensor:
    """Stack file slices into ordinary memory, or into `upload`'s pinned host buffer and send them to its device."""
    shape = (len(slices), *slices[0].shape)
    host = torch.empty(shape, dtype=slices[0].dtype) if upload is None else upload.host_buffer(shape, slices[0].dtype)
    torch.stack(slices, out=host)  # the one copy out of the mapping: never DMA from a safetensors mmap
    return host if upload is None else upload.upload(host)


def _as_fused(words: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """[E_c, storage dims] words packed along K -> a [E_c, N_l, K_l/(4*P8)] view."""
    return words.permute([0, 1 + layout.dims.index(Dim.N), 1 + layout.dims.index(Dim.K)])


def _words_are_fused(layout: TensorLayout, spec: QuantSpec, spans: dict[Dim, Span]) -> bool:
    """Words packed sequentially along K and cut on word boundaries hold the fused bytes as they are."""
    k, per_word = spans[Dim.K], spec.pack_factor
    return layout.packed is Dim.K and layout.slot_order is None and k.start % per_word == 0 and \
        k.stop % per_word == 0


def _nibble_path(layout: TensorLayout, spec: QuantSpec, spans: dict[Dim, Span]) -> bool:
    """4-bit words packed along N, with K cut on whole 8-row blocks: the nibble transpose applies."""
    k = spans[Dim.K]
    return layout.packed is Dim.N and spec.bits == 4 and k.start % 8 == 0 and k.stop % 8 == 0


def _converted_qweight(raw: torch.Tensor, spec: QuantSpec, layout: TensorLayout,
                       spans: dict[Dim, Span]) -> torch.Tensor:
    """[E_c, storage dims] words -> [E_c, N_l, K_l/P8] fused bytes (or their int32 words)."""
    k_axis, n_axis = 1 + layout.dims.index(Dim.K), 1 + layout.dims.index(Dim.N)
    n = spans[Dim.N]
    if _nibble_path(layout, spec, spans):
        words = transpose_nibble_words(raw.permute([0, k_axis, n_axis]), slot_order=layout.slot_order)
        return words.narrow(1, n.start % spec.pack_factor, len(n))  # [E_c, N words * 8 -> N_l, K_l/8]
    values = _unpacked(raw, spec, layout, spans, lead=1)  # storage dim order
    packed = pack_bytes(values, bits=spec.bits, dim=k_axis)  # pack before transposing
    return packed.permute([0, n_axis, k_axis])


def _first(bad: torch.Tensor) -> int:
    """Index of the first expert flagged in a [E_b] bool tensor."""
    return int(bad.nonzero()[0, 0])


def _check_finite(scales: torch.Tensor, sources: Sequence[SourceTensors]) -> None:
    """One min/max pass (NaN and +-Inf propagate into it); the per-expert count only on failure."""
    if not scales.numel() or bool(torch.isfinite(torch.stack(torch.aminmax(scales))).all()):
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
    groups = group_count(spec, sources[0].k_total)
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
