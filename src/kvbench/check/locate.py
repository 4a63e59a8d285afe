"""Where a failing `verify` row went wrong: the first step, layer, head and cache slot whose K or V differs from the
reference, or, when the cache holds the right values, the first layer whose attention output differs.

The reference is the no-cache forward of the model under test over each sequence the run held: one forward computes
every token's K and V (and its attention output) at every layer, so what a cache must return for position p of a
sequence is row p of that forward's. For a failing row the run its check made is replayed with recording on
(`located`, called by the suite once per group of rows that share a run):

    logits, greedy, reference   the single-prompt run; step j is the forward that chose token j (step 0: the prefill)
    batched                     the left-padded batch, then each prompt alone when the batch matches the reference
    cache_state                 the first prompt's run on the fresh cache, then the second's on the reused one
    rollback, fork, reorder, chunked_prefill    the scenario (check/lifecycle.py), forward by forward

A replay runs twice: as the check ran it, which gives the tokens every row held (the sequences the reference is taken
over), then with recording on, comparing as it goes and stopping at the first difference (under tensor parallelism
every rank runs it to the end: the ranks' collectives must pair). A run that raises is replayed up to the call that
raised (the tokens chosen before it read from its logits; a scenario's sequences kept by its session): a difference
before it is located as any other, and otherwise the location says where the run raised. What the cached side reads: for our GPT-2, what
each layer's cache `update` returns to attention (wrapped for the one call; the fixed-shape step's slot writer too)
and each head's attention output (the input of `c_proj`); for a Hugging Face model, what transformers'
`Cache.update` returns for each layer and each attention module's output. Slots: with left padding a row's position
p sits in column pad + p; slot c holds column c (our designs, transformers' full-attention layers), and a
sliding-window layer that returns fewer slots than the run has columns holds the last ones.

Per head: |cached - reference| <= atol + rtol x that head's largest |reference value| at the compared positions,
the row's own (rtol, atol) (fp32: 1e-5); a lossy design's K/V differ from the full-precision reference by design, so
they are held to its own rtol (int8: 5% of the head's scale) with the dtype's atol. When the first difference is a
slot's, the location says what the slot holds instead when that is something the run computed: another position
of the same sequence, another head, another row of the batch, another sequence of the run, or zeros.

A compiled row is replayed eagerly (our `--compile off`; for transformers the same cache without generate's
compile): when the eager replay matches the reference everywhere, the difference comes from compilation and the
location says so. Every row of a compiled subject also reports the compilations, recompiles and graph breaks its
runs caused (torch._dynamo's compile callbacks and counters), failing or not.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from unittest.mock import patch

import torch

from kvbench.check.judge import TOLERANCES, CheckRow
from kvbench.check.lifecycle import LIFECYCLE, SCENARIOS
from kvbench.check.subject import Run

SINGLE = ("logits", "greedy", "reference")  # the checks that share the single-prompt run
EVERY_RANK = " (on every rank)"  # ends the detail of a row whose run raised on every tensor-parallel rank (suite.py)


class _Found(Exception):
    """Raised from a recording hook at the first difference: the replay has shown what it had to."""


@dataclass
class Call:
    """One forward call of a replayed run, as a correct cache holds it afterwards."""

    label: str  # the call in words: "step 3", "forward 9 of the rollback scenario, the first after crop(27)"
    seqs: list[list[int]]  # per batch row: every token its cache holds after the call, in position order
    pads: list[int]  # per batch row: the columns before its position 0 (left padding)
    new: int  # tokens the call writes per row
    whose: str = ""  # whose sequences these are, where the location should name them: "the first prompt"

    @property
    def cols(self) -> int:
        """Columns every row's cache fills after the call (pads included)."""
        return self.pads[0] + len(self.seqs[0])


class Reference:
    """The no-cache forward's K, V and attention outputs over a set of sequences: one forward for each sequence that
    is not a prefix of another (causal attention: position p's values depend on tokens 0..p only).

    `forward(seq)` gives {layer: (K (H, n, Dh), V (H, n, Dh), Y)} fp32, Y each position's attention output per head
    (n, H, Dh), or (n, 1, C) where the heads are not separable, or None."""

    def __init__(self, calls: Sequence[Call | None], forward: Callable[[list[int]], dict]) -> None:
        seqs = {tuple(q) for c in calls if c is not None for q in c.seqs}
        self.longest: list[tuple[int, ...]] = []
        for seq in sorted(seqs, key=len, reverse=True):
            if not any(m[: len(seq)] == seq for m in self.longest):
                self.longest.append(seq)
        self.values = {m: forward(list(m)) for m in self.longest}
        self.whose = {self._longest(q): c.whose for c in calls if c is not None and c.whose for q in c.seqs}

    def _longest(self, seq: list[int]) -> tuple[int, ...]:
        t = tuple(seq)
        return next(m for m in self.longest if m[: len(t)] == t)

    def of(self, seq: list[int]) -> dict:
        return self.values[self._longest(seq)]


def first_bad(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[int, int, float, int] | None:
    """got, want (h, m, D): the first index along m where some head's vector is outside atol + rtol x that head's
    largest |want| (NaN is outside), as (index, first such head, its largest |delta|, heads outside there)."""
    if got.numel() == 0:
        return None
    diff = (got - want).abs()  # (h, m, D)
    bound = atol + rtol * want.abs().amax(dim=(1, 2), keepdim=True)  # (h, 1, 1)
    per = (~(diff <= bound)).any(-1)  # (h, m)
    where = per.any(0).nonzero()
    if not where.numel():
        return None
    i = int(where[0, 0])
    heads = per[:, i].nonzero()[:, 0]
    h = int(heads[0])
    return i, h, float(diff[h, i].max()), len(heads)


def _slots(n: int) -> str:
    return f"{n} slot" + ("" if n == 1 else "s")


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


class Probe:
    """Compares what a replayed run's attention reads and computes with the reference, call by call and layer by
    layer (in the order the model runs them), and keeps the first difference in words (`found`).

    `calls[i]` is what the i-th forward call must hold (None: not compared, e.g. the first prompt's run before a
    reused cache's); `heads`: the model's heads this process holds (a tensor-parallel rank's slice), None for all;
    `stop`: raise at the first difference instead of running on."""

    def __init__(
        self,
        calls: Sequence[Call | None],
        ref: Reference,
        rtol: float,
        atol: float,
        heads: range | None = None,
        rank: int | None = None,
        stop: bool = True,
    ) -> None:
        self.calls, self.ref, self.rtol, self.atol = calls, ref, rtol, atol
        self.heads, self.rank, self.stop = heads, rank, stop
        self.i = -1
        self.layers = 0  # layers of the current call whose cache returned to attention
        self.found: str | None = None

    def next_call(self) -> None:
        self.i += 1
        self.layers = 0

    def raised(self, n_layers: int) -> str:
        """Where the run raised, in words, when nothing differed before: the call and the layer it had reached."""
        i, at = self.i, f", layer {self.layers}"
        if self.i < 0 or self.layers >= n_layers:  # after a call's last layer: in the next call, before its first
            i, at = self.i + 1, ", before its first layer"
        call = self.calls[i] if 0 <= i < len(self.calls) else None
        if call is None:
            return ""
        return f"K/V and attention outputs equal the reference until the run raised in {call.label}{at}"

    def _call(self) -> Call | None:
        if self.found is not None or not 0 <= self.i < len(self.calls):
            return None
        return self.calls[self.i]

    def _stop(self, words: str) -> None:
        self.found = words
        if self.stop:
            raise _Found

    def _head(self, h: int) -> str:
        if self.heads is None:
            return f"head {h}"
        return f"head {self.heads.start + h} (rank {self.rank}'s head {h})"

    def _mine(self, t: torch.Tensor) -> torch.Tensor:
        """This process's heads of a reference tensor whose dim 0 is every head."""
        return t if self.heads is None else t[self.heads.start : self.heads.stop]

    def kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, read: int | None = None, windowed: bool = False) -> None:
        """What layer `layer`'s cache returned to attention, (B, h, S, Dh); `read`: the slots attention reads (the
        mask's count), where known; `windowed`: a sliding-window layer (fewer slots than columns hold the last)."""
        self.layers += 1
        call = self._call()
        if call is None:
            return
        cols, S = call.cols, k.size(2)
        off = cols - S if windowed and S < cols else 0  # columns before the layer's first slot
        firsts, short = [], None
        for b, (seq, pad) in enumerate(zip(call.seqs, call.pads, strict=True)):
            ref = self.ref.of(seq)[layer]
            n = len(seq)
            lo, hi = max(0, off - pad), min(n, S + off - pad)  # the positions the returned slots hold
            if hi < n:
                short = S
            for j, (name, got) in enumerate((("K", k), ("V", v))):
                g = got[b, :, pad + lo - off : pad + hi - off].float()  # (h, m, Dh)
                w = self._mine(ref[j])[:, lo:hi]  # (h, m, Dh)
                bad = first_bad(g, w, self.rtol, self.atol)
                if bad is not None:
                    p = lo + bad[0]
                    firsts.append((pad + p - off, b, j, name, p, bad, g[bad[1], bad[0]]))
        where = f"{call.label}, layer {layer}"
        reads = f"; attention reads {_slots(read)} where the sequence fills {cols}" if read not in (None, cols) else ""
        if firsts:
            slot, b, j, name, p, (_, h, err, nh), vec = min(firsts, key=lambda f: f[:3])
            row = f", row {b}" if len(call.seqs) > 1 else ""
            pad = call.pads[b]
            at = f"position {p}" + (f", after {pad} pad slots" if pad else "")
            more = f" (+{nh - 1} more)" if nh > 1 else ""
            hint = self._holds(layer, call, b, j, h, p, vec)
            self._stop(
                f"{call.label}{row}, layer {layer}, {self._head(h)}{more}, slot {slot} ({at}): {name} differs from "
                f"the reference by {err:.3g}{hint}{reads}"
            )
        elif short is not None:
            self._stop(f"{where}: the cache returns {_slots(short)} where the sequence fills {cols}")
        elif reads:
            self._stop(f"{where}: K/V equal, but{reads[1:]}")

    def _holds(self, layer: int, call: Call, b: int, j: int, h: int, p: int, vec: torch.Tensor) -> str:
        """'; it holds <what>' when the slot's vector is one the run computed elsewhere (or zeros), else ''."""
        name = "KV"[j]
        seq = call.seqs[b]
        ref = self.ref.of(seq)[layer][j]  # (H, n, Dh)
        gh = h if self.heads is None else self.heads.start + h
        scale = self._mine(ref)[h, : len(seq)].abs().max()
        bound = self.atol + self.rtol * float(scale)

        def near(x: torch.Tensor) -> torch.Tensor:  # (..., Dh) -> (...) bool
            return ((x - vec).abs() <= bound).all(-1)

        if bool((vec.abs() <= bound).all()):
            return "; it holds zeros"
        same = near(ref[gh, : len(seq)]).nonzero()
        if same.numel():
            return f"; it holds position {int(same[0, 0])}'s {name}"
        heads = near(ref[:, p]).nonzero()
        if heads.numel():
            return f"; it holds head {int(heads[0, 0])}'s {name}"
        for r, other in enumerate(call.seqs):
            if r != b and len(other) > p and bool(near(self.ref.of(other)[layer][j][gh, p])):
                return f"; it holds row {r}'s {name}"
        for m, values in self.ref.values.items():
            if len(m) > p and m[: len(seq)] != tuple(seq) and bool(near(values[layer][j][gh, p])):
                whose = self.ref.whose.get(m)
                if whose:
                    return f"; it holds the {name} {whose} has at that position"
                return f"; it holds the {name} another sequence of this run has at that position"
        return ""

    def attn(self, layer: int, y: torch.Tensor, per_head: bool = True) -> None:
        """Layer `layer`'s attention output for this call's queries: (B, T, h, Dh) per head, or (B, T, 1, C) with
        `per_head` False."""
        call = self._call()
        if call is None:
            return
        T = y.size(1)
        firsts = []
        for b, (seq, pad) in enumerate(zip(call.seqs, call.pads, strict=True)):
            want = self.ref.of(seq)[layer][2]
            if want is None:
                return
            q0 = call.cols - T - pad  # the position of query 0 (negative: a pad)
            i0 = max(0, -q0)
            g = y[b, i0:].float().transpose(0, 1)  # (h, m, D)
            w = want[q0 + i0 : q0 + T].transpose(0, 1)  # (H, m, D)
            bad = first_bad(g, self._mine(w) if per_head else w, self.rtol, self.atol)
            if bad is not None:
                firsts.append((q0 + i0 + bad[0], b, bad))
        if firsts:
            p, b, (_, h, err, nh) = min(firsts, key=lambda f: f[:2])
            row = f", row {b}" if len(call.seqs) > 1 else ""
            head = f", {self._head(h)}" + (f" (+{nh - 1} more)" if nh > 1 else "") if per_head else ""
            self._stop(
                f"K/V equal; attention output differs first at layer {layer} ({call.label}{row}{head}, "
                f"query at position {p}) by {err:.3g}"
            )


# --- the runs a group of rows made, replayed -------------------------------------------------------------------------
def generate_calls(prompts: list[list[int]], tokens: list[list[int]], prefix: str = "", whose: str = "") -> list[Call]:
    """The forward calls of a greedy run of `prompts` (left-padded) that chose `tokens`: the prefill, then one call
    per token but the last."""
    T = max(map(len, prompts))
    pads = [T - len(p) for p in prompts]
    return [
        Call(
            f"{prefix}step {j}" + (" (prefill)" if j == 0 else ""),
            [p + t[:j] for p, t in zip(prompts, tokens, strict=True)],
            pads,
            T if j == 0 else 1,
            whose,
        )
        for j in range(len(tokens[0]))
    ]


class _Noted:
    """A subject whose sessions note each forward call as a correct cache holds it afterwards: the tokens written,
    crop, fork and reorder applied to each row's sequence, and the call in words. The calls made before a run
    raised stay noted."""

    def __init__(self, s, check: str) -> None:
        self._s, self.check = s, check
        self.calls: list[Call] = []

    def __getattr__(self, name: str):
        return getattr(self._s, name)

    def open(self, batch: int, max_len: int) -> _NotedSession:
        return _NotedSession(self, self._s.open(batch, max_len), "", [[] for _ in range(batch)])


class _NotedSession:
    def __init__(self, noted: _Noted, inner, whose: str, rows: list[list[int]]) -> None:
        self.noted, self.inner, self.whose, self.rows = noted, inner, whose, rows
        self.op, self.since = "", 0

    def _did(self, op: str) -> None:
        self.op, self.since = op, 0

    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        self.since += 1
        words = f"forward {len(self.noted.calls) + 1} of the {self.noted.check} scenario{self.whose}"
        if self.op:
            words += f", the {_ordinal(self.since)} after {self.op}"
        self.rows = [r + list(t) for r, t in zip(self.rows, ids, strict=True)]
        self.noted.calls.append(Call(words, [list(r) for r in self.rows], [0] * len(ids), len(ids[0])))
        return self.inner.forward(ids)

    def prepare_rollback(self, most: int) -> None:
        self.inner.prepare_rollback(most)

    def crop(self, length: int) -> None:
        self.inner.crop(length)
        self.rows = [r[:length] for r in self.rows]
        self._did(f"crop({length})")

    def fork(self) -> _NotedSession:
        twin = _NotedSession(self.noted, self.inner.fork(), " on the fork", [list(r) for r in self.rows])
        twin._did("fork()")
        self._did("fork()")
        return twin

    def reorder(self, index: list[int]) -> None:
        self.inner.reorder(index)
        self.rows = [list(self.rows[i]) for i in index]
        self._did(f"reorder({list(index)})")


# --- what the replays hook into: our GPT-2, a Hugging Face model -----------------------------------------------------
def _reads(mask) -> int | None:
    """The key slots attention reads this call, from the mask the model built (the fixed-shape step's too)."""
    n = getattr(mask, "n_valid", None)
    if n is not None:
        return int(n)
    allowed = getattr(mask, "allowed", None)  # (B, 1, 1, L)
    if allowed is None:
        return None
    cols = allowed.reshape(-1, allowed.size(-1)).any(0).nonzero()
    return int(cols.max()) + 1 if cols.numel() else 0


class _Tap:
    """Stands in for one layer's cache (or the fixed-shape step's slot writer) for one attention call: updates it
    and passes what it returns to the probe."""

    def __init__(self, cache, layer: int, probe: Probe, read: int | None) -> None:
        self.cache, self.layer, self.probe, self.read = cache, layer, probe, read
        self.visible = getattr(cache, "visible", None)  # the design's own policy: the model's mask asks it

    def update(self, k, v, positions):
        k, v = self.cache.update(k, v, positions)
        self.probe.kv(self.layer, k, v, self.read)
        return k, v

    @property
    def key_positions(self):
        """An evicting design's slot positions (the model masks by them), passed through."""
        return getattr(self.cache, "key_positions", None)


class GPT2Side:
    """Our GPT-2 subject as a replay sees it: the eager subject to rerun, the whole model as reference, the heads
    this process holds."""

    def __init__(self, s) -> None:
        from kvbench.model.tp import place, rank_heads

        self.subject = s
        if s.compile != "off":
            self.subject = copy.copy(s)
            self.subject.compile = "off"
        self.runner, self.whole = s.gpt, s.model.gpt
        at = place(self.runner)
        self.heads = rank_heads(self.whole.config.n_head, at.rank, at.world) if at.heads_split else None
        self.rank = at.rank if at.heads_split else None
        self.head, self.n_layers = self.runner.lm_head, len(self.runner.transformer.h)  # what the run samples from

    @torch.inference_mode()
    def forward(self, seq: list[int]) -> dict:
        gpt, cfg = self.whole, self.whole.config
        H, Dh, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        got: dict[int, list] = {}
        hooks = []
        for i, block in enumerate(gpt.transformer.h):

            def kv(module, args, out, i=i):
                _, k, v = out[0].split(C, dim=-1)  # (n, C) each
                got[i] = [t.view(-1, H, Dh).transpose(0, 1).float() for t in (k, v)]  # (H, n, Dh)

            def y(module, args, i=i):
                got[i].append(args[0][0].view(-1, H, Dh).float())  # (n, H, Dh)

            hooks += [block.attn.c_attn.register_forward_hook(kv), block.attn.c_proj.register_forward_pre_hook(y)]
        try:
            device = gpt.lm_head.weight.device
            ids = torch.tensor([seq], device=device)  # (1, n)
            gpt(ids, torch.arange(len(seq), device=device)[None])
        finally:
            for h in hooks:
                h.remove()
        return {i: tuple(t) for i, t in got.items()}

    @contextmanager
    def taps(self, probe: Probe) -> Iterator[None]:
        hooks = []
        for i, block in enumerate(self.runner.transformer.h):

            def cache(module, args, i=i):
                if i == 0:
                    probe.next_call()
                x, positions, c, mask = args
                return None if c is None else (x, positions, _Tap(c, i, probe, _reads(mask)), mask)

            def y(module, args, i=i):
                B, T, _ = args[0].shape
                probe.attn(i, args[0].view(B, T, -1, self.whole.config.head_dim))  # (B, T, h, Dh)

            hooks += [block.attn.register_forward_pre_hook(cache), block.attn.c_proj.register_forward_pre_hook(y)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


def _attention_modules(model) -> list:
    """transformers' attention modules: they know their layer (`layer_idx`)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and getattr(m, "layer_idx", None) is not None
    ]


class HFSide:
    """A Hugging Face subject as a replay sees it: the eager subject to rerun (generate's compile off), the whole
    model as reference, the key/value heads this process holds."""

    def __init__(self, s) -> None:
        from kvbench.hf.caches import HF_CACHES

        self.subject = s
        if "compile_config" in s.spec.generate_kwargs:  # the same cache, eager
            eager = next(
                n for n, c in HF_CACHES.items() if c.build is s.spec.build and "compile_config" not in c.generate_kwargs
            )
            self.subject = copy.copy(s)
            self.subject.cache, self.subject.spec = eager, HF_CACHES[eager]
        self.runner, self.whole = s.loaded.model, s.model.loaded
        self.head, self.n_layers = self.runner.get_output_embeddings(), len(_attention_modules(self.runner))
        self.heads = self.rank = None
        if s.loaded is not s.model.loaded:  # a tensor-parallel rank's shard
            import torch.distributed as dist

            from kvbench.model.tp import rank_heads

            self.rank = dist.get_rank()
            self.heads = rank_heads(self.whole.info.n_kv_heads, self.rank, dist.get_world_size())

    @torch.no_grad()
    def forward(self, seq: list[int]) -> dict:
        from transformers import DynamicCache

        from kvbench.check.hf_subject import forward_inputs
        from kvbench.hf.caches import text_config
        from kvbench.hf.introspect import cache_kwarg

        model = self.whole.model
        kv: dict[int, tuple] = {}
        ys: dict[int, torch.Tensor] = {}

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            kv[layer_idx] = (key_states[0].float(), value_states[0].float())  # (H, n, Dh)
            return key_states, value_states  # the whole sequence's, as the no-cache forward attends

        cache = DynamicCache(config=text_config(model))
        cache.update = update  # type: ignore[method-assign]  # this object records the forward's K/V, caches nothing

        def y(module, args, out):
            ys[module.layer_idx] = (out[0] if isinstance(out, tuple) else out)[0, :, None].float()  # (n, 1, C)

        hooks = [m.register_forward_hook(y) for m in _attention_modules(model)]
        try:
            ids = torch.tensor([seq], device=next(model.parameters()).device)  # (1, n)
            model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                use_cache=True,
                **{cache_kwarg(): cache},
                **forward_inputs(model, ids),
            )
        finally:
            for h in hooks:
                h.remove()
        return {i: (k, v, ys.get(i)) for i, (k, v) in kv.items()}

    @contextmanager
    def taps(self, probe: Probe) -> Iterator[None]:
        from transformers.cache_utils import Cache

        real = Cache.__dict__["update"]
        last = [None]

        def update(cache, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = real(cache, key_states, value_states, layer_idx, *args, **kwargs)
            if last[0] is None or layer_idx <= last[0]:
                probe.next_call()
            last[0] = layer_idx
            layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
            probe.kv(layer_idx, k, v, windowed=bool(getattr(layer, "is_sliding", False)))
            return k, v

        def y(module, args, out):
            t = out[0] if isinstance(out, tuple) else out  # (B, T, C)
            probe.attn(module.layer_idx, t[:, :, None], per_head=False)

        # a shard's attention output is its heads' share before the all-reduce: compared on one process only
        hooks = [] if self.heads is not None else [m.register_forward_hook(y) for m in _attention_modules(self.runner)]
        try:
            with patch.object(Cache, "update", update):  # every cache class's update goes through it meanwhile
                yield
        finally:
            for h in hooks:
                h.remove()


def _side(s) -> GPT2Side | HFSide | None:
    from kvbench.check.gpt2_subject import GPT2Subject
    from kvbench.check.hf_subject import HFSubject

    if isinstance(s, GPT2Subject):
        return GPT2Side(s)
    if isinstance(s, HFSubject):
        return HFSide(s)
    return None


# --- locating ----------------------------------------------------------------------------------------------------
def _kv_tolerance(s) -> tuple[float, float]:
    """(rtol, atol) for K/V and attention outputs: the row's own; a lossy path's rtol with the dtype's atol."""
    if not s.tol.lossy:
        return s.tol.rtol, s.tol.atol
    return s.tol.rtol, TOLERANCES[s.model.dtype][1]


def _replay(s, side, calls: Sequence[Call | None], run: Callable[[], object]) -> str | None:
    """`run` again with recording on, held to the reference over `calls`' sequences: the first difference, None
    when every compared call matches, or "" when the run raised before showing one (nothing can be said)."""
    ref = Reference(calls, side.forward)
    rtol, atol = _kv_tolerance(s)
    probe = Probe(calls, ref, rtol, atol, side.heads, side.rank, stop=side.rank is None)
    try:
        with side.taps(probe):
            run()
    except _Found:
        pass
    except s.crashes:  # the run raised where the row's did: what it showed before that stands
        return probe.found or probe.raised(side.n_layers)
    return probe.found


def _chosen(s, side, rows: int, run: Callable[[], Run], skip: int = 0) -> list[list[int]]:
    """The tokens a greedy run chose, per row (its first `skip` forward calls another run's). Where it raises, the
    tokens its calls chose before that (each call's last logits' argmax) and a stand-in for the call that raised:
    the replay's calls reach the one that raised, whose sequence the tokens before it give."""
    picked: list[list[int]] = []
    hook = side.head.register_forward_hook(lambda m, a, out: picked.append(out[:, -1].argmax(-1).tolist()))
    try:
        return run().tokens
    except s.crashes:
        return [[p[b] for p in picked[skip:]] + [0] for b in range(rows)]
    finally:
        hook.remove()


def _where(s, side, check: str, prompts: list[list[int]], new: int, short: int) -> str | None:
    """The first difference of the run `check` made, None when there is none, "" when a run raised first."""
    e = side.subject
    if check in SINGLE:
        tokens = _chosen(s, side, 1, partial(e.generate, [prompts[0]], new))
        return _replay(s, side, generate_calls([prompts[0]], tokens), partial(e.generate, [prompts[0]], new))
    if check == "batched":
        runs = [(prompts, "")] + [([p], f"the prompt of {len(p)} tokens alone, ") for p in prompts]
        for batch, prefix in runs:
            tokens = _chosen(s, side, len(batch), partial(e.generate, batch, short))
            found = _replay(s, side, generate_calls(batch, tokens, prefix), partial(e.generate, batch, short))
            if found is not None:
                return found
        return None
    if check == "cache_state":  # the first prompt's run on the fresh cache is the single-prompt run's, shorter
        before = _chosen(s, side, 1, partial(e.generate, [prompts[0]], short))
        reused = partial(e.reused, prompts[0], prompts[1], short)
        tokens = _chosen(s, side, 1, lambda: reused()[0], skip=len(before[0]))
        calls = generate_calls([prompts[0]], before, "the first prompt, ", "the first prompt")
        calls += generate_calls([prompts[1]], tokens, "on the reused cache, ")
        return _replay(s, side, calls, reused)
    if check in LIFECYCLE:
        noted = _Noted(e, check)
        try:
            SCENARIOS[check](noted, prompts, short)
        except s.crashes:  # the calls before it and the one that raised are noted: replayed up to there
            pass
        return _replay(s, side, noted.calls, lambda: SCENARIOS[check](_Noted(e, check), prompts, short))
    return None


def locate(s, rows: list[CheckRow], prompts: list[list[int]], new: int, short: int) -> None:
    """Each failing row of one group (rows that share a run) gets the location of that run's first difference."""
    failing = [r for r in rows if not r.passed and not r.skipped and not r.location]  # a row located already stays
    side = _side(s) if failing and s.cached else None
    if side is None:
        return
    crashes = s.crashes
    if getattr(s, "together", False) and all(r.detail.endswith(EVERY_RANK) for r in failing):
        # the run raised on every rank at the same call (suite._guarded): each rank's replay raises there too, so
        # every rank catches it as one process does, and their collectives stay paired
        s.crashes = (Exception,)
    try:
        found = _where(s, side, failing[0].name, prompts, new, short)
    except s.crashes:  # raised outside the runs a replay follows (the reference forward): nothing to say
        return
    finally:
        s.crashes = crashes
    if found == "":
        return
    eager = side.subject is not s
    if found is None:
        run = f"forward of the {failing[0].name} scenario" if failing[0].name in LIFECYCLE else "step"
        found = f"K/V and attention outputs equal the reference at every {run} and layer" + (
            f": the difference comes from compilation ({compiled(s)})" if eager else ""
        )
    elif eager:
        found += " (replayed without compilation)"
    for r in failing:
        r.location = found


# --- compiled runs -----------------------------------------------------------------------------------------------
def compiled(s) -> str | None:
    """How a subject's runs are compiled, in words, or None when they run eagerly."""
    from kvbench.caches import get_cache_spec
    from kvbench.check.gpt2_subject import GPT2Subject
    from kvbench.check.hf_subject import HFSubject

    if isinstance(s, GPT2Subject) and s.compile != "off" and s.cached and get_cache_spec(s.cache).fixed_step:
        return f"--compile {s.compile}"
    if isinstance(s, HFSubject) and "compile_config" in s.spec.generate_kwargs:
        return "generate's torch.compile"
    return None


@dataclass
class Compilations:
    """What torch.compile did during some runs: frames compiled, how many of them recompiled a frame compiled
    before, and graph breaks."""

    compiles: int = 0
    recompiles: int = 0
    graph_breaks: int = 0

    def words(self, how: str) -> str:
        return (
            f"compiled ({how}): {self.compiles} compilation(s), {self.recompiles} recompile(s), "
            f"{self.graph_breaks} graph break(s) in this check's runs"
        )


@contextmanager
def counting() -> Iterator[Compilations]:
    """Counts compilations, recompiles (a frame's second or later compilation: dynamo's compile id frame/attempt
    with attempt > 0) and graph breaks (torch._dynamo's counters) while the block runs."""
    from torch._dynamo.callback import callback_handler
    from torch._dynamo.utils import counters

    counts, ids = Compilations(), []

    def started(args) -> None:
        ids.append(str(args.compile_id))

    breaks = sum(counters["graph_break"].values())
    callback_handler.register_start_callback(started)
    try:
        yield counts
    finally:
        callback_handler.remove_start_callback(started)
        attempts = [re.search(r"(\d+)/(\d+)", i) for i in ids]
        counts.compiles = len(ids)
        counts.recompiles = sum(1 for m in attempts if m and int(m.group(2)) > 0)
        counts.graph_breaks = sum(counters["graph_break"].values()) - breaks


def located(s, run: Callable[[], list[CheckRow]], prompts: list[list[int]], new: int, short: int) -> list[CheckRow]:
    """The rows `run` gives for one group of checks that share a run, each failing one located; a compiled subject's
    rows (failing or not) also say what compilation did during the run."""
    how = compiled(s)
    if how is None:
        rows = run()
    else:
        with counting() as counts:
            rows = run()
        for r in rows:
            if not r.skipped:
                r.detail += f"; {counts.words(how)}"
    locate(s, rows, prompts, new, short)
    return rows
