"""`kvbench compare`: a candidate bench run against a baseline, row by row; the CI gate for decode speed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import JustifyMethod

from kvbench import console
from kvbench.cli.app import command
from kvbench.console import fitted, line, out, print_gate, shared_columns, styled, wrote
from kvbench.errors import KVBenchError
from kvbench.options import option
from kvbench.text import md

FORMATS = ("table", "md", "json")


@dataclass
class CompareOptions:
    """One `kvbench compare` command line."""

    baseline: Path = option(argument=True, help="The reference run folder (written by kvbench bench).")
    candidate: Path = option(argument=True, help="The run folder to judge against it.")
    alpha: float = option(
        "--alpha", default=0.01, help="Significance level of the Mann-Whitney U test on decode steps."
    )
    threshold: str = option(
        "--threshold",
        default="5%",
        help="Minimum TPOT change that counts, e.g. 5% or 0.05 (smaller: no change).",
    )
    fail_on: str | None = option(
        "--fail-on",
        default=None,
        help="Exit 1 when any row regresses: slower (TPOT), slower-ttft, memory, comma-separated (the CI gate).",
    )
    fmt: str = option("--format", "-f", default="table", help="table (Rich), md (Markdown for a pull request) or json.")
    allow_env_change: bool = option(
        "--allow-env-change",
        default=False,
        help="Compare runs from different devices, dtypes or library versions (the changes are printed).",
    )
    out_dir: str | None = option(
        "--out",
        "-o",
        default=None,
        help="Where compare.png and compare.json go (default: the CANDIDATE folder).",
    )


@command(CompareOptions)
def compare(o: CompareOptions) -> None:
    """Compare two bench runs: TPOT ratio with a confidence interval and a verdict per row.

    Rows are matched on engine, cache, model, weights, dtype, device, prompt length, new tokens and batch. TTFT is
    tested the same way on its repeats (ttft.csv), with its own verdict.
    Exit 0; 1 with --fail-on when a row regresses; 2 on bad input."""
    from kvbench.results import compare as C

    if o.fmt not in FORMATS:
        raise KVBenchError(f"--format {o.fmt!r}: choose table, md or json")
    if o.out_dir is not None and not o.out_dir.strip():
        raise KVBenchError(
            "--out is empty; give a folder for compare.png and compare.json (or leave --out out for the candidate "
            "folder)"
        )
    gates = C.parse_fail_on(o.fail_on)
    comparison, files = run_compare(
        o.baseline, o.candidate, o.alpha, C.parse_threshold(o.threshold), o.allow_env_change, o.out_dir
    )
    for text in comparison.gate_warnings(gates):
        console.warn(text)
    if o.fmt == "json":
        console.print_json(json_any(comparison, gates, files))
    elif o.fmt == "md":
        typer.echo(markdown_any(comparison, gates), nl=False)
        console.note(f"wrote {', '.join(f.name for f in files)} in {files[0].parent}")
    else:
        render_any(comparison, gates, files)
    if comparison.regressions(gates):
        raise typer.Exit(1)


def run_compare(
    baseline,
    candidate,
    alpha: float = 0.01,
    threshold: float = 0.05,
    allow_env_change: bool = False,
    out_dir=None,
):
    """Compare, warn about allowed environment changes, write compare.png and compare.json (into the candidate
    folder unless `out_dir`); returns the Comparison and the files written. Shared with `bench --baseline`."""
    from pathlib import Path

    from kvbench.results import compare as C
    from kvbench.results.plots import compare_figure
    from kvbench.results.rundir import prepare_run_dir, write_json

    _keep_other_comparison(Path(out_dir or candidate) / "compare.json", baseline)
    if _endpoint_runs(baseline, candidate):  # two bench --endpoint runs: their own comparison
        from kvbench.cli.compare_endpoint import run_endpoint_compare

        where = Path(out_dir or candidate).expanduser()
        endpoint, files = run_endpoint_compare(baseline, candidate, alpha, threshold, allow_env_change, where)
        warn_about(endpoint)
        return endpoint, files
    comparison = C.compare_runs(baseline, candidate, alpha, threshold, allow_env_change)
    warn_about(comparison)
    where = prepare_run_dir(out_dir or comparison.candidate)
    png, js = where / "compare.png", where / "compare.json"
    compare_figure(comparison, png)
    write_json(js, C.json_doc(comparison, [], [png, js]))
    return comparison, [png, js]


def _endpoint_runs(baseline, candidate) -> bool:
    """Are both folders bench --endpoint runs? One of each kind is refused: they measure different things."""
    from kvbench.results.endpoint_runs import is_endpoint_run

    kinds = [is_endpoint_run(p) for p in (baseline, candidate)]
    if kinds[0] != kinds[1]:
        which = ("baseline", "candidate")[kinds.index(True)]
        raise KVBenchError(
            f"the {which} is a bench --endpoint run (a server's latency) and the other a bench sweep: compare two "
            "runs of one kind"
        )
    return kinds[0]


def json_any(comparison, gates: list[str], files: list[Path]) -> dict:
    """The JSON document of either kind of comparison."""
    from kvbench.results import compare as C
    from kvbench.results import endpoint_compare as E

    if isinstance(comparison, E.EndpointComparison):
        return E.json_doc(comparison, gates, files)
    return C.json_doc(comparison, gates, files)


def markdown_any(comparison, gates: list[str]) -> str:
    from kvbench.cli.compare_endpoint import endpoint_markdown
    from kvbench.results.endpoint_compare import EndpointComparison

    if isinstance(comparison, EndpointComparison):
        return endpoint_markdown(comparison, gates)
    return markdown(comparison, gates)


def render_any(comparison, gates: list[str], files: list[Path]) -> None:
    from kvbench.cli.compare_endpoint import render_endpoint_compare
    from kvbench.results.endpoint_compare import EndpointComparison

    if isinstance(comparison, EndpointComparison):
        render_endpoint_compare(comparison, gates, files)
    else:
        render_compare(comparison, gates, files)


def _keep_other_comparison(js, baseline) -> None:
    """A folder's compare.json against another baseline is another comparison's result: never replaced silently.
    The same comparison run again (same baseline) replaces its own files."""
    import json
    from pathlib import Path

    js = Path(js)
    try:
        earlier = json.loads(js.read_text()).get("baseline") if js.is_file() else None
    except (OSError, ValueError, AttributeError):
        earlier = None  # unreadable: nothing worth keeping is lost by writing a readable one
    if earlier is not None and Path(str(earlier)).resolve() != Path(str(baseline)).resolve():
        raise KVBenchError(
            f"{js} holds the comparison against {earlier}; write this one elsewhere with --out DIR (or remove that "
            "file to replace it)"
        )


def warn_about(comparison) -> None:
    """One warning line each: an allowed environment change, rows matched without a key, a measured condition that
    changed between the runs, a run whose sweep did not finish."""
    from kvbench.results.environment import describe_changes, describe_context

    if comparison.env_changes:
        console.warn(f"comparing across an environment change: {describe_changes(comparison.env_changes)}")
    if comparison.relaxed_keys:
        console.warn(f"rows matched without {' and '.join(comparison.relaxed_keys)} (the runs differ in it)")
    changed = [f for f in comparison.context if f.differs]
    if changed:
        console.warn(
            f"the machine measured differently in the two runs ({describe_context(changed)}); timings may differ "
            "for that reason too"
        )
    for text in comparison.unfinished:
        console.warn(text)
    for text in comparison.warnings:
        console.warn(text)


# --- rendering ---
VERDICT_STYLE = {"slower": "bold red", "faster": "bold green", "no significant change": "dim"}


def _ttft_verdict(r) -> str:
    """The TTFT verdict: faster, slower, no significant change, inconclusive (n=3), no ttft.csv."""
    return r.ttft.ttft_verdict if r.ttft is not None else "no ttft.csv"


def _x(v: float, digits: int = 3) -> str:
    return "-" if v != v else f"×{v:.{digits}f}"  # v != v: NaN (a run without the column)


def _ms(v: float) -> str:
    """About three significant digits, trailing zeros kept: 2.20, 14.5, 312."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _delta(v: float, spec: str = ".1f") -> str:
    return "-" if v != v else "0" if v == 0 else format(v, "+" + spec)


def _git(g) -> str:
    if not isinstance(g, dict) or not g.get("commit"):
        return "unknown"
    return str(g["commit"])[:7] + (" (uncommitted changes)" if g.get("dirty") else "")


def _has_agreement(c) -> bool:
    return any(r.token_agreement_baseline == r.token_agreement_baseline for r in c.rows)


def _agreement(r) -> str:
    b, c = r.token_agreement_baseline, r.token_agreement_candidate
    return "-" if b != b and c != c else f"{b:.3f} → {c:.3f}"


def _cells(r) -> list[str]:
    """The numbers of one row, as both the Rich and the Markdown tables show them (verdict left to the caller)."""
    return [
        f"{_ms(r.tpot_ms_baseline)} → {_ms(r.tpot_ms_candidate)}",
        _x(r.tpot_ratio),
        f"{r.ci_low:.3f}–{r.ci_high:.3f}",
        f"{r.p_value:.2g}",
    ]


def _after(r) -> list[str]:
    return [
        _x(r.ttft_ratio, 2),
        _ttft_verdict(r),
        _x(r.tokens_per_s_ratio, 2),
        _delta(r.peak_mem_delta_mib),
        _delta(r.kv_cache_delta_mib, ".3g"),
    ]


def _footer(c) -> list[tuple[str, str]]:
    """(kind, text) lines under the table: row notes, unsteady runs, rows not compared, environment changes."""
    from kvbench.results.environment import describe_changes, describe_context
    from kvbench.results.runs import row_label
    from kvbench.text import printable

    lines = [("note", f"{r.label}: {n}") for r in c.rows for n in r.notes]
    unsteady = [r for r in c.rows if not r.steady]
    if unsteady:
        spread = max(max(r.repeat_spread_baseline, r.repeat_spread_candidate) for r in unsteady)
        lines.append(
            (
                "*",
                f"in {len(unsteady)} row(s) the repeats of one run disagree by more than {c.threshold:.0%} (up to "
                f"{spread:.0%}): the machine changed speed during the run, so p understates the uncertainty there; "
                "rerun both on a quiet machine",
            )
        )
    lines += [("not compared", f"{row_label(u)} ({printable(u.detail)}): {printable(u.reason)}") for u in c.unmatched]
    if c.env_changes:
        lines.append(("environment changed (allowed)", describe_changes(c.env_changes)))
    if c.context:
        lines.append(("measured in the runs (baseline -> candidate)", describe_context(c.context)))
    lines += [("unfinished", text) for text in c.unfinished]
    return lines


def _counts(c) -> str:
    n = {v: sum(r.verdict == v for r in c.rows) for v in VERDICT_STYLE}
    return (
        f"{len(c.rows)} row(s) compared: {n['slower']} slower, {n['faster']} faster, "
        f"{n['no significant change']} no significant change"
        + (f"; {len(c.unmatched)} not compared" if c.unmatched else "")
    )


def render_compare(c, fail_on: list[str], files: list[Path]) -> None:
    """The Rich table, the lines under it, the gate's result and the files written. User text (paths, names) is
    literal: cells and lines go through `cell`, `line` and `styled`, never through markup."""
    cols, rows, caption = _compare_table(c)
    cols, rows, same = shared_columns(cols, rows, names=("engine", "prompt"))
    _render_header(c, same)
    keys = sum(1 for k in cols[:4] if k in ("engine", "cache", "prompt", "batch"))
    justify: list[JustifyMethod] = ["left" if k in ("engine", "cache") else "right" for k in cols]
    for x in fitted(None, cols, rows, out.width, keys=keys, justify=justify):
        out.print(x)
    out.print(styled(caption, "dim"))
    for kind, text in _footer(c):
        out.print(line(styled(kind if kind == "*" else f"{kind}:", "yellow"), " ", text))
    out.print(_counts(c), markup=False)
    if fail_on:
        print_gate(c.regressions(fail_on), fail_on)
    out.print(wrote(files, files[0].parent))


def _render_header(c, same: list[str]) -> None:
    """The two lines above the table, printed as lines rather than as the table's title so long paths are never
    wrapped or folded; the second ends with `same`, the columns every row shares ("engine kvbench")."""
    first = c.rows[0]
    out.print(
        line(
            styled("compare:", "bold"),
            f" {c.candidate} ",
            styled("against baseline", "bold"),
            f" {c.baseline}",
        )
    )
    out.print(
        f"{first.model} ({first.weights} weights), {first.dtype} on {first.device}, {first.new_tokens} new tokens, "
        f"{''.join(f'{s}, ' for s in same)}batch {','.join(map(str, _batches(c)))}; git {_git(c.baseline_git)} -> "
        f"{_git(c.candidate_git)}",
        markup=False,
    )


def _batches(c) -> list[int]:
    """The batch sizes of the compared rows: a batch column when there are several."""
    return sorted({int(r.batch) for r in c.rows})


# The columns after engine, cache, prompt (and batch): TPOT, its ratio, [the interval], then the rest; the last
# is the token agreement's, shown when a row has one. As the terminal table and the Markdown report name them.
TERMINAL_COLUMNS = (
    "TPOT ms",
    "ratio",
    "p",
    "verdict",
    "TTFT",
    "TTFT verdict",
    "tok/s",
    "Δpeak MiB",
    "ΔKV MiB",
    "agreement",
)
MARKDOWN_COLUMNS = (
    "TPOT ms (base → cand)",
    "TPOT ratio",
    "p",
    "verdict",
    "TTFT ratio",
    "TTFT verdict",
    "tokens/s ratio",
    "Δ peak MiB",
    "Δ KV MiB",
    "token agreement",
)


def _columns(c, names: tuple[str, ...]) -> tuple[list[str], bool, bool]:
    """The table's columns from `names` (TERMINAL_COLUMNS or MARKDOWN_COLUMNS): (columns, a batch column, an
    agreement column)."""
    swept = len(_batches(c)) > 1
    tpot, ratio, *rest, agreement = names
    cols = ["engine", "cache", "prompt", *(["batch"] if swept else []), tpot, ratio, f"{c.confidence:.0%} CI", *rest]
    agree = _has_agreement(c)
    return cols + ([agreement] if agree else []), swept, agree


SHORT = {"no significant change": "n.s."}  # a verdict as the table shows it; the caption says what n.s. means


def _compare_table(c) -> tuple[list[str], list[list], str]:
    """One row per compared configuration: (columns, rows, the caption saying what each column means)."""
    from kvbench.text import printable

    level = f"{c.confidence:.0%}"
    cols, swept, agree = _columns(c, TERMINAL_COLUMNS)
    caption = (
        f"TPOT: median decode step, baseline → candidate; ratio = candidate / baseline (> 1: slower), with its "
        f"{level} bootstrap interval. verdict: two-sided Mann-Whitney U on the pooled decode steps at alpha "
        f"{c.alpha:g}, and a change of at least {c.threshold:.0%} (n.s.: no significant change). TTFT: median "
        "ratio; its verdict: the same test on the TTFT repeats (ttft.csv; inconclusive when so few repeats cannot "
        "reach alpha). tok/s: ratio of the summary medians (> 1: faster). Δ: candidate - baseline."
    )
    rows = []
    for r in c.rows:
        after: list = _after(r)
        if r.memory_regressed:
            after[-1] = styled(after[-1], "red")
        after[1] = styled(SHORT.get(after[1], after[1]), VERDICT_STYLE.get(after[1], "yellow"))
        verdict = SHORT.get(r.verdict, r.verdict) + ("" if r.steady else " *")
        row = [
            printable(r.engine),
            printable(r.cache),
            r.prompt_len,
            *([r.batch] if swept else []),
            *_cells(r),
            styled(verdict, VERDICT_STYLE[r.verdict]),
            *after,
        ]
        rows.append(row + ([_agreement(r)] if agree else []))
    return cols, rows, caption


def markdown(c, fail_on: list[str]) -> str:
    """A Markdown report to paste into a pull request: the table, then the lines under it and the gate."""
    level = f"{c.confidence:.0%}"
    cols, swept, agree = _columns(c, MARKDOWN_COLUMNS)
    lines = [
        f"**kvbench compare**: `{md(c.candidate)}` against the baseline `{md(c.baseline)}`",
        "",
        f"Decode-step TPOT, candidate / baseline (> 1: slower), {level} bootstrap intervals; verdict by "
        f"Mann-Whitney U at alpha {c.alpha:g} and a change of at least {c.threshold:.0%}; TTFT verdict: the same test "
        "on the TTFT repeats (ttft.csv).",
        "",
        "| " + " | ".join(cols) + " |",
        "|"
        + "|".join("---" if i < 2 or cols[i] in ("verdict", "TTFT verdict") else "---:" for i in range(len(cols)))
        + "|",
    ]
    for r in c.rows:
        verdict = f"**{r.verdict}**" if r.verdict != "no significant change" else r.verdict
        verdict += "" if r.steady else " \\*"
        cells = [
            md(r.engine),
            md(r.cache),
            str(r.prompt_len),
            *([str(r.batch)] if swept else []),
            *_cells(r),
            verdict,
            *_after(r),
        ]
        lines.append("| " + " | ".join(cells + ([_agreement(r)] if agree else [])) + " |")
    lines.append("")
    lines += ["- " + ("\\*" if kind == "*" else f"{kind}:") + f" {md(text)}" for kind, text in _footer(c)]
    lines += [f"- warning: {md(text)}" for text in c.warnings]  # on stderr too; a pasted report keeps them
    lines.append(f"- {_counts(c)}")
    if fail_on:
        lines.append(_gate_line(c, fail_on))
    return "\n".join(lines) + "\n"


def _gate_line(c, fail_on: list[str]) -> str:
    """The Markdown report's last line: the regressions --fail-on names, or PASS."""
    regressions = c.regressions(fail_on)
    gate = ", ".join(fail_on)
    if regressions:
        return f"- **FAIL** ({gate}): " + "; ".join(map(md, regressions))
    return f"- PASS ({gate}): no regression"
