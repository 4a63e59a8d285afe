"""How `kvbench break` lays out its results: each fault as it completes (what it is, the correct and faulty tokens,
which checks caught it, the fix), then one table of every fault. `--verbose` adds each fault's verify rows with
their tolerance and detail in full."""

from __future__ import annotations

from rich.console import JustifyMethod
from rich.text import Text

from kvbench.cli.verify_render import verbose_rows
from kvbench.console import fitted, line, out, styled


def _seq(text: str | None, tokens: list[int], first: int | None) -> str | Text:
    if text is not None:
        return repr(text)
    parts = [styled(t, "red") if first is not None and i >= first else str(t) for i, t in enumerate(tokens)]
    return Text(" ").join(Text(p) if isinstance(p, str) else p for p in parts)


def _location(location: str) -> Text:
    """`location (<check>): <where>` from the result's "<check>: <where>"."""
    check, _, where = location.partition(": ")
    return line(f"location ({check}): {where}")


def render_break(r, verbose: bool = False) -> None:
    head = styled("detected", "green") if r.detected else styled("NOT detected", "bold red")
    out.rule(line(styled(r.name, "bold"), f": {r.summary}"), align="left")
    div = "none (the outputs are identical)" if r.first_divergence is None else f"step {r.first_divergence}"
    lines = [
        line(f"cache {r.cache}; the bug lives in {r.where}"),
        line(f"first divergent token: {div}"),
        line("correct: ", _seq(r.correct_text, r.correct_tokens, r.first_divergence)),
        line("faulty:  ", _seq(r.faulty_text, r.faulty_tokens, r.first_divergence)),
        line(f"signature: {r.signature}"),
        line(head, f" by {_judges([r])}: {', '.join(r.caught_by) if r.caught_by else 'no check failed'}"),
        *([_location(r.location)] if r.location else []),
        line(f"fix: {r.fix}"),
        line(f"dormant: {r.dormant_where} ({r.dormant_shown})"),
    ]
    for text in lines:
        out.print(text)
    if verbose:
        verbose_rows(r.checks)


def _caught(r) -> str:
    """The checks that caught a fault; when most did, the few that did not: "all 9 but cache_state"."""
    if not r.caught_by:
        return "-"
    ran = [n for n in dict.fromkeys(c.name for c in r.checks if not c.skipped) if n != "-"]
    missed = [n for n in ran if n not in r.caught_by]
    if len(r.caught_by) > 3 and len(missed) < len(r.caught_by) and set(r.caught_by) <= set(ran):
        return f"all {len(ran)} but {', '.join(missed)}" if missed else f"all {len(ran)}"
    return ", ".join(r.caught_by)


def render_break_summary(results: list) -> None:
    if not results:  # nothing slipped through because nothing ran: say so, not a detection count
        out.print(
            line(
                styled("NOTHING CHECKED", "bold yellow"),
                ": every fault was skipped (see the notes); no verdict, exit 5",
            )
        )
        return
    rows = [
        [
            r.name,
            r.cache,
            styled("yes", "green") if r.detected else styled("NO", "bold red"),
            _caught(r),
            "-" if r.first_divergence is None else str(r.first_divergence),
        ]
        for r in results
    ]
    cols = ["fault", "cache", "detected", "caught by", "diverges at"]
    title = "kvbench break: injected faults"
    justify: list[JustifyMethod] = ["left", "left", "left", "left", "right"]
    for t in fitted(title, cols, rows, out.width, justify=justify, wrap=("caught by",)):
        out.print(t)
    n = sum(r.detected for r in results)
    style = "bold green" if n == len(results) else "bold red"
    out.print(styled(f"{n} of {len(results)} faults detected by {_judges(results)}", style))


def _judges(results: list) -> str:
    """What detects the faults shown: verify's checks, or for a server fault (cache `serve`) the serving checks."""
    server = {r.cache == "serve" for r in results}
    return {frozenset({False}): "verify", frozenset({True}): "the serve checks"}.get(
        frozenset(server), "verify and the serve checks"
    )
