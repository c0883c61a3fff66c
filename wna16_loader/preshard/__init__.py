"""Pre-shard a checkpoint once into every rank's fused tensors; load them back with no conversion.

Output folder OUT (W = tp * ep ranks, rank r = ep_rank * tp + tp_rank):

| path                                   | content                                             |
|----------------------------------------|-----------------------------------------------------|
| .wna16-plan.json                       | parameters + source fingerprint (written first)     |
| rank-{r:05d}-of-{W:05d}/*.safetensors  | `{experts_prefix}.{fused name}` of rank r's load    |
|                                        | (--layout checkpoint: source tensors, sliced)       |
| common/*.safetensors                   | every non-routed-expert tensor, bytes unchanged     |
| config.json, tokenizer*, ...           | small non-safetensors files of the source, copied   |
| wna16_manifest.json                    | hashes, layout, source account (written last)       |

Every file is written under a temporary name, fsynced and renamed; `.wna16-done.jsonl`
journals finished files so `resume=True` redoes only the rest. A run into a finished output re-checks
every file against the manifest (size, then sha256) and rewrites only those that differ or are missing. Output is deterministic
(sorted tensors, fixed metadata, no timestamps), so a resumed run is byte-identical to a
clean one. Fused rank tensors come from the loader's own per-layer path (`loader.load_layer`), one
layer at a time, so memory does not grow with the layer count; --layout checkpoint slices come from
`presliced` (the loader's storage index computation). `workers` > 1 writes folders in a process pool.

Modules, one job each (imports point down this list):

| module     | job                                                                  |
|------------|----------------------------------------------------------------------|
| safefiles  | temporary name + fsync + rename, the output lock, write errors       |
| slices     | `--layout checkpoint`: each rank's slices of the source tensors      |
| plan       | the plan from headers: ranks, files, size caps, source fingerprint   |
| layouts    | `--plan`: G_eff, padding and bytes per rank of every TP size; which  |
|            | vLLM methods take a layout                                           |
| progress   | the plan in words, progress lines or bar, the summary table          |
| manifest   | the manifest's records (tensors, layers, source account)             |
| journal    | the plan file, the resume journal, re-checking finished files,       |
|            | refusing foreign outputs                                             |
| writing    | safetensors serialisation, streaming and hashing, parallel folders   |
| verify     | hashes, and every tensor against the source                          |
| run        | `preshard_checkpoint`: the whole run in order; `shard`, its CLI twin  |
| distributed| `preshard_distributed`: the run split over torch.distributed processes|

The read side is below the loader, in `wna16_loader.load`: the folder and manifest (`is_presharded`,
`read_manifest`) in `outputs`, a rank's tensors (`load_presharded`) in `presharded`; it is re-exported here.
"""

from __future__ import annotations

from ..load.outputs import MANIFEST_NAME, PLAN_NAME, SCHEMA_VERSION, OutputLayout, is_presharded, read_manifest
from ..load.presharded import load_presharded
from .distributed import preshard_distributed
from .journal import JOURNAL_NAME
from .layouts import LayoutCost, describe_layouts, layout_cost
from .plan import COMMON_DIR, LAYOUTS, FilePlan, RankPlan, ShardPlan, make_plan, rank_folder, split_files
from .progress import RankSummary, ShardSummary, describe_plan
from .run import preshard_checkpoint, shard
from .safefiles import LOCK_NAME
from .verify import verify_output

__all__ = [
    "COMMON_DIR", "JOURNAL_NAME", "LAYOUTS", "LOCK_NAME", "MANIFEST_NAME", "PLAN_NAME", "SCHEMA_VERSION", "FilePlan",
    "LayoutCost", "OutputLayout", "RankPlan", "RankSummary", "ShardPlan", "ShardSummary", "describe_layouts",
    "describe_plan",
    "is_presharded", "layout_cost", "load_presharded", "make_plan", "preshard_checkpoint", "preshard_distributed",
    "rank_folder", "read_manifest", "shard", "split_files", "verify_output",
]
