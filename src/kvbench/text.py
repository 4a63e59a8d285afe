"""User text made safe for one line of a table, a Markdown row or a plot (names read from CSV files, cache names)."""

from __future__ import annotations


def printable(text: object) -> str:
    """`text` with control characters (a newline or a tab in a cache name read from a CSV) written as escapes, so
    a label stays on one line of a table, a Markdown row or a plot."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in s)


def md(text: str) -> str:
    """User text inside a Markdown table cell or code span: one line, no column break."""
    return printable(text).replace("|", "\\|").replace("`", "'")
