"""Rich at the edge: the consoles, tables and progress bars, and the JSON printer.

Library modules never print; they return dataclasses and rows. Everything a person sees goes through here.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def error(message: str) -> None:
    """One red line on stderr: the whole user-facing error."""
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {message}", soft_wrap=True)


def note(message: str) -> None:
    err.print(f"[dim]{message}[/]", soft_wrap=True)


def print_json(doc: Any) -> None:
    """One JSON document on stdout and nothing else (for scripts and CI)."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def table(title: str, columns: list[str], rows: list[list[Any]], caption: str | None = None) -> Table:
    t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t


# --- generate ---
class TextStream:
    """Prints a single completion as it is produced. Decodes the whole completion each time and prints the new
    suffix, so a character split across two byte-level tokens appears once it is complete."""

    def __init__(self, tokenizer, prompt: str) -> None:
        self.tok, self.ids, self.shown = tokenizer, [], ""
        out.print(f"[bold]{prompt}[/]", end="")

    def push(self, ids: list[int]) -> None:
        if ids[0] == self.tok.eot_id:
            return
        self.ids.append(ids[0])
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        out.print(text[len(self.shown) :], end="", markup=False, highlight=False)
        self.shown = text

    def close(self) -> None:
        out.print()


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def render_generation(doc: dict, streamed: bool) -> None:
    if not streamed:
        for i, c in enumerate(doc["completions"], 1):
            out.rule(f"[dim]sequence {i} ({c['prompt_tokens']} prompt tokens)")
            out.print(f"[bold]{c['prompt']}[/]", end="")
            out.print(c["text"], markup=False, highlight=False)
    s, t, c = doc["settings"], doc["timings"], doc["cache"]
    tpot = t["tpot_ms_median"]
    rows = [
        [
            "model / weights",
            f"{s['model']} / {s['weights']}"
            + ("  [yellow](random: text is meaningless)[/]" if s["random_weights"] else ""),
        ],
        ["device / dtype", f"{s['device_name']} / {s['dtype']}"],
        [
            "cache",
            f"{c['name']}: {_fmt_bytes(c['bytes'])} held"
            + (f", {_fmt_bytes(c['bytes_copied'])} of history copied" if c["bytes_copied"] else ""),
        ],
        ["prefill (TTFT)", f"{t['ttft_ms']:.1f} ms for batch {s['batch']}"],
        ["median time per output token", "-" if tpot is None else f"{tpot:.2f} ms (decode steps only)"],
        [
            "throughput",
            f"{t['tokens_per_s']:.1f} tokens/s incl. prefill ({t['generated_tokens']} tokens kept)",
        ],
    ]
    tbl = table("generate", ["", ""], [], caption="timings are device-synchronised wall clock")
    tbl.show_header = False
    for r in rows:
        tbl.add_row(*r)
    out.print(tbl)


# --- bench ---
class _BenchProgress:
    """A Rich progress bar over the sweep's runs (warm-ups included), on stderr so --json stdout stays clean."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]bench[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=err,
            transient=True,
        )
        self._task = None

    def __enter__(self) -> _BenchProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def update(self, done: int, total: int, label: str) -> None:
        if self._task is None:
            self._task = self._progress.add_task(label, total=total)
        self._progress.update(self._task, completed=done, total=total, description=label)


def bench_progress() -> _BenchProgress:
    return _BenchProgress()


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)  # x != x: NaN


def render_bench(rows: list, meta: dict, run_dir, files: list) -> None:
    cols = ["engine", "cache", "prompt", "TTFT ms", "TPOT ms", "p90", "total s", "speedup", "peak MiB", "KV MiB",
            "copied", "cold TPOT"]  # fmt: skip
    body = []
    for r in rows:
        speedup = _f(r.speedup_vs_none, ".2f") + ("x" if r.speedup_vs_none == r.speedup_vs_none else "")
        body.append(
            [
                r.engine, r.cache if r.status == "ok" else f"[red]{r.cache} ({r.status})[/]", r.prompt_len, _f(r.ttft_ms, ".1f"),
                _f(r.tpot_ms_median, ".2f"), _f(r.tpot_ms_p90, ".2f"), _f(r.total_s, ".3f"), speedup,
                _f(r.peak_mem_mib, ".0f"), _f(r.kv_cache_mib, ".2f"),
                "-" if r.bytes_copied != r.bytes_copied else _fmt_bytes(int(r.bytes_copied)),
                _f(r.cold_tpot_ms_median, ".2f"),
            ]
        )  # fmt: skip
    first = rows[0] if rows else None
    title = f"bench: {meta['model']} ({meta['weights']}) on {meta['device_name']}, {meta['dtype']}"
    if first is not None:
        title += f", {first.new_tokens} new tokens, batch {first.batch}, {first.repeats} repeats"
    caption = (
        "TTFT, total: medians over timed repeats (total includes the prefill). TPOT: decode steps pooled over "
        "repeats. speedup: vs the same engine's `none`. cold: the first run of each shape. peak: "
        + (
            "CUDA max allocated."
            if meta["device"].startswith("cuda")
            else "process peak RSS (high-water mark)."
        )
    )
    tbl = Table(
        title=title,
        caption=caption,
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for i, c in enumerate(cols):
        tbl.add_column(c, no_wrap=True, justify="left" if i < 2 else "right")
    for r in body:
        tbl.add_row(*[str(x) for x in r])
    # A narrow (or non-tty, 80-column) console would squeeze the numbers into ellipses: print at full width instead.
    wide = out if out.width >= 130 else Console(highlight=False, width=130)
    wide.print(tbl)
    out.print(f"[green]wrote[/] {', '.join(p.name for p in files)} [dim]in[/] {run_dir}")


# --- memory ---
# Rendering for `kvbench memory`: the planner returns dataclasses with their working; these functions only lay them
# out. Imports of kvbench.memory stay local so `import kvbench.console` stays light.


def _mem_ctx(ctx: int, beyond: bool, windowed: bool) -> str:
    from kvbench.memory import fmt_tokens

    return fmt_tokens(ctx) + ("*" if windowed else "") + ("†" if beyond else "")


def memory_plan(p) -> None:
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


def memory_all(plans: list, batch: int, kv_dtype: str, weights_dtype: str) -> None:
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


def memory_copy_traffic(traffic: list) -> None:
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


def memory_measure(report) -> None:
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


def memory_paged(r) -> None:
    """Paged vs static for a batch of mixed lengths: the waste paging removes."""
    from kvbench.memory import fmt_bytes

    rows = [
        ["needed (exactly the tokens held)", fmt_bytes(r.needed_bytes), "-"],
        [f"static: {len(r.lengths)} x {r.max_len} slots reserved", fmt_bytes(r.static_bytes), f"{r.static_waste:.1%}"],
        [f"paged: {r.blocks_used} blocks of {r.block_size} per layer", fmt_bytes(r.paged_bytes), f"{r.paged_waste:.1%}"],
    ]  # fmt: skip
    title = f"paged vs static for sequences of {', '.join(map(str, r.lengths))} tokens"
    out.print(table(title, ["", "KV memory", "waste"], rows, caption=f"paging reserves {r.saving:.1%} less"))


# --- verify ---
def _diff(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def verify_row(row) -> None:
    """One line per check as it finishes (stderr, so a long run shows progress)."""
    mark = "[green]pass[/]" if row.passed else "[bold red]FAIL[/]"
    err.print(
        f"[dim]{row.cache:>12} {row.name:<12}[/] {mark} [dim]{_diff(row.max_abs_diff)}[/]", soft_wrap=True
    )


def render_verify(report, meta: dict) -> None:
    rows = [
        [
            r.name,
            r.cache,
            "[green]pass[/]" if r.passed else "[bold red]FAIL[/]",
            _diff(r.max_abs_diff),
            "-" if r.first_divergence is None else str(r.first_divergence),
            r.tolerance,
            r.detail,
        ]
        for r in report.checks
    ]
    title = f"kvbench verify: {meta['model']}, {meta['weights']}, {meta['device']}, {meta['dtype']}"
    cols = ["check", "cache", "result", "max |Δlogit|", "first diverge", "tolerance", "detail"]
    out.print(table(title, cols, rows))
    for n in report.notes:
        out.print(f"[dim]- {n}[/]", soft_wrap=True)
    failed = [f"{r.name}/{r.cache}" for r in report.checks if not r.passed]
    if failed:
        out.print(f"[bold red]FAILED[/] {len(failed)} of {len(report.checks)} checks: {', '.join(failed)}")
    else:
        out.print(f"[bold green]PASSED[/] all {len(report.checks)} checks")


# --- break ---
def _seq(text: str | None, tokens: list[int], first: int | None) -> str:
    if text is not None:
        from rich.markup import escape

        return escape(repr(text))
    return " ".join(("[red]" + str(t) + "[/]") if first is not None and i >= first else str(t)
                    for i, t in enumerate(tokens))  # fmt: skip


def render_break(r) -> None:
    head = "[green]detected[/]" if r.detected else "[bold red]NOT detected[/]"
    out.rule(f"[bold]{r.name}[/]: {r.summary}", align="left")
    div = "none (the outputs are identical)" if r.first_divergence is None else f"step {r.first_divergence}"
    lines = [
        f"cache {r.cache}; the bug lives in {r.where}",
        f"first divergent token: {div}",
        f"correct: {_seq(r.correct_text, r.correct_tokens, r.first_divergence)}",
        f"faulty:  {_seq(r.faulty_text, r.faulty_tokens, r.first_divergence)}",
        f"signature: {r.signature}",
        f"{head} by verify: {', '.join(r.caught_by) if r.caught_by else 'no check failed'}",
        f"fix: {r.fix}",
        f"dormant: {r.dormant_where} ({r.dormant_shown})",
    ]
    for line in lines:
        out.print(line, soft_wrap=True)


def render_break_summary(results: list) -> None:
    rows = [
        [
            r.name,
            r.cache,
            "[green]yes[/]" if r.detected else "[bold red]NO[/]",
            ", ".join(r.caught_by) or "-",
            "-" if r.first_divergence is None else str(r.first_divergence),
        ]
        for r in results
    ]
    out.print(
        table(
            "kvbench break: injected faults",
            ["fault", "cache", "detected", "caught by", "first diverge"],
            rows,
        )
    )
    n = sum(r.detected for r in results)
    style = "bold green" if n == len(results) else "bold red"
    out.print(f"[{style}]{n} of {len(results)} faults detected by verify[/]")
