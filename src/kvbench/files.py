"""Reading a file a user names: a regular file under a size bound, never blocking, one line when it is not one.

Every path kvbench reads (prompts, tokenizer files, bench sweeps, config.json files) goes through `read_bytes`, or
through the text, JSON and TOML readers built on it. The path is checked with `stat` before it is opened (a device
such as /dev/zero, a directory or a named pipe is refused by what it is), opened with O_NONBLOCK (so a named pipe
never waits for a writer) and checked again with `fstat` on the open file (so a path swapped in between is caught),
and at most `max_bytes` + 1 bytes are read (so a file that grows while it is read cannot exhaust memory).
Files that other libraries load themselves (weights) get the same check without the read: `check_file`.

`label` names the file in messages the way the user gave it: "--prompts-file prompts.txt", or a bare path.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MiB = 2**20
CONFIG_BYTES = 16 * MiB  # a config.json or a sweep's TOML is a few kilobytes
PROMPTS_BYTES = 64 * MiB  # far more text than any batch of prompts fits in a model's context
TOKENIZER_BYTES = 64 * MiB  # GPT-2's ranks file is 0.8 MiB, its vocab.json 1 MiB
MAX_DEPTH = 64  # objects, lists or tables inside one another: a Hugging Face config nests 3 or 4 deep
# A TOML key of more dotted parts than a config could nest (`a.a.a....`): tomllib's cost grows with the square of
# the parts (100,000 of them take gigabytes), so such a file is refused before it is parsed.
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"[^"\n]*"|'[^'\n]*')[ \t]*\.[ \t]*"""  # a bare or quoted key, then a dot
# a match starts only where a key can start (not inside a run of key characters): from every position of a long run
# the bare part would take the rest of the run and give it back a character at a time, a cost that grows with the
# square of the run (a 100,000-character key: minutes)
_DOTTED_KEY = re.compile(f"(?<![A-Za-z0-9_-])(?:{_KEY_PART}){{{MAX_DEPTH}}}")

_CHUNK = MiB


def size_text(n: int) -> str:
    """Bytes for a message: '512 B', '16 MiB', '3.2 GiB'."""
    if n < 1024:
        return f"{n} B"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n // scale} {unit}" if n % scale == 0 else f"{n / scale:.1f} {unit}"
    return f"{n} B"  # pragma: no cover - unreachable


def _kind(mode: int) -> str:
    """What a path that is not a regular file is, in words."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"


def what_is(path: str | os.PathLike) -> str:
    """'a regular file', 'a directory', 'a character device', ... (following links); 'missing' if nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return "missing"
    return "a regular file" if stat.S_ISREG(mode) else _kind(mode)


def _refuse_not_regular(mode: int, label: str, fix: str) -> None:
    if stat.S_ISREG(mode):
        return
    tail = f"; {fix}" if fix else ""
    if stat.S_ISDIR(mode):
        raise KVBenchError(f"{label} is a directory, not a file{tail}")
    raise KVBenchError(f"{label} is not a regular file ({_kind(mode)}){tail}")


def _refuse_too_big(size: int, label: str, max_bytes: int, noun: str) -> None:
    if size > max_bytes:
        raise KVBenchError(
            f"{label} is {size_text(size)}, more than the {size_text(max_bytes)} {noun} may be"
            if size < 2**62
            else f"{label} is more than the {size_text(max_bytes)} {noun} may be"
        )


def _stat(path: Path, label: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise KVBenchError(f"{label}: file not found") from None
    except NotADirectoryError:
        raise KVBenchError(f"{label}: file not found (a part of the path is a file, not a directory)") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise KVBenchError(f"cannot read {label}: {getattr(e, 'strerror', None) or e}") from None


def check_file(path: str | os.PathLike, label: str, fix: str = "") -> Path:
    """`path` exists and is a regular file (following links); for files another library reads itself."""
    p = Path(path)
    _refuse_not_regular(_stat(p, label).st_mode, label, fix)
    return p


def read_bytes(path: str | os.PathLike, label: str, max_bytes: int, noun: str = "a file", fix: str = "") -> bytes:
    """The whole of the regular file at `path`, at most `max_bytes` long; one line naming `label` otherwise.

    noun: what such a file is, for the size message ("a config", "a prompts file")."""
    p = Path(path)
    st = _stat(p, label)
    _refuse_not_regular(st.st_mode, label, fix)
    _refuse_too_big(st.st_size, label, max_bytes, noun)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise KVBenchError(f"cannot read {label}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # the file now open, in case the path was swapped since the stat
        _refuse_not_regular(st.st_mode, label, fix)
        _refuse_too_big(st.st_size, label, max_bytes, noun)
        data = _read_at_most(fd, max_bytes + 1, label)
    finally:
        os.close(fd)
    _refuse_too_big(len(data), label, max_bytes, noun)  # it grew while being read
    return data


def _read_at_most(fd: int, limit: int, label: str) -> bytes:
    parts, total = [], 0
    while total < limit:
        try:
            chunk = os.read(fd, min(_CHUNK, limit - total))
        except OSError as e:
            raise KVBenchError(f"cannot read {label}: {e.strerror}") from None
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


def read_text(path: str | os.PathLike, label: str, max_bytes: int, noun: str = "a file", fix: str = "") -> str:
    """The file as UTF-8 text (a leading byte-order mark kept: callers that split lines decide)."""
    data = read_bytes(path, label, max_bytes, noun, fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KVBenchError(f"{label} is not UTF-8 text (byte {e.start:,})") from None


def load_json(
    path: str | os.PathLike, label: str, max_bytes: int = CONFIG_BYTES, noun: str = "a config", fix: str = ""
) -> Any:
    """The JSON document in the file; a parse error, or nesting deeper than Python's parser goes, is one line."""
    text = read_text(path, label, max_bytes, noun, fix)
    return parse_json(text, label, noun)


def parse_json(text: str, label: str, noun: str = "a config") -> Any:
    try:
        doc = json.loads(text)
    except RecursionError:
        raise _too_deep_error(label, "JSON", noun) from None
    except ValueError as e:  # JSONDecodeError, or an integer literal of thousands of digits
        raise KVBenchError(f"{label} is not valid JSON ({' '.join(str(e).split())})") from None
    if _too_deep(doc):
        raise _too_deep_error(label, "JSON", noun)
    return doc


def load_toml(
    path: str | os.PathLike, label: str, max_bytes: int = CONFIG_BYTES, noun: str = "a config", fix: str = ""
) -> dict[str, Any]:
    """The TOML document in the file, as a dict; a parse error or too deep a nesting is one line."""
    text = read_text(path, label, max_bytes, noun, fix)
    if _DOTTED_KEY.search(text):
        raise _too_deep_error(label, "TOML", noun)
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        raise _too_deep_error(label, "TOML", noun) from None
    except ValueError as e:  # TOMLDecodeError, or an integer of thousands of digits
        raise KVBenchError(f"{label} is not valid TOML: {' '.join(str(e).split())}") from None
    if _too_deep(doc):
        raise _too_deep_error(label, "TOML", noun)
    return doc


def _too_deep_error(label: str, fmt: str, noun: str) -> KVBenchError:
    return KVBenchError(f"{label}: {fmt} nested too deeply to be {noun} (more than {MAX_DEPTH} levels)")


def _too_deep(doc: Any, limit: int = MAX_DEPTH) -> bool:
    """More than `limit` objects, lists or tables inside one another (counted without recursion)."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
