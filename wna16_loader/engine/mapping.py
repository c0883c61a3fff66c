"""Engine-facing names: vLLM's projection ids, and checkpoint tensor name -> the fused parameters it feeds.

`ExpertParamMapping` maps a checkpoint name to the fused parameters it feeds in
O(1): the name regex runs once per name shape (`ExpertNameParser`), the planner's rule once per kind
(`KeyRules`); every other name is a split and dict lookups.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import FormatError
from ..formats import Role
from ..layouts.spec import Half
from ..load.keys import KeyRules
from ..models.config import MoEConfig
from ..models.names import PROJ_ALIASES, ExpertNameParser, Proj

FUSED_ROLE_NAMES = {Role.QWEIGHT: "qweight", Role.SCALES: "scales", Role.ZEROS: "qzeros", Role.G_IDX: "g_idx",
                    Role.WEIGHT: "weight"}


class ShardId(enum.Enum):
    """vLLM's projection ids, converted to `Proj` at the hook boundary."""

    W1 = "w1"  # gate
    W3 = "w3"  # up
    W2 = "w2"  # down

    @property
    def proj(self) -> Proj:
        """The logical projection this id names."""
        return {ShardId.W1: Proj.GATE, ShardId.W3: Proj.UP, ShardId.W2: Proj.DOWN}[self]

    @classmethod
    def of_proj(cls, proj: Proj) -> "ShardId":
        """The id of a projection."""
        return {Proj.GATE: cls.W1, Proj.UP: cls.W3, Proj.DOWN: cls.W2}[proj]

    @classmethod
    def parse(cls, shard_id: "str | ShardId", weight_name: str) -> "ShardId":
        """`shard_id` as an enum; FormatError naming the tensor for anything else."""
        if isinstance(shard_id, ShardId):
            return shard_id
        try:
            return cls(shard_id)
        except ValueError:
            raise FormatError(f"{weight_name}: shard_id={shard_id!r} is not a projection id; expected one of "
                              f"{[s.value for s in cls]} (w1 gate, w3 up, w2 down).") from None


def fused_half(proj: Proj) -> str:
    """'w13' for gate and up, 'w2' for down."""
    return Half.of(proj).value


def default_alias(proj: Proj) -> str:
    """The first checkpoint module name of a projection (gate_proj, up_proj, down_proj)."""
    return next(alias for alias, source in PROJ_ALIASES.items() if source.value == proj.value)


@dataclass(frozen=True)
class ParamTarget:
    """One fused parameter a checkpoint tensor feeds, and the weight_loader arguments for it."""

    param_name: str  # "{experts prefix}.{fused_name}"
    fused_name: str  # e.g. "w13_qweight"; roles without a fused tensor of their own map to the qweight
    shard_id: ShardId
    expert_id: int | None  # global id; None for a tensor stacked over experts


class ExpertParamMapping:
    """Checkpoint tensor name -> the fused parameters it feeds, in O(1) per name.

    Names under another experts prefix (when `prefix` is given), with a suffix the
    layer's spec does not declare (each layer's own: `MoEConfig.spec_of`), an expert id >= E,
    or stacked sources other than gate_up/down map to ().
    """

    def __init__(self, moe: MoEConfig, prefix: str | None = None) -> None:
        self.moe, self.prefix = moe, prefix
        self._parse = ExpertNameParser()
        self._layers: dict[str, tuple[MoEConfig, dict[tuple[Proj, Role], str], KeyRules]] = {}

    def _layer(self, experts_prefix: str) -> tuple[MoEConfig, dict[tuple[Proj, Role], str], KeyRules]:
        """The layer's config (its own spec), (projection, role) -> fused parameter name, and the planner's
        rule for its keys, made once per layer."""
        if experts_prefix not in self._layers:
            moe = self.moe.at_layer(experts_prefix)
            quant = moe.quant
            stored = {Role.QWEIGHT, Role.SCALES, Role.WEIGHT} | ({Role.G_IDX} if quant.act_order else set())
            stored |= set() if quant.symmetric else {Role.ZEROS}
            main = "qweight" if quant.quantized else "weight"
            self._layers[experts_prefix] = (moe, {
                (proj, layout.role): f"{fused_half(proj)}_{FUSED_ROLE_NAMES[layout.role]}" if layout.role in stored
                else f"{fused_half(proj)}_{main}" for proj in Proj for layout in quant.layouts}, KeyRules(moe))
        return self._layers[experts_prefix]

    def __call__(self, name: str) -> tuple[ParamTarget, ...]:
        """The targets of checkpoint tensor `name`: two for gate_up_proj, one otherwise, () if none."""
        key = self._parse(name)
        if key is None or (self.prefix is not None and key.experts_prefix != self.prefix):
            return ()
        moe, fused, rules = self._layer(key.experts_prefix)
        if rules.problem(key) is not None:
            return ()
        layout = moe.quant.layout_for_suffix(key.suffix)
        assert layout is not None, "expert_key_problem checks the suffix"
        return tuple(ParamTarget(f"{key.experts_prefix}.{fused[(proj, layout.role)]}", fused[(proj, layout.role)],
                                 ShardId.of_proj(proj), key.expert) for proj in key.source.projs)

    map_checkpoint_name = __call__


def expert_param_mapping(moe: MoEConfig, prefix: str | None = None) -> ExpertParamMapping:
    """The O(1) name mapping for `moe` (only names under experts prefix `prefix`, when given)."""
    return ExpertParamMapping(moe, prefix)
