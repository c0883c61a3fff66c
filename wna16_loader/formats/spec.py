"""Declarations shared by every format: tensor layouts and the quantization spec.

A format is data: for each role (qweight, zeros, scales, g_idx, shape) it says
which suffix names the tensor, the order of its storage dims, which logical dim
(if any) is packed into int32 words and in which slot order. Nothing here reads
files or knows about parallelism.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import ConfigError


class Role(enum.Enum):
    """What a tensor of one quantized projection holds."""

    QWEIGHT = "qweight"
    ZEROS = "zeros"
    SCALES = "scales"
    G_IDX = "g_idx"
    SHAPE = "shape"

    __hash__ = object.__hash__  # members are singletons: hash by identity, in C (hot dict keys in planning)


class Dim(enum.Enum):
    """A logical storage dimension of a projection W[N, K]."""

    N = "N"  # outputs
    K = "K"  # inputs
    GROUP = "G"  # quantization groups along K
    PAIR = "2"  # the [N, K] pair of a shape tensor


class Need(enum.Enum):
    """When a role must be present in the checkpoint."""

    ALWAYS = "always"
    ASYMMETRIC = "asymmetric"  # required when asymmetric; validated when present otherwise
    ACT_ORDER = "act_order"  # required with act-order; validated when present otherwise


INT_DTYPES = (torch.int32,)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class TensorLayout:
    """How one role is stored, e.g. GPTQ `qweight [K/P, N]` packed along K.

    `slot_order[i]` is the position, inside a word, of the value in bit slot i
    (bits b*i .. b*i+b-1); None means sequential (slot i holds position i).
    """

    role: Role
    suffix: str
    dims: tuple[Dim, ...]
    need: Need = Need.ALWAYS
    packed: Dim | None = None
    slot_order: tuple[int, ...] | None = None
    dtypes: tuple[torch.dtype, ...] = INT_DTYPES


@dataclass(frozen=True)
class ModuleFilter:
    """Which Linear modules a quantization config covers (`targets` minus `ignore`).

    A pattern `re:...` is a regular expression matched in full against the module
    name; `Linear` matches every Linear module; anything else is an exact name.
    """

    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def covers(self, module_name: str) -> bool:
        """True when `module_name` (a Linear module) is quantized by this config."""
        return _any_match(self.targets, module_name) and not _any_match(self.ignore, module_name)


def _any_match(patterns: tuple[str, ...], module_name: str) -> bool:
    for pattern in patterns:
        if pattern == "Linear" or pattern == module_name:
            return True
        if pattern.startswith("re:") and re.fullmatch(pattern[3:], module_name):
            return True
    return False


@dataclass(frozen=True)
class QuantSpec:
    """The resolved quantization of a checkpoint's routed experts."""

    format_name: str
    bits: int
    group_size: int  # -1: channelwise (one group per row)
    symmetric: bool
    act_order: bool
    layouts: tuple[TensorLayout, ...]
    zero_word_bias: bool = False  # GPTQ v1: z - 1 was subtracted from whole packed words
    checkpoint_format: str | None = None
    modules: ModuleFilter = field(default_factory=ModuleFilter)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"quantization_config: bits={self.bits} is not supported; "
                              f"WNA16 experts must be 4- or 8-bit.")
        if self.group_size != -1 and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise ConfigError(f"quantization_config: group_size={self.group_size} is not supported; use a "
                              f"power of two >= 16 or -1 (channelwise).")

    @property
    def pack_factor(self) -> int:
        """P: values per int32 word."""
        return 32 // self.bits

    @property
    def implicit_zero(self) -> int:
        """z of a symmetric scheme: 2^(bits-1)."""
        return 1 << (self.bits - 1)

    def layout(self, role: Role) -> TensorLayout | None:
        """The layout declared for `role`, if the format has one."""
        return next((lay for lay in self.layouts if lay.role is role), None)

    def layout_for_suffix(self, suffix: str) -> TensorLayout | None:
        """The layout whose tensor suffix is `suffix`."""
        return next((lay for lay in self.layouts if lay.suffix == suffix), None)

    def required(self, layout: TensorLayout) -> bool:
        """Whether `layout`'s tensor must be present for every projection."""
        if layout.need is Need.ASYMMETRIC:
            return not self.symmetric
        if layout.need is Need.ACT_ORDER:
            return self.act_order
        return True


@dataclass(frozen=True)
class FormatDecl:
    """A checkpoint format: the `quant_method` values it answers to and its parser."""

    name: str
    quant_methods: tuple[str, ...]
    parse: Callable[[dict[str, Any]], QuantSpec]
    to_config: Callable[..., dict[str, Any]]  # (bits, group_size, symmetric, act_order, **extra) -> config


def int_key(qconfig: dict[str, Any], keys: tuple[str, ...], default: int | None = None) -> int:
    """The first of `keys` present in `qconfig`, as an int (error naming the keys tried)."""
    for key in keys:
        value = qconfig.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"quantization_config: {key}={value!r} must be an integer.")
            return value
    if default is None:
        raise ConfigError(f"quantization_config: none of the keys {list(keys)} is present; "
                          f"found keys {sorted(qconfig)}.")
    return default


def bool_key(qconfig: dict[str, Any], key: str, default: bool) -> bool:
    """`qconfig[key]` as a bool, `default` when absent (error for non-bool values)."""
    value = qconfig.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"quantization_config: {key}={value!r} must be true or false.")
    return value


def str_tuple(value: Any) -> tuple[str, ...]:
    """A list of module names or patterns from a config (None -> empty)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)
