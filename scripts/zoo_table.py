"""The zoo's table (zoo.csv): its columns and verdicts, a table read back, and `zoo.py --baseline`: a sweep compared
with an earlier one, the rows that moved classed by the triage file, printed and written to diff.md. scripts/zoo.py
documents the options; this module is imported by it."""

from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path

FIELDS = ("type", "exit", "seconds", "verdict", "failing", "skips", "error")
VERDICTS = ("pass", "pass with skips", "nothing checked", "fail", "refused", "crashed", "timed out", "no config")
RECORDED = ("transformers", "torch", "kvbench_commit")  # zoo.json's record of what the sweep ran under


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit 2 (as argparse does)."""
    print(f"zoo.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def one_line(text: str) -> str:
    """`text` on one line, at most 400 characters: a cell of zoo.csv."""
    return " ".join(str(text).split())[:400]


TRIAGE_CLASSES = ("transformers defect", "transformers fix", "transformers change", "kvbench reading")
TRIAGE_KEYS = ("types", "transformers", "class", "note", "reproducer", "upstream")
# how far a verdict is from a clean pass; a move between two verdicts of one rank is `changed`
RANK = {"pass": 0, "pass with skips": 1, "nothing checked": 2, "fail": 2, "refused": 2}
RANK |= {"crashed": 3, "timed out": 3, "no config": 3}


def diff(args) -> int:
    """--baseline: print the rows that moved and write diff.md; 1 when one of them is untriaged."""
    from kvbench.errors import KVBenchError

    sweep = Path(args.against or Path(args.out) / "zoo.csv")
    baseline = Path(args.baseline)
    triage = Path(args.triage) if args.triage else baseline.parent / "triage.toml"
    out = Path(args.out) if args.out_given or not args.against else sweep.parent
    try:
        old = read_table(baseline, f"--baseline {baseline}")
        new = read_table(sweep, f"--against {sweep}" if args.against else f"the sweep {sweep}")
        if baseline.resolve() == sweep.resolve():
            fail(f"--baseline {baseline} is the sweep's own table; --out or --against names the new sweep")
        entries = read_triage(triage, f"--triage {triage}") if args.triage or triage.exists() else []
    except KVBenchError as e:
        fail(str(e))
    made = {"baseline": _recorded(baseline), "sweep": _recorded(sweep)}
    rows = moved(old, new, entries, made["sweep"].get("transformers"))
    head = _diff_head(baseline, sweep, made, triage if args.triage or triage.exists() else None)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "diff.md").write_text(diff_markdown(rows, head, len(new)))
    except OSError as e:
        fail(f"cannot write {out / 'diff.md'}: {e.strerror or e}")
    print("\n".join([*head, "", *_diff_text(rows, len(new)), f"wrote {out / 'diff.md'}"]))
    return 1 if any(not r["triaged"] for r in rows) else 0


def read_table(path: Path, label: str) -> dict[str, dict]:
    """A zoo.csv's rows by type; a file that is not one is one line (KVBenchError), naming the line at fault."""
    from kvbench.errors import KVBenchError
    from kvbench.files import read_text

    reader = csv.DictReader(io.StringIO(read_text(path, label, 64 * 2**20, "a zoo table")))
    rows: dict[str, dict] = {}
    try:
        if tuple(reader.fieldnames or ()) != FIELDS:
            raise KVBenchError(f"{label} is not a zoo table (columns {', '.join(FIELDS)})")
        for row in reader:
            where = f"{label} line {reader.line_num}"
            if None in row or None in row.values():
                raise KVBenchError(f"{where} does not have the {len(FIELDS)} columns of a zoo row")
            if not row["type"]:
                raise KVBenchError(f"{where} has no type")
            if row["verdict"] not in VERDICTS:
                raise KVBenchError(f"{where}: verdict {row['verdict']!r} is not one of {', '.join(VERDICTS)}")
            if row["type"] in rows:
                raise KVBenchError(f"{where}: {row['type']} has a row already")
            rows[row["type"]] = row
    except csv.Error as e:
        raise KVBenchError(f"{label} line {reader.line_num} is not CSV: {e}") from None
    return rows


def read_triage(path: Path, label: str) -> list[dict]:
    """The [[triage]] tables of a triage file (format: results/zoo/triage.toml), each checked; one line if not."""
    from kvbench.errors import KVBenchError
    from kvbench.files import load_toml

    doc = load_toml(path, label, noun="a triage file")
    if set(doc) - {"triage"} or not isinstance(doc.get("triage", []), list):
        raise KVBenchError(f"{label}: a triage file holds [[triage]] tables only (found {', '.join(sorted(doc))})")
    for n, entry in enumerate(doc.get("triage", []), 1):
        where = f"{label}, [[triage]] {n}"
        if not isinstance(entry, dict):
            raise KVBenchError(f"{where} is not a table")
        unknown = sorted(set(entry) - set(TRIAGE_KEYS))
        if unknown:
            raise KVBenchError(f"{where}: unknown key {unknown[0]!r} (the keys: {', '.join(TRIAGE_KEYS)})")
        types = entry.get("types")
        if not types or not isinstance(types, list) or not all(isinstance(t, str) and t for t in types):
            raise KVBenchError(f"{where}: `types` must be a list of model types")
        if entry.get("class") not in TRIAGE_CLASSES:
            raise KVBenchError(f"{where}: `class` must be one of {', '.join(TRIAGE_CLASSES)}")
        for key in TRIAGE_KEYS[1:]:
            if not isinstance(entry.get(key, ""), str):
                raise KVBenchError(f"{where}: `{key}` must be text, in quotes")
        if not entry.get("note"):
            raise KVBenchError(f"{where}: `note` is required: what moved and why")
        if entry["class"] == "transformers defect" and not entry.get("reproducer"):
            raise KVBenchError(f"{where}: a transformers defect needs a `reproducer` (a script or a snippet)")
    return doc.get("triage", [])


def _recorded(table: Path) -> dict:
    """The zoo.json beside a table (its settings and the versions it ran under); {} when absent or unreadable."""
    try:
        doc = json.loads((table.parent / "zoo.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def moved(old: dict[str, dict], new: dict[str, dict], entries: list[dict], release: str | None) -> list[dict]:
    """Each type whose row moved, new or gone, in the sweep's order: its two rows (None where absent), what moved,
    its classes and whether it is triaged (a new or gone type is, by its class)."""
    rows = []
    for t in [*new, *(t for t in old if t not in new)]:
        before, after = old.get(t), new.get(t)
        changes = _changes(before, after) if before and after else []
        if before and after and before["verdict"] == after["verdict"] and not changes:
            continue
        found = [e for e in entries if t in e["types"] and _applies(e.get("transformers"), release)]
        automatic = ["new type"] if before is None else ["removed type"] if after is None else []
        classes = list(dict.fromkeys(automatic + [e["class"] for e in found]))
        row = {"type": t, "before": before, "after": after, "changes": changes, "entries": found}
        rows.append(row | {"classes": classes or [_direction(before, after)], "triaged": bool(classes)})
    return rows


def _applies(wanted: str | None, release: str | None) -> bool:
    """A triage entry for `wanted` ("5.25.0", or "5.25" for every 5.25.x; None: any) covers a sweep of `release`."""
    return wanted is None or (release is not None and (release == wanted or release.startswith(wanted + ".")))


def _parts(row: dict, field: str) -> set[str]:
    sep = " | " if field == "skips" else " "
    return {p.strip() for p in row[field].split(sep) if p.strip()}


def _error(row: dict) -> str:
    """The refusal line as compared: without the folder its sweep wrote the config to, or the rank that said it."""
    text = re.sub(r"^rank \d+: ", "", row["error"])
    return re.sub(rf"\S*?((?:configs|models)/{re.escape(row['type'])})\b", r"\1", text)


def _changes(before: dict, after: dict) -> list[str]:
    """What moved between two rows of a type besides the verdict, one line each (the seconds are not compared)."""
    old, new = _parts(before, "failing"), _parts(after, "failing")
    failing = [*(f"+{p}" for p in sorted(new - old)), *(f"-{p}" for p in sorted(old - new))]
    changes = [f"failing: {' '.join(failing)}"] if failing else []
    old, new = _parts(before, "skips"), _parts(after, "skips")
    changes += [f"new skip: {p}" for p in sorted(new - old)] + [f"skip gone: {p}" for p in sorted(old - new)]
    if _error(before) != _error(after):
        changes += [f"error was: {before['error'] or '(none)'}", f"error now: {after['error'] or '(none)'}"]
    return changes


def _direction(before: dict, after: dict) -> str:
    """The provisional class of an untriaged row: better or worse by verdict, then by the failing rows and the skip
    reasons (fewer is better); `changed` when neither way."""
    a, b = RANK[before["verdict"]], RANK[after["verdict"]]
    if a != b:
        return "better" if b < a else "worse"
    if before["verdict"] == after["verdict"]:
        for field in ("failing", "skips"):
            old, new = _parts(before, field), _parts(after, field)
            if old != new:
                return "better" if new < old else "worse" if new > old else "changed"
    return "changed"


def _made_with(recorded: dict) -> str:
    shown = [f"{k} {recorded[k]}" for k in ("transformers", "torch") if recorded.get(k)]
    if recorded.get("kvbench_commit"):
        shown.append(f"kvbench {recorded['kvbench_commit']}")
    return ", ".join(shown) or "versions not recorded"


def _diff_head(baseline: Path, sweep: Path, made: dict, triage: Path | None) -> list[str]:
    head = [
        f"baseline: {baseline} ({_made_with(made['baseline'])})",
        f"sweep:    {sweep} ({_made_with(made['sweep'])})",
        f"triage:   {triage if triage else 'none (every moved row is untriaged)'}",
    ]
    settings = [{k: v for k, v in m.items() if k not in RECORDED} for m in made.values()]
    if all(settings) and settings[0] != settings[1]:
        flags = [" ".join(f"--{k.replace('_', '-')} {v}" for k, v in s.items()) for s in settings]
        head += ["note: the two ran with other settings, and rows may move for that alone:"]
        head += [f"  baseline {flags[0]}", f"  sweep    {flags[1]}"]
    return head


def _counts(rows: list[dict], of: int) -> str:
    new, gone = sum(r["before"] is None for r in rows), sum(r["after"] is None for r in rows)
    untriaged = sum(not r["triaged"] for r in rows)
    return (
        f"{len(rows)} rows moved ({of} types in the sweep): {new} new, {gone} removed, "
        f"{len(rows) - untriaged} triaged, {untriaged} untriaged"
    )


def _verdicts(row: dict) -> str:
    return " -> ".join(r["verdict"] if r else "(absent)" for r in (row["before"], row["after"]))


def _diff_text(rows: list[dict], of: int) -> list[str]:
    if not rows:
        return [f"nothing moved: the {of} types of the sweep have the baseline's rows"]
    lines = [_counts(rows, of), ""]
    for r in rows:
        lines += [f"{r['type']}: {_verdicts(r)}", f"  class: {_label(r)}"]
        lines += [f"  {c}" if len(c) <= 96 else f"  {c[:93]}..." for c in map(one_line, r["changes"])]
    return lines


def _label(row: dict) -> str:
    """A moved row's classes: `transformers defect + kvbench reading`, or `worse, untriaged`."""
    return " + ".join(row["classes"]) + ("" if row["triaged"] else ", untriaged")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _finding(n: int, entry: dict) -> list[str]:
    """One triage finding under the diff's table: its class, the types it names, its note, reproducer and status."""
    pad = " " * len(f"{n}. ")  # a list item's continuation lines
    lines = [f"{n}. **{entry['class']}** ({', '.join(entry['types'])}): {entry['note']}"]
    reproducer = entry.get("reproducer", "").strip()
    if "\n" in reproducer:  # a snippet
        lines += [f"{pad}- reproducer:", "", f"{pad}  ```python", *[f"{pad}  {x}" for x in reproducer.splitlines()]]
        lines += [f"{pad}  ```", ""]
    elif reproducer:
        lines.append(f"{pad}- reproducer: `{reproducer}`")
    if entry.get("upstream"):
        lines.append(f"{pad}- upstream: {entry['upstream']}")
    return lines


def diff_markdown(rows: list[dict], head: list[str], of: int) -> str:
    """diff.md: the moved rows as a table, each triage finding they cite written once beneath it."""
    lines = ["# Zoo rows that moved", "", *[f"- {h.strip()}" for h in head], ""]
    if not rows:
        return "\n".join([*lines, f"Nothing moved: the {of} types of the sweep have the baseline's rows.", ""])
    cited = list({id(e): e for r in rows for e in r["entries"]}.values())  # in order of first citation
    number = {id(e): n for n, e in enumerate(cited, 1)}
    lines += [
        _counts(rows, of) + ".",
        "",
        "| type | class | verdict | what moved | findings |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        what = "<br>".join(_cell(c) for c in r["changes"])
        refs = ", ".join(str(number[id(e)]) for e in r["entries"])
        lines.append(f"| {r['type']} | {_label(r)} | {_verdicts(r)} | {what} | {refs} |")
    if cited:
        lines += ["", "## Findings (the triage file's)", ""]
        for n, e in enumerate(cited, 1):
            lines += _finding(n, e)
    return "\n".join([*lines, ""])
