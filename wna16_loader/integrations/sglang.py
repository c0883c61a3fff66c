"""SGLang model-loader plugin: `--load-format wna16` fills every `FusedMoE` layer's expert parameters in place, in
the layout of the MoE method SGLang picked for that layer, and the rest of the model through SGLang's own
`load_weights`. No `--quantization` flag is needed.

Registered by the `sglang.srt.plugins` entry point (`register`), pinned to SGLang 0.5.23 (see
requirements/sglang-cpu.txt), through SGLang's own extension points: `add_load_format_choices` (the CLI accepts
`wna16`) and an AROUND hook on `LoadConfig._verify_load_format` (its closed `LoadFormat` enum would refuse the
string) that turns `wna16` into `WNA16ModelLoader`, a class `get_model_loader` instantiates as it is. The folder
is a checkpoint folder (each rank reads only its slices of the expert tensors) or a `wna16-shard --layout fused`
output (each rank reads only its own files and `common/`).

| SGLang MoE method (layer.scheme, else quant_method) | its parameters, declared in / loaded by             |
|----------------------------------------------------|-----------------------------------------------------|
| see `METHOD_LAYOUTS`                                | `wna16_loader.layouts.sglang` (one row each)        |
| every other parameter                               | SGLang's `model.load_weights`, non-expert tensors   |

After the load SGLang runs its own `process_weights_after_loading` as usual. `--startup-weight-load-mode overlap`
is refused by name (`WNA16ModelLoader.commit_model_weights`; SGLang refuses it first, "DefaultModelLoader only").
Layers where SGLang fused a family's shared experts (DeepSeek-V3/R1) get them too (`load.shared`). Importing this
module imports SGLang; `import wna16_loader` never does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..layouts import AUTO_AWQ, CT_WNA16_K_MAJOR, GPTQ_MARLIN, MOE_WNA16, UNQUANTIZED, MethodLayout
from ..load.inplace import FillReport, LayerTarget
from ..parallel.config import ParallelConfig
from ..storage.hub import resolve_checkpoint
from .fill import common_weights, fill_model, moe_layers

try:
    from sglang.srt.arg_groups.choices import add_load_format_choices
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import get_world_group
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.awq.schemes.awq_moe import AWQMoEScheme
    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe import (
        CompressedTensorsWNA16MoE, CompressedTensorsWNA16TritonMoE)
    from sglang.srt.layers.quantization.gptq.schemes.gptq_moe import GPTQMarlinMoEScheme
    from sglang.srt.layers.quantization.moe_wna16 import MoeWNA16Method
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
    from sglang.srt.model_loader import loader as sglang_loader
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.model_loader.utils import set_default_torch_dtype
except ImportError as exc:  # the plugin is only imported by SGLang itself, or by a user who has it
    raise ImportError("wna16_loader.integrations.sglang is the SGLang plugin and needs SGLang (tested with "
                      "sglang==0.5.23, see requirements/sglang-cpu.txt); the rest of wna16_loader does not") from exc

LOAD_FORMAT = "wna16"
# SGLang's MoE method class -> the row declaring its parameters: the one place a method is told apart.
METHOD_LAYOUTS: dict[type, MethodLayout] = {
    MoeWNA16Method: MOE_WNA16,
    GPTQMarlinMoEScheme: GPTQ_MARLIN,
    AWQMoEScheme: AUTO_AWQ,
    CompressedTensorsWNA16MoE: CT_WNA16_K_MAJOR,
    CompressedTensorsWNA16TritonMoE: CT_WNA16_K_MAJOR,
    UnquantizedFusedMoEMethod: UNQUANTIZED,
}
VERIFY_LOAD_FORMAT = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"
# the static method a model class renames checkpoint names with before its load_weights looks them up (deepseek_v4.py)
REMAP_WEIGHT_NAME = "remap_weight_name_to_dpsk_hf_format"


def register() -> None:
    """The `sglang.srt.plugins` entry point: `--load-format wna16` accepted by the CLI and `LoadConfig`, which
    then holds `WNA16ModelLoader` (SGLang's `load_plugins` applies the hook after every plugin ran)."""
    add_load_format_choices([LOAD_FORMAT])
    HookRegistry.register(VERIFY_LOAD_FORMAT, wna16_load_format, HookType.AROUND)


def wna16_load_format(verify, config, *args, **kwargs):
    """AROUND `LoadConfig._verify_load_format`: `wna16` becomes the loader class (which SGLang's own check
    leaves alone); any other format goes to SGLang's check."""
    if isinstance(config.load_format, str) and config.load_format.lower() == LOAD_FORMAT:
        config.load_format = WNA16ModelLoader
    return verify(config, *args, **kwargs)


class WNA16ModelLoader(sglang_loader.DefaultModelLoader):
    """SGLang's default loader, except that routed-expert parameters are filled by `fill_layers`."""

    def download_model(self, model_config: ModelConfig) -> None:
        resolve_checkpoint(model_config.model_path, revision=model_config.revision)

    def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        model = self.initialize_model_for_startup(model_config=model_config, device_config=device_config)
        with set_default_torch_dtype(model_config.dtype):
            self.load_into(model, model_config, torch.device(device_config.device))
        return model.eval()

    def commit_model_weights(self, *, model: nn.Module, **_: object) -> None:
        """SGLang's `--startup-weight-load-mode overlap` second step (real weights into a model whose parameters
        its `process_weights_after_loading` already re-laid once, on sentinel values, for CUDA-graph capture):
        refused by name. The expert parameters are filled in the layout SGLang's MoE method allocates, before that
        step; SGLang 0.5.23 itself admits overlap for its own DefaultModelLoader and unquantized models only."""
        raise ConfigError(f"--startup-weight-load-mode overlap: --load-format {LOAD_FORMAT} fills the MoE layers "
                          f"of {type(model).__name__} before SGLang's process_weights_after_loading, and overlap "
                          f"runs that step first; serve with --startup-weight-load-mode serial (the default)")

    def load_into(self, model: nn.Module, model_config: ModelConfig, target_device: torch.device) -> None:
        """The experts in place, every other tensor through SGLang's load_weights, then its post-processing."""
        folder = resolve_checkpoint(model_config.model_path, revision=model_config.revision)
        report = load_experts_into(model, folder)
        self.load_weights_and_postprocess(model, common_weights(folder, report.ignored, report.shared), target_device)


def load_experts_into(model: nn.Module, folder: Path) -> FillReport:
    """Fill every MoE layer of `model` from `folder`, in place, in its method's layout."""
    layers = expert_layers(model)
    return fill_model(folder, "SGLang", layers, layer_target, parallel_of(next(iter(layers.values()))),
                      layer_name_of(model), world_group=get_world_group().cpu_group)


def layer_name_of(model: nn.Module) -> Callable[[str], str]:
    """A checkpoint experts prefix -> the SGLang layer name: renamed as the model's own load_weights renames every
    checkpoint name where its class declares that renaming (DeepSeek-V4's static `remap_weight_name_to_dpsk_hf_format`:
    `layers.L.ffn.experts` -> `model.layers.L.mlp.experts`), else as it is."""
    return getattr(type(model), REMAP_WEIGHT_NAME, str)


def expert_layers(model: nn.Module) -> dict[str, FusedMoE]:
    """SGLang layer name -> every `FusedMoE` module of the model (its MoE layers)."""
    return moe_layers(model, FusedMoE, "SGLang")


def method_of(layer: FusedMoE) -> object:
    """The object whose parameters the layer holds: its scheme where its method delegates to one (as SGLang's
    own weight loader asks), else its method."""
    scheme = getattr(layer, "scheme", None)
    return scheme if scheme is not None else layer.quant_method


def layer_target(layer: FusedMoE) -> LayerTarget:
    """The layout row of the method SGLang chose for `layer`, its parameters, the routed experts of its slots and
    its fused shared-expert slots: SGLang stores them after the rank's routed experts on every rank, one per
    shared expert (`FusedMoE._map_global_expert_id_to_local_expert_id` maps shared id `num_global_routed + i` to
    slot `num_local_routed + i`; with per-rank slots (DeepEP-class and MegaMoE backends) each rank's own are
    there too), split by the layer's MoE TP as a routed expert is."""
    method = method_of(layer)
    layout = METHOD_LAYOUTS.get(type(method))
    if layout is None:
        known = ", ".join(cls.__name__ for cls in METHOD_LAYOUTS)
        raise ConfigError(f"{layer.layer_name}: SGLang chose the MoE method {type(method).__name__}, whose "
                          f"parameters --load-format {LOAD_FORMAT} does not fill (it fills {known}); load this "
                          f"model with SGLang's default --load-format")
    return LayerTarget.of(layout, layer, layer._map_global_expert_id_to_local_expert_id,
                          layer.num_global_routed_experts, shared_slots=layer.num_fused_shared_experts)


def parallel_of(layer: FusedMoE) -> ParallelConfig:
    """The rank of `layer` as SGLang placed it (its MoE TP and EP sizes and ranks; experts placed linearly)."""
    return ParallelConfig(tp_size=layer.moe_tp_size, tp_rank=layer.moe_tp_rank, ep_size=layer.moe_ep_size,
                          ep_rank=layer.moe_ep_rank)
