"""The Typer app: commands built from their settings dataclasses, and the one layer where errors become exit codes.

A command is registered with `command(Settings, ...)`: its parameters are the fields of those dataclasses declared
with `kvbench.options.option` (flags, help, defaults, types written once, on the field), and the function receives
the filled dataclasses. `Given(Settings)` passes only the options given on the command line, as a dict, for a
settings object whose other values come from a file (bench's TOML). Each command lives in its own module beside this
one; `kvbench.cli` imports them so they register on `app`.

Exit codes (`exit_code`, the one mapping): 0 success; 1 a verdict that failed (raised by the command as
typer.Exit(1)); 2 bad input (KVBenchError, or a usage error Click found); 3 out of memory (NotEnoughMemoryError or
an allocation failure); 5 nothing checked (verify or break skipped every row: no verdict, as pytest exits 5 when no
test ran); 70 a kvbench bug (anything else); 75 a tensor-parallel rank lost (killed by a signal, left without a
word, hung past --tp-timeout; a rank whose peer was lost exits 75 too); 130 interrupted (Ctrl-C), 128 + the signal
for SIGTERM and SIGHUP (`Terminated`); 141 stdout closed by its reader. A launched --tp run's status is the
launcher's (kvbench.distributed.RanksFailed); its ranks report how they ended to it and say nothing themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import signal
import sys
import threading
import typing
from collections.abc import Sequence
from dataclasses import MISSING
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer import core as typer_core
from typer.core import TyperCommand, TyperGroup

from kvbench import __version__, console

if TYPE_CHECKING:
    import torch

    from kvbench.model.weights import LoadedModel
from kvbench.errors import (
    CheckRaised,
    FailedThenStopped,
    KVBenchError,
    NotEnoughMemoryError,
    is_out_of_host_memory,
    is_out_of_memory,
    one_line,
)
from kvbench.jsonio import SCHEMA_VERSION
from kvbench.options import flag_of
from kvbench.thirdparty import note_signal, watching_signals

# The click that Typer runs on: vendored as typer._click in recent Typer, the click package before.
click = getattr(typer_core, "_click", None) or __import__("click")

FAILED = 1  # a verdict that failed: a check, a fault not detected, a regression
BAD_INPUT = 2  # KVBenchError: a wrong command, a bad file or value
OUT_OF_MEMORY = 3  # the command was right, the machine too small
NOTHING_CHECKED = 5  # verify or break skipped every row: no verdict either way (pytest's "no tests ran")
BUG = 70  # anything else: a kvbench bug (EX_SOFTWARE)
INTERRUPTED = 130  # 128 + SIGINT
# The reader of stdout went away early (`kvbench ... | head -1`): 128 + SIGPIPE, what a shell reports for a program
# the signal stopped. The command ends quietly, with no verdict.
STDOUT_CLOSED = 141

VERBOSE = {"on": False}  # set by the root --verbose flag


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP while a command runs: handled like Ctrl-C (a bench keeps its rows, --json prints its error
    document, --junit-xml its error case), and the exit status is 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def line(self) -> str:
        """The line said for it (and written as a report's error)."""
        return "terminated" if self.signum == signal.SIGTERM else f"terminated ({self})"


@contextlib.contextmanager
def terminations_interrupt():
    """While a command runs, SIGTERM and SIGHUP raise Terminated (a real interrupt, even where it lands inside a
    plugin's code), where their handler is the default one: an ignored SIGHUP (nohup) stays ignored, and a
    program's own handler stays its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        note_signal()
        raise Terminated(signum)

    sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    old = {sig: signal.signal(sig, stop) for sig in sigs if signal.getsignal(sig) is signal.SIG_DFL}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def out_of_memory(e: BaseException) -> str | None:
    """One line for an allocation failure, CPU or GPU (errors.is_out_of_memory); None if `e` is something else."""
    if not is_out_of_memory(e):
        return None
    if is_out_of_host_memory(e):
        return "out of CPU memory (an allocation failed); lower --batch, the lengths or the model"
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return f"out of GPU memory: {first}; lower --batch, the lengths or the model"


def exit_code(e: BaseException) -> tuple[int, str | None]:
    """The exit status for an exception that ended a command, and its one line for stderr (None: say nothing)."""
    from kvbench import distributed

    if isinstance(e, distributed.RanksFailed):  # a launched run: the launcher's line and status
        return e.code, str(e)
    if isinstance(e, NotEnoughMemoryError):
        return OUT_OF_MEMORY, str(e)
    if distributed.peer_lost(e):  # another rank failed first (launched by kvbench, the launcher names it)
        return distributed.PEER_LOST, str(e) if isinstance(e, distributed.PeerLost) else distributed.lost_line()
    if isinstance(e, FailedThenStopped):
        return FAILED, str(e)
    if isinstance(e, KVBenchError):
        return BAD_INPUT, str(e)
    if isinstance(e, CheckRaised):
        return BUG, f"{e} (--verbose shows the traceback)"
    if isinstance(e, Terminated):
        return 128 + e.signum, e.line
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    if isinstance(e, BrokenPipeError):
        return STDOUT_CLOSED, None
    oom = out_of_memory(e)
    if oom:
        return OUT_OF_MEMORY, oom
    return BUG, f"unexpected {one_line(e)} (a kvbench bug: please report it; --verbose shows the traceback)"


def print_error_document(doc: dict) -> None:
    """The boundary's --json error document; a stdout that cannot take it (a full disk) loses it, and the error's
    line on stderr still says what ended the command."""
    with contextlib.suppress(KVBenchError):
        console.print_json(doc)


class KVBenchCommand(TyperCommand):
    """A command whose every exception becomes one line on stderr and its exit status (`exit_code`). Under --json
    (compare: --format json) stdout carries one JSON document on every exit: where the command ended without
    printing its own (refused, out of memory, interrupted), the boundary prints its error document,
    `error_document`."""

    error_doc: dict = {}  # the document's verdict keys for a refused run, e.g. {"passed": False}

    def invoke(self, ctx):
        from kvbench import distributed

        if distributed.status_dir() is not None:  # a rank kvbench launched: its launcher says the run's line
            return self._invoke_rank(ctx)
        printed, said = console.documents_printed(), len(console.errors_said())
        json_out = prints_json(ctx.params)
        try:
            check_environment()
            with watching_signals(), terminations_interrupt(), console.json_stdout(json_out):
                return super().invoke(ctx)
        except (typer.Exit, typer.Abort, click.exceptions.ClickException) as e:
            code = getattr(e, "exit_code", None)
            if json_out and code not in (None, 0) and console.documents_printed() == printed:
                # ended by the command itself without its document: its line was said
                lines = console.errors_said()[said:]
                said_last = lines[-1] if lines else f"stopped with exit status {code}"
                print_error_document(error_document(self.error_doc, said_last, code))
            raise
        except BaseException as e:
            if isinstance(e, SystemExit):
                raise
            code, message = exit_code(e)
            if code == BUG and VERBOSE["on"]:
                raise
            if code == STDOUT_CLOSED:
                console.stdout_closed()
            elif json_out and console.documents_printed() == printed:
                print_error_document(error_document(self.error_doc, message, code))
            if message is not None:
                console.error(message)
            raise typer.Exit(code) from None

    def _invoke_rank(self, ctx):
        """One rank of a run kvbench launched: the command runs as anywhere, but how it ended (its status, its
        line, whether rank 0 printed its document, where a signal found it) goes to the launcher
        (distributed.record_end), which says the run's one line and prints its error document; the rank itself
        says no error line. Rank 0 still prints its verdict (tables, the --json document, a failed bench's line)."""
        from kvbench import distributed

        distributed.stop_with_launcher()
        distributed.record_faults()
        printed = console.documents_printed()
        code, line, kind, where = 0, None, "done", None
        try:
            with watching_signals(), terminations_interrupt(), console.json_stdout(prints_json(ctx.params)):
                check_environment()
                return super().invoke(ctx)
        except (typer.Exit, typer.Abort, click.exceptions.ClickException) as e:
            code = getattr(e, "exit_code", None) or 0
            kind = "done" if code in (0, FAILED, NOTHING_CHECKED) else "error"
            raise
        except BaseException as e:
            if isinstance(e, SystemExit):
                raise
            code, line = exit_code(e)
            kind = "lost" if code == distributed.PEER_LOST else "error"
            if isinstance(e, KeyboardInterrupt):
                kind, where = "stopped", _where(e)
            if code == BUG and VERBOSE["on"]:
                raise
            if code == STDOUT_CLOSED:
                console.stdout_closed()
            raise typer.Exit(code) from None
        finally:
            distributed.record_end(code, line, kind, console.documents_printed() - printed, where)


_HANDLERS = {"stop", "_interrupted"}  # the signal handlers that raise an interrupt (here, thirdparty, bench)


def _where(e: BaseException) -> str | None:
    """Where an interrupt found the command: 'module line N, in function' of the innermost frame that is not the
    signal handler that raised it."""
    frames, tb = [], e.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_globals.get("__name__", "?"), tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    while frames and frames[-1][0].startswith("kvbench.") and frames[-1][2] in _HANDLERS:
        frames.pop()
    if not frames:
        return None
    module, line, function = frames[-1]
    return f"{module} line {line}, in {function}"


def error_document(verdict: dict, message: str | None, code: int) -> dict:
    """The --json document of a command that ended without its own: schema_version, the command's verdict keys
    (verify's `passed`, break's `all_detected`: false), the one line said on stderr and the exit status. Every
    schema (`kvbench schema KIND`) has this variant: a document with `error` has these keys only."""
    return {"schema_version": SCHEMA_VERSION, **verdict, "error": message, "exit_code": code}


def _asks_json(args: list[str]) -> bool:
    """A command line Click refused asks for a JSON document: --json, or --format json / -f json / --format=json
    (read from the words, since the refused line was never parsed)."""
    words = [str(a) for a in args]
    if "--" in words:
        words = words[: words.index("--")]
    pairs = zip(words, [*words[1:], ""], strict=True)
    return "--json" in words or any((a in ("--format", "-f") and b == "json") or a == "--format=json" for a, b in pairs)


def prints_json(params: dict) -> bool:
    """The command prints one JSON document: --json (compare: --format json)."""
    return bool(params.get("json_out")) or params.get("fmt") == "json"


class KVBenchGroup(TyperGroup):
    """Click's own usage errors (an unknown option, `--batch abc`) answered like every other error: one red line
    on stderr naming the problem, exit 2; never a usage panel or a traceback."""

    def main(  # type: ignore[override]  # the same call, typer's windows_expand_args passed on in **extra
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        was_devnull = console.stdout_is_devnull()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except BrokenPipeError:  # help or a usage error written to a pipe closed early
            console.stdout_closed()
            sys.exit(STDOUT_CLOSED)
        except OSError as e:  # help written to a stdout that takes no more (a full disk, /dev/full)
            console.error(str(console.stdout_lost(e, sys.stdout, "the help")))
            sys.exit(BAD_INPUT)
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
            code = BAD_INPUT if isinstance(e, click.exceptions.UsageError) else e.exit_code
            words = [str(a) for a in (sys.argv[1:] if args is None else args)]
            command = getattr(getattr(e, "ctx", None), "command", None)
            if not isinstance(command, KVBenchCommand):  # an error Click raised with no context: the command named
                command = self.commands.get(next((w for w in words if not w.startswith("-")), ""))
            if isinstance(command, KVBenchCommand) and _asks_json(words):
                print_error_document(error_document(command.error_doc, e.format_message() + where, code))
            console.error(e.format_message() + where)
            sys.exit(code)
        except (typer.Abort, getattr(click.exceptions, "Abort", typer.Abort)):  # where click has its own
            console.error("aborted")
            sys.exit(INTERRUPTED)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=KVBenchGroup,
    name="kvbench",
    help="Build, verify, break and measure the KV cache of LLM decoding on a from-scratch GPT-2.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# --- commands from settings dataclasses ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Given:
    """A settings class whose options reach the command as {field: value} for those given on the command line."""

    cls: type


def _parameters(source: type | Given) -> list[inspect.Parameter]:
    """The Typer parameters of a settings dataclass's option fields, in field order."""
    cls = source.cls if isinstance(source, Given) else source
    hints = typing.get_type_hints(cls)
    params = []
    for f in dataclasses.fields(cls):
        flag = flag_of(f)
        if flag is None:
            continue
        kind = flag.cli_type if flag.cli_type is not None else hints[f.name]
        if isinstance(source, Given):
            kind, default = kind | None, None
        elif f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        info = (
            typer.Argument(help=flag.help, show_default=default is not None)
            if flag.argument
            else typer.Option(*flag.decls, help=flag.help, rich_help_panel=flag.panel)
        )
        params.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, info])
        )
    return params


def _build(source: type | Given, values: dict[str, Any]) -> Any:
    """The settings object (or, for Given, the dict of given options) from the parsed command line."""
    cls = source.cls if isinstance(source, Given) else source
    mine = {f.name: values[f.name] for f in dataclasses.fields(cls) if flag_of(f) is not None}
    if isinstance(source, Given):
        return {k: v for k, v in mine.items() if v is not None}
    return cls(**mine)


def command(*sources: type | Given, name: str | None = None, error_doc: dict | None = None):
    """Register the decorated function as a command taking one argument per source: its options are the option
    fields of the sources, declared once there. `error_doc`: the verdict keys of the --json document printed when
    the command is refused (the boundary adds schema_version, error and exit_code)."""

    def register(fn):
        params = [p for s in sources for p in _parameters(s)]
        names = [p.name for p in params]
        assert len(names) == len(set(names)), f"{fn.__name__}: an option declared twice in {names}"
        # positional arguments first, in declaration order, as Click lists them
        params.sort(key=lambda p: not isinstance(typing.get_args(p.annotation)[1], typer.models.ArgumentInfo))

        @functools.wraps(fn)
        def run(**values):
            return fn(*(_build(s, values) for s in sources))

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        del run.__wrapped__  # Typer reads the signature above, not the function's own
        cls = type(f"{fn.__name__}Command", (KVBenchCommand,), {"error_doc": error_doc or {}})
        app.command(name=name, cls=cls, help=_flowing(fn.__doc__ or ""))(run)
        return fn

    return register


def _flowing(doc: str) -> str:
    """A docstring as help: each paragraph one line, for Rich to wrap at the terminal's width (Typer keeps the
    source's line breaks after the first paragraph, which left fragments on lines of their own)."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


# --- the root: --version, --verbose, the environment --------------------------------------------------------------
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
    if not verbose:
        quiet_libraries()


def check_environment() -> None:
    """The environment variables kvbench reads, checked before a command starts, so a typo stops the run before
    any work (each is read again where it is used)."""
    from kvbench.bench import hugepages
    from kvbench.validate import PROBE_ENV, probe_bytes_setting

    probe_bytes_setting(os.environ.get(PROBE_ENV, ""))
    hugepages.check()


def quiet_libraries() -> None:
    """Keep transformers' and huggingface_hub's loading bars, advisories and warnings off the terminal: kvbench
    reports what matters itself. Environment variables the user set win."""
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


# --- loading our GPT-2 for a command -------------------------------------------------------------------------------
def load_for_cli(
    model: str | None, weights: str, device: str, dtype: str, seed: int, init_std: float = 0.02
) -> tuple[LoadedModel, torch.device, torch.dtype]:
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
    from kvbench.model.weights import checkpoint_dir

    loaded, dev, dt = load_for_cli(model, weights, device, dtype, seed, init_std=CHECK_INIT_STD)
    found = None if loaded.random else checkpoint_dir(model, weights)
    return loaded, dev, dt, str(found) if found else None
