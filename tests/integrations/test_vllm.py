"""wna16_loader/integrations/vllm.py without vLLM: the package never imports it, the plugin module says what it
needs, and the entry point names it. Its behaviour with vLLM is the vLLM tier's (tests_vllm/, ./scripts/test --vllm)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "wna16_loader" / "integrations" / "vllm.py"
PLUGINS = (PLUGIN, ROOT / "wna16_loader" / "integrations" / "sglang.py")  # the one module per engine that imports it

BLOCK_VLLM = """
import importlib.abc, sys
class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "sglang"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, NoVllm())
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_VLLM + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_no_module_but_the_plugins_imports_an_engine():
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in (ROOT / "wna16_loader").rglob("*.py") if p not in PLUGINS)
    done = run(f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\nprint(len({modules!r}))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == len(modules) > 40


def test_the_plugin_without_vllm_names_what_it_needs():
    done = run("import wna16_loader.integrations.vllm")
    assert done.returncode == 1
    assert ("ImportError: wna16_loader.integrations.vllm is the vLLM plugin and needs vLLM, one of the tested "
            "versions 0.32.0, 0.34.0 (docs/vllm-versions.md); importing what it uses failed: blocked: vllm; the rest "
            "of wna16_loader does not need vLLM") in done.stderr


def test_the_entry_point_names_the_register_function():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["wna16"]
    assert target == "wna16_loader.integrations.vllm:register"
    functions = {n.name for n in ast.parse(PLUGIN.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert "register" in functions
    assert not any(d.startswith("vllm") for d in project["dependencies"])
