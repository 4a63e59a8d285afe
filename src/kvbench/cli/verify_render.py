"""How `kvbench verify` (and `verify --hf`) lays out its report: a grid of checks by caches, each cell a verdict and
its figure; beneath it each failing cell's tolerance and detail with where it went wrong (its location), the skipped
cells' reasons, a line of figures for each lossy cache's distortion, with --text the table of each cache's perplexity
and KL divergence on the text, the notes and the verdict line. `--verbose` lists every row's tolerance and detail in
full instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text

from kvbench.console import clipped, err, fitted, fmt_bytes, fmt_share, line, out, styled

if TYPE_CHECKING:
    from rich.console import JustifyMethod

    from kvbench.check.judge import CheckRow

# A failing cell's tolerance and detail beneath the grid: at most this many lines without --verbose.
DETAIL_LINES = 3
MORE = "(--verbose: in full)"
# Checks judged on tokens: a failure's figure is its first divergent step.
TOKEN_CHECKS = ("greedy", "batched", "cache_state")


def _result(row) -> Text:
    if row.skipped:
        return styled("skip", "yellow")
    return styled("pass", "green") if row.passed else styled("FAIL", "bold red")


def _diff(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def figure(row) -> str:
    """The number a cell shows beside its verdict: the max |Δlogit| (3.1e-06), or for a token failure the first
    divergent step (step 3); empty for a skip or a row that compared nothing."""
    if row.skipped:
        return ""
    diverged = not row.passed and row.first_divergence is not None
    if diverged and (row.max_abs_diff is None or row.name in TOKEN_CHECKS):
        return f"step {row.first_divergence}"
    if row.max_abs_diff is None:
        return ""
    return "0" if row.max_abs_diff == 0 else f"{row.max_abs_diff:.1e}"


def verify_row(row) -> None:
    """One line per check as it finishes (stderr, so a long run shows progress)."""
    err.print(
        line(
            styled(f"{row.cache:>20} {row.name:<15} ", "dim"),  # llamacpp-f16-kv-q8_0: 20
            _result(row),
            styled(f" {_diff(row.max_abs_diff)}", "dim"),
        ),
        soft_wrap=True,
    )


def _label(row) -> str:
    return f"{row.name}/{_column(row)}" if row.name != "-" else f"{_column(row)} (every check)"


def _cell(row) -> Text:
    fig = figure(row)
    return line(_result(row), f" {fig}" if fig else "")


def _grid(checks: list, width: int, title: str) -> list:
    """Rows are checks in the suite's order, columns caches in the report's order. A cache skipped as a whole (one
    row named "-") shows skip in every check; a check not run on a cache shows "-"."""
    from kvbench.check.suite import TP_CHECKS as CHECKS

    caches = list(dict.fromkeys(_column(r) for r in checks))
    names = [r.name for r in checks if r.name != "-"]
    order = [c for c in CHECKS if c in names] + [n for n in dict.fromkeys(names) if n not in CHECKS]
    cells: dict[tuple[str, str], CheckRow] = {}
    for r in checks:
        key = (r.name, _column(r))
        if key not in cells or cells[key].passed or cells[key].skipped:  # a repeat never hides a failure
            cells[key] = r
    whole = {_column(r): r for r in checks if r.name == "-"}
    order = order or (["-"] if whole else [])
    rows = []
    for name in order:
        row = [name]
        for c in caches:
            r = cells.get((name, c), whole.get(c))
            row.append(_cell(r) if r is not None else styled("-", "dim"))
        rows.append(row)
    return fitted(title, ["check", *map(_header, caches)], rows, width)


def _column(row) -> str:
    """A row's column: its cache, or `cache =policy` for the rows held to the design's declared policy."""
    return f"{row.cache} =policy" if getattr(row, "policy", False) else row.cache


def _header(cache: str) -> str:
    """A plugin's `pkg.module:Class` heads its column on two lines, so the column is as narrow as its class name."""
    module, colon, name = cache.rpartition(":")
    return f"{module}:\n{name}" if colon and len(cache) > 14 else cache


def _entry(row, verbose: bool, width: int) -> Text:
    """`check/cache (tolerance): detail`, in full with `verbose` (and the row's verdict), else clipped."""
    style = "bold red" if not row.passed and not row.skipped else "bold"
    tol = f" ({row.tolerance})" if row.tolerance and row.tolerance != "skipped" else ""
    head: list[str | Text] = [styled(_label(row), style)]
    if verbose:
        head += [" ", _result(row)]
    text = line(*head, f"{tol}: {row.detail or '-'}")
    return text if verbose else clipped(text, width, DETAIL_LINES, MORE)


def _where(row, verbose: bool, width: int) -> Text:
    """`  location: <where it went wrong>` beneath a failing row's entry, clipped unless `verbose`."""
    text = line("  ", styled("location", "bold"), f": {row.location}")
    return text if verbose else clipped(text, width, DETAIL_LINES, MORE)


def _skips(skipped: list, width: int) -> list[Text]:
    """One line per reason: the skipped cells that share it, then the reason, clipped to one line."""
    by_reason: dict[str, list[str]] = {}
    for r in skipped:
        by_reason.setdefault(r.detail, []).append(_label(r))
    return [
        clipped(line(styled("skip", "yellow"), f" {', '.join(cells)}: {why}"), width, 1)
        for why, cells in by_reason.items()
    ]


def distortion_line(cache: str, d: dict) -> Text:
    """One lossy cache's cost in one line: KL mean and max, top-1 agreement, mean |Δp|, the bytes it saves against
    the full-precision cache holding the same tokens."""
    saved = ""
    if d.get("bytes_saved") is not None:
        saved = f"; saves {d['bytes_saved_fraction']:.0%} of {fmt_bytes(d['reference_kv_bytes'])}"
    return line(
        styled("distortion", "bold"),
        f" {cache}: KL mean {d['kl_mean']:.2g}, max {d['kl_max']:.2g}; top-1 {fmt_share(d['top1_agreement'])}; "
        f"mean |Δp| {d['mean_abs_dp']:.2g}{saved}",
    )


def distortion_notes(costs: dict[str, dict]) -> list[str]:
    """What the distortion lines measured and what they mean for these weights, each said once."""
    if not costs:
        return []
    first = next(iter(costs.values()))
    return [
        f"distortion: each lossy cache against {first['reference']}, {first['steps']} steps on the first prompt; "
        "KL(p_full || p_lossy) in nats, top-1: the same top token, |Δp|: the chosen token's probability moved; "
        "by depth in --json",
        *dict.fromkeys(d["note"] for d in costs.values()),
    ]


def _g(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def text_table(text: dict, about: dict, width: int) -> list:
    """verify --text: each cache's perplexity on the text, its ln(PPL / PPL_ref), KL divergence mean and p99, top-1
    agreement and RMS Δp against the no-cache forward; the title says what was scored and both reference PPLs."""
    if not text:
        return []
    from kvbench.resources import TEMPEST_HELDOUT

    file = about.get("file", "?")
    shown = f"{TEMPEST_HELDOUT.name} (bundled, held out of training)" if file == str(TEMPEST_HELDOUT) else file
    title = f"text: {shown}, {text['tokens']:,} tokens, windows of {text['window']:,} every {text['stride']:,}"
    rows = []
    for cache, d in text["caches"].items():
        if "error" in d:
            rows.append([cache, "exact" if d["exact"] else "lossy", styled("raised", "bold red"), *["-"] * 5])
            continue
        verdict = styled("pass", "green") if d.get("passed") else styled("FAIL", "bold red")
        rows.append(
            [
                cache,
                "exact" if d["exact"] else "lossy",
                line(f"{d['ppl']:.6g} ", verdict if d["exact"] or not d.get("passed") else ""),
                _g(d.get("ln_ppl_ratio"), "+.2e"),
                _g(d["kld"]["mean"], ".2e"),
                _g(d["kld"]["p99"], ".2e"),
                fmt_share(d["top1_agreement"]),
                _g(d["rms_dp"], ".2e"),
            ]
        )
    columns = ["cache", "kind", "PPL", "ln(PPL/ref)", "KLD mean", "KLD p99", "top-1", "RMS Δp"]
    right: list[JustifyMethod] = ["right"] * 6
    tables = fitted(title, columns, rows, width, justify=["left", "left", *right])
    tables.append(
        line(
            f"reference PPL: no cache {text['ppl_no_cache']:.6g}, transformers {text['ppl_transformers']:.6g}; an "
            f"exact cache's must equal it (|ln(PPL/ref)| <= {text['tolerance']:g}), a lossy one's is reported"
        )
    )
    if about.get("plot"):
        tables.append(styled(f"KL divergence by context depth: {about['plot']}", "dim"))
    return tables


def verbose_rows(checks: list) -> None:
    """--verbose: every row, its verdict, tolerance and detail in full."""
    for r in checks:
        out.print(_entry(r, True, out.width))
        if r.location:
            out.print(_where(r, True, out.width))


def render_verify(report, meta: dict, verbose: bool = False) -> None:
    width = out.width
    title = (
        meta.get("title") or f"kvbench verify: {meta['model']}, {meta['weights']}, {meta['device']}, {meta['dtype']}"
    )
    for t in _grid(report.checks, width, title):
        out.print(t)
    judged = [r for r in report.checks if not r.skipped]
    skipped = [r for r in report.checks if r.skipped]
    if verbose:
        verbose_rows(report.checks)
    else:
        for r in judged:
            if not r.passed:
                out.print(_entry(r, verbose, width))
                if r.location:
                    out.print(_where(r, verbose, width))
        for text in _skips(skipped, width):
            out.print(text)
    costs = getattr(report, "distortion", {})
    for cache, d in costs.items():
        out.print(distortion_line(cache, d))
    for t in text_table(getattr(report, "text", {}), meta.get("text", {}), width):
        out.print(t)
    for n in report.notes + distortion_notes(costs):
        out.print(styled(f"- {n}", "dim"))
    also = f" ({len(skipped)} row(s) skipped: see the rows)" if skipped else ""
    failed = [f"{r.name}/{r.cache}" for r in judged if not r.passed]
    if failed:
        out.print(
            line(
                styled("FAILED", "bold red"),
                f" {len(failed)} of {len(judged)} checks: {', '.join(failed)}{also}",
            )
        )
    elif not judged:  # nothing failed because nothing ran: say so, not PASSED
        out.print(
            line(
                styled("NOTHING CHECKED", "bold yellow"),
                f": all {len(skipped)} row(s) skipped (see the rows); no verdict, exit 5",
            )
        )
    else:
        out.print(line(styled("PASSED", "bold green"), f" all {len(judged)} checks{also}"))
