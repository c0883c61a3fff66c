"""What the padded part of a rank's fused slice holds, so that it dequantises to exactly 0.0.

A padded layout (sharding.Partition) gives every rank I_p columns of the intermediate
dim, the last `padding` of which are not in the checkpoint: rows of gate and up (w13),
columns of down (w2). Since W = (q - z) * s, they hold q = z with finite scales:

| padded part                          | q              | z         | s         | g_idx     |
|--------------------------------------|----------------|-----------|-----------|-----------|
| w13 rows                             | z_pad          | 0 (asym)  | 1.0       | unchanged |
| w2 groups of padding only            | z_pad          | 0 (asym)  | 1.0       | -         |
| w2 columns in a group with real ones | that group's z | its own   | its own   | -         |
| w2 columns, act-order                | z of group 0   | its own   | its own   | 0         |

z_pad is 0 with stored zero points and 2^(b-1) (the implicit zero) when symmetric.
Channelwise w2 has one group, which holds real columns.
Scale 1.0 (not a neighbour's) keeps padding independent of the checkpoint's values and
exact in every scale dtype; a group holding real columns keeps its checkpoint scale and
zero point, so only its padded weights are chosen.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..formats.packing import pack_bytes


class FusedSpec(Protocol):
    """What the padding fill reads of a layer's fused spec (`fused.FusedSpec` is one; kept structural so that
    this module stays below the fused writer that calls it)."""

    experts: tuple[int, ...]
    hidden: int
    part: int
    padding: int
    bits: int
    group_size: int
    act_order: bool
    has_zero_point: bool
    scale_dtype: torch.dtype
    w13_groups: int
    w2_groups: int

    @property
    def real(self) -> int: ...

    @property
    def quantized(self) -> bool: ...


def pad_value(bits: int, has_zero_point: bool) -> int:
    """The weight (and zero point) of padding in a group of padding only."""
    return 0 if has_zero_point else 1 << (bits - 1)


def pad_byte(value: int, bits: int) -> int:
    """The byte holding `value` in every one of its 8 / bits fields."""
    return sum(value << shift for shift in range(0, 8, bits))


def real_groups(spec: FusedSpec, half: str) -> int:
    """Scale groups of 'w13' or 'w2' that hold checkpoint columns (the first ones; the rest are padding)."""
    if half == "w13" or spec.act_order:
        return spec.w13_groups if half == "w13" else spec.w2_groups
    return 1 if spec.group_size == -1 else -(-spec.real // spec.group_size)


def real_rows(spec: FusedSpec, rows: tuple[str, slice, slice]) -> tuple[str, slice, slice]:
    """FusedWriter.rows of a projection narrowed to the checkpoint's rows of w13 (padding rows follow
    them); w2 is unchanged (its padding is along K)."""
    half, weight_rows, zero_rows = rows
    if half == "w2" or not spec.padding:
        return rows
    return half, slice(weight_rows.start, weight_rows.start + spec.real), \
        slice(zero_rows.start, zero_rows.start + spec.real // max(1, 8 // spec.bits))


def fill_padding(staging: dict[str, torch.Tensor], spec: FusedSpec, slots: slice,
                 rows: tuple[str, slice, slice], zeros: torch.Tensor | None) -> None:
    """Write the padding of one projection for a run of slots into `staging` (the fused tensors).

    `rows`: FusedWriter.rows of the projection ('w13' or 'w2', weight/scale rows, zero-point rows);
    `zeros`: the real zero points just written, [E_b, N_l, nG] (None when symmetric).
    """
    half, weight_rows, zero_rows = rows
    per_byte, value = 8 // spec.bits, pad_value(spec.bits, spec.has_zero_point)
    if half == "w13":
        staging["w13_scales"][slots, weight_rows.start + spec.real:weight_rows.stop].fill_(1)
        if spec.has_zero_point:
            staging["w13_qzeros"][slots, zero_rows.start + spec.real // per_byte:zero_rows.stop].fill_(0)
        staging["w13_qweight"][slots, weight_rows.start + spec.real:weight_rows.stop].fill_(pad_byte(value, spec.bits))
        return
    real = real_groups(spec, "w2")
    staging["w2_scales"][slots, :, real:].fill_(1)
    if spec.has_zero_point:
        staging["w2_qzeros"][slots, :, real:].fill_(0)
    if spec.act_order:
        staging["w2_g_idx"][slots, spec.real:].fill_(0)
    weights = padded_w2_weights(spec, slots.stop - slots.start, zeros)
    staging["w2_qweight"][slots, :, spec.real // per_byte:].copy_(pack_bytes(weights, bits=spec.bits, dim=2))


def padded_w2_weights(spec: FusedSpec, experts: int, zeros: torch.Tensor | None) -> torch.Tensor:
    """[E_b, H, padding] uint8: the zero point of the group of every padded w2 column."""
    if not spec.has_zero_point:
        return torch.full((experts, spec.hidden, spec.padding), pad_value(spec.bits, False), dtype=torch.uint8)
    assert zeros is not None, "asymmetric layout but no zero points"
    every = torch.zeros((experts, spec.hidden, spec.w2_groups), dtype=torch.uint8)
    every[:, :, :zeros.shape[2]] = zeros
    cols = torch.arange(spec.real, spec.part)
    groups = cols * 0 if spec.act_order or spec.group_size == -1 else cols // spec.group_size
    return every[:, :, groups]


def padding_bytes(spec: FusedSpec) -> int:
    """Bytes of one rank's fused layer that `fill_padding` writes: padded weight rows (w13) and columns (w2),
    their w13 scales and zero points, the scales and zero points of w2 groups of padding only, and padded
    w2_g_idx rows (act-order). 0 for an unpadded rank."""
    p, h, per_byte = spec.padding, spec.hidden, max(1, 8 // spec.bits)
    scale = torch.empty(0, dtype=spec.scale_dtype).element_size()
    if not spec.quantized:  # float weights: zeroed rows of w13 (gate, up) and columns of w2, in the stored dtype
        return len(spec.experts) * (2 * p * h + h * p) * scale
    zero = 1 if spec.has_zero_point else 0
    pad_groups = spec.w2_groups - real_groups(spec, "w2")
    w13 = 2 * p * (h // per_byte + spec.w13_groups * scale) + zero * (2 * p // per_byte) * spec.w13_groups
    w2 = h * (p // per_byte) + h * pad_groups * scale + zero * (h // per_byte) * pad_groups
    return len(spec.experts) * (w13 + w2 + (4 * p if spec.act_order else 0))
