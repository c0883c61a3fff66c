"""The name scan: every tensor name parsed once, split into routed-expert layers and the rest."""

from __future__ import annotations

from wna16_loader.load.scan import CheckpointScan
from wna16_loader.models.config import read_config_files
from wna16_loader.storage.index import CheckpointIndex
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


def test_scan_splits_expert_layers_from_the_rest_in_layer_order(tmp_path):
    write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32), num_layers=3, files=2)
    with CheckpointIndex(tmp_path) as index:
        scan = CheckpointScan.of(index)
        names = set(index.refs)
    assert list(scan.layers) == [f"model.layers.{layer}.mlp.experts" for layer in range(3)]
    assert {key.name for keys in scan.layers.values() for key in keys} | set(scan.others) == names
    assert all(key.experts_prefix == prefix for prefix, keys in scan.layers.items() for key in keys)
    assert list(scan.others) == sorted(scan.others) and "model.embed_tokens.weight" in scan.others


def test_scan_moves_mtp_layers_to_the_other_tensors(tmp_path):
    """CheckpointScan.mtp_prefixes / without: the MTP layer's expert tensors become non-expert tensors, the
    decoder's layers stay as they were."""
    from sources import mtp_checkpoint
    mtp_checkpoint(tmp_path, "qwen3_5_moe-mtp")
    with CheckpointIndex(tmp_path) as index:
        scan = CheckpointScan.of(index)
    mtp = scan.mtp_prefixes(read_config_files(tmp_path).mtp)
    assert mtp == ("mtp.layers.0.mlp.experts",)
    left = scan.without(mtp)
    assert list(left.layers) == [p for p in scan.layers if p not in mtp] and scan.without(()) is scan
    moved = {key.name for key in scan.layers[mtp[0]]}
    assert set(left.others) == set(scan.others) | moved and list(left.others) == sorted(left.others)
