"""FusedMoEExperts, the engine-style weight_loader hook, the load_state_dict hook and the reference forward.

Every fill path is checked bit for bit against `load_experts`; the reference
forward is checked against the synthetic float32 references and, summed over
every TP x EP rank, against the unsharded forward.
"""

from __future__ import annotations

import json
import logging
import re
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest
import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from safetensors.torch import load_file
from sources import nemotron_checkpoint
from torch import nn

from wna16_loader import (
    FUSED_NAMES,
    Activation,
    CompletenessError,
    ConfigError,
    FormatError,
    FusedMoEExperts,
    LayoutMismatchError,
    MoEConfig,
    ParallelConfig,
    ShardId,
    WNA16Error,
    check_model_complete,
    expert_param_mapping,
    install_load_hook,
    load_experts,
    load_model_experts,
    read_moe_config,
    reference_forward,
)
from wna16_loader.formats import Role, resolve_module_rules
from wna16_loader.testing.synthetic import (
    WRITER_MODELS,
    QuantizedProjection,
    SyntheticCheckpoint,
    encode_role,
    quant_config,
    write_checkpoint,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
REAL = sorted(p.name for p in FIXTURES.iterdir() if (p / "checkpoint" / "config.json").is_file()) \
    if FIXTURES.is_dir() else []

FORMATS = {
    "awq": quant_config("awq"),
    "gptq_act_order": quant_config("gptq", act_order=True),
    "gptq_sym": quant_config("gptq", symmetric=True),
    "ct_asym": quant_config("compressed-tensors"),
    "ct_w8_channel_sym": quant_config("compressed-tensors", bits=8, group_size=-1, symmetric=True),
    "ct_act_order": quant_config("compressed-tensors", act_order=True),
    "autoround": quant_config("auto-round"),
}


# ---------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., SyntheticCheckpoint]:
    """Write (once per module) a small synthetic checkpoint: hidden 64, intermediate 64, 4 experts."""
    cache: dict[tuple, SyntheticCheckpoint] = {}

    def make(fmt: str, **kwargs: Any) -> SyntheticCheckpoint:
        key = (fmt, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = write_checkpoint(tmp_path_factory.mktemp(fmt), FORMATS[fmt],
                                          **{"num_experts": 4, "hidden": 64, "intermediate": 64, **kwargs})
        return cache[key]

    return make


@pytest.fixture(scope="module")
def checkpoints(synthetic: Callable[..., SyntheticCheckpoint]) -> Callable[..., Path]:
    """The folder of a `synthetic` checkpoint."""
    return lambda fmt, **kwargs: synthetic(fmt, **kwargs).folder


def build_model(prefixes: tuple[str, ...], make: Callable[[str], nn.Module]) -> nn.Module:
    """A module tree whose paths are the experts prefixes, e.g. root.model.layers.0.mlp.experts."""
    root = nn.Module()
    for prefix in prefixes:
        parent = root
        *path, last = prefix.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(last, make(prefix))
    return root


def model_for(folder: Path, parallel: ParallelConfig, **kwargs: Any) -> tuple[nn.Module, MoEConfig]:
    moe = read_moe_config(folder)
    return build_model(moe.experts_prefixes, lambda p: FusedMoEExperts(moe, p, parallel, **kwargs)), moe


def checkpoint_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint folder, whole, in file order (what an engine iterates)."""
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def engine_load(model: nn.Module, moe: MoEConfig, tensors: list[tuple[str, torch.Tensor]]) -> int:
    """Feed every tensor to its parameter's weight_loader, as an engine does; returns the accepted count."""
    params = dict(model.named_parameters())
    mapping = expert_param_mapping(moe)
    accepted = 0
    for name, tensor in tensors:
        for target in mapping(name):
            param = params[target.param_name]
            accepted += param.weight_loader(param, tensor, name, target.shard_id.value, target.expert_id)
    return accepted


def experts_of(model: nn.Module) -> dict[str, FusedMoEExperts]:
    return {m.prefix: m for m in model.modules() if isinstance(m, FusedMoEExperts)}


def assert_equal_to_load_experts(model: nn.Module, folder: Path, parallel: ParallelConfig) -> None:
    loaded = load_experts(folder, parallel)
    modules = experts_of(model)
    assert sorted(modules) == sorted(loaded)
    for prefix, module in modules.items():
        want = loaded[prefix].tensors
        got = dict(module.named_parameters())
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"{prefix}.{name} differs from load_experts"


def routing(tokens: int, num_experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 64, generator=gen) / 8
    weights, ids = torch.rand(tokens, num_experts, generator=gen).softmax(-1).topk(top_k)
    return hidden, ids, weights


# ---------------------------------------------------------------------- construction

@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order", "ct_asym", "ct_w8_channel_sym", "autoround"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (4, 1), (3, 1), (8, 2)])  # 3, 8: I = 64 padded to 96, 128
def test_module_layout_equals_load_experts(checkpoints: Callable[..., Path], fmt: str, tp: int, ep: int) -> None:
    folder = checkpoints(fmt)
    moe = read_moe_config(folder)
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
        layer = load_experts(folder, parallel)[moe.experts_prefixes[0]]
        module = FusedMoEExperts(moe, moe.experts_prefixes[0], parallel)
        params = dict(module.named_parameters())
        assert list(params) == [n for n in FUSED_NAMES if n in layer.tensors]
        assert {n: (p.shape, p.dtype) for n, p in params.items()} == \
            {n: (t.shape, t.dtype) for n, t in layer.tensors.items()}
        assert not any(p.requires_grad for p in params.values())
        assert (module.bits, module.group_size, module.has_zero_point, module.act_order) == \
            (layer.bits, layer.group_size, layer.has_zero_point, layer.act_order)
        assert (module.intermediate_size, module.intermediate_size_per_partition, module.padding) == \
            (layer.intermediate_size, layer.intermediate_size_per_partition, layer.padding)
        assert module.expert_ids.tolist() == layer.expert_ids.tolist()
        assert all(p.weight_loader == module.weight_loader for p in params.values())
        assert not hasattr(module, "tp_size")


def test_meta_construction_allocates_nothing() -> None:
    """A ~28 GiB layer under init_empty_weights: every parameter on meta, no resident memory."""
    moe = read_moe_config_like(num_experts=256, hidden=8192, intermediate=8192)
    rss = psutil.Process().memory_info().rss
    with init_empty_weights():
        module = FusedMoEExperts(moe, "model.layers.0.mlp.experts", ParallelConfig(1, 0))
    explicit = FusedMoEExperts(moe, "model.layers.0.mlp.experts", ParallelConfig(1, 0), device="meta")
    assert psutil.Process().memory_info().rss - rss < 64 * 2**20
    for m in (module, explicit):
        assert all(p.is_meta for p in m.parameters())
        assert sum(p.numel() * p.element_size() for p in m.parameters()) > 24 * 2**30
    with pytest.raises(CompletenessError, match="meta device"):
        module.weight_loader(module.w13_qweight, torch.zeros(1), "model.layers.0.mlp.experts.0.gate_proj.qweight",
                             "w1", 0)


def read_moe_config_like(**sizes: int) -> MoEConfig:
    """A MoEConfig with the given sizes (no checkpoint needed)."""
    from wna16_loader.models.config import resolve_moe_config
    from wna16_loader.testing.synthetic import model_config

    config = model_config(WRITER_MODELS["qwen3_moe"], FORMATS["gptq_act_order"], num_experts=sizes["num_experts"],
                          hidden=sizes["hidden"], intermediate=sizes["intermediate"], num_layers=1, top_k=2)
    return resolve_moe_config(config)


@pytest.mark.parametrize("materialise", ["to_empty", "materialize"])
def test_meta_then_materialise_then_load(checkpoints: Callable[..., Path], materialise: str) -> None:
    folder = checkpoints("gptq_act_order")
    parallel = ParallelConfig(tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)
    with init_empty_weights():
        model, moe = model_for(folder, parallel)
    if materialise == "to_empty":
        model.to_empty(device="cpu")
    else:
        for module in experts_of(model).values():
            module.materialize("cpu")
            assert all(not p.any() for n, p in module.named_parameters() if n != "expert_ids")
    for module in experts_of(model).values():
        assert module.expert_ids.tolist() == [2, 3]
        assert all(p.weight_loader == module.weight_loader for p in module.parameters())  # re-attached
    engine_load(model, moe, list(checkpoint_tensors(folder)))
    check_model_complete(model)
    assert_equal_to_load_experts(model, folder, parallel)


# ---------------------------------------------------------------------- engine-style weight_loader

ENGINE_CASES = {
    "gptq_act_order_tp2_ep2": ("gptq_act_order", {}, 2, 2),
    "awq_tp2": ("awq", {}, 2, 1),
    "ct_asym_ep2": ("ct_asym", {}, 1, 2),
    "ct_act_order_tp2": ("ct_act_order", {}, 2, 1),
    "ct_w8_channel_tp4": ("ct_w8_channel_sym", {}, 4, 1),
    "autoround_tp2_ep2": ("autoround", {}, 2, 2),
    "gptq_stacked_tp2_ep2": ("gptq_act_order", {"stacked": True}, 2, 2),
    "awq_mixtral_names_two_layers": ("awq", {"family": "mixtral", "num_layers": 2, "files": 2}, 2, 2),
    "ct_gemma4_root": ("ct_asym", {"family": "gemma4"}, 2, 1),
    # padded: I = 64 at tp 3 -> I' = 96 (rank 2 all padding), at tp 5 -> I' = 80, I = 72 at tp 2 (I_p = 36 unaligned)
    "awq_tp3_padded": ("awq", {}, 3, 1),
    "gptq_stacked_tp5_ep2_padded": ("gptq_act_order", {"stacked": True}, 5, 2),
    "ct_w8_channel_tp3_padded": ("ct_w8_channel_sym", {}, 3, 1),
    "ct_asym_i72_tp2_padded": ("ct_asym", {"intermediate": 72}, 2, 1),
}


@pytest.mark.parametrize("order", ["file", "reversed"])
@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_weight_loader_equals_load_experts(checkpoints: Callable[..., Path], case: str, order: str) -> None:
    """Every checkpoint tensor, whole, through weight_loader == load_experts, bit for bit, on every rank."""
    fmt, kwargs, tp, ep = ENGINE_CASES[case]
    folder = checkpoints(fmt, **kwargs)
    tensors = list(checkpoint_tensors(folder))
    if order == "reversed":  # optional roles (g_idx, symmetric zeros) arrive after the required ones
        tensors.reverse()
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
        model, moe = model_for(folder, parallel)
        assert engine_load(model, moe, tensors) > 0
        check_model_complete(model)
        assert_equal_to_load_experts(model, folder, parallel)
        assert all(len(m.hook.store) == 0 and not m.hook.pending for m in experts_of(model).values())


@pytest.mark.parametrize("cap", [1, 6000])
@pytest.mark.parametrize("order", ["file", "reversed"])
@pytest.mark.parametrize("case", ["gptq_act_order_tp2_ep2", "awq_tp3_padded", "gptq_stacked_tp2_ep2"])
def test_weight_loader_batches_of_any_size(checkpoints: Callable[..., Path], case: str, order: str, cap: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage cap of one byte writes every projection as it completes (stages of one slot), 6000 bytes
    stages of two or three slots: same bytes."""
    monkeypatch.setattr("wna16_loader.engine.hook.HOOK_BATCH_BYTES", cap)
    fmt, kwargs, tp, ep = ENGINE_CASES[case]
    folder = checkpoints(fmt, **kwargs)
    tensors = list(checkpoint_tensors(folder))[::-1 if order == "reversed" else 1]
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
        model, moe = model_for(folder, parallel)
        engine_load(model, moe, tensors)
        for module in experts_of(model).values():
            assert not module.hook.ready and not module.hook.pending and len(module.hook.store) == 0
        check_model_complete(model)
        assert_equal_to_load_experts(model, folder, parallel)


def test_handed_over_per_expert_tensors_are_not_kept(checkpoints: Callable[..., Path]) -> None:
    """The hook copies the rank's part of a per-expert tensor and keeps no reference to the engine's tensor
    (it is freed at once, before its projection is written); what it stages is the rank's slice only."""
    folder = checkpoints("gptq_act_order")
    model, moe = model_for(folder, ParallelConfig(tp_size=2, tp_rank=1))
    module = next(iter(experts_of(model).values()))
    name = f"{module.prefix}.0.gate_proj.qweight"
    tensor = dict(checkpoint_tensors(folder))[name].clone()
    alive = weakref.ref(tensor)
    assert module.weight_loader(module.w13_qweight, tensor, name, "w1", 0)
    del tensor
    assert alive() is None and len(module.hook.store) == 0
    (stage,) = module.hook.pending.values()
    assert stage.buffers["qweight"].shape == (len(module.spec.experts), 8, 32)  # [K/8, N/2] of [8, 64]


def test_complete_projections_wait_for_their_batch_until_read(checkpoints: Callable[..., Path]) -> None:
    """Expert 0 alone: its projections are complete but held (their batch waits for the other experts);
    reading the module (to_fused, ledger_report, check_complete) writes them first."""
    folder = checkpoints("awq")
    model, moe = model_for(folder, ParallelConfig(1, 0))
    module = next(iter(experts_of(model).values()))
    engine_load(model, moe, [(n, t) for n, t in checkpoint_tensors(folder) if f"{module.prefix}.0." in n])
    assert set(module.hook.ready) == set(module.spec.projections) and not module.w13_qweight.any()
    fused, want = module.to_fused(), load_experts(folder, ParallelConfig(1, 0))[module.prefix]
    assert not module.hook.ready and len(module.hook.store) == 0
    for name, tensor in want.tensors.items():
        if name != "expert_ids":
            assert torch.equal(fused.tensors[name][0], tensor[0]), name
    assert module.ledger_report() and all(f"{module.prefix}.0." not in line for line in module.ledger_report())


def test_fast_path_refuses_what_the_checked_path_refuses(checkpoints: Callable[..., Path]) -> None:
    """Once a tensor of a kind took the checked path, the next of that kind takes the fast one: every
    inconsistent argument still raises its own error there."""
    folder = checkpoints("awq")
    model, moe = model_for(folder, ParallelConfig(1, 0))
    module = next(iter(experts_of(model).values()))
    tensors = dict(checkpoint_tensors(folder))
    first, name = f"{module.prefix}.0.gate_proj.qweight", f"{module.prefix}.1.gate_proj.qweight"
    assert module.weight_loader(module.w13_qweight, tensors[first], first, "w1", 0)
    cases = [((tensors[name], name, "w2", 1), "means down"),
             ((tensors[name], name, "w1", 2), "expert_id=2 but the name says expert 1"),
             ((tensors[name], f"{module.prefix}.7.gate_proj.qweight", "w1", None), "outside 0..3"),
             ((tensors[name][:, :4], name, "w1", 1), r"shape \[64, 4\]"),
             ((tensors[name].float(), name, "w1", 1), "dtype torch.float32")]
    for args, message in cases:
        with pytest.raises(FormatError, match=message):
            module.weight_loader(module.w13_qweight, *args)
    assert module.weight_loader(module.w13_qweight, tensors[name], name, "w1", None)


@pytest.mark.skipif(not REAL, reason="no real fixtures")
@pytest.mark.parametrize("name", REAL)
def test_weight_loader_real_checkpoints(name: str) -> None:
    """Third-party checkpoints (GPTQModel, AutoAWQ, llm-compressor) through the hook at TP=2 x EP=2."""
    folder = FIXTURES / name / "checkpoint"
    for parallel in (ParallelConfig(tp_size=2, tp_rank=1, ep_size=2, ep_rank=0),
                     ParallelConfig(tp_size=2, tp_rank=0, ep_size=2, ep_rank=1)):
        dtype = next(iter(load_experts(folder, parallel).values())).spec.scale_dtype
        model, moe = model_for(folder, parallel, scale_dtype=dtype)
        engine_load(model, moe, list(checkpoint_tensors(folder)))
        check_model_complete(model)
        assert_equal_to_load_experts(model, folder, parallel)


def test_non_local_experts_return_false(checkpoints: Callable[..., Path]) -> None:
    folder = checkpoints("awq")
    moe = read_moe_config(folder)
    prefix = moe.experts_prefixes[0]
    with init_empty_weights():  # nothing is converted for a non-local expert, so meta parameters are fine
        module = FusedMoEExperts(moe, prefix, ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=0))
    tensors = dict(checkpoint_tensors(folder))
    for expert in (2, 3):
        for proj, shard in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            for suffix in ("qweight", "qzeros", "scales"):
                name = f"{prefix}.{expert}.{proj}.{suffix}"
                assert module.weight_loader(module.w13_qweight, tensors[name], name, shard, expert) is False
    assert not module.ledger.written and len(module.hook.store) == 0 and not module.hook.pending
    assert len(module.ledger.missing()) == module.ledger.expected_count()  # experts 0 and 1 are still all missing


@pytest.mark.parametrize("shard_id", ["w4", "gate", "W1", "", 1, None])
def test_invalid_shard_id_raises(checkpoints: Callable[..., Path], shard_id: Any) -> None:
    folder = checkpoints("awq")
    model, moe = model_for(folder, ParallelConfig(1, 0))
    module = next(iter(experts_of(model).values()))
    name = f"{module.prefix}.0.gate_proj.qweight"
    with pytest.raises(WNA16Error, match="shard_id"):
        module.weight_loader(module.w13_qweight, torch.zeros(64, 8, dtype=torch.int32), name, shard_id, 0)


def test_weight_loader_rejects_inconsistent_arguments(checkpoints: Callable[..., Path]) -> None:
    folder = checkpoints("awq")
    model, moe = model_for(folder, ParallelConfig(1, 0))
    module = next(iter(experts_of(model).values()))
    tensors = dict(checkpoint_tensors(folder))
    name = f"{module.prefix}.1.gate_proj.qweight"
    cases = [
        ((tensors[name], name, "w2", 1), "means down"),  # gate tensor sent as down
        ((tensors[name], name, "w1", 2), "expert_id=2 but the name says expert 1"),
        ((tensors[name], f"{module.prefix}.1.gate_proj.bias", "w1", 1), "suffix 'bias'"),
        ((tensors[name], f"{module.prefix}.w13_qweight", "w1", 1), "suffix 'w13_qweight'"),  # engine's mapped name
        ((tensors[name], f"{module.prefix}.7.gate_proj.qweight", "w1", 7), "outside 0..3"),
        ((tensors[name][:, :4], name, "w1", 1), r"shape \[64, 4\]"),
        ((tensors[name].float(), name, "w1", 1), "dtype torch.float32"),
    ]
    for args, message in cases:
        with pytest.raises(FormatError, match=message):
            module.weight_loader(module.w13_qweight, *args)
    assert module.weight_loader(module.w13_qweight, tensors[name], "qweight", ShardId.W1, 1)  # bare suffix + ids


def test_module_refuses_a_layer_whose_modules_resolve_differently(checkpoints: Callable[..., Path]) -> None:
    """One layer, one spec: a config that leaves one expert's gate_proj in float (the rest quantized) is refused
    when the layer's module is built, naming both specs, their modules and the rules."""
    folder = checkpoints("awq")
    moe = read_moe_config(folder)
    prefix = moe.experts_prefixes[0]
    qconfig = {**json.loads((folder / "config.json").read_text())["quantization_config"],
               "modules_to_not_convert": [f"{prefix}.1.gate_proj"]}
    mixed = replace(moe, rules=resolve_module_rules(qconfig), layer_specs=())
    with pytest.raises(ConfigError, match=rf"{re.escape(prefix)}: the expert modules of this MoE layer resolve to 2 "
                                          rf"different quantization specs, but one fused layer holds one spec:\n"
                                          rf"  - awq 4-bit g\d+ (a)?sym \(\d+ modules, by the top-level "
                                          rf"quantization_config\): .*\n  - not quantized \(float weights\) \(1 "
                                          rf"modules, by modules_to_not_convert entry '{re.escape(prefix)}.1.gate_proj'"
                                          rf"\): {re.escape(prefix)}.1.gate_proj\n"):
        FusedMoEExperts(mixed, prefix, ParallelConfig(1, 0))


def test_late_optional_role_is_checked(checkpoints: Callable[..., Path]) -> None:
    """GPTQ symmetric: qzeros arriving after the projection was written are still validated."""
    folder = checkpoints("gptq_sym")
    model, moe = model_for(folder, ParallelConfig(1, 0))
    module = next(iter(experts_of(model).values()))
    engine_load(model, moe, list(checkpoint_tensors(folder)))
    module.check_complete()
    spec, layout, name = moe.quant, moe.quant.layout(Role.ZEROS), f"{module.prefix}.0.gate_proj.qzeros"

    def zeros(value: int) -> torch.Tensor:
        proj = QuantizedProjection(q=torch.zeros(64, 64, dtype=torch.uint8), scales=torch.ones(64, 2),
                                   zeros=torch.full((64, 2), value, dtype=torch.uint8), g_idx=None)
        return encode_role(spec, layout, proj)

    assert module.weight_loader(module.w13_qweight, zeros(8), name, "w1", 0)  # z = 2^(b-1): fine
    with pytest.raises(FormatError, match="refusing to drop them"):
        module.weight_loader(module.w13_qweight, zeros(3), f"{module.prefix}.0.up_proj.qzeros", "w3", 0)


def test_scale_dtype_never_rounds(checkpoints: Callable[..., Path]) -> None:
    folder = checkpoints("awq")  # float16 scales
    parallel = ParallelConfig(tp_size=2, tp_rank=0)
    wide, moe = model_for(folder, parallel, scale_dtype=torch.float32)
    engine_load(wide, moe, list(checkpoint_tensors(folder)))
    want = load_experts(folder, parallel)[moe.experts_prefixes[0]].tensors
    assert torch.equal(next(iter(experts_of(wide).values())).w13_scales, want["w13_scales"].float())
    narrow, _ = model_for(folder, parallel, scale_dtype=torch.bfloat16)
    with pytest.raises(FormatError, match="scale_dtype=torch.float16"):
        engine_load(narrow, moe, list(checkpoint_tensors(folder)))


def test_duplicates_and_missing_reach_the_ledger(checkpoints: Callable[..., Path]) -> None:
    folder = checkpoints("ct_asym")
    model, moe = model_for(folder, ParallelConfig(tp_size=2, tp_rank=1))
    module = next(iter(experts_of(model).values()))
    tensors = [(n, t) for n, t in checkpoint_tensors(folder) if n != f"{module.prefix}.2.down_proj.weight_scale"]
    engine_load(model, moe, tensors)
    dup = f"{module.prefix}.0.up_proj.weight_packed"
    engine_load(model, moe, [(dup, dict(tensors)[dup])])
    report = module.ledger_report()
    assert report == [f"missing: {module.prefix}.2.down.scales",
                      f"written 2 times: {module.prefix}.0.up.qweight from {[dup, dup]}"]
    with pytest.raises(CompletenessError, match="2 problems"):
        check_model_complete(model)
    module.reset_load()
    engine_load(model, moe, list(checkpoint_tensors(folder)))
    module.check_complete()
    assert_equal_to_load_experts(model, folder, ParallelConfig(tp_size=2, tp_rank=1))


# ---------------------------------------------------------------------- name mapping

@pytest.mark.parametrize("family", sorted(WRITER_MODELS))
@pytest.mark.parametrize("stacked", [False, True])
def test_mapping_covers_every_family(tmp_path: Path, family: str, stacked: bool) -> None:
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, FORMATS["gptq_act_order"], family=family, num_experts=4, hidden=64, intermediate=64,
                     num_layers=2, stacked=stacked)
    model, moe = model_for(folder, ParallelConfig(1, 0))
    params = dict(model.named_parameters())
    mapping = expert_param_mapping(moe)
    mapped = calls = 0
    for name, _ in checkpoint_tensors(folder):
        targets = mapping(name)
        if ".experts." not in name:
            assert targets == (), name
            continue
        assert targets, name
        mapped, calls = mapped + 1, calls + len(targets)
        for target in targets:
            assert target.param_name in params, (name, target)
            assert target.param_name.endswith("." + target.fused_name)
            assert target.expert_id == (None if stacked else int(name.split(".experts.")[1].split(".")[0]))
        assert [t.shard_id for t in targets] == expected_shards(name)
    roles, experts, layers = 4, 4, len(moe.experts_prefixes)  # GPTQ act-order: qweight qzeros scales g_idx
    assert mapped == (2 * roles if stacked else 3 * roles * experts) * layers
    assert engine_load(model, moe, list(checkpoint_tensors(folder))) == calls
    check_model_complete(model)


def expected_shards(name: str) -> list[ShardId]:
    module = name.rsplit(".", 2)[-2]
    return {"gate_proj": [ShardId.W1], "w1": [ShardId.W1], "up_proj": [ShardId.W3], "w3": [ShardId.W3],
            "down_proj": [ShardId.W2], "w2": [ShardId.W2], "gate_up_proj": [ShardId.W1, ShardId.W3]}[module]


def test_mapping_names_fused_parameters(checkpoints: Callable[..., Path]) -> None:
    moe = read_moe_config(checkpoints("ct_act_order"))
    mapping = expert_param_mapping(moe, "model.layers.0.mlp.experts")
    p = "model.layers.0.mlp.experts"
    assert [(t.fused_name, t.shard_id, t.expert_id) for t in mapping(f"{p}.3.down_proj.weight_zero_point")] == \
        [("w2_qzeros", ShardId.W2, 3)]
    assert [t.fused_name for t in mapping(f"{p}.1.up_proj.weight_g_idx")] == ["w13_g_idx"]
    assert [t.fused_name for t in mapping(f"{p}.1.up_proj.weight_shape")] == ["w13_qweight"]  # no tensor of its own
    others = (f"{p}.4.up_proj.weight_packed", f"{p}.1.up_proj.qweight", "model.layers.1.mlp.experts.1.w1.weight_packed",
              "model.layers.0.mlp.gate.weight", f"{p}.gate_proj.weight_packed")
    for other in others:
        assert mapping(other) == (), other


# ---------------------------------------------------------------------- load_state_dict

def test_load_state_dict_reports_accurately(checkpoints: Callable[..., Path]) -> None:
    folder = checkpoints("gptq_act_order", num_layers=2)
    parallel = ParallelConfig(tp_size=2, tp_rank=1, ep_size=2, ep_rank=0)  # experts 0 and 1
    model, moe = model_for(folder, parallel)
    install_load_hook(model)
    install_load_hook(model)  # idempotent
    state = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if ".experts." in k}
    missing = "model.layers.0.mlp.experts.1.up_proj.scales"
    del state[missing], state["model.layers.1.mlp.experts.3.down_proj.qweight"]  # the second is not this rank's
    junk = ["model.layers.0.mlp.experts.1.gate_proj.bogus", "model.layers.1.mlp.experts.junk"]
    state.update({k: torch.zeros(1) for k in junk})
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == [missing]
    assert sorted(result.unexpected_keys) == sorted(junk)
    strict, _ = model_for(folder, parallel)
    install_load_hook(strict)
    with pytest.raises(RuntimeError) as error:
        strict.load_state_dict(state, strict=True)
    assert all(name in str(error.value) for name in [missing, *junk]) and "w13_qweight" not in str(error.value)
    layer1 = experts_of(model)["model.layers.1.mlp.experts"]
    want = load_experts(folder, parallel)
    for name, tensor in want[layer1.prefix].tensors.items():
        assert torch.equal(getattr(layer1, name), tensor)


def test_load_state_dict_complete_and_fused_round_trip(checkpoints: Callable[..., Path]) -> None:
    folder = checkpoints("awq")
    parallel = ParallelConfig(tp_size=2, tp_rank=0, ep_size=2, ep_rank=1)
    model, _ = model_for(folder, parallel)
    install_load_hook(model)
    state = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if ".experts." in k}
    assert model.load_state_dict(state, strict=True) is not None  # nothing missing, nothing unexpected
    assert_equal_to_load_experts(model, folder, parallel)
    again, _ = model_for(folder, parallel)
    install_load_hook(again)
    result = again.load_state_dict(model.state_dict(), strict=True)  # fused names load as plain parameters
    assert not result.missing_keys and not result.unexpected_keys
    assert_equal_to_load_experts(again, folder, parallel)
    other_rank, _ = model_for(folder, ParallelConfig(tp_size=2, tp_rank=0, ep_size=2, ep_rank=0))
    install_load_hook(other_rank)
    with pytest.raises(LayoutMismatchError, match=r"holds experts \[2, 3\] but this rank owns \[0, 1\]"):
        other_rank.load_state_dict(model.state_dict(), strict=True)


def test_install_load_hook_needs_modules() -> None:
    with pytest.raises(CompletenessError, match="no FusedMoEExperts"):
        install_load_hook(nn.Linear(2, 2))


# ---------------------------------------------------------------------- load_model_experts

@pytest.mark.parametrize("tp", [2, 3])  # 3: padded
@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order", "ct_asym"])
def test_load_model_experts_equals_load_experts(checkpoints: Callable[..., Path], fmt: str, tp: int) -> None:
    folder = checkpoints(fmt, num_layers=2)
    for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=2):
        model, _ = model_for(folder, parallel)
        report = load_model_experts(model, folder, parallel)
        assert (report.layers, report.experts, report.tensors) == (2, 4, 2 * 2 * 3 * len(FORMATS_ROLES[fmt]))
        real = any(m.padding < m.intermediate_size_per_partition for m in experts_of(model).values())
        if real:  # tp 3 rank 2 is all padding: it reads at most act-order's shared scales and g_idx
            assert report.bytes_read > 0 and report.bytes_written > 0
        assert_equal_to_load_experts(model, folder, parallel)


FORMATS_ROLES = {"awq": ("qweight", "qzeros", "scales"), "gptq_act_order": ("qweight", "qzeros", "scales", "g_idx"),
                 "ct_asym": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}


def test_load_model_experts_checks_the_model(checkpoints: Callable[..., Path]) -> None:
    folder = checkpoints("awq", num_layers=2)
    parallel = ParallelConfig(tp_size=2, tp_rank=0)
    model, moe = model_for(folder, parallel)
    with pytest.raises(LayoutMismatchError, match="another parallel layout"):
        load_model_experts(model, folder, ParallelConfig(tp_size=2, tp_rank=1))
    partial = build_model(moe.experts_prefixes[:1], lambda p: FusedMoEExperts(moe, p, parallel))
    with pytest.raises(CompletenessError, match="model.layers.1.mlp.experts has no FusedMoEExperts"):
        load_model_experts(partial, folder, parallel)
    other = read_moe_config(checkpoints("ct_w8_channel_sym", num_layers=2))
    wrong = build_model(moe.experts_prefixes, lambda p: FusedMoEExperts(other, p, parallel))
    with pytest.raises(LayoutMismatchError, match="was built as"):
        load_model_experts(wrong, folder, parallel)


def test_rank_prefixed_summary_log(checkpoints: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    folder = checkpoints("awq")
    parallel = ParallelConfig(tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)
    model, moe = model_for(folder, parallel)
    with caplog.at_level(logging.INFO, logger="wna16_loader"):
        load_model_experts(model, folder, parallel)
    lines = [r.getMessage() for r in caplog.records if "loaded into the model" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("[rank 3 tp 1/2 ep 1/2] loaded into the model: 1 layers")
    caplog.clear()
    model, moe = model_for(folder, parallel)
    engine_load(model, moe, list(checkpoint_tensors(folder)))
    with caplog.at_level(logging.INFO, logger="wna16_loader"):
        check_model_complete(model)
    assert [r.getMessage()[:30] for r in caplog.records] == ["[rank 3 tp 1/2 ep 1/2] complet"]


# ---------------------------------------------------------------------- forward

@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order", "ct_asym"])
def test_forward_rank_sum_equals_unsharded(synthetic: Callable[..., SyntheticCheckpoint], fmt: str,
                                           activation: Activation) -> None:
    ckpt = synthetic(fmt)
    folder = ckpt.folder
    hidden, ids, weights = routing(tokens=24, num_experts=4, top_k=2)
    single = ParallelConfig(1, 0)
    model, moe = model_for(folder, single, activation=activation)
    load_model_experts(model, folder, single)
    full = next(iter(experts_of(model).values()))
    want = full(hidden, ids, weights)
    torch.testing.assert_close(want, manual_forward(ckpt, hidden, ids, weights, activation), rtol=1e-5, atol=1e-5)
    for tp, ep in ((2, 1), (1, 2), (2, 2), (4, 1), (3, 1), (8, 1)):  # 3, 8: padded
        total = torch.zeros_like(want)
        for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
            model, _ = model_for(folder, parallel, activation=activation)
            load_model_experts(model, folder, parallel)
            total += next(iter(experts_of(model).values()))(hidden, ids, weights)
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5, msg=f"tp={tp} ep={ep}")


def manual_forward(ckpt: SyntheticCheckpoint, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   activation: Activation) -> torch.Tensor:
    """Token by token from the synthetic float32 references: sum_k w_k * down(act(gate x) * up x)."""
    act = {Activation.SILU: torch.nn.functional.silu,
           Activation.GELU_TANH: lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
           Activation.RELU2: lambda x: torch.clamp(x, min=0) ** 2}[activation]
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            gate, up, down = (ckpt.references[(ckpt.prefixes[0], int(ids[t, k]), n)] for n in ("gate", "up", "down"))
            out[t] += weights[t, k] * (down @ (act(gate @ hidden[t]) * (up @ hidden[t])))
    return out


def test_forward_checks_inputs(checkpoints: Callable[..., Path]) -> None:
    folder = checkpoints("awq")
    model, _ = model_for(folder, ParallelConfig(1, 0))
    module = next(iter(experts_of(model).values()))
    hidden, ids, weights = routing(tokens=4, num_experts=4, top_k=2)
    with pytest.raises(FormatError, match=r"\[T, 64\]"):
        module(hidden[:, :32], ids, weights)
    with pytest.raises(FormatError, match="topk_ids"):
        module(hidden, ids[:, :1], weights)
    assert reference_forward(module.dequantize(), (), hidden, ids, weights, Activation.SILU).abs().sum() == 0


def test_load_model_experts_from_a_presharded_output(tmp_path):
    """load_model_experts reads a wna16-shard output directly and equals a load from the source."""
    from torch import nn

    from wna16_loader import FusedMoEExperts, ParallelConfig, load_experts, load_model_experts, read_moe_config
    from wna16_loader.preshard import preshard_checkpoint
    from wna16_loader.testing.synthetic import quant_config, write_checkpoint

    src, out = tmp_path / "src", tmp_path / "out"
    write_checkpoint(src, quant_config("gptq", bits=4, group_size=32, act_order=True), hidden=64, intermediate=64)
    preshard_checkpoint(src, out, tp_size=2, ep_size=2, progress=False)
    moe = read_moe_config(src)
    for parallel in ParallelConfig.all_ranks(tp_size=2, ep_size=2):
        model = nn.Module()
        model.experts = FusedMoEExperts(moe, moe.experts_prefixes[0], parallel)
        report = load_model_experts(model, out, parallel)
        direct = load_experts(src, parallel)[moe.experts_prefixes[0]]
        assert report.layers == 1
        for name, tensor in direct.tensors.items():
            assert torch.equal(getattr(model.experts, name), tensor), name
        assert model.experts.ledger_report() == []


# ---------------------------------------------------------------------- non-gated experts (Nemotron-H)

def test_non_gated_engine_load_uses_w3_and_w2_only(tmp_path: Path) -> None:
    ckpt = nemotron_checkpoint(tmp_path)
    assert ckpt.prefixes == ("backbone.layers.1.mixer.experts", "backbone.layers.4.mixer.experts")
    moe = read_moe_config(tmp_path)
    names = [name for name, _ in checkpoint_tensors(tmp_path)]
    assert {t.shard_id.value for name in names for t in expert_param_mapping(moe)(name)} == {"w3", "w2"}
    for parallel in ParallelConfig.all_ranks(tp_size=2, ep_size=2):
        model, _ = model_for(tmp_path, parallel)
        assert engine_load(model, moe, list(checkpoint_tensors(tmp_path))) == 2 * 2 * 2 * 3  # layers experts projs roles
        check_model_complete(model)
        assert_equal_to_load_experts(model, tmp_path, parallel)
        for module in experts_of(model).values():
            assert (module.gated, module.activation) == (False, Activation.RELU2)
            assert module.w13_qweight.shape == (2, 32, 32) and module.w13_scales.shape == (2, 32, 2)
            assert module.w13_qzeros.shape == (2, 16, 2)


def test_non_gated_refuses_a_gate_shard_id(tmp_path: Path) -> None:
    nemotron_checkpoint(tmp_path)
    model, moe = model_for(tmp_path, ParallelConfig(1, 0))
    module = experts_of(model)["backbone.layers.1.mixer.experts"]
    name, tensor = next((n, t) for n, t in checkpoint_tensors(tmp_path)
                        if n == "backbone.layers.1.mixer.experts.0.up_proj.qweight")
    with pytest.raises(FormatError, match=r"backbone\.layers\.1\.mixer\.experts\.0\.up_proj\.qweight: shard_id 'w1' "
                                          r"means gate, but nemotron_h experts are not gated; their tensors come "
                                          r"with shard_id \['w3', 'w2'\]"):
        module.weight_loader(module.w13_qweight, tensor, name, "w1", 0)


def test_non_gated_forward_rank_sum_equals_relu2_reference(tmp_path: Path) -> None:
    ckpt = nemotron_checkpoint(tmp_path)
    hidden, ids, weights = routing(tokens=16, num_experts=4, top_k=2)
    prefix = ckpt.prefixes[1]
    want = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            up, down = (ckpt.references[(prefix, int(ids[t, k]), n)] for n in ("up", "down"))
            want[t] += weights[t, k] * (down @ torch.relu(up @ hidden[t]) ** 2)
    for tp, ep in ((1, 1), (2, 2)):
        total = torch.zeros_like(want)
        for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
            model, _ = model_for(tmp_path, parallel)
            load_model_experts(model, tmp_path, parallel)
            total += experts_of(model)[prefix](hidden, ids, weights)
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5, msg=f"tp={tp} ep={ep}")


# ---------------------------------------------------------------------- MTP layers

@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_5_moe-mtp"])  # appended model.layers.L / mtp.layers.0
def test_mtp_modules_load_through_every_engine_path(tmp_path: Path, name: str) -> None:
    """FusedMoEExperts for the MTP layer (by its experts prefix) fill through load_model_experts(include_mtp=True),
    the weight_loader and load_state_dict exactly as load_experts(include_mtp=True); without include_mtp the
    MTP module is an error of coverage, and a model without it loads the decoder's layers alone."""
    from sources import mtp_checkpoint
    ckpt = mtp_checkpoint(tmp_path, name)
    moe = read_moe_config(tmp_path)
    prefixes = (*moe.experts_prefixes, *moe.mtp_prefixes)
    for parallel in ParallelConfig.all_ranks(tp_size=2, ep_size=2):
        want = load_experts(tmp_path, parallel, include_mtp=True)
        full = build_model(prefixes, lambda p: FusedMoEExperts(moe, p, parallel))
        report = load_model_experts(full, tmp_path, parallel, include_mtp=True)
        hooked = build_model(prefixes, lambda p: FusedMoEExperts(moe, p, parallel))
        assert engine_load(hooked, moe, list(checkpoint_tensors(tmp_path))) > 0
        check_model_complete(hooked)
        state = build_model(prefixes, lambda p: FusedMoEExperts(moe, p, parallel))
        install_load_hook(state)
        result = state.load_state_dict(dict(checkpoint_tensors(tmp_path)), strict=False)
        assert not result.missing_keys
        assert report.layers == len(prefixes) == len(want)
        for model in (full, hooked, state):
            modules = experts_of(model)
            assert [p for p, m in modules.items() if m.mtp] == [ckpt.prefixes[-1]]
            assert modules[ckpt.prefixes[-1]].to_fused().mtp
            for prefix, layer in want.items():
                for tensor_name, tensor in layer.tensors.items():
                    assert torch.equal(getattr(modules[prefix], tensor_name), tensor), (prefix, tensor_name)
    parallel = ParallelConfig(1, 0)
    with pytest.raises(CompletenessError, match=f"module {re.escape(ckpt.prefixes[-1])} has no expert tensors"):
        load_model_experts(build_model(prefixes, lambda p: FusedMoEExperts(moe, p, parallel)), tmp_path, parallel)
    main_only = build_model(moe.experts_prefixes, lambda p: FusedMoEExperts(moe, p, parallel))
    assert load_model_experts(main_only, tmp_path, parallel).layers == len(moe.experts_prefixes)


def test_load_model_experts_mtp_from_a_presharded_output(tmp_path: Path) -> None:
    """From a wna16-shard output: the MTP module fills only with include_mtp=True; by default the model needs
    (and gets) the decoder's layers alone."""
    from sources import mtp_checkpoint

    from wna16_loader.preshard import preshard_checkpoint
    mtp_checkpoint(tmp_path / "src", "qwen3_next")
    preshard_checkpoint(tmp_path / "src", tmp_path / "out", tp_size=2, progress=False)
    moe = read_moe_config(tmp_path / "src")
    parallel = ParallelConfig(tp_size=2, tp_rank=1)
    everything = build_model((*moe.experts_prefixes, *moe.mtp_prefixes), lambda p: FusedMoEExperts(moe, p, parallel))
    assert load_model_experts(everything, tmp_path / "out", parallel, include_mtp=True).layers == 3
    want = load_experts(tmp_path / "src", parallel, include_mtp=True)["mtp.layers.0.mlp.experts"]
    got = experts_of(everything)["mtp.layers.0.mlp.experts"]
    assert all(torch.equal(getattr(got, name), tensor) for name, tensor in want.tensors.items())
    main_only = build_model(moe.experts_prefixes, lambda p: FusedMoEExperts(moe, p, parallel))
    assert load_model_experts(main_only, tmp_path / "out", parallel).layers == 2
    with pytest.raises(CompletenessError, match="module mtp.layers.0.mlp.experts is not in the pre-sharded output"):
        load_model_experts(build_model((*moe.experts_prefixes, *moe.mtp_prefixes),
                                       lambda p: FusedMoEExperts(moe, p, parallel)), tmp_path / "out", parallel)


def test_float_layer_weights_are_never_rounded(tmp_path: Path) -> None:
    """A float (bf16) layer built with fp16 weights: the hook refuses to round, naming the option that fits."""
    folder = FIXTURES / "autoround_layer_config_mixed" / "checkpoint"
    moe = read_moe_config(folder)
    prefix = "model.layers.2.mlp.experts"
    module = FusedMoEExperts(moe, prefix, ParallelConfig(1, 0), weight_dtype=torch.float16)
    assert not module.quantized and module.w13_weight.dtype == torch.float16
    name = f"{prefix}.0.gate_proj.weight"
    tensor = dict(checkpoint_tensors(folder))[name]
    with pytest.raises(FormatError, match=re.escape(f"{name}: weights are torch.bfloat16 but {prefix} stores "
                                                    f"torch.float16 weights; converting would round them. Build the "
                                                    f"module with weight_dtype=torch.bfloat16.")):
        module.weight_loader(module.w13_weight, tensor, name, "w1", 0)
        module.flush()  # complete projections are written in batches; the write refuses to round
    assert FusedMoEExperts(moe, prefix, ParallelConfig(1, 0)).w13_weight.dtype == torch.bfloat16  # as stored
