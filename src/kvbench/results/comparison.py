"""What every comparison of two runs carries, whichever kind of run it compares (a bench sweep's rows:
results/compare.py; a served model's phases, bench --endpoint: results/endpoint_compare.py), and the JSON
document's members they share.

`Compared` holds the fields both kinds have (the two folders, the statistics' settings, the environment, the git
revisions, the warnings) and the two gates' methods each kind answers for its rows; `compared_fields` fills the
fields taken straight from the two runs, and `comparison_doc` writes the document (schema compare.json) around the
rows as each kind writes them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.jsonio import SCHEMA_VERSION
from kvbench.results.environment import ContextField, EnvChange


def check_alpha(alpha: float) -> None:
    """The significance level of every test and interval of a comparison: strictly between 0 and 1."""
    if not 0 < alpha < 1:
        raise KVBenchError(f"--alpha must be between 0 and 1, got {alpha}")


class _Run(Protocol):  # results/runs.py's Run, endpoint_runs.py's EndpointRun
    @property
    def path(self) -> Path: ...

    @property
    def meta(self) -> dict: ...


@dataclass(kw_only=True)
class Compared:
    """Two runs compared, candidate against baseline; `rows` and `unmatched` are each kind's own."""

    baseline: str
    candidate: str
    alpha: float
    threshold: float
    confidence: float  # level of the bootstrap intervals: 1 - alpha
    rows: list[Any]
    unmatched: list[Any]  # what was not compared, with the reason
    env_changes: list[EnvChange]
    env_allowed: bool  # --allow-env-change was given (there may be no changes)
    relaxed_keys: list[str] = field(default_factory=list)  # key fields not matched on (allowed, the runs differ)
    baseline_git: dict | None = None
    candidate_git: dict | None = None
    context: list[ContextField] = field(default_factory=list)  # measured at run time, side by side
    unfinished: list[str] = field(default_factory=list)  # one line per run that did not finish
    warnings: list[str] = field(default_factory=list)  # e.g. the runs started under loads a core apart

    def gate_warnings(self, fail_on: list[str]) -> list[str]:
        """A gate asked for that some rows cannot trip, one line each."""
        raise NotImplementedError

    def regressions(self, fail_on: list[str]) -> list[str]:
        """One line per regressed row, for the gates named in `fail_on`."""
        raise NotImplementedError


def compared_fields(
    base: _Run, cand: _Run, alpha: float, threshold: float, changes: list[EnvChange], allow_env_change: bool
) -> dict[str, Any]:
    """The Compared fields the two runs and the statistics' settings give as they are."""
    return {
        "baseline": str(base.path),
        "candidate": str(cand.path),
        "alpha": alpha,
        "threshold": threshold,
        "confidence": 1 - alpha,
        "env_changes": changes,
        "env_allowed": allow_env_change,
        "baseline_git": base.meta.get("git"),
        "candidate_git": cand.meta.get("git"),
    }


def comparison_doc(
    c: Compared,
    fail_on: list[str],
    rows: list[dict[str, Any]],
    files: list[Path] | None = None,
    kind: str | None = None,
    environment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The comparison as one JSON-ready document (NaN and infinities become null when written with
    jsonio.json_text): `rows` as its kind writes them, `kind` where it is not a sweep's, `environment`'s members
    after the changes."""
    regressions = c.regressions(fail_on)
    return {
        "schema_version": SCHEMA_VERSION,
        **({} if kind is None else {"kind": kind}),
        "baseline": c.baseline,
        "candidate": c.candidate,
        "alpha": c.alpha,
        "threshold": c.threshold,
        "confidence": c.confidence,
        "fail_on": fail_on,
        "regressed": bool(regressions),
        "regressions": regressions,
        "environment": {"changes": [asdict(e) for e in c.env_changes], "allowed": c.env_allowed, **(environment or {})},
        "unfinished": c.unfinished,
        "warnings": c.warnings + c.gate_warnings(fail_on),
        "git": {"baseline": c.baseline_git, "candidate": c.candidate_git},
        "rows": rows,
        "unmatched": [asdict(u) for u in c.unmatched],
        "files": [str(f) for f in files or []],
    }


def number(row: pd.Series, col: str) -> float:
    """A summary row's number, NaN where the column is missing or empty."""
    v = row.get(col, math.nan)
    return math.nan if v is None or pd.isna(v) else float(v)
