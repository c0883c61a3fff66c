"""`load_state_dict` with per-expert checkpoint names: the two torch hooks one FusedMoEExperts gets.

The pre-hook feeds every per-expert key under the module's prefix to its `weight_loader` (and
removes it from the state dict); the post-hook reports the rank's unfilled slots by checkpoint name
instead of fused parameter names, and refuses a fused state dict saved by another rank.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..errors import LayoutMismatchError
from ..load.fused import FusedSpec
from .hook import ExpertLoadHook
from .mapping import ExpertParamMapping


class HookedExperts(Protocol):
    """What the hooks use of a FusedMoEExperts (an nn.Module with these members)."""

    prefix: str
    spec: FusedSpec
    hook: ExpertLoadHook
    mapping: ExpertParamMapping
    expert_ids: torch.Tensor
    _parameters: dict[str, Any]
    weight_loader: Callable[..., bool]
    _register_load_state_dict_pre_hook: Callable[..., Any]
    register_load_state_dict_post_hook: Callable[..., Any]

    def attach_loaders(self) -> None: ...

    def flush(self) -> None: ...

    def synchronize(self) -> None: ...


class StateDictHooks:
    """The load_state_dict pre- and post-hooks of one FusedMoEExperts (registered on construction)."""

    def __init__(self, module: HookedExperts) -> None:
        self.module = module
        self.call: tuple[str, int] | None = None  # (load_state_dict prefix, tensors consumed)
        self.handles = [module._register_load_state_dict_pre_hook(self.consume),
                        module.register_load_state_dict_post_hook(self.fix_incompatible_keys)]

    def consume(self, state_dict: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
        """Pre-hook: feed every per-expert key under `prefix` to the weight loader."""
        module, consumed = self.module, 0
        for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in module._parameters]:
            name = f"{module.prefix}.{key[len(prefix):]}"
            targets = module.mapping(name)
            if targets:
                tensor = state_dict.pop(key)
                for target in targets:
                    module.weight_loader(getattr(module, target.fused_name), tensor, name, target.shard_id,
                                         target.expert_id)
                consumed += 1
        self.call = (prefix, consumed)

    def fix_incompatible_keys(self, _: nn.Module, incompatible: Any) -> None:
        """Post-hook: report missing checkpoint names instead of fused parameter names."""
        module = self.module
        prefix, consumed = self.call or ("", 0)
        self.call = None
        module.attach_loaders()  # assign=True replaces parameters
        module.flush()  # every complete projection of this load_state_dict is in the parameters when it returns
        if not prefix:  # the module is the root of this load_state_dict: the load ends here
            module.synchronize()
        if not module.expert_ids.is_meta and module.expert_ids.tolist() != list(module.spec.experts):
            raise LayoutMismatchError(f"{prefix}expert_ids: the state dict holds experts "
                                      f"{module.expert_ids.tolist()} but this rank owns {list(module.spec.experts)}; "
                                      f"load the fused state dict saved by the same rank of the same ParallelConfig.")
        if not consumed:
            return
        fused = {prefix + name for name in module._parameters}
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in fused]
        incompatible.missing_keys.extend(module.hook.missing_names(prefix))
