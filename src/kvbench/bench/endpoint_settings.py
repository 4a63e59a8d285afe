"""`bench --endpoint URL`'s settings: its own options (EndpointOptions), the few of bench's options it shares
(--prompt-len, --new-tokens, --seed, --out, --force, --json, --baseline), and the rules they are held to before any
request is sent (`endpoint_workload`). Everything that chooses a model kvbench would run itself is refused: the
engine behind the URL runs its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench import validate
from kvbench.endpoint.resets import Reset, get_reset
from kvbench.errors import KVBenchError, listed
from kvbench.options import option

PANEL = "Serving engines (--endpoint)"
DEFAULT_PROMPT_LEN = 256
DEFAULT_NEW_TOKENS = 64
MAX_CONCURRENCY = 1024  # client threads of one level
MAX_REQUESTS = 1_000_000
MAX_TIMEOUT = 86_400.0
MAX_COLD_WARM = 100
# bench's own options that --endpoint takes; any other given with it is refused (it chooses what kvbench runs)
SHARED = ("prompt_len", "new_tokens", "seed", "out")


@dataclass
class EndpointOptions:
    """bench's options for a running OpenAI-compatible server (docs/bench-endpoint.md)."""

    endpoint: str | None = option(
        "--endpoint",
        default=None,
        panel=PANEL,
        help="Measure serving latency of a running OpenAI-compatible server instead (kvbench serve, vLLM, SGLang, "
        "llama.cpp's server): its base URL, e.g. http://127.0.0.1:8000/v1. TTFT, TPOT, ITL, throughput per "
        "--concurrency level, streamed /v1/completions.",
    )
    concurrency: str = option(
        "--concurrency",
        default="1,4",
        panel=PANEL,
        help="With --endpoint: requests in flight, comma-separated, one level each.",
    )
    requests: int = option(
        "--requests", default=32, panel=PANEL, help="With --endpoint: requests sent per concurrency level."
    )
    prefix_len: int = option(
        "--prefix-len",
        default=0,
        panel=PANEL,
        help="With --endpoint: tokens every prompt of a level shares, so prefix-cache hits are measured "
        "(0: unique prompts; cold vs warm then repeats whole prompts).",
    )
    reset: str = option(
        "--reset",
        default="kvbench",
        panel=PANEL,
        help="With --endpoint: how the engine starts cold: kvbench | vllm (POST /reset_prefix_cache), sglang "
        '(POST /flush_cache), llamacpp ("cache_prompt": false), none.',
    )
    cold_warm: int = option(
        "--cold-warm",
        default=3,
        panel=PANEL,
        help="With --endpoint: rounds of cold vs warm TTFT (a cold request after the reset, then warm repeats of "
        "its prefix); 0 skips them.",
    )
    timeout: float = option(
        "--timeout",
        default=60.0,
        panel=PANEL,
        help="With --endpoint: seconds any wait may take (connecting, an answer, the next streamed token).",
    )


@dataclass
class Workload:
    """One `bench --endpoint` run, checked: what is sent, at which concurrency, and how the engine starts cold."""

    url: str
    concurrency: list[int]
    requests: int
    prompt_len: int
    prefix_len: int
    new_tokens: int
    seed: int
    reset: Reset
    cold_warm: int
    timeout: float
    out: str | None = None

    def settings(self) -> dict[str, Any]:
        """meta.json's settings: every value as run."""
        return {
            "endpoint": self.url,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "prompt_len": self.prompt_len,
            "prefix_len": self.prefix_len,
            "new_tokens": self.new_tokens,
            "seed": self.seed,
            "reset": self.reset.name,
            "cold_warm": self.cold_warm,
            "timeout": self.timeout,
        }


def given_endpoint_options(o: EndpointOptions) -> list[str]:
    """The --endpoint options given a value other than their default (refused without --endpoint)."""
    defaults = EndpointOptions()
    names = ("concurrency", "requests", "prefix_len", "reset", "cold_warm", "timeout")
    return ["--" + n.replace("_", "-") for n in names if getattr(o, n) != getattr(defaults, n)]


def endpoint_workload(o: EndpointOptions, given: dict[str, Any], refused: dict[str, bool]) -> Workload:
    """The run `o` and bench's options `given` on the command line ask for, checked (module docstring). `refused`:
    bench's other options (flag -> whether given), each an error when given."""
    assert o.endpoint is not None, "--endpoint given"
    if not o.endpoint.strip():
        raise KVBenchError("--endpoint is empty; give the server's base URL, e.g. http://127.0.0.1:8000/v1")
    bench_own = {"--" + k.replace("_", "-"): True for k in given if k not in SHARED}
    for flag, on in {**refused, **bench_own}.items():
        if on:
            raise KVBenchError(
                f"{flag} chooses what kvbench runs itself; with --endpoint the engine behind the URL runs its own "
                f"model: drop {flag}"
            )
    prompt_len = _one_prompt_len(given.get("prompt_len"))
    new_tokens = validate.new_tokens(
        _whole(given.get("new_tokens", DEFAULT_NEW_TOKENS), "--new-tokens"), 1, "the tokens each request asks for"
    )
    w = Workload(
        url=o.endpoint.strip(),
        concurrency=_concurrency(o.concurrency),
        requests=validate.integer("--requests", o.requests, 1, MAX_REQUESTS),
        prompt_len=prompt_len,
        prefix_len=validate.integer("--prefix-len", o.prefix_len, 0, prompt_len, "at most --prompt-len"),
        new_tokens=new_tokens,
        seed=validate.seed(given.get("seed", 0)),
        reset=get_reset(o.reset),
        cold_warm=validate.integer("--cold-warm", o.cold_warm, 0, MAX_COLD_WARM),
        timeout=validate.real("--timeout", o.timeout, 0.001, MAX_TIMEOUT),
        out=given.get("out"),
    )
    if max(w.concurrency) > w.requests:
        raise KVBenchError(
            f"--concurrency {max(w.concurrency)} is more than --requests {w.requests}: that level could never have "
            f"{max(w.concurrency)} requests in flight; give --requests {max(w.concurrency)} or more"
        )
    return w


def _whole(value: Any, name: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value.strip())
    return validate.integer(name, value)


def _one_prompt_len(value: Any) -> int:
    """--prompt-len with --endpoint: one length (bench's own sweeps several)."""
    if value is None:
        return DEFAULT_PROMPT_LEN
    from kvbench.bench.settings import coerce

    lengths = coerce({"prompt_len": value}, "command line")["prompt_len"]
    if len(lengths) != 1:
        raise KVBenchError(
            f"--prompt-len with --endpoint takes one length, got {listed(lengths)}; run one bench per length"
        )
    return validate.integer("--prompt-len", lengths[0], 1)


def _concurrency(text: str) -> list[int]:
    items = [v.strip() for v in str(text).split(",") if v.strip()]
    if not items:
        raise KVBenchError("--concurrency is empty; give one or more levels, e.g. 1,4,16")
    out = [validate.integer("--concurrency", _whole(v, "--concurrency"), 1, MAX_CONCURRENCY) for v in items]
    return list(dict.fromkeys(out))
