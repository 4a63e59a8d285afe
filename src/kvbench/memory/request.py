"""One `kvbench memory` request: every option read and checked, and every model resolved, before any work.

`parse_request` turns the command line's raw values into a `Request` or raises one KVBenchError naming the bad
value: option combinations that would be silently ignored, sizes out of range, unknown names, unreadable config
files. Only then does the command plan, measure or check, so a bad value never arrives after a printed table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.memory.check import check_format
from kvbench.memory.config import is_local, looks_like_hub_id, resolve_config, resolve_hub, resolve_local
from kvbench.memory.formulas import TP_ENGINES
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
from kvbench.memory.units import MAX_TOKENS, parse_bytes, parse_ctx, parse_overhead
from kvbench.options import option
from kvbench.resources import BUNDLED_MODELS
from kvbench.validate import MAX_PLAN_BATCH, one_of

DEFAULT_COPY_RANGE = (128, 528)  # a 128-token prompt and 400 new tokens
DEFAULT_MEASURE_CTX = 1024
ALL_CONTEXTS = [8 * 1024, 128 * 1024]
MAX_CONTEXTS = 256  # rows of one table; each is a bisection for the longest context that fits


@dataclass
class Options:
    """The command line as given: None (or False) for an option the user did not pass (memory_rules)."""

    model: list[str] | None = option(
        "--model",
        "-m",
        default=None,
        help="Preset from configs/models.toml (llama-3-8b), a local model directory or config.json, or a Hugging "
        "Face hub id (org/name; fetches its config.json) (repeatable).",
    )
    config: Path | None = option(
        "--config",
        default=None,
        help="Any Hugging Face config.json of a decoder LLM (resolved by transformers); as --model PATH.",
    )
    all_: bool = option("--all", default=False, help="One table for every preset.")
    ctx: str | None = option(
        "--ctx",
        default=None,
        help="Context lengths, e.g. 8k,32k,128k (k = 1024 tokens, m = 1024k). "
        "Default: the model's max context; 8k,128k with --all.",
    )
    batch: str = option("--batch", "-b", default="1", help="Sequences held at once: one, or a list such as 1,16.")
    kv_dtype: str = option(
        "--kv-dtype",
        default="fp16",
        help="fp32 | fp16 | bf16 | fp8 | int8 | int4 (int8/int4 add group scales); also float32/float, "
        "float16/half, bfloat16, fp8_e4m3/float8_e4m3fn (case-insensitive).",
    )
    weights_dtype: str | None = option(
        "--weights-dtype",
        default=None,
        help="fp32 | fp16 | bf16 (default) | fp8 | int8 | int4; torch's names work too (float16, bfloat16, ...).",
    )
    gpu: str | None = option(
        "--gpu", default=None, help="GPU preset from configs/gpus.toml: t4, a100-80gb, h100, h200, ..."
    )
    gpu_mem: str | None = option(
        "--gpu-mem", default=None, help="GPU memory instead of --gpu, e.g. 80GiB (GB = 10^9 B)."
    )
    overhead: str | None = option(
        "--overhead",
        default=None,
        help="Allowance for activations, CUDA context, allocator: 10% (default) or 4GiB.",
    )
    tp: int | None = option("--tp", default=None, help="Tensor-parallel GPUs (KV heads split across them).")
    tp_engine: str | None = option(
        "--tp-engine",
        default=None,
        help="Whose rule splits the KV heads over --tp GPUs: vllm (default: a KV head replicated when --tp exceeds "
        "the KV heads) or transformers (no replication: such a model cannot run).",
    )
    check: bool = option(
        "--check",
        default=False,
        help="Also allocate transformers' own cache for the model on the meta device and compare per layer kind.",
    )
    copy_traffic: bool = option(
        "--copy-traffic", default=False, help="Bytes a torch.cat cache copies growing from --from to --to."
    )
    from_: int | None = option("--from", default=None, help="Tokens cached at the start (--copy-traffic; default 128).")
    to: int | None = option("--to", default=None, help="Tokens cached at the end (--copy-traffic; default 528).")
    measure: bool = option(
        "--measure", default=False, help="gpt2 family: allocate every registered cache and compare bytes."
    )
    lengths: str | None = option(
        "--lengths",
        default=None,
        help="With --measure: a batch of mixed sequence lengths, e.g. 37,130,260,528: the blocks a paged "
        "cache holds vs a static cache's batch x max-length reservation (max length: --ctx, else the longest).",
    )
    caches: str | None = option(
        "--caches",
        default=None,
        help="With --measure: the caches to allocate, comma-separated names or pkg.module:Class plugins "
        "(default: all).",
    )
    device: str | None = option(
        "--device",
        "-d",
        default=None,
        help="Where --measure and the copy counter run: auto | cpu | cuda | cuda:N.",
    )
    json_out: bool = option("--json", default=False, help="Print one JSON document to stdout and nothing else.")
    bandwidth: str | None = option(
        "--bandwidth",
        default=None,
        help="Memory bandwidth for the decode floor, e.g. 3.35TB/s or 2TiB/s (TB = 10^12 B); overrides the --gpu's "
        "listed figure, or alone names a custom device.",
    )
    plot: str | None = option(
        "--plot",
        default=None,
        cli_type=str | None,  # as typed: '' stays empty (a Path would read it as '.')
        help="Write the capacity chart (KV GiB and max batch against context) to FILE.png.",
    )


@dataclass
class Request:
    """A checked request: what to run, on which models, with which sizes."""

    specs: list[ModelSpec]  # the models, in the order given
    contexts: list[int] | None  # --ctx, or None for each model's own default
    batch: int  # the first (with --measure and --copy-traffic, the only) batch
    kv_dtype: str
    weights_dtype: str
    tp: int
    tp_engine: str  # whose rule splits the KV heads over the tp GPUs (formulas.TP_ENGINES)
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


# --- the rules -------------------------------------------------------------------------------------------------------
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


def memory_rules(o: Options, batches: list[int]) -> None:
    """`kvbench memory` (Options), its --batch list read: combinations that would be silently
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
    if n0 < 0 or n1 <= n0:
        raise KVBenchError(f"--from {n0} --to {n1}: need 0 <= from < to")
    if n1 > MAX_TOKENS:
        raise KVBenchError(f"--to {n1} is more than {MAX_TOKENS:,} tokens (2^40)")


# --- reading the request -------------------------------------------------------------------------------------------
def _batches(o: Options) -> list[int]:
    """--batch 16 or --batch 1,16: whole numbers of sequences (memory_rules bounds them); a repeat is one."""
    if isinstance(o.batch, int):
        return [o.batch]
    try:
        values = [int(b) for b in str(o.batch).replace("_", "").split(",")]
    except ValueError:
        raise KVBenchError(
            f"cannot read --batch {o.batch!r}: give whole numbers of sequences, e.g. --batch 1,16"
        ) from None
    return list(dict.fromkeys(values))


def _bandwidth(o: Options, gpu: GPUSpec | None) -> PeakBandwidth | None:
    """--bandwidth (over the --gpu's own figure when both are given), else the GPU's published figure."""
    if o.bandwidth is not None:
        rate = parse_bandwidth(o.bandwidth)
        return PeakBandwidth("custom", f"--bandwidth {o.bandwidth.strip()}", rate, o.bandwidth.strip(), "--bandwidth")
    if gpu is not None and gpu.bandwidth is not None:
        return PeakBandwidth(gpu.name, gpu.label, gpu.bandwidth, gpu.bandwidth_text, gpu.bandwidth_source)
    return None


def _plot_path(o: Options) -> Path | None:
    if o.plot is None:
        return None
    if not o.plot.strip():
        raise KVBenchError("--plot is empty; give a .png file path, e.g. capacity.png")
    plot = Path(o.plot).expanduser()
    if plot.suffix.lower() != ".png":
        raise KVBenchError(f"--plot {plot} must name a .png file")
    if not plot.parent.is_dir():
        raise KVBenchError(f"--plot {plot}: no such directory {plot.parent}")
    from kvbench.outputs import output_kind

    output_kind(plot, "--plot")  # a folder, a block device or a socket refused before any work
    return plot


def _gpu(o: Options) -> tuple[GPUSpec | None, int | None]:
    gpu = get_gpu(o.gpu) if o.gpu is not None else None
    gpu_mem = parse_bytes(o.gpu_mem) if o.gpu_mem is not None else None
    memory = gpu.memory if gpu is not None else gpu_mem
    if memory is not None:
        parse_overhead(o.overhead or DEFAULT_OVERHEAD, memory)
    return gpu, gpu_mem


def _lengths(o: Options, contexts: list[int] | None) -> list[int] | None:
    if o.lengths is None:
        return None
    lengths = parse_ctx(o.lengths, "--lengths", "--lengths value")
    if contexts and max(lengths) > max(contexts):
        raise KVBenchError(f"--lengths has a sequence of {max(lengths):,} tokens, longer than --ctx {max(contexts):,}")
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
        if spec is None and key in BUNDLED_MODELS:  # shipped with kvbench: its own config.json, offline
            r = resolve_local(str(BUNDLED_MODELS[key]))
            spec = replace(r.spec, name=key, source=f"bundled with kvbench (kvbench/data/{key})")
            resolved[key] = replace(r, spec=spec)
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
    batches = _batches(o)
    memory_rules(o, batches)
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
        copy_range_rules(*copy_range)
    lengths = _lengths(o, contexts)
    specs, resolved = _specs(o, extra if (o.measure or o.copy_traffic) else None)
    return Request(
        specs=specs,
        contexts=contexts,
        batch=batches[0],
        kv_dtype=kv,
        weights_dtype=weights_dtype,
        tp=o.tp or 1,
        tp_engine=o.tp_engine or "vllm",
        gpu=gpu,
        gpu_mem=gpu_mem,
        gpu_mem_text=o.gpu_mem or "",
        overhead=o.overhead or DEFAULT_OVERHEAD,
        all_=o.all_,
        check=o.check,
        measure=o.measure,
        copy_traffic=o.copy_traffic,
        copy_range=copy_range,
        lengths=lengths,
        device=o.device or "auto",
        resolved=resolved,
        batches=batches,
        bandwidth=bandwidth,
        plot=plot,
    )


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
                    spec,
                    contexts_for(req, spec),
                    req.batches or req.batch,
                    req.kv_dtype,
                    req.weights_dtype,
                    req.tp,
                    req.gpu,
                    req.gpu_mem,
                    req.overhead,
                    req.gpu_mem_text,
                    req.bandwidth,
                    req.tp_engine,
                )
            )
        except KVBenchError as e:
            if not req.all_:
                raise
            left_out.append(f"{spec.name} left out: {e}")
    return plans, left_out
