"""DeepSeek-V3-shaped checkpoints SGLang 0.5.23 builds as a whole `DeepseekV3ForCausalLM` on a CPU (MLA attention
included), with its shared expert fused into the routed MoE layer, for the SGLang tier's fused-shared-expert tests.

The config is DeepSeek-V3's (tests/fixtures/configs/deepseek_v3.json, as transformers writes it: 256 routed experts,
1 shared, first_k_dense_replace, MLA ranks) with the keys the publisher's config.json (deepseek-ai/DeepSeek-V3) holds
and transformers' does not, which SGLang's deepseek_v2.py reads: `architectures`, `moe_layer_freq`, `rope_scaling`
(yarn: SGLang's CPU RoPE takes only DeepSeek's yarn), `topk_method`, `scoring_func`. Shrunk: H 128, the dense and
expert I (256 each, TP 2 halves them to whole 32-groups), 2 decoder layers (layer 0 dense by first_k_dense_replace,
layer 1 MoE), 2 attention heads, vocabulary 256.

Written: every routed expert, the shared expert (`mlp.shared_experts`, quantized like them: SGLang fuses it only
then) and the router of layer 1, by the package's synthetic writer (random q and scales, exactly representable).
The quantization_config keeps attention unquantized (`modules_to_not_convert`, GPTQ `dynamic`): SGLang's DeepSeek
`post_load_weights` dequantizes a quantized kv_b_proj with a CUDA/HIP kernel only. Every tensor not written (attention,
norms, the dense layer) is left as allocated by both loaders alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from wna16_loader.testing.synthetic import quant_config, write_family_checkpoint

CONFIG = Path(__file__).resolve().parent.parent / "tests/fixtures/configs/deepseek_v3.json"
PUBLISHER = {"architectures": ["DeepseekV3ForCausalLM"], "moe_layer_freq": 1, "topk_method": "noaux_tc",
             "scoring_func": "sigmoid",
             "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 4096, "type": "yarn"}}
SIZES = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 2,
         "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256}
ROUTED, EXPERTS, SHARED = 256, "model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts"
KEEP = ("self_attn",)
DENSE = r"layers\.0\.mlp"  # SGLang 0.5.23 builds no linear layer of asymmetric GPTQ ("non-Marlin GPTQ ... removed")
# case -> (quantization_config, SGLang's --quantization or None, the MoE method class SGLang picks)
CASES = {
    "gptq_sym": (quant_config("gptq", bits=4, group_size=32, symmetric=True,
                              dynamic={r"-:.*self_attn.*": {}}), None, "GPTQMarlinMoEScheme"),
    "awq": (quant_config("awq", bits=4, group_size=32, symmetric=False, modules_to_not_convert=list(KEEP)), None,
            "AWQMoEScheme"),
    "gptq_asym": (quant_config("gptq", bits=4, group_size=32, symmetric=False,
                               dynamic={r"-:.*self_attn.*": {}, rf"-:.*{DENSE}.*": {}}), "moe_wna16",
                  "MoeWNA16Method"),
}

PER_RANK = {"per_rank_slots": True, "server_args": {"enforce_shared_experts_fusion": True}}
# group -> (ranks, EP, the rank script's settings, the cases run): SGLang fuses the shared expert at TP 1 and TP 2;
# at EP 2 it keeps it apart (not AMD), unless the all-to-all backend gives every rank its own slots (DeepEP-class,
# MegaMoE) and --enforce-shared-experts-fusion asks for fusion, as DeepEP's refusal says (unfused, asymmetric GPTQ's
# shared expert is an asymmetric GPTQ linear layer, which SGLang 0.5.23 does not build: not run)
GROUPS = {"tp1": (1, False, {}, tuple(CASES)), "tp2": (2, False, {}, tuple(CASES)),
          "ep2-per-rank": (2, True, PER_RANK, tuple(CASES)), "ep2": (2, True, {}, ("gptq_sym", "awq"))}


def deepseek_config() -> dict:
    config = json.loads(CONFIG.read_text())
    config.update(PUBLISHER, **SIZES)
    return config


def write_deepseek(folder: Path, case: str, *, seed: int = 0) -> Path:
    """The checkpoint of `case` (see the module text) in `folder`."""
    written = write_family_checkpoint(folder, deepseek_config(), CASES[case][0], shared=True, seed=seed).folder
    tensors = load_file(str(written / "model.safetensors"))
    kept = {name: t for name, t in tensors.items() if name.startswith((EXPERTS + ".", SHARED + "."))}
    kept["model.layers.1.mlp.gate.weight"] = tensors["model.layers.1.mlp.gate.weight"]
    save_file(kept, str(written / "model.safetensors"), metadata={"format": "pt"})
    return written


def renamed(folder: Path, out: Path) -> Path:
    """`folder` as SGLang's DeepSeek weight loader reads it with fusion on (deepseek_weight_loader.py): every
    `mlp.shared_experts` tensor renamed to `mlp.experts.{n_routed_experts}`, a checkpoint of 257 routed experts."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({name.replace(SHARED + ".", f"{EXPERTS}.{ROUTED}."): t for name, t in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "n_routed_experts": ROUTED + 1}))
    return out
