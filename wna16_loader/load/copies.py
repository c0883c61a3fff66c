"""Copies into the fused layout: tiled transposing copies (`copy_transposing`) and `place`, which also lets
`NibbleWords` transpose themselves straight into their destination rows.

| copy_transposing | value [..., N, W] with unit stride along N (a transposed view) -> target [..., N, W] |
"""

from __future__ import annotations

import torch

from ..formats.packing import NibbleWords

PAGE_BYTES = 4096  # rows a multiple of this apart all fall into the same cache sets (see copy_transposing)
STAGED_ROWS = 64  # source rows moved per block through a buffer whose rows are not a page apart
BLOCKED_MIN = 60 * 60  # the fewest elements for which torch's copy_ takes its blocked transpose
CACHED_BLOCK_BYTES = 32 << 10  # a block of source rows this size stays in a core's L1 (32-64 KiB on server CPUs) as
#                                it is transposed: such blocks of all experts in one copy beat a blocked copy each
BATCHED_MATRIX_BYTES = 256 << 10  # up to this size per matrix (measured: 0.2-0.9x up to 384 KiB, 1.1-1.6x from 768)


def place(target: torch.Tensor, value: torch.Tensor | NibbleWords) -> None:
    """`value` into `target`: `NibbleWords` write themselves, tensors go through `copy_transposing`."""
    if isinstance(value, NibbleWords):
        value.write(target)
    else:
        copy_transposing(target, value)


def copy_transposing(target: torch.Tensor, value: torch.Tensor) -> None:
    """`target.copy_(value)`, tile by tile when `value`'s last two dims are transposed (unit stride
    along dim -2), e.g. the [K/P, N] -> [N, K/P] transposes of packed weights or scales.

    A tiled copy keeps both the rows read and the rows written in cache (about 1.5x faster than a
    plain strided copy). Any leading dims (experts) are carried along; the source rows may be
    strided (a column slice of a file's tensor). On the CPU, source rows a whole number of pages apart
    (N a multiple of 1024 int32 words) defeat the tiles (every row of a tile maps to the same cache sets):
    they go through a padded buffer first. On one thread, whole transposed matrices go through torch's
    blocked transpose instead, one call each (1.2-2x the tiles; the tiles, unlike it, spread over torch's
    threads), or, up to BATCHED_MATRIX_BYTES each, in blocks of source rows that fit a core's L1, every expert's
    block in one copy (scales and zero points in one block; a TP rank's word cuts in a few)."""
    if value.dim() < 2 or value.shape[-2] < 2 or value.stride(-2) != 1 or value.stride(-1) == 1:
        target.copy_(value)  # not a transpose
        return
    if value.device.type == "cpu" and torch.get_num_threads() == 1 and _whole_transposed_matrices(target, value):
        if value.dim() == 3 and value[0].numel() * value.element_size() <= BATCHED_MATRIX_BYTES:
            _copy_in_row_blocks(target, value)
            return
        for matrix, source in zip(target.unbind(0), value.unbind(0)) if value.dim() == 3 else [(target, value)]:
            matrix.copy_(source)
        return
    n, w = value.shape[-2:]
    if value.device.type == "cpu" and value.stride(-1) * value.element_size() % PAGE_BYTES == 0 \
            and w >= 2 * STAGED_ROWS:
        _copy_through_padded_rows(target, value)
        return
    block = next((b for b in (16, 8, 4) if n % b == 0 and w % b == 0), 0)
    if not block:
        target.copy_(value)
        return
    tiled = lambda t: t.unflatten(-2, (n // block, block)).unflatten(-1, (w // block, block))  # noqa: E731
    tiled(target).copy_(tiled(value))


def _copy_in_row_blocks(target: torch.Tensor, value: torch.Tensor) -> None:
    """`copy_transposing` of experts' whole transposed matrices (value [E, N, W], each a stored [W, N]), a block of
    source rows at a time for every expert at once, each block at most CACHED_BLOCK_BYTES of a matrix."""
    n, w = value.shape[-2:]
    blocks = -(-w // max(1, CACHED_BLOCK_BYTES // (n * value.element_size())))
    rows = -(-w // blocks)  # blocks of even size
    for start in range(0, w, rows):
        target[..., start:start + rows].copy_(value[..., start:start + rows])


def _whole_transposed_matrices(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Each [N, W] matrix of `value` (experts first, if any) a [W, N] one transposed, `target`'s contiguous."""
    n, w = value.shape[-2:]
    return value.dim() in (2, 3) and target.shape == value.shape and target.dtype == value.dtype and \
        value.stride(-1) == n and target.stride(-1) == 1 and target.stride(-2) == w and n * w >= BLOCKED_MIN


def _copy_through_padded_rows(target: torch.Tensor, value: torch.Tensor) -> None:
    """`copy_transposing` for source rows a page multiple apart: STAGED_ROWS source rows at a time are
    copied (contiguously) into a buffer with a row stride of N + 16, then tiled from there."""
    n, w = value.shape[-2:]
    buffer = torch.empty((*value.shape[:-2], STAGED_ROWS, n + 16), dtype=value.dtype)
    for start in range(0, w, STAGED_ROWS):
        count = min(STAGED_ROWS, w - start)
        staged = buffer[..., :count, :n]
        staged.copy_(value[..., start:start + count].transpose(-1, -2))
        copy_transposing(target[..., start:start + count], staged.transpose(-1, -2))
