"""Careless and hostile input to generate, verify and break: each case one line on stderr, exit 2, nothing on stdout,
no traceback, and no work done first (the limits are checked before anything is allocated).

Bench and memory have their own tables (test_bench_bad_input.py, test_memory_bad_input.py)."""

import json
import re
import time

import pytest
from typer.testing import CliRunner

from kvbench.cli import app

TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "latin1.txt").write_bytes(b"caf\xe9\n")
    (d / "folder").mkdir()
    (d / "many_prompts.txt").write_text("hi\nhi there\n" * 50_000)  # 100,000 prompts of 1 and 2 tokens

    def checkpoint(name, cfg, weights=None):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps({"model_type": "gpt2", **cfg}))
        if weights is not None:
            (d / name / "pytorch_model.bin").write_bytes(weights)
        return str(d / name)

    ok = {"vocab_size": 500, "n_layer": 2, "n_head": 4, "n_embd": 64}
    checkpoint("float_layers", {**ok, "n_layer": 2.7})
    checkpoint("bool_heads", {**ok, "n_head": True})
    checkpoint("zero_layers", {**ok, "n_layer": 0})
    checkpoint("negative_width", {**ok, "n_embd": -64})
    checkpoint("string_vocab", {**ok, "vocab_size": "500"})
    checkpoint("heads_not_dividing", {**ok, "n_head": 3})
    checkpoint("huge_layers", {**ok, "n_layer": 10**9})
    checkpoint("nan_eps", {**ok, "layer_norm_epsilon": float("nan")})
    checkpoint("corrupt_bin", ok, weights=b"\x80\x04not a pickle at all" * 40)
    (d / "non_utf8").mkdir()
    (d / "non_utf8" / "config.json").write_bytes(b'{"model_type": "gpt2", "x": "\xff"}')
    return d


CASES = {
    # sizes: checked against the model's limits and sane bounds before anything is allocated
    "verify huge batch and prompt": (
        ["verify", "--batch", "2000000", "--prompt-len", "200000"],
        "--batch must be <= 1,048,576",
    ),
    "verify prompt beyond int64": (["verify", "--prompt-len", "99999999999999999999"], "exceeds the model's context"),
    "verify prompt beyond context": (["verify", "--prompt-len", "2000"], "exceeds the model's context of 1,024"),
    "verify zero prompt": (["verify", "--prompt-len", "0"], "--prompt-len must be >= 3"),
    "verify batch of one": (["verify", "--batch", "1"], "--batch must be >= 2"),
    "verify one new token": (["verify", "--new-tokens", "1"], "--new-tokens must be >= 2"),
    "generate zero tokens": (["generate", "hi", "-n", "0"], "--new-tokens must be >= 1"),
    "generate negative tokens": (["generate", "hi", "-n", "-5"], "--new-tokens must be >= 1"),
    "generate beyond context": (["generate", "hi", "-n", "99999999999999999999"], "exceeds the model's context"),
    "break beyond context": (["break", "all", "-n", "99999"], "exceeds the model's context"),
    "break batch of one": (["break", "all", "--batch", "1"], "--batch 1"),
    # numbers: finite, in range, integers where integers are meant
    "nan temperature": (["generate", "hi", "-t", "nan", "-n", "2"], "--temperature must be a finite number"),
    "infinite temperature": (["generate", "hi", "-t", "inf", "-n", "2"], "--temperature must be a finite number"),
    "negative temperature": (["generate", "hi", "-t", "-1", "-n", "2"], "--temperature must be >= 0"),
    "seed beyond 64 bits": (["generate", "hi", "--seed", "99999999999999999999"], "--seed must be <= "),
    "negative seed": (["verify", "--seed", "-1"], "--seed must be >= 0"),
    "float for an int": (["verify", "--batch", "2.5"], "Invalid value for '--batch'"),
    "top-k zero": (["generate", "hi", "--top-k", "0", "-t", "1"], "--top-k must be >= 1"),
    # no silent no-ops
    "top-k at temperature 0": (["generate", "hi", "--top-k", "5"], "has no effect at --temperature 0"),
    "empty model": (["generate", "hi", "-m", ""], "--model is empty"),
    "empty cache list": (["verify", "--caches", " , "], "no cache named"),
    "empty cache": (["generate", "hi", "--cache", ""], "unknown cache ''"),
    "break cache none": (["break", "all", "--cache", "none"], "--cache none"),
    "unknown option": (["verify", "--nope"], "No such option: --nope"),
    "unknown command": (["frobnicate"], "No such command 'frobnicate'"),
    "bad reference": (["verify", "--reference", "tf"], "--reference must be hf or none"),
    "bad device": (["generate", "hi", "--device", ""], "unknown device ''"),
    "unknown fault": (["break", "mask2"], "unknown fault 'mask2'"),
    "break sink fault in a short run": (
        ["break", "sink-evicts-one-more", "-n", "10"],
        "fires only past 36 tokens of context",
    ),
    "break sink fault, a one-token prompt": (
        ["break", "sink-evicts-one-more", "--prompt", "x", "-n", "2"],
        "this run's prompt of 1 token and 2 new ones stay within them",
    ),
    "break sink fault on another cache": (
        ["break", "sink-evicts-one-more", "--cache", "dynamic"],
        "lives in the sink cache; it cannot run on 'dynamic'",
    ),
    "prompts of different lengths on sink, 100,000 of them": (
        ["generate", "--prompts-file", "{many_prompts.txt}", "--cache", "sink"],
        "the prompts encode to 1, 2, 1, 2, 1 and 99,995 more tokens: give prompts of one length",
    ),
    # files
    "prompts file not UTF-8": (["generate", "--prompts-file", "{latin1.txt}"], "is not UTF-8 text"),
    "prompts file is a folder": (["generate", "--prompts-file", "{folder}"], "is a directory, not a file"),
    "prompts file missing": (["generate", "--prompts-file", "{nope.txt}"], "nope.txt: file not found"),
    "tokenizer folder without files": (["generate", "hi", "--tokenizer", "{folder}"], "has neither vocab.json"),
    "tokenizer not a ranks file": (["generate", "hi", "--tokenizer", "{latin1.txt}"], "malformed tokenizer file"),
    "weights is a file": (["generate", "hi", "--weights", "{latin1.txt}"], "is not a directory"),
    "config float": (["generate", "hi", "--weights", "{float_layers}"], "n_layer must be an integer, got 2.7"),
    "config bool": (["generate", "hi", "--weights", "{bool_heads}"], "n_head must be an integer, got True"),
    "config zero": (["generate", "hi", "--weights", "{zero_layers}"], "n_layer must be >= 1, got 0"),
    "config negative": (["generate", "hi", "--weights", "{negative_width}"], "n_embd must be >= 1, got -64"),
    "config string": (["generate", "hi", "--weights", "{string_vocab}"], "vocab_size must be an integer, got '500'"),
    "config heads": (["generate", "hi", "--weights", "{heads_not_dividing}"], "n_embd 64 is not divisible by n_head 3"),
    "config huge": (["verify", "--weights", "{huge_layers}"], "n_layer must be <= 1,000"),
    "config nan": (["generate", "hi", "--weights", "{nan_eps}"], "layer_norm_epsilon must be a finite number"),
    "config not UTF-8": (["generate", "hi", "--weights", "{non_utf8}"], "is not UTF-8 text"),
    "config as --model float": (
        ["generate", "hi", "-m", "{float_layers}/config.json", "--weights", "random"],
        "n_layer must be an integer",
    ),
    "corrupt checkpoint": (["generate", "hi", "--weights", "{corrupt_bin}"], "kvbench loads tensors only"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_nothing_on_stdout(case, files):
    args, message = CASES[case]
    args = [re.sub(r"\{([^}]+)\}", lambda m: str(files / m.group(1)), a) for a in args]
    has = set(args)
    extra = [] if ({"-m", "--weights"} & has) or args[0] == "frobnicate" else TINY
    if "--weights" in has and "--device" not in has:
        extra = ["--device", "cpu"]
    t0 = time.perf_counter()
    r = CliRunner().invoke(app, [args[0], *extra, *args[1:]])  # the case's own options come last and win
    elapsed = time.perf_counter() - t0
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert len(lines[0]) < 500, f"a refusal line of {len(lines[0]):,} characters: {lines[0][:1000]}"
    assert r.stdout == "", r.stdout
    assert "Traceback" not in r.output
    assert "weights_only=False" not in r.output  # never advise loading pickled code
    # refused before any work: seconds even on a busy machine, where loading a model and decoding would take minutes
    assert elapsed < 60, f"{case}: {elapsed:.1f} s: the input should be refused before any work"


def test_user_text_is_never_markup(ranks_file):
    """Brackets, closing tags and emoji codes in a prompt are printed as typed."""
    prompt = "a [/] b [bold]c[/bold] :smile: [link=x]d"
    r = CliRunner().invoke(app, ["generate", prompt, "-n", "3", *TINY, "--no-stop"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(prompt), r.stdout[:200]


def test_a_model_name_with_markup_in_an_error_is_literal():
    r = CliRunner().invoke(app, ["generate", "hi", "-m", "[/]bad[red]", "--weights", "random", "--device", "cpu"])
    assert r.exit_code == 2 and "unknown model '[/]bad[red]'" in r.stderr, r.output


def test_cpu_allocation_failure_is_reported_like_out_of_memory(monkeypatch):
    """An allocation the CPU cannot satisfy is one line and exit 3 (out of memory), as CUDA OOM is."""
    import kvbench.decode.generate as gen

    def no_memory(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried")

    monkeypatch.setattr(gen, "make_caches", no_memory)
    r = CliRunner().invoke(app, ["generate", "hi", "-n", "3", *TINY])
    assert r.exit_code == 3 and r.stderr.strip().splitlines() == [
        "error: out of CPU memory (an allocation failed); lower --batch, the lengths or the model"
    ], r.output


def test_an_unexpected_error_is_one_line_naming_a_bug(monkeypatch):
    import kvbench.decode.generate as gen

    def broken(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(gen, "make_caches", broken)
    r = CliRunner().invoke(app, ["generate", "hi", "-n", "3", *TINY])
    assert r.exit_code == 70, r.output
    (line,) = r.stderr.strip().splitlines()
    assert "unexpected ZeroDivisionError: division by zero (a kvbench bug" in line


def test_piped_output_is_not_wrapped_at_80_columns():
    """Not a terminal: prose and long table rows stay on one line each."""
    r = CliRunner().invoke(app, ["verify", "--caches", "dynamic", "-n", "2", "--reference", "none", *TINY])
    assert r.exit_code == 0, r.output
    note = [x for x in r.stdout.splitlines() if "seeded prompts of lengths" in x]
    assert len(note) == 1 and len(note[0]) > 100, r.stdout
