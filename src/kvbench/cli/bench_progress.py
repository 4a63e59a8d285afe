"""bench's sweep under a progress bar (stderr, interactive only), with SIGTERM and SIGHUP handled as Ctrl-C: an
interrupted sweep keeps every completed row, writes its plots and marks meta.json `interrupted`."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

from kvbench import console
from kvbench.cli.app import Terminated
from kvbench.console import err


def run_recorded(recorder, sweep, engines: dict | None = None) -> list[Path]:
    """Run `sweep(on_progress)` under a progress bar, with SIGTERM and SIGHUP handled as Ctrl-C: an interruption
    keeps every completed row, writes the plots and marks meta.json `interrupted`. Returns the files written."""
    try:
        with _signals_interrupt(), bench_progress() as progress:
            sweep(progress.update)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP (Terminated): the CLI says the line and the status
        with _signals_ignored():  # a second Ctrl-C or a SIGTERM now would lose the rows' plots and meta.json
            recorder.finish("interrupted", engines)
        for text in recorder.plot_notes:
            console.note(text)
        console.note(f"interrupted: {len(recorder.summary)} completed configuration(s) kept in {recorder.run_dir}")
        raise
    except Exception:  # the run ended by an error (under --tp, a rank that failed): its rows kept, its end recorded
        with _signals_ignored():
            recorder.finish("failed", engines)
        raise
    with _signals_ignored():
        files = recorder.finish("complete", engines)
    for text in recorder.plot_notes:
        console.note(text)
    return files


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _signals_interrupt():
    """While the sweep runs, SIGTERM and SIGHUP stop it the way Ctrl-C does."""
    if not _in_main_thread():  # signal handlers can only be set from the main thread
        yield
        return

    def stop(signum, frame):
        from kvbench.thirdparty import note_signal

        note_signal()  # a real interrupt, even where it lands inside a plugin's code
        raise Terminated(signum)

    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    old = {sig: signal.signal(sig, stop) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_ignored():
    """While the rows are written out: Ctrl-C, SIGTERM and SIGHUP wait (ignored) until the files are complete."""
    if not _in_main_thread():
        yield
        return
    sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# --- rendering ---
class _BenchProgress:
    """A Rich progress bar over the sweep's runs (warm-ups included), on stderr so --json stdout stays clean."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]bench[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=err,
            transient=True,
        )
        self._task: TaskID | None = None

    def __enter__(self) -> _BenchProgress:
        if self._shown():
            self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._shown():
            self._progress.__exit__(*exc)

    def _shown(self) -> bool:
        """Drawn only on an interactive stderr: the bar is transient, and elsewhere (a file, a pipe, CI's log) all
        Rich would leave of it is an empty line."""
        return err.is_interactive

    def update(self, done: int, total: int, label: str) -> None:
        if not self._shown():
            return
        if self._task is None:
            self._task = self._progress.add_task(label, total=total)
        self._progress.update(self._task, completed=done, total=total, description=label)


def bench_progress() -> _BenchProgress:
    return _BenchProgress()
