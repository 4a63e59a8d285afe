"""Do a bench row's tokens agree with the no-cache path? A wrong but fast path must not pass as a speedup.

The reference for a prompt is what kvbench's `none` (full recomputation every step) generated from the same prompt
ids in the same run: for kvbench rows and for transformers' rows alike. Every run of a row (cold, warm-ups, timed)
is compared and the worst one is reported:

    token_agreement   fraction of the batch x new_tokens generated tokens equal to the reference's
    first_divergence  first token index (0 = the prefill's token) where a sequence differs
    flips             sequences of the batch that differ
    near_tie_flips    of those, flips explained by rounding, judged as `verify` judges them

Greedy decoding makes a flip cascade: after the first differing token the two continuations read different text,
so agreement counts everything after a flip as different. Whether the first flip is a bug or rounding is decided
at that token, as `verify` does: both paths have read identical tokens up to it, so the reference's logits there
(one no-cache forward over the prompt and the reference tokens before it, the computation `none` itself did) are
compared with the row's own logits at that token (from one extra, untimed run of the same configuration with its
logits recorded). A flip is a near-tie when the reference's top-2 gap is at most twice the largest logit difference
(each of the two logits may move by the error) and that difference is itself within rounding (verify's tolerance
for the dtype, widened to a lossy cache's own): in fp16 and bf16 the paths round differently and such flips are
expected; in fp32 they are rare. Any other flip is a real difference (a bug, or a lossy cache's error).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.check.judge import near_tie


@dataclass
class TokenCheck:
    agreement: float  # NaN without a reference
    first_divergence: int | None
    flips: int
    near_tie_flips: int
    note: str  # one line: "identical", the first flip and its explanation, or why there is no check

    @classmethod
    def missing(cls, why: str) -> TokenCheck:
        return cls(math.nan, None, 0, 0, why)


def divergences(ref: list[list[int]], got: list[list[int]]) -> tuple[float, dict[int, int]]:
    """(fraction of tokens equal position by position, {sequence: first differing token index})."""
    total = same = 0
    first: dict[int, int] = {}
    for b, (r, g) in enumerate(zip(ref, got, strict=True)):
        n = max(len(r), len(g))
        total += n
        for i in range(n):
            if i < len(r) and i < len(g) and r[i] == g[i]:
                same += 1
            elif b not in first:
                first[b] = i
    return (same / total if total else math.nan), first


@torch.inference_mode()
def reference_logits(model: torch.nn.Module, ids: torch.Tensor, ref: list[list[int]], d: int) -> torch.Tensor:
    """(B, V) fp32: the logits `none` computed for token d, one forward over the prompts + ref tokens before d."""
    device = ids.device
    x = torch.cat([ids, torch.tensor([r[:d] for r in ref], device=device, dtype=ids.dtype)], dim=1)  # (B, T + d)
    positions = torch.arange(x.size(1), device=device).expand(x.size(0), -1)  # (B, T + d)
    return model(x, positions, last_only=True)[:, -1].float().cpu()


def check_tokens(
    ref: list[list[int]],
    runs: list[list[list[int]]],
    ref_logits: Callable[[int], torch.Tensor],
    rerun: Callable[[], tuple[list[list[int]], list[torch.Tensor]]],
    rtol: float,
    atol: float,
    lossy: bool = False,
) -> TokenCheck:
    """Judge a row's runs (each (B, N) tokens) against the reference tokens (B, N).

    ref_logits(d) -> (B, V): the reference's logits at token d. rerun() -> (tokens, logits per token): one more run
    of the row with its logits recorded; called only when some run differs. rtol, atol: the rounding a correct
    path may show at that token (verify's tolerance for the dtype: atol + rtol x the row's largest |logit|); a flip
    is a near-tie only within it, so a path whose logits are simply wrong is never excused by a small gap.
    """
    scored = [divergences(ref, got) for got in runs]
    worst = min(range(len(runs)), key=lambda i: scored[i][0])
    agreement, first = scored[worst]
    if not first:
        return TokenCheck(agreement, None, 0, 0, "identical")
    n, d0 = len(first), min(first.values())
    try:
        near, details = _explain(ref, runs[worst], first, ref_logits, rerun, rtol, atol)
    except Exception as e:  # explaining is a diagnosis: its failure is reported in the row, the timings stand
        why = " ".join(str(e).split())[:200]
        return TokenCheck(agreement, d0, n, 0, f"flips not explained: {type(e).__name__}: {why}")
    note = details[0] + (f"; {n - 1} more sequence(s) flipped, {near} of all {n} at near-ties" if n > 1 else "")
    return TokenCheck(agreement, d0, n, near, ("lossy cache; " if lossy else "") + note)


def _explain(
    ref: list[list[int]],
    got: list[list[int]],
    first: dict[int, int],
    ref_logits: Callable[[int], torch.Tensor],
    rerun: Callable[[], tuple[list[list[int]], Any]],
    rtol: float,
    atol: float,
) -> tuple[int, list[str]]:
    """(flips at near-ties, one explanation per flipped sequence, earliest flip first)."""
    again, logits = rerun()
    near, details, ref_rows = 0, [], {}
    for b, d in sorted(first.items(), key=lambda kv: kv[1]):
        if again[b][: d + 1] != got[b][: d + 1] or d >= len(logits) or d >= len(ref[b]):
            details.append(f"token {d}: runs of this configuration differ from each other (not deterministic)")
            continue
        if d not in ref_rows:
            ref_rows[d] = ref_logits(d)  # one forward per distinct flip position
        row = ref_rows[d][b]
        tie, gap, err = near_tie(row, logits[d][b])
        bound = atol + rtol * float(row.abs().max())
        near += tie and err <= bound
        if tie and err <= bound:
            details.append(f"token {d}: near-tie, top-2 gap {gap:.3g} <= 2 x logit error {err:.3g} (rounding)")
        elif tie:
            details.append(f"token {d}: DIFFERS, logit error {err:.3g} exceeds rounding ({bound:.3g})")
        else:
            details.append(f"token {d}: DIFFERS, top-2 gap {gap:.3g} > 2 x logit error {err:.3g}")
    return near, details
