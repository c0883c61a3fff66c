"""The byte ranges a layer plan reads, for `storage.readahead`: every local source's role tensors, cut as
`LayerLoad` cuts them (`rank_spans`, `storage_index`), each as the span of file bytes it touches.

| planned_ranges(index, plan) | [PlannedRange]: one per tensor slice the plan reads; `shared` when the span |
|                             | holds more bytes than the slice (a column cut: other ranks' columns share  |
|                             | its pages), else the rank's own bytes                                      |
"""

from __future__ import annotations

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
    for (_, proj), src in plan.sources.items():
        spans, _ = rank_spans(src, plan.geometry.slice(proj))
        for role, ref in src.tensors.items():
            layout = quant.layout(role)
            begin = ref.begin if ref.begin >= 0 else index.begin(ref.name)
            cut = storage_index(layout, spans, quant.pack_factor, src.expert_row)
            low, high, nbytes = span_of(begin, ref.shape, ref.dtype.itemsize, cut)
            if nbytes:
                out.append(PlannedRange(index.folder / ref.file, low, high, high - low > nbytes))
    return out
