"""wna16_loader/integrations/sglang.py without SGLang: the plugin module says what it needs, and the entry point
names it (that no other module imports SGLang: tests/integrations/test_vllm.py). Its behaviour with SGLang is the
SGLang tier's (tests_sglang/, ./scripts/test --sglang)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "wna16_loader" / "integrations" / "sglang.py"
BLOCK_SGLANG = """
import importlib.abc, sys
class NoSglang(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "sglang":
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, NoSglang())
"""


def test_the_plugin_without_sglang_names_what_it_needs():
    done = subprocess.run([sys.executable, "-c", BLOCK_SGLANG + "import wna16_loader.integrations.sglang"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "ImportError: wna16_loader.integrations.sglang is the SGLang plugin and needs SGLang (tested with " \
           "sglang==0.5.23, see requirements/sglang-cpu.txt)" in done.stderr


def test_the_entry_point_names_the_register_function():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["sglang.srt.plugins"]["wna16"] == "wna16_loader.integrations.sglang:register"
    functions = {n.name for n in ast.parse(PLUGIN.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert "register" in functions
    assert not any(d.startswith("sglang") for d in project["dependencies"])
