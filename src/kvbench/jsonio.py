"""Strict JSON for every document kvbench writes or prints (NaN and infinities as null, never bare `NaN`), and the
JSON Schemas (draft 2020-12) those documents follow, shipped in kvbench/schemas/.

Each schema lists the keys a document always has and their types, and allows any other key: documents gain keys
without a new `schema_version` (SCHEMA_VERSION); a key removed, renamed or retyped raises it.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.resources import package_file

# The version of every JSON document kvbench prints (--json) or writes (meta.json, compare.json), as each
# document's `schema_version`; `kvbench schema KIND` prints the JSON Schema it follows. Raised when a key is
# removed or renamed or its type changes; new keys are added without raising it (readers must allow unknown keys).
SCHEMA_VERSION = 1

# kind -> what the schema describes
KINDS = {
    "verify": "kvbench verify --json (also --hf)",
    "break": "kvbench break --json",
    "bench": "a bench run folder's meta.json, and kvbench bench --json (its summary rows: summary.csv's columns)",
    "compare": "kvbench compare --format json and compare.json",
    "memory": "kvbench memory --json",
}


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


def load_schema(kind: str) -> dict:
    """The JSON Schema of `kind` (one of KINDS), as a dict."""
    if kind not in KINDS:
        raise KVBenchError(f"no schema named {kind!r}; choose one of {', '.join(KINDS)}")
    return json.loads(package_file("schemas", f"{kind}.json").read_text(encoding="utf-8"))
