"""scripts/bench --suite inplace (bench/suite_inplace.py): what filling vLLM-shaped parameters in place adds at its peak, measured on the
device path (the GPU stand-in's max_memory_allocated, as scripts/gpu_check measures it on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench import suite_inplace as bench_inplace

from wna16_loader.preshard.run import preshard_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer GPTQ 4-bit g128 checkpoint of 16 experts and its TP 2 fused output (the script's own shape,
    smaller)."""
    tmp = tmp_path_factory.mktemp("inplace")
    src = write_checkpoint(tmp / "ckpt", quant_config("gptq", bits=4, group_size=128, symmetric=True),
                           num_experts=16, hidden=256, intermediate=256, num_layers=2, references=False).folder
    preshard_checkpoint(src, tmp / "shard", tp_size=2, progress=False)
    return json.dumps({"checkpoint": str(src), "shard": str(tmp / "shard")})


def test_the_previous_path_adds_the_parameters_and_in_place_adds_at_most_a_layer(sources: str) -> None:
    """On the device: load-then-copy holds a second set of the parameters; moe_wna16 (taken as is) adds less
    than one layer; auto_gptq from the checkpoint (its own words, copied expert by expert: load.direct) less
    than one 8-expert chunk of a layer; moe_wna16 from a shard almost nothing (read into the parameters)."""
    copy = bench_inplace.child("copy", "moe_wna16", sources, 1, "stand-in")
    as_is = bench_inplace.child("checkpoint", "moe_wna16", sources, 1, "stand-in")
    copied = bench_inplace.child("checkpoint", "auto_gptq", sources, 1, "stand-in")
    shard = bench_inplace.child("shard", "moe_wna16", sources, 2, "stand-in")
    assert copy["added"] >= copy["params"]
    assert as_is["added"] < as_is["layer"]
    assert copied["added"] < copied["layer"] / 2  # 16 experts: no fused layer, no chunk of 8
    assert shard["added"] < 1024
