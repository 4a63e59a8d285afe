"""The rules of the options that run a decode step, each checked once at the boundary, before any work: --compile
(the modes decode/fixed_step.py builds, and only where a cache has a fixed-shape step), --draft (prompt-lookup where
it can run), a left-padded batch (only for a design that takes padding), and `kvbench generate`'s options together.

They read the cache registry's facts (caches/) and the decode step's modes (decode/), so they live here, above both;
the generic checks they use (integer, seed, sampling_rules) are validate.py's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from kvbench.caches import get_cache_spec
from kvbench.caches.plugins import missing_lifecycle, probe_layer
from kvbench.decode.fixed_step import COMPILE_MODES
from kvbench.errors import KVBenchError, listed
from kvbench.validate import MAX_DRAFT_TOKENS, MAX_NGRAM, integer, new_tokens, one_of, run_batch, sampling_rules


class GenerateChoices(Protocol):
    """What generate_rules reads of `kvbench generate`'s options (cli/generate.py GenerateOptions)."""

    new_tokens: int
    cache: str
    compile: str
    temperature: float
    top_k: int | None
    seed: int
    draft: str
    draft_tokens: int | None
    ngram: int | None


def compile_mode(mode: str, device_type: str | None = None, caches: list[str] | None = None) -> str:
    """`--compile` for a step on `device_type`: one of COMPILE_MODES, max on the CPU only (not checked where the
    device is not known yet: None); other than off, only where one of `caches` (when given) has a fixed-shape
    step, since nothing else is compiled."""
    if mode not in COMPILE_MODES:
        raise KVBenchError(f"--compile {mode!r}: use off (eager), default (torch.compile) or max (CPU, frozen weights)")
    if caches is not None and mode != "off" and not any(get_cache_spec(c).fixed_step for c in caches):
        runs = ", ".join(caches) or "none of kvbench's"
        raise KVBenchError(
            f"--compile {mode} compiles the fixed-shape decode step of static-graph; the caches run here ({runs}) "
            "have none, so nothing would be compiled: add static-graph or drop --compile"
        )
    if mode == "max" and device_type not in (None, "cpu"):
        raise KVBenchError(
            f"--compile max compiles the CPU decode step (frozen weights, kvbench's CPU kernels); on {device_type} "
            "use --compile default"
        )
    if mode != "off" and device_type == "cpu":
        _cpp_compiler(mode)
    return mode


def _cpp_compiler(mode: str) -> None:
    """Inductor compiles a CPU step's kernels with a C++ compiler ($CXX, else its default): refused up front where
    it finds none that works, rather than as every compiled row's error."""
    from torch._inductor.cpp_builder import get_cpp_compiler  # here: Inductor takes seconds to import
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        cxx = os.environ.get("CXX")
        which = f"$CXX={cxx!r} does not work" if cxx else "no working C++ compiler (g++) on PATH"
        raise KVBenchError(
            f"--compile {mode}: Inductor compiles the CPU step with a C++ compiler, and {which}; install one or set "
            "CXX, or use --compile off"
        ) from None


def draft_rules(
    draft: str,
    draft_tokens: int | None,
    ngram: int | None,
    cache: str,
    n_prompts: int,
    temperature: float,
    compile: str,
) -> None:
    """--draft and its settings: a known method; --draft-tokens and --ngram only with prompt-lookup, within their
    bounds; prompt-lookup only where it runs: one prompt, greedy, eager, a cache that can crop (a probe layer cache
    is built on a tiny CPU config to ask it)."""
    one_of("--draft", draft, ("none", "prompt-lookup"))
    if draft == "none":
        for flag, value in (("--draft-tokens", draft_tokens), ("--ngram", ngram)):
            if value is not None:
                raise KVBenchError(f"{flag} {value} has no effect without --draft prompt-lookup; add it or drop {flag}")
        return
    if draft_tokens is not None:
        integer("--draft-tokens", draft_tokens, 1, MAX_DRAFT_TOKENS)
    if ngram is not None:
        integer("--ngram", ngram, 1, MAX_NGRAM)
    what = "--draft prompt-lookup decodes one prompt greedily"
    if n_prompts != 1:
        raise KVBenchError(f"{what} (batch 1); {n_prompts} prompts were given: give one prompt, or drop --draft")
    if temperature > 0:
        raise KVBenchError(f"{what}; --temperature {temperature:g} samples: use --temperature 0, or drop --draft")
    if compile != "off":
        raise KVBenchError(
            f"--compile {compile} compiles static-graph's fixed-shape decode step, which --draft does not run "
            "(its forwards verify several tokens at once): drop --compile or --draft"
        )
    spec = get_cache_spec(cache)
    if spec.factory is None:
        raise KVBenchError(
            f"--draft prompt-lookup needs a cache to crop rejected draft tokens from; --cache {cache} keeps none: "
            "use --cache dynamic (or another cache that implements crop)"
        )
    if "crop" in missing_lifecycle(probe_layer(spec)):
        raise KVBenchError(
            f"--draft prompt-lookup crops the cache after each verification; cache {cache!r} does not implement "
            "crop: use a cache that does (every built-in one except none), or drop --draft"
        )


def generate_rules(o: GenerateChoices, n_prompts: int) -> None:
    """`kvbench generate` (cli/generate.py GenerateOptions), before the tokenizer and the model: one new token at
    least, the batch, the cache, the compile mode, sampling and drafting."""
    new_tokens(o.new_tokens, 1, "generate makes at least one token")
    run_batch(n_prompts, "the number of prompts")
    get_cache_spec(o.cache)
    compile_mode(o.compile, caches=[o.cache])
    sampling_rules(o.temperature, o.top_k, o.seed)
    draft_rules(o.draft, o.draft_tokens, o.ngram, o.cache, n_prompts, o.temperature, o.compile)


def padding_rule(cache: str, lengths: Sequence[int]) -> None:
    """Prompts of different lengths run as a left-padded batch; a design that evicts by position (`padding=False`
    on its spec: its slots are positions, not columns) takes none."""
    if len(set(lengths)) > 1 and not get_cache_spec(cache).padding:
        raise KVBenchError(
            f"cache {cache} evicts by position and takes no left-padded batch, but the prompts encode to "
            f"{listed(lengths)} tokens: give prompts of one length, or run them one at a time"
        )
