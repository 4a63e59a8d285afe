"""What `kvbench memory --model NAME` names: a preset, a local model directory or config.json, or a hub id.

As hf-mem and accelerate's estimate-memory do, a name that is neither a preset nor a local path is a Hugging Face
hub id, and only its config.json is fetched (huggingface_hub, into the usual cache). With HF_HUB_OFFLINE set, a
config.json already in the cache is used and anything else is one line naming the id and HF_HUB_OFFLINE.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.memory.resolve import Resolved, resolve_config

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def is_local(name: str) -> bool:
    """A path on this machine: a model directory or a config.json file."""
    return bool(name.strip()) and Path(name).expanduser().exists()


def resolve_local(name: str) -> Resolved:
    """A model directory (its config.json) or a config.json path, resolved as --config resolves it."""
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise KVBenchError(f"--model {name}: a directory without a config.json; not a Hugging Face model")
    return resolve_config(path, "--model")


def _hub_config(repo_id: str) -> Path:
    """The hub id's config.json on this machine: from the cache, or fetched unless HF_HUB_OFFLINE is set."""
    # only for a hub id: presets and local files never import huggingface_hub
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    if hub_offline():
        raise KVBenchError(
            f"--model {repo_id} is a hub id and HF_HUB_OFFLINE is set (its config.json is not in the local cache): "
            "unset HF_HUB_OFFLINE, or give a local model directory or config.json"
        )
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as e:  # huggingface_hub raises many types: not found, gated, no network
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise KVBenchError(f"--model {repo_id}: cannot fetch its config.json from the hub: {why}") from None


def resolve_hub(repo_id: str) -> Resolved:
    """A hub id's config.json, resolved, and named by the id."""
    r = resolve_config(_hub_config(repo_id))
    return dataclasses.replace(r, spec=dataclasses.replace(r.spec, name=repo_id, source=repo_id))


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name.strip())) and not name.startswith(".")
