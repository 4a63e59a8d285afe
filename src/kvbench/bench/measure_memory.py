"""`kvbench memory --measure`: allocate our real caches on a device and hold them against the planner's prediction.

The planner (`kvbench.memory`) predicts bytes with arithmetic; this module builds every cache in the registry for the same
model, batch and context, fills it, and reads back the bytes of tensor storage each one holds (`nbytes`). The static
cache must agree to the byte; the others are explained (a growing cache holds exactly what it was given but copies
its history to grow; a cache added later reports its own difference). It also runs the `dynamic` cache's own copy
counter for `--copy-traffic`. torch is imported here, never by the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench import devices
from kvbench.caches import CACHES, get_cache_spec, make_caches
from kvbench.caches.base import CacheSpec, cache_bytes_copied, cache_nbytes
from kvbench.caches.paged import paged_memory_report
from kvbench.caches.planned import planner_format, spec_from_gpt_config
from kvbench.devices import DTYPES, device_name, resolve_device
from kvbench.errors import KVBenchError, NotEnoughMemoryError, is_out_of_memory
from kvbench.memory.formulas import bytes_per_sequence, copy_traffic, layer_bytes_per_token
from kvbench.memory.spec import KVFormat, ModelSpec, get_kv_format
from kvbench.memory.units import GiB, fmt_bytes, fmt_int
from kvbench.model.gpt2 import PRESETS, GPTConfig
from kvbench.validate import past_context

# Counting the dynamic cache's copies re-runs every torch.cat; above this many bytes copied it is not worth the wait.
MAX_COUNTED_COPY_BYTES = 8 * GiB
# --lengths fills a paged cache one token at a time, one update per token: at most this many tokens in all.
MAX_PAGED_TOKENS = 2**16


@dataclass
class MeasureRow:
    """One registered cache, allocated and filled on the device."""

    cache: str  # registry name
    summary: str  # the registry's one-line description
    planner_format: str  # the planner's --kv-dtype that models this cache (int8 for the int8 cache)
    predicted_bytes: int  # the planner's bytes for batch x ctx tokens in that format (0 for no cache)
    measured_bytes: int  # sum of nbytes over layers after filling ctx tokens
    allocated_bytes: int | None  # CUDA: torch.cuda.memory_allocated growth (allocator rounds to 512 B blocks)
    peak_extra_bytes: int | None  # CUDA: transient bytes above the final footprint while filling (torch.cat)
    difference: int  # measured - predicted
    exact: bool  # measured == predicted, to the byte
    explanation: str  # why any difference is there


@dataclass
class MeasureReport:
    """Predicted vs measured cache bytes for one model, batch and context on one device."""

    model: str  # kvbench.model.gpt2 preset
    device: str  # where the caches were allocated
    kv_dtype: str  # element type of K and V
    batch: int  # sequences
    ctx: int  # tokens per sequence
    predicted_bytes: int  # the planner's figure
    rows: list[MeasureRow]  # one per registered cache
    working: list[str] = field(default_factory=list)  # the prediction's arithmetic
    warnings: list[str] = field(default_factory=list)  # e.g. a context beyond the model's trained maximum


def _gpt_config(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise KVBenchError(
            f"--measure builds our own GPT-2 caches, so it takes a gpt2-family model ({', '.join(PRESETS)}), "
            f"not {name!r}"
        )
    return PRESETS[name]


def _torch_dtype(kv_dtype: str) -> torch.dtype:
    if kv_dtype not in DTYPES:
        raise KVBenchError(
            f"--measure allocates real torch caches: use --kv-dtype {', '.join(DTYPES)} (not {kv_dtype})"
        )
    return DTYPES[kv_dtype]


def _fill(
    caches: list | None, cfg: GPTConfig, batch: int, n0: int, n1: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Prefill n0 tokens in one update, then decode one token per update up to n1, in every layer."""
    H, Dh = cfg.n_head, cfg.head_dim
    steps = ([(0, n0)] if n0 > 0 else []) + [(t, t + 1) for t in range(n0, n1)]
    for start, end in steps:
        T = end - start
        k = torch.zeros(batch, H, T, Dh, dtype=dtype, device=device)  # (B, H, T, Dh): values do not matter
        v = torch.zeros_like(k)
        pos = torch.arange(start, end, device=device).expand(batch, T)  # (B, T)
        for c in caches or []:  # no cache (`none`): nothing held
            c.update(k, v, pos)


def _explain(
    design: CacheSpec,
    no_cache: bool,
    diff: int,
    expected: int,
    measured: int,
    plain: int,
    spec: ModelSpec,
    fmt: KVFormat,
    batch: int,
) -> str:
    """Why a cache's measured bytes are what they are, in one line."""
    what = design.memory_note or design.summary
    if no_cache:
        return what
    if design.storage_dtype:
        q = planner_format(design, fmt)
        head = (
            f"equals the planner's --kv-dtype {q.name} figure to the byte ({q.note})"
            if diff == 0
            else f"{diff:+,} B vs the planner's --kv-dtype {q.name} figure ({q.note}): its scales are wider"
        )
        return f"{head}; {measured / plain:.3f} of the {fmt.name} cache; {what}"
    if diff == 0:
        return f"equals the prediction to the byte; {what}"
    slot = layer_bytes_per_token(spec, fmt) * spec.n_layers * batch
    extra = f" = {diff // slot:,} extra token slots per sequence" if diff > 0 and diff % slot == 0 else ""
    return f"{diff:+,} B ({100 * diff / expected:+.2f}%){extra}: {what}"


def measure_caches(
    name: str,
    batch: int,
    ctx: int,
    kv_dtype: str = "fp16",
    device: str = "auto",
    caches: list[str] | None = None,
) -> MeasureReport:
    """Allocate each cache in `caches` (default: every registered one) for (batch, ctx), fill it with ctx tokens,
    and compare nbytes to the plan. check_measure has refused what cannot be measured."""
    # the caller's promise (request.memory_rules, check_measure): a batch and a context, a gpt2 preset, a torch format
    assert batch >= 1 and ctx >= 1 and name in PRESETS and kv_dtype in DTYPES, (batch, ctx, name, kv_dtype)
    cfg, dtype = PRESETS[name], DTYPES[kv_dtype]
    dev = resolve_device(device)
    spec = spec_from_gpt_config(cfg)
    fmt = get_kv_format(kv_dtype)
    predicted = bytes_per_sequence(spec, fmt, ctx) * batch
    el = torch.tensor([], dtype=dtype).element_size()
    working = [
        f"predicted: 2 (K and V) x {cfg.n_layer} layers x batch {batch} x {cfg.n_head} heads x {ctx} tokens x "
        f"{cfg.head_dim} head_dim x {el} B ({kv_dtype}) = {fmt_int(predicted)} B = {fmt_bytes(predicted)}",
        "measured: sum over layers of each cache's nbytes (bytes of K/V tensor storage it holds) after "
        f"prefilling {ctx - 1} tokens and decoding 1"
        if ctx > 1
        else "measured: after one 1-token update",
    ]
    rows = [_measure_one(cname, cfg, spec, fmt, batch, ctx, dtype, dev, predicted) for cname in caches or list(CACHES)]
    warnings = []
    if past_context(ctx, cfg.block_size):
        warnings.append(
            f"{name}: {ctx:,} tokens is beyond the {cfg.block_size:,} it was trained for; the caches are "
            f"allocated anyway (the model's position table stops at {cfg.block_size:,})"
        )
    return MeasureReport(
        model=name,
        device=f"{dev} ({device_name(dev)})",
        kv_dtype=kv_dtype,
        batch=batch,
        ctx=ctx,
        predicted_bytes=predicted,
        rows=rows,
        working=working,
        warnings=warnings,
    )


def _measure_one(
    cname: str,
    cfg: GPTConfig,
    spec: ModelSpec,
    fmt: KVFormat,
    batch: int,
    ctx: int,
    dtype: torch.dtype,
    dev: torch.device,
    predicted: int,
) -> MeasureRow:
    """One registered cache allocated for (batch, ctx), filled, measured and explained against the planner's figure
    for its format (`predicted`: the figure for the --kv-dtype asked for)."""
    cspec = get_cache_spec(cname)
    caches, allocated, peak_extra = _allocate_and_fill(cname, cfg, batch, ctx, dtype, dev, predicted)
    measured = cache_nbytes(caches)
    pformat = planner_format(cspec, fmt)
    held = cspec.holds(ctx) if cspec.holds is not None else ctx  # an evicting design holds fewer
    expected = 0 if caches is None else bytes_per_sequence(spec, pformat, held) * batch
    diff = measured - expected
    return MeasureRow(
        cache=cname,
        summary=cspec.summary,
        planner_format=pformat.name,
        predicted_bytes=expected,
        measured_bytes=measured,
        allocated_bytes=allocated,
        peak_extra_bytes=peak_extra,
        difference=diff,
        exact=diff == 0,
        explanation=(f"the planner's figure for the {held:,} tokens of {ctx:,} it holds; " if held != ctx else "")
        + _explain(cspec, caches is None, diff, expected, measured, predicted, spec, fmt, batch),
    )


def _allocate_and_fill(
    name: str, cfg: GPTConfig, batch: int, ctx: int, dtype: torch.dtype, dev: torch.device, predicted: int
) -> tuple[list | None, int | None, int | None]:
    """The cache `name` for (batch, ctx), filled with ctx tokens (None for no cache), and on CUDA the allocator's
    growth and the transient peak above it while filling (None elsewhere). Running out of memory is one line."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
    try:
        caches = make_caches(name, cfg, batch, ctx, dtype, dev)
        if caches is not None:
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            _fill(caches, cfg, batch, max(ctx - 1, 0), ctx, dtype, dev)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise NotEnoughMemoryError(
            f"--measure: the {name!r} cache for batch {batch} x {ctx} tokens ({fmt_bytes(predicted)}) "
            f"does not fit on {dev}; lower --batch or --ctx"
        ) from None
    if not cuda:
        return caches, None, None
    torch.cuda.synchronize(dev)
    allocated = torch.cuda.memory_allocated(dev) - base
    peak_extra = None if caches is None else max(0, torch.cuda.max_memory_allocated(dev) - base - allocated)
    return caches, allocated, peak_extra


def count_copy_traffic(
    name: str, n0: int, n1: int, batch: int = 1, kv_dtype: str = "fp16", device: str = "auto"
) -> tuple[int | None, str]:
    """Run the `dynamic` cache from n0 to n1 tokens and read its own bytes_copied counter.

    Returns (bytes copied, where it ran), or (None, why not): not one of our GPT-2 presets, no `dynamic` cache
    registered, a storage format torch caches do not have, or more copying than is worth the wait.
    """
    if name not in PRESETS:
        return None, "no counter: only our own GPT-2 presets run through the dynamic cache"
    if "dynamic" not in CACHES:
        return None, "no counter: no `dynamic` cache is registered"
    if kv_dtype not in DTYPES:
        return None, f"no counter: the dynamic cache stores {', '.join(DTYPES)}, not {kv_dtype}"
    cfg = PRESETS[name]
    total = copy_traffic(spec_from_gpt_config(cfg), n0, n1, batch, kv_dtype).exact_bytes
    if total > MAX_COUNTED_COPY_BYTES:
        return None, (
            f"counter skipped: it would copy {fmt_bytes(total)} "
            f"(over {fmt_bytes(MAX_COUNTED_COPY_BYTES)}); the closed form stands alone"
        )
    dtype = DTYPES[kv_dtype]
    dev = resolve_device(device)
    caches = make_caches("dynamic", cfg, batch, n1, dtype, dev)
    _fill(caches, cfg, batch, n0, n1, dtype, dev)
    return cache_bytes_copied(caches), f"counted by the dynamic cache on {dev}"


def check_measure(
    name: str,
    batch: int,
    contexts: list[int],
    kv_dtype: str,
    device: str,
    lengths: list[int] | None = None,
    paged_max_len: int | None = None,
) -> None:
    """Everything --measure (and --lengths) will allocate, checked before the first cache: a gpt2-family model,
    a torch format, and room on the device for the largest cache (twice: torch.cat holds old and new at once)."""
    cfg, dev = _gpt_config(name), resolve_device(device)
    _torch_dtype(kv_dtype)
    spec, fmt, room = (
        spec_from_gpt_config(cfg),
        get_kv_format(kv_dtype),
        devices.available_memory_bytes(dev),
    )
    need = 2 * bytes_per_sequence(spec, fmt, max(contexts)) * batch
    if room is not None and need > room:
        raise NotEnoughMemoryError(
            f"--measure at batch {batch} x {max(contexts):,} tokens needs about {fmt_bytes(need)} on {dev}, "
            f"which has {fmt_bytes(room)} free; lower --batch or --ctx"
        )
    if lengths is None:
        return
    if sum(lengths) > MAX_PAGED_TOKENS:
        raise KVBenchError(
            f"--lengths adds up to {sum(lengths):,} tokens; the paged cache is filled one token at a time, so keep "
            f"the total at or under {MAX_PAGED_TOKENS:,}"
        )
    one_layer = bytes_per_sequence(spec, fmt, paged_max_len or max(lengths)) * len(lengths) // cfg.n_layer
    if room is not None and one_layer > room:
        raise KVBenchError(
            f"--lengths needs {fmt_bytes(one_layer)} of paged blocks; the host has {fmt_bytes(room)} free"
        )


def paged_waste(name: str, lengths: list[int], max_len: int | None, kv_dtype: str) -> Any:
    """`memory --measure --lengths`: the blocks a paged cache holds for a batch of mixed lengths against a static
    cache's batch x max_len reservation (max_len defaults to the longest sequence)."""
    cfg = _gpt_config(name)
    max_len = max_len or max(lengths)
    if max(lengths) > max_len:
        raise KVBenchError(f"--lengths has a sequence of {max(lengths)} tokens, longer than --ctx {max_len}")
    return paged_memory_report(cfg, lengths, max_len, _torch_dtype(kv_dtype))
