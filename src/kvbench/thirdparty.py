"""Code kvbench runs but did not write (cache plugins, a model's own modelling code under --trust-remote-code),
contained: whatever it raises, `sys.exit()` included, becomes one KVBenchError naming it and what it was doing, and
whatever it prints goes to stderr, so stdout stays kvbench's own (one JSON document under --json). Ctrl-C still
interrupts, and a KVBenchError it raises (a kvbench cache's own overflow error) passes through unchanged, as does
an allocation failure: running out of memory is the machine's answer, not a broken plugin (a bench row `oom`, exit 3
elsewhere).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Literal

from kvbench.errors import KVBenchError, is_out_of_memory, one_line


class contained:
    """`with contained(fail): their_code()`: on any exception or other BaseException `e` from inside, raise
    `fail(e)` instead (one line for the user); while inside, `print` writes to stderr.

    A class, not a generator: it wraps every per-layer call of a plugin cache, so it stays cheap."""

    __slots__ = ("fail", "saved")

    def __init__(self, fail: Callable[[BaseException], BaseException]) -> None:
        self.fail = fail

    def __enter__(self) -> None:
        self.saved, sys.stdout = sys.stdout, sys.stderr

    def __exit__(self, kind, e, tb) -> Literal[False]:
        sys.stdout = self.saved
        if e is None or isinstance(e, KVBenchError | KeyboardInterrupt) or is_out_of_memory(e):
            return False
        raise self.fail(e) from None


def did(doing: str, e: BaseException) -> str:
    """What third-party code did, in words: 'update raised ValueError: boom', 'update called sys.exit(0) instead
    of raising an exception'."""
    if isinstance(e, SystemExit):
        return f"{doing} called sys.exit({e.code!r}) instead of raising an exception"
    return f"{doing} raised {one_line(e)}"
