"""`kvbench compare` of two `bench --endpoint` runs (results/endpoint_compare.py): the comparison written to
compare.png and compare.json, then its table, its Markdown report or its JSON document."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import JustifyMethod

from kvbench.console import fitted, line, out, print_gate, styled, wrote

if TYPE_CHECKING:
    from kvbench.results.endpoint_compare import EndpointComparison, PhaseComparison
    from kvbench.results.stats import TTFTComparison

VERDICT_STYLE = {"slower": "bold red", "faster": "bold green", "no significant change": "dim"}
SHORT = {"no significant change": "n.s."}


def run_endpoint_compare(
    baseline: Any, candidate: Any, alpha: float, threshold: float, allow_env_change: bool, where: Path
) -> tuple[EndpointComparison, list[Path]]:
    """Compare, then write compare.png and compare.json into `where`; the comparison and the files written."""
    from kvbench.results.endpoint_compare import compare_endpoint_runs, json_doc
    from kvbench.results.endpoint_plot import endpoint_compare_figure
    from kvbench.results.rundir import prepare_run_dir, write_json

    comparison = compare_endpoint_runs(baseline, candidate, alpha, threshold, allow_env_change)
    folder = prepare_run_dir(where)
    png, js = folder / "compare.png", folder / "compare.json"
    endpoint_compare_figure(comparison, png)
    write_json(js, json_doc(comparison, [], [png, js]))
    return comparison, [png, js]


def _ms(v: float) -> str:
    if v != v:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _x(v: float, digits: int = 3) -> str:
    return "-" if v != v else f"×{v:.{digits}f}"


def _metric(x: TTFTComparison, ratio: float) -> list[str]:
    ci = "-" if x.ttft_ci_low != x.ttft_ci_low else f"{x.ttft_ci_low:.2f}–{x.ttft_ci_high:.2f}"
    return [f"{_ms(x.ttft_ms_baseline)} → {_ms(x.ttft_ms_candidate)}", _x(ratio), ci]


def _cached(r: PhaseComparison) -> str:
    b, c = r.cached_tokens_baseline, r.cached_tokens_candidate

    def n(v: float) -> str:
        return "-" if v != v else f"{v:.0f}"

    return "-" if b != b and c != c else f"{n(b)} → {n(c)}"


COLUMNS = ["phase", "conc", "TTFT ms", "ratio", "CI", "verdict", "TPOT ms", "ratio", "CI", "verdict", "tok/s"]
COLUMNS += ["cached"]
MD_COLUMNS = ["phase", "concurrency", "TTFT ms (base → cand)", "TTFT ratio", "CI", "TTFT verdict"]
MD_COLUMNS += ["TPOT ms (base → cand)", "TPOT ratio", "CI", "TPOT verdict", "tokens/s ratio", "cached tokens"]


def _verdict(v: str) -> Any:
    return styled(SHORT.get(v, v), VERDICT_STYLE.get(v, "yellow"))


def _caption(c: EndpointComparison) -> str:
    return (
        f"TTFT and TPOT: median over the phase's requests, baseline → candidate; ratio = candidate / baseline (> 1: "
        f"slower) with its {c.confidence:.0%} bootstrap interval; verdict: two-sided Mann-Whitney U on the requests at "
        f"alpha {c.alpha:g} and a change of at least {c.threshold:.0%} (n.s.: no significant change; inconclusive: "
        "too few requests to reach alpha). tok/s: output tokens/s ratio (> 1: faster). cached: mean cached tokens."
    )


def _lines(c: EndpointComparison) -> list[tuple[str, str]]:
    from kvbench.results.environment import describe_changes

    lines = [("not compared", str(u)) for u in c.unmatched]
    if c.env_changes:
        lines.append(("environment changed (allowed)", describe_changes(c.env_changes)))
    return lines + [("unfinished", u) for u in c.unfinished]


def render_endpoint_compare(c: EndpointComparison, fail_on: list[str], files: list[Path]) -> None:
    out.print(
        line(styled("compare:", "bold"), f" {c.candidate} ", styled("against baseline", "bold"), f" {c.baseline}")
    )
    first = c.rows[0]
    out.print(
        f"bench --endpoint runs: prompt {first.prompt_len} tokens, shared prefix {first.prefix_len}, "
        f"{first.new_tokens} new tokens",
        markup=False,
    )
    rows = []
    for r in c.rows:
        rows.append(
            [r.phase, r.concurrency, *_metric(r.ttft, r.ttft_ratio), _verdict(r.ttft.ttft_verdict)]
            + [*_metric(r.tpot, r.tpot_ratio), _verdict(r.tpot.ttft_verdict), _x(r.output_tok_s_ratio, 2), _cached(r)]
        )
    justify: list[JustifyMethod] = ["left" if i == 0 else "right" for i in range(len(COLUMNS))]
    for x in fitted(None, COLUMNS, rows, out.width, keys=2, justify=justify):
        out.print(x)
    out.print(styled(_caption(c), "dim"))
    for kind, text in _lines(c):
        out.print(line(styled(f"{kind}:", "yellow"), " ", text))
    if fail_on:
        print_gate(c.regressions(fail_on), fail_on)
    out.print(wrote(files, files[0].parent))


def endpoint_markdown(c: EndpointComparison, fail_on: list[str]) -> str:
    """A Markdown report to paste into a pull request."""
    from kvbench.text import md

    lines = [
        f"**kvbench compare** (bench --endpoint): `{md(c.candidate)}` against the baseline `{md(c.baseline)}`",
        "",
        _caption(c),
        "",
        "| " + " | ".join(MD_COLUMNS) + " |",
        "|" + "|".join("---" if i in (0, 5, 9) else "---:" for i in range(len(MD_COLUMNS))) + "|",
    ]
    for r in c.rows:
        cells = [md(r.phase), str(r.concurrency), *_metric(r.ttft, r.ttft_ratio), r.ttft.ttft_verdict]
        cells += [*_metric(r.tpot, r.tpot_ratio), r.tpot.ttft_verdict, _x(r.output_tok_s_ratio, 2), _cached(r)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {kind}: {md(text)}" for kind, text in _lines(c)]
    lines += [f"- warning: {md(text)}" for text in c.warnings]
    if fail_on:
        regressions = c.regressions(fail_on)
        gate = ", ".join(fail_on)
        lines.append(
            f"- **FAIL** ({gate}): " + "; ".join(map(md, regressions))
            if regressions
            else f"- PASS ({gate}): no regression"
        )
    return "\n".join(lines) + "\n"
