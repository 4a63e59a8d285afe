import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import CACHES, get_cache_spec
from kvbench.check.gpt2_subject import full_logits
from kvbench.check.suite import CHECKS
from kvbench.check.verify import random_prompts, run_verify
from kvbench.cli import app
from kvbench.decode.generate import generate
from kvbench.model.gpt2 import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=500)
N = 24


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).init_weights(seed=0, std=0.1).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(CFG.vocab_size, 15, 3, seed=0)  # lengths 15, 10, 5


@pytest.fixture(scope="module")
def report(model, prompts):
    return run_verify(model, list(CACHES), prompts, N)


def test_prompts_have_three_different_lengths(prompts):
    assert len({len(p) for p in prompts}) == 3, [len(p) for p in prompts]


def test_output_depends_on_the_prompt(model, prompts):
    a = generate(model, [prompts[0]], N, cache="none").tokens[0]
    b = generate(model, [prompts[1]], N, cache="none").tokens[0]
    assert a != b
    assert len(set(a)) > 3, f"degenerate greedy output {a}"


def test_teacher_forced_rows_equal_the_no_cache_loop(model, prompts):
    """verify's shortcut: one causal forward's argmax rows are the `none` loop's tokens, and its rows its logits."""
    loop = generate(model, [prompts[0]], N, cache="none", record_logits=True)
    rows = full_logits(model, prompts[0], loop.tokens[0])[len(prompts[0]) - 1 :]
    assert rows.argmax(-1).tolist() == loop.tokens[0]
    torch.testing.assert_close(rows, torch.cat(loop.logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", list(CACHES))
def test_every_check_passes_on_every_cache(report, cache):
    rows = [r for r in report.checks if r.cache == cache]
    expected = {"reference", "batched"} if get_cache_spec(cache).factory is None else set(CHECKS)
    assert {r.name for r in rows} == expected
    for r in rows:
        assert r.passed, r
        if r.skipped:  # a design that evicts by position takes no left-padded batch
            assert r.name == "batched" and not get_cache_spec(cache).padding, r
            continue
        assert r.max_abs_diff is not None
        if r.policy:  # held to its declared policy at the exact tolerance
            assert "lossy" not in r.tolerance and r.max_abs_diff <= 1e-5, r
        elif not get_cache_spec(cache).exact:
            assert "lossy" in r.tolerance, r  # lossy caches pass by their documented tolerance, saying so


def test_exact_caches_match_to_1e5_in_fp32(report):
    for r in report.checks:
        if get_cache_spec(r.cache).exact and r.name != "reference":
            assert r.max_abs_diff <= 1e-5, r


def test_reference_loads_hf_directory(model, prompts, tmp_path):
    """When weights come from a Hugging Face directory, the reference is loaded from it (our port is checked)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from kvbench.model.weights import load_model

    torch.manual_seed(1)
    hf_cfg = GPT2Config(
        vocab_size=500, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
    )
    GPT2LMHeadModel(hf_cfg).save_pretrained(tmp_path)
    ours = load_model(None, str(tmp_path), torch.device("cpu"), torch.float32).model
    rep = run_verify(ours, ["none", "dynamic"], prompts, 8, hf_dir=str(tmp_path), checks=("reference",))
    assert rep.passed and len(rep.checks) == 2, rep.checks
    # and the check can fail: a port that forgets one Conv1D transpose is caught against the directory
    with torch.no_grad():
        w = ours.transformer.h[0].mlp.c_fc.weight
        ours.transformer.h[0].mlp.c_fc.weight.copy_(w + 0.05 * torch.randn_like(w))
    rep = run_verify(ours, ["none"], prompts, 8, hf_dir=str(tmp_path), checks=("reference",))
    assert not rep.passed, rep.checks


def test_bf16_reports_near_ties_instead_of_failing(model, prompts):
    m = GPT(CFG).init_weights(seed=0, std=0.1).eval().to(torch.bfloat16)
    rep = run_verify(m, ["dynamic"], prompts, 16, reference="none")
    assert rep.dtype == "bf16"
    assert any("near-tie" in n for n in rep.notes)
    for r in rep.checks:
        assert r.passed or "near-tie" not in r.detail, r


def test_cli_verify_json(tmp_path):
    r = CliRunner().invoke(
        app,
        [
            *"verify --model gpt2-tiny --weights random --caches dynamic,static --prompt-len 6 --new-tokens 4".split(),
            *"--reference none --json".split(),
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["passed"] is True
    assert {c["cache"] for c in doc["checks"]} == {"dynamic", "static"}
    assert {"name", "cache", "passed", "max_abs_diff", "first_divergence"} <= set(doc["checks"][0])


def test_cli_verify_bad_input_exits_2():
    r = CliRunner().invoke(app, ["verify", "--model", "gpt2-tiny", "--weights", "random", "--new-tokens", "0"])
    assert r.exit_code == 2, r.output
    r = CliRunner().invoke(app, ["verify", "--model", "gpt2-tiny", "--weights", "random", "--caches", "nope"])
    assert r.exit_code == 2, r.output


# --- logits that are not finite (a checkpoint with NaN or inf in a weight) -----------------------------------------
def _poisoned(tmp_path_factory, name: str, poison) -> str:
    """A tiny Hugging Face GPT-2 saved with `poison(model)` applied to its weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        n_positions=64,
        vocab_size=300,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        poison(model)
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    return str(d)


def _nan_mlp(m):
    m.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")  # every position goes NaN from layer 0 on


def _inf_norm(m):
    m.transformer.ln_f.weight[0] = float("inf")  # every logit +-inf or NaN


def _nan_token(m):
    m.transformer.wte.weight[7, 0] = float("nan")  # tied lm_head: one NaN logit (token 7) in every row


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> dict[str, str]:
    return {
        name: _poisoned(tmp_path_factory, name, fn)
        for name, fn in (("nan-mlp", _nan_mlp), ("inf-norm", _inf_norm), ("nan-token", _nan_token))
    }


@pytest.mark.parametrize("ckpt", ["nan-mlp", "inf-norm", "nan-token"])
@pytest.mark.parametrize("subject", ["weights", "hf"])
def test_not_finite_logits_fail_every_check_with_the_reason(poisoned, ckpt, subject):
    """NaN or inf logits are a failing row saying so, for every check and every cache (exit 1), never a crash; and
    never a pass because two NaN runs happen to pick the same argmax."""
    where = ["--weights", poisoned[ckpt], "--device", "cpu"] if subject == "weights" else ["--hf", poisoned[ckpt]]
    caches = ["--caches", "none,dynamic"]
    r = CliRunner().invoke(app, ["verify", *where, *caches, "--prompt-len", "6", "--new-tokens", "4", "--json"])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and "kvbench bug" not in r.output, r.output
    checks = [c for c in json.loads(r.stdout)["checks"] if not c["skipped"]]
    assert checks and not any(c["passed"] for c in checks), checks
    for c in checks:
        assert "logits are not finite (" in c["detail"] and " NaN, " in c["detail"], c
    first = checks[0]["detail"] if subject == "hf" else next(c for c in checks if c["name"] == "logits")["detail"]
    assert "the model itself is not finite" in first, first


@pytest.mark.parametrize("ckpt", ["nan-mlp", "inf-norm", "nan-token"])
@pytest.mark.parametrize("fault", ["position", "static-pointer", "all"])
def test_break_refuses_a_model_that_is_not_finite(poisoned, ckpt, fault):
    """break cannot show a fault caught when the clean model's own logits are NaN: one line saying so, exit 2."""
    r = CliRunner().invoke(app, ["break", fault, "--weights", poisoned[ckpt], "--device", "cpu", "-n", "4"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert "the clean model is not finite: with no fault injected, logits are not finite (" in lines[0], lines[0]
    assert "detected" not in r.stdout, r.stdout


def test_finite_check_compares_nothing_it_cannot():
    """The rule itself: NaN anywhere in either run fails the comparison with counts; finite runs compare as before."""
    from kvbench.check.judge import not_finite

    a = torch.zeros(3, 5)
    assert not_finite([("x", a), ("y", a)]) is None
    b = a.clone()
    b[1, 2], b[2, 0], b[0, 4] = float("nan"), float("inf"), -float("inf")
    assert not_finite([("x", a), ("y", b)]) == "logits are not finite (1 NaN, 2 inf) in y"
