"""engine/kinds.py: the checked classification of a handed-over tensor and the Kind its kind then shares
(header, role bit, the storage part of the rank's slice that is staged, the slots per stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wna16_loader import FormatError, ParallelConfig, read_moe_config
from wna16_loader.engine.kinds import resolve, staged_kind
from wna16_loader.formats import Role
from wna16_loader.load.params import expected_shape
from wna16_loader.load.plan import layer_geometry
from wna16_loader.load.tables import sizes_source_tensors
from wna16_loader.models.names import Proj, Source
from wna16_loader.storage.index import TensorRef
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


@pytest.mark.parametrize("stacked", [False, True])
def test_staged_kind_stages_the_rank_slice_in_chunks_of_bytes(tmp_path: Path, stacked: bool) -> None:
    """GPTQ, H = I = 64 at TP 2 rank 1: gate qweight [K/8, N] = [8, 64] stages rows 0..7, columns 32..63;
    a slot stages at most 8*32*4 (qweight) + 2*4*4 (qzeros) + 2*32*4 (scales, up to float32) + 64*8 (g_idx,
    up to int64) = 1,824 bytes, so 4,000 bytes take two slots."""
    folder = write_checkpoint(tmp_path, quant_config("gptq", act_order=True), stacked=stacked).folder
    moe = read_moe_config(folder)
    geometry = layer_geometry(moe, ParallelConfig(tp_size=2, tp_rank=1), 0)
    source, row = (Source.GATE_UP, 0) if stacked else (Source.GATE, None)
    ref = TensorRef("q", "f", (), torch.int32)
    src = sizes_source_tensors(geometry.hidden, geometry.intermediate, source, {Role.QWEIGHT: ref}, row)
    arrival = resolve(moe, geometry, f"{moe.experts_prefixes[0]}.{'' if stacked else '0.'}"
                      f"{'gate_up_proj' if stacked else 'gate_proj'}.qweight", Proj.GATE, None)
    shape = expected_shape(moe.quant.layout(Role.QWEIGHT), moe.quant, src, geometry.num_experts)
    roles = tuple(dict.fromkeys(lay.role for lay in moe.quant.layouts))
    kind = staged_kind(moe, geometry, arrival, Proj.GATE, src, shape, roles, 4000)
    assert (kind.role, kind.value, kind.bit, kind.origin) == \
        (Role.QWEIGHT, "qweight", 1 << roles.index(Role.QWEIGHT), (source.value, stacked))
    if stacked:
        assert kind.index is None and kind.chunk == len(geometry.experts)
    else:
        assert kind.index == (slice(0, 8), slice(32, 64)) and kind.chunk == 2


def test_resolve_names_the_inconsistent_argument(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path, quant_config("awq")).folder
    moe = read_moe_config(folder)
    geometry = layer_geometry(moe, ParallelConfig(1, 0), 0)
    name = f"{moe.experts_prefixes[0]}.1.gate_proj.qweight"
    assert resolve(moe, geometry, name, Proj.GATE, 1) == (Source.GATE, Role.QWEIGHT, 1, "gate_proj")
    with pytest.raises(FormatError, match="expert_id=2 but the name says expert 1"):
        resolve(moe, geometry, name, Proj.GATE, 2)
    with pytest.raises(FormatError, match="means down, but the tensor holds"):
        resolve(moe, geometry, name, Proj.DOWN, 1)
    with pytest.raises(FormatError, match="suffix 'bias' is not a awq expert tensor"):
        resolve(moe, geometry, f"{moe.experts_prefixes[0]}.1.gate_proj.bias", Proj.GATE, 1)
