"""Pure bit manipulation: int32 word (un)packing and the fused byte packing.

Words hold P = 32 / b values. `slot_order[i]` is the position of the value in
bit slot i (bits b*i .. b*i+b-1); None means slot i holds position i. All
functions are vectorised over whole tensors; nothing here reads files.
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch

_WORD = 1 << 32


def word_bias(bits: int) -> int:
    """The word with a 1 in every b-bit field: 0x11111111 (4-bit), 0x01010101 (8-bit)."""
    return sum(1 << (bits * i) for i in range(32 // bits))


def add_word_bias(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Add 1 to every field of every int32 word, carrying across fields, modulo 2^32.

    GPTQ v1 stores z - 1 by subtracting `word_bias` from whole words; this undoes
    it exactly, including the borrow a zero point of 0 took from its neighbour.
    """
    wide = (words.to(torch.int64) + word_bias(bits)) % _WORD
    return torch.where(wide >= _WORD // 2, wide - _WORD, wide).to(torch.int32)


def _inverse(order: tuple[int, ...] | None, count: int) -> list[int]:
    """slot index for each position (argsort of `order`)."""
    if order is None:
        return list(range(count))
    if sorted(order) != list(range(count)):
        raise AssertionError(f"slot order {order} is not a permutation of 0..{count - 1}")
    inverse = [0] * count
    for slot, position in enumerate(order):
        inverse[position] = slot
    return inverse


def unpack_words(words: torch.Tensor, *, bits: int, dim: int, slot_order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unpack int32 `words` along `dim` into uint8 values (that dim grows P times).

    Works on the little-endian bytes of each word, so no int32 temporaries per value.

    | in  | words  [..., W, ...] int32  |
    | out | values [..., W*P, ...] uint8 |
    """
    assert sys.byteorder == "little", "int32 -> byte views assume a little-endian host"
    per_word = 32 // bits
    moved = _word_bytes(words.movedim(dim, -1))  # [..., W*4]
    values = unpack_bytes(moved, bits=bits, dim=-1)  # [..., W*P], slot order within each word
    if slot_order is not None:
        shape = values.shape
        slots = values.reshape(*shape[:-1], shape[-1] // per_word, per_word)
        index = torch.tensor(_inverse(slot_order, per_word), device=words.device)
        values = torch.index_select(slots, -1, index).reshape(shape)
    return values.movedim(-1, dim)


def words_as_bytes(words: torch.Tensor, *, dim: int) -> torch.Tensor:
    """Sequentially packed words along `dim` read as the fused byte packing along `dim`.

    A word packing values least-significant first holds, in its little-endian bytes,
    exactly `pack_bytes` of those values, so no unpacking is needed. This is the identity
    the loader's fast path relies on (it copies such words into an int32 view of the
    fused bytes); the tests pin it here.

    | in  | words [..., W, ...] int32   |
    | out | bytes [..., W*4, ...] uint8 |
    """
    assert sys.byteorder == "little", "int32 -> byte views assume a little-endian host"
    return _word_bytes(words.movedim(dim, -1)).movedim(-1, dim)


# (shift, mask) of the three swap stages of an 8x8 transpose of 4-bit fields held in 8 int32 words:
# 4x4 blocks (16 bits), then 2x2 blocks (8 bits), then single fields (4 bits).
_NIBBLE_STAGES = ((16, 0x0000FFFF), (8, 0x00FF00FF), (4, 0x0F0F0F0F))


def transpose_nibble_words(words: torch.Tensor, *, slot_order: tuple[int, ...] | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit words packed along N (rows K) -> words packed sequentially along K, written into `out`.

    Each block of 8 rows x 1 word is an 8x8 matrix of 4-bit fields; three masked swap
    stages on whole tensors transpose every block at once, so no value is ever unpacked.
    Output word (n, t) holds q[n, 8t .. 8t+7], least significant first: its little-endian
    bytes are the fused byte packing along K. `slot_order` as in `unpack_words`. Leading
    dims (experts) are carried along. The stages run slot-major (every op a pass over long
    contiguous rows); each slot's words then go straight to their rows of `out` in one
    transposing copy, so the slot order costs nothing and nothing else is copied.

    | in  | words [..., K, W] int32, K a multiple of 8 (a view is fine, e.g. of a file mapping; not modified) |
    | out | words [..., W*8, K/8] int32: `out` (any strides, e.g. rows of a fused qweight as words) or fresh  |
    """
    *lead, rows, width = words.shape
    if rows % 8:
        raise AssertionError(f"the nibble transpose needs a multiple of 8 rows, got {rows}")
    order = tuple(range(8)) if slot_order is None else slot_order
    _inverse(order, 8)  # checks that it is a permutation
    if out is None:
        out = torch.empty((*lead, width * 8, rows // 8), dtype=torch.int32, device=words.device)
    assert tuple(out.shape) == (*lead, width * 8, rows // 8), f"out {list(out.shape)} for words {list(words.shape)}"
    block = _nibble_blocks(words.reshape(-1, rows // 8, 8, width))
    by_position = out.view(-1, width, 8, rows // 8)  # [B, W, 8 positions, K/8]
    for slot, position in enumerate(order):  # one plain strided copy each: 1.3x tiles of 8 or 16 (measured)
        by_position[:, :, position].copy_(block[slot].transpose(1, 2))
    return out


def _nibble_blocks(source: torch.Tensor) -> torch.Tensor:
    """The three swap stages, slot-major: the first reads `source` in place (no copy), all write scratch.
    Slot s of word w of block t holds q[8t .. 8t+7, 8w + slot_order[s]] least significant first.

    | in  | source [B, K/8, 8 rows, W] int32  |
    | out | block  [8 slots, B, K/8, W] int32 (this thread's scratch: valid until its next call) |
    """
    rows_first = source.permute(2, 0, 1, 3)  # [8 rows, B, K/8, W], a view
    block = _scratch(0, rows_first.shape, source.dtype, source.device)
    half = _scratch(1, (4, *rows_first.shape[1:]), source.dtype, source.device)
    for stage, (shift, mask) in enumerate(_NIBBLE_STAGES):
        split = (2 ** stage, 2, 4 // 2 ** stage)  # rows 4, 2, 1 apart are paired
        pairs = (rows_first if stage == 0 else block).unflatten(0, split)
        swapped = block.unflatten(0, split)
        delta = half.unflatten(0, (split[0], split[2]))  # one scratch buffer for every stage
        torch.bitwise_right_shift(pairs[:, 0], shift, out=delta)
        delta.bitwise_xor_(pairs[:, 1]).bitwise_and_(mask)  # the fields that differ between the halves
        torch.bitwise_xor(pairs[:, 1], delta, out=swapped[:, 1])
        torch.bitwise_xor(pairs[:, 0], delta.bitwise_left_shift_(shift), out=swapped[:, 0])
    return block


@dataclass(frozen=True)
class NibbleWords:
    """4-bit words packed along N whose nibble transpose runs when they are written, straight into the
    destination: rows [start, start + count) of `transpose_nibble_words(words, slot_order=slot_order)`.

    | words | [..., K, W] int32 (a view of a file mapping is fine: read only while writing) |
    | shape | [..., count, K/8] int32 words (count <= W*8)                                   |
    """

    words: torch.Tensor
    slot_order: tuple[int, ...] | None
    start: int
    count: int
    dtype: ClassVar[torch.dtype] = torch.int32

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.words.shape[:-2], self.count, self.words.shape[-2] // 8)

    @property
    def device(self) -> torch.device:
        return self.words.device

    def write(self, out: torch.Tensor) -> None:
        """Place the rows in `out` [..., count, K/8] int32 (any strides): in one pass when they are all
        the words' rows, else through a fresh transposed copy."""
        if self.start == 0 and self.count == 8 * self.words.shape[-1]:
            transpose_nibble_words(self.words, slot_order=self.slot_order, out=out)
            return
        whole = transpose_nibble_words(self.words, slot_order=self.slot_order)
        out.copy_(whole.narrow(-2, self.start, self.count))


_SCRATCH = threading.local()  # per thread: host buffers reused from call to call
SCRATCH_MAX_BYTES = 16 << 20  # larger requests get fresh memory (the loader converts chunks of 2-6 MiB)


def _scratch(slot: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised host tensor for the caller's own use until its next call on this thread (slot
    `slot`; grown when too small); a fresh one on a device (its allocator caches its own) or above
    SCRATCH_MAX_BYTES. Fresh host memory costs a page fault per 4 KiB once the allocator has returned
    it to the system: measured, the nibble transpose of 2 MiB chunks ran at 0.9 GB/s with fresh
    buffers and 3.0 with reused ones."""
    count = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or count > SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buffers: dict[int, torch.Tensor] = _SCRATCH.__dict__.setdefault("buffers", {})
    if slot not in buffers or buffers[slot].numel() < count:
        buffers[slot] = torch.empty(count, dtype=torch.uint8)
    return buffers[slot][:count].view(dtype).view(shape)


def _word_bytes(words: torch.Tensor) -> torch.Tensor:
    """[..., W] int32 -> [..., W*4] uint8, the little-endian bytes of each word."""
    flat = words.to(torch.int32).reshape(-1)
    if flat.stride(0) != 1:  # size-1 dims may carry any stride, even after .contiguous()
        flat = flat.clone(memory_format=torch.contiguous_format)
    flat = flat.view(torch.uint8)
    return flat.reshape(*words.shape[:-1], words.shape[-1] * 4)


def pack_words(values: torch.Tensor, *, bits: int, dim: int, slot_order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of `unpack_words`: pack values in [0, 2^b) along `dim` into int32 words.

    A length that is not a multiple of P is zero-padded at the end.

    | in  | values [..., L, ...]       |
    | out | words  [..., ceil(L/P), ...] int32 |
    """
    per_word = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    pad = (-moved.shape[-1]) % per_word
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // per_word, per_word)
    if slot_order is not None:
        grouped = grouped[..., list(slot_order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    wide = (grouped << shifts).sum(-1)
    words = torch.where(wide >= _WORD // 2, wide - _WORD, wide).to(torch.int32)
    return words.movedim(-1, dim)


def pack_bytes(values: torch.Tensor, *, bits: int, dim: int) -> torch.Tensor:
    """The fused byte packing along `dim`: 4-bit byte j = v[2j] + 16 * v[2j+1]; 8-bit as is.

    Works in place along any dim (no transposition), so packing along the
    outer dim of a row-major tensor stays a pass over whole rows.

    | in  | values [..., L, ...] uint8    |
    | out | bytes  [..., L*b/8, ...] uint8 |
    """
    if bits == 8:
        return values.to(torch.uint8)
    dim = dim % values.ndim
    if values.shape[dim] % 2:
        raise AssertionError(f"4-bit byte packing needs an even length, got {values.shape[dim]}")
    even = [slice(None)] * values.ndim
    odd = list(even)
    even[dim], odd[dim] = slice(0, None, 2), slice(1, None, 2)
    values = values.to(torch.uint8)
    return torch.bitwise_or(values[tuple(even)], torch.bitwise_left_shift(values[tuple(odd)], 4))


def unpack_bytes(packed: torch.Tensor, *, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_bytes`.

    | in  | bytes  [..., L*b/8, ...] uint8 |
    | out | values [..., L, ...] uint8     |
    """
    if bits == 8:
        return packed
    moved = packed.movedim(dim, -1)
    low = torch.bitwise_and(moved, 0xF)
    high = torch.bitwise_right_shift(moved, 4)
    return torch.stack((low, high), dim=-1).reshape(*moved.shape[:-1], moved.shape[-1] * 2).movedim(-1, dim)
