"""The SGLang tier (./scripts/test --sglang): collected only where SGLang is importable; the main suite never
collects this folder (pyproject's testpaths is tests/)."""

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the tier's helpers (workarounds, tier, sglang_rank) are plain modules here
    sys.path.insert(0, str(HERE))

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py", "*/test_*.py"]


def pytest_report_header(config):
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed: the SGLang tier is not collected (run ./scripts/test --sglang)"
    from importlib.metadata import version
    return f"SGLang tier: sglang {version('sglang')}"
