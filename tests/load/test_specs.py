"""Each layer's spec against its tensors (wna16_loader/load/specs.py), and float (unquantized) experts: synthetic
two-layer checkpoints whose layer 1 is stored as bf16 `.weight` per expert, or stacked as transformers writes it
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`), in vLLM's unquantized fused layout."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import assert_exact, assert_owners, reassemble, rewrite

from wna16_loader import ConfigError, FormatError, ParallelConfig, load_experts, read_moe_config
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

E, H, I = 4, 64, 64
L0, L1 = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"
PROJS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
DROP_RULE = {"-:model\\.layers\\.1\\.mlp\\.experts\\..*": {}}


def _weights(seed: int) -> dict[tuple[int, str], torch.Tensor]:
    """Identifiable bf16 weights of layer 1: [N, K] per (expert, projection)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    return {(e, p): torch.randn(shape, generator=gen).to(torch.bfloat16) for e in range(E) for p, shape in shapes.items()}


def _float_layer(folder: Path, *, stacked: bool, dynamic: dict | None = DROP_RULE, seed: int = 3):
    """A GPTQ 4-bit checkpoint whose layer 1 experts are replaced by bf16 ones (per expert, or stacked)."""
    ckpt = write_checkpoint(folder, quant_config("gptq", bits=4, group_size=32, symmetric=False,
                                                 **({"dynamic": dynamic} if dynamic else {})),
                            num_experts=E, hidden=H, intermediate=I, num_layers=2)
    weights = _weights(seed)

    def mutate(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith(L1 + ".")]:
            del tensors[name]
        if stacked:
            tensors[f"{L1}.gate_up_proj"] = torch.stack([torch.cat([weights[(e, "gate")], weights[(e, "up")]])
                                                          for e in range(E)])
            tensors[f"{L1}.down_proj"] = torch.stack([weights[(e, "down")] for e in range(E)])
        else:
            tensors.update({f"{L1}.{e}.{PROJS[p]}.weight": w for (e, p), w in weights.items()})

    rewrite(folder / "model.safetensors", mutate)
    refs = {k: v for k, v in ckpt.references.items() if k[0] == L0}
    refs.update({(L1, e, p): w.to(torch.float32) for (e, p), w in weights.items()})
    return refs


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (3, 1), (4, 2)])
def test_float_layer_loads_in_the_unquantized_layout(tmp_path: Path, stacked: bool, tp: int, ep: int) -> None:
    refs = _float_layer(tmp_path, stacked=stacked)
    weights, owners = reassemble(tmp_path, tp, ep)  # padding (tp 3: I' = 96) checked to be exactly 0
    assert_owners(owners, (L0, L1), E, tp, ep)
    assert_exact(weights, refs)
    layer = load_experts(tmp_path, ParallelConfig(tp_size=tp, tp_rank=tp - 1, ep_size=ep, ep_rank=ep - 1))[L1]
    part = layer.intermediate_size_per_partition
    assert not layer.quantized and layer.bits == 16
    assert {n: (list(t.shape), t.dtype) for n, t in layer.tensors.items()} == {
        "w13_weight": ([E // ep, 2 * part, H], torch.bfloat16), "w2_weight": ([E // ep, H, part], torch.bfloat16),
        "expert_ids": ([E // ep], torch.int32)}


def test_float_layer_rows_are_gate_then_up_of_each_rank(tmp_path: Path) -> None:
    """w13_weight rows: the rank's gate rows, then its up rows; w2_weight: the rank's columns of down."""
    _float_layer(tmp_path, stacked=True)
    weights = _weights(3)
    layer = load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=1))[L1]
    half = I // 2
    assert torch.equal(layer.w13_weight[2, :half], weights[(2, "gate")][half:])
    assert torch.equal(layer.w13_weight[2, half:], weights[(2, "up")][half:])
    assert torch.equal(layer.w2_weight[2], weights[(2, "down")][:, half:])


def test_the_tensors_decide_a_float_layer_the_config_calls_quantized(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """No rule names layer 1, so the config says 4-bit; its tensors are bf16 `.weight`: loaded as stored, with one
    warning naming the rule, the layer and what was found."""
    refs = _float_layer(tmp_path, stacked=False, dynamic=None)
    with caplog.at_level(logging.WARNING, logger="wna16_loader"):
        weights, _ = reassemble(tmp_path, 2, 1)
        caplog.clear()
        load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0))
    assert_exact(weights, refs)
    warned = [r.getMessage() for r in caplog.records if "the tensors decide" in r.getMessage()]
    assert warned == [f"{L1}: the top-level quantization_config makes this layer gptq 4-bit g32 asym, but its "
                      f"expert tensors are float tensors such as {L1}.0.down_proj.weight [64, 64] bfloat16; loading "
                      f"the layer as its tensors are stored (the tensors decide)."]


def test_the_tensors_decide_a_quantized_layer_the_config_calls_float(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A `-:` rule leaves layer 1 in float, but its tensors are GPTQ 4-bit: read with the config's spec they fit."""
    ckpt = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32, symmetric=False, dynamic=DROP_RULE),
                            num_experts=E, hidden=H, intermediate=I, num_layers=2)
    with caplog.at_level(logging.WARNING, logger="wna16_loader"):
        layer = read_moe_config(tmp_path).spec_of(L1)
    assert layer.spec.quantized and layer.spec.bits == 4
    assert re.search(rf"{re.escape(L1)}: dynamic rule '-:model.*' makes this layer not quantized \(float weights\), "
                     rf"but its expert tensors are quantized tensors such as .*, read as gptq 4-bit g32 asym",
                     caplog.text)
    weights, _ = reassemble(tmp_path, 2, 2)
    assert_exact(weights, ckpt.references)


def test_quantized_tensors_that_fit_no_spec_name_every_number(tmp_path: Path) -> None:
    """Under a float rule, 8-bit tensors fit no spec the config declares (4-bit g32): the error lists the tensors'
    shapes and what each spec expected."""
    write_checkpoint(tmp_path, quant_config("gptq", bits=8, group_size=32, symmetric=False), num_experts=E, hidden=H,
                     intermediate=I, num_layers=2)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(bits=4, dynamic={"-:model\\.layers\\.[01]\\..*": {}})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=rf"{re.escape(L0)}: the config leaves this layer in float, but its expert "
                                          rf"tensors are quantized \({re.escape(L0)}.0.down_proj.qweight \[16, 64\] "
                                          rf"int32, .*\); they fit none of the config's quantized specs \(H=64, I=64\): "
                                          rf"gptq 4-bit g32 asym: {re.escape(L0)}.0.down_proj.qweight \[16, 64\] "
                                          rf"\(expected \[8, 64\]\), {re.escape(L0)}.0.down_proj.scales \[2, 64\] "
                                          rf"\(expected \[2, 64\]\). Fix the layer's rule"):
        load_experts(tmp_path, ParallelConfig(1, 0))


def _ct_config(folder: Path, groups: dict) -> None:
    """Add `groups` before the writer's int4 group; as llm-compressor writes it then, every group names its format
    and the top level says mixed-precision."""
    config = json.loads((folder / "config.json").read_text())
    qconfig = config["quantization_config"]
    own = {name: {**group, "format": qconfig["format"]} for name, group in qconfig["config_groups"].items()}
    qconfig.update(config_groups={**groups, **own}, format="mixed-precision")
    (folder / "config.json").write_text(json.dumps(config))


FP8 = {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                "symmetric": True},
       "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}


def test_ct_fp8_attention_beside_int4_experts_loads_the_experts(tmp_path: Path) -> None:
    """An FP8 group that covers only attention (format mixed-precision) does not stop the experts from loading."""
    ckpt = write_checkpoint(tmp_path, quant_config("compressed-tensors", bits=4, group_size=32, symmetric=False),
                            num_experts=E, hidden=H, intermediate=I)
    _ct_config(tmp_path, {"group_fp8": {**FP8, "targets": ["re:.*self_attn.*"]}})
    weights, _ = reassemble(tmp_path, 2, 2)
    assert_exact(weights, ckpt.references)


def test_ct_fp8_group_covering_experts_is_not_wna16(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, quant_config("compressed-tensors", bits=4, group_size=32, symmetric=False),
                     num_experts=E, hidden=H, intermediate=I)
    _ct_config(tmp_path, {"group_fp8": {**FP8, "targets": ["re:.*mlp\\.experts\\..*"]}})
    with pytest.raises(ConfigError, match=rf"{re.escape(L0)}: routed expert {re.escape(L0)}.0.down_proj is covered by "
                                          rf"config_groups\['group_fp8'\] target 're:.\*mlp\\\\.experts\\\\..\*': "
                                          rf"compressed-tensors group 'group_fp8' has format='float-quantized'; only "
                                          rf"'pack-quantized' integer weights are WNA16. 12 of the layer's 12 expert "
                                          rf"modules are, so its experts are not WNA16"):
        load_experts(tmp_path, ParallelConfig(1, 0))
