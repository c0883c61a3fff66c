"""The SGLang plugin (`--load-format wna16`) against SGLang's default loader, in whole Qwen3-MoE models (the real
GPTQModel fixture's config, symmetric 4-bit GPTQ: tests_vllm/model_checkpoint.py) built by SGLang on the CPU
(gloo ranks) at TP 1, TP 2 and EP 2, with no --quantization flag, as `sglang serve` runs it: SGLang picks GPTQ
Marlin for the experts, and the plugin fills its K-major parameters in place, from the checkpoint folder and from a
`wna16-shard --layout fused` output (re-laid on the way in). Every parameter of every rank equals SGLang's default
load as its loader left it (before process_weights_after_loading), but the one pinned difference (MARLIN_QZEROS).
The CLI and LoadConfig accept `--load-format wna16` once SGLang's load_plugins ran our entry point."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
import workarounds
from sglang_cases import GROUPS
from tier import result

workarounds.apply()  # before SGLang is imported in this process

from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.model_loader.loader import get_model_loader  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from wna16_loader import ConfigError  # noqa: E402
from wna16_loader.integrations import sglang as plugin  # noqa: E402
from wna16_loader.layouts import SGLANG_LAYOUTS  # noqa: E402

LOADS = ("wna16-checkpoint", "wna16-shard")
EXPERTS = "model.layers.0.mlp.experts"
# GPTQ Marlin's qzeros are allocated in the model's dtype (gptq_moe.py create_weights); SGLang's loader copies the
# checkpoint's int32 words into them as numbers (GPTQ's symmetric midpoint word 0x77777777 becomes inf in float16).
# The Marlin kernel never reads them (it holds symmetric layers only), and the plugin leaves them as allocated.
MARLIN_QZEROS = {f"{EXPERTS}.w13_qzeros", f"{EXPERTS}.w2_qzeros"}


@pytest.fixture(scope="module")
def loaded(sglang_out):
    """group -> {job name: each rank's parameters} of the model jobs (layer_cases.plugin_model_jobs)."""
    return {group: {name: [result(sglang_out / group, name, r) for r in range(GROUPS[group][0])]
                    for name in ("auto", *LOADS)} for group in GROUPS}


def test_the_entry_point_names_the_plugin():
    """SGLang runs every entry point of this group in each of its processes (sglang.srt.plugins.load_plugins)."""
    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert plugins.get("wna16") == "wna16_loader.integrations.sglang:register"


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("name", LOADS)
def test_plugin_equals_default_loader(loaded, group, name):
    for rank, (theirs, ours) in enumerate(zip(loaded[group]["auto"], loaded[group][name])):
        assert "type" not in theirs and "type" not in ours, (theirs.get("trace"), ours.get("trace"))
        assert bytes(ours["loader"].tolist()) == b"WNA16ModelLoader"
        assert bytes(theirs["loader"].tolist()) == b"DefaultModelLoader"
        assert sorted(ours) == sorted(theirs)
        differ = {param for param, tensor in theirs.items()
                  if param != "loader" and not torch.equal(ours[param], tensor)}
        assert differ == MARLIN_QZEROS, f"{group} rank{rank}: {sorted(differ)} differ ({name})"


def test_the_pinned_qzeros_are_sglangs_cast_words(loaded):
    """SGLang's default load leaves inf in GPTQ Marlin's float16 qzeros (the midpoint words as numbers)."""
    theirs = loaded["tp1"]["auto"][0]
    assert all(bool(torch.isinf(theirs[name]).all()) for name in MARLIN_QZEROS)


@pytest.mark.parametrize("group, shape", [("tp1", (4, 128 // 8, 2 * 128)), ("tp2", (4, 128 // 8, 128)),
                                          ("ep2", (2, 128 // 8, 2 * 128))])
def test_without_a_flag_sglang_picks_gptq_marlin(loaded, group, shape):
    """GPTQ Marlin's K-major int32 words [E_l, H/P, 2·I_p]: TP 2 halves I, EP 2 the experts."""
    params = loaded[group]["wna16-checkpoint"][0]
    assert params[f"{EXPERTS}.w13_qweight"].shape == shape and params[f"{EXPERTS}.w13_scales"].dtype == torch.float16


def test_the_cli_and_load_config_take_wna16_once_the_plugins_ran():
    load_plugins()
    args = prepare_server_args(["--model-path", "unused", "--load-format", "wna16"])
    config = LoadConfig(load_format=args.load_format)
    assert config.load_format is plugin.WNA16ModelLoader
    assert type(get_model_loader(load_config=config)) is plugin.WNA16ModelLoader


def test_every_declared_layout_has_its_sglang_method():
    assert sorted({layout.name for layout in plugin.METHOD_LAYOUTS.values()}) == \
        sorted(layout.name for layout in SGLANG_LAYOUTS)


def test_a_model_without_moe_layers_is_refused():
    with pytest.raises(ConfigError, match=r"the model has no MoE layer; load it with SGLang's default --load-format"):
        plugin.expert_layers(torch.nn.Linear(2, 2))


def test_an_unknown_moe_method_is_refused():
    class Layer:
        layer_name, num_fused_shared_experts, scheme, quant_method = EXPERTS, 0, None, object()

    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.experts: SGLang chose the MoE method object, "
                       r"whose parameters --load-format wna16 does not fill \(it fills MoeWNA16Method, "
                       r"GPTQMarlinMoEScheme, AWQMoEScheme, CompressedTensorsWNA16MoE, "
                       r"CompressedTensorsWNA16TritonMoE, UnquantizedFusedMoEMethod\); load this model with "
                       r"SGLang's default --load-format"):
        plugin.layer_target(Layer())


def overlap_options(**changes):
    """SGLang's startup-overlap options as on a CUDA host with CUDA graphs, TP 1 (every rule before the loader's
    passes), with `changes`."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.model_executor.model_runner_components.startup_weight_load import StartupWeightLoadOptions

    fields = {name: False for name in StartupWeightLoadOptions.__dataclass_fields__}
    fields.update(device="cuda", is_cuda_platform=True, cuda_graph_enabled=True, prefill_cuda_graph_backend=Backend.FULL,
        speculative_algorithm=None, tp_size=1, attn_cp_size=1,
        dcp_size=1, pp_size=1, num_dp_ranks=1, ep_size=1, cpu_offload_gb=0, offload_group_size=0,
        prefetch_num_threads=1)
    return StartupWeightLoadOptions(**{**fields, **changes})


def test_startup_overlap_is_refused_by_sglang_and_by_the_plugin():
    """--startup-weight-load-mode overlap: SGLang 0.5.23 admits its own DefaultModelLoader only (and no quantized
    model); the plugin's commit step refuses it by name too, should SGLang ever call it."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner_components.startup_weight_load import StartupWeightLoadManager

    load_plugins()
    config = LoadConfig(load_format="wna16")
    model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]))
    with pytest.raises(ValueError, match=r"--startup-weight-load-mode=overlap is not supported: DefaultModelLoader "
                       r"only"):
        StartupWeightLoadManager.create(loader=plugin.WNA16ModelLoader(config), model_config=model_config,
                                        load_config=config, device_config=None, options=overlap_options())
    with pytest.raises(ConfigError, match=r"--startup-weight-load-mode overlap: --load-format wna16 fills the MoE "
                       r"layers of Linear before SGLang's process_weights_after_loading, and overlap runs that step "
                       r"first; serve with --startup-weight-load-mode serial \(the default\)"):
        plugin.WNA16ModelLoader(config).commit_model_weights(model=torch.nn.Linear(2, 2), model_config=None,
                                                             resolved_sources=(), target_device=None,
                                                             startup_prefetch_active=False)
