"""JUnit XML for `verify --junit-xml` and `break --junit-xml`: the report CI systems render as test results.

One `<testsuites>` holding one `<testsuite>`; one `<testcase>` per verify row (classname `verify.<check>`, name
`verify.<check>.<cache>`, so a reader that shows only the name still tells the rows apart) or per injected fault
(`break.<fault>.<cache>`, passed when verify caught the fault). A failed row carries `<failure>` with the row's
detail; a skipped row `<skipped>` with the reason; a run stopped by an error (exit 2) one `<error>` case instead.
Text is escaped by ElementTree; characters XML 1.0 cannot hold at all (control characters, lone surrogates) are
written as `\\xNN` / `\\uNNNN`, so the file always parses.
"""

from __future__ import annotations

import re
import tempfile
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KVBenchError, one_line
from kvbench.results.rundir import output_kind, write_output

# Characters outside XML 1.0's Char production: C0 controls but tab, newline and carriage return; surrogates;
# U+FFFE and U+FFFF.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_safe(text: str) -> str:
    """`text` with every character XML 1.0 forbids written as a visible escape (`\\x1b`, `\\ud800`)."""
    return _NOT_XML.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


class JUnitPathError(KVBenchError):
    """--junit-xml names a path no report can be written to."""


@dataclass
class Case:
    """One test case: `outcome` is passed, failure, skipped or error; `message` the one-line reason, `text` the
    element's body (the full detail)."""

    classname: str
    name: str
    outcome: str = "passed"
    message: str = ""
    text: str = ""
    seconds: float = 0.0


@dataclass
class Suite:
    name: str
    cases: list[Case] = field(default_factory=list)
    seconds: float = 0.0
    properties: dict[str, str] = field(default_factory=dict)


def suite_xml(suite: Suite) -> str:
    """The whole document, with its XML declaration."""
    counts = {k: sum(c.outcome == k for c in suite.cases) for k in ("failure", "skipped", "error")}
    attrs = {
        "tests": str(len(suite.cases)),
        "failures": str(counts["failure"]),
        "errors": str(counts["error"]),
        "skipped": str(counts["skipped"]),
        "time": f"{suite.seconds:.3f}",
    }
    root = ET.Element("testsuites", {"name": xml_safe(suite.name), **attrs})
    ts = ET.SubElement(root, "testsuite", {"name": xml_safe(suite.name), **attrs})
    if suite.properties:
        props = ET.SubElement(ts, "properties")
        for k, v in suite.properties.items():
            ET.SubElement(props, "property", {"name": xml_safe(k), "value": xml_safe(v)})
    for c in suite.cases:
        tc = ET.SubElement(
            ts,
            "testcase",
            {"classname": xml_safe(c.classname), "name": xml_safe(c.name), "time": f"{c.seconds:.3f}"},
        )
        if c.outcome != "passed":
            assert c.outcome in counts, f"unknown outcome {c.outcome!r}"
            el = ET.SubElement(tc, c.outcome, {"message": xml_safe(c.message)})
            el.text = xml_safe(c.text) or None
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_suite(path: Path, suite: Suite) -> None:
    """Write the report atomically: a reader sees the previous file or the complete new one (a FIFO or a device,
    /dev/stdout, is written as a stream, never replaced: rundir.output_kind)."""
    write_output(Path(path), suite_xml(suite).encode("utf-8"), "--junit-xml")


def check_junit_path(path: str | Path | None, command: str = "verify") -> Path | None:
    """--junit-xml PATH checked before any work: not a folder, in a folder that exists and can be written."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not str(path).strip():
        raise JUnitPathError("--junit-xml is empty; give a file path for the JUnit XML report")
    if p.is_dir():
        raise JUnitPathError(f"--junit-xml {p} is a folder; give a file path, e.g. {p / f'kvbench-{command}.xml'}")
    if not p.parent.is_dir():
        raise JUnitPathError(f"--junit-xml {p}: the folder {p.parent} does not exist; create it or choose another path")
    try:
        if output_kind(p, "--junit-xml") == "stream":  # written in place: no file is made beside it
            return p
    except KVBenchError as e:
        raise JUnitPathError(str(e)) from None
    try:  # a file can be made there (permissions alone do not say: root, read-only or virtual file systems)
        with tempfile.NamedTemporaryFile(dir=p.parent, prefix=".kvbench-junit-"):
            pass
    except OSError as e:
        raise JUnitPathError(
            f"--junit-xml {p}: {p.parent} cannot be written ({e.strerror or e}); choose another path"
        ) from None
    return p


def verify_suite(report, meta: dict, seconds: list[float], total: float) -> Suite:
    """verify's rows as cases; `seconds[i]` is row i's share of the run (time since the row before it)."""
    cases = []
    for i, r in enumerate(report.checks):
        c = Case(f"verify.{r.name}", f"verify.{r.name}.{r.cache}", seconds=seconds[i] if i < len(seconds) else 0.0)
        if r.skipped:
            c.outcome, c.message = "skipped", r.detail
        elif not r.passed:
            c.outcome, c.message, c.text = "failure", f"{r.name} on {r.cache}: {r.detail}", _row_text(r)
        cases.append(c)
    props = {k: str(v) for k, v in meta.items() if isinstance(v, str | int | float)}
    return Suite("kvbench verify", cases, total, props | text_properties(getattr(report, "text", {})))


def text_properties(text: dict) -> dict[str, str]:
    """verify --text's figures as suite properties, for CI dashboards: both reference perplexities, and each
    cache's perplexity and mean and p99 KL divergence (text.ppl.int8, text.kld_mean.int8, ...)."""
    if not text:
        return {}
    props = {
        "text.ppl_no_cache": f"{text['ppl_no_cache']:.9g}",
        "text.ppl_transformers": f"{text['ppl_transformers']:.9g}",
    }
    for cache, d in text["caches"].items():
        if "ppl" in d:
            props[f"text.ppl.{cache}"] = f"{d['ppl']:.9g}"
            props[f"text.kld_mean.{cache}"] = f"{d['kld']['mean']:.6g}"
            props[f"text.kld_p99.{cache}"] = f"{d['kld']['p99']:.6g}"
    return props


def _row_text(r) -> str:
    diverge = "-" if r.first_divergence is None else str(r.first_divergence)
    diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.3e}"
    return (
        f"check: {r.name}\ncache: {r.cache}\ntolerance: {r.tolerance}\nmax |dlogit|: {diff}\n"
        f"first divergence: {diverge}\ndetail: {r.detail}" + (f"\nlocation: {r.location}" if r.location else "")
    )


def break_suite(results: list, skipped: list[tuple[str, str]], meta: dict, seconds: list[float], total: float) -> Suite:
    """break's faults as cases: passed when verify caught the fault, failed when it slipped through; `skipped`
    holds (fault, why) for faults not run on this cache; `seconds[i]` is fault i's run."""
    cases = []
    for i, r in enumerate(results):
        c = Case(f"break.{r.name}", f"break.{r.name}.{r.cache}", seconds=seconds[i] if i < len(seconds) else 0.0)
        if not r.detected:
            c.outcome, c.message = (
                "failure",
                f"{r.name} on {r.cache}: not detected by verify (no check failed)",
            )
            c.text = f"{r.summary}\nsignature: {r.signature}\nfix: {r.fix}"
        cases.append(c)
    cases += [Case(f"break.{n}", f"break.{n}", "skipped", why) for n, why in skipped]
    props = {k: str(v) for k, v in meta.items() if isinstance(v, str | int | float)}
    return Suite("kvbench break", cases, total, props)


@contextmanager
def errors_reported(path: str | Path | None, command: str, clock: RowClock):
    """With a report path, a run stopped by an error (a refusal, running out of memory: exit 2) or by a signal
    (Ctrl-C, SIGTERM, SIGHUP) still leaves a report: one error case with the line said on stderr. A path that is
    itself refused (a folder, a missing folder) gets none."""
    try:
        yield
    except (Exception, KeyboardInterrupt) as e:
        if path is not None and not isinstance(e, JUnitPathError):
            if isinstance(e, KeyboardInterrupt):  # the CLI's Terminated carries its line (SIGTERM: "terminated")
                message = getattr(e, "line", "interrupted")
            else:
                message = str(e) if isinstance(e, KVBenchError) else one_line(e)
            with suppress(KVBenchError):  # the run's own error is the one to report
                write_suite(Path(path).expanduser(), error_suite(command, message, clock.total()))
        raise


def error_suite(command: str, message: str, total: float) -> Suite:
    """A run stopped by an error before its verdict (exit 2): one `<error>` case saying why, so CI shows the
    reason instead of a missing report."""
    return Suite(f"kvbench {command}", [Case(command, f"{command}.run", "error", message, message)], total)


class RowClock:
    """Passed as a run's `on_row`: notes each row's share of the run (the time since the row before it, the first
    since the clock started), then hands the row on to `then`."""

    def __init__(self, then=None) -> None:
        self.then = then
        self.start = self.last = time.perf_counter()
        self.seconds: list[float] = []

    def __call__(self, row) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now
        if self.then is not None:
            self.then(row)

    def total(self) -> float:
        return time.perf_counter() - self.start
