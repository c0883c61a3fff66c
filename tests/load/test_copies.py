"""copies: tiled transposing copies into the fused layout, and `place` (tensors and `NibbleWords`).

Expected values come from plain torch (`Tensor.copy_`) or the nibble transpose's fresh output, never from
the function under test.
"""

from __future__ import annotations

import math

from typing import Callable

import pytest
import torch
from conftest import random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

from wna16_loader.formats.awq import AWQ_ORDER
from wna16_loader.formats.packing import NibbleWords, transpose_nibble_words
from wna16_loader.load.copies import BATCHED_MATRIX_BYTES, CACHED_BLOCK_BYTES, copy_transposing, place

# --- copy_transposing ----------------------------------------------------------------------------------------

def assert_copies_like_torch(base: torch.Tensor, view: Callable[[torch.Tensor], torch.Tensor],
                             value: torch.Tensor) -> None:
    """copy_transposing into view(base) leaves base exactly as Tensor.copy_ does (inside and outside the view)."""
    ours, theirs = base.clone(), base.clone()
    copy_transposing(view(ours), value)
    view(theirs).copy_(value)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, base) or torch.equal(view(base), value)  # the copy did something


DTYPES = [torch.int32, torch.uint8, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_transposed_contiguous_2d(dtype: torch.dtype) -> None:
    value = random_tensor((32, 48), dtype).t()  # [48, 32], unit stride along dim -2
    assert value.stride() == (1, 48)
    assert_copies_like_torch(torch.zeros(48, 32, dtype=dtype), lambda t: t, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_transposed_column_slice(dtype: torch.dtype) -> None:
    """A column slice of a wider stored tensor, transposed: strided source rows."""
    value = random_tensor((40, 100), dtype)[:, 12:36].t()  # [24, 40], strides (1, 100)
    assert value.stride() == (1, 100)
    assert_copies_like_torch(torch.zeros(24, 40, dtype=dtype), lambda t: t, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_batch_of_transposes(dtype: torch.dtype) -> None:
    value = random_tensor((3, 16, 40), dtype).transpose(1, 2)  # [3, 40, 16]
    assert_copies_like_torch(torch.zeros(3, 40, 16, dtype=dtype), lambda t: t, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_into_row_range_of_larger_target(dtype: torch.dtype) -> None:
    """The target is rows [20, 44) of every slot of a larger tensor (like w13 gate/up rows of some experts)."""
    value = random_tensor((2, 8, 200), dtype)[:, :, 50:74].transpose(1, 2)  # [2, 24, 8], strided rows
    assert_copies_like_torch(torch.full((4, 64, 8), 7, dtype=dtype), lambda t: t[1:3, 20:44], value)


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 4), (1, 32), (32, 1), (18, 12)])
def test_copy_transposed_odd_shapes(shape: tuple[int, int]) -> None:
    """Sizes with no common block of 16/8/4 (or a size-1 dim) take the plain copy; the result is the same."""
    value = random_tensor(shape[::-1], torch.int32).t()
    assert_copies_like_torch(torch.zeros(shape, dtype=torch.int32), lambda t: t, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_not_transposed(dtype: torch.dtype) -> None:
    value = random_tensor((3, 32, 64), dtype)[:, :, 8:40]  # row-major rows, a column slice
    assert_copies_like_torch(torch.zeros(3, 40, 32, dtype=dtype), lambda t: t[:, 4:36], value)


def test_copy_int32_words_into_byte_view() -> None:
    """Transposed int32 words into an int32 view of uint8 rows (the writer's as_bytes copy)."""
    words = random_tensor((4, 24), torch.int32).t()  # [24, 4] words = [24, 16] bytes
    target = torch.zeros(3, 24, 16, dtype=torch.uint8)
    copy_transposing(target[1].view(torch.int32), words)
    assert torch.equal(target[1], words.contiguous().view(torch.uint8))
    assert not target[0].any() and not target[2].any()


SIZES = st.one_of(st.integers(1, 10).map(lambda x: 4 * x), st.integers(1, 40))  # often a tiled shape


@settings(max_examples=60, deadline=None)
@given(lead=st.sampled_from([(), (1,), (3,)]), n=SIZES, w=SIZES,
       col=st.integers(0, 9), extra=st.integers(0, 9), row=st.integers(0, 5), transposed=st.booleans(),
       dtype=st.sampled_from(DTYPES))
def test_copy_transposing_matches_copy(lead: tuple[int, ...], n: int, w: int, col: int, extra: int, row: int,
                                       transposed: bool, dtype: torch.dtype) -> None:
    """Any shape, column offset, source row stride and target row offset: the same as Tensor.copy_."""
    if transposed:  # stored [..., W, col + N + extra], read as the transpose of a column slice
        value = random_tensor((*lead, w, col + n + extra), dtype, seed=n * 41 + w)[..., col:col + n].transpose(-1, -2)
    else:
        value = random_tensor((*lead, n, col + w + extra), dtype, seed=n * 41 + w)[..., col:col + w]
    assert_copies_like_torch(torch.zeros((*lead, row + n + 3, w), dtype=dtype),
                             lambda t: t[..., row:row + n, :], value)



@pytest.mark.parametrize("rows,cols,dtype,calls", [
    (64, 96, torch.float16, [(4, 96, 64)]),  # 12 KiB: one block, every expert in one copy
    (256, 96, torch.int32, [(4, 96, 64)] * 4),  # 96 KiB: four blocks of 64 source rows (24 KiB each)
    (256, 768, torch.int32, [(768, 256)] * 4),  # 768 KiB: torch's blocked transpose, one matrix each
], ids=["12-KiB-one-block", "96-KiB-four-blocks", "768-KiB-one-each"])
def test_whole_transposed_matrices_go_in_blocks_that_stay_in_cache(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                                   cols: int, dtype: torch.dtype,
                                                                   calls: list[tuple[int, ...]]) -> None:
    """On one thread, 4 experts' whole transposed matrices (each a stored [K, N] read as [N, K]) of up to
    BATCHED_MATRIX_BYTES go in even blocks of source rows of at most CACHED_BLOCK_BYTES, one copy per block for
    every expert; larger ones through torch's blocked transpose, one each. The values are Tensor.copy_'s."""
    value = random_tensor((4, rows, cols), dtype, seed=rows).transpose(1, 2)
    target, made, original = torch.zeros(4, cols, rows, dtype=dtype), [], torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, *args: object) -> torch.Tensor:
        made.append(tuple(src.shape))
        return original(self, src, *args)

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    copy_transposing(target, value)
    monkeypatch.undo()
    assert made == calls
    assert (rows * cols * dtype.itemsize <= BATCHED_MATRIX_BYTES) == (made[0][0] == 4)
    assert all(math.prod(shape[1:]) * dtype.itemsize <= CACHED_BLOCK_BYTES for shape in made if shape[0] == 4)
    assert torch.equal(target, value.contiguous())


# --- place ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start,count", [(0, 24), (3, 13), (8, 16)])
def test_place_writes_nibble_words_rows_into_a_byte_view(start: int, count: int) -> None:
    """NibbleWords placed into an int32 view of rows of a larger uint8 target: exactly their rows of the
    fresh transpose (all rows in one pass, a part through the fresh copy), nothing outside the view."""
    words = random_tensor((2, 16, 3), torch.int32, seed=5) * 77777  # [E, K, W]: K 16, N = 24
    target = torch.full((4, 30, 8), 0xEE, dtype=torch.uint8)  # [E_l, rows, K/2 bytes]
    view = target[1:3, 2:2 + count].view(torch.int32)  # [2, count, K/8 words]
    place(view, NibbleWords(words, AWQ_ORDER, start, count))
    want = transpose_nibble_words(words, slot_order=AWQ_ORDER).narrow(1, start, count)
    assert torch.equal(view, want)
    outside = torch.ones_like(target, dtype=torch.bool)
    outside[1:3, 2:2 + count] = False
    assert bool((target[outside] == 0xEE).all())


def test_place_tensor_is_copy_transposing() -> None:
    value = random_tensor((2, 16, 40), torch.int32).transpose(1, 2)
    ours, theirs = torch.zeros(2, 40, 16, dtype=torch.int32), torch.zeros(2, 40, 16, dtype=torch.int32)
    place(ours, value)
    theirs.copy_(value)
    assert torch.equal(ours, theirs)
