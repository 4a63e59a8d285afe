"""Writing an output file the user named: atomically in place of a regular file, or as a stream into a FIFO or a
device, never anything else; a write that fails is one line naming the folder or the option.

    output_kind     "file" or "stream", a folder, block device or socket refused
    write_output    the bytes written atomically (a reader sees the old file or the new one) or streamed
    writing_into    an OSError while writing into a folder, as one KVBenchError
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvbench.errors import KVBenchError


@contextmanager
def writing_into(folder: Path) -> Iterator[None]:
    """A write into a run folder that fails becomes one line: the folder was removed while the run wrote into it,
    or the file system refused (full, read-only)."""
    try:
        yield
    except OSError as e:
        if not folder.is_dir():
            raise KVBenchError(f"the run folder disappeared: {folder}") from None
        raise KVBenchError(f"cannot write into {folder} ({e.strerror or e})") from None


def output_kind(path: Path, flag: str | None = None) -> str:
    """What an output path names, for a write that must never replace what it should not: "file" (a regular file,
    through any symbolic links, or none yet: written atomically in place of the file the links lead to, the links
    kept) or "stream" (a FIFO, a character device such as /dev/null, or anything under /dev or /proc such as
    /dev/stdout: opened and written as it is, never replaced). A folder, a block device or a socket is refused in
    one line naming `flag` (the option the path came from)."""
    label = f"{flag} {path}" if flag else str(path)
    try:
        mode = os.stat(path).st_mode  # through symbolic links
    except FileNotFoundError:  # a new file (or a link to one)
        return "file"
    except OSError as e:
        raise KVBenchError(f"{label}: cannot be written ({e.strerror or e})") from None
    if stat.S_ISREG(mode):
        special = str(Path(path).absolute()).startswith(("/dev/", "/proc/"))  # /dev/stdout onto a file: its fd
        return "stream" if special else "file"
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        return "stream"
    what = "a folder" if stat.S_ISDIR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket"
    raise KVBenchError(f"{label} is {what}; give a regular file, a FIFO or a character device (/dev/stdout)")


def write_output(path: Path, data: bytes, flag: str | None = None) -> None:
    """Write `data` to `path` (`output_kind`): a regular or new file atomically (a reader sees the previous file or
    the complete new one; a symbolic link stays a link), a FIFO or a device as a stream, nothing else ever."""
    if output_kind(path, flag) == "stream":
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as e:
            raise KVBenchError(f"{f'{flag} ' if flag else ''}{path}: cannot be written ({e.strerror or e})") from None
        return
    real = Path(os.path.realpath(path))
    tmp = real.with_name(f".{real.name}.tmp-{os.getpid()}")
    with writing_into(real.parent):
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, real)
