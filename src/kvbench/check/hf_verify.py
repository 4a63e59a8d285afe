"""`kvbench verify --hf`: every check of the suite (check/suite.py) on any Hugging Face causal LM, through
transformers' own caches (hf/caches.py), against the model's own no-cache path. A cache that cannot run here
(offloading without CUDA, a quantization backend that is not installed, a quantized cache on a model with
sliding-window layers) is one row marked skipped, with the reason. transformers' continuous batching (`paged`) has
checks of its own, each request of two generate_batch calls against the no-cache forward (check/hf_paged.py).

Lossy caches (quantized) are held to a bound on every step's logits against the no-cache forward over the same
tokens (teacher-forced, so one early flip does not turn the rest into noise): |diff| <= rtol x the row's largest
logit + atol. The token agreement with the no-cache tokens is reported beside it, not judged: on random weights
the top two logits are often close, and any rounding flips them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbench.check.causal import refuse_non_causal
from kvbench.check.distortion import HF_REFERENCE_CACHE, measure_subjects
from kvbench.check.hf_paged import ENTRY, PAGED_CHECKS, paged_rows
from kvbench.check.hf_policy import hf_policy_rows
from kvbench.check.hf_subject import HFModel, HFSubject, full_logits
from kvbench.check.judge import LOW_PRECISION_NOTE, CheckRow, VerifyReport, skipped
from kvbench.check.lifecycle import LIFECYCLE
from kvbench.check.suite import SHORT_TOKENS, prompts_note, run_checks
from kvbench.check.text import TextRun, text_rows
from kvbench.check.tp import RankBytes, hf_tp_rows
from kvbench.check.verify import verify_report
from kvbench.distributed import Rank
from kvbench.hf.caches import HF_CACHES
from kvbench.hf.introspect import HFModelInfo
from kvbench.hf.models import LoadedHF
from kvbench.memory.config import quiet_transformers
from kvbench.validate import past_context

HF_TEXT_REFERENCE = "transformers no-cache forward (use_cache=False, one forward over each window)"
SUITE = ("logits", "greedy", "batched", "cache_state", *LIFECYCLE)
CHECKS = (*SUITE, *PAGED_CHECKS)  # the paged entry's rows: its own checks (check/hf_paged.py)


def run_hf_verify(
    loaded: LoadedHF,
    caches: list[str],
    prompts: list[list[int]],
    new_tokens: int = 100,
    checks: tuple[str, ...] = CHECKS,
    short_tokens: int = SHORT_TOKENS,
    on_row: Callable[[CheckRow], None] | None = None,
    tp: Rank | None = None,
    shard: LoadedHF | None = None,
    distortion: bool = True,
    text: tuple[list[int], int] | None = None,
) -> VerifyReport:
    """Run `checks` for every cache in `caches` (names in HF_CACHES) on `prompts` (prompts[0] is the single-prompt
    checks' prompt; all of them form the batch; prompts[1] is cache_state's second prompt). `tp`: this process is
    one rank (kvbench.distributed.Rank) and `shard` its split of the model: the cached runs go through it, held to
    `loaded` (the whole model); rank 0's report holds every rank's rows, with rank_cache (check/tp.py).
    `distortion`: each lossy cache's cost against the model with transformers' `dynamic` cache on prompts[0]
    (check/distortion.py; not under `tp`). `text`: (tokens, window), every cache teacher-forced over real text
    against the model's own no-cache forward (check/text.py; not under `tp`)."""
    lens = [len(p) for p in prompts]
    unknown = [c for c in caches if c not in HF_CACHES]
    assert not unknown, f"unknown caches {unknown}"
    # the caller's promise (cli/verify.py, on the model's meta-device build): the run fits the model's context
    assert not past_context(max(lens) + new_tokens, loaded.info.context), (max(lens), new_tokens)
    refuse_non_causal(loaded)
    target = HFModel(loaded)
    world = 1 if tp is None else tp.world
    batching = [c for c in caches if HF_CACHES[c].batching and any(n in checks for n in PAGED_CHECKS)]
    subjects = [HFSubject(target, c, runner=shard, tp=world) for c in caches if not HF_CACHES[c].batching]
    if tp is not None:
        from kvbench.check.tp import IN_STEP
        from kvbench.distributed import barrier

        for s in subjects:
            s.crashes, s.together = IN_STEP, True
        barrier()  # the ranks start the checks together
    baseline = HFSubject(target, "none")  # what the model itself does without a cache (run_checks)
    report = on_row if tp is None or tp.rank == 0 else None
    with quiet_transformers():
        rows = run_checks(subjects, prompts, new_tokens, checks, short_tokens, report, baseline) if subjects else []
        held: list[RankBytes] = []
        policy_notes: list[str] = []
        if tp is not None:
            rows, held = hf_tp_rows(subjects, rows, prompts[0], new_tokens, tp, report)
        elif "logits" in checks:  # each lossy cache held to its own policy too, where one is declared
            policy, policy_notes = hf_policy_rows(subjects, prompts, new_tokens, report)
            rows += policy
        costs: dict[str, dict] = {}
        raised: list[str] = []
        if distortion and tp is None:
            full = HFSubject(target, HF_REFERENCE_CACHE)
            costs = measure_subjects(subjects, full, prompts[0], new_tokens, loaded.random, raised)
        batch_rows, batch_notes = _batching(target, batching, prompts, min(short_tokens, new_tokens), tp, report)
        rows += batch_rows
        text_found, text_doc = _text(loaded, subjects, text if tp is None else None, report)
        rows += text_found
    notes = _notes(loaded, subjects, prompts, new_tokens, short_tokens) + policy_notes + batch_notes
    notes += _tp_notes(tp, held) + raised
    reference = "transformers no-cache path (use_cache=False)"
    return verify_report(rows, target.dtype, prompts, new_tokens, reference, notes, held, costs, text_doc)


def _text(
    loaded: LoadedHF,
    subjects: list[HFSubject],
    text: tuple[list[int], int] | None,
    report: Callable[[CheckRow], None] | None,
) -> tuple[list[CheckRow], dict]:
    """verify --hf --text: each cache's rows and the report's text section, against the no-cache forward."""
    if text is None:
        return [], {}
    scorer = TextRun(*text, lambda seq: full_logits(loaded, seq[:1], seq[1:]), HF_TEXT_REFERENCE)
    dtype = next(loaded.model.parameters()).dtype
    return text_rows(scorer, subjects, dtype, report)


def _batching(
    target: HFModel,
    caches: list[str],
    prompts: list[list[int]],
    new: int,
    tp: Rank | None,
    report: Callable[[CheckRow], None] | None,
) -> tuple[list[CheckRow], list[str]]:
    """The continuous-batching entry's rows and notes (check/hf_paged.py); under --tp, one skip row."""
    if not caches:
        return [], []
    if tp is not None:
        row = skipped(ENTRY, "continuous batching runs in one process: not checked under --tp")
        if report is not None:
            report(row)
        return [row], []
    return paged_rows(target, prompts, new, add=report)


def _tp_notes(tp: Rank | None, held: list[RankBytes]) -> list[str]:
    if tp is None:
        return []
    from kvbench.check.judge import TP_NOTE
    from kvbench.check.tp import rank_bytes_notes

    where = "transformers' tensor-parallel plan (tp_plan auto)"
    return [
        f"{TP_NOTE}; {tp.world} ranks ({tp.backend}) split by {where}, each held to the whole model in its own process",
        *rank_bytes_notes(held),
    ]


def _notes(
    loaded: LoadedHF, subjects: list[HFSubject], prompts: list[list[int]], new_tokens: int, short_tokens: int
) -> list[str]:
    info, longest = loaded.info, max(map(len, prompts)) + new_tokens
    notes = [
        prompts_note(prompts, new_tokens, short_tokens, has_ref=False),
        "reference: transformers' own no-cache path on the same model (generate and forward with use_cache=False)",
        f"model: {info.architecture}, {_model_layers(info)}, {info.attn_implementation} attention, "
        f"{info.positions_summary()}, transformers {info.transformers_version}",
    ]
    built = [(s.cache, s.cache_layers) for s in subjects if s.cache_layers]
    if built:
        notes.append("cache layers built: " + "; ".join(f"{n}: {_count(ls)}" for n, ls in built))
    if info.windowed:
        windows = sorted({t for t in info.layer_types if t != "full"})
        notes.append(
            f"sliding-window layers ({', '.join(windows)}): transformers builds them inside DynamicCache and "
            "StaticCache (its older sliding_window and hybrid cache names are aliases of these); prompt + new "
            f"tokens ({longest}) {'exceed' if longest > _window(info) else 'fit in'} the window"
        )
    if next(loaded.model.parameters()).dtype != torch.float32:
        notes.append(LOW_PRECISION_NOTE)
    return notes + list(loaded.notes)


def _model_layers(info: HFModelInfo) -> str:
    """'2 full attention layers, 4 heads (2 key/value)'; a model with recurrent layers says so, and how many of its
    layers cache K/V (none: it has no KV cache, so the cache checks do not apply)."""
    if not info.layer_types:
        return "layers not described by its config (transformers' DynamicCache cannot read it)"
    heads = f"{info.n_heads} heads ({info.n_kv_heads} key/value)"
    if "by layer" in info.head_dims:
        heads += f", {info.head_dims}"
    if not info.recurrent:
        return f"{info.layers_summary()} attention layers, {heads}"
    if not info.kv_layers:
        return f"{info.layers_summary()} layers: no attention, so no KV cache (a fixed-size state per sequence)"
    return f"layers {info.layers_summary()}: {info.kv_layers} of {info.n_layers} cache K/V, {heads}"


def _count(names: list[str]) -> str:
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{n} x{c}" for n, c in counts.items())


def _window(info: HFModelInfo) -> int:
    sizes = [int(t[len("sliding(") : -1]) for t in info.layer_types if t.startswith("sliding(")]
    return min(sizes) if sizes else 0
