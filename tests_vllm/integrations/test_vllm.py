"""The vLLM plugin (`--load-format wna16`) against vLLM's default loader, in whole Qwen3-MoE models built by
vLLM with the moe_wna16 method at TP 1 and 2 (gloo): every parameter of every rank is equal."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from model_checkpoint import write_model
from tier import result, run_group

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
