"""Declarations shared by every format: tensor layouts and the quantization spec.

A format is data: for each role (qweight, zeros, scales, g_idx, shape) it says
which suffix names the tensor, the order of its storage dims, which logical dim
(if any) is packed into int32 words and in which slot order. Nothing here reads
files or knows about parallelism.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
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
    WEIGHT = "weight"  # the float weight of an unquantized projection

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
class QuantSpec:
    """The resolved quantization of routed experts: a checkpoint's top-level scheme, or one layer's
    (`formats.rules`); bits = UNQUANTIZED_BITS (`unquantized_spec()`) means float weights."""

    format_name: str
    bits: int
    group_size: int  # -1: channelwise (one group per row)
    symmetric: bool
    act_order: bool
    layouts: tuple[TensorLayout, ...]
    zero_word_bias: bool = False  # GPTQ v1: z - 1 was subtracted from whole packed words
    checkpoint_format: str | None = None

    def __post_init__(self) -> None:
        if self.bits == UNQUANTIZED_BITS and self.group_size == -1 and self.layouts == FLOAT_LAYOUTS:
            return
        if self.bits not in (4, 8):
            raise ConfigError(f"quantization_config: bits={self.bits} is not supported; "
                              f"WNA16 experts must be 4- or 8-bit.")
        if self.group_size != -1 and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise ConfigError(f"quantization_config: group_size={self.group_size} is not supported; use a "
                              f"power of two >= 16 or -1 (channelwise).")

    @property
    def quantized(self) -> bool:
        """False for float (unquantized) experts."""
        return self.bits != UNQUANTIZED_BITS

    @property
    def dtype_role(self) -> Role:
        """The role whose dtype the fused layer keeps: the scales, or the float weights."""
        return Role.SCALES if self.quantized else Role.WEIGHT

    def describe(self) -> str:
        """e.g. `gptq 4-bit g128 asym act-order`, or `not quantized (float weights)`."""
        if not self.quantized:
            return "not quantized (float weights)"
        return " ".join([self.format_name, f"{self.bits}-bit", group_words(self.group_size, "g"),
                         "sym" if self.symmetric else "asym"] + (["act-order"] if self.act_order else []))

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


def group_words(group_size: int, unit: str = "group ") -> str:
    """A group size in words: `channelwise` for -1, else `unit` and the size (`group 128`, `g128`, `128`)."""
    return "channelwise" if group_size == -1 else f"{unit}{group_size}"


UNQUANTIZED_BITS = 16
FLOAT_LAYOUTS = (  # `experts.E.gate_proj.weight [N, K]`, or transformers' stacked `experts.gate_up_proj [E, N, K]`
    TensorLayout(Role.WEIGHT, "weight", (Dim.N, Dim.K), dtypes=FLOAT_DTYPES),
    TensorLayout(Role.WEIGHT, "", (Dim.N, Dim.K), dtypes=FLOAT_DTYPES),
)


def unquantized_spec() -> QuantSpec:
    """The spec of float (unquantized) experts: weights [N, K] in their stored dtype."""
    return QuantSpec(format_name="unquantized", bits=UNQUANTIZED_BITS, group_size=-1, symmetric=True,
                     act_order=False, layouts=FLOAT_LAYOUTS)


@dataclass(frozen=True)
class FormatDecl:
    """A checkpoint format: the `quant_method` values it answers to, its parser, and its per-module rules
    (`rules(qconfig, base)`: how its quantizer gives each module its own spec; see rules.py)."""

    name: str
    quant_methods: tuple[str, ...]
    parse: Callable[[dict[str, Any]], QuantSpec]
    to_config: Callable[..., dict[str, Any]]  # (bits, group_size, symmetric, act_order, **extra) -> config
    rules: Callable[[dict[str, Any], QuantSpec], Any]  # -> rules.ModuleRules (declared above this module)


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
