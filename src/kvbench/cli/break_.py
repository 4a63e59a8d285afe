"""`kvbench break`: inject the classic KV-cache bugs and show verify catching each."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from kvbench import console
from kvbench.cli.app import (
    DeviceOpt,
    JsonOpt,
    ModelOpt,
    SeedOpt,
    TokenizerOpt,
    WeightsOpt,
    _dtype_opt,
    app,
    handle_errors,
    load_for_checks,
)  # fmt: skip
from kvbench.console import line, out, styled, table
from kvbench.errors import KVBenchError

BREAK_PROMPTS = (
    "The key to fast inference is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The capital of France is Paris, and the capital of Italy is",
)


@app.command(name="break")
@handle_errors
def break_(
    name: Annotated[str, typer.Argument(help="A fault name, or all.")] = "all",
    prompt: Annotated[
        str | None, typer.Option("--prompt", "-p", help="The prompt (default: a built-in one).")
    ] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", "-n", help="Tokens per run.")] = 40,
    batch: Annotated[
        int, typer.Option("--batch", help="Prompts in the batch for `padding` and the batched check (>= 2).")
    ] = 3,
    reference: Annotated[
        str, typer.Option("--reference", help="hf: include the Hugging Face reference check; none: skip.")
    ] = "hf",
    cache: Annotated[
        str | None,
        typer.Option(
            "--cache",
            "-c",
            help="Run the faults on this cache (a name or a pkg.module:Class plugin); default: each fault's own. "
            "Faults that live inside one cache design (static-pointer) are skipped on others.",
        ),
    ] = None,
    model: ModelOpt = None,
    weights: WeightsOpt = "auto",
    device: DeviceOpt = "auto",
    dtype: str = _dtype_opt("fp32"),
    seed: SeedOpt = 0,
    tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Inject the classic KV-cache bugs and show verify catching each.

    Runs correct and faulty code side by side on the same model and prompt. Exit 0 when every injected fault was
    detected by verify, 1 when any slipped through."""
    from kvbench.caches import get_cache_spec
    from kvbench.check.faults import FAULTS, break_fault, parse_fault_names
    from kvbench.check.verify import random_prompts
    from kvbench.model.tokenizer import load_tokenizer

    names = parse_fault_names(name)
    if cache is not None:
        cache = get_cache_spec(cache).name
        if cache == "none":
            raise KVBenchError("--cache none: the faults live in cached decoding; name a cache")
        skipped = [n for n in names if not FAULTS[n].applies_to(cache)]
        if skipped and name != "all":
            raise KVBenchError(
                f"the {name} fault lives in the {FAULTS[name].cache} cache; it cannot run on {cache!r}"
            )
        names = [n for n in names if n not in skipped]
        for n in skipped:
            console.note(f"{n}: skipped (the bug lives inside the {FAULTS[n].cache} cache, not in {cache})")
    if new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (a fault shows from the first decode step), got {new_tokens}"
        )
    if batch < 2:
        why = "padding needs >= 2 prompts of different lengths: with one prompt nothing is padded, the bug is dormant"
        raise KVBenchError(f"--batch {batch}: {why}; use --batch 2 or more")
    if reference not in ("hf", "none"):
        raise KVBenchError(f"--reference must be hf or none, got {reference!r}")
    from kvbench import validate
    from kvbench.model.weights import peek_config

    validate.integer("--batch", batch, 2, validate.MAX_BATCH)
    validate.seed(seed)
    cfg = peek_config(model, weights)
    validate.fits_context("a one-token prompt", 1, new_tokens, cfg.block_size, "use fewer --new-tokens")
    loaded, dev, dt, hf_dir = load_for_checks(model, weights, device, dtype, seed)
    try:
        tok = load_tokenizer(tokenizer)
    except KVBenchError as e:
        if tokenizer is not None:
            raise
        tok = None
        console.warn(f"no tokenizer ({e}); showing random prompts and token ids instead of text")
    vocab = loaded.config.vocab_size
    if tok is not None and vocab >= tok.eot_id + 1:
        texts = [prompt or BREAK_PROMPTS[0], *BREAK_PROMPTS[1:]]
        texts = (texts * batch)[:batch]
        prompts = [tok.encode(t) for t in texts]
        if not prompts[0]:
            raise KVBenchError("--prompt encodes to zero tokens")
        if len({len(p) for p in prompts}) < 2:
            prompts[1] = prompts[1] + prompts[0]  # the batch needs two different lengths
        decode = tok.decode
    else:
        prompts = random_prompts(vocab, 24, batch, seed)[::-1]  # shortest first: prompts[0] is the one shown
        decode = tok.decode if tok is not None else None
    ctx = loaded.config.block_size
    longest = max(map(len, prompts))
    if longest + new_tokens > ctx:
        raise KVBenchError(
            f"longest batch prompt {longest} (after padding) + new tokens {new_tokens} exceeds the context of {ctx}"
        )
    results = []
    for n in names:
        r = break_fault(loaded.model, n, prompts, new_tokens, reference, hf_dir, decode, cache)
        results.append(r)
        if not json_out:
            render_break(r)
    meta = {"model": loaded.config.name, "weights": loaded.weights, "device": str(dev)}
    if json_out:
        from dataclasses import asdict

        console.print_json({"all_detected": all(r.detected for r in results), **meta,
                            "bugs": [asdict(r) for r in results]})  # fmt: skip
    else:
        render_break_summary(results)
    if not all(r.detected for r in results):
        raise typer.Exit(1)


# --- rendering ---
def _seq(text: str | None, tokens: list[int], first: int | None) -> str:
    if text is not None:
        return repr(text)
    parts = [styled(t, "red") if first is not None and i >= first else str(t) for i, t in enumerate(tokens)]
    return Text(" ").join(Text(p) if isinstance(p, str) else p for p in parts)


def render_break(r) -> None:
    head = styled("detected", "green") if r.detected else styled("NOT detected", "bold red")
    out.rule(line(styled(r.name, "bold"), f": {r.summary}"), align="left")
    div = "none (the outputs are identical)" if r.first_divergence is None else f"step {r.first_divergence}"
    lines = [
        line(f"cache {r.cache}; the bug lives in {r.where}"),
        line(f"first divergent token: {div}"),
        line("correct: ", _seq(r.correct_text, r.correct_tokens, r.first_divergence)),
        line("faulty:  ", _seq(r.faulty_text, r.faulty_tokens, r.first_divergence)),
        line(f"signature: {r.signature}"),
        line(head, f" by verify: {', '.join(r.caught_by) if r.caught_by else 'no check failed'}"),
        line(f"fix: {r.fix}"),
        line(f"dormant: {r.dormant_where} ({r.dormant_shown})"),
    ]
    for text in lines:
        out.print(text, soft_wrap=True)


def render_break_summary(results: list) -> None:
    rows = [
        [
            r.name,
            r.cache,
            styled("yes", "green") if r.detected else styled("NO", "bold red"),
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
    out.print(styled(f"{n} of {len(results)} faults detected by verify", style))
