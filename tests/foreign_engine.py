"""A small OpenAI-compatible server with its own naive prefix cache: the engine `verify --endpoint` is tested on.

It stands in for the engines users point verify at (vLLM, SGLang, llama.cpp's server): written here from the
standard library (ThreadingHTTPServer) and transformers alone, sharing no code with kvbench, so a test that passes
against it says kvbench's checks work on an engine kvbench did not write. The model is a tiny random Llama saved to
a folder (`save_tiny_model`); the tokenizer is bytes (token id = byte + 3, ids 0-2 special, ids past 258 written
`<id>`). Its prefix cache is a dict from token-prefix tuples, each a multiple of the block size, to copies of a
transformers DynamicCache cropped to that prefix: each key stands for one block (its last), the pool holds
`pool_blocks` of them, least recently used first out, into a lower tier of `host_blocks` when there is one. A
request reuses the longest cached prefix of at most its length - 1 tokens (the last prompt token is always
computed), and stores every block boundary of prompt + completion afterwards, as vLLM does.

Modes (what it gets wrong on purpose):
    honest          nothing
    corrupt-warm    a prefix-cache hit's K/V get noise (std 0.1): warm answers differ from cold ones
    corrupt-host    a prefix coming back from the lower tier gets that noise (host_blocks must be > 0)
    lie-cached      reports the whole block-rounded prompt as cached, hit or not
    lie-zero        reports 0 cached tokens, hit or not (its /metrics hit counter tells the truth)
    batch-variant   logits get noise while another request is in flight (a batch-dependent kernel)
    unchained       a prompt's first block matches a cached block of the same tokens wherever it sat (a block hash
                    without its parent): its K/V, computed after another prefix, are reused
    reset-keeps-host  a reset empties the device pool only; the lower tier still answers
    no-logprobs     ignores `logprobs` (as `transformers serve` does)
    garbage         answers every request with an HTML page
    error           answers completions with HTTP 500

Run alone: `python tests/foreign_engine.py MODEL_DIR --mode honest --port 0` prints
`foreign engine: http://127.0.0.1:PORT/v1` when it listens (`--save-model DIR` writes the tiny model first).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MODES = (
    "honest",
    "corrupt-warm",
    "corrupt-host",
    "lie-cached",
    "lie-zero",
    "batch-variant",
    "unchained",
    "reset-keeps-host",
    "no-logprobs",
    "garbage",
    "error",
)
RESETS = ("vllm", "sglang", "llamacpp", "none")  # vllm: POST /reset_prefix_cache; sglang: POST /flush_cache
MODEL_ID = "foreign-tiny"
VOCAB = 320
MAX_LEN = 512
NOISE = 0.1  # the std of the noise a corrupt mode adds


def save_tiny_model(path: Path, tokenizer: bool = False) -> Path:
    """A 2-layer Llama (4 heads, 2 K/V heads, vocabulary 320) at init std 0.1, so greedy output varies; with
    `tokenizer`, `byte_tokenizer` saved beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    if tokenizer:
        byte_tokenizer().save_pretrained(path)
    return path


def byte_tokenizer() -> Any:
    """The engine's tokenizer as a transformers one (for `transformers serve` on the same model): every byte a
    token of its own, id = byte + 3, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte-to-character table, which byte-level BPE spells its tokens with
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in shown]
    char = {**{b: chr(b) for b in shown}, **{b: chr(256 + i) for i, b in enumerate(extra)}}
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{char[b]: b + 3 for b in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def encode(text: str) -> list[int]:
    return [b + 3 for b in text.encode("utf-8")]


def token_text(i: int) -> str:
    if 3 <= i < 259:
        b = i - 3
        return chr(b) if b < 128 else f"\\x{b:02x}"
    return f"<{i}>"


class BadRequest(Exception):
    pass


@dataclass
class Settings:
    mode: str = "honest"
    reset: str = "vllm"
    block_size: int = 16
    pool_blocks: int = 24
    host_blocks: int = 0
    metrics: str = "vllm"  # vllm | kvbench | none: the names /metrics uses, or no /metrics
    logprobs: bool = True  # answers `logprobs` (False: ignores it, as mode no-logprobs)
    usage_details: bool = True  # usage.prompt_tokens_details.cached_tokens
    token_prompts: bool = True  # a prompt may be a list of token ids
    token_ids: str = "always"  # a completion's token ids: always, asked (with return_token_ids, as vLLM), never
    die_after: int | None = None  # completions answered before the server stops mid-request
    hang_after: int | None = None  # completions answered before every request hangs


class Engine:
    """The model, its prefix cache and counters; one request at a time runs the model."""

    def __init__(self, model_dir: Path, settings: Settings) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        assert settings.mode in MODES, settings.mode
        self.s = settings
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.lock = threading.Lock()  # the model, the store and the counters
        self.device: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self.host: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self.queries = self.hits = self.host_hits = 0
        self.inflight: set[int] = set()  # requests waiting for the model or running
        self.overlapped: set[int] = set()  # ... and those of them another request was in flight beside
        self.counting = threading.Lock()  # `inflight`, `overlapped` and `served`
        self.served = 0
        self.release = threading.Event()  # ends a hang when the server stops

    # --- the prefix cache ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        with self.lock:
            self.device.clear()
            if self.s.mode != "reset-keeps-host":
                self.host.clear()

    def lookup(self, ids: list[int]) -> tuple[int, Any]:
        """The longest cached block-multiple prefix of at most len(ids) - 1 tokens: (its length, a copy)."""
        b = self.s.block_size
        for k in range((len(ids) - 1) // b * b, 0, -b):
            key = tuple(ids[:k])
            if key in self.device:
                self.device.move_to_end(key)
                return k, self.corrupted(copy.deepcopy(self.device[key]), self.s.mode == "corrupt-warm")
            if key in self.host:
                entry = self.host.pop(key)
                self.host_hits += k
                self.insert(key, entry)
                return k, self.corrupted(copy.deepcopy(entry), self.s.mode in ("corrupt-warm", "corrupt-host"))
        return self.unchained(ids) if self.s.mode == "unchained" and len(ids) > b else (0, None)

    def unchained(self, ids: list[int]) -> tuple[int, Any]:
        """The first block found as the last block of any cached prefix: that prefix's K/V of it, as if at 0."""
        b = self.s.block_size
        first = tuple(ids[:b])
        for key, entry in self.device.items():
            if len(key) > b and key[-b:] == first:
                cache = copy.deepcopy(entry)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[..., -b:, :], layer.values[..., -b:, :]
                return b, cache
        return 0, None

    def corrupted(self, cache: Any, on: bool) -> Any:
        if on:
            g = self.torch.Generator().manual_seed(1)
            for layer in cache.layers:
                layer.keys = layer.keys + NOISE * self.torch.randn(layer.keys.shape, generator=g)
                layer.values = layer.values + NOISE * self.torch.randn(layer.values.shape, generator=g)
        return cache

    def insert(self, key: tuple[int, ...], cache: Any) -> None:
        self.device[key] = cache
        while len(self.device) > self.s.pool_blocks:
            old, entry = self.device.popitem(last=False)
            if self.s.host_blocks:
                self.host[old] = entry
                while len(self.host) > self.s.host_blocks:
                    self.host.popitem(last=False)

    def store(self, ids: list[int], cache: Any) -> None:
        """Every block boundary of `ids` (whose K/V `cache` holds) not cached yet."""
        n = cache.get_seq_length()
        assert n == len(ids), (n, len(ids))
        for j in range(self.s.block_size, n + 1, self.s.block_size):
            key = tuple(ids[:j])
            if key in self.device:
                self.device.move_to_end(key)
                continue
            part = copy.deepcopy(cache)
            part.crop(j - n)  # a negative count removes that many tokens from the end
            self.insert(key, part)

    # --- a completion --------------------------------------------------------------------------------------------
    def complete(self, body: dict, rid: int = 0) -> dict:
        ids, n, temperature, top_n, seed, use_cache = self.parse(body)
        with self.lock:
            doc = self.run(ids, n, temperature, top_n, seed, use_cache, rid)
        asked = self.s.token_ids == "asked" and body.get("return_token_ids") is True
        if not (self.s.token_ids == "always" or asked):
            del doc["choices"][0]["token_ids"]
        return doc

    def parse(self, body: dict) -> tuple[list[int], int, float, int | None, int, bool]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not self.s.token_prompts:
                raise BadRequest("prompt must be a string")
            ids = list(prompt)
        else:
            raise BadRequest("prompt must be a string or a list of token ids")
        if any(not 0 <= t < VOCAB for t in ids) or not ids:
            raise BadRequest(f"token ids must lie in [0, {VOCAB}) and the prompt may not be empty")
        n = body.get("max_tokens", 16)
        if not isinstance(n, int) or n < 1 or len(ids) + n > MAX_LEN:
            raise BadRequest(f"max_tokens must be >= 1 and prompt + max_tokens <= {MAX_LEN}")
        top_n = body.get("logprobs")
        if self.s.mode == "no-logprobs" or not self.s.logprobs:
            top_n = None
        if top_n is not None and (not isinstance(top_n, int) or not 0 <= top_n <= 20):
            raise BadRequest("logprobs must be an integer from 0 to 20")
        temperature = float(body.get("temperature", 1.0))
        use_cache = not (self.s.reset == "llamacpp" and body.get("cache_prompt") is False)
        return ids, n, temperature, top_n, int(body.get("seed") or 0), use_cache

    def run(
        self, ids: list[int], n: int, temperature: float, top_n: int | None, seed: int, use_cache: bool, rid: int
    ) -> dict:
        torch = self.torch
        from transformers import DynamicCache

        k, cache = self.lookup(ids) if use_cache else (0, None)
        self.queries += len(ids)
        self.hits += k
        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        g = torch.Generator().manual_seed(seed)
        x, out, steps = torch.tensor([ids[k:]]), [], []
        with torch.no_grad():
            for i in range(n):
                logits = self.model(input_ids=x, use_cache=True, **{self.cache_kw: cache}).logits[0, -1].float()
                if self.s.mode == "batch-variant" and rid in self.overlapped:
                    logits = logits + NOISE * 5 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(i))
                lp = logits.log_softmax(-1)
                t = (
                    int(lp.argmax())
                    if temperature == 0
                    else int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=g))
                )
                out.append(t)
                steps.append((float(lp[t]), lp.topk(top_n) if top_n else None))
                x = torch.tensor([[t]])
        self.store(ids + out[:-1], cache)
        return self.document(ids, out, steps, top_n, k)

    def reported_cached(self, ids: list[int], k: int) -> int:
        if self.s.mode == "lie-cached":
            return (len(ids) - 1) // self.s.block_size * self.s.block_size
        return 0 if self.s.mode == "lie-zero" else k

    def document(self, ids: list[int], out: list[int], steps: list, top_n: int | None, k: int) -> dict:
        texts = [token_text(t) for t in out]
        logprobs = None
        if top_n is not None:
            offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
            tops = [
                {token_text(int(j)): float(v) for v, j in zip(top.values, top.indices, strict=True)}
                if top is not None
                else {}
                for _, top in steps
            ]
            logprobs = {
                "tokens": texts,
                "token_logprobs": [lp for lp, _ in steps],
                "top_logprobs": tops,
                "text_offset": offsets,
            }
        usage: dict[str, Any] = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "total_tokens": len(ids) + len(out),
        }
        if self.s.usage_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.reported_cached(ids, k)}
        choice = {"index": 0, "text": "".join(texts), "finish_reason": "length", "logprobs": logprobs, "token_ids": out}
        return {
            "id": f"cmpl-{self.served}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": MODEL_ID,
            "choices": [choice],
            "usage": usage,
        }

    def metrics(self) -> str:
        s = self.s
        if s.metrics == "kvbench":
            lines = {
                "kvbench_prefix_cache_queries_total": self.queries,
                "kvbench_prefix_cache_hits_total": self.hits,
                "kvbench_kv_blocks_total": s.pool_blocks,
                "kvbench_kv_blocks_used": len(self.device),
                "kvbench_kv_block_size": s.block_size,
                "kvbench_host_blocks_total": s.host_blocks,
                "kvbench_host_tier_hits_total": self.host_hits,
            }
            return "".join(f"{name} {value}\n" for name, value in lines.items())
        label = f'{{model_name="{MODEL_ID}"}}'
        config = f'{{block_size="{s.block_size}",cache_dtype="auto",num_gpu_blocks="{s.pool_blocks}"}}'
        return (
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{label} {float(self.queries)}\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{label} {float(self.hits)}\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{config} 1.0\n"
        )


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the tests read the verdicts, not the log
        pass

    def send(self, status: int, doc: Any, kind: str = "application/json") -> None:
        data = (json.dumps(doc) if kind == "application/json" else str(doc)).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, status: int, message: str) -> None:
        self.send(status, {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})

    def do_GET(self) -> None:
        engine = self.server.engine
        if engine.s.mode == "garbage":
            return self.send(200, "<html><body>not an API</body></html>", "text/html")
        if self.path == "/v1/models":
            model = {"id": MODEL_ID, "object": "model", "owned_by": "tests", "max_model_len": MAX_LEN}
            return self.send(200, {"object": "list", "data": [model]})
        if self.path == "/health":
            return self.send(200, {})
        if self.path == "/metrics" and engine.s.metrics != "none":
            with engine.lock:
                return self.send(200, engine.metrics(), "text/plain; version=0.0.4")
        self.error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        engine = self.server.engine
        if engine.s.mode == "garbage":
            return self.send(200, "<html><body>not an API</body></html>", "text/html")
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        reset_path = {"vllm": "/reset_prefix_cache", "sglang": "/flush_cache"}.get(engine.s.reset)
        if self.path == reset_path:
            engine.reset()
            if engine.s.reset == "sglang":  # SGLang's /flush_cache answers a sentence, not JSON
                return self.send(200, "Cache flushed.", "text/plain")
            return self.send(200, {})
        if self.path != "/v1/completions":
            return self.error(404, f"no route {self.path}")
        self.completion(engine, body)

    def completion(self, engine: Engine, body: dict) -> None:
        with engine.counting:
            engine.served += 1
            served = engine.served
        if engine.s.die_after is not None and served > engine.s.die_after:
            return self.server.die()  # mid-request: the client's connection closes unanswered
        if engine.s.hang_after is not None and served > engine.s.hang_after:
            engine.release.wait()
            return None
        if engine.s.mode == "error":
            return self.send(500, {"error": {"message": "internal server error", "type": "server_error"}})
        with engine.counting:
            if engine.inflight:
                engine.overlapped |= engine.inflight | {served}
            engine.inflight.add(served)
        try:
            doc = engine.complete(body, served)
        except BadRequest as e:
            return self.error(400, str(e))
        finally:
            with engine.counting:
                engine.inflight.discard(served)
                engine.overlapped.discard(served)
        self.send(200, doc)  # after leaving the active requests: the client's next request may come at once


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, engine: Engine, port: int = 0, exit_on_die: bool = False) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.engine = engine
        self.exit_on_die = exit_on_die

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def die(self) -> None:
        if self.exit_on_die:
            os._exit(3)
        threading.Thread(target=self.stop, daemon=True).start()

    def stop(self) -> None:
        self.engine.release.set()
        self.shutdown()
        self.server_close()


class Running:
    """A server on a free port of 127.0.0.1, in a thread of this process: `with Running(dir, Settings()) as url:`."""

    def __init__(self, model_dir: Path, settings: Settings) -> None:
        self.server = Server(Engine(model_dir, settings))

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.server.url

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--save-model", action="store_true", help="write the tiny model to MODEL_DIR first")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--mode", choices=MODES, default="honest")
    p.add_argument("--reset", choices=RESETS, default="vllm")
    p.add_argument("--metrics", choices=("vllm", "kvbench", "none"), default="vllm")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=24)
    p.add_argument("--host-blocks", type=int, default=0)
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--hang-after", type=int, default=None)
    a = p.parse_args(argv)
    if a.save_model:
        save_tiny_model(a.model_dir)
    settings = Settings(
        mode=a.mode,
        reset=a.reset,
        block_size=a.block_size,
        pool_blocks=a.pool_blocks,
        host_blocks=a.host_blocks,
        metrics=a.metrics,
        die_after=a.die_after,
        hang_after=a.hang_after,
    )
    server = Server(Engine(a.model_dir, settings), a.port, exit_on_die=True)
    print(f"foreign engine: {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
