"""Files shipped inside the package: model presets, GPU list, bench sweeps, GPT-2's BPE ranks, the bundled
checkpoint gpt2-shakespeare and its held-out passage.

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

# Checkpoints shipped with kvbench (Hugging Face's format: config.json + model.safetensors), by preset name: what
# `--weights auto` loads for that preset, offline. data/README.md says how each was made.
BUNDLED_MODELS = {"gpt2-shakespeare": package_file("data", "gpt2-shakespeare")}
# The passage `verify --text` reads by default for gpt2-shakespeare: the start of The Tempest, held out of its training.
TEMPEST_HELDOUT = package_file("data", "tempest-heldout.txt")
