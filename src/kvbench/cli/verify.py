"""`kvbench verify`: cached decoding equals full recomputation, for every cache, against Hugging Face."""

from __future__ import annotations

import sys
from contextlib import contextmanager, redirect_stdout
from typing import Annotated

import typer

from kvbench import console
from kvbench.cli.app import (
    CompileOpt,
    DeviceOpt,
    JsonOpt,
    ModelOpt,
    SeedOpt,
    WeightsOpt,
    _dtype_opt,
    app,
    handle_errors,
    load_for_checks,
)  # fmt: skip
from kvbench.cli.hf import HFOpt, LayersOpt, TrustOpt
from kvbench.cli.options import JUnitXmlOpt, VerboseOpt
from kvbench.cli.verify_render import render_verify, verify_row
from kvbench.errors import KVBenchError
from kvbench.jsonio import SCHEMA_VERSION

CachesOpt = Annotated[
    str | None,
    typer.Option(
        "--caches",
        help="Comma-separated caches to check (default: all). With --hf: none, dynamic, static, "
        "static-compiled, offloaded, offloaded_static, quantized-quanto, quantized-hqq, quantized-fp8.",
    ),
]
PromptLenOpt = Annotated[int, typer.Option("--prompt-len", help="Tokens in the longest prompt.")]
NewTokensOpt = Annotated[
    int, typer.Option("--new-tokens", "-n", help="Greedy tokens for logits/greedy/reference.")
]
BatchOpt = Annotated[
    int, typer.Option("--batch", help="Prompts of different lengths in the batched check (>= 2).")
]
ReferenceOpt = Annotated[
    str, typer.Option("--reference", help="hf: also check against transformers' GPT2LMHeadModel; none: skip.")
]


@app.command()
@handle_errors
def verify(
    caches: CachesOpt = None, prompt_len: PromptLenOpt = 32, new_tokens: NewTokensOpt = 100, batch: BatchOpt = 3,
    reference: ReferenceOpt = "hf", model: ModelOpt = None, weights: WeightsOpt = "auto", device: DeviceOpt = "auto",
    dtype: str = _dtype_opt("fp32"), seed: SeedOpt = 0, compile: CompileOpt = "off", json_out: JsonOpt = False,
    hf: HFOpt = None, trust_remote_code: TrustOpt = False, layers: LayersOpt = None,
    junit_xml: JUnitXmlOpt = None, verbose: VerboseOpt = False,
) -> None:  # fmt: skip
    """Prove cached decoding equals full recomputation, for every cache, against Hugging Face.

    With --hf SOURCE: the same checks on any Hugging Face causal LM, for each of transformers' own caches, against
    its own no-cache path. Exit 0 when every check passes, 1 when any fails. In fp16/bf16 a token flip at a
    near-tie that the logit error explains is reported, not failed."""
    from kvbench.results import junit

    clock = junit.RowClock(None if json_out else verify_row)
    with _json_safe(json_out), junit.errors_reported(junit_xml, "verify", clock):
        junit_path = junit.check_junit_path(junit_xml)
        if hf is not None:
            from kvbench.cli.hf import refuse_gpt2_options, run_verify_hf

            refuse_gpt2_options(
                **{
                    "--model": model,
                    "--weights": weights != "auto",
                    "--reference": reference != "hf",
                    "--compile": compile != "off",
                }
            )
            report, meta = run_verify_hf(
                hf, caches=caches, prompt_len=prompt_len, new_tokens=new_tokens, batch=batch, device=device,
                dtype=dtype, seed=seed, layers=layers, trust=trust_remote_code, on_row=clock,
            )  # fmt: skip
        else:
            report, meta = _verify_gpt2(caches, prompt_len, new_tokens, batch, reference, model, weights, device, dtype,
                                        seed, clock, trust_remote_code, layers, compile)  # fmt: skip
    if junit_path is not None:
        junit.write_suite(junit_path, junit.verify_suite(report, meta, clock.seconds, clock.total()))
    if json_out:
        from dataclasses import asdict

        console.print_json(
            {"schema_version": SCHEMA_VERSION, "passed": report.passed, **meta, **asdict(report)}
        )
    else:
        render_verify(report, meta, verbose)
    if not report.passed:
        raise typer.Exit(1)


@contextmanager
def _json_safe(json_out: bool):
    """With --json, stdout carries one JSON document whatever happens: a model's own print() goes to stderr while
    it runs, and a refusal (exit 2) still prints {"passed": false, "error": ...} before its line on stderr."""
    if not json_out:
        yield
        return
    try:
        with redirect_stdout(sys.stderr):
            yield
    except KVBenchError as e:
        console.print_json(
            {"schema_version": SCHEMA_VERSION, "passed": False, "error": str(e), "exit_code": 2}
        )
        raise


def _verify_gpt2(caches, prompt_len, new_tokens, batch, reference, model, weights, device, dtype, seed, on_row,
                 trust_remote_code, layers, compile):  # fmt: skip
    from kvbench import validate
    from kvbench.caches import parse_cache_names
    from kvbench.check.verify import random_prompts, run_verify
    from kvbench.decode.fixed_step import check_compile
    from kvbench.model.weights import peek_config

    for flag, value in (("--trust-remote-code", trust_remote_code), ("--layers", layers is not None)):
        if value:
            raise KVBenchError(f"{flag} applies to --hf models only")
    names = parse_cache_names(caches)
    check_compile(compile, caches=names)
    if reference not in ("hf", "none"):
        raise KVBenchError(f"--reference must be hf or none, got {reference!r}")
    validate.integer("--new-tokens", new_tokens, 2, why="the logits check needs a decode step")
    validate.integer(
        "--batch", batch, 2, validate.MAX_BATCH, why="the batched check needs prompts of different lengths"
    )
    validate.integer(
        "--prompt-len", prompt_len, batch, why=f"{batch} prompts of distinct lengths need that many tokens"
    )
    validate.seed(seed)
    cfg = peek_config(model, weights)
    validate.fits_context(
        "--prompt-len", prompt_len, new_tokens, cfg.block_size, "lower --prompt-len or --new-tokens"
    )
    loaded, dev, dt, hf_dir = load_for_checks(model, weights, device, dtype, seed)
    check_compile(compile, dev.type)
    prompts = random_prompts(loaded.config.vocab_size, prompt_len, batch, seed)
    report = run_verify(
        loaded.model, names, prompts, new_tokens, reference, hf_dir, on_row=on_row, compile=compile
    )
    meta = {"model": loaded.config.name, "weights": loaded.weights, "device": str(dev), "dtype": report.dtype,
            "compile": compile}  # fmt: skip
    return report, meta
