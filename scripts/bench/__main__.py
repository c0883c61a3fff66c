"""`python scripts/bench [--suite NAME | --size SIZE] [--quick] [options of the suite]` (see cli.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: `bench` is this package

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
