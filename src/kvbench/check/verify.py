"""`kvbench verify` on our GPT-2: every check of the suite (check/suite.py) for each cache, against the no-cache
path and transformers' GPT2LMHeadModel on the same weights. Tolerances and the near-tie rule: check/judge.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch

from kvbench.caches import get_cache_spec
from kvbench.check.distortion import REFERENCE_CACHE, measure_subjects
from kvbench.check.gpt2_subject import REFERENCE, GPT2Model, GPT2Subject, Injection, full_logits, hf_logits
from kvbench.check.judge import LOW_PRECISION_NOTE, TP_NOTE, CheckRow, VerifyReport, verdict
from kvbench.check.policy import policy_rows
from kvbench.check.suite import CHECKS, SHORT_TOKENS, prompts_note, run_checks
from kvbench.check.text import TextRun, text_rows
from kvbench.check.tp import RankBytes, rank_bytes_notes, tp_rows
from kvbench.devices import dtype_name
from kvbench.distributed import Rank
from kvbench.model.gpt2 import GPT, GPTConfig


def run_bytes(cfg: GPTConfig, batch: int, tokens: int, element_size: int, logit_copies: int = 3) -> int:
    """A rough allowance for running `batch` sequences of `tokens` tokens on our GPT-2 (the same reckoning as
    hf/models.run_bytes): K and V of every layer, twice (a cache and the copy a fork or a concatenation makes), the
    logits of every position (fp32; a check keeps three copies: the cached run's, the no-cache forward's, the
    reference's) and one attention's scores over the whole length."""
    kv = 2 * cfg.n_layer * cfg.n_embd * tokens * batch * element_size
    logits = logit_copies * batch * tokens * cfg.vocab_size * 4
    scores = batch * cfg.n_head * tokens * tokens * 4
    return 2 * kv + logits + scores


def check_run_fits(
    cfg: GPTConfig,
    batch: int,
    tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    what: str = "",
    logit_copies: int = 3,
) -> None:
    """Before any weight is loaded: the weights and run_bytes against the memory available now (on the CPU, what
    the kernel can give without swapping), so a run too large is one line and exit 3, not the kernel's OOM killer."""
    from kvbench.devices import available_memory_bytes
    from kvbench.distributed import weights_bytes
    from kvbench.errors import NotEnoughMemoryError

    free = available_memory_bytes(device)
    elem = torch.empty((), dtype=dtype).element_size()
    weights = weights_bytes(cfg) // 4 * elem
    run = run_bytes(cfg, batch, tokens, elem, logit_copies)
    if free is not None and weights + run > free:
        gib = 2**30
        raise NotEnoughMemoryError(
            f"{what or f'--batch {batch} x {tokens} tokens (--prompt-len + --new-tokens)'} on {cfg.name} needs about "
            f"{(weights + run) / gib:.1f} GiB (weights {weights / gib:.1f} + the caches, logits and attention scores "
            f"{run / gib:.1f}), more than the {free / gib:.1f} GiB available; "
            + (
                "fewer or shorter prompts, or fewer --new-tokens"
                if what
                else "lower --batch, --prompt-len or --new-tokens"
            )
        )


def random_prompts(vocab_size: int, prompt_len: int, batch: int, seed: int) -> list[list[int]]:
    """`batch` seeded random prompts of distinct lengths prompt_len, ..., about prompt_len / batch (first is the
    longest: it doubles as the single-prompt checks' prompt)."""
    assert 2 <= batch <= prompt_len, f"{batch} distinct prompt lengths up to {prompt_len} (validate.verify_rules)"
    g = torch.Generator().manual_seed(seed)
    lens = [-(-prompt_len * (batch - i) // batch) for i in range(batch)]  # ceil: distinct, longest first
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lens]


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
    tp: Rank | None = None,
    distortion: bool = True,
    random_weights: bool = False,
    text: tuple[list[int], int] | None = None,
) -> VerifyReport:
    """Run `checks` for every cache in `caches` on `prompts` (prompts[0] is the single-prompt checks' prompt; all
    of them form the batch). `fault` injects a bug (faults.Fault) into every cached run. `compile`: how a fixed-shape
    decode step runs (fixed_step.COMPILE_MODES). `tp`: this process is one rank of a tensor-parallel group: the
    cached runs go through its shard (check/tp.py), every rank runs this, and rank 0's report holds every rank's
    rows (the other ranks' reports hold their own). `distortion`: each lossy cache's cost against the full-precision
    `static` cache on prompts[0] (check/distortion.py; not with a fault or under `tp`), its note saying what the
    figures mean for `random_weights`. `text`: (tokens, window), every cache teacher-forced over real text against
    the no-cache forward and transformers (check/text.py; not with a fault or under `tp`)."""
    lens = [len(p) for p in prompts]
    # the caller's promise (validate.verify_rules, validate.fits_context)
    assert reference in ("hf", "none") and max(lens) + new_tokens <= model.config.block_size, (
        reference,
        lens,
    )
    target = GPT2Model(model, reference if "reference" in checks else "none", hf_dir)
    held: list[RankBytes] = []
    if tp is None:
        subjects = [GPT2Subject(target, c, fault, compile) for c in caches]
        rows = run_checks(subjects, prompts, new_tokens, checks, short_tokens, on_row)
        short = min(short_tokens, new_tokens)
        rows += policy_rows(target, caches, prompts, new_tokens, short, fault, compile, on_row, checks)
    else:
        rows, held = tp_rows(target, caches, prompts, new_tokens, checks, short_tokens, on_row, fault, compile, tp)
    costs: dict[str, dict] = {}
    raised: list[str] = []
    if distortion and fault is None and tp is None:
        full = GPT2Subject(target, REFERENCE_CACHE)
        costs = measure_subjects(subjects, full, prompts[0], new_tokens, random_weights, raised)
    text_doc: dict = {}
    if text is not None and fault is None and tp is None:
        text_found, text_doc = text_rows(gpt2_text_run(target, *text), subjects, target.dtype, on_row)
        rows += text_found
    notes = _notes(target, caches, prompts, new_tokens, short_tokens, hf_dir, tp, held) + raised
    reference_name = REFERENCE if target.hf is not None else "none"
    return verify_report(rows, target.dtype, prompts, new_tokens, reference_name, notes, held, costs, text_doc)


def gpt2_text_run(target: GPT2Model, tokens: list[int], window: int) -> TextRun:
    """verify --text on our GPT-2: the no-cache forward as reference, transformers' GPT2LMHeadModel (when it runs)
    scoring the same windows independently."""
    hf = target.hf
    return TextRun(
        tokens,
        window,
        lambda seq: full_logits(target.gpt, seq[:1], seq[1:]),
        "no-cache forward (one causal forward over each window)",
        None if hf is None else (lambda seq: hf_logits(hf, seq[:1], seq[1:])),
        None if hf is None else REFERENCE,
    )


def verify_report(
    rows: list[CheckRow],
    dtype: torch.dtype,
    prompts: list[list[int]],
    new_tokens: int,
    reference: str,
    notes: list[str],
    held: list[RankBytes],
    costs: dict[str, dict],
    text: dict | None = None,
) -> VerifyReport:
    """The report of a verify run (ours or --hf): its rows' verdict, what ran, the notes, each rank's cache bytes
    (under --tp), each lossy cache's cost and, with --text, the text's perplexities."""
    return VerifyReport(
        **verdict(rows),
        checks=rows,
        dtype=dtype_name(dtype),
        new_tokens=new_tokens,
        prompt_len=len(prompts[0]),
        batch_lens=[len(p) for p in prompts],
        reference=reference,
        notes=notes,
        rank_cache_bytes=[asdict(b) | {"equal": b.equal} for b in held],
        distortion=costs,
        text=text or {},
    )


def _notes(
    target: GPT2Model,
    caches: list[str],
    prompts: list[list[int]],
    new_tokens: int,
    short_tokens: int,
    hf_dir: str | None,
    tp: Rank | None,
    held: list[RankBytes],
) -> list[str]:
    """What the report's rows mean: the prompts, the paths compared, the reference, the precision, the ranks."""
    notes = [
        prompts_note(prompts, new_tokens, short_tokens, target.hf is not None),
        "no-cache path = one causal forward over prompt + generated tokens (row T-1+i is step i of the no-cache loop)",
    ]
    if target.hf is not None:
        notes.append(
            f"reference: {REFERENCE}"
            + (f" loaded from {hf_dir}" if hf_dir else ", same weights copied in (the inverse port)")
        )
    if target.dtype != torch.float32:
        notes.append(LOW_PRECISION_NOTE)
    if tp is not None:
        notes.append(f"{TP_NOTE}; {tp.world} ranks ({tp.backend}), each held to the whole model in its own process")
        notes += rank_bytes_notes(held)
        declared = [c for c in caches if get_cache_spec(c).roundtrip or get_cache_spec(c).visible]
        if declared:
            notes.append(
                f"{', '.join(declared)}: the =policy rows run in one process (verify without --tp); under --tp "
                "rank_cache holds each rank's stored values to the declared policy"
            )
    return notes
