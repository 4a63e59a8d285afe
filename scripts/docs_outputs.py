"""Rerun the commands whose output README.md and docs/*.md show, and rewrite (or check) those blocks.

A block of command output is marked by an HTML comment on the line before its opening fence:

    <!-- output: kvbench verify -m gpt2-tiny -w random -d cpu --caches dynamic,static -n 8 -->
    <!-- output: kvbench bench ... (timings vary) -->
    <!-- output: kvbench memory --all --ctx 8k,128k (head 6; tail 1) -->
    <!-- output: transcript -->

The command runs through bash in a temporary folder (holding links to the repository's examples/, configs/ and scripts/), on
a pseudo-terminal 100 columns wide, with this repository's .venv/bin first on PATH, HF_HUB_OFFLINE=1, NO_COLOR=1 and
OMP_NUM_THREADS=1 (one torch thread, so the outputs do not depend on the machine's cores): what a user at such a
terminal sees (stdout and stderr as they interleave, a progress bar as it is left) replaces the block. Options, in parentheses at the end of the marker, separated by ';':

    timings vary   the figures differ run to run: --check compares the block's shape, every number masked
                   (its labels, columns and row count), and that the command still exits as expected
    recorded       a measurement, or a run in another environment, that the text around it discusses (its date,
                   machine or versions stated there): listed, never rerun
    head N, tail N keep the first N and/or the last N lines, with a line '...' where lines were left out
    exit N         the exit status the command is expected to end with (default 0)

A block whose first line starts with '$ ' keeps that line, as '$ ' and the marker's command. A `transcript` block
holds several commands, each on a line starting with '$ ', each followed by its output; every command is rerun and
its output replaced (`$ echo $?` prints the exit status of the command before it).

    python scripts/docs_outputs.py              # rewrite every marked block
    python scripts/docs_outputs.py --check      # exit 1 listing the blocks whose output changed
    python scripts/docs_outputs.py docs/memory.md --list
    python scripts/docs_outputs.py docs/verify.md --match int8,sink   # only the blocks whose command has this

--check compares with timing figures ignored (a number followed by ms, s, tokens/s or GB/s); a `timings vary`
block is compared with every number masked and runs of spaces or of a rule's character taken as one, so a figure
that moved (and a column that widened with it) passes while a changed label, column or row count does not.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!--\s*output:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```|~~~)")
OPTION = r"(?:timings vary|recorded|head \d+|tail \d+|exit \d+)"
OPTIONS = re.compile(rf"^{OPTION}(?:\s*;\s*{OPTION})*$")
NUMBER = re.compile(r"(?<![A-Za-z_\d.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")  # not the 2 of gpt2
RUN = re.compile(r"\s+|([─━═┄╌-])\1+")  # spaces that align columns, a rule's length
TIMING = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?\s?(?:ms|s|tokens/s|GB/s)(?![\w/])")
ELLIPSIS = "..."
WIDTH = 100  # the terminal the outputs are shown in
TIMEOUT_S = 1800  # a command still running after this long is stopped and reported


@dataclass
class Block:
    path: Path
    marker_line: int  # 0-based index of the marker
    start: int  # index of the first line inside the fence
    end: int  # index of the closing fence
    command: str
    marker: str = ""  # the marker's line as written
    vary: bool = False
    recorded: bool = False
    head: int | None = None
    tail: int | None = None
    exit: int = 0
    old: list[str] = field(default_factory=list)
    new: list[str] | None = None  # what the rerun printed, trimmed; None: keep the block as it is

    @property
    def where(self) -> str:
        return f"{shown(self.path)}:{self.marker_line + 1}"


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def parse_marker(text: str) -> dict:
    opts: dict = {"vary": False, "recorded": False, "head": None, "tail": None, "exit": 0}
    m = re.match(r"^(.*?)\s*\(([^()]*)\)$", text)
    if m and OPTIONS.match(m.group(2).strip()):
        text = m.group(1)
        for opt in (o.strip() for o in m.group(2).split(";")):
            if opt == "timings vary":
                opts["vary"] = True
            elif opt == "recorded":
                opts["recorded"] = True
            else:
                key, value = opt.split()
                opts[key] = int(value)
    opts["command"] = text.strip()
    return opts


def find_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
            raise SystemExit(f"{shown(path)}:{i + 1}: an output marker must sit on the line before a fence")
        fence = FENCE.match(lines[i + 1]).group(2)
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise SystemExit(f"{shown(path)}:{i + 2}: the fence is never closed")
        blocks.append(Block(path, i, i + 2, end, marker=line, old=lines[i + 2 : end], **parse_marker(m.group(1))))
    return blocks


def environment() -> dict:
    env = dict(os.environ)
    # one torch thread, so what a run prints (its device line, its timings) does not depend on the machine's cores
    env.update(COLUMNS=str(WIDTH), LINES="50", HF_HUB_OFFLINE="1", NO_COLOR="1", TERM="xterm", OMP_NUM_THREADS="1")
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("FORCE_COLOR", None)
    return env


CSI = re.compile(r"\x1b\[([0-9;?]*)([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


def screen(raw: str) -> list[str]:
    """What a terminal shows after `raw`: styles dropped, carriage returns, line erases and cursor-up moves (a
    progress bar redrawing itself) applied."""
    lines, row, col = [""], 0, 0
    pos = 0
    while pos < len(raw):
        m = CSI.match(raw, pos)
        if m:
            args, cmd = m.group(1) or "", m.group(2)
            n = int(args) if args.isdigit() else 1
            if cmd == "A":
                row, col = max(0, row - n), col
            elif cmd == "K":
                lines[row] = "" if args == "2" else lines[row][:col]
            elif cmd == "G":
                col = n - 1
            pos = m.end()
            continue
        ch = raw[pos]
        pos += 1
        if ch == "\n":
            row += 1
            col = 0
            if row == len(lines):
                lines.append("")
        elif ch == "\r":
            col = 0
        elif ch == "\b":
            col = max(0, col - 1)
        elif ch != "\x1b":
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1 :]
            col += 1
    return [line.rstrip() for line in lines]


def run(command: str, folder: Path) -> tuple[int, list[str]]:
    """Run `command` as a user at a terminal WIDTH columns wide would: (exit status, the lines on the screen)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, WIDTH, 0, 0))
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=folder,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + TIMEOUT_S
    while True:
        if time.monotonic() > deadline:  # the command and whatever it started
            os.killpg(proc.pid, signal.SIGKILL)
            chunks.append(f"\n(stopped after {TIMEOUT_S} s)\n".encode())
            break
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # the other end closed: the command and every child it left are done
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    rc = proc.wait()
    raw = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n").replace(str(folder) + "/", "")
    out = screen(raw)
    while out and not out[-1]:
        out.pop()
    return rc, out


def trim(lines: list[str], head: int | None, tail: int | None) -> list[str]:
    if head is None and tail is None:
        return lines
    h, t = head or 0, tail or 0
    if h + t >= len(lines):
        return lines
    return [*lines[:h], ELLIPSIS, *(lines[len(lines) - t :] if t else [])]


def transcript(block: Block, folder: Path) -> tuple[list[str], list[str]]:
    """The block rerun command by command: (new lines, problems)."""
    new, problems, rc = [], [], 0
    for line in block.old:
        if not line.startswith("$ "):
            continue
        command = line[2:]
        new.append(line)
        if command.strip() == "echo $?":
            new.append(str(rc))
            continue
        rc, out = run(command, folder)
        if any(o.startswith("Traceback (most recent call last)") for o in out):
            problems.append(f"`{command}` ended in a traceback")
        new.extend(out)
    return new, problems


def rerun(block: Block, folder: Path) -> tuple[list[str], list[str]]:
    if block.command == "transcript":
        return transcript(block, folder)
    rc, out = run(block.command, folder)
    problems = [] if rc == block.exit else [f"exit status {rc}, expected {block.exit}"]
    new = trim(out, block.head, block.tail)
    if block.old and block.old[0].startswith("$ "):
        new = [f"$ {block.command}", *new]
    return new, problems


def normalise(lines: list[str]) -> list[str]:
    return [TIMING.sub("<time>", line).rstrip() for line in lines]


def shape(lines: list[str]) -> list[str]:
    """The lines with every number masked and alignment dropped: what a run whose figures vary must keep."""
    return [RUN.sub(lambda m: m.group(1) or " ", NUMBER.sub("#", line)).strip() for line in lines]


def differs(old: list[str], new: list[str], vary: bool) -> bool:
    """Whether a rerun's output differs from the block: timing figures ignored; under `vary` every number."""
    if vary:
        return shape(new) != shape(old)
    return normalise(new) != normalise(old)


def write(path: Path, blocks: list[Block]) -> None:
    """Replace each rerun block of `path` (found when the run began; the file must not change meanwhile)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for b in sorted((b for b in blocks if b.new is not None), key=lambda b: -b.start):
        assert lines[b.marker_line] == b.marker, f"{b.where} moved while its command ran"
        lines[b.start : b.end] = b.new
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/*.md)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 listing the blocks that differ")
    p.add_argument("--list", action="store_true", help="list the marked blocks and their commands")
    p.add_argument("--match", default="", help="only the blocks whose command contains this text")
    args = p.parse_args(argv)
    files = [f.resolve() for f in args.files] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if args.list:
        for b in (b for f in files for b in find_blocks(f)):
            note = "  (recorded: not rerun)" if b.recorded else "  (timings vary)" if b.vary else ""
            print(f"{b.where}: {b.command}{note}")
        return 0
    differ = []
    with tempfile.TemporaryDirectory(prefix="kvbench-docs-") as tmp:
        folder = Path(tmp)
        for name in ("examples", "configs", "scripts"):
            (folder / name).symlink_to(ROOT / name)
        for f in files:  # each file rewritten as soon as its blocks have run, so an interrupted run keeps them
            blocks = [b for b in find_blocks(f) if not b.recorded and args.match in b.command]
            for b in blocks:
                print(f"{b.where}: {b.command}", file=sys.stderr, flush=True)
                new, problems = rerun(b, folder)
                changed = differs(b.old, new, b.vary)
                if problems or (args.check and changed):
                    differ.append(f"{b.where}: {b.command}: {'; '.join(problems) or 'the output differs'}")
                if not problems:  # a block whose command failed keeps what it showed
                    b.new = new
            if not args.check:
                write(f, blocks)
    for line in differ:
        print(line)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
