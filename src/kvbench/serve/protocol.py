"""The OpenAI documents `kvbench serve` reads and writes, without the web framework: a completion request read and
checked (`parse_completion`), the response and its stream chunks, the error document, /v1/models and /metrics.

A request is refused (HTTP 400, OpenAI's error document) before it reaches the engine when its JSON is invalid, a
field has the wrong type or range, the model is not the one served, the prompt is empty, holds a token id outside
the vocabulary or does not leave room for max_tokens in the context, or it needs more blocks than the pool holds; a
body past MAX_BODY_BYTES is refused unread (HTTP 413), and a route or method the server lacks gets the same document
(404, 405: `route_error`). A field sent as null takes its default, as OpenAI's API takes it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol

MAX_BODY_BYTES = 8 << 20  # a request body past this is refused unread: 1,024 token ids are ~8 KB, 1,024 tokens of text
# at most ~1 MB even JSON-escaped; the cap bounds what one request makes the server read, parse and tokenize
MAX_LOGPROBS = 20  # as OpenAI's completions API (and vLLM's default)
SEED_LIMIT = 2**63  # seeds are 0 .. 2**63 - 1
# Fields a client may send that only have their default here: anything else would change the output silently.
DEFAULTS_ONLY = {"n": 1, "best_of": 1, "echo": False, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0}


class RequestError(Exception):
    """A request refused: OpenAI's error document, HTTP `status`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def document(self) -> dict[str, Any]:
        return error_document(self.message, self.param, self.code)


def error_document(
    message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def body_too_large() -> RequestError:
    return RequestError(
        f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB; no prompt that fits the model is that long",
        None,
        "request_too_large",
        413,
    )


def route_error(status: int, method: str, path: str, allowed: str | None) -> dict[str, Any]:
    """OpenAI's error document for a route the server lacks (404) or a method the route does not take (405)."""
    if status == 405:
        message = f"{method} is not allowed on {path}" + (f"; use {allowed}" if allowed else "")
        return error_document(message, None, "method_not_allowed")
    if status == 404:
        routes = "POST /v1/completions, GET /v1/models, GET /metrics, POST /reset_prefix_cache, GET /health"
        return error_document(f"no route {method} {path}; this server answers {routes}", None, "not_found")
    return error_document(f"HTTP {status} on {method} {path}", None, None)


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Served:
    """What the server serves, as requests are checked against it."""

    model: str  # the id clients name
    vocab: int  # token ids 0 .. vocab - 1
    max_model_len: int  # prompt + max_tokens may fill it, never pass it
    block_size: int
    kv_blocks: int
    tokenizer: Codec
    dtype: str = "float32"  # what the model computes in, as /v1/models states it (torch's name)

    def text(self, ids: list[int]) -> str:
        """Token ids as text; an id the tokenizer lacks (a model with a larger vocabulary) as <|id|>."""
        try:
            return self.tokenizer.decode(ids)
        except KeyError:
            if len(ids) == 1:
                return f"<|{ids[0]}|>"
            return "".join(self.text([i]) for i in ids)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    logprobs: int | None
    stream: bool


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:  # absent or null: the default
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {json.dumps(value)[:80]}", name, "invalid_type")
    if value < lo or (hi is not None and value > hi):
        limit = f"{lo} .. {hi}" if hi is not None else f">= {lo}"
        raise RequestError(f"{name} must be {limit}, got {value}", name, "invalid_value")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {json.dumps(value)[:80]}", name, "invalid_type")
    if value < 0:
        raise RequestError(f"{name} must be >= 0, got {value}", name, "invalid_value")
    return float(value)


def _prompt(body: dict, served: Served) -> list[int]:
    """One prompt: text, or token ids (a list of one of either is taken as that prompt)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str):
        ids = served.tokenizer.encode(p)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, str | list) for t in p):
        raise RequestError(f"one prompt per request, got {len(p)}", "prompt", "invalid_value")
    else:
        raise RequestError("prompt must be a string or a list of token ids", "prompt", "invalid_type")
    if not ids:
        raise RequestError("prompt is empty (zero tokens)", "prompt", "invalid_value")
    bad = next((t for t in ids if not 0 <= t < served.vocab), None)
    if bad is not None:
        raise RequestError(
            f"prompt token id {bad} is outside the vocabulary (0 .. {served.vocab - 1})", "prompt", "invalid_value"
        )
    return ids


def _tokens(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"


def _fits(prompt: list[int], max_tokens: int, served: Served) -> None:
    n = len(prompt)
    if n >= served.max_model_len:
        raise RequestError(
            f"prompt of {_tokens(n)} leaves no room in the model's context of {served.max_model_len} tokens",
            "prompt",
            "context_length_exceeded",
        )
    if n + max_tokens > served.max_model_len:
        raise RequestError(
            f"prompt of {_tokens(n)} + max_tokens {max_tokens} = {n + max_tokens} is past the model's context of "
            f"{served.max_model_len} tokens; use max_tokens <= {served.max_model_len - n}",
            "max_tokens",
            "context_length_exceeded",
        )
    blocks = -(-(n + max_tokens - 1) // served.block_size)
    if blocks > served.kv_blocks:
        raise RequestError(
            f"prompt of {_tokens(n)} + max_tokens {max_tokens} needs {blocks} KV blocks of {served.block_size} tokens "
            f"and the pool holds {served.kv_blocks} (--kv-blocks): it can never run; use a shorter prompt or fewer "
            "max_tokens",
            "max_tokens",
            "kv_pool_too_small",
        )


def parse_completion(raw: bytes, served: Served) -> CompletionRequest:
    """A POST /v1/completions body read and checked (module docstring); RequestError names what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", None, "invalid_json")
    model = body.get("model")
    if model is not None and model != served.model:
        raise RequestError(
            f"the model {json.dumps(model)[:120]} does not exist; this server serves {served.model!r}",
            "model",
            "model_not_found",
        )
    for name, default in DEFAULTS_ONLY.items():
        if body.get(name) not in (None, default):
            raise RequestError(f"{name} is not supported (only {json.dumps(default)})", name, "unsupported")
    if body.get("stop") not in (None, [], ""):
        raise RequestError("stop is not supported (generation stops at <|endoftext|> or max_tokens)", "stop")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream", "invalid_type")
    max_tokens = _integer(body, "max_tokens", 16, 1)
    assert max_tokens is not None
    prompt = _prompt(body, served)
    _fits(prompt, max_tokens, served)
    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        seed=_integer(body, "seed", None, 0, SEED_LIMIT - 1),
        logprobs=_integer(body, "logprobs", None, 0, MAX_LOGPROBS),
        stream=stream,
    )


# --- the documents written --------------------------------------------------------------------------------------------
def logprobs_document(served: Served, tokens: list[Any], offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object for sampled tokens (engine.Token): each token's text, logprob, top alternatives
    and its offset in the completion's text (`offset`: the text before the first of them)."""
    texts = [served.text([t.id]) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{served.text([i]): lp for i, lp in (t.top or [])} for t in tokens],
        "text_offset": offsets,
    }


def completion_document(
    rid: str, created: int, served: Served, choice: dict[str, Any], usage: dict[str, Any] | None
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": served.model,
        "choices": [{"index": 0, **choice}],
    }
    if usage is not None:
        doc["usage"] = usage
    return doc


def usage_document(done: Any) -> dict[str, Any]:
    """The usage of a finished request (engine.Done)."""
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def models_document(served: Served) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": served.model,
                "object": "model",
                "owned_by": "kvbench",
                "max_model_len": served.max_model_len,
                "dtype": served.dtype,
            }
        ],
    }


# name -> (Prometheus type, help, the engine's stats key)
METRICS: dict[str, tuple[str, str, str]] = {
    "kvbench_prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache.", "queries"),
    "kvbench_prefix_cache_hits_total": ("counter", "Prompt tokens found in the prefix cache (either tier).", "hits"),
    "kvbench_host_tier_hits_total": ("counter", "Prompt tokens found in the host tier.", "host_hits"),
    "kvbench_host_swap_in_blocks_total": ("counter", "Blocks copied host to device.", "swap_in_blocks"),
    "kvbench_host_swap_out_blocks_total": ("counter", "Blocks copied device to host.", "swap_out_blocks"),
    "kvbench_kv_block_evictions_total": ("counter", "Cached device blocks taken for new K/V.", "evictions"),
    "kvbench_requests_total": ("counter", "Completion requests accepted.", "requests"),
    "kvbench_requests_finished_total": ("counter", "Requests that finished (length or stop).", "finished"),
    "kvbench_requests_failed_total": ("counter", "Requests ended by an error or a shutdown.", "failed"),
    "kvbench_prompt_tokens_total": ("counter", "Prompt tokens of the requests admitted.", "prompt_tokens"),
    "kvbench_prefill_tokens_total": ("counter", "Prompt tokens computed (not found in the cache).", "prefill_tokens"),
    "kvbench_generation_tokens_total": ("counter", "Tokens sampled and returned.", "generated_tokens"),
    "kvbench_decode_steps_total": ("counter", "Decode forwards of the running batch.", "steps"),
    "kvbench_kv_blocks_total": ("gauge", "Device KV blocks in the pool (--kv-blocks).", "blocks_total"),
    "kvbench_kv_blocks_used": ("gauge", "Device KV blocks held by running requests.", "blocks_used"),
    "kvbench_kv_blocks_cached": ("gauge", "Device KV blocks holding a cached prefix block.", "blocks_cached"),
    "kvbench_kv_block_size": ("gauge", "Tokens per KV block (--block-size).", "block_size"),
    "kvbench_host_blocks_total": ("gauge", "Host-tier blocks (--host-blocks).", "host_blocks_total"),
    "kvbench_host_blocks_used": ("gauge", "Host-tier blocks holding a cached prefix block.", "host_blocks_used"),
    "kvbench_requests_running": ("gauge", "Requests in the running batch.", "running"),
    "kvbench_requests_waiting": ("gauge", "Requests waiting for a place in the batch or for blocks.", "waiting"),
}


def metrics_text(stats: dict[str, int]) -> str:
    """Prometheus' text format (version 0.0.4) of the engine's stats."""
    lines = []
    for name, (kind, help_, key) in METRICS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {stats[key]}"]
    return "\n".join(lines) + "\n"
