"""ParallelConfig: the only source of tensor- and expert-parallel sizes and ranks.

TP and EP compose: experts are split across `ep_size` ranks, and each expert's
intermediate dimension across `tp_size` ranks. The global rank of a (tp, ep)
pair is `ep_rank * tp_size + tp_rank`. `ShardJob` is the same for the processes of a
rank-parallel `wna16-shard` run. `Node` names the ranks that share one machine (its storage and page cache),
which read a checkpoint together. This module is the one place that reads torch.distributed and the
environment to build them.
"""

from __future__ import annotations

import enum
import json
import os
import re
import secrets
import socket
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..errors import ShardingError
from ..logs import log

MANIFEST_NAME = "wna16_manifest.json"  # a wna16-shard output's manifest; from_manifest reads its parallel record


def _manifest_at(path: Path) -> Any:
    """The parsed manifest of output folder `path` (or of the manifest file `path`), for its parallel record."""
    file = path / MANIFEST_NAME if path.is_dir() else path
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        found = "no such file" if isinstance(exc, FileNotFoundError) else f"{type(exc).__name__}: {exc}"
        raise ShardingError(f"ParallelConfig.from_manifest: {file}: {found}; pass the OUT folder of a finished "
                            f"wna16-shard run (it holds {MANIFEST_NAME}).") from None


class ExpertPlacement(enum.Enum):
    """How global expert ids are dealt to EP ranks."""

    LINEAR = "linear"  # consecutive blocks; the first E % ep ranks get one more
    ROUND_ROBIN = "round_robin"  # ids ep_rank, ep_rank + ep, ...


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes and ranks of one process, validated on construction."""

    tp_size: int
    tp_rank: int
    ep_size: int = 1
    ep_rank: int = 0
    expert_placement: ExpertPlacement | str = ExpertPlacement.LINEAR

    def __post_init__(self) -> None:
        for label, size, rank in (("tp", self.tp_size, self.tp_rank), ("ep", self.ep_size, self.ep_rank)):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, rank)):
                raise ShardingError(f"ParallelConfig: {label}_size and {label}_rank must be integers, "
                                    f"got {label}_size={size!r}, {label}_rank={rank!r}.")
            if size < 1:
                raise ShardingError(f"ParallelConfig: {label}_size must be >= 1, got {size}.")
            if not 0 <= rank < size:
                raise ShardingError(f"ParallelConfig: {label}_rank={rank} is out of range for "
                                    f"{label}_size={size}; valid ranks are 0..{size - 1}.")
        placement = self.expert_placement
        if not isinstance(placement, ExpertPlacement):
            try:
                placement = ExpertPlacement(placement)
            except ValueError:
                raise ShardingError(f"ParallelConfig: expert_placement={placement!r} is unknown; use one of "
                                    f"{[p.value for p in ExpertPlacement]}.") from None
            object.__setattr__(self, "expert_placement", placement)

    @property
    def world_size(self) -> int:
        """Number of ranks in the TP x EP grid."""
        return self.tp_size * self.ep_size

    @property
    def rank(self) -> int:
        """Global rank in the grid: `ep_rank * tp_size + tp_rank`."""
        return self.ep_rank * self.tp_size + self.tp_rank

    def same_experts(self, parallel: "ParallelConfig") -> bool:
        """Whether rank `parallel` holds the experts this rank holds: the same EP size, rank and placement (a TP
        peer)."""
        return (self.ep_size, self.ep_rank, self.expert_placement) == \
            (parallel.ep_size, parallel.ep_rank, parallel.expert_placement)

    @classmethod
    def from_rank(cls, rank: int, *, tp_size: int, ep_size: int = 1,
                  expert_placement: ExpertPlacement | str = ExpertPlacement.LINEAR) -> "ParallelConfig":
        """The config of global `rank` in a `tp_size` x `ep_size` grid."""
        world = tp_size * ep_size
        if not 0 <= rank < world:
            raise ShardingError(f"ParallelConfig: rank {rank} is out of range for tp_size={tp_size} x "
                                f"ep_size={ep_size} = {world} ranks.")
        return cls(tp_size=tp_size, tp_rank=rank % tp_size, ep_size=ep_size, ep_rank=rank // tp_size,
                   expert_placement=expert_placement)

    @classmethod
    def all_ranks(cls, *, tp_size: int, ep_size: int = 1,
                  expert_placement: ExpertPlacement | str = ExpertPlacement.LINEAR) -> list["ParallelConfig"]:
        """Every rank of the grid, in global rank order."""
        return [cls.from_rank(r, tp_size=tp_size, ep_size=ep_size, expert_placement=expert_placement)
                for r in range(tp_size * ep_size)]

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any] | str | os.PathLike[str], *, rank: int) -> "ParallelConfig":
        """The config of global `rank` in the layout a `wna16-shard` output was written for.

        `manifest` is the output folder OUT (or its manifest file), or the parsed manifest
        (`read_manifest(OUT)`): its `parallel` record gives tp, ep and the expert placement.
        """
        if isinstance(manifest, (str, os.PathLike)):
            manifest = _manifest_at(Path(manifest))
        par = manifest.get("parallel") if isinstance(manifest, Mapping) else None
        if not isinstance(par, Mapping) or not all(key in par for key in ("tp", "ep", "placement")):
            raise ShardingError(f"ParallelConfig.from_manifest: the manifest has no 'parallel' record with tp, ep "
                                f"and placement (found {par!r}); pass read_manifest(OUT) of a wna16-shard output.")
        return cls.from_rank(rank, tp_size=par["tp"], ep_size=par["ep"], expert_placement=par["placement"])

    @classmethod
    def from_environment(cls, *, tp_size: int | None = None, ep_size: int = 1, process_group: Any = None,
                         expert_placement: ExpertPlacement | str = ExpertPlacement.LINEAR) -> "ParallelConfig":
        """Build from torch.distributed, torchrun's environment or accelerate's PartialState.

        The one place in the package that reads them. Order: an initialised
        torch.distributed (optionally `process_group`), then accelerate's
        `PartialState` when it is initialised, then torchrun's `RANK` /
        `WORLD_SIZE`, else a single process. `tp_size` defaults to
        world_size // ep_size; tp_size * ep_size must equal the world size.
        """
        rank, world = _detect_rank_and_world(process_group)
        if tp_size is None:
            if world % ep_size:
                raise ShardingError(f"ParallelConfig.from_environment: world size {world} is not divisible "
                                    f"by ep_size={ep_size}; use an ep_size that divides {world}.")
            tp_size = world // ep_size
        if tp_size * ep_size != world:
            raise ShardingError(f"ParallelConfig.from_environment: tp_size={tp_size} x ep_size={ep_size} = "
                                f"{tp_size * ep_size} but the world size is {world}.")
        return cls.from_rank(rank, tp_size=tp_size, ep_size=ep_size, expert_placement=expert_placement)

    from_process_group = from_environment


@dataclass(frozen=True)
class ShardJob:
    """Which process of a rank-parallel `wna16-shard` run this is: process p of K writes the output
    ranks r with r % K == p (and p = 0 also common/ and the manifest). The few collectives the run
    needs (small Python objects over gloo) are methods here, next to the one place that reads
    torch.distributed."""

    process: int = 0
    processes: int = 1
    process_group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.process < self.processes:
            raise ShardingError(f"ShardJob: process {self.process} outside 0..{self.processes - 1}; the process "
                                f"index must be below the process count (torchrun's RANK < WORLD_SIZE).")

    @classmethod
    def from_environment(cls, process_group: Any = None) -> "ShardJob":
        """Build from torch.distributed (optionally `process_group`), accelerate or torchrun's environment,
        like `ParallelConfig.from_environment`; a single process when none is set up."""
        process, processes = _detect_rank_and_world(process_group)
        return cls(process, processes, process_group)

    @classmethod
    @contextmanager
    def joined(cls) -> Iterator["ShardJob"]:
        """`from_environment`, first joining torchrun's rendezvous with gloo when several processes were
        started and no process group exists yet (left again on exit)."""
        import torch.distributed as dist

        job = cls.from_environment()
        started = job.processes > 1 and not dist.is_initialized()
        if started:
            dist.init_process_group("gloo")
        try:
            yield job
        finally:
            if started:
                dist.destroy_process_group()

    def broadcast(self, value: Any) -> Any:
        """Process 0's `value`, on every process."""
        import torch.distributed as dist

        box = [value]
        if self.processes > 1:
            dist.broadcast_object_list(box, src=0, group=self.process_group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every process's `value`, in process order."""
        import torch.distributed as dist

        if self.processes == 1:
            return [value]
        out: list[Any] = [None] * self.processes
        dist.all_gather_object(out, value, group=self.process_group)
        return out

    def barrier(self) -> None:
        """Wait for every process."""
        import torch.distributed as dist

        if self.processes > 1:
            dist.barrier(group=self.process_group)

    def node(self, load: str, *, window_bytes: int = 1 << 30, timeout_s: float = 300.0) -> "Node":
        """The processes of this run on this host that write from the same source (`load`: e.g. its path), as a
        `Node` of their process indices; this process alone in a single-process run. Every process calls it."""
        if self.processes == 1:
            return Node.alone(self.process)
        return Node.from_environment(self.process_group, rank=self.process, load=load, window_bytes=window_bytes,
                                     timeout_s=timeout_s)


@dataclass(frozen=True)
class Node:
    """The ranks that share this machine and load together (`ReadOptions(node=...)`): each byte the node
    needs is read from storage once, by one of them, into a shared window, and each rank takes its own
    slices from there (`storage/node.py`). `ParallelConfig` stays the source of every TP/EP size and rank.

    `ranks`: the global ranks (`ParallelConfig.rank`) of the node's processes, in local-rank order, this
    process at `local_rank`; `key`: the same text on every rank of the node and a different one for every
    job (it names the shared window in /dev/shm, which other users of the host may share: `from_environment`
    makes it with a secret only the job's processes learn; a key you pass yourself should carry one too); `window_bytes`: the shared memory the node reads into (three parts,
    each grown to the largest layer where one does not fit: the load reports what it used); `timeout_s`: how
    long a rank waits for the others at one step before raising `NodeError`."""

    ranks: tuple[int, ...]
    local_rank: int
    key: str
    window_bytes: int = 1 << 30
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ShardingError(f"Node: ranks={self.ranks!r} must be distinct global ranks >= 0, at least one.")
        if not 0 <= self.local_rank < len(self.ranks):
            raise ShardingError(f"Node: local_rank={self.local_rank} is out of range for {len(self.ranks)} ranks; "
                                f"valid local ranks are 0..{len(self.ranks) - 1}.")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,120}", self.key):
            raise ShardingError(f"Node: key={self.key!r} must be 1-120 letters, digits, '.', '_' or '-' "
                                f"(it names a file in /dev/shm); pass the same such text on every rank.")
        if self.window_bytes < 1 or self.timeout_s <= 0:
            raise ShardingError(f"Node: window_bytes={self.window_bytes} and timeout_s={self.timeout_s} must be "
                                f"positive.")

    @property
    def size(self) -> int:
        """How many ranks load together."""
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.local_rank]

    @classmethod
    def alone(cls, rank: int = 0) -> "Node":
        """A node of one rank: it reads everything it needs itself."""
        return cls((rank,), 0, f"alone-{os.getpid()}")

    @classmethod
    def from_environment(cls, process_group: Any = None, *, rank: int | None = None, load: str = "",
                         window_bytes: int = 1 << 30, timeout_s: float = 300.0) -> "Node":
        """The node of this process: the ranks of an initialised torch.distributed group (`process_group`,
        else the world) on this host that load the same thing, found by all-gathering (host, `rank`, `load`);
        else torchrun's `LOCAL_RANK` / `LOCAL_WORLD_SIZE` / `RANK`; else this process alone. `rank`: this
        process's `ParallelConfig.rank` (default: its rank in the group, as `ParallelConfig.from_environment`
        takes it); `load`: what it loads (e.g. its layers: ranks of other pipeline stages load others and are
        never one node); ranks of one rank number (data-parallel replicas) go to nodes of their own."""
        ranks, local, key = _detect_node(process_group, rank, load)
        return cls(ranks, local, key, window_bytes=window_bytes, timeout_s=timeout_s)


def _detect_node(process_group: Any, rank: int | None, load: str) -> tuple[tuple[int, ...], int, str]:
    """(the node's global ranks, this process's index among them, the node's key). The key carries a secret that
    only the node's own processes learn (local rank 0's random token, handed out by the all-gather that forms the
    node; or torchrun's random run id): no one else on the host can name its window in advance."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        me = (socket.gethostname(), dist.get_rank(process_group) if rank is None else rank, load, os.getpid(),
              secrets.token_hex(16))
        everyone: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(everyone, me, group=process_group)
        return _node_of(everyone, everyone.index(me))
    if all(name in os.environ for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK")):
        return _torchrun_node(os.environ, rank)
    return (_detect_rank_and_world(process_group)[0] if rank is None else rank,), 0, f"alone-{os.getpid()}"


def _torchrun_node(env: Mapping[str, str], rank: int | None) -> tuple[tuple[int, ...], int, str]:
    """The node torchrun's environment describes, where its run id is a secret: a random UUID, as torchrun makes
    one for a single-host run (and `--standalone`). A run id the user chose (`--rdzv-id`) may be known to others
    on the host, so then each rank reads alone (a warning says so)."""
    try:
        local, count, first = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]), int(env["RANK"])
    except ValueError:
        raise ShardingError(f"Node.from_environment: LOCAL_RANK={env['LOCAL_RANK']!r}, LOCAL_WORLD_SIZE="
                            f"{env['LOCAL_WORLD_SIZE']!r} and RANK={env['RANK']!r} must be integers (as torchrun "
                            f"sets them).") from None
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if not _random_uuid(run):
        log.warning("Node.from_environment: torchrun's run id %r is not a random UUID, so a window named with it "
                    "could be known to other users of this host; the ranks read alone. Initialise "
                    "torch.distributed first (the ranks then share a secret), or run torchrun on one host without "
                    "--rdzv-id.", run)
        return (first if rank is None else rank,), 0, f"alone-{os.getpid()}"
    job = f"{run}-{env.get('MASTER_PORT', '0')}-{os.getppid()}"
    return tuple(range(first - local, first - local + count)), local, _key(f"{job}-{socket.gethostname()}")


def _random_uuid(text: str) -> bool:
    """Whether `text` is a random (version 4) UUID."""
    try:
        return uuid.UUID(text).version == 4
    except ValueError:
        return False


def _node_of(everyone: list[tuple[str, int, str, int, str]], me: int) -> tuple[tuple[int, ...], int, str]:
    """The node of process `me` among every process's (host, rank, load, pid, token): the processes of its host
    and load, the n-th of each rank number in the n-th node; its key leads with the token of its first process
    (local rank 0), then the host and that process's pid."""
    host, rank, load, _, _ = everyone[me]
    peers = [i for i, (h, _, l, _, _) in enumerate(everyone) if (h, l) == (host, load)]
    nth = [sum(everyone[j][1] == everyone[i][1] for j in peers[:at]) for at, i in enumerate(peers)]
    mine = [i for i, n in zip(peers, nth) if n == nth[peers.index(me)]]
    ranks = tuple(everyone[i][1] for i in mine)
    _, _, _, pid, token = everyone[mine[0]]
    return ranks, mine.index(me), _key(f"{token}-{host}-{pid}")


def _key(text: str) -> str:
    """`text` as a node key: characters a file name takes, at most 120."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:120]


def _detect_rank_and_world(process_group: Any) -> tuple[int, int]:
    """(rank, world size) from torch.distributed, accelerate or torchrun's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    try:
        from accelerate import PartialState

        if PartialState._shared_state:  # initialised by the user; never create one here
            state = PartialState()
            return state.process_index, state.num_processes
    except ImportError:  # accelerate is a dependency, but stay usable without it
        pass
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise ShardingError(f"ParallelConfig.from_environment: RANK={os.environ['RANK']!r} and WORLD_SIZE="
                                f"{os.environ['WORLD_SIZE']!r} must be integers (as torchrun sets them).") from None
    return 0, 1
