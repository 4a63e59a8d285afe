"""`kvbench break`: inject the classic KV-cache bugs and show verify catching each."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import typer

from kvbench import console, options
from kvbench.cli.app import NOTHING_CHECKED, command, load_for_checks
from kvbench.cli.break_render import render_break, render_break_summary
from kvbench.errors import KVBenchError
from kvbench.jsonio import SCHEMA_VERSION
from kvbench.options import option

if TYPE_CHECKING:
    from kvbench.model.gpt2 import GPTConfig
    from kvbench.tp_command import Split


@dataclass
class BreakOptions:
    """One `kvbench break` command line (validate.break_rules)."""

    name: str = option(
        argument=True,
        default="all",
        help="A fault name, or all (every in-process fault); a server fault (kvbench serve --fault) runs by its name.",
    )
    prompt: str | None = option("--prompt", "-p", default=None, help="The prompt (default: a built-in one).")
    new_tokens: int = option("--new-tokens", "-n", default=40, help="Tokens per run.")
    batch: int = option("--batch", default=3, help="Prompts in the batch for `padding` and the batched check (>= 2).")
    reference: str = option(
        "--reference", default="hf", help="hf: include the Hugging Face reference check; none: skip."
    )
    cache: str | None = option(
        "--cache",
        "-c",
        default=None,
        help="Run the faults on this cache (a name or a pkg.module:Class plugin); default: each fault's own. "
        "Faults that live inside one cache design (static-pointer) are skipped on others.",
    )
    model: str | None = options.model_option()
    weights: str = options.weights_option()
    device: str = options.device_option()
    dtype: str = options.dtype_option("fp32")
    seed: int = options.seed_option()
    tokenizer: str | None = options.tokenizer_option()
    tp: int = options.tp_option()
    tp_timeout: float = options.tp_timeout_option()
    json_out: bool = options.json_option()
    junit_xml: str | None = options.junit_option()
    verbose: bool = options.verbose_option()


@command(BreakOptions, name="break", error_doc={"all_detected": False})
def break_(o: BreakOptions) -> None:
    """Inject the classic KV-cache bugs and show verify catching each.

    Runs correct and faulty code side by side on the same model and prompt. Exit 0 when every injected fault was
    detected by verify, 1 when any slipped through, 5 when every fault was skipped."""
    from kvbench import distributed, tp_command, validate
    from kvbench.results import junit

    role = distributed.role(o.tp)  # launch the ranks, be one, or run alone; a --tp torchrun did not launch refused
    launching, reports = role.launches, role.reports  # under --tp, rank 0 reports
    clock, exit_code = junit.RowClock(), None
    with junit.errors_reported(o.junit_xml if role.writes_errors else None, "break", clock):
        junit_path = junit.check_junit_path(o.junit_xml, "break") if reports else None
        validate.break_rules(o)
        if launching:
            from kvbench.model.weights import peek_config

            cfg = peek_config(o.model, o.weights)
            _chosen(o, cfg, warn=False)  # a fault that cannot run is refused before any rank starts, as on a rank
            exit_code = tp_command.launch(_split(o, cfg), sys.argv[1:])
        else:
            results, skipped, meta = _run_faults(o, clock, reports)
    if exit_code is not None:  # the ranks have reported
        raise typer.Exit(exit_code)
    if not reports:
        return
    if junit_path is not None:
        junit.write_suite(junit_path, junit.break_suite(results, skipped, meta, clock.seconds, clock.total()))
    if o.json_out:
        from dataclasses import asdict

        console.print_json(
            {
                "schema_version": SCHEMA_VERSION,
                "all_detected": bool(results) and all(r.detected for r in results),
                "nothing_checked": not results,
                **meta,
                "bugs": [asdict(r) for r in results],
            }
        )
    else:
        render_break_summary(results)
    if not results:
        raise typer.Exit(NOTHING_CHECKED)
    if not all(r.detected for r in results):
        raise typer.Exit(1)


def _chosen(o: BreakOptions, cfg, warn: bool = True):
    """(the cache named, the faults that run, {fault skipped: why}, the tokenizer, the prompts): the faults chosen for
    this run's cache, ranks and context (the shown prompt, prompts[0], plus the new tokens)."""
    from kvbench import validate
    from kvbench.caches import get_cache_spec
    from kvbench.check.breaking import break_prompts
    from kvbench.check.faults import select_faults
    from kvbench.serve.faults import SERVER_FAULTS, server_fault_rules

    cache = get_cache_spec(o.cache).name if o.cache is not None else None
    server = o.name.strip() in SERVER_FAULTS
    if server:  # a server fault: kvbench serve's engine in one process (serve/scenarios.py)
        server_fault_rules(o.name, cache, o.tp)
    else:
        _known(o.name)
        select_faults(o.name, cache, o.tp)  # a fault that cannot run on this cache or rank count: before the tokenizer
    validate.fits_context("a one-token prompt", 1, o.new_tokens, cfg.block_size, "use fewer --new-tokens")
    tok = _tokenizer(o.tokenizer, warn)
    prompts = break_prompts(tok, cfg.vocab_size, o.prompt, o.batch, o.seed)
    if server:
        from kvbench.serve.scenarios import scenario_fits

        scenario_fits(prompts, o.new_tokens, cfg.block_size)
        return cache, [o.name.strip()], {}, tok, prompts
    validate.fits_context(
        "longest batch prompt (after padding)",
        max(map(len, prompts)),
        o.new_tokens,
        cfg.block_size,
        "use fewer --new-tokens or a shorter --prompt",
    )
    names, why = select_faults(o.name, cache, o.tp, (len(prompts[0]), o.new_tokens))
    return cache, names, why, tok, prompts


def _run_faults(o: BreakOptions, on_fault, reports: bool = True):
    """Each chosen fault against the correct path, each result passed to `on_fault` as it completes:
    (results, [(fault, why skipped)], meta). Under --tp, every rank runs them (rank 0 renders: `reports`)."""
    from kvbench import tp_command
    from kvbench.check.breaking import break_fault
    from kvbench.model.weights import peek_config
    from kvbench.serve.faults import SERVER_FAULTS
    from kvbench.serve.scenarios import break_server_fault

    cfg = peek_config(o.model, o.weights)
    cache, names, why, tok, prompts = _chosen(o, cfg, warn=reports)
    rank = tp_command.join(_split(o, cfg))  # one rank of the group: join it first, on its own device
    device = o.device if rank is None else str(rank.device)
    from kvbench.check.verify import check_run_fits
    from kvbench.devices import resolve_device, resolve_dtype

    run_on = resolve_device(device)
    check_run_fits(cfg, len(prompts), max(map(len, prompts)) + o.new_tokens, resolve_dtype(o.dtype, run_on), run_on)
    loaded, dev, dt, hf_dir = load_for_checks(o.model, o.weights, device, o.dtype, o.seed)
    assert loaded.config.vocab_size == cfg.vocab_size, "the prompts were drawn for the model's vocabulary"
    decode = tok.decode if tok is not None else None
    results = []
    for n in names:
        if n in SERVER_FAULTS:
            results.append(break_server_fault(loaded.model, n, prompts, o.new_tokens, decode))
        else:
            results.append(
                break_fault(loaded.model, n, prompts, o.new_tokens, o.reference, hf_dir, decode, cache, rank)
            )
        on_fault(results[-1])
        if reports and not o.json_out:
            render_break(results[-1], o.verbose)
    for n in why if reports else ():
        console.note(f"{n}: skipped ({why[n]})")
    if reports and o.name.strip() == "all":
        console.note(f"server faults (kvbench serve --fault NAME; kvbench break NAME): {', '.join(SERVER_FAULTS)}")
    meta = {"model": loaded.config.name, "weights": loaded.weights, "device": str(dev), "tp": o.tp}
    return results, list(why.items()), meta


def _known(name: str) -> None:
    """An unknown fault name is refused with both registries' names."""
    from kvbench.check.faults import FAULTS
    from kvbench.serve.faults import SERVER_FAULTS

    if name.strip() != "all" and name.strip() not in FAULTS:
        raise KVBenchError(
            f"unknown fault {name.strip()!r}; known faults: {', '.join(FAULTS)}; server faults: "
            f"{', '.join(SERVER_FAULTS)} (or all: every fault but the server faults)"
        )


def _split(o: BreakOptions, cfg: GPTConfig) -> Split:
    """What this command splits over --tp ranks: our GPT-2, of config `cfg`."""
    from kvbench.tp_command import Split

    return Split(o.tp, o.device, o.tp_timeout, config=cfg)


def _tokenizer(name: str | None, warn: bool = True):
    """The tokenizer for showing text; without one (and none named) the faults run on random ids (said when `warn`)."""
    from kvbench.model.tokenizer import load_tokenizer

    try:
        return load_tokenizer(name)
    except KVBenchError as e:
        if name is not None:
            raise
        if warn:
            console.warn(f"no tokenizer ({e}); showing random prompts and token ids instead of text")
        return None
