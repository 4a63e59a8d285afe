"""The lifecycle checks (rollback, fork, reorder, chunked_prefill): every built-in cache passes them on our GPT-2;
transformers' caches pass or skip with transformers' own reason on Llama, Qwen2, Mistral and Gemma 2; a plugin with a
broken crop fails exactly `rollback`, one without the operations skips them; the four lifecycle faults of `break`
are each caught by their check and dormant in plain generation."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import CACHES
from kvbench.check.breaking import break_fault
from kvbench.check.lifecycle import LIFECYCLE
from kvbench.check.verify import random_prompts, run_verify
from kvbench.cli import app
from kvbench.model.gpt2 import GPT
from tiny import ByFamily, tiny_families, varied_gpt

TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]


@pytest.fixture(scope="module")
def model() -> GPT:
    return varied_gpt()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(256, 20, 3, seed=0)


@pytest.mark.parametrize("cache", [c for c in CACHES if c != "none"])
def test_every_built_in_cache_passes_the_lifecycle(model, prompts, cache):
    rep = run_verify(model, [cache], prompts, 20, reference="none", checks=LIFECYCLE)
    assert [r.name for r in rep.checks if not r.policy] == list(LIFECYCLE), rep.checks
    for r in rep.checks:
        assert r.passed and not r.skipped, r
        if CACHES[cache].exact or r.policy:  # a lossy design is exact to its own policy
            assert r.max_abs_diff <= 1e-5, r


@pytest.mark.parametrize(
    "fault, check",
    [
        ("stale-rollback", "rollback"),
        ("aliased-fork", "fork"),
        ("reorder-keys-only", "reorder"),
        ("chunk-causal", "chunked_prefill"),
    ],
)
def test_lifecycle_faults_are_caught_by_their_check_and_dormant_in_generate(model, prompts, fault, check):
    r = break_fault(model, fault, prompts, 12, reference="none")
    assert r.detected and check in r.caught_by, (r.caught_by, r.checks)
    assert {"logits", "greedy", "batched", "cache_state"}.isdisjoint(r.caught_by), r.caught_by
    assert r.dormant_shown.endswith("True"), r.dormant_shown


# --- plugins ------------------------------------------------------------------------------------------------------
def _verify(*args):
    r = CliRunner().invoke(app, ["verify", *args, *TINY, "-n", "8", "--reference", "none", "--json"])
    return r, {(c["name"], c["cache"]): c for c in json.loads(r.stdout)["checks"]}


def test_a_plugin_with_a_broken_crop_fails_rollback_only(lifecycle_plugins):
    ref = f"{lifecycle_plugins}:CropKeysOnly"
    r, rows = _verify("--caches", ref)
    assert r.exit_code == 1, r.output
    failed = {name for (name, _), c in rows.items() if not c["passed"]}
    assert failed == {"rollback"}, rows


def test_a_plugin_without_the_operations_skips_them_and_passes_the_rest(lifecycle_plugins):
    ref = f"{lifecycle_plugins}:AppendOnly"
    r, rows = _verify("--caches", ref)
    assert r.exit_code == 0, r.output
    for name in ("rollback", "fork", "reorder"):
        c = next(c for (n, _), c in rows.items() if n == name)
        assert c["skipped"] and "AppendOnly has no" in c["detail"], c
    assert all(
        c["passed"] and not c["skipped"] for (n, _), c in rows.items() if n not in ("rollback", "fork", "reorder")
    )


# --- transformers' caches -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_reports(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from kvbench.check.hf_verify import run_hf_verify
    from kvbench.hf.models import load_hf

    configs = tiny_families(8)

    def build(name):
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(configs[name]).save_pretrained(d)
        loaded = load_hf(str(d), torch.device("cpu"), torch.float32)
        ps = random_prompts(256, 12, 3, seed=0)
        return run_hf_verify(loaded, ["dynamic", "static"], ps, 20, checks=LIFECYCLE)

    return ByFamily(build)


# The plain decoder and the hybrid (sliding and full layers) in the default tier; the other two in the slow tier.
@pytest.mark.parametrize(
    "family",
    ["llama", pytest.param("qwen2", marks=pytest.mark.slow), pytest.param("mistral", marks=pytest.mark.slow), "gemma2"],
)
def test_transformers_caches_pass_or_skip_with_transformers_reason(hf_reports, family):
    rows = {(r.name, r.cache): r for r in hf_reports[family].checks}
    assert set(rows) == {(c, k) for c in LIFECYCLE for k in ("dynamic", "static")}, rows
    windowed = family in ("mistral", "gemma2")
    for (name, cache), r in rows.items():
        if windowed and cache == "static" and name == "rollback":
            # the run is longer than the window: transformers itself declares the static cache not croppable
            assert r.skipped and "is_croppable False" in r.detail, r
            continue
        if cache == "static" and name == "rollback":
            # the rollback is exact; transformers' own prompt lookup overruns the StaticCache generate allocates:
            # its known defect, reported and not judged (hf/known.py)
            assert r.skipped and "a known defect of transformers" in r.detail, r
            assert "generate(prompt_lookup_num_tokens=3) raised IndexError" in r.detail, r
            continue
        assert r.passed and not r.skipped and r.max_abs_diff <= 1e-5, r
