"""`kvbench verify` on our GPT-2: every check of the suite (check/suite.py) for each cache, against the no-cache
path and transformers' GPT2LMHeadModel on the same weights. Tolerances and the near-tie rule: check/judge.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch

from kvbench.caches import get_cache_spec
from kvbench.check.distortion import REFERENCE_CACHE, measure_subjects
from kvbench.check.gpt2_subject import REFERENCE, GPT2Model, GPT2Subject, Injection
from kvbench.check.judge import LOW_PRECISION_NOTE, TP_NOTE, CheckRow, VerifyReport, verdict
from kvbench.check.policy import policy_rows
from kvbench.check.suite import CHECKS, SHORT_TOKENS, prompts_note, run_checks
from kvbench.check.tp import RankBytes, rank_bytes_notes, tp_rows
from kvbench.devices import dtype_name
from kvbench.distributed import Rank
from kvbench.model.gpt2 import GPT


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
) -> VerifyReport:
    """Run `checks` for every cache in `caches` on `prompts` (prompts[0] is the single-prompt checks' prompt; all
    of them form the batch). `fault` injects a bug (faults.Fault) into every cached run. `compile`: how a fixed-shape
    decode step runs (fixed_step.COMPILE_MODES). `tp`: this process is one rank of a tensor-parallel group: the
    cached runs go through its shard (check/tp.py), every rank runs this, and rank 0's report holds every rank's
    rows (the other ranks' reports hold their own). `distortion`: each lossy cache's cost against the full-precision
    `static` cache on prompts[0] (check/distortion.py; not with a fault or under `tp`), its note saying what the
    figures mean for `random_weights`."""
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
    notes += raised
    return VerifyReport(
        **verdict(rows),
        checks=rows,
        dtype=dtype_name(target.dtype),
        new_tokens=new_tokens,
        prompt_len=len(prompts[0]),
        batch_lens=lens,
        reference=REFERENCE if target.hf is not None else "none",
        notes=notes,
        rank_cache_bytes=[asdict(b) | {"equal": b.equal} for b in held],
        distortion=costs,
    )
