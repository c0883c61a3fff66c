"""A whole Qwen3-MoE checkpoint vLLM can build on a CPU, for the plugin test.

The config is the real GPTQModel fixture's (tests/fixtures/gptq_w4_g32_zero_edge: Qwen3-MoE, 1 layer, H 128,
4 experts of I 128, 2 attention heads), with a symmetric 4-bit GPTQ quantization_config: vLLM 0.32's GPTQ
linear method refuses asymmetric GPTQ ("Unsupported quantization config: bits=4, sym=False") and its CPU
WNA16 linear kernel refuses the router's 4 outputs ("supported sizes are multiples of 32"), so the router
is kept in float16 through GPTQ's own `dynamic` exclusion. Every quantized tensor is written by the
package's synthetic writer (random q and scales, exactly representable), with the midpoint `qzeros` that
GPTQModel writes for symmetric layers too (vLLM's AutoGPTQ method loads them and its CPU kernel reads them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from wna16_loader.formats import Role, resolve_quant_spec
from wna16_loader.testing.synthetic import encode_projection, encode_role, quant_config, random_projection

SOURCE_CONFIG = Path(__file__).resolve().parent.parent / "tests/fixtures/gptq_w4_g32_zero_edge/checkpoint/config.json"
QUANT = {**quant_config("gptq", bits=4, group_size=32, symmetric=True), "dynamic": {r"-:.*\.mlp\.gate$": {}}}


def write_model(folder: Path, seed: int = 3, *, qzeros: bool = True, reference: Path | None = None) -> Path:
    """config.json + model.safetensors of the whole model in `folder`. `qzeros` False: no qzeros tensors (the
    symmetric GPTQ spelling the package reads too); `reference`: also write there, as the fixtures'
    reference.safetensors, every quantized module's float32 `<module>.weight` [N, K]."""
    config = {**json.loads(SOURCE_CONFIG.read_text()), "quantization_config": QUANT}
    spec, gen = resolve_quant_spec(QUANT), torch.Generator().manual_seed(seed)
    h, i, e = config["hidden_size"], config["moe_intermediate_size"], config["num_local_experts"]
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    tensors: dict[str, torch.Tensor] = {}
    references: dict[str, torch.Tensor] = {}

    def linear(name: str, n: int, k: int) -> None:
        proj = random_projection(gen, n, k, spec, torch.float16)
        tensors.update({f"{name}.{suffix}": t for suffix, t in encode_projection(spec, proj).items()})
        if qzeros:
            tensors[f"{name}.qzeros"] = encode_role(spec, spec.layout(Role.ZEROS), proj)
        references[f"{name}.weight"] = proj.dequantize(spec.group_size)

    def plain(name: str, *shape: int) -> None:
        tensors[name] = (torch.randn(*shape, generator=gen) / 8).to(torch.float16)

    plain("model.embed_tokens.weight", config["vocab_size"], h)
    plain("lm_head.weight", config["vocab_size"], h)
    plain("model.norm.weight", h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", dim),
                           ("self_attn.k_norm", dim)):
            plain(f"{p}.{norm}.weight", size)
        for proj, n, k in (("q_proj", heads * dim, h), ("k_proj", kv * dim, h), ("v_proj", kv * dim, h),
                           ("o_proj", h, heads * dim)):
            linear(f"{p}.self_attn.{proj}", n, k)
        plain(f"{p}.mlp.gate.weight", e, h)
        for x in range(e):
            for proj, n, k in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
                linear(f"{p}.mlp.experts.{x}.{proj}", n, k)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if reference is not None:
        save_file(references, str(reference))
    return folder
