"""bench's rules: a sweep's settings checked before any work (ranges, names, duplicates, an empty sweep, combinations
that would be silently ignored), and bench --hf's, which refuse what chooses our GPT-2 or its engine.

They read the engine, cache and compile registries, so they live here beside bench's settings, never in validate.py.
"""

from __future__ import annotations

from kvbench.bench.choices import BenchSettings
from kvbench.bench.timing_stats import DEFAULT_PERCENTILES
from kvbench.errors import KVBenchError, listed
from kvbench.validate import MAX_RUN_BATCH, REPEATS, THREADS, WARMUP, new_tokens, seed, tp_rules


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _value_rules(s: BenchSettings) -> None:
    """Each value on its own: no empty text, the dtype's canonical name, the batch sizes (each once), the run counts,
    the seed and the new tokens."""
    from kvbench import dtypes

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


def bench_rules(s: BenchSettings) -> None:
    """A bench sweep's settings (bench/choices.py BenchSettings), from the TOML file and the command line, types
    already checked: ranges, names, duplicates (a prompt length, batch, cache or engine given twice runs once, so
    they are normalised here), an empty sweep, and combinations that would be silently ignored."""
    # the registries load torch: imported when the rules run, so importing the CLI leaves torch unloaded and the
    # command can still ask for huge pages first (cli/__init__.py)
    from kvbench.bench.engines import ENGINES
    from kvbench.caches import parse_cache_names
    from kvbench.decode.rules import compile_mode
    from kvbench.peers import FAMILIES, expand

    _value_rules(s)
    if not s.prompt_len:
        raise KVBenchError("--prompt-len is empty; give one or more prompt lengths, e.g. 16,128,512")
    if min(s.prompt_len) < 1:
        raise KVBenchError(f"--prompt-len values must be >= 1, got {listed(p for p in s.prompt_len if p < 1)}")
    s.prompt_len = list(dict.fromkeys(s.prompt_len))
    if not s.caches:
        raise KVBenchError("--caches is empty; name one or more caches, or 'all'")
    s.caches = parse_cache_names(",".join(s.caches))  # validated, each once
    names = [*ENGINES, *FAMILIES]
    if not s.engine:
        raise KVBenchError(f"--engine is empty; name one or more of {', '.join(names)}")
    for e in s.engine:
        if e not in names:
            raise KVBenchError(f"unknown engine {e!r}; engines: {', '.join(names)}")
    s.engine = expand(s.engine)  # a peer family (ct2) is its peers, each engine once
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
    _peer_rules(s)
    for e in s.engine:
        if not any(ENGINES[e].supports(c) for c in s.caches):
            runs = [c for c in ("none", "dynamic", "static") if ENGINES[e].supports(c)]
            raise KVBenchError(
                f"engine {e} runs none of the caches asked for ({', '.join(s.caches)}): it runs "
                f"{', '.join(runs)}; add one of them to --caches or drop {e} from --engine"
            )


def _peer_rules(s: BenchSettings) -> None:
    """Peer engines (CTranslate2) run kvbench's float32 weights on the CPU (--fill random: _random_fill_rules)."""
    from kvbench.peers import PEERS

    peers = [e for e in s.engine if e in PEERS]
    if not peers:
        return
    if s.profile and len(peers) == len(s.engine):
        raise KVBenchError(
            f"--profile with --engine {','.join(peers)}: a peer's step runs in its own code, which torch's profiler "
            "does not see; add --engine kvbench (or hf) to profile those rows, or drop --profile"
        )
    if s.device not in ("cpu", "auto") or s.dtype not in ("fp32", "float32", "auto"):
        raise KVBenchError(
            f"--engine {','.join(peers)}: peers run kvbench's float32 weights on the CPU here; use --device cpu "
            f"--dtype fp32 (got --device {s.device} --dtype {s.dtype})"
        )
    one_sequence = [p for p in peers if not PEERS[p].batches]
    if one_sequence and max(s.batch) > 1:
        raise KVBenchError(
            f"--batch {max(s.batch)} with --engine {','.join(one_sequence)}: llama.cpp's peer decodes one sequence "
            "at a time (llama-cpp-python's Llama holds one); use --batch 1 or drop it"
        )


def _tp_bench_rules(s: BenchSettings) -> None:
    """bench --tp N (N > 1): what the ranks cannot run in step is refused before any rank starts."""
    from kvbench.peers import PEERS

    others = [e for e in s.engine if e != "kvbench"]
    peers = [e for e in others if e in PEERS]
    if peers:
        raise KVBenchError(
            f"--engine {','.join(peers)} with --tp {s.tp}: a peer engine runs in one process here, with its own "
            "threads; use --engine kvbench, or drop --tp"
        )
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


def bench_hf_rules(raw: dict, given: dict, config: object) -> None:
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


def _random_fill_rules(s: BenchSettings) -> None:
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
