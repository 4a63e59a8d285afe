"""Every cache in the registry: cached decoding equals full recomputation, and the caches' own contracts."""

import pytest
import torch

from kvbench.caches import CACHES, make_caches
from kvbench.caches.dynamic import DynamicCache
from kvbench.caches.static import StaticCache
from kvbench.decode.generate import generate
from kvbench.errors import CacheOverflowError

EXACT = [n for n, s in CACHES.items() if s.exact and s.factory is not None]
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


@pytest.mark.parametrize("name", EXACT)
def test_one_cached_decode_step_equals_full_recompute(tiny_model, name):
    cfg = tiny_model.config
    ids = torch.tensor([PROMPT])
    T = ids.size(1)
    caches = make_caches(name, cfg, 1, T + 4, torch.float32, "cpu")
    with torch.no_grad():
        prefill = tiny_model(ids, torch.arange(T)[None], caches)
        nxt = prefill[:, -1].argmax(-1, keepdim=True)
        step = tiny_model(nxt, torch.tensor([[T]]), caches)[:, -1]
        full = tiny_model(torch.cat([ids, nxt], 1), torch.arange(T + 1)[None])[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
    assert all(c.length == T + 1 for c in caches)


@pytest.mark.parametrize("name", EXACT)
def test_fifty_greedy_tokens_identical_to_no_cache(tiny_model, name):
    ref = generate(tiny_model, [PROMPT], 50, cache="none", record_logits=True)
    got = generate(tiny_model, [PROMPT], 50, cache=name, record_logits=True)
    assert got.tokens == ref.tokens
    assert len(set(ref.tokens[0])) > 5, "degenerate greedy output would hide bugs"
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_greedy_sampler_picks_argmax_s_token_among_ties_nans_and_minus_infinity(dtype):
    """The loop's greedy pick (a max's index, faster than argmax on the CPU) is argmax's: the first of tied maxima,
    the first NaN where a row has one, index 0 of a row that is all -inf."""
    from kvbench.decode.generate import Sampler

    torch.manual_seed(0)
    logits = torch.randint(0, 4, (6, 50257)).to(dtype)  # many ties at the maximum
    logits[1, [7, 900, 40000]] = float("nan")
    logits[2] = float("-inf")
    logits[3, 50256] = 9  # the last column
    got = Sampler()(logits, None)
    assert got.shape == (6, 1) and torch.equal(got, logits.argmax(-1, keepdim=True))
    assert got[:4, 0].tolist() == [logits[0].tolist().index(3), 7, 0, 50256]


def test_greedy_output_depends_on_prompt(tiny_model):
    a = generate(tiny_model, [PROMPT], 20, cache="dynamic").tokens
    b = generate(tiny_model, [PROMPT[:-1] + [7]], 20, cache="dynamic").tokens
    assert a != b


def test_cached_decode_matches_hf_full_recompute(hf_dir):
    """Every cached step's logits against HF recomputing the whole sequence (independent implementation)."""
    from transformers import GPT2LMHeadModel

    from kvbench.model.weights import load_model

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ours = load_model(None, str(hf_dir), torch.device("cpu"), torch.float32).model
    for name in EXACT:
        res = generate(ours, [PROMPT], 12, cache=name, record_logits=True)
        seq = PROMPT + res.tokens[0]
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, len(PROMPT) - 1 : -1]  # logits that chose each new token
        torch.testing.assert_close(torch.cat(res.logits), want, rtol=1e-5, atol=1e-5, msg=name)


def test_static_overflow_names_capacity():
    c = StaticCache(1, 2, 4, 8, torch.float32, "cpu")
    c.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), None)
    with pytest.raises(CacheOverflowError, match="capacity 4"):
        c.update(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), None)


def test_static_returns_views_without_copying_history():
    c = StaticCache(2, 3, 16, 8, torch.float32, "cpu")
    ptr = c.k.data_ptr()
    k0 = torch.randn(2, 3, 5, 8)
    for step in range(6):
        k = k0 if step == 0 else torch.randn(2, 3, 1, 8)
        ks, vs = c.update(k, k.clone(), None)
        assert ks.data_ptr() == ptr and vs.data_ptr() == c.v.data_ptr()  # same storage every step
        assert ks.shape == (2, 3, c.length, 8)
        assert torch.equal(ks[:, :, :5], k0)  # history untouched
    assert c.nbytes == 2 * 2 * 3 * 16 * 8 * 4 and c.bytes_copied == 0
    c.reset()
    assert c.length == 0 and c.k.data_ptr() == ptr  # reset keeps the allocation


def test_dynamic_copy_counter_matches_closed_form():
    B, H, Dh, n0, n1 = 2, 3, 8, 5, 17
    c = DynamicCache()
    c.update(torch.randn(B, H, n0, Dh), torch.randn(B, H, n0, Dh), None)
    for _ in range(n1 - n0):
        c.update(torch.randn(B, H, 1, Dh), torch.randn(B, H, 1, Dh), None)
    per_token = 2 * B * H * Dh * 4  # K and V, fp32
    assert c.bytes_copied == per_token * (n1 - n0) * (n0 + n1 - 1) // 2
    assert c.length == n1 and c.nbytes == per_token * n1
