import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pytest
from typer.testing import CliRunner

from kvbench.caches import get_cache_spec
from kvbench.check.breaking import break_fault
from kvbench.check.faults import FAULTS, get_fault, mask_signature
from kvbench.check.verify import random_prompts, run_verify
from kvbench.cli import app
from kvbench.decode.generate import generate
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPT, GPTConfig

ONE_PROCESS = [n for n, f in FAULTS.items() if not f.tp]  # the tp faults: tests/test_tp.py

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=500)
N = 16


@pytest.fixture(scope="module")
def model() -> GPT:
    return GPT(CFG).init_weights(seed=0, std=0.1).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(CFG.vocab_size, 15, 3, seed=1)[::-1]  # lengths 5, 10, 15: shortest shown


def _new_tokens(name: str, prompts) -> int:
    """N, or for a fault that fires only past a context (the sink's 4 + 32 tokens) one token more than it needs:
    the shown prompt plus the new tokens pass it by one, so the boundary break refuses below is the real one."""
    past = FAULTS[name].fires_past
    return N if not past else past + 1 - len(prompts[0])


@pytest.fixture(scope="module")
def results(model, prompts):
    return {name: break_fault(model, name, prompts, _new_tokens(name, prompts)) for name in ONE_PROCESS}


@pytest.fixture(scope="module")
def control(model, prompts):
    """The un-faulted path through the same checks: it must pass, or detection would mean nothing."""
    return run_verify(model, sorted({f.cache for f in FAULTS.values()}), prompts, N)


def test_control_passes(control):
    assert control.passed, [r for r in control.checks if not r.passed]


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_every_fault_is_detected(results, name):
    r = results[name]
    assert r.detected and r.caught_by, r.checks
    assert r.fix and r.dormant_where and r.signature
    if not get_cache_spec(FAULTS[name].cache).exact:  # under the loose bound: only the exact policy rows see it
        assert all(c.endswith("=policy") for c in r.caught_by), r.caught_by
        assert all(c.passed for c in r.checks if not c.policy and not c.skipped), r.checks
        assert all(c.location for c in r.checks if c.policy and not c.passed), r.checks
        return
    assert r.first_divergence is not None, "the faulty run must differ from the correct one"
    assert r.correct_tokens != r.faulty_tokens


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_fault_is_dormant_where_documented(results, name):
    assert r_true(results[name].dormant_shown), results[name].dormant_shown


def r_true(shown: str) -> bool:
    return shown.endswith("True")


def test_expected_checks_catch_each_fault(results):
    assert "greedy" in results["position"].caught_by
    assert "reference" in results["position"].caught_by  # independent implementation disagrees too
    assert "logits" in results["mask"].caught_by
    assert results["padding"].caught_by == ["batched"]  # a batch of one is dormant: only batching shows it
    assert "cache_state" in results["reset"].caught_by
    assert "logits" in results["static-pointer"].caught_by


# Where each fault first shows (check/locate.py), on prompts of 5, 10 and 15 tokens: (the first check that caught it,
# what its location says). The single-prompt run's prompt is 5 tokens: step 1 writes slot 5.
LOCATIONS = {
    "position": ("logits", ["step 1, layer 0, head 0", "slot 5 (position 5): K differs from the reference"]),
    "mask": ("logits", ["K/V equal; attention output differs first at layer 0 (step 1, head 0", "query at position 5"]),
    "padding": (
        "batched",
        [
            "step 0 (prefill), row 1, layer 0",
            "slot 5 (position 0, after 5 pad slots): K differs",
            "holds position 5's K",
        ],
    ),
    "reset": (
        "cache_state",
        [
            "on the reused cache, step 0 (prefill), layer 0",
            "slot 0 (position 0): K differs",
            "holds the K the first prompt has",
            "reads 30 slots",
        ],
    ),
    "static-pointer": (
        "logits",
        ["step 1, layer 0", "slot 4 (position 4): K differs", "holds position 5's K; attention reads 5 slots where"],
    ),
    "stale-rollback": ("rollback", ["the second after crop(22), layer 0", "slot 23 (position 23): K differs"]),
    "aliased-fork": ("fork", ["scenario on the fork, the second after fork(), layer 0", "slot 15 (position 15): K"]),
    "reorder-keys-only": ("reorder", ["the first after reorder([1, 1, 0]), row 0, layer 0", "V differs", "row 2's V"]),
    "chunk-causal": ("rollback", ["K/V equal; attention output differs first at layer 0 (forward 6 of the rollback"]),
    # the lossy faults: caught by the rows held to the design's declared policy, located by check/policy.py
    "int8-reorder-scales": (
        "reorder =policy",
        ["forward 2 of the reorder scenario, layer 0 K differs first at row 0, head 0, slot 0 (position 0)"],
    ),
    "int8-requantised-fork": (
        "fork =policy",
        ["forward 2 of the fork scenario, layer 0 K differs first at head 0, slot 0 (position 0)"],
    ),
    # the run passes the sink's 4 + 32 tokens by one: the last step's query (position 35) loses position 4
    "sink-evicts-one-more": (
        "logits =policy",
        ["step 31, layer 0 no longer holds position 4, which the query at 35 may still read"],
    ),
}


def test_every_one_process_fault_has_its_location():
    assert sorted(LOCATIONS) == sorted(ONE_PROCESS)


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_each_fault_is_located_where_it_lives(results, name):
    """The location names the step, layer, head and slot a porter would inspect, or the layer whose attention reads
    the right K/V wrongly; every check that caught the fault carries its own."""
    r = results[name]
    check, parts = LOCATIONS[name]
    assert r.location.startswith(f"{check}: "), r.location
    for part in parts:
        assert part in r.location, (part, r.location)
    failing = [c for c in r.checks if not c.passed and not c.skipped]
    assert failing and all(c.location for c in failing), [(c.name, c.location) for c in failing]
    assert all(not c.location for c in r.checks if c.passed), "only failing rows are located"


def test_position_bug_is_dormant_without_cache(model, prompts):
    ok = generate(model, [prompts[2]], N, cache="none").tokens
    bug = FAULTS["position"].rules
    assert generate(model, [prompts[2]], N, cache="none", rules=bug).tokens == ok
    assert generate(model, [prompts[2]], N, cache="dynamic", rules=bug).tokens != ok


def test_mask_signature_attends_to_key_zero_only(model, prompts):
    s = mask_signature(model, prompts[2])
    assert s["keys"] == len(prompts[2]) + 1
    assert s["mass_on_key0_wrong"] == pytest.approx(1.0)
    assert s["keys_attended_wrong"] == 1
    assert s["keys_attended_right"] == s["keys"]
    assert s["mass_on_key0_right"] < 0.9


def test_a_faulty_run_leaves_nothing_behind(model, prompts):
    """The faults are passed into the loop, never set on the model: a correct run after a faulty one is correct."""
    ok = generate(model, [prompts[0]], 6, cache="dynamic").tokens
    assert generate(model, [prompts[0]], 6, cache="dynamic", rules=FAULTS["mask"].rules).tokens != ok
    assert generate(model, [prompts[0]], 6, cache="dynamic").tokens == ok


def test_break_prompts_always_hold_two_lengths_for_the_padding_fault(ranks_file):
    from kvbench.check.breaking import break_prompts
    from kvbench.model.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ranks_file))
    for prompt in ("abc", "The key to fast inference is", None):
        ids = break_prompts(tok, 50257, prompt, 2, 0)
        assert len({len(p) for p in ids}) == 2, ids


def test_fault_names_are_trimmed_as_cache_names_are():
    assert get_fault(" mask ").name == "mask"


def test_unknown_fault_lists_the_known_ones():
    with pytest.raises(KVBenchError, match="static-pointer"):
        get_fault("nope")


def test_cli_break_json():
    r = CliRunner().invoke(
        app,
        "break mask --model gpt2-tiny --weights random --new-tokens 4 --reference none --json".split(),
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["all_detected"] is True
    (bug,) = doc["bugs"]
    assert bug["name"] == "mask" and bug["detected"] and bug["caught_by"]
    assert bug["first_divergence"] is not None
    assert bug["location"].startswith("logits: K/V equal; attention output differs first at layer 0"), bug
    rows = {c["name"]: c for c in bug["checks"]}
    assert rows["logits"]["location"].startswith("K/V equal; attention output differs first at layer 0 (step 1")
    assert rows["cache_state"]["passed"] and rows["cache_state"]["location"] == ""
    r = CliRunner().invoke(app, "break mask --model gpt2-tiny --weights random --new-tokens 4 --reference none".split())
    assert "location (logits): K/V equal; attention output differs first at layer 0" in r.stdout, r.stdout


def test_a_fault_that_fires_past_the_run_is_skipped_or_refused(results, prompts):
    """The sink fault fires once a run's context passes 4 + 32 tokens (the fixture's run passes it by one token and
    is caught): `break all` on a shorter run skips it with the reason, `break sink-evicts-one-more` refuses it, each
    saying how many new tokens it needs."""
    from kvbench.check.faults import select_faults

    assert results["sink-evicts-one-more"].detected
    assert sum(map(len, prompts[:1])) + _new_tokens("sink-evicts-one-more", prompts) == 37
    names, why = select_faults("all", None, 1, (5, 31))
    assert "sink-evicts-one-more" not in names and "mask" in names, names
    assert why["sink-evicts-one-more"].endswith("the bug is dormant: use --new-tokens 32 or more"), why
    assert "sink-evicts-one-more" in select_faults("all", None, 1, (5, 32))[0]
    with pytest.raises(KVBenchError, match=r"^the sink-evicts-one-more fault fires only past 36 tokens of context"):
        select_faults("sink-evicts-one-more", None, 1, (6, 30))


@pytest.mark.parametrize("cache", ["sink", "sink-0-1", "sink-4-256"])
def test_a_batched_fault_is_skipped_on_a_cache_that_takes_no_left_padded_batch(cache):
    from kvbench.check.faults import FAULTS, select_faults

    batched = [n for n, f in FAULTS.items() if f.batched]
    assert batched == ["padding"]
    names, why = select_faults("all", cache, 1, (6, 40))
    assert "padding" not in names and "mask" in names and "position" in names, names
    assert why["padding"] == (
        f"it needs a left-padded batch, and {cache} takes none: it evicts by position, so its slots are positions, "
        "not columns"
    )
    with pytest.raises(KVBenchError, match=rf"^the padding fault needs a left-padded batch, and {cache} takes none"):
        select_faults("padding", cache, 1)
    assert "padding" in select_faults("all", "dynamic", 1, (6, 40))[0]  # a cache that takes one runs it


def test_cli_break_all_on_a_sink_cache_runs_what_applies_and_skips_padding():
    args = "break all --cache sink --model gpt2-tiny --weights random --device cpu -n 4 --reference none --json"
    r = CliRunner().invoke(app, args.split())
    assert r.exit_code == 0, r.output  # every fault that runs is detected; none ends the run
    doc = json.loads(r.stdout)
    assert {b["name"] for b in doc["bugs"]} == {"position", "mask", "reset", "chunk-causal"}, doc["bugs"]
    assert all(b["detected"] and b["cache"] == "sink" for b in doc["bugs"])
    assert "padding: skipped (it needs a left-padded batch, and sink takes none" in r.output, r.output
    one = CliRunner().invoke(app, args.replace("all", "padding").split())
    assert one.exit_code == 2 and "takes none" in one.output and "Traceback" not in one.output, one.output


def test_cli_break_that_runs_no_fault_checked_nothing_and_exits_5(monkeypatch, tmp_path):
    """Every fault skipped: nothing was detected and nothing slipped through, which is no verdict: exit 5, in the
    table, the JSON document and the JUnit report (every case skipped)."""
    from kvbench.check import faults

    monkeypatch.setattr(faults, "select_faults", lambda name, cache, tp=1, context=None: ([], {"mask": "not here"}))
    args = "break all --model gpt2-tiny --weights random --new-tokens 4 --reference none".split()
    xml = tmp_path / "b.xml"
    r = CliRunner().invoke(app, [*args, "--json", "--junit-xml", str(xml)])
    assert r.exit_code == 5, r.output
    doc = json.loads(r.stdout)
    assert doc["all_detected"] is False and doc["nothing_checked"] is True and doc["bugs"] == [], doc
    assert 'tests="1"' in xml.read_text() and 'skipped="1"' in xml.read_text(), xml.read_text()
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 5 and "NOTHING CHECKED" in r.stdout and "mask: skipped (not here)" in r.output, r.output


@pytest.mark.parametrize(
    "args, match",
    [
        (["break", "nope"], "known faults"),
        (["break", "padding", "--batch", "1"], "padding"),
        (["break", "position", "--new-tokens", "0"], "new-tokens"),
        (["break", "position", "--new-tokens", "2000"], "context"),
    ],
)
def test_cli_break_bad_input_exits_2(args, match):
    r = CliRunner().invoke(app, [*args, "--model", "gpt2-tiny", "--weights", "random", "--reference", "none"])
    assert r.exit_code == 2, r.output
    assert match in r.output, r.output


@pytest.mark.parametrize("cache", ["static", "static-graph", "paged", "int8"])
def test_reset_fault_on_a_fixed_capacity_cache_shows_stale_columns_not_an_overflow(cache):
    """The reset bug keeps the first prompt's K/V: a cache sized for one prompt would overflow and stop `break all`
    with a bad-input error; sized for both, the stale columns show and the fault is caught."""
    r = CliRunner().invoke(
        app,
        [
            "break",
            "reset",
            "--cache",
            cache,
            *"--model gpt2-tiny --weights random --device cpu --new-tokens 4 --reference none --json".split(),
        ],
    )
    assert r.exit_code == 0, r.output
    (bug,) = json.loads(r.stdout)["bugs"]
    # int8 is held to its declared roundtrip: its =policy row judges it (its loose row is the policy's cost)
    caught = "cache_state =policy" if cache == "int8" else "cache_state"
    assert bug["detected"] and caught in bug["caught_by"], bug
    assert "stale columns instead of 0" in bug["signature"] and "with 0 stale" not in bug["signature"]
