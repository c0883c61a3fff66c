"""The benchmark of wna16_loader: one package, one entry point (`python scripts/bench`, see cli.py), one
contender table (contenders.py) and one target table (targets.py). Suites:

  scale    the real-scale run (Qwen3-30B-A3B-shaped GPTQ, 48 or 8 layers): ours, the read floors, the
           whole-tensor loader and the peers (Run:ai Model Streamer, fastsafetensors), warm and cold
  small    the 550 MB shape and smaller synthetic checkpoints of every format (GPTQ, AWQ, CT)
  names    DeepSeek-V3's 178,176 expert tensors at tiny sizes: the cost per tensor; then the conversions
  bounds   the name-scale loads with parts of the checkpoint index made free (their lower bounds)
  reads    mapping against preadv for a TP rank's column slices
  verify   `wna16-shard verify --source` against writing the same output
  device   host-to-device bandwidth and every rank's device load (CUDA or ROCm)
  inplace  the peak memory the in-place fill of vLLM's MoE parameters adds over them, per method row
  vllm     vLLM's model load, its default loader (as is, EP filter, prefetch) against --load-format wna16 from
           the checkpoint and from a wna16-shard output, TP/EP 4 and 8, cold and warm (in a vLLM venv)
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing
