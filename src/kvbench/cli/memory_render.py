"""How `kvbench memory` lays out what the planner returns: the plan tables with their working, --all, --check,
--copy-traffic and --measure. The planner's dataclasses carry the numbers and cli/memory_working.py writes their
arithmetic out; these functions only lay it out."""

from __future__ import annotations

from rich.text import Text

from kvbench.console import Notes, fitted, line, out, styled, table

# --- rendering ---
# The planner returns dataclasses of numbers and memory_working writes out their arithmetic; these functions lay both
# out. Names, paths and config fields are user text: they go into Text (literal), never into markup.


def _mem_ctx(ctx: int, beyond: bool, windowed: bool) -> str:
    from kvbench.memory.units import fmt_tokens

    return fmt_tokens(ctx) + ("*" if windowed else "") + ("†" if beyond else "")


def _working(lines: list[str]) -> None:
    for w in lines:
        out.print(Text(f"  {w}"), soft_wrap=True)


def _shape(m) -> str:
    return {
        "MHA": f"MHA, {m.n_heads} heads each with its own K/V",
        "GQA": f"GQA, {m.n_heads} query heads share {m.n_kv_heads} KV heads",
        "MQA": f"MQA, {m.n_heads} query heads share 1 KV head",
        "MLA": f"MLA, {m.n_heads} heads read one {m.kv_lora_rank}+{m.qk_rope_head_dim} latent",
        "none": "no attention: every layer keeps a fixed-size recurrent state",
    }[m.attention]


def _layers(m) -> str:
    if m.model_layers is None:
        return f"{m.n_layers} layers"
    if not m.kv_cache:
        return f"{m.model_layers} recurrent layers"
    return f"{m.model_layers} layers ({m.n_layers} attention, {m.state_layers} with a recurrent state)"


def _cache_line(p):
    from kvbench.memory.units import fmt_bytes

    m = p.model
    state = (
        f"{fmt_bytes(p.state_bytes_per_sequence)} per sequence at any context"
        if m.state_elements is not None
        else "not sized from this config"
    )
    if not m.kv_cache:
        return line("KV cache: ", styled("none", "bold"), f"; recurrent state: {state} ({p.kv_dtype})")
    per_token = styled(f"{fmt_bytes(p.bytes_per_token)}/token", "bold")
    if not m.state_layers:
        return line("KV cache: ", per_token, f" ({p.kv_dtype})")
    return line(
        "KV cache: ",
        per_token,
        f" ({p.kv_dtype}) in its {m.n_layers} attention layers; recurrent state: {state}",
    )


def _longest(r, m) -> str:
    from kvbench.memory.units import MAX_TOKENS

    if r.max_ctx_unbounded:
        return "unbounded (no KV cache)" if not m.kv_cache else "unbounded (all layers windowed)"
    if r.max_ctx_at_limit:
        return f">= {r.max_ctx:,}" + ("" if r.max_ctx == MAX_TOKENS else f" (searched up to {MAX_TOKENS:,})")
    return f"{r.max_ctx:,}" + ("†" if m.max_context and r.max_ctx > m.max_context else "")


def _plan_table(p):
    from kvbench.memory.units import fmt_bytes

    batches = list(dict.fromkeys(r.batch for r in p.rows))
    batch = batches[0] if batches else 1
    several = len(batches) > 1
    weights_gpu = None if p.weights_bytes is None else -(-p.weights_bytes // p.tp)
    floors = any(r.decode_floor is not None for r in p.rows)
    cols = ["context"] + (["batch"] if several else []) + ["per seq"]
    cols += ["batch total" if several else f"batch of {batch}"] if several or batch > 1 else []
    cols += [f"per GPU (tp {p.tp})"] if p.tp > 1 else []
    cols += ["+ weights" + (" per GPU" if p.tp > 1 else "")] if weights_gpu is not None else []
    cols += ["fits", "max batch", "max context"] if p.gpu is not None else []
    cols += ["floor/step", "tok/s/seq", "tok/s"] if floors else []
    rows = []
    for r in p.rows:
        row: list[str | Text] = [_mem_ctx(r.ctx, r.beyond_max, r.windowed)]
        row += [str(r.batch)] if several else []
        row += [fmt_bytes(r.bytes_per_seq)]
        row += [fmt_bytes(r.bytes_batch)] if several or batch > 1 else []
        row += [fmt_bytes(r.bytes_per_gpu)] if p.tp > 1 else []
        row += [fmt_bytes(r.bytes_per_gpu + weights_gpu)] if weights_gpu is not None else []
        if p.gpu is not None:
            row += [
                styled("yes", "green") if r.fits else styled("no", "red"),
                str(r.max_batch),
                _longest(r, p.model),
            ]
        if floors:
            f = r.decode_floor
            row += (
                ["-"] * 3
                if f is None
                else [f"{f.floor_ms:.4g} ms", f"{f.tokens_per_s_per_sequence:,.4g}", f"{f.tokens_per_s:,.4g}"]
            )
        rows.append(row)
    return fitted(None, cols, rows, out.width, keys=2 if several else 1)


def _plan_key(p) -> str:
    """What the plan table's short headers stand for."""
    several = len({r.batch for r in p.rows}) > 1
    at = "this batch" if several else f"batch {p.rows[0].batch if p.rows else 1}"
    parts = ["per seq: KV bytes of one sequence at the context"]
    if p.gpu is not None:
        parts += [f"max batch: sequences that fit at this context; max context: at {at}"]
    if any(r.decode_floor is not None for r in p.rows):
        parts += ["floor/step: the decode floor of one step; tok/s/seq: tokens/s per sequence; tok/s: the batch's"]
    return "; ".join(parts)


def render_plan(p) -> None:
    """One model: a header with the per-token working, a row per context, then each row's arithmetic and notes."""
    from kvbench.cli.memory_working import gpu_line, plan_lines, row_lines
    from kvbench.memory.units import fmt_tokens

    m = p.model
    max_ctx = "unknown" if m.max_context is None else fmt_tokens(m.max_context)
    head = f"  {_shape(m)}, {_layers(m)}, max context {max_ctx}"
    source = ("  ", styled(m.source, "dim")) if m.source != m.name else ()
    out.print(line(styled(m.name, "bold"), *source, head), soft_wrap=True)
    out.print(_cache_line(p), soft_wrap=True)
    _working(plan_lines(p))
    for x in _plan_table(p):
        out.print(x)
    out.print(styled(_plan_key(p), "dim"))
    if any(r.max_ctx_at_limit for r in p.rows):
        from kvbench.memory.units import MAX_TOKENS

        out.print(styled(f">= the longest context the planner tries: searched up to {MAX_TOKENS:,}", "dim"))
    if any(r.windowed for r in p.rows):
        out.print(styled(f"* {m.window_label} layers capped at {m.sliding_window:,} tokens", "dim"))
    if any(r.beyond_max for r in p.rows):
        out.print(styled("† beyond the context the model was trained for (computed anyway)", "dim"))
    if p.gpu is not None:
        out.print(Text(f"GPU: {p.gpu.label}: {gpu_line(p.gpu)}"), soft_wrap=True)
    out.print(styled("working:", "dim"))
    for r in p.rows:
        _working(row_lines(p, r))
    for n in p.notes:
        out.print(line(styled("note:", "dim"), " ", n), soft_wrap=True)


def _all_caption(plans: list, gpu) -> str:
    from kvbench.memory.units import fmt_bytes

    windowed = [
        f"{p.model.name} ({p.model.n_windowed} of {p.model.n_layers} layers at {p.model.sliding_window}"
        + (", chunked" if p.model.window_kind == "chunked" else "")
        + ")"
        for p in plans
        if p.model.sliding_layers
    ]
    caption = (
        "bytes/token = 2 x layers x kv_heads x head_dim x bytes (MLA: (kv_lora_rank + qk_rope_head_dim) x layers "
        "x bytes)."
        + (f" * layers capped at their window (sliding or chunked): {', '.join(windowed)}." if windowed else "")
        + " † beyond the context the model was trained for, computed anyway."
        + (" Weights of multimodal models are their language model's." if any(p.model.wrapper for p in plans) else "")
    )
    if gpu is not None:
        tp = plans[0].tp
        where = f"{tp} x {gpu.label} (tensor parallel)" if tp > 1 else gpu.label
        caption += f" Max batch on {where} after weights and a {fmt_bytes(gpu.overhead)} allowance per GPU."
    return caption


def render_all(plans: list, batch: int, kv_dtype: str, weights_dtype: str) -> None:
    """Every preset in one table."""
    from kvbench.memory.units import fmt_bytes, fmt_tokens

    if not plans:
        return
    contexts = [r.ctx for r in plans[0].rows]
    gpu = plans[0].gpu
    per = "per sequence" if batch == 1 else f"batch of {batch}"
    cols = ["model", "attention", "layers", "KV/token"]
    cols += [fmt_tokens(c) for c in contexts]
    if gpu is not None:
        cols += [f"max batch {fmt_tokens(c)}" for c in contexts]
    cols += ["trained", "weights"]
    rows = []
    for p in plans:
        m = p.model
        row = [m.name, f"{m.attention} {m.kv_shape}", str(m.n_layers), fmt_bytes(p.bytes_per_token)]
        row += [fmt_bytes(r.bytes_batch) + ("*" if r.windowed else "") + ("†" if r.beyond_max else "") for r in p.rows]
        if gpu is not None:
            row += [str(r.max_batch) for r in p.rows]
        row += [
            "?" if m.max_context is None else fmt_tokens(m.max_context),
            "?" if p.weights_bytes is None else fmt_bytes(p.weights_bytes),
        ]
        rows.append(row)
    title = (
        f"KV cache for every preset ({kv_dtype}): KV bytes {per} at each context; weights in {weights_dtype}; "
        "trained = the context the model was trained for"
    )
    for x in fitted(title, cols, rows, out.width, wrap=("attention",)):
        out.print(x)
    out.print(styled(_all_caption(plans, gpu), "dim"))


def render_checks(checks: list) -> None:
    """--check: planner vs transformers' own cache per context and layer kind, each difference in one line."""
    from kvbench.memory.units import fmt_bytes, fmt_tokens

    c0 = checks[0]
    title = Text(f"check: {c0.model} against transformers' own cache")
    if not c0.checkable:
        out.print(line(title, ": ", styled(c0.how, "yellow")), soft_wrap=True)
        return
    cols = ["context", "layer kind", "layers", "planner", "transformers", "result", "one transformers layer"]
    rows, notes = [], Notes()
    for c in checks:
        for k in c.kinds:
            layers = (
                str(k.planner_layers)
                if k.planner_layers == k.transformers_layers
                else (f"{k.planner_layers} vs {k.transformers_layers}")
            )
            result = styled("agrees", "green") if k.agrees else styled(f"differs {notes.ref(k.explanation)}", "yellow")
            rows.append(
                [
                    fmt_tokens(c.ctx),
                    k.label,
                    layers,
                    fmt_bytes(k.planner_bytes),
                    fmt_bytes(k.transformers_bytes),
                    result,
                    _kv_shape(k.transformers_layer_shape),
                ]
            )
    for x in fitted(title, cols, rows, out.width, keys=2, wrap=("layer kind", "one transformers layer")):
        out.print(x)
    for n in notes.lines():
        out.print(n)
    out.print(styled(c0.how, "dim"))
    if c0.transformers_params is not None and c0.planner_params is not None:
        from kvbench.cli.memory_working import params_line

        out.print(Text(f"  parameters: {params_line(c0)}"), soft_wrap=True)
    verdict = all(c.agrees for c in checks)
    out.print(
        styled(
            "the plan agrees with transformers to the byte"
            if verdict
            else "the plan and transformers differ where the notes beneath the table say why",
            "bold green" if verdict else "bold yellow",
        )
    )


def _kv_shape(shape: str) -> str:
    """One layer's K and V shapes, once when they are the same: "K,V 1x8x8192x128"."""
    k, sep, v = shape.partition(", V ")
    return f"K,V {v}" if sep and k == f"K {v}" else shape


def render_copy_traffic(traffic: list) -> None:
    """What a torch.cat cache copies while growing: the closed form, the common (n1^2 - n0^2)/2 approximation, and
    our counter."""
    from kvbench.memory.units import fmt_bytes

    cols = ["model", "KV/token", "tokens", "copied (exact)", "(n1²-n0²)/2", "counted"]
    rows, notes = [], Notes()
    for name, t in traffic:
        if t.measured_bytes is None:
            counted = styled(notes.ref(t.counter_note), "dim")
        else:
            same = styled("= exact", "green") if t.measured_bytes == t.exact_bytes else styled("differs", "red")
            counted = line(f"{t.measured_bytes:,} B ", same, f" {notes.ref(t.counter_note)}")
        rows.append(
            [
                name,
                fmt_bytes(t.bytes_per_token),
                f"{t.n0} -> {t.n1}" + (f" x {t.batch} seqs" if t.batch > 1 else ""),
                f"{fmt_bytes(t.exact_bytes)} ({t.exact_bytes:,} B)",
                fmt_bytes(t.seed_approx_bytes),
                counted,
            ]
        )
    title = "History copied by torch.cat while decoding: exact, the seed's (n1²-n0²)/2, and the dynamic cache's counter"
    for x in fitted(title, cols, rows, out.width, wrap=("tokens", "copied (exact)", "counted")):
        out.print(x)
    for n in notes.lines():
        out.print(n)
    if len(traffic) == 1:
        from kvbench.cli.memory_working import copy_traffic_lines

        _working(copy_traffic_lines(traffic[0][1]))


def render_measure(report) -> None:
    """Predicted vs measured bytes for every registered cache."""
    from kvbench.memory.units import fmt_bytes

    cuda = any(r.allocated_bytes is not None for r in report.rows)
    cols = ["cache", "predicted", "measured (nbytes)", "difference"]
    if cuda:
        cols += ["allocator growth", "transient extra"]
    cols.append("why")
    rows, notes = [], Notes()
    for r in report.rows:
        diff = styled("0 B (exact)", "green") if r.exact else styled(f"{r.difference:+,} B", "yellow")
        fmt_note = f" ({r.planner_format})" if r.planner_format != report.kv_dtype else ""
        row = [r.cache, f"{r.predicted_bytes:,} B{fmt_note}", f"{r.measured_bytes:,} B", diff]
        if cuda:
            row += [
                "-" if r.allocated_bytes is None else fmt_bytes(r.allocated_bytes),
                "-" if not r.peak_extra_bytes else fmt_bytes(r.peak_extra_bytes),
            ]
        row.append(notes.ref(r.explanation))
        rows.append(row)
    title = (
        f"{report.model}: predicted vs measured, batch {report.batch} x {report.ctx} tokens, {report.kv_dtype}; "
        f"device: {report.device}"
    )
    for x in fitted(Text(title), cols, rows, out.width, wrap=("predicted",)):
        out.print(x)
    for n in notes.lines():
        out.print(n)
    _working(report.working)


def render_paged(r) -> None:
    """Paged vs static for a batch of mixed lengths: the waste paging removes."""
    from kvbench.memory.units import fmt_bytes

    rows = [
        ["needed (exactly the tokens held)", fmt_bytes(r.needed_bytes), "-"],
        [f"static: {len(r.lengths)} x {r.max_len} slots reserved", fmt_bytes(r.static_bytes), f"{r.static_waste:.1%}"],
        [
            f"paged: {r.blocks_used} blocks of {r.block_size} per layer",
            fmt_bytes(r.paged_bytes),
            f"{r.paged_waste:.1%}",
        ],
    ]
    title = f"paged vs static for sequences of {', '.join(map(str, r.lengths))} tokens"
    out.print(table(title, ["", "KV memory", "waste"], rows, caption=f"paging reserves {r.saving:.1%} less"))
