"""Rich at the edge: the consoles and the primitives every command's renderer uses.

Library modules never print; they return dataclasses and rows, and each command's module in `kvbench.cli` lays them
out with these. Text a user gave (prompts, names, paths, config fields) is printed literally, never read as Rich
markup: `table` cells and message bodies are plain text, and styling is added with `styled`, never with markup
built by formatting a string.

Control characters in that text (an escape sequence in a prompt file, a carriage return in a model's output) never
reach the terminal raw: every C0 and C1 control character but newline and tab is shown as a visible escape such as
`\x1b` (`escape_controls`), so printed text cannot move the cursor, recolour or clear the user's terminal.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

from rich.console import Console
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from kvbench.jsonio import json_text

# Piped or redirected output is not an 80-column terminal: lay tables out wide and never wrap prose there.
PIPE_WIDTH = 200


# C0 controls but tab and newline, DEL, and C1 controls, each as a visible escape: ESC -> \x1b
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\t\n"}
# and the bidirectional overrides and isolates, which reorder what follows them on screen: U+202E as \u202e
_CONTROLS.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def escape_controls(text: str) -> str:
    """`text` with every control character but newline and tab shown as a visible escape (ESC as `\\x1b`)."""
    return text.translate(_CONTROLS)


class SafeConsole(Console):
    """A Rich console that prints control characters in text as visible escapes. Strings are escaped before Rich
    measures them (so tables stay aligned); a rendered piece of text that still holds one (a Text built elsewhere)
    is escaped on its way out. Rich's own control codes (cursor moves, styles) are left alone."""

    def render_str(self, text: str, **kwargs) -> Text:
        return super().render_str(escape_controls(text), **kwargs)

    def render(self, renderable, options=None):
        for seg in super().render(renderable, options):
            if seg.control is None and escape_controls(seg.text) != seg.text:
                seg = Segment(escape_controls(seg.text), seg.style)
            yield seg

    def on_broken_pipe(self) -> None:
        """A reader closing the pipe early raises BrokenPipeError (the CLI's error layer ends the command quietly,
        cli/app.py) instead of Rich's own exit 1, which reads as a failed check."""
        raise BrokenPipeError(errno.EPIPE, "the reader closed the pipe")


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    return SafeConsole(stderr=stderr, highlight=False, width=None if tty else PIPE_WIDTH, soft_wrap=not tty)


out = _console(stderr=False)
err = _console(stderr=True)


def styled(text: Any, style: str) -> Text:
    """`text` (printed literally) in a Rich style: the one way renderers colour a cell or a line."""
    return Text(escape_controls(str(text)), style=style)


def line(*parts: str | Text) -> Text:
    """A line assembled from plain strings (literal) and `styled` pieces."""
    return Text.assemble(*(escape_controls(p) if isinstance(p, str) else p for p in parts))


def error(message: str) -> None:
    """One red line on stderr: the whole user-facing error. The message is literal text."""
    err.print(line(styled("error:", "bold red"), " ", _one_line(message)), soft_wrap=True)


def warn(message: str) -> None:
    err.print(line(styled("warning:", "yellow"), " ", message), soft_wrap=True)


def note(message: str) -> None:
    err.print(styled(message, "dim"), soft_wrap=True)


def _one_line(message: str) -> str:
    return " ".join(str(message).split("\n")) if "\n" in str(message) else str(message)


def stdout_closed() -> None:
    """The reader of stdout went away (`kvbench ... | head -1`): point stdout at /dev/null, so nothing written later
    (nor Python's flush at exit) fails again and prints a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file descriptor (captured, replaced)
        pass


def stdout_is_devnull() -> bool:
    """Is stdout's file descriptor /dev/null (where stdout_closed, or Rich, points a closed pipe)?"""
    try:
        a, b = os.fstat(sys.stdout.fileno()), os.stat(os.devnull)
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def print_json(doc: Any) -> None:
    """One JSON document on stdout and nothing else (for scripts and CI): strict JSON, NaN and infinities null."""
    sys.stdout.write(json_text(doc) + "\n")
    sys.stdout.flush()


def table(title: str, columns: list[str], rows: list[list[Any]], caption: str | None = None) -> Table:
    t = Table(
        title=cell(title) if title else None,
        caption=cell(caption) if caption else None,
        title_justify="left",
        caption_justify="left",
    )
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[cell(x) for x in r])
    return t


def cell(x: Any) -> Text:
    """A table cell: Rich Text as given, anything else as literal text."""
    return x if isinstance(x, Text) else Text(escape_controls(str(x)))


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
