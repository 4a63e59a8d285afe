"""Where kvbench keeps what it builds once per machine: peers' converted models, the CPU GEMV kernel."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVBENCH_CACHE_DIR"


def cache_root() -> Path:
    """$KVBENCH_CACHE_DIR, default ~/.cache/kvbench."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvbench").expanduser()
