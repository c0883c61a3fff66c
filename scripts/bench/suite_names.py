"""Suite names, the name scale: DeepSeek-V3's tensor list (61 layers, 3 dense, 256 experts, GPTQ 4-bit G 32 with g_idx
stored, as GPTQModel writes it) at tiny sizes (H 64, I 256): 178,176 routed-expert tensors whose bytes hardly
count, so what a loader spends per tensor decides its speed.

Usage: python scripts/bench --size deepseek-names --workdir /tmp/wna16-names --reps 2 --json out.json

The checkpoint is written directly in seconds (constant words and scales, g_idx = k // G, one file per decoder
layer, tensors in safetensors' writer order), with the config from tests/fixtures/configs/deepseek_v3.json at
the sizes above (no MTP layer: `num_nextn_predict_layers` 0). Every file is read into the page cache first.
Contenders, alternated within each repetition, one process, freed heap returned to the OS before each:

  floor        every expert tensor read once (safe_open + get_tensor + clone)
  headers      safe_open + get_slice(name).get_shape() for every expert tensor
  tp8 / ep8    load_experts, TP 8 rank 0 / EP 8 rank 0
  model        load_model_experts into one FusedMoEExperts per layer (TP 8 rank 0; modules built before)
  hook tp8/1   the engine convention: every expert tensor get_tensor'ed and handed to its parameter's
               weight_loader, then check_model_complete (modules and the engine's name mapping built before)

Each is timed in wall-clock seconds and in this process's CPU seconds (one torch thread: CPU time is the
work done, which other processes sharing the machine disturb far less than the wall clock), with the full
collections of the cyclic GC it ran and their CPU seconds (`gc.callbacks`).

Then the conversions (baselines.conversion_rates): GB/s of each on one and two threads against a
plain copy of the same bytes.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from wna16_loader import FusedMoEExperts, ParallelConfig, load_experts, load_model_experts, read_moe_config
from wna16_loader.engine.mapping import expert_param_mapping
from wna16_loader.engine.model import check_model_complete
from wna16_loader.storage.bulk import gc_paused
from wna16_loader.storage.index import CheckpointIndex
from wna16_loader.testing.synthetic import quant_config

from .baselines import (
    NAME_SIZES,
    conversion_rates,
    conversion_table,
    expert_tensors,
    release_freed_memory,
    run_floor,
    suite_parser,
)
from .targets import NAME_TARGETS

CONFIG = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs" / "deepseek_v3.json"
ROLES = ("g_idx", "qweight", "qzeros", "scales")  # GPTQModel stores all four for every module
PROJS = ("down_proj", "gate_proj", "up_proj")


# ---------------------------------------------------------------- the checkpoint

def module_tensors(k: int, n: int, group: int) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """suffix -> (dtype, shape, bytes) of one GPTQ v1 symmetric 4-bit module W[n, k]: constant words, stored
    zero points z - 1 = 7, scales 1/64, g_idx = k // G."""
    words = lambda shape, value: torch.full(shape, value, dtype=torch.int32).numpy().tobytes()  # noqa: E731
    return {"g_idx": ("I32", (k,), (torch.arange(k, dtype=torch.int32) // group).numpy().tobytes()),
            "qweight": ("I32", (k // 8, n), words((k // 8, n), 0x76543210)),
            "qzeros": ("I32", (k // group, n // 8), words((k // group, n // 8), 0x77777777)),
            "scales": ("F16", (k // group, n), torch.full((k // group, n), 1 / 64, dtype=torch.float16).numpy().tobytes())}


def layer_tensors(layer: int, sizes: dict[str, int]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of one decoder layer (attention and norms too: their names are parsed like any other)."""
    h, i, g = sizes["hidden"], sizes["inter"], sizes["group"]
    base, out = f"model.layers.{layer}", {}
    linear = {"self_attn.q_a_proj": (h, 2 * h), "self_attn.q_b_proj": (2 * h, 2 * h),
              "self_attn.kv_a_proj_with_mqa": (h, h), "self_attn.kv_b_proj": (h, 2 * h), "self_attn.o_proj": (2 * h, h)}
    if layer < sizes["dense"]:
        linear.update({"mlp.gate_proj": (h, 4 * i), "mlp.up_proj": (h, 4 * i), "mlp.down_proj": (4 * i, h)})
    else:
        linear.update({"mlp.shared_experts.gate_proj": (h, i), "mlp.shared_experts.up_proj": (h, i),
                       "mlp.shared_experts.down_proj": (i, h)})
        experts = {"down_proj": module_tensors(i, h, g), "gate_proj": module_tensors(h, i, g),
                   "up_proj": module_tensors(h, i, g)}
        for expert in range(sizes["experts"]):
            for proj, roles in experts.items():
                for suffix, entry in roles.items():
                    out[f"{base}.mlp.experts.{expert}.{proj}.{suffix}"] = entry
        out[f"{base}.mlp.gate.weight"] = ("BF16", (sizes["experts"], h), bytes(2 * sizes["experts"] * h))
        out[f"{base}.mlp.gate.e_score_correction_bias"] = ("F32", (sizes["experts"],), bytes(4 * sizes["experts"]))
    for module, (k, n) in linear.items():
        for suffix, entry in module_tensors(k, n, g).items():
            out[f"{base}.{module}.{suffix}"] = entry
    for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"):
        out[f"{base}.{norm}.weight"] = ("BF16", (h,), bytes(2 * h))
    return out


def write_file(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file in the writer's order (wider dtypes first, then by name)."""
    width = {"F32": 4, "I32": 4, "F16": 2, "BF16": 2}
    entries, blobs, offset = {}, [], 0
    for name in sorted(tensors, key=lambda t: (-width[tensors[t][0]], t)):
        dtype, shape, blob = tensors[name]
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header + b"".join(blobs))


def build(workdir: Path, size: str) -> Path:
    """Write the checkpoint once (seconds)."""
    sizes = NAME_SIZES[size]
    folder = workdir / f"{size}-gptq-int4-g{sizes['group']}"
    if (folder / ".complete").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = json.loads(CONFIG.read_text())
    config.update(hidden_size=sizes["hidden"], moe_intermediate_size=sizes["inter"], intermediate_size=4 * sizes["inter"],
                  num_hidden_layers=sizes["layers"], first_k_dense_replace=sizes["dense"],
                  n_routed_experts=sizes["experts"], num_nextn_predict_layers=0,
                  quantization_config=quant_config("gptq", bits=4, group_size=sizes["group"], symmetric=True))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weight_map: dict[str, str] = {}
    last = {"model.embed_tokens.weight": ("BF16", (64, sizes["hidden"]), bytes(128 * sizes["hidden"])),
            "model.norm.weight": ("BF16", (sizes["hidden"],), bytes(2 * sizes["hidden"])),
            "lm_head.weight": ("BF16", (64, sizes["hidden"]), bytes(128 * sizes["hidden"]))}
    for layer in range(sizes["layers"]):
        tensors = layer_tensors(layer, sizes) | (last if layer == sizes["layers"] - 1 else {})
        file = f"model-{layer + 1:05d}-of-{sizes['layers']:05d}.safetensors"
        write_file(folder / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / ".complete").write_text("ok\n")
    return folder


# ---------------------------------------------------------------- contenders

def run_headers(path: Path, tensors: dict[str, list[str]]) -> int:
    """safe_open + get_slice(name).get_shape() of every expert tensor."""
    count = 0
    for file, names in tensors.items():
        with safe_open(str(path / file), framework="pt") as handle:
            for name in names:
                count += len(handle.get_slice(name).get_shape())
    return count


def run_header_json(path: Path) -> int:
    """json.loads of every file's header alone (the collector paused, as the index does): what any parse of
    the headers in Python pays at least."""
    count = 0
    with gc_paused():
        for file in sorted(path.glob("*.safetensors")):
            with open(file, "rb") as handle:
                count += len(json.loads(handle.read(int.from_bytes(handle.read(8), "little"))))
    return count


def run_index(path: Path) -> int:
    """The checkpoint index every load builds first (every header parsed and checked whole, the index file's
    weight map compared with them)."""
    with CheckpointIndex(path) as index:
        return len(index.refs)


def build_model(path: Path, parallel: ParallelConfig) -> dict[str, FusedMoEExperts]:
    """One FusedMoEExperts per MoE layer on the CPU, keyed by experts prefix (outside the clock)."""
    moe = read_moe_config(path)
    root = torch.nn.Module()
    modules = {prefix: FusedMoEExperts(moe, prefix, parallel) for prefix in moe.experts_prefixes}
    for i, module in enumerate(modules.values()):
        root.add_module(f"layer{i}", module)
    root.experts = modules
    return root


Calls = tuple[list[Any], dict[str, list[tuple[str, int, str, int | None]]]]


def engine_calls(path: Path, model: torch.nn.Module) -> Calls:
    """(parameters, file -> (name, parameter number, shard id, expert id) of every expert tensor in the file's
    key order): the engine's own name mapping, worked out before the clock (an engine does it with string
    replaces). Plain tuples of strings and ints, which the garbage collector stops tracking, so that the
    harness adds no objects for every collection during the timed loops to scan."""
    moe = read_moe_config(path)
    mapping = expert_param_mapping(moe)
    named = dict(model.named_parameters())
    params, number = list(named.values()), {name: i for i, name in enumerate(named)}
    prefix_of = {m.prefix: f"layer{i}" for i, m in enumerate(model.experts.values())}
    out: dict[str, list[tuple[str, int, str, int | None]]] = {}
    for file in sorted(p.name for p in path.glob("*.safetensors")):
        calls = out.setdefault(file, [])
        with safe_open(str(path / file), framework="pt") as handle:
            for name in handle.keys():
                for target in mapping(name):
                    prefix = target.param_name.rsplit(".", 1)[0]
                    calls.append((name, number[f"{prefix_of[prefix]}.{target.fused_name}"], target.shard_id.value,
                                  target.expert_id))
    return params, out


def run_hook(path: Path, model: torch.nn.Module, calls: Calls) -> None:
    """The engine loop: get_tensor every expert tensor, hand it to weight_loader; then the completeness check."""
    for module in model.experts.values():
        module.reset_load()
    params, files = calls
    for file, entries in files.items():
        with safe_open(str(path / file), framework="pt") as handle:
            for name, number, shard_id, expert_id in entries:
                param = params[number]
                param.weight_loader(param, handle.get_tensor(name), name, shard_id, expert_id)
    check_model_complete(model)


def run_model(path: Path, model: torch.nn.Module, parallel: ParallelConfig) -> None:
    for module in model.experts.values():
        module.reset_load()
    load_model_experts(model, path, parallel)


def contenders(path: Path) -> dict[str, Callable[[], Any]]:
    tensors = expert_tensors(path)
    tp8, tp1, ep8 = ParallelConfig(8, 0), ParallelConfig(1, 0), ParallelConfig(1, 0, 8, 0)
    models = {"tp8": build_model(path, tp8), "tp1": build_model(path, tp1)}
    calls = {k: engine_calls(path, m) for k, m in models.items()}
    return {"floor": lambda: run_floor(path, tensors),
            "headers": lambda: run_headers(path, tensors),
            "header json": lambda: run_header_json(path),
            "index": lambda: run_index(path),
            "tp8": lambda: load_experts(path, tp8),
            "ep8": lambda: load_experts(path, ep8),
            "model": lambda: run_model(path, models["tp8"], tp8),
            "hook tp8": lambda: run_hook(path, models["tp8"], calls["tp8"]),
            "hook tp1": lambda: run_hook(path, models["tp1"], calls["tp1"])}


class FullCollections:
    """Counts the cyclic collector's full (oldest-generation) collections and their CPU seconds through
    `gc.callbacks` while installed (`with`): what a loader that keeps many objects alive pays per load."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.process_time()
        else:
            self.count += 1
            self.seconds += time.process_time() - self._start

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self)


def measure(path: Path, reps: int, only: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Median wall-clock and CPU seconds (this process: on a shared machine the steadier of the two) per
    contender over `reps` alternated repetitions (order reversed every other one), and the median count
    and CPU seconds of the full collections each ran ("gc full", "gc s")."""
    tasks = contenders(path)
    labels = [label for label in tasks if not only or label in only]
    times: dict[str, dict[str, list[float]]] = {clock: {label: [] for label in labels}
                                                for clock in ("wall", "cpu", "gc full", "gc s")}
    for rep in range(reps):
        for label in labels if rep % 2 == 0 else labels[::-1]:
            release_freed_memory()
            with FullCollections() as full:
                wall, cpu = time.perf_counter(), time.process_time()
                result = tasks[label]()
                times["cpu"][label].append(time.process_time() - cpu)
                times["wall"][label].append(time.perf_counter() - wall)
            times["gc full"][label].append(full.count)
            times["gc s"][label].append(full.seconds)
            del result
    return {clock: {label: statistics.median(v) for label, v in runs.items()} for clock, runs in times.items()}


def report(seconds: dict[str, float], tensors: int) -> str:
    """The name-scale table: seconds, ratios, µs per expert tensor above the floor, targets."""
    floor, headers = seconds.get("floor"), seconds.get("headers")
    rows = [("floor", "reading every expert tensor once", None),
            ("headers", "the headers alone", None),
            ("header json", "json.loads of every header (a bound of any parse in Python)", None),
            ("index", "CheckpointIndex (every header parsed and checked, the weight map compared)", None),
            ("tp8", "load_experts, TP 8 rank 0", NAME_TARGETS["tp8"]),
            ("ep8", "load_experts, EP 8 rank 0", NAME_TARGETS["ep8"]),
            ("model", "load_model_experts, TP 8 rank 0", NAME_TARGETS["model"]),
            ("hook tp8", "weight_loader loop, TP 8 rank 0", NAME_TARGETS["hook tp8"]),
            ("hook tp1", "weight_loader loop, TP 1", NAME_TARGETS["hook tp1"])]
    lines = ["| path | seconds | ÷ floor | ÷ headers | µs / tensor above the floor | target | pass? |",
             "|---|---|---|---|---|---|---|"]
    for key, label, target in rows:
        if key not in seconds:
            continue
        s = seconds[key]
        ratio = lambda base: f"{s / seconds[base]:.2f}" if seconds.get(base) else ""  # noqa: E731
        above = f"{1e6 * (s - floor) / tensors:.1f}" if floor is not None and key != "floor" else ""
        checks = list(target or ())
        text = "; ".join(f"≤ {limit}× {base}" for base, limit in checks)
        ok = all(s / seconds[base] <= limit for base, limit in checks if base in seconds) if checks else None
        lines.append(f"| {label} | {s:.3f} | {ratio('floor')} | {ratio('headers')} | {above} | {text} | "
                     f"{'' if ok is None else 'PASS' if ok else 'FAIL'} |")
    del headers
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = suite_parser("names", __doc__, sorted(NAME_SIZES), "wna16-names", 2)
    parser.add_argument("--no-conversions", action="store_true", help="skip the conversion GB/s table")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    start = time.perf_counter()
    path = build(args.workdir, args.size)
    print(f"checkpoint {path} ready in {time.perf_counter() - start:.1f} s", flush=True)
    for file in path.glob("*.safetensors"):
        file.read_bytes()  # into the page cache
    tensors = sum(len(v) for v in expert_tensors(path).values())
    seconds = measure(path, args.reps, [s for s in args.only.split(",") if s] or None)
    text = "\n\n".join(f"{clock} seconds:\n" + report(seconds[clock], tensors) for clock in ("wall", "cpu"))
    text += "\n\nfull GC collections per run (median): " + ", ".join(
        f"{label} {seconds['gc full'][label]:g} ({seconds['gc s'][label]:.2f} s CPU)" for label in seconds["gc full"])
    rates = {} if args.no_conversions else conversion_rates()
    print(f"\nsize={args.size} reps={args.reps} expert tensors={tensors} cpus={os.cpu_count()} "
          f"threads={torch.get_num_threads()}\n{text}")
    if rates:
        print("\n" + conversion_table(rates))
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "reps": args.reps, "tensors": tensors, "seconds": seconds,
                                         "table": text, "conversions": rates}, indent=2))

