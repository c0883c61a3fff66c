"""The vLLM plugin (`--load-format wna16`) against vLLM's default loader, in whole Qwen3-MoE models built by
vLLM with the moe_wna16 method at TP 1 and 2 (gloo): every parameter of every rank is equal."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from model_checkpoint import write_model
from tier import result, run_group

from wna16_loader import ConfigError, FusedExperts, LayoutMismatchError, ParallelConfig, load_experts
from wna16_loader.integrations import vllm as plugin
from wna16_loader.preshard.run import preshard_checkpoint

TP_SIZES = (1, 2)


@pytest.fixture(scope="session")
def loaded(tmp_path_factory):
    """tp -> {"auto": ..., "wna16-checkpoint": ..., "wna16-shard": ...}: each rank's parameters."""
    root = tmp_path_factory.mktemp("plugin")
    source = write_model(root / "model")
    out = {}
    for tp in TP_SIZES:
        shard = root / f"shard-tp{tp}"
        preshard_checkpoint(source, shard, tp_size=tp, progress=False)
        jobs = [{"kind": "model", "name": "auto", "folder": str(source), "load_format": "auto"},
                {"kind": "model", "name": "wna16-checkpoint", "folder": str(source), "load_format": "wna16"},
                {"kind": "model", "name": "wna16-shard", "folder": str(shard), "load_format": "wna16"}]
        run_group(tp, jobs, root / f"tp{tp}")
        out[tp] = {job["name"]: [result(root / f"tp{tp}", job["name"], r) for r in range(tp)] for job in jobs}
    return out


def test_the_entry_point_names_the_plugin():
    """vLLM loads general plugins by this entry point group (vllm.plugins.load_general_plugins)."""
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("wna16") == "wna16_loader.integrations.vllm:register"


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("name", ["wna16-checkpoint", "wna16-shard"])
def test_plugin_equals_default_loader(loaded, tp, name):
    for rank, (theirs, ours) in enumerate(zip(loaded[tp]["auto"], loaded[tp][name])):
        assert "type" not in theirs and "type" not in ours, (theirs.get("trace"), ours.get("trace"))
        assert sorted(ours) == sorted(theirs)
        assert any(".experts." in n and n.endswith("w13_qweight") for n in ours), sorted(ours)
        for param, tensor in theirs.items():
            assert torch.equal(ours[param], tensor), f"tp{tp} rank{rank}: {param} differs ({name})"


# --- the plugin's refusals, in this process (no vLLM model needed) ---------------------------------------

GPTQ = Path(__file__).resolve().parents[2] / "tests/fixtures/gptq_w4_g32_zero_edge/checkpoint"
PREFIX = "model.layers.0.mlp.experts"


class Slots(torch.nn.Module):
    """The two members of vLLM's RoutedExperts that fill_layer uses: parameters by name, and the expert map."""

    def __init__(self, tensors: dict[str, torch.Tensor], local: dict[int, int]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
        self.local = local

    def _map_global_expert_id_to_local_expert_id(self, expert: int) -> int:
        return self.local.get(expert, -1)


def rank0() -> FusedExperts:
    return load_experts(GPTQ, ParallelConfig(tp_size=1, tp_rank=0))[PREFIX]


def test_fill_layer_copies_every_tensor():
    experts = rank0()
    layer = Slots({k: v for k, v in experts.tensors.items() if k != "expert_ids"}, {e: e for e in range(4)})
    plugin.fill_layer(layer, experts)
    assert all(torch.equal(getattr(layer, k), v) for k, v in experts.tensors.items() if k != "expert_ids")


def test_fill_layer_refuses_another_shape():
    experts = rank0()
    tensors = {k: v for k, v in experts.tensors.items() if k != "expert_ids"}
    tensors["w2_scales"] = torch.zeros(4, 128, 8, dtype=torch.float16)  # vLLM's group size 16
    with pytest.raises(LayoutMismatchError, match=r"model\.layers\.0\.mlp\.experts\.w2_scales: vLLM's parameter is "
                       r"\[4, 128, 8\], this rank's fused tensor \[4, 128, 4\] \(group size 32, I_p 128\)"):
        plugin.fill_layer(Slots(tensors, {e: e for e in range(4)}), experts)


def test_fill_layer_refuses_another_expert_placement():
    experts = rank0()
    layer = Slots({k: v for k, v in experts.tensors.items() if k != "expert_ids"}, {0: 0, 1: 2, 2: 1, 3: 3})
    with pytest.raises(LayoutMismatchError, match="slot 1 holds expert 1 here, but vLLM places it in slot 2; use "
                       "the same --expert-placement-strategy"):
        plugin.fill_layer(layer, experts)


def test_a_model_without_moe_wna16_layers_is_refused():
    with pytest.raises(ConfigError, match=r"the model has 0 MoE layer\(s\) .* --quantization moe_wna16"):
        plugin.expert_layers(torch.nn.Linear(2, 2))


def test_an_experts_prefix_vllm_does_not_have_is_refused():
    with pytest.raises(ConfigError, match=r"prefix 'model\.layers\.7\.mlp\.experts' \(vLLM name "
                       r"'model\.layers\.7\.mlp\.experts'\) is no MoE layer of the vLLM model; its MoE layers: "
                       r"\['model\.layers\.0\.mlp\.experts'\]"):
        plugin.vllm_name(torch.nn.Module(), "model.layers.7.mlp.experts", {PREFIX: torch.nn.Module()})
