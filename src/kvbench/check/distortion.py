"""What a lossy cache costs, measured as its users measure it (llama.cpp's `--kl-divergence`): the next-token
distributions of the lossy cache against those of a full-precision cache, per step and by context depth.

Teacher-forced: both paths are fed the same tokens, the prompt (or, under `bench --fill random`, caches filled with
the same random K/V), then at every step the token the full-precision path chose (its greedy token). Each step so
compares two distributions over one prefix, never two texts that drifted apart. With p the full-precision path's
next-token distribution and q the lossy path's (the softmax of each path's logits, in float64), a step gives:

    KL      KL(p || q) = sum_v p_v (log p_v - log q_v), in nats; 0 when q equals p, never negative
    top-1   argmax q == argmax p: the lossy path would choose the same token
    |Δp|    |q_t - p_t| for t = argmax p: how far the probability of the chosen token moved (llama.cpp's Δp is the
            change in the probability of the token evaluated; here that is the full-precision path's token)

A step's depth is the context it reads: the tokens the paths hold once its input is written (prompt + step, or a
filled context + 1 + step). Steps are pooled in power-of-two depth bins (32-63, 64-127, ...) beside the whole run's
figures. The full-precision path is a cache that verify holds exact (our `static`, transformers' `dynamic`) in the
model's own dtype, so the figures are the lossy design's cost, not a dtype's; the bytes each path's cache holds at
the end (the same tokens, the same capacity) give what the lossy design saves, where they can be read.

On random weights the figures describe that model only: random logits are nearly flat, so KL is small because the
distributions are. On real weights they are the numbers users quote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvbench.caches import make_caches
from kvbench.caches.base import cache_nbytes
from kvbench.decode.path import CachePath
from kvbench.errors import one_line

if TYPE_CHECKING:
    from kvbench.check.subject import Subject
    from kvbench.model.gpt2 import GPT

REFERENCE_CACHE = "static"  # our GPT-2's full-precision path
HF_REFERENCE_CACHE = "dynamic"  # a Hugging Face model's
RANDOM_NOTE = (
    "random weights: these figures describe this model only (random logits are nearly flat, so KL is small because "
    "the distributions are); on real weights they are the numbers users quote"
)
REAL_NOTE = "real weights: the numbers users quote (llama.cpp's --kl-divergence convention, teacher-forced)"


def weights_note(random: bool) -> str:
    """What the figures mean for these weights, in one line (every output that shows them carries it)."""
    return RANDOM_NOTE if random else REAL_NOTE


class Path(Protocol):
    """One path a forward at a time (a check Session, or CachePath over our layer caches)."""

    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        """Write (B, T) tokens after what the path holds; logits (B, T or 1, V), the last row the next token's."""


# --- the figures -----------------------------------------------------------------------------------------------
def step_figures(
    p_logits: torch.Tensor, q_logits: torch.Tensor, target: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL(p || q), top-1 agreement, |Δp|) of logits (..., V), each (...,): KL and |Δp| float64, top-1 bool.
    p is the full-precision path's distribution, q the lossy one's; a token p gives no probability adds nothing to
    KL, a token q rules out that p does not makes it infinite. |Δp| is taken at `target` (...,) where given (the
    text's next token, verify --text), else at the full-precision path's own top token."""
    lp = torch.log_softmax(p_logits.double(), dim=-1)
    lq = torch.log_softmax(q_logits.double(), dim=-1)
    p = lp.exp()
    kl = torch.where(p > 0, p * (lp - lq), 0.0).sum(-1).clamp_min(0.0)  # float64 rounding can dip below 0 by 1e-17
    top = p.argmax(-1, keepdim=True)  # (..., 1): the full-precision path's token
    top1 = lq.argmax(-1, keepdim=True) == top
    t = top if target is None else target.to(top.device)[..., None]  # (..., 1)
    dp = (lq.gather(-1, t).exp() - p.gather(-1, t)).abs()
    return kl, top1.squeeze(-1), dp.squeeze(-1)


@dataclass
class Steps:
    """The figures of B sequences over N teacher-forced steps, each (B, N), and each step's depth."""

    kl: torch.Tensor
    top1: torch.Tensor
    abs_dp: torch.Tensor
    depth: list[int]  # (N,): the tokens each step reads


@torch.inference_mode()
def teacher_forced(full: Path, lossy: Path, first: list[list[int]], new: int, held: int = 0) -> Steps:
    """`new` steps of both paths: `first` ((B, T) tokens, written after the `held` tokens each path already holds)
    gives step 0's logits (its last row), and every later step feeds both paths the token the full-precision path
    chose at the step before."""
    assert new >= 1 and first and len({len(r) for r in first}) == 1, (new, [len(r) for r in first])
    p, q = full.forward(first)[:, -1].cpu(), lossy.forward(first)[:, -1].cpu()  # (B, V) each
    figures = []
    for i in range(new):
        figures.append(step_figures(p, q))
        if i + 1 < new:
            ids = p.argmax(-1, keepdim=True).tolist()  # (B, 1): the full-precision path's greedy token
            p, q = full.forward(ids)[:, -1].cpu(), lossy.forward(ids)[:, -1].cpu()
    kl, top1, dp = (torch.stack(f, dim=1) for f in zip(*figures, strict=True))  # (B, N) each
    start = held + len(first[0])
    return Steps(kl, top1, dp, list(range(start, start + new)))


def depth_bin(depth: int) -> tuple[int, int]:
    """The power-of-two bin holding `depth`: 32..63 for 40, 1024..2047 for 1057."""
    lo = 1 << (max(depth, 1).bit_length() - 1)
    return lo, 2 * lo - 1


@dataclass
class DepthBin:
    depth_from: int
    depth_to: int  # inclusive
    steps: int  # steps in the bin, over every sequence
    kl_mean: float
    kl_max: float
    top1_agreement: float
    mean_abs_dp: float


@dataclass
class Distortion:
    """One lossy cache against the full-precision path: the whole run's figures, by depth, and per step."""

    cache: str
    reference: str  # the full-precision path, in words
    note: str  # what the figures mean for these weights (weights_note)
    sequences: int
    steps: int  # teacher-forced steps per sequence
    kl_mean: float  # nats, over every step of every sequence
    kl_max: float
    top1_agreement: float  # fraction of steps whose top token is the full-precision path's
    mean_abs_dp: float
    max_abs_dp: float
    kv_bytes: int | None  # what the lossy cache holds at the end; None where it cannot be read
    reference_kv_bytes: int | None  # what the full-precision cache holds then (the same tokens and capacity)
    by_depth: list[DepthBin] = field(default_factory=list)
    # each step's figures, averaged over the sequences: depth, kl, top1 (a fraction), abs_dp
    per_step: dict[str, list] = field(default_factory=dict)

    @property
    def bytes_saved(self) -> int | None:
        if self.kv_bytes is None or self.reference_kv_bytes is None:
            return None
        return self.reference_kv_bytes - self.kv_bytes

    def as_dict(self) -> dict:
        saved = self.bytes_saved
        fraction = saved / self.reference_kv_bytes if saved is not None and self.reference_kv_bytes else None
        return {**asdict(self), "bytes_saved": saved, "bytes_saved_fraction": fraction}


def summarise(
    cache: str, steps: Steps, reference: str, note: str, kv_bytes: int | None = None, ref_bytes: int | None = None
) -> Distortion:
    """The whole run's figures, each depth bin's and each step's (averaged over the sequences)."""
    kl, top1, dp = steps.kl, steps.top1.double(), steps.abs_dp  # (B, N) each
    depth = torch.tensor(steps.depth)  # (N,)
    bins = []
    for lo, hi in dict.fromkeys(depth_bin(d) for d in steps.depth):
        at = (depth >= lo) & (depth <= hi)  # (N,)
        k = kl[:, at]
        bins.append(
            DepthBin(
                lo, hi, k.numel(), float(k.mean()), float(k.max()), float(top1[:, at].mean()), float(dp[:, at].mean())
            )
        )
    per_step = {
        "depth": list(steps.depth),
        "kl": kl.mean(0).tolist(),
        "top1": top1.mean(0).tolist(),
        "abs_dp": dp.mean(0).tolist(),
    }
    return Distortion(
        cache=cache,
        reference=reference,
        note=note,
        sequences=kl.size(0),
        steps=kl.size(1),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agreement=float(top1.mean()),
        mean_abs_dp=float(dp.mean()),
        max_abs_dp=float(dp.max()),
        kv_bytes=kv_bytes,
        reference_kv_bytes=ref_bytes,
        by_depth=bins,
        per_step=per_step,
    )


# --- verify: a subject's session against the full-precision one ---------------------------------------------------
def session_bytes(session: object) -> int | None:
    """The bytes a session's caches hold: our layer caches; None for transformers' (a quantized layer keeps its
    packed tensors inside its backend)."""
    caches = getattr(session, "caches", None)
    return cache_nbytes(caches) if isinstance(caches, list) else None


def measure_subjects(
    subjects: Sequence[Subject],
    reference: Subject,
    prompt: list[int],
    new: int,
    random: bool,
    notes: list[str] | None = None,
) -> dict[str, dict]:
    """Each lossy subject (a check Subject whose tolerance is lossy and that can run here) against `reference`, the
    same model with a full-precision cache, teacher-forced over `prompt` and `new` steps: {cache: Distortion as a
    dict}. A subject whose run raises has no entry; a line in `notes` says why."""
    out: dict[str, dict] = {}
    what = f"{reference.cache} (full precision), teacher-forced on its greedy tokens"
    for s in subjects:
        if not (s.cached and s.tol.lossy) or s.unavailable() is not None:
            continue
        try:
            size = len(prompt) + new - 1  # what both hold at the end: the last step's token is never written
            full, lossy = reference.open(1, size), s.open(1, size)
            steps = teacher_forced(full, lossy, [prompt], new)
        except s.crashes as e:
            if notes is not None:
                notes.append(f"distortion of {s.cache} not measured: the run raised {one_line(e)}")
            continue
        d = summarise(s.cache, steps, what, weights_note(random), session_bytes(lossy), session_bytes(full))
        out[s.cache] = d.as_dict()
    return out


# --- bench: our GPT-2 over layer caches ---------------------------------------------------------------------------
def measure_layers(
    model: GPT,
    cache: str,
    first: list[list[int]],
    new: int,
    context: int = 0,
    fill: Callable[[list], None] | None = None,
    note: str = "",
) -> Distortion:
    """Cache `cache` against our `static` cache on `model`, teacher-forced for `new` steps from `first` ((B, T)
    tokens). With `context`, `fill` is given every layer cache of both paths and writes the same `context` tokens
    into each first (bench --fill random). Both are allocated for exactly what they hold at the end, so their bytes
    compare one design with the other. `note`: what the figures mean for these weights (weights_note), where the
    caller says it per row."""
    assert (fill is None) == (context == 0), (context, fill)
    w = model.lm_head.weight
    size = context + len(first[0]) + new - 1  # what both hold at the end: the last step's token is never written
    full = make_caches(REFERENCE_CACHE, model.cache_config, len(first), size, w.dtype, w.device)
    lossy = make_caches(cache, model.cache_config, len(first), size, w.dtype, w.device)
    assert full is not None and lossy is not None, f"{cache} holds no cache to measure"
    if fill is not None:
        fill(full + lossy)
    # the last token's logits only: a long prompt's rows would not fit a large batch
    full_path, lossy_path = (CachePath(model, c, context, last_only=True) for c in (full, lossy))
    steps = teacher_forced(full_path, lossy_path, first, new, context)
    what = f"{REFERENCE_CACHE} (full precision), teacher-forced on its greedy tokens"
    return summarise(cache, steps, what, note, cache_nbytes(lossy), cache_nbytes(full))
