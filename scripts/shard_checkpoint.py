#!/usr/bin/env python
"""Thin wrapper: `python scripts/shard_checkpoint.py SRC OUT --tp N ...` == `wna16-shard SRC OUT --tp N ...`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from wna16_loader.cli import run  # noqa: E402

if __name__ == "__main__":
    run()
