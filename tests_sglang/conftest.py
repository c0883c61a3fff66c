"""The SGLang tier (./scripts/test --sglang): collected only where SGLang is importable; the main suite never
collects this folder (pyproject's testpaths is tests/)."""

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the tier's helpers (workarounds, sglang_cases, sglang_rank) are plain modules here
    sys.path.insert(0, str(HERE))
TESTS_VLLM = HERE.parent / "tests_vllm"
if str(TESTS_VLLM) not in sys.path:  # the vLLM tier's engine-neutral helpers (tier, layer_cases, model_checkpoint),
    sys.path.append(str(TESTS_VLLM))  # after this folder's (both have a workarounds.py)

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py", "*/test_*.py"]


def pytest_report_header(config):
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed: the SGLang tier is not collected (run ./scripts/test --sglang)"
    from importlib.metadata import version
    return f"SGLang tier: sglang {version('sglang')}"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Every layer case's checkpoint and references, by checkpoint name."""
    from layer_cases import write_checkpoints
    from sglang_cases import CASES

    return write_checkpoints(tmp_path_factory.mktemp("checkpoints"), CASES)


@pytest.fixture(scope="session")
def sglang_out(checkpoints, tmp_path_factory):
    """What SGLang's own loader and the plugin loaded, every layer case and the whole model in every group (one
    gloo group each): job NAME (SGLang's weight loader), NAME-plugin (the plugin, from the checkpoint folder)
    and, for SHARD_CASES in SHARD_GROUPS, NAME-plugin-shard (from a wna16-shard output for the group's layout);
    the model jobs of layer_cases.plugin_model_jobs."""
    from layer_cases import plugin_model_jobs
    from sglang_cases import CASES, GROUPS, SHARD_CASES, SHARD_GROUPS, parallel
    from tier import run_group

    from wna16_loader.preshard.run import preshard_checkpoint

    out = tmp_path_factory.mktemp("sglang")
    for group, (ranks, ep) in GROUPS.items():
        jobs = plugin_model_jobs(out, group, parallel(group, 0))
        for case in CASES:
            folder = checkpoints[case.checkpoint].folder
            jobs += [case.job(folder), case.job(folder, loader="plugin", suffix="-plugin")]
            if case.name in SHARD_CASES and group in SHARD_GROUPS:
                layout = parallel(group, 0)
                shard = out / f"shard-{group}-{case.name}"
                if not shard.exists():
                    preshard_checkpoint(folder, shard, tp_size=layout.tp_size, ep_size=layout.ep_size,
                                        progress=False)
                jobs.append(case.job(folder, loader="plugin", source=shard, suffix="-plugin-shard"))
        run_group(ranks, jobs, out / group, ep=ep, script=HERE / "sglang_rank.py")
    return out


@pytest.fixture(scope="session")
def deepseek_out(tmp_path_factory):
    """What SGLang's default loader and the plugin loaded of each DeepSeek-V3-shaped model (deepseek_model.CASES),
    whole, in each of deepseek_model.GROUPS (one gloo group each): jobs CASE-auto, CASE-wna16 (the checkpoint)
    and CASE-wna16-shard (a wna16-shard output for the group's TP and EP)."""
    from deepseek_model import CASES, GROUPS, write_deepseek
    from tier import run_group

    from wna16_loader.preshard.run import preshard_checkpoint

    out = tmp_path_factory.mktemp("deepseek")
    folders = {case: write_deepseek(out / case, case) for case in CASES}
    for group, (ranks, ep, settings, cases) in GROUPS.items():
        jobs = []
        for case in cases:
            shard = out / f"shard-{group}-{case}"
            preshard_checkpoint(folders[case], shard, tp_size=1 if ep else ranks, ep_size=ranks if ep else 1,
                                progress=False)
            model = {"kind": "model", "quantization": CASES[case][1]}
            jobs += [{**model, "name": f"{case}-auto", "folder": str(folders[case]), "load_format": "auto"},
                     {**model, "name": f"{case}-wna16", "folder": str(folders[case]), "load_format": "wna16"},
                     {**model, "name": f"{case}-wna16-shard", "folder": str(shard), "load_format": "wna16"}]
        run_group(ranks, jobs, out / group, ep=ep, script=HERE / "sglang_rank.py", settings=settings)
    return out


@pytest.fixture(scope="session")
def fixture_models_out(tmp_path_factory):
    """Each real fixture (fixture_models.OUTCOMES) as a whole model, in every group: jobs NAME-auto (SGLang's
    default loader), NAME-wna16 (the plugin, from the checkpoint) and, for fixture_models.SHARDED, NAME-wna16-shard
    (from a wna16-shard output for the group's layout)."""
    from fixture_models import OUTCOMES, SHARDED
    from sglang_cases import GROUPS, parallel
    from tier import run_group

    from wna16_loader.preshard.run import preshard_checkpoint

    out = tmp_path_factory.mktemp("fixture-models")
    fixtures = HERE.parent / "tests" / "fixtures"
    for group, (ranks, ep) in GROUPS.items():
        jobs, layout = [], parallel(group, 0)
        for name in OUTCOMES:
            folder = fixtures / name / "checkpoint"
            model = {"kind": "model", "folder": str(folder)}
            jobs += [{**model, "name": f"{name}-auto", "load_format": "auto"},
                     {**model, "name": f"{name}-wna16", "load_format": "wna16"}]
            if name in SHARDED:
                shard = out / f"shard-{group}-{name}"
                preshard_checkpoint(folder, shard, tp_size=layout.tp_size, ep_size=layout.ep_size, progress=False)
                jobs.append({**model, "name": f"{name}-wna16-shard", "folder": str(shard), "load_format": "wna16"})
        run_group(ranks, jobs, out / group, ep=ep, script=HERE / "sglang_rank.py")
    return out
