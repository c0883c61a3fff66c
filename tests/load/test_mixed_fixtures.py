"""The three mixed-precision real checkpoints (GPTQModel `dynamic`, compressed-tensors config groups + ignore,
auto-round `extra_config`): each layer's own spec, then bit-exact against the quantizer's dequantisation at
TP 1/2/4/8 x EP 1/2 through load_experts, the engine hook and a wna16-shard output. See tests/fixtures/README.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_exact, assert_owners, load_all_ranks, stitch
from safetensors import safe_open
from safetensors.torch import load_file

from wna16_loader import (
    FusedMoEExperts,
    LoadedExperts,
    ParallelConfig,
    check_model_complete,
    expert_param_mapping,
    install_load_hook,
    load_experts,
    load_model_experts,
    read_moe_config,
)
from wna16_loader.preshard import preshard_checkpoint
from wna16_loader.preshard.verify import verify_output

NAMES = ("gptq_dynamic_mixed", "ct_multigroup_mixed", "autoround_layer_config_mixed")
PREFIXES = tuple(f"model.layers.{layer}.mlp.experts" for layer in range(3))
PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
NUM_EXPERTS = 4
SPLITS = [(tp, ep) for tp in (1, 2, 4, 8) for ep in (1, 2)]
SPECS = {  # layer -> (describe(), the rule as the loader names it), from each fixture's provenance.json
    "gptq_dynamic_mixed": (
        ("gptq 4-bit g32 asym", "the top-level quantization_config"),
        ("gptq 8-bit g64 asym", "dynamic rule '+:model\\\\.layers\\\\.1\\\\.mlp\\\\.experts(\\\\.|$)' "
                                "{'bits': 8, 'group_size': 64}"),
        ("not quantized (float weights) float16", "dynamic rule '-:model\\\\.layers\\\\.2\\\\.mlp\\\\.experts(\\\\.|$)'")),
    "ct_multigroup_mixed": (
        ("compressed-tensors 4-bit g32 asym", "config_groups['group_1'] target 'Linear'"),
        ("compressed-tensors 8-bit g64 sym", "config_groups['group_2'] target 're:.*layers\\\\.1\\\\.mlp\\\\.experts\\\\..*'"),
        ("not quantized (float weights) float16",
         "ignore entry 'model.layers.2.mlp.experts.0.down_proj' (and 11 more entries like it)")),
    "autoround_layer_config_mixed": (
        ("gptq 4-bit g32 sym", "the top-level quantization_config"),
        ("gptq 8-bit g64 sym", "extra_config['model.layers.1.mlp.experts.0.down_proj'] = {'bits': 8, 'group_size': 64} "
                               "(and 11 more entries like it)"),
        ("not quantized (float weights) bfloat16",
         "extra_config['model.layers.2.mlp.experts.0.down_proj'] = {'bits': 16} (and 11 more entries like it)")),
}


def checkpoint(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def references(name: str) -> dict[tuple[str, int, str], torch.Tensor]:
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    return {(prefix, e, proj): ref[f"{prefix}.{e}.{tensor}.weight"]
            for prefix in PREFIXES for e in range(NUM_EXPERTS) for proj, tensor in PROJ_NAMES.items()}


def check(name: str, loads: dict[tuple[int, int], LoadedExperts], tp: int, ep: int) -> None:
    """Every rank's layer has its own spec; the stitched weights equal the tool's reference bit for bit."""
    for loaded in loads.values():
        layers = [loaded[p] for p in PREFIXES]
        assert [layer.quantized for layer in layers] == [True, True, False]
        assert [layer.bits for layer in layers] == [4, 8, 16]
        part = 128 // tp
        assert [layer.group_size for layer in layers] == [min(32, part), min(64, part), -1]  # G_eff per layer
    weights, owners = stitch(loads, tp)
    assert_owners(owners, PREFIXES, NUM_EXPERTS, tp, ep)
    assert_exact(weights, references(name))


@pytest.mark.parametrize("name", NAMES)
def test_each_layer_resolves_its_own_spec(name: str) -> None:
    provenance = json.loads((FIXTURES / name / "provenance.json").read_text())["layers"]
    moe = read_moe_config(checkpoint(name))
    assert moe.experts_prefixes == PREFIXES
    for prefix, (spec, rule) in zip(PREFIXES, SPECS[name]):
        layer = moe.spec_of(prefix)
        assert layer.describe() == f"{spec}  <- {rule}"
        assert layer.spec.quantized == provenance[prefix].get("quantized", True)
        if layer.spec.quantized:
            assert (layer.spec.bits, layer.spec.group_size, layer.spec.symmetric) == tuple(
                provenance[prefix][k] for k in ("bits", "group_size", "sym"))


@pytest.mark.parametrize("tp,ep", SPLITS, ids=[f"tp{t}-ep{e}" for t, e in SPLITS])
@pytest.mark.parametrize("name", NAMES)
def test_load_experts_matches_the_tool(name: str, tp: int, ep: int) -> None:
    check(name, load_all_ranks(checkpoint(name), tp, ep), tp, ep)


def _engine_rank(name: str, parallel: ParallelConfig) -> LoadedExperts:
    """One rank through FusedMoEExperts + weight_loader, fed every checkpoint tensor whole (as an engine)."""
    moe = read_moe_config(checkpoint(name))
    modules = {p: FusedMoEExperts(moe, p, parallel) for p in moe.experts_prefixes}
    mapping = expert_param_mapping(moe)
    with safe_open(str(checkpoint(name) / "model.safetensors"), framework="pt") as handle:
        for tensor_name in handle.keys():
            for target in mapping(tensor_name):
                module = modules[target.param_name.rsplit(".", 1)[0]]
                module.weight_loader(getattr(module, target.fused_name), handle.get_tensor(tensor_name),
                                     tensor_name, target.shard_id.value, target.expert_id)
    out = LoadedExperts()
    for prefix, module in modules.items():
        module.check_complete()
        out[prefix] = module.to_fused()
    return out


@pytest.mark.parametrize("tp,ep", SPLITS, ids=[f"tp{t}-ep{e}" for t, e in SPLITS])
@pytest.mark.parametrize("name", NAMES)
def test_engine_hook_matches_the_tool(name: str, tp: int, ep: int) -> None:
    loads = {(t, e): _engine_rank(name, ParallelConfig(tp_size=tp, tp_rank=t, ep_size=ep, ep_rank=e))
             for e in range(ep) for t in range(tp)}
    check(name, loads, tp, ep)


@pytest.mark.parametrize("tp,ep", SPLITS, ids=[f"tp{t}-ep{e}" for t, e in SPLITS])
@pytest.mark.parametrize("name", NAMES)
def test_wna16_shard_output_matches_the_tool(name: str, tp: int, ep: int, tmp_path: Path) -> None:
    out = tmp_path / "out"
    preshard_checkpoint(checkpoint(name), out, tp_size=tp, ep_size=ep, progress=False)
    check(name, load_all_ranks(out, tp, ep), tp, ep)
    layers = json.loads((out / "wna16_manifest.json").read_text())["quantization"]["layers"]
    assert [layers[p]["spec"] for p in PREFIXES] == [spec.split(" float")[0].split(" bfloat")[0]
                                                      for spec, _ in SPECS[name]]
    assert [layers[p]["rule"] for p in PREFIXES] == [rule for _, rule in SPECS[name]]


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2)])  # tp 4: layer 1 (G 64) has no group-aligned cut
@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_layout_output_verifies(name: str, tp: int, ep: int, tmp_path: Path) -> None:
    """--layout checkpoint slices each layer in its own format (a float layer as rows / columns of its weights);
    verify reassembles every layer over TP and compares it with the source."""
    out = tmp_path / "out"
    preshard_checkpoint(checkpoint(name), out, tp_size=tp, ep_size=ep, progress=False, layout="checkpoint")
    assert verify_output(out, source=checkpoint(name)) == []
    with safe_open(str(out / f"rank-00000-of-{tp * ep:05d}" / "model.safetensors"), framework="pt") as handle:
        gate = handle.get_slice(f"{PREFIXES[2]}.0.gate_proj.weight")
        assert gate.get_shape() == [128 // tp, 64]  # the rank's rows of the float gate_proj [I, H]


@pytest.mark.parametrize("name", NAMES)
def test_model_level_loads_build_each_layers_own_parameters(name: str, tmp_path: Path) -> None:
    """load_model_experts (from the checkpoint and from a wna16-shard output) and load_state_dict fill each layer's
    own parameter set (w13_weight for the float layer), equal to load_experts."""
    parallel = ParallelConfig(tp_size=2, tp_rank=1, ep_size=2, ep_rank=0)
    want = load_experts(checkpoint(name), parallel)
    out = tmp_path / "out"
    preshard_checkpoint(checkpoint(name), out, tp_size=2, ep_size=2, progress=False)
    moe = read_moe_config(checkpoint(name))
    for fill in ("checkpoint", "output", "state_dict"):
        model = torch.nn.ModuleDict({str(i): FusedMoEExperts(moe, p, parallel) for i, p in enumerate(PREFIXES)})
        if fill == "state_dict":
            install_load_hook(model)
            prefixed = {f"{i}.{n[len(p) + 1:]}": t for i, p in enumerate(PREFIXES)
                        for n, t in load_file(str(checkpoint(name) / "model.safetensors")).items()
                        if n.startswith(p + ".")}
            model.load_state_dict(prefixed, strict=False)
            check_model_complete(model)
        else:
            load_model_experts(model, checkpoint(name) if fill == "checkpoint" else out, parallel)
        for i, prefix in enumerate(PREFIXES):
            got = dict(model[str(i)].named_parameters())
            assert sorted(got) == sorted(want[prefix].tensors), (fill, prefix)
            assert all(torch.equal(got[n], t) for n, t in want[prefix].tensors.items()), (fill, prefix)
