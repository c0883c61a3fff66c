"""One rank of the SGLang suite, a process of its own: `python scripts/bench/sglang_rank.py SPEC.json RANK`.
Joins the group's gloo process group as the SGLang tier does (tests_sglang/workarounds.py: CPU stand-ins for
triton and torchvision, an H100's capability for Marlin's checks, none of which touches how a tensor is loaded),
builds the model with SGLang's own `get_model_loader(...).load_model` (the spec's `--load-format` and
`--quantization`), and writes what
it measured to OUT/rank{R}.json: the load's seconds after the model's parameters exist (SGLang's weights loaded,
its default `load_weights` or the plugin's fill), bytes from storage (/proc/self/io read_bytes), the parameters'
bytes and the anonymous memory the load added at its peak (RssAnon sampled every 5 ms, as vllm_rank.py samples
it). SGLang's process_weights_after_loading (its Marlin repack, CUDA code) is left out, as the tier leaves it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests_sglang"), str(Path(__file__).parent)]

import workarounds  # noqa: E402  (the SGLang tier's, imported before vllm_rank puts the vLLM tier's on the path)
from vllm_rank import Peaks, proc_io, proc_status  # noqa: E402  (engine-neutral measurements)


def join_group(spec: dict, rank: int) -> None:
    """This process as rank `rank` of SGLang's group: --tp-size `ranks`, --ep-size `ranks` when `ep`."""
    workarounds.apply()
    workarounds.init_parallel(spec["ranks"], rank, spec["init_method"], ep=spec["ep"])


def load_measured(spec: dict) -> dict:
    """SGLang's load_model of the folder, timed from the end of the model's initialisation, memory sampled."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as every SGLang process does: the entry point registers --load-format wna16
    model_config = ModelConfig(model_path=spec["folder"], dtype="float16", quantization=spec["quantization"])
    chosen = loader.get_model_loader(load_config=LoadConfig(load_format=spec["load_format"]), model_config=model_config)
    loader.DefaultModelLoader.postprocess_weights = staticmethod(lambda model, target_device: None)
    initialize, measured = loader._initialize_model, {}

    def initialized(*args, **kwargs):  # the parameters exist: the load starts now
        model = initialize(*args, **kwargs)
        measured.update(param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                        start=time.perf_counter(), before=proc_status()["RssAnon"], io=proc_io())
        return model

    loader._initialize_model = initialized
    with Peaks() as peaks:
        chosen.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    end, io = time.perf_counter(), proc_io()
    return {"param_bytes": measured["param_bytes"], "load_weights_s": end - measured["start"],
            "anon_added": (peaks.anon - measured["before"]) * 1024,
            **{key: io[key] - measured["io"][key] for key in io}}


def main(spec_file: str, rank_arg: str) -> None:
    spec, rank = json.loads(Path(spec_file).read_text()), int(rank_arg)
    join_group(spec, rank)
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(load_measured(spec)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
