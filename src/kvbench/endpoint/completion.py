"""A completion read from an engine's answer, and the seeded prompts the checks send.

Engines write a completion's tokens three ways: OpenAI's legacy `logprobs` (tokens, token_logprobs, top_logprobs as
{token: logprob}), the chat form some servers use on /v1/completions too (logprobs.content: [{token, logprob,
top_logprobs: [{token, logprob}]}]), and a `token_ids` list beside the text (kvbench serve; vLLM with
return_token_ids). `Completion` holds what the answer gave and says nothing about what it lacks.

Prompts are token ids where the engine takes them (ids 3 to 255: every tokenizer has at least 256 tokens, and the
lowest ids are often special), else text: words from a fixed list. Either way a prompt is a value that joins
(`list + list`, `str + str`), made by a seeded `Prompts`, so a run sends the same prompts every time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvbench.endpoint.client import EndpointError

Prompt = list[int] | str
ID_RANGE = (3, 256)  # token ids a prompt draws from: within any tokenizer's first 256, above the usual specials
WORDS = (
    "the of and to in is was for on are with as at be by this from have or an they which one you had were her all "
    "she there would their we him been has when who will more no if out so said what up its about into than them "
    "can only other new some could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came right"
).split()


@dataclass
class Completion:
    """One answer: its text and, where the engine gave them, its token ids, token strings, each sampled token's
    logprob and the top logprobs at each step; the prompt's token count and how many of them it says were cached."""

    text: str
    finish: str
    token_ids: list[int] | None = None
    tokens: list[str] | None = None
    logprobs: list[float] | None = None
    tops: list[dict[str, float]] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    seconds: float = 0.0  # the request's wall time, sent to answered

    @property
    def has_logprobs(self) -> bool:
        return self.logprobs is not None and self.tokens is not None


def read_completion(doc: Any, where: str) -> Completion:
    """The first choice of a /v1/completions answer; an answer without one is not an OpenAI completion."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    if choice is None or not isinstance(choice.get("text"), str):
        shown = str(doc)[:120]
        raise EndpointError(
            f"{where}: POST /v1/completions answered without choices[0].text ({shown}); not an OpenAI completion"
        )
    c = Completion(text=choice["text"], finish=str(choice.get("finish_reason")))
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        c.token_ids = ids
    _read_logprobs(c, choice.get("logprobs"))
    usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else {}
    if isinstance(usage.get("prompt_tokens"), int):
        c.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        c.cached_tokens = details["cached_tokens"]
    return c


def _read_logprobs(c: Completion, lp: Any) -> None:
    """The sampled tokens' logprobs and the top ones, where every value is a number and there is one per token: an
    answer whose logprobs hold anything else (null, a string, lists of other lengths) is read as one without them,
    never a crash."""
    if not isinstance(lp, dict):
        return
    if isinstance(lp.get("token_logprobs"), list) and isinstance(lp.get("tokens"), list):  # OpenAI's legacy form
        values = _numbers(lp["token_logprobs"])
        if values and len(values) == len(lp["tokens"]):  # a step without its token (or one more) is no logprobs
            c.tokens, c.logprobs = [str(t) for t in lp["tokens"]], values
            tops = lp.get("top_logprobs")
            if isinstance(tops, list) and len(tops) == len(values) and all(isinstance(t, dict) for t in tops):
                c.tops = _tops([list(t.items()) for t in tops])
        return
    content = lp.get("content")
    if isinstance(content, list) and content and all(isinstance(s, dict) for s in content):
        values = _numbers([s.get("logprob") for s in content])  # the chat form (llama.cpp)
        if not values:
            return
        c.tokens, c.logprobs = [str(s.get("token")) for s in content], values
        if all(isinstance(s.get("top_logprobs"), list) for s in content):
            pairs = [
                [(t.get("token"), t.get("logprob")) if isinstance(t, dict) else (None, None) for t in s["top_logprobs"]]
                for s in content
            ]
            c.tops = _tops(pairs)


def _numbers(values: list[Any]) -> list[float] | None:
    """`values` as floats where each is a JSON number (not a bool); else None."""
    if values and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return [float(v) for v in values]
    return None


def _tops(steps: list[list[tuple[Any, Any]]]) -> list[dict[str, float]] | None:
    """Each step's top logprobs as {token: logprob}, where every logprob is a number; else None."""
    out = []
    for pairs in steps:
        values = _numbers([v for _, v in pairs]) if pairs else []
        if values is None:
            return None
        out.append({str(k): v for (k, _), v in zip(pairs, values, strict=True)})
    return out


class Prompts:
    """Seeded prompts: `fresh(n)` is n new token ids (or, in text, n words), never sent before in this run."""

    def __init__(self, seed: int, token_ids: bool) -> None:
        self.rng = random.Random(seed)
        self.token_ids = token_ids

    def fresh(self, n: int) -> Prompt:
        if self.token_ids:
            return [self.rng.randrange(*ID_RANGE) for _ in range(n)]
        return "".join(" " + self.rng.choice(WORDS) for _ in range(n))

    def fork(self, n: int) -> tuple[Prompt, Prompt]:
        """Two fresh continuations of n that differ from their first token (or word) on."""
        a = self.fresh(n)
        while True:
            b = self.fresh(n)
            if _head(a) != _head(b):
                return a, b

    def completion_of(self, c: Completion) -> Prompt | None:
        """A completion as a prompt's continuation: its token ids, its text; None when ids are wanted and the
        engine returned none."""
        if not self.token_ids:
            return c.text
        return list(c.token_ids) if c.token_ids is not None else None


def _head(p: Prompt) -> int | str:
    return p[0] if isinstance(p, list) else p.split()[0]


def length(prompt: Prompt) -> int:
    """Tokens in a token-id prompt; words in a text one (its token count is the engine's to say)."""
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())
