"""Fused tensors -> an engine parameter declared by a `ParamDecl`: the maths, a run of experts at a time.

| decl.source, packing         | from the fused layer (E_c experts)             | to                                   |
|------------------------------|------------------------------------------------|--------------------------------------|
| QWEIGHT, BYTES               | bytes [E_c, N, K/P8] uint8                      | the same                             |
| QWEIGHT, K_WORDS             | bytes read as int32 words [E_c, N, K/P]         | order applied: [E_c, N, K/P] or [E_c, K/P, N] |
| QWEIGHT, N_WORDS             | values [E_c, N, K], packed along N in slot order | [E_c, K, N/P] (K-major)             |
| SCALES / WEIGHT, NONE        | [E_c, N, G_eff] (every div-th group to reach G) | [E_c, N, G] or [E_c, G, N]           |
| ZEROS, BYTES                 | bytes [E_c, N/P8, G_eff] uint8                  | the same                             |
| ZEROS, N_WORDS               | z [E_c, N, G] (2^(b-1) when symmetric), words along N minus `zero_offset` per field | [E_c, N/P, G] or [E_c, G, N/P] |
| SHAPE                        | each expert's checkpoint [N, K]                 | [E_c, 2]                             |

Group reduction: a fused layer whose G_eff is G / div (moe_wna16's halving) repeats each group `div` times;
a parameter at the checkpoint's G takes every div-th one. Anything else raises LayoutMismatchError.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import LayoutMismatchError
from ..formats.packing import pack_words, unpack_bytes, word_bias
from .spec import Order, Packing, ParamDecl, Source

EXPERT_CHUNK = 8  # experts converted at once: the conversion scratch is a few of one expert's tensors


def fill_param(param: torch.Tensor, decl: ParamDecl, fused: torch.Tensor | None, *, bits: int,
               shape_nk: tuple[int, int] = (0, 0), label: str = "") -> None:
    """Write `decl`'s values made from one half's fused tensor `fused` (None: a symmetric layer's absent
    zero points, or a SHAPE parameter) into `param` [E_l, ...], `EXPERT_CHUNK` experts at a time."""
    name = f"{label}.{decl.name}"
    for first in range(0, param.shape[0], EXPERT_CHUNK):
        rows = slice(first, min(first + EXPERT_CHUNK, param.shape[0]))
        target = param[rows]
        value = _CONVERT[(decl.source, decl.packing)](decl, None if fused is None else fused[rows], target, bits,
                                                      shape_nk, name)
        if tuple(value.shape) != tuple(target.shape):
            raise LayoutMismatchError(f"{name}: the engine's parameter holds {list(target.shape)} per "
                                      f"{target.shape[0]} experts, the rank's slice re-laid as {decl.shape} is "
                                      f"{list(value.shape)}; load it with the engine's own loader or re-shard it "
                                      f"for the engine's TP/EP sizes")
        target.copy_(value)


def _oriented(decl: ParamDecl, value: torch.Tensor) -> torch.Tensor:
    return value.transpose(1, 2) if decl.order is Order.K_MAJOR else value


def _regrouped(value: torch.Tensor, groups: int, label: str) -> torch.Tensor:
    """[E_c, X, G_eff] -> [E_c, X, groups]: every div-th group of a reduced group size."""
    have = value.shape[-1]
    if have == groups:
        return value
    if groups == 0 or have % groups:
        raise LayoutMismatchError(f"{label}: the fused layer has {have} groups, the engine's parameter {groups}; "
                                  f"{have} is not a multiple of {groups}, so no group size maps one to the other")
    return value[..., :: have // groups]


def _as_is(decl: ParamDecl, fused: torch.Tensor, target: torch.Tensor, bits: int, _nk, _name) -> torch.Tensor:
    return fused


def _k_words(decl: ParamDecl, fused: torch.Tensor, target: torch.Tensor, bits: int, _nk, _name) -> torch.Tensor:
    return _oriented(decl, fused.contiguous().view(torch.int32))


def _qweight_n_words(decl: ParamDecl, fused: torch.Tensor, target: torch.Tensor, bits: int, _nk,
                     _name) -> torch.Tensor:
    values = unpack_bytes(fused, bits=bits, dim=-1)  # [E_c, N, K]
    return _oriented(decl, pack_words(values, bits=bits, dim=1, slot_order=decl.slot_order))


def _scales(decl: ParamDecl, fused: torch.Tensor, target: torch.Tensor, bits: int, _nk, name: str) -> torch.Tensor:
    groups = target.shape[1] if decl.order is Order.K_MAJOR else target.shape[2]
    return _oriented(decl, _regrouped(fused, groups, name))


def _zero_words(decl: ParamDecl, fused: torch.Tensor | None, target: torch.Tensor, bits: int, _nk,
                name: str) -> torch.Tensor:
    per_word = 32 // bits
    k_major = decl.order is Order.K_MAJOR
    n, groups = (target.shape[2] * per_word, target.shape[1]) if k_major else (target.shape[1] * per_word,
                                                                               target.shape[2])
    if fused is None:  # symmetric: the midpoint every kernel assumes
        values = torch.full((target.shape[0], n, groups), 1 << (bits - 1), dtype=torch.uint8, device=target.device)
    else:
        values = _regrouped(unpack_bytes(fused, bits=bits, dim=1), groups, name)
    words = pack_words(values, bits=bits, dim=1, slot_order=decl.slot_order)
    if decl.zero_offset:
        wide = (words.to(torch.int64) - decl.zero_offset * word_bias(bits)) % (1 << 32)
        words = torch.where(wide >= 1 << 31, wide - (1 << 32), wide).to(torch.int32)
    return _oriented(decl, words)


def _shape(decl: ParamDecl, fused: None, target: torch.Tensor, bits: int, shape_nk: tuple[int, int],
           _name) -> torch.Tensor:
    return torch.tensor(shape_nk, dtype=target.dtype, device=target.device).expand(target.shape[0], 2)


# (decl, the fused half's rows or None, the parameter's rows, bits, the checkpoint's [N, K], the full tensor name)
Converter = Callable[[ParamDecl, torch.Tensor | None, torch.Tensor, int, tuple[int, int], str], torch.Tensor]
_CONVERT: dict[tuple[Source, Packing], Converter] = {
    (Source.QWEIGHT, Packing.BYTES): _as_is,
    (Source.QWEIGHT, Packing.K_WORDS): _k_words,
    (Source.QWEIGHT, Packing.N_WORDS): _qweight_n_words,
    (Source.SCALES, Packing.NONE): _scales,
    (Source.WEIGHT, Packing.NONE): _as_is,
    (Source.ZEROS, Packing.BYTES): _as_is,
    (Source.ZEROS, Packing.N_WORDS): _zero_words,
    (Source.SHAPE, Packing.NONE): _shape,
}
