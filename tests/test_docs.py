"""The documentation holds each paragraph once and every relative link lands: README.md and docs/*.md, pure text.

A line of 60 or more characters may appear in one place only: in one of the files, once. Code blocks count (a
command line or an output copied into a second page is a paragraph kept twice); a line repeated inside one code
block is real output repeating itself and counts once. Table separator rows and lines of markup alone (box-drawing
borders, rules) are not text and are ignored. One allowance: the outputs of two commands shown on one page (the
blocks marked `<!-- output: ... -->`, scripts/docs_outputs.py) may share lines, as two runs of a tool share its
headers and footers; across pages they may not, and no two blocks show the output of the same command.
"""

import re
import unicodedata
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_LEN = 60

FENCE = re.compile(r"^\s*(```|~~~)")
MARKER = re.compile(r"^<!--\s*output:\s*(.*?)\s*-->\s*$")
SEPARATOR = re.compile(r"^\s*\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*$")  # | --- | :---: |
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def units(text: str):
    """(line number, stripped line, unit) for every line; a code block is one unit ("output" when a marker names
    the command that printed it), every other line its own."""
    in_fence, block, kind, previous = False, 0, "block", ""
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            block += 1
            kind = "output" if in_fence and MARKER.match(previous) else "block"
            previous = line
            continue
        previous = line
        yield n, line.strip(), (kind, block) if in_fence else ("line", n)


def is_text(line: str) -> bool:
    return len(line) >= MIN_LEN and not SEPARATOR.match(line) and any(ch.isalnum() for ch in line)


def test_no_line_kept_in_two_places():
    seen = defaultdict(set)  # line -> {(file, unit)}
    where = defaultdict(list)  # line -> ["file:line", ...]
    for path in doc_files():
        name = path.relative_to(ROOT).as_posix()
        for n, line, unit in units(path.read_text(encoding="utf-8")):
            if is_text(line) and (name, unit) not in seen[line]:
                seen[line].add((name, unit))
                where[line].append(f"{name}:{n}")

    def kept_twice(line: str) -> bool:
        places = seen[line]
        files = {name for name, _ in places}
        return len(files) > 1 or (len(places) > 1 and any(unit[0] != "output" for _, unit in places))

    repeated = {line: where[line] for line in where if kept_twice(line)}
    report = "\n".join(f"{', '.join(p)}: {line[:100]}" for line, p in sorted(repeated.items(), key=lambda i: i[1]))
    assert not repeated, f"{len(repeated)} line(s) kept in two places (say it once, link from the other):\n{report}"


def test_no_command_output_shown_twice():
    shown = defaultdict(list)
    for path in doc_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = MARKER.match(line)
            if m and m.group(1).split(" (")[0] != "transcript":
                shown[m.group(1).split(" (")[0]].append(f"{path.relative_to(ROOT).as_posix()}:{n}")
    twice = {cmd: places for cmd, places in shown.items() if len(places) > 1}
    assert not twice, "\n".join(f"{', '.join(p)}: {cmd}" for cmd, p in twice.items())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.strip().lower()
    kept = [ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM"]
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, counts, in_fence = set(), defaultdict(int), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            base = slug(m.group(1))
            found.add(base if counts[base] == 0 else f"{base}-{counts[base]}")
            counts[base] += 1
    return found


def links(path: Path):
    in_fence = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            for m in LINK.finditer(INLINE_CODE.sub("", line)):
                yield n, m.group(1)


def test_every_relative_link_lands():
    broken = []
    for path in doc_files():
        name = path.relative_to(ROOT).as_posix()
        for n, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{name}:{n}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{name}:{n}: {target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_guard_can_fail():
    """The two checks above see what they are meant to see."""
    assert slug("`kvbench verify --hf`: any Hugging Face causal LM, through transformers' own caches") == (
        "kvbench-verify---hf-any-hugging-face-causal-lm-through-transformers-own-caches"
    )
    assert slug("A real result (CPU)") == "a-real-result-cpu"
    text = "a\n```\n" + "x" * 70 + "\n" + "x" * 70 + "\n```\n" + "x" * 70 + "\n"
    got = [(line, unit) for _, line, unit in units(text) if is_text(line)]
    assert len({u for _, u in got}) == 2  # twice in one block counts once; the prose line is a second place
    marked = "<!-- output: kvbench memory --all -->\n```text\n" + "y" * 70 + "\n```\n"
    assert [u[0] for _, line, u in units(marked) if is_text(line)] == ["output"]
    assert not is_text("|---|---|:---:|" + "-" * 60) and not is_text("┏" + "━" * 70 + "┓")
    found = list(links(Path(__file__).parent.parent / "README.md"))
    assert found, "README.md has relative links"


def test_every_page_the_code_names_exists():
    """kvbench's own messages and docstrings point readers at docs/PAGE.md#anchor: each must land."""
    broken = []
    for path in sorted((ROOT / "src").rglob("*")):
        if path.suffix not in (".py", ".json", ".toml") or not path.is_file():
            continue
        for m in re.finditer(r"docs/([\w-]+\.md)(?:#([\w-]+))?", path.read_text(encoding="utf-8")):
            page = ROOT / "docs" / m.group(1)
            if not page.exists() or (m.group(2) and m.group(2) not in anchors(page)):
                broken.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not broken, "pages the code names that do not exist:\n" + "\n".join(broken)


def test_every_script_the_code_and_docs_name_exists():
    """A docstring or page that says `scripts/NAME.py measures it` must point at a script that is there."""
    missing = []
    texts = [*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "Makefile"]
    for path in sorted(texts):
        for m in re.finditer(r"scripts/([\w-]+\.(?:py|sh))", path.read_text(encoding="utf-8")):
            if not (ROOT / "scripts" / m.group(1)).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "scripts named that do not exist:\n" + "\n".join(missing)
