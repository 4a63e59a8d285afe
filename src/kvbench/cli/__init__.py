"""The `kvbench` command line: the app (app.py), the options (options.py), one module per command.

Commands gather their options into one settings object, call a library function that returns dataclasses, and
render them; heavy imports (torch, transformers, matplotlib) happen inside the commands, so `kvbench --help` is
instant and `main` can still ask for huge pages before torch loads.
"""

from kvbench.bench import hugepages
from kvbench.cli import bench, break_, compare, generate, memory, schema, verify  # noqa: F401  (each registers its command)
from kvbench.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    hugepages.request()  # before torch loads: its CPU allocator reads THP_MEM_ALLOC_ENABLE once (bench/hugepages.py)
    app()
