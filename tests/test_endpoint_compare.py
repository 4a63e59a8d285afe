"""The rules `verify --endpoint` judges by, one row each: a warm completion against a cold one (compare.py), the
answers it reads in each engine's form (completion.py), /metrics under each engine's names (engine.py), the
cached-token counts against the block-rounded reusable prefix (accounting.py)."""

from __future__ import annotations

import pytest

from kvbench.endpoint.accounting import Seen
from kvbench.endpoint.client import Answer, Client, error_message
from kvbench.endpoint.compare import DIVERGED, DRIFT, IDENTICAL, compare, comparison_row
from kvbench.endpoint.completion import Completion, read_completion
from kvbench.endpoint.engine import parse_metrics

TOL = 0.05


def run(ids: list[int], lps: list[float] | None = None, tops: list[dict[str, float]] | None = None) -> Completion:
    toks = [f"t{i}" for i in ids]
    return Completion(text="".join(toks), finish="length", token_ids=ids, tokens=toks, logprobs=lps, tops=tops)


COLD = run([1, 2, 3], [-0.5, -0.7, -0.2], [{"t1": -0.5, "t9": -1.5}, {"t2": -0.7, "t8": -0.75}, {"t3": -0.2}])


@pytest.mark.parametrize(
    "warm, kind, first, said",
    [
        (COLD, IDENTICAL, None, "all 3 tokens and logprobs identical"),
        (run([1, 2, 3], [-0.5, -0.71, -0.2], COLD.tops), DRIFT, None, "same 3 tokens, |Δlogprob| <= 0.01"),
        (run([1, 2, 3], [-0.5, -0.9, -0.2], COLD.tops), DIVERGED, None, "step 1's logprob differs by 0.2 > 0.05"),
        # step 1: the cold run's t2 and t8 are 0.05 apart, each moved by 0.03: a near-tie
        (
            run([1, 8, 4], [-0.5, -0.72, -0.1], [COLD.tops[0], {"t2": -0.73, "t8": -0.72}, {"t4": -0.1}]),
            DRIFT,
            1,
            "token 1 differs (cold 2 't2' vs warm 8 't8') at a near-tie: top-2 gap 0.05 <= 2 x logprob error 0.03",
        ),
        # step 0: t9 is 1.0 below t1 in the cold run; an error of 0.01 does not explain the flip
        (
            run([9, 2, 3], [-0.51, -0.7, -0.2], [{"t1": -0.51, "t9": -1.49}, *COLD.tops[1:]]),
            DIVERGED,
            0,
            "token 0 differs (cold 1 't1' vs warm 9 't9'): top-2 gap 1 > 2 x logprob error 0.01",
        ),
        # a near-tie in gap, but an error past the tolerance is not rounding
        (
            run([1, 8, 4], [-0.5, -0.6, -0.1], [COLD.tops[0], {"t2": -0.8, "t8": -0.6}, {"t4": -0.1}]),
            DIVERGED,
            1,
            "where the logprobs differ by 0.15 > 0.05",
        ),
        (
            run([1, 7, 3], [-0.5, -0.7, -0.2], [COLD.tops[0], {"t7": -0.7}, COLD.tops[2]]),
            DIVERGED,
            1,
            "the warm token is not in the cold run's top 2, so the gap is unknown",
        ),
        (run([1, 2]), DIVERGED, 2, "token 2 differs (cold 3 't3' vs warm (ended))"),
    ],
    ids=["identical", "drift", "logprob off", "near-tie", "flip", "flip past tol", "unknown gap", "ended"],
)
def test_a_warm_run_against_the_cold_one(warm, kind, first, said):
    c = compare("warm vs cold", COLD, warm, TOL)
    assert (c.kind, c.first) == (kind, first), c
    assert said in c.words, c.words


def test_without_logprobs_every_difference_diverges():
    cold, warm = run([1, 2, 3]), run([1, 2, 4])
    assert compare("w", cold, cold, TOL).kind == IDENTICAL
    c = compare("w", cold, warm, TOL)
    assert (c.kind, c.first, c.basis) == (DIVERGED, 2, "token ids")
    assert c.words.endswith("the engine gives no logprobs, so a near-tie cannot be told from a bug")
    text = compare("w", Completion(" a cat", "length"), Completion(" a cap", "length"), TOL)
    assert (text.kind, text.basis) == (DIVERGED, "text") and "text differs from character 5: 't' vs 'p'" in text.words


def test_a_row_fails_on_its_first_divergence_and_shows_the_largest_difference():
    good = compare("warm run 1 vs cold", COLD, COLD, TOL)
    bad = compare("warm run 2 vs cold", COLD, run([9, 2, 3], [-0.5, -0.7, -0.2], [{"t1": -0.5, "t9": -1.5}] * 3), TOL)
    row = comparison_row("warm-cold:repeat", "m", "a prompt", [good, bad], TOL)
    assert not row.passed and row.first_divergence == 0 and row.max_abs_diff == 0
    assert row.detail.startswith("diverged: warm run 2 vs cold: token 0 differs"), row.detail
    assert row.detail.endswith("; runs: a prompt"), row.detail
    assert comparison_row("warm-cold:repeat", "m", "a prompt", [good, good], TOL).passed


LEGACY = {
    "choices": [
        {
            "text": "ab",
            "finish_reason": "length",
            "logprobs": {
                "tokens": ["a", "b"],
                "token_logprobs": [-0.1, -0.2],
                "top_logprobs": [{"a": -0.1}, {"b": -0.2}],
            },
        }
    ],
    "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}},
}
CHAT_FORM = {  # llama.cpp's server: logprobs.content on /v1/completions
    "choices": [
        {
            "text": "ab",
            "finish_reason": "length",
            "logprobs": {
                "content": [
                    {"id": 1, "token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]},
                    {"id": 2, "token": "b", "logprob": -0.2, "top_logprobs": [{"token": "b", "logprob": -0.2}]},
                ]
            },
        }
    ],
    "usage": {"prompt_tokens": 7, "prompt_tokens_details": None},
}


@pytest.mark.parametrize("doc, cached", [(LEGACY, 0), (CHAT_FORM, None)], ids=["legacy", "chat form"])
def test_each_engines_logprobs_are_read(doc, cached):
    c = read_completion(doc, "here")
    assert (c.tokens, c.logprobs, c.tops) == (["a", "b"], [-0.1, -0.2], [{"a": -0.1}, {"b": -0.2}])
    assert (c.prompt_tokens, c.cached_tokens) == (7, cached)


VLLM = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0
"""
KVBENCH = "kvbench_kv_blocks_total 64\nkvbench_kv_block_size 16\nkvbench_prefix_cache_hits_total 48\n"
SGLANG = 'sglang:max_total_num_tokens{model_name="m"} 65536.0\nsglang:cache_hit_rate{model_name="m"} 0.5\n'


@pytest.mark.parametrize(
    "text, hits, block, pool",
    [
        (VLLM, (128.0, "vllm:prefix_cache_hits_total"), (16, "vllm:cache_config_info"), 2048 * 16),
        (KVBENCH, (48.0, "kvbench_prefix_cache_hits_total"), (16, "kvbench_kv_block_size"), 64 * 16),
        (SGLANG, None, None, 65536),
    ],
    ids=["vllm", "kvbench", "sglang"],
)
def test_each_engines_metrics_are_read(text, hits, block, pool):
    from kvbench.endpoint.engine import HITS

    m = parse_metrics(text)
    assert m.total(HITS) == hits and m.block_size() == block
    assert (m.pool_tokens() or (None,))[0] == pool


@pytest.mark.parametrize(
    "seen, block, fits",
    [
        (Seen("repeat", 40, 32, 40, 40), 16, True),  # 39 reusable -> 32
        (Seen("repeat", 40, 39, 40, 40), 1, True),  # any number of tokens (SGLang, llama.cpp)
        (Seen("repeat", 40, 40, 40, 40), 1, False),  # the last prompt token is always computed
        (Seen("repeat", 40, 16, 40, 40), 16, False),  # a block it could have reused
        (Seen("unseen", 40, 32, 0, 0), 16, False),
        (Seen("extension", 90, 64, 69, 76), 16, True),  # between the prompt and prompt + completion
        (Seen("extension", 90, 48, 69, 76), 16, False),
    ],
)
def test_a_cached_count_against_the_reusable_prefix(seen, block, fits):
    assert seen.fits(block) is fits


@pytest.mark.parametrize(
    "url, root, port",
    [
        ("http://h:8000/v1", "", 8000),
        ("http://h:8000/v1/", "", 8000),
        ("http://h/api", "/api", 80),
        ("https://h/x/v1", "/x", 443),
    ],
)
def test_the_url_names_the_servers_root(url, root, port):
    c = Client(url, 1.0)
    assert (c.root, c.port) == (root, port)


@pytest.mark.parametrize(
    "body, said",
    [
        (b'{"error": {"message": "model not found", "type": "invalid_request_error"}}', "model not found"),
        (b'{"detail": "prompt must be a string."}', "prompt must be a string."),
        (b'{"object": "error", "message": "bad"}', "bad"),
        (b"<html>Bad Gateway</html>", "<html>Bad Gateway</html>"),
    ],
)
def test_an_error_answer_says_what_the_server_said(body, said):
    assert error_message(Answer(400, "", body)) == said
