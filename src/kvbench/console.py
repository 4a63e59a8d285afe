"""Rich at the edge: the consoles, tables and progress bars, and the JSON printer.

Library modules never print; they return dataclasses and rows. Everything a person sees goes through here.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def error(message: str) -> None:
    """One red line on stderr: the whole user-facing error."""
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)  # user text, printed literally


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def note(message: str) -> None:
    err.print(f"[dim]{escape(message)}[/]", soft_wrap=True)


def print_json(doc: Any) -> None:
    """One JSON document on stdout and nothing else (for scripts and CI)."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def table(title: str, columns: list[str], rows: list[list[Any]], caption: str | None = None) -> Table:
    t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
