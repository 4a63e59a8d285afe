"""What an OpenAI-compatible engine exposes, probed once, and its completions at temperature 0.

The probe asks GET /v1/models (the model, its max_model_len), then one short completion: token-id prompts where the
engine takes them, else text; `logprobs` where it answers them; `token_ids` (asked for with vLLM's
`return_token_ids` where the answer lacks them) and `usage.prompt_tokens_details.cached_tokens` where its answer
has them. GET /metrics, where it answers, is read for
the prefix-cache hit counters, the block size and the pool size under the names each engine uses (`METRICS`). The
reset (--reset) is tried once, so a wrong way is said before any check runs.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from kvbench.endpoint.client import Client, EndpointError, EndpointHTTPError
from kvbench.endpoint.completion import ID_RANGE, Completion, Prompt, read_completion
from kvbench.endpoint.resets import Reset

TOP_N = 5  # top logprobs asked for at each step: enough to find the runner-up of a flipped token

# Prometheus names, by what they measure: the first one an engine's /metrics has is read.
HITS = ("kvbench_prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")
QUERIES = ("kvbench_prefix_cache_queries_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")
LOWER_TIER_HITS = ("kvbench_host_tier_hits_total",)
SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Metrics:
    """GET /metrics parsed: each name's samples as (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def total(self, names: tuple[str, ...]) -> tuple[float, str] | None:
        """The sum over label sets of the first of `names` present, and that name."""
        for name in names:
            if name in self.samples:
                return sum(v for _, v in self.samples[name]), name
        return None

    def label(self, name: str, key: str) -> int | None:
        for labels, _ in self.samples.get(name, []):
            if labels.get(key, "").isdigit():
                return int(labels[key])
        return None

    def block_size(self) -> tuple[int, str] | None:
        size = self.total(("kvbench_kv_block_size",))
        if size is not None and _count(size[0]):
            return int(size[0]), size[1]
        vllm = self.label("vllm:cache_config_info", "block_size")
        return (vllm, "vllm:cache_config_info") if vllm else None

    def pool_tokens(self) -> tuple[int, str] | None:
        """The device pool in tokens: kvbench serve's blocks x block size, vLLM's GPU blocks x block size, SGLang's
        max_total_num_tokens. A value that is no count (NaN, infinite, 0, negative) is none stated."""
        blocks, size = self.total(("kvbench_kv_blocks_total",)), self.total(("kvbench_kv_block_size",))
        if blocks is not None and size is not None and _count(blocks[0]) and _count(size[0]):
            return int(blocks[0]) * int(size[0]), "kvbench_kv_blocks_total x kvbench_kv_block_size"
        n, b = (
            self.label("vllm:cache_config_info", "num_gpu_blocks"),
            self.label("vllm:cache_config_info", "block_size"),
        )
        if n and b:
            return n * b, "vllm:cache_config_info num_gpu_blocks x block_size"
        sglang = self.total(("sglang:max_total_num_tokens",))
        return (int(sglang[0]), sglang[1]) if sglang and _count(sglang[0]) else None


def _count(value: float) -> bool:
    """A value /metrics states as a size: a finite number >= 1."""
    return math.isfinite(value) and value >= 1


def parse_metrics(text: str) -> Metrics:
    m = Metrics()
    for line in text.splitlines():
        s = SAMPLE.match(line.strip())
        if s is None or line.startswith("#"):
            continue
        try:
            value = float(s.group(3))
        except ValueError:
            continue
        m.samples.setdefault(s.group(1), []).append((dict(LABEL.findall(s.group(2) or "")), value))
    return m


@dataclass
class Engine:
    """One server as the checks drive it: what it exposes, and `complete` at temperature 0."""

    client: Client
    model: str
    max_len: int | None
    dtype: str | None  # what /v1/models says the model computes in (kvbench serve states it); None: not said
    token_prompts: bool  # takes a prompt as a list of token ids
    logprobs: bool  # answers logprobs (the sampled token's at each step)
    tops: bool  # ... and the top logprobs at each step
    token_ids: bool  # its answer lists the completion's token ids
    cached_field: bool  # usage.prompt_tokens_details.cached_tokens
    reset: Reset
    has_metrics: bool = False
    seed: int = 0
    fields: dict = field(default_factory=dict)  # added to every request: {"return_token_ids": true} where it helps

    def complete(self, prompt: Prompt, n: int, cold: bool = False, clear: bool = True) -> Completion:
        """`prompt` continued by `n` greedy tokens; `cold`: run it cold (the reset before it, unless `clear` is
        False because the caller reset already, or in it)."""
        body: dict = {"model": self.model, "prompt": prompt, "max_tokens": n, "temperature": 0, "seed": self.seed}
        body.update(self.fields)
        if self.logprobs:
            body["logprobs"] = TOP_N
        if cold:
            if self.reset.path is not None and clear:
                self.clear()
            body.update(self.reset.fields)
        t0 = time.perf_counter()
        doc = self.client.json("POST", "/v1/completions", body)
        c = read_completion(doc, self.client.where)
        c.seconds = time.perf_counter() - t0
        return c

    def clear(self) -> None:
        assert self.reset.path is not None, "a reset that POSTs"
        try:
            self.client.call_ok("POST", self.reset.path)
        except EndpointHTTPError as e:
            raise EndpointError(
                f"{e}; --reset {self.reset.name} ({self.reset.summary}) is not this engine's way: name its way "
                "(--reset kvbench, vllm, sglang or llamacpp) or use --reset none"
            ) from None

    def metrics(self) -> Metrics | None:
        """GET /metrics parsed, or None where the engine answers none (404, not Prometheus text)."""
        a = self.client.call("GET", "/metrics")
        if a.status != 200 or a.body.lstrip().startswith((b"{", b"<")):
            return None
        return parse_metrics(a.body.decode("utf-8", "replace"))


def probe(client: Client, reset: Reset, seed: int) -> Engine:
    """The engine behind `client`: its model and what its answers hold (module docstring)."""
    model, max_len, dtype = _model(client)
    e = Engine(client, model, max_len, dtype, True, True, True, True, True, reset, seed=seed)
    c = _first_completion(e)
    e.logprobs, e.tops = e.logprobs and c.has_logprobs, e.logprobs and c.tops is not None
    e.token_ids = c.token_ids is not None or _token_ids_on_request(e)
    e.cached_field = c.cached_tokens is not None
    e.has_metrics = e.metrics() is not None
    if reset.path is not None:
        e.clear()
    return e


def _token_ids_on_request(e: Engine) -> bool:
    """Whether the engine lists a completion's token ids when asked with `return_token_ids` (vLLM's field), so a
    second turn can continue the first one's exact tokens; an engine that refuses the field is not asked again."""
    e.fields = {"return_token_ids": True}
    try:
        c = e.complete(list(range(ID_RANGE[0], ID_RANGE[0] + 8)) if e.token_prompts else " the first of many", 2)
    except EndpointHTTPError as err:
        if err.status not in (400, 422):
            raise
        c = None
    if c is None or c.token_ids is None:
        e.fields = {}
        return False
    return True


def _model(client: Client) -> tuple[str, int | None, str | None]:
    doc = client.json("GET", "/v1/models")
    data = doc.get("data") if isinstance(doc, dict) else None
    if (
        not isinstance(data, list)
        or not data
        or not isinstance(data[0], dict)
        or not isinstance(data[0].get("id"), str)
    ):
        raise EndpointError(
            f"{client.where}: GET /v1/models answered no model list ({str(doc)[:80]}); not an OpenAI-compatible server"
        )
    max_len, dtype = data[0].get("max_model_len"), data[0].get("dtype")
    max_len = max_len if isinstance(max_len, int) and not isinstance(max_len, bool) and max_len > 0 else None
    return data[0]["id"], max_len, dtype if isinstance(dtype, str) else None


def _first_completion(e: Engine) -> Completion:
    """A 2-token completion in the first form the engine takes: token ids with logprobs, text with logprobs, then
    each without. Refused every way: the first refusal is raised."""
    first: EndpointHTTPError | None = None
    for ids, logprobs in ((True, True), (False, True), (True, False), (False, False)):
        e.token_prompts, e.logprobs = ids, logprobs
        prompt: Prompt = list(range(ID_RANGE[0], ID_RANGE[0] + 8)) if ids else " the first of many"
        try:
            return e.complete(prompt, 2)
        except EndpointHTTPError as err:
            if err.status not in (400, 422):
                raise
            first = first or err
    assert first is not None
    raise first
