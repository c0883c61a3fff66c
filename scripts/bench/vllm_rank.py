"""One rank of the vLLM suite, a process of its own: `python scripts/bench/vllm_rank.py SPEC.json RANK`.
Joins the group's gloo process group as vLLM's CPU worker does (the vLLM tier's CPU workarounds,
tests_vllm/workarounds.py, none of which touches how a tensor is loaded), builds the model with the spec's
LoadConfig and ParallelConfig fields, and writes what it measured to OUT/rank{R}.json: the loader's
load_weights seconds, bytes from storage (/proc/self/io read_bytes) and through read calls (rchar), the
parameters' bytes, the anonymous memory the load added at its peak (RssAnon sampled every 5 ms) and, on a
CUDA device, what it added to torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests_vllm")]


def proc_io() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/io").read_text().splitlines())
    return {key: int(fields[key]) for key in ("rchar", "read_bytes")}


def proc_status() -> dict[str, int]:
    """RSS now (anonymous, file-backed, total) and the total's peak, KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) for key in ("RssAnon", "RssFile", "VmRSS", "VmHWM")}


class Peaks:
    """The peak of RssAnon while it runs (sampled every 5 ms: the kernel keeps no peak of it)."""

    def __init__(self) -> None:
        self.anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.anon = max(self.anon, proc_status()["RssAnon"])
            time.sleep(0.005)

    def __enter__(self) -> "Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def join_group(spec: dict, rank: int):
    """This process as rank `rank` of the group (gloo); its vLLM ParallelConfig (TP size, EP on or off, and
    the spec's other ParallelConfig fields, e.g. enable_ep_weight_filter)."""
    import workarounds

    if spec["device"] == "cpu":
        workarounds.apply(f"wna16-bench-{spec['ranks']}-{rank}")
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from wna16_loader.integrations import vllm as plugin

    plugin.register()  # what vLLM's general-plugin entry point does in a server process
    parallel = ParallelConfig(tensor_parallel_size=spec["ranks"], enable_expert_parallel=spec["ep"],
                              **spec["parallel"])
    with set_current_vllm_config(VllmConfig(parallel_config=parallel)):
        init_distributed_environment(world_size=spec["ranks"], rank=rank, local_rank=rank,
                                     distributed_init_method=spec["init_method"], backend="gloo")
        initialize_model_parallel(spec["ranks"])
    return parallel


def load_measured(spec: dict, parallel) -> dict:
    """vLLM's load_model of the folder, with the loader's load_weights timed and its memory sampled."""
    import torch
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import base_loader, get_model_loader

    model_config = ModelConfig(model=spec["folder"], dtype="float16", skip_tokenizer_init=True, enforce_eager=True)
    load_config = LoadConfig(load_format=spec["load_format"], **spec["load"])
    config = VllmConfig(model_config=model_config, load_config=load_config, device_config=DeviceConfig(spec["device"]),
                        parallel_config=parallel)
    if not spec["process"]:
        base_loader.process_weights_after_loading = lambda model, model_config, target_device: None
    loader, measured, cuda = get_model_loader(load_config), {}, spec["device"] == "cuda"
    inner = loader.load_weights

    def timed(model, model_config):  # vLLM allocated the parameters: the load fills them
        start, before = time.perf_counter(), proc_status()["RssAnon"]
        measured["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated()
        with Peaks() as peaks:
            inner(model, model_config)
        if cuda:
            torch.cuda.synchronize()
            measured["cuda_added"] = torch.cuda.max_memory_allocated() - allocated
        measured.update(load_weights_s=time.perf_counter() - start, anon_added=(peaks.anon - before) * 1024)

    loader.load_weights = timed
    io, start = proc_io(), time.perf_counter()
    with set_current_vllm_config(config):
        loader.load_model(vllm_config=config, model_config=model_config)
    after = proc_io()
    return {**measured, "get_model_s": time.perf_counter() - start, **{key: after[key] - io[key] for key in after}}


def main(spec_file: str, rank_arg: str) -> None:
    spec, rank = json.loads(Path(spec_file).read_text()), int(rank_arg)
    measured = load_measured(spec, join_group(spec, rank))
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(measured))


if __name__ == "__main__":
    main(*sys.argv[1:3])
