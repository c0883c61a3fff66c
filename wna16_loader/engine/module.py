"""FusedMoEModule (formerly FusedMoEExperts): one MoE layer's fused expert parameters on one rank, as an nn.Module.

Its parameters are exactly the fused layout of `fused.py` (w13_qweight, w2_qweight,
w13_scales, w2_scales, w13_qzeros/w2_qzeros when asymmetric, w13_g_idx/w2_g_idx with
act-order, expert_ids), requires_grad=False. Three ways to fill them, one code path
underneath (`ExpertLoadHook.write` -> `read_projection` -> `FusedWriter`):

| path                                   | who walks the checkpoint                        |
|----------------------------------------|-------------------------------------------------|
| `param.weight_loader(...)`             | an engine, tensor by tensor (vLLM's convention) |
| `install_load_hook` + `load_state_dict`| torch, from per-expert checkpoint names         |
| `load_model_experts(model, folder, p)` | this package: lazy slice reads, like load_experts |
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from ..errors import CompletenessError, LayoutMismatchError
from ..load.device import DevicePolicy
from ..load.fused import DequantizedExperts, FusedExperts, FusedSpec, FusedWriter, SpecView
from ..load.ledger import Ledger
from ..load.plan import LayerPlan, expect_projection, layer_geometry
from ..load.presharded import put_layer
from ..models.config import MoEConfig
from ..models.names import layer_of_prefix
from ..parallel.config import ParallelConfig
from ..storage.index import CheckpointIndex
from .hook import ExpertLoadHook
from .mapping import ExpertParamMapping, ParamTarget, ShardId
from .reference import Activation, reference_forward
from .state_dict import StateDictHooks


def _registers_on_meta() -> bool:
    """True inside accelerate's init_empty_weights (register_parameter moves parameters to meta)."""
    probe = nn.Module()
    probe.register_parameter("p", nn.Parameter(torch.empty(0), requires_grad=False))
    return probe.p.is_meta


class FusedMoEModule(SpecView, nn.Module):
    """One MoE layer's routed experts on one rank as an `nn.Module` (its parameters: the fused layout, see the
    module table), for a model that owns its modules; `load_experts` returns plain `FusedTensors` instead.
    Formerly `FusedMoEExperts` (still an alias).

    Under `accelerate.init_empty_weights()` (or with device="meta") nothing is
    allocated; `materialize(device)` or `.to_empty(device=...)` then allocates.
    Every parameter carries `weight_loader(param, loaded_weight, weight_name,
    shard_id, expert_id) -> bool`; the ledger (`ledger_report`, `check_complete`)
    records every slot written.
    """

    def __init__(self, moe: MoEConfig, prefix: str, parallel: ParallelConfig, *,
                 device: torch.device | str | None = None, scale_dtype: torch.dtype = torch.float16,
                 activation: Activation | None = None, allow_nonfinite_scales: bool = False,
                 weight_dtype: torch.dtype | None = None) -> None:
        """`activation`: None takes the config's (`moe.activation`, SiLU when it names none). The layer's own
        spec (`moe.spec_of(prefix)`) decides its parameters; a float (unquantized) layer keeps its weights in
        `weight_dtype` (None: the stored dtype `read_moe_config` recorded, else `scale_dtype`)."""
        super().__init__()
        self.layer_spec = moe.spec_of(prefix)
        moe = moe.at_layer(prefix)
        self.moe, self.prefix, self.parallel = moe, prefix, parallel
        self.activation = activation or Activation.from_config(moe.activation)
        self.geometry = layer_geometry(moe, parallel, layer_of_prefix(prefix))
        dtype = scale_dtype if moe.quant.quantized else weight_dtype or self.layer_spec.dtype or scale_dtype
        self.spec = FusedSpec.of(self.geometry, moe.quant, dtype, gated=moe.gated, activation=moe.activation)
        self.ledger = Ledger()
        for expert in self.spec.experts:
            for proj in self.spec.projections:
                expect_projection(self.ledger, moe, prefix, expert, proj)
        self.hook = ExpertLoadHook(prefix, moe, self.geometry, self.ledger, allow_nonfinite=allow_nonfinite_scales)
        self.mapping = ExpertParamMapping(moe, prefix)
        self._writer: FusedWriter | None = None
        self._load_hooks: StateDictHooks | None = None
        target = torch.device("meta") if _registers_on_meta() else \
            torch.device(device) if device is not None else torch.empty(0).device  # the default device
        for name, (shape, dtype) in self.spec.shapes().items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=dtype, device=target),
                                                       requires_grad=False))
        self._after_move()

    mtp = property(lambda self: self.moe.mtp.index(self.prefix) is not None, doc="Whether this is an MTP layer.")

    def extra_repr(self) -> str:
        return (f"{self.prefix!r}, {self.spec.describe()}, mtp={self.mtp}, spec={self.moe.quant.describe()!r}, "
                f"activation={self.activation.value}, gated={self.gated}")

    # ------------------------------------------------------------------ materialisation

    def materialize(self, device: torch.device | str) -> "FusedMoEModule":
        """Allocate every parameter on `device`, zeroed (expert_ids filled); returns self."""
        self.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for param in self.parameters(recurse=False):
                param.zero_()
        self._after_move()
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "FusedMoEModule":
        super()._apply(fn, recurse)
        self._after_move()
        return self

    def _after_move(self) -> None:
        """Re-attach the weight loaders (moves may replace parameters) and fill expert_ids."""
        self.attach_loaders()
        if not self.expert_ids.is_meta:
            with torch.no_grad():
                self.expert_ids.copy_(torch.tensor(self.spec.experts, dtype=torch.int32))

    def attach_loaders(self) -> None:
        """Give every parameter this module's weight_loader (moves and assign=True replace parameters)."""
        self._writer = None
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def _fused_writer(self) -> FusedWriter:
        """A FusedWriter whose staging tensors are this module's parameters."""
        if self._writer is None:
            if self.expert_ids.is_meta:
                raise CompletenessError(f"{self.prefix}: the fused parameters are on the meta device; call "
                                        f"materialize(device) or .to_empty(device=...) before loading weights.")
            self._writer = FusedWriter(self.prefix, self.spec, self.expert_ids.device,
                                       staging=dict(self.named_parameters(recurse=False)))
        return self._writer

    # ------------------------------------------------------------------ loading

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
                      shard_id: str | ShardId, expert_id: int | None) -> bool:
        """Take one whole checkpoint tensor (vLLM's convention); False when no local expert needs it.

        `weight_name` is the checkpoint tensor's name (e.g. `...experts.3.gate_proj.qweight`);
        `shard_id` "w1" (gate), "w3" (up) or "w2" (down); `expert_id` the global id (None for
        a stacked tensor). `param` is any parameter of this module: a projection's tensors
        fill several fused parameters at once, written when all its required roles are in.
        """
        if loaded_weight.requires_grad:  # what is staged or written never joins a graph (writes run in no_grad)
            loaded_weight = loaded_weight.detach()
        return self.hook.accept(self._fused_writer, loaded_weight, weight_name, shard_id, expert_id)

    def map_checkpoint_name(self, name: str) -> tuple[ParamTarget, ...]:
        """The fused parameters of this layer that checkpoint tensor `name` feeds (O(1))."""
        return self.mapping(name)

    def load_plan(self, index: CheckpointIndex, plan: LayerPlan) -> None:
        """Fill this layer from a `plan_layers` plan through slice reads of `index`."""
        found = replace(plan.fused, scale_dtype=self.spec.scale_dtype)
        if found != self.spec:
            raise LayoutMismatchError(f"{self.prefix}: the checkpoint's layout on this rank is {found} but the module "
                                      f"was built as {self.spec}; build it from this checkpoint's read_moe_config "
                                      f"and the same ParallelConfig.")
        with torch.no_grad():
            self.hook.flush()
            self.hook.load_plan(index, self._fused_writer(), plan)

    def load_fused(self, spec: FusedSpec, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        """Copy one already fused layer into the parameters, tensor by tensor, and fill the ledger.

        `tensors`: the layer's fused tensors by full name (`<prefix>.w13_qweight`, ...), e.g. views of a
        wna16-shard output's file mappings (`presharded.read_rank`): each is copied out of the mapping
        (through a pinned buffer and one non-blocking copy for a GPU), nothing else is held.
        """
        if spec != self.spec:
            raise LayoutMismatchError(f"{self.prefix}: {source} holds the layout {spec} but the module was built "
                                      f"as {self.spec}; build it with the ParallelConfig the output was sharded for.")
        with torch.no_grad():
            self.hook.flush()
            put_layer(source, self._fused_writer(), tensors)
        for slot in self.ledger.missing():
            self.ledger.record_slot(slot, f"{source}:{self.prefix}")

    def flush(self) -> None:
        """Write the projections the weight loader has complete but still holds for a batch (see
        `engine.hook`); everything that reads the parameters or the ledger calls it first."""
        with torch.no_grad():
            self.hook.flush()

    def synchronize(self) -> None:
        """Wait for the device work queued by loads into this module (nothing on the CPU or meta)."""
        self.flush()
        if not self.expert_ids.is_meta:
            DevicePolicy.of(self.expert_ids.device).synchronize()

    def ledger_report(self) -> list[str]:
        """Every missing, duplicated or unexpected slot so far (empty when complete)."""
        self.flush()
        return self.ledger.offenders()

    def check_complete(self) -> None:
        """Raise CompletenessError naming every missing or duplicated slot."""
        self.flush()
        self.ledger.check()

    def reset_load(self) -> None:
        """Forget what was loaded (ledger, pending tensors) before loading the weights again."""
        self.ledger.clear_records()
        self.hook = ExpertLoadHook(self.prefix, self.moe, self.geometry, self.ledger,
                                   allow_nonfinite=self.hook.allow_nonfinite)
        self._writer = None

    def install_load_hook(self) -> None:
        """Let `load_state_dict` take per-expert checkpoint names (idempotent)."""
        if self._load_hooks is None:
            self._load_hooks = StateDictHooks(self)

    # ------------------------------------------------------------------ use

    def to_fused(self) -> FusedExperts:
        """The parameters as a FusedExperts (shared storage)."""
        self.flush()
        return FusedExperts(self.prefix, self.spec, {n: p.data for n, p in self.named_parameters(recurse=False)},
                            mtp=self.mtp)

    def dequantize(self) -> DequantizedExperts:
        """Float32 weights of every local expert."""
        return self.to_fused().dequantize()

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial MoE output; see `reference_forward`. A correctness reference, not a kernel."""
        return reference_forward(self.dequantize(), self.spec.experts, hidden_states, topk_ids, topk_weights,
                                 self.activation)


FusedMoEExperts = FusedMoEModule  # the former name, kept as an alias
