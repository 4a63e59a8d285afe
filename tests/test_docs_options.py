"""Every option the documentation names for a kvbench command exists, and every default it states is the command's.

The text read is what is a kvbench command line or a kvbench options table, nothing else (options of pip,
torchrun or transformers are not kvbench's):

- a command line: `kvbench CMD ...` in a code block or an inline code span, up to a shell separator or comment;
  in prose, an inline span that starts with the command itself (`verify --hf`, `bench --tp N`);
- an options table: a table whose first header cell is `option`, on a command's page (its command) or in
  docs/cli.md (the commands that share those options). Where the table has a `default` column, the cell's first
  literal (`300`, `auto`, or off/on for a flag) must equal the parameter's default wherever that default is set at
  the command line (bench reads the rest from its TOML sweep: there, the settings' own default).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import typer

from kvbench.bench.settings import BenchSettings
from kvbench.cli import app

ROOT = Path(__file__).resolve().parents[1]
COMMANDS: dict[str, click.Command] = typer.main.get_command(app).commands  # type: ignore[attr-defined]
SHARED = ("generate", "verify", "break", "bench")  # docs/cli.md's "Options every model-running command takes"
PAGES = {
    "generate.md": ("generate",),
    "verify.md": ("verify",),
    "verify-hf.md": ("verify",),
    "verify-endpoint.md": ("verify",),
    "break.md": ("break",),
    "bench.md": ("bench",),
    "bench-scaling.md": ("bench",),
    "bench-endpoint.md": ("bench",),
    "compare.md": ("compare",),
    "memory.md": ("memory",),
    "serve.md": ("serve",),
    "cli.md": SHARED,
}
FENCE = re.compile(r"^\s*(```|~~~)")
SPAN = re.compile(r"`([^`]+)`")
NAMES = "|".join(COMMANDS)
IN_LINE = re.compile(rf"(?:^|[\s(=/])kvbench(?:\s+--verbose)?\s+({NAMES})\b(.*)")
SPAN_START = re.compile(rf"^(?:kvbench\s+)?({NAMES})\s+(--.*)")
SEPARATOR = re.compile(r"\s(?:\|\|?|&&|;|\d?>>?|#)\s|\s\|")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def option_names(cmd: click.Command) -> dict[str, click.Parameter]:
    return {o: p for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def named_in(text: str, span: bool) -> Iterator[tuple[str, str]]:
    """(command, option) for each option a kvbench command line in `text` names."""
    for segment in re.split(r"\$\(|\)\s*$", text):
        m = IN_LINE.search(segment) or (SPAN_START.match(segment) if span else None)
        if m:
            line = SEPARATOR.split(m.group(2) + " ")[0]
            for option in OPTION.findall(line):
                yield m.group(1), option


def command_lines(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line number, command, option) for every option a command line of `path` names."""
    in_fence, joined = False, ""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            joined += line.rstrip("\\").removeprefix("$ ") + " "
            if not line.rstrip().endswith("\\"):
                yield from ((n, c, o) for c, o in named_in(joined, span=False))
                joined = ""
        else:
            for code in SPAN.findall(line.replace("\\|", "|")):
                yield from ((n, c, o) for c, o in named_in(code, span=True))


def table_rows(path: Path) -> Iterator[tuple[int, list[str], list[str]]]:
    """(line number, header cells, row cells) of each row of a table whose first header cell is `option`."""
    header: list[str] | None = None
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            header = None
        elif header is None:
            header = cells if cells[0] == "option" else []
        elif header and not set(line) <= set("|-: "):
            yield n, header, cells


def documented_default(cell: str) -> object:
    """The first literal of a default cell: `300`, `auto`, off/on for a flag; None where it states none."""
    m = re.match(r"^`([^`]*)`", cell)
    if m:
        return m.group(1)
    return {"off": False, "on": True}.get(cell.split(" ")[0])


def actual_default(command: str, param: click.Parameter) -> object:
    if param.default is None and command == "bench":  # bench's options default to its sweep: the settings' field
        field = {f.name: f for f in dataclasses.fields(BenchSettings)}.get(param.name or "")
        return None if field is None or field.default is dataclasses.MISSING else field.default
    return param.default


def same(documented: object, actual: object) -> bool:
    if isinstance(actual, bool) or isinstance(documented, bool):
        return documented == actual
    if isinstance(actual, (int, float)):
        try:
            return float(str(documented)) == float(actual)
        except ValueError:
            return False
    if isinstance(actual, (list, tuple)):
        return str(documented) == ",".join(str(a) for a in actual)
    return str(documented) == str(actual)


def unknown_options(paths: list[Path], root: Path = ROOT) -> list[str]:
    wrong = []
    for path in paths:
        name = path.relative_to(root).as_posix()
        for n, command, option in command_lines(path):
            if option not in option_names(COMMANDS[command]) and option != "--help":
                wrong.append(f"{name}:{n}: kvbench {command} has no {option}")
        for n, _, cells in table_rows(path):
            commands = PAGES.get(path.name, ())
            for option in OPTION.findall(cells[0]):
                if commands and not any(option in option_names(COMMANDS[c]) for c in commands):
                    wrong.append(f"{name}:{n}: no {option} in kvbench {' or '.join(commands)}")
    return wrong


def wrong_defaults(paths: list[Path], root: Path = ROOT) -> list[str]:
    wrong = []
    for path in paths:
        name = path.relative_to(root).as_posix()
        for n, header, cells in table_rows(path):
            if "default" not in header or len(cells) != len(header):
                continue
            documented = documented_default(cells[header.index("default")])
            options = OPTION.findall(cells[0])[:1]
            for command in PAGES.get(path.name, ()) if options and documented is not None else ():
                param = option_names(COMMANDS[command]).get(options[0])
                actual = None if param is None else actual_default(command, param)
                if actual is not None and not same(documented, actual):
                    wrong.append(
                        f"{name}:{n}: {options[0]} defaults to {actual!r} in kvbench {command}, not {documented!r}"
                    )
    return wrong


def test_every_documented_option_exists() -> None:
    wrong = unknown_options(doc_files())
    assert not wrong, "options the docs name that the commands do not take:\n" + "\n".join(wrong)


def test_every_documented_default_is_the_commands() -> None:
    wrong = wrong_defaults(doc_files())
    assert not wrong, "defaults the docs state that the commands do not have:\n" + "\n".join(wrong)


def test_the_docs_name_options_and_defaults() -> None:
    """The readers above see the docs' command lines and tables (an empty harvest would pass anything)."""
    found = {(c, o) for p in doc_files() for _, c, o in command_lines(p)}
    assert {("verify", "--hf"), ("bench", "--prompt-len"), ("memory", "--ctx"), ("compare", "--fail-on")} <= found
    rows = [cells[0] for _, header, cells in table_rows(ROOT / "docs" / "cli.md") if "default" in header]
    assert any("--tp-timeout" in r for r in rows) and any("--seed" in r for r in rows)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("```bash\nkvbench verify --cachez dynamic\n```\n", "kvbench verify has no --cachez"),
        ("Run `kvbench bench --prompt-lens 512` once.\n", "kvbench bench has no --prompt-lens"),
        ("As `memory --measur` shows.\n", "kvbench memory has no --measur"),
        ("```bash\nkvbench generate 'hi' \\\n  --new-tokenz 4\n```\n", "kvbench generate has no --new-tokenz"),
        ("| option | values | default |\n|---|---|---|\n| `--tp-timout` | seconds | `300` |\n", "no --tp-timout"),
        ("| option | values | default |\n|---|---|---|\n| `--tp-timeout` | seconds | `30` |\n", "not '30'"),
        ("| option | values | default |\n|---|---|---|\n| `--seed` | seed | `1` |\n", "not '1'"),
        ("| option | values | default |\n|---|---|---|\n| `--json` | a document | on |\n", "not True"),
    ],
)
def test_a_drift_fails(tmp_path: Path, text: str, problem: str) -> None:
    page = tmp_path / "cli.md"  # read as docs/cli.md: its tables are the shared options
    page.write_text(text, encoding="utf-8")
    found = [w.split(": ", 1)[1] for w in unknown_options([page], tmp_path) + wrong_defaults([page], tmp_path)]
    assert any(problem in f for f in found), found


@pytest.mark.parametrize(
    "text",
    [
        "```bash\npip install kvbench --no-deps\ntorchrun --nproc-per-node 2 -m kvbench verify --tp 2\n```\n",
        "```bash\nkvbench verify --json | python -c 'print(1)' --whatever\n```\n",
        "The `generate(prompt_lookup_num_tokens=3)` feature, `transformers-cli --foo`.\n",
        "| option | values | default |\n|---|---|---|\n| `--tp-timeout` | seconds | `300` |\n| `--json` | doc | off |\n",
    ],
)
def test_other_tools_and_right_text_pass(tmp_path: Path, text: str) -> None:
    page = tmp_path / "cli.md"
    page.write_text(text, encoding="utf-8")
    assert unknown_options([page], tmp_path) + wrong_defaults([page], tmp_path) == []
