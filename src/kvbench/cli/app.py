"""The Typer app, the one layer where errors become exit codes, and loading a model for a command.

Each command lives in its own module beside this one (generate, verify, break, bench, memory, compare), with its
renderers; the options they share are declared in cli/options.py. `kvbench.cli` imports the command modules so they
register on `app`.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer import core as typer_core
from typer.core import TyperGroup

from kvbench import __version__, console
from kvbench.bench import hugepages
from kvbench.errors import KVBenchError, NotEnoughMemoryError, one_line
from kvbench.validate import PROBE_ENV, probe_bytes_setting

# The click that Typer runs on: vendored as typer._click in recent Typer, the click package before.
click = getattr(typer_core, "_click", None) or __import__("click")

BAD_INPUT = 2  # KVBenchError: a wrong command, a bad file or value
OUT_OF_MEMORY = (
    3  # NotEnoughMemoryError or an allocation failure: the command was right, the machine too small
)
# The exit status when the reader of stdout goes away early (`kvbench ... | head -1`): 128 + SIGPIPE, what a shell
# reports for a program the signal stopped. The command ends quietly, with no verdict.
STDOUT_CLOSED = 141


class KVBenchGroup(TyperGroup):
    """Click's own usage errors (an unknown option, `--batch abc`) answered like every other error: one red line
    on stderr naming the problem, exit 2; never a usage panel or a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        was_devnull = console.stdout_is_devnull()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except BrokenPipeError:  # help or a usage error written to a pipe closed early
            console.stdout_closed()
            sys.exit(STDOUT_CLOSED)
        except SystemExit as e:
            # Typer's help is printed by a Rich console of its own, which answers a closed pipe by pointing stdout
            # at /dev/null and exiting 1; seen from here, that is the same closed pipe.
            if e.code == 1 and not was_devnull and console.stdout_is_devnull():
                sys.exit(STDOUT_CLOSED)
            raise
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            sys.exit(0)
        except click.exceptions.ClickException as e:
            where = f" (see: {e.ctx.command_path} --help)" if getattr(e, "ctx", None) is not None else ""
            console.error(e.format_message() + where)
            sys.exit(2 if isinstance(e, click.exceptions.UsageError) else e.exit_code)
        except (typer.Abort, getattr(click.exceptions, "Abort", typer.Abort)):  # where click has its own
            console.error("aborted")
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=KVBenchGroup,
    name="kvbench",
    help="Build, verify, break and measure the KV cache of LLM decoding on a from-scratch GPT-2.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def handle_errors(fn):
    """The one layer where errors become exit codes: KVBenchError -> red line + exit 2; running out of memory (CPU or
    GPU: an allocation failure, or a NotEnoughMemoryError refusal up front) -> red line + exit 3; Ctrl-C -> exit 130; stdout closed by its reader -> quiet exit 141; anything else ->
    one line naming it as a kvbench bug, exit 70 (the traceback with --verbose)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotEnoughMemoryError as e:
            console.error(str(e))
            raise typer.Exit(OUT_OF_MEMORY) from None
        except KVBenchError as e:
            console.error(str(e))
            raise typer.Exit(BAD_INPUT) from None
        except KeyboardInterrupt:
            console.error("interrupted")
            raise typer.Exit(130) from None
        except BrokenPipeError:
            console.stdout_closed()
            raise typer.Exit(STDOUT_CLOSED) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:
            oom = out_of_memory(e)
            if oom:
                console.error(oom)
                raise typer.Exit(OUT_OF_MEMORY) from None
            if VERBOSE["on"]:
                raise
            console.error(
                f"unexpected {one_line(e)} (a kvbench bug: please report it; --verbose shows the traceback)"
            )
            raise typer.Exit(70) from None

    return wrapper


VERBOSE = {"on": False}  # set by the root --verbose flag


def out_of_memory(e: BaseException) -> str | None:
    """One line for an allocation failure, CPU or GPU (errors.is_out_of_memory); None if `e` is something else."""
    from kvbench.errors import is_out_of_host_memory, is_out_of_memory

    if not is_out_of_memory(e):
        return None
    if is_out_of_host_memory(e):
        return "out of CPU memory (an allocation failed); lower --batch, the lengths or the model"
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return f"out of GPU memory: {first}; lower --batch, the lengths or the model"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvbench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", help="Show transformers' own log messages, warnings and progress bars."),
    ] = False,
) -> None:
    """kvbench: generate, verify, break, bench and memory over one GPT-2 core."""
    VERBOSE["on"] = verbose
    try:  # read again where they are used; checked here so a typo stops the run before it starts
        probe_bytes_setting(os.environ.get(PROBE_ENV, ""))
        hugepages.check()
    except KVBenchError as e:
        console.error(str(e))
        raise typer.Exit(2) from None
    if not verbose:
        quiet_libraries()


def quiet_libraries() -> None:
    """Keep transformers' and huggingface_hub's loading bars, advisories and warnings off the terminal: kvbench
    reports what matters itself. Environment variables the user set win."""
    import sys
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", module=r"(transformers|huggingface_hub)(\..*)?$")
    warnings.filterwarnings("ignore", module=r"torch\._(inductor|dynamo)(\..*)?$")  # compiling a decode step
    # already imported (tests, or an embedding program): set it directly too
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def load_for_cli(model: str | None, weights: str, device: str, dtype: str, seed: int, init_std: float = 0.02):
    """Resolve device and dtype, load the model, and show the random-weights warning once. Shared by commands."""
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.model.weights import load_model

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    loaded = load_model(model, weights, dev, dt, seed=seed, init_std=init_std)
    if loaded.warning:
        console.warn(loaded.warning)
    return loaded, dev, dt


# Random weights for verify and break use init std 0.05, not GPT-2's 0.02: at 0.02 a random GPT-2's greedy output
# repeats one token (5 distinct in 100 on gpt2), which hides bugs such as wrong positions; at 0.05 it varies (47 of
# 100). Not larger: at 0.1 a 12-layer random model's activations blow up and its logits turn chaotic (near-ties
# everywhere), which no real checkpoint looks like.
CHECK_INIT_STD = 0.05


def load_for_checks(model: str | None, weights: str, device: str, dtype: str, seed: int):
    """Like load_for_cli, with CHECK_INIT_STD for random weights; also the Hugging Face directory the weights came
    from, if any, so the reference loads the checkpoint itself rather than our port of it."""
    from kvbench.model.weights import hub_snapshot

    loaded, dev, dt = load_for_cli(model, weights, device, dtype, seed, init_std=CHECK_INIT_STD)
    hf_dir = None
    if not loaded.random:
        if weights not in ("auto", "hub"):
            hf_dir = str(Path(weights).expanduser())
        else:
            snap = hub_snapshot(model or "gpt2", allow_download=False)
            hf_dir = str(snap) if snap else None
    return loaded, dev, dt, hf_dir
