"""bench's settings: one sweep from defaults, a TOML file and command-line options, validated before any work.

Everything here runs before a model is loaded or anything is allocated: keys and types (integers are integers, never
truncated), ranges, duplicates (a prompt length, cache or engine given twice runs once), an empty sweep (named:
which engine runs none of the caches asked for), the model's context and the device's memory against the largest
configuration.
"""

from __future__ import annotations

import re
import typing
from dataclasses import asdict, fields
from pathlib import Path

from kvbench import files, validate
from kvbench.bench.choices import BenchSettings, all_caches
from kvbench.bench.rules import bench_rules
from kvbench.errors import KVBenchError, NotEnoughMemoryError, shown

if typing.TYPE_CHECKING:
    import torch

    from kvbench.model.gpt2 import GPTConfig


# Under --tp N the default engine is ours alone: transformers' engines cannot split GPT-2 (it has no TP plan there).
TP_DEFAULTS = {"engine": lambda: ["kvbench"]}

# With --fill random a sweep times decode steps at long contexts (bench/context.py): no `none` (nothing to fill), only our
# engine (transformers' generate cannot start from a filled cache), and a few dozen steps per context.
FILL_RANDOM_DEFAULTS = {
    "caches": lambda: [c for c in all_caches() if c != "none"],
    "engine": lambda: ["kvbench"],
    "new_tokens": lambda: 32,
}

SETTING_KEYS = tuple(f.name for f in fields(BenchSettings))
K = 1024  # --prompt-len 4k = 4,096 tokens
_INT_TEXT = re.compile(r"([+-]?\d+)([kK]?)")


def _whole(value: object, key: str, where: str) -> int:
    """An integer from TOML (int, not bool or float) or the command line (decimal digits, or with a k suffix:
    4k = 4 x 1,024); anything else is an error, never truncated."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _INT_TEXT.fullmatch(value.strip()) if isinstance(value, str) else None
    if m:
        return int(m.group(1)) * (K if m.group(2) else 1)
    raise KVBenchError(f"{where}: {key} must be whole numbers, got {shown(value)} (a k suffix is x1024: 4k = 4096)")


def _as_list(key: str, value: typing.Any, where: str, integers: bool) -> list:
    given = value  # for the error: what the file said, not the list made of it
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple):
        value = [value]
    if integers:
        return [_whole(v, key, where) for v in value]
    if not all(isinstance(v, str) for v in value):
        raise KVBenchError(f"{where}: {key} must be names, got {shown(given)}")
    return [v.strip() for v in value if v.strip()]


_TYPES = typing.get_type_hints(BenchSettings)


def coerce(raw: dict, where: str) -> dict:
    """Keys and types of settings from a file or the command line, read from BenchSettings' field types (lists
    from comma-separated text too); unknown keys are errors naming them."""
    from kvbench.bench.timing_stats import parse_percentiles

    out = {}
    for key, value in raw.items():
        if key not in SETTING_KEYS:
            raise KVBenchError(f"{where}: unknown key {shown(key)}; known keys: {', '.join(SETTING_KEYS)}")
        kind = _TYPES[key]
        if kind == list[int]:
            value = _as_list(key, value, where, integers=True)
        elif kind == list[str]:
            value = _as_list(key, value, where, integers=False)
        elif kind == list[float]:
            value = parse_percentiles(value, f"{where}: {key}")
        elif kind is int or kind == int | None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise KVBenchError(f"{where}: {key} must be an integer, got {shown(value)}")
        elif kind is bool:
            if not isinstance(value, bool):
                raise KVBenchError(f"{where}: {key} must be true or false, got {shown(value)}")
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise KVBenchError(f"{where}: {key} must be a number, got {shown(value)}")
        elif not isinstance(value, str):
            raise KVBenchError(f"{where}: {key} must be a string, got {shown(value)}")
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


def load_settings(path: str | Path | None, given: dict) -> BenchSettings:
    """Defaults < the TOML file at `path` < `given` (the options given on the command line, by field name; None
    values are not given), checked (bench/rules.py bench_rules). Under --tp the engine defaults to kvbench's alone."""
    raw = read_settings(path, given)
    if raw.get("tp", 1) > 1:
        raw.update({k: make() for k, make in TP_DEFAULTS.items() if k not in raw})
    s = BenchSettings(**raw)
    bench_rules(s)
    return s


def read_settings(path: str | Path | None, given: dict) -> dict:
    """The keys the TOML file at `path` and then `given` set (no defaults), keys and types checked."""
    merged: dict = {}
    if path is not None:
        p = resolve_config_path(path)
        data = files.load_toml(p, f"--config {p}", files.CONFIG_BYTES, "a sweep's TOML file")
        merged.update(coerce(data, str(p)))
    merged.update(coerce({k: v for k, v in given.items() if v is not None}, "command line"))
    if merged.get("fill") == "random":
        merged.update({k: make() for k, make in FILL_RANDOM_DEFAULTS.items() if k not in merged})
    return merged


def sweep_warnings(s: BenchSettings) -> list[str]:
    """Things the sweep will quietly not do, said out loud: caches no selected engine runs, a missing reference."""
    from kvbench.bench.engines import ENGINES
    from kvbench.caches import parse_cache_names
    from kvbench.host import usable_cpus

    notes: list[str] = []
    cpus = usable_cpus()
    if s.threads is not None and cpus is not None and s.threads > cpus:
        notes.append(
            f"--threads {s.threads} is more than the {cpus} core(s) this process may use: the threads wait on each "
            "other and every CPU row is timed far slower than the machine can run"
        )
    if s.fill == "random":
        return notes  # every check of a random-fill sweep is an error above, and it has no token reference
    if set(s.caches) != set(parse_cache_names("all")):
        skipped = [c for c in s.caches if not any(ENGINES[e].supports(c) for e in s.engine)]
        if skipped:
            notes.append(f"no selected engine runs {', '.join(skipped)}; those caches are skipped")
    if "none" not in s.caches:
        notes.append(
            "speedup_vs_none and token_agreement need `none` in the sweep (--caches none,...): speedup_vs_none each "
            "engine's own, token_agreement kvbench's; without it those columns stay empty"
        )
    elif "kvbench" not in s.engine:
        notes.append(
            "token_agreement needs kvbench's `none` in the sweep (--engine kvbench,...); without it that column stays "
            "empty"
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


def _check_random_fill_memory(s: BenchSettings, cfg: GPTConfig, weights: int, kv: int, device: torch.device) -> None:
    """One configuration's cache is alive at a time; on top of it, one layer's K and V may exist up to four times
    over (torch.cat's new tensor, the paged gather, int8's dequantisation temporaries)."""
    from kvbench import devices

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
    s: BenchSettings,
    weights: int,
    kv_per_sequence: int,
    total: int | None,
    what: str,
    fix: str = "",
    step_per_sequence: int = 0,
    available: bool = False,
) -> dict[int, str]:
    """The batch sizes whose weights + KV cache (+ `step_per_sequence` per sequence: what a step holds beside the
    cache) exceed `total`, each with the reason: their rows are `oom` without being run (an allocation that large
    fails, or on a CPU swaps for minutes or wakes the kernel's OOM killer first). `total`: the device's memory, or
    with `available` the memory free now; None: unknown, nothing is predicted. When even the smallest batch does not
    fit, the sweep is refused, naming the largest batch that would: nothing would run."""
    if total is None:
        return {}
    gib, longest, out = 2**30, max(s.prompt_len) + s.new_tokens, {}
    for b in s.batch:
        kv, step = sweep_kv_bytes(s, kv_per_sequence, b), b * step_per_sequence
        if weights + kv + step > total:
            out[b] = f"batch {b} x {longest:,} tokens needs " + (
                f"a {kv / gib:.1f} GiB KV cache plus {weights / gib:.1f} GiB of weights{what}, more than the "
                f"device's {total / gib:.1f} GiB"
                if not available
                else f"a {kv / gib:.1f} GiB KV cache + {step / gib:.1f} GiB for a step's logits and activations"
                + (f" + {weights / gib:.1f} GiB of weights" if weights else " (beside the weights loaded)")
                + f" = {(weights + kv + step) / gib:.1f} GiB, more than the {total / gib:.1f} GiB available"
            )
    if len(out) == len(s.batch):
        fits = (total - weights) // (sweep_kv_bytes(s, kv_per_sequence, 1) + step_per_sequence)
        lower = f"lower --batch (at most {fits:,} fits)" if fits >= 1 else "lower --batch"
        raise NotEnoughMemoryError(f"--{out[min(s.batch)]}; {lower}, --prompt-len or --new-tokens{fix}")
    return out


# Beside the weights and the KV cache, a step of our loop holds, per sequence (measured on gpt2-tiny, CPU, fp32):
# the logits, up to three copies of (vocabulary) fp32 values (this step's, the last step's until they are replaced,
# transformers' fp32 copy in its generate), and the activations of the longest forward, about 12 widths per token (the
# residual stream, a LayerNorm, Q/K/V, the MLP's two 4x-wide tensors: 10.5 measured at a 1,000-token prefill).
LOGITS_COPIES = 3
ACTIVATION_WIDTHS = 12


def step_bytes_per_sequence(s: BenchSettings, cfg: GPTConfig, element_size: int) -> int:
    """What one sequence's step holds beyond its KV cache: the logits and the activations of the longest forward,
    the prompt's prefill (or with `none`, which recomputes the whole sequence every step, prompt + new tokens)."""
    tokens = max(s.prompt_len) + (s.new_tokens if "none" in s.caches else 0)
    return LOGITS_COPIES * cfg.vocab_size * 4 + ACTIVATION_WIDTHS * tokens * cfg.n_embd * element_size


def check_sizes(
    s: BenchSettings, cfg: GPTConfig, dtype: torch.dtype, device: torch.device, weights_loaded: bool = False
) -> dict[int, str]:
    """Before anything is allocated: prompts fit the context, and weights + the KV cache + what a step holds beside
    it (step_bytes_per_sequence) fit the memory available now. Returns the batch sizes predicted not to fit
    (oversized_batches); refuses the sweep when none fits.
    weights_loaded: the model is already in memory, so what is still available is compared without it."""
    from kvbench import devices
    from kvbench.decode.rules import compile_mode  # it loads torch (the CLI imports this module before torch)

    compile_mode(s.compile, device.type)
    check_fits_context(s, cfg.block_size, cfg.name)
    elem = dtype.itemsize
    weights = 0 if weights_loaded else gpt2_parameters(cfg) * elem
    per_sequence = (max(s.prompt_len) + s.new_tokens) * cfg.kv_bytes_per_token(elem)
    if s.fill == "random":
        kv = sweep_kv_bytes(s, per_sequence, s.batch[0])
        _check_random_fill_memory(s, cfg, weights, kv, device)
        return {}
    free = devices.available_memory_bytes(device)
    room, available = (free, True) if free is not None else (devices.device_memory_bytes(device), False)
    step = step_bytes_per_sequence(s, cfg, elem)
    return oversized_batches(s, weights, per_sequence, room, "", step_per_sequence=step, available=available)


def settings_dict(s: BenchSettings) -> dict:
    return asdict(s)
