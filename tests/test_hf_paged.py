"""verify --hf's `paged` entry: transformers' continuous batching (generate_batch over its PagedAttentionCache, prefix
sharing on, two calls on one persistent manager, pages of 16 and 256 tokens) on tiny random models saved to tmp_path.
Every request's tokens are held to generate(use_cache=False) of its prompt alone; the check passes where transformers
is exact, fails where prefix sharing or a block table is broken, and skips in one line where continuous batching
cannot run the model."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvbench.check.hf_paged import PAGED_CHECKS, paged_rows
from kvbench.check.hf_subject import HFModel, generate_run
from kvbench.check.hf_verify import run_hf_verify
from kvbench.check.verify import random_prompts
from kvbench.cli import app
from kvbench.hf.caches import HF_CACHES, parse_verify_caches
from kvbench.hf.models import load_hf
from kvbench.hf.paged import PAGE_SIZES, Manager, cb_config, sizes
from tiny import COMMON, tiny_llama

CPU = torch.device("cpu")
PROMPT, NEW = 24, 8
ROWS = {(n, f"paged-{p}") for n in PAGED_CHECKS for p in PAGE_SIZES}


def _saved(cfg, d: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    # context 1024: a prompt spans a whole page of 256 tokens, so the second call shares blocks at both page sizes
    return _saved(tiny_llama(max_position_embeddings=1024), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama(llama_dir):
    loaded = load_hf(str(llama_dir), CPU, torch.float32)
    return loaded, random_prompts(loaded.info.vocab_size, PROMPT, 3, seed=0)


@pytest.fixture(scope="module")
def llama_rows(llama):
    loaded, prompts = llama
    rows, notes = paged_rows(HFModel(loaded), prompts, NEW)
    return {(r.name, r.cache): r for r in rows}, notes


def test_paged_is_in_the_default_run_on_the_cpu():
    assert "paged" in parse_verify_caches(None, CPU) and HF_CACHES["paged"].batching
    assert HF_CACHES["paged"].generate_kwargs == {"cache_implementation": "paged"}


def test_every_request_equals_full_recomputation(llama_rows):
    rows, notes = llama_rows
    assert set(rows) == ROWS, rows
    for r in rows.values():
        assert r.passed and not r.skipped, r
        assert r.max_abs_diff is not None and r.max_abs_diff <= 2e-5, r  # logprobs: fp32 rounding
        assert "all identical" in r.detail, r
    # the second call found the first call's blocks (the prompt and the answer it generated), at both page sizes
    for page in PAGE_SIZES:
        detail = rows["reuse", f"paged-{page}"].detail
        found = [int(x) for x in detail.split("(the cache held ")[1].split(" of them)")[0].split(", ")]
        assert found[0] >= 2 * page if page == 16 else found[0] == page, detail
        assert found[-1] == 0, detail  # a different first block: nothing may be shared
    assert "prefix sharing on" in notes[0], notes


def test_paged_tokens_equal_generate_without_a_cache(llama):
    """Independently of the check's judge: each request of one generate_batch (mixed lengths, two sharing their
    first 16 tokens) yields exactly generate(use_cache=False)'s tokens for its prompt alone."""
    loaded, prompts = llama
    stem = prompts[2][:16]
    batch = [stem + prompts[0], stem + prompts[1], prompts[2]]
    blocks, tokens = sizes([[len(p) for p in batch]], NEW, 16)
    manager = Manager(loaded.model, NEW, cb_config(16, blocks, tokens))
    try:
        got = manager.call(batch)
    finally:
        manager.close()
    for r in got:
        want = generate_run(loaded, [r.prompt], NEW, use_cache=False).tokens[0]
        assert r.error is None and r.tokens == want, (len(r.prompt), r.tokens, want)
        assert len(r.logprobs) == NEW and all(lp <= 0 for lp in r.logprobs)
    assert loaded.model.config._attn_implementation == "sdpa"  # restored after the run


def _broken_hash(monkeypatch):
    """Prefix sharing broken the way a hash that forgets its parent breaks it: a block matches any block of the same
    tokens, wherever it sits in the sequence."""
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    real = cache_allocator.compute_block_hash
    monkeypatch.setattr(cache_allocator, "compute_block_hash", lambda parent, tokens: real(None, tokens))


def _stale_block_table(monkeypatch):
    """A prefix hit's block table corrupted: every block it shares maps to the first one it matched."""
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator

    real = CacheAllocator.acquire_prefix_blocks
    monkeypatch.setattr(
        CacheAllocator, "acquire_prefix_blocks", lambda self, rid, n, ids: real(self, rid, n, ids[:1] * len(ids))
    )


@pytest.mark.parametrize("fault, fails", [(_broken_hash, "batch"), (_stale_block_table, "reuse")])
def test_the_check_fails_on_a_broken_paged_cache(llama, monkeypatch, fault, fails):
    loaded, prompts = llama
    fault(monkeypatch)
    rows = {(r.name, r.cache): r for r in paged_rows(HFModel(loaded), prompts, NEW)[0]}
    row = rows[fails, "paged-16"]
    assert not row.passed and not row.skipped, row
    assert "the no-cache argmax" in row.detail or "logprob" in row.detail, row
    assert row.max_abs_diff > 1e-3, row


def test_a_sliding_window_model_runs_without_prefix_sharing(tmp_path):
    from transformers import MistralConfig

    loaded = load_hf(str(_saved(MistralConfig(**COMMON, sliding_window=8), tmp_path)), CPU, torch.float32)
    prompts = random_prompts(loaded.info.vocab_size, PROMPT, 3, seed=0)
    rows, notes = paged_rows(HFModel(loaded), prompts, NEW)
    assert {(r.name, r.cache) for r in rows} == ROWS and all(r.passed for r in rows), rows
    assert "prefix sharing off" in notes[0], notes


def test_a_model_continuous_batching_cannot_page_is_one_skip_row(tmp_path):
    """A layer kind transformers' continuous batching has no allocator for (here linear attention): one row, the
    reason in transformers' own words."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(**{**COMMON, "layer_types": ["linear_attention", "full_attention"]})
    loaded = load_hf(str(_saved(cfg, tmp_path)), CPU, torch.float32)
    report = run_hf_verify(loaded, ["paged"], random_prompts(loaded.info.vocab_size, PROMPT, 3, seed=0), NEW)
    (row,) = report.checks
    assert row.skipped and row.cache == "paged" and row.name == "-", row
    assert "full and sliding-window attention layers only" in row.detail and "linear_attention" in row.detail, row
    assert report.nothing_checked


def test_a_model_whose_code_continuous_batching_cannot_run_is_one_skip_row(tmp_path):
    """GPT-NeoX calls PagedAttentionCache.update without the batch's kwargs: every request fails inside transformers'
    generation loop. One row, naming the model, the error, where it was raised and transformers' defect."""
    from transformers import GPTNeoXConfig

    cfg = GPTNeoXConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    loaded = load_hf(str(_saved(cfg, tmp_path)), CPU, torch.float32)
    rows, _ = paged_rows(HFModel(loaded), random_prompts(loaded.info.vocab_size, PROMPT, 3, seed=0), NEW)
    (row,) = rows
    assert row.skipped and row.cache == "paged", row
    assert row.detail.startswith("transformers' continuous batching cannot run GPTNeoXForCausalLM: every request "), row
    assert (
        "TypeError: PagedAttentionCache.update() missing" in row.detail
        and "a known defect of transformers" in row.detail
    )


def test_verify_hf_caches_paged(llama_dir):
    r = CliRunner().invoke(app, ["verify", "--hf", str(llama_dir), "--caches", "paged", "-n", "8", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert {(c["name"], c["cache"]) for c in doc["checks"]} == ROWS, doc["checks"]
    assert "PagedAttentionCache" in doc["hf"]["caches"]["paged"]
    assert any(n.startswith("paged: transformers' continuous batching") for n in doc["notes"]), doc["notes"]
