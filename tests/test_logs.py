"""logs.py: the rank prefix and the reduced-group-size warning."""

from __future__ import annotations

import logging

import pytest

from wna16_loader.logs import log, warn_reduced_groups


def test_tp1_always_keeps_the_group_size(caplog: pytest.LogCaptureFixture) -> None:
    """Gemma 4's I = 704 with G = 128: no TP size > 1 keeps G unpadded, but TP 1 does (one rank, every column)."""
    with caplog.at_level(logging.WARNING, logger=log.name):
        warn_reduced_groups(log, group_size=128, effective={"model.layers.0.experts": 32}, tp_size=2,
                            intermediate=704)
    assert [r.getMessage() for r in caplog.records] == [
        "tp=2: group size 128 becomes G_eff 32 in 1 layer(s) (model.layers.0.experts): I/tp = 704/2 is not a multiple "
        "of 128, so each scale and zero point is repeated; kernels that accept only some group sizes may refuse it. "
        "TP sizes that keep group size 128: [1]."]
