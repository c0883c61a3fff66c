"""The vLLM suite's checkpoints: a whole Qwen3-MoE model vLLM builds with no --quantization flag, GPTQ 4-bit
group 128 symmetric as GPTQModel writes it (router kept in float16 by GPTQ's `dynamic`), one safetensors file
per decoder layer, written once per size and layer count (kept in the workdir).

| size               | config                                                    | experts per layer        |
|--------------------|-----------------------------------------------------------|--------------------------|
| qwen3-30b          | Qwen3-30B-A3B's (tests/fixtures/configs/qwen3_moe.json)   | 128 of I 768, H 2048: 0.30 GB |
| deepseek-v3-shaped | the same model with DeepSeek-V3's MoE sizes (256 experts, top 8, H 7168), I cut to --inter (512) | 256 of I 512: 1.41 GB |

vLLM cannot build a DeepSeek-V3 MoE layer on a CPU (its routing), so the DeepSeek-V3 shape rides on Qwen3-MoE's
model code: what is measured is the loading of 256 experts of that H, which the model code does not change.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from wna16_loader.formats import Role, resolve_quant_spec
from wna16_loader.testing.synthetic import encode_projection, encode_role, quant_config, random_projection

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests/fixtures/configs/qwen3_moe.json"
QUANT = {**quant_config("gptq", bits=4, group_size=128, symmetric=True), "dynamic": {r"-:.*\.mlp\.gate$": {}}}
VOCAB = 4096
SIZES = {"qwen3-30b": {}, "deepseek-v3-shaped": {"num_local_experts": 256, "num_experts_per_tok": 8,
                                                 "hidden_size": 7168, "moe_intermediate_size": 512}}


def model_config(size: str, layers: int, inter: int | None) -> dict:
    """config.json of the benchmark model (`inter`: the expert I, None: the size's)."""
    changes = {**SIZES[size], **({"moe_intermediate_size": inter} if inter else {})}
    return {**json.loads(CONFIG.read_text()), **changes, "num_hidden_layers": layers, "vocab_size": VOCAB,
            "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "float16", "quantization_config": QUANT}


@functools.cache
def template(n: int, k: int) -> dict[str, torch.Tensor]:
    """suffix -> one projection's GPTQ tensors (W [N, K]) by the package's writer, with the midpoint qzeros
    GPTQModel writes for symmetric layers; the shapes and dtypes every projection of [N, K] gets."""
    spec = resolve_quant_spec(QUANT)
    proj = random_projection(torch.Generator().manual_seed(n * k), n, k, spec, torch.float16)
    return {**encode_projection(spec, proj), "qzeros": encode_role(spec, spec.layout(Role.ZEROS), proj)}


def quantized(gen: torch.Generator, name: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """A random projection in the template's layout: uniform qweight words are uniform 4-bit values (packing
    each one by the writer would take minutes per layer); scales as the writer draws them; midpoint qzeros."""
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


def write_model(folder: Path, size: str, layers: int, inter: int | None = None) -> Path:
    """The benchmark's checkpoint in `folder` (kept: written once per size, layer count and I)."""
    if (folder / "model.safetensors.index.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config, gen, weight_map = model_config(size, layers, inter), torch.Generator().manual_seed(0), {}
    files = [f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors" for i in range(layers + 1)]
    h = config["hidden_size"]
    head = {"model.embed_tokens.weight": (torch.randn(VOCAB, h, generator=gen) / 8).to(torch.float16),
            "lm_head.weight": (torch.randn(VOCAB, h, generator=gen) / 8).to(torch.float16),
            "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    for n, file in enumerate(files):
        tensors = head if n == 0 else layer_tensors(gen, config, n - 1)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        del tensors
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
