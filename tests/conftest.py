"""Shared helpers: load every rank of a TP x EP grid and stitch the shards back together.

`reassemble` is the independent check used by the fixture and loader tests: it
loads each rank with its own `ParallelConfig`, dequantises the fused layout,
splits w13 into gate (rows 0..I_p-1) and up (rows I_p..; all rows when not gated), checks that each
rank's padding (the last `padding` of its I_p columns) dequantises to 0, and concatenates the real columns
of the TP slices (gate/up along rows, down along columns). `expected_experts` computes
the expert placement from the spec, independently of the package.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from safetensors.torch import load_file, save_file

from wna16_loader import ExpertPlacement, LoadedExperts, ParallelConfig, load_experts

# No wall-clock deadline on any property: a test's verdict must not depend on how loaded the machine is
# (a 200 ms deadline failed cases that take 0.1 ms alone, on a 2-core machine under load).
settings.register_profile("wna16", deadline=None)
settings.load_profile("wna16")

FIXTURES = Path(__file__).parent / "fixtures"

# The tests move tiny tensors; intra-op threads only add overhead (and spin under CPU contention).
torch.set_num_threads(1)

Weights = dict[tuple[str, int, str], torch.Tensor]
Owners = dict[tuple[str, int], dict[int, list[int]]]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Seeded values of `dtype`: normal floats, or integers in [0, 200)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 200, shape, generator=gen, dtype=torch.int64).to(dtype)


def expected_experts(num_experts: int, ep: int, ep_rank: int, placement: str = "linear") -> list[int]:
    """Global expert ids of `ep_rank`, from the spec: linear = E//ep consecutive ids with the first E%ep
    ranks holding one more; round_robin = ep_rank, ep_rank + ep, ..."""
    if ExpertPlacement(placement) is ExpertPlacement.ROUND_ROBIN:
        return list(range(ep_rank, num_experts, ep))
    counts = [num_experts // ep + (1 if r < num_experts % ep else 0) for r in range(ep)]
    start = sum(counts[:ep_rank])
    return list(range(start, start + counts[ep_rank]))


def load_all_ranks(folder: str | Path, tp: int, ep: int, placement: str = "linear",
                   **kwargs: Any) -> dict[tuple[int, int], LoadedExperts]:
    """(tp_rank, ep_rank) -> the load of that rank."""
    return {(tp_rank, ep_rank): load_experts(folder, ParallelConfig(tp_size=tp, tp_rank=tp_rank, ep_size=ep,
                                                                    ep_rank=ep_rank, expert_placement=placement),
                                             **kwargs)
            for ep_rank in range(ep) for tp_rank in range(tp)}


def stitch(loads: dict[tuple[int, int], LoadedExperts], tp: int) -> tuple[Weights, Owners]:
    """Dequantise every rank's layers and concatenate the TP slices.

    Returns ({(prefix, expert, "gate"|"up"|"down"): float32 [N, K]}, {(prefix, expert): {tp_rank: [ep_ranks]}}).
    """
    slices: dict[tuple[str, int, str], dict[int, torch.Tensor]] = defaultdict(dict)
    owners: Owners = defaultdict(lambda: defaultdict(list))
    for (tp_rank, ep_rank), loaded in sorted(loads.items()):
        for prefix, layer in loaded.items():
            deq = layer.dequantize()
            assert deq.w13.dtype == torch.float32 and deq.w2.dtype == torch.float32
            ids = layer.expert_ids.tolist()
            part = deq.w2.shape[2]
            halves = ("gate", "up") if layer.gated else ("up",)
            assert deq.w13.shape[1] == len(halves) * part, \
                f"{prefix}: w13 rows {deq.w13.shape[1]} vs w2 columns {part} (gated={layer.gated})"
            real = part - layer.padding  # the checkpoint's columns; the padding after them must be exactly 0
            for i in range(len(halves)):
                assert not deq.w13[:, i * part + real:(i + 1) * part].any(), f"{prefix}: w13 padding"
            assert not deq.w2[:, :, real:].any(), f"{prefix}: w2 padding"
            for slot, expert in enumerate(ids):
                owners[(prefix, expert)][tp_rank].append(ep_rank)
                if tp_rank in slices[(prefix, expert, "down")]:
                    continue  # a duplicate owner; the owner map reports it
                for i, half in enumerate(halves):
                    slices[(prefix, expert, half)][tp_rank] = deq.w13[slot, i * part:i * part + real]
                slices[(prefix, expert, "down")][tp_rank] = deq.w2[slot, :, :real]
    weights: Weights = {}
    for key, parts in slices.items():
        assert sorted(parts) == list(range(tp)), f"{key}: TP slices {sorted(parts)} of {tp}"
        weights[key] = torch.cat([parts[r] for r in range(tp)], dim=1 if key[2] == "down" else 0)
    return weights, {k: dict(v) for k, v in owners.items()}


def reassemble(folder: str | Path, tp: int, ep: int, placement: str = "linear",
               **kwargs: Any) -> tuple[Weights, Owners]:
    """Load every rank of the tp x ep grid and return (full float32 weights, owner map); see `stitch`."""
    return stitch(load_all_ranks(folder, tp, ep, placement, **kwargs), tp)


def assert_owners(owners: Owners, prefixes: tuple[str, ...] | list[str], num_experts: int, tp: int, ep: int,
                  placement: str = "linear") -> None:
    """Every expert of every layer sits on exactly one EP rank per TP slice, the one the spec names."""
    want_rank = {e: r for r in range(ep) for e in expected_experts(num_experts, ep, r, placement)}
    assert sorted(owners) == sorted((p, e) for p in prefixes for e in range(num_experts))
    for (prefix, expert), per_tp in owners.items():
        assert per_tp == {t: [want_rank[expert]] for t in range(tp)}, (prefix, expert, per_tp)


def assert_exact(weights: Weights, references: dict[tuple[str, int, str], torch.Tensor]) -> None:
    """Reassembled weights equal the references bit for bit."""
    assert sorted(weights) == sorted(references)
    for key, ref in references.items():
        got = weights[key]
        assert got.shape == ref.shape, (key, got.shape, ref.shape)
        if not torch.equal(got, ref.to(torch.float32)):
            diff = (got - ref).abs()
            raise AssertionError(f"{key}: {int((diff > 0).sum())} of {ref.numel()} values differ, "
                                 f"max |diff| {float(diff.max())}")


def rewrite(path: str | Path, mutate) -> None:
    """Load a safetensors file, let `mutate(tensors)` edit the dict in place, save it back."""
    path = Path(path)
    tensors = load_file(str(path))
    mutate(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES
