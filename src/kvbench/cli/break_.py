"""`kvbench break`: inject the classic KV-cache bugs and show verify catching each."""

from __future__ import annotations

from typing import Annotated

import typer

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
from kvbench.cli.break_render import render_break, render_break_summary
from kvbench.cli.options import JUnitXmlOpt, VerboseOpt
from kvbench.errors import KVBenchError
from kvbench.jsonio import SCHEMA_VERSION

FaultArg = Annotated[str, typer.Argument(help="A fault name, or all.")]
PromptOpt = Annotated[
    str | None, typer.Option("--prompt", "-p", help="The prompt (default: a built-in one).")
]
NewTokensOpt = Annotated[int, typer.Option("--new-tokens", "-n", help="Tokens per run.")]
BatchOpt = Annotated[
    int, typer.Option("--batch", help="Prompts in the batch for `padding` and the batched check (>= 2).")
]
ReferenceOpt = Annotated[
    str, typer.Option("--reference", help="hf: include the Hugging Face reference check; none: skip.")
]
CacheOpt = Annotated[
    str | None,
    typer.Option(
        "--cache",
        "-c",
        help="Run the faults on this cache (a name or a pkg.module:Class plugin); default: each fault's own. "
        "Faults that live inside one cache design (static-pointer) are skipped on others.",
    ),
]


@app.command(name="break")
@handle_errors
def break_(
    name: FaultArg = "all", prompt: PromptOpt = None, new_tokens: NewTokensOpt = 40, batch: BatchOpt = 3,
    reference: ReferenceOpt = "hf", cache: CacheOpt = None, model: ModelOpt = None, weights: WeightsOpt = "auto",
    device: DeviceOpt = "auto", dtype: str = _dtype_opt("fp32"), seed: SeedOpt = 0, tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False, junit_xml: JUnitXmlOpt = None, verbose: VerboseOpt = False,
) -> None:  # fmt: skip
    """Inject the classic KV-cache bugs and show verify catching each.

    Runs correct and faulty code side by side on the same model and prompt. Exit 0 when every injected fault was
    detected by verify, 1 when any slipped through."""
    from kvbench.results import junit

    clock = junit.RowClock()
    with junit.errors_reported(junit_xml, "break", clock):
        junit_path = junit.check_junit_path(junit_xml, "break")
        results, skipped, meta = _run_faults(name, prompt, new_tokens, batch, reference, cache, model, weights, device,
                                             dtype, seed, tokenizer, json_out, clock, verbose)  # fmt: skip
    if junit_path is not None:
        junit.write_suite(junit_path, junit.break_suite(results, skipped, meta, clock.seconds, clock.total()))
    if json_out:
        from dataclasses import asdict

        console.print_json({"schema_version": SCHEMA_VERSION, "all_detected": all(r.detected for r in results),
                            **meta, "bugs": [asdict(r) for r in results]})  # fmt: skip
    else:
        render_break_summary(results)
    if not all(r.detected for r in results):
        raise typer.Exit(1)


def _run_faults(name, prompt, new_tokens, batch, reference, cache, model, weights, device, dtype, seed, tokenizer,
                json_out, on_fault, verbose=False):  # fmt: skip
    """Each chosen fault against the correct path, each result passed to `on_fault` as it completes:
    (results, [(fault, why skipped)], meta)."""
    from kvbench import validate
    from kvbench.caches import get_cache_spec
    from kvbench.check.breaking import break_fault, break_prompts
    from kvbench.check.faults import FAULTS, select_faults

    cache = get_cache_spec(cache).name if cache is not None else None
    names, skipped = select_faults(name, cache)
    why = {n: f"the bug lives inside the {FAULTS[n].cache} cache, not in {cache}" for n in skipped}
    for n in skipped:
        console.note(f"{n}: skipped ({why[n]})")
    _check_options(new_tokens, batch, reference, seed, model, weights)
    loaded, dev, dt, hf_dir = load_for_checks(model, weights, device, dtype, seed)
    tok = _tokenizer(tokenizer)
    prompts = break_prompts(tok, loaded.config.vocab_size, prompt, batch, seed)
    longest = max(map(len, prompts))
    validate.fits_context("longest batch prompt (after padding)", longest, new_tokens, loaded.config.block_size,
                          "use fewer --new-tokens or a shorter --prompt")  # fmt: skip
    decode = tok.decode if tok is not None else None
    results = []
    for n in names:
        results.append(break_fault(loaded.model, n, prompts, new_tokens, reference, hf_dir, decode, cache))
        on_fault(results[-1])
        if not json_out:
            render_break(results[-1], verbose)
    meta = {"model": loaded.config.name, "weights": loaded.weights, "device": str(dev)}
    return results, [(n, why[n]) for n in skipped], meta


def _check_options(new_tokens: int, batch: int, reference: str, seed: int, model, weights) -> None:
    from kvbench import validate
    from kvbench.model.weights import peek_config

    if new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (a fault shows from the first decode step), got {new_tokens}"
        )
    if batch < 2:
        why = "padding needs >= 2 prompts of different lengths: with one prompt nothing is padded, the bug is dormant"
        raise KVBenchError(f"--batch {batch}: {why}; use --batch 2 or more")
    if reference not in ("hf", "none"):
        raise KVBenchError(f"--reference must be hf or none, got {reference!r}")
    validate.integer("--batch", batch, 2, validate.MAX_BATCH)
    validate.seed(seed)
    cfg = peek_config(model, weights)
    validate.fits_context("a one-token prompt", 1, new_tokens, cfg.block_size, "use fewer --new-tokens")


def _tokenizer(name: str | None):
    """The tokenizer for showing text; without one (and none named) the faults run on random ids."""
    from kvbench.model.tokenizer import load_tokenizer

    try:
        return load_tokenizer(name)
    except KVBenchError as e:
        if name is not None:
            raise
        console.warn(f"no tokenizer ({e}); showing random prompts and token ids instead of text")
        return None
