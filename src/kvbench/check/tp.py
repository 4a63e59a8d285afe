"""`kvbench verify --tp N`: every check of the suite on each rank's shard, held to the whole model in one process.

Each rank builds the same model (same weights), keeps it whole as the model under test (its no-cache forward is the
reference every check compares with) and runs its cached checks through its own shard (model/tp.py for our GPT-2,
transformers' TP plan for --hf), so the suite's rows mean what they mean on one device, at the tensor-parallel
tolerance (check/judge.py). One check exists only here:

    rank_cache   the K and V each rank's cache holds, layer by layer, against its slice of the heads of the same
                 cache design filled by the whole model over the same tokens (prefill, then one decode step per
                 token): a head stored on the wrong rank fails here even where the tokens agree. A Hugging Face
                 layer whose attention transformers' plan keeps whole on every rank (a plan that splits only the
                 MLP or the experts, or gathers a split projection's output) holds every head: all of them compared

Rank 0 gathers every rank's rows and merges them: a row passes when it passes on every rank, and the detail of a
rank that failed says which rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbench.check.judge import CheckRow, tolerance
from kvbench.check.rank_slices import (
    HeldLayer,
    Recording,
    compare_slices,
    compare_steps,
    filled,
    held_heads,
    plain_layer,
)
from kvbench.check.suite import RANK_CACHE

if TYPE_CHECKING:
    import torch

    from kvbench.check.gpt2_subject import GPT2Model, GPT2Subject, Injection
    from kvbench.check.hf_subject import HFSubject
    from kvbench.distributed import Rank
    from kvbench.hf.models import LoadedHF
    from kvbench.model.gpt2 import GPTConfig


def merge(per_rank: list[list[CheckRow]]) -> list[CheckRow]:
    """The ranks' rows as one report: row i of every rank is the same check on the same cache."""
    merged = []
    for rows in zip(*per_rank, strict=True):
        first = rows[0]
        failed = sorted(((r, row) for r, row in enumerate(rows) if not row.passed), key=lambda x: _earliest(x[1]))
        diffs = [row.max_abs_diff for row in rows if row.max_abs_diff is not None]
        steps = [row.first_divergence for row in rows if row.first_divergence is not None]
        detail = first.detail
        if failed and failed[0][0] != 0:
            detail = "; ".join(f"rank {r}: {row.detail}" for r, row in failed)
        elif len(failed) > 1:
            detail = failed[0][1].detail + "".join(f"; rank {r}: {row.detail}" for r, row in failed[1:])
        located = list(dict.fromkeys((r, row.location) for r, row in failed if row.location))
        where = "; ".join(f"rank {r}: {loc}" for r, loc in located)
        if len({loc for _, loc in located}) == 1:  # every failing rank located it alike
            where = located[0][1]
        merged.append(
            CheckRow(
                name=first.name,
                cache=first.cache,
                passed=not failed,
                max_abs_diff=max(diffs) if diffs else None,
                first_divergence=min(steps) if steps else None,
                tolerance=failed[0][1].tolerance if failed else first.tolerance,
                detail=detail,
                skipped=all(row.skipped for row in rows),
                location=where,
            )
        )
    return merged


def _earliest(row: CheckRow) -> tuple[int, int]:
    """(step, layer) of where a failing row went wrong, read from its location or detail: a rank's own fault comes
    before what the all-reduce carried from it into the other ranks' later layers and steps."""
    import re

    text = row.location or row.detail
    step = re.search(r"(?:forward|step) (\d+)", text)
    layer = re.search(r"layer (\d+)", text)
    big = 1 << 30
    prefill = "the prefill" in text
    return (0 if prefill else int(step.group(1)) if step else big, int(layer.group(1)) if layer else big)


# Under tensor parallelism a run that raises on one rank cannot become a failed row: the other ranks would go on to
# the next collective while it does not, and pair with the wrong one. So nothing is caught: the exception ends this
# rank (its one line names it, kvbench.launcher) and the others lose their peer within the collective timeout.
IN_STEP: tuple[type[BaseException], ...] = ()

# A lossy design's stored values may land one quantisation step apart where the shard's rounding puts a value on the
# other side of a rounding boundary (int8: 1/127 of the head's scale per token); an exact design's may not.
LOSSY_SLICE_RTOL = 1e-2


def planned_rank_bytes(cfg: GPTConfig, cache: str, tokens: int, tp: int, dtype: torch.dtype) -> int:
    """What the planner (kvbench.memory) predicts one rank's cache of `cache` holds for one sequence of `tokens`
    tokens split over `tp` ranks: the format the design stores (caches/planned.planner_format), the heads
    formulas.kv_heads_per_gpu gives a rank."""
    from kvbench.caches import get_cache_spec
    from kvbench.caches.planned import planner_format, spec_from_gpt_config
    from kvbench.devices import dtype_name
    from kvbench.memory.formulas import bytes_per_sequence, kv_heads_per_gpu
    from kvbench.memory.spec import get_kv_format

    spec = spec_from_gpt_config(cfg)
    fmt = planner_format(get_cache_spec(cache), get_kv_format(dtype_name(dtype)))
    return bytes_per_sequence(spec, fmt, tokens, kv_heads_per_gpu(spec, tp))


@dataclass
class RankBytes:
    """One rank's cache of one design after the rank_cache run, beside the planner's figure for it."""

    rank: int
    cache: str
    tokens: int  # tokens the cache holds (its slots, for a preallocated one)
    measured_bytes: int  # nbytes of every layer's cache on this rank
    planned_bytes: int  # planned_rank_bytes for those tokens

    @property
    def equal(self) -> bool:
        return self.measured_bytes == self.planned_bytes


def gpt2_rank_cache(s: GPT2Subject, prompt: list[int], new: int, tp: Rank) -> tuple[CheckRow, RankBytes]:
    """`rank_cache` for our GPT-2 (a GPT2Subject running through this rank's shard): the greedy tokens of this
    cache, teacher-forced through the shard's caches and through the whole model's, and what every layer's update
    returned, at every step, held three ways:

    - to what this rank's cache was given: the K and V each update received, replayed into a plain cache with the
      design's declared roundtrip applied (check/policy.py PolicyCache), equal to what the design returned over the
      tokens it holds (an evicting design's slots by their positions), at the dtype's tolerance: a cache that changes
      what it stores (or stores it otherwise than its policy says) fails here whatever the other ranks do;
    - to the same design on the whole model, its slice of the heads, every slot attention was given (a stale slot
      past the length, or one too many, shows): an exact design at the dtype's tolerance, a lossy one within one
      quantisation step (LOSSY_SLICE_RTOL of the head's scale: the shard's rounding may put a value across a
      boundary), never its logit bound;
    - the design on the whole model in this rank's process against the previous rank's (_same_in_every_process).

    And the bytes this rank's cache holds, beside the planner's figure."""
    from kvbench.caches import get_cache_spec
    from kvbench.check.gpt2_subject import fresh_caches
    from kvbench.model.gpt2 import EXACT_MASK
    from kvbench.model.tp import rank_heads

    spec = get_cache_spec(s.cache)
    tokens = s.generate([prompt], new).tokens[0]
    seq = prompt + tokens[:-1]
    mask = s.fault.rules.mask if s.fault is not None else EXACT_MASK
    got = filled(s.gpt, lambda n: fresh_caches(s.gpt, s.cache, 1, n, s.fault), seq, len(prompt), mask)
    whole = s.model.gpt
    want = filled(whole, lambda n: fresh_caches(whole, s.cache, 1, n), seq, len(prompt), EXACT_MASK)
    heads = rank_heads(whole.config.n_head, tp.rank, tp.world)
    exact = tolerance(whole.lm_head.weight.dtype, tp=tp.world)  # the dtype's, whatever the design's logit bound
    row = _held_as_given(s.cache, got, spec.roundtrip, exact.rtol, exact.atol, tp.rank)
    if row.passed:
        rtol = exact.rtol if s.exact else LOSSY_SLICE_RTOL
        row = compare_steps(s.cache, got, want, heads, rtol, exact.atol, tp.rank, every_slot=True)
    cross = _same_in_every_process(s.cache, want, whole.config.n_head, exact.rtol, exact.atol, tp)  # every rank
    row = cross if row.passed and not cross.passed else row
    held = got[0].capacity or len(seq)
    dtype = whole.lm_head.weight.dtype
    planned = planned_rank_bytes(whole.config, s.cache, held, tp.world, dtype)
    return row, RankBytes(tp.rank, s.cache, held, sum(c.nbytes for c in got), planned)


def _held_as_given(
    cache: str,
    got: list[Recording],
    roundtrip: Callable[[torch.Tensor], torch.Tensor] | None,
    rtol: float,
    atol: float,
    rank: int,
) -> CheckRow:
    """What each layer's update returned against what it was given: the same inputs replayed into a PolicyCache
    (every token kept, in order, through the design's roundtrip), compared over the tokens the design holds; an
    evicting design's slots are matched by the positions it says they hold (`key_positions`)."""
    from kvbench.check.policy import PolicyCache

    replayed = []
    for layer in got:
        ref, steps = PolicyCache(roundtrip), []  # type: ignore[var-annotated]
        for (k, v, positions), (_, _, n) in zip(layer.given, layer.steps, strict=True):
            rk, rv = ref.update(k, v, positions)  # (B, h, every token so far, Dh)
            where = layer.slot_positions[len(steps)]
            if where is not None:  # an evicting design: its slots hold these positions
                rk, rv = rk[:, :, where], rv[:, :, where]
            steps.append((rk, rv, n))
        replayed.append(Recording.replayed(steps))
    return compare_steps(
        cache,
        got,
        replayed,
        range(got[0].steps[0][0].size(1)),
        rtol,
        atol,
        rank,
        against="what it was given (each update's K and V"
        + (", the design's roundtrip applied)" if roundtrip else ")"),
    )


def _same_in_every_process(
    cache: str, want: list[Recording], n_head: int, rtol: float, atol: float, tp: Rank
) -> CheckRow:
    """The design on the whole model, this rank's process against the previous rank's, every slot at every step:
    both run the same design over the same tokens, so they hold the same. A design that depends on the process it
    runs in (a plugin that keys off the rank) corrupts this process's shard and its one-process reference alike, and
    shows only here. Every rank takes part (a collective)."""
    import torch.distributed as dist

    steps = [[(k.cpu(), v.cpu(), n) for k, v, n in r.steps] for r in want]
    every: list = [None] * tp.world
    dist.all_gather_object(every, steps)
    prev = (tp.rank - 1) % tp.world
    theirs = [Recording.replayed(layer) for layer in every[prev]]
    return compare_steps(
        cache,
        want,
        theirs,
        range(n_head),
        rtol,
        atol,
        tp.rank,
        every_slot=True,
        mine=f"the design on the whole model in rank {tp.rank}'s process",
        against=f"in rank {prev}'s (the same tokens: it depends on the process it runs in)",
    )


def planned_hf_rank_bytes(
    loaded: LoadedHF, tokens: int, tp: int, dtype: torch.dtype, between_steps: bool = False
) -> int | None:
    """The planner's bytes for one rank's cache of a Hugging Face model (its config.json resolved as `memory
    --model DIR` resolves it) holding `tokens` tokens, under transformers' tensor-parallel rule (tp = 1: a rank
    that holds every head); None when the source is not a local directory, or when the planner cannot size the
    model (`memory --model DIR` says why: its refusal is not the checks' verdict).

    The planner holds a windowed layer at its window W, what a step reads and what a static cache allocates.
    `between_steps`: the bytes transformers' dynamic cache keeps between two forwards instead, where a windowed
    layer (DynamicSlidingWindowLayer) keeps the last W - 1 tokens (each forward's new token joins them: W again)."""
    from dataclasses import replace
    from pathlib import Path

    from kvbench.devices import dtype_name
    from kvbench.errors import KVBenchError
    from kvbench.memory.config import resolve_local
    from kvbench.memory.formulas import bytes_per_sequence, kv_heads_per_gpu
    from kvbench.memory.spec import get_kv_format

    if not Path(loaded.source).expanduser().is_dir():
        return None
    try:
        spec = resolve_local(loaded.source).spec
        heads = kv_heads_per_gpu(spec, tp, "transformers")
    except KVBenchError:
        return None
    if between_steps and spec.sliding_window is not None and spec.sliding_layers:
        if spec.sliding_window == 1:  # nothing kept between steps; the planner holds no window of 0
            return None
        spec = replace(spec, sliding_window=spec.sliding_window - 1)
    return bytes_per_sequence(spec, get_kv_format(dtype_name(dtype)), tokens, heads)


def hf_rank_cache(s: HFSubject, prompt: list[int], new: int, tp: Rank) -> tuple[CheckRow, RankBytes | None]:
    """`rank_cache` for a Hugging Face model (an HFSubject running through this rank's shard): the cache `generate`
    returns on this rank against the one the whole model's `generate` returns for the same prompt and cache; and
    the bytes this rank's cache holds beside the planner's figure (a dynamic cache: it holds exactly its tokens)."""
    from kvbench.check.hf_subject import generate_run
    from kvbench.check.judge import skipped
    from kvbench.hf.caches import generate_kwargs

    kw = generate_kwargs(s.cache)
    got, want = generate_run(s.loaded, [prompt], new, **kw), generate_run(s.model.loaded, [prompt], new, **kw)
    if got.tokens != want.tokens:
        return skipped(
            s.cache,
            "the shard's greedy tokens differ from the whole model's (see greedy): their caches "
            "hold different sequences",
            RANK_CACHE,
        ), None
    layers = [list(getattr(r.cache, "layers", None) or []) for r in (got, want)]
    plain = all(plain_layer(x) for x in layers[0] + layers[1])
    if not layers[0] or not plain:
        kinds = sorted({type(x).__name__ for x in layers[0]}) or [type(got.cache).__name__]
        why = f"{', '.join(kinds)} holds no plain keys and values per layer to compare"
        return skipped(s.cache, why, RANK_CACHE), None
    # K/V at the dtype's tolerance, a lossy cache's within one quantisation step: never its logit bound
    rtol = tolerance(s.model.dtype, tp=tp.world).rtol if not s.tol.lossy else LOSSY_SLICE_RTOL
    mine, whole = [HeldLayer(x) for x in layers[0]], [HeldLayer(x) for x in layers[1]]
    heads = held_heads(mine, whole, tp.rank, tp.world)
    bound = f"rtol {rtol:g}, atol 1e-5"
    if isinstance(heads, str):
        return CheckRow(name=RANK_CACHE, cache=s.cache, passed=False, tolerance=bound, detail=heads), None
    row = compare_slices(s.cache, mine, whole, heads, rtol, 1e-5, tp.rank)
    every = [len(h) == w.k.size(1) for h, w in zip(heads, whole, strict=True)]
    if s.cache != "dynamic" or len(set(every)) > 1:  # the planner holds one rule for every layer
        return row, None
    held = len(prompt) + new - 1  # generate never writes its last token
    dtype = s.model.dtype
    planned = planned_hf_rank_bytes(s.model.loaded, held, 1 if every[0] else tp.world, dtype, between_steps=True)
    measured = sum(h.k.nbytes + h.v.nbytes for h in mine)
    return row, None if planned is None else RankBytes(tp.rank, s.cache, held, measured, planned)


def tp_rows(
    target: GPT2Model,
    caches: list[str],
    prompts: list[list[int]],
    new_tokens: int,
    checks: tuple[str, ...],
    short_tokens: int,
    on_row: Callable[[CheckRow], None] | None,
    fault: Injection | None,
    compile: str,
    tp: Rank,
) -> tuple[list[CheckRow], list[RankBytes]]:
    """Every check of the suite, and rank_cache, for each cache on this rank's shard of `target`'s model; rank 0
    returns every rank's rows merged, the other ranks their own."""
    from kvbench.check.gpt2_subject import GPT2Subject
    from kvbench.check.suite import run_checks
    from kvbench.distributed import barrier
    from kvbench.model.tp import shard

    barrier()  # the ranks start the checks together
    report = on_row if tp.rank == 0 else None
    runner = shard(target.gpt, tp.rank, tp.world)
    subjects = [GPT2Subject(target, c, fault, compile, runner=runner, tp=tp.world) for c in caches]
    for s in subjects:
        s.crashes = IN_STEP
    rows = run_checks(subjects, prompts, new_tokens, checks, short_tokens, report)
    held: list[RankBytes] = []
    for s in subjects:
        if s.cached:
            row, nbytes = gpt2_rank_cache(s, prompts[0], new_tokens, tp)
            rows.append(row)
            held.append(nbytes)
            if report is not None:
                report(row)
    return gathered(rows, held)


def hf_tp_rows(
    subjects: list[HFSubject],
    rows: list[CheckRow],
    prompt: list[int],
    new: int,
    tp: Rank,
    on_row: Callable[[CheckRow], None] | None,
) -> tuple[list[CheckRow], list[RankBytes]]:
    """A Hugging Face model's rows on this rank with rank_cache for each cache that ran, then gathered: rank 0
    returns every rank's rows merged and every rank's cache bytes, the other ranks their own."""
    from kvbench.check.suite import _guarded

    ran = {r.cache for r in rows if not r.skipped}
    held: list[RankBytes] = []
    for s in subjects:
        if s.cached and s.cache in ran:
            measured: list[RankBytes | None] = [None]

            def rank_cache(s: HFSubject = s, measured: list[RankBytes | None] = measured) -> list[CheckRow]:
                row, measured[0] = hf_rank_cache(s, prompt, new, tp)
                return [row]

            (row,) = _guarded(s, [RANK_CACHE], rank_cache)  # raised on every rank: a failed row, as the checks'
            rows.append(row)
            held += [b for b in measured if b is not None]
            if on_row is not None:
                on_row(row)
    return gathered(rows, held)


def gathered(rows: list[CheckRow], held: list[RankBytes]) -> tuple[list[CheckRow], list[RankBytes]]:
    """Every rank's rows and cache bytes on rank 0: the rows merged (merge), the bytes in rank order; the other
    ranks keep their own."""
    from kvbench.distributed import gather

    per_rank = gather((rows, held))
    if per_rank is None:
        return rows, held
    return merge([r for r, _ in per_rank]), [b for _, bs in per_rank for b in bs]


def rank_bytes_notes(held: list[RankBytes]) -> list[str]:
    """One line per design: each rank's cache bytes and the planner's figure for a rank; where they differ, the
    design's own layout, which the planner's generic format does not model, says why (its `memory_note`)."""
    from kvbench.caches import get_cache_spec

    lines = []
    for cache in dict.fromkeys(b.cache for b in held):
        mine = [b for b in held if b.cache == cache]
        got = ", ".join(f"rank {b.rank} {b.measured_bytes:,} B" for b in mine)
        planned = mine[0].planned_bytes
        if all(b.equal for b in mine):
            verdict = f"equal to the byte (planner: {planned:,} B)"
        else:
            note = get_cache_spec(cache).memory_note  # only a design of ours differs (an HF row: dynamic)
            why = f": {note}" if note else ""
            verdict = f"planner: {planned:,} B ({mine[0].measured_bytes - planned:+,} B on rank {mine[0].rank}{why})"
        lines.append(f"{cache} cache per rank at {mine[0].tokens} tokens: {got}; {verdict}")
    return lines
