"""The Typer app: one thin command per subcommand, shared options defined once, errors turned into exit codes.

Commands parse options, call a library function that returns dataclasses, and hand them to `console` to render.
Heavy imports (torch, transformers, matplotlib) happen inside the commands so `kvbench --help` is instant.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from kvbench import __version__, console
from kvbench.errors import KVBenchError

app = typer.Typer(
    name="kvbench",
    help="Build, verify, break and measure the KV cache of LLM decoding on a from-scratch GPT-2.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# --- shared options (defined once, used by every command that loads a model) ------------------------------------
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model", "-m", help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-tiny, or a GPT-2 config.json."
    ),
]
WeightsOpt = Annotated[
    str,
    typer.Option(
        "--weights", "-w", help="auto | hub | random | PATH (a local Hugging Face GPT-2 directory)."
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", "-d", help="auto | cpu | cuda | cuda:N.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for random weights, random prompts and sampling.")]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        help="A .tiktoken ranks file or a directory with vocab.json + merges.txt (default: $KVBENCH_TOKENIZER, "
        "else tiktoken's gpt2 download).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout and nothing else.")]


def _dtype_opt(default: str) -> object:
    return typer.Option(default, "--dtype", help="fp32 | fp16 | bf16 (auto: fp16 on CUDA, fp32 on CPU).")


def handle_errors(fn):
    """The one layer where errors become exit codes: KVBenchError -> red line + exit 2; Ctrl-C -> exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KVBenchError as e:
            console.error(str(e))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            console.error("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvbench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """kvbench: generate, verify, break, bench and memory over one GPT-2 core."""


# --- commands ------------------------------------------------------------------------------------------------------
def load_for_cli(model: str | None, weights: str, device: str, dtype: str, seed: int, init_std: float = 0.02):
    """Resolve device and dtype, load the model, and show the random-weights warning once. Shared by commands."""
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.weights import load_model

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    loaded = load_model(model, weights, dev, dt, seed=seed, init_std=init_std)
    if loaded.warning:
        console.warn(loaded.warning)
    return loaded, dev, dt


def read_prompts(prompt: str | None, prompts: list[str] | None, prompts_file: Path | None) -> list[str]:
    texts = ([prompt] if prompt is not None else []) + list(prompts or [])
    if prompts_file is not None:
        try:
            lines = prompts_file.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise KVBenchError(f"cannot read --prompts-file {prompts_file}: {e.strerror}") from None
        texts += [line for line in lines if line.strip()]
    if not texts:
        raise KVBenchError("no prompt given: pass PROMPT, --prompt (repeatable) or --prompts-file")
    for i, t in enumerate(texts):
        if not t.strip():
            raise KVBenchError(f"prompt {i + 1} is empty")
    return texts


@app.command()
@handle_errors
def generate(
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt (or use --prompt / --prompts-file).")
    ] = None,
    prompts: Annotated[
        list[str] | None,
        typer.Option("--prompt", "-p", help="A prompt; repeat for a batch decoded together."),
    ] = None,
    prompts_file: Annotated[
        Path | None,
        typer.Option("--prompts-file", help="One prompt per line, decoded together as a batch."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate.")] = 64,
    cache: Annotated[
        str, typer.Option("--cache", "-c", help="KV cache: none, dynamic, static, ...")
    ] = "dynamic",
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy.")] = 0.0,
    top_k: Annotated[
        int | None, typer.Option("--top-k", help="Sample from the k most likely tokens.")
    ] = None,
    stop_at_eot: Annotated[
        bool, typer.Option("--stop/--no-stop", help="Stop a sequence at <|endoftext|>.")
    ] = True,
    model: ModelOpt = None,
    weights: WeightsOpt = "auto",
    device: DeviceOpt = "auto",
    dtype: str = _dtype_opt("auto"),
    seed: SeedOpt = 0,
    tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Generate text through any cache (and batches of prompts). Greedy by default; streams a single prompt."""
    texts = read_prompts(prompt, prompts, prompts_file)
    from kvbench.caches import get_cache_spec
    from kvbench.generation import Sampler
    from kvbench.generation import generate as run_generate
    from kvbench.tokenizer import load_tokenizer

    get_cache_spec(cache)
    sampler = Sampler(temperature=temperature, top_k=top_k, seed=seed)
    tok = load_tokenizer(tokenizer)
    ids = [tok.encode(t) for t in texts]
    loaded, dev, dt = load_for_cli(model, weights, device, dtype, seed)
    vocab = loaded.config.vocab_size
    for i, p in enumerate(ids):
        if not p:
            raise KVBenchError(f"prompt {i + 1} encodes to zero tokens")
        if max(p) >= vocab:
            raise KVBenchError(f"prompt {i + 1} has token id {max(p)} >= the model's vocabulary of {vocab}")

    stream = console.TextStream(tok, texts[0]) if (len(texts) == 1 and not json_out) else None
    result = run_generate(
        loaded.model,
        ids,
        max_new_tokens,
        cache=cache,
        sampler=sampler,
        stop_token=tok.eot_id if stop_at_eot else None,
        on_token=stream.push if stream else None,
    )
    if stream:
        stream.close()
    doc = generation_report(texts, result, tok, loaded, dev, dt, sampler, tokenizer_source=tok.source)
    if json_out:
        console.print_json(doc)
    else:
        console.render_generation(doc, streamed=stream is not None)


def generation_report(texts, result, tok, loaded, dev, dt, sampler, tokenizer_source) -> dict:
    """The JSON document of a generate run: completions, settings, timings (all device-synchronised)."""
    import statistics

    from kvbench.devices import device_name, dtype_name

    n_tokens = sum(len(t) for t in result.tokens)
    return {
        "completions": [
            {"prompt": p, "prompt_tokens": n, "tokens": t, "text": tok.decode(t)}
            for p, n, t in zip(texts, result.prompt_lens, result.tokens, strict=True)
        ],
        "settings": {
            "model": loaded.config.name,
            "weights": loaded.weights,
            "random_weights": loaded.random,
            "tokenizer": tokenizer_source,
            "cache": result.cache,
            "device": str(dev),
            "device_name": device_name(dev),
            "dtype": dtype_name(dt),
            "batch": len(texts),
            "temperature": sampler.temperature,
            "top_k": sampler.top_k,
            "seed": sampler.seed,
        },
        "timings": {
            "ttft_ms": result.ttft_s * 1e3,
            "tpot_ms_median": statistics.median(result.step_s) * 1e3 if result.step_s else None,
            "total_s": result.total_s,
            "generated_tokens": n_tokens,
            "tokens_per_s": (len(texts) * result.new_tokens) / result.total_s if result.total_s > 0 else None,
        },
        "cache": {"name": result.cache, "bytes": result.cache_bytes, "bytes_copied": result.bytes_copied},
        "warning": loaded.warning,
    }


# Random weights for verify and break use init std 0.05, not GPT-2's 0.02: at 0.02 a random GPT-2's greedy output
# repeats one token (5 distinct in 100 on gpt2), which hides bugs such as wrong positions; at 0.05 it varies (47 of
# 100). Not larger: at 0.1 a 12-layer random model's activations blow up and its logits turn chaotic (near-ties
# everywhere), which no real checkpoint looks like.
CHECK_INIT_STD = 0.05


def _load_for_checks(model: str | None, weights: str, device: str, dtype: str, seed: int):
    """Like load_for_cli, with CHECK_INIT_STD for random weights; also the Hugging Face directory the weights came
    from, if any, so the reference loads the checkpoint itself rather than our port of it."""
    from kvbench.weights import hub_snapshot

    loaded, dev, dt = load_for_cli(model, weights, device, dtype, seed, init_std=CHECK_INIT_STD)
    hf_dir = None
    if not loaded.random:
        if weights not in ("auto", "hub"):
            hf_dir = str(Path(weights).expanduser())
        else:
            snap = hub_snapshot(model or "gpt2", allow_download=False)
            hf_dir = str(snap) if snap else None
    return loaded, dev, dt, hf_dir


@app.command()
@handle_errors
def verify(
    caches: Annotated[
        str | None, typer.Option("--caches", "-c", help="Comma-separated caches to check (default: all).")
    ] = None,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Tokens in the longest prompt.")] = 32,
    new_tokens: Annotated[
        int, typer.Option("--new-tokens", "-n", help="Greedy tokens for logits/greedy/reference.")
    ] = 100,
    batch: Annotated[
        int, typer.Option("--batch", help="Prompts of different lengths in the batched check (>= 2).")
    ] = 3,
    reference: Annotated[
        str,
        typer.Option("--reference", help="hf: also check against transformers' GPT2LMHeadModel; none: skip."),
    ] = "hf",
    model: ModelOpt = None,
    weights: WeightsOpt = "auto",
    device: DeviceOpt = "auto",
    dtype: str = _dtype_opt("fp32"),
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Prove cached decoding equals full recomputation, for every cache, against Hugging Face.

    Exit 0 when every check passes, 1 when any fails. In fp16/bf16 a token flip at a near-tie that the logit error
    explains is reported, not failed."""
    from kvbench.caches import parse_cache_names
    from kvbench.verify import random_prompts, run_verify

    names = parse_cache_names(caches)
    if reference not in ("hf", "none"):
        raise KVBenchError(f"--reference must be hf or none, got {reference!r}")
    if new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (the logits check needs a decode step), got {new_tokens}"
        )
    loaded, dev, dt, hf_dir = _load_for_checks(model, weights, device, dtype, seed)
    prompts = random_prompts(loaded.config.vocab_size, prompt_len, batch, seed)
    on_row = None if json_out else console.verify_row
    report = run_verify(loaded.model, names, prompts, new_tokens, reference, hf_dir, on_row=on_row)
    meta = {"model": loaded.config.name, "weights": loaded.weights, "device": str(dev), "dtype": report.dtype}
    if json_out:
        from dataclasses import asdict

        console.print_json({"passed": report.passed, **meta, **asdict(report)})
    else:
        console.render_verify(report, meta)
    if not report.passed:
        raise typer.Exit(1)


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
    from kvbench.faults import break_fault, parse_fault_names
    from kvbench.tokenizer import load_tokenizer
    from kvbench.verify import random_prompts

    names = parse_fault_names(name)
    if new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (a fault shows from the first decode step), got {new_tokens}"
        )
    if batch < 2:
        why = "padding needs >= 2 prompts of different lengths: with one prompt nothing is padded, the bug is dormant"
        raise KVBenchError(f"--batch {batch}: {why}; use --batch 2 or more")
    if reference not in ("hf", "none"):
        raise KVBenchError(f"--reference must be hf or none, got {reference!r}")
    loaded, dev, dt, hf_dir = _load_for_checks(model, weights, device, dtype, seed)
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
        r = break_fault(loaded.model, n, prompts, new_tokens, reference, hf_dir, decode)
        results.append(r)
        if not json_out:
            console.render_break(r)
    meta = {"model": loaded.config.name, "weights": loaded.weights, "device": str(dev)}
    if json_out:
        from dataclasses import asdict

        console.print_json({"all_detected": all(r.detected for r in results), **meta,
                            "bugs": [asdict(r) for r in results]})  # fmt: skip
    else:
        console.render_break_summary(results)
    if not all(r.detected for r in results):
        raise typer.Exit(1)


@app.command()
@handle_errors
def bench(
    prompt_len: Annotated[
        str | None,
        typer.Option("--prompt-len", help="Prompt lengths to sweep, comma-separated (default: 16,128,512)."),
    ] = None,
    new_tokens: Annotated[
        int | None, typer.Option("--new-tokens", help="Tokens generated per run (default: 400).")
    ] = None,
    caches: Annotated[
        str | None,
        typer.Option("--caches", help="Comma-separated cache names, or 'all' (default: all registered)."),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine", help="kvbench, hf (transformers' generate), comma-separated (default: both)."
        ),
    ] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="Sequences per run (default: 1).")] = None,
    repeats: Annotated[
        int | None, typer.Option("--repeats", help="Timed runs per configuration (default: 3).")
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option(
            "--warmup", help="Runs before the timed ones; the first is reported as cold (default: 1)."
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="A TOML sweep (configs/bench/); options override it."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Run directory (default: results/<timestamp>-bench/).")
    ] = None,
    model: ModelOpt = None,
    weights: WeightsOpt = None,
    device: DeviceOpt = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="fp32 | fp16 | bf16 | auto (fp16 on CUDA, fp32 on CPU).")
    ] = None,
    seed: SeedOpt = None,
    threads: Annotated[
        int | None,
        typer.Option("--threads", help="torch CPU threads (default: torch's default: one per core)."),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Measure no cache vs each cache vs transformers: TTFT, TPOT, memory."""
    from kvbench import bench as B
    from kvbench import report

    overrides = dict(
        prompt_len=prompt_len, new_tokens=new_tokens, caches=caches, engine=engine, batch=batch, repeats=repeats,
        warmup=warmup, model=model, weights=weights, device=device, dtype=dtype, seed=seed, threads=threads,
        out=None if out is None else str(out),
    )  # fmt: skip
    settings = B.load_settings(config, overrides)
    run_dir = report.prepare_run_dir(settings.out or report.default_run_dir("bench"))  # before any work
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    loaded, dev, dt = load_for_cli(
        settings.model, settings.weights, settings.device, settings.dtype, settings.seed
    )
    B.check_fits_context(settings, loaded.config.block_size, loaded.config.name)
    recorder = report.BenchRecorder(run_dir, loaded, dev, dt, settings, config)
    with console.bench_progress() as progress:
        try:
            B.run_sweep(
                loaded.model,
                settings,
                recorder.dtype,
                recorder.device_label,
                on_result=recorder.add,
                on_progress=progress.update,
            )
        except KeyboardInterrupt:
            recorder.finish("interrupted")
            console.note(f"interrupted: {len(recorder.summary)} completed configuration(s) kept in {run_dir}")
            raise
    files = recorder.finish("complete")
    if json_out:
        console.print_json(recorder.json_doc())
    else:
        console.render_bench(recorder.summary, recorder.meta, run_dir, files)


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
                console.memory_measure(r)
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
                console.memory_paged(paged)
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
            console.memory_copy_traffic(traffic)
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
        console.memory_all(plans, batch, kv_dtype, weights_dtype)
    else:
        for p in plans:
            console.memory_plan(p)


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
