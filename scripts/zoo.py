#!/usr/bin/env python
"""`kvbench verify --hf` over every causal LM type in transformers, each as a tiny random config (kvbench.hf.tiny).

    python scripts/zoo.py [--out results/zoo] [--types llama,gpt2] [--caches none,dynamic,static]
                          [--new-tokens 100] [--timeout 300] [--tp N] [--summary]
    python scripts/zoo.py --baseline results/zoo/zoo.csv [--out DIR | --against CSV] [--triage TOML]

For each type it writes OUT/configs/<type>/config.json, runs `kvbench verify --hf <it> --device cpu --json` in its
own process (a crash, a hang or an exit inside transformers cannot stop the sweep) and appends one row to
OUT/zoo.csv as it finishes: type, exit code, seconds, verdict, failing rows, skip reasons, the refusal line. A rerun
keeps the rows already there and runs only the missing types, writing every type's config either way (--fresh
starts over; delete a type's row to run it again). OUT/summary.md counts the verdicts: pass, pass with skips
(grouped by reason), nothing checked (exit 5: every row skipped), fail (the failing rows), refused (exit 2, its
line), crashed (exit 70), timed out, and types whose default config transformers itself cannot build. --summary writes OUT/summary.md from the rows OUT/zoo.csv
holds and runs nothing: the summary of a sweep still running, or stopped part way, says how many types it covers.

--baseline CSV compares the sweep in OUT/zoo.csv (or --against CSV) with an earlier one and runs nothing: it prints
the rows that moved (verdict, failing rows, skip reasons or refusal line), the types new in the sweep and those gone
from it, each with a class. A row the triage file names (default: triage.toml beside the baseline; its format is in
the committed results/zoo/triage.toml) takes that file's classes; any other moved row a provisional `better`, `worse`
or `changed`, untriaged. It writes the same as a Markdown table to diff.md (in --out when given, else beside the
sweep's table) and exits 0 when every moved row is triaged, 1 when one is not, 2 when a table or the triage file is
not one. A sweep records the transformers and torch it ran under and the kvbench commit in zoo.json, beside its table;
the diff's header shows them.

--tp N (default OUT: results/zoo-tp) sweeps the types whose config class declares a tensor-parallel plan
(`base_model_tp_plan`), each made tiny with heads and key/value heads that divide by N where the family allows. Every
rank must load the same weights, so each type's random model (the weights `verify --hf config.json` draws) is first
saved with save_pretrained to OUT/models/<type>/ in a process of its own, then checked with `kvbench verify --hf
OUT/models/<type> --tp N --device cpu --json`; a model that cannot be built is the row of that step (kvbench's
refusal line, or the crash). The seconds column counts both steps.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

FIELDS = ("type", "exit", "seconds", "verdict", "failing", "skips", "error")
VERDICTS = ("pass", "pass with skips", "nothing checked", "fail", "refused", "crashed", "timed out", "no config")
RECORDED = ("transformers", "torch", "kvbench_commit")  # zoo.json's record of what the sweep ran under


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.baseline:
        return diff(args)
    from functools import partial

    from kvbench.hf.tiny import model_types, tiny_config

    tiny_config = partial(tiny_config, tp=args.tp)
    out = Path(args.out)
    try:
        (out / "configs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _fail(f"--out {out}: {e.strerror or e}")
    table = out / "zoo.csv"
    if args.summary and not table.exists():
        _fail(f"--summary: {table} does not exist (the sweep writes it)")
    types = _types(args.types, model_types(tp_plan=args.tp > 1), args.tp)
    _same_options(out / "zoo.json", args)
    done = {} if args.fresh or not table.exists() else _finished(table)
    if args.summary:
        rows = [done[t] for t in types if t in done]
        (out / "summary.md").write_text(summary(rows, args, of=len(types)))
        print(f"wrote {out / 'summary.md'}: {len(rows)} of {len(types)} types have a row in {table}")
        return 0
    if not table.exists() or args.fresh:
        with table.open("w", newline="") as f:
            csv.DictWriter(f, FIELDS).writeheader()
    ran = 0
    for i, t in enumerate(types, 1):
        if t in done:  # finished earlier: its config is written again (the reproducers read it), not rerun
            with contextlib.suppress(Exception):  # a type whose default config does not build has none
                _write_config(t, tiny_config, out)
            continue
        row = _run_type(t, tiny_config, out, args)
        ran += 1
        with table.open("a", newline="") as f:  # as it goes: an interrupted sweep keeps every finished type
            csv.DictWriter(f, FIELDS).writerow(row)
        done[t] = row
        print(f"[{i}/{len(types)}] {t}: {row['verdict']} ({row['seconds']} s) {row['failing'] or row['error']}")
    if not ran:  # every type had a row: the table and its summary stay as they were made
        print(f"nothing to run: every type is in {table} (configs written to {out / 'configs'}; --fresh reruns)")
        return 0
    rows = [done[t] for t in types if t in done]
    others = [r for t, r in done.items() if t not in types]  # kept from an earlier run of other types
    tmp = table.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:  # in transformers' order at the end, a resumed run's rows included
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows + others)
    tmp.replace(table)
    (out / "summary.md").write_text(summary(rows, args))
    print(f"wrote {table} and {out / 'summary.md'}")
    return 0


def _types(text: str | None, known: list[str], tp: int) -> list[str]:
    """--types: model types transformers maps to a causal LM (with a tensor-parallel plan under --tp), each once;
    all of them when not given."""
    if text is None:
        return known
    types = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in types if t not in known]
    if not types or unknown:
        what = f"unknown model type(s) {', '.join(unknown[:3])}" if unknown else "no model type"
        which = " whose config declares base_model_tp_plan (--tp)" if tp > 1 else ""
        _fail(f"--types names {what}; the types are those of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES{which}")
    return types


def _same_options(path: Path, args) -> None:
    """--caches checked as verify checks it, and a resumed table's settings and release kept: rows of two settings
    or two releases never mix. A table started afresh records its settings and versions (_versions)."""
    import torch

    from kvbench.errors import KVBenchError
    from kvbench.hf.caches import parse_verify_caches

    try:
        parse_verify_caches(args.caches, torch.device("cpu"))
    except KVBenchError as e:
        _fail(f"--caches: {e}")
    options = {"caches": args.caches, "new_tokens": args.new_tokens} | ({"tp": args.tp} if args.tp > 1 else {})
    resumed = not args.fresh and (path.parent / "zoo.csv").exists()
    if resumed and path.exists():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = None
        settings = {k: v for k, v in earlier.items() if k not in RECORDED} if isinstance(earlier, dict) else earlier
        if settings != options:
            _fail(f"{path.parent} was made with other settings ({path.name}: {settings}); rerun with them, or --fresh")
        if not args.summary:
            _same_release(path, earlier)
        return  # kept as it was made: the versions are those the table was started with
    # a table already there without a zoo.json holds rows of unknown versions: only the settings are recorded
    path.write_text(json.dumps(options | ({} if resumed or args.summary else _versions())) + "\n")


def _versions() -> dict:
    """What a sweep runs under, recorded beside its table: transformers, torch, and kvbench's commit ("-dirty" when
    src/ has uncommitted changes; None outside a git checkout)."""
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "-uno", "--", "src"], capture_output=True)
        kvbench = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        kvbench = None
    return {"transformers": version("transformers"), "torch": version("torch"), "kvbench_commit": kvbench}


def _same_release(path: Path, earlier: dict) -> None:
    """A resumed table keeps the transformers and torch it was started with: rows of two releases never mix."""
    now = _versions()
    for package in ("transformers", "torch"):
        if earlier.get(package, now[package]) != now[package]:
            _fail(
                f"{path.parent} was made with {package} {earlier[package]} ({path.name}), this is {now[package]}: "
                "rows of two releases never mix; rerun with --fresh, or into another --out"
            )


def _fail(message: str) -> None:
    """Bad input: one line on stderr, exit 2 (as argparse does)."""
    print(f"zoo.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _finished(table: Path) -> dict[str, dict]:
    """The rows of an earlier run, to resume from; one line when the file is not this script's table."""
    with table.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != FIELDS:
            _fail(f"{table} is not a zoo table (columns {', '.join(FIELDS)}); use --fresh")
        return {r["type"]: r for r in reader}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="default: results/zoo, or results/zoo-tp with --tp")
    p.add_argument("--types", default=None, help="comma-separated model types (default: all)")
    p.add_argument("--caches", default="none,dynamic,static")
    p.add_argument("--new-tokens", type=int, default=100)
    p.add_argument("--timeout", type=int, default=300, help="seconds per type")
    p.add_argument("--fresh", action="store_true", help="start over instead of keeping finished types")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: each type saved, then verify --tp N")
    p.add_argument("--summary", action="store_true", help="write summary.md from the rows zoo.csv holds; run nothing")
    p.add_argument("--baseline", default=None, help="a zoo.csv to compare the sweep with; runs nothing")
    p.add_argument("--against", default=None, help="with --baseline: the sweep's zoo.csv (default: OUT/zoo.csv)")
    p.add_argument("--triage", default=None, help="with --baseline: the triage file (default: beside the baseline)")
    args = p.parse_args(argv)
    if args.summary and args.fresh:
        p.error("--summary reads the rows zoo.csv holds; --fresh would drop them")
    if args.baseline and (args.summary or args.fresh or args.types):
        p.error("--baseline compares two tables and runs nothing: --summary, --fresh and --types do not apply")
    if not args.baseline and (args.against or args.triage):
        p.error("--against and --triage go with --baseline")
    args.out_given = args.out is not None
    if args.new_tokens < 2 or args.timeout < 1:
        p.error("--new-tokens must be >= 2 (a decode step) and --timeout >= 1 second")
    if args.tp < 1:
        p.error("--tp must be >= 1 (1: no tensor parallelism)")
    if args.out is None:
        args.out = "results/zoo-tp" if args.tp > 1 else "results/zoo"
    return args


def _run_type(t: str, tiny_config, out: Path, args) -> dict:
    row = dict.fromkeys(FIELDS, "")
    row["type"] = t
    try:
        path = _write_config(t, tiny_config, out)
    except Exception as e:  # transformers' own default config for this type does not build
        row.update(exit="", seconds=0, verdict="no config", error=_line(f"{type(e).__name__}: {e}"))
        return row
    verify = ["verify", "--hf", str(path), "--device", "cpu", "--caches", args.caches]
    verify += ["--new-tokens", str(args.new_tokens), "--json"]
    t0 = time.perf_counter()
    if args.tp > 1:  # every rank loads the same weights: the random model saved first, in a process of its own
        model = out / "models" / t
        saved = _run([__file__, "--save", str(path), str(model)], args.timeout)
        if saved is None or saved.returncode != 0:
            return _ended(row, saved, t0, args.timeout)
        verify[2] = str(model)
        verify += ["--tp", str(args.tp), "--tp-timeout", str(args.timeout)]
    proc = _run(["-m", "kvbench", *verify], args.timeout - (time.perf_counter() - t0))
    return _ended(row, proc, t0, args.timeout)


def _ended(row: dict, proc: subprocess.CompletedProcess | None, t0: float, timeout: int) -> dict:
    """The row of a type whose last step ended with `proc` (None: the type ran past its timeout)."""
    if proc is None:
        return {**row, "exit": "", "seconds": timeout, "verdict": "timed out"}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["exit"] = proc.returncode
    return {**row, **_judged(proc)}


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """`python *args` in a session of its own, its output captured; None when it outlived `timeout` seconds. Past
    it, or when the sweep is interrupted, it is stopped as Ctrl-C would stop it (SIGTERM: kvbench's launcher then
    ends its ranks, which run in sessions of their own), and killed 30 s later if it is still there."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=max(timeout, 1))
    except BaseException as e:  # the timeout, or Ctrl-C: nothing it started outlives the sweep
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            return None
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _save(config: str, model: str) -> int:
    """`zoo.py --save CONFIG DIR`: the random model `verify --hf CONFIG` checks (its seed and init scale) saved to
    DIR with save_pretrained; a refusal is kvbench's one line and exit 2, as verify's own."""
    import torch

    from kvbench.cli.app import CHECK_INIT_STD
    from kvbench.errors import KVBenchError
    from kvbench.hf.models import load_hf

    try:
        loaded = load_hf(config, torch.device("cpu"), torch.float32, init_std=CHECK_INIT_STD)
    except KVBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loaded.model.save_pretrained(model)
    return 0


def _write_config(t: str, tiny_config, out: Path) -> Path:
    path = out / "configs" / t / "config.json"
    config = tiny_config(t)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1, default=str) + "\n")
    return path


def _judged(proc: subprocess.CompletedProcess) -> dict:
    err = _line(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "").removeprefix("error: ")
    if proc.returncode == 2:
        return {"verdict": "refused", "error": err}
    if proc.returncode not in (0, 1, 5):  # 5: every row skipped, nothing checked
        return {"verdict": "crashed", "error": err}
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"verdict": "crashed", "error": "stdout is not one JSON document: " + _line(proc.stdout[:200])}
    rows = report["checks"]
    failing = [f"{r['name']}/{r['cache']}" for r in rows if not r["passed"] and not r["skipped"]]
    skips = sorted({_reason(r["detail"]) for r in rows if r["skipped"]})
    verdict = "fail" if failing else ("pass with skips" if skips else "pass")
    if proc.returncode == 5:
        verdict = "nothing checked"
    return {"verdict": verdict, "failing": " ".join(failing), "skips": " | ".join(skips)}


def _reason(detail: str) -> str:
    """A skip's reason without its measured figures, so equal reasons group."""
    return detail.split("; measured:")[0].split(" after ")[0]


def _line(text: str) -> str:
    return " ".join(str(text).split())[:400]


def summary(rows: list[dict], args, of: int | None = None) -> str:
    """The summary of `rows`; `of`: how many types the sweep covers, when `rows` may be fewer (a partial table)."""
    counts = Counter(r["verdict"] for r in rows)
    tp = f" --tp {args.tp}" if args.tp > 1 else ""
    which = " with a tensor-parallel plan" if args.tp > 1 else ""
    how = ", each saved and split by transformers' plan" if args.tp > 1 else ""
    left = 0 if of is None else of - len(rows)
    partial = (
        [f"Partial: {len(rows)} of {of} types have a row; the same command runs the other {left}.", ""] if left else []
    )
    lines = [
        f"# `kvbench verify --hf{tp}` over transformers' causal-LM types{which}",
        "",
        f"Command: `python scripts/zoo.py{tp} --caches {args.caches} --new-tokens {args.new_tokens}` "
        f"({len(rows)} types, tiny random configs from kvbench.hf.tiny{how}, CPU, fp32).",
        "",
        *partial,
        "| verdict | types |",
        "|---|---|",
        *[f"| {v} | {counts[v]} |" for v in VERDICTS if counts[v]],
        "",
    ]
    reasons = Counter(s for r in rows for s in r["skips"].split(" | ") if s)
    if reasons:
        lines += ["## Skip reasons (rows, by types)", "", "| types | reason |", "|---|---|"]
        lines += [f"| {n} | {reason} |" for reason, n in reasons.most_common()]
        lines.append("")
    for verdict, field in (
        ("fail", "failing"),
        ("refused", "error"),
        ("crashed", "error"),
        ("no config", "error"),
        ("timed out", "error"),
    ):
        chosen = [r for r in rows if r["verdict"] == verdict]
        if chosen:
            lines += [f"## {verdict}", "", "| type | " + field + " |", "|---|---|"]
            lines += [f"| {r['type']} | {r[field]} |" for r in chosen]
            lines.append("")
    return "\n".join(lines)


# ---- --baseline: the rows that moved between two sweeps, each classed ----

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
            _fail(f"--baseline {baseline} is the sweep's own table; --out or --against names the new sweep")
        entries = read_triage(triage, f"--triage {triage}") if args.triage or triage.exists() else []
    except KVBenchError as e:
        _fail(str(e))
    made = {"baseline": _recorded(baseline), "sweep": _recorded(sweep)}
    rows = moved(old, new, entries, made["sweep"].get("transformers"))
    head = _diff_head(baseline, sweep, made, triage if args.triage or triage.exists() else None)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "diff.md").write_text(diff_markdown(rows, head, len(new)))
    except OSError as e:
        _fail(f"cannot write {out / 'diff.md'}: {e.strerror or e}")
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
        lines += [f"  {c}" if len(c) <= 96 else f"  {c[:93]}..." for c in map(_line, r["changes"])]
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["--save"]:  # one step of a --tp sweep, in its own process (see _save)
        sys.exit(_save(*sys.argv[2:4]))
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # stdout's reader (head, less) stopped reading: nothing more to say, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # as a shell reports a process that SIGPIPE ended
    except KeyboardInterrupt:  # the rows of every finished type are already in zoo.csv
        print(
            "zoo.py: interrupted; every finished type's row is in its zoo.csv (rerun to resume)",
            file=sys.stderr,
        )
        sys.exit(130)
