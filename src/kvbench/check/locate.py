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

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvbench.check.judge import TOLERANCES, CheckRow
from kvbench.check.lifecycle import LIFECYCLE, SCENARIOS
from kvbench.check.probe import Call, Found, Probe, Reference, ordinal
from kvbench.check.subject import Replay, Run, Session, Subject

SINGLE = ("logits", "greedy", "reference")  # the checks that share the single-prompt run
EVERY_RANK = " (on every rank)"  # ends the detail of a row whose run raised on every tensor-parallel rank (suite.py)


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

    def __init__(self, s: Subject, check: str) -> None:
        self._s, self.check = s, check
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    def open(self, batch: int, max_len: int) -> _NotedSession:
        return _NotedSession(self, self._s.open(batch, max_len), "", [[] for _ in range(batch)])


class _NotedSession:
    def __init__(self, noted: _Noted, inner: Session, whose: str, rows: list[list[int]]) -> None:
        self.noted, self.inner, self.whose, self.rows = noted, inner, whose, rows
        self.op, self.since = "", 0

    def _did(self, op: str) -> None:
        self.op, self.since = op, 0

    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        self.since += 1
        words = f"forward {len(self.noted.calls) + 1} of the {self.noted.check} scenario{self.whose}"
        if self.op:
            words += f", the {ordinal(self.since)} after {self.op}"
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


# --- locating ----------------------------------------------------------------------------------------------------
def _kv_tolerance(s: Subject) -> tuple[float, float]:
    """(rtol, atol) for K/V and attention outputs: the row's own; a lossy path's rtol with the dtype's atol."""
    if not s.tol.lossy:
        return s.tol.rtol, s.tol.atol
    return s.tol.rtol, TOLERANCES[s.model.dtype][1]


def _replay(s: Subject, side: Replay, calls: Sequence[Call | None], run: Callable[[], object]) -> str | None:
    """`run` again with recording on, held to the reference over `calls`' sequences: the first difference, None
    when every compared call matches, or "" when the run raised before showing one (nothing can be said)."""
    ref = Reference(calls, side.forward)
    rtol, atol = _kv_tolerance(s)
    probe = Probe(calls, ref, rtol, atol, side.heads, side.rank, stop=side.rank is None)
    try:
        with side.taps(probe):
            run()
    except Found:
        pass
    except s.crashes:  # the run raised where the row's did: what it showed before that stands
        return probe.found or probe.raised(side.n_layers)
    return probe.found


def _chosen(s: Subject, side: Replay, rows: int, run: Callable[[], Run], skip: int = 0) -> list[list[int]]:
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


def _where(s: Subject, side: Replay, check: str, prompts: list[list[int]], new: int, short: int) -> str | None:
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


def locate(s: Subject, rows: list[CheckRow], prompts: list[list[int]], new: int, short: int) -> None:
    """Each failing row of one group (rows that share a run) gets the location of that run's first difference."""
    failing = [r for r in rows if not r.passed and not r.skipped and not r.location]  # a row located already stays
    side: Replay | None = s.replay() if failing and s.cached and hasattr(s, "replay") else None
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
def compiled(s: Subject) -> str | None:
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

    def started(args: Any) -> None:
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


def located(
    s: Subject, run: Callable[[], list[CheckRow]], prompts: list[list[int]], new: int, short: int
) -> list[CheckRow]:
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
