"""Every range and consistency rule of kvbench's options, checked once at the boundary, before any work.

The command line and a bench TOML file both pass through here; the library then asserts what it was promised instead
of checking again. Each bound is defined once, for one meaning, with its reason beside it. A rule that fails is one
KVBenchError naming the option, the value and the fix, so a typo (`--prompt-len 200000`, `--batch 100000`) fails in
milliseconds instead of growing until the kernel kills the process.

    bounds               SEED_MAX, MAX_RUN_BATCH, MAX_PLAN_BATCH, REPEATS, ...
    values               integer, real, seed, new_tokens, run_batch, names
    the model's context  past_context, context_error, fits_context
    per command          generate_rules, draft_rules, verify_rules, break_rules, bench_rules, memory_rules,
                         compare_rules; compile_mode (every command that runs a step)

What a value names (a cache, an engine, a fault, a model) is looked up in its registry, which refuses an unknown
name; files are read through files.py, which refuses what cannot be read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvbench.errors import KVBenchError, listed, shown

# --- bounds, one per meaning -----------------------------------------------------------------------------------------
SEED_MAX = 2**64 - 1  # what torch.Generator.manual_seed takes (a 64-bit unsigned seed)
# Sequences one run decodes together (generate's prompts, verify's and break's batches, a bench batch): a million
# sequences of even one token of gpt2's K/V are 36 GiB in fp16, beyond which nothing runs anywhere. A bench batch that
# does not fit the device is an `oom` row, judged against its memory, not refused here.
MAX_RUN_BATCH = 1 << 20
# Sequences in a memory plan: arithmetic only, nothing allocated; far above any deployment, low enough to stay exact.
MAX_PLAN_BATCH = 2**31
REPEATS = (1, 10_000)  # bench --repeats: timed runs per configuration
WARMUP = (0, 10_000)  # bench --warmup: untimed runs before them
THREADS = (1, 4096)  # bench --threads: torch intra-op threads
MAX_DRAFT_TOKENS = 64  # --draft-tokens: one forward verifies at most this many
MAX_NGRAM = 16  # --ngram: the longest suffix looked up
TEMPERATURE_MAX = 1e6  # --temperature: beyond it sampling is uniform to float precision
MAX_TP = 1024  # --tp: ranks of one tensor-parallel group (the largest NVLink domains hold 72 GPUs)


# --- values ----------------------------------------------------------------------------------------------------------
def integer(name: str, value: object, lo: int | None = None, hi: int | None = None, why: str = "") -> int:
    """`value` as an int within [lo, hi]; bools and floats (even 3.0 from a TOML file) are refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVBenchError(f"{name} must be an integer, got {shown(value)}")
    if lo is not None and value < lo:
        raise KVBenchError(f"{name} must be >= {lo}, got {value}" + (f" ({why})" if why else ""))
    if hi is not None and value > hi:
        raise KVBenchError(f"{name} must be <= {hi:,}, got {value:,}" + (f" ({why})" if why else ""))
    return value


def real(name: str, value: object, lo: float | None = None, hi: float | None = None) -> float:
    """A finite float within [lo, hi]: NaN and infinities are refused by name."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KVBenchError(f"{name} must be a number, got {shown(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise KVBenchError(f"{name} must be a finite number, got {value}")
    if lo is not None and value < lo:
        raise KVBenchError(f"{name} must be >= {lo:g}, got {value:g}")
    if hi is not None and value > hi:
        raise KVBenchError(f"{name} must be <= {hi:g}, got {value:g}")
    return value


def seed(value: object, name: str = "--seed") -> int:
    return integer(name, value, 0, SEED_MAX, "a seed is a non-negative 64-bit integer")


def new_tokens(value: object, least: int, why: str) -> int:
    """--new-tokens of a command that needs at least `least` of them (`why`: what needs them)."""
    return integer("--new-tokens", value, least, why=why)


def run_batch(value: object, name: str = "--batch", least: int = 1, why: str = "") -> int:
    return integer(name, value, least, MAX_RUN_BATCH, why)


def one_of(name: str, value: str, choices: Sequence[str], fix: str = "") -> str:
    if value not in choices:
        raise KVBenchError(f"{name} {shown(value)}: use {' or '.join(choices)}" + (f" ({fix})" if fix else ""))
    return value


def reference(value: str) -> str:
    if value not in ("hf", "none"):
        raise KVBenchError(f"--reference must be hf or none, got {shown(value)}")
    return value


def only_with_hf(hf: str | None, **given: bool) -> None:
    """Options that choose what --hf loads, given without it (`given`: flag -> whether it was given)."""
    for flag, on in given.items():
        if on and hf is None:
            raise KVBenchError(f"{flag} applies to --hf models only")


def not_with_hf(**given: bool) -> None:
    """Options that choose our GPT-2 have no meaning with --hf: name the first one given."""
    for flag, on in given.items():
        if on:
            raise KVBenchError(f"{flag} chooses kvbench's own GPT-2; with --hf the model is SOURCE, drop {flag}")


# --- the model's context ---------------------------------------------------------------------------------------------
def past_context(tokens: int, context: int | None) -> bool:
    """The rule every run is held to: its tokens (prompt + new tokens) may fill the model's context, never pass it
    (learned positions stop there). `context` None: the model has no configured maximum."""
    return context is not None and tokens > context


def context_error(
    subject: str,
    context: int,
    fix: str,
    whose: str = "the model's",
    why: str = "",
    detail: str = "",
    grouped: bool = True,
) -> KVBenchError:
    """The one line for a run past the model's context: '{subject} exceeds {whose} context of {context} tokens
    ({why}): {detail}; {fix}', the parenthesis only with a `why` and the colon only with a `detail`. `grouped`: the
    context written with thousands separators."""
    ctx = f"{context:,}" if grouped else str(context)
    why = f" ({why})" if why else ""
    detail = f": {detail}" if detail else ""
    return KVBenchError(f"{subject} exceeds {whose} context of {ctx} tokens{why}{detail}; {fix}")


def fits_context(
    what: str,
    prompt_len: int | Sequence[int],
    new_tokens: int,
    context: int | None,
    fix: str,
    whose: str = "the model's",
    grouped: bool = True,
) -> None:
    """Each prompt length + `new_tokens` within `context` (past_context); else one context_error naming the ones
    that are not (the first few and a count: errors.listed). One prompt: '{what} P + new tokens N = T exceeds ...';
    a sweep's list of prompt lengths: '{what} + new tokens exceeds ...: P + N = T, ...'."""
    if context is None:  # no configured maximum: nothing to pass
        return
    n = (lambda x: f"{x:,}") if grouped else str
    if isinstance(prompt_len, int):
        if past_context(prompt_len + new_tokens, context):
            subject = f"{what} {n(prompt_len)} + new tokens {n(new_tokens)} = {n(prompt_len + new_tokens)}"
            raise context_error(subject, context, fix, whose, grouped=grouped)
        return
    bad = [p for p in prompt_len if past_context(p + new_tokens, context)]
    if bad:
        sums = listed(f"{n(p)} + {n(new_tokens)} = {n(p + new_tokens)}" for p in bad)
        raise context_error(f"{what} + new tokens", context, fix, whose, detail=sums, grouped=grouped)


# --- the commands ----------------------------------------------------------------------------------------------------
def compile_mode(mode: str, device_type: str | None = None, caches: list[str] | None = None) -> str:
    """`--compile` for a step on `device_type`: one of COMPILE_MODES, max on the CPU only (not checked where the
    device is not known yet: None); other than off, only where one of `caches` (when given) has a fixed-shape
    step, since nothing else is compiled."""
    from kvbench.caches import get_cache_spec
    from kvbench.decode.fixed_step import COMPILE_MODES

    if mode not in COMPILE_MODES:
        raise KVBenchError(
            f"--compile {mode!r}: use off (the eager step), default (torch.compile) or max (CPU: frozen weights, "
            "autotuned C++ GEMMs)"
        )
    if caches is not None and mode != "off" and not any(get_cache_spec(c).fixed_step for c in caches):
        runs = ", ".join(caches) or "none of kvbench's"
        raise KVBenchError(
            f"--compile {mode} compiles the fixed-shape decode step of static-graph; the caches run here ({runs}) "
            "have none, so nothing would be compiled: add static-graph or drop --compile"
        )
    if mode == "max" and device_type not in (None, "cpu"):
        raise KVBenchError(
            f"--compile max compiles the CPU decode step (frozen weights, C++ GEMM templates); on {device_type} "
            "use --compile default"
        )
    return mode


def sampling_rules(temperature: float, top_k: int | None, seed_: int) -> None:
    real("--temperature", temperature, 0.0, TEMPERATURE_MAX)
    if top_k is not None:
        integer("--top-k", top_k, 1)
        if temperature == 0:
            raise KVBenchError(
                f"--top-k {top_k} has no effect at --temperature 0 (greedy decoding takes the argmax); "
                "give --temperature > 0 to sample, or drop --top-k"
            )
    seed(seed_)


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
    from kvbench.caches import get_cache_spec
    from kvbench.caches.plugins import missing_lifecycle, probe_layer

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


def generate_rules(o: Any, n_prompts: int) -> None:
    """`kvbench generate` (cli/generate.py GenerateOptions), before the tokenizer and the model: one new token at
    least, the batch, the cache, the compile mode, sampling and drafting."""
    from kvbench.caches import get_cache_spec

    new_tokens(o.new_tokens, 1, "generate makes at least one token")
    run_batch(n_prompts, "the number of prompts")
    get_cache_spec(o.cache)
    compile_mode(o.compile, caches=[o.cache])
    sampling_rules(o.temperature, o.top_k, o.seed)
    draft_rules(o.draft, o.draft_tokens, o.ngram, o.cache, n_prompts, o.temperature, o.compile)


def padding_rule(cache: str, lengths: Sequence[int]) -> None:
    """Prompts of different lengths run as a left-padded batch; a design that evicts by position (`padding=False`
    on its spec: its slots are positions, not columns) takes none."""
    from kvbench.caches import get_cache_spec

    if len(set(lengths)) > 1 and not get_cache_spec(cache).padding:
        raise KVBenchError(
            f"cache {cache} evicts by position and takes no left-padded batch, but the prompts encode to "
            f"{listed(lengths)} tokens: give prompts of one length, or run them one at a time"
        )


CHECKED_NEW_TOKENS = 2  # verify and break: the logits check (and a fault) needs at least one decode step


def tp_rules(tp: int, timeout: float, compile: str = "off") -> None:
    """--tp and --tp-timeout, before the model's shape is known (tp_shape_rules then)."""
    integer("--tp", tp, 1, MAX_TP)
    real("--tp-timeout", timeout, 1.0, 7 * 24 * 3600.0)
    if tp > 1 and compile != "off":
        raise KVBenchError(
            f"--compile {compile} with --tp {tp}: the compiled decode step is not built for the all-reduce between "
            "ranks; drop --compile (static-graph still runs its eager fixed-shape step)"
        )


def tp_shape_rules(tp: int, what: str, heads: int, kv_heads: int, width: int | None = None) -> None:
    """A model `what` split over `tp` ranks: its attention heads, KV heads (and MLP width) must divide by tp, or a
    rank would hold part of a head; transformers' own tensor parallelism loads such a model without a word and fails
    in its first forward (transformers #48307)."""
    if tp == 1:
        return
    parts = [("attention heads", heads), ("key/value heads", kv_heads)] + ([("MLP width", width)] if width else [])
    for name, n in parts:
        if n % tp:
            raise KVBenchError(
                f"--tp {tp}: {what} has {heads} attention heads and {kv_heads} key/value heads, and {n} {name} do "
                f"not divide over {tp} ranks, so a rank would hold part of a head (transformers' TP loads such a "
                f"model without a warning and fails in its first forward, transformers #48307); use a --tp that "
                f"divides {n}"
            )


def verify_rules(o: Any) -> None:
    """`kvbench verify` (cli/verify.py VerifyOptions), before any model is loaded."""
    new_tokens(o.new_tokens, CHECKED_NEW_TOKENS, "the logits check needs a decode step")
    run_batch(o.batch, least=2, why="the batched check needs prompts of different lengths")
    integer(
        "--prompt-len",
        o.prompt_len,
        o.batch,
        why=f"{o.batch} prompts of distinct lengths need that many tokens",
    )
    seed(o.seed)
    tp_rules(o.tp, o.tp_timeout, o.compile)
    if o.hf is None:
        only_with_hf(o.hf, **{"--trust-remote-code": o.trust_remote_code, "--layers": o.layers is not None})
        reference(o.reference)
    else:
        not_with_hf(
            **{
                "--model": o.model is not None,
                "--weights": o.weights != "auto",
                "--reference": o.reference != "hf",
                "--compile": o.compile != "off",
            }
        )


def break_rules(o: Any) -> None:
    """`kvbench break` (cli/break_.py BreakOptions), before any model is loaded."""
    new_tokens(o.new_tokens, CHECKED_NEW_TOKENS, "a fault shows from the first decode step")
    if o.batch < 2:
        why = "padding needs >= 2 prompts of different lengths: with one prompt nothing is padded, the bug is dormant"
        raise KVBenchError(f"--batch {o.batch}: {why}; use --batch 2 or more")
    run_batch(o.batch, least=2)
    reference(o.reference)
    seed(o.seed)
    tp_rules(o.tp, o.tp_timeout)


# --- bench -----------------------------------------------------------------------------------------------------------
def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def bench_rules(s: Any) -> None:
    """A bench sweep's settings (bench/settings.py BenchSettings), from the TOML file and the command line, types
    already checked: ranges, names, duplicates (a prompt length, batch, cache or engine given twice runs once, so
    they are normalised here), an empty sweep, and combinations that would be silently ignored."""
    from kvbench import dtypes
    from kvbench.bench.engines import ENGINES
    from kvbench.caches import parse_cache_names

    for key in ("model", "weights", "device", "dtype"):
        value = getattr(s, key)
        if value is not None and not value.strip():
            raise KVBenchError(f"{_flag(key)} is empty; give a value or leave the option out")
    # any spelling (half, torch.bfloat16, ...) -> the canonical name, which settings.json records
    s.dtype = dtypes.canonical(s.dtype, "--dtype", dtypes.FLOATS, extra=("auto",))
    if not s.batch:
        raise KVBenchError("--batch is empty; give one or more batch sizes, e.g. 1,4,16")
    if min(s.batch) < 1:
        raise KVBenchError(f"--batch values must be >= 1, got {listed(b for b in s.batch if b < 1)}")
    if max(s.batch) > MAX_RUN_BATCH:
        raise KVBenchError(f"--batch values must be at most {MAX_RUN_BATCH:,}, got {max(s.batch):,}")
    s.batch = list(dict.fromkeys(s.batch))
    for key, (lo, hi) in (("repeats", REPEATS), ("warmup", WARMUP), ("threads", THREADS)):
        value = getattr(s, key)
        if value is not None and not lo <= value <= hi:
            raise KVBenchError(f"{_flag(key)} must be between {lo} and {hi}, got {value}")
    seed(s.seed)
    new_tokens(s.new_tokens, 2, "one prefill token + decode steps")
    if not s.prompt_len:
        raise KVBenchError("--prompt-len is empty; give one or more prompt lengths, e.g. 16,128,512")
    if min(s.prompt_len) < 1:
        raise KVBenchError(f"--prompt-len values must be >= 1, got {listed(p for p in s.prompt_len if p < 1)}")
    s.prompt_len = list(dict.fromkeys(s.prompt_len))
    if not s.caches:
        raise KVBenchError("--caches is empty; name one or more caches, or 'all'")
    s.caches = parse_cache_names(",".join(s.caches))  # validated, each once
    if not s.engine:
        raise KVBenchError(f"--engine is empty; name one or more of {', '.join(ENGINES)}")
    for e in s.engine:
        if e not in ENGINES:
            raise KVBenchError(f"unknown engine {e!r}; engines: {', '.join(ENGINES)}")
    s.engine = list(dict.fromkeys(s.engine))
    if s.fill not in ("prefill", "random"):
        raise KVBenchError(f"--fill {s.fill!r}: use prefill (a real prefill, the default) or random")
    compile_mode(s.compile, caches=s.caches if "kvbench" in s.engine else [])
    if s.order not in ("sequential", "interleaved"):
        raise KVBenchError(
            f"--order {s.order!r}: use sequential (each configuration's runs back to back, the default) or "
            "interleaved (timed runs in rounds over the configurations of a prompt length)"
        )
    tp_rules(s.tp, s.tp_timeout, s.compile)
    if s.fill == "random":
        _random_fill_rules(s)
    if s.tp > 1:
        _tp_bench_rules(s)
    for e in s.engine:
        if not any(ENGINES[e].supports(c) for c in s.caches):
            runs = [c for c in ("none", "dynamic", "static") if ENGINES[e].supports(c)]
            raise KVBenchError(
                f"engine {e} runs none of the caches asked for ({', '.join(s.caches)}): it runs "
                f"{', '.join(runs)}; add one of them to --caches or drop {e} from --engine"
            )


def _tp_bench_rules(s: Any) -> None:
    """bench --tp N (N > 1): what the ranks cannot run in step is refused before any rank starts."""
    others = [e for e in s.engine if e != "kvbench"]
    if others:
        raise KVBenchError(
            f"--engine {','.join(others)} with --tp {s.tp}: transformers' engines cannot split GPT-2 (it has no "
            "tensor-parallel plan in transformers); use --engine kvbench, or --hf SOURCE for a model transformers "
            "splits itself"
        )
    if s.fill == "random":
        raise KVBenchError(f"--fill random with --tp {s.tp}: the context sweep runs in one process; drop --tp")
    if s.order != "sequential":
        raise KVBenchError(
            f"--order interleaved with --tp {s.tp}: ranks hold one configuration at a time; use --order sequential"
        )
    if s.profile:
        raise KVBenchError(f"--profile with --tp {s.tp}: the profiler traces one process; drop --profile or --tp")


def bench_hf_tp_rules(tp: int, caches: list[str]) -> None:
    """bench --hf --tp N: no compiled decode step (one is not built for the collectives between ranks)."""
    from kvbench.hf.caches import compiles

    compiled = [c for c in caches if compiles(c)]
    if tp > 1 and compiled:
        raise KVBenchError(
            f"--caches {','.join(compiled)} with --tp {tp}: the compiled decode step is not built for the "
            f"all-reduce between ranks; drop {','.join(compiled)} (static runs the same cache eagerly)"
        )


def bench_hf_rules(raw: dict, given: dict, config: Any) -> None:
    """bench --hf's settings as read (the TOML file's keys, then the options `given`): what chooses our GPT-2 or its
    engine is refused, naming where it came from (the --config file, or the option)."""

    def from_file(key: str) -> bool:
        return given.get(key) is None  # in raw, but not given as an option: the --config file set it

    if raw.get("fill") == "random":  # checked first: it also brings its own defaults (engine kvbench, ...)
        what = f"--config {config} sets fill = random" if from_file("fill") else "--fill random"
        raise KVBenchError(
            f"{what}: random-filled caches are timed on kvbench's own GPT-2 only; with --hf the engine is "
            "transformers' generate, which fills its cache with a real prefill: use --fill prefill (the default)"
        )
    if raw.get("compile", "off") != "off":
        what = (
            f"--config {config} sets compile = {raw['compile']}"
            if from_file("compile")
            else f"--compile {raw['compile']}"
        )
        raise KVBenchError(
            f"{what}: --compile runs kvbench's own fixed-shape decode step; with --hf transformers' generate runs "
            "the model (its compiled static cache is --caches static-compiled)"
        )
    for key in ("model", "weights"):
        if key in raw:
            what, fix = (
                (f"--config {config} sets {key}, which", f"remove {key} from it")
                if from_file(key)
                else (f"--{key}", f"drop --{key}")
            )
            raise KVBenchError(f"{what} chooses kvbench's own GPT-2; with --hf the model is SOURCE: {fix}")
    engine = raw.get("engine")
    if engine is not None and list(dict.fromkeys(engine)) != ["hf"]:
        names = ",".join(engine) or repr("")
        what, fix = (
            (f"--config {config} sets engine = {names}", "remove engine from it")
            if from_file("engine")
            else (f"--engine {names}", "drop --engine")
        )
        raise KVBenchError(
            f"{what}: with --hf the one engine is transformers' generate on the model (hf; its compiled static cache "
            f"is --caches static-compiled); {fix}"
        )


def _random_fill_rules(s: Any) -> None:
    from kvbench.bench.timing_stats import DEFAULT_PERCENTILES

    if "none" in s.caches:
        raise KVBenchError(
            "--fill random times decode steps over a filled cache, and `none` has no cache to fill; "
            "drop none from --caches"
        )
    others = [e for e in s.engine if e != "kvbench"]
    if others:
        raise KVBenchError(
            f"--fill random runs only --engine kvbench (transformers' generate cannot start from a cache filled "
            f"without a prefill); drop {', '.join(others)}"
        )
    if s.order != "sequential":
        raise KVBenchError("--order interleaved applies to prefill sweeps; --fill random holds one cache at a time")
    if s.profile:
        raise KVBenchError("--profile traces prefill sweeps; it does not apply to --fill random")
    if len(s.batch) > 1:
        raise KVBenchError(
            f"--fill random sweeps contexts at one batch size, got --batch {listed(s.batch, sep=',')}; "
            "run one sweep per batch size, or sweep batch sizes with a prefill sweep"
        )
    if s.percentiles != list(DEFAULT_PERCENTILES):
        raise KVBenchError(
            "--percentiles applies to prefill sweeps; --fill random writes its own tpot_ms_p10 and tpot_ms_p90"
        )


# --- memory ----------------------------------------------------------------------------------------------------------
# option -> (the runs it belongs to, how to say so). A given option outside its run would be silently ignored.
_MEMORY_SCOPE = {
    "--from": ("copy", "--from and --to go with --copy-traffic"),
    "--to": ("copy", "--from and --to go with --copy-traffic"),
    "--lengths": ("measure", "--lengths goes with --measure (it fills a real paged cache)"),
    "--device": ("measure copy", "--device goes with --measure or --copy-traffic (a plan allocates nothing)"),
    "--caches": ("measure", "--caches goes with --measure (it names the caches to allocate)"),
    "--gpu": ("plan", "--gpu sizes a plan; --measure and --copy-traffic do not use it"),
    "--gpu-mem": ("plan", "--gpu-mem sizes a plan; --measure and --copy-traffic do not use it"),
    "--tp": ("plan", "--tp splits a plan over GPUs; --measure and --copy-traffic do not use it"),
    "--tp-engine": (
        "plan",
        "--tp-engine says how --tp splits a plan; --measure and --copy-traffic do not use it",
    ),
    "--weights-dtype": (
        "plan",
        "--weights-dtype sizes a plan's weights; --measure and --copy-traffic do not",
    ),
    "--check": ("plan", "--check checks a plan: use it without --measure and --copy-traffic"),
    "--bandwidth": (
        "plan",
        "--bandwidth gives a plan its decode floor; --measure and --copy-traffic do not use it",
    ),
    "--plot": ("plan", "--plot draws a plan; --measure and --copy-traffic do not make one"),
}


def memory_rules(o: Any, batches: list[int]) -> None:
    """`kvbench memory` (memory/request.py Options), its --batch list read: combinations that would be silently
    ignored, and the bounds."""
    if o.all_ and (o.model or o.config is not None):
        raise KVBenchError("use --all or --model/--config, not both")
    if o.gpu is not None and o.gpu_mem is not None:
        raise KVBenchError("use --gpu or --gpu-mem, not both")
    runs = ({"measure"} if o.measure else set()) | ({"copy"} if o.copy_traffic else set()) or {"plan"}
    given = {
        "--from": o.from_ is not None,
        "--to": o.to is not None,
        "--lengths": o.lengths is not None,
        "--device": o.device is not None,
        "--caches": o.caches is not None,
        "--gpu": o.gpu is not None,
        "--gpu-mem": o.gpu_mem is not None,
        "--tp": o.tp is not None,
        "--weights-dtype": o.weights_dtype is not None,
        "--tp-engine": o.tp_engine is not None,
        "--check": o.check,
        "--bandwidth": o.bandwidth is not None,
        "--plot": o.plot is not None,
    }
    for opt, on in given.items():
        scope, why = _MEMORY_SCOPE[opt]
        if on and not runs & set(scope.split()):
            raise KVBenchError(why)
    if o.overhead is not None and o.gpu is None and o.gpu_mem is None:
        raise KVBenchError("--overhead goes with --gpu or --gpu-mem (it is set aside from the GPU's memory)")
    if o.check and o.all_:
        raise KVBenchError("--check builds each model on the meta device: name them with --model or --config")
    if o.measure and (o.all_ or o.config is not None or not o.model or len(o.model) != 1):
        raise KVBenchError("--measure takes one gpt2-family --model (gpt2, gpt2-medium, gpt2-large, gpt2-xl)")
    for b in batches:
        if not 1 <= b <= MAX_PLAN_BATCH:
            raise KVBenchError(f"--batch {b} must be from 1 to {MAX_PLAN_BATCH:,}")
    if len(batches) > 1 and (o.measure or o.copy_traffic or o.all_):
        raise KVBenchError("--measure, --copy-traffic and --all take one --batch; a list goes with --model")
    if o.tp is not None and o.tp < 1:
        raise KVBenchError(f"--tp {o.tp} must be at least 1")
    if o.tp_engine is not None:
        from kvbench.memory.formulas import TP_ENGINES

        one_of("--tp-engine", o.tp_engine, TP_ENGINES)
        if o.tp is None:
            raise KVBenchError("--tp-engine says how --tp splits the KV heads: give --tp too")
    if o.plot is not None:
        if o.gpu is None and o.gpu_mem is None:
            raise KVBenchError("--plot draws against a GPU's memory: give --gpu h100 or --gpu-mem 80GiB")
        if o.all_:
            raise KVBenchError("--plot draws the models named with --model (or --config), not --all")


def copy_range_rules(n0: int, n1: int) -> None:
    """`memory --copy-traffic --from N0 --to N1` (defaults filled in)."""
    from kvbench.memory.units import MAX_TOKENS

    if n0 < 0 or n1 <= n0:
        raise KVBenchError(f"--from {n0} --to {n1}: need 0 <= from < to")
    if n1 > MAX_TOKENS:
        raise KVBenchError(f"--to {n1} is more than {MAX_TOKENS:,} tokens (2^40)")


# --- the environment -------------------------------------------------------------------------------------------------
PROBE_ENV = "KVBENCH_PROBE_BYTES"  # the bandwidth probe's size in bytes; read by bench/floor.py
# 1 MiB (a smaller probe sits in a cache) to 1 TiB (more than any device's memory)
PROBE_MIN, PROBE_MAX = 1 << 20, 1 << 40


def probe_bytes_setting(text: str) -> int | None:
    """`$KVBENCH_PROBE_BYTES`: unset or empty -> None (the probe sizes itself); else a decimal byte count from 1 MiB
    to 1 TiB. Anything else is refused."""
    value = text.strip()
    if not value:
        return None
    n = int(value) if value.isascii() and value.isdigit() and len(value) <= 20 else None
    if n is None or not PROBE_MIN <= n <= PROBE_MAX:
        raise KVBenchError(
            f"{PROBE_ENV}={text[:40]!r}: give the probe's size in bytes, from {PROBE_MIN} (1 MiB) to {PROBE_MAX} "
            "(1 TiB), or leave it unset"
        )
    return n
