"""One `kvbench memory` request: every option read and checked, and every model resolved, before any work.

`parse_request` turns the command line's raw values into a `Request` or raises one KVBenchError naming the bad
value: option combinations that would be silently ignored, sizes out of range, unknown names, unreadable config
files. Only then does the command plan, measure or check, so a bad value never arrives after a printed table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.memory.check import check_format
from kvbench.memory.config import is_local, looks_like_hub_id, resolve_config, resolve_hub, resolve_local
from kvbench.memory.formulas import check_copy_range
from kvbench.memory.planner import DEFAULT_OVERHEAD, ModelPlan, plan
from kvbench.memory.presets import get_gpu, get_model, load_presets
from kvbench.memory.spec import (
    GPUSpec,
    ModelSpec,
    PeakBandwidth,
    get_kv_format,
    parse_bandwidth,
    weight_dtype,
)
from kvbench.memory.units import MAX_BATCH, fmt_int, parse_bytes, parse_ctx, parse_overhead

DEFAULT_COPY_RANGE = (128, 528)  # a 128-token prompt and 400 new tokens
DEFAULT_MEASURE_CTX = 1024
ALL_CONTEXTS = [8 * 1024, 128 * 1024]
MAX_CONTEXTS = 256  # rows of one table; each is a bisection for the longest context that fits


@dataclass
class Options:
    """The command line as given: None (or False) for an option the user did not pass."""

    model: list[str] | None = None
    config: Path | None = None
    all_: bool = False
    ctx: str | None = None
    batch: int | str = 1  # one batch, or a list such as "1,16"
    kv_dtype: str = "fp16"
    weights_dtype: str | None = None
    gpu: str | None = None
    gpu_mem: str | None = None
    overhead: str | None = None
    tp: int | None = None
    copy_traffic: bool = False
    from_: int | None = None
    to: int | None = None
    measure: bool = False
    lengths: str | None = None
    check: bool = False
    device: str | None = None
    caches: str | None = None  # --measure's caches as given; the command resolves them (plugins need torch)
    bandwidth: str | None = None  # --bandwidth: memory bandwidth for the decode floor, e.g. 3.35TB/s
    plot: Path | None = None  # --plot: the capacity chart's PNG


@dataclass
class Request:
    """A checked request: what to run, on which models, with which sizes."""

    specs: list[ModelSpec]  # the models, in the order given
    contexts: list[int] | None  # --ctx, or None for each model's own default
    batch: int  # the first (with --measure and --copy-traffic, the only) batch
    kv_dtype: str
    weights_dtype: str
    tp: int
    gpu: GPUSpec | None
    gpu_mem: int | None
    gpu_mem_text: str
    overhead: str
    all_: bool
    check: bool
    measure: bool
    copy_traffic: bool
    copy_range: tuple[int, int]
    lengths: list[int] | None
    device: str
    resolved: dict[str, object] = field(default_factory=dict)  # spec name -> resolve.Resolved (--config)
    cache_names: list[str] | None = None  # --measure: the caches to allocate (None: every registered one)
    batches: list[int] = field(default_factory=list)  # --batch, every value (a plan has a row for each)
    bandwidth: PeakBandwidth | None = None  # --bandwidth, else the --gpu's published figure (None: no floor)
    plot: Path | None = None  # --plot: where the capacity chart goes

    @property
    def plans(self) -> bool:
        """A plan is printed unless the run is only --measure and/or --copy-traffic."""
        return not (self.measure or self.copy_traffic)


# option -> (the runs it belongs to, how to say so). A given option outside its run would be silently ignored.
_SCOPE = {
    "--from": ("copy", "--from and --to go with --copy-traffic"),
    "--to": ("copy", "--from and --to go with --copy-traffic"),
    "--lengths": ("measure", "--lengths goes with --measure (it fills a real paged cache)"),
    "--device": ("measure copy", "--device goes with --measure or --copy-traffic (a plan allocates nothing)"),
    "--gpu": ("plan", "--gpu sizes a plan; --measure and --copy-traffic do not use it"),
    "--gpu-mem": ("plan", "--gpu-mem sizes a plan; --measure and --copy-traffic do not use it"),
    "--tp": ("plan", "--tp splits a plan over GPUs; --measure and --copy-traffic do not use it"),
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


def _check_combinations(o: Options) -> None:
    if o.all_ and (o.model or o.config is not None):
        raise KVBenchError("use --all or --model/--config, not both")
    if o.gpu is not None and o.gpu_mem is not None:
        raise KVBenchError("use --gpu or --gpu-mem, not both")
    runs = {"measure"} if o.measure else set()
    runs |= {"copy"} if o.copy_traffic else set()
    runs = runs or {"plan"}
    given = {
        "--from": o.from_ is not None, "--to": o.to is not None, "--lengths": o.lengths is not None,
        "--device": o.device is not None, "--gpu": o.gpu is not None, "--gpu-mem": o.gpu_mem is not None,
        "--tp": o.tp is not None, "--weights-dtype": o.weights_dtype is not None, "--check": o.check,
        "--bandwidth": o.bandwidth is not None, "--plot": o.plot is not None,
    }  # fmt: skip
    for opt, on in given.items():
        scope, why = _SCOPE[opt]
        if on and not runs & set(scope.split()):
            raise KVBenchError(why)
    if o.overhead is not None and o.gpu is None and o.gpu_mem is None:
        raise KVBenchError("--overhead goes with --gpu or --gpu-mem (it is set aside from the GPU's memory)")
    if o.check and o.all_:
        raise KVBenchError("--check builds each model on the meta device: name them with --model or --config")
    if o.measure and (o.all_ or o.config is not None or not o.model or len(o.model) != 1):
        raise KVBenchError("--measure takes one gpt2-family --model (gpt2, gpt2-medium, gpt2-large, gpt2-xl)")


def _batches(o: Options) -> list[int]:
    """--batch 16 or --batch 1,16: whole numbers of sequences, each from 1 to MAX_BATCH; a repeat is one."""
    if isinstance(o.batch, int):
        values = [o.batch]
    else:
        try:
            values = [int(b) for b in str(o.batch).replace("_", "").split(",")]
        except ValueError:
            raise KVBenchError(
                f"cannot read --batch {o.batch!r}: give whole numbers of sequences, e.g. --batch 1,16"
            ) from None
    for b in values:
        if not 1 <= b <= MAX_BATCH:
            raise KVBenchError(f"--batch {b} must be from 1 to {fmt_int(MAX_BATCH)}")
    batches = list(dict.fromkeys(values))
    if len(batches) > 1 and (o.measure or o.copy_traffic or o.all_):
        raise KVBenchError("--measure, --copy-traffic and --all take one --batch; a list goes with --model")
    return batches


def _bandwidth(o: Options, gpu: GPUSpec | None) -> PeakBandwidth | None:
    """--bandwidth (over the --gpu's own figure when both are given), else the GPU's published figure."""
    if o.bandwidth is not None:
        rate = parse_bandwidth(o.bandwidth)
        return PeakBandwidth(
            "custom", f"--bandwidth {o.bandwidth.strip()}", rate, o.bandwidth.strip(), "--bandwidth"
        )
    if gpu is not None and gpu.bandwidth is not None:
        return PeakBandwidth(gpu.name, gpu.label, gpu.bandwidth, gpu.bandwidth_text, gpu.bandwidth_source)
    return None


def _plot_path(o: Options) -> Path | None:
    if o.plot is None:
        return None
    if o.gpu is None and o.gpu_mem is None:
        raise KVBenchError("--plot draws against a GPU's memory: give --gpu h100 or --gpu-mem 80GiB")
    if o.all_:
        raise KVBenchError("--plot draws the models named with --model (or --config), not --all")
    if o.plot.suffix.lower() != ".png":
        raise KVBenchError(f"--plot {o.plot} must name a .png file")
    if not o.plot.parent.is_dir():
        raise KVBenchError(f"--plot {o.plot}: no such directory {o.plot.parent}")
    return o.plot


def _gpu(o: Options) -> tuple[GPUSpec | None, int | None]:
    gpu = get_gpu(o.gpu) if o.gpu is not None else None
    gpu_mem = parse_bytes(o.gpu_mem) if o.gpu_mem is not None else None
    if gpu is not None or gpu_mem is not None:
        parse_overhead(o.overhead or DEFAULT_OVERHEAD, gpu.memory if gpu else gpu_mem)
    return gpu, gpu_mem


def _lengths(o: Options, contexts: list[int] | None) -> list[int] | None:
    if o.lengths is None:
        return None
    lengths = parse_ctx(o.lengths, "--lengths", "--lengths value")
    if contexts and max(lengths) > max(contexts):
        raise KVBenchError(
            f"--lengths has a sequence of {max(lengths):,} tokens, longer than --ctx {max(contexts):,}"
        )
    return lengths


def _specs(o: Options, extra: Callable[[str], ModelSpec | None] | None) -> tuple[list[ModelSpec], dict]:
    """The models named by --model, --config or --all, each resolved (a config.json through transformers)."""
    presets = load_presets()
    if o.all_:
        return list(presets.values()), {}
    specs = []
    resolved = {}
    for name in dict.fromkeys(o.model or []):  # a model named twice is planned once
        key = name.strip().lower()
        spec = extra(name) if extra and key not in presets else None
        if spec is None and key not in presets and (is_local(name) or looks_like_hub_id(name)):
            r = resolve_local(name) if is_local(name) else resolve_hub(name.strip())
            spec, resolved[r.spec.name] = r.spec, r
        specs.append(spec or get_model(name, presets))
    if o.config is not None:
        r = resolve_config(o.config)
        specs.append(r.spec)
        resolved[r.spec.name] = r
    if not specs:
        raise KVBenchError("name a model: --model llama-3-8b, --config path/to/config.json, or --all")
    return specs, resolved


def parse_request(o: Options, extra: Callable[[str], ModelSpec | None] | None = None) -> Request:
    """Check every option and resolve every model; raise one KVBenchError for the first bad value.

    `extra` names models beyond the presets (the command passes our own GPT-2 presets for --measure and
    --copy-traffic), so this module needs no torch."""
    _check_combinations(o)
    batches = _batches(o)
    if o.tp is not None and o.tp < 1:
        raise KVBenchError(f"--tp {o.tp} must be at least 1")
    contexts = list(dict.fromkeys(parse_ctx(o.ctx))) if o.ctx is not None else None  # a repeat is one row
    if contexts and len(contexts) > MAX_CONTEXTS:
        raise KVBenchError(f"--ctx lists {len(contexts):,} context lengths; give at most {MAX_CONTEXTS}")
    kv = get_kv_format(o.kv_dtype).name
    weights_dtype = weight_dtype(o.weights_dtype or "bf16")
    if o.check:
        check_format(kv)
    gpu, gpu_mem = _gpu(o)
    bandwidth, plot = _bandwidth(o, gpu), _plot_path(o)
    copy_range = (
        o.from_ if o.from_ is not None else DEFAULT_COPY_RANGE[0],
        o.to if o.to is not None else DEFAULT_COPY_RANGE[1],
    )
    if o.copy_traffic:
        check_copy_range(*copy_range, batches[0])
    lengths = _lengths(o, contexts)
    specs, resolved = _specs(o, extra if (o.measure or o.copy_traffic) else None)
    if o.caches is not None and not o.measure:
        raise KVBenchError("--caches goes with --measure (it names the caches to allocate)")
    return Request(
        specs=specs, contexts=contexts, batch=batches[0], kv_dtype=kv, weights_dtype=weights_dtype, tp=o.tp or 1,
        gpu=gpu, gpu_mem=gpu_mem, gpu_mem_text=o.gpu_mem or "", overhead=o.overhead or DEFAULT_OVERHEAD,
        all_=o.all_, check=o.check, measure=o.measure, copy_traffic=o.copy_traffic, copy_range=copy_range,
        lengths=lengths, device=o.device or "auto", resolved=resolved, batches=batches, bandwidth=bandwidth,
        plot=plot,
    )  # fmt: skip


def contexts_for(req: Request, spec: ModelSpec) -> list[int]:
    """--ctx, else 8k and 128k for --all, else the model's trained context."""
    if req.contexts:
        return req.contexts
    if req.all_:
        return ALL_CONTEXTS
    if spec.max_context is None:
        raise KVBenchError(f"{spec.name} has no max_position_embeddings; give --ctx, e.g. --ctx 8k")
    return [spec.max_context]


def plan_request(req: Request) -> tuple[list[ModelPlan], list[str]]:
    """Every model's plan, and warnings for the models --all leaves out (e.g. --tp 2 and Falcon's 71 heads)."""
    plans, left_out = [], []
    for spec in req.specs:
        try:
            plans.append(
                plan(
                    spec, contexts_for(req, spec), req.batches or req.batch, req.kv_dtype, req.weights_dtype,
                    req.tp, req.gpu, req.gpu_mem, req.overhead, req.gpu_mem_text, req.bandwidth,
                )
            )  # fmt: skip
        except KVBenchError as e:
            if not req.all_:
                raise
            left_out.append(f"{spec.name} left out: {e}")
    return plans, left_out
