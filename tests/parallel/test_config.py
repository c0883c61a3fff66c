"""ParallelConfig validation and environment detection, and the source scan that keeps it the only
source of tp/ep sizes and ranks in the package."""

from __future__ import annotations

import ast
import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from processes import start_ranks

import wna16_loader
from wna16_loader.errors import ShardingError, WNA16Error
from wna16_loader.parallel.config import ExpertPlacement, Node, ParallelConfig, _node_of

PACKAGE_DIR = Path(wna16_loader.__file__).resolve().parent
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def test_sharding_error_is_a_wna16_and_value_error() -> None:
    assert issubclass(ShardingError, WNA16Error)
    assert issubclass(ShardingError, ValueError)


# ---------------------------------------------------------------- construction / validation


def test_defaults() -> None:
    pc = ParallelConfig(tp_size=1, tp_rank=0)
    assert (pc.tp_size, pc.tp_rank, pc.ep_size, pc.ep_rank) == (1, 0, 1, 0)
    assert pc.expert_placement is ExpertPlacement.LINEAR
    assert pc.world_size == 1
    assert pc.rank == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp_size=2, tp_rank=2), r"tp_rank=2 is out of range for tp_size=2; valid ranks are 0\.\.1"),
    (dict(tp_size=2, tp_rank=-1), r"tp_rank=-1 is out of range for tp_size=2; valid ranks are 0\.\.1"),
    (dict(tp_size=1, tp_rank=0, ep_size=4, ep_rank=4), r"ep_rank=4 is out of range for ep_size=4; valid ranks are 0\.\.3"),
    (dict(tp_size=1, tp_rank=0, ep_size=4, ep_rank=-2), r"ep_rank=-2 is out of range for ep_size=4"),
])
def test_rank_out_of_range(kwargs: dict, match: str) -> None:
    with pytest.raises(ShardingError, match=match):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp_size=0, tp_rank=0), r"tp_size must be >= 1, got 0\."),
    (dict(tp_size=-2, tp_rank=0), r"tp_size must be >= 1, got -2\."),
    (dict(tp_size=1, tp_rank=0, ep_size=0, ep_rank=0), r"ep_size must be >= 1, got 0\."),
])
def test_size_below_one(kwargs: dict, match: str) -> None:
    with pytest.raises(ShardingError, match=match):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp_size=2.0, tp_rank=0), r"tp_size and tp_rank must be integers, got tp_size=2\.0, tp_rank=0"),
    (dict(tp_size=2, tp_rank="1"), r"tp_size and tp_rank must be integers, got tp_size=2, tp_rank='1'"),
    (dict(tp_size="2", tp_rank=0), r"tp_size and tp_rank must be integers"),
    (dict(tp_size=None, tp_rank=0), r"tp_size and tp_rank must be integers, got tp_size=None"),
    (dict(tp_size=True, tp_rank=0), r"tp_size and tp_rank must be integers, got tp_size=True"),
    (dict(tp_size=1, tp_rank=0, ep_size=2, ep_rank=0.0), r"ep_size and ep_rank must be integers, got ep_size=2, "
                                                         r"ep_rank=0\.0"),
    (dict(tp_size=1, tp_rank=0, ep_size=True, ep_rank=0), r"ep_size and ep_rank must be integers"),
])
def test_non_integer_sizes_and_ranks(kwargs: dict, match: str) -> None:
    with pytest.raises(ShardingError, match=match):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(tp_size=2, tp_rank=True), dict(tp_size=1, tp_rank=0, ep_size=2,
                                                                         ep_rank=False)])
def test_bool_rank_is_rejected_like_a_bool_size(kwargs: dict) -> None:
    # Sizes reject bools explicitly (bool is an int subclass); ranks should too.
    with pytest.raises(ShardingError, match=r"must be integers"):
        ParallelConfig(**kwargs)


def test_error_is_catchable_as_value_error() -> None:
    with pytest.raises(ValueError, match=r"tp_rank=5 is out of range"):
        ParallelConfig(tp_size=4, tp_rank=5)


@pytest.mark.parametrize("value,expected", [
    ("linear", ExpertPlacement.LINEAR),
    ("round_robin", ExpertPlacement.ROUND_ROBIN),
    (ExpertPlacement.ROUND_ROBIN, ExpertPlacement.ROUND_ROBIN),
])
def test_placement_string_converts_to_enum(value, expected: ExpertPlacement) -> None:
    pc = ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=1, expert_placement=value)
    assert pc.expert_placement is expected


@pytest.mark.parametrize("value", ["roundrobin", "LINEAR", "", None, 3])
def test_unknown_placement(value) -> None:
    with pytest.raises(ShardingError, match=r"expert_placement=.* is unknown; use one of \['linear', 'round_robin'\]"):
        ParallelConfig(tp_size=1, tp_rank=0, expert_placement=value)


def test_frozen() -> None:
    pc = ParallelConfig(tp_size=2, tp_rank=1)
    with pytest.raises(AttributeError):
        pc.tp_rank = 0  # type: ignore[misc]


# ---------------------------------------------------------------- rank arithmetic


def test_rank_and_world_size() -> None:
    pc = ParallelConfig(tp_size=4, tp_rank=3, ep_size=2, ep_rank=1)
    assert pc.world_size == 8
    assert pc.rank == 1 * 4 + 3


def test_from_rank() -> None:
    pc = ParallelConfig.from_rank(6, tp_size=4, ep_size=2, expert_placement="round_robin")
    assert (pc.tp_size, pc.tp_rank, pc.ep_size, pc.ep_rank) == (4, 2, 2, 1)
    assert pc.rank == 6
    assert pc.expert_placement is ExpertPlacement.ROUND_ROBIN


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_from_rank_out_of_range(rank: int) -> None:
    with pytest.raises(ShardingError, match=rf"rank {rank} is out of range for tp_size=4 x ep_size=2 = 8 ranks"):
        ParallelConfig.from_rank(rank, tp_size=4, ep_size=2)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 4), (2, 3), (4, 2), (8, 1)])
def test_all_ranks(tp: int, ep: int) -> None:
    grid = ParallelConfig.all_ranks(tp_size=tp, ep_size=ep)
    assert len(grid) == tp * ep
    assert [pc.rank for pc in grid] == list(range(tp * ep))
    assert {(pc.tp_rank, pc.ep_rank) for pc in grid} == {(t, e) for t in range(tp) for e in range(ep)}
    assert all(pc.world_size == tp * ep and pc.tp_size == tp and pc.ep_size == ep for pc in grid)
    # tp is the fastest-moving index
    assert [(pc.ep_rank, pc.tp_rank) for pc in grid] == sorted((e, t) for e in range(ep) for t in range(tp))


def test_all_ranks_passes_placement() -> None:
    grid = ParallelConfig.all_ranks(tp_size=1, ep_size=3, expert_placement="round_robin")
    assert all(pc.expert_placement is ExpertPlacement.ROUND_ROBIN for pc in grid)


def test_same_experts_are_those_of_the_same_ep_rank_size_and_placement() -> None:
    """The TP peers of a rank (same EP rank) hold its experts; another EP rank, EP size or placement does not."""
    grid = ParallelConfig.all_ranks(tp_size=2, ep_size=2)
    assert [[b.rank for b in grid if a.same_experts(b)] for a in grid] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    one = ParallelConfig(tp_size=2, tp_rank=0, ep_size=2, ep_rank=0)
    assert not one.same_experts(ParallelConfig(tp_size=4, tp_rank=0, ep_size=1, ep_rank=0))
    assert not one.same_experts(ParallelConfig(2, 1, 2, 0, expert_placement="round_robin"))


# ---------------------------------------------------------------- from_environment


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "tests expect torch.distributed uninitialised"
    try:
        from accelerate import PartialState

        assert not PartialState._shared_state, "tests expect accelerate's PartialState uninitialised"
    except ImportError:
        pass
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_from_environment_single_process(clean_env: pytest.MonkeyPatch) -> None:
    pc = ParallelConfig.from_environment()
    assert pc == ParallelConfig(tp_size=1, tp_rank=0)


def test_from_environment_needs_both_vars(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "3")
    assert ParallelConfig.from_environment() == ParallelConfig(tp_size=1, tp_rank=0)


def test_from_environment_torchrun_vars_tp_default(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    pc = ParallelConfig.from_environment()
    assert (pc.tp_size, pc.tp_rank, pc.ep_size, pc.ep_rank) == (4, 3, 1, 0)


def test_from_environment_with_ep(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    pc = ParallelConfig.from_environment(ep_size=2, expert_placement="round_robin")
    assert (pc.tp_size, pc.tp_rank, pc.ep_size, pc.ep_rank) == (4, 1, 2, 1)
    assert pc.rank == 5
    assert pc.expert_placement is ExpertPlacement.ROUND_ROBIN


def test_from_environment_explicit_tp(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "4")
    pc = ParallelConfig.from_environment(tp_size=1, ep_size=4)
    assert (pc.tp_size, pc.tp_rank, pc.ep_size, pc.ep_rank) == (1, 0, 4, 2)


def test_from_process_group_is_an_alias(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    assert ParallelConfig.from_process_group() == ParallelConfig.from_environment()
    assert ParallelConfig.from_process_group() == ParallelConfig(tp_size=2, tp_rank=1)


def test_from_environment_world_not_divisible_by_ep(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "6")
    with pytest.raises(ShardingError, match=r"world size 6 is not divisible by ep_size=4; use an ep_size that "
                                            r"divides 6"):
        ParallelConfig.from_environment(ep_size=4)


def test_from_environment_tp_times_ep_mismatch(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "4")
    with pytest.raises(ShardingError, match=r"tp_size=2 x ep_size=1 = 2 but the world size is 4"):
        ParallelConfig.from_environment(tp_size=2)
    with pytest.raises(ShardingError, match=r"tp_size=4 x ep_size=2 = 8 but the world size is 4"):
        ParallelConfig.from_environment(tp_size=4, ep_size=2)


def test_from_environment_rank_beyond_world(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "4")
    clean_env.setenv("WORLD_SIZE", "4")
    with pytest.raises(ShardingError, match=r"rank 4 is out of range for tp_size=4 x ep_size=1 = 4 ranks"):
        ParallelConfig.from_environment()


# ---------------------------------------------------------------- source scan (regression)

PARALLEL_FIELDS = {"tp_size", "tp_rank", "ep_size", "ep_rank"}
# The package holds a ParallelConfig under the name `parallel`: a parameter/variable (`parallel.tp_size`) or
# an attribute of a dataclass (`self.parallel.tp_rank` in sharding.py, `r.parallel.ep_rank` for a rank
# plan). `self` is allowed only inside ParallelConfig itself (parallel/config.py).
ALLOWED_HOLDER_NAMES = {"parallel"}
ALLOWED_HOLDER_NAMES_IN_PARALLEL_PY = ALLOWED_HOLDER_NAMES | {"self"}
# An engine plugin turns the engine's own description of a rank into the ParallelConfig, once, as
# from_environment does for torch.distributed: vLLM's FusedMoEParallelConfig, named `moe_parallel_config`.
ALLOWED_HOLDER_NAMES_BY_FILE = {"integrations/vllm.py": ALLOWED_HOLDER_NAMES | {"moe_parallel_config"}}


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of Names/Attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _parallel_field_offenders(source: str, filename: str) -> list[str]:
    own = Path(filename).as_posix().endswith("parallel/config.py")
    allowed = ALLOWED_HOLDER_NAMES_IN_PARALLEL_PY if own else ALLOWED_HOLDER_NAMES_BY_FILE.get(
        Path(filename).as_posix(), ALLOWED_HOLDER_NAMES)
    offenders = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in PARALLEL_FIELDS:
            value = node.value
            holder = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", None)
            if holder not in allowed:
                offenders.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return offenders


def _environment_offenders(source: str, filename: str) -> list[str]:
    offenders = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            offenders += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.startswith("torch.distributed") or (
                    module == "torch" and any(a.name == "distributed" for a in node.names)):
                offenders.append(f"{where}: from {module} import ...")
            if module == "os" and any(a.name in ("environ", "getenv", "environb") for a in node.names):
                offenders.append(f"{where}: from os import environ/getenv")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted in ("os.environ", "os.getenv", "os.environb", "torch.distributed"):
                offenders.append(f"{where}: {dotted}")
    return offenders


def _package_sources() -> list[Path]:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) >= 10 and (PACKAGE_DIR / "parallel" / "config.py") in files
    return files


def test_scanner_catches_stray_access() -> None:
    bad = "def f(cfg, args):\n    return cfg.tp_size + args.ep_rank + get().tp_rank\n"
    assert len(_parallel_field_offenders(bad, "x.py")) == 3
    good = "def f(parallel):\n    return parallel.tp_size + self.parallel.ep_rank + plan.ranks[0].parallel.tp_rank\n"
    assert _parallel_field_offenders(good, "x.py") == []
    assert len(_parallel_field_offenders("x = self.config.tp_size + parallel_cfg.tp_rank\n", "x.py")) == 2
    assert len(_parallel_field_offenders("self.tp_size\n", "x.py")) == 1
    assert _parallel_field_offenders("self.tp_size\n", "parallel/config.py") == []
    env = ("import os\nimport torch.distributed as dist\nfrom torch import distributed\n"
           "x = os.environ['RANK']\ny = os.getenv('WORLD_SIZE')\nz = torch.distributed.get_rank()\n")
    assert len(_environment_offenders(env, "x.py")) == 5


def test_tp_ep_fields_read_only_from_parallel_config() -> None:
    """The bug this project prevents: sizes/ranks read from some other object (a model config, argparse
    namespace, env) instead of the one ParallelConfig."""
    offenders = []
    for path in _package_sources():
        offenders += _parallel_field_offenders(path.read_text(encoding="utf-8"),
                                               str(path.relative_to(PACKAGE_DIR)))
    assert offenders == [], "tp/ep sizes or ranks read from something other than a ParallelConfig:\n" + "\n".join(
        offenders)


def test_only_parallel_py_touches_distributed_or_environment() -> None:
    offenders = []
    for path in _package_sources():
        if path == PACKAGE_DIR / "parallel" / "config.py":
            continue
        offenders += _environment_offenders(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE_DIR)))
    assert offenders == [], "torch.distributed / os.environ used outside parallel/config.py:\n" + "\n".join(offenders)


def test_parallel_py_is_where_the_environment_is_read() -> None:
    # Sanity check that the scanner would see it (otherwise the test above proves nothing).
    offenders = _environment_offenders((PACKAGE_DIR / "parallel" / "config.py").read_text(encoding="utf-8"),
                                    "parallel/config.py")
    assert any("torch.distributed" in o for o in offenders)
    assert any("os.environ" in o for o in offenders)


def test_from_manifest_reads_the_parallel_record() -> None:
    manifest = {"parallel": {"tp": 2, "ep": 3, "placement": "round_robin"}}
    assert ParallelConfig.from_manifest(manifest, rank=5) == ParallelConfig(2, 1, 3, 2, "round_robin")
    with pytest.raises(ShardingError, match=r"from_manifest: the manifest has no 'parallel' record with tp, ep and "
                                            r"placement \(found \{'tp': 2\}\); pass read_manifest\(OUT\)"):
        ParallelConfig.from_manifest({"parallel": {"tp": 2}}, rank=0)


def test_from_manifest_takes_the_output_folder(tmp_path: Path) -> None:
    """As one writes it first: a path (the OUT folder or its manifest file) works like read_manifest(OUT)."""
    (tmp_path / "wna16_manifest.json").write_text('{"parallel": {"tp": 4, "ep": 1, "placement": "linear"}}')
    for given in (tmp_path, str(tmp_path), tmp_path / "wna16_manifest.json"):
        assert ParallelConfig.from_manifest(given, rank=1) == ParallelConfig(4, 1)
    missing = tmp_path / "out-tp4"
    with pytest.raises(ShardingError) as exc:
        ParallelConfig.from_manifest(str(missing), rank=1)
    assert str(exc.value) == (f"ParallelConfig.from_manifest: {missing}: no such file; pass the OUT folder of a "
                              f"finished wna16-shard run (it holds wna16_manifest.json).")


# ---------------------------------------------------------------- Node: the ranks of one machine

def test_node_of_groups_by_host_and_load_and_splits_replicas() -> None:
    everyone = [("a", 0, "L", 10, "t0"), ("a", 1, "L", 11, "t1"), ("b", 2, "L", 12, "t2"), ("a", 0, "L", 13, "t3"),
                ("a", 1, "M", 14, "t4"), ("a", 2, "L", 15, "t5")]
    assert _node_of(everyone, 0) == ((0, 1, 2), 0, "t0-a-10")
    assert _node_of(everyone, 5) == ((0, 1, 2), 2, "t0-a-10")
    assert _node_of(everyone, 3) == ((0,), 0, "t3-a-13")  # a second replica of rank 0
    assert _node_of(everyone, 4) == ((1,), 0, "t4-a-14")  # another load (pipeline stage)
    assert _node_of(everyone, 2) == ((2,), 0, "t2-b-12")


def test_node_of_keys_lead_with_the_token_however_long_the_host_name() -> None:
    token = "f" * 32
    key = _node_of([("h" * 200, 0, "L", 10, token)], 0)[2]
    assert key.startswith(f"{token}-hhh") and len(key) == 120


def _job_key(rank: int, world: int, init: str, out: str) -> None:
    """One rank of a job whose processes have fixed pids and host name: its node's key."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    os.getpid, socket.gethostname = (lambda: 1000 + rank), (lambda: "host")  # (this child process only)
    node = Node.from_environment(load="experts")
    Path(out, f"rank{rank}.json").write_text(json.dumps([node.key, list(node.ranks), node.local_rank]))
    dist.destroy_process_group()


def test_two_jobs_with_the_same_pids_host_and_sizes_name_different_windows(tmp_path: Path) -> None:
    """4 ranks over gloo, twice: within a job every rank has the same key; the two jobs' keys differ, and neither
    can be told from what another user of the host sees (pids, host name, sizes)."""
    jobs = []
    for job in ("a", "b"):
        (tmp_path / job).mkdir()
        start_ranks(_job_key, (4, str(tmp_path / f"init-{job}"), str(tmp_path / job)), 4)
        jobs.append([json.loads((tmp_path / job / f"rank{r}.json").read_text()) for r in range(4)])
    for ranks in jobs:
        assert [(local, members) for _, members, local in ranks] == [(r, [0, 1, 2, 3]) for r in range(4)]
        assert len({key for key, _, _ in ranks}) == 1
    first, second = jobs[0][0][0], jobs[1][0][0]
    assert first != second and first.endswith("-host-1000") and second.endswith("-host-1000")
    assert len(first.split("-")[0]) == 32  # local rank 0's 128-bit token leads


def _torchrun(monkeypatch: pytest.MonkeyPatch, run_id: str) -> None:
    for name, value in (("RANK", "6"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "4"), ("MASTER_PORT", "29500"),
                        ("TORCHELASTIC_RUN_ID", run_id)):
        monkeypatch.setenv(name, value)


def test_node_from_torchrun_environment_with_a_random_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = "0b4c3f9e-8a51-4c1e-9d2f-6e7a8b9c0d1e"  # what torchrun makes on one host: str(uuid.uuid4())
    _torchrun(monkeypatch, run_id)
    node = Node.from_environment(window_bytes=1 << 20)
    assert (node.ranks, node.local_rank, node.rank, node.size, node.window_bytes) == ((4, 5, 6, 7), 2, 6, 4, 1 << 20)
    assert node.key.startswith(f"{run_id}-29500-{os.getppid()}-")
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ShardingError, match="Node.from_environment: LOCAL_RANK='x', LOCAL_WORLD_SIZE='4' and RANK='6' "
                                            "must be integers"):
        Node.from_environment()


@pytest.mark.parametrize("run_id", ["job 7", "none", "", "6ba7b810-9dad-11d1-80b4-00c04fd430c8"])  # the last: a v1
def test_node_from_torchrun_environment_reads_alone_with_a_run_id_others_may_know(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, run_id: str) -> None:
    _torchrun(monkeypatch, run_id)
    node = Node.from_environment()
    assert (node.ranks, node.local_rank, node.size) == ((6,), 0, 1)
    assert f"Node.from_environment: torchrun's run id {run_id!r} is not a random UUID, so a window named with it " \
           f"could be known to other users of this host; the ranks read alone." in caplog.text


def test_node_alone_without_an_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    node = Node.from_environment(rank=3)
    assert (node.ranks, node.local_rank, node.size) == ((3,), 0, 1)
    assert Node.alone(5).ranks == (5,)
