"""One rank of the SGLang tier's serve-verdict jobs (a process of its own, started by `tier.run_group`).

    python serve_rank.py JOBS.json RANK

JOBS.json: {"tp", "ep", "init_method", "out", "jobs": [{"kind": "serve", "name", "folder", "quantization"}]}: SGLang
builds the whole model of `folder` (a `wna16-shard` output) as `sglang serve --model-path FOLDER --load-format wna16
[--quantization Q]` does (`ModelConfig`, `get_model_loader(...).load_model`, after `load_plugins()`), and the job's
result is the MoE method of each of its MoE layers (the plugin's METHOD_LAYOUTS row name), or SGLang's error.
SGLang's `process_weights_after_loading` (CUDA code) is not run (sglang_rank.loaded_parameters).

Two of SGLang's checks ask CUDA itself, and answer as on a GPU here, as the verdict describes one (`as_on_a_gpu`):
its AWQ config builds Marlin methods on CUDA only (`awq.py`'s `_is_cuda`), and compressed-tensors checks each
scheme's minimum capability with `torch.cuda.get_device_capability()` (an H100's 9.0 here, as
workarounds.apply answers moe_wna16's and Marlin's). Nothing else differs from the tier's layer and model jobs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tier  # tests_vllm/tier.py: the engine-neutral runner
import workarounds
from sglang_rank import loaded_parameters


def as_on_a_gpu() -> None:
    """SGLang's AWQ Marlin config is chosen on CUDA only, and compressed-tensors asks CUDA for the capability of
    each scheme: both answer as on an H100 (see the module docstring)."""
    from sglang.srt.layers.quantization.awq import awq
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    awq._is_cuda = True

    def on_hopper(self, min_capability: int, error: bool = True) -> bool:
        if min_capability > 90 and error:
            raise RuntimeError(f"a scheme needing capability {min_capability} is built on an H100 here (90)")
        return min_capability <= 90

    CompressedTensorsConfig._check_scheme_supported = on_hopper


def serve_job(job: dict) -> dict[str, str]:
    """Each MoE layer's method row as SGLang built the whole model with --load-format wna16 (see the docstring)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader
    from sglang.srt.plugins import load_plugins

    from wna16_loader.integrations import sglang as plugin

    load_plugins()
    model_config = ModelConfig(model_path=job["folder"], dtype="float16", quantization=job["quantization"])
    chosen = loader.get_model_loader(load_config=LoadConfig(load_format="wna16"), model_config=model_config)
    with loaded_parameters(loader):
        model = chosen.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    return {name: plugin.METHOD_LAYOUTS[type(plugin.method_of(layer))].name
            for name, layer in plugin.expert_layers(model).items()}


def main(jobs_file: str, rank_arg: str) -> None:
    spec, rank = json.loads(Path(jobs_file).read_text()), int(rank_arg)
    workarounds.apply()
    as_on_a_gpu()
    workarounds.init_parallel(spec["tp"], rank, spec["init_method"], ep=spec["ep"])
    for job in spec["jobs"]:
        tier.run_job(job, Path(spec["out"]), rank, serve_job)


if __name__ == "__main__":
    main(*sys.argv[1:])
