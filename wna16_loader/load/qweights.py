"""Read the weights of one projection's rank slice, for a batch of experts, in the fused byte packing.

Slice first, then convert: only the int32 words covering the rank's rows and columns are read, and
the conversion touches nothing else. Pieces come a bounded chunk of experts at a time, so a batch
never holds a whole layer's converted weights:

| words packed along K, cut on word boundaries | already the fused packing: views of the words     |
| 4-bit words packed along N, K cut on 8 rows  | views of the words, nibble-transposed as written   |
| anything else                                | unpacked, trimmed and repacked                     |

| QweightPiece.tensor | [E_c, N_c, K_l/P8] uint8 (a chunk of experts, a block of rows), or the same |
|                     | bytes as int32 words, or `NibbleWords` that write those words when placed    |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..formats import Dim, QuantSpec, Role, TensorLayout
from ..formats.packing import NibbleWords, pack_bytes
from ..parallel.partition import Span
from .copies import PAGE_BYTES
from .device import DevicePolicy
from .params import SourceTensors, TensorReader, storage_index, storage_indices, unpacked

QWEIGHT_CHUNK_BYTES = 2 << 20  # words converted at once on the host: amortises per-op cost, stays in cache
NIBBLE_CHUNK_BYTES = 6 << 20  # words nibble-transposed at once: its ops split well over torch's threads (2 threads:
#                               1.44 MB experts 1.6 GB/s one at a time, 3.5 four at a time, measured), still in L3
UPLOAD_CHUNK_BYTES = 64 << 20  # words staged and sent to a device at once


@dataclass(frozen=True)
class QweightPiece:
    """Weights of `sources[experts]` for the rows `n` of the rank's N slice (0-based inside it), in the
    fused byte packing [E_c, len(n), K_l/P8] uint8, or the same bytes as int32 words (as a tensor, or as
    `NibbleWords` whose conversion runs when the writer places them). Valid until the next piece is asked
    for: gathered words live in the reader's scratch, which the next chunk reuses (place each piece first)."""

    experts: slice
    n: Span
    tensor: torch.Tensor | NibbleWords


def read_qweights(reader: TensorReader, spec: QuantSpec, sources: Sequence[SourceTensors], spans: dict[Dim, Span],
                  *, upload: DevicePolicy | None = None) -> Iterator[QweightPiece]:
    """The weights of a batch of experts in the fused byte packing, piece by piece.

    | words packed along K, cut on word boundaries | already the fused packing: a view of the words    |
    |                                              | (the writer's copy does the transpose)             |
    | 4-bit words packed along N, K cut on 8 rows  | a view of the words as `NibbleWords`: the writer   |
    |                                              | nibble-transposes them straight into its rows      |
    | anything else                                | unpacked, trimmed and repacked                     |

    On the host, views and conversions cover about QWEIGHT_CHUNK_BYTES of words (NIBBLE_CHUNK_BYTES for
    the nibble transpose): several experts, or slabs of N words of one large expert; no word is copied out
    of the file first unless small slices lie scattered. With `upload` (the policy of a GPU
    that converts weights), the raw words of UPLOAD_CHUNK_BYTES of experts are copied out of the file
    mapping into one pinned host buffer, sent in one non-blocking copy, and converted on the device by
    the same tensor operations.
    """
    if not len(spans[Dim.N]) or not len(spans[Dim.K]):
        return  # a rank whose slice is all padding reads no weights
    layout = spec.layout(Role.QWEIGHT)
    fused, whole = _words_are_fused(layout, spec, spans), Span(0, len(spans[Dim.N]))
    nibble, words = not fused and _nibble_path(layout, spec, spans), _words_per_expert(layout, spec, spans)
    if upload is None and nibble and 4 * words > NIBBLE_CHUNK_BYTES:
        yield from _nibble_slabs(reader, spec, layout, sources, spans)
        return
    if upload is None and fused:
        yield from _viewed_chunks(reader, spec, layout, sources, spans, lambda w: _as_fused(w, layout),
                                  QWEIGHT_CHUNK_BYTES)
        return
    if upload is None and nibble:
        yield from _viewed_chunks(reader, spec, layout, sources, spans,
                                  lambda w: _converted_qweight(w, spec, layout, spans), NIBBLE_CHUNK_BYTES)
        return
    step = max(1, (QWEIGHT_CHUNK_BYTES if upload is None else UPLOAD_CHUNK_BYTES) // (4 * words))
    for start in range(0, len(sources), step):
        chunk = slice(start, min(start + step, len(sources)))
        refs = [src.tensors[Role.QWEIGHT] for src in sources[chunk]]
        indices = storage_indices(layout, spans, spec.pack_factor, sources[chunk])
        raw = reader.gather(refs, indices, scratch=True) if upload is None else \
            _uploaded([reader.view(ref, index) for ref, index in zip(refs, indices)], upload)
        yield QweightPiece(chunk, whole, _as_fused(raw, layout) if fused else
                           _converted_qweight(raw, spec, layout, spans))


def _viewed_chunks(reader: TensorReader, spec: QuantSpec, layout: TensorLayout, sources: Sequence[SourceTensors],
                   spans: dict[Dim, Span], convert: Callable[[torch.Tensor], torch.Tensor | NibbleWords],
                   budget: int) -> Iterator[QweightPiece]:
    """Words the writer takes as they are (`convert`: a view, or `NibbleWords`), about `budget` bytes of
    experts at a time: one strided view of the chunk when its slices are evenly spaced in one file (no
    copy here); else one view per expert when a slice fills a third of the budget, and smaller slices
    gathered into the reader's scratch (one copy, in cache: per-expert Python work would cost more than the
    bytes; one buffer reused, whose pages fault once)."""
    whole = Span(0, len(spans[Dim.N]))
    step = max(1, budget // (4 * _words_per_expert(layout, spec, spans)))
    for start in range(0, len(sources), step):
        chunk = slice(start, min(start + step, len(sources)))
        refs = [src.tensors[Role.QWEIGHT] for src in sources[chunk]]
        indices = storage_indices(layout, spans, spec.pack_factor, sources[chunk])
        words = reader.view_stacked(refs, indices) if len(refs) > 1 else None
        if words is not None or step > 2:
            words = reader.gather(refs, indices, scratch=True) if words is None else words
            yield QweightPiece(chunk, whole, convert(words))
            continue
        for i, (ref, index) in enumerate(zip(refs, indices)):
            yield QweightPiece(slice(start + i, start + i + 1), whole, convert(reader.view(ref, index)[None]))


def _words_per_expert(layout: TensorLayout, spec: QuantSpec, spans: dict[Dim, Span]) -> int:
    """int32 words of one expert's storage slice covering `spans`."""
    index = storage_index(layout, spans, spec.pack_factor, None)
    return math.prod(s.stop - s.start for s in index if isinstance(s, slice))


def _nibble_slabs(reader: TensorReader, spec: QuantSpec, layout: TensorLayout, sources: Sequence[SourceTensors],
                  spans: dict[Dim, Span]) -> Iterator[QweightPiece]:
    """The nibble path for experts larger than NIBBLE_CHUNK_BYTES: one expert at a time, in slabs of N words
    (all K rows) holding about that many bytes each, viewed in the file; a slab fills a block of output rows."""
    n, per_word = spans[Dim.N], spec.pack_factor
    words = max(1, NIBBLE_CHUNK_BYTES // (4 * len(spans[Dim.K])))
    words -= words > 1 and 4 * per_word * words % PAGE_BYTES == 0  # converted rows must not alias
    width = per_word * words  # N values per slab
    cuts = [n.start] + list(range(n.start // per_word * per_word + width, n.stop, width)) + [n.stop]
    for i, src in enumerate(sources):
        for start, stop in zip(cuts, cuts[1:]):
            part = {**spans, Dim.N: Span(start, stop)}
            index = storage_index(layout, part, per_word, src.expert_row)
            raw = reader.view(src.tensors[Role.QWEIGHT], index)[None]
            yield QweightPiece(slice(i, i + 1), Span(start - n.start, stop - n.start),
                               _converted_qweight(raw, spec, layout, part))


def _uploaded(slices: list[torch.Tensor], upload: DevicePolicy) -> torch.Tensor:
    """Stack file slices into `upload`'s pinned host buffer and send them to its device."""
    host = upload.host_buffer((len(slices), *slices[0].shape), slices[0].dtype)
    torch.stack(slices, out=host)  # the one copy out of the mapping: never DMA from a safetensors mmap
    return upload.upload(host)


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
                       spans: dict[Dim, Span]) -> torch.Tensor | NibbleWords:
    """[E_c, storage dims] words -> [E_c, N_l, K_l/P8] fused bytes (or their int32 words, or `NibbleWords`
    that write them: the nibble transpose runs into the destination)."""
    k_axis, n_axis = 1 + layout.dims.index(Dim.K), 1 + layout.dims.index(Dim.N)
    n = spans[Dim.N]
    if _nibble_path(layout, spec, spans):  # [E_c, K_l, N words] -> rows of [E_c, N words * 8, K_l/8]
        return NibbleWords(raw.permute([0, k_axis, n_axis]), layout.slot_order, n.start % spec.pack_factor, len(n))
    values = unpacked(raw, spec, layout, spans, lead=1)  # storage dim order
    packed = pack_bytes(values, bits=spec.bits, dim=k_axis)  # pack before transposing
    return packed.permute([0, n_axis, k_axis])
