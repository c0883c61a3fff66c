"""The checkpoints of the SGLang tier's layer tests and how SGLang is asked to load them: the vLLM tier's
checkpoints (tests_vllm/layer_cases.py: the real fixtures and synthetic ones, their references, a rank's slice of
them), each with the method SGLang 0.5.23 builds for it (`Case.method`: SGLang's name for
get_quantization_config), in the gloo groups the SGLang tier runs."""

from __future__ import annotations

from layer_cases import AWQ_MIXTRAL, GPTQ_W4_SYM, GPTQ_W8_SYM, MIXTRAL, Case  # tests_vllm/, on conftest's path

from wna16_loader import ParallelConfig
from wna16_loader.testing.synthetic import quant_config

# group -> (ranks, EP): with EP, SGLang's MoE layers are EP `ranks`-way, MoE TP 1
GROUPS = {"tp1": (1, False), "tp2": (2, False), "ep2": (2, True)}
SYNTHETIC = {"sizes": (4, 128, 384)}
GPTQ_I704 = {"quant": quant_config("gptq", bits=4, group_size=128, symmetric=True), "intermediate": 704}
CASES = [
    Case("gptq_w4_g32_zero_edge", "moe_wna16"),
    Case("awq_w4_g32", "moe_wna16"),
    Case("awq_w4_g32.marlin", "awq_marlin", ckpt="awq_w4_g32"),
    Case("ct_w4_g32_asym", "compressed-tensors"),
    Case("ct_w8_channel_sym", "compressed-tensors"),
    Case("synthetic_gptq_w4_sym", "moe_wna16", synthetic=GPTQ_W4_SYM, **SYNTHETIC),
    Case("synthetic_gptq_w4_sym.marlin", "gptq_marlin", synthetic=GPTQ_W4_SYM, ckpt="synthetic_gptq_w4_sym",
         **SYNTHETIC),
    Case("synthetic_gptq_w4_asym", "moe_wna16", **SYNTHETIC,
         synthetic={"quant": quant_config("gptq", bits=4, group_size=64, symmetric=False)}),
    Case("synthetic_gptq_w8_sym.marlin", "gptq_marlin", synthetic=GPTQ_W8_SYM, ckpt="synthetic_gptq_w8_sym",
         **SYNTHETIC),
    Case("synthetic_gptq_w8_asym", "moe_wna16", **SYNTHETIC,
         synthetic={"quant": quant_config("gptq", bits=8, group_size=32, symmetric=False)}),
    Case("synthetic_gptq_v2_w4_asym", "moe_wna16", **SYNTHETIC,
         synthetic={"quant": quant_config("gptq", bits=4, group_size=32, symmetric=False,
                                          checkpoint_format="gptq_v2")}),
    Case("synthetic_awq_mixtral.marlin", "awq_marlin", synthetic=AWQ_MIXTRAL, ckpt="synthetic_awq_mixtral",
         **SYNTHETIC, **MIXTRAL),
    Case("synthetic_ct_w4_sym_gemma4", "compressed-tensors", prefix="model.language_model.layers.0.experts",
         synthetic={"quant": quant_config("compressed-tensors", bits=4, group_size=32, symmetric=True),
                    "family": "gemma4"}, **SYNTHETIC),
    Case("synthetic_awq_mixtral", "moe_wna16", synthetic=AWQ_MIXTRAL, **SYNTHETIC, **MIXTRAL),
    Case("synthetic_gptq_w4_sym_i704", "moe_wna16", sizes=(4, 128, 704), synthetic=GPTQ_I704),
    Case("synthetic_gptq_w4_sym_i704.marlin", "gptq_marlin", sizes=(4, 128, 704), synthetic=GPTQ_I704,
         ckpt="synthetic_gptq_w4_sym_i704"),
    Case("gptq_w4_g32_actorder_asym", "moe_wna16"),
    Case("autoround_w8_g64_asym", "auto-round"),
]
# mixed precision: each MoE layer of the three real mixed fixtures (layer 0 base, 1 an 8-bit g64 override, 2 float)
# with the method SGLang builds for it from the checkpoint's config
MIXED = {"gptq_dynamic_mixed": ("moe_wna16", "float16"), "ct_multigroup_mixed": ("compressed-tensors", "float16"),
         "autoround_layer_config_mixed": ("auto-round", "bfloat16")}
CASES += [Case(f"{ckpt}.L{layer}", method, prefix=f"model.layers.{layer}.mlp.experts", sizes=(4, 64, 128), ckpt=ckpt,
               dtype=dtype) for ckpt, (method, dtype) in MIXED.items() for layer in range(3)]
BY_NAME = {case.name: case for case in CASES}
SHARD_CASES = ("synthetic_gptq_w4_sym.marlin", "synthetic_awq_mixtral.marlin", "ct_w8_channel_sym",
               "synthetic_gptq_w4_asym")  # also filled by the plugin from a wna16-shard --layout fused output
SHARD_GROUPS = ("tp2", "ep2")


def parallel(group: str, rank: int) -> ParallelConfig:
    """This package's ParallelConfig of `rank` in `group`, as SGLang places it (linear experts)."""
    ranks, ep = GROUPS[group]
    return ParallelConfig(tp_size=1, tp_rank=0, ep_size=ranks, ep_rank=rank) if ep else \
        ParallelConfig(tp_size=ranks, tp_rank=rank)
