"""Strict JSON for every document kvbench writes or prints: NaN and infinities as null, never bare `NaN`."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

# The version of every JSON document kvbench prints (--json) or writes (meta.json, compare.json), as each
# document's `schema_version`; `kvbench schema KIND` prints the JSON Schema it follows. Raised when a key is
# removed or renamed or its type changes; new keys are added without raising it (readers must allow unknown keys).
SCHEMA_VERSION = 1


def finite_or_null(doc: Any) -> Any:
    """`doc` with every NaN and infinity (Python or numpy) replaced by None, numpy integers made ints: JSON has no
    NaN or infinity, and a reader given `NaN` or `Infinity` gets a document that is not JSON."""
    if isinstance(doc, dict):
        return {k: finite_or_null(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [finite_or_null(v) for v in doc]
    if isinstance(doc, bool | int | str) or doc is None:
        return doc
    if isinstance(doc, numbers.Integral):
        return int(doc)
    if isinstance(doc, numbers.Real):
        return float(doc) if math.isfinite(doc) else None
    return doc


def json_text(doc: Any) -> str:
    """Strict JSON (NaN and infinities as null), indented; values JSON cannot hold (paths) as text."""
    return json.dumps(finite_or_null(doc), indent=2, default=str, allow_nan=False)
