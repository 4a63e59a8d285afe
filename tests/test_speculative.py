"""Prompt-lookup speculative decoding (decode/speculative.py, `generate --draft prompt-lookup`): the same tokens as
plain greedy decoding on every built-in cache that can crop, drafts proposed and accepted on a repetitive prompt,
the draft lookup itself, and the refusals (no cache, a cache without crop, batches, sampling, --compile)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import CACHES
from kvbench.cli import app
from kvbench.decode.generate import generate
from kvbench.decode.speculative import lookup, speculative_generate
from kvbench.model.gpt2 import GPT
from tiny import varied_gpt

CROPPABLE = [c for c in CACHES if c != "none"]
REPETITIVE = [10, 20, 30, 40, 50, 60] * 5 + [10, 20]  # 32 tokens, period 6
NON_REPETITIVE = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:32].tolist()  # distinct ids
TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]


@pytest.fixture(scope="module")
def model() -> GPT:
    return varied_gpt()


@pytest.mark.parametrize("cache", CROPPABLE)
def test_repetitive_prompt_gives_plain_greedy_tokens_with_drafts_accepted(model, cache):
    plain = generate(model, [REPETITIVE], 60, cache=cache)
    spec = speculative_generate(model, [REPETITIVE], 60, cache=cache, draft_tokens=4, ngram=3)
    assert spec.generation.tokens == plain.tokens
    assert spec.generation.new_tokens == 60 and len(spec.generation.step_s) == 59
    assert 0 < spec.accepted < spec.proposed, (spec.accepted, spec.proposed)  # some drafts kept, some rejected
    assert spec.forwards < 60 and spec.forwards == 1 + len(spec.forward_s)
    assert spec.acceptance_rate == spec.accepted / spec.proposed


@pytest.mark.parametrize("cache", CROPPABLE)
def test_non_repetitive_prompt_gives_plain_greedy_tokens(model, cache):
    assert lookup(NON_REPETITIVE, 3, 4) == []  # no suffix occurs earlier: the first step is a plain one
    plain = generate(model, [NON_REPETITIVE], 40, cache=cache)
    spec = speculative_generate(model, [NON_REPETITIVE], 40, cache=cache)
    assert spec.generation.tokens == plain.tokens


def test_exactly_n_tokens_stop_token_and_streaming(model):
    for n in (1, 2, 7, 33):
        spec = speculative_generate(model, [REPETITIVE], n, draft_tokens=8)
        assert spec.generation.tokens == generate(model, [REPETITIVE], n).tokens
        assert len(spec.generation.tokens[0]) == n
    plain = generate(model, [REPETITIVE], 40).tokens[0]
    stop = plain[len(plain) // 2]  # a token the run produces
    streamed: list[int] = []
    spec = speculative_generate(model, [REPETITIVE], 40, stop_token=stop, on_token=streamed.extend)
    assert spec.generation.tokens == generate(model, [REPETITIVE], 40, stop_token=stop).tokens
    assert streamed == plain[: plain.index(stop) + 1]  # every kept token once, in order, the stop token last


def test_lookup_takes_the_most_recent_occurrence_read_with_its_period():
    assert lookup([1, 2, 3, 1, 2], 2, 4) == [3, 1, 2, 3]  # "1 2" 3 tokens back: period 3
    assert lookup([7, 1, 2, 9, 1, 2], 2, 2) == [9, 1]  # the latest occurrence, not the first
    assert lookup([1, 2, 3, 4, 5, 3], 3, 4) == [4, 5, 3, 4]  # no 3- or 2-gram: the 1-gram "3"
    assert lookup([5, 5], 3, 3) == [5, 5, 5]
    assert lookup([1, 2, 3], 3, 4) == [] and lookup([4], 3, 4) == [] and lookup([1, 2, 1], 2, 0) == []


def test_a_plugin_with_crop_runs(model, lifecycle_plugins):
    spec = speculative_generate(model, [REPETITIVE], 30, cache=f"{lifecycle_plugins}:Dynamic")
    assert spec.generation.tokens == generate(model, [REPETITIVE], 30).tokens and spec.accepted > 0


# --- the CLI ------------------------------------------------------------------------------------------------------
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"


def _run(*args):
    return CliRunner().invoke(app, ["generate", *TINY, *map(str, args)])


def test_cli_json_carries_the_draft_stats_and_the_plain_tokens():
    plain = _run(PROMPT, "-n", 24, "--no-stop", "--json")
    draft = _run(PROMPT, "-n", 24, "--no-stop", "--json", "--draft", "prompt-lookup", "--draft-tokens", 5)
    assert plain.exit_code == 0 and draft.exit_code == 0, (plain.output, draft.output)
    p, d = json.loads(plain.stdout), json.loads(draft.stdout)
    assert d["completions"][0]["tokens"] == p["completions"][0]["tokens"]
    assert p["draft"] is None and p["settings"]["draft"] == "none" and d["settings"]["draft"] == "prompt-lookup"
    stats = d["draft"]
    assert stats["method"] == "prompt-lookup" and stats["draft_tokens"] == 5 and stats["ngram"] == 3
    assert 0 < stats["accepted"] <= stats["proposed"] and stats["forwards"] < 24
    assert stats["acceptance_rate"] == stats["accepted"] / stats["proposed"]
    assert stats["tokens_per_forward"] == 24 / stats["forwards"]
    assert d["timings"]["generated_tokens"] == 24


def test_cli_summary_prints_the_draft_row():
    r = _run(PROMPT, "-n", 12, "--no-stop", "--draft", "prompt-lookup")
    assert r.exit_code == 0, r.output
    assert "draft (prompt-lookup)" in r.output and "draft tokens accepted" in r.output


REFUSED = {
    "no cache": (["--cache", "none"], "--cache none keeps none"),
    "batch": (["-p", "a"], "one prompt greedily (batch 1); 2 prompts"),
    "sampling": (["--temperature", "0.8"], "--temperature 0.8 samples"),
    "compile": (["--cache", "static-graph", "--compile", "default"], "which --draft does not run"),
    "draft tokens": (["--draft-tokens", "0"], "--draft-tokens must be >= 1"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_cli_refusals_are_one_line_before_the_model_loads(case, monkeypatch):
    import kvbench.cli.generate as cli_generate

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_generate, "load_for_cli", no_load)
    args, message = REFUSED[case]
    r = _run("hi", "--draft", "prompt-lookup", *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_cli_draft_settings_without_draft_and_unknown_methods_are_refused():
    r = _run("hi", "--ngram", 2)
    assert r.exit_code == 2 and "--ngram 2 has no effect without --draft prompt-lookup" in r.output, r.output
    r = _run("hi", "--draft", "medusa")
    assert r.exit_code == 2 and "--draft 'medusa': use none or prompt-lookup" in r.output, r.output


def test_cli_refuses_a_plugin_without_crop(lifecycle_plugins):
    r = _run("hi", "--draft", "prompt-lookup", "--cache", f"{lifecycle_plugins}:AppendOnly")
    assert r.exit_code == 2 and "does not implement crop" in r.output, r.output
