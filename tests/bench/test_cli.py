"""scripts/bench/cli.py: which suite runs, and the arguments it gets."""

from __future__ import annotations

import pytest
from bench.cli import QUICK, suite_argv, suite_of


def test_the_suite_follows_the_size() -> None:
    assert suite_of(None, None) == "scale"
    assert suite_of(None, "qwen3-30b-8l") == "scale"
    assert suite_of(None, "deepseek-names") == "names"
    assert suite_of(None, "full") == "small"
    assert suite_of("bounds", None) == "bounds"
    with pytest.raises(SystemExit, match="--size huge: not a size of any suite"):
        suite_of(None, "huge")


def test_quick_comes_first_so_that_the_users_own_arguments_win() -> None:
    assert suite_argv("scale", None, True, ["--reps", "3"]) == QUICK["scale"] + ["--reps", "3"]
    assert suite_argv("small", "full", False, ["--formats", "gptq"]) == ["--size", "full", "--formats", "gptq"]
    assert suite_argv("bounds", None, False, []) == []


@pytest.mark.parametrize("suite", ["scale", "small", "names", "bounds", "reads", "verify", "device"])
def test_every_suite_takes_its_options(suite: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each suite's parser is whole (no option defined twice) and says how it is called."""
    import importlib

    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"bench.suite_{suite}").main(["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: scripts/bench --suite {suite} ")
