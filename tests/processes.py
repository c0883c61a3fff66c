"""For tests that interrupt a child process: SIGINT delivered as a terminal delivers it."""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """`preexec_fn` of a child that a test sends SIGINT: a pytest started in the background by a
    non-interactive shell passes SIGINT on ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
