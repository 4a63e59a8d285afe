"""The project's one exception type for bad user input and unmet preconditions.

Library code raises `KVBenchError` with a message that names the bad value and the fix; the CLI turns it into a red
one-line message on stderr and exit 2 (3 for `NotEnoughMemoryError`, a run too large for the machine). Internal invariants use `assert` instead. Other exceptions are read
here too: in one line (`one_line`), and whether they are an allocation failure (`is_out_of_memory`). A value or a
list the user gave is named in a line of bounded length (`listed`, `shown`). Nothing here imports torch.
"""

from collections.abc import Iterable


class KVBenchError(Exception):
    """Bad input or an unmet precondition, explained in one line for the user."""


class NotEnoughMemoryError(KVBenchError):
    """A run that does not fit the machine's memory: refused before allocating (what it needs against what the
    device has), or an allocation that failed, explained. The CLI exits 3 for it, not 2: the command was right, the
    machine is too small."""


class ContainedOutOfMemory(NotEnoughMemoryError):
    """An allocation that failed inside third-party code (a cache plugin, a model's own code), worded as that code's
    (kvbench.thirdparty): an allocation failure all the same (`is_out_of_memory`)."""


class FailedThenStopped(KVBenchError):
    """A run that an error stopped after some of its checks had already failed (`verify --endpoint` whose server
    stopped answering): the verdict is known, so the CLI exits 1 with the error's line, not 2."""


class CacheOverflowError(KVBenchError):
    """A fixed-capacity cache was asked to hold more tokens than it has slots for."""


class CheckRaised(Exception):
    """A check whose run raised on one tensor-parallel rank, with the check, the cache and what was raised in one
    line. It ends the run (the CLI exits 70): this rank cannot go on to collectives the others may already wait in,
    where verify without --tp reports the same exception as the check's failed row."""


# A refusal names at most this many items of a list the user gave, then how many more there are.
LISTED = 5
# ... and shows at most this many characters of one value the user gave.
SHOWN_CHARS = 120


def listed(items: Iterable[object], sep: str = ", ", most: int = LISTED) -> str:
    """Items of a user's list for an error line: all of them up to `most`, else the first `most` and a count,
    '8, 9, 10, 11, 12 and 99,995 more', so a line stays short however long the list (each item as `shown`)."""
    items = list(items)
    head = sep.join(shown(x, repr_=False) for x in items[:most])
    rest = len(items) - most
    return f"{head} and {rest:,} more" if rest > 0 else head


def shown(value: object, repr_: bool = True) -> str:
    """One value the user gave, for an error line: its repr (`repr_`; else str), a list or tuple as `listed` in
    brackets, and text longer than SHOWN_CHARS cut with its length ('...' (1,862,908 characters))."""
    if isinstance(value, list | tuple) and len(value) > LISTED:
        return f"[{listed(map(repr, value))}]"
    text = repr(value) if repr_ else str(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def one_line(e: BaseException) -> str:
    """An exception in one line for the user: 'ValueError: its first line', or the type alone when it says nothing.
    A first line that only introduces what follows ('Validation error for field x:') keeps the next line."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# What an allocation failure says in its text, where its type does not say it: the CPU allocator ("DefaultCPUAllocator:
# can't allocate memory" on Linux and macOS, "not enough memory" on Windows) and a device's ("CUDA out of memory",
# "CUDA error: out of memory", "MPS backend out of memory", "XPU out of memory").
_HOST_OOM_TEXT = ("can't allocate memory", "not enough memory")
_DEVICE_OOM_TEXT = ("out of memory",)


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure on any device: torch's OutOfMemoryError (matched by name, so torch is not imported
    here), Python's MemoryError, or an exception whose text is the CPU, CUDA or MPS allocator's. A KVBenchError is
    never one (it is a refusal already explained) but for ContainedOutOfMemory, one worded as third-party code's."""
    if isinstance(e, KVBenchError):
        return isinstance(e, ContainedOutOfMemory)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return any(s in text for s in _HOST_OOM_TEXT + _DEVICE_OOM_TEXT)


def is_out_of_host_memory(e: BaseException) -> bool:
    """Of the failures `is_out_of_memory` matches, those of the CPU's memory: MemoryError or the CPU allocator's."""
    if not is_out_of_memory(e) or type(e).__name__ == "OutOfMemoryError":
        return False
    return isinstance(e, MemoryError) or any(s in str(e) for s in _HOST_OOM_TEXT)
