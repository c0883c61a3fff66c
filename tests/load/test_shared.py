"""load.shared through integrations.fill: an engine layer with fused shared-expert slots (LayerTarget.shared_slots)
gets its routed experts and, after them, the family's shared experts, split by TP as a routed expert is and held
by every EP rank, from a checkpoint folder and from a wna16-shard output (common/ holds them as the checkpoint
does). The reference is what SGLang's DeepSeek loader does to the checkpoint: `mlp.shared_experts` renamed to
`mlp.experts.{n_routed_experts}` and loaded as one more routed expert (here: that renamed checkpoint filled by
load.inplace with n_routed_experts + 1 experts at TP only, its slots taken as the engine places them).

The model is DeepSeek-V3's published config (tests/fixtures/configs/deepseek_v3.json: 256 routed experts, 1 shared,
first_k_dense_replace) at H = I = 64 with 2 decoder layers (layer 1 the one MoE layer), in each row SGLang fills:
GPTQ Marlin, moe_wna16, AWQ, compressed-tensors, and unquantized (the MoE layer kept float by GPTQ's `dynamic`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wna16_loader import ConfigError, ParallelConfig, load_experts
from wna16_loader.integrations.fill import common_weights, fill_model
from wna16_loader.layouts import AUTO_AWQ, CT_WNA16_K_MAJOR, GPTQ_MARLIN, MOE_WNA16, UNQUANTIZED, allocated_shape
from wna16_loader.load.inplace import LayerTarget, fill_layers, layer_sizes
from wna16_loader.load.shared import fill_shared
from wna16_loader.models.config import read_config_files
from wna16_loader.preshard.run import preshard_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_family_checkpoint

CONFIG = Path(__file__).resolve().parents[1] / "fixtures/configs/deepseek_v3.json"
PREFIX = "model.layers.1.mlp.experts"
SHARED = "model.layers.1.mlp.shared_experts"
ROUTED = 256
CASES = {  # name -> (quantization_config, the engine's row)
    "gptq_sym_marlin": (quant_config("gptq", bits=4, group_size=32, symmetric=True), GPTQ_MARLIN),
    "gptq_asym_moe_wna16": (quant_config("gptq", bits=4, group_size=32, symmetric=False), MOE_WNA16),
    "awq": (quant_config("awq", bits=4, group_size=32, symmetric=False), AUTO_AWQ),
    "ct": (quant_config("compressed-tensors", bits=4, group_size=32, symmetric=True), CT_WNA16_K_MAJOR),
}
PARALLEL = [ParallelConfig(tp_size=1, tp_rank=0), ParallelConfig(tp_size=2, tp_rank=1),
            ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=1)]


def deepseek_config() -> dict:
    config = json.loads(CONFIG.read_text())
    config.update(hidden_size=64, moe_intermediate_size=64, num_hidden_layers=2, first_k_dense_replace=1)
    return config


def renamed(folder: Path, out: Path) -> Path:
    """`folder` as SGLang's DeepSeek loader reads it: shared experts renamed to routed expert 256 (257 experts)."""
    out.mkdir()
    tensors = load_file(folder / "model.safetensors")
    save_file({name.replace(SHARED + ".", f"{PREFIX}.{ROUTED}."): t for name, t in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "n_routed_experts": ROUTED + 1}))
    return out


FLOAT = "float_unquantized"  # the MoE layer (routed and shared experts) kept float16 by GPTQ's `dynamic`


def floated(folder: Path) -> None:
    """`folder`'s MoE layer as a quantizer keeps a module float: every expert and shared-expert projection a float16
    `.weight` [N, K] (`dynamic` excludes the layer), the rest of the checkpoint as it is."""
    tensors, gen = load_file(folder / "model.safetensors"), torch.Generator().manual_seed(7)
    kept = {n: t for n, t in tensors.items() if not n.startswith((PREFIX + ".", SHARED + "."))}
    modules = [f"{PREFIX}.{e}" for e in range(ROUTED)] + [SHARED]
    for module in modules:
        for proj, shape in (("gate_proj", (64, 64)), ("up_proj", (64, 64)), ("down_proj", (64, 64))):
            kept[f"{module}.{proj}.weight"] = torch.randn(*shape, generator=gen).to(torch.float16)
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {r"-:model\.layers\.1\.mlp\..*": {}}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=sorted(CASES) + [FLOAT])
def case(request, tmp_path_factory):
    """(checkpoint, its wna16-shard outputs by TP/EP, the renamed reference checkpoint, the row)."""
    root = tmp_path_factory.mktemp(request.param)
    quant, row = CASES.get(request.param, (CASES["gptq_asym_moe_wna16"][0], UNQUANTIZED))
    folder = write_family_checkpoint(root / "ckpt", deepseek_config(), quant, shared=True).folder
    if request.param == FLOAT:
        floated(folder)
    shards = {}
    for tp, ep in ((1, 1), (2, 1), (1, 2)):
        shards[tp, ep] = root / f"shard-tp{tp}-ep{ep}"
        preshard_checkpoint(folder, shards[tp, ep], tp_size=tp, ep_size=ep, progress=False)
    return folder, shards, renamed(folder, root / "renamed"), row


def sentinel_params(row, folder: Path, parallel: ParallelConfig, slots: int) -> dict[str, torch.Tensor]:
    """The row's parameters for the rank's layer with `slots` expert slots, every byte 0x5A."""
    spec = load_experts(folder, parallel)[PREFIX].spec
    sizes = replace(layer_sizes(spec, 32), E=slots)
    params = {d.name: torch.empty(allocated_shape(d, sizes), dtype=d.dtype or torch.float16)
              for d in row.filled(spec.has_zero_point)}
    for param in params.values():
        param.view(torch.uint8).fill_(0x5A)
    return params


def reference(case, parallel: ParallelConfig) -> dict[str, torch.Tensor]:
    """SGLang's layout of the rank's slots: its routed experts, then the shared expert (from the renamed checkpoint)."""
    _, _, ref, row = case
    tp = ParallelConfig(tp_size=parallel.tp_size, tp_rank=parallel.tp_rank)
    whole = LayerTarget(row, sentinel_params(row, ref, tp, ROUTED + 1), tuple(range(ROUTED + 1)))
    fill_layers(ref, tp, {PREFIX: whole})
    local = ROUTED // parallel.ep_size
    keep = [*range(parallel.ep_rank * local, (parallel.ep_rank + 1) * local), ROUTED]
    return {name: param[keep] for name, param in whole.params.items()}


def engine_fill(case, parallel: ParallelConfig, source: Path):
    """The plugin's fill (integrations.fill.fill_model) of one engine layer with one fused shared slot."""
    folder, _, _, row = case
    local = ROUTED // parallel.ep_size
    first = parallel.ep_rank * local
    target = LayerTarget(row, sentinel_params(row, folder, parallel, local + 1), tuple(range(first, first + local)),
                         shared_slots=1)
    report = fill_model(source, "the engine", {PREFIX: target}, lambda layer: layer, parallel)
    return target, report


@pytest.mark.parametrize("parallel", PARALLEL, ids=lambda p: f"tp{p.tp_size}r{p.tp_rank}-ep{p.ep_size}r{p.ep_rank}")
@pytest.mark.parametrize("from_shard", [False, True], ids=["checkpoint", "output"])
def test_the_shared_slot_holds_what_sglangs_renaming_loads(case, parallel, from_shard):
    folder, shards, _, _ = case
    source = shards[parallel.tp_size, parallel.ep_size] if from_shard else folder
    target, report = engine_fill(case, parallel, source)
    want = reference(case, parallel)
    for name, param in want.items():
        assert torch.equal(target.params[name], param), name
    shared = sorted(name for name in load_file(folder / "model.safetensors") if name.startswith(SHARED + "."))
    assert sorted(report.shared) == shared and len(shared) >= 3  # gate, up and down at least
    assert not set(report.shared) & set(report.ignored)


@pytest.mark.parametrize("from_shard", [False, True], ids=["checkpoint", "output"])
def test_the_engine_is_handed_every_other_tensor_but_the_shared_experts(case, from_shard):
    folder, shards, _, _ = case
    parallel = ParallelConfig(tp_size=2, tp_rank=0)
    source = shards[2, 1] if from_shard else folder
    _, report = engine_fill(case, parallel, source)
    handed = {name for name, _ in common_weights(source, report.ignored, report.shared)}
    others = {name for name in load_file(folder / "model.safetensors") if not name.startswith(PREFIX + ".")}
    assert handed == others - set(report.shared) and not any(name.startswith(SHARED) for name in handed)


def test_without_shared_slots_the_shared_experts_stay_the_engines(case):
    """A layer the engine holds apart from its shared experts (no shared slots): nothing changes."""
    folder, _, _, row = case
    parallel = ParallelConfig(tp_size=2, tp_rank=1)
    target = LayerTarget(row, sentinel_params(row, folder, parallel, ROUTED), tuple(range(ROUTED)))
    report = fill_model(folder, "the engine", {PREFIX: target}, lambda layer: layer, parallel)
    assert report.shared == () and {n for n in report.ignored if n.startswith(SHARED + ".")}
    assert fill_shared(read_config_files(folder), folder, parallel, {PREFIX: target}) == ()


def test_a_family_without_shared_experts_is_refused_by_name(tmp_path):
    config = json.loads((CONFIG.parent / "qwen3_moe.json").read_text())
    config.update(hidden_size=64, moe_intermediate_size=64, num_hidden_layers=1, num_experts=4, num_experts_per_tok=2)
    folder = write_family_checkpoint(tmp_path / "q", config, CASES["gptq_asym_moe_wna16"][0]).folder
    parallel = ParallelConfig(tp_size=1, tp_rank=0)
    prefix = "model.layers.0.mlp.experts"
    target = LayerTarget(MOE_WNA16, {}, (0, 1, 2, 3), shared_slots=1)
    with pytest.raises(ConfigError, match=rf"{prefix}: the engine holds 1 fused shared-expert slot\(s\), but the "
                       r"families table's row 'qwen3_moe' declares no shared experts \(Family\.shared\); add them"):
        fill_shared(read_config_files(folder), folder, parallel, {prefix: target})


def test_a_shared_count_other_than_one_is_refused_by_name(tmp_path):
    config = {**deepseek_config(), "n_shared_experts": 2}
    folder = write_family_checkpoint(tmp_path / "two", config, CASES["awq"][0], shared=True).folder
    target = LayerTarget(AUTO_AWQ, {}, tuple(range(ROUTED)), shared_slots=1)
    with pytest.raises(ConfigError, match=rf"{PREFIX}: the engine holds 1 fused shared-expert slot\(s\), the config "
                       r"counts 2 shared experts in one shared_experts module \(n_shared_experts\); .* only a count "
                       r"of 1 fuses"):
        fill_shared(read_config_files(folder), folder, ParallelConfig(tp_size=1, tp_rank=0), {PREFIX: target})


def test_a_checkpoint_without_the_shared_tensors_is_refused_by_name(tmp_path):
    folder = write_family_checkpoint(tmp_path / "none", deepseek_config(), CASES["awq"][0]).folder
    tensors = load_file(folder / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if not n.startswith(SHARED)}, folder / "model.safetensors")
    target = LayerTarget(AUTO_AWQ, {}, tuple(range(ROUTED)), shared_slots=1)
    with pytest.raises(ConfigError, match=rf"the engine fused shared experts into 1 MoE layers, but \['{SHARED}'\] "
                       rf"hold no tensors here \(expected e\.g\. {SHARED}\.gate_proj\.qweight\)"):
        fill_shared(read_config_files(folder), folder, ParallelConfig(tp_size=1, tp_rank=0), {PREFIX: target})


def test_an_output_says_where_its_shared_experts_are(case, tmp_path):
    """A wna16-shard output keeps the shared experts in common/ as the source holds them, its manifest says so, and
    verify passes; a source without shared experts records none."""
    from wna16_loader.preshard import read_manifest, verify_output

    folder, shards, _, _ = case
    manifest = read_manifest(shards[2, 1])
    assert manifest["shared_experts"] == {"modules": [SHARED], "count": 1, "where": "common/, as the source holds them"}
    assert {name: place for name, place in manifest["source_tensors"].items() if name.startswith(SHARED + ".")} == \
        {name: {"common": "common/model.safetensors"} for name in load_file(folder / "model.safetensors")
         if name.startswith(SHARED + ".")}
    assert verify_output(shards[2, 1], folder) == []
    config = json.loads((CONFIG.parent / "qwen3_moe.json").read_text())
    config.update(hidden_size=64, moe_intermediate_size=64, num_hidden_layers=1, num_experts=4, num_experts_per_tok=2)
    other = write_family_checkpoint(tmp_path / "q", config, CASES["awq"][0]).folder
    preshard_checkpoint(other, tmp_path / "q-out", tp_size=2, progress=False)
    assert "shared_experts" not in read_manifest(tmp_path / "q-out")
