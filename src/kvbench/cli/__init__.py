"""The `kvbench` command line: the app and its error boundary (app.py), one module per command.

A command's options are the fields of its settings dataclass (declared with kvbench.options.option); the command
receives that object, calls a library function that returns dataclasses, and renders them. Heavy imports (torch,
transformers, matplotlib) happen inside the commands, so `kvbench --help` is instant and `main` can still ask for
huge pages before torch loads.
"""

from kvbench.bench import hugepages
from kvbench.cli import bench, break_, compare, generate, memory, schema, serve, verify  # noqa: F401  (each registers its command)
from kvbench.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    hugepages.request()  # before torch loads: its CPU allocator reads THP_MEM_ALLOC_ENABLE once (bench/hugepages.py)
    _piped_help_width()
    app()


def _piped_help_width() -> None:
    """--help piped (`kvbench bench --help | less`) is laid out as wide as kvbench's other piped output: at Rich's
    default of 80 columns Typer cut option names and defaults short with an ellipsis. TERMINAL_WIDTH, Typer's own
    setting, still wins."""
    import os
    import sys

    import typer.rich_utils

    from kvbench.console import PIPE_WIDTH

    if not sys.stdout.isatty() and not os.environ.get("TERMINAL_WIDTH"):
        typer.rich_utils.MAX_WIDTH = PIPE_WIDTH
