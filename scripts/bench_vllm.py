#!/usr/bin/env python3
"""vLLM's model load with its default loader against `--load-format wna16`, per rank, in one run.

The model is a whole Qwen3-MoE (the real Qwen3-30B-A3B config of tests/fixtures/configs/qwen3_moe.json: H 2048,
128 experts of I 768, top-8) cut to --layers decoder layers and a 4096-token vocabulary, GPTQ 4-bit group 128
symmetric as GPTQModel writes it (router kept in float16 by GPTQ's `dynamic`), one safetensors file per
layer; vLLM builds it with no --quantization flag (AutoGPTQMoEMethod for the experts). 4 layers hold 1.2 GB of
experts. Each contender is a vLLM TP group of processes (gloo, CPU), one fresh process per rank and run:

| contender           | vLLM load_config                  | folder                                           |
|---------------------|-----------------------------------|--------------------------------------------------|
| default, checkpoint | load_format auto (vLLM's own)     | the checkpoint                                    |
| wna16, checkpoint   | load_format wna16 (this package)  | the checkpoint                                    |
| wna16, shard        | load_format wna16                 | a `wna16-shard` output for the group's TP size   |

at TP 1 and 2, alternated within each repetition, the folder's files evicted from the page cache before each
run (posix_fadvise DONTNEED on those files only: a server starting after a download). Per rank: seconds of the
loader's load_weights and of the whole get_model, bytes read (/proc/self/io read_bytes: from the disk;
rchar: through read calls, which a mapping's page faults are not), and peak RSS (VmHWM) with the RSS before
the load. vLLM's process_weights_after_loading (its kernel repack, the same for both loaders) is skipped
unless --process. The vLLM-on-CPU workarounds are the tier's (tests_vllm/workarounds.py; none touches
how a tensor is loaded).

Runs in the vLLM tier's venv:  ./scripts/test_vllm --python scripts/bench_vllm.py [--workdir DIR] [--layers 4]
    [--tp 1,2] [--reps 2] [--json OUT.json] [--process]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests_vllm"))  # workarounds: vLLM 0.32 on a CPU, as the tier runs it

from wna16_loader.formats import Role, resolve_quant_spec  # noqa: E402
from wna16_loader.testing.synthetic import encode_projection, encode_role, quant_config, random_projection  # noqa: E402

CONFIG = ROOT / "tests/fixtures/configs/qwen3_moe.json"
QUANT = {**quant_config("gptq", bits=4, group_size=128, symmetric=True), "dynamic": {r"-:.*\.mlp\.gate$": {}}}
VOCAB = 4096
CONTENDERS = {"default, checkpoint": ("auto", "checkpoint"), "wna16, checkpoint": ("wna16", "checkpoint"),
              "wna16, shard": ("wna16", "shard")}
GIB = 1 << 30


# --- the model ------------------------------------------------------------------------------------------

def model_config(layers: int) -> dict:
    return {**json.loads(CONFIG.read_text()), "num_hidden_layers": layers, "vocab_size": VOCAB,
            "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "float16", "quantization_config": QUANT}


@functools.cache
def template(n: int, k: int) -> dict[str, torch.Tensor]:
    """suffix -> one projection's GPTQ tensors (W [N, K]) by the package's writer, with the midpoint qzeros
    GPTQModel writes for symmetric layers; the shapes and dtypes every projection of [N, K] gets."""
    spec = resolve_quant_spec(QUANT)
    proj = random_projection(torch.Generator().manual_seed(n * k), n, k, spec, torch.float16)
    return {**encode_projection(spec, proj), "qzeros": encode_role(spec, spec.layout(Role.ZEROS), proj)}


def quantized(gen: torch.Generator, name: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """A random projection in the template's layout: every int32 word of qweight is 8 valid 4-bit values, so
    uniform words are uniform q (packing each one by the writer costs 0.4 s: 10 minutes for 4 layers); scales
    as the writer draws them; the qzeros words (all the midpoint) as they are."""
    out = {}
    for suffix, like in template(n, k).items():
        if suffix == "qweight":
            like = torch.randint(-(1 << 31), 1 << 31, like.shape, generator=gen, dtype=torch.int32)
        elif suffix == "scales":
            like = (torch.randint(1, 256, like.shape, generator=gen).float() / 1024).to(like.dtype)
        out[f"{name}.{suffix}"] = like.clone()  # safetensors refuses tensors sharing memory
    return out


def layer_tensors(gen: torch.Generator, config: dict, layer: int) -> dict[str, torch.Tensor]:
    h, i, e = config["hidden_size"], config["moe_intermediate_size"], config["num_local_experts"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim", h // heads)
    p = f"model.layers.{layer}"
    out = {f"{p}.{norm}.weight": torch.ones(size, dtype=torch.float16) for norm, size in
           (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", dim),
            ("self_attn.k_norm", dim))}
    for proj, n, k in (("q_proj", heads * dim, h), ("k_proj", kv * dim, h), ("v_proj", kv * dim, h),
                       ("o_proj", h, heads * dim)):
        out.update(quantized(gen, f"{p}.self_attn.{proj}", n, k))
    out[f"{p}.mlp.gate.weight"] = (torch.randn(e, h, generator=gen) / 32).to(torch.float16)
    for x in range(e):
        for proj, n, k in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
            out.update(quantized(gen, f"{p}.mlp.experts.{x}.{proj}", n, k))
    return out


def write_model(folder: Path, layers: int) -> Path:
    """The benchmark's checkpoint in `folder` (kept: written once per --layers)."""
    if (folder / "model.safetensors.index.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config, gen, weight_map = model_config(layers), torch.Generator().manual_seed(0), {}
    files = [f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors" for i in range(layers + 1)]
    h = config["hidden_size"]
    head = {"model.embed_tokens.weight": (torch.randn(VOCAB, h, generator=gen) / 8).to(torch.float16),
            "lm_head.weight": (torch.randn(VOCAB, h, generator=gen) / 8).to(torch.float16),
            "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    for file, tensors in zip(files, [head, *(layer_tensors(gen, config, n) for n in range(layers))]):
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def expert_bytes(folder: Path) -> int:
    """Bytes of every routed-expert tensor of the checkpoint, from the safetensors headers."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        total += sum(entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()
                     if ".mlp.experts." in name)
    return total


# --- one rank (a process of its own) ----------------------------------------------------------------------

def proc_io() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/io").read_text().splitlines())
    return {key: int(fields[key]) for key in ("rchar", "read_bytes")}


def proc_status() -> dict[str, int]:
    """RSS now (anonymous, file-backed, total) and the total's peak, KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) for key in ("RssAnon", "RssFile", "VmRSS", "VmHWM")}


class Peaks:
    """The peaks of RssAnon and RssFile while it runs (sampled every 5 ms: the kernel keeps no peak of either;
    VmHWM is the peak of their sum)."""

    def __init__(self) -> None:
        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = proc_status()
            self.anon, self.file = max(self.anon, now["RssAnon"]), max(self.file, now["RssFile"])
            time.sleep(0.005)

    def __enter__(self) -> "Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def join_group(spec: dict, rank: int):
    """This process as rank `rank` of the group's gloo process group, as vLLM's CPU worker sets it up; its
    vLLM ParallelConfig."""
    import workarounds

    workarounds.apply(f"wna16-bench-{spec['tp']}-{rank}")
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from wna16_loader.integrations import vllm as plugin

    plugin.register()  # what vLLM's general-plugin entry point does in a server process
    parallel = ParallelConfig(tensor_parallel_size=spec["tp"])
    with set_current_vllm_config(VllmConfig(parallel_config=parallel)):
        init_distributed_environment(world_size=spec["tp"], rank=rank, local_rank=rank,
                                     distributed_init_method=spec["init_method"], backend="gloo")
        initialize_model_parallel(spec["tp"])
    return parallel


def load_measured(spec: dict, parallel) -> dict:
    """vLLM's load_model of the folder, with the loader's load_weights timed and its memory sampled."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import base_loader, get_model_loader

    model_config = ModelConfig(model=spec["folder"], dtype="float16", skip_tokenizer_init=True, enforce_eager=True)
    load_config = LoadConfig(load_format=spec["load_format"])
    config = VllmConfig(model_config=model_config, load_config=load_config, device_config=DeviceConfig("cpu"),
                        parallel_config=parallel)
    if not spec["process"]:
        base_loader.process_weights_after_loading = lambda model, model_config, target_device: None
    loader, measured = get_model_loader(load_config), {}
    inner = loader.load_weights

    def timed(model, model_config):  # vLLM allocated the parameters (untouched pages): the load fills them
        start, params = time.perf_counter(), proc_status()
        measured["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        with Peaks() as peaks:
            inner(model, model_config)
        measured.update(load_weights_s=time.perf_counter() - start, anon_params_kib=params["RssAnon"],
                        peak_anon_kib=peaks.anon, peak_file_kib=peaks.file, peak_rss_kib=proc_status()["VmHWM"])

    loader.load_weights = timed
    io, start = proc_io(), time.perf_counter()
    with set_current_vllm_config(config):
        loader.load_model(vllm_config=config, model_config=model_config)
    after = proc_io()
    return {**measured, "get_model_s": time.perf_counter() - start, **{key: after[key] - io[key] for key in after}}


def rank_main(spec_file: str, rank_arg: str) -> None:
    """Load the model once as one rank of the group and write what it measured to OUT/rank{R}.json."""
    spec, rank = json.loads(Path(spec_file).read_text()), int(rank_arg)
    measured = load_measured(spec, join_group(spec, rank))
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(measured))


# --- the driver -----------------------------------------------------------------------------------------

def evict(folder: Path) -> None:
    """Drop every file of `folder` from the page cache."""
    for file in folder.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(folder: Path, load_format: str, tp: int, out: Path, process: bool) -> list[dict]:
    """One vLLM TP group loading `folder` cold; each rank's measurements."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"tp": tp, "folder": str(folder), "load_format": load_format, "process": process, "out": str(out),
            "init_method": f"tcp://127.0.0.1:{free_port()}"}
    (out / "spec.json").write_text(json.dumps(spec))
    evict(folder)
    logs = [out / f"rank{r}.log" for r in range(tp)]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(out / "spec.json"), str(r)],
                              stdout=log.open("w"), stderr=subprocess.STDOUT) for r, log in enumerate(logs)]
    for proc, log in zip(procs, logs):
        if proc.wait() != 0:
            raise SystemExit(f"{log} (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]


def shard(source: Path, workdir: Path, tp: int) -> tuple[Path, float]:
    """A `wna16-shard` output of `source` for TP `tp` (kept), and the seconds writing it took (0: kept)."""
    from wna16_loader.preshard.run import preshard_checkpoint

    out = workdir / f"shard-tp{tp}"
    if (out / "wna16_manifest.json").exists():
        return out, 0.0
    start = time.perf_counter()
    preshard_checkpoint(source, out, tp_size=tp, progress=False)
    return out, time.perf_counter() - start


def measure(args: argparse.Namespace, source: Path, shards: dict[int, Path]) -> list[dict]:
    """Every contender at every TP size, --reps times, alternated within each repetition."""
    runs = []
    for rep in range(args.reps):
        for tp in args.tp:
            for name, (load_format, kind) in CONTENDERS.items():
                folder = source if kind == "checkpoint" else shards[tp]
                out = args.workdir / "runs" / f"rep{rep}-tp{tp}-{load_format}-{kind}"
                ranks = run_group(folder, load_format, tp, out, args.process)
                runs.append({"contender": name, "tp": tp, "rep": rep, "ranks": ranks})
                print(f"rep {rep} tp {tp} {name}: " + "; ".join(
                    f"rank {r} {m['load_weights_s']:.1f} s, {m['read_bytes'] / GIB:.2f} GiB read" for r, m in
                    enumerate(ranks)), flush=True)
    return runs


def cell(runs: list[dict], key: str, scale: float, digits: int) -> str:
    """'r0 / r1' of the median over repetitions, per rank."""
    ranks = len(runs[0]["ranks"])
    return " / ".join(f"{statistics.median(run['ranks'][r][key] for run in runs) / scale:.{digits}f}"
                      for r in range(ranks))


def added_anon(run: dict) -> dict:
    """The run with each rank's anonymous memory added during load_weights (its peak over the start, which
    includes filling the untouched parameter pages) as a multiple of the rank's parameter bytes."""
    return {**run, "ranks": [{**m, "added_x": (m["peak_anon_kib"] - m["anon_params_kib"]) * 1024 / m["param_bytes"]}
                             for m in run["ranks"]]}


def table(runs: list[dict]) -> str:
    head = ("| contender | TP | load_weights s | read_bytes GiB | rchar GiB | anon added × params | peak anon GiB "
            "| peak RSS GiB |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for tp in sorted({run["tp"] for run in runs}):
        for name in CONTENDERS:
            mine = [added_anon(run) for run in runs if run["tp"] == tp and run["contender"] == name]
            rows.append(f"| {name} | {tp} | {cell(mine, 'load_weights_s', 1, 1)} | {cell(mine, 'read_bytes', GIB, 2)} "
                        f"| {cell(mine, 'rchar', GIB, 2)} | {cell(mine, 'added_x', 1, 2)} "
                        f"| {cell(mine, 'peak_anon_kib', 1 << 20, 2)} | {cell(mine, 'peak_rss_kib', 1 << 20, 2)} |")
    return "\n".join([head, *rows])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/wna16-bench-vllm"))
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (4: 1.2 GB of experts)")
    parser.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every run and the table here")
    parser.add_argument("--process", action="store_true", help="also run vLLM's process_weights_after_loading")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = time.perf_counter()
    source = write_model(args.workdir / f"qwen3-moe-{args.layers}l-gptq", args.layers)
    written = time.perf_counter() - start
    shards = {tp: shard(source, args.workdir / f"{source.name}-shards", tp) for tp in args.tp}
    experts = expert_bytes(source)
    print(f"checkpoint {source}: {experts / GIB:.2f} GiB of experts (written in {written:.0f} s); shards: "
          + ", ".join(f"TP {tp} {s:.0f} s" for tp, (_, s) in shards.items()), flush=True)
    runs = measure(args, source, {tp: folder for tp, (folder, _) in shards.items()})
    text = table(runs)
    print(f"\n{experts / GIB:.2f} GiB of experts, {args.layers} layers, median of {args.reps} cold runs; per rank "
          f"'rank 0 / rank 1'\n{text}")
    if args.json:
        args.json.write_text(json.dumps({"expert_bytes": experts, "layers": args.layers, "reps": args.reps,
                                         "process": args.process, "runs": runs, "table": text}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(*sys.argv[2:4])
    else:
        main()
