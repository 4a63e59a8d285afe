"""The plan: one model's cache at each context, per sequence, per batch, per GPU, what fits next to the weights, and
the decode floor those bytes put under a step.

Every figure is a number in a dataclass, with the terms it was computed from beside it (bytes per token on one GPU,
per layer kind, per recurrent-state element, ...): the working shown under a plan, the arithmetic a reader checks by
hand, is built from these numbers where the plan is rendered.

The decode floor: a decode step reads every weight once and the K/V of every sequence at its context, and writes
this token's K/V; with little arithmetic per byte, it cannot run faster than

    floor = (weights + K/V read + K/V write) / bandwidth        per GPU, every GPU in parallel under tensor parallel

so `batch / floor` is a ceiling on tokens per second for the batch (and `1 / floor` per sequence). The terms match
the ones `kvbench bench` calls step bytes (bench/floor.py): K/V read is the cache at `ctx` tokens (this step's
token included), the write is one more token's K/V. Not counted: activations, logits, the design's own extra
traffic (copies, dequantisation), tensor-parallel communication, and the re-write of a recurrent state (it is read
once, as part of the cache). Weights are all the parameters, once (a step reads only its batch's rows of an input
embedding table; bench counts those rows), but for a mixture of experts (`step_params`): a step reads the dense
layers, attention, the routers and the shared experts, and in each MoE layer the routed experts its tokens pick,
min(experts, batch x top-k) of them: the top-k at batch 1, every expert only once batch x top-k reaches the expert
count (tokens spread over distinct experts, as load-balanced routing tends to; a batch whose tokens share experts
reads fewer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.memory.formulas import (
    bytes_per_sequence,
    kind_bytes_per_token,
    kv_heads_per_gpu,
    layer_bytes_per_token,
    state_bytes,
    state_element_bytes,
    token_bytes,
)
from kvbench.memory.spec import GPUSpec, KVFormat, ModelSpec, PeakBandwidth, get_kv_format, weight_bits
from kvbench.memory.units import MAX_TOKENS, fmt_bytes, fmt_int, parse_overhead
from kvbench.validate import past_context

# reserve for activations, CUDA context and allocator slack (vLLM's default leaves 10%)
DEFAULT_OVERHEAD = "10%"


@dataclass
class DecodeFloor:
    """One context and batch: the bytes a decode step moves on one GPU, and the time and rate they allow."""

    weights_bytes: int  # weights on one GPU, each read once per step
    kv_read_bytes: int  # the cache of every sequence at ctx on one GPU (K/V, and any recurrent state)
    kv_write_bytes: int  # this step's token: its K/V for every sequence on one GPU
    step_bytes: int  # weights + kv_read + kv_write
    bandwidth: int  # bytes/s divided by
    floor_ms: float  # step_bytes / bandwidth, in milliseconds: no step is faster
    tokens_per_s_per_sequence: float  # 1 / floor: each sequence gains one token per step
    tokens_per_s: float  # batch / floor: the whole batch's tokens per second (aggregate)
    kv_write_bytes_per_sequence: int = 0  # one sequence's share of kv_write_bytes: one token's K/V on one GPU
    experts_read: int | None = None  # MoE: routed experts the step reads per MoE layer (step_params); None: dense


@dataclass
class PlanRow:
    """One model at one context length."""

    ctx: int  # context length in tokens (prompt + generated)
    batch: int  # sequences
    tokens_held: int  # tokens held per sequence summed over layers (ctx x layers unless windows cap some)
    bytes_per_seq: int  # cache bytes for one sequence at ctx
    bytes_batch: int  # cache bytes for the batch
    bytes_per_gpu: int  # cache bytes each GPU holds under tensor parallelism (= bytes_batch at tp 1)
    beyond_max: bool  # ctx is past the context the model was trained for
    windowed: bool  # some layers are capped at their window at this ctx
    fits: bool | None  # weights + cache + allowance fit in the GPU (None: no GPU given)
    max_batch: int | None  # most sequences of ctx tokens that fit next to the weights (None: no GPU)
    max_ctx: int | None  # longest context at `batch` that fits (None: no GPU, or unbounded)
    max_ctx_unbounded: bool  # every layer is windowed and the windows fit: the cache stops growing
    max_ctx_at_limit: bool = False  # the search limit itself fits: the true maximum is max_ctx or more
    decode_floor: DecodeFloor | None = None  # the step's bytes over the bandwidth (None: no bandwidth given)
    kv_bytes_per_seq: int = 0  # bytes_per_seq without the recurrent state: one sequence's K/V


@dataclass
class GPUBudget:
    """What a GPU has left for the KV cache."""

    name: str  # preset key or "custom"
    label: str  # product name or the --gpu-mem text
    memory: int  # bytes per GPU
    overhead: int  # bytes set aside for activations, CUDA context and allocator slack
    weights_per_gpu: int  # bytes of weights on each GPU
    available: int  # memory - overhead - weights: what the cache may use (negative: weights alone do not fit)
    overhead_text: str = ""  # --overhead as given: a share of the memory (10%) or a size (4GiB)


@dataclass
class ModelPlan:
    """One model's cache across contexts, and the terms its numbers were computed from."""

    model: ModelSpec  # the shape used
    kv_dtype: str  # storage format of the cache
    weights_dtype: str  # storage format of the weights
    tp: int  # tensor-parallel degree
    kv_heads_per_gpu: int  # KV heads each GPU holds (replicated when tp > kv_heads under vLLM; all of MLA's latent)
    layer_bytes_per_token: int  # bytes one layer caches per token (whole model)
    bytes_per_token: int  # bytes per token over all layers, no window applied ("KiB / token")
    weights_bytes: int | None  # params x bytes(weights dtype), whole model
    rows: list[PlanRow]  # one per context
    gpu: GPUBudget | None  # the budget, when a GPU was given
    warnings: list[str]  # beyond-trained-context and similar, one line each
    notes: list[str]  # facts about the model the numbers depend on (windows, MLA, quantization overhead)
    kv_cache: bool = True  # False: no layer attends, so nothing grows per token (a recurrent model)
    # a recurrent state held per sequence at any context (included in the rows)
    state_bytes_per_sequence: int = 0
    bandwidth: PeakBandwidth | None = None  # what the rows' decode floors divide by (None: no floor)
    bytes_per_token_per_gpu: int = 0  # bytes_per_token on one GPU under tensor parallelism
    # bytes_per_token split into the full-attention layers ("full") and the windowed ones (their window kind)
    bytes_per_token_by_kind: dict[str, int] = field(default_factory=dict)
    state_element_bytes: int = 0  # bytes of one recurrent-state element
    state_bytes_per_gpu: int = 0  # state_bytes_per_sequence split evenly over the tp GPUs
    weights_bytes_per_gpu: int | None = None  # weights_bytes split evenly over the tp GPUs
    tp_engine: str = "vllm"  # whose rule split the KV heads over the tp GPUs (formulas.TP_ENGINES)


def gpu_budget(
    gpu: GPUSpec | None, gpu_mem: int | None, overhead: str, weights_per_gpu: int, gpu_mem_text: str = ""
) -> GPUBudget | None:
    """Memory - allowance - weights: the bytes each GPU has for the cache (None when no GPU was given)."""
    if gpu is not None:
        memory = gpu.memory
    elif gpu_mem is not None:
        memory = gpu_mem
    else:
        return None
    reserve, _ = parse_overhead(overhead, memory)
    label = f"{gpu.label} ({gpu.nominal})" if gpu else f"--gpu-mem {gpu_mem_text or fmt_bytes(memory)}"
    return GPUBudget(
        name=gpu.name if gpu else "custom",
        label=label,
        memory=memory,
        overhead=reserve,
        weights_per_gpu=weights_per_gpu,
        available=memory - reserve - weights_per_gpu,
        overhead_text=overhead,
    )


def max_context(
    spec: ModelSpec, fmt: KVFormat, kv_heads: int, batch: int, available: int, state: int = 0
) -> tuple[int | None, str]:
    """Longest context whose cache for `batch` sequences (each also holding `state` bytes of recurrent state) fits
    in `available` bytes, and how it ended: "found", "unbounded" (every layer windowed or recurrent: the memory
    stops growing) or "limit" (MAX_TOKENS fits)."""

    def need(ctx: int) -> int:
        return batch * (bytes_per_sequence(spec, fmt, ctx, kv_heads) + state)

    if available <= 0 or need(1) > available:
        return 0, "found"
    if need(MAX_TOKENS) <= available:
        return (None, "unbounded") if spec.n_full == 0 else (MAX_TOKENS, "limit")
    lo, hi = 1, MAX_TOKENS  # lo fits, hi does not; bytes grow monotonically with ctx, so bisect
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= available:
            lo = mid
        else:
            hi = mid
    return lo, "found"


def _window_note(spec: ModelSpec) -> str:
    assert spec.sliding_window is not None, f"{spec.name}: windowed layers without a window"
    n, w = spec.n_windowed, fmt_int(spec.sliding_window)
    # a hybrid: only attention layers have a window
    attn = "attention " if spec.model_layers is not None else ""
    every = n == spec.n_layers
    which = f"every {attn}layer uses" if every else f"{n} of {spec.n_layers} {attn}layers use"
    if spec.window_kind == "chunked":
        return (
            f"{which} {w}-token chunked attention: each attends only within its own chunk, so "
            f"{'each holds' if every else 'those layers hold'} at most {w} tokens (a cache that ignores "
            f"the chunks holds all of them)"
        )
    return (
        f"{which} {_a(w)} {w}-token sliding window: past that length {'each holds' if every else 'those layers hold'} "
        f"only the last {w} tokens (a windowed cache; a cache that ignores the window holds all of them)"
    )


def _a(number: str) -> str:
    """The article before a number as it is read aloud: an 8-, an 11-, an 18-, an 800-token window; a 4,096-."""
    lead = number.split(",")[0]
    return "an" if lead.startswith("8") or lead in ("11", "18") else "a"


def _notes(spec: ModelSpec, fmt: KVFormat, per_token: int) -> list[str]:
    notes: list[str] = []
    if spec.state_layers:
        what = (
            "keeps a fixed-size recurrent state and no KV cache"
            if not spec.kv_cache
            else (
                f"is a hybrid: {spec.state_layers} of its {spec.model_layers} layers keep a fixed-size recurrent state, "
                f"only its attention layers ({spec.n_layers}) cache K/V"
            )
        )
        notes.append(f"{spec.family} {what}: the state does not grow with the context")
    if spec.sliding_layers:
        notes.append(_window_note(spec))
    if spec.is_mla and spec.qk_nope_head_dim and spec.v_head_dim:
        assert spec.qk_rope_head_dim is not None, f"{spec.name}: an MLA latent without its RoPE key width"
        expanded = spec.n_layers * spec.n_kv_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim)
        notes.append(
            f"MLA caches the {spec.kv_lora_rank}+{spec.qk_rope_head_dim} latent (vLLM, SGLang, DeepSeek's own code "
            f"and transformers 5.x all do). An engine that expands it to per-head K "
            f"({spec.qk_nope_head_dim}+{spec.qk_rope_head_dim}) and V ({spec.v_head_dim}) for {spec.n_kv_heads} "
            f"heads before caching holds {fmt_int(expanded)} elements/token, "
            f"{expanded / (per_token / (fmt.bits / 8)):.0f}x more"
        )
    if fmt.group_size or fmt.name == "fp8":
        notes.append(f"{fmt.name} cache: {fmt.note}")
    if spec.resolved_by.startswith("transformers"):
        notes.append(f"config.json read by {spec.resolved_by}")
    if spec.note:
        notes.append(spec.note)
    return notes


@dataclass(frozen=True)
class _Sizes:
    """What every row of one plan shares."""

    fmt: KVFormat
    kv_heads_gpu: int
    batch: int
    budget: GPUBudget | None
    state: int = 0  # recurrent state bytes per sequence
    state_gpu: int = 0  # the same on one GPU under tp


def _row(spec: ModelSpec, s: _Sizes, ctx: int) -> PlanRow:
    held = spec.held(ctx)
    kv_per_seq = bytes_per_sequence(spec, s.fmt, ctx)
    per_seq = kv_per_seq + s.state
    per_seq_gpu = bytes_per_sequence(spec, s.fmt, ctx, s.kv_heads_gpu) + s.state_gpu
    per_gpu = per_seq_gpu * s.batch
    row = PlanRow(
        ctx=ctx,
        batch=s.batch,
        tokens_held=held,
        bytes_per_seq=per_seq,
        bytes_batch=per_seq * s.batch,
        bytes_per_gpu=per_gpu,
        beyond_max=past_context(ctx, spec.max_context),
        windowed=held < ctx * spec.n_layers,
        fits=None,
        max_batch=None,
        max_ctx=None,
        max_ctx_unbounded=False,
        kv_bytes_per_seq=kv_per_seq,
    )
    if s.budget is not None:
        available = s.budget.available
        row.fits = available >= per_gpu
        row.max_batch = (available // per_seq_gpu if per_seq_gpu else None) if available > 0 else 0
        row.max_ctx, how = max_context(spec, s.fmt, s.kv_heads_gpu, s.batch, available, s.state_gpu)
        row.max_ctx_unbounded, row.max_ctx_at_limit = how == "unbounded", how == "limit"
    return row


def _check_request(contexts: list[int], batches: list[int]) -> None:
    # the caller's promise (memory/request.py: parse_ctx, memory_rules)
    assert contexts and all(1 <= c <= MAX_TOKENS for c in contexts), contexts
    assert all(b >= 1 for b in batches), batches


def _beyond_training(spec: ModelSpec, contexts: list[int]) -> list[str]:
    """A warning for each context past the one the model was trained for (planned anyway: it is arithmetic)."""
    trained = spec.max_context
    return [
        f"{spec.name}: {fmt_int(ctx)} tokens is beyond the {fmt_int(trained)} it was trained for "
        f"(max_position_embeddings); computed anyway"
        for ctx in contexts
        if trained is not None and past_context(ctx, trained)
    ]


def plan(
    spec: ModelSpec,
    contexts: list[int],
    batch: int | list[int] = 1,
    kv_dtype: str = "fp16",
    weights_dtype: str = "bf16",
    tp: int = 1,
    gpu: GPUSpec | None = None,
    gpu_mem: int | None = None,
    overhead: str = DEFAULT_OVERHEAD,
    gpu_mem_text: str = "",
    bandwidth: PeakBandwidth | None = None,
    tp_engine: str = "vllm",
) -> ModelPlan:
    """Bytes per token, per sequence, per batch and per GPU for `spec` at each context (a row per batch and context
    when `batch` is a list), with the terms they come from; with `bandwidth`, each row's decode floor too. The KV
    heads split over `tp` GPUs by `tp_engine`'s rule (formulas.TP_ENGINES)."""
    batches = [batch] if isinstance(batch, int) else list(batch)
    _check_request(contexts, batches)
    fmt, wbits, kvh = (
        get_kv_format(kv_dtype),
        weight_bits(weights_dtype),
        kv_heads_per_gpu(spec, tp, tp_engine),
    )
    per_token = token_bytes(spec, fmt)
    state, state_gpu = state_bytes(spec, fmt), state_bytes(spec, fmt, tp)
    weights = None if spec.params is None else -(-spec.params * wbits // 8)
    weights_gpu = None if weights is None else -(-weights // tp)
    budget = gpu_budget(gpu, gpu_mem, overhead, weights_gpu or 0, gpu_mem_text)
    rows = [_row(spec, _Sizes(fmt, kvh, b, budget, state, state_gpu), ctx) for b in batches for ctx in contexts]
    p = ModelPlan(
        model=spec,
        kv_dtype=fmt.name,
        weights_dtype=weights_dtype,
        tp=tp,
        kv_heads_per_gpu=kvh,
        layer_bytes_per_token=layer_bytes_per_token(spec, fmt),  # the model-wide shape's (per_token: all layers)
        bytes_per_token=per_token,
        weights_bytes=weights,
        rows=rows,
        gpu=budget,
        warnings=_beyond_training(spec, contexts),
        notes=_notes(spec, fmt, per_token),
        kv_cache=spec.kv_cache,
        state_bytes_per_sequence=state,
        bytes_per_token_per_gpu=token_bytes(spec, fmt, kvh),
        bytes_per_token_by_kind=kind_bytes_per_token(spec, fmt),
        state_element_bytes=0 if spec.state_elements is None else state_element_bytes(fmt),
        state_bytes_per_gpu=state_gpu,
        weights_bytes_per_gpu=weights_gpu,
        tp_engine=tp_engine,
    )
    attach_floors(p, bandwidth)
    return p


def experts_read(spec: ModelSpec, batch: int) -> int:
    """Routed experts a decode step of `batch` sequences reads per MoE layer: min(experts, batch x top-k)."""
    return min(spec.experts, batch * spec.experts_per_token)


def step_params(spec: ModelSpec, batch: int) -> int | None:
    """Parameters one decode step of `batch` sequences reads: all of them for a dense model; for a mixture of
    experts, all but the routed experts no token of the step can route to."""
    if spec.params is None or not spec.experts:
        return spec.params
    return spec.params - (spec.experts - experts_read(spec, batch)) * spec.expert_params


def floor_for(batch: int, weights: int, kv_read: int, write_per_seq: int, bw: PeakBandwidth) -> DecodeFloor:
    """The floor of one step of `batch` sequences, from per-GPU bytes: the weights, the cache read at the context,
    and this token's K/V write for each sequence."""
    write = batch * write_per_seq
    total = weights + kv_read + write
    seconds = total / bw.bytes_per_s
    per_seq = 1 / seconds
    return DecodeFloor(
        weights_bytes=weights,
        kv_read_bytes=kv_read,
        kv_write_bytes=write,
        step_bytes=total,
        bandwidth=bw.bytes_per_s,
        floor_ms=seconds * 1e3,
        tokens_per_s_per_sequence=per_seq,
        tokens_per_s=batch * per_seq,
        kv_write_bytes_per_sequence=write_per_seq,
    )


def attach_floors(plan: ModelPlan, bw: PeakBandwidth | None) -> None:
    """Give every row of `plan` its decode floor over `bw`; a model without a parameter count gets a note instead
    (its weights, most of a step's bytes, are unknown)."""
    if bw is None:
        return
    plan.bandwidth = bw
    if plan.weights_bytes_per_gpu is None:
        plan.notes.append("no parameter count for this model, so no decode floor (its weights are unknown)")
        return
    spec, fmt = plan.model, get_kv_format(plan.kv_dtype)
    write = bytes_per_sequence(spec, fmt, 1, plan.kv_heads_per_gpu) if spec.kv_cache else 0
    for r in plan.rows:
        weights = plan.weights_bytes_per_gpu
        read = step_params(spec, r.batch)
        if spec.experts and read is not None:  # the experts this step can route to, on one GPU
            read_bytes = -(-read * weight_bits(plan.weights_dtype) // 8)
            weights = -(-read_bytes // plan.tp)
        r.decode_floor = floor_for(r.batch, weights, r.bytes_per_gpu, write, bw)
        if spec.experts:
            r.decode_floor.experts_read = experts_read(spec, r.batch)
