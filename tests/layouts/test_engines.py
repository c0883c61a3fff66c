"""layouts.engines: the names `--for` takes, and the serve lines of both engines."""

from __future__ import annotations

import pytest

from wna16_loader import ConfigError
from wna16_loader.layouts.engines import ENGINES, TESTED, versions_for


@pytest.mark.parametrize(("text", "named"), [
    ("vllm", ["vLLM 0.32.0", "vLLM 0.34.0"]), ("sglang", ["SGLang 0.5.23"]), ("SGLang==0.5.23", ["SGLang 0.5.23"]),
    ("vllm==0.34.0", ["vLLM 0.34.0"]),
])
def test_for_names_an_engine_or_one_of_its_versions(text, named):
    assert [v.label for v in versions_for(text)] == named


@pytest.mark.parametrize("text", ["slang", "vllm==0.33.0", "vllm=0.34.0", ""])
def test_anything_else_names_what_is_accepted(text):
    with pytest.raises(ConfigError) as caught:
        versions_for(text)
    assert str(caught.value) == (f"--for {text}: no tested engine version of that name; use one of vllm, sglang, "
                                 f"vllm==0.32.0, vllm==0.34.0, sglang==0.5.23.")


def test_every_tested_version_is_of_a_listed_engine():
    assert {v.engine for v in TESTED} == set(ENGINES) and len({v.label for v in TESTED}) == len(TESTED)
