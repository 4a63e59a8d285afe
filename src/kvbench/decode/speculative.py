"""Prompt-lookup speculative decoding: greedy generation that drafts tokens by copying from its own text.

No draft model: the draft is read from prompt + generated text. Each step:

    1. lookup   the last n tokens (n = ngram down to 1) are searched for earlier in the text; at the most recent
                earlier occurrence, the tokens that followed it are the draft (up to K of them). The text is read
                as repeating with that occurrence's period, so a draft may run past the end of the text: with
                "a b c a b" and n = 2, "a b" occurred 3 tokens back, so the draft is "c a b c" for K = 4.
    2. verify   ONE forward over [last accepted token, draft...] (T = 1 + k) through the cache, at positions
                past + arange(T): row i's argmax is the model's greedy choice after the draft's first i tokens.
    3. accept   the longest draft prefix equal to those choices, plus the model's own next choice after it, so
                every forward produces at least one token (k + 1 at most).
    4. crop     every layer cache back to the accepted length (the last accepted token is not in the cache: it is
                the next forward's first input, as in plain decoding).

With no occurrence found, the step is a plain one-token decode step. Drafts never run past `max_new_tokens` (k is
capped at the tokens left minus one), so a run generates exactly the tokens plain greedy decoding generates:
token for token the same greedy choices, as long as the T-token verification forward gives the same argmax as T
single steps (a different matrix shape can round differently; for the exact caches in fp32 the test suite checks
equality with plain `generate` on every built-in cache that can crop).

Batch 1 and greedy only; a cache must implement `crop` (caches.missing_lifecycle). The stop token ends the run
as in `generate` (the tokens after it are dropped, the stop token is not kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.caches import make_caches
from kvbench.decode.generate import GenerationResult, Sampler, _result, left_pad
from kvbench.devices import synchronize
from kvbench.model.gpt2 import GPT

DEFAULT_DRAFT_TOKENS = 4  # K: the most tokens one forward verifies besides the last accepted one
DEFAULT_NGRAM = 3  # the longest suffix looked up (then shorter ones, down to 1)


@dataclass
class SpeculativeResult:
    """A prompt-lookup run: the generation (as plain `generate` returns it) and what the drafts did.

    `generation.step_s` holds one entry per token after the first, each forward's time split evenly over the tokens
    it produced, so `total_s` and `new_tokens` mean what they mean for plain decoding; `forward_s` holds each
    forward after the prefill as it ran."""

    generation: GenerationResult
    draft_tokens: int  # K
    ngram: int  # the longest suffix looked up
    forwards: int  # forward calls, the prefill included (plain greedy decoding runs one per token)
    proposed: int  # draft tokens sent to verification
    accepted: int  # draft tokens the model's greedy choice confirmed
    forward_s: list[float]  # each forward after the prefill (lookup + forward + argmax + crop), synchronised

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def lookup(text: list[int], ngram: int, k: int) -> list[int]:
    """Up to `k` draft tokens: what followed the most recent earlier occurrence of the text's last n tokens
    (n = ngram, ngram - 1, ..., 1), read with that occurrence's period; [] when no suffix occurred before."""
    L = len(text)
    if k < 1:
        return []
    for n in range(min(ngram, L - 1), 0, -1):
        tail = text[L - n :]
        for start in range(L - n - 1, -1, -1):  # most recent first; the suffix itself is not an occurrence
            if text[start : start + n] == tail:
                period = L - n - start  # the text repeats with this period from here on
                ext = list(text[-period:])
                while len(ext) < k:
                    ext.append(ext[len(ext) - period])
                return ext[:k]
    return []


def _verify(model: GPT, caches: list, text: list[int], draft: list[int]) -> list[int]:
    """One forward over the last produced token and the draft; the tokens kept: the longest draft prefix equal to
    the model's greedy choices, then its own next choice. The rejected draft tokens are cropped from every cache."""
    device = model.lm_head.weight.device
    past = len(text) - 1  # tokens cached: prompt + produced - 1 (the last produced is the next input)
    ids = torch.tensor([[text[-1], *draft]], device=device)  # (1, T), T = 1 + k
    positions = past + torch.arange(ids.size(1), device=device)[None]  # (1, T)
    logits = model(ids, positions, caches, None, last_only=not draft)[0]  # (T, V)
    choices = logits.argmax(-1).tolist()  # the greedy choice after each prefix of the draft
    n = 0
    while n < len(draft) and draft[n] == choices[n]:
        n += 1
    if draft:
        for c in caches:
            c.crop(past + 1 + n)  # the last input and the n accepted draft tokens stay
    return [*draft[:n], choices[n]]


@torch.inference_mode()
def speculative_generate(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int,
    cache: str = "dynamic",
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    ngram: int = DEFAULT_NGRAM,
    stop_token: int | None = None,
    on_token: Callable[[list[int]], None] | None = None,
) -> SpeculativeResult:
    """Greedy prompt-lookup decoding of one prompt through fresh caches of `cache` (module docstring).
    `on_token([id])` is called for each kept token in order, as plain `generate` calls it. The caller has checked
    the settings (decode.rules.draft_rules): one prompt, a cache that can crop, prompt + new tokens within the context."""
    assert len(prompts) == 1 and draft_tokens >= 1 and ngram >= 1, (len(prompts), draft_tokens, ngram)
    device = model.lm_head.weight.device
    batch = left_pad(prompts, device)
    P = batch.ids.size(1)
    assert 1 <= max_new_tokens and P + max_new_tokens <= model.config.block_size, (P, max_new_tokens)
    caches = make_caches(cache, model.cache_config, 1, P + max_new_tokens, model.lm_head.weight.dtype, device)
    assert caches is not None, f"{cache} holds no cache to crop (decode.rules.draft_rules)"
    greedy = Sampler()

    text = list(prompts[0])  # prompt + every token produced so far
    out: list[torch.Tensor] = []  # (1, 1) each, as generate's loop collects them
    seconds: list[float] = []  # per token, as generate's: the prefill's, then each later token's share
    forward_s: list[float] = []
    proposed = accepted = 0
    done = False

    def keep(tokens: list[int], t: float) -> None:
        nonlocal done
        for tok in tokens:
            text.append(tok)
            out.append(torch.tensor([[tok]]))
            seconds.append(t / len(tokens))
            if on_token is not None:
                on_token([tok])
            if (stop_token is not None and tok == stop_token) or len(out) == max_new_tokens:
                done = True
                return

    synchronize(device)
    t0 = time.perf_counter()
    logits = model(batch.ids, batch.positions, caches, None, last_only=True)[:, -1]  # (1, V)
    first = int(greedy(logits, None))
    synchronize(device)
    keep([first], time.perf_counter() - t0)
    while not done:
        synchronize(device)
        t0 = time.perf_counter()
        draft = lookup(text, ngram, min(draft_tokens, max_new_tokens - len(out) - 1))
        kept = _verify(model, caches, text, draft)
        synchronize(device)
        dt = time.perf_counter() - t0
        forward_s.append(dt)
        proposed, accepted = proposed + len(draft), accepted + len(kept) - 1
        keep(kept, dt)
    generation = _result(cache, batch, out, seconds, stop_token, caches, None)
    return SpeculativeResult(generation, draft_tokens, ngram, 1 + len(forward_s), proposed, accepted, forward_s)
