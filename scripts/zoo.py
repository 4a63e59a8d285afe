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
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # zoo_table.py beside this file, also when loaded by path
from zoo_table import (  # noqa: E402
    FIELDS,
    RECORDED,
    VERDICTS,
    diff,
    fail,
    one_line,
)


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
        fail(f"--out {out}: {e.strerror or e}")
    table = out / "zoo.csv"
    if args.summary and not table.exists():
        fail(f"--summary: {table} does not exist (the sweep writes it)")
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
        fail(f"--types names {what}; the types are those of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES{which}")
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
        fail(f"--caches: {e}")
    options = {"caches": args.caches, "new_tokens": args.new_tokens} | ({"tp": args.tp} if args.tp > 1 else {})
    resumed = not args.fresh and (path.parent / "zoo.csv").exists()
    if resumed and path.exists():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = None
        settings = {k: v for k, v in earlier.items() if k not in RECORDED} if isinstance(earlier, dict) else earlier
        if settings != options:
            fail(f"{path.parent} was made with other settings ({path.name}: {settings}); rerun with them, or --fresh")
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
            fail(
                f"{path.parent} was made with {package} {earlier[package]} ({path.name}), this is {now[package]}: "
                "rows of two releases never mix; rerun with --fresh, or into another --out"
            )


def _finished(table: Path) -> dict[str, dict]:
    """The rows of an earlier run, to resume from; one line when the file is not this script's table."""
    with table.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != FIELDS:
            fail(f"{table} is not a zoo table (columns {', '.join(FIELDS)}); use --fresh")
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
        row.update(exit="", seconds=0, verdict="no config", error=one_line(f"{type(e).__name__}: {e}"))
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
    err = one_line(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "").removeprefix("error: ")
    if proc.returncode == 2:
        return {"verdict": "refused", "error": err}
    if proc.returncode not in (0, 1, 5):  # 5: every row skipped, nothing checked
        return {"verdict": "crashed", "error": err}
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"verdict": "crashed", "error": "stdout is not one JSON document: " + one_line(proc.stdout[:200])}
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
