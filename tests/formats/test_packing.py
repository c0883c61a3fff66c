"""Bit-level packing: hand-written words for every format's bit order, and round-trip properties.

The expected words below are written by hand (hex literals), never produced by pack_words, so a
symmetric mistake in pack_words and unpack_words cannot hide.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wna16_loader.formats.awq import AWQ_ORDER
from wna16_loader.formats.packing import (
    NibbleWords,
    add_word_bias,
    pack_bytes,
    pack_words,
    transpose_nibble_words,
    unpack_bytes,
    unpack_words,
    word_bias,
    words_as_bytes,
)

WORD = 1 << 32


def i32(*words: int) -> torch.Tensor:
    """int32 tensor from unsigned 32-bit literals (high bit set -> negative int32)."""
    return torch.tensor([w - WORD if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def u8(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


# ---------------------------------------------------------------- word_bias


def test_word_bias_literals() -> None:
    assert word_bias(4) == 0x11111111
    assert word_bias(8) == 0x01010101


# ---------------------------------------------------------------- AWQ order


def test_awq_order_constant() -> None:
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)


def test_awq_slot_i_holds_value_i() -> None:
    # nibble slot i (bits 4i..4i+3) holds the value i; slot i is column ORDER[i]
    out = unpack_words(i32(0x76543210), bits=4, dim=0, slot_order=AWQ_ORDER)
    assert out.dtype == torch.uint8
    assert out.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_awq_columns_0_to_7_word() -> None:
    # columns 0..7 holding values 0..7 are stored with slot i = value ORDER[i]: slots 0,2,4,6,1,3,5,7
    out = unpack_words(i32(0x75316420), bits=4, dim=0, slot_order=AWQ_ORDER)
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_awq_qweight_packed_along_n_2d() -> None:
    # qweight [K=2, N/8=2]; packed along N (dim 1)
    words = torch.stack([i32(0x75316420, 0xFDB9ECA8), i32(0x00000000, 0x11111111)])
    out = unpack_words(words, bits=4, dim=1, slot_order=AWQ_ORDER)
    assert out.shape == (2, 16)
    assert out[0].tolist() == list(range(16))
    assert out[1].tolist() == [0] * 8 + [1] * 8


def test_awq_order_is_not_sequential() -> None:
    assert unpack_words(i32(0x76543210), bits=4, dim=0).tolist() != unpack_words(
        i32(0x76543210), bits=4, dim=0, slot_order=AWQ_ORDER).tolist()


# ---------------------------------------------------------------- GPTQ sequential


def test_gptq_sequential_4_bit() -> None:
    assert unpack_words(i32(0x76543210), bits=4, dim=0).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert unpack_words(i32(0xFEDCBA98), bits=4, dim=0).tolist() == [8, 9, 10, 11, 12, 13, 14, 15]


def test_gptq_sequential_8_bit() -> None:
    assert unpack_words(i32(0x04030201), bits=8, dim=0).tolist() == [1, 2, 3, 4]
    assert unpack_words(i32(0xFF807F00), bits=8, dim=0).tolist() == [0, 127, 128, 255]


def test_gptq_qweight_packed_along_k() -> None:
    # qweight [K/8=2, N=2]: packed along K (dim 0); word row w of column n holds rows 8w..8w+7 of column n
    words = i32(0x76543210, 0xFEDCBA98, 0x11111111, 0x00000000).reshape(2, 2)
    out = unpack_words(words, bits=4, dim=0)
    assert out.shape == (16, 2)
    assert out[:, 0].tolist() == list(range(8)) + [1] * 8
    assert out[:, 1].tolist() == list(range(8, 16)) + [0] * 8


def test_negative_int32_words() -> None:
    # high bit set: int32 value is negative, but every field must come out unsigned
    w = i32(0x80000000, 0xFFFFFFFF, 0xF0000001)
    assert w.tolist() == [-(1 << 31), -1, -0x0FFFFFFF]
    assert unpack_words(w, bits=4, dim=0).tolist() == [0] * 7 + [8] + [15] * 8 + [1] + [0] * 6 + [15]
    assert unpack_words(i32(0xFFFFFFFF), bits=8, dim=0).tolist() == [255, 255, 255, 255]
    assert unpack_words(i32(0x80000000), bits=8, dim=0).tolist() == [0, 0, 0, 128]


def test_pack_words_literals() -> None:
    # pack_words checked against hand-written words (not against unpack_words)
    assert pack_words(u8(*range(8)), bits=4, dim=0).tolist() == i32(0x76543210).tolist()
    assert pack_words(u8(1, 2, 3, 4), bits=8, dim=0).tolist() == i32(0x04030201).tolist()
    assert pack_words(u8(*range(8)), bits=4, dim=0, slot_order=AWQ_ORDER).tolist() == i32(0x75316420).tolist()
    assert pack_words(u8(*[15] * 8), bits=4, dim=0).tolist() == [-1]
    assert pack_words(u8(0, 0, 0, 128), bits=8, dim=0).tolist() == [-(1 << 31)]


def test_pack_words_pads_to_whole_words() -> None:
    out = pack_words(u8(1, 2, 3), bits=4, dim=0)
    assert out.tolist() == i32(0x00000321).tolist()


def test_single_word_along_packed_dim_with_row_major_storage() -> None:
    """A GPTQ qweight read of one word row, [1, N] row-major as read from safetensors (e.g. down_proj with
    K/tp = 8, channelwise): the packed dim has length 1, so movedim(0, -1) gives a [N, 1] view whose last
    stride is N and which torch already calls contiguous."""
    words = torch.tensor([[0x76543210, 0x01234567]], dtype=torch.int32)  # [K/8 = 1, N = 2], strides (2, 1)
    out = unpack_words(words, bits=4, dim=0)
    assert out.shape == (8, 2)
    assert out[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert out[:, 1].tolist() == [7, 6, 5, 4, 3, 2, 1, 0]


def test_single_word_sliced_from_a_wider_tensor() -> None:
    """One word that is a view into a wider tensor ([1, 1] with strides (1, 4) after movedim): torch calls it
    contiguous, and even reshape(-1) keeps stride 4, so an int32 -> uint8 view of it fails."""
    wide = i32(0x76543210, 0x11111111, 0x22222222, 0x33333333).reshape(1, 4)
    one = wide[:, :1]  # [K/8 = 1, N = 1] as a slice of [1, 4]
    assert unpack_words(one, bits=4, dim=0).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert words_as_bytes(one, dim=0).flatten().tolist() == [0x10, 0x32, 0x54, 0x76]


def test_words_as_bytes_literals() -> None:
    # sequential 4-bit words are, byte for byte, the fused packing: byte j = v[2j] + 16 * v[2j+1]
    assert words_as_bytes(i32(0x76543210), dim=0).tolist() == [0x10, 0x32, 0x54, 0x76]
    assert words_as_bytes(i32(0xFEDCBA98), dim=0).tolist() == [0x98, 0xBA, 0xDC, 0xFE]
    words = i32(0x76543210, 0x04030201).reshape(2, 1)  # [N=2, K/8=1] packed along K (dim 1)
    assert words_as_bytes(words, dim=1).tolist() == [[0x10, 0x32, 0x54, 0x76], [0x01, 0x02, 0x03, 0x04]]


def test_words_as_bytes_single_word_along_packed_dim() -> None:
    words = i32(0x76543210, 0x04030201).reshape(1, 2)  # [K/8 = 1, N = 2] packed along K (dim 0)
    assert words_as_bytes(words, dim=0).tolist() == [[0x10, 0x01], [0x32, 0x02], [0x54, 0x03], [0x76, 0x04]]


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 4), dim=st.sampled_from([0, 1]), seed=st.integers(0, 2**31 - 1))
def test_words_as_bytes_equals_pack_bytes_of_unpacked(rows: int, cols: int, dim: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (rows, cols), generator=gen, dtype=torch.int64).to(torch.int32)
    expected = pack_bytes(unpack_words(words, bits=4, dim=dim), bits=4, dim=dim)
    assert torch.equal(words_as_bytes(words, dim=dim), expected)


# ---------------------------------------------------------------- GPTQ v1 zero-point word bias


def test_gptq_v1_borrow_4_bit_minimal() -> None:
    # true zeros z = [0, 1, 0, 0, 0, 0, 0, 0]: word(z) = 0x00000010
    # v1 stores (0x00000010 - 0x11111111) mod 2^32 = 0xEEEEEEFF
    stored = i32(0xEEEEEEFF)
    per_field = ((unpack_words(stored, bits=4, dim=0).int() + 1) % 16).tolist()
    assert per_field == [0, 0, 15, 15, 15, 15, 15, 15]  # wrong: the borrow is decoded as data
    fixed = add_word_bias(stored, 4)
    assert fixed.tolist() == [0x00000010]
    assert unpack_words(fixed, bits=4, dim=0).tolist() == [0, 1, 0, 0, 0, 0, 0, 0]


def test_gptq_v1_borrow_4_bit_zero_and_fifteen() -> None:
    # true zeros z = [0, 5, 0, 15, 3, 0, 7, 1]: word(z) = 0x1703F050
    # stored = 0x1703F050 - 0x11111111 = 0x05F2DF3F
    stored = i32(0x05F2DF3F)
    per_field = ((unpack_words(stored, bits=4, dim=0).int() + 1) % 16).tolist()
    assert per_field == [0, 4, 0, 14, 3, 0, 6, 1]  # off by one after each zero point of 0
    fixed = add_word_bias(stored, 4)
    assert fixed.tolist() == [0x1703F050]
    assert unpack_words(fixed, bits=4, dim=0).tolist() == [0, 5, 0, 15, 3, 0, 7, 1]


def test_gptq_v1_all_zero_points_zero_wraps() -> None:
    # z = 0 everywhere: stored = -0x11111111 mod 2^32 = 0xEEEEEEEF (negative int32)
    stored = i32(0xEEEEEEEF)
    assert stored.item() < 0
    assert add_word_bias(stored, 4).tolist() == [0]


def test_gptq_v1_top_field_carry_out_is_dropped() -> None:
    # z = [15]*8: stored = 0xFFFFFFFF - 0x11111111 = 0xEEEEEEEE; adding back must not overflow int32
    fixed = add_word_bias(i32(0xEEEEEEEE), 4)
    assert fixed.dtype == torch.int32
    assert fixed.tolist() == [-1]
    assert unpack_words(fixed, bits=4, dim=0).tolist() == [15] * 8


def test_gptq_v1_borrow_8_bit() -> None:
    # true zeros z = [0, 200, 0, 255]: word(z) = 0xFF00C800
    # stored = 0xFF00C800 - 0x01010101 = 0xFDFFC6FF (negative int32)
    stored = i32(0xFDFFC6FF)
    assert stored.item() < 0
    per_field = ((unpack_words(stored, bits=8, dim=0).int() + 1) % 256).tolist()
    assert per_field == [0, 199, 0, 254]  # wrong
    fixed = add_word_bias(stored, 8)
    assert fixed.tolist() == i32(0xFF00C800).tolist()
    assert unpack_words(fixed, bits=8, dim=0).tolist() == [0, 200, 0, 255]


def test_gptq_v1_8_bit_bias_word() -> None:
    # z = [1, 1, 1, 1] is stored as 0: adding 0x01010101 gives it back
    assert add_word_bias(i32(0x00000000), 8).tolist() == [0x01010101]


def test_add_word_bias_keeps_shape() -> None:
    words = i32(0xEEEEEEFF, 0x05F2DF3F, 0xEEEEEEEF, 0x00000000, 0x7FFFFFFF, 0x80000000).reshape(2, 3)
    out = add_word_bias(words, 4)
    assert out.shape == (2, 3) and out.dtype == torch.int32
    assert out.flatten().tolist() == i32(0x00000010, 0x1703F050, 0x00000000, 0x11111111, 0x91111110,
                                         0x91111111).tolist()


# ---------------------------------------------------------------- fused byte packing


def test_pack_bytes_4_bit_literals() -> None:
    # byte j = v[2j] + 16 * v[2j+1]
    assert pack_bytes(u8(1, 2, 3, 4, 15, 0, 0, 15), bits=4, dim=0).tolist() == [0x21, 0x43, 0x0F, 0xF0]


def test_pack_bytes_4_bit_along_dim_1() -> None:
    values = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.uint8)
    assert pack_bytes(values, bits=4, dim=1).tolist() == [[0x21, 0x43], [0x65, 0x87]]
    assert pack_bytes(values, bits=4, dim=0).tolist() == [[0x51, 0x62, 0x73, 0x84]]


def test_pack_bytes_8_bit_is_identity() -> None:
    values = u8(0, 127, 128, 255)
    out = pack_bytes(values, bits=8, dim=0)
    assert out.dtype == torch.uint8 and out.tolist() == [0, 127, 128, 255]


def test_unpack_bytes_literals() -> None:
    assert unpack_bytes(u8(0x21, 0x43, 0xF0), bits=4, dim=0).tolist() == [1, 2, 3, 4, 0, 15]


def test_pack_bytes_odd_length() -> None:
    with pytest.raises(AssertionError, match=r"4-bit byte packing needs an even length, got 3"):
        pack_bytes(u8(1, 2, 3), bits=4, dim=0)


# ---------------------------------------------------------------- compressed-tensors offset


def test_ct_4_bit_signed_values_stored_with_offset_8() -> None:
    # signed q = [-8, -1, 0, 7, 1, 2, -3, 3] stored as q + 8 = [0, 7, 8, 15, 9, 10, 5, 11], sequential
    stored = unpack_words(i32(0xB5A9F870), bits=4, dim=0)
    assert stored.tolist() == [0, 7, 8, 15, 9, 10, 5, 11]
    assert (stored.int() - 8).tolist() == [-8, -1, 0, 7, 1, 2, -3, 3]


def test_ct_8_bit_signed_values_stored_with_offset_128() -> None:
    stored = unpack_words(i32(0xFF807F00), bits=8, dim=0)
    assert (stored.int() - 128).tolist() == [-128, -1, 0, 127]


def test_ct_weight_packed_along_k() -> None:
    # weight_packed [N=2, K/8=1]: packed along K (dim 1)
    words = i32(0xB5A9F870, 0x88888888).reshape(2, 1)
    stored = unpack_words(words, bits=4, dim=1)
    assert stored.shape == (2, 8)
    assert (stored.int() - 8).tolist() == [[-8, -1, 0, 7, 1, 2, -3, 3], [0] * 8]


# ---------------------------------------------------------------- nibble transpose (N-packed -> K-packed words)


def dense(words: torch.Tensor) -> torch.Tensor:
    """A row-major copy of `words` (size-1 dims of a transposed view may carry any stride)."""
    return words.clone(memory_format=torch.contiguous_format)


def test_transpose_nibbles_rows_become_fields() -> None:
    # q[k, n] = k: input row k is 0xkkkkkkkk; every output row n holds q[n, 0..7] = 0..7
    words = i32(*(0x11111111 * k for k in range(8))).reshape(8, 1)
    out = transpose_nibble_words(words)
    assert out.shape == (8, 1)
    assert dense(out).reshape(-1).tolist() == i32(*[0x76543210] * 8).tolist()


def test_transpose_nibbles_fields_become_rows() -> None:
    # q[k, n] = n: every input row is 0x76543210; output row n is 0xnnnnnnnn
    out = transpose_nibble_words(i32(*[0x76543210] * 8).reshape(8, 1))
    assert dense(out).reshape(-1).tolist() == i32(*(0x11111111 * n for n in range(8))).tolist()


def test_transpose_nibbles_awq_order() -> None:
    # AWQ stores columns 0..7 holding 0..7 as 0x75316420; output row n holds q[n, k] = n for every k
    out = transpose_nibble_words(i32(*[0x75316420] * 8).reshape(8, 1), slot_order=AWQ_ORDER)
    assert dense(out).reshape(-1).tolist() == i32(*(0x11111111 * n for n in range(8))).tolist()


def test_transpose_nibbles_two_blocks_and_words() -> None:
    # K = 16 (two output words per row), W = 2 (16 output rows); q[k, n] = (k + n) % 16
    q = (torch.arange(16).unsqueeze(1) + torch.arange(16).unsqueeze(0)) % 16
    words = pack_words(q, bits=4, dim=1)
    out = dense(transpose_nibble_words(words))
    row = lambda n: [sum(((8 * t + i + n) % 16) << (4 * i) for i in range(8)) for t in range(2)]  # noqa: E731
    assert out.tolist() == [i32(*row(n)).tolist() for n in range(16)]


def test_transpose_nibbles_needs_whole_blocks() -> None:
    with pytest.raises(AssertionError, match="multiple of 8 rows, got 12"):
        transpose_nibble_words(torch.zeros(12, 1, dtype=torch.int32))


@settings(max_examples=80, deadline=None)
@given(blocks=st.integers(1, 4), width=st.integers(1, 5), lead=st.integers(0, 2), extra=st.integers(0, 2),
       order=st.one_of(st.none(), st.permutations(range(8)).map(tuple)), seed=st.integers(0, 2**31 - 1))
def test_transpose_nibbles_equals_unpack_then_pack_along_k(blocks: int, width: int, lead: int, extra: int,
                                                           order: tuple[int, ...] | None, seed: int) -> None:
    shape = [2] * lead + [8 * blocks, 8 * (width + extra)]
    q = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    stored = pack_words(q, bits=4, dim=-1, slot_order=order)
    words = stored.narrow(-1, extra, width)  # a column slice, as a rank reads it from a file
    before = words.clone()
    out = transpose_nibble_words(words, slot_order=order)
    assert out.shape == (*shape[:-2], 8 * width, blocks)
    expected = pack_bytes(q.narrow(-1, 8 * extra, 8 * width).transpose(-1, -2), bits=4, dim=-1)
    assert torch.equal(dense(out).view(torch.uint8), expected)
    assert torch.equal(words, before)


def test_transpose_nibbles_into_out_rows_of_a_larger_tensor() -> None:
    """`out` a strided view (rows of some slots of a wider int32 tensor): the same words as a fresh
    result, written there and nowhere else, and `out` returned."""
    gen = torch.Generator().manual_seed(11)
    words = torch.randint(-2**31, 2**31 - 1, (2, 24, 5), generator=gen, dtype=torch.int32)
    base = torch.full((4, 50, 6), 7, dtype=torch.int32)
    out = base[1:3, 4:44, 1:4]  # [2, W*8 = 40, K/8 = 3], rows 6 words apart
    assert transpose_nibble_words(words, slot_order=AWQ_ORDER, out=out) is out
    assert torch.equal(out, transpose_nibble_words(words, slot_order=AWQ_ORDER))
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[1:3, 4:44, 1:4] = False
    assert bool((base[untouched] == 7).all())


def test_transpose_nibbles_out_of_another_shape_is_refused() -> None:
    with pytest.raises(AssertionError, match=r"out \[2, 8, 2\] for words \[2, 16, 2\]"):
        transpose_nibble_words(torch.zeros(2, 16, 2, dtype=torch.int32), out=torch.zeros(2, 8, 2, dtype=torch.int32))


def test_nibble_words_shape_and_rows() -> None:
    """NibbleWords stand for rows [start, start + count) of the transpose: their shape, dtype and bytes."""
    q = torch.arange(16 * 24).reshape(16, 24) % 16  # [K 16, N 24]
    words = pack_words(q, bits=4, dim=1, slot_order=AWQ_ORDER)[None]  # [1, K, N/8]
    lazy = NibbleWords(words, AWQ_ORDER, 5, 11)
    assert lazy.shape == (1, 11, 2) and lazy.dtype == torch.int32 and lazy.device == words.device
    out = torch.zeros(lazy.shape, dtype=torch.int32)
    lazy.write(out)
    assert torch.equal(out.view(torch.uint8)[0], pack_bytes(q[:, 5:16].t(), bits=4, dim=1))


# ---------------------------------------------------------------- properties


@st.composite
def packed_case(draw):
    bits = draw(st.sampled_from([4, 8]))
    per_word = 32 // bits
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    shape[dim] = per_word * draw(st.integers(1, 4))
    order = draw(st.one_of(st.none(), st.permutations(range(per_word)).map(tuple)))
    seed = draw(st.integers(0, 2**31 - 1))
    values = torch.randint(0, 1 << bits, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    return bits, dim, order, values.to(torch.uint8)


@settings(max_examples=150, deadline=None)
@given(packed_case())
def test_unpack_inverts_pack(case) -> None:
    bits, dim, order, values = case
    words = pack_words(values, bits=bits, dim=dim, slot_order=order)
    assert words.dtype == torch.int32
    assert words.shape[dim] == values.shape[dim] * bits // 32
    # as read from a file: a fresh row-major tensor, and a slice of a wider one (storage strides)
    fresh = torch.tensor(words.tolist(), dtype=torch.int32)
    wider = torch.cat([fresh, fresh], dim=-1).narrow(-1, 0, fresh.shape[-1])
    for w in (words, fresh, wider):
        out = unpack_words(w, bits=bits, dim=dim, slot_order=order)
        assert out.dtype == torch.uint8
        assert torch.equal(out, values)


@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from([4, 8]), words=st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=1, max_size=16),
       order=st.data())
def test_pack_inverts_unpack(bits: int, words: list[int], order) -> None:
    per_word = 32 // bits
    slot_order = order.draw(st.one_of(st.none(), st.permutations(range(per_word)).map(tuple)))
    w = torch.tensor(words, dtype=torch.int32)
    assert torch.equal(pack_words(unpack_words(w, bits=bits, dim=0, slot_order=slot_order), bits=bits, dim=0,
                                  slot_order=slot_order), w)


@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 4), pairs=st.integers(1, 8), dim=st.sampled_from([0, 1, -1]),
       seed=st.integers(0, 2**31 - 1))
def test_unpack_bytes_inverts_pack_bytes(bits: int, rows: int, pairs: int, dim: int, seed: int) -> None:
    shape = [rows, rows + 1]
    shape[dim] = 2 * pairs
    values = torch.randint(0, 1 << bits, shape, generator=torch.Generator().manual_seed(seed)).to(torch.uint8)
    packed = pack_bytes(values, bits=bits, dim=dim)
    assert packed.dtype == torch.uint8
    assert packed.shape[dim] == values.shape[dim] * bits // 8
    assert torch.equal(unpack_bytes(packed, bits=bits, dim=dim), values)


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from([4, 8]), words=st.lists(st.integers(0, WORD - 1), min_size=1, max_size=16))
def test_add_word_bias_inverts_subtracting_word_bias(bits: int, words: list[int]) -> None:
    stored = i32(*[(w - word_bias(bits)) % WORD for w in words])
    assert add_word_bias(stored, bits).tolist() == i32(*words).tolist()


@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from([4, 8]), data=st.data())
def test_gptq_v1_zero_points_round_trip(bits: int, data) -> None:
    # any true zero points, stored the v1 way (whole word minus word_bias), decode exactly
    per_word = 32 // bits
    z = data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=per_word, max_size=per_word * 3)
                  .filter(lambda v: len(v) % per_word == 0))
    true_words = [sum(v << (bits * i) for i, v in enumerate(z[j:j + per_word])) for j in range(0, len(z), per_word)]
    stored = i32(*[(w - word_bias(bits)) % WORD for w in true_words])
    assert unpack_words(add_word_bias(stored, bits), bits=bits, dim=0).tolist() == z
