"""The one write path of every load: read this rank's slice of a layer's projections, write it fused.

`LayerLoad.write` reads the rank's scales, zero points, g_idx and weight bytes of one projection for a
run of consecutive local experts (through any `TensorReader`: a checkpoint index or tensors an engine
handed over) and writes them through a `FusedWriter`. `load_experts` drives it with a whole plan
(`load_plan`); the engine hook (`engine.hook.ExpertLoadHook`, a subclass) with one expert's tensors at a
time, once they have all arrived.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Iterator, Sequence

import torch

from ..errors import FormatError
from ..formats import Role
from ..models.config import MoEConfig
from ..models.names import Proj, Source
from ..parallel.partition import LayerGeometry
from ..storage.index import CheckpointIndex
from .fused import FusedWriter
from .params import SourceTensors, TensorReader, rank_spans, read_params, read_role
from .plan import LayerPlan
from .qweights import read_qweights


class LayerLoad:
    """Reads and writes this rank's slice of one MoE layer's projections; counts tensors and bytes."""

    def __init__(self, prefix: str, moe: MoEConfig, geometry: LayerGeometry, *,
                 allow_nonfinite: bool = False) -> None:
        self.prefix, self.moe, self.geometry = prefix, moe, geometry
        self.allow_nonfinite = allow_nonfinite
        self.tensors = 0
        self.bytes_written = 0

    def write(self, reader: TensorReader, writer: FusedWriter, experts: Sequence[int], proj: Proj,
              sources: Sequence[SourceTensors]) -> None:
        """Read the rank's slice of `proj` for `experts` (consecutive slots, one source kind) through
        `reader` and write it: the one write path of every load."""
        role = self.moe.quant.dtype_role
        for src in {src.tensors[role].dtype: src for src in reversed(sources)}.values():  # first of each dtype
            self._check_scale_dtype(src, writer)
        cut = self.geometry.slice(proj)
        if not self.moe.quant.quantized:
            self._write_floats(reader, writer, experts, proj, sources)
            return
        params = read_params(reader, self.moe.quant, sources, cut, allow_nonfinite=self.allow_nonfinite)
        before = writer.bytes_written
        upload = writer.policy if writer.upload_to is not None else None
        with writer.policy.scope():  # uploads and device conversion run in the target's context
            writer.write_params(experts, proj, params, labels=Labels(self.prefix, experts, proj._value_))
            spans, _ = rank_spans(sources[0], cut)
            for piece in read_qweights(reader, self.moe.quant, sources, spans, upload=upload):
                writer.write_qweight(experts[piece.experts], proj, piece.tensor, n=piece.n)
        self.bytes_written += writer.bytes_written - before

    def _write_floats(self, reader: TensorReader, writer: FusedWriter, experts: Sequence[int], proj: Proj,
                      sources: Sequence[SourceTensors]) -> None:
        """The float weights of an unquantized layer: the rank's rows (gate, up) or columns (down), stacked
        over `experts` as [E_b, N_l, K_l], written in the stored dtype."""
        spans, _ = rank_spans(sources[0], self.geometry.slice(proj))
        quant = self.moe.quant
        before = writer.bytes_written
        with writer.policy.scope():
            weights = read_role(reader, quant, quant.layout(Role.WEIGHT), sources, spans)
            writer.write_weights(experts, proj, weights)
        self.bytes_written += writer.bytes_written - before

    def _check_scale_dtype(self, src: SourceTensors, writer: FusedWriter) -> None:
        """Scales (float weights) may widen into the fused dtype (fp16 -> fp32), never round."""
        half = "w2" if src.source is Source.DOWN else "w13"
        quantized = self.moe.quant.quantized
        what, option = ("scales", "scale_dtype") if quantized else ("weights", "weight_dtype")
        ref = src.tensors[self.moe.quant.dtype_role]
        target = writer.staging[f"{half}_{'scales' if quantized else 'weight'}"].dtype
        if torch.promote_types(ref.dtype, target) != target:
            raise FormatError(f"{ref.name}: {what} are {ref.dtype} but {self.prefix} stores {target} {what}; "
                              f"converting would round them. Build the module with {option}={ref.dtype}.")

    def load_plan(self, index: CheckpointIndex, writer: FusedWriter, plan: LayerPlan) -> None:
        """Read and write every projection of a `plan_layer` plan (the `load_experts` path), a run of
        experts at a time (the plan's ledger already accounts for every tensor)."""
        for proj in plan.fused.projections:
            for experts, sources in plan_runs(plan, proj):
                self.tensors += sum(len(src.tensors) for src in sources)
                self.write(index, writer, experts, proj, sources)


class Labels(Sequence[str]):
    """`{prefix}.{expert}.{proj}` of each of `experts`, for errors: made when asked (an error is rare)."""

    def __init__(self, prefix: str, experts: Sequence[int], proj: str) -> None:
        self.prefix, self.experts, self.proj = prefix, experts, proj

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return Labels(self.prefix, self.experts[i], self.proj)
        return f"{self.prefix}.{self.experts[i]}.{self.proj}"

    def __len__(self) -> int:
        return len(self.experts)


def plan_runs(plan: LayerPlan, proj: Proj) -> Iterator[tuple[tuple[int, ...], tuple[SourceTensors, ...]]]:
    """Maximal runs of the plan's local experts (in slot order) whose `proj` comes from one source
    kind with one set of roles: each run is read and written as one batch (one run, found in C, when
    every expert's comes from one kind with one set of roles)."""
    experts = plan.fused.experts
    sources = [plan.sources[(expert, proj)] for expert in experts]
    kinds, roles = list(map(_SOURCE, sources)), list(map(dict.keys, map(_TENSORS, sources)))
    if sources and kinds.count(kinds[0]) == len(kinds) and roles.count(roles[0]) == len(roles):
        yield tuple(experts), tuple(sources)
        return
    run: list[tuple[int, SourceTensors]] = []
    for expert, src in zip(experts, sources):
        if run and (run[-1][1].source, run[-1][1].tensors.keys()) != (src.source, src.tensors.keys()):
            yield tuple(e for e, _ in run), tuple(s for _, s in run)
            run = []
        run.append((expert, src))
    if run:
        yield tuple(e for e, _ in run), tuple(s for _, s in run)


_SOURCE, _TENSORS = attrgetter("source"), attrgetter("tensors")
