"""`kvbench memory --json`: the planner's dataclasses as plain JSON values."""

from __future__ import annotations

from dataclasses import asdict, fields, is_dataclass
from typing import Any

from kvbench.memory.spec import ModelSpec


def to_jsonable(obj: Any) -> Any:
    """Dataclasses (and lists of them) as plain dicts; a model spec also says its attention kind."""
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(o) for o in obj]
    if isinstance(obj, ModelSpec):
        return {**asdict(obj), "attention": obj.attention, "sliding_layers": list(obj.sliding_layers)}
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj
