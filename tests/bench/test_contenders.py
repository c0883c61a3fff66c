"""scripts/bench/contenders.py: the contender table, and rows whose peer is not installed."""

from __future__ import annotations

from pathlib import Path

from bench import contenders, peers
from bench.contenders import BY_KEY, CONTENDERS, PEER_KEYS, TP1_MAX_BYTES, Contender, runnable


def test_every_row_has_its_own_key_and_the_peers_run_in_both_modes() -> None:
    assert len(BY_KEY) == len(CONTENDERS)
    assert PEER_KEYS == ("runai buffered", "fastsafetensors buffered", "runai direct", "fastsafetensors direct")
    assert dict(BY_KEY["runai direct"].env)["RUNAI_STREAMER_FS_STRATEGY"] == "io_uring_direct,sync_buffered"
    assert dict(BY_KEY["fastsafetensors direct"].env) == {"FASTSAFETENSORS_ODIRECT": "1"}
    assert dict(BY_KEY["fastsafetensors buffered"].env) == {"FASTSAFETENSORS_ODIRECT": "0"}
    assert {row.folder for row in CONTENDERS} == {"checkpoint", "presharded"}
    assert all(row.scope in contenders.scopes() or row.scope is None for row in CONTENDERS)


def test_a_row_whose_peer_is_not_installed_is_skipped_with_one_line() -> None:
    absent = Contender("absent", "a loader that is not there", lambda folder: lambda: None,
                       peer=peers.Peer("wna16_no_such_module", "no-such-package"))
    present = BY_KEY["floor"]
    rows, skipped = runnable((present, absent), 1 << 20)
    assert rows == [present]
    assert skipped == {"absent": "no-such-package is not installed (pip install -e '.[bench]')"}


def test_tp1_runs_only_where_the_fused_model_fits_beside_the_checkpoint() -> None:
    assert BY_KEY["tp1"] in runnable(CONTENDERS, TP1_MAX_BYTES - 1)[0]
    rows, skipped = runnable(CONTENDERS, TP1_MAX_BYTES)
    assert BY_KEY["tp1"] not in rows and "do not both fit" in skipped["tp1"]


def test_the_floor_of_a_large_checkpoint_is_read_file_by_file(tmp_path: Path) -> None:
    seen: list[dict[str, list[str]]] = []
    contenders._file_by_file(lambda folder, tensors: seen.append(tensors), tmp_path, {"a": ["x", "y"], "b": ["z"]})
    assert seen == [{"a": ["x", "y"]}, {"b": ["z"]}]
