"""The working under `kvbench memory`: the planner's arithmetic as text, built from the numbers it returns, one line
per step, for the terminal and for --json alike; and the --json documents that carry it.

The planner (kvbench.memory) computes numbers and keeps the terms beside them; every line here substitutes those
numbers into the formula they came from, so a reader can redo the arithmetic by hand. Nothing here computes a byte
count the plan does not hold.
"""

from __future__ import annotations

from dataclasses import asdict, fields, is_dataclass
from typing import Any

from kvbench.memory.check import CacheCheck
from kvbench.memory.formulas import CopyTraffic
from kvbench.memory.planner import GPUBudget, ModelPlan, PlanRow
from kvbench.memory.spec import KVFormat, ModelSpec, PeakBandwidth, fmt_rate, get_kv_format, weight_bits
from kvbench.memory.units import MAX_TOKENS, fmt_bytes, fmt_int, fmt_params, fmt_tokens, parse_overhead


# --- one model's plan ----------------------------------------------------------------------------------------------
def plan_lines(p: ModelPlan) -> list[str]:
    """How bytes per token, the recurrent state, the weights, the GPU budget and the decode floor were computed."""
    spec, fmt = p.model, get_kv_format(p.kv_dtype)
    lines = _kv_lines(p, spec, fmt)
    if spec.state_layers:
        lines.append(_state_line(p, spec, fmt))
        if p.tp > 1 and p.state_bytes_per_sequence:
            lines.append(
                f"per GPU (tp {p.tp}): the recurrent state split evenly = {fmt_bytes(p.state_bytes_per_gpu)} per "
                "sequence"
            )
    if p.weights_bytes is not None:
        lines.append(_weights_line(p, spec))
    if p.gpu is not None:
        lines.append(f"GPU budget: {gpu_line(p.gpu)}")
    if p.bandwidth is not None and p.weights_bytes is not None:
        lines.append(_floor_plan_line(p, p.bandwidth))
    return lines


def row_lines(p: ModelPlan, r: PlanRow) -> list[str]:
    """One row's arithmetic: the bytes of one sequence, of the batch, on one GPU, whether it fits, and the floor."""
    lines = [_sequence_line(p, r)]
    if r.batch > 1:
        lines.append(f"  x {r.batch} sequences = {fmt_bytes(r.bytes_batch)}")
    if p.tp > 1:
        lines.append(f"  per GPU at tp {p.tp}: {fmt_bytes(r.bytes_per_gpu)}")
    if p.gpu is not None:
        lines.append(_fit_line(r, p.gpu))
    if r.decode_floor is not None:
        lines.append(floor_line(r))
    return lines


def gpu_line(b: GPUBudget) -> str:
    """Memory - allowance - weights, or why nothing is left."""
    _, how = parse_overhead(b.overhead_text, b.memory)
    if b.available >= 0:
        return (
            f"{fmt_bytes(b.memory)} ({fmt_int(b.memory)} B) - allowance {how} for activations, CUDA context and "
            f"allocator slack - weights {fmt_bytes(b.weights_per_gpu)} per GPU = {fmt_bytes(b.available)} for the cache"
        )
    return f"weights {fmt_bytes(b.weights_per_gpu)} per GPU + allowance {how} exceed {fmt_bytes(b.memory)}"


def plan_warnings(p: ModelPlan) -> list[str]:
    """The plan's own warnings, and one when the weights leave the GPU no room for any cache."""
    if p.gpu is None or p.gpu.available > 0:
        return list(p.warnings)
    return [*p.warnings, f"{p.model.name}: {gpu_line(p.gpu)}: no room for any cache"]


def floor_line(r: PlanRow) -> str:
    """The decode floor of one row: the step's bytes over the bandwidth, and the tokens/s it allows."""
    f = r.decode_floor
    assert f is not None, "a row with a decode floor"
    return (
        f"  decode floor at {fmt_tokens(r.ctx)} x {r.batch}: (weights {fmt_int(f.weights_bytes)} B + K/V read "
        f"{fmt_int(f.kv_read_bytes)} B + K/V write {r.batch} x {fmt_int(f.kv_write_bytes_per_sequence)} B) = "
        f"{fmt_int(f.step_bytes)} B ({fmt_bytes(f.step_bytes)}) / {fmt_int(f.bandwidth)} B/s = {f.floor_ms:.4g} ms "
        f"per step; 1 / {f.floor_ms:.4g} ms = {f.tokens_per_s_per_sequence:,.4g} tokens/s per sequence, x "
        f"{r.batch} = {f.tokens_per_s:,.4g} tokens/s aggregate"
    )


def _vector(fmt: KVFormat, n: int) -> str:
    """The bytes of one n-element cached vector in `fmt`, as arithmetic."""
    if fmt.group_size is None:
        return f"{n} x {fmt.bits / 8:g} B"
    groups = -(-n // fmt.group_size)
    return f"({n} x {fmt.bits}/8 B + ceil({n}/{fmt.group_size}) = {groups} groups x {fmt.meta_bytes} B scales)"


def _per_token(spec: ModelSpec, fmt: KVFormat, kv_heads: int, total: int, label: str) -> str:
    """The per-token formula with this model's numbers, one line."""
    if spec.is_mla:
        assert spec.kv_lora_rank is not None and spec.qk_rope_head_dim is not None, f"{spec.name}: MLA widths"
        n = spec.kv_lora_rank + spec.qk_rope_head_dim
        return (
            f"{label}: ({spec.kv_lora_rank} kv_lora_rank + {spec.qk_rope_head_dim} qk_rope_head_dim) x "
            f"{spec.n_layers} layers x {_vector(fmt, n) if fmt.group_size else f'{fmt.bits / 8:g} B'} ({fmt.name})"
            f" = {fmt_int(total)} B = {fmt_bytes(total)}   [MLA: one latent per token per layer, no factor 2, "
            f"no KV heads]"
        )
    if spec.layer_kv:
        return _per_layer_token(spec, fmt, kv_heads, total, label)
    heads = f"{kv_heads} kv_heads" + (f" (of {spec.n_kv_heads})" if kv_heads != spec.n_kv_heads else "")
    if fmt.group_size:
        vec = f"{_vector(fmt, spec.head_dim)} per {spec.head_dim}-element head vector"
        return (
            f"{label}: 2 (K and V) x {spec.n_layers} layers x {heads} x {vec} ({fmt.name}) = "
            f"{fmt_int(total)} B = {fmt_bytes(total)}"
        )
    return (
        f"{label}: 2 (K and V) x {spec.n_layers} layers x {heads} x {spec.head_dim} head_dim x "
        f"{fmt.bits / 8:g} B ({fmt.name}) = {fmt_int(total)} B = {fmt_bytes(total)}"
    )


def _per_layer_token(spec: ModelSpec, fmt: KVFormat, kv_heads: int, total: int, label: str) -> str:
    """The per-token formula of a model whose layers differ in K/V shape: one term per distinct shape."""
    counts: dict[tuple[int, int], int] = {}
    for i in range(spec.n_layers):
        shape = spec.layer_shape(i, kv_heads)
        counts[shape] = counts.get(shape, 0) + 1
    size = lambda d: _vector(fmt, d) if fmt.group_size else f"{d} head_dim x {fmt.bits / 8:g} B"  # noqa: E731
    terms = " + ".join(f"{n} layers x {h} kv_heads x {size(d)}" for (h, d), n in counts.items())
    return f"{label}: 2 (K and V) x ({terms}) ({fmt.name}) = {fmt_int(total)} B = {fmt_bytes(total)}"


def _kv_lines(p: ModelPlan, spec: ModelSpec, fmt: KVFormat) -> list[str]:
    """The per-token working: every layer, a hybrid's attention layers only, or no KV cache at all; and how the
    bytes divide over tp GPUs (MLA's latent does not)."""
    if not spec.kv_cache:
        return [f"per token: no KV cache: no layer of this {spec.family} model attends; each keeps a fixed-size state"]
    line = _per_token(spec, fmt, spec.n_kv_heads, p.bytes_per_token, "per token")
    if spec.model_layers is not None:
        line += (
            f"   [the {spec.n_layers} attention layers of {spec.model_layers}; {spec.state_layers} layers keep a "
            "recurrent state instead of K/V]"
        )
    if p.tp == 1:
        return [line]
    if spec.is_mla:
        return [
            line,
            f"per GPU (tp {p.tp}): the MLA latent is shared by all heads, so tensor parallelism cannot split it; "
            f"every rank holds the whole {fmt_bytes(p.bytes_per_token)}/token",
        ]
    kvh = p.kv_heads_per_gpu
    split = _per_token(spec, fmt, kvh, p.bytes_per_token_per_gpu, f"per GPU (tp {p.tp}, {p.tp_engine})")
    if kvh * p.tp > spec.n_kv_heads:
        split += (
            f"   [{spec.n_kv_heads} KV heads < tp {p.tp}: each head replicated on {p.tp // spec.n_kv_heads} GPUs (vLLM); "
            "transformers' TP cannot run this split (#48307)]"
        )
    else:
        split += f"   [{spec.n_kv_heads} KV heads / tp {p.tp}, the same under vLLM and transformers' TP]"
    return [line, split]


def _state_line(p: ModelPlan, spec: ModelSpec, fmt: KVFormat) -> str:
    """The recurrent state's bytes per sequence, as arithmetic (its element count as the config gave it)."""
    if spec.state_elements is None:
        return f"recurrent state: {spec.state_working} (not counted below)"
    b = p.state_element_bytes
    held = fmt.name if b * 8 == fmt.bits else f"16-bit: --kv-dtype {fmt.name} applies to K/V only"
    total = p.state_bytes_per_sequence
    return (
        f"recurrent state: {spec.state_working} x {b} B ({held}) = {fmt_int(total)} B = {fmt_bytes(total)} per "
        "sequence, the same at any context"
    )


def _weights_line(p: ModelPlan, spec: ModelSpec) -> str:
    approx = "~" if spec.params_estimated else ""
    wbits, weights = weight_bits(p.weights_dtype), p.weights_bytes
    # the plan counts weights from the parameters, split over the GPUs
    assert spec.params is not None and weights is not None and p.weights_bytes_per_gpu is not None
    line = (
        f"weights: {approx}{fmt_int(spec.params)} params x {wbits / 8:g} B ({p.weights_dtype}) = {fmt_bytes(weights)}"
    )
    if p.tp > 1:
        line += f", {fmt_bytes(p.weights_bytes_per_gpu)} per GPU at tp {p.tp}"
    if spec.wrapper:
        vision = f" (~{fmt_params(spec.vision_params)})" if spec.vision_params else ""
        line += f"  [language model only: the {spec.wrapper} vision tower{vision} is not counted]"
    if approx:
        line += "  [estimated from config.json: embeddings, attention, MLP with every expert, norms; no biases]"
    return line


def _rate(bw: PeakBandwidth) -> str:
    """'3.35 TB/s (3,350,000,000,000 B/s; NVIDIA H100 80GB, <source>)'."""
    where = bw.label if bw.source == "--bandwidth" else f"{bw.label}, {bw.source}"
    return f"{fmt_rate(bw.bytes_per_s)} ({fmt_int(bw.bytes_per_s)} B/s; {where})"


def _floor_plan_line(p: ModelPlan, bw: PeakBandwidth) -> str:
    write = next((r.decode_floor.kv_write_bytes_per_sequence for r in p.rows if r.decode_floor), 0)
    where = " per GPU, every GPU at once (communication not counted)" if p.tp > 1 else ""
    return (
        f"decode floor per step = (weights + K/V of every sequence at the context + this token's K/V write "
        f"{fmt_int(write)} B per sequence){where} / bandwidth {_rate(bw)}"
    )


def _sequence_line(p: ModelPlan, r: PlanRow) -> str:
    """The bytes one sequence holds at this context: its K/V, and any recurrent state beside it."""
    spec, state = p.model, p.state_bytes_per_sequence
    kv = _kv_sequence(p, r)
    if not state:
        return kv
    if not spec.kv_cache:
        return (
            f"{fmt_tokens(r.ctx)}: recurrent state {fmt_int(state)} B = {fmt_bytes(r.bytes_per_seq)} per sequence "
            "(no KV cache)"
        )
    return f"{kv} + recurrent state {fmt_int(state)} B = {fmt_bytes(r.bytes_per_seq)} per sequence"


def _kv_sequence(p: ModelPlan, r: PlanRow) -> str:
    """One sequence's K/V: every layer holds ctx tokens, or its window caps it."""
    spec, ctx, held, kv = p.model, r.ctx, r.tokens_held, r.kv_bytes_per_seq
    per_seq = f"{fmt_int(kv)} B = {fmt_bytes(kv)} per sequence"
    if spec.layer_kv and held != ctx * spec.n_layers:
        tokens = {"full": ctx, spec.window_kind: min(ctx, spec.sliding_window or ctx)}
        layers = {"full": spec.n_full, spec.window_kind: spec.n_windowed}
        terms = " + ".join(
            f"{layers[kind]} {kind} layers ({fmt_int(b)} B/token) x {fmt_int(tokens[kind])} tokens"
            for kind, b in p.bytes_per_token_by_kind.items()
        )
        return f"{fmt_tokens(ctx)}: {terms} = {per_seq}"
    if held == ctx * spec.n_layers:
        return f"{fmt_tokens(ctx)}: {fmt_int(p.bytes_per_token)} B/token x {fmt_int(ctx)} tokens = {per_seq}"
    assert spec.sliding_window is not None, f"{spec.name}: fewer tokens held than ctx x layers without a window"
    return (
        f"{fmt_tokens(ctx)}: {spec.n_full} full layers x {fmt_int(ctx)} tokens + {spec.n_windowed} "
        f"{spec.window_kind} layers x min({fmt_int(ctx)}, {fmt_int(spec.sliding_window)}) tokens = {fmt_int(held)} "
        f"layer-tokens x {fmt_int(p.layer_bytes_per_token)} B = {per_seq}"
    )


def _fit_line(r: PlanRow, budget: GPUBudget) -> str:
    if r.max_ctx_unbounded:
        longest = "unbounded context (" + ("no KV cache" if r.tokens_held == 0 else "every layer windowed") + ")"
    else:
        assert r.max_ctx is not None, "a bounded max context is a number"
        at_limit = f" (searched up to {fmt_int(MAX_TOKENS)})" if r.max_ctx_at_limit else ""
        longest = f"max context {'>= ' if at_limit else ''}{fmt_int(r.max_ctx)}{at_limit}"
    return (
        f"  fits: {fmt_bytes(r.bytes_per_gpu)} {'<=' if r.fits else '>'} {fmt_bytes(max(budget.available, 0))} "
        f"available; max batch {r.max_batch} at {fmt_tokens(r.ctx)}; {longest} at batch {r.batch}"
    )


# --- --copy-traffic and --check ------------------------------------------------------------------------------------
def copy_traffic_lines(t: CopyTraffic) -> list[str]:
    """The closed form of what torch.cat copies, and the common approximation of it, with the numbers."""
    b = f" x {t.batch} sequences" if t.batch > 1 else ""
    n0, n1, per_token = t.n0, t.n1, fmt_int(t.bytes_per_token)
    return [
        f"step t copies the t cached tokens of K and V in every layer; t = {n0} .. {n1 - 1}",
        f"exact: {per_token} B/token x ({n1} - {n0})({n0} + {n1} - 1)/2 = {per_token} x {fmt_int(t.history_tokens)}{b}"
        f" = {fmt_int(t.exact_bytes)} B = {fmt_bytes(t.exact_bytes)}"
        + ("   [windowed layers capped at the window]" if t.windowed else ""),
        f"seed's approximation: {per_token} B/token x ({n1}^2 - {n0}^2)/2{b} = {fmt_int(t.seed_approx_bytes)} B = "
        f"{fmt_bytes(t.seed_approx_bytes)}",
    ]


def params_line(c: CacheCheck) -> str:
    """The planner's parameter estimate against transformers' count ("" when either is missing)."""
    if c.planner_params is None or c.transformers_params is None:
        return ""
    diff = c.planner_params / c.transformers_params - 1
    return (
        f"planner ~{fmt_int(c.planner_params)}, transformers' model {fmt_int(c.transformers_params)} "
        f"(numel on the meta device): {diff:+.2%}"
    )


# --- --json --------------------------------------------------------------------------------------------------------
def to_jsonable(obj: Any) -> Any:
    """Dataclasses (and lists of them) as plain dicts; a model spec also says its attention kind."""
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(o) for o in obj]
    if isinstance(obj, ModelSpec):
        return {**asdict(obj), "attention": obj.attention, "sliding_layers": list(obj.sliding_layers)}
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj


def _with(doc: dict, after: str, key: str, value: Any) -> dict:
    """`doc` with `key` inserted right after `after`, where --json documents have always carried it."""
    out = {}
    for k, v in doc.items():
        out[k] = v
        if k == after:
            out[key] = value
    return out


def plan_json(p: ModelPlan) -> dict:
    """One plan as --json prints it: its numbers, and the working of the plan, its GPU budget, each row and each
    row's decode floor under the key `working`, the same lines the terminal shows."""
    doc = _with(to_jsonable(p), "gpu", "working", plan_lines(p))
    doc["warnings"] = plan_warnings(p)
    if p.gpu is not None:
        doc["gpu"] = _with(doc["gpu"], "available", "working", gpu_line(p.gpu))
    rows = []
    for r, row in zip(p.rows, doc["rows"], strict=True):
        row = _with(row, "max_ctx_at_limit", "working", row_lines(p, r))
        if r.decode_floor is not None:
            row["decode_floor"] = _with(row["decode_floor"], "tokens_per_s", "working", floor_line(r))
        rows.append(row)
    doc["rows"] = rows
    return doc


def copy_traffic_json(t: CopyTraffic) -> dict:
    """One model's --copy-traffic result, with its working."""
    return _with(to_jsonable(t), "counter_note", "working", copy_traffic_lines(t))
