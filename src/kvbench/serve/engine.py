"""The serving engine: a request queue and the continuous-batching loop over the pool, in one thread.

Each iteration of the loop (`step`):
    1. takes what arrived: new requests (into the waiting queue), cancellations, resets of the prefix cache;
    2. admits waiting requests first come, first served, while the batch has room (--max-batch) and the pool can
       give each every block it may ever need (its prompt plus max_tokens - 1 tokens, less the blocks it finds in
       the device tier): a request that fits later waits, and no running request is ever preempted;
    3. prefills each admitted request alone: its cached leading blocks are held (device) or copied back (host), and
       one forward computes only the uncached suffix; its first token is sampled and it joins the running batch;
    4. runs one decode forward for every running request together, each row at its own position (batch.py), samples
       each row with its own temperature and generator, and releases the blocks of those that finished.

A request's tokens are emitted as they are sampled (`Token`), then `Done` with its usage, or `Failed`. The model,
the pool and the requests are touched by the loop's thread only; other threads submit, cancel and reset through
the queue, and read the counters (`stats`).
"""

from __future__ import annotations

import queue
import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvbench.model.gpt2 import GPT
from kvbench.serve.batch import step_caches
from kvbench.serve.pool import ROOT_HASH, KVPool

# A draw divides the logits, less their max (so every value is <= 0), by the temperature: no temperature, however
# small, overflows them to inf and the softmax to NaN (which failed the whole batch); below float32's smallest normal
# number a temperature is that number, where the draw is the argmax anyway.
TINY_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Token:
    """One sampled token: its id, its logprob under the model (None unless asked) and the top alternatives."""

    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (id, logprob), most likely first


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "length" (max_tokens reached) or "stop" (<|endoftext|> sampled; not emitted)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache (either tier)


@dataclass(frozen=True)
class Failed:
    message: str


Event = Token | Done | Failed


@dataclass
class Submission:
    """A checked request (serve/protocol.py checks it): what the engine runs and where its events go."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # None: drawn from the server's own seeded generator
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k
    emit: Callable[[Event], None] = lambda event: None  # called on the engine's thread
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Sequence:
    """A request inside the engine: its tokens, its blocks and what it may still allocate."""

    sub: Submission
    tokens: list[int]  # prompt, then every sampled token (the last one not yet written to the pool)
    blocks: list[int] = field(default_factory=list)  # device blocks in token order
    hashes: list[bytes] = field(default_factory=list)  # hashes of its full blocks committed so far (a chain)
    filled: int = 0  # tokens whose K/V are in its blocks
    reserved: int = 0  # blocks it may still allocate (admission set them aside)
    cached: int = 0  # prompt tokens found in the prefix cache
    generator: torch.Generator | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.sub.prompt)


class Engine:
    """The loop over `model` and `pool` (module docstring). `start` runs it in a thread of its own; `step` runs one
    iteration on the caller's thread (the in-process scenarios of serve/faults.py do)."""

    def __init__(self, model: GPT, pool: KVPool, max_batch: int, stop_id: int | None, seed: int = 0) -> None:
        self.model, self.pool, self.max_batch, self.stop_id = model, pool, max_batch, stop_id
        self.device = model.lm_head.weight.device
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seeds = random.Random(seed)
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.counters = {"requests": 0, "finished": 0, "failed": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self.counters |= {"prefill_tokens": 0, "steps": 0}
        self.on_error: Callable[[str], None] = lambda line: None  # one log line per failed step

    # --- other threads -----------------------------------------------------------------------------------------------
    def submit(self, sub: Submission) -> None:
        self.inbox.put(("submit", sub))

    def reset_prefix_cache(self) -> Future:
        """Forget the cached blocks nobody holds, in both tiers, on the loop's thread: a future of (device, host)."""
        done: Future = Future()
        self.inbox.put(("reset", done))
        return done

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kvbench-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop: every waiting and running request fails ("the server is shutting down")."""
        self.inbox.put(("stop", None))
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def stats(self) -> dict[str, int]:
        """The counters and the current state, read from any thread (each value is read once, not as a snapshot)."""
        p, c = self.pool, self.pool.counters
        return {
            **self.counters,
            "queries": c.queries,
            "hits": c.hits,
            "host_hits": c.host_hits,
            "swap_in_blocks": c.swap_in_blocks,
            "swap_out_blocks": c.swap_out_blocks,
            "evictions": c.evictions,
            "blocks_total": p.num_blocks,
            "blocks_used": p.used,
            "blocks_cached": p.cached,
            "block_size": p.block_size,
            "host_blocks_total": p.host_blocks,
            "host_blocks_used": p.host_used,
            "running": len(self.running),
            "waiting": len(self.waiting),
        }

    # --- the loop ----------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping:
            try:
                self.step(block=True)
            except Exception as e:  # a serving bug: the requests in flight fail, the server goes on
                self.on_error(f"engine step failed: {type(e).__name__}: {e}")
                self._abort(f"internal error: {type(e).__name__}: {e}", waiting=False)
        self._abort("the server is shutting down", waiting=True)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting and self.inbox.empty()

    @torch.inference_mode()
    def step(self, block: bool = False) -> None:
        """One iteration: take what arrived (waiting for something when `block` and there is nothing to do), admit
        and prefill, then one decode forward of the running batch."""
        self._take(block and not self.running and not self.waiting)
        if self.stopping:
            return
        self._drop_cancelled()
        for seq in self._admit():
            self._prefill(seq)
        if self.running:
            self._decode()

    def _take(self, block: bool) -> None:
        items = [self.inbox.get()] if block else []
        while not self.inbox.empty():
            items.append(self.inbox.get())
        for kind, arg in items:
            if kind == "submit":
                self.counters["requests"] += 1
                self.waiting.append(Sequence(arg, list(arg.prompt)))
            elif kind == "reset":
                arg.set_result(self.pool.reset())
            else:
                self.stopping = True

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running if s.sub.cancelled.is_set()]:
            self._finish(seq, None)
        self.waiting = deque(s for s in self.waiting if not s.sub.cancelled.is_set())

    # --- admission and prefill -----------------------------------------------------------------------------------------
    def blocks_needed(self, prompt: int, max_tokens: int) -> int:
        """Blocks a request may ever hold: its prompt and every sampled token but the last (never written)."""
        return -(-(prompt + max_tokens - 1) // self.pool.block_size)

    def _lookup_hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of the prompt's full blocks that may be looked up: all but a last token stays to compute."""
        return self.pool.prefix_hashes(seq.tokens, (len(seq.tokens) - 1) // self.pool.block_size)

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            hashes = self._lookup_hashes(seq)
            m = self.pool.match(hashes)
            need = self.blocks_needed(len(seq.tokens), seq.sub.max_tokens) - m.device_hits
            idle_hits = sum(
                1 for k, b in zip(m.kinds, m.ids, strict=True) if k == "device" and b in self.pool.evictable
            )
            promised = sum(s.reserved for s in self.running)
            if need > self.pool.available - idle_hits - promised:
                break  # first come, first served: it waits for blocks, and so do those behind it
            self.waiting.popleft()
            seq.blocks, _ = self.pool.acquire(hashes, len(seq.tokens))
            seq.hashes = hashes[: len(seq.blocks)]
            seq.cached = seq.filled = len(seq.blocks) * self.pool.block_size
            seq.reserved = self.blocks_needed(len(seq.tokens), seq.sub.max_tokens) - len(seq.blocks)
            seed = seq.sub.seed if seq.sub.seed is not None else self.seeds.getrandbits(63)
            if seq.sub.temperature > 0:
                seq.generator = torch.Generator(device=self.device).manual_seed(seed)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _grow(self, seq: Sequence, tokens: int) -> None:
        """Blocks for `seq` to hold `tokens` tokens, from its reservation."""
        while len(seq.blocks) * self.pool.block_size < tokens:
            assert seq.reserved > 0, f"a request outgrew its reservation at {tokens} tokens"
            seq.blocks.append(self.pool.allocate())
            seq.reserved -= 1

    def _commit(self, seq: Sequence) -> None:
        """Hash and cache the blocks `seq` has filled since the last commit (chained on the previous block)."""
        bs = self.pool.block_size
        for i in range(len(seq.hashes), seq.filled // bs):
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            h = self.pool.block_hash(parent, seq.tokens[i * bs : (i + 1) * bs])
            self.pool.commit(seq.blocks[i], h)
            seq.hashes.append(h)

    def _prefill(self, seq: Sequence) -> None:
        """The prompt's uncached suffix in one forward (this request alone), then its first token."""
        start, end = seq.filled, len(seq.tokens)
        self._grow(seq, end)
        ids = torch.tensor([seq.tokens[start:end]], dtype=torch.long, device=self.device)  # (1, T)
        caches = step_caches(self.pool, [seq.blocks], [start], end - start)
        positions = torch.arange(start, end, device=self.device)[None]  # (1, T)
        logits = self.model(ids, positions, caches, last_only=True)[:, -1]  # (1, V)
        seq.filled = end
        self._commit(seq)
        self.counters["prompt_tokens"] += end
        self.counters["prefill_tokens"] += end - start
        self._sample([seq], logits)

    # --- decode ------------------------------------------------------------------------------------------------------
    def _decode(self) -> None:
        """One forward of every running request's last sampled token, each at its own position."""
        rows = self.running
        for seq in rows:
            self._grow(seq, seq.filled + 1)
        ids = torch.tensor([[s.tokens[-1]] for s in rows], dtype=torch.long, device=self.device)  # (B, 1)
        starts = [s.filled for s in rows]
        caches = step_caches(self.pool, [s.blocks for s in rows], starts, 1)
        positions = torch.tensor(starts, dtype=torch.long, device=self.device)[:, None]  # (B, 1)
        logits = self.model(ids, positions, caches, last_only=True)[:, -1]  # (B, V)
        self.counters["steps"] += 1
        for seq in rows:
            seq.filled += 1
            self._commit(seq)
        self._sample(list(rows), logits)

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """Each row's next token from its logits (B, V): argmax at temperature 0, else a draw from its own
        generator; emitted with its logprob and the top alternatives when asked; finished rows leave the batch."""
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
        for b, seq in enumerate(rows):
            sub = seq.sub
            if sub.temperature == 0:
                tok = int(logits[b].argmax())
            else:
                row = logits[b : b + 1].float()  # (1, V)
                probs = torch.softmax((row - row.max()) / max(sub.temperature, TINY_TEMPERATURE), dim=-1)
                tok = int(torch.multinomial(probs, 1, generator=seq.generator))
            if tok == self.stop_id:
                self._finish(seq, "stop")
                continue
            seq.tokens.append(tok)
            self.counters["generated_tokens"] += 1
            lp = top = None
            if sub.logprobs is not None:
                lp = float(logp[b, tok])
                top = []
                if sub.logprobs:
                    values, ids = logp[b].topk(min(sub.logprobs, logp.shape[-1]))  # a vocabulary under 20
                    top = list(zip(ids.tolist(), values.tolist(), strict=True))
            sub.emit(Token(tok, lp, top))
            if seq.generated >= sub.max_tokens:
                self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        """Release `seq`'s blocks and take it out of the batch; tell its client how it ended (None: cancelled)."""
        self.pool.release(seq.blocks)
        seq.blocks, seq.reserved = [], 0
        self.running.remove(seq)
        if reason is not None:
            self.counters["finished"] += 1
            seq.sub.emit(Done(reason, len(seq.sub.prompt), seq.generated, seq.cached))

    def _abort(self, message: str, waiting: bool) -> None:
        """Fail every running request (and every waiting one, when `waiting`), releasing what they hold."""
        seqs = self.running + (list(self.waiting) if waiting else [])
        for seq in self.running:
            try:
                self.pool.release(seq.blocks)
            except AssertionError:  # the pool's books are what failed: leave them
                break
        self.running = []
        if waiting:
            self.waiting = deque()
        for seq in seqs:
            self.counters["failed"] += 1
            seq.sub.emit(Failed(message))
