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
import functools
import io
import os
import sys
from contextlib import contextmanager, suppress
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, JustifyMethod
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from kvbench.errors import KVBenchError
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

    def _check_buffer(self) -> None:
        """Rich writes what it rendered here; a stdout that takes no more (a full disk, /dev/full) is one line."""
        try:
            super()._check_buffer()
        except BrokenPipeError:
            raise
        except OSError as e:
            if self.stderr:
                raise
            raise stdout_lost(e, self.file, "the output") from None

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


_SAID: list[str] = []  # the error lines said so far (the CLI's error document repeats the last one)


def wrote(files: list[Any], folder: Any) -> Text:
    """The closing line of a command that wrote files: which, and in which folder."""
    return line(styled("wrote", "green"), f" {', '.join(p.name for p in files)} ", styled("in", "dim"), f" {folder}")


def print_gate(regressions: list[str], fail_on: list[str]) -> None:
    """A --fail-on gate's verdict on stdout: FAIL with each regression, or PASS."""
    gate = ", ".join(fail_on)
    if regressions:
        out.print(line(styled("FAIL", "bold red"), f" ({gate}): {len(regressions)} regression(s)"))
        for text in regressions:
            out.print(f"  {text}", markup=False)
    else:
        out.print(line(styled("PASS", "bold green"), f" ({gate}): no regression"))


def error(message: str) -> None:
    """One red line on stderr: the whole user-facing error. The message is literal text."""
    _SAID.append(_one_line(message))
    err.print(line(styled("error:", "bold red"), " ", _one_line(message)), soft_wrap=True)


def errors_said() -> list[str]:
    """The error lines said on stderr so far, oldest first."""
    return list(_SAID)


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


_DOCUMENT: list = []  # where print_json writes while a --json command runs (json_stdout), innermost last


_PRINTED = [0]  # JSON documents printed by this process (or by the processes it started: count_documents)


def print_json(doc: Any) -> None:
    """One JSON document on stdout and nothing else (for scripts and CI): strict JSON, NaN and infinities null."""
    stream = _DOCUMENT[-1] if _DOCUMENT else sys.stdout
    _PRINTED[0] += 1
    try:
        stream.write(json_text(doc) + "\n")
        stream.flush()
    except BrokenPipeError:  # the reader went away: the CLI ends quietly (cli/app.py)
        raise
    except OSError as e:  # a full disk, /dev/full: one line, not a traceback
        raise stdout_lost(e, stream, "the JSON document") from None


def stdout_lost(e: OSError, stream: Any, what: str) -> KVBenchError:
    """The one-line error for a stdout that cannot be written (a full disk, /dev/full; not a closed pipe), `what`
    was on its way there. A write that failed leaves its text in the stream's buffer, and Python flushes it again at
    exit, where the failure is a message on stderr and exit status 120; the text is lost either way, so the stream's
    descriptor is pointed at /dev/null and the buffer let go there."""
    with suppress(OSError, ValueError, AttributeError):
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
        stream.flush()
    return KVBenchError(f"stdout cannot be written ({e.strerror or e}): {what} is lost")


def documents_printed() -> int:
    """How many JSON documents this process has printed so far (the CLI prints an error document where a --json
    command ended without one)."""
    return _PRINTED[0]


def count_documents(n: int) -> None:
    """`n` documents were printed on this process's stdout by a process it started (tensor-parallel rank 0)."""
    _PRINTED[0] += n


@contextmanager
def json_stdout(active: bool = True):
    """While a --json command runs, stdout carries its one JSON document and nothing else, whatever else runs: what
    is printed (`print`, `sys.stdout`), written to `sys.__stdout__` or to file descriptor 1 itself (native code, a
    logging handler bound to the process's stdout) goes to stderr, and `print_json` writes the document to the real
    stdout, kept aside on a descriptor of its own. Everything is put back when the block ends. A process that ends
    itself with `os._exit()` writes no document: nothing in a process can contain that."""
    if not active:
        yield
        return
    sys.stdout.flush()
    shown, saved, document = sys.stdout, _dup(1), None
    if saved is not None:
        if _fileno(shown) == 1:  # the process's own stdout: the document goes to the descriptor kept aside
            document = os.fdopen(os.dup(saved), "w", encoding=shown.encoding or "utf-8")
        _stderr_onto(1)
    _DOCUMENT.append(document if document is not None else shown)
    _KEPT.append(saved)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = shown
        _DOCUMENT.pop()
        _KEPT.pop()
        if document is not None:
            with suppress(OSError):  # a reader that went away: the document's own write has said so
                document.close()
        if saved is not None:
            _flush_writes_to_fd1()
            os.dup2(saved, 1)
            os.close(saved)


_KEPT: list = []  # the real stdout's descriptor kept aside by json_stdout (None where fd 1 was closed)


@contextmanager
def stdout_inherited():
    """Inside json_stdout: descriptor 1 back on the real stdout for the block, for processes started in it that
    write the document themselves (tensor-parallel ranks: rank 0 reports) and guard their own descriptor 1. What
    they printed is counted by whoever knows (`count_documents`: the launcher, from rank 0's own account)."""
    saved = _KEPT[-1] if _KEPT else None
    if saved is None:
        yield
        return
    _flush_writes_to_fd1()
    os.dup2(saved, 1)
    try:
        yield
    finally:
        _stderr_onto(1)


def _flush_writes_to_fd1() -> None:
    """What was buffered on its way to descriptor 1 (Python's `sys.__stdout__`, C's stdio: a native printf) is
    written out now, to where descriptor 1 points while it was written."""
    with suppress(OSError, ValueError, AttributeError):
        if sys.__stdout__ is not None:
            sys.__stdout__.flush()
    with suppress(ImportError, OSError, AttributeError, TypeError):  # no C library to ask (not POSIX)
        import ctypes

        ctypes.CDLL(None).fflush(None)


def _dup(fd: int) -> int | None:
    try:
        return os.dup(fd)
    except OSError:  # closed (`kvbench ... >&-`)
        return None


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # captured or replaced
        return None


def _stderr_onto(fd: int) -> None:
    """Descriptor `fd` onto stderr's, or onto /dev/null where stderr is closed."""
    try:
        os.dup2(2, fd)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


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


GAP = 2  # characters between two columns of a fitted table: its divider and one space of padding


def fitted(
    title: str | Text | None,
    columns: list[str],
    rows: list[list[Any]],
    width: int,
    keys: int = 1,
    justify: list[JustifyMethod] | None = None,
    header: bool = True,
    wrap: tuple[int | str, ...] = (),
) -> list[Text | Table]:
    """The title (a line of its own, wrapped to the console), then `rows` under `columns` laid out in `width`
    characters, every cell in at most two lines:

    - one table with every cell on one line when that fits;
    - else one table whose widest columns wrap into two lines at most: headers first, then the text of the columns
      named in `wrap` (by header or index) at its spaces; a word is never split, and other cells never wrap;
    - else several tables, each repeating the first `keys` columns and taking the others in order, as evenly as
      the width allows, with a blank line between them.

    `justify` gives each column's ("left" or "right", default left); `header` False leaves the header row out.
    """
    justify = justify or ["left"] * len(columns)
    assert len(justify) == len(columns), f"{len(justify)} justifications for {len(columns)} columns"
    heads = [Text(c if header else "") for c in columns]
    body = [[cell(x) for x in r] for r in rows]
    one = [_widest([h, *(r[i] for r in body)]) for i, h in enumerate(heads)]  # every cell on one line
    head2 = [max(_narrowest([h], 2), *(_widest([r[i]]) for r in body)) for i, h in enumerate(heads)]
    wraps = [i in wrap or c in wrap for i, c in enumerate(columns)]
    two = [
        min(head2[i], _narrowest([h, *(r[i] for r in body)], 2)) if wraps[i] else head2[i] for i, h in enumerate(heads)
    ]

    def layout(which: list[int]) -> list[int] | None:
        """Each column's width when `which` fits in `width` (wrapping as little as it can), else None."""
        widths = {i: one[i] for i in which}
        over = sum(widths.values()) + GAP * (len(which) - 1) - width
        for narrow in (head2, two):  # headers first: a wrapped header leaves the rows one line each
            for i in sorted(which, key=lambda i: widths[i] - narrow[i], reverse=True):
                cut = min(max(0, widths[i] - narrow[i]), max(0, over))
                widths[i] -= cut
                over -= cut
        return None if over > 0 else [widths[i] for i in which]

    def build(which: list[int]) -> Table:
        widths = layout(which)
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), show_header=header)
        for n, i in enumerate(which):
            w = None if widths is None else widths[n]  # None: too narrow for any layout, Rich squeezes it
            t.add_column(heads[i], justify=justify[i], width=w, no_wrap=w == one[i], overflow="fold")
        for r in body:
            t.add_row(*[r[i] for i in which])
        return t

    everything = list(range(len(columns)))
    parts = [everything] if layout(everything) is not None else _split(everything, keys, one, layout)
    heading = [Text.assemble(cell(title), style="table.title")] if title else []
    tables = [build(p) for p in parts]
    return heading + [x for t in tables for x in (Text(), t)][1:]  # a blank line between the parts


def _split(columns: list[int], keys: int, one: list[int], layout) -> list[list[int]]:
    """`columns` dealt into as few parts as fit, each part the key columns and a run of the others in order, the
    runs chosen so the widest part is as narrow as it can be (the last part is not one stray column). A column too
    wide to fit beside the keys is a part of its own."""
    head, rest = columns[:keys], columns[keys:]
    n = len(rest)

    @functools.cache
    def fits(a: int, b: int) -> bool:
        return b - a == 1 or layout(head + rest[a:b]) is not None

    def width(a: int, b: int) -> int:
        return sum(one[j] + GAP for j in rest[a:b])

    count, a = 0, 0  # the fewest parts: each as many columns as fit
    while a < n:
        b = a + 1
        while b < n and fits(a, b + 1):
            b += 1
        count, a = count + 1, b
    # best[k][b]: (the widest part, where the last part starts) over rest[:b] in k parts
    inf = (float("inf"), 0)
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    best[0][0] = (0, 0)
    for k in range(1, count + 1):
        for b in range(1, n + 1):
            for a in range(k - 1, b):
                if best[k - 1][a][0] < float("inf") and fits(a, b):
                    best[k][b] = min(best[k][b], (max(best[k - 1][a][0], width(a, b)), a))
    parts: list[list[int]] = []
    b = n
    for k in range(count, 0, -1):
        a = best[k][b][1]
        parts.insert(0, head + rest[a:b])
        b = a
    return parts or [head]


def _widest(cells: list[Text]) -> int:
    """The longest line among `cells`."""
    return max((cell_len(ln) for c in cells for ln in c.plain.split("\n")), default=0)


def _narrowest(cells: list[Text], lines: int) -> int:
    """The narrowest width at which every one of `cells` wraps into at most `lines` lines without a word split."""
    lo = max((cell_len(w) for c in cells for w in c.plain.split()), default=0)
    hi = max(lo, _widest(cells))
    while lo < hi:
        mid = (lo + hi) // 2
        if all(len(c.wrap(out, mid, overflow="fold")) <= lines for c in cells):
            hi = mid
        else:
            lo = mid + 1
    return hi


def shared_columns(
    columns: list[str], rows: list[list[Any]], names: tuple[str, ...] = (), empty: str = "-"
) -> tuple[list[str], list[list[Any]], list[str]]:
    """Columns that say nothing row by row, taken out of a table: each of `names` whose value every row shares
    (returned as "name value" for the title), and any column that is `empty` in every row (dropped).
    Returns (columns, rows, the title's additions)."""
    plain = [[cell(x).plain for x in r] for r in rows]
    keep, title = [], []
    for i, c in enumerate(columns):
        values = {r[i] for r in plain}
        if rows and values == {empty}:
            continue
        if rows and c in names and len(values) == 1:
            title.append(f"{c} {values.pop()}")
            continue
        keep.append(i)
    return [columns[i] for i in keep], [[r[i] for i in keep] for r in rows], title


class Notes:
    """Long free text moved out of a table into numbered notes beneath it: a cell shows `[n]`, the same text
    shares one number, and `lines` are the notes to print."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[Text]:
        return [line(styled(f"[{n}]", "dim"), f" {t}") for n, t in enumerate(self.texts, 1)]


def clipped(text: Text, width: int, max_lines: int, hint: str = "") -> Text:
    """`text` wrapped to `width`, cut after `max_lines` lines with "..." and `hint` when it runs longer."""
    lines = text.wrap(out, width)
    if len(lines) <= max_lines:
        return Text("\n").join(lines)
    tail = Text(f"... {hint}".rstrip(), style="dim")
    last = lines[max_lines - 1]
    last = last[: max(0, width - tail.cell_len - 1)]
    last.rstrip()
    return Text("\n").join([*lines[: max_lines - 1], Text.assemble(last, " ", tail)])


def cell(x: Any) -> Text:
    """A table cell: Rich Text as given, anything else as literal text."""
    return x if isinstance(x, Text) else Text(escape_controls(str(x)))


def fmt_share(x: float) -> str:
    """A fraction as a percentage with one decimal, 100% as itself: 99.5%, 100%."""
    return "100%" if x == 1 else f"{x:.1%}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
