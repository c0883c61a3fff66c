"""vLLM model-loader plugin: `--load-format wna16` fills every `FusedMoE` layer's expert parameters in place,
in the layout of the MoE method vLLM picked for that layer, and the rest of the model through vLLM's own
`load_weights`. No `--quantization` flag is needed.

Registered by the `vllm.general_plugins` entry point (`register`); tested with the vLLM versions of
`layouts.serving_vllm.TESTED_VLLM` (0.32.0 and 0.34.0, docs/vllm-versions.md). The folder is a checkpoint folder (each rank reads only its slices of the
expert tensors) or a `wna16-shard --layout fused` output (each rank reads only its own files and `common/`).

| vLLM MoE method (layer.quant_method)  | its parameters, declared in           |
|---------------------------------------|---------------------------------------|
| see `METHOD_LAYOUTS`                  | `wna16_loader.layouts.vllm` (one row each) |
| every other parameter                 | vLLM's `model.load_weights` over the non-expert tensors |

After the load vLLM runs its own `process_weights_after_loading` as usual. Importing this module imports
vLLM; `import wna16_loader` never does.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from torch import nn

from ..errors import ConfigError
from ..layouts import AUTO_AWQ, AUTO_GPTQ, CT_WNA16, MOE_WNA16, UNQUANTIZED, MethodLayout
from ..layouts.serving_vllm import TESTED_VLLM
from ..load.inplace import FillReport, LayerTarget
from ..parallel.config import ExpertPlacement, ParallelConfig
from ..storage.hub import resolve_checkpoint
from .fill import common_weights, fill_model, moe_layers

try:
    from vllm.config import ModelConfig, get_current_vllm_config
    from vllm.distributed.parallel_state import get_world_group
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQMoEMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct_wna16,
    )
    from vllm.model_executor.layers.quantization.moe_wna16 import MoeWNA16Method
    from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader
except ImportError as exc:  # the plugin is only imported by vLLM itself, or by a user who has it
    raise ImportError(f"wna16_loader.integrations.vllm is the vLLM plugin and needs vLLM, one of the tested versions "
                      f"{', '.join(v.version for v in TESTED_VLLM)} (docs/vllm-versions.md); importing what it uses "
                      f"failed: {exc}; the rest of wna16_loader does not need vLLM") from exc

LOAD_FORMAT = "wna16"
# vLLM's MoE method class -> the row declaring its parameters: the one place a method is told apart.
METHOD_LAYOUTS: dict[type, MethodLayout] = {
    MoeWNA16Method: MOE_WNA16,
    AutoGPTQMoEMethod: AUTO_GPTQ,
    AutoAWQMoEMethod: AUTO_AWQ,
    ct_wna16.CompressedTensorsWNA16MoEMethod: CT_WNA16,
    UnquantizedFusedMoEMethod: UNQUANTIZED,
}


def register() -> None:
    """The `vllm.general_plugins` entry point: make `--load-format wna16` choose `WNA16ModelLoader`."""
    register_model_loader(LOAD_FORMAT)(WNA16ModelLoader)


class WNA16ModelLoader(DefaultModelLoader):
    """vLLM's default loader, except that routed-expert parameters are filled by `fill_layers`."""

    def download_model(self, model_config: ModelConfig) -> None:
        resolve_checkpoint(model_config.model, revision=model_config.revision)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        folder = resolve_checkpoint(model_config.model, revision=model_config.revision)
        report = load_experts_into(model, folder)
        model.load_weights(common_weights(folder, report.ignored))


def load_experts_into(model: nn.Module, folder: Path) -> FillReport:
    """Fill every MoE layer of `model` from `folder`, in place, in its method's layout."""
    layers = expert_layers(model)
    return fill_model(folder, "vLLM", layers, layer_target, parallel_of(next(iter(layers.values()))),
                      partial(vllm_name, model), world_group=get_world_group().cpu_group)


def expert_layers(model: nn.Module) -> dict[str, RoutedExperts]:
    """vLLM layer name -> every `RoutedExperts` module of the model (its MoE layers)."""
    return moe_layers(model, RoutedExperts, "vLLM")


def layer_target(layer: RoutedExperts) -> LayerTarget:
    """The layout row of the method vLLM chose for `layer`, its parameters and the experts of its slots."""
    layout = METHOD_LAYOUTS.get(type(layer.quant_method))
    if layout is None:
        known = ", ".join(cls.__name__ for cls in METHOD_LAYOUTS)
        raise ConfigError(f"{layer.layer_name}: vLLM chose the MoE method {type(layer.quant_method).__name__}, "
                          f"whose parameters --load-format {LOAD_FORMAT} does not fill (it fills {known}); load "
                          f"this model with vLLM's default --load-format")
    return LayerTarget.of(layout, layer, layer._map_global_expert_id_to_local_expert_id, layer.global_num_experts)


def parallel_of(layer: RoutedExperts) -> ParallelConfig:
    """The rank of `layer` as vLLM placed it (TP/EP sizes and ranks of its MoE parallel config)."""
    moe_parallel_config = layer.moe_config.moe_parallel_config  # vLLM's flattened DP x PCP x TP / EP ranks
    placement = ExpertPlacement(get_current_vllm_config().parallel_config.expert_placement_strategy)
    return ParallelConfig(tp_size=moe_parallel_config.tp_size, tp_rank=moe_parallel_config.tp_rank,
                          ep_size=moe_parallel_config.ep_size, ep_rank=moe_parallel_config.ep_rank,
                          expert_placement=placement)


def vllm_name(model: nn.Module, prefix: str) -> str:
    """The vLLM layer name of a checkpoint experts prefix (through the model's `hf_to_vllm_mapper`)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return mapper.map_name(prefix) if mapper is not None else prefix
