"""The Typer app: one thin command per subcommand, shared options defined once, errors turned into exit codes.

Commands parse options, call a library function that returns dataclasses, and hand them to `console` to render.
Heavy imports (torch, transformers, matplotlib) happen inside the commands so `kvbench --help` is instant.
"""

from __future__ import annotations

import functools
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
@app.command()
@handle_errors
def generate() -> None:
    """Generate text through any cache (and batches of prompts)."""
    raise KVBenchError("generate: not built yet")


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
