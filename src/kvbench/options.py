"""How a command's option is declared: once, as a field of the settings dataclass it fills.

    new_tokens: int = option("--new-tokens", "-n", default=400, help="Tokens generated per run.")

The field is the option: its name, type and default are the settings object's, its flags and help the command
line's (cli/app.py builds the Typer parameters from them, so nothing restates them). A field whose command-line
form differs from what it holds (a list read from "1,4,16") names that form with `cli_type`; a positional argument
says `argument=True`. Only the standard library is imported here: settings modules declare their options without
loading Typer.

The options several commands share with one meaning are declared once below (`model_option`, `device_option`, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    """A field's command-line declaration (the field's metadata under "cli")."""

    decls: tuple[str, ...]  # "--new-tokens", "-n" (or "--profile/--no-profile"); none for a positional argument
    help: str
    cli_type: Any = None  # the command line's type when it differs from the field's (None: the field's own)
    argument: bool = False  # positional, not an option
    panel: str | None = None  # the --help section it is listed under (None: Options)


def option(
    *decls: str,
    help: str,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    cli_type: Any = None,
    argument: bool = False,
    panel: str | None = None,
) -> Any:
    """A dataclass field declared as a command-line option (or, with `argument`, a positional argument)."""
    meta = {"cli": Flag(tuple(decls), help, cli_type, argument, panel)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def list_option(*decls: str, help: str, default: Callable[[], list[Any]]) -> Any:
    """A list field the command line gives comma-separated ("1,4,16"), its default built per settings object."""
    return option(*decls, default_factory=default, cli_type=str, help=help)


def flag_of(f: dataclasses.Field) -> Flag | None:
    return f.metadata.get("cli")


# --- options shared by several commands, one meaning each ------------------------------------------------------------
HF_PANEL = "Hugging Face models"
DTYPE_HELP = (
    "fp32 | fp16 | bf16 | auto (fp16 on CUDA, fp32 on CPU); torch's names work too: float32/float, float16/half, "
    "bfloat16 (case-insensitive)."
)
MODEL_HELP = (
    "gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-tiny, gpt2-shakespeare (shipped with its weights: real text "
    "offline), or a GPT-2 config.json."
)
WEIGHTS_HELP = "auto | hub | random | PATH (a local Hugging Face GPT-2 directory)."
COMPILE_HELP = (
    "How static-graph's fixed-shape decode step runs: off (eager), default (torch.compile), or max (CPU only: "
    "weights frozen into the step; one-row products and attention kvbench's C kernels, other GEMMs autotuned over "
    "Inductor's C++ templates). The first step compiles."
)


def model_option(default: str | None = None) -> Any:
    return option("--model", "-m", default=default, help=MODEL_HELP)


def weights_option(default: str | None = "auto") -> Any:
    return option("--weights", "-w", default=default, help=WEIGHTS_HELP)


def device_option(default: str | None = "auto") -> Any:
    return option("--device", "-d", default=default, help="auto | cpu | cuda | cuda:N.")


def dtype_option(default: str | None) -> Any:
    return option("--dtype", default=default, help=DTYPE_HELP)


def seed_option(default: int | None = 0) -> Any:
    return option("--seed", default=default, help="Seed for random weights, random prompts and sampling.")


def compile_option(default: str | None = "off") -> Any:
    return option("--compile", default=default, help=COMPILE_HELP)


def json_option() -> Any:
    return option("--json", default=False, help="Print one JSON document to stdout and nothing else.")


def verbose_option() -> Any:
    return option("--verbose", "-v", default=False, help="Print every row's tolerance and detail in full.")


def tokenizer_option() -> Any:
    return option(
        "--tokenizer",
        default=None,
        help="A .tiktoken ranks file or a directory with vocab.json + merges.txt (default: $KVBENCH_TOKENIZER, "
        "else GPT-2's ranks file shipped inside kvbench; nothing is downloaded).",
    )


def junit_option() -> Any:
    return option(
        "--junit-xml",
        default=None,
        cli_type=str | None,  # as typed: '' stays empty (a Path would read it as '.')
        help="Also write the verdict as JUnit XML to this file (one test case per row), for CI test reports; "
        "written when checks fail too, and as one error case when the run is refused.",
    )


def tp_option() -> Any:
    return option(
        "--tp",
        default=1,
        help="Tensor-parallel ranks: run as N ranks on torch.distributed (gloo on the CPU, NCCL with one GPU per "
        "rank), each holding 1/N of the heads and so of the KV cache; launched here, or one rank under torchrun.",
    )


def tp_timeout_option() -> Any:
    return option(
        "--tp-timeout",
        default=300.0,
        help="With --tp: seconds a collective may wait; past it the run ends, naming the rank that failed or hung.",
    )


def hf_option() -> Any:
    return option(
        "--hf",
        default=None,
        panel=HF_PANEL,
        help="Run on a Hugging Face causal LM instead of our GPT-2: a model directory, a config.json (random "
        "weights, transformers' init), or a hub id (online, or in the local cache).",
    )


def trust_option() -> Any:
    return option(
        "--trust-remote-code",
        default=False,
        panel=HF_PANEL,
        help="With --hf: let the model directory's own modelling code (auto_map) run.",
    )


def layers_option() -> Any:
    return option(
        "--layers",
        default=None,
        panel=HF_PANEL,
        help="With --hf: keep the first N decoder layers (faster; the cache code is the same in every layer).",
    )
