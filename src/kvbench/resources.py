"""Files shipped inside the package: model presets, GPU list, bench sweeps, GPT-2's BPE ranks.

They live under `src/kvbench/configs/` and `src/kvbench/data/` so an installed wheel has them; the repository's
top-level `configs/` is a link to the same folder, for people who read and edit them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def package_file(*parts: str) -> Path:
    """A file shipped with kvbench, as a filesystem path (kvbench is never installed zipped)."""
    return Path(str(resources.files("kvbench").joinpath(*parts)))


def config_file(*parts: str) -> Path:
    return package_file("configs", *parts)


def bench_config_names() -> list[str]:
    """Names of the bench sweeps shipped in configs/bench/ ('seed', 'quick', ...)."""
    return sorted(p.stem for p in config_file("bench").glob("*.toml"))


GPT2_RANKS = package_file("data", "gpt2.tiktoken")
