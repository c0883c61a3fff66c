"""engine/staging.py: a Stage keeps the staged part of each slot's tensor and reads it back exactly as the
whole tensor would be read; anything it cannot stage is held whole, and reads outside the staged part fail."""

from __future__ import annotations

import pytest
import torch

from wna16_loader.engine.staging import HOLD_WHOLE_BYTES, MEMORY_FILE, Stage, TensorStore, copy_index, within
from wna16_loader.models.names import Source
from wna16_loader.storage.index import TensorRef

WHOLE = (slice(0, 6), slice(0, 40))  # a [6, 40] per-expert tensor
PART = (slice(0, 6), slice(8, 24))  # what the rank needs of it: columns 8..23


def tensor(expert: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A [6, 40] tensor whose every value names its expert and position."""
    return (expert * 1000 + torch.arange(240).reshape(6, 40)).to(dtype)


def ref(expert: int, dtype: torch.dtype = torch.int32) -> TensorRef:
    return TensorRef(f"x.{expert}.gate_proj.qweight", MEMORY_FILE, (6, 40), dtype)


def staged(count: int) -> tuple[Stage, TensorStore]:
    """A stage of `count` slots with slot i holding expert i's tensor, staged as PART."""
    store = TensorStore()
    stage = Stage(0, count, Source.GATE, False, store)
    for i in range(count):
        stage.take("qweight", PART, i, tensor(i), ref(i).name)
    return stage, store


def test_within_translates_reads_inside_the_staged_part() -> None:
    assert within(PART, (slice(0, 6), slice(8, 24))) == (slice(0, 6), slice(0, 16))
    assert within(PART, (slice(2, 3), slice(16, 20))) == (slice(2, 3), slice(8, 12))
    assert within(PART, (slice(0, 0), slice(8, 8))) == (slice(0, 0), slice(0, 0))


@pytest.mark.parametrize("index", [(slice(0, 6), slice(4, 24)), (slice(0, 6), slice(8, 25)), (slice(0, 6),),
                                   (0, slice(8, 24)), (slice(0, 6), slice(8, 24, 2))])
def test_within_refuses_reads_outside_the_staged_part(index: tuple) -> None:
    with pytest.raises(AssertionError):
        within(PART, index)


def test_copy_index_drops_trailing_whole_dims() -> None:
    assert copy_index(PART, (6, 40)) == PART
    assert copy_index((slice(0, 3), slice(0, 40)), (6, 40)) == slice(0, 3)
    assert copy_index(WHOLE, (6, 40)) is None
    assert copy_index((slice(0, 6), slice(0, 39)), (6, 40)) == (slice(0, 6), slice(0, 39))


@pytest.mark.parametrize("index", [WHOLE, (slice(2, 5), slice(0, 40))])
def test_stage_copies_whole_or_row_cut_parts(index: tuple) -> None:
    stage = Stage(0, 2, Source.DOWN, False, TensorStore())
    for i in range(2):
        stage.take("qweight", index, i, tensor(i), ref(i).name)
    assert torch.equal(stage.gather([ref(0), ref(1)], [index] * 2), torch.stack([tensor(0)[index], tensor(1)[index]]))


def test_stage_reads_equal_the_whole_tensors_and_keep_no_tensor_per_slot() -> None:
    stage, store = staged(4)
    assert len(store) == 0 and stage.buffers["qweight"].shape == (4, 6, 16)
    for i in range(4):
        assert torch.equal(stage.view(ref(i), PART), tensor(i)[PART])
        assert torch.equal(stage.view(ref(i), (slice(1, 4), slice(10, 12))), tensor(i)[1:4, 10:12])
    refs = [ref(i) for i in (1, 2, 3)]
    stacked = stage.view_stacked(refs, [PART] * 3)
    assert stacked is not None and torch.equal(stacked, torch.stack([tensor(i)[PART] for i in (1, 2, 3)]))
    gathered = stage.gather(refs, [PART] * 3)
    assert torch.equal(gathered, stacked) and gathered.data_ptr() != stacked.data_ptr()  # fresh memory
    assert stage.view_stacked([ref(1), ref(3)], [PART] * 2) is None  # not consecutive slots: gather copies
    assert torch.equal(stage.gather([ref(3), ref(1)], [PART] * 2), torch.stack([tensor(3)[PART], tensor(1)[PART]]))


def test_a_scratch_gather_reuses_the_stores_buffer() -> None:
    """`gather(scratch=True)` stacks into the held store's `Scratch`: equal values, one buffer for every chunk."""
    stage, store = staged(4)
    first = stage.gather([ref(3), ref(1)], [PART] * 2, scratch=True)  # not consecutive: stacked
    assert torch.equal(first, torch.stack([tensor(3)[PART], tensor(1)[PART]]))
    second = stage.gather([ref(1), ref(2)], [PART] * 2, scratch=True)  # consecutive: one view, copied
    assert torch.equal(second, torch.stack([tensor(1)[PART], tensor(2)[PART]]))
    assert first.data_ptr() == second.data_ptr() == store.scratch.buffer.data_ptr()
    fresh = stage.gather([ref(1), ref(2)], [PART] * 2)
    assert fresh.data_ptr() != second.data_ptr() and torch.equal(fresh, second)


def test_stage_copies_so_the_engine_tensor_can_go() -> None:
    stage, _ = staged(1)
    original = tensor(7)
    stage.take("qweight", PART, 0, original, ref(7).name)
    original.fill_(-1)  # the engine reuses or frees its tensor: the stage is not affected
    assert torch.equal(stage.view(ref(7), PART), tensor(7)[PART])


def test_a_duplicate_replaces_the_slot_and_another_dtype_is_held_whole() -> None:
    stage, store = staged(2)
    stage.take("qweight", PART, 1, tensor(5), ref(1).name)  # a duplicate of slot 1: the newest stays
    assert torch.equal(stage.view(ref(1), PART), tensor(5)[PART]) and len(store) == 0
    wide = tensor(1, torch.int64)
    stage.take("qweight", PART, 1, wide, ref(1).name)  # not the buffer's dtype: held as it is
    assert len(store) == 1 and stage.ref("qweight", 1).dtype == torch.int64
    assert torch.equal(stage.view(ref(1, torch.int64), PART), wide[PART])
    assert stage.view_stacked([ref(0), ref(1, torch.int64)], [PART] * 2) is None
    stage.release(1)
    assert len(store) == 0 and stage.written == 1 and stage.roles[1] == -1


def test_stacked_tensors_are_held_once_for_every_slot() -> None:
    store = TensorStore()
    stage = Stage(0, 3, Source.DOWN, True, store)
    whole = torch.arange(3 * 6 * 40, dtype=torch.int32).reshape(3, 6, 40)
    for i in range(3):
        stage.take("qweight", None, i, whole, "x.down_proj.qweight")
    assert len(store) == 1 and not stage.buffers
    big = TensorRef("x.down_proj.qweight", MEMORY_FILE, (3, 6, 40), torch.int32)
    assert torch.equal(stage.gather([big] * 3, [(i, *PART) for i in range(3)]), whole[:, :, 8:24])
    for i in range(3):
        stage.release(i)
    assert len(store) == 0


def test_buffers_stay_on_the_cpu_under_another_default_device() -> None:
    """Engines build models under `torch.device(...)`: the staged parts and gathers are CPU memory anyway."""
    tensors, stage = [tensor(0), tensor(1)], Stage(0, 2, Source.GATE, False, TensorStore())
    with torch.device("meta"):
        for i, handed in enumerate(tensors):
            stage.take("qweight", PART, i, handed, ref(i).name)
        gathered = stage.gather([ref(0), ref(1)], [PART] * 2)
    assert stage.buffers["qweight"].device.type == "cpu" and gathered.device.type == "cpu"
    assert torch.equal(gathered, torch.stack([tensor(0)[PART], tensor(1)[PART]]))


def test_large_tensors_needed_whole_are_held_and_large_parts_staged() -> None:
    """A whole tensor of HOLD_WHOLE_BYTES is held as it is (a copy would buy nothing); a part of one is staged."""
    big = torch.arange(HOLD_WHOLE_BYTES // 4, dtype=torch.int32).reshape(128, -1)
    name, whole = "x.0.down_proj.qweight", (slice(0, 128), slice(0, big.shape[1]))
    big_ref = TensorRef(name, MEMORY_FILE, tuple(big.shape), torch.int32)
    store = TensorStore()
    held = Stage(0, 1, Source.DOWN, False, store)
    held.take("qweight", whole, 0, big, name)
    assert len(store) == 1 and not held.buffers and torch.equal(held.gather([big_ref], [whole])[0], big)
    store = TensorStore()
    cut = Stage(0, 1, Source.DOWN, False, store)
    cut.take("qweight", (slice(0, 64), whole[1]), 0, big, name)
    assert len(store) == 0 and torch.equal(cut.view(big_ref, (slice(0, 64), whole[1])), big[:64])
