"""What CI systems and dashboards read: verify's and break's JUnit XML, the JSON Schemas every document follows
(validated against the real documents the commands print and write), and bench's github-action-benchmark export."""

import csv
import json
import os
import re
import shutil
import textwrap
import xml.etree.ElementTree as ET

import jsonschema
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.jsonio import KINDS, SCHEMA_VERSION, load_schema

TINY = ["--model", "gpt2-tiny", "--weights", "random", "--device", "cpu"]
VERIFY = ["verify", *TINY, "--prompt-len", "6", "--new-tokens", "4", "--reference", "none"]


def invoke(args):
    return CliRunner().invoke(app, [str(a) for a in args])


def validate(kind: str, doc) -> None:
    jsonschema.Draft202012Validator(load_schema(kind)).validate(doc)


def cases(path):
    """(testsuite element, {name: testcase element}) of a JUnit file, parsed back."""
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    return suite, {tc.get("name"): tc for tc in suite.findall("testcase")}


# --- JUnit XML -------------------------------------------------------------------------------------------------------
def test_verify_junit_matches_the_json_rows(tmp_path):
    xml = tmp_path / "verify.xml"
    r = invoke([*VERIFY, "--caches", "dynamic,static", "--json", "--junit-xml", xml])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    validate("verify", doc)
    assert doc["schema_version"] == SCHEMA_VERSION
    suite, by_name = cases(xml)
    assert suite.get("name") == "kvbench verify"
    assert int(suite.get("tests")) == len(doc["checks"]) == len(by_name)
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    assert int(suite.get("skipped")) == sum(c["skipped"] for c in doc["checks"])
    for c in doc["checks"]:
        tc = by_name[f"verify.{c['name']}.{c['cache']}"]
        assert tc.get("classname") == f"verify.{c['name']}"
        assert float(tc.get("time")) >= 0
        assert (tc.find("skipped") is not None) == c["skipped"]
        assert tc.find("failure") is None


HOSTILE = 'boom <&> "quoted" ]]> \x1b[31mred\x00 \ud800 end'


@pytest.fixture
def raising_cache(tmp_path, monkeypatch):
    """mycache.Raises: a dynamic cache that raises, with text XML 1.0 cannot hold as is, once it holds more than
    the 4 tokens of the probe a plugin passes when it is loaded."""
    (tmp_path / "mycache.py").write_text(
        textwrap.dedent(
            f"""
            from kvbench.caches.dynamic import DynamicCache

            class Raises(DynamicCache):
                def __init__(self, config, batch, max_len, dtype, device):
                    super().__init__()

                def update(self, k, v, positions):
                    out = super().update(k, v, positions)
                    if self.length > 4:
                        raise ValueError({HOSTILE!r})
                    return out
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mycache:Raises"


def test_verify_junit_failures_carry_the_detail_and_always_parse(tmp_path, raising_cache):
    xml = tmp_path / "out.xml"
    r = invoke([*VERIFY, "--caches", f"dynamic,{raising_cache}", "--json", "--junit-xml", xml])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    validate("verify", doc)
    failed = [c for c in doc["checks"] if not c["passed"] and not c["skipped"]]
    assert failed and all(c["cache"] == raising_cache for c in failed)
    suite, by_name = cases(xml)  # parses: the control characters and the lone surrogate were escaped
    assert int(suite.get("failures")) == len(failed)
    for c in failed:
        f = by_name[f"verify.{c['name']}.{c['cache']}"].find("failure")
        assert f is not None
        assert 'boom <&> "quoted" ]]> \\x1b[31mred\\x00 \\ud800 end' in f.text
        assert c["detail"].replace("\x1b", "\\x1b").replace("\x00", "\\x00").replace("\ud800", "\\ud800") in f.text
        assert f.get("message").startswith(f"{c['name']} on {c['cache']}: ")
    assert by_name["verify.logits.dynamic"].find("failure") is None


def test_verify_refusal_leaves_one_error_case(tmp_path):
    xml = tmp_path / "refused.xml"
    r = invoke([*VERIFY, "--batch", "1", "--junit-xml", xml])
    assert r.exit_code == 2, r.output
    suite, by_name = cases(xml)
    assert (suite.get("tests"), suite.get("errors"), suite.get("failures")) == ("1", "1", "0")
    err = by_name["verify.run"].find("error")
    assert "--batch" in err.get("message") and err.get("message") in r.stderr.replace("\n", " ")


def test_junit_path_refused_before_work(tmp_path):
    r = invoke([*VERIFY, "--junit-xml", tmp_path])  # a folder
    assert r.exit_code == 2 and "is a folder" in r.stderr and "kvbench-verify.xml" in r.stderr, r.output
    r = invoke([*VERIFY, "--junit-xml", tmp_path / "missing" / "v.xml"])
    assert r.exit_code == 2 and "does not exist" in r.stderr, r.output
    assert list(tmp_path.iterdir()) == []
    # a folder nothing can be made in (permissions do not say it for root: /proc is read-only to everyone)
    r = invoke([*VERIFY, "--junit-xml", "/proc/kvbench-verify.xml"])
    assert r.exit_code == 2 and "/proc cannot be written" in r.stderr and "pass" not in r.stdout, r.output
    r = invoke(["break", "position", *TINY, "--junit-xml", tmp_path])
    assert r.exit_code == 2 and "kvbench-break.xml" in r.stderr, r.output


@pytest.mark.parametrize(
    "args, line",
    [
        ([*VERIFY, "--junit-xml", ""], "error: --junit-xml is empty; give a file path for the JUnit XML report"),
        ([*VERIFY, "--junit-xml", "  "], "error: --junit-xml is empty; give a file path for the JUnit XML report"),
        (["break", "position", *TINY, "--junit-xml", ""], "error: --junit-xml is empty; give a file path"),
        (["memory", "--gpu", "h200", "-m", "llama-3-8b", "--plot", ""], "error: --plot is empty; give a .png file"),
        (["memory", "--gpu", "h200", "-m", "llama-3-8b", "--plot", "."], "error: --plot . must name a .png file"),
    ],
)
def test_an_empty_output_path_is_called_empty_not_dot(args, line):
    r = invoke(args)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[0].startswith(line), r.stderr


def test_break_junit_one_case_per_fault(tmp_path):
    xml = tmp_path / "break.xml"
    r = invoke(
        ["break", "all", *TINY, "-n", "4", "--reference", "none", "--cache", "dynamic", "--json", "--junit-xml", xml]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    validate("break", doc)
    suite, by_name = cases(xml)
    assert suite.get("name") == "kvbench break" and suite.get("failures") == "0"
    for b in doc["bugs"]:
        tc = by_name[f"break.{b['name']}.{b['cache']}"]
        assert b["detected"] and tc.find("failure") is None and tc.find("skipped") is None
    skipped = [tc for tc in by_name.values() if tc.find("skipped") is not None]
    assert len(by_name) == len(doc["bugs"]) + len(skipped) and skipped  # static-cache faults skip on dynamic
    reasons = [tc.find("skipped").get("message") for tc in skipped]
    # faults that live in another cache (static, int8, sink) or only across tensor-parallel ranks
    assert all("the bug lives inside the" in m or "tensor-parallel" in m for m in reasons), reasons


# --- schemas ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_schema_command_prints_a_valid_schema(kind):
    r = invoke(["schema", kind])
    assert r.exit_code == 0, r.output
    schema = json.loads(r.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema == load_schema(kind)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    top = schema["$defs"]["meta"] if kind == "bench" else schema
    assert top["properties"]["schema_version"]["const"] == SCHEMA_VERSION  # the version the documents carry


def test_schema_unknown_kind_is_one_line():
    r = invoke(["schema", "nope"])
    assert r.exit_code == 2
    assert r.stderr.strip().count("\n") == 0 and "verify" in r.stderr


# Each command refused under --json: (command line, the schema its document follows or None, its verdict keys).
REFUSED_JSON = [
    (["verify", *TINY, "--caches", "nope", "--json"], "verify", {"passed": False}),
    (["verify", *TINY, "--prompt-len", "0", "--json"], "verify", {"passed": False}),
    (["break", "nope", *TINY, "--json"], "break", {"all_detected": False}),
    (["break", *TINY, "--prompt-len", "-3", "--json"], "break", {"all_detected": False}),
    (["bench", *TINY, "--prompt-len", "0", "--json"], "bench", {}),
    (["bench", *TINY, "--caches", "nope", "--json"], "bench", {}),
    (["memory", "-m", "nope", "--json"], "memory", {}),
    (["memory", "-m", "llama-3-8b", "--ctx", "-1", "--json"], "memory", {}),
    (["generate", "hi", *TINY, "-n", "0", "--json"], None, {}),
    (["compare", "nope1", "nope2", "--format", "json"], "compare", {}),
    (["compare", "nope1", "nope2", "-f", "json", "--alpha", "2"], "compare", {}),
    # Click's own usage errors, where the line asked for JSON
    (["bench", *TINY, "--batch", "abc", "--json"], "bench", {}),
    (["memory", "--nope", "--json"], "memory", {}),
    (["verify", "--json", "--caches"], "verify", {"passed": False}),
    (["compare", "a", "--format=json"], "compare", {}),
    (["break", "--json", "--what", "x"], "break", {"all_detected": False}),
]


@pytest.mark.parametrize(
    "args, kind, verdict", REFUSED_JSON, ids=lambda x: " ".join(x) if isinstance(x, list) else None
)
def test_every_json_command_prints_an_error_document_when_refused(args, kind, verdict):
    """--json (compare: --format json) prints one JSON document on every exit: a refusal is its schema's error
    variant, carrying the line said on stderr and the exit status."""
    r = invoke(args)
    assert r.exit_code == 2, r.output
    (line,) = r.stderr.strip().splitlines()
    doc = json.loads(r.stdout)
    assert doc == {"schema_version": SCHEMA_VERSION, **verdict, "error": line.removeprefix("error: "), "exit_code": 2}
    if kind is not None:
        validate(kind, doc)


def test_without_json_a_refusal_prints_nothing_on_stdout():
    for args in (["memory", "-m", "nope"], ["compare", "a", "b", "--format", "md"], ["memory", "--nope", "--json2"]):
        r = invoke(args)
        assert r.exit_code == 2 and r.stdout == "", r.output


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_schema_has_an_error_variant_and_keeps_its_document_s_keys(kind):
    """An error document validates with schema_version, error and exit_code (and the verdict, false); one
    without `error` still needs the document's own keys, and one with `error` needs its exit status."""
    verdict = {"verify": {"passed": False}, "break": {"all_detected": False}}.get(kind, {})
    doc = {"schema_version": SCHEMA_VERSION, **verdict, "error": "boom", "exit_code": 2}
    validate(kind, doc)
    validate(kind, {**doc, "error": None, "exit_code": 75})
    for bad in (
        {k: v for k, v in doc.items() if k != "exit_code"},
        {k: v for k, v in doc.items() if k != "error"},
        {**doc, "exit_code": "2"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate(kind, bad)
    if kind == "break":
        with pytest.raises(jsonschema.ValidationError):
            validate(kind, {**doc, "all_detected": True})


def test_schemas_allow_new_keys_and_reject_missing_or_mistyped_ones():
    doc = {"schema_version": SCHEMA_VERSION, "kv_dtype": "fp16", "weights_dtype": "bf16", "batch": 1, "tp": 1}
    validate("memory", {**doc, "a_field_added_later": {"x": 1}})
    for bad in (
        {k: v for k, v in doc.items() if k != "batch"},
        {**doc, "batch": "one"},
        {**doc, "schema_version": 0},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate("memory", bad)


def test_memory_json_follows_its_schema():
    r = invoke(["memory", "-m", "llama-3-8b", "--ctx", "8k,32k", "--gpu", "h100", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    validate("memory", doc)
    assert doc["schema_version"] == SCHEMA_VERSION


# --- bench: meta.json, --json, compare, --export ---------------------------------------------------------------------
BENCH = [
    "bench",
    *TINY,
    *"--prompt-len 6,8 --new-tokens 4 --repeats 2 --warmup 1 --caches none,dynamic --engine kvbench".split(),
]


def test_bench_documents_and_export(tmp_path):
    run = tmp_path / "run"
    # inside --out: any name but the run's own files is fine (the folder is made as the run starts)
    export = run / "gab.json"
    r = invoke([*BENCH, "--out", run, "--json", "--export", "github-action-benchmark", export])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    validate("bench", doc)
    meta = json.loads((run / "meta.json").read_text())
    validate("bench", meta)
    assert doc["schema_version"] == meta["schema_version"] == SCHEMA_VERSION
    with pytest.raises(jsonschema.ValidationError):  # the schema tells the two apart and checks each
        validate("bench", {**doc, "summary": [{"cache": "none"}]})

    rows = list(csv.DictReader((run / "summary.csv").open()))
    entries = json.loads(export.read_text())
    assert len(entries) == 2 * len(rows) == 8  # a TPOT and a TTFT entry per ok row
    by_name = {e["name"]: e for e in entries}
    for row in rows:
        label = f"{row['engine']}/{row['cache']} prompt={row['prompt_len']} batch={row['batch']}"
        for metric, col in (("TPOT", "tpot_ms_median"), ("TTFT", "ttft_ms")):
            e = by_name[f"{label} {metric}"]
            assert e["unit"] == "ms" and isinstance(e["value"], float)
            assert e["value"] == pytest.approx(float(row[col]), rel=1e-3)

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    r = invoke(["compare", run, copy, "--format", "json"])
    assert r.exit_code == 0, r.output
    cmp = json.loads(r.stdout)
    validate("compare", cmp)
    assert cmp["schema_version"] == SCHEMA_VERSION and len(cmp["rows"]) == len(rows)


def test_export_bad_format_refused_before_the_run(tmp_path):
    run = tmp_path / "run"
    r = invoke([*BENCH, "--out", run, "--export", "csv", tmp_path / "x.json"])
    assert r.exit_code == 2, r.output
    assert "--export 'csv'" in r.stderr and r.stderr.strip().count("\n") == 0
    assert not run.exists()
    r = invoke([*BENCH, "--out", run, "--export", "github-action-benchmark", tmp_path / "no" / "x.json"])
    assert r.exit_code == 2 and "does not exist" in r.stderr, r.output
    assert not run.exists()


def test_export_never_replaces_the_runs_own_files(tmp_path):
    """FILE inside --out: refused when it is a file the run writes (any other name there is fine:
    test_bench_documents_and_export writes its export inside the run folder)."""
    run = tmp_path / "run"
    for own in ("summary.csv", "meta.json", "ttft.csv", "batch.png", "profile"):
        r = invoke([*BENCH, "--out", run, "--export", "github-action-benchmark", run / own])
        assert r.exit_code == 2 and f"that is the run's own {own}" in r.stderr, r.output
        assert not run.exists()


def test_export_leaves_out_rows_that_did_not_complete():
    from types import SimpleNamespace

    from kvbench.results.rundir import github_action_benchmark

    def row(cache, status, tpot):
        return SimpleNamespace(
            engine="kvbench",
            cache=cache,
            prompt_len=16,
            batch=4,
            status=status,
            device="cpu",
            dtype="fp32",
            repeats=3,
            tpot_ms_median=tpot,
            tpot_ms_p90=tpot,
            ttft_ms=float("nan"),
        )

    entries, skipped = github_action_benchmark([row("static", "ok", 1.23456), row("paged", "oom", float("nan"))])
    assert entries == [
        {
            "name": "kvbench/static prompt=16 batch=4 TPOT",
            "unit": "ms",
            "value": 1.235,
            "extra": "cpu fp32; 3 timed repeats; TPOT p90 1.235 ms",
        }
    ]
    assert skipped == ["kvbench/paged prompt=16 batch=4 (oom)"]


# --- output paths: never replaced when they are not regular files, never inside another run's folder ---------------
def _reading(path):
    """Read a FIFO in a thread, as `cat fifo` would: returns a function giving what was read."""
    import threading

    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(path.read_bytes()), daemon=True)
    t.start()

    def result() -> bytes:
        t.join(30)
        return got[0] if got else b""

    return result


def test_outputs_stream_into_fifos_and_write_through_links(tmp_path):
    """A FIFO (named directly, or through a link as /dev/stdout is) is written as a stream and stays a FIFO; a link
    to a regular file stays a link and its file gets the content; a dangling link gets its file made."""
    import os
    import stat

    from kvbench.results.rundir import output_kind, write_output

    fifo, via = tmp_path / "f.xml", tmp_path / "stdout.xml"
    os.mkfifo(fifo)
    via.symlink_to(fifo)
    for target in (fifo, via):
        assert output_kind(target) == "stream"
        result = _reading(fifo)
        write_output(target, b"<xml/>\n", "--junit-xml")
        assert result() == b"<xml/>\n" and stat.S_ISFIFO(os.stat(fifo).st_mode) and via.is_symlink()
    real, link, dangling = tmp_path / "real.xml", tmp_path / "link.xml", tmp_path / "dangling.xml"
    real.write_text("old")
    link.symlink_to(real)
    dangling.symlink_to(tmp_path / "made.xml")
    for target, file in ((link, real), (dangling, tmp_path / "made.xml")):
        assert output_kind(target) == "file"
        write_output(target, b"new", "--junit-xml")
        assert target.is_symlink() and file.read_bytes() == b"new"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no temporary file left beside them


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="os.mknod needs root")
def test_outputs_write_into_a_character_device_and_refuse_a_block_device(tmp_path):
    """Device nodes made in the test's folder (never /dev): /dev/null's numbers is written as a stream and stays a
    device; a block device is refused in one line, before anything is written."""
    import stat

    from kvbench.errors import KVBenchError
    from kvbench.results.rundir import write_output

    null, block = tmp_path / "n.xml", tmp_path / "b.xml"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(block, 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    write_output(null, b"<xml/>", "--junit-xml")
    assert stat.S_ISCHR(os.stat(null).st_mode)
    with pytest.raises(KVBenchError, match=r"^--junit-xml .*b\.xml is a block device; give a regular file"):
        write_output(block, b"<xml/>", "--junit-xml")
    assert stat.S_ISBLK(os.stat(block).st_mode)
    r = invoke([*VERIFY, "--caches", "static", "--junit-xml", null])
    assert r.exit_code == 0 and stat.S_ISCHR(os.stat(null).st_mode), r.output
    r = invoke([*VERIFY, "--caches", "static", "--junit-xml", block])
    assert r.exit_code == 2 and "is a block device" in r.stderr, r.output


def test_a_socket_is_refused_as_an_output_in_one_line(tmp_path):
    import socket

    path = tmp_path / "s.xml"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        r = invoke([*VERIFY, "--caches", "static", "--junit-xml", path])
        assert r.exit_code == 2, r.output
        assert r.stderr.strip().splitlines() == [
            f"error: --junit-xml {path} is a socket; give a regular file, a FIFO or a character device (/dev/stdout)"
        ]
        r = invoke(["memory", "--gpu", "h200", "-m", "llama-3-8b", "--ctx", "8k", "--plot", tmp_path / "s.png"])
        assert r.exit_code == 0  # no socket there: a new file
        (tmp_path / "s.png").unlink()


def test_junit_and_plot_stream_into_a_fifo(tmp_path):
    """verify --junit-xml and memory --plot onto FIFOs: the reader gets the XML and the PNG, the FIFOs stay."""
    import stat

    xml, png = tmp_path / "f.xml", tmp_path / "cap.png"
    os.mkfifo(xml)
    os.mkfifo(png)
    result = _reading(xml)
    r = invoke([*VERIFY, "--caches", "static", "--junit-xml", xml])
    assert r.exit_code == 0, r.output
    assert result().startswith(b"<?xml") and stat.S_ISFIFO(os.stat(xml).st_mode)
    result = _reading(png)
    r = invoke(["memory", "--gpu", "h200", "-m", "llama-3-8b", "--ctx", "8k", "--plot", png])
    assert r.exit_code == 0, r.output
    assert result().startswith(b"\x89PNG") and stat.S_ISFIFO(os.stat(png).st_mode)


def test_export_never_lands_in_a_run_folder_however_spelled(tmp_path):
    """Any file of another run folder (one holding meta.json, its profile/ included) is refused, and the run's own
    files are refused through a symbolic link or a `..` spelling too: paths are compared resolved."""
    from kvbench.errors import KVBenchError
    from kvbench.results.rundir import check_export_target

    other, own = tmp_path / "A", tmp_path / "C"
    (other / "profile").mkdir(parents=True)
    (other / "meta.json").write_text("{}")
    own.mkdir()
    (tmp_path / "alias").symlink_to(own)
    (tmp_path / "sub").mkdir()
    fmt = "github-action-benchmark"
    for target, needle in [
        (other / "summary.csv", "is a kvbench run folder (it has a meta.json)"),
        (other / "gab.json", "is a kvbench run folder"),
        (other / "profile" / "x.json", "is a kvbench run folder"),
        (tmp_path / "sub" / ".." / "A" / "summary.csv", "is a kvbench run folder"),
        (tmp_path / "alias" / "summary.csv", "that is the run's own summary.csv"),
        (tmp_path / "sub" / ".." / "C" / "meta.json", "that is the run's own meta.json"),
        (own / "profile" / "x.json", "inside the run's own profile/"),
    ]:
        with pytest.raises(KVBenchError, match=re.escape(needle)):
            check_export_target((fmt, target), own)
    for fine in (own / "gab.json", tmp_path / "alias" / "gab.json", tmp_path / "sub" / "gab.json"):
        check_export_target((fmt, fine), own)
    r = invoke([*BENCH, "--out", tmp_path / "B", "--export", fmt, other / "summary.csv"])
    assert r.exit_code == 2 and "is a kvbench run folder" in r.stderr and not (tmp_path / "B").exists(), r.output
