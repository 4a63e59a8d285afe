"""The project's one exception type for bad user input and unmet preconditions.

Library code raises `KVBenchError` with a message that names the bad value and the fix; the CLI turns it into a red
one-line message on stderr and a non-zero exit. Internal invariants use `assert` instead.
"""


class KVBenchError(Exception):
    """Bad input or an unmet precondition, explained in one line for the user."""


class CacheOverflowError(KVBenchError):
    """A fixed-capacity cache was asked to hold more tokens than it has slots for."""


def one_line(e: BaseException) -> str:
    """An exception in one line for the user: 'ValueError: its first line', or the type alone when it says nothing."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
