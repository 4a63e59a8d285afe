"""verify --text: real text through every cache; exact caches score transformers' perplexity, lossy ones move it,
and every bad input is one line."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch
from typer.testing import CliRunner

from kvbench.check.text import windows
from kvbench.cli import app
from kvbench.resources import TEMPEST_HELDOUT

SHK = ["-m", "gpt2-shakespeare", "--device", "cpu"]
FAST = ["-n", "4", "--prompt-len", "8"]


@pytest.fixture(scope="module")
def short_text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "tempest.txt"
    p.write_text(TEMPEST_HELDOUT.read_text(encoding="utf-8")[:900], encoding="utf-8")  # ~250 tokens
    return p


@pytest.mark.parametrize(("n", "window"), [(2, 2), (5, 512), (100, 16), (101, 16), (3089, 512), (40, 7)])
def test_windows_score_every_token_once_with_context(n, window):
    scored: list[int] = []
    for k, (begin, end, first) in enumerate(windows(n, window)):
        assert 0 <= begin < first < end <= n and end - begin <= window
        if k:
            assert first - begin >= min(window, n) - max(1, min(window, n) // 2)  # at least window - stride read
        scored += range(first, end)
    assert scored == list(range(1, n))


def test_text_rows_exact_caches_score_transformers_perplexity_lossy_ones_move():
    """The library path, on 160 tokens in windows of 64: the no-cache forward, transformers and the exact caches give
    one perplexity; int8 and sink move it."""
    from kvbench.check.gpt2_subject import GPT2Model, GPT2Subject
    from kvbench.check.text import text_rows
    from kvbench.check.verify import gpt2_text_run
    from kvbench.model.tokenizer import load_tokenizer
    from kvbench.model.weights import load_model
    from kvbench.resources import BUNDLED_MODELS

    model = load_model("gpt2-shakespeare", "auto", torch.device("cpu"), torch.float32).model
    target = GPT2Model(model, "hf", str(BUNDLED_MODELS["gpt2-shakespeare"]))
    ids = load_tokenizer().encode(TEMPEST_HELDOUT.read_text(encoding="utf-8"))[:160]
    subjects = [GPT2Subject(target, c) for c in ("none", "static", "int8", "sink")]
    rows, text = text_rows(gpt2_text_run(target, ids, 64), subjects, torch.float32)
    assert all(r.passed for r in rows) and [r.cache for r in rows] == ["none", "static", "int8", "sink"]
    ref, caches = text["ppl_transformers"], text["caches"]
    assert text["windows"] == 4 and text["stride"] == 32  # sink (4 + 32 kept) evicts past depth 36
    for name in ("none", "static"):
        assert abs(math.log(caches[name]["ppl"] / ref)) <= 1e-4 and caches[name]["exact"], (name, caches[name])
    for name in ("int8", "sink"):
        assert caches[name]["ppl"] != ref and caches[name]["kld"]["mean"] > 0 and not caches[name]["exact"]
    assert abs(caches["sink"]["ln_ppl_ratio"]) > abs(caches["int8"]["ln_ppl_ratio"]) > 0


@pytest.mark.slow
def test_verify_text_exact_caches_equal_transformers_lossy_ones_move(short_text, tmp_path):
    plot, junit = tmp_path / "kld.png", tmp_path / "verify.xml"
    args = ["verify", *SHK, *FAST, "--caches", "dynamic,static,int8,sink", "--text", str(short_text)]
    r = CliRunner().invoke(app, [*args, "--window", "64", "--plot", str(plot), "--junit-xml", str(junit), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    text = doc["text"]
    assert text["window"] == 64 and text["stride"] == 32 and text["windows"] > 3
    assert text["file"] == str(short_text) and text["plot"] == str(plot)
    ref = text["ppl_transformers"]
    assert 1 < ref < 5_000 and math.isclose(text["ppl_no_cache"], ref, rel_tol=1e-4)
    caches = text["caches"]
    for name in ("none", "dynamic", "static"):
        c = caches[name]
        assert c["exact"] and c["passed"] and abs(math.log(c["ppl"] / ref)) <= 1e-4, (name, c["ppl"], ref)
        assert c["kld"]["mean"] < 1e-9 and c["top1_agreement"] == 1.0
    for name in ("int8", "sink"):
        c = caches[name]
        assert not c["exact"] and c["passed"] and c["ppl"] != ref and c["kld"]["mean"] > 0, (name, c)
        assert {"mean", "p99", "max"} <= set(c["kld"]) and c["by_depth"] and c["rms_dp"] > 0
    # sink keeps 4 + 32 tokens of a 64-token window: deep predictions lose context, int8 only rounds it
    assert abs(caches["sink"]["ln_ppl_ratio"]) > abs(caches["int8"]["ln_ppl_ratio"]) > 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    rows = [c for c in doc["checks"] if c["name"] == "text"]
    assert {c["cache"] for c in rows} == {"none", "dynamic", "static", "int8", "sink"}
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    names = {c.get("name") for c in suite.iter("testcase")}
    assert {"verify.text.dynamic", "verify.text.int8"} <= names
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert float(props["text.ppl.int8"]) == pytest.approx(caches["int8"]["ppl"])


def test_verify_text_json_follows_the_schema(short_text):
    import jsonschema

    from kvbench.jsonio import load_schema

    r = CliRunner().invoke(app, ["verify", *SHK, *FAST, "--caches", "dynamic", "--text", str(short_text), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema.Draft202012Validator(load_schema("verify")).validate(doc)
    assert set(doc["text"]["caches"]) == {"none", "dynamic"} and doc["text"]["plot"] is None  # no lossy cache
    assert "ppl" in doc["text"]["caches"]["dynamic"] and "kld" in doc["text"]["caches"]["dynamic"]


def test_an_exact_cache_off_the_reference_fails_its_text_row():
    from kvbench.check.text import TEXT_TOLERANCES, _row

    tol = TEXT_TOLERANCES[torch.float32]
    got = {"ppl": 100.0 * math.exp(3 * tol), "tokens": 10, "kld": {"mean": 0.0}, "top1_agreement": 1.0}
    assert not _row("static", True, got, 100.0, "transformers", tol).passed
    assert _row("int8", False, got, 100.0, "transformers", tol).passed  # lossy: reported
    assert not _row("int8", False, {**got, "ppl": math.inf}, 100.0, "transformers", tol).passed


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_text("")
    (d / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    (d / "nul.txt").write_bytes(b"text\x00with a NUL")
    (d / "one.txt").write_text("Hi")
    (d / "folder").mkdir()
    (d / "ok.txt").write_text("Where is the master, boatswain? Do you not hear him?")
    return d


BAD = {
    "missing": (["--text", "{nope.txt}"], "file not found"),
    "empty": (["--text", "{empty.txt}"], "holds 0 tokens"),
    "binary": (["--text", "{binary.bin}"], "is not UTF-8 text"),
    "NUL bytes": (["--text", "{nul.txt}"], "is not text"),
    "one token": (["--text", "{one.txt}"], "holds 1 token; perplexity needs at least 2"),
    "a folder": (["--text", "{folder}"], "is a directory"),
    "window 1": (["--text", "{ok.txt}", "--window", "1"], "at least 2 tokens"),
    "window past context": (["--text", "{ok.txt}", "--window", "513"], "longer than gpt2-shakespeare's context"),
    "plot is a folder": (["--text", "{ok.txt}", "--plot", "{folder}"], "is a folder"),
    "window without text": (["--text", "none", "--window", "64"], "--window goes with --text"),
    "text under --tp": (["--text", "{ok.txt}", "--tp", "2"], "--text runs in one process"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_text_input_is_one_line_exit_2(case, bad_files):
    args, message = BAD[case]
    args = [a.replace("{", str(bad_files) + "/").replace("}", "") if a.startswith("{") else a for a in args]
    r = CliRunner().invoke(app, ["verify", *SHK, *args])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


def test_a_model_without_gpt2s_vocabulary_is_refused(bad_files, tmp_path):
    cfg = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 64, "vocab_size": 500}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ["verify", "-m", str(tmp_path / "config.json"), "-w", "random", "-d", "cpu", *FAST]
    r = CliRunner().invoke(app, [*args, "--text", str(bad_files / "ok.txt")])
    assert r.exit_code == 2, r.output
    assert "tokenizes with GPT-2's BPE" in r.stderr and "vocabulary of 500" in r.stderr


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama with a tokenizer of its own (a BPE of under 256 ids trained here, offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tiny import tiny_llama

    d = tmp_path_factory.mktemp("llama-text")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(d)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEMPEST_HELDOUT.read_text(encoding="utf-8")], trainers.BpeTrainer(vocab_size=200))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    return d


def test_verify_hf_text(tiny_llama_dir, short_text):
    args = ["verify", "--hf", str(tiny_llama_dir), "--device", "cpu", *FAST, "--caches", "dynamic,static"]
    r = CliRunner().invoke(app, [*args, "--text", str(short_text), "--window", "48", "--json"])
    assert r.exit_code == 0, r.output
    text = json.loads(r.stdout)["text"]
    assert text["tokenizer"].endswith(f"from {tiny_llama_dir}") and text["window"] == 48
    assert text["ppl_transformers"] == text["ppl_no_cache"]  # the model is its own reference
    for name in ("dynamic", "static"):
        c = text["caches"][name]
        assert c["exact"] and c["passed"] and abs(math.log(c["ppl"] / text["ppl_no_cache"])) <= 1e-4, c


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_verify_hf_text_needs_the_models_tokenizer(tmp_path, short_text, arch):
    """A folder of weights without tokenizer files. For gpt2, transformers (5.25) builds an empty GPT2Tokenizer
    rather than raising: the text must not be scored as zero tokens."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from tiny import tiny_llama

    config = tiny_llama() if arch == "llama" else GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    r = CliRunner().invoke(app, ["verify", "--hf", str(tmp_path), "--device", "cpu", "--text", str(short_text)])
    assert r.exit_code == 2, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "needs the model's tokenizer" in r.stderr


def test_verify_hf_names_the_bundled_model_and_scores_it_with_its_own_bpe(short_text):
    """`--hf gpt2-shakespeare` is the shipped folder (weights only) read by transformers, its text tokenized with the
    GPT-2 BPE it was trained with: transformers' perplexity equals the one our own model scores on the same windows,
    and transformers' fp8 QuantizedCache moves it."""
    text_args = ["--text", str(short_text), "--window", "128", "--json"]
    r = CliRunner().invoke(
        app, ["verify", "--hf", "gpt2-shakespeare", "-d", "cpu", *FAST, "--caches", "static,quantized-fp8", *text_args]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    hf = doc["text"]
    assert hf["tokenizer"].startswith("GPT-2 BPE (bundled") and doc["weights"] == "bundled:gpt2-shakespeare"
    ours = CliRunner().invoke(
        app, ["verify", "-m", "gpt2-shakespeare", "-d", "cpu", *FAST, "--caches", "static", *text_args]
    )
    assert ours.exit_code == 0, ours.output
    mine = json.loads(ours.stdout)["text"]
    assert hf["tokens"] == mine["tokens"] and hf["scored"] == mine["scored"]
    assert abs(math.log(hf["ppl_no_cache"] / mine["ppl_no_cache"])) <= 1e-4
    assert hf["caches"]["static"]["passed"] and not hf["caches"]["quantized-fp8"]["exact"]
    assert abs(math.log(hf["caches"]["quantized-fp8"]["ppl"] / hf["ppl_no_cache"])) > 1e-4


@pytest.mark.parametrize(
    ("given", "scored"),
    [
        ({}, True),
        ({"tp": 2}, False),  # --text runs in one process: no default text to refuse under --tp
        ({"endpoint": "http://127.0.0.1:1"}, False),
        ({"weights": "random"}, False),
        ({"model": "gpt2"}, False),
        ({"hf": "gpt2-shakespeare"}, True),
        ({"hf": "gpt2-shakespeare", "tp": 2}, False),
        ({"text": "none"}, False),
    ],
)
def test_the_bundled_passage_is_the_default_only_where_text_is_scored(given, scored):
    from types import SimpleNamespace

    from kvbench.cli.verify_text import text_path

    o = SimpleNamespace(
        **{"text": None, "hf": None, "endpoint": None, "tp": 1, "model": "gpt2-shakespeare"}
        | {"weights": "auto", **given}
    )
    assert (text_path(o) == str(TEMPEST_HELDOUT)) is scored


@pytest.mark.slow
def test_verify_tp_on_the_bundled_model_runs_without_text():
    """Ranks re-run the command line, so this runs kvbench in a process of its own."""
    import os
    import subprocess
    import sys

    args = ["verify", "-m", "gpt2-shakespeare", "--tp", "2", "-d", "cpu", *FAST, "--caches", "static"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASSED" in r.stdout and "text" not in r.stderr
