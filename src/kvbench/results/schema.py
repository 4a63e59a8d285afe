"""The JSON Schemas (draft 2020-12) of the documents kvbench prints and writes, shipped in kvbench/schemas/.

Each schema lists the keys a document always has and their types, and allows any other key: documents gain keys
without a new `schema_version` (jsonio.SCHEMA_VERSION); a key removed, renamed or retyped raises it.
"""

from __future__ import annotations

import json

from kvbench.errors import KVBenchError
from kvbench.resources import package_file

# kind -> what the schema describes
KINDS = {
    "verify": "kvbench verify --json (also --hf)",
    "break": "kvbench break --json",
    "bench": "a bench run folder's meta.json, and kvbench bench --json (its summary rows: summary.csv's columns)",
    "compare": "kvbench compare --format json and compare.json",
    "memory": "kvbench memory --json",
}


def load_schema(kind: str) -> dict:
    """The JSON Schema of `kind` (one of KINDS), as a dict."""
    if kind not in KINDS:
        raise KVBenchError(f"no schema named {kind!r}; choose one of {', '.join(KINDS)}")
    return json.loads(package_file("schemas", f"{kind}.json").read_text(encoding="utf-8"))
