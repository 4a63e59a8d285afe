"""`kvbench verify`: cached decoding equals full recomputation, for every cache, against Hugging Face."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import typer

from kvbench import console, options
from kvbench.cli.app import NOTHING_CHECKED, command, load_for_checks
from kvbench.cli.verify_render import render_verify, verify_row
from kvbench.cli.verify_text import NO_TEXT, gpt2_text, hf_text, hf_text_tokens, text_plot, text_rules
from kvbench.dtypes import FLOATS, canonical
from kvbench.errors import KVBenchError
from kvbench.jsonio import SCHEMA_VERSION
from kvbench.options import option

if TYPE_CHECKING:
    from kvbench.check.judge import CheckRow, VerifyReport
    from kvbench.model.gpt2 import GPTConfig
    from kvbench.tp_command import Split


ENDPOINT_PANEL = "Serving engines (--endpoint)"
PEER_PANEL = "Peer engines (--engine)"


@dataclass
class VerifyOptions:
    """One `kvbench verify` command line (validate.verify_rules)."""

    caches: str | None = option(
        "--caches",
        default=None,
        help="Comma-separated caches to check (default: every built-in but sink; all: every one). With --hf: none, dynamic, static, "
        "static-compiled, offloaded, offloaded_static, quantized-quanto, quantized-hqq, quantized-fp8, paged.",
    )
    prompt_len: int = option("--prompt-len", default=32, help="Tokens in the longest prompt.")
    new_tokens: int = option("--new-tokens", "-n", default=100, help="Greedy tokens for logits/greedy/reference.")
    batch: int = option("--batch", default=3, help="Prompts of different lengths in the batched check (>= 2).")
    reference: str = option(
        "--reference", default="hf", help="hf: also check against transformers' GPT2LMHeadModel; none: skip."
    )
    text: str | None = option(
        "--text",
        default=None,
        help="A UTF-8 text file teacher-forced through every cache: perplexity, KL divergence, top-1 agreement and "
        "RMS Δp against the no-cache forward and transformers (default for gpt2-shakespeare with its bundled weights: "
        "its held-out passage; none: no text rows).",
    )
    window: int | None = option(
        "--window", default=None, help="With --text: tokens per window (default: the model's context); stride half."
    )
    plot: str | None = option(
        "--plot",
        default=None,
        help="With --text: where the PNG of KL divergence by context depth goes (default: "
        "results/<timestamp>-verify/text-kld.png; written when a lossy cache ran).",
    )
    model: str | None = options.model_option()
    weights: str = options.weights_option()
    device: str = options.device_option()
    dtype: str = options.dtype_option("fp32")
    seed: int = options.seed_option()
    compile: str = options.compile_option()
    tp: int = options.tp_option()
    tp_timeout: float = options.tp_timeout_option()
    json_out: bool = options.json_option()
    hf: str | None = options.hf_option()
    trust_remote_code: bool = options.trust_option()
    layers: int | None = options.layers_option()
    junit_xml: str | None = options.junit_option()
    verbose: bool = options.verbose_option()
    engine: str | None = option(
        "--engine",
        default=None,
        panel=PEER_PANEL,
        help="Check a peer engine's cache instead, on the same weights against transformers: ct2 (CTranslate2 in "
        "float32 and with int8 weights), ct2-fp32, ct2-int8 (needs kvbench\\[ct2]); llamacpp (llama.cpp: "
        "llamacpp-f32, llamacpp-f16, llamacpp-f16-kv-q8_0, llamacpp-f16-kv-q4_0; needs kvbench\\[llamacpp]); "
        "comma-separated.",
    )
    hold_exact: bool = option(
        "--hold-exact/--no-hold-exact",
        default=False,
        panel=PEER_PANEL,
        help="With --engine: hold lossy peers (int8 weights) to the exact fp32 tolerance too, as a deployment that "
        "claims exactness; they then fail with their distortion figures.",
    )
    endpoint: str | None = option(
        "--endpoint",
        default=None,
        panel=ENDPOINT_PANEL,
        help="Check cross-request KV-cache reuse on a running OpenAI-compatible server instead (kvbench serve, vLLM, "
        "SGLang, llama.cpp's server): its base URL, e.g. http://127.0.0.1:8000/v1.",
    )
    checks: str | None = option(
        "--checks",
        default=None,
        panel=ENDPOINT_PANEL,
        help="With --endpoint: comma-separated checks (default: all): warm-cold, evicted, batch-invariance, "
        "accounting.",
    )
    reset: str = option(
        "--reset",
        default="kvbench",
        panel=ENDPOINT_PANEL,
        help="With --endpoint: how the engine runs a request cold: kvbench | vllm (POST /reset_prefix_cache), sglang "
        '(POST /flush_cache), llamacpp ("cache_prompt": false), none.',
    )
    evict_tokens: int | None = option(
        "--evict-tokens",
        default=None,
        panel=ENDPOINT_PANEL,
        help="With --endpoint: the engine's KV pool in tokens, for the evicted check (default: from its /metrics).",
    )
    timeout: float = option(
        "--timeout",
        default=60.0,
        panel=ENDPOINT_PANEL,
        help="With --endpoint: seconds each HTTP request may take in all; past it the run ends with one line.",
    )
    logprob_tol: float | None = option(
        "--logprob-tol",
        default=None,
        panel=ENDPOINT_PANEL,
        help="With --endpoint: the largest |logprob difference| of a sampled token between a warm and a cold run "
        "that still counts as drift (a token flip passes only at a near-tie). Default: 1e-4 where /v1/models says "
        "the model computes in float32 (kvbench serve does), else 0.05 (16-bit rounding).",
    )


@command(VerifyOptions, error_doc={"passed": False})
def verify(o: VerifyOptions) -> None:
    """Prove cached decoding equals full recomputation, for every cache, against Hugging Face.

    With --hf SOURCE: the same checks on any Hugging Face causal LM, for each of transformers' own caches, against
    its own no-cache path. With --text FILE, real text teacher-forced through every cache: perplexity and KL
    divergence, an exact cache held to transformers' perplexity. Exit 0 when every check passes, 1 when any fails, 5 when every row was skipped. In fp16/bf16 a token flip at a
    near-tie that the logit error explains is reported, not failed."""
    from kvbench import distributed, tp_command, validate
    from kvbench.results import junit

    role = distributed.role(o.tp)  # launch the ranks, be one, or run alone; a --tp torchrun did not launch refused
    launching, reports = role.launches, role.reports  # under --tp, rank 0 reports
    clock = junit.RowClock(None if o.json_out or not reports else verify_row)
    exit_code = None
    with junit.errors_reported(o.junit_xml if role.writes_errors else None, "verify", clock):
        junit_path = junit.check_junit_path(o.junit_xml) if reports else None
        validate.verify_rules(o)
        _peer_rules(o)  # first: a peer takes no --text, so --window is refused for that, not for a missing --text
        text_rules(o)
        _endpoint_rules(o)
        if launching:
            exit_code = tp_command.launch(_split(o), sys.argv[1:])
        elif o.endpoint is not None:
            report, meta = _verify_endpoint(o, clock)
        elif o.engine is not None:
            report, meta = _verify_peers(o, clock)
        else:
            report, meta = _verify_hf(o, clock) if o.hf is not None else _verify_gpt2(o, clock)
    if exit_code is not None:  # the ranks have reported
        raise typer.Exit(exit_code)
    if not reports:
        return
    if report.text:
        meta["text"]["plot"] = text_plot(report, meta, o.plot)
    if junit_path is not None:
        junit.write_suite(junit_path, junit.verify_suite(report, meta, clock.seconds, clock.total()))
    if o.json_out:
        from dataclasses import asdict

        doc = asdict(report)
        doc["text"] = {**meta.pop("text", {}), **doc["text"]}  # empty where no text was scored
        console.print_json({"schema_version": SCHEMA_VERSION, "passed": report.passed, **meta, **doc})
    else:
        render_verify(report, meta, o.verbose)
    if report.nothing_checked:
        raise typer.Exit(NOTHING_CHECKED)
    if not report.passed:
        raise typer.Exit(1)


def _split(o: VerifyOptions, cfg: GPTConfig | None = None) -> Split:
    """What this command splits over --tp ranks: our GPT-2 (its config, read here when not given) or --hf's model."""
    from kvbench.tp_command import Split

    if o.hf is not None:
        return Split(o.tp, o.device, o.tp_timeout, hf=o.hf, trust_remote_code=o.trust_remote_code)
    if cfg is None:
        from kvbench.model.weights import peek_config

        cfg = peek_config(o.model, o.weights)
    return Split(o.tp, o.device, o.tp_timeout, config=cfg)


def _verify_gpt2(o: VerifyOptions, on_row):
    from kvbench import tp_command, validate
    from kvbench.caches import parse_cache_names
    from kvbench.check.verify import random_prompts, run_verify
    from kvbench.decode.rules import compile_mode
    from kvbench.model.weights import peek_config

    names = parse_cache_names(o.caches)
    compile_mode(o.compile, caches=names)
    cfg = peek_config(o.model, o.weights)
    validate.fits_context(
        "--prompt-len", o.prompt_len, o.new_tokens, cfg.block_size, "lower --prompt-len or --new-tokens"
    )
    rank = tp_command.join(_split(o, cfg))  # one rank of the group: join it first, on its own device
    device = o.device if rank is None else str(rank.device)
    from kvbench.check.verify import check_run_fits
    from kvbench.devices import resolve_device, resolve_dtype

    run_on = resolve_device(device)
    check_run_fits(cfg, o.batch, o.prompt_len + o.new_tokens, resolve_dtype(o.dtype, run_on), run_on)
    text, text_meta = gpt2_text(o, cfg)
    loaded, dev, dt, hf_dir = load_for_checks(o.model, o.weights, device, o.dtype, o.seed)
    compile_mode(o.compile, dev.type)
    prompts = random_prompts(loaded.config.vocab_size, o.prompt_len, o.batch, o.seed)
    report = run_verify(
        loaded.model,
        names,
        prompts,
        o.new_tokens,
        o.reference,
        hf_dir,
        on_row=on_row,
        compile=o.compile,
        tp=rank,
        random_weights=loaded.random,
        text=text,
    )
    meta = {
        "model": loaded.config.name,
        "weights": loaded.weights,
        "device": str(dev),
        "dtype": report.dtype,
        "compile": o.compile,
        "tp": o.tp,
    }
    if text_meta:
        meta["text"] = text_meta
    return report, meta


def _verify_hf(o: VerifyOptions, on_row):
    """`kvbench verify --hf`: load, run every check on every cache, return (report, meta) for the renderers."""
    assert o.hf is not None, "--hf given"
    from kvbench import tp_command
    from kvbench.check.hf_verify import run_hf_verify
    from kvbench.check.verify import random_prompts
    from kvbench.cli.app import CHECK_INIT_STD
    from kvbench.cli.hf import load_hf_for_cli
    from kvbench.devices import resolve_device
    from kvbench.hf.caches import HF_CACHES, parse_verify_caches
    from kvbench.hf.models import check_length

    names = parse_verify_caches(o.caches, resolve_device(o.device))

    def fits(shape) -> None:  # on the meta-device build, before any weight is read
        check_length(
            shape.info,
            o.prompt_len + o.new_tokens,
            f"--prompt-len {o.prompt_len} + --new-tokens {o.new_tokens}",
            "lower --prompt-len or --new-tokens",
        )

    text_tokens = hf_text_tokens(o)  # the text and the model's tokenizer, before the model
    # one rank of the group: join it, then load the whole model and this rank's split of it
    rank, shard = tp_command.join(_split(o)), None
    device = o.device if rank is None else str(rank.device)
    loaded, dev, dt = load_hf_for_cli(
        o.hf,
        device,
        o.dtype,
        o.seed,
        o.layers,
        o.trust_remote_code,
        init_std=CHECK_INIT_STD,
        run=(o.batch, o.prompt_len + o.new_tokens),
        check=fits,
    )
    if rank is not None:
        from kvbench.hf.models import load_hf

        shard = load_hf(o.hf, dev, dt, o.seed, o.layers, o.trust_remote_code, tp=True)
    prompts = random_prompts(loaded.info.vocab_size, o.prompt_len, o.batch, o.seed)
    text, text_meta = hf_text(o, text_tokens, loaded)
    report = run_hf_verify(loaded, names, prompts, o.new_tokens, on_row=on_row, tp=rank, shard=shard, text=text)
    meta = {
        "model": loaded.label,
        "weights": loaded.weights,
        "device": str(dev),
        "dtype": report.dtype,
        "tp": o.tp,
        "hf": {**loaded.meta(), "caches": {n: HF_CACHES[n].summary for n in names}},
    }
    if text_meta:
        meta["text"] = text_meta
    return report, meta


def _peer_rules(o: VerifyOptions) -> list[str]:
    """--engine's peers (families expanded), and the options that do not apply to them refused."""
    from kvbench.peers import FAMILIES, PEERS, expand

    if o.engine is None:
        if o.hold_exact:
            raise KVBenchError("--hold-exact holds a peer engine to the exact tolerance: give --engine too")
        return []
    names = [n.strip() for n in o.engine.split(",") if n.strip()]
    if not names:
        raise KVBenchError(f"--engine is empty; name one or more of {', '.join([*FAMILIES, *PEERS])}")
    for n in names:
        if n not in PEERS and n not in FAMILIES:
            raise KVBenchError(f"unknown peer engine {n!r}; peers: {', '.join([*FAMILIES, *PEERS])}")
    given = {
        "--caches": o.caches is not None,
        "--hf": o.hf is not None,
        "--endpoint": o.endpoint is not None,
        "--dtype": canonical(o.dtype, "--dtype", FLOATS, ("auto",)) not in ("fp32", "auto"),  # auto: fp32 on a CPU
        "--compile": o.compile != "off",
        "--tp": o.tp != 1,
        "--reference": o.reference != "hf",
        "--text": o.text not in (None, NO_TEXT),  # the text rows score kvbench's caches; a peer has none of them
        "--window": o.window is not None,
        "--plot": o.plot is not None,
    }
    for flag, on in given.items():
        if on:
            raise KVBenchError(
                f"{flag} with --engine: a peer runs its own cache on kvbench's float32 weights, held to transformers; "
                f"drop {flag}"
            )
    return expand(names)


def _verify_peers(o: VerifyOptions, on_row: Callable[[CheckRow], None]) -> tuple[VerifyReport, dict]:
    """`kvbench verify --engine PEER`: a peer's cache on our GPT-2's weights (check/peer_verify.py)."""
    from kvbench import validate
    from kvbench.check.peer_verify import run_peer_verify
    from kvbench.check.verify import random_prompts
    from kvbench.model.weights import peek_config
    from kvbench.peers import spec

    peers = [spec(n) for n in _peer_rules(o)]
    cfg = peek_config(o.model, o.weights)
    validate.fits_context(
        "--prompt-len", o.prompt_len, o.new_tokens, cfg.block_size, "lower --prompt-len or --new-tokens"
    )
    loaded, dev, dt, _ = load_for_checks(o.model, o.weights, o.device, o.dtype, o.seed)
    prompts = random_prompts(loaded.config.vocab_size, o.prompt_len, o.batch, o.seed)
    report = run_peer_verify(loaded.model, peers, prompts, o.new_tokens, o.hold_exact, on_row, loaded.random)
    meta = {
        "model": loaded.config.name,
        "weights": loaded.weights,
        "device": str(dev),
        "dtype": report.dtype,
        "engines": {p.name: p.summary for p in peers},
    }
    return report, meta


def _endpoint_rules(o: VerifyOptions) -> None:
    """--endpoint's options, and none of the options that choose a model kvbench runs beside it."""
    from kvbench.endpoint.run import endpoint_rules

    endpoint_rules(o)
    if o.endpoint is None:
        return
    given = {
        "--caches": o.caches is not None,
        "--hf": o.hf is not None,
        "--model": o.model is not None,
        "--weights": o.weights != "auto",
        "--device": o.device != "auto",
        "--dtype": o.dtype != "fp32",
        "--compile": o.compile != "off",
        "--tp": o.tp != 1,
        "--reference": o.reference != "hf",
    }
    for flag, on in given.items():
        if on:
            raise KVBenchError(
                f"{flag} chooses what kvbench runs itself; with --endpoint the engine runs its own model, drop {flag}"
            )


def _verify_endpoint(o: VerifyOptions, on_row: Callable[[CheckRow], None]) -> tuple[VerifyReport, dict]:
    """`kvbench verify --endpoint URL`: the checks on a running engine (endpoint/run.py)."""
    assert o.endpoint is not None, "--endpoint given"
    from kvbench.endpoint.run import EndpointSettings, parse_checks, run_endpoint

    settings = EndpointSettings(
        url=o.endpoint,
        checks=parse_checks(o.checks),
        reset=o.reset,
        prompt_len=o.prompt_len,
        new_tokens=o.new_tokens,
        neighbours=o.batch,
        seed=o.seed,
        tol=o.logprob_tol,
        evict_tokens=o.evict_tokens,
        timeout=o.timeout,
    )
    return run_endpoint(settings, on_row)
