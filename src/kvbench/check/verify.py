"""The exactness checks behind `kvbench verify`: cached decoding equals full recomputation, for every cache.

Five checks, each returning one `CheckRow` per cache:
    logits       one cached decode step against a full forward over the same prefix (the seed's cell 5a)
    greedy       N greedy tokens through the cache against the no-cache path (the seed's cell 5b)
    reference    prefill and decode logits against Hugging Face's GPT2LMHeadModel holding the same weights
    batched      prompts of different lengths, left-padded and decoded together, against each prompt alone
    cache_state  a cache reset and reused for a new prompt against a fresh cache

The no-cache path as one forward. The `none` loop runs N forwards over prefixes of length T, T+1, ...; causal
attention makes row T-1+i of ONE forward over prompt + generated tokens exactly what that loop computes at step i
(position j never reads a later token). So greedy compares the cached tokens with the argmax of those rows: if every
row's argmax is the cached token, the `none` loop produces the same N tokens; the first row where it is not is the
first divergent step. The same rows give the per-step logit error. (tests/test_verify.py checks this against the
real `none` loop.) The no-cache path itself is held to Hugging Face by the `reference` row of cache `none`.

Tolerances (`TOLERANCES`): exact caches in fp32 must match to rtol = atol = 1e-5 (rtol relative to the row's
largest logit, see `_allclose_err`) and produce identical tokens. In
fp16/bf16 the two paths round differently, so a token may flip at a near-tie: a mismatch whose top-2 logit gap at
the divergent step is within twice the logit error there (each of the two logits may move by the error) is reported
as a near-tie and passes, with the reason in the row. A lossy cache (`CacheSpec.exact` False) is held to its own
documented `logit_atol`, `logit_rtol` and `min_greedy_agreement`, and the row says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvbench.caches import get_cache_spec, make_caches
from kvbench.decode.generate import DecodeRules, GenerationResult, generate
from kvbench.errors import KVBenchError, one_line
from kvbench.model.gpt2 import GPT

CHECKS = ("logits", "greedy", "reference", "batched", "cache_state")
# (rtol, atol) for cached vs recomputed logits with an exact cache, by dtype. fp32 is the seed's 1e-5; the low
# precisions allow their rounding (bf16 keeps 8 mantissa bits, fp16 11).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}
# Against Hugging Face: a different implementation (eager matmul + softmax attention, fp32) on the same weights.
# In fp32 only summation order differs, so the seed's 1e-5 holds (measured on gpt2, random std 0.05: 1.05e-5 on
# logits of magnitude ~6); our low-precision logits also carry their own rounding.
REFERENCE_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-2, 5e-2),
    torch.bfloat16: (5e-2, 2e-1),
}
SHORT_TOKENS = 16  # new tokens in the batched and cache_state checks (each runs several generations)


@dataclass
class CheckRow:
    name: str  # one of CHECKS
    cache: str  # registry name of the cache checked
    passed: bool
    max_abs_diff: float | None  # largest |logit difference| compared (None when no logits were compared)
    first_divergence: int | None = None  # first generated step whose token differs (0 = the prefill's token)
    tolerance: str = ""  # the criterion applied, in words
    detail: str = ""  # what was compared, and why it passed or failed
    skipped: bool = False  # not run here (the detail says why); never fails the report


@dataclass
class VerifyReport:
    passed: bool
    checks: list[CheckRow]
    dtype: str
    new_tokens: int
    prompt_len: int
    batch_lens: list[int]
    reference: str  # what the reference was, or "none"
    notes: list[str] = field(default_factory=list)


class Injection(Protocol):
    """What a check runs with in place of the correct code (faults.Fault): the loop's rules, and optionally a layer
    cache factory (config, batch, max_len, dtype, device) in place of the design's own."""

    rules: DecodeRules
    layer_cache: Callable | None


# --- prompts and runs ---------------------------------------------------------------------------------------------
def random_prompts(vocab_size: int, prompt_len: int, batch: int, seed: int) -> list[list[int]]:
    """`batch` seeded random prompts of distinct lengths prompt_len, ..., about prompt_len / batch (first is the
    longest: it doubles as the single-prompt checks' prompt)."""
    if batch < 2:
        raise KVBenchError(
            f"--batch must be >= 2 for the batched check (a batch of one has no padding), got {batch}"
        )
    if prompt_len < batch:
        raise KVBenchError(
            f"--prompt-len {prompt_len} is too short for {batch} distinct prompt lengths; use --prompt-len >= {batch}"
        )
    g = torch.Generator().manual_seed(seed)
    lens = [-(-prompt_len * (batch - i) // batch) for i in range(batch)]  # ceil: distinct, longest first
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lens]


def fresh_caches(
    model: GPT, cache: str, batch: int, max_len: int, fault: Injection | None = None
) -> list | None:
    """The caches a check runs on: the design's own, or the injected fault's layer cache (`kvbench break`)."""
    if fault is not None and fault.layer_cache is not None:
        cfg, w = model.config, model.lm_head.weight
        return [fault.layer_cache(cfg, batch, max_len, w.dtype, w.device) for _ in range(cfg.n_layer)]
    return make_caches(
        cache, model.config, batch, max_len, model.lm_head.weight.dtype, model.lm_head.weight.device
    )


def run(
    model: GPT,
    prompts: list[list[int]],
    new: int,
    cache: str,
    fault: Injection | None = None,
    caches: list | None = None,
    compile: str = "off",
) -> GenerationResult:
    """Greedy generation with logits recorded, through `generate` (the code `kvbench generate` runs); with `fault`,
    the same loop with the fault's rules and caches passed in."""
    if caches is None:
        caches = fresh_caches(model, cache, len(prompts), max(map(len, prompts)) + new, fault)
    kw = {} if fault is None else {"rules": fault.rules}
    return generate(
        model, prompts, new, cache=cache, record_logits=True, caches=caches, compile=compile, **kw
    )


@torch.inference_mode()
def full_logits(model: GPT, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """One no-cache forward over prompt + tokens[:-1]: (T + N - 1, V) fp32 on the CPU; row T-1+i predicts step i."""
    device = model.lm_head.weight.device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)  # (1, T + N - 1)
    pos = torch.arange(ids.size(1), device=device)[None]  # (1, T + N - 1)
    return model(ids, pos)[0].float().cpu()


def _stack(res: GenerationResult, b: int = 0) -> torch.Tensor:
    return torch.stack([step[b] for step in res.logits])  # (N, V)


# Where non-finite logits came from, for the row's detail: the reference is the model itself, not the cache.
NO_CACHE = "the no-cache forward: the model itself is not finite (check its weights), whatever the cache"
CACHED = "the cached run (the no-cache forward is finite)"


def not_finite(runs: list[tuple[str, torch.Tensor]]) -> str | None:
    """'logits are not finite (3 NaN, 0 inf) in <where>' for the first run whose logits hold a NaN or an inf; None
    when all are finite. Comparing such logits means nothing (NaN is never within a tolerance, and an argmax over
    NaN still picks a token, so two NaN runs would agree), so a check fails with this reason instead."""
    for where, t in runs:
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            return f"logits are not finite ({nan:,} NaN, {inf:,} inf) in {where}"
    return None


def _allclose_err(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float]:
    """|a - b| <= atol + rtol * (the row's largest |logit|): rtol is relative to the logit scale, not to each
    element, since logits near zero would otherwise be held to atol alone, which the fp32 summation-order
    differences of a 12-layer model exceed (about 3e-5 on logits of magnitude 12)."""
    diff = (a - b).abs()
    scale = b.abs().amax(-1, keepdim=True)
    return bool((diff <= atol + rtol * scale).all()), float(diff.max()) if diff.numel() else 0.0


def _tol(spec_name: str, dtype: torch.dtype, table: dict) -> tuple[float, float, str]:
    """(rtol, atol, words) for a cache: the dtype's tolerance, widened to the cache's own if it is lossy."""
    spec = get_cache_spec(spec_name)
    rtol, atol = table[dtype]
    if not spec.exact:
        rtol, atol = max(rtol, spec.logit_rtol), max(atol, spec.logit_atol)
        return rtol, atol, f"lossy: atol {atol:g} + rtol {rtol:g} x row scale (its logit_atol, logit_rtol)"
    return rtol, atol, f"rtol {rtol:g}, atol {atol:g}"


def _near_tie(ref_row: torch.Tensor, got_row: torch.Tensor) -> tuple[bool, float, float]:
    """Is a token flip at this step explained by rounding? (explained, top-2 gap, |logit error|)."""
    top2 = ref_row.topk(2).values
    gap, err = float(top2[0] - top2[1]), float((ref_row - got_row).abs().max())
    return gap <= 2 * err, gap, err


def _compare_tokens(
    name: str,
    cache: str,
    dtype: torch.dtype,
    want: list[int],
    got: list[int],
    ref_rows: torch.Tensor,
    got_rows: torch.Tensor,
    what: str,
    ref_where: str = NO_CACHE,
    got_where: str = CACHED,
) -> CheckRow:
    """Tokens `got` against `want`, with logit rows (N, V) of each: exact, near-tie, or lossy agreement."""
    spec = get_cache_spec(cache)
    bad = not_finite([(ref_where, ref_rows), (got_where, got_rows)])
    if bad:
        return CheckRow(name, cache, False, None, None, "finite logits", f"{what}{'; ' if what else ''}{bad}")
    n = min(len(want), len(got))
    first = next((i for i in range(n) if want[i] != got[i]), None)
    upto = n if first is None else first + 1  # inputs are identical up to and including the divergent step
    err = float((ref_rows[:upto] - got_rows[:upto]).abs().max())
    if not spec.exact:
        agree = sum(w == g for w, g in zip(want, got, strict=False)) / max(n, 1)
        ok = agree >= spec.min_greedy_agreement
        tol = f"lossy: agree >= {spec.min_greedy_agreement:.0%} (its min_greedy_agreement)"
        return CheckRow(name, cache, ok, err, first, tol, f"{what}; {agree:.0%} of {n} tokens agree")
    return token_verdict(name, cache, dtype, want, got, ref_rows, got_rows, first, err, n, what)


def token_verdict(
    name: str, cache: str, dtype: torch.dtype, want: list[int], got: list[int], ref_rows: torch.Tensor,
    got_rows: torch.Tensor, first: int | None, err: float, n: int, what: str,
) -> CheckRow:  # fmt: skip
    """An exact path's token check: identical tokens pass; in fp16/bf16 a flip the logit error explains (a near-tie)
    passes and says so; any other difference fails, naming the step, the tokens, the gap and the error."""
    if first is None:
        return CheckRow(name, cache, True, err, None, "identical tokens", f"{what}: all {n} identical")
    tie, gap, step_err = _near_tie(ref_rows[first], got_rows[first])
    if dtype != torch.float32 and tie:
        return CheckRow(
            name, cache, True, err, first, "identical tokens (near-tie flips allowed)",
            f"{what}; step {first} flipped at a near-tie: top-2 gap {gap:.3g} <= 2 x logit error {step_err:.3g} "
            "(rounding, not a cache bug)",
        )  # fmt: skip
    return CheckRow(
        name, cache, False, err, first, "identical tokens",
        f"{what}; token {first} differs ({want[first]} vs {got[first]}), top-2 gap {gap:.3g}, "
        f"logit error {step_err:.3g}",
    )  # fmt: skip


# --- the checks ---------------------------------------------------------------------------------------------------
def check_logits(
    model: GPT, cache: str, prompt: list[int], res: GenerationResult, full: torch.Tensor
) -> CheckRow:
    """Every cached decode step's logits against a full forward over exactly the same prefix (teacher-forced on the
    tokens the cached run produced, so a bug that appears only after a few steps, such as a write pointer that
    stops advancing, shows at the step it starts)."""
    dtype = model.lm_head.weight.dtype
    rtol, atol, tol = _tol(cache, dtype, TOLERANCES)
    T = len(prompt)
    got, want = (
        _stack(res)[1:],
        full[T:],
    )  # (N - 1, V): decode steps 1..N-1 vs rows predicting the same tokens
    bad = not_finite([(NO_CACHE, want), (CACHED, got)])
    if bad:
        return CheckRow("logits", cache, False, None, None, tol, bad)
    ok, err = _allclose_err(got, want, rtol, atol)
    first = None
    if not ok:
        per_step = (got - want).abs() > atol + rtol * want.abs().amax(-1, keepdim=True)  # (N - 1, V)
        first = int(per_step.any(-1).nonzero()[0, 0]) + 1
    what = f"decode steps 1..{got.size(0)} vs a full forward over the same prefix"
    return CheckRow(
        "logits", cache, ok, err, None, tol, what + (f"; first off at step {first}" if first else "")
    )


def check_greedy(
    model: GPT, cache: str, prompt: list[int], res: GenerationResult, full: torch.Tensor
) -> CheckRow:
    """Every cached greedy token against the no-cache argmax over the same prefix (see the module docstring)."""
    T, got = len(prompt), res.tokens[0]
    rows = full[T - 1 :]  # (N, V)
    want = rows.argmax(-1).tolist()
    return _compare_tokens(
        "greedy", cache, model.lm_head.weight.dtype, want, got, rows, _stack(res),
        f"{len(got)} greedy tokens vs no cache",
    )  # fmt: skip


def check_reference(
    cache: str, dtype: torch.dtype, prompt: list[int], res: GenerationResult | None, ours_full: torch.Tensor,
    hf_full: torch.Tensor, source: str,
) -> CheckRow:  # fmt: skip
    """Our logits against Hugging Face's over the same tokens (teacher-forced). For `none`: every position of our
    no-cache forward (prefill and decode rows); for a cache: the logits it produced at each generated step."""
    rtol, atol, tol = _tol(cache, dtype, REFERENCE_TOLERANCES)
    T = len(prompt)
    ours = ours_full if res is None else _stack(res)
    bad = not_finite(
        [(NO_CACHE, ours_full), (CACHED, ours), ("Hugging Face's reference (ours are finite)", hf_full)]
    )
    if bad:
        return CheckRow("reference", cache, False, None, None, tol, bad)
    if res is None:
        ok, err = _allclose_err(ours_full, hf_full, rtol, atol)
        what = f"no-cache logits at all {ours_full.size(0)} positions vs HF"
    else:
        ok, err = _allclose_err(_stack(res), hf_full[T - 1 :], rtol, atol)
        what = f"prefill + {len(res.logits) - 1} decode steps vs HF"
    return CheckRow("reference", cache, ok, err, None, tol, what)


def check_batched(
    model: GPT, cache: str, batch_res: GenerationResult, solo: list[GenerationResult], lens: list[int]
) -> CheckRow:
    """Each row of a left-padded batch against the same prompt generated alone, through the same cache."""
    n = len(batch_res.tokens[0])
    what = f"lengths {', '.join(map(str, lens))} left-padded together vs alone, {n} tokens"
    broken = not_finite([(f"the prompt of length {lens[b]} alone", _stack(s)) for b, s in enumerate(solo)]
                     + [("the padded batch", torch.stack(batch_res.logits))])  # fmt: skip
    if broken:
        model_itself = ": the model itself is not finite (check its weights)" if cache == "none" else ""
        return CheckRow(
            "batched", cache, False, None, None, "finite logits", f"{what}; {broken}{model_itself}"
        )
    rows = [
        _compare_tokens(
            "batched",
            cache,
            model.lm_head.weight.dtype,
            s.tokens[0],
            batch_res.tokens[b],
            _stack(s),
            _stack(batch_res, b),
            "",
        )  # fmt: skip
        for b, s in enumerate(solo)
    ]
    bad = [b for b, r in enumerate(rows) if not r.passed]
    firsts = [r.first_divergence for r in rows if r.first_divergence is not None]
    if bad:
        what += "; differs for length " + ", ".join(
            f"{lens[b]} (from step {rows[b].first_divergence})" for b in bad
        )
    else:
        what += "".join(f"; length {lens[b]}{r.detail}" for b, r in enumerate(rows) if "near-tie" in r.detail)
        if not get_cache_spec(cache).exact:
            agree = min(
                sum(x == y for x, y in zip(s.tokens[0], batch_res.tokens[b], strict=True)) / n
                for b, s in enumerate(solo)
            )
            what += f"; worst row: {agree:.0%} of {n} tokens agree"
    return CheckRow(
        "batched", cache, not bad, max(r.max_abs_diff for r in rows), min(firsts) if firsts else None,
        rows[0].tolerance, what,
    )  # fmt: skip


def check_cache_state(
    model: GPT,
    cache: str,
    prev: list[int],
    prompt: list[int],
    fresh: GenerationResult,
    new: int,
    fault: Injection | None,
    compile: str = "off",
) -> CheckRow:
    """Generate for `prev`, then for `prompt` on the same cache objects (generate resets them) vs a fresh cache."""
    caches = fresh_caches(model, cache, 1, max(len(prev), len(prompt)) + new, fault)
    try:
        run(model, [prev], new, cache, fault, caches, compile)
        reused = run(model, [prompt], new, cache, fault, caches, compile)
    except KVBenchError as e:  # e.g. a static cache that overflows because it was never reset
        return CheckRow("cache_state", cache, False, None, None, "identical tokens", f"reuse raised: {e}")
    row = _compare_tokens(
        "cache_state", cache, model.lm_head.weight.dtype, fresh.tokens[0], reused.tokens[0], _stack(fresh),
        _stack(reused), f"reused after another prompt vs fresh, {new} tokens", "a fresh cache", "the reused cache",
    )  # fmt: skip
    return row


# --- the Hugging Face reference -----------------------------------------------------------------------------------
def hf_reference(model: GPT, hf_dir: str | None = None):
    """transformers' GPT2LMHeadModel in fp32 with eager attention (matmul + softmax, not SDPA, so it shares no
    attention kernel with us), on our model's device. From `hf_dir` when our weights came from that Hugging Face
    directory (so a bug in our port cannot hide); otherwise our weights copied into it (the inverse port:
    same names and layouts)."""
    from transformers import GPT2LMHeadModel

    from kvbench.model.weights import to_hf_model

    if hf_dir is None:
        return to_hf_model(model, attn_implementation="eager", dtype=torch.float32)
    hf = GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    return hf.to(model.lm_head.weight.device).eval()


@torch.inference_mode()
def hf_logits(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's logits over prompt + tokens[:-1], (T + N - 1, V) fp32 on the CPU."""
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    return hf(input_ids=ids, use_cache=False).logits[0].float().cpu()


# --- the runner ---------------------------------------------------------------------------------------------------
# An invariant tripped inside a run (a model assert, a cache overflow): the path is broken loudly, not silently.
# Still a failed check, reported with the exception, never a traceback.
CRASHES = (KVBenchError, AssertionError, RuntimeError)


def _guarded(cache: str, names: list[str], fn: Callable[[], list[CheckRow]]) -> list[CheckRow]:
    try:
        return fn()
    except CRASHES as e:
        why = f"the run raised {one_line(e)}"
        return [CheckRow(n, cache, False, None, None, "runs without error", why) for n in names]


def run_verify(
    model: GPT,
    caches: list[str],
    prompts: list[list[int]],
    new_tokens: int = 100,
    reference: str = "hf",
    hf_dir: str | None = None,
    fault: Injection | None = None,
    checks: tuple[str, ...] = CHECKS,
    short_tokens: int = SHORT_TOKENS,
    on_row: Callable[[CheckRow], None] | None = None,
    compile: str = "off",
) -> VerifyReport:
    """Run `checks` for every cache in `caches` on `prompts` (prompts[0] is the single-prompt checks' prompt; all
    of them form the batch). `fault` injects a bug (faults.Fault) into every cached run. `compile`: how a fixed-shape
    decode step runs (fixed_step.COMPILE_MODES)."""
    if new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (the logits check needs a decode step), got {new_tokens}"
        )
    if reference not in ("hf", "none"):
        raise KVBenchError(f"--reference must be hf or none, got {reference!r}")
    lens = [len(p) for p in prompts]
    if len(prompts) < 2 or len(set(lens)) < 2:
        raise KVBenchError(f"the batched check needs >= 2 prompts of different lengths, got lengths {lens}")
    ctx = model.config.block_size
    if max(lens) + new_tokens > ctx:
        raise KVBenchError(
            f"longest prompt {max(lens)} (after padding) + new tokens {new_tokens} = {max(lens) + new_tokens} "
            f"exceeds the model's context of {ctx}; lower --prompt-len or --new-tokens"
        )
    dtype = model.lm_head.weight.dtype
    prompt, short = prompts[0], min(short_tokens, new_tokens)
    rows: list[CheckRow] = []

    def add(row: CheckRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    hf = hf_reference(model, hf_dir) if reference == "hf" and "reference" in checks else None
    source = "transformers GPT2LMHeadModel (eager, fp32)"
    memo: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def full(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = tuple(tokens)
        if key not in memo:
            memo[key] = (full_logits(model, prompt, tokens), hf_logits(hf, prompt, tokens) if hf else None)
        return memo[key]

    for cache in caches:
        cached = get_cache_spec(cache).factory is not None
        single = [c for c in ("logits", "greedy") if cached and c in checks] + (["reference"] if hf else [])
        multi = [c for c in ("batched", "cache_state") if c in checks and (cached or c == "batched")]

        def single_rows(cache=cache, cached=cached) -> list[CheckRow]:
            if not cached:  # the no-cache path, teacher-forced over a generated continuation (any tokens do)
                tokens = (
                    list(next(iter(memo))) if memo else run(model, [prompt], new_tokens, "dynamic").tokens[0]
                )
                ours, theirs = full(tokens)
                return [check_reference(cache, dtype, prompt, None, ours, theirs, source)]
            res = run(model, [prompt], new_tokens, cache, fault, compile=compile)
            ours, theirs = full(res.tokens[0])
            out = []
            if "logits" in checks:
                out.append(check_logits(model, cache, prompt, res, ours))
            if "greedy" in checks:
                out.append(check_greedy(model, cache, prompt, res, ours))
            if hf is not None:
                out.append(check_reference(cache, dtype, prompt, res, ours, theirs, source))
            return out

        def multi_rows(cache=cache, multi=multi) -> list[CheckRow]:
            solo = [run(model, [p], short, cache, fault, compile=compile) for p in prompts]
            out = []
            if "batched" in checks:
                batch = run(model, prompts, short, cache, fault, compile=compile)
                out.append(check_batched(model, cache, batch, solo, lens))
            if "cache_state" in multi:
                out.append(
                    check_cache_state(model, cache, prompts[0], prompts[1], solo[1], short, fault, compile)
                )
            return out

        for names, fn in ((single, single_rows), (multi, multi_rows)):
            if names:
                for row in _guarded(cache, names, fn):
                    add(row)

    notes = [
        f"{len(prompts)} seeded prompts of lengths {', '.join(map(str, lens))}; logits, greedy and reference use "
        f"the first with {new_tokens} new tokens; batched and cache_state use {short} new tokens",
        "no-cache path = one causal forward over prompt + generated tokens (row T-1+i is step i of the no-cache loop)",
    ]
    if hf is not None:
        notes.append(
            f"reference: {source}"
            + (f" loaded from {hf_dir}" if hf_dir else ", same weights copied in (the inverse port)")
        )
    if dtype != torch.float32:
        notes.append(
            "low precision: cached and recomputed paths round differently, so a token may flip at a near-tie; "
            "such a flip (top-2 gap <= 2 x logit error at that step) is reported, not failed"
        )
    from kvbench.devices import dtype_name

    return VerifyReport(
        passed=all(r.passed for r in rows),
        checks=rows,
        dtype=dtype_name(dtype),
        new_tokens=new_tokens,
        prompt_len=len(prompt),
        batch_lens=lens,
        reference=source if hf is not None else "none",
        notes=notes,
    )
