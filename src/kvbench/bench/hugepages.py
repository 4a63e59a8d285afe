"""Transparent huge pages (Linux) for the tensors of a `kvbench` process.

A decode step on the CPU streams every weight once: ~500 MB for gpt2 fp32. In 4 KiB pages that is ~120k pages, and
each new page costs a TLB walk and restarts the hardware prefetcher's stream; in 2 MiB pages the same reads run
faster (docs/bench.md has the measurements). PyTorch's CPU allocator asks the kernel for huge pages (madvise
MADV_HUGEPAGE) for every buffer of 2 MiB or more when THP_MEM_ALLOC_ENABLE=1 is set at its first allocation, i.e.
before torch is imported.

The `kvbench` command sets it for its own process, unless the variable is already set (THP_MEM_ALLOC_ENABLE=0
measures with ordinary pages). Everything in the process gets the same pages: our weights, transformers' weights,
the KV caches and the bandwidth probe, so rows of one run stay comparable. `status()` records, in meta.json,
whether huge pages were actually in use, checked on a fresh buffer rather than assumed from the variable.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from kvbench.errors import KVBenchError

ENV = "THP_MEM_ALLOC_ENABLE"
SYSTEM = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # e.g. "always [madvise] never"
PROBE_BYTES = 6 << 20  # holds at least two whole 2 MiB-aligned regions wherever the allocator places it


def request(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask PyTorch for huge pages in this process. True when the variable was set here; False when it was already
    set (the user's choice stands; empty counts as unset) or torch is already loaded (its allocator has read the
    variable, or soon will)."""
    if environ.get(ENV, "").strip() or "torch" in sys.modules:
        return False
    environ[ENV] = "1"
    return True


def check(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse what torch would ignore with a warning mid-run: it reads only 0 and 1."""
    value = environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise KVBenchError(f"{ENV}={value!r}: use 1 (huge pages, kvbench's default) or 0 (4 KiB pages)")


def advise(mm: mmap.mmap, environ: Mapping[str, str] = os.environ) -> None:
    """Give a private anonymous mapping the pages torch's allocator gives its buffers in this process: huge pages
    where ENV is 1, else the kernel's default. bench's paired floor reads from such a mapping (bench/floor.py); in
    other pages than the weights' it reads at another rate (4 KiB pages: 49-51 GB/s where huge pages read 58-66, a
    2-core AMD EPYC VM, 2026-12-07)."""
    if environ.get(ENV) == "1" and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP (EINVAL): the read goes on in the pages it has
            pass


def system_mode(path: Path = SYSTEM) -> str | None:
    """The kernel's THP mode: "always", "madvise" or "never"; None where the kernel has no THP (or not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _mapping_at(address: int, smaps: Path = Path("/proc/self/smaps")) -> dict[str, str] | None:
    """The smaps fields ("AnonHugePages", "VmFlags", ...) of the mapping that holds `address`; None when /proc
    cannot say or no mapping holds it."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return None
    fields: dict[str, str] | None = None
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms offset dev inode path"
            if fields is not None:
                return fields
            lo, hi = (int(x, 16) for x in head.split("-"))
            fields = {} if lo <= address < hi else None
        elif fields is not None and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _probe() -> tuple[bool | None, bool | None]:
    """(advised, in_use) for a fresh PROBE_BYTES tensor: did the allocator ask for huge pages on it (madvise, the
    smaps flag "hg": what the software chose), and did the kernel back it with them (what the machine could give:
    it depends on fragmentation and load)? None where /proc cannot say."""
    # here, not at the top: the CLI imports this module before torch, to set ENV first
    import torch

    buf = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    buf.fill_(1)  # fault the pages in
    fields = _mapping_at(buf.data_ptr())
    if fields is None:
        return None, None
    advised = "hg" in fields["VmFlags"].split() if "VmFlags" in fields else None
    huge = fields.get("AnonHugePages")
    return advised, (None if huge is None else int(huge.split()[0]) > 0)


def status() -> dict[str, object]:
    """For meta.json: the variable and whether the allocator asked for huge pages (chosen), the kernel's mode, and
    whether huge pages were in use on a fresh buffer (measured: the kernel may refuse them on a fragmented or busy
    machine, so it describes the run's context, not its identity)."""
    advised, used = _probe()
    return {ENV: os.environ.get(ENV), "system": system_mode(), "advised": advised, "in_use": used}
