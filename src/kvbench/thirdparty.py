"""Code kvbench runs but did not write (cache plugins, a model's own modelling code under --trust-remote-code),
contained: whatever it raises, `sys.exit()` included, becomes one KVBenchError naming it and what it was doing, and
whatever it prints goes to stderr, so stdout stays kvbench's own (one JSON document under --json; the CLI also points
file descriptor 1 at stderr while a --json command runs, console.json_stdout).

Nothing it raises can pass for kvbench's own verdict: a KVBenchError (a refusal, "out of memory") or a
KeyboardInterrupt it raises is worded as that code's like any other exception. Two things pass as what they are:
a real interrupt, one that a signal delivered while it ran (Ctrl-C, or bench's SIGTERM; the CLI notes each one,
`watching_signals`), which still stops the run; and an allocation failure, which is the machine's answer rather than
a broken plugin: it is worded as that code's too, and stays out of memory (`ContainedOutOfMemory`: a bench row `oom`,
exit 3 elsewhere). `os._exit()` ends the process on the spot, past every handler: no process can contain that in
itself.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Literal

from kvbench.errors import ContainedOutOfMemory, NotEnoughMemoryError, is_out_of_memory, one_line


class _Signals:
    """Interrupts that signals delivered, counted while the CLI watches for them (`watching_signals`)."""

    watching = False
    seen = 0


def note_signal() -> None:
    """A signal handler of kvbench's is about to raise KeyboardInterrupt (or a subclass): it is a real one."""
    _Signals.seen += 1


def _interrupted(signum, frame) -> None:
    note_signal()
    raise KeyboardInterrupt


@contextmanager
def watching_signals():
    """While the block runs, Ctrl-C (SIGINT) is noted as it raises KeyboardInterrupt, so `contained` tells a real
    interrupt from a KeyboardInterrupt that third-party code raised itself. Elsewhere (kvbench as a library, another
    thread, a SIGINT handler of the program's own) every KeyboardInterrupt is taken as real."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    was = _Signals.watching
    signal.signal(signal.SIGINT, _interrupted)
    _Signals.watching = True
    try:
        yield
    finally:
        _Signals.watching = was
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _real_interrupt(seen: int) -> bool:
    """A KeyboardInterrupt is real when a signal delivered it since `seen` (watching), or, unwatched, unless the
    process ignores SIGINT (started in the background: no Ctrl-C can reach it, so the exception is the code's own).
    A signal one of kvbench's handlers noted (SIGTERM and SIGHUP too) is real wherever SIGINT stands."""
    if _Signals.seen != seen:
        return True
    if _Signals.watching:
        return False
    main = threading.current_thread() is threading.main_thread()
    return not (main and signal.getsignal(signal.SIGINT) is signal.SIG_IGN)


_WORDED = object()  # marks an error `contained` raised, so an enclosing block passes it on as worded


class contained:
    """`with contained(fail): their_code()`: on any exception or other BaseException `e` from inside, raise
    `fail(e)` instead (one line for the user; `ContainedOutOfMemory` with its text for an allocation failure); while
    inside, `print` writes to stderr. A KeyboardInterrupt passes through only when a signal delivered it.

    A class, not a generator: it wraps every per-layer call of a plugin cache, so it stays cheap."""

    __slots__ = ("fail", "saved", "seen")

    def __init__(self, fail: Callable[[BaseException], BaseException]) -> None:
        self.fail = fail

    def __enter__(self) -> None:
        self.saved, sys.stdout = sys.stdout, sys.stderr
        self.seen = _Signals.seen

    def __exit__(self, kind, e, tb) -> Literal[False]:
        sys.stdout = self.saved
        if e is None:
            return False
        if isinstance(e, KeyboardInterrupt) and _real_interrupt(self.seen):
            return False  # a real interrupt: Ctrl-C still stops the run
        if getattr(e, "_worded_by", None) is _WORDED:
            return False  # already worded by a contained block inside this one (remote generate -> forward)
        error = self.fail(e)
        if is_out_of_memory(e) and not isinstance(error, NotEnoughMemoryError):
            error = ContainedOutOfMemory(str(error))
        error._worded_by = _WORDED  # type: ignore[attr-defined]
        raise error from None


def did(doing: str, e: BaseException) -> str:
    """What third-party code did, in words: 'update raised ValueError: boom', 'update called sys.exit(0) instead
    of raising an exception', 'update ran out of memory (OutOfMemoryError: ...)'."""
    if isinstance(e, SystemExit):
        return f"{doing} called sys.exit({e.code!r}) instead of raising an exception"
    if is_out_of_memory(e):
        return f"{doing} ran out of memory ({one_line(e)})"
    return f"{doing} raised {one_line(e)}"
