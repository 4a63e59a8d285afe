"""Every file kvbench reads, given something that is not such a file: a named pipe (refused at once, never waited
on), /dev/zero, a directory, a file past the size bound, JSON or TOML nested without end. Each case is one line on
stderr, exit 2, nothing on stdout, no traceback, and the file given is left as it was. Also: how a prompts file is
split into prompts, control characters in printed text, and $KVBENCH_PROBE_BYTES."""

import json
import os
import stat
import threading
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from tiny import LLAMA_JSON

TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]
BENCH = [*TINY, "--repeats", "1", "--warmup", "0", "--prompt-len", "8", "--new-tokens", "4"]
GPT2_SMALL = {
    "model_type": "gpt2",
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 8,
    "vocab_size": 50,
    "n_positions": 128,
}
BIG = 65 * 2**20  # past every bound (configs 16 MiB, prompts and tokenizer files 64 MiB); sparse, so free


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Things that are not the file a reader expects, by kind."""
    d = tmp_path_factory.mktemp("targets")
    os.mkfifo(d / "pipe")
    (d / "folder").mkdir()
    with open(d / "big", "wb") as f:
        f.truncate(BIG)
    (d / "deep.json").write_text("[" * 100_000)
    (d / "deep.toml").write_text("prompt_len = " + "[" * 100_000)
    return {
        "pipe": d / "pipe",
        "/dev/zero": "/dev/zero",
        "directory": d / "folder",
        "too big": d / "big",
        "deep JSON": d / "deep.json",
        "deep TOML": d / "deep.toml",
    }


def _holder(tmp, name: str, target, **others) -> str:
    """A directory whose file `name` is a link to `target` (beside `others`: name -> contents)."""
    d = tmp / "holder"
    d.mkdir()
    (d / name).symlink_to(target)
    for other, text in others.items():
        (d / other.replace("_", ".")).write_text(text)
    return str(d)


# reader -> (arguments given the target and tmp_path, environment, the path the message names)
READERS = {
    "--prompts-file": (lambda t, tmp: ["generate", *TINY, "--prompts-file", str(t)], None, "{t}"),
    "--tokenizer file": (lambda t, tmp: ["generate", "hi", *TINY, "--tokenizer", str(t)], None, "{t}"),
    "KVBENCH_TOKENIZER": (lambda t, tmp: ["generate", "hi", *TINY], "{t}", "KVBENCH_TOKENIZER={t}"),
    "--tokenizer vocab.json": (
        lambda t, tmp: ["generate", "hi", *TINY, "--tokenizer", _holder(tmp, "vocab.json", t, merges_txt="#v\n")],
        None,
        "holder/vocab.json",
    ),
    "bench --config": (lambda t, tmp: ["bench", *BENCH, "--out", str(tmp / "run"), "--config", str(t)], None, "{t}"),
    "memory --config": (lambda t, tmp: ["memory", "--config", str(t)], None, "{t}"),
    "--model config.json": (lambda t, tmp: ["generate", "hi", *TINY, "-m", str(t)], None, "{t}"),
    "--weights DIR/config.json": (
        lambda t, tmp: ["generate", "hi", "--weights", _holder(tmp, "config.json", t), "--device", "cpu"],
        None,
        "holder/config.json",
    ),
    "--hf FILE": (lambda t, tmp: ["verify", "--hf", str(t), "--device", "cpu"], None, "{t}"),
    "--hf DIR/config.json": (
        lambda t, tmp: ["verify", "--hf", _holder(tmp, "config.json", t, model_safetensors=""), "--device", "cpu"],
        None,
        "holder/config.json",
    ),
}

KIND_MESSAGE = {
    "pipe": "(a named pipe)",
    "/dev/zero": "(a character device)",
    "directory": "is a directory, not a file",
    "too big": "MiB, more than the ",
    "deep JSON": "JSON nested too deeply",
    "deep TOML": "TOML nested too deeply",
}
JSON_READERS = (
    "memory --config",
    "--model config.json",
    "--weights DIR/config.json",
    "--hf FILE",
    "--hf DIR/config.json",
    "--tokenizer vocab.json",
)
# Where a reader takes a directory, or reads the path as something else, the message says so in its own words.
SPECIAL = {
    ("--hf FILE", "pipe"): "is a named pipe, neither a config.json file nor a model directory",
    ("--hf FILE", "/dev/zero"): "is a character device, neither a config.json file nor a model directory",
    ("--tokenizer file", "directory"): "has neither vocab.json + merges.txt",
    ("KVBENCH_TOKENIZER", "directory"): "has neither vocab.json + merges.txt",
    ("--model config.json", "directory"): "folder/config.json: file not found",
    ("--hf FILE", "directory"): "no config.json in",
}
CASES = [
    (reader, kind)
    for reader in READERS
    for kind in KIND_MESSAGE
    if not kind.startswith("deep")
    or (kind == "deep JSON" and reader in JSON_READERS)
    or (kind == "deep TOML" and reader == "bench --config")
]


@contextmanager
def never_hangs(pipe):
    """If a reader does block on the pipe, play its writer (open and close it) so the test fails, not hangs."""
    stop = threading.Event()

    def release():
        while not stop.wait(5):
            try:
                os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader waiting on it
                pass

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _one_error_line(r) -> str:
    shown = f"exit {r.exit_code}\nstdout: {r.stdout!r}\nstderr: {r.stderr!r}"
    assert r.exit_code == 2, shown
    assert "Traceback" not in r.output, shown
    assert r.stdout == "", shown
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    return lines[0]


def _state(path):
    st = os.stat(path)
    return stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns


@pytest.mark.parametrize("reader, kind", CASES, ids=[f"{r} <- {k}" for r, k in CASES])
def test_a_reader_refuses_what_is_not_its_file(reader, kind, targets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = targets[kind]
    argv, env, named = READERS[reader]
    args = argv(target, tmp_path)
    before = _state(target)
    with never_hangs(targets["pipe"]):
        r = CliRunner().invoke(app, args, env={"KVBENCH_TOKENIZER": env.format(t=target)} if env else None)
    line = _one_error_line(r)
    assert SPECIAL.get((reader, kind), KIND_MESSAGE[kind]) in line, line
    assert named.format(t=target) in line, line
    assert _state(target) == before, "the file given was changed"
    assert not (tmp_path / "run").exists() and not (tmp_path / "results").exists(), "a run folder was left"


def test_hf_names_a_pipe_that_looks_like_a_hub_id(targets, monkeypatch):
    """`--hf pipe` in the pipe's folder is that pipe, not a hub id to look up."""
    monkeypatch.chdir(targets["pipe"].parent)
    with never_hangs(targets["pipe"]):
        line = _one_error_line(CliRunner().invoke(app, ["verify", "--hf", "pipe", "--device", "cpu"]))
    assert "--hf pipe is a named pipe, neither a config.json file nor a model directory" in line, line


def test_the_size_bound_is_named(targets):
    line = _one_error_line(CliRunner().invoke(app, ["memory", "--config", str(targets["too big"])]))
    assert line.endswith("is 65 MiB, more than the 16 MiB a config.json may be"), line
    line = _one_error_line(CliRunner().invoke(app, ["generate", *TINY, "--prompts-file", str(targets["too big"])]))
    assert line.endswith("is 65 MiB, more than the 64 MiB a prompts file may be"), line


def test_weights_files_that_are_not_regular_files(targets, tmp_path):
    """A pipe or a device named model.safetensors is refused by what it is, not read (or skipped)."""
    for i, (kind, target) in enumerate((("pipe", targets["pipe"]), ("/dev/zero", "/dev/zero"))):
        d = tmp_path / f"ckpt{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(GPT2_SMALL))
        (d / "model.safetensors").symlink_to(target)
        with never_hangs(targets["pipe"]):
            for args in (["generate", "hi", "--weights", str(d)], ["verify", "--hf", str(d)]):
                line = _one_error_line(CliRunner().invoke(app, [*args, "--device", "cpu"]))
                assert f"{d}/model.safetensors is not a regular file ({KIND_MESSAGE[kind][1:-1]})" in line, line


# --- nesting without end, in every form a parser may meet it -------------------------------------------------------
DEEP_JSON = {
    "arrays": "[" * 100_000,
    "objects": '{"a": ' * 100_000,
    "closed arrays 500 deep": "[" * 500 + "]" * 500,
    "inside a field": '{"model_type": "gpt2", "n_layer": ' + "[" * 100_000,
}
DEEP_TOML = {
    "arrays": "prompt_len = " + "[" * 100_000,
    "inline tables": "x = " + "{a = " * 100_000,
    "closed inline tables 500 deep": "x = " + "{a = " * 500 + "1" + "}" * 500,
    "a dotted key of 100,000 parts": ".".join(["a"] * 100_000) + " = 1",
    "a table header of 1,000 parts": "[" + ".".join(['"a"'] * 1_000) + "]\n",
    "a dotted key under a known key": "model." + ".".join(["a"] * 300) + " = 1",
}


@pytest.mark.parametrize("reader", JSON_READERS[:-1])
@pytest.mark.parametrize("form", list(DEEP_JSON))
def test_deep_json_is_one_line(reader, form, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(DEEP_JSON[form])
    r = CliRunner().invoke(app, READERS[reader][0](path, tmp_path))
    assert "JSON nested too deeply" in _one_error_line(r)


@pytest.mark.parametrize("form", list(DEEP_TOML))
def test_deep_toml_is_one_line(form, tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(DEEP_TOML[form])
    r = CliRunner().invoke(app, ["bench", *BENCH, "--out", str(tmp_path / "run"), "--config", str(path)])
    assert "TOML nested too deeply to be a sweep's TOML file" in _one_error_line(r)
    assert not (tmp_path / "run").exists()


def test_a_toml_integer_of_5000_digits_is_one_line(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text("seed = " + "9" * 5000 + "\n")
    r = CliRunner().invoke(app, ["bench", *BENCH, "--config", str(path)])
    assert "is not valid TOML: Exceeds the limit" in _one_error_line(r)


def test_a_ranks_file_read_once_is_not_cached(ranks_file, tmp_path):
    """A tokenizer file changed at the same path is read again, never served from a copy of its old contents."""
    from kvbench.errors import KVBenchError
    from kvbench.model.tokenizer import load_tokenizer

    path = tmp_path / "gpt2.tiktoken"
    path.write_bytes(ranks_file.read_bytes())
    assert load_tokenizer(path).encode("Hello world") == [15496, 995]
    path.write_text("garbage\n")
    with pytest.raises(KVBenchError, match="malformed tokenizer file"):
        load_tokenizer(path)


# --- a prompts file is split at newlines, and only there ----------------------------------------------------------
SPLITS = {
    "LF": ("one\ntwo\n", ["one", "two"]),
    "CRLF": ("one\r\ntwo\r\n", ["one", "two"]),
    "a lone CR stays": ("one\rtwo\n", ["one\rtwo"]),
    "byte-order mark": ("\ufeffone\ntwo", ["one", "two"]),
    "byte-order mark and CRLF": ("\ufeffone\r\ntwo\r\n", ["one", "two"]),
    "U+2028 line separator": ("one\u2028two\nthree", ["one\u2028two", "three"]),
    "U+2029 paragraph separator": ("one\u2029two", ["one\u2029two"]),
    "form feed": ("one\x0ctwo\nthree", ["one\x0ctwo", "three"]),
    "vertical tab": ("one\x0btwo", ["one\x0btwo"]),
    "U+0085 next line": ("one\x85two\nthree", ["one\x85two", "three"]),
    "file and group separators": ("one\x1ctwo\x1dthree\x1efour", ["one\x1ctwo\x1dthree\x1efour"]),
    "blank lines skipped": ("one\n\n   \ntwo\n", ["one", "two"]),
}


@pytest.mark.parametrize("case", list(SPLITS))
def test_prompts_file_lines(case, tmp_path):
    text, prompts = SPLITS[case]
    path = tmp_path / "prompts.txt"
    path.write_bytes(text.encode("utf-8"))
    r = CliRunner().invoke(app, ["generate", *TINY, "--prompts-file", str(path), "-n", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert [c["prompt"] for c in json.loads(r.stdout)["completions"]] == prompts


# --- control characters never reach the terminal raw ---------------------------------------------------------------
HOSTILE = "a\x1b[2J\x1b]0;owned\x07b\x9b31mc\rd\x08e\x7f\u202ef\u2066g"
SHOWN = "a\\x1b[2J\\x1b]0;owned\\x07b\\x9b31mc\\x0dd\\x08e\\x7f\\u202ef\\u2066g"
BIDI = {*map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))}  # reorder what follows on screen


def _raw_controls(text: str) -> set[str]:
    return {c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0 or c in BIDI}


@pytest.mark.parametrize("batch", [1, 2], ids=["streamed", "batch"])
def test_control_characters_in_a_prompt_are_shown_escaped(batch, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join([HOSTILE] * batch))
    r = CliRunner().invoke(app, ["generate", *TINY, "--prompts-file", str(path), "-n", "2", "--no-stop"])
    assert r.exit_code == 0, r.output
    assert SHOWN in r.stdout, r.stdout
    assert not _raw_controls(r.stdout), sorted(_raw_controls(r.stdout))


def test_control_characters_in_model_output_are_shown_escaped(capsys):
    from kvbench.cli.generate import TextStream

    class Tok:
        eot_id = -1

        def decode(self, ids):
            return "".join(["\x1b[2J", "\x9b", "ok"][: len(ids)])

    stream = TextStream(Tok(), "p")
    for i in range(3):
        stream.push([i])
    stream.close()
    out = capsys.readouterr().out
    assert "\\x1b[2J\\x9bok" in out and not _raw_controls(out), repr(out)


def test_control_characters_in_an_error_line_are_shown_escaped(tmp_path):
    r = CliRunner().invoke(app, ["generate", *TINY, "--prompts-file", str(tmp_path / "x\x1b[2Jy")])
    line = _one_error_line(r)
    assert "x\\x1b[2Jy: file not found" in line and not _raw_controls(line), repr(line)


# --- messages that named the wrong thing ---------------------------------------------------------------------------
PROBE = {
    "10**21": "1" + "0" * 21,
    "5000 digits": "9" * 5000,
    "below 1 MiB": "1024",
    "negative": "-5",
    "exponent": "1e9",
    "superscript digit": "\u00b2",
    "Arabic-Indic digits": "\u0663" * 8,
}


@pytest.mark.parametrize("case", list(PROBE))
def test_probe_bytes_out_of_range_is_one_line(case):
    r = CliRunner().invoke(app, ["generate", "hi", *TINY], env={"KVBENCH_PROBE_BYTES": PROBE[case]})
    line = _one_error_line(r)
    assert "KVBENCH_PROBE_BYTES=" in line and "from 1048576 (1 MiB) to 1099511627776 (1 TiB)" in line, line


@pytest.mark.parametrize("where", ["option", "config"])
def test_bench_hf_with_fill_random_names_the_fill(where, tmp_path):
    cfg = tmp_path / "gpt2.json"
    cfg.write_text(json.dumps(GPT2_SMALL))
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('fill = "random"\n')
    fill = ["--fill", "random"] if where == "option" else ["--config", str(sweep)]
    r = CliRunner().invoke(app, ["bench", "--hf", str(cfg), "--device", "cpu", "--out", str(tmp_path / "run"), *fill])
    line = _one_error_line(r)
    assert ("--fill random:" if where == "option" else f"--config {sweep} sets fill = random:") in line, line
    assert "None" not in line and "engine = kvbench" not in line, line
    assert not (tmp_path / "run").exists()


def test_tokenizer_help_says_nothing_is_downloaded():
    r = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "300"})
    text = " ".join(r.stdout.split())
    assert "shipped inside kvbench; nothing is downloaded" in text and "download)" not in text, text


def test_memory_check_of_thousands_of_layers_is_refused_before_it_runs(tmp_path):
    cfg = {**LLAMA_JSON, "num_hidden_layers": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    line = _one_error_line(CliRunner().invoke(app, ["memory", "--config", str(path), "--check"]))
    assert "4,096 layers x 1 context is more than the 2,048 layer-steps it runs" in line, line
    two = _one_error_line(CliRunner().invoke(app, ["memory", "--config", str(path), "--check", "--ctx", "1k,2k"]))
    assert "x 2 contexts" in two and "give fewer --ctx values" in two, two
    r = CliRunner().invoke(app, ["memory", "--config", str(path), "--json"])  # the plan itself is unaffected
    assert r.exit_code == 0, r.output


def test_a_key_of_a_million_characters_is_refused_as_fast_as_a_short_one(tmp_path):
    """The too-deep scan looks for a run of dotted key parts; one long bare key must not make it quadratic (a key of
    100,000 characters took minutes before the scan started only where a key can start)."""
    import time

    path = tmp_path / "sweep.toml"
    path.write_text("k" * 1_000_000 + " = 1\n")
    t0 = time.perf_counter()
    r = CliRunner().invoke(app, ["bench", *BENCH, "--out", str(tmp_path / "run"), "--config", str(path)])
    assert r.exit_code == 2 and "unknown key" in _one_error_line(r), r.output
    assert time.perf_counter() - t0 < 60  # a margin for a loaded machine: the scan itself takes well under a second
