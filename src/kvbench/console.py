"""Rich at the edge: the consoles, tables and progress bars, and the JSON printer.

Library modules never print; they return dataclasses and rows. Everything a person sees goes through here.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def error(message: str) -> None:
    """One red line on stderr: the whole user-facing error."""
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {message}", soft_wrap=True)


def note(message: str) -> None:
    err.print(f"[dim]{message}[/]", soft_wrap=True)


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


# --- generate ---
class TextStream:
    """Prints a single completion as it is produced. Decodes the whole completion each time and prints the new
    suffix, so a character split across two byte-level tokens appears once it is complete."""

    def __init__(self, tokenizer, prompt: str) -> None:
        self.tok, self.ids, self.shown = tokenizer, [], ""
        out.print(f"[bold]{prompt}[/]", end="")

    def push(self, ids: list[int]) -> None:
        if ids[0] == self.tok.eot_id:
            return
        self.ids.append(ids[0])
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        out.print(text[len(self.shown) :], end="", markup=False, highlight=False)
        self.shown = text

    def close(self) -> None:
        out.print()


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def render_generation(doc: dict, streamed: bool) -> None:
    if not streamed:
        for i, c in enumerate(doc["completions"], 1):
            out.rule(f"[dim]sequence {i} ({c['prompt_tokens']} prompt tokens)")
            out.print(f"[bold]{c['prompt']}[/]", end="")
            out.print(c["text"], markup=False, highlight=False)
    s, t, c = doc["settings"], doc["timings"], doc["cache"]
    tpot = t["tpot_ms_median"]
    rows = [
        [
            "model / weights",
            f"{s['model']} / {s['weights']}"
            + ("  [yellow](random: text is meaningless)[/]" if s["random_weights"] else ""),
        ],
        ["device / dtype", f"{s['device_name']} / {s['dtype']}"],
        [
            "cache",
            f"{c['name']}: {_fmt_bytes(c['bytes'])} held"
            + (f", {_fmt_bytes(c['bytes_copied'])} of history copied" if c["bytes_copied"] else ""),
        ],
        ["prefill (TTFT)", f"{t['ttft_ms']:.1f} ms for batch {s['batch']}"],
        ["median time per output token", "-" if tpot is None else f"{tpot:.2f} ms (decode steps only)"],
        [
            "throughput",
            f"{t['tokens_per_s']:.1f} tokens/s incl. prefill ({t['generated_tokens']} tokens kept)",
        ],
    ]
    tbl = table("generate", ["", ""], [], caption="timings are device-synchronised wall clock")
    tbl.show_header = False
    for r in rows:
        tbl.add_row(*r)
    out.print(tbl)
