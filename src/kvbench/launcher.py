"""kvbench's own launcher for `--tp N`: the command's ranks started with torch's elastic launcher (standalone, a
c10d rendezvous on localhost at a free port), waited for, and how the run ended said in one line.

Each rank writes how it ended to a folder of the launcher's (kvbench.distributed.record_end); the launcher says the
run's one line: rank 0's verdict when it gave one, otherwise the rank that failed first and how (its own error, a
signal that killed it, an exit without a word, or a hang past --tp-timeout), as `RanksFailed` with the run's exit
status. A rank that crashed in native code is placed at its Python frame, and its stacks and last output are kept in
a file the line names (`crash_report`). Ctrl-C, SIGTERM and SIGHUP reach every rank; the launcher stops them all before it returns.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvbench.distributed import LAUNCHER_ENV, PEER_LOST, RanksFailed


def launch(world: int, argv: list[str]) -> int:
    """Run `python -m kvbench *argv` as `world` ranks on this machine and wait for them. Returns rank 0's verdict
    (its exit status: 0, 1 or 5) when it gave one, whatever happened to the ranks after it; otherwise raises
    RanksFailed with the run's one line and exit status (`_outcome`). Each rank writes how it ended to a folder of
    the launcher's (`record_end`); a rank's own line is never printed by the rank, only named here."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # its own progress lines: one line of ours instead
    signalled = _Signalled()  # which ranks the launcher itself stopped, and with what
    api_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    api_log.addHandler(signalled)
    # one intra-op thread share per rank unless the user chose (ranks would otherwise oversubscribe the cores)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    logs = Path(tempfile.mkdtemp(prefix="kvbench-ranks-"))
    ends = logs / "ends"
    ends.mkdir()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=f"kvbench-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port: parallel runs never collide
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects={r: Std.ALL for r in range(1, world)}),
    )
    # the launcher installs handlers for these (to stop every rank) and leaves them: a library caller's stay its own
    handled = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]
    before = (
        {sig: signal.getsignal(sig) for sig in handled} if threading.current_thread() is threading.main_thread() else {}
    )
    marker = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = f"{os.getpid()}:{ends}"
    codes, order, stopped_by = dict.fromkeys(range(world), 0), list(range(world)), None
    try:
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "kvbench", *argv)
        except ChildFailedError as e:
            codes |= {r: f.exitcode for r, f in e.failures.items()}
            order = [*e.failures, *(r for r in range(world) if r not in e.failures)]  # as the launcher saw them
            pids = {r: f.pid for r, f in e.failures.items()}
            signalled.ranks = {r for r, pid in pids.items() if pid in signalled.pids}
        except SignalException as e:
            stopped_by = signal.Signals(e.sigval)
        return _outcome(Ended(codes, _read_ends(ends), order, signalled, stopped_by, logs), argv)
    finally:
        if marker is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = marker
        api_log.removeHandler(signalled)
        shutil.rmtree(logs, ignore_errors=True)
        for sig, handler in before.items():
            if handler is not None:  # None: a handler not installed from Python, left as the launcher put it
                signal.signal(sig, handler)


class _Signalled(logging.Handler):
    """The pids torch's launcher signalled to stop them (its log records "Sending process PID closing signal SIG",
    and "Unable to shutdown process PID ..." before it sends SIGKILL): a rank it stopped is not a rank that failed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.pids: set[int] = set()
        self.ranks: set[int] | None = None  # by rank, once the failures are known; None: no failure was reported
        self.seen = False  # any record at all (torch still words its records this way)

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if msg.startswith(("Sending process", "Unable to shutdown process")) and record.args:
            self.seen = True
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            if isinstance(args[0], int):
                self.pids.add(args[0])


@dataclass
class Ended:
    """What the launcher knows when its ranks are gone: each rank's exit status (negative: the signal that ended it),
    the order the launcher saw the failures in, what each rank recorded (record_end; none for a rank that was killed
    or left by os._exit), the ranks the launcher itself signalled, and the signal that stopped the launcher."""

    codes: dict[int, int]
    ends: dict[int, dict]
    order: list[int]
    signalled: _Signalled
    stopped_by: signal.Signals | None = None
    logs: Path | None = None  # the launcher's folder: the ranks' output (ranks 1..N-1) and fault stacks (ends/)

    def stopped_by_launcher(self, r: int) -> bool:
        """Did the launcher stop rank `r` (after another rank ended, or on the launcher's own signal)?"""
        end = self.ends.get(r)
        if end is not None:
            return end["kind"] == "stopped"
        if self.signalled.ranks is not None and self.signalled.seen:
            return r in self.signalled.ranks
        return self.codes[r] == -signal.SIGTERM  # torch's launcher stops its ranks with SIGTERM


def _read_ends(folder: Path) -> dict[int, dict]:
    ends = {}
    for path in folder.glob("rank-*.json"):
        try:
            doc = json.loads(path.read_text())
            ends[int(doc["rank"])] = doc
        except (OSError, ValueError, KeyError, TypeError):  # a rank killed while writing: as if it wrote nothing
            continue
    return ends


def _outcome(run: Ended, argv: list[str]) -> int:
    """Rank 0's verdict when it gave one (the ranks stopped after it had every rank's rows, so it stands); else
    RanksFailed naming the rank that ended the run first and how, with the run's exit status:

    - a rank's own error (a refusal, out of memory, a plugin that raised): that rank's line and exit status;
    - a rank killed by a signal not the launcher's own (SIGKILL, SIGSEGV, SIGABRT): PEER_LOST, naming the signal;
    - a rank that left without a word (os._exit, a crash in native code), whatever its status: PEER_LOST;
    - the launcher stopped by a signal (Ctrl-C, SIGTERM, SIGHUP): 128 + the signal;
    - a rank that hung: another lost it in a collective past --tp-timeout, and the launcher stopped it: PEER_LOST.
    """
    from kvbench import console

    first = run.ends.get(0)
    console.count_documents(first["documents"] if first is not None else 0)  # rank 0's document, when it printed one
    if first is not None and first["kind"] == "done":
        return int(first["code"])
    plugins = _plugins(argv)
    own = sorted((e["time"], r) for r, e in run.ends.items() if e["kind"] == "error")
    if own:
        r = own[0][1]
        line = run.ends[r]["line"] or f"exited with status {run.ends[r]['code']}"
        if 0 in run.ends and run.ends[0]["kind"] == "error" and run.ends[0]["line"] == line:
            r = 0  # the same refusal on every rank: said once, as rank 0's
        code = int(run.ends[r]["code"])
        raise RanksFailed(line if r == 0 else f"rank {r}: {line}", PEER_LOST if code == PEER_LOST else code)
    silent = [r for r in run.order if r not in run.ends and not run.stopped_by_launcher(r)]
    killed = [r for r in silent if run.codes[r] < 0]
    if killed:
        r = killed[0]
        sig = _signal_name(-run.codes[r])
        why = " (as the kernel's out-of-memory killer does)" if sig == "SIGKILL" else ""
        at, kept = crash_report(run.logs, r)
        raise RanksFailed(f"rank {r} was killed by {sig}{at}{why}, so the run lost it{kept}{plugins}", PEER_LOST)
    if silent and run.stopped_by is None:
        r = silent[0]
        at, kept = crash_report(run.logs, r)
        raise RanksFailed(
            f"rank {r} left the run early{at}: it exited with status {run.codes[r]} without a word (os._exit() or a "
            f"crash in native code){kept}{plugins}",
            PEER_LOST,
        )
    if run.stopped_by is not None:
        name = run.stopped_by.name
        line = "interrupted" if run.stopped_by == signal.SIGINT else f"terminated ({name})"
        raise RanksFailed(f"{line}: every rank stopped", 128 + int(run.stopped_by))
    lost = [r for r, e in sorted(run.ends.items()) if e["kind"] == "lost"]
    hung = [r for r in run.order if r not in lost and run.stopped_by_launcher(r)]
    if lost and hung:
        r = hung[0]
        where = (run.ends.get(r) or {}).get("where")
        at = f"; it was at {where} when stopped" if where else ""
        raise RanksFailed(
            f"rank {r} hung: it did not reach a collective that rank {lost[0]} waited in for --tp-timeout"
            f"{_timeout(argv)}, and was stopped{at}{plugins}",
            PEER_LOST,
        )
    said = ", ".join(f"rank {r} {_how(run, r)}" for r in range(len(run.codes)))
    raise RanksFailed(f"the ranks ended without a verdict and without an error of their own ({said})", PEER_LOST)


FAULT_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)')
TAIL_LINES = 200  # of a lost rank's own output, kept beside its stacks


def crash_report(logs: Path | None, r: int) -> tuple[str, str]:
    """Where a lost rank was, for its line (" in FILE line N, in FUNC": the innermost Python frame of the thread that
    crashed, from its faulthandler file; "" when it left none, as after SIGKILL or os._exit), and a file kept after
    the launcher's folder is removed, with the rank's Python stacks and the end of its output (ranks 1..N-1; rank 0's
    went to the terminal): "(its stacks and last output: PATH)", or "" when there is nothing to keep."""
    if logs is None:
        return "", ""
    from kvbench.distributed import fault_file

    stacks = _read(fault_file(logs / "ends", r))
    output = [f"--- {p.name} ---\n" + "".join(_read(p).splitlines(True)[-TAIL_LINES:]) for p in _rank_logs(logs, r)]
    output = [o for o in output if not o.endswith("---\n")]  # the empty ones
    if not stacks.strip() and not output:
        return "", ""
    at = _crashed_at(stacks)
    fd, name = tempfile.mkstemp(prefix=f"kvbench-rank{r}-lost-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join([stacks.rstrip("\n"), *output]) + "\n")
    what = "stacks and last output" if stacks.strip() and output else "stacks" if stacks.strip() else "last output"
    return at, f" (its {what}: {name})"


LIBRARY = re.compile(r"(?:.*/site-packages/|.*/lib/python3\.\d+/)(.+)")


def _crashed_at(stacks: str) -> str:
    """' in FILE line N, in FUNC' for the innermost frame of the thread that crashed (faulthandler's "Current
    thread", listed among the others), and ' (called from ...)' for the innermost frame outside the standard library
    and installed packages where that frame is not one: the caller's own code, a plugin or kvbench."""
    lines = stacks.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    frames = []
    for line in lines[start:] if start is not None else []:
        m = FAULT_FRAME.match(line)
        if m is None:
            break
        frames.append((m.group(1), m.group(2), m.group(3)))
    if not frames:
        return ""

    def where(f: tuple[str, str, str]) -> str:
        lib = LIBRARY.match(f[0])
        return f"{lib.group(1) if lib else Path(f[0]).name} line {f[1]}, in {f[2]}"

    own = next((f for f in frames if not LIBRARY.match(f[0]) and not f[0].startswith("<")), None)
    caller = f" (called from {where(own)})" if own is not None and own != frames[0] else ""
    return f" in {where(frames[0])}{caller}"


def _rank_logs(logs: Path, r: int) -> list[Path]:
    return sorted(logs.glob(f"*/attempt_*/{r}/std*.log"))


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _how(run: Ended, r: int) -> str:
    end = run.ends.get(r)
    if end is not None:
        return f"{end['kind']} (exit {end['code']})"
    return f"killed by {_signal_name(-run.codes[r])}" if run.codes[r] < 0 else f"exit {run.codes[r]}"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _option_values(argv: list[str], names: tuple[str, ...]) -> list[str]:
    values = []
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a in names and i + 1 < len(argv):
            values.append(argv[i + 1])
        values += [a.split("=", 1)[1] for n in names if a.startswith(f"{n}=")]
    return values


def _plugins(argv: list[str]) -> str:
    """The cache plugins the command line loads (`pkg.module:Class`), as the end of a line; empty when none."""
    names = [n.strip() for v in _option_values(argv, ("--caches", "--cache", "-c")) for n in v.split(",")]
    plugins = sorted({n for n in names if ":" in n})
    if not plugins:
        return ""
    return f"; cache plugin{'s' if len(plugins) > 1 else ''} loaded: {', '.join(plugins)}"


def _timeout(argv: list[str]) -> str:
    given = _option_values(argv, ("--tp-timeout",))
    return f" ({given[-1]} s)" if given else ""
