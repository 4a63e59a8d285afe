"""`verify --text FILE`: real text teacher-forced through every cache, scored as language models are scored.

The text's tokens are cut into windows of `window` tokens (the model's context unless asked), each starting
`stride` = window // 2 tokens after the one before, the last ending at the text's end; a window scores only the
tokens no earlier window scored, so every token after the first is scored exactly once and, past the first window,
with at least window - stride tokens of context (the sliding-window perplexity of transformers' documentation).

Through a cache, a window runs as decoding does: its unscored context in one forward (the prefill), then one token
a forward, each step reading what the cache holds. The reference for the same window is one no-cache forward over
it; with our GPT-2, transformers' GPT2LMHeadModel on the same weights scores it too, independently. Per scored token,
with p the reference's next-token distribution and q the cache's: -log q(next token) (perplexity), KL(p || q),
whether argmax q == argmax p (top-1), and Δp = q(next) - p(next), each through check/distortion.py's step_figures.

Verdicts: an exact cache's perplexity must equal the exact reference's (transformers' where it runs, else the no-cache
forward's) to |ln(PPL / PPL_ref)| <= TEXT_TOLERANCES[dtype]; the no-cache forward is held to transformers the same
way. A lossy cache (int8, sink, quantized-*, a plugin with a policy) reports its figures and is not failed for
moving perplexity (its own bounds are its logits, greedy and =policy rows); a perplexity that is not finite, or a
run that raised, fails it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvbench.check.distortion import depth_bin, step_figures
from kvbench.check.judge import CheckRow, skipped
from kvbench.errors import KVBenchError, one_line

if TYPE_CHECKING:
    from kvbench.check.subject import Session, Subject

CHECK = "text"
# |ln(PPL_cache / PPL_ref)| an exact cache may show: fp32 rounding moves a mean log-probability by ~1e-7; 16-bit
# logits by ~1e-3
TEXT_TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
MIN_TOKENS = 2  # one token to read, one to predict
CHUNK = 64  # scored rows whose figures are computed together

Logits = Callable[[list[int]], torch.Tensor]  # a window's tokens -> (len - 1, V) fp32 CPU logits, row i predicts i+1


def windows(n: int, window: int) -> list[tuple[int, int, int]]:
    """(begin, end, first) of each window over n tokens: tokens begin..end-1, scoring positions first..end-1 of
    the text (first > begin; together every position 1..n-1 once)."""
    assert n >= MIN_TOKENS and window >= MIN_TOKENS, (n, window)
    w = min(window, n)
    stride = max(1, w // 2)
    out, scored, begin = [], 1, 0
    while True:
        end = min(begin + w, n)
        out.append((begin, end, scored))
        scored = end
        if end == n:
            return out
        begin += stride


@dataclass
class Scored:
    """Per scored token of one path: -log q(next), KL(p || q), top-1 agreement, Δp and the depth (tokens read)."""

    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    dp: list[float] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)

    def add(self, p: torch.Tensor, q: torch.Tensor, targets: torch.Tensor, depth: list[int]) -> None:
        """Rows (m, V) of the reference p and this path q predicting `targets` (m,), CHUNK rows at a time (the
        figures are float64 over the vocabulary)."""
        for i in range(0, len(targets), CHUNK):
            t = targets[i : i + CHUNK]
            kl, top1, dp = step_figures(p[i : i + CHUNK], q[i : i + CHUNK], t)
            nll = -torch.log_softmax(q[i : i + CHUNK].double(), dim=-1).gather(-1, t[:, None])[:, 0]
            self.nll += nll.tolist()
            self.kl += kl.tolist()
            self.top1 += top1.tolist()
            self.dp += dp.tolist()
        self.depth += depth

    @property
    def ppl(self) -> float:
        """exp of the mean -log q(next); inf past what a float holds, nan where a log-probability was nan."""
        mean = sum(self.nll) / len(self.nll)
        return math.exp(mean) if mean < 700 else math.inf if mean == mean else math.nan


def figures(s: Scored) -> dict:
    """One path's perplexity, KL mean, p99 and max, top-1 agreement and RMS Δp."""
    kl = torch.tensor(s.kl, dtype=torch.float64)
    dp = torch.tensor(s.dp, dtype=torch.float64)
    return {
        "ppl": s.ppl,
        "kld": {"mean": float(kl.mean()), "p99": float(torch.quantile(kl, 0.99)), "max": float(kl.max())},
        "top1_agreement": sum(s.top1) / len(s.top1),
        "rms_dp": float(dp.square().mean().sqrt()),
        "tokens": len(s.nll),
    }


def by_depth(s: Scored) -> list[dict]:
    """figures() of each power-of-two depth bin (check/distortion.py's bins), shallowest first."""
    bins: dict[tuple[int, int], Scored] = {}
    for i, d in enumerate(s.depth):
        b = bins.setdefault(depth_bin(d), Scored())
        b.nll.append(s.nll[i])
        b.kl.append(s.kl[i])
        b.top1.append(s.top1[i])
        b.dp.append(s.dp[i])
    return [{"depth_from": lo, "depth_to": hi, **figures(bins[(lo, hi)])} for lo, hi in sorted(bins)]


@dataclass
class TextRun:
    """What verify --text ran on: the text's tokens, the windows, the reference and the independent scorer."""

    tokens: list[int]
    window: int
    reference: Logits  # the no-cache forward
    reference_name: str
    independent: Logits | None = None  # transformers on the same weights (our GPT-2), None where the model is its own
    independent_name: str | None = None


@torch.inference_mode()
def cache_rows(session: Session, seq: list[int], first: int) -> torch.Tensor:
    """A window through one fresh cache session: seq[:first] in one forward, then one token a forward; the rows
    predicting seq[first:], (len(seq) - first, V)."""
    rows = [session.forward([seq[:first]])[0, -1:]]
    for t in seq[first:-1]:
        rows.append(session.forward([[t]])[0, -1:])
    return torch.cat(rows)


def score(run: TextRun, subjects: Sequence[Subject]) -> tuple[Scored, Scored | None, dict[str, Scored | str]]:
    """The reference's, the independent scorer's and each subject's Scored (or why its run raised), window by
    window (only one window's logits are held at a time)."""
    ref, ind = Scored(), Scored() if run.independent is not None else None
    out: dict[str, Scored | str] = {s.cache: Scored() for s in subjects}
    for begin, end, scored in windows(len(run.tokens), run.window):
        seq, first = run.tokens[begin:end], scored - begin
        targets = torch.tensor(seq[first:])
        depth = list(range(first, len(seq)))
        p = run.reference(seq)[first - 1 :]  # (m, V)
        ref.add(p, p, targets, depth)
        if ind is not None and run.independent is not None:
            ind.add(p, run.independent(seq)[first - 1 :], targets, depth)
        for s in subjects:
            got = out[s.cache]
            if isinstance(got, str):
                continue
            try:
                got.add(p, cache_rows(s.open(1, len(seq)), seq, first), targets, depth)
            except s.crashes as e:
                out[s.cache] = f"the run raised {one_line(e)}"
    return ref, ind, out


def _row(cache: str, exact: bool, got: dict, ref_ppl: float, ref_name: str, tol: float) -> CheckRow:
    ratio = math.log(got["ppl"] / ref_ppl) if math.isfinite(got["ppl"]) else math.inf
    said = (
        f"PPL {got['ppl']:.6g} vs {ref_name} {ref_ppl:.6g} (ln ratio {ratio:+.2e}) over {got['tokens']:,} tokens; "
        f"KLD mean {got['kld']['mean']:.2g}, top-1 {got['top1_agreement']:.1%}"
    )
    if exact:
        ok = abs(ratio) <= tol
        return CheckRow(name=CHECK, cache=cache, passed=ok, tolerance=f"|ln(PPL/PPL_ref)| <= {tol:g}", detail=said)
    ok = math.isfinite(got["ppl"])
    why = "" if ok else ": its perplexity is not finite"
    return CheckRow(
        name=CHECK, cache=cache, passed=ok, tolerance="reported (lossy: PPL moves by design)", detail=said + why
    )


def text_rows(
    run: TextRun, subjects: Sequence[Subject], dtype: torch.dtype, on_row: Callable[[CheckRow], None] | None = None
) -> tuple[list[CheckRow], dict]:
    """The text rows (one per subject, and the no-cache path's against transformers where it runs) and the report's
    `text` section: the windows, both reference perplexities, and each cache's figures and figures by depth."""
    tol = TEXT_TOLERANCES.get(dtype, TEXT_TOLERANCES[torch.float32])
    ref, ind, scored = score(run, [s for s in subjects if s.cached and s.unavailable() is None])
    exact_ppl, exact_name = (ind.ppl, "transformers") if ind is not None else (ref.ppl, "no cache")
    rows: list[CheckRow] = []
    caches: dict[str, dict] = {}
    if ind is not None:  # the no-cache forward against transformers
        rows.append(_row("none", True, figures(ref), exact_ppl, exact_name, tol))
        caches["none"] = {"exact": True, **figures(ref), "ln_ppl_ratio": math.log(ref.ppl / exact_ppl)}
    for s in subjects:
        why = s.unavailable() if s.cached else None
        if why is not None:
            rows.append(skipped(s.cache, why, CHECK))
        elif s.cache in scored:
            row, caches[s.cache] = _cache_entry(s.cache, not s.tol.lossy, scored[s.cache], exact_ppl, exact_name, tol)
            rows.append(row)
    for r in rows:
        if on_row is not None:
            on_row(r)
        if r.cache in caches:
            caches[r.cache]["passed"] = r.passed
    n, w = len(run.tokens), min(run.window, len(run.tokens))
    doc = {
        "tokens": n,
        "scored": n - 1,
        "window": w,
        "stride": max(1, w // 2),
        "windows": len(windows(n, run.window)),
        "reference": run.reference_name,
        "ppl_no_cache": ref.ppl,
        "transformers": run.independent_name if ind is not None else run.reference_name,
        "ppl_transformers": exact_ppl if ind is not None else ref.ppl,
        "tolerance": tol,
        "caches": caches,
    }
    return rows, doc


def _cache_entry(
    cache: str, exact: bool, got: Scored | str, ref_ppl: float, ref_name: str, tol: float
) -> tuple[CheckRow, dict]:
    """One cache's row and its entry of the text section."""
    if isinstance(got, str):
        row = CheckRow(name=CHECK, cache=cache, passed=False, tolerance="the run completes", detail=got)
        return row, {"exact": exact, "error": got}
    f = figures(got)
    ratio = math.log(f["ppl"] / ref_ppl) if math.isfinite(f["ppl"]) else None
    return _row(cache, exact, f, ref_ppl, ref_name, tol), {
        "exact": exact,
        **f,
        "ln_ppl_ratio": ratio,
        "by_depth": by_depth(got),
    }


def read_text_tokens(path: str, encode: Callable[[str], list[int]], label: str = "--text") -> list[int]:
    """The file at `path` as token ids: a UTF-8 text file of at least MIN_TOKENS tokens, else one line."""
    from kvbench import files

    what = f"{label} {path}"
    fix = "give a UTF-8 text file (e.g. a passage of prose)"
    text = files.read_text(path, what, files.PROMPTS_BYTES, "a text file", fix)
    if "\x00" in text:
        raise KVBenchError(f"{what} is not text (it holds NUL bytes); {fix}")
    ids = encode(text)
    if len(ids) < MIN_TOKENS:
        raise KVBenchError(
            f"{what} holds {len(ids)} token{'s' if len(ids) != 1 else ''}; perplexity needs at least {MIN_TOKENS}"
        )
    return ids
