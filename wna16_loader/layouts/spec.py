"""Engine layouts as data: how one MoE method of an inference engine holds a layer's expert parameters,
declared against this package's fused layout (load/fused.py: N-major rows, K packed low value first, scales
[E, N, K/G], zero points packed along N).

A `MethodLayout` is one row per engine MoE method; each of its `ParamDecl`s names one engine parameter,
the fused tensor it is made from, its logical shape, and how its values are laid out:

| field       | meaning                                                                              |
|-------------|--------------------------------------------------------------------------------------|
| `shape`     | logical dims, e.g. ("E", "K/P", "2*I_p"): symbols of `Sizes`, `*` and `/` (exact)    |
| `order`     | N_MAJOR: the fused orientation [E, N, X]; K_MAJOR: the last two dims swapped [E, X, N] |
| `packing`   | BYTES: the fused bytes as they are; K_WORDS: int32 words packed along K (the fused bytes read as words); N_WORDS: int32 words packed along N in `slot_order`; NONE: unpacked values |
| `zero_offset` | what a zero-point word stores: z - offset in every field, subtracted from whole words (GPTQ v1: 1) |
| `need`      | when the parameter is filled: always, with zero points (asymmetric) or always, filling a symmetric layer's midpoint |
| `storage`   | (derived) one expert's dims, packed dim, slot order and zero offset as a `WordLayout`: equal to a checkpoint role's `WordLayout.of`, the parameter holds that checkpoint's own words |
| `tp_dim`    | (derived from `half` and `order`) the dim the TP cut splits, the one holding I_p: w13's N, w2's K; None for SHAPE (whole on every rank); the EP cut splits dim 0 (E) |
| `allocated` | where the engine allocates more than the rank's values (`shape`): its shape; the values fill its head, the rest is zeros (None: `shape`) |

Nothing here branches on a method's name: the loader fills any row through `relayout.fill_param`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace

import torch

from ..errors import LayoutMismatchError
from ..formats.spec import Dim, QuantSpec, Role, TensorLayout
from ..models.names import Proj


class Half(enum.Enum):
    """Which fused half a parameter comes from: w13 (gate ‖ up, N = 2·I_p) or w2 (down, N = H)."""

    W13 = "w13"
    W2 = "w2"

    @classmethod
    def of(cls, proj: Proj) -> "Half":
        """The half a projection's rows belong to: w2 for down, w13 for gate and up."""
        return cls.W2 if proj is Proj.DOWN else cls.W13


class Source(enum.Enum):
    """The fused tensor (of one half) a parameter holds."""

    QWEIGHT = "qweight"
    SCALES = "scales"
    ZEROS = "qzeros"
    WEIGHT = "weight"  # float experts
    SHAPE = "shape"  # each expert's checkpoint [N, K] (compressed-tensors' weight_shape)


class Order(enum.Enum):
    N_MAJOR = "N-major"  # [E, N, X], as fused
    K_MAJOR = "K-major"  # [E, X, N]: the checkpoint's own GPTQ/AWQ orientation stacked over experts


class Packing(enum.Enum):
    NONE = "none"  # values as they are (scales, float weights, shapes)
    BYTES = "bytes"  # the fused uint8 packing (4-bit: byte j = v[2j] | v[2j+1] << 4)
    K_WORDS = "K words"  # int32 words along K, value i in bits 4i.. (the fused bytes read as little-endian words)
    N_WORDS = "N words"  # int32 words along N, in the declaration's slot order


class Need(enum.Enum):
    ALWAYS = "always"
    ZERO_POINTS = "asymmetric"  # only layers with zero points have the parameter filled
    ZERO_POINTS_ALWAYS = "always, midpoint when symmetric"  # symmetric layers get z = 2^(b-1) everywhere


@dataclass(frozen=True)
class ParamDecl:
    """One engine parameter of a MoE layer (see the module table)."""

    name: str
    half: Half
    source: Source
    shape: tuple[str, ...]
    dtype: torch.dtype | None  # None: the layer's scale (or float weight) dtype
    order: Order = Order.N_MAJOR
    packing: Packing = Packing.NONE
    slot_order: tuple[int, ...] | None = None
    zero_offset: int = 0
    need: Need = Need.ALWAYS
    allocated: tuple[str, ...] | None = None

    @property
    def tp_dim(self) -> int | None:
        """The dim the TP cut splits: w13's N (dim 1 N-major, 2 K-major), w2's K (2 N-major, 1 K-major); None for a
        SHAPE parameter, whole on every rank. Derived, so that no row can declare a cut its order contradicts."""
        if self.source is Source.SHAPE:
            return None
        return 1 if (self.half is Half.W13) == (self.order is Order.N_MAJOR) else 2

    ep_dim = property(lambda self: 0, doc="The dim the EP cut splits: E, the first of every parameter.")

    @property
    def storage(self) -> "WordLayout | None":
        """How one expert's values lie in the parameter, comparable with a checkpoint role's `WordLayout.of`;
        None where no checkpoint stores them so (the fused bytes, a SHAPE record)."""
        if self.packing is Packing.BYTES or self.source is Source.SHAPE:
            return None
        dims = (Dim.N, Dim.K if self.source in (Source.QWEIGHT, Source.WEIGHT) else Dim.GROUP)
        packed = {Packing.K_WORDS: Dim.K, Packing.N_WORDS: Dim.N}.get(self.packing)
        return WordLayout(ROLES[self.source], dims[::-1] if self.order is Order.K_MAJOR else dims, packed,
                          self.slot_order if packed is not None else None, self.zero_offset)


ROLES = {Source.QWEIGHT: Role.QWEIGHT, Source.SCALES: Role.SCALES, Source.ZEROS: Role.ZEROS,
         Source.WEIGHT: Role.WEIGHT}  # the checkpoint role a parameter's values come from


@dataclass(frozen=True)
class WordLayout:
    """The storage of one expert's tensor of one role: its dims in order, the dim packed into int32 words
    (None: values), the slot order of a word (None: sequential) and the `zero_offset` subtracted from every
    field of a zero-point word. A parameter whose `ParamDecl.storage` equals the checkpoint role's holds the
    checkpoint's own words (`load.direct` copies them)."""

    role: Role
    dims: tuple[Dim, ...]
    packed: Dim | None
    slot_order: tuple[int, ...] | None
    zero_offset: int

    @classmethod
    def of(cls, layout: TensorLayout, spec: QuantSpec) -> "WordLayout":
        """A checkpoint role's storage under `spec` (GPTQ v1's zero points: offset 1, `zero_word_bias`)."""
        offset = int(spec.zero_word_bias and layout.role is Role.ZEROS)
        order = layout.slot_order if layout.packed is not None else None
        return cls(layout.role, layout.dims, layout.packed, order, offset)


@dataclass(frozen=True)
class MethodLayout:
    """The parameters one engine MoE method holds for a layer; `quantized` False: float experts.
    `fused_as_is`: every parameter is a fused tensor as it is, so a `--layout fused` output (and the
    loader's own writer) fills it with no conversion."""

    name: str
    engines: tuple[str, ...]  # the engines whose method holds its parameters so (one row where they agree)
    params: tuple[ParamDecl, ...]
    quantized: bool = True
    notes: str = ""
    reduced_groups: bool = False  # holds a layer whose G_eff is below the checkpoint's G (moe_wna16's halving)
    padded: bool = False  # holds an I_p with padding columns (an I that TP does not divide)
    asymmetric: bool = True  # holds layers with zero points (the engine builds the method for them)
    act_order: bool = True  # holds a layer whose g_idx orders its groups (False: the row has no place for g_idx)
    min_group: int = 0  # the smallest G_eff the engine builds it with (moe_wna16: `assert group_size >= 32`)

    @property
    def fused_as_is(self) -> bool:
        return all(p.order is Order.N_MAJOR and p.packing in (Packing.BYTES, Packing.NONE)
                   and p.source is not Source.SHAPE for p in self.params)

    @property
    def partial_groups(self) -> bool:
        """Whether the row holds a layer whose G leaves a last, partial group along H or I_p (G = G_eff not
        dividing them): every parameter is sized by the fused layer's group counts (GH_eff, GI_eff: the
        checkpoint's ceil), none by the engine's K // G (GH, GI), as shapes evaluated under both say."""
        floor = Sizes(E=1, N13=64, H=64, I=64, I_p=64, bits=4, GH=1, GI=1, GH_eff=2, GI_eff=2, GI_all=1)
        ceil = replace(floor, GH=floor.GH_eff, GI=floor.GI_eff, GI_all=2)
        return all(allocated_shape(p, floor) == allocated_shape(p, ceil) for p in self.params)

    def refusal(self, *, quantized: bool, padded: bool, reduced: bool, asymmetric: bool, partial: bool,
                group_eff: int, act_order: bool = False) -> str | None:
        """Why this row cannot hold a fused layer of this kind (None: it can); `partial`: G leaves a last,
        partial group along H or I_p (`leaves_partial_group`); `act_order`: the layer's g_idx orders its groups."""
        if self.quantized != quantized:
            return f"{self.name} holds {'quantized' if self.quantized else 'float'} experts, the layer's are not"
        why = (["padding columns (an I that TP does not split evenly)"] * (padded and not self.padded)
               + ["a G_eff below the checkpoint's G"] * (reduced and not self.reduced_groups)
               + ["zero points"] * (asymmetric and not self.asymmetric)
               + ["a partial last group"] * (partial and not self.partial_groups)
               + ["act-order (g_idx)"] * (act_order and not self.act_order)
               + [f"G_eff {group_eff} (it needs G >= {self.min_group})"] * (0 < group_eff < self.min_group))
        return f"{self.name} does not hold {' or '.join(why)}" if why else None

    def filled(self, has_zero_point: bool) -> tuple[ParamDecl, ...]:
        """The parameters filled for a layer with or without zero points."""
        return tuple(p for p in self.params if p.need is not Need.ZERO_POINTS or has_zero_point)


def leaves_partial_group(group_size: int, group_eff: int, *dims: int) -> bool:
    """Whether a layer written at `group_eff` from a checkpoint of group size `group_size` holds a last, partial
    group along one of `dims` (H, I_p): G_eff = G (not channelwise, not reduced) and G does not divide it. Only
    rows with `MethodLayout.partial_groups` hold such a layer (`--plan`'s column and the in-place fill ask this
    one question)."""
    return group_eff == group_size > 0 and any(d % group_size for d in dims)


def allocated_groups(k: int, group_size: int) -> int:
    """Groups along an input dim of `k` columns as vLLM's MoE methods allocate their scales and zero points:
    k // G, floor (1 channelwise, G = -1); e.g. gptq_marlin's create_weights, `scales_size13 = hidden_size //
    group_size`, `scales_size2 = intermediate_size_per_partition // group_size`.

    Deliberately not the checkpoint's count, `load.params.checkpoint_groups`: a checkpoint stores ceil(k / G)
    groups (its last, partial group has a scale of its own). The two agree whenever G divides k (and
    channelwise); the package accepts a k that G does not divide (H, or I_p at TP 1 or with act-order, need only
    be whole bytes), and there an engine parameter of this size is short of the checkpoint's groups. A fill
    into such a row is refused, naming both counts (`load.inplace.check_target`; H 80, G 32: 3 and 2; H 48,
    G 32: 2 and 1, which a regrouping would take for a halved group size, keeping every other group's scale)."""
    return 1 if group_size == -1 else k // group_size


@dataclass(frozen=True)
class Sizes:
    """The symbols of shape expressions for one layer on one rank."""

    E: int  # local experts
    N13: int  # rows of w13: 2·I_p (gate ‖ up), I_p for non-gated experts
    H: int
    I: int  # the model's intermediate size
    I_p: int  # this rank's
    bits: int
    GH: int  # groups an engine allocates along H at the checkpoint's G: H // G (`allocated_groups`; 1 channelwise)
    GI: int  # groups an engine allocates along I_p at it: I_p // G
    GH_eff: int  # the fused layout's groups along H (G_eff, moe_wna16's halving)
    GI_eff: int  # the fused layout's groups of w2
    GI_all: int  # groups an engine allocates along the whole model's I (every rank's I_p): I // G

    @property
    def symbols(self) -> dict[str, int]:
        return {"E": self.E, "N13": self.N13, "H": self.H, "I": self.I, "I_p": self.I_p, "P": 32 // self.bits,
                "P8": 8 // self.bits, "GH": self.GH, "GI": self.GI, "GH_eff": self.GH_eff, "GI_eff": self.GI_eff,
                "GI_all": self.GI_all}


_TERM = re.compile(r"\s*([*/]?)\s*([A-Za-z_][A-Za-z_0-9]*|\d+)\s*")


def evaluate(expr: str, sizes: Sizes) -> int:
    """The value of a shape expression (`2*I_p/P`), left to right; a division that leaves a remainder raises."""
    value, symbols, pos = None, sizes.symbols, 0
    while pos < len(expr):
        match = _TERM.match(expr, pos)
        assert match is not None and (match.group(1) == "") == (value is None), f"bad shape expression {expr!r}"
        op, token = match.groups()
        term = int(token) if token.isdigit() else symbols[token]
        if op == "/" and (value % term if term else 1):
            raise LayoutMismatchError(f"shape expression {expr!r}: {value} is not divisible by {token} = {term} "
                                      f"({sizes}); this layer's sizes do not fit the method's layout")
        value = term if value is None else value * term if op == "*" else value // term
        pos = match.end()
    assert value is not None, f"empty shape expression {expr!r}"
    return value


def shape_of(decl: ParamDecl, sizes: Sizes) -> tuple[int, ...]:
    """The concrete shape of `decl` for `sizes`."""
    return tuple(evaluate(dim, sizes) for dim in decl.shape)


def allocated_shape(decl: ParamDecl, sizes: Sizes) -> tuple[int, ...]:
    """The shape the engine allocates for `decl` (`decl.allocated`, else its values' `shape_of`)."""
    return tuple(evaluate(dim, sizes) for dim in decl.allocated) if decl.allocated else shape_of(decl, sizes)
