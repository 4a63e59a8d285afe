"""`verify --hf`'s `paged` entry: transformers' continuous batching (hf/paged.py) held to full recomputation.

For each page size (16 and 256 tokens, column `paged-16`, `paged-256`), two `generate_batch` calls on one persistent
manager, each row one call:
    batch   requests of mixed lengths in one forward, two of them beginning with the same tokens (with pages of 16,
            the same first block, which the cache holds once after the prefill)
    reuse   a second call on the same cache: the first request's prompt, its answer and a new turn (the blocks the
            first call wrote, prompt and decode alike), the second request's prompt again, and the first request's
            tokens after a different first block (nothing to share: a block's hash chains its parent's)

Every request's greedy tokens and logprobs are held to one no-cache forward over its prompt and the tokens it chose
(teacher-forced, so every step is judged): each token the argmax of that forward's row, each logprob within twice
the logits' tolerance of that row's log-softmax (a log-softmax moves by at most twice its logits' largest error). In
fp16/bf16 a token whose row puts it within twice that tolerance of the argmax is a near-tie, reported and passed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.check.hf_subject import HFModel
from kvbench.check.judge import NO_CACHE, CheckRow, Tolerance, not_finite, skipped, tolerance
from kvbench.errors import one_line
from kvbench.hf.caches import HF_CACHES
from kvbench.hf.known import known_defect
from kvbench.hf.paged import PAGE_SIZES, Manager, Request, cb_config, sizes, switches_attention, unavailable

PAGED_CHECKS = ("batch", "reuse")
ENTRY = "paged"  # its name in hf/caches.py; a row's cache is the entry and its page size


@dataclass
class Verdict:
    """One request against the no-cache forward over its own tokens."""

    passed: bool
    err: float | None = None  # largest |logprob difference|
    first: int | None = None  # first step whose token is not the argmax
    why: str = ""  # what differed, or the near-ties allowed


def first_call(
    prompts: list[list[int]], new: int, page: int, room: int | None, g: torch.Generator, vocab: int
) -> list[list[int]]:
    """The first call's prompts, longest first: a shared stem (a block and a half, where the context leaves room
    for it and for the second call's longest prompt) then the first prompt, the stem's first block then the second
    prompt, the second and the last prompts alone."""
    p0, p1, last = prompts[0], prompts[1], prompts[-1]
    space = page + page // 2 if room is None else min(page + page // 2, room - len(p0) - new - len(last))
    stem = torch.randint(0, vocab, (max(space, 0),), generator=g).tolist()
    return _distinct([stem + p0, stem[:page] + p1, p1, last], room)


def second_call(
    first: list[list[int]],
    answer: list[int],
    last: list[int],
    page: int,
    room: int | None,
    g: torch.Generator,
    vocab: int,
) -> list[list[int]]:
    """The second call's prompts: the first prompt, its answer and a new turn; the second prompt again; the first
    prompt's tokens after a different first block."""
    a = first[0]
    k = min(page, len(a) // 2)
    other = torch.randint(0, vocab, (k,), generator=g).tolist()
    if other == a[:k]:
        other[0] = (other[0] + 1) % vocab
    return _distinct([a + answer + last, first[1], other + a[k:]], room)


def _distinct(prompts: list[list[int]], room: int | None) -> list[list[int]]:
    """Each prompt cut to `room` tokens (the context less the new tokens), each once."""
    cut = [p if room is None else p[:room] for p in prompts]
    return [list(p) for p in dict.fromkeys(tuple(p) for p in cut if p)]


def judge(model: HFModel, r: Request, new: int, tol: Tolerance) -> Verdict:
    """`r`'s tokens and logprobs against one no-cache forward over its prompt and those tokens."""
    if r.error is not None:
        return Verdict(False, why=f"failed: {r.error.strip().splitlines()[0] if r.error.strip() else 'no message'}")
    if len(r.tokens) != new or (r.logprobs and len(r.logprobs) != new):
        return Verdict(False, why=f"returned {len(r.tokens)} tokens and {len(r.logprobs)} logprobs, not {new}")
    rows = model.full_logits(r.prompt, r.tokens)[len(r.prompt) - 1 :]  # (N, V): row i predicts token i
    broken = not_finite([(NO_CACHE, rows)])
    if broken:
        return Verdict(False, why=broken)
    got = torch.tensor(r.tokens)
    bound = tol.atol + tol.rtol * rows.abs().amax(-1)  # (N,): the logits' tolerance at each step
    gap = rows.amax(-1) - rows.gather(-1, got[:, None])[:, 0]  # (N,): 0 where the token is the argmax
    ties = (gap > 0) & (gap <= 2 * bound) & (model.dtype != torch.float32)
    flips = (gap > 0) & ~ties
    v = Verdict(True)
    if r.logprobs:
        want = torch.log_softmax(rows, -1).gather(-1, got[:, None])[:, 0]
        diff = (torch.tensor(r.logprobs) - want).abs()
        v.err = float(diff.max())
        off = (diff > 2 * bound).nonzero()
        if off.numel():
            i = int(off[0, 0])
            v.passed = False
            v.why = f"step {i} logprob {r.logprobs[i]:.6g} vs {float(want[i]):.6g} (off by {float(diff[i]):.3g})"
    if flips.any():
        i = int(flips.nonzero()[0, 0])
        v.passed, v.first = False, i
        best = int(rows[i].argmax())
        v.why = f"token {i} is {r.tokens[i]}, the no-cache argmax {best} (gap {float(gap[i]):.3g})" + (
            f"; {v.why}" if v.why else ""
        )
    elif ties.any() and v.passed:
        i = int(ties.nonzero()[0, 0])
        v.why = f"step {i} flipped at a near-tie: gap {float(gap[i]):.3g} <= 2 x tolerance {float(bound[i]):.3g}"
    return v


def call_row(name: str, cache: str, model: HFModel, requests: list[Request], new: int, what: str) -> CheckRow:
    """One call's row: every request judged; the first failures named by their prompt's length."""
    tol = tolerance(model.dtype)
    verdicts = [judge(model, r, new, tol) for r in requests]
    errs = [v.err for v in verdicts if v.err is not None]
    firsts = [v.first for v in verdicts if v.first is not None]
    lens = ", ".join(str(len(r.prompt)) for r in requests)
    found = [r.found for r in requests]
    cached = "" if None in found or not any(found) else f" (the cache held {', '.join(map(str, found))} of them)"
    detail = f"{what}: prompts of {lens} tokens{cached}; {new} new tokens each vs a no-cache forward over them"
    bad = [(r, v) for r, v in zip(requests, verdicts, strict=True) if not v.passed]
    notes = [(len(r.prompt), v.why) for r, v in (bad or zip(requests, verdicts, strict=True)) if v.why]
    if len(notes) == len(requests) > 1 and len({why for _, why in notes}) == 1:
        detail += f"; every request {notes[0][1]}"
    else:
        detail += ("; " + "; ".join(f"length {n}: {why}" for n, why in notes[:3])) if notes else ": all identical"
    ties = "identical tokens (near-tie flips allowed)" if model.dtype != torch.float32 else "identical tokens"
    return CheckRow(
        name=name,
        cache=cache,
        passed=not bad,
        max_abs_diff=max(errs) if errs else None,
        first_divergence=min(firsts, default=None),
        tolerance=f"{ties}; |dlogprob| <= 2 x (atol {tol.atol:g} + rtol {tol.rtol:g} x row scale)",
        detail=detail,
    )


@dataclass
class PageRun:
    """One page size's two calls: their rows, or why they could not run; what was sized; whether blocks were shared."""

    page: int
    rows: list[CheckRow]
    skip: str = ""
    sized: str = ""
    sharing: bool | None = None


def paged_rows(
    model: HFModel, prompts: list[list[int]], new: int, seed: int = 0, add: Callable[[CheckRow], None] | None = None
) -> tuple[list[CheckRow], list[str]]:
    """The `paged` entry's rows (one skip row where it cannot run) and its note; each row passed to `add` too."""
    why = model.caches_unsupported or unavailable(model.loaded.model, model.device)
    runs = [] if why else [_page(model, prompts, new, page, seed) for page in PAGE_SIZES]
    skips = [r.skip for r in runs if r.skip]
    if why or len(skips) == len(runs):
        rows, notes = [skipped(ENTRY, why or skips[0])], []
    else:
        rows = [row for r in runs for row in r.rows] + [skipped(f"{ENTRY}-{r.page}", r.skip) for r in runs if r.skip]
        sharing = next((r.sharing for r in runs if r.sharing is not None), None)
        rows, notes = _known(model, rows), [_note(model, [r.sized for r in runs if r.sized], sharing)]
    for row in rows:
        if add is not None:
            add(row)
    return rows, notes


def _known(model: HFModel, rows: list[CheckRow]) -> list[CheckRow]:
    """Failing rows a known defect of transformers explains, as skips (hf/known.py); where it explains every row (a
    model continuous batching cannot run), one row for the entry, saying so first."""
    info, defects = model.loaded.info, HF_CACHES[ENTRY].known
    words = [None if r.passed or r.skipped else known_defect(defects, r.name, r.detail, info) for r in rows]
    if rows and all(words) and len(set(words)) == 1:
        failed = rows[0].detail.partition("every request ")[2] or rows[0].detail
        why = f"transformers' continuous batching cannot run {info.architecture}: every request {failed}"
        return [skipped(ENTRY, f"{why}; not judged: {words[0]}")]
    return [
        r if w is None else skipped(r.cache, f"not judged: {w}; measured: {r.detail}", r.name)
        for r, w in zip(rows, words, strict=True)
    ]


def _page(model: HFModel, prompts: list[list[int]], new: int, page: int, seed: int) -> PageRun:
    """The two calls at one page size, judged."""
    loaded, cache = model.loaded, f"{ENTRY}-{page}"
    g, vocab = torch.Generator().manual_seed(seed + page), loaded.info.vocab_size
    room = None if loaded.info.context is None else loaded.info.context - new
    first = first_call(prompts, new, page, room, g, vocab)
    planned = second_call(first, [0] * new, prompts[-1], page, room, torch.Generator(), vocab)
    blocks, batch = sizes([[len(p) for p in first], [len(p) for p in planned]], new, page)
    run = PageRun(page, [], sized=f"page_size {page}: {blocks} blocks, max_batch_tokens {batch}")
    manager = Manager(loaded.model, new, cb_config(page, blocks, batch))
    try:
        one = manager.call(first)
        second = second_call(first, one[0].tokens, prompts[-1], page, room, g, vocab)
        two = manager.call(second)
    except MemoryError as e:  # transformers' own sizing: the cache it would allocate does not fit here
        run.skip = f"transformers' continuous batching cannot size its cache here: {one_line(e)}"
        return run
    except Exception as e:
        run.rows = [_raised(n, cache, e) for n in PAGED_CHECKS]
        return run
    finally:
        run.sharing = manager.sharing
        manager.close()
    shared = next((i for i, (x, y) in enumerate(zip(first[0], first[1], strict=False)) if x != y), len(first[1]))
    what = "one generate_batch" + (f" (two share their first {shared} tokens)" if shared else "")
    run.rows = [
        call_row("batch", cache, model, one, new, what),
        call_row("reuse", cache, model, two, new, "a second generate_batch on the same cache"),
    ]
    return run


def _raised(name: str, cache: str, e: Exception) -> CheckRow:
    why = f"generate_batch raised {one_line(e)}"
    return CheckRow(name=name, cache=cache, passed=False, tolerance="runs without error", detail=why)


def _note(model: HFModel, sized: list[str], sharing: bool | None) -> str:
    """What the paged rows ran, in one line."""
    attention = model.loaded.info.attn_implementation
    shares = {
        True: "prefix sharing on",
        False: "prefix sharing off (transformers shares blocks only where every layer is full attention)",
        None: "prefix sharing unknown",
    }[sharing]
    return (
        f"paged: transformers' continuous batching, two generate_batch calls on one persistent manager per page size "
        f"({'; '.join(s for s in sized if s)}), every prompt of a call in one forward, greedy with logprobs, "
        f"{shares}, the model's {attention} attention"
        + (" (auto_switch_to_flash off)" if switches_attention() else "")
        + ("; transformers runs eager as paged|eager" if attention == "eager" else "")
    )
