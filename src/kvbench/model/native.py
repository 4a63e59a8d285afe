"""Building kvbench's native libraries (model/gemv.c with $CC, model/operators.cpp with $CXX): one compiler run, the
file written whole, and what went wrong in one line."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from kvbench.cachedir import CACHE_ENV


def compile_library(
    compiler: str, source: Path, out: Path, flags: Sequence[str], libs: Sequence[str], timeout: float
) -> str:
    """Build `source` into the shared library `out` with `compiler`, which may carry flags of its own ("gcc -m64"):
    written beside `out`, then renamed, so a concurrent build never loads half a file. "" or why not, in one line."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot write under {out.parent}: {e.strerror or e}; set {CACHE_ENV} to a writable folder"
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        argv = [*shlex.split(compiler), *flags, str(source), "-o", str(tmp), *libs]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, ValueError, subprocess.SubprocessError) as e:  # ValueError: a compiler shlex cannot split
        return f"cannot run {compiler}: {e}"
    if done.returncode != 0:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
        first = next((ln for ln in lines if "error" in ln), lines[0] if lines else "")[:200]
        return f"{compiler} failed to build {source.name}: {first or f'exit status {done.returncode}'}"
    os.replace(tmp, out)
    return ""
