"""Everything the SGLang tier changes about SGLang 0.5.23 to build its MoE layers and run its own weight loaders on
a CPU, with why. None of these touch how a tensor is loaded. Applied once per process by `apply`, before SGLang's
layers are imported."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import sys
import tempfile
from types import ModuleType
from unittest import mock


def apply() -> None:
    """Every process-wide workaround, in one call."""
    # 1. process_weights_after_loading (never run here: it JIT-compiles CUDA) and SGLang's caches write under
    #    SGLANG_CACHE_DIR: a temporary folder, never the user's ~/.cache/sglang.
    os.environ.setdefault("SGLANG_CACHE_DIR", tempfile.mkdtemp(prefix="sglang-tier-"))
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)  # the GPU branches of the loader (`is_cpu()` False)
    _triton_stub()
    _no_torchvision()
    _pretend_hopper()
    _rope_as_on_cpu()
    fuse_shared_experts_as_on_hopper()
    _awq_marlin_as_on_hopper()
    _compressed_tensors_as_on_hopper()


def _platform_stubs() -> ModuleType:
    """sglang/_platform_stubs.py, loaded from its file without importing the `sglang` package (whose
    __init__ imports triton)."""
    if "sglang._platform_stubs" not in sys.modules:
        origin = importlib.util.find_spec("sglang").submodule_search_locations[0]
        spec = importlib.util.spec_from_file_location("sglang._platform_stubs", f"{origin}/_platform_stubs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["sglang._platform_stubs"]


def _triton_stub() -> None:
    """2. SGLang imports triton at module level everywhere (utils/common.py:91). The tier installs no triton
    (its wheel bundles CUDA compilers, ~1 GB; nothing here runs a kernel), so triton is SGLang's own stub for
    Apple's MPS (`install_platform_stubs`: kernels defined, never compiled), installed by answering its
    platform gates as on an M-series Mac. What else it installs patches `torch.mps` attributes and copies to an
    "mps" device only, neither of which a CPU run touches."""
    import torch

    stubs = _platform_stubs()
    with mock.patch.object(sys, "platform", "darwin"), mock.patch.object(platform, "machine", lambda: "arm64"), \
            mock.patch.object(torch.backends.mps, "is_available", lambda: True):
        stubs.install_platform_stubs()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `torchvision` and its submodules as SGLang's own mock modules."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _platform_stubs()._MockModule(spec.name)

    def exec_module(self, module):
        return None


def _no_torchvision() -> None:
    """3. sglang.srt.configs imports every model config, and two of them (nano_nemotron_vl through
    multimodal/internvl_utils.py, deepseek_ocr) import torchvision at module level. A CPU torchvision wheel for
    torch 2.13 is not on the index the tier installs from (an unpinned one pulls a CUDA torch), so torchvision
    is SGLang's own catch-all mock module (`sglang._platform_stubs._MockModule`). transformers' cached
    `is_torchvision_available()` is asked first, so that transformers goes on without torchvision."""
    from transformers.utils import import_utils

    for probe in ("is_torchvision_available", "is_torchvision_v2_available"):
        getattr(import_utils, probe, lambda: False)()
    sys.meta_path.insert(0, _StubFinder())


def _pretend_hopper() -> None:
    """4. A CPU has no device capability ((None, None)): moe_wna16 with AWQ then multiplies None
    (moe_wna16.py:99) and AWQ Marlin refuses "device_capability = -1" (marlin_utils.py:158). Both answer as on
    an H100 (9.0), the capability those methods are served on."""
    from sglang.srt.layers.quantization import marlin_utils, moe_wna16

    moe_wna16.get_device_capability = marlin_utils.get_device_capability = lambda *args, **kwargs: (9, 0)


def _rope_as_on_cpu() -> None:
    """5. RotaryEmbedding (built by every attention layer of a whole model) takes a fallback kernel on a device
    it does not recognise, `vllm._custom_ops.rotary_embedding` (rotary_embedding/base.py:138), and vLLM is not
    installed: it answers as on SGLang's CPU backend (its native RoPE). RoPE holds no checkpoint weights."""
    from sglang.srt.layers.rotary_embedding import base

    base._is_cpu = True


def fuse_shared_experts_as_on_hopper() -> None:
    """6. SGLang fuses DeepSeek-V3/R1's shared expert into the routed MoE layer on CUDA of capability >= 8.0
    (`DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason`, read by `resolve_shared_experts_config` before
    the model is built). While that check runs, and only then, the platform answers as an H100 (CUDA, 9.0); its
    other checks (architecture, expert counts, quantization, EP, backend) are SGLang's own."""
    import torch
    from sglang.srt.models import deepseek_v2

    model = deepseek_v2.DeepseekV2ForCausalLM
    check = model.shared_experts_fusion_disable_reason.__func__

    def as_on_hopper(cls, hf_config, quant_config):
        with mock.patch.object(deepseek_v2, "_is_cuda", True), \
                mock.patch.object(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0)):
            return check(cls, hf_config, quant_config)

    model.shared_experts_fusion_disable_reason = classmethod(as_on_hopper)


def _awq_marlin_as_on_hopper() -> None:
    """8. A whole AWQ model is served with AWQ Marlin where SGLang finds it convertible
    (`AWQMarlinConfig.override_quantization_method`), which asks `is_awq_marlin_compatible`: False off CUDA. While
    that check runs, and only then, the platform answers as CUDA (its Marlin checks then ask the capability,
    answered by 4.)."""
    from sglang.srt.layers.quantization.awq import awq

    check = awq.AWQMarlinConfig.is_awq_marlin_compatible.__func__

    def as_on_hopper(cls, quant_config):
        with mock.patch.object(awq, "_is_cuda", True):
            return check(cls, quant_config)

    awq.AWQMarlinConfig.is_awq_marlin_compatible = classmethod(as_on_hopper)


def _compressed_tensors_as_on_hopper() -> None:
    """9. A whole compressed-tensors model's linear layers ask `CompressedTensorsConfig._check_scheme_supported`,
    which reads `torch.cuda.get_device_capability()` (an error without CUDA). While that check runs, and only then,
    the capability answers as an H100's (9.0)."""
    import torch
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    check = CompressedTensorsConfig._check_scheme_supported

    def as_on_hopper(self, *args, **kwargs):
        with mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)):
            return check(self, *args, **kwargs)

    CompressedTensorsConfig._check_scheme_supported = as_on_hopper


def per_rank_shared_slots() -> None:
    """7. With DeepEP-class and MegaMoE all-to-all backends SGLang gives every EP rank its own fused shared slots
    (`uses_per_rank_fused_shared_slots`). Those backends need their CUDA libraries to be built, so the backend's
    answer is given instead, in every module that asked it: yes."""
    from sglang.srt.layers.moe import topk, utils
    from sglang.srt.layers.moe.fused_moe_triton import layer
    from sglang.srt.models import deepseek_v2

    def per_rank(num_shared: int) -> bool:
        return num_shared > 0

    for module in (utils, topk, layer, deepseek_v2):
        for name, answer in (("uses_per_rank_fused_shared_slots", lambda: True),
                             ("has_per_rank_fused_shared_slots", per_rank)):
            if hasattr(module, name):
                setattr(module, name, answer)


def init_parallel(world_size: int, rank: int, init_method: str, *, ep: bool, **server_args) -> None:
    """SGLang's distributed state over gloo for rank `rank` of `world_size` (TP `world_size`, MoE EP
    `world_size` when `ep`; `server_args`: more of SGLang's ServerArgs, e.g. enforce_shared_experts_fusion), as
    sglang/test/layer_ut_utils.py sets it up (inlined: sglang.test.test_utils imports sglang.benchmark, which
    needs `datasets`)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                 distributed_init_method=init_method, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=world_size, ep_size=world_size if ep else 1,
                       device="cpu", **server_args), role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)  # the WORLD group the reset dropped
    initialize_model_parallel(backend="gloo")
