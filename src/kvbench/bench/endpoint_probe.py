"""What a server takes and tells, found before `bench --endpoint` sends its workload (`probe`), and the prompts it
sends (`Prompts`).

The probe reads GET /v1/models (the model id every request names, the context where the server says it), checks
the reset asked for (--reset: its POST must answer 2xx), then streams one request of the workload's shape. It asks
first for everything a measurement wants and falls back one step at a time where the server refuses a field with
HTTP 400 or 422: token ids as the prompt (else text), `min_tokens` and `ignore_eos` so every request produces
exactly --new-tokens tokens (else max_tokens alone: the engine may stop early at its end token; short_requests
counts those), `stream_options: {"include_usage": true}` (else the stream's events are counted). Cached tokens come
from the stream's usage; where it carries none, from a non-streamed request (its usage, read once after each
phase); where neither says, they stay empty with a note. The probe request is also the run's warm-up: no phase
pays the server's first request.

Prompts are random token ids from a seeded generator (the same --seed sends the same prompts), drawn from a range
every common vocabulary holds as ordinary tokens; a server that refuses ids gets their text under GPT-2's BPE.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvbench.bench.endpoint_settings import Workload
from kvbench.endpoint.client import EndpointError, EndpointHTTPError
from kvbench.endpoint.stream import COMPLETIONS, StreamClient, Streamed
from kvbench.errors import KVBenchError

# Random prompt ids come from [ID_LOW, ID_HIGH): ordinary tokens in GPT-2's vocabulary (50,257), Llama 2's and
# Mistral's (32,000), Llama 3's (128,256) and Qwen's, clear of the special tokens at either end.
ID_LOW, ID_HIGH = 1_000, 30_000
REFUSED = (400, 422)  # what a server answers a field or prompt form it does not take
TEMPERATURE = 0.0  # greedy: the same prompt gives the same work


class Prompts:
    """The run's prompts: a shared prefix drawn once per phase (`prefix`), each prompt that prefix plus a suffix of
    its own (`prompt`), as token ids or (`text`) their text under GPT-2's BPE."""

    def __init__(self, seed: int | str, prompt_len: int, text: bool = False) -> None:
        self.rng = random.Random(seed)  # seeded by value: the same --seed, the same prompts
        self.prompt_len = prompt_len
        self.text = text
        self._decode = None
        if text:
            from kvbench.model.tokenizer import load_tokenizer

            self._decode = load_tokenizer().decode

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(ID_LOW, ID_HIGH) for _ in range(n)]

    def prefix(self, n: int) -> list[int]:
        return self.ids(n)

    def prompt(self, prefix: list[int]) -> list[int] | str:
        ids = prefix + self.ids(self.prompt_len - len(prefix))
        return self._decode(ids) if self._decode is not None else ids


@dataclass
class Served:
    """What the probe found: how every request is written, and what the server reports."""

    model: str  # the id each request names: the first /v1/models lists
    max_model_len: int | None
    text: bool  # prompts sent as text (the server refused token ids)
    exact: bool  # min_tokens and ignore_eos sent (the server took them)
    usage_option: bool  # stream_options include_usage sent
    cached_source: str  # stream | probe | none
    token_ids: bool  # the stream's chunks carry token ids
    notes: list[str] = field(default_factory=list)

    def body(self, prompt: list[int] | str, max_tokens: int, stream: bool = True, **extra: Any) -> dict[str, Any]:
        doc: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        doc["temperature"] = TEMPERATURE
        if self.exact:
            doc.update(min_tokens=max_tokens, ignore_eos=True)
        doc["stream"] = stream
        if stream and self.usage_option:
            doc["stream_options"] = {"include_usage": True}
        return {**doc, **extra}

    def meta(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "max_model_len": self.max_model_len,
            "prompt_form": "text" if self.text else "token ids",
            "exact_length_fields": ["min_tokens", "ignore_eos"] if self.exact else [],
            "stream_usage": self.usage_option,
            "cached_tokens_from": self.cached_source,
            "token_ids_in_stream": self.token_ids,
            "notes": self.notes,
        }


def probe(server: StreamClient, w: Workload) -> Served:
    """The server read and the workload's first request sent (module docstring); EndpointError or KVBenchError (one
    line) where it cannot serve this workload."""
    model, max_len, notes = _models(server)
    if max_len is not None and w.prompt_len + w.new_tokens > max_len:
        raise KVBenchError(
            f"{server.where}: --prompt-len {w.prompt_len} + --new-tokens {w.new_tokens} is past {model}'s context of "
            f"{max_len} tokens (/v1/models max_model_len); lower them"
        )
    reset(server, w)
    served, streamed = _first_stream(server, w, model, max_len, notes)
    served.token_ids = streamed.token_ids
    usage = streamed.usage
    if usage is None:
        notes.append("the stream carries no usage: output tokens are counted from the streamed events")
    if cached_tokens(usage) is not None:
        served.cached_source = "stream"
    else:
        prompts = Prompts(f"{w.seed}-probe", w.prompt_len, served.text)
        doc = server.json("POST", COMPLETIONS, served.body(prompts.prompt([]), 1, stream=False), empty_ok=True)
        found = cached_tokens(doc.get("usage") if isinstance(doc, dict) else None)
        served.cached_source = "probe" if found is not None else "none"
        notes.append(
            "the stream's usage has no prompt_tokens_details.cached_tokens: each phase's cached_tokens_mean is read "
            "from one non-streamed request after it (its prompt shares the phase's prefix)"
            if found is not None
            else "the server reports no cached tokens (usage.prompt_tokens_details.cached_tokens), streamed or not: "
            "cached_tokens stays empty (vLLM: --enable-prompt-tokens-details; SGLang: --enable-cache-report)"
        )
    return served


def cached_tokens(usage: object) -> int | None:
    """usage.prompt_tokens_details.cached_tokens where a usage object holds it."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def reset(server: StreamClient, w: Workload) -> None:
    """--reset's POST (where it has one): the engine's prefix cache emptied; a refusal names the other ways."""
    if w.reset.path is None:
        return
    try:
        server.call_ok("POST", w.reset.path)  # any 2xx answer, as verify --endpoint takes it (SGLang answers text)
    except EndpointHTTPError as e:
        raise EndpointError(
            f"--reset {w.reset.name}: {e}; give the engine's own way (--reset kvbench, vllm, sglang, llamacpp) or "
            "--reset none"
        ) from None


def _models(server: StreamClient) -> tuple[str, int | None, list[str]]:
    """(the first model /v1/models lists, its max_model_len where given, notes)."""
    try:
        doc = server.json("GET", "/v1/models", empty_ok=True)
    except EndpointHTTPError as e:
        raise EndpointError(f"{e}; is this an OpenAI-compatible server, and the URL its /v1 base?") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise EndpointError(
            f"{server.where}: GET /v1/models did not answer OpenAI's model list ({str(doc)[:80]!r}); is this an "
            "OpenAI-compatible server?"
        )
    first = data[0]
    max_len = first.get("max_model_len")
    notes = [f"the server lists {len(data)} models; requests name the first, {first['id']}"] if len(data) > 1 else []
    return str(first["id"]), max_len if isinstance(max_len, int) and max_len > 0 else None, notes


FALLBACKS = (  # (text prompt, min_tokens + ignore_eos, include_usage), tried in order
    (False, True, True),
    (False, False, True),
    (False, True, False),
    (False, False, False),
    (True, True, True),
    (True, False, True),
    (True, True, False),
    (True, False, False),
)


def _first_stream(
    server: StreamClient, w: Workload, model: str, max_len: int | None, notes: list[str]
) -> tuple[Served, Streamed]:
    """The first form of FALLBACKS the server takes, with the notes on what it refused."""
    refusals: list[str] = []
    for text, exact, usage in FALLBACKS:
        served = Served(model, max_len, text, exact, usage, "none", False, notes)
        prompts = Prompts(f"{w.seed}-probe", w.prompt_len, text)
        try:
            streamed = server.stream(served.body(prompts.prompt([]), w.new_tokens))
        except EndpointHTTPError as e:
            if e.status not in REFUSED:
                raise
            refusals.append(str(e))
            continue
        if text:
            notes.append(
                "the server refused token ids as the prompt: prompts are sent as text (GPT-2's BPE of the "
                "same random ids); the engine's own count is prompt_tokens"
            )
        if not exact:
            notes.append(
                "the server refused min_tokens and ignore_eos: requests may end before --new-tokens at the model's "
                "end token (short_requests counts them)"
            )
        if not usage:
            notes.append('the server refused stream_options {"include_usage": true}')
        return served, streamed
    raise EndpointError(f"{refusals[0]} (also refused with every fallback: text prompt, no min_tokens, no usage)")
