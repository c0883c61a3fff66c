"""One rank of an SGLang group (a process of its own, started by `tier.run_group`).

    python sglang_rank.py JOBS.json RANK

JOBS.json: {"tp", "ep", "init_method", "out", "jobs": [...]} (ep: SGLang's MoE layers EP `tp`-way, MoE TP 1);
a job is either
- {"kind": "layer", "name", "folder", "method", "prefix", "experts", "hidden", "intermediate", "top_k",
   "ckpt_names", "loader", "dtype"[, "source"]}: SGLang builds one `FusedMoE` layer with
   `get_quantization_config(method).from_config(...)` and fills it with its own weight loader over the
  checkpoint's expert tensors (loader "default", as its models' load_weights call it) or with the plugin
  (loader "plugin", from the folder or from `source`, a wna16-shard output); or
- {"kind": "model", "name", "folder", "load_format"[, "quantization"]}: SGLang builds and loads the whole model
  (`get_model_loader(...).load_model`, with `load_plugins()` run first, as every SGLang process does; with
  SGLang's --quantization where given), and records each MoE layer's fused shared experts and method.
JOBS.json may also hold "server_args" (more of SGLang's ServerArgs for every job, e.g.
enforce_shared_experts_fusion) and "per_rank_slots" (the all-to-all backend's answer: per-rank fused shared slots,
`workarounds.per_rank_shared_slots`).
Every parameter is kept as the loader left it: SGLang's `process_weights_after_loading` compiles CUDA code and is
not run. Each job writes OUT/NAME/rank{R}.safetensors (every parameter) or OUT/NAME/rank{R}.json (SGLang's error),
through the vLLM tier's `tier.run_job`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file

import tier  # tests_vllm/tier.py: the engine-neutral runner
import workarounds


def layer_job(job: dict) -> dict[str, torch.Tensor]:
    """One MoE layer built by SGLang with the method `job["method"]` picks for it: every parameter as the loader
    left it ("loaded." names), and the method's class name ("loaded.method")."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization import get_quantization_config

    folder = Path(job["folder"])
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    layer = FusedMoE(num_experts=job["experts"], hidden_size=job["hidden"], intermediate_size=job["intermediate"],
                     layer_id=0, top_k=job["top_k"], params_dtype=getattr(torch, job["dtype"]), prefix=job["prefix"],
                     quant_config=get_quantization_config(job["method"]).from_config(config))
    for param in layer.parameters():  # a sentinel: a parameter no loader writes compares equal, not as garbage
        param.data.view(torch.uint8).fill_(0x5A)
    (plugin_fill if job["loader"] == "plugin" else default_fill)(layer, job, folder)
    from wna16_loader.integrations.sglang import method_of

    tensors = {f"loaded.{name}": p.data.clone() for name, p in layer.named_parameters()}
    tensors["loaded.method"] = torch.tensor(list(type(method_of(layer)).__name__.encode()), dtype=torch.uint8)
    return tensors


def default_fill(layer, job: dict, folder: Path) -> None:
    """SGLang's own weight loader over the layer's expert tensors, called as its models' load_weights call it
    (FusedMoE.make_expert_params_mapping: the checkpoint module name replaced by the fused parameter's)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    gate, down, up = job["ckpt_names"]
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name=gate, ckpt_down_proj_name=down,
                                                  ckpt_up_proj_name=up, num_experts=job["experts"])
    params = {f"{job['prefix']}.{name}": p for name, p in layer.named_parameters()}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if not name.startswith(job["prefix"] + "."):
            continue
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                name = name.replace(weight_name, param_name)
                if name in params:
                    params[name].weight_loader(params[name], tensor, name, shard_id=shard_id, expert_id=expert_id)
                break


def plugin_fill(layer, job: dict, folder: Path) -> None:
    """The plugin's in-place fill of the layer, from the checkpoint folder or a wna16-shard output."""
    from wna16_loader.integrations import sglang as plugin

    model = torch.nn.Module()  # the plugin's own path over a model whose one MoE layer this is
    model.experts = layer
    plugin.load_experts_into(model, Path(job.get("source", folder)))


def model_job(job: dict) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model as SGLang's load (`job["load_format"]`: auto or wna16) left it, before
    its `process_weights_after_loading` (names as they are), and the loader class SGLang chose ("loader")."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as every SGLang process does: our entry point registers --load-format wna16
    model_config = ModelConfig(model_path=job["folder"], dtype="float16", quantization=job.get("quantization"))
    chosen = loader.get_model_loader(load_config=LoadConfig(load_format=job["load_format"]), model_config=model_config)
    with loaded_parameters(loader) as loaded:
        model = chosen.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    loaded["loader"] = text_tensor(type(chosen).__name__)
    loaded.update(moe_record(model))
    return {name: t.contiguous() for name, t in loaded.items()}


def text_tensor(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def moe_record(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each MoE layer's fused shared experts and slots ("moe.NAME.fused_shared": [num_fused_shared_experts,
    num_experts, routed slots on this rank]) and the class of its method ("moe.NAME.method")."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from wna16_loader.integrations.sglang import method_of

    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, FusedMoE):
            out[f"moe.{name}.fused_shared"] = torch.tensor([layer.num_fused_shared_experts, layer.num_experts,
                                                            layer.num_local_experts - layer.num_fused_shared_experts])
            out[f"moe.{name}.method"] = text_tensor(type(method_of(layer)).__name__)
    return out


@contextmanager
def loaded_parameters(loader: ModuleType) -> Iterator[dict[str, torch.Tensor]]:
    """While in it, SGLang's model loaders start every parameter as a sentinel (a parameter no loader writes
    compares equal, not as torch.empty's garbage) and, in place of process_weights_after_loading (which compiles
    CUDA code), copy what the loader wrote into the dict yielded."""
    loaded: dict[str, torch.Tensor] = {}
    process, initialize = loader.DefaultModelLoader.postprocess_weights, loader._initialize_model

    def probe(model, target_device):
        loaded.update({name: p.data.clone() for name, p in model.named_parameters()})

    def with_sentinel(*args, **kwargs):
        model = initialize(*args, **kwargs)
        for param in model.parameters():
            param.data.view(torch.uint8).fill_(0x5A)
        return model

    loader.DefaultModelLoader.postprocess_weights, loader._initialize_model = staticmethod(probe), with_sentinel
    try:
        yield loaded
    finally:
        loader.DefaultModelLoader.postprocess_weights, loader._initialize_model = staticmethod(process), initialize


def main(jobs_file: str, rank_arg: str) -> None:
    spec, rank = json.loads(Path(jobs_file).read_text()), int(rank_arg)
    workarounds.apply()
    if spec.get("per_rank_slots"):
        workarounds.per_rank_shared_slots()
    workarounds.init_parallel(spec["tp"], rank, spec["init_method"], ep=spec["ep"], **spec.get("server_args", {}))
    for job in spec["jobs"]:
        tier.run_job(job, Path(spec["out"]), rank, layer_job if job["kind"] == "layer" else model_job)


if __name__ == "__main__":
    main(*sys.argv[1:])
