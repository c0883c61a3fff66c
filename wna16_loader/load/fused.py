"""The fused expert layout and its writer (the completeness ledger is `ledger.py`).

Per MoE layer and rank (E_l local experts in ascending global id, b bits,
P8 = 8 / b values per byte):

| name        | dtype  | shape                                        |
|-------------|--------|----------------------------------------------|
| w13_qweight | uint8  | [E_l, 2*I_p, H/P8]  gate rows, then up rows  |
| w2_qweight  | uint8  | [E_l, H, I_p/P8]                             |
| w13_scales  | scale  | [E_l, 2*I_p, ceil(H/G_eff)]                  |
| w2_scales   | scale  | [E_l, H, ceil(I_p/G_eff)] (act-order: ceil(I/G)) |
| w13_qzeros  | uint8  | [E_l, 2*I_p/P8, ceil(H/G_eff)] (asymmetric)  |
| w2_qzeros   | uint8  | [E_l, H/P8, w2 groups] (asymmetric)          |
| w13_g_idx   | int32  | [E_l, H] (act-order)                         |
| w2_g_idx    | int32  | [E_l, I_p] (act-order)                       |
| expert_ids  | int32  | [E_l]                                        |

Non-gated experts (`gated=False`, e.g. Nemotron-H: down(act(up(x)))) keep the same
conventions with only the up rows in w13: w13_qweight [E_l, I_p, H/P8], w13_scales
[E_l, I_p, ceil(H/G_eff)], w13_qzeros [E_l, I_p/P8, ceil(H/G_eff)].

Weights pack along K (4-bit byte j = q[2j] + 16*q[2j+1]); zero points pack
along N. Dequantisation: W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)].

Padding (see sharding.Partition): the last `padding` of a rank's I_p columns
(rows of gate and up, columns of down) are not in the checkpoint; `padfill` writes
them so that they dequantise to exactly 0.

Unquantized experts (`bits` = 16, `quantized` False: float weights in the stored dtype,
`scale_dtype`) take vLLM's unquantized fused layout, with the same row order, cut,
expert placement and padding (zeros):

| w13_weight  | stored | [E_l, 2*I_p, H] (non-gated [E_l, I_p, H]) gate rows, then up rows |
| w2_weight   | stored | [E_l, H, I_p]                                                   |
| expert_ids  | int32  | [E_l]                                                           |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import FormatError, format_ranges
from ..formats import QuantSpec
from ..formats.packing import NibbleWords, pack_bytes
from ..formats.spec import UNQUANTIZED_BITS, group_words
from ..models.names import Proj
from ..parallel.partition import LayerGeometry, Span, values_per_byte
from ..storage.index import nbytes_of
from .copies import place
from .dequant import DequantizedExperts, dequantize
from .device import DevicePolicy
from .padfill import fill_padding, real_groups, real_rows
from .params import ProjectionParams

FUSED_NAMES = ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros",
               "w13_g_idx", "w2_g_idx", "w13_weight", "w2_weight", "expert_ids")
PACKED_WEIGHTS = frozenset({"w13_qweight", "w2_qweight"})  # unpacked from the checkpoint's words: the fused
#                                                            tensors a GPU converts itself (DevicePolicy.staging)


SHORT_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}  # for `group_label`


@dataclass(frozen=True)
class FusedSpec:
    """Shapes and dtypes of one layer's fused parameters on one rank."""

    experts: tuple[int, ...]
    hidden: int
    part: int  # I_p
    intermediate: int  # I
    bits: int
    group_size: int  # G_eff, -1 channelwise
    w13_groups: int
    w2_groups: int
    has_zero_point: bool
    act_order: bool
    scale_dtype: torch.dtype  # unquantized: the dtype of the float weights
    gated: bool = True  # False: w13 holds only the up projection
    activation: str | None = None  # the experts' activation as the config names it (e.g. "silu", "relu2")
    padding: int = 0  # columns at the end of this rank's I_p that are padding (not in the checkpoint)

    @classmethod
    def of(cls, geometry: LayerGeometry, quant: QuantSpec, scale_dtype: torch.dtype, *,
           gated: bool = True, activation: str | None = None) -> "FusedSpec":
        """The fused layout for `geometry` under `quant` (`gated=False`: w13 holds up only)."""
        w13_groups = (geometry.fused_groups(geometry.hidden) if not geometry.act_order
                      else -(-geometry.hidden // geometry.group_size))
        return cls(experts=geometry.experts, hidden=geometry.hidden, part=geometry.part,
                   intermediate=geometry.intermediate, bits=quant.bits, group_size=geometry.group_eff,
                   w13_groups=w13_groups, w2_groups=geometry.w2_groups, has_zero_point=not quant.symmetric,
                   act_order=geometry.act_order, scale_dtype=scale_dtype, gated=gated, activation=activation,
                   padding=geometry.padding)

    @property
    def quantized(self) -> bool:
        """False for float experts (w13_weight / w2_weight)."""
        return self.bits < UNQUANTIZED_BITS

    @property
    def projections(self) -> tuple[Proj, ...]:
        """The projections this layout holds, in w13 row order then down."""
        return layer_projections(self.gated)

    @property
    def w13_rows(self) -> int:
        """Rows of w13: 2*I_p (gate, up) or I_p (up only)."""
        return (2 if self.gated else 1) * self.part

    intermediate_size = property(lambda self: self.intermediate, doc="I: the model's expert intermediate size.")
    intermediate_size_per_partition = property(lambda self: self.part, doc="I_p (I'/tp when padded).")

    @property
    def real(self) -> int:
        """Columns of this rank's I_p taken from the checkpoint (the first ones)."""
        return self.part - self.padding

    @property
    def group_label(self) -> str:
        """The group size in words: `32` (G_eff), `channelwise`, or `float bf16` (the weights' dtype) for float
        experts, which have no groups."""
        if not self.quantized:
            return f"float {SHORT_DTYPES.get(self.scale_dtype, str(self.scale_dtype).removeprefix('torch.'))}"
        return group_words(self.group_size, "")

    def describe(self) -> str:
        """The layout in words, for reprs: `4-bit quantized, group 32, asymmetric, act-order, experts 0–3, I 768,
        I_p 160, padding 32` (float experts: `float bf16 (not quantized), ...`)."""
        if self.quantized:
            kind = (f"{self.bits}-bit quantized, {group_words(self.group_size)}, "
                    f"{'asymmetric' if self.has_zero_point else 'symmetric'}{', act-order' if self.act_order else ''}")
        else:
            kind = f"{self.group_label} (not quantized)"
        return (f"{kind}, experts {format_ranges(list(self.experts)) or 'none'}, I {self.intermediate}, "
                f"I_p {self.part}, padding {self.padding}")

    @property
    def nbytes(self) -> int:
        """Bytes of every parameter present in this layout (`shapes()`), expert_ids included."""
        return sum(nbytes_of(shape, dtype) for shape, dtype in self.shapes().values())

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every parameter present in this layout."""
        e, h, i, per_byte = len(self.experts), self.hidden, self.part, values_per_byte(self.bits)
        if not self.quantized:
            return {"w13_weight": ((e, self.w13_rows, h), self.scale_dtype), "w2_weight": ((e, h, i), self.scale_dtype),
                    "expert_ids": ((e,), torch.int32)}
        out = {
            "w13_qweight": ((e, self.w13_rows, h // per_byte), torch.uint8),
            "w2_qweight": ((e, h, i // per_byte), torch.uint8),
            "w13_scales": ((e, self.w13_rows, self.w13_groups), self.scale_dtype),
            "w2_scales": ((e, h, self.w2_groups), self.scale_dtype),
        }
        if self.has_zero_point:
            out["w13_qzeros"] = ((e, self.w13_rows // per_byte, self.w13_groups), torch.uint8)
            out["w2_qzeros"] = ((e, h // per_byte, self.w2_groups), torch.uint8)
        if self.act_order:
            out["w13_g_idx"] = ((e, h), torch.int32)
            out["w2_g_idx"] = ((e, i), torch.int32)
        out["expert_ids"] = ((e,), torch.int32)
        return out


def layer_projections(gated: bool) -> tuple[Proj, ...]:
    """The projections of a gated (gate, up, down) or non-gated (up, down) expert."""
    return (Proj.GATE, Proj.UP, Proj.DOWN) if gated else (Proj.UP, Proj.DOWN)


class SpecView:
    """The layout facts of a layer read through its `spec` (a FusedSpec): shared by `FusedExperts` and the
    engine's `FusedMoEExperts`."""

    spec: FusedSpec
    bits = property(lambda self: self.spec.bits, doc="Bits per weight (16: float experts).")
    quantized = property(lambda self: self.spec.quantized, doc="False for float experts (w13_weight / w2_weight).")
    group_size = property(lambda self: self.spec.group_size, doc="G_eff (-1: channelwise).")
    has_zero_point = property(lambda self: self.spec.has_zero_point, doc="Whether qzeros are stored.")
    act_order = property(lambda self: self.spec.act_order, doc="Whether g_idx orders the groups.")
    gated = property(lambda self: self.spec.gated, doc="Whether w13 holds gate and up (else up only).")
    intermediate_size = property(lambda self: self.spec.intermediate, doc="I: the model's expert intermediate size.")
    intermediate_size_per_partition = property(lambda self: self.spec.part, doc="I_p (I'/tp when padded).")
    padding = property(lambda self: self.spec.padding, doc="Columns of this rank's I_p that are padding (zeros).")


class FusedTensors(SpecView):
    """One MoE layer's fused tensors on one rank, as `load_experts` returns them (plain tensors in `tensors`, also
    as attributes; see the module table); `mtp`: an MTP layer's. The `nn.Module` holding the same parameters is
    `engine.module.FusedMoEModule`. Formerly `FusedExperts` (still an alias)."""

    def __init__(self, prefix: str, spec: FusedSpec, tensors: dict[str, torch.Tensor], *, mtp: bool = False) -> None:
        assert set(tensors) == set(spec.shapes()), f"{prefix}: tensors {sorted(tensors)} do not match the layout"
        self.prefix = prefix
        self.spec = spec
        self.tensors = tensors
        self.mtp = mtp

    def __getattr__(self, name: str) -> torch.Tensor | None:
        if name in FUSED_NAMES:
            return self.__dict__["tensors"].get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    activation = property(lambda self: self.spec.activation, doc="The experts' activation, as the config names it.")

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={list(v.shape)}" for k, v in self.tensors.items())
        return f"FusedTensors({self.prefix!r}, {self.spec.describe()}, mtp={self.mtp}; {shapes})"

    def dequantize(self) -> DequantizedExperts:
        """Float32 weights of every local expert, for users and tests (float experts: their weights)."""
        if not self.quantized:
            return DequantizedExperts(w13=self.tensors["w13_weight"].to(torch.float32),
                                      w2=self.tensors["w2_weight"].to(torch.float32), gated=self.spec.gated)
        return DequantizedExperts(
            w13=dequantize(self.tensors["w13_qweight"], self.tensors["w13_scales"], self.tensors.get("w13_qzeros"),
                           self.tensors.get("w13_g_idx"), bits=self.bits, group_size=self.group_size),
            w2=dequantize(self.tensors["w2_qweight"], self.tensors["w2_scales"], self.tensors.get("w2_qzeros"),
                          self.tensors.get("w2_g_idx"), bits=self.bits, group_size=self.group_size),
            gated=self.spec.gated,
        )


FusedExperts = FusedTensors  # the former name, kept as an alias


class FusedWriter:
    """Writes projection shards into one layer's fused parameters.

    Where each parameter is staged is the `DevicePolicy`'s decision: on the CPU the staging
    buffers are the parameters. For a GPU target, weights are converted on the device by
    default (`upload_to`: raw words go up in large pinned chunks, and the qweight parameters
    are allocated there); every other parameter is staged in pinned host memory and `finish`
    moves each in one non-blocking copy. With `convert_on_device=False` the weights are
    converted and staged in ordinary host memory. Nothing here synchronises: the load that
    owns the writer calls `policy.synchronize()` once at its end.
    """

    def __init__(self, prefix: str, spec: FusedSpec, device: torch.device | str, *,
                 staging: dict[str, torch.Tensor] | None = None, convert_on_device: bool = True,
                 huge_results: bool = True) -> None:
        """`staging`: existing tensors to write into directly (e.g. a module's parameters, all on
        `device`), one per name of `spec.shapes()`; `finish` is then not needed. `huge_results`: as
        `DevicePolicy.of` takes it."""
        self.prefix, self.spec = prefix, spec
        self.policy = DevicePolicy.of(device, convert_on_device=convert_on_device, huge_results=huge_results)
        self.device = self.policy.target
        external = staging is not None
        with self.policy.scope():
            staging = staging if staging is not None else staging_buffers(spec, self.policy)
        assert {n: tuple(t.shape) for n, t in staging.items()} == {n: s for n, (s, _) in spec.shapes().items()}, \
            f"{prefix}: staging tensors do not match the layout {spec.shapes()}"
        self.staging = staging
        self.device_bound = frozenset(name for name in staging if self.policy.gpu and
                                      (external or self.policy.on_device(name in PACKED_WEIGHTS)))
        self.upload_to = self.policy.upload_to
        self.staging["expert_ids"].copy_(torch.tensor(spec.experts, dtype=torch.int32))
        self._slots = {expert: i for i, expert in enumerate(spec.experts)}
        self._g_idx_owner: dict[int, str] = {}
        self.bytes_written = 0

    def rows(self, proj: Proj) -> tuple[str, slice, slice]:
        """('w13' or 'w2', weight/scale rows, zero-point rows) of `proj` in its fused parameters."""
        if proj is Proj.DOWN:
            return "w2", slice(None), slice(None)
        part, per_byte = self.spec.part, values_per_byte(self.spec.bits)
        half = 0 if proj is Proj.GATE or not self.spec.gated else 1
        return "w13", slice(half * part, (half + 1) * part), slice(half * part // per_byte, (half + 1) * part // per_byte)

    def slots(self, experts: Sequence[int]) -> slice:
        """The run of consecutive slots holding `experts` (given in slot order)."""
        first = self._slots[experts[0]]
        assert [self._slots[e] for e in experts] == list(range(first, first + len(experts))), \
            f"{self.prefix}: experts {list(experts)} are not consecutive slots"
        return slice(first, first + len(experts))

    def write_params(self, experts: Sequence[int], proj: Proj, params: ProjectionParams, *,
                     labels: Sequence[str]) -> None:
        """Place the scales, zero points and g_idx of `experts` (consecutive slots; `labels` name
        each expert's projection in errors) in their rows of the fused parameters."""
        slots = self.slots(experts)
        half, rows, zero_rows = real_rows(self.spec, self.rows(proj))
        groups = slice(0, real_groups(self.spec, half))
        self._copy(f"{half}_scales", slots, rows, params.scales, cols=groups)
        if self.spec.has_zero_point:
            assert params.zeros is not None, f"{self.prefix}: asymmetric layout but no zero points"
            self._copy(f"{half}_qzeros", slots, zero_rows, pack_bytes(params.zeros, bits=self.spec.bits, dim=1),
                       cols=groups)
        if self.spec.act_order:
            assert params.g_idx is not None, f"{labels[0]}: act-order layout but no g_idx"
            if proj is Proj.DOWN:
                self._copy("w2_g_idx", slots, slice(0, self.spec.real), params.g_idx)
            else:
                self._put_w13_g_idx(experts, params.g_idx, labels)
        if self.spec.padding:
            fill_padding(self.staging, self.spec, slots, self.rows(proj), params.zeros)

    def write_qweight(self, experts: Sequence[int], proj: Proj, qweight: torch.Tensor | NibbleWords, *,
                      n: Span | None = None) -> None:
        """Place the weights of `experts` (consecutive slots; fused bytes [E_c, len(n), K_l/P8], or their
        int32 words, as a tensor or `NibbleWords`) in the rows `n` of the rank's slice of `proj` (default: all)."""
        half, rows, _ = real_rows(self.spec, self.rows(proj))
        if n is not None:
            first = rows.start or 0
            rows = slice(first + n.start, first + n.stop)
        cols = slice(0, self.spec.real // values_per_byte(self.spec.bits)) if half == "w2" else slice(None)
        self._copy(f"{half}_qweight", self.slots(experts), rows, qweight, as_bytes=True, cols=cols)

    def write_weights(self, experts: Sequence[int], proj: Proj, weights: torch.Tensor) -> None:
        """Place the float weights of `experts` (consecutive slots; [E_b, N_l, K_l] of the rank's real columns)
        in an unquantized layout's rows of `proj`, and zeros in its padding."""
        half, rows, _ = real_rows(self.spec, self.rows(proj))
        slots, name = self.slots(experts), f"{half}_weight"
        cols = slice(0, self.spec.real) if half == "w2" else slice(None)
        self._copy(name, slots, rows, weights, cols=cols)
        if self.spec.padding:
            padding = self.staging[name][slots, rows.stop:self.rows(proj)[1].stop] if half == "w13" else \
                self.staging[name][slots, :, self.spec.real:]
            padding.zero_()

    def _put_w13_g_idx(self, experts: Sequence[int], g_idx: torch.Tensor, labels: Sequence[str]) -> None:
        """gate and up share one w13_g_idx row per expert: the first writes it, the second must agree."""
        owned = [self._g_idx_owner.get(expert) for expert in experts]
        if all(owner is None for owner in owned):
            self._copy("w13_g_idx", self.slots(experts), slice(None), g_idx)
            self._g_idx_owner.update(zip(experts, labels))
            return
        if any(owner is None for owner in owned):  # a mixed run: one expert at a time
            for i, expert in enumerate(experts):
                self._put_w13_g_idx([expert], g_idx[i:i + 1], labels[i:i + 1])
            return
        staged = self.staging["w13_g_idx"][self.slots(experts)]
        differs = (staged != g_idx.to(staged.device)).any(1)  # compared where the staged row lives
        if bool(differs.any()):
            i = int(differs.nonzero()[0, 0])
            raise FormatError(f"{labels[i]}: its g_idx differs from that of {owned[i]}; gate and up of one expert "
                              f"share w13_g_idx and must carry the same act-order permutation.")

    def put_whole(self, name: str, value: torch.Tensor) -> None:
        """Copy a whole fused parameter (e.g. a view of a pre-sharded file's mapping) into its staging
        tensor: on the host, one copy; onto the device, through a pinned buffer and one non-blocking copy."""
        target = self.staging[name]
        assert target.shape == value.shape and target.dtype == value.dtype, \
            f"{self.prefix}.{name}: {list(value.shape)} {value.dtype} vs {list(target.shape)} {target.dtype}"
        if name in self.device_bound:
            with self.policy.scope():
                self.policy.send(target, self.policy.host_copy(value))
        else:
            target.copy_(value)
        self.bytes_written += value.numel() * value.element_size()

    def _copy(self, name: str, slots: slice, rows: slice, value: torch.Tensor | NibbleWords, *,
              as_bytes: bool = False, cols: slice = slice(None)) -> None:
        """Copy `value` [E_b, rows, cols] into rows (and columns) of a run of slots. With `as_bytes`, a value
        of another dtype (int32 words of packed weights) is taken as the same bytes, so a transposed view
        is copied in one pass and `NibbleWords` are transposed straight into the rows."""
        target = self.staging[name][slots, rows] if cols == slice(None) else self.staging[name][slots, rows, cols]
        if as_bytes and value.dtype != target.dtype:
            target = target.view(value.dtype)
        assert target.shape == value.shape, f"{self.prefix}.{name}: shard {list(value.shape)} vs slot {list(target.shape)}"
        if name in self.device_bound and value.device.type == "cpu":  # never DMA from a file mapping
            with self.policy.scope():  # pinned memory in the target's context
                host = self.policy.host_buffer(tuple(value.shape), value.dtype)
                place(host, value)
                self.policy.send(target, host)
        else:
            place(target, value)
        self.bytes_written += math.prod(value.shape) * value.dtype.itemsize

    def finish(self, *, mtp: bool = False) -> FusedExperts:
        """Move the parameters staged on the host to the device (one copy each, queued: the load
        synchronises once at its end) and return the layer (`mtp`: an MTP layer's)."""
        if not self.policy.gpu:
            return FusedExperts(self.prefix, self.spec, self.staging, mtp=mtp)
        with self.policy.scope():
            moved = {name: buf if name in self.device_bound else self.policy.upload(buf)
                     for name, buf in self.staging.items()}
        return FusedExperts(self.prefix, self.spec, moved, mtp=mtp)


def staging_buffers(spec: FusedSpec, policy: DevicePolicy) -> dict[str, torch.Tensor]:
    """Empty tensors for every fused parameter, where `policy` stages each (see device.py)."""
    return {name: policy.staging(shape, dtype, packed=name in PACKED_WEIGHTS)
            for name, (shape, dtype) in spec.shapes().items()}
