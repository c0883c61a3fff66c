"""The vLLM plugin (`--load-format wna16`) against vLLM's default loader, in whole Qwen3-MoE models built by
vLLM (gloo ranks) at TP 1, TP 2 and EP 2 (vLLM's enable_expert_parallel on 2 ranks: MoE TP 1, EP 2):

- with no --quantization flag, as `vllm serve` runs it: vLLM picks AutoGPTQMoEMethod for the symmetric GPTQ
  experts, and the plugin fills its K-major parameters in place, from the checkpoint folder and from a
  `wna16-shard --layout fused` output (re-laid on the way in);
- with --quantization moe_wna16: the fused layout written straight into vLLM's parameters.

Every parameter of every rank is equal to vLLM's default load as its loader left it (before
process_weights_after_loading), on every machine; where vLLM's CPU int4 MoE kernel runs (AMX:
workarounds.processes_moe_weights) also after vLLM's own processing ("processed." names)."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from layer_cases import GROUPS, MODEL_GROUPS
from tier import result

from wna16_loader import ConfigError
from wna16_loader.integrations import vllm as plugin
from wna16_loader.layouts import VLLM_LAYOUTS

LOADS = ("wna16-checkpoint", "wna16-shard", "moe_wna16-wna16")


@pytest.fixture(scope="session")
def loaded(vllm_out):
    """group -> {job name: each rank's parameters} of the model jobs (layer_cases.model_jobs, run with the
    layer jobs by conftest's vllm_out): "auto" and "moe_wna16-auto" are vLLM's default loader."""
    names = ("auto", *LOADS, "moe_wna16-auto")
    return {group: {name: [result(vllm_out / group, name, r) for r in range(GROUPS[group][0])] for name in names}
            for group in MODEL_GROUPS}


def test_the_entry_point_names_the_plugin():
    """vLLM loads general plugins by this entry point group (vllm.plugins.load_general_plugins)."""
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("wna16") == "wna16_loader.integrations.vllm:register"


@pytest.mark.parametrize("group", MODEL_GROUPS)
@pytest.mark.parametrize("name", LOADS)
def test_plugin_equals_default_loader(loaded, group, name):
    baseline = "moe_wna16-auto" if name.startswith("moe_wna16") else "auto"
    for rank, (theirs, ours) in enumerate(zip(loaded[group][baseline], loaded[group][name])):
        assert "type" not in theirs and "type" not in ours, (theirs.get("trace"), ours.get("trace"))
        assert sorted(ours) == sorted(theirs)
        assert any(".experts." in n and n.endswith("w13_qweight") for n in ours), sorted(ours)
        for param, tensor in theirs.items():
            assert torch.equal(ours[param], tensor), f"{group} rank{rank}: {param} differs ({name})"


def test_without_a_flag_vllm_picks_auto_gptq(loaded):
    """No --quantization: the symmetric GPTQ experts get AutoGPTQ's K-major int32 words, [E, H/P, 2·I_p]."""
    params = loaded["tp1"]["auto"][0]
    assert params["model.layers.0.mlp.experts.routed_experts.w13_qweight"].shape == (4, 128 // 8, 2 * 128)
    assert loaded["tp1"]["moe_wna16-auto"][0]["model.layers.0.mlp.experts.routed_experts.w13_qweight"].dtype \
        == torch.uint8


def test_every_declared_layout_has_its_vllm_method():
    assert sorted(layout.name for layout in plugin.METHOD_LAYOUTS.values()) == \
        sorted(layout.name for layout in VLLM_LAYOUTS)


def test_a_model_without_moe_layers_is_refused():
    with pytest.raises(ConfigError, match=r"the model has no MoE layer; load it with vLLM's default --load-format"):
        plugin.expert_layers(torch.nn.Linear(2, 2))


def test_an_unknown_moe_method_is_refused():
    class Layer:
        layer_name = "model.layers.0.mlp.experts"
        quant_method = object()

    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.experts: vLLM chose the MoE method object, "
                       r"whose parameters --load-format wna16 does not fill \(it fills MoeWNA16Method, "
                       r"AutoGPTQMoEMethod, AutoAWQMoEMethod, CompressedTensorsWNA16MoEMethod, "
                       r"UnquantizedFusedMoEMethod\)"):
        plugin.layer_target(Layer())
