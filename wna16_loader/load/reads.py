"""The byte ranges a layer plan reads, for `storage.readahead`: every local source's role tensors, cut as
`LayerLoad` cuts them (`rank_spans`, `storage_index`), each as the span of file bytes it touches.

| planned_ranges(index, plan) | [PlannedRange]: one per tensor slice the plan reads; `shared` when the span |
|                             | holds more bytes than the slice (a column cut: other ranks' columns share  |
|                             | its pages), else the rank's own bytes                                      |
"""

from __future__ import annotations

from pathlib import Path

from ..storage.index import CheckpointIndex
from ..storage.readahead import PlannedRange, span_of
from .params import rank_spans, storage_index
from .plan import LayerPlan


def planned_ranges(index: CheckpointIndex, plan: LayerPlan, *, min_tensor_bytes: int = 0) -> list[PlannedRange]:
    """The file byte ranges `plan`'s load reads (see the module table), in plan order; none when the layer's
    first source holds no tensor of `min_tensor_bytes` (tiny experts: working out a range per tensor would
    cost more than the mapping's reads of them)."""
    quant, out = plan.moe.quant, []
    first = next(iter(plan.sources.values()), None)
    if first is None or max(ref.nbytes for ref in first.tensors.values()) < min_tensor_bytes:
        return []
    spans: dict[tuple, tuple[int, int, int]] = {}  # one cut per (projection, source, role, header): experts share it
    paths: dict[str, Path] = {}
    for (_, proj), src in plan.sources.items():
        for role, ref in src.tensors.items():
            key = (proj, src.source, src.expert_row, role, ref.shape, ref.dtype)
            if key not in spans:
                cut = storage_index(quant.layout(role), rank_spans(src, plan.geometry.slice(proj))[0],
                                    quant.pack_factor, src.expert_row)
                spans[key] = span_of(0, ref.shape, ref.dtype.itemsize, cut)
            low, high, nbytes = spans[key]
            if nbytes:
                begin = index.first_byte(ref)
                path = paths.get(ref.file) or paths.setdefault(ref.file, index.folder / ref.file)
                out.append(PlannedRange(path, begin + low, begin + high, high - low > nbytes))
    return out
