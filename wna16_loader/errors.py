"""One error hierarchy for every user-facing failure.

Every class derives from `WNA16Error`, itself a `ValueError`, so callers that
already catch `ValueError` keep working. Messages name the tensor or file, what
was expected, what was found (with every number) and the fix.
"""

from __future__ import annotations


class WNA16Error(ValueError):
    """Base class of every error this package raises on bad input."""


class ConfigError(WNA16Error):
    """config.json (or its quantization config) is missing, malformed or unsupported."""


class FormatError(WNA16Error):
    """A tensor's dtype, shape or content disagrees with its declared format."""


class CheckpointError(WNA16Error):
    """A checkpoint file or index is missing, unsafe or inconsistent."""


class ShardingError(WNA16Error):
    """A parallel layout cannot be applied to this model."""


class CompletenessError(WNA16Error):
    """Expert slots are missing, duplicated or unexpected after a load."""


class LayoutMismatchError(ShardingError):
    """A pre-sharded output was loaded with a different parallel layout."""


def format_offenders(items: list[str], *, limit: int = 20) -> str:
    """Render up to `limit` offenders, one per line, and a count of the rest."""
    shown = [f"  - {item}" for item in items[:limit]]
    if len(items) > limit:
        shown.append(f"  ... and {len(items) - limit} more ({len(items)} in all)")
    return "\n".join(shown)


class ExpertsPrefixError(WNA16Error, KeyError):
    """A lookup names an experts prefix that the load (or checkpoint) does not have. Also a KeyError, so that
    code written for a dict (`except KeyError`) keeps working; its text is the message, not a quoted key."""

    __str__ = WNA16Error.__str__


def format_ranges(ids: list[int]) -> str:
    """Sorted ids as runs: [0, 1, 2, 3, 5] -> '0–3, 5'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


class PreshardError(WNA16Error):
    """A pre-sharded output folder is locked, foreign, or was written with other parameters."""


class NodeError(WNA16Error):
    """A rank of the node reading a checkpoint together failed, exited or did not arrive in time: every other
    rank of the node raises this instead of waiting for it."""


class SharedMemoryError(WNA16Error):
    """The machine's shared memory (/dev/shm) has no room left for a node's window."""


class DeviceError(WNA16Error):
    """A requested device does not exist or this PyTorch build cannot drive it."""


class ShardInterrupted(KeyboardInterrupt):
    """A `wna16-shard` run stopped by Ctrl-C (SIGINT). Not a WNA16Error (the input was not bad): a caller
    that catches KeyboardInterrupt still does. The message says how far it got and how to finish:
    `interrupted after F of N files; re-run with --resume`. `done`, `total`: the files finished and planned."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__(f"interrupted after {done} of {total} files; re-run with --resume")
        self.done, self.total = done, total

    def __str__(self) -> str:
        return str(self.args[0])
