"""DeepSeek-V4 as published, through the SGLang plugin: SGLang 0.5.23 builds its own DeepseekV4ForCausalLM on the
CPU (gloo ranks) at TP 1, TP 2 and EP 2 from a compressed-tensors W4A16 checkpoint in V4's published names
(`layers.L.ffn.experts.E.{w1, w3, w2}`, the MTP layer `mtp.0.ffn.experts...`), and loads it with its default loader
and with `--load-format wna16`, from the checkpoint folder and from a `wna16-shard` output of the group's layout.
Every parameter of every rank equals SGLang's default load, as its loader left it (before
process_weights_after_loading, which compiles CUDA code).

The config is deepseek-ai/DeepSeek-V4-Flash-Base's as published (tests/fixtures/configs/deepseek_v4-flash-base.json,
the key layout SGLang's DeepSeekV4Config reads) at test sizes. Its layers are the published pattern's layers 2-5
(compress ratios 4, 128, 4, 128): on a CPU SGLang builds RoPE only through its CPU factory, which takes the
compressed layers' deepseek_yarn scaling alone (rotary_embedding/factory.py:478 asserts `rope_scaling is not None`
for a layer of ratio 0, deepseek_v4.py:1395), so Flash's two uncompressed first layers cannot be built here.

The checkpoint holds what llm-compressor's W4A16 recipe quantizes when attention and the shared expert are ignored:
the routed experts packed 4-bit (every layer, the 3 hash-routed ones too, and the MTP layer's), the routers with their
routing tables (`gate.tid2eid`, `gate.bias`) and the shared experts in float16. SGLang's V4 class keeps the shared expert apart unless --enforce-shared-experts-fusion is
given (DeepseekV4ForCausalLM.shared_experts_fusion_disable_reason), so no flag is needed to keep it unfused; the
attention tensors are not written (both loads leave those parameters as allocated, and so equal).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_cases import GROUPS, parallel
from tier import result, run_group

from wna16_loader.preshard.run import preshard_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_family_checkpoint

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "tests" / "fixtures" / "configs"
LAYERS = 4
# llm-compressor's W4A16 (group 16: TP 2 keeps whole groups of I 128 / 2), attention and shared experts ignored
QUANT = {**quant_config("compressed-tensors", bits=4, group_size=16, symmetric=True),
         "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}
SIZES = {"num_hidden_layers": LAYERS, "n_routed_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
         "moe_intermediate_size": 128, "num_attention_heads": 4, "head_dim": 128, "q_lora_rank": 64,
         "o_lora_rank": 64, "o_groups": 2, "index_n_heads": 2, "index_head_dim": 64, "index_topk": 8,
         "vocab_size": 256}
LOADS = ("wna16-checkpoint", "wna16-shard")
# DeepSeek-V4's load_weights ends by JIT-compiling its mHC kernel for the GPU (deepseek_v4.py:5644,
# _prewarm_mhc_kernels; on a CPU mhc.py:821 asks torch.cuda for the SM count); SGLang's own switch skips it (no weight
# is touched)
NO_MHC_PREWARM = ("SGLANG_OPT_USE_TILELANG_MHC_PRE", "0")
SENTINEL = 0x5A  # sglang_rank.loaded_parameters: every parameter starts as this byte


def v4_config() -> dict:
    """The published Flash-Base config at test sizes, layers 2-5 of its compress-ratio pattern and its MTP slot."""
    config = json.loads((CONFIGS / "deepseek_v4-flash-base.json").read_text())
    ratios = config["compress_ratios"]
    return {**config, **SIZES, "compress_ratios": [*ratios[2:2 + LAYERS], ratios[-1]]}


def write_v4(folder: Path) -> dict[str, torch.Tensor]:
    """The W4A16 checkpoint in `folder`: the synthetic writer's experts (MTP layer included) and routers, each
    router's routing table as V4 publishes it (`gate.tid2eid` [vocab, top-k] in the hash-routed layers, `gate.bias`
    [E] in the others), the shared experts as float16 `w1`/`w3`/`w2`; returns its tensors."""
    config = v4_config()
    write_family_checkpoint(folder, config, QUANT, mtp=True)
    written = load_file(str(folder / "model.safetensors"))
    kept = {name: t for name, t in written.items() if ".ffn.experts." in name or name.endswith(".ffn.gate.weight")}
    gen, h, e = torch.Generator().manual_seed(7), config["hidden_size"], config["n_routed_experts"]
    shared = config["moe_intermediate_size"] * config["n_shared_experts"]
    for layer in range(LAYERS):
        for proj, shape in (("w1", (shared, h)), ("w3", (shared, h)), ("w2", (h, shared))):
            kept[f"layers.{layer}.ffn.shared_experts.{proj}.weight"] = \
                (torch.randn(*shape, generator=gen) / 8).to(torch.float16)
        if layer < config["num_hash_layers"]:
            kept[f"layers.{layer}.ffn.gate.tid2eid"] = torch.randint(
                0, e, (config["vocab_size"], config["num_experts_per_tok"]), generator=gen, dtype=torch.int32)
        else:
            kept[f"layers.{layer}.ffn.gate.bias"] = torch.randn(e, generator=gen)
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return kept


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """group -> {job: each rank's parameters (or SGLang's error)}: SGLang's default load ("auto") and the plugin's
    from the checkpoint and from a wna16-shard output of the group's layout; "written": the checkpoint's tensors."""
    out = tmp_path_factory.mktemp("deepseek_v4")
    source = out / "checkpoint"
    got: dict = {"written": write_v4(source)}
    for group, (ranks, ep) in GROUPS.items():
        layout = parallel(group, 0)
        shard = out / f"shard-{group}"
        preshard_checkpoint(source, shard, tp_size=layout.tp_size, ep_size=layout.ep_size, progress=False)
        model = {"kind": "model", "folder": str(source)}
        jobs = [{**model, "name": "auto", "load_format": "auto"},
                {**model, "name": "wna16-checkpoint", "load_format": "wna16"},
                {**model, "name": "wna16-shard", "folder": str(shard), "load_format": "wna16"}]
        with pytest.MonkeyPatch.context() as env:
            env.setenv(*NO_MHC_PREWARM)
            run_group(ranks, jobs, out / group, ep=ep, script=HERE / "sglang_rank.py")
        got[group] = {job["name"]: [result(out / group, job["name"], r) for r in range(ranks)] for job in jobs}
    return got


def expert_params(params: dict) -> dict[str, torch.Tensor]:
    """The MoE layers' parameters (not sglang_rank's `moe.NAME...` records of each layer)."""
    return {name: t for name, t in params.items() if ".mlp.experts." in name and not name.startswith("moe.")}


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("name", LOADS)
def test_plugin_equals_sglangs_own_v4_load(loaded, group, name):
    """Every parameter of every rank, MoE and other, equals SGLang's default load of the same checkpoint."""
    for rank, (theirs, ours) in enumerate(zip(loaded[group]["auto"], loaded[group][name])):
        assert "type" not in theirs and "type" not in ours, (theirs.get("trace"), ours.get("trace"))
        assert bytes(ours["loader"].tolist()) == b"WNA16ModelLoader"
        assert bytes(theirs["loader"].tolist()) == b"DefaultModelLoader"
        assert sorted(ours) == sorted(theirs)
        differ = sorted(p for p, t in theirs.items() if p != "loader" and not torch.equal(ours[p], t))
        assert not differ, f"{group} rank{rank} ({name}): {differ} differ from SGLang's own load"


def test_the_routing_tables_reach_sglang_through_the_plugin(loaded):
    """The hash-routed layers' tid2eid and the others' correction bias (non-expert tensors, handed to SGLang's
    load_weights) hold the checkpoint's values after the plugin's load (the test above: equal to SGLang's own)."""
    params, written = loaded["tp1"]["wna16-checkpoint"][0], loaded["written"]
    for layer in range(3):
        assert torch.equal(params[f"model.layers.{layer}.mlp.topk.tid2eid"],
                           written[f"layers.{layer}.ffn.gate.tid2eid"])
    assert torch.equal(params["model.layers.3.mlp.gate.e_score_correction_bias"], written["layers.3.ffn.gate.bias"])


@pytest.mark.parametrize("group", GROUPS)
def test_every_layer_is_an_int4_moe_layer_whose_experts_are_written(loaded, group):
    """SGLang builds a compressed-tensors MoE layer in each of the 4 layers (hash-routed 0-2 too), named
    model.layers.L.mlp.experts, none for the MTP layer; the plugin writes every scale of the rank's experts."""
    for rank, params in enumerate(loaded[group]["wna16-checkpoint"]):
        experts = expert_params(params)
        assert {n.split(".mlp.")[0] for n in experts} == {f"model.layers.{layer}" for layer in range(LAYERS)}
        fused = {name: int(record[0]) for name, record in params.items() if name.endswith(".fused_shared")}
        assert fused == {f"moe.model.layers.{layer}.mlp.experts.fused_shared": 0 for layer in range(LAYERS)}
        for layer in range(LAYERS):
            for half in ("w13", "w2"):
                scales = experts[f"model.layers.{layer}.mlp.experts.{half}_weight_scale"]
                assert not (scales.view(torch.uint8) == SENTINEL).all(-1).any(), f"{group} rank{rank} L{layer}"


@pytest.mark.parametrize("group, shape", [("tp1", (8, 64 // 8, 2 * 128)), ("tp2", (8, 64 // 8, 128)),
                                          ("ep2", (4, 64 // 8, 2 * 128))])
def test_each_rank_holds_its_share(loaded, group, shape):
    """CompressedTensorsWNA16MoE's K-major words w13_weight_packed [E_l, H/8, 2·I_p]: TP 2 halves I, EP 2 the
    experts."""
    params = loaded[group]["wna16-checkpoint"][0]
    assert tuple(params["model.layers.0.mlp.experts.w13_weight_packed"].shape) == shape
