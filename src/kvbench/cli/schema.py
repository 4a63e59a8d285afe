"""`kvbench schema KIND`: the JSON Schema of a document kvbench prints or writes."""

from __future__ import annotations

from typing import Annotated

import typer

from kvbench import console
from kvbench.cli.app import app, handle_errors

KindArg = Annotated[
    str, typer.Argument(help="verify, break, bench (meta.json and bench --json), compare or memory.")
]


@app.command()
@handle_errors
def schema(kind: KindArg) -> None:
    """Print the JSON Schema (draft 2020-12) of a kvbench document, for validating it in CI or a dashboard.

    Every document carries `schema_version`; the schemas list the keys always present and allow others."""
    from kvbench.jsonio import load_schema

    console.print_json(load_schema(kind))
