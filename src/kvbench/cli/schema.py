"""`kvbench schema KIND`: the JSON Schema of a document kvbench prints or writes."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench import console
from kvbench.cli.app import command
from kvbench.options import option


@dataclass
class SchemaOptions:
    kind: str = option(argument=True, help="verify, break, bench (meta.json and bench --json), compare or memory.")


@command(SchemaOptions)
def schema(o: SchemaOptions) -> None:
    """Print the JSON Schema (draft 2020-12) of a kvbench document, for validating it in CI or a dashboard.

    Every document carries `schema_version`; the schemas list the keys always present and allow others."""
    from kvbench.jsonio import load_schema

    console.print_json(load_schema(o.kind))
