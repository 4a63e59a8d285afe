"""Rendering `kvbench bench`: the prefill sweep's table, the `--fill random` table (decode cost against context,
bench/context.py), the floor's caption both carry, a line for each lossy row's distortion, and the closing line
naming the files written."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich import box
from rich.console import JustifyMethod
from rich.table import Table

from kvbench import console
from kvbench.console import cell, fitted, line, out, shared_columns, styled, wrote

KEYS = ("engine", "cache", "prompt", "batch")  # a row's configuration: repeated in each part of a split table


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)  # x != x: NaN


def _times(x: float) -> str:
    return _f(x, ".2f") + ("" if x != x else "x")


def _shown(rows: Sequence, column: str) -> bool:
    """Whether any row has a figure in `column` (a table leaves out a column empty in every row)."""
    return any(getattr(r, column, math.nan) == getattr(r, column, math.nan) for r in rows)  # x == x: not NaN


def floor_caption(meta: dict, rows: Sequence) -> str:
    """What the floor columns mean, for the rows shown: nothing where no row has a floor (--hf models)."""
    bw = meta.get("floor", {}).get("bandwidth")
    if not bw or not _shown(rows, "x_floor"):
        return ""
    text = (
        f"floor: the bytes the median decode step must move (weights, K/V read and written, the design's copies) / "
        f"read bandwidth measured in this run ({bw['read_gbps']:.1f} GB/s read, {bw['copy_gbps']:.1f} GB/s copy, "
        f"{bw['nbytes'] / 2**20:.0f} MiB streamed); x floor = TPOT / floor; none has no floor. "
    )
    if _shown(rows, "x_floor_paired"):
        text += (
            "x paired: every timed step over the floor at the bandwidth read just before and after its run, the "
            "median. "
        )
    rounds = meta["floor"].get("by_prompt_len")
    if rounds:  # --order interleaved: probed again every round
        each = ", ".join(f"prompt {p}: {b['read_gbps']:.1f}" for p, b in rounds.items())
        text += f"Interleaved: the floor divides by the median of the first probe and one per round ({each} GB/s). "
    llc = bw.get("llc_bytes")
    if llc and any(r.step_bytes <= llc for r in rows):  # NaN compares False
        text += (
            f"Steps of at most {llc / 2**20:.0f} MiB fit in the last-level cache and can run below the floor "
            "(x floor < 1): it bounds steps that stream from memory. "
        )
    return text


def _tokens_cell(r):
    """Agreement with kvbench's `none`: 100%, or a lower figure marked ~ (all flips at near-ties) or ! (not)."""
    if r.token_agreement != r.token_agreement:
        return "-"
    text = f"{100 * r.token_agreement:.0f}%"
    if r.flips == 0:
        return text
    if r.near_tie_flips == r.flips:
        return styled(text + " ~", "yellow")
    return styled(text + " !", "bold red")


def caption_text(meta: dict, rows: Sequence = ()) -> str:
    """The table's footer: what every column includes, cold and warm defined."""
    cuda = meta["device"].startswith("cuda")
    hf = "hf" in meta  # bench --hf: the model's own caches, its `none` the token reference
    return floor_caption(meta, rows) + (
        "TTFT, total: medians over timed repeats (total includes the prefill). TPOT: decode steps pooled over "
        "timed repeats. warm = the timed repeats, after --warmup runs of the same shapes on the same caches, "
        "nothing freed in between. cold = the first run of each configuration"
        + (" (from an emptied allocator cache)" if cuda else "")
        + ": allocation, kernel selection and plan building for shapes not seen earlier in the sweep, graph "
        "capture (capture ms, static-graph on CUDA) or compilation ("
        + ("static-compiled" if hf else "hf-compiled")
        + "); it depends on sweep order. "
        "tok/s: decode tokens of all the batch's sequences per second of decode (prefill excluded). "
        "speedup: end to end vs the same family's `none` (hf-compiled vs hf none). vs hf: TPOT of the fastest "
        "transformers row at that prompt and batch / this TPOT. tokens: share of generated tokens equal to "
        + ("the model's own none's" if hf else "kvbench none's")
        + " (worst run; ~ all flips at near-ties, rounding; ! a real difference, see tokens_note in summary.csv). "
        "peak: this engine's weights (counted once) + the peak above what was in use before the configuration "
        + ("(CUDA max allocated)." if cuda else "(CPU resident set size; indicative).")
    )


def _oom_lines(rows: list) -> None:
    """One line per reason the `oom` rows ran out of memory (or were predicted to), naming their configurations."""
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r.status == "oom":
            reasons.setdefault(r.tokens_note or "out of memory", []).append(f"{r.engine} {r.cache}")
    for note, which in reasons.items():
        out.print(styled(f"oom ({', '.join(dict.fromkeys(which))}): {note}", "red"))


def _unsteady_line(meta: dict) -> None:
    """A warning when the run's read bandwidth moved further than its floor can absorb (bench/floor.py's rule)."""
    from kvbench.bench.floor import unsteady

    note = unsteady(meta.get("floor") or {})
    if note:
        out.print(styled(f"unsteady floor: {note}", "yellow"))


def _bench_row(r, swept: bool) -> list:
    """One row of the bench table; `swept`: a batch sweep, with the batch size after the prompt length."""
    return [
        r.engine,
        r.cache if r.status == "ok" else styled(f"{r.cache} ({r.status.split(':')[0]})", "red"),
        r.prompt_len,
        *([r.batch] if swept else []),
        _f(r.ttft_ms, ".1f"),
        _f(r.tpot_ms_median, ".2f"),
        _f(r.tpot_ms_p90, ".2f"),
        _f(r.floor_ms, ".2f"),
        _times(r.x_floor),
        _times(r.x_floor_paired),
        _f(r.total_s, ".3f"),
        _f(r.decode_tokens_per_s, ",.0f"),
        _times(r.speedup_vs_none),
        _times(r.speedup_vs_fastest_hf),
        _tokens_cell(r),
        _f(r.peak_mem_mib, ".0f"),
        _f(r.kv_cache_mib, ".2f"),
        "-" if r.bytes_copied != r.bytes_copied else console.fmt_bytes(int(r.bytes_copied)),
        _f(r.capture_ms, ".1f"),
        _f(r.cold_tpot_ms_median, ".2f"),
    ]


def _print_table(title: str, cols: list[str], body: list[list], caption: str) -> None:
    """A sweep's table at the console's width: configuration columns shared by every row (one engine, one prompt
    length) said once in the title, columns empty in every row left out, the rest split into as many tables as the
    width needs (each repeating the configuration), and the caption beneath as prose."""
    cols, body, same = shared_columns(cols, body, names=("engine", "prompt"))
    keys = sum(1 for c in cols[: len(KEYS)] if c in KEYS)
    justify: list[JustifyMethod] = ["left" if c in ("engine", "cache") else "right" for c in cols]
    title += "".join(f", {s}" for s in same)
    for x in fitted(title, cols, body, out.width, keys=keys, justify=justify):
        out.print(x)
    if caption:
        out.print(styled(caption, "dim"))


def _tokens(n: int) -> str:
    """A context as --prompt-len takes it: 4k for 4,096; 1,000 as itself."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def distortion_lines(rows: list, meta: dict, label) -> None:
    """A line for each lossy row measured against the full-precision cache (check/distortion.py), with the bytes it
    saves, then what the figures mean for these weights; each lossy row not measured, and why."""
    shown = [r for r in rows if r.kl_mean == r.kl_mean]  # NaN: an exact cache, or not measured
    dist = meta.get("distortion", {})
    for r in shown:
        d = dist.get("rows", {}).get(r.distortion_key(), {})
        saved = ""
        if d.get("bytes_saved") is not None and d.get("reference_kv_bytes"):
            saved = f"; saves {d['bytes_saved_fraction']:.0%} of {console.fmt_bytes(d['reference_kv_bytes'])}"
        out.print(
            line(
                styled("distortion", "bold"),
                f" {label(r)}: KL mean {r.kl_mean:.2g}; top-1 {console.fmt_share(r.top1_agreement)}; "
                f"mean |Δp| {r.mean_abs_dp:.2g}{saved}",
            )
        )
    for key, why in dist.get("not_measured", {}).items():
        out.print(styled(f"distortion of {key} not measured: {why}", "red"))
    if shown:
        filled = "filled with the same random K/V and " if meta.get("fill") == "random" else ""
        out.print(
            styled(
                f"distortion: against the full-precision static cache, both {filled}fed its greedy tokens "
                "(teacher-forced); "
                "KL(p_full || p_lossy) in nats, top-1: the same top token, |Δp|: the chosen token's probability "
                f"moved; by token in distortion.csv, by depth in distortion.png and meta.json. {dist.get('note', '')}",
                "dim",
            )
        )


def render_bench(rows: list, meta: dict, run_dir, files: list, ranks: Sequence = ()) -> None:
    """The bench table, its caption, the rows that failed or flipped, the SDPA backends; under --tp the per-rank
    table (`ranks`: tp.csv's rows); then the files written."""
    batches = list(dict.fromkeys(r.batch for r in rows))
    swept = len(batches) > 1  # a batch sweep: a batch column, and decode tokens/s across the batch
    cols = [
        "engine",
        "cache",
        "prompt",
        *(["batch"] if swept else []),
        "TTFT ms",
        "TPOT ms",
        "p90",
        "floor ms",
        "x floor",
        "x paired",
        "total s",
        "tok/s",
        "speedup",
        "vs hf",
        "tokens",
        "peak MiB",
        "KV MiB",
        "copied",
        "capture ms",
        "cold TPOT",
    ]
    body = [_bench_row(r, swept) for r in rows]
    _print_table(_bench_title(meta, rows, batches), cols, body, caption_text(meta, rows))
    _unsteady_line(meta)
    _oom_lines(rows)
    for r in rows:
        where = f"{r.engine} {r.cache} prompt {r.prompt_len}" + (f" batch {r.batch}" if swept else "")
        if r.status.startswith("error"):
            out.print(styled(f"{where}: {r.status}", "red"))
        elif r.flips and r.near_tie_flips < r.flips:
            out.print(styled(f"{where}: tokens {r.tokens_note}", "red"))
    # only kvbench rows are measured: the engine goes without saying
    distortion_lines(rows, meta, lambda r: f"{r.cache} prompt {r.prompt_len}" + (f" batch {r.batch}" if swept else ""))
    _sdpa_line(rows, meta)
    if meta.get("tp"):
        render_ranks(list(ranks), meta)
    out.print(wrote(files, run_dir))


def _bench_title(meta: dict, rows: list, batches: list) -> str:
    """The bench table's title: model, device, dtype; new tokens, batch sizes, repeats; rank 0's under --tp."""
    title = f"bench: {meta['model']} ({meta['weights']}) on {meta['device_name']}, {meta['dtype']}"
    if rows:
        title += (
            f", {rows[0].new_tokens} new tokens, batch {','.join(map(str, batches))}, "
            f"{max(r.repeats for r in rows)} repeats"
        )
    tp = meta.get("tp")
    if tp:
        title += f", tensor parallel over {tp['ranks']} ranks ({tp['backend']}): rank 0's figures"
    return title


def _sdpa_line(rows: list, meta: dict) -> None:
    """The SDPA backends each finished engine x cache got (prefill / decode), and the cuDNN version, dimmed."""
    observed = {f"{r.engine} {r.cache}": (r.sdpa_prefill, r.sdpa_decode) for r in rows if r.status == "ok"}
    kinds = sorted(set(observed.values()))
    if kinds:
        out.print(
            styled(
                "SDPA backends (prefill / decode): "
                + "; ".join(
                    f"{p or '-'} / {d or '-'}: " + ", ".join(k for k, v in observed.items() if v == (p, d))
                    for p, d in kinds
                )
                + f"; cuDNN {meta['sdpa'].get('cudnn_version') or 'not available'}",
                "dim",
            )
        )


def _planner_cell(r) -> object:
    """The planner's bytes for the rank: `equal` when the measured bytes are exactly that, else the figure."""
    if r.planned_equal is None:
        return "-"
    return styled("equal", "green") if r.planned_equal else f"{int(r.planned_kv_cache_bytes):,}"


def render_ranks(rows: list, meta: dict) -> None:
    """bench --tp: each rank's figures per configuration (tp.csv), and what CPU timings mean."""
    tp = meta["tp"]
    swept = len({r.batch for r in rows}) > 1
    cols = [
        "engine",
        "cache",
        "prompt",
        *(["batch"] if swept else []),
        "rank",
        "TTFT ms",
        "TPOT ms",
        "KV bytes",
        "planner",
        "peak MiB",
        "collectives",
    ]
    body = [
        [
            r.engine,
            r.cache,
            r.prompt_len,
            *([r.batch] if swept else []),
            r.rank,
            _f(r.ttft_ms, ".1f"),
            _f(r.tpot_ms_median, ".2f"),
            _f(r.kv_cache_bytes, ",.0f"),
            _planner_cell(r),
            _f(r.peak_mem_mib, ".0f"),
            "-" if r.collective_share != r.collective_share else f"{100 * r.collective_share:.0f}%",
        ]
        for r in rows
    ]
    title = f"per rank: tensor parallel over {tp['ranks']} ranks ({tp['backend']})"
    caption = (
        "TTFT, TPOT: each rank's own medians over the timed repeats. KV bytes: the K and V the rank's cache holds at "
        "the end of a run; planner: kvbench memory's figure for one rank at the same slots per sequence, `equal` "
        "when the two agree to the byte (else the planner's figure; - where it has none). peak: the rank's "
        "weights + its peak above what it used before the configuration. collectives: the share of one more "
        "run's time spent inside the collectives, the device synchronised around each."
    )
    _print_table(title, cols, body, caption)
    if tp["backend"] != "nccl":
        out.print(styled(f"timings in both tables are {tp['timing']}", "yellow"))


def _mb(n: float) -> str:
    return _f(n / 1e6, ",.1f")


def render_context(rows: list, meta: dict, run_dir, files: list) -> None:
    cols = [
        "cache",
        "context",
        "TPOT ms",
        "p10",
        "p90",
        "floor ms",
        "x floor",
        "step MB",
        "K/V read MB",
        "design MB",
        "KV MiB held",
    ]
    title = (
        f"bench --fill random: {meta['model']} ({meta['weights']}) on {meta['device_name']}, {meta['dtype']}; "
        "caches filled with RANDOM K/V, no prefill, decode steps only"
        + (f", {rows[0].new_tokens} steps x {max(r.repeats for r in rows)} repeats" if rows else "")
    )
    caption = (
        floor_caption(meta, rows)
        + f"K/V read = weight read at {meta['crossover_context']:,} tokens (past it the cache is most of the "
        "step). TPOT: median over every timed step (forward + argmax, synchronised); p10/p90 of the same steps. "
        "step MB: bytes the median step moves, of which K/V read by attention and the design's own copies."
    )
    body = []
    for r in rows:
        name = r.cache if r.status == "ok" else styled(f"{r.cache} ({r.status.split(':')[0]})", "red")
        body.append(
            [
                name,
                f"{r.context:,}",
                _f(r.tpot_ms_median, ".2f"),
                _f(r.tpot_ms_p10, ".2f"),
                _f(r.tpot_ms_p90, ".2f"),
                _f(r.floor_ms, ".2f"),
                _times(r.x_floor),
                _mb(r.step_bytes),
                _mb(r.kv_read_bytes),
                _mb(r.design_bytes),
                _f(r.kv_cache_mib, ".1f"),
            ]
        )
    _print_table(title, cols, body, caption)
    _unsteady_line(meta)
    for r in rows:
        if r.status.startswith("error"):
            out.print(styled(f"{r.cache} context {r.context}: {r.status}", "red"))
    distortion_lines(rows, meta, lambda r: f"{r.cache} context {_tokens(r.context)}")
    out.print(wrote(files, run_dir))


def render_profile(ops: list, per_configuration: int = 3) -> None:
    """--profile's table, once after the sweep: each configuration's top operators by self time (profile_ops.csv
    holds the top 20 of each)."""
    device = any(o.self_device_ms > 0 for o in ops)
    tbl = Table(
        title="profile: top operators by self time in one warm run of each configuration "
        + ("(device time)" if device else "(CPU time)"),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for c in ("engine", "cache", "prompt", "batch", "operator", "calls", "self ms", "share"):
        tbl.add_column(c, no_wrap=c != "operator", justify="left" if c in ("engine", "cache", "operator") else "right")
    shown: dict = {}
    for o in ops:
        key = (o.engine, o.cache, o.prompt_len, o.batch)
        if shown.get(key, 0) >= per_configuration or o.op.startswith("(other"):
            continue
        shown[key] = shown.get(key, 0) + 1
        ms = o.self_device_ms if device else o.self_cpu_ms
        tbl.add_row(*[cell(x) for x in (*key, o.op, f"{o.calls:,}", f"{ms:,.1f}", f"{100 * o.share:.0f}%")])
    out.print(tbl)
