"""FusedMoEExperts: one MoE layer's fused expert parameters on one rank, as an nn.Module.

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

import enum
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import CheckpointIndex
from .errors import CompletenessError, FormatError, LayoutMismatchError, format_offenders
from .fused import DequantizedExperts, FusedExperts, FusedSpec, FusedWriter, Ledger
from .hook import ExpertLoadHook, ExpertParamMapping, ParamTarget, ShardId
from .loader import LoadReport, load_experts, planned
from .preshard import is_presharded
from .logs import rank_logger
from .modelconfig import MoEConfig
from .names import Proj
from .parallel import ParallelConfig
from .plan import LayerPlan, expect_projection, layer_geometry



class Activation(enum.Enum):
    """The gate activation of a gated MLP: act(gate) * up."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"  # Gemma 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x) if self is Activation.SILU else F.gelu(x, approximate="tanh")


def _registers_on_meta() -> bool:
    """True inside accelerate's init_empty_weights (register_parameter moves parameters to meta)."""
    probe = nn.Module()
    probe.register_parameter("p", nn.Parameter(torch.empty(0), requires_grad=False))
    return probe.p.is_meta


class FusedMoEExperts(nn.Module):
    """One MoE layer's routed experts on one rank, in the fused layout (see the module table).

    Under `accelerate.init_empty_weights()` (or with device="meta") nothing is
    allocated; `materialize(device)` or `.to_empty(device=...)` then allocates.
    Every parameter carries `weight_loader(param, loaded_weight, weight_name,
    shard_id, expert_id) -> bool`; the ledger (`ledger_report`, `check_complete`)
    records every slot written.
    """

    def __init__(self, moe: MoEConfig, prefix: str, parallel: ParallelConfig, *,
                 device: torch.device | str | None = None, scale_dtype: torch.dtype = torch.float16,
                 activation: Activation = Activation.SILU, allow_nonfinite_scales: bool = False) -> None:
        super().__init__()
        self.moe, self.prefix, self.parallel, self.activation = moe, prefix, parallel, activation
        self.geometry = layer_geometry(moe, parallel)
        self.spec = FusedSpec.of(self.geometry, moe.quant, scale_dtype)
        self.ledger = Ledger()
        for expert in self.spec.experts:
            for proj in Proj:
                expect_projection(self.ledger, moe, prefix, expert, proj)
        self.hook = ExpertLoadHook(prefix, moe, self.geometry, self.ledger, allow_nonfinite=allow_nonfinite_scales)
        self.mapping = ExpertParamMapping(moe, prefix)
        self._writer: FusedWriter | None = None
        self._hook_handles: list[Any] = []
        self._load_call: tuple[str, int] | None = None  # (load_state_dict prefix, tensors consumed)
        target = torch.device("meta") if _registers_on_meta() else \
            torch.device(device) if device is not None else torch.empty(0).device  # the default device
        for name, (shape, dtype) in self.spec.shapes().items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=dtype, device=target),
                                                       requires_grad=False))
        self._after_move()

    bits = property(lambda self: self.spec.bits, doc="Bits per weight.")
    group_size = property(lambda self: self.spec.group_size, doc="G_eff (-1: channelwise).")
    has_zero_point = property(lambda self: self.spec.has_zero_point, doc="Whether qzeros are stored.")
    act_order = property(lambda self: self.spec.act_order, doc="Whether g_idx orders the groups.")

    def extra_repr(self) -> str:
        return (f"{self.prefix!r}, experts={list(self.spec.experts)}, I_p={self.spec.part}, bits={self.bits}, "
                f"group_size={self.group_size}, zero_point={self.has_zero_point}, act_order={self.act_order}, "
                f"activation={self.activation.value}")

    # ------------------------------------------------------------------ materialisation

    def materialize(self, device: torch.device | str) -> "FusedMoEExperts":
        """Allocate every parameter on `device`, zeroed (expert_ids filled); returns self."""
        self.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for param in self.parameters(recurse=False):
                param.zero_()
        self._after_move()
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "FusedMoEExperts":
        super()._apply(fn, recurse)
        self._after_move()
        return self

    def _after_move(self) -> None:
        """Re-attach the weight loaders (moves may replace parameters) and fill expert_ids."""
        self._attach_loaders()
        if not self.expert_ids.is_meta:
            with torch.no_grad():
                self.expert_ids.copy_(torch.tensor(self.spec.experts, dtype=torch.int32))

    def _attach_loaders(self) -> None:
        self._writer = None
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def _fused_writer(self) -> FusedWriter:
        """A FusedWriter whose staging tensors are this module's parameters."""
        if self._writer is None:
            if self.w13_qweight.is_meta:
                raise CompletenessError(f"{self.prefix}: the fused parameters are on the meta device; call "
                                        f"materialize(device) or .to_empty(device=...) before loading weights.")
            self._writer = FusedWriter(self.prefix, self.spec, self.w13_qweight.device,
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
        with torch.no_grad():
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
            self.hook.load_plan(index, self._fused_writer(), plan)

    def load_fused(self, fused: FusedExperts, *, source: str) -> None:
        """Copy an already fused layer (e.g. from a wna16-shard output) into the parameters; fills the ledger."""
        if fused.spec != self.spec:
            raise LayoutMismatchError(f"{self.prefix}: {source} holds the layout {fused.spec} but the module was built "
                                      f"as {self.spec}; build it with the ParallelConfig the output was sharded for.")
        with torch.no_grad():
            for name, tensor in fused.tensors.items():
                getattr(self, name).copy_(tensor)
        for slot in self.ledger.missing():
            self.ledger.record_slot(slot, f"{source}:{self.prefix}")

    def ledger_report(self) -> list[str]:
        """Every missing, duplicated or unexpected slot so far (empty when complete)."""
        return self.ledger.offenders()

    def check_complete(self) -> None:
        """Raise CompletenessError naming every missing or duplicated slot."""
        self.ledger.check()

    def reset_load(self) -> None:
        """Forget what was loaded (ledger, pending tensors) before loading the weights again."""
        self.ledger.clear_records()
        self.hook = ExpertLoadHook(self.prefix, self.moe, self.geometry, self.ledger,
                                   allow_nonfinite=self.hook.allow_nonfinite)
        self._writer = None

    def install_load_hook(self) -> None:
        """Let `load_state_dict` take per-expert checkpoint names (idempotent)."""
        if not self._hook_handles:
            self._hook_handles = [self._register_load_state_dict_pre_hook(self._consume_state_dict),
                                  self.register_load_state_dict_post_hook(self._fix_incompatible_keys)]

    def _consume_state_dict(self, state_dict: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
        """load_state_dict pre-hook: feed every per-expert key under `prefix` to the weight loader."""
        consumed = 0
        for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in self._parameters]:
            name = f"{self.prefix}.{key[len(prefix):]}"
            targets = self.mapping(name)
            if targets:
                tensor = state_dict.pop(key)
                for target in targets:
                    self.weight_loader(getattr(self, target.fused_name), tensor, name, target.shard_id,
                                       target.expert_id)
                consumed += 1
        self._load_call = (prefix, consumed)

    def _fix_incompatible_keys(self, module: nn.Module, incompatible: Any) -> None:
        """load_state_dict post-hook: report missing checkpoint names instead of fused parameter names."""
        prefix, consumed = self._load_call or ("", 0)
        self._load_call = None
        self._attach_loaders()  # assign=True replaces parameters
        if not self.expert_ids.is_meta and self.expert_ids.tolist() != list(self.spec.experts):
            raise LayoutMismatchError(f"{prefix}expert_ids: the state dict holds experts {self.expert_ids.tolist()} "
                                      f"but this rank owns {list(self.spec.experts)}; load the fused state dict "
                                      f"saved by the same rank of the same ParallelConfig.")
        if not consumed:
            return
        fused = {prefix + name for name in self._parameters}
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in fused]
        incompatible.missing_keys.extend(self.hook.missing_names(prefix))

    # ------------------------------------------------------------------ use

    def to_fused(self) -> FusedExperts:
        """The parameters as a FusedExperts (shared storage)."""
        return FusedExperts(self.prefix, self.spec, {n: p.data for n, p in self.named_parameters(recurse=False)})

    def dequantize(self) -> DequantizedExperts:
        """Float32 weights of every local expert."""
        return self.to_fused().dequantize()

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial MoE output; see `reference_forward`. A correctness reference, not a kernel."""
        return reference_forward(self.dequantize(), self.spec.experts, hidden_states, topk_ids, topk_weights,
                                 self.activation)


def reference_forward(weights: DequantizedExperts, experts: tuple[int, ...], hidden_states: torch.Tensor,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: Activation) -> torch.Tensor:
    """Dequantise-then-matmul MoE over the local experts and the local slice of I.

    A correctness reference, not a kernel: float32 math, one matmul per expert.
    Summing the outputs of every TP x EP rank (all_reduce sum) gives the
    unsharded layer, since gate/up are column- and down row-parallel along I.

    | hidden_states | [T, H]          | topk_ids | [T, k] global expert ids |
    | w13           | [E_l, 2*I_p, H] | w2       | [E_l, H, I_p]            |
    | topk_weights  | [T, k]          | out      | [T, H] hidden dtype      |
    """
    _check_inputs(weights, hidden_states, topk_ids, topk_weights)
    x = hidden_states.to(torch.float32)
    out = torch.zeros_like(x)
    part = weights.w2.shape[2]
    for slot, expert in enumerate(experts):
        token, which = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ weights.w13[slot].T  # [t, 2*I_p]
        y = (activation(h[:, :part]) * h[:, part:]) @ weights.w2[slot].T  # [t, H]
        out.index_add_(0, token, y * topk_weights[token, which].to(torch.float32).unsqueeze(1))
    return out.to(hidden_states.dtype)


def _check_inputs(weights: DequantizedExperts, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> None:
    hidden = weights.w13.shape[2]
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise FormatError(f"hidden_states: shape {list(hidden_states.shape)} but the experts expect [T, {hidden}].")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
        raise FormatError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
                          f"[T, k] with T = {hidden_states.shape[0]} tokens.")


# ---------------------------------------------------------------------- model level

def experts_modules(model: nn.Module) -> dict[str, FusedMoEExperts]:
    """Every FusedMoEExperts of `model`, by experts prefix (error when a prefix repeats)."""
    found: dict[str, FusedMoEExperts] = {}
    for path, module in model.named_modules():
        if isinstance(module, FusedMoEExperts):
            if module.prefix in found:
                raise LayoutMismatchError(f"{path}: a second FusedMoEExperts for experts prefix {module.prefix!r}; "
                                          f"each layer needs one module with its own prefix.")
            found[module.prefix] = module
    return found


def install_load_hook(model: nn.Module) -> list[FusedMoEExperts]:
    """Let `model.load_state_dict(sd, strict=False)` take per-expert checkpoint names.

    Afterwards keys like `model.layers.0.mlp.experts.3.gate_proj.qweight` fill the
    fused parameters through the weight loader, and the returned missing/unexpected
    keys name checkpoint tensors: missing = this rank's slots still unfilled,
    unexpected = keys no parameter takes. Tensors of non-local experts are consumed.
    """
    modules = list(experts_modules(model).values())
    if not modules:
        raise CompletenessError(f"{type(model).__name__}: no FusedMoEExperts modules to hook; build them first.")
    for module in modules:
        module.install_load_hook()
    return modules


def check_model_complete(model: nn.Module) -> None:
    """Check every FusedMoEExperts ledger after an engine-driven load; one summary log line per rank."""
    modules = list(experts_modules(model).values())
    problems = [item for module in modules for item in module.ledger_report()]
    if problems:
        raise CompletenessError(f"the expert load is incomplete or inconsistent: {len(problems)} problems\n"
                                f"{format_offenders(problems)}")
    if modules:
        written = sum(m.hook.bytes_written for m in modules)
        rank_logger(modules[0].parallel).info(
            "complete: %d layers, %d local experts, %d tensors taken, %.1f MiB written", len(modules),
            sum(len(m.spec.experts) for m in modules), sum(m.hook.tensors for m in modules), written / 2**20)


def load_model_experts(model: nn.Module, checkpoint_folder: str | Path, parallel: ParallelConfig) -> LoadReport:
    """Fill every FusedMoEExperts of `model` with `parallel`'s share of the checkpoint.

    The same plan and slice reads as `load_experts`: non-local experts are never
    read, each local projection is read as the slice covering the rank's columns
    and written straight into the module's parameters. Every module's ledger must
    end complete; call `reset_load()` on the modules to load them a second time.
    """
    start = time.perf_counter()
    modules = experts_modules(model)
    _check_parallel(modules, parallel)
    if is_presharded(checkpoint_folder):
        return _load_presharded_into(modules, checkpoint_folder, parallel)
    with planned(checkpoint_folder, parallel) as (_, index, scan, plans):
        _check_coverage(modules, plans)
        before = {prefix: (m.hook.tensors, m.hook.bytes_written) for prefix, m in modules.items()}
        for plan in plans:
            modules[plan.prefix].load_plan(index, plan)
        bytes_read = index.bytes_read
    for module in modules.values():
        module.check_complete()
    report = LoadReport.of(plans, scan, tensors=sum(m.hook.tensors - before[p][0] for p, m in modules.items()),
                           bytes_read=bytes_read, start=start,
                           bytes_written=sum(m.hook.bytes_written - before[p][1] for p, m in modules.items()))
    rank_logger(parallel).info("loaded into the model: %s", report)
    return report


def _load_presharded_into(modules: dict[str, FusedMoEExperts], folder: str | Path,
                          parallel: ParallelConfig) -> LoadReport:
    """Fill the modules from a wna16-shard output: the rank's fused tensors, copied as they are."""
    layers = load_experts(folder, parallel)
    problems = [f"output layer {p} has no FusedMoEExperts in the model" for p in sorted(set(layers) - set(modules))]
    problems += [f"module {p} is not in the pre-sharded output" for p in sorted(set(modules) - set(layers))]
    if problems:
        raise CompletenessError(f"{folder}: the model's FusedMoEExperts and the output's MoE layers differ:\n"
                                f"{format_offenders(problems)}")
    for prefix, fused in layers.items():
        modules[prefix].load_fused(fused, source=str(folder))
        modules[prefix].check_complete()
    rank_logger(parallel).info("loaded pre-sharded output into the model: %s", layers.report)
    return layers.report


def _check_parallel(modules: dict[str, FusedMoEExperts], parallel: ParallelConfig) -> None:
    wrong = [f"{prefix}: {m.parallel}" for prefix, m in modules.items() if m.parallel != parallel]
    if wrong:
        raise LayoutMismatchError(f"FusedMoEExperts built for another parallel layout than {parallel}:\n"
                                  f"{format_offenders(wrong)}\nBuild every module with the ParallelConfig you load.")


def _check_coverage(modules: dict[str, FusedMoEExperts], plans: list[LayerPlan]) -> None:
    planned = {plan.prefix for plan in plans}
    problems = [f"checkpoint layer {p} has no FusedMoEExperts in the model" for p in sorted(planned - set(modules))]
    problems += [f"module {p} has no expert tensors in the checkpoint" for p in sorted(set(modules) - planned)]
    if problems:
        raise CompletenessError(f"the model's FusedMoEExperts and the checkpoint's MoE layers differ:\n"
                                f"{format_offenders(problems)}")
