"""Fixtures of the tests of a `wna16-shard` output's read side (`test_outputs.py`, `test_presharded.py`): one tiny
output (GPTQ act-order, TP 2 x EP 2, several files per rank) serves every test; the tests that damage it work on a
copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from wna16_loader.preshard import preshard_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 4-expert GPTQ act-order checkpoint (H 64, I 128) pre-sharded for TP 2 x EP 2, files of
    at most 24 kB (several per rank)."""
    root = tmp_path_factory.mktemp("presharded")
    write_checkpoint(root / "src", quant_config("gptq", act_order=True), hidden=64, intermediate=128,
                     num_layers=2, files=2, seed=3)
    preshard_checkpoint(root / "src", root / "out", tp_size=2, ep_size=2, max_file_size=24_000, progress=False)
    return root / "out"


@pytest.fixture
def copy(output: Path, tmp_path: Path) -> Path:
    """A copy of the output to damage."""
    return Path(shutil.copytree(output, tmp_path / "out"))
