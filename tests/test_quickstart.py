"""The README's Quickstart, run verbatim on the demo checkpoint: every bash and python block of the section, in
order, from a folder laid out like the repository root (scripts/ linked in), with `wna16-shard` on PATH as
`source .venv/bin/activate` puts it; then the "Load a rank" section's block that builds a rank's modules from the
output alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def section(title: str) -> str:
    """The README text under `## title`, up to the next `## ` heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced bash or python block of `text`, in order."""
    return re.findall(r"```(bash|python)\n(.*?)```", text, flags=re.S)


def scripts_interpreter_is_this_one() -> bool:
    """./scripts/demo runs in the scripts' interpreter (WNA16_PYTHON or .venv); it must be this one, installed,
    or the demo would create and fill an environment of its own."""
    if os.environ.get("WNA16_PYTHON"):
        return Path(os.environ["WNA16_PYTHON"]).resolve() == Path(sys.executable).resolve()
    return Path(sys.prefix).resolve() == (ROOT / ".venv").resolve() and (ROOT / ".venv/.wna16-installed").is_file()


@pytest.mark.skipif(not scripts_interpreter_is_this_one(), reason="the suite runs outside the scripts' interpreter")
def test_quickstart_runs_verbatim(tmp_path: Path) -> None:
    console = Path(sys.executable).parent / "wna16-shard"
    if not console.is_file():
        pytest.skip("the wna16-shard console script is not installed next to this interpreter")
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    env = {**os.environ, "PATH": f"{console.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    code = blocks(section("Quickstart"))
    assert [lang for lang, _ in code] == ["bash", "bash", "python", "bash"]
    api = [c for lang, c in blocks(section("Load a rank")) if lang == "python" and 'read_moe_config("out-tp2")' in c]
    assert len(api) == 1, "the 'Load a rank' section shows how a rank builds its modules from the output alone"
    outputs = []
    for lang, text in code + [("python", api[0])]:
        command = ["bash", "-euo", "pipefail", "-c", text] if lang == "bash" else [sys.executable, "-c", text]
        run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, (text, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr
        outputs.append(run.stdout)
    assert "already complete: nothing to do" in outputs[1]
    assert "reassembly: 48/48 expert projections identical" in outputs[0]
    assert outputs[3].startswith("wna16-shard verify: out-tp2: ok: 3 files")
    assert outputs[4].startswith("2 layers, 16 local experts, 14 tensors")  # 8 experts in each of 2 layers
    assert not (ROOT / "demo-ckpt").exists() and not (ROOT / "out-tp2").exists()
