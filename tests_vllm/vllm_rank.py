"""One rank of a vLLM TP group (a process of its own, started by `tier.run_group`).

    python vllm_rank.py JOBS.json RANK

JOBS.json: {"tp", "ep", "init_method", "out", "jobs": [...]} (ep: vLLM's enable_expert_parallel, so the MoE
layers are EP tp-way with MoE TP 1); a job is either
- {"kind": "layer", "name", "folder", "method", "prefix", "experts", "hidden", "intermediate", "top_k",
   "ckpt_names"}: vLLM builds one `FusedMoE` layer with `get_quantization_config(method).from_config(...)`,
   loads the checkpoint's expert tensors through `runner.load_weights` (vLLM's weight loaders) and runs its
   `process_weights_after_loading`; or
- {"kind": "model", "name", "folder", "load_format"}: vLLM builds and loads the whole model (`get_model`,
   `job["quantization"]`, default: none, as `vllm serve` picks from the checkpoint).
Each job writes OUT/NAME/rank{R}.safetensors (every parameter) or OUT/NAME/rank{R}.json (vLLM's error).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

import tier
import workarounds

# vLLM's compressed-tensors method names its fused parameters apart; after its Triton conversion their
# contents are in the moe_wna16 layout. moe_wna16 name -> compressed-tensors name.
CT_NAMES = {"w13_qweight": "w13_weight_packed", "w2_qweight": "w2_weight_packed", "w13_scales": "w13_weight_scale",
            "w2_scales": "w2_weight_scale", "w13_qzeros": "w13_weight_zero_point", "w2_qzeros": "w2_weight_zero_point"}


def layer_job(job: dict) -> dict[str, torch.Tensor]:
    """One MoE layer built by vLLM with the method `job["method"]` picks for it: every parameter as the
    loader left it ("loaded." names; `job["loader"]`: "default", vLLM's weight loaders over the checkpoint's
    expert tensors, or "plugin", the plugin's in-place fill), then, where vLLM's backend can prepare the
    weights here (`workarounds.processes_layer`), its fused parameters after process_weights_after_loading
    under the moe_wna16 names (compressed-tensors' converted to that layout)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.quantization import get_quantization_config

    folder = Path(job["folder"])
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    runner = FusedMoEFactory(num_experts=job["experts"], top_k=job["top_k"], hidden_size=job["hidden"],
                             intermediate_size=job["intermediate"], params_dtype=getattr(torch, job.get("dtype", "float16")),
                             quant_config=get_quantization_config(job["method"]).from_config(config),
                             prefix=job["prefix"], ckpt_names=tuple(job["ckpt_names"]))
    layer = runner.routed_experts
    for param in layer.parameters():  # a sentinel: a parameter no loader writes compares equal, not as garbage
        param.data.view(torch.uint8).fill_(0x5A)
    (plugin_fill if job.get("loader") == "plugin" else default_fill)(runner, job, folder, config)
    tensors = {f"loaded.{name}": p.data.clone() for name, p in layer.named_parameters()}
    tensors["loaded.method"] = torch.tensor(list(type(layer.quant_method).__name__.encode()), dtype=torch.uint8)
    if not workarounds.processes_layer(layer):
        return tensors
    layer.quant_method.process_weights_after_loading(layer)
    params = dict(layer.named_parameters())
    for ours, ct in CT_NAMES.items():
        param = params.get(ct, params.get(ours))
        if param is not None and param.numel() > 0:  # symmetric GPTQ: moe_wna16 registers empty qzeros
            tensors[ours] = param.data
    return tensors


def node_job(job: dict) -> dict[str, torch.Tensor]:
    """The plugin's fill of one layer (as `layer_job` builds it) from a cold checkpoint: rank 0 evicts its files,
    every rank waits for that, then fills; what this rank read from storage (/proc/self/io read_bytes), the
    node's window (FillReport.window_bytes) and what rank 0 found still resident after the eviction."""
    import torch.distributed as dist
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.quantization import get_quantization_config

    from wna16_loader.integrations import vllm as plugin

    folder = Path(job["folder"])
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    runner = FusedMoEFactory(num_experts=job["experts"], top_k=job["top_k"], hidden_size=job["hidden"],
                             intermediate_size=job["intermediate"], params_dtype=torch.float16,
                             quant_config=get_quantization_config(job["method"]).from_config(config),
                             prefix=job["prefix"], ckpt_names=tuple(job["ckpt_names"]))
    model = torch.nn.Module()
    model.experts = runner.routed_experts
    resident = evicted(sorted(folder.glob("*.safetensors"))) if dist.get_rank() == 0 else 0
    dist.barrier()
    before = read_bytes()
    report = plugin.load_experts_into(model, folder)
    return {"storage": torch.tensor([read_bytes() - before]), "window": torch.tensor([report.window_bytes]),
            "resident": torch.tensor([resident])}


def read_bytes() -> int:
    lines = Path("/proc/self/io").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith("read_bytes:"))


def evicted(files: list[Path]) -> int:
    """Write back and drop the files' pages (POSIX_FADV_DONTNEED); the bytes still resident (mincore)."""
    import ctypes
    import mmap
    import os

    os.sync()
    libc, left = ctypes.CDLL(None, use_errno=True), 0
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        os.close(fd)
        anchor = ctypes.c_char.from_buffer(mapped)
        vector = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector)
        del anchor
        mapped.close()
        left += size if failed else sum(v & 1 for v in vector) * mmap.PAGESIZE
    return left


def default_fill(runner, job: dict, folder: Path, config: dict) -> None:
    """vLLM's own weight loaders over the checkpoint's expert tensors of the layer."""
    head = job["prefix"] + "."
    weights = [(name[len(head):], t) for name, t in load_file(str(folder / "model.safetensors")).items()
               if name.startswith(head)]
    list(runner.load_weights(workarounds.drop_trivial_g_idx(weights, config.get("group_size", -1))))


def plugin_fill(runner, job: dict, folder: Path, config: dict) -> None:
    """The plugin's in-place fill of the layer, from the checkpoint folder or a wna16-shard output
    (`job["source"]`, default the folder)."""
    from wna16_loader.integrations import vllm as plugin

    model = torch.nn.Module()  # the plugin's own path over a model whose one MoE layer this is
    model.experts = runner.routed_experts
    plugin.load_experts_into(model, Path(job.get("source", folder)))


def model_job(job: dict) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model as vLLM's load (`job["load_format"]`: auto or wna16) left it
    before its `process_weights_after_loading` (names as they are), and after it where vLLM's MoE backend
    can run on this CPU (`workarounds.processes_moe_weights`; names prefixed "processed.")."""
    from vllm.model_executor.model_loader import base_loader

    loaded: dict[str, torch.Tensor] = {}
    process = base_loader.process_weights_after_loading

    def probe(model, model_config, target_device):  # what the loader wrote, then vLLM's own processing
        loaded.update({name: p.data.clone() for name, p in model.named_parameters()})
        if workarounds.processes_moe_weights():
            process(model, model_config, target_device)

    base_loader.process_weights_after_loading = probe
    try:
        model = build_model(job)
    finally:
        base_loader.process_weights_after_loading = process
    if workarounds.processes_moe_weights():
        loaded.update({f"processed.{name}": p.data for name, p in model.named_parameters()})
    return {name: t.contiguous() for name, t in loaded.items()}


def serve_job(job: dict) -> dict[str, str]:
    """The MoE method class vLLM built each MoE layer with, after the whole model loaded as `model_job`'s
    (vLLM's own processing left out: no forward is run)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader import base_loader

    process = base_loader.process_weights_after_loading
    base_loader.process_weights_after_loading = lambda *args: None
    workarounds.any_linear_kernel()
    try:
        model = build_model(job)
    finally:
        base_loader.process_weights_after_loading = process
    return {m.layer_name: type(m.quant_method).__name__ for m in model.modules() if isinstance(m, RoutedExperts)}


def build_model(job: dict):
    """vLLM's model of `job["folder"]`, loaded with `job["load_format"]` and `job["quantization"]` (None: none)."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as every vLLM process does: our entry point registers --load-format wna16
    model_config = ModelConfig(model=job["folder"], quantization=job.get("quantization"), dtype="float16",
                               skip_tokenizer_init=True, enforce_eager=True)
    config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format=job["load_format"]),
                        device_config=DeviceConfig("cpu"), parallel_config=current_parallel())
    with set_current_vllm_config(config):  # replaces the job's fresh config: this one names the model
        return get_model(vllm_config=config)


def current_parallel():
    from vllm.config import ParallelConfig, get_current_vllm_config

    current = get_current_vllm_config().parallel_config
    return ParallelConfig(tensor_parallel_size=current.tensor_parallel_size,
                          enable_expert_parallel=current.enable_expert_parallel)


def main(jobs_file: str, rank_arg: str) -> None:
    spec, rank = json.loads(Path(jobs_file).read_text()), int(rank_arg)
    workarounds.apply(f"wna16-tier-{spec['tp']}-{spec.get('ep', False)}-{rank}")
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    tp, ep = spec["tp"], spec.get("ep", False)

    def fresh():  # one config per job: vLLM registers every layer name in the current config, once
        parallel = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep)
        return set_current_vllm_config(VllmConfig(parallel_config=parallel))

    with fresh():
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                     distributed_init_method=spec["init_method"], backend="gloo")
        initialize_model_parallel(tp)
    for job in spec["jobs"]:
        with fresh():
            tier.run_job(job, Path(spec["out"]), rank, JOBS[job["kind"]])


JOBS = {"layer": layer_job, "model": model_job, "serve": serve_job, "node": node_job}


if __name__ == "__main__":
    main(*sys.argv[1:])
