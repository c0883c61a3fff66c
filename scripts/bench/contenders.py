"""The contender table of the real-scale run: one row per contender (ours, the read floors, the whole-tensor
loader, the peers), each run alone in a fresh interpreter, warm and cold. Adding a contender adds a row.

A row says which folder it reads (the checkpoint, or the wna16-shard --tp 8 output), which rank's share its
bytes are counted against, the peer library it needs (a row whose peer is not installed is reported as
skipped, in one line) and the environment it runs in; `prepare` is called in the child before the clock and
returns the timed call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import peers
from .peers import Peer

PRESHARDED_RANK = "rank-00007-of-00008"  # the pre-sharded rank timed (TP 8 rank 7, as the checkpoint loads)
TP1_MAX_BYTES = 4 << 30  # TP 1 holds the whole fused model: only where it and the checkpoint fit the page cache


@dataclass(frozen=True)
class Contender:
    """One row: what is timed, on which folder, needing what."""

    key: str
    label: str
    prepare: Callable[[Path], Callable[[], Any]]  # (folder) -> the timed call, made before the clock
    folder: str = "checkpoint"  # or "presharded"
    scope: str | None = "all"  # whose expert tensors it reads ("all", "tp8", "ep8"; None: not counted)
    peer: Peer | None = None
    env: tuple[tuple[str, str], ...] = ()
    small_only: bool = False  # only for checkpoints under TP1_MAX_BYTES

    def missing(self) -> str | None:
        """Why this row cannot run here (its peer is not installed), or None."""
        return self.peer.missing() if self.peer is not None else None


def _floor(transposed: bool, scope: str) -> Callable[[Path], Callable[[], Any]]:
    """Every expert tensor of `scope` read once (get_tensor + clone; qweights copied transposed with
    `transposed`), file by file for checkpoints over TP1_MAX_BYTES (holding every copy would push the
    checkpoint out of the page cache of a 24 GiB machine)."""
    def prepare(folder: Path) -> Callable[[], Any]:
        from .baselines import expert_tensors, run_floor, run_floor_transposed

        read = run_floor_transposed if transposed else run_floor
        tensors = expert_tensors(folder, scopes()[scope])
        if scope != "all" or checkpoint_bytes(folder) < TP1_MAX_BYTES:
            return lambda: read(folder, tensors)
        return lambda: _file_by_file(read, folder, tensors)
    return prepare


def _file_by_file(read: Callable[[Path, dict[str, list[str]]], Any], folder: Path,
                  tensors: dict[str, list[str]]) -> None:
    """`read` one file at a time, each file's copies dropped before the next (the copies then reuse freed
    memory: fewer page faults than a load that keeps its output)."""
    for file, names in tensors.items():
        read(folder, {file: names})


def _load(scope: str) -> Callable[[Path], Callable[[], Any]]:
    """load_experts of rank `scope` (from the checkpoint or a pre-sharded output: it detects which)."""
    def prepare(folder: Path) -> Callable[[], Any]:
        from wna16_loader import load_experts

        parallel = scopes()[scope]
        return lambda: load_experts(folder, parallel)
    return prepare


def _whole(folder: Path) -> Callable[[], Any]:
    from .baselines import run_whole

    return lambda: run_whole(folder, scopes()["tp8"])


def _rank_files(folder: Path) -> Callable[[], Any]:
    files = sorted((folder / PRESHARDED_RANK).glob("*.safetensors"))
    return lambda: [f.read_bytes() for f in files]


def scopes() -> dict[str, Any]:
    """scope name -> ParallelConfig (None for every expert at TP 1)."""
    from wna16_loader import ParallelConfig

    return {"all": None, "tp1": ParallelConfig(1, 0), "tp8": ParallelConfig(8, 7), "ep8": ParallelConfig(1, 0, 8, 7)}


def checkpoint_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _peer_rows() -> list[Contender]:
    rows = []
    for mode in ("buffered", "direct"):
        rows.append(Contender(f"runai {mode}", f"Run:ai Model Streamer, every file ({peers.RUNAI_STRATEGY[mode]})",
                              lambda folder: peers.runai_read(folder), peer=peers.RUNAI,
                              env=tuple(sorted(peers.runai_env(mode).items()))))
        rows.append(Contender(f"fastsafetensors {mode}", f"fastsafetensors, every file (nogds, "
                              f"FASTSAFETENSORS_ODIRECT={peers.FST_ODIRECT[mode]})",
                              lambda folder: peers.fastsafetensors_read(folder), peer=peers.FASTSAFETENSORS,
                              env=tuple(sorted(peers.fastsafetensors_env(mode).items()))))
    return rows


CONTENDERS: tuple[Contender, ...] = (
    Contender("floor", "safetensors get_tensor + clone of every expert tensor (the floor)", _floor(False, "all")),
    Contender("floortr", "the floor, qweights copied transposed (the least a TP 1 load does)", _floor(True, "all")),
    Contender("own", "the expert tensors of EP 8 rank 7 only (its own bytes)", _floor(False, "ep8"), scope="ep8"),
    Contender("owntr", "EP 8 rank 7's own bytes, qweights transposed", _floor(True, "ep8"), scope="ep8"),
    Contender("tp1", "load_experts, TP 1", _load("tp1"), scope="all", small_only=True),
    Contender("tp8", "load_experts, TP 8 rank 7", _load("tp8"), scope="tp8"),
    Contender("ep8", "load_experts, EP 8 rank 7", _load("ep8"), scope="ep8"),
    Contender("whole", "a whole-tensor loader, TP 8 rank 7 (what engines do today)", _whole, scope="tp8"),
    Contender("pre", "load_experts of the wna16-shard --tp 8 output, rank 7", _load("tp8"), folder="presharded",
              scope=None),
    Contender("prefiles", "reading that rank's files (read_bytes)", _rank_files, folder="presharded", scope=None),
    *_peer_rows(),
)

BY_KEY = {row.key: row for row in CONTENDERS}
PEER_KEYS = tuple(row.key for row in CONTENDERS if row.peer is not None)


def runnable(rows: tuple[Contender, ...], checkpoint_size: int) -> tuple[list[Contender], dict[str, str]]:
    """(rows to run, key -> why skipped) for a checkpoint of `checkpoint_size` bytes."""
    run, skipped = [], {}
    for row in rows:
        why = row.missing() or ("the fused TP 1 model and the checkpoint do not both fit the page cache"
                                if row.small_only and checkpoint_size >= TP1_MAX_BYTES else None)
        if why is None:
            run.append(row)
        else:
            skipped[row.key] = why
    return run, skipped


# --- the vLLM suite (suite_vllm.py): vLLM's model load, its default loader against --load-format wna16 ---------

@dataclass(frozen=True)
class VllmContender:
    """One row of the vLLM suite: vLLM's load_format, the folder it reads ("checkpoint", or "shard": a
    wna16-shard output of the layout's split), the LoadConfig and ParallelConfig fields it sets (a row whose
    field this vLLM lacks is reported as skipped), and whether it means anything without expert parallelism."""

    key: str
    label: str
    load_format: str
    folder: str = "checkpoint"
    load: tuple[tuple[str, Any], ...] = ()
    parallel: tuple[tuple[str, Any], ...] = ()
    ep_only: bool = False


VLLM_CONTENDERS: tuple[VllmContender, ...] = (
    VllmContender("default", "vLLM's default loader, as is", "auto"),
    VllmContender("default+filter", "vLLM's default loader, --enable-ep-weight-filter", "auto",
                  parallel=(("enable_ep_weight_filter", True),), ep_only=True),
    VllmContender("default+prefetch", "vLLM's default loader, --safetensors-load-strategy prefetch", "auto",
                  load=(("safetensors_load_strategy", "prefetch"),)),
    VllmContender("wna16", "--load-format wna16 from the checkpoint", "wna16"),
    VllmContender("wna16 shard", "--load-format wna16 from a wna16-shard output", "wna16", folder="shard"),
)


@dataclass(frozen=True)
class SglangContender:
    """One row of the SGLang suite: SGLang's --load-format and the folder it reads ("checkpoint", or "shard": a
    wna16-shard output of the layout's split)."""

    key: str
    label: str
    load_format: str
    folder: str = "checkpoint"


SGLANG_CONTENDERS: tuple[SglangContender, ...] = (
    SglangContender("default", "SGLang's default loader", "auto"),
    SglangContender("wna16", "--load-format wna16 from the checkpoint", "wna16"),
    SglangContender("wna16 shard", "--load-format wna16 from a wna16-shard output", "wna16", folder="shard"),
)
