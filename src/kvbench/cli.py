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
def load_for_cli(model: str | None, weights: str, device: str, dtype: str, seed: int):
    """Resolve device and dtype, load the model, and show the random-weights warning once. Shared by commands."""
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.weights import load_model

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    loaded = load_model(model, weights, dev, dt, seed=seed)
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


@app.command()
@handle_errors
def verify() -> None:
    """Prove cached decoding equals full recomputation, for every cache, against Hugging Face."""
    raise KVBenchError("verify lands with issue 3 (verify and break); not built yet")


@app.command(name="break")
@handle_errors
def break_() -> None:
    """Inject the classic KV-cache bugs and show verify catching each."""
    raise KVBenchError("break lands with issue 3 (verify and break); not built yet")


@app.command()
@handle_errors
def bench() -> None:
    """Measure no cache vs each cache vs transformers: TTFT, TPOT, memory."""
    raise KVBenchError("bench lands with issue 4; not built yet")


@app.command()
@handle_errors
def memory() -> None:
    """Plan KV-cache memory for real models (bytes/token, per sequence, fits on a GPU)."""
    raise KVBenchError("memory lands with issue 5; not built yet")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
