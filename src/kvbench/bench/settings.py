"""bench's settings: one sweep from defaults, a TOML file and command-line options, validated before any work.

Everything here runs before a model is loaded or anything is allocated: keys and types (integers are integers, never
truncated), ranges, duplicates (a prompt length, cache or engine given twice runs once), an empty sweep (named:
which engine runs none of the caches asked for), the model's context and the device's memory against the largest
configuration.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from kvbench import devices, dtypes, files, validate
from kvbench.bench.engines import ENGINES
from kvbench.bench.timing_stats import DEFAULT_PERCENTILES, parse_percentiles
from kvbench.caches import CACHES, parse_cache_names
from kvbench.decode.fixed_step import check_compile
from kvbench.errors import KVBenchError, NotEnoughMemoryError
from kvbench.model.gpt2 import GPTConfig


@dataclass
class BenchSettings:
    """One sweep. Every field can come from a TOML file in configs/bench/ and be overridden on the command line."""

    # preset name or GPT-2 config.json; None: gpt2, or the checkpoint's own with --weights
    model: str | None = None
    weights: str = "auto"  # auto | hub | random | PATH
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # fp16 on CUDA, fp32 on the CPU
    seed: int = 0  # random weights and the random prompt ids
    # a short, a medium and a long prompt
    prompt_len: list[int] = field(default_factory=lambda: [16, 128, 512])
    new_tokens: int = 400  # generated tokens per run (the first from the prefill, the rest decode steps)
    caches: list[str] = field(default_factory=lambda: list(CACHES))  # every registered cache by default
    engine: list[str] = field(default_factory=lambda: ["kvbench", "hf"])  # hf-compiled on request
    # sequences per run (same length, no padding); several: a batch sweep (rows per batch size, batch.png)
    batch: list[int] = field(default_factory=lambda: [1])
    repeats: int = 3  # timed runs per configuration
    warmup: int = 1  # runs before the timed ones, same shapes; the first of them is the reported cold run
    out: str | None = None  # run directory; None: results/<timestamp>-bench/
    threads: int | None = None  # torch intra-op CPU threads; None: torch's default (one per core)
    fill: str = "prefill"  # prefill: a real prefill fills the cache; random: random K/V, decode timed only
    order: str = "sequential"  # sequential: each configuration's runs back to back; interleaved: in rounds
    # off | default | max: how static-graph's fixed-shape decode step runs (decode/fixed_step.py)
    compile: str = "off"
    # one more warm run per configuration under torch.profiler: a trace in profile/, its top operators (profile.py)
    profile: bool = False
    # TPOT percentiles in summary.csv (tpot_ms_pNN; 50 and 90 are always there as tpot_ms_median, tpot_ms_p90)
    percentiles: list[float] = field(default_factory=lambda: list(DEFAULT_PERCENTILES))


@dataclass
class BenchOverrides:
    """The command line's values for BenchSettings' fields: None for an option left out (the TOML file or the
    default decides). Lists are comma-separated text, checked by `coerce` as a TOML file's values are."""

    prompt_len: str | None = None
    new_tokens: int | None = None
    caches: str | None = None
    engine: str | None = None
    batch: str | None = None
    repeats: int | None = None
    warmup: int | None = None
    model: str | None = None
    weights: str | None = None
    device: str | None = None
    dtype: str | None = None
    seed: int | None = None
    threads: int | None = None
    out: str | None = None
    fill: str | None = None
    order: str | None = None
    compile: str | None = None
    profile: bool | None = None
    percentiles: str | None = None

    def given(self) -> dict:
        """The options that were given, by field name, in field order (the order `coerce` checks them in)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


FILLS = ("prefill", "random")
ORDERS = ("sequential", "interleaved")
# With --fill random a sweep times decode steps at long contexts (bench/context.py): no `none` (nothing to fill), only our
# engine (transformers' generate cannot start from a filled cache), and a few dozen steps per context.
FILL_RANDOM_DEFAULTS = {
    "caches": lambda: [c for c in CACHES if c != "none"],
    "engine": lambda: ["kvbench"],
    "new_tokens": lambda: 32,
}


SETTING_KEYS = tuple(f.name for f in fields(BenchSettings))
BOOL_KEYS = ("profile",)
INT_KEYS = ("new_tokens", "repeats", "warmup", "seed", "threads")
K = 1024  # --prompt-len 4k = 4,096 tokens
# Sane bounds checked before anything is loaded or allocated (sizes that depend on the model are checked against
# its context and the device's memory in check_sizes).
MAX_BATCH = 1 << 20  # sequences per run; a larger batch needs a device no one has for GPT-2
LIMITS = {"repeats": (1, 10_000), "warmup": (0, 10_000), "threads": (1, 4096), "seed": (0, 2**64 - 1)}
_INT_TEXT = re.compile(r"([+-]?\d+)([kK]?)")


def _whole(value, key: str, where: str) -> int:
    """An integer from TOML (int, not bool or float) or the command line (decimal digits, or with a k suffix:
    4k = 4 x 1,024); anything else is an error, never truncated."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _INT_TEXT.fullmatch(value.strip()) if isinstance(value, str) else None
    if m:
        return int(m.group(1)) * (K if m.group(2) else 1)
    raise KVBenchError(
        f"{where}: {key} must be whole numbers, got {value!r} (a k suffix is x1024: 4k = 4096)"
    )


def _as_list(key: str, value, where: str, integers: bool) -> list:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple):
        value = [value]
    if integers:
        return [_whole(v, key, where) for v in value]
    if not all(isinstance(v, str) for v in value):
        raise KVBenchError(f"{where}: {key} must be names, got {value!r}")
    return [v.strip() for v in value if v.strip()]


def coerce(raw: dict, where: str) -> dict:
    """Validate keys and types of settings from a file or the command line; unknown keys are errors naming them."""
    out = {}
    for key, value in raw.items():
        if key not in SETTING_KEYS:
            raise KVBenchError(f"{where}: unknown key {key!r}; known keys: {', '.join(SETTING_KEYS)}")
        if key in ("prompt_len", "batch"):
            value = _as_list(key, value, where, integers=True)
        elif key in ("caches", "engine"):
            value = _as_list(key, value, where, integers=False)
        elif key == "percentiles":
            value = parse_percentiles(value, f"{where}: percentiles")
        elif key in INT_KEYS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise KVBenchError(f"{where}: {key} must be an integer, got {value!r}")
        elif key in BOOL_KEYS:
            if not isinstance(value, bool):
                raise KVBenchError(f"{where}: {key} must be true or false, got {value!r}")
        elif not isinstance(value, str):
            raise KVBenchError(f"{where}: {key} must be a string, got {value!r}")
        out[key] = value
    return out


def resolve_config_path(path: str | Path) -> Path:
    """A TOML file, or the name of a sweep shipped with kvbench (`seed`, `quick`: configs/bench/NAME.toml)."""
    from kvbench.resources import bench_config_names, config_file

    p = Path(path).expanduser()
    if p.exists() or p.suffix or "/" in str(path):
        fix = f"give a TOML file or one of {', '.join(bench_config_names())}"
        return files.check_file(p, f"--config {p}", fix)
    if str(path) in bench_config_names():
        return config_file("bench", f"{path}.toml")
    raise KVBenchError(
        f"--config {path!r}: no such file, and no shipped sweep of that name; shipped: {', '.join(bench_config_names())}"
    )


def load_settings(path: str | Path | None, overrides: BenchOverrides | dict) -> BenchSettings:
    """Defaults < the TOML file at `path` < `overrides` (the command line: a BenchOverrides, or a dict of its keys;
    None = not given)."""
    s = BenchSettings(**read_settings(path, overrides))
    check_settings(s)
    return s


def read_settings(path: str | Path | None, overrides: BenchOverrides | dict) -> dict:
    """The keys the TOML file at `path` and then `overrides` give (no defaults), keys and types checked."""
    merged: dict = {}
    if path is not None:
        p = resolve_config_path(path)
        data = files.load_toml(p, f"--config {p}", files.CONFIG_BYTES, "a sweep's TOML file")
        merged.update(coerce(data, str(p)))
    if isinstance(overrides, BenchOverrides):
        given = overrides.given()
    else:
        given = {k: v for k, v in overrides.items() if v is not None}
    merged.update(coerce(given, "command line"))
    if merged.get("fill") == "random":
        merged.update({k: make() for k, make in FILL_RANDOM_DEFAULTS.items() if k not in merged})
    return merged


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def check_settings(s: BenchSettings) -> None:
    """Everything that can be checked without the model: types done, now ranges, names, duplicates, emptiness."""
    for key in ("model", "weights", "device", "dtype"):
        value = getattr(s, key)
        if value is not None and not value.strip():
            raise KVBenchError(f"{_flag(key)} is empty; give a value or leave the option out")
    # any spelling (half, torch.bfloat16, ...) -> the canonical name, which settings.json records
    s.dtype = dtypes.canonical(s.dtype, "--dtype", dtypes.FLOATS, extra=("auto",))
    if not s.batch:
        raise KVBenchError("--batch is empty; give one or more batch sizes, e.g. 1,4,16")
    if min(s.batch) < 1:
        raise KVBenchError(f"--batch values must be >= 1, got {s.batch}")
    if max(s.batch) > MAX_BATCH:
        raise KVBenchError(f"--batch values must be at most {MAX_BATCH:,}, got {max(s.batch):,}")
    s.batch = list(dict.fromkeys(s.batch))  # a size given twice runs once
    for key, (lo, hi) in LIMITS.items():
        value = getattr(s, key)
        if value is not None and not lo <= value <= hi:
            raise KVBenchError(f"{_flag(key)} must be between {lo} and {hi}, got {value}")
    if s.new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (one prefill token + decode steps), got {s.new_tokens}"
        )
    if not s.prompt_len:
        raise KVBenchError("--prompt-len is empty; give one or more prompt lengths, e.g. 16,128,512")
    if min(s.prompt_len) < 1:
        raise KVBenchError(f"--prompt-len values must be >= 1, got {s.prompt_len}")
    s.prompt_len = list(dict.fromkeys(s.prompt_len))  # a length given twice runs once
    if not s.caches:
        raise KVBenchError("--caches is empty; name one or more caches, or 'all'")
    s.caches = parse_cache_names(",".join(s.caches))  # validated, each once
    if not s.engine:
        raise KVBenchError(f"--engine is empty; name one or more of {', '.join(ENGINES)}")
    for e in s.engine:
        if e not in ENGINES:
            raise KVBenchError(f"unknown engine {e!r}; engines: {', '.join(ENGINES)}")
    s.engine = list(dict.fromkeys(s.engine))
    if s.fill not in FILLS:
        raise KVBenchError(f"--fill {s.fill!r}: use prefill (a real prefill, the default) or random")
    check_compile(s.compile, caches=s.caches if "kvbench" in s.engine else [])
    if s.order not in ORDERS:
        raise KVBenchError(
            f"--order {s.order!r}: use sequential (each configuration's runs back to back, the default) or "
            "interleaved (timed runs in rounds over the configurations of a prompt length)"
        )
    if s.fill == "random":
        _check_random_fill(s)
    for e in s.engine:
        if not any(ENGINES[e].supports(c) for c in s.caches):
            runs = [c for c in ("none", "dynamic", "static") if ENGINES[e].supports(c)]
            raise KVBenchError(
                f"engine {e} runs none of the caches asked for ({', '.join(s.caches)}): it runs "
                f"{', '.join(runs)}; add one of them to --caches or drop {e} from --engine"
            )


def _check_random_fill(s: BenchSettings) -> None:
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
        raise KVBenchError(
            "--order interleaved applies to prefill sweeps; --fill random holds one cache at a time"
        )
    if s.profile:
        raise KVBenchError("--profile traces prefill sweeps; it does not apply to --fill random")
    if len(s.batch) > 1:
        raise KVBenchError(
            f"--fill random sweeps contexts at one batch size, got --batch {','.join(map(str, s.batch))}; "
            "run one sweep per batch size, or sweep batch sizes with a prefill sweep"
        )
    if s.percentiles != list(DEFAULT_PERCENTILES):
        raise KVBenchError(
            "--percentiles applies to prefill sweeps; --fill random writes its own tpot_ms_p10 and tpot_ms_p90"
        )


def sweep_warnings(s: BenchSettings) -> list[str]:
    """Things the sweep will quietly not do, said out loud: caches no selected engine runs, a missing reference."""
    notes = []
    if s.fill == "random":
        return notes  # every check of a random-fill sweep is an error above, and it has no token reference
    if set(s.caches) != set(parse_cache_names("all")):
        skipped = [c for c in s.caches if not any(ENGINES[e].supports(c) for e in s.engine)]
        if skipped:
            notes.append(f"no selected engine runs {', '.join(skipped)}; those caches are skipped")
    if "kvbench" not in s.engine or "none" not in s.caches:
        notes.append(
            "token_agreement and speedup_vs_none need kvbench's `none` in the sweep (--engine kvbench, --caches "
            "none,...); without it those columns stay empty"
        )
    return notes


def sweep_model_config(s: BenchSettings) -> GPTConfig:
    """The model's shape from its preset or the checkpoint's config.json, without loading any weights. One rule for
    every command: a checkpoint's own config decides; a --model given as well must agree with it."""
    from kvbench.model.weights import peek_config, resolve_config

    cfg = peek_config(s.model, s.weights)
    if s.weights not in ("auto", "hub", "random") and s.model is not None:
        want = resolve_config(s.model)
        got = (cfg.n_layer, cfg.n_head, cfg.n_embd)
        if (want.n_layer, want.n_head, want.n_embd) != got:
            raise KVBenchError(
                f"--model {s.model} does not match the checkpoint in {s.weights} (layers, heads, width = {got}); "
                "leave --model out to use the checkpoint's own"
            )
    return cfg


def check_fits_context(s: BenchSettings, block_size: int | None, model_name: str) -> None:
    """Reject an impossible sweep before any work, naming every offending prompt length (validate.fits_context)."""
    if s.fill == "random":
        fix = (
            "use --model gpt2-long (GPT-2's widths with 65,536 positions, random weights, for timing) or shorter "
            "--prompt-len"
        )
        validate.fits_context("context", s.prompt_len, s.new_tokens, block_size, fix, f"{model_name}'s")
    elif block_size is not None:
        fix = f"use --prompt-len <= {max(block_size - s.new_tokens, 1)} and --new-tokens < {block_size}"
        validate.fits_context(
            "prompt length", s.prompt_len, s.new_tokens, block_size, fix, f"{model_name}'s", grouped=False
        )


def _check_random_fill_memory(s: BenchSettings, cfg: GPTConfig, weights: int, kv: int, device) -> None:
    """One configuration's cache is alive at a time; on top of it, one layer's K and V may exist up to four times
    over (torch.cat's new tensor, the paged gather, int8's dequantisation temporaries)."""
    temporaries = 4 * kv // cfg.n_layer
    need = weights + kv + temporaries
    free = devices.available_memory_bytes(device)
    if free is not None and need > free:
        gib = 2**30
        parts = (f"weights {weights / gib:.1f} + " if weights else "") + (
            f"KV cache {kv / gib:.1f} + one layer's temporaries {temporaries / gib:.1f}"
        )
        raise NotEnoughMemoryError(
            f"--fill random at {max(s.prompt_len):,} + {s.new_tokens} tokens x batch {s.batch[0]} needs about "
            f"{need / gib:.1f} GiB ({parts}), more than the {free / gib:.1f} GiB available; "
            "lower --prompt-len or --batch"
        )


def gpt2_parameters(cfg: GPTConfig) -> int:
    """GPT-2's parameter count from its shape (wte, wpe, the blocks, ln_f; lm_head is tied to wte)."""
    C = cfg.n_embd
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * (12 * C * C + 13 * C) + 2 * C


def sweep_kv_bytes(s: BenchSettings, kv_per_sequence: int, batch: int) -> int:
    """The KV cache bytes the sweep holds at once at one batch size, from one sequence's at the longest prompt +
    new tokens: that cache, or in interleaved order every configuration's of a prompt length (each holds its own
    through the rounds)."""
    kv = batch * kv_per_sequence
    if s.order == "interleaved":
        kv *= max(len(s.engine) * len([c for c in s.caches if c != "none"]), 1)
    return kv


def oversized_batches(
    s: BenchSettings, weights: int, kv_per_sequence: int, total: int | None, what: str, fix: str = ""
) -> dict[int, str]:
    """The batch sizes whose weights + KV cache exceed the device's memory, each with the reason: their rows are
    `oom` without being run (an allocation that large fails, or on a CPU swaps for minutes first). When even the
    smallest batch does not fit, the sweep is refused: nothing would run."""
    if total is None:
        return {}
    gib, longest, out = 2**30, max(s.prompt_len) + s.new_tokens, {}
    for b in s.batch:
        kv = sweep_kv_bytes(s, kv_per_sequence, b)
        if weights + kv > total:
            out[b] = (
                f"batch {b} x {longest} tokens needs a {kv / gib:.1f} GiB KV cache plus {weights / gib:.1f} GiB "
                f"of weights{what}, more than the device's {total / gib:.1f} GiB"
            )
    if len(out) == len(s.batch):
        raise NotEnoughMemoryError(f"--{out[min(s.batch)]}; lower --batch, --prompt-len or --new-tokens{fix}")
    return out


def check_sizes(
    s: BenchSettings, cfg: GPTConfig, dtype: torch.dtype, device: torch.device, weights_loaded: bool = False
) -> dict[int, str]:
    """Before anything is allocated: prompts fit the context, and weights + the KV cache fit the device. Returns
    the batch sizes predicted not to fit (oversized_batches); refuses the sweep when none fits.
    weights_loaded: the model is already in memory (a random-fill sweep then compares only the cache with what is
    still available)."""
    check_compile(s.compile, device.type)
    check_fits_context(s, cfg.block_size, cfg.name)
    elem = torch.empty((), dtype=dtype).element_size()
    weights = gpt2_parameters(cfg) * elem
    per_sequence = (max(s.prompt_len) + s.new_tokens) * cfg.kv_bytes_per_token(elem)
    if s.fill == "random":
        kv = sweep_kv_bytes(s, per_sequence, s.batch[0])
        _check_random_fill_memory(s, cfg, 0 if weights_loaded else weights, kv, device)
        return {}
    return oversized_batches(s, weights, per_sequence, devices.device_memory_bytes(device), "")


def settings_dict(s: BenchSettings) -> dict:
    return asdict(s)
