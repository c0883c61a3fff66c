"""LoadedExperts and LoadReport: what a load returns."""

from __future__ import annotations

import pytest

from wna16_loader import ExpertsPrefixError, ParallelConfig, WNA16Error, load_experts
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


def test_unknown_prefix_lists_the_ones_loaded(tmp_path) -> None:
    """The README's `layers["model.layers.3.mlp.experts"]` on a 2-layer checkpoint: the package's error (also a
    KeyError, for dict-minded code), naming the prefixes that exist."""
    write_checkpoint(tmp_path, quant_config("gptq"), hidden=64, intermediate=128, num_layers=2)
    layers = load_experts(tmp_path, ParallelConfig(1, 0))
    with pytest.raises(ExpertsPrefixError) as exc:
        layers["model.layers.3.mlp.experts"]
    assert isinstance(exc.value, WNA16Error) and isinstance(exc.value, KeyError)
    assert str(exc.value) == ("'model.layers.3.mlp.experts': no such experts prefix among the 2 layer(s) loaded "
                              "(model.layers.0.mlp.experts, model.layers.1.mlp.experts); the keys are the "
                              "checkpoint's experts prefixes: use one of these, or iterate over the result.")
    assert layers.get("model.layers.3.mlp.experts") is None and "model.layers.3.mlp.experts" not in layers
    assert layers["model.layers.1.mlp.experts"].spec.experts == (0, 1, 2, 3)
