"""Whole checkpoints vLLM can build on a CPU, for the serve tests: a Qwen3-MoE model (`write_model`) and a
Qwen3-Next model with its MTP layer (`write_mtp_model`), both symmetric 4-bit GPTQ (vLLM's AutoGPTQ methods).

Qwen3-MoE: the config is the real GPTQModel fixture's (tests/fixtures/gptq_w4_g32_zero_edge: 1 layer, H 128,
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

FIXTURES = Path(__file__).resolve().parent.parent / "tests/fixtures"
SOURCE_CONFIG = FIXTURES / "gptq_w4_g32_zero_edge/checkpoint/config.json"
GPTQ_W4_SYM = quant_config("gptq", bits=4, group_size=32, symmetric=True)
QUANT = {**GPTQ_W4_SYM, "dynamic": {r"-:.*\.mlp\.gate$": {}}}
# Qwen3-Next (transformers' Qwen3NextConfig as tests/fixtures/configs/qwen3_next.json holds it) at test sizes,
# with its one MTP layer (vLLM qwen3_next_mtp.py: mtp.fc, mtp.layers.0 a full-attention MoE decoder layer);
# one decoder layer, of the full-attention type of its layer_types (every 4th in the published pattern: no
# linear-attention layer, which is not what is tested here). architectures as Qwen/Qwen3-Next-80B-A3B-Instruct's
# config.json writes it (transformers' class keeps none). GLM-4.5 and DeepSeek-V3 cannot be served here: their
# routing (sigmoid + e_score_correction_bias, RoutingMethodType.DeepSeekV3) is not one vLLM 0.32's CPU int4
# MoE kernel takes (see tests_vllm/layer_cases.py DEEPSEEK_MTP). No `dynamic` exclusion: vLLM builds the router
# (GateLinear) and shared_expert_gate unquantized anyway.
MTP_CHANGES = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 1, "layer_types": ["full_attention"],
               "hidden_size": 128, "head_dim": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
               "shared_expert_intermediate_size": 128, "vocab_size": 256}


class Writer:
    """The tensors of one checkpoint as they are written: quantized `linear` modules (and the float32
    `<module>.weight` [N, K] reference of each) and float16 `plain` ones, from one seeded generator."""

    def __init__(self, quant: dict, seed: int, qzeros: bool) -> None:
        self.spec, self.gen, self.qzeros = resolve_quant_spec(quant), torch.Generator().manual_seed(seed), qzeros
        self.tensors: dict[str, torch.Tensor] = {}
        self.references: dict[str, torch.Tensor] = {}

    def linear(self, name: str, n: int, k: int) -> None:
        proj = random_projection(self.gen, n, k, self.spec, torch.float16)
        self.tensors.update({f"{name}.{suffix}": t for suffix, t in encode_projection(self.spec, proj).items()})
        if self.qzeros:
            self.tensors[f"{name}.qzeros"] = encode_role(self.spec, self.spec.layout(Role.ZEROS), proj)
        self.references[f"{name}.weight"] = proj.dequantize(self.spec.group_size)

    def plain(self, name: str, *shape: int, dtype: torch.dtype = torch.float16) -> None:
        self.tensors[name] = (torch.randn(*shape, generator=self.gen) / 8).to(dtype)

    def attention(self, prefix: str, config: dict, o_inputs: int | None = None) -> None:
        """q/k/v/o projections of `prefix`.self_attn (`o_inputs`: o_proj's K when it is not q_proj's N)."""
        h, heads, kv, dim = (config[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                     "head_dim"))
        for proj, n, k in (("q_proj", heads * dim, h), ("k_proj", kv * dim, h), ("v_proj", kv * dim, h),
                           ("o_proj", h, o_inputs or heads * dim)):
            self.linear(f"{prefix}.self_attn.{proj}", n, k)

    def mlp(self, prefix: str, h: int, i: int) -> None:
        """gate/up/down projections of one gated MLP (an expert, a shared expert, a dense layer)."""
        for proj, n, k in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
            self.linear(f"{prefix}.{proj}", n, k)

    def save(self, folder: Path, config: dict, reference: Path | None) -> Path:
        """config.json + model.safetensors in `folder` (and the references at `reference`, unless None)."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        save_file(self.tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        if reference is not None:
            save_file(self.references, str(reference))
        return folder


def write_model(folder: Path, seed: int = 3, *, qzeros: bool = True, reference: Path | None = None) -> Path:
    """The Qwen3-MoE model in `folder`. `qzeros` False: no qzeros tensors (the symmetric GPTQ spelling the
    package reads too); `reference`: also write there, as the fixtures' reference.safetensors, every quantized
    module's float32 `<module>.weight` [N, K]."""
    config = {**json.loads(SOURCE_CONFIG.read_text()), "quantization_config": QUANT}
    w = Writer(QUANT, seed, qzeros)
    h, i, e = config["hidden_size"], config["moe_intermediate_size"], config["num_local_experts"]
    w.plain("model.embed_tokens.weight", config["vocab_size"], h)
    w.plain("lm_head.weight", config["vocab_size"], h)
    w.plain("model.norm.weight", h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm",
                           config["head_dim"]), ("self_attn.k_norm", config["head_dim"])):
            w.plain(f"{p}.{norm}.weight", size)
        w.attention(p, config)
        w.plain(f"{p}.mlp.gate.weight", e, h)
        for x in range(e):
            w.mlp(f"{p}.mlp.experts.{x}", h, i)
    return w.save(folder, config, reference)


def write_mtp_model(folder: Path, seed: int = 5, *, qzeros: bool = True) -> Path:
    """The Qwen3-Next model with its MTP layer in `folder` (`qzeros` as in `write_model`): the decoder as vLLM's
    Qwen3NextForCausalLM reads it, and the MTP tree as Qwen3NextMTP reads it (mtp.fc [H, 2H], its norms and
    mtp.layers.0, a decoder layer; its embedding and lm_head are the model's)."""
    config = {**json.loads((FIXTURES / "configs/qwen3_next.json").read_text()), **MTP_CHANGES,
              "quantization_config": GPTQ_W4_SYM}
    w, h = Writer(GPTQ_W4_SYM, seed, qzeros), config["hidden_size"]
    w.plain("model.embed_tokens.weight", config["vocab_size"], h)
    w.plain("lm_head.weight", config["vocab_size"], h)
    w.plain("model.norm.weight", h)
    for layer in (*(f"model.layers.{n}" for n in range(config["num_hidden_layers"])), "mtp.layers.0"):
        gated = {**config, "num_attention_heads": 2 * config["num_attention_heads"]}  # q_proj: queries and gates
        for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h),
                           ("self_attn.q_norm", config["head_dim"]), ("self_attn.k_norm", config["head_dim"])):
            w.plain(f"{layer}.{norm}.weight", size)
        w.attention(layer, gated, o_inputs=config["num_attention_heads"] * config["head_dim"])
        e = config["num_experts"]
        w.plain(f"{layer}.mlp.gate.weight", e, h)
        w.plain(f"{layer}.mlp.shared_expert_gate.weight", 1, h)
        w.mlp(f"{layer}.mlp.shared_expert", h, config["shared_expert_intermediate_size"])
        for x in range(e):
            w.mlp(f"{layer}.mlp.experts.{x}", h, config["moe_intermediate_size"])
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        w.plain(f"mtp.{norm}.weight", h)
    w.linear("mtp.fc", h, 2 * h)
    return w.save(folder, config, None)
