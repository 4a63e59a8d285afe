"""`kvbench memory`: KV-cache capacity planning for real models, and the measured check against our caches."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvbench import console
from kvbench.cli.app import DeviceOpt, JsonOpt, app, handle_errors
from kvbench.console import out, table
from kvbench.errors import KVBenchError


@app.command()
@handle_errors
def memory(
    model: Annotated[
        list[str] | None,
        typer.Option("--model", "-m", help="Preset from configs/models.toml, e.g. llama-3-8b (repeatable)."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="Any Hugging Face config.json of a decoder LLM.")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="One table for every preset.")] = False,
    ctx: Annotated[
        str | None,
        typer.Option(
            "--ctx",
            help="Context lengths, e.g. 8k,32k,128k (k = 1024 tokens, m = 1024k). "
            "Default: the model's max context; 8k,128k with --all.",
        ),
    ] = None,
    batch: Annotated[int, typer.Option("--batch", "-b", help="Sequences held at once.")] = 1,
    kv_dtype: Annotated[
        str,
        typer.Option(
            "--kv-dtype", help="fp32 | fp16 | bf16 | fp8 | int8 | int4 (int8/int4 add group scales)."
        ),
    ] = "fp16",
    weights_dtype: Annotated[
        str, typer.Option("--weights-dtype", help="fp32 | fp16 | bf16 | fp8 | int8 | int4.")
    ] = "bf16",
    gpu: Annotated[
        str | None,
        typer.Option("--gpu", help="GPU preset from configs/gpus.toml: t4, a100-80gb, h100, h200, ..."),
    ] = None,
    gpu_mem: Annotated[
        str | None, typer.Option("--gpu-mem", help="GPU memory instead of --gpu, e.g. 80GiB (GB = 10^9 B).")
    ] = None,
    overhead: Annotated[
        str,
        typer.Option("--overhead", help="Allowance for activations, CUDA context, allocator: 10% or 4GiB."),
    ] = "10%",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel GPUs (KV heads split across them).")] = 1,
    copy_traffic: Annotated[
        bool,
        typer.Option("--copy-traffic", help="Bytes a torch.cat cache copies growing from --from to --to."),
    ] = False,
    from_: Annotated[int, typer.Option("--from", help="Tokens cached at the start (--copy-traffic).")] = 128,
    to: Annotated[int, typer.Option("--to", help="Tokens cached at the end (--copy-traffic).")] = 528,
    measure: Annotated[
        bool,
        typer.Option("--measure", help="gpt2 family: allocate every registered cache and compare bytes."),
    ] = False,
    lengths: Annotated[
        str | None,
        typer.Option(
            "--lengths",
            help="With --measure: a batch of mixed sequence lengths, e.g. 37,130,260,528: the blocks a paged "
            "cache holds vs a static cache's batch x max-length reservation (max length: --ctx, else the longest).",
        ),
    ] = None,
    device: DeviceOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Plan KV-cache memory for real models (bytes/token, per sequence, fits on a GPU)."""
    from kvbench import memory as mem

    if all_ and (model or config):
        raise KVBenchError("use --all or --model/--config, not both")
    if gpu and gpu_mem:
        raise KVBenchError("use --gpu or --gpu-mem, not both")
    if batch < 1:
        raise KVBenchError(f"--batch {batch} must be at least 1")
    contexts = mem.parse_ctx(ctx) if ctx is not None else None
    mem.get_kv_format(kv_dtype)
    mem.weight_bits(weights_dtype)
    gpu_spec = mem.get_gpu(gpu) if gpu else None
    gpu_bytes = mem.parse_bytes(gpu_mem) if gpu_mem else None
    if gpu_bytes is not None or gpu_spec is not None:
        mem.parse_overhead(overhead, gpu_bytes or gpu_spec.memory)

    doc: dict = {"kv_dtype": kv_dtype, "weights_dtype": weights_dtype, "batch": batch, "tp": tp}
    if measure:
        from kvbench.measure_memory import measure_caches

        if all_ or config or not model or len(model) != 1:
            raise KVBenchError(
                "--measure takes one gpt2-family --model (gpt2, gpt2-medium, gpt2-large, gpt2-xl)"
            )
        reports = [
            measure_caches(model[0].strip().lower(), batch, c, kv_dtype, device) for c in contexts or [1024]
        ]
        doc["measure"] = mem.to_jsonable(reports)
        for w in (w for r in reports for w in r.warnings):
            console.warn(w)
        if not json_out:
            for r in reports:
                render_measure(r)
        if lengths:
            from kvbench.measure_memory import paged_waste

            paged = paged_waste(
                model[0].strip().lower(), mem.parse_ctx(lengths), ctx and max(contexts), kv_dtype
            )
            doc["paged"] = {
                **mem.to_jsonable(paged),
                "static_waste": paged.static_waste,
                "paged_waste": paged.paged_waste,
                "saving": paged.saving,
            }
            if not json_out:
                render_paged(paged)
    elif lengths:
        raise KVBenchError("--lengths goes with --measure (it fills a real paged cache)")

    presets = mem.load_presets()
    specs = (
        list(presets.values())
        if all_
        else [_memory_spec(n, presets, measure or copy_traffic) for n in model or []]
    )
    if config is not None:
        specs.append(mem.spec_from_hf_config(config))
    if not specs:
        raise KVBenchError("name a model: --model llama-3-8b, --config path/to/config.json, or --all")

    if copy_traffic:
        from kvbench.measure_memory import count_copy_traffic

        traffic = []
        for spec in specs:
            t = mem.copy_traffic(spec, from_, to, batch, kv_dtype)
            t.measured_bytes, t.counter_note = count_copy_traffic(
                spec.name, from_, to, batch, kv_dtype, device
            )
            traffic.append((spec.name, t))
        doc["copy_traffic"] = [dict(model=n, **mem.to_jsonable(t)) for n, t in traffic]
        if not json_out:
            render_copy_traffic(traffic)
    if measure or copy_traffic:
        if json_out:
            console.print_json(doc)
        return

    plans = []
    for spec in specs:
        cs = contexts or (
            [8 * 1024, 128 * 1024] if all_ else [spec.max_context] if spec.max_context else None
        )
        if cs is None:
            raise KVBenchError(f"{spec.name} has no max_position_embeddings; give --ctx, e.g. --ctx 8k")
        try:
            plans.append(
                mem.plan(
                    spec, cs, batch, kv_dtype, weights_dtype, tp, gpu_spec, gpu_bytes, overhead, gpu_mem or ""
                )
            )
        except KVBenchError as e:
            if not all_:
                raise
            console.warn(f"{spec.name} left out: {e}")  # e.g. --tp 2 cannot split Falcon's 71 heads
    for p in [] if all_ else plans:  # --all marks beyond-context cells with a dagger instead of a line each
        for w in p.warnings:
            console.warn(w)
    doc["plans"] = mem.to_jsonable(plans)
    if json_out:
        console.print_json(doc)
    elif all_:
        render_all(plans, batch, kv_dtype, weights_dtype)
    else:
        for p in plans:
            render_plan(p)


def _memory_spec(name: str, presets: dict, allow_gpt2: bool):
    """A models.toml preset; for --measure/--copy-traffic also our own GPT-2 presets (gpt2-tiny)."""
    from kvbench import memory as mem

    try:
        return mem.get_model(name, presets)
    except KVBenchError:
        if not allow_gpt2:
            raise
        from kvbench.measure_memory import spec_from_gpt_config
        from kvbench.model import PRESETS as GPT_PRESETS

        if name.strip().lower() not in GPT_PRESETS:
            raise
        return spec_from_gpt_config(GPT_PRESETS[name.strip().lower()])


# --- rendering ---
# Rendering for `kvbench memory`: the planner returns dataclasses with their working; these functions only lay them
# out. Imports of kvbench.memory stay local so `import kvbench.console` stays light.


def _mem_ctx(ctx: int, beyond: bool, windowed: bool) -> str:
    from kvbench.memory import fmt_tokens

    return fmt_tokens(ctx) + ("*" if windowed else "") + ("†" if beyond else "")


def render_plan(p) -> None:
    """One model: a header with the per-token working, a row per context, then each row's arithmetic and notes."""
    from kvbench.memory import fmt_bytes, fmt_tokens

    m = p.model
    shape = {
        "MHA": f"MHA, {m.n_heads} heads each with its own K/V",
        "GQA": f"GQA, {m.n_heads} query heads share {m.n_kv_heads} KV heads",
        "MQA": f"MQA, {m.n_heads} query heads share 1 KV head",
        "MLA": f"MLA, {m.n_heads} heads read one {m.kv_lora_rank}+{m.qk_rope_head_dim} latent",
    }[m.attention]
    max_ctx = "unknown" if m.max_context is None else fmt_tokens(m.max_context)
    out.print(f"[bold]{m.name}[/]  [dim]{m.source}[/]  {shape}, {m.n_layers} layers, max context {max_ctx}")
    out.print(f"KV cache: [bold]{fmt_bytes(p.bytes_per_token)}/token[/] ({p.kv_dtype})", soft_wrap=True)
    for line in p.working:
        out.print(f"  {line}", soft_wrap=True, markup=False)
    batch = p.rows[0].batch if p.rows else 1
    weights_gpu = None if p.weights_bytes is None else -(-p.weights_bytes // p.tp)
    cols = ["context", "per sequence"]
    if batch > 1:
        cols.append(f"batch of {batch}")
    if p.tp > 1:
        cols.append(f"per GPU (tp {p.tp})")
    if weights_gpu is not None:
        cols.append("+ weights" + (" per GPU" if p.tp > 1 else ""))
    if p.gpu is not None:
        cols += ["fits", "max batch at this context", f"max context at batch {batch}"]
    rows = []
    for r in p.rows:
        row = [_mem_ctx(r.ctx, r.beyond_max, r.windowed), fmt_bytes(r.bytes_per_seq)]
        if batch > 1:
            row.append(fmt_bytes(r.bytes_batch))
        if p.tp > 1:
            row.append(fmt_bytes(r.bytes_per_gpu))
        if weights_gpu is not None:
            row.append(fmt_bytes(r.bytes_per_gpu + weights_gpu))
        if p.gpu is not None:
            row += [
                "[green]yes[/]" if r.fits else "[red]no[/]",
                str(r.max_batch),
                "unbounded (all layers windowed)"
                if r.max_ctx_unbounded
                else f"{r.max_ctx:,}" + ("†" if m.max_context and r.max_ctx > m.max_context else ""),
            ]
        rows.append(row)
    out.print(table("", cols, rows))
    if any(r.windowed for r in p.rows):
        out.print(f"[dim]* sliding-window layers capped at {m.sliding_window:,} tokens[/]")
    if any(r.beyond_max for r in p.rows):
        out.print("[dim]† beyond the context the model was trained for (computed anyway)[/]")
    if p.gpu is not None:
        out.print(f"GPU: {p.gpu.label}: {p.gpu.working}", soft_wrap=True, markup=False)
    out.print("[dim]working:[/]")
    for r in p.rows:
        for line in r.working:
            out.print(f"  {line}", soft_wrap=True, markup=False)
    for n in p.notes:
        out.print(f"[dim]note:[/] {n}", soft_wrap=True)


def render_all(plans: list, batch: int, kv_dtype: str, weights_dtype: str) -> None:
    """Every preset in one table: the seed's table, extended."""
    from kvbench.memory import fmt_bytes, fmt_tokens

    contexts = [r.ctx for r in plans[0].rows]
    gpu = plans[0].gpu
    per = "per sequence" if batch == 1 else f"batch {batch}"
    cols = ["model", "attn", "layers", "KV heads x d_head", f"KV / token ({kv_dtype})"]
    cols += [f"{fmt_tokens(c)} ({per})" for c in contexts]
    if gpu is not None:
        cols += [f"max batch {fmt_tokens(c)}" for c in contexts]
    cols += ["trained ctx", f"weights ({weights_dtype})"]
    rows = []
    for p in plans:
        m = p.model
        row = [m.name, m.attention, str(m.n_layers), m.kv_shape, fmt_bytes(p.bytes_per_token)]
        for r in p.rows:
            mark = ("*" if r.windowed else "") + ("†" if r.beyond_max else "")
            row.append(fmt_bytes(r.bytes_batch) + mark)
        if gpu is not None:
            row += [str(r.max_batch) for r in p.rows]
        row += [
            "?" if m.max_context is None else fmt_tokens(m.max_context),
            "?" if p.weights_bytes is None else fmt_bytes(p.weights_bytes),
        ]
        rows.append(row)
    windowed = [
        f"{p.model.name} ({len(p.model.sliding_layers)} of {p.model.n_layers} layers at {p.model.sliding_window})"
        for p in plans
        if p.model.sliding_layers
    ]
    caption = (
        "bytes/token = 2 x layers x kv_heads x head_dim x bytes (MLA: (kv_lora_rank + qk_rope_head_dim) x layers "
        "x bytes)."
        + (f" * sliding-window layers capped at their window: {', '.join(windowed)}." if windowed else "")
        + " † beyond the context the model was trained for, computed anyway."
    )
    if gpu is not None:
        tp = plans[0].tp
        where = f"{tp} x {gpu.label} (tensor parallel)" if tp > 1 else gpu.label
        caption += f" Max batch on {where} after weights and a {fmt_bytes(gpu.overhead)} allowance per GPU."
    t = table(f"KV cache for every preset ({kv_dtype})", cols, rows, caption=caption)
    t.columns[0].no_wrap = True  # model names stay whole; the caption and the numbers wrap instead
    out.print(t)


def render_copy_traffic(traffic: list) -> None:
    """What a torch.cat cache copies while growing: closed form, the seed's approximation, and our counter."""
    from kvbench.memory import fmt_bytes

    cols = ["model", "KV / token", "tokens", "copied (exact)", "seed's (n1²-n0²)/2", "dynamic cache counter"]
    rows = []
    for name, t in traffic:
        if t.measured_bytes is None:
            counted = f"[dim]{t.counter_note}[/]"
        else:
            same = "[green]= exact[/]" if t.measured_bytes == t.exact_bytes else "[red]differs[/]"
            counted = f"{t.measured_bytes:,} B {same} ({t.counter_note})"
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
    out.print(table("History copied by torch.cat while decoding", cols, rows))
    if len(traffic) == 1:
        for line in traffic[0][1].working:
            out.print(f"  {line}", soft_wrap=True, markup=False)


def render_measure(report) -> None:
    """Predicted vs measured bytes for every registered cache."""
    from kvbench.memory import fmt_bytes

    cuda = any(r.allocated_bytes is not None for r in report.rows)
    cols = ["cache", "predicted", "measured (nbytes)", "difference"]
    if cuda:
        cols += ["allocator growth", "transient extra"]
    cols.append("why")
    rows = []
    for r in report.rows:
        diff = "[green]0 B (exact)[/]" if r.exact else f"[yellow]{r.difference:+,} B[/]"
        fmt_note = f" ({r.planner_format})" if r.planner_format != report.kv_dtype else ""
        row = [r.cache, f"{r.predicted_bytes:,} B{fmt_note}", f"{r.measured_bytes:,} B", diff]
        if cuda:
            row += [
                "-" if r.allocated_bytes is None else fmt_bytes(r.allocated_bytes),
                "-" if not r.peak_extra_bytes else fmt_bytes(r.peak_extra_bytes),
            ]
        row.append(r.explanation)
        rows.append(row)
    title = f"{report.model}: predicted vs measured, batch {report.batch} x {report.ctx} tokens, {report.kv_dtype}"
    out.print(table(title, cols, rows, caption=f"device: {report.device}"))
    for line in report.working:
        out.print(f"  {line}", soft_wrap=True, markup=False)


def render_paged(r) -> None:
    """Paged vs static for a batch of mixed lengths: the waste paging removes."""
    from kvbench.memory import fmt_bytes

    rows = [
        ["needed (exactly the tokens held)", fmt_bytes(r.needed_bytes), "-"],
        [f"static: {len(r.lengths)} x {r.max_len} slots reserved", fmt_bytes(r.static_bytes), f"{r.static_waste:.1%}"],
        [f"paged: {r.blocks_used} blocks of {r.block_size} per layer", fmt_bytes(r.paged_bytes), f"{r.paged_waste:.1%}"],
    ]  # fmt: skip
    title = f"paged vs static for sequences of {', '.join(map(str, r.lengths))} tokens"
    out.print(table(title, ["", "KV memory", "waste"], rows, caption=f"paging reserves {r.saving:.1%} less"))
