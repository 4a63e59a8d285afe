"""The cores this process may run on: one rule for meta.json, bench's --threads note, the GEMV's tuning and --tp's
check on the CPU. No torch here, so `compare` (which reads meta.json's host facts) stays free of it."""

from __future__ import annotations

import os


def usable_cpus() -> int | None:
    """The cores this process may run on (its affinity mask); None where the platform does not say."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def cores() -> int:
    """The cores this process may run on, or the machine's count where the platform has no affinity mask."""
    return usable_cpus() or os.cpu_count() or 1
