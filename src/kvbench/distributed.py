"""Running a command as N tensor-parallel ranks on torch.distributed: started by its own launcher or by torchrun.

    kvbench verify --tp 2 ...        the command launches its ranks itself: torch's elastic launcher, standalone
                                     (a c10d rendezvous on localhost at a free port, so parallel jobs never collide),
                                     each rank `python -m kvbench <the same command line>`
    torchrun --nproc-per-node 2 -m kvbench verify --tp 2 ...
                                     each process is one rank already (how clusters run it; multi-node rendezvous
                                     flags are torchrun's own)

Which of these a process is (`role`) is read from its environment, never guessed: a rank of kvbench's launcher
carries the launcher's own marker, a torchrun rank torchrun's full set of variables (checked, a bad one refused
naming it), and a kvbench started by a rank as a tool of its own (the rank is its parent) is a plain process.
--tp must equal the number of ranks launched, 1 included.

A rank joins the process group with gloo on the CPU and NCCL on CUDA (one GPU per rank: cuda:LOCAL_RANK), with a
collective timeout, so a rank that fails, exits or hangs ends every rank within that time. Each rank stops when the
process that launched it is gone (`stop_with_launcher`). Rank 0 reports; the others print nothing. Launched here,
every rank writes how it ended to a file the launcher reads (`record_end`), and the launcher says the run's one line:
rank 0's verdict when it gave one, otherwise the rank that failed first and how (its own error, a signal that killed
it, an exit without a word, or a hang past --tp-timeout), as `RanksFailed` with the run's exit status. Ctrl-C, SIGTERM
and SIGHUP reach every rank; the launcher stops them all before it returns.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import KVBenchError

# A rank that lost a peer (another rank failed, was killed, exited or hung past --tp-timeout), and the run that lost
# a rank: the exit status (EX_TEMPFAIL). Launched by kvbench, the launcher's one line names the rank and how.
PEER_LOST = 75
DEFAULT_TIMEOUT_S = 300  # a collective that waits longer means a rank is lost (loading gpt2-xl on one core: ~60 s)
# How long a rank whose step raised waits for the others to say they raised in it too (raised_together).
TOGETHER_TIMEOUT_S = 60
_TOGETHER: dict = {}  # "group": the process group raised_together asks on, made by start()
_JOINED: dict = {}  # "rank": this process's rank once it joined a process group (start)
# Set by kvbench's launcher for the ranks it starts: "<the launcher's pid>:<the folder each rank's end is written to>"
# (no KVBENCH_ prefix: those are the user's settings, recorded in a run's meta.json).
LAUNCHER_ENV = "_KVBENCH_TP_LAUNCHER"
# What torchrun (torch's elastic agent) sets for each rank it starts; a process with TORCHELASTIC_RUN_ID must have all.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# On the CPU, what one rank costs besides the model's weights (measured: about 400 MiB of RSS per rank of a 1-layer
# model, torch and the process group), for refusing a --tp the machine cannot hold.
RANK_OVERHEAD_BYTES = 400 * 2**20


class PeerLost(KVBenchError):
    """A collective failed because another rank failed, exited or hung past --tp-timeout (not this rank's error)."""


class RanksFailed(KVBenchError):
    """A launched run that ended without rank 0's verdict: the one line naming the rank and how it ended, and the
    run's exit status (`code`)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# --- where this process stands -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Role:
    """This process in a --tp run: it launches the ranks, is one of them, or runs alone (--tp 1)."""

    launches: bool  # kvbench launches the ranks from this process
    rank: int | None  # this process's rank (None: not a rank)
    world: int
    launcher: str | None  # "kvbench" or "torchrun" for a rank

    @property
    def reports(self) -> bool:
        """This process writes the verdict: alone, the launcher, or rank 0."""
        return self.rank in (None, 0)

    @property
    def writes_errors(self) -> bool:
        """This process writes a run's error reports (JSON, JUnit): under kvbench's launcher the launcher does."""
        return self.reports and self.launcher != "kvbench"


def role(tp: int) -> Role:
    """Where this process stands for a command run with --tp `tp`. A rank's launcher must have launched --tp ranks
    (torchrun --nproc-per-node 2 with --tp 1 is refused, naming both)."""
    launcher, rank, world = _launched()
    if launcher is None:
        return Role(tp > 1, None, 1, None)
    if tp != world:
        by = "kvbench" if launcher == "kvbench" else "torchrun"
        raise KVBenchError(
            f"--tp {tp}, but {by} launched {world} ranks (WORLD_SIZE={world}): give --tp {world}, or launch {tp} "
            f"rank{'s' if tp != 1 else ''}"
        )
    if world == 1:
        return Role(False, None, 1, None)  # a world of one rank is the whole model: no process group
    return Role(False, rank, world, launcher)


def _launched() -> tuple[str | None, int, int]:
    """(launcher, rank, world): ("kvbench" | "torchrun", RANK, WORLD_SIZE) for a rank, (None, 0, 1) otherwise."""
    env = os.environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is None or _parent_is_rank(run_id):
        return None, 0, 1  # no launcher's rank; or a kvbench that a rank started as a tool: a plain process
    world = _number("WORLD_SIZE", 1)
    rank = _number("RANK", 0, world - 1)
    _number("LOCAL_RANK", 0)
    if not env.get("MASTER_ADDR", "").strip():
        raise _bad_env("MASTER_ADDR", "is not set" if "MASTER_ADDR" not in env else "is empty")
    _number("MASTER_PORT", 1, 65535)
    return ("kvbench" if status_dir() is not None else "torchrun"), rank, world


def _number(name: str, low: int, high: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        raise _bad_env(name, "is not set")
    try:
        n = int(value.strip())
    except ValueError:
        raise _bad_env(name, f"is {value!r}, not a whole number") from None
    if n < low or (high is not None and n > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise _bad_env(name, f"is {n}, not {bound}")
    return n


def _bad_env(name: str, what: str) -> KVBenchError:
    return KVBenchError(
        f"{name} {what}, and TORCHELASTIC_RUN_ID says this process is a torchrun rank (torchrun sets "
        f"{', '.join(TORCHRUN_VARS)}): start kvbench under torchrun, or unset TORCHELASTIC_RUN_ID"
    )


def _parent_is_rank(run_id: str) -> bool:
    """Is the parent process a rank of the same run (kvbench started by it as a tool, inheriting its variables)?
    A rank's parent is its launcher, which is not one. Read from /proc; where that cannot be read, no."""
    try:
        environ = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"TORCHELASTIC_RUN_ID={run_id}".encode() in environ


def status_dir() -> Path | None:
    """The folder kvbench's launcher reads this rank's end from, when kvbench launched this process (its marker
    names this process's parent); None otherwise."""
    mark = os.environ.get(LAUNCHER_ENV, "")
    pid, _, folder = mark.partition(":")
    if not (pid.isdigit() and folder and "TORCHELASTIC_RUN_ID" in os.environ):
        return None
    if int(pid) != os.getppid() or _parent_is_rank(os.environ["TORCHELASTIC_RUN_ID"]):
        return None  # inherited: a process a rank started
    return Path(folder)


def in_rank() -> bool:
    """Is this process one rank of a launched group (kvbench's launcher or torchrun)? A refusal for a torchrun
    environment that is incomplete or wrong."""
    return _launched()[0] is not None


def global_rank() -> int:
    """This process's rank in the launched group (0 outside one)."""
    return _launched()[1]


# --- a rank ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    device: object  # torch.device: cuda:LOCAL_RANK on CUDA, else the CPU
    backend: str  # gloo | nccl


def start(world: int, device, timeout_s: float) -> Rank:
    """Join the process group as one of `world` ranks on `device` (a resolved torch.device's type decides the
    backend). `role` has checked the launch: --tp is the launched world size."""
    import torch
    import torch.distributed as dist

    launched = int(os.environ["WORLD_SIZE"])
    assert launched == world, f"role() refuses --tp {world} in a world of {launched}"
    stop_with_launcher()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise KVBenchError(
                f"rank {local} needs cuda:{local}, but {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # no peer answered the rendezvous: not a lost peer, a launch that never happened
            raise KVBenchError(
                f"rank {os.environ['RANK']} of {world} could not join the process group at "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} ({_first_line(e)}): start the ranks with "
                "torchrun, or without torchrun's variables let kvbench launch them"
            ) from None
    wait = datetime.timedelta(seconds=min(timeout_s, TOGETHER_TIMEOUT_S))
    _TOGETHER["group"] = dist.new_group(backend="gloo", timeout=wait)  # every rank makes it, in the same order
    _JOINED["rank"] = dist.get_rank()
    return Rank(dist.get_rank(), dist.get_world_size(), device, backend)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


_WATCHED: dict = {}  # "parent": the launcher's pid this rank watches (stop_with_launcher)


def stop_with_launcher() -> None:
    """End this rank when the process that launched it is gone (killed with SIGKILL, it cannot stop its ranks):
    Linux sends SIGTERM at once (prctl PR_SET_PDEATHSIG); elsewhere, and as a backstop, a thread watching the parent
    sends SIGTERM within a second, and SIGKILL 15 s later if the rank has not ended (stuck in native code)."""
    if _WATCHED or threading.current_thread() is not threading.main_thread():
        return
    parent = os.getppid()
    _WATCHED["parent"] = parent
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(15.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="kvbench-launcher-watch", daemon=True).start()
    if os.getppid() != parent:  # gone before the watch began
        os.kill(os.getpid(), signal.SIGTERM)


def barrier() -> None:
    """Every rank waits here for the others (the collective timeout applies): called before the checks start, so a
    rank that loaded its models minutes later than another under load does not make a step that raises on every
    rank look, to raised_together's shorter wait, like one that raised on one rank only."""
    import torch.distributed as dist

    dist.barrier()


def raised_together(step: str) -> bool:
    """Asked by a rank whose `step` (a check on a cache) raised: did every rank raise in that same step? Then every
    rank stopped between the same two collectives and the run can go on, the step a failed row on each. It is asked
    on a process group of its own, so it never pairs with a collective a rank that did not raise waits in: that
    rank never asks, and this one gets False within TOGETHER_TIMEOUT_S (or the collective timeout, if shorter)."""
    import torch.distributed as dist

    group = _TOGETHER.get("group")
    if group is None or not dist.is_initialized():
        return False
    steps: list[object] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(steps, step, group=group)
    except Exception:  # a rank that did not raise here: it never asked
        return False
    return all(s == step for s in steps)


def peer_lost(e: BaseException) -> bool:
    """Did a collective fail because another rank failed, exited or timed out? Only in a process that joined a group
    (this rank's own error is not; a process that never joined lost no peer)."""
    if isinstance(e, PeerLost):
        return True
    if "rank" not in _JOINED:
        return False
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and any(s in text for s in ("/gloo/", "Connection closed by peer", "NCCL"))
    )


def lost_line() -> str:
    """What a rank that lost a peer says (under torchrun; launched by kvbench it says nothing, the launcher names
    the rank that was lost)."""
    return (
        f"rank {_JOINED.get('rank', global_rank())} lost a peer: a collective failed because another rank failed, "
        "exited or hung past --tp-timeout (that rank's own output says why)"
    )


def record_end(code: int, line: str | None, kind: str, documents: int, where: str | None = None) -> None:
    """Under kvbench's launcher: write how this rank's command ended, for the launcher's one line. `kind`: done (it
    finished: rank 0's verdict), error (its own error: `line`), lost (a peer was lost), stopped (a signal: `where`
    it was when it came). Written atomically; nothing is written outside kvbench's launcher."""
    folder = status_dir()
    if folder is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    doc: dict[str, object] = {
        "rank": rank,
        "code": code,
        "line": line,
        "kind": kind,
        "documents": documents,
        "where": where,
    }
    doc |= {"time": time.time()}
    tmp = folder / f".rank-{rank}.json.tmp"
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, folder / f"rank-{rank}.json")
    except OSError:  # the launcher's folder is gone (the launcher is): nobody reads it
        pass


def gather(obj: object) -> list | None:
    """Every rank's `obj` on rank 0 (in rank order); None on the other ranks."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# --- the launcher --------------------------------------------------------------------------------------------------
def check_ranks_fit(world: int, device: str, weights_bytes: int) -> None:
    """On the CPU, a --tp the machine cannot hold is refused before any rank starts: more ranks than the cores this
    process may run on (each rank is a process of its own, busy in every collective), or more memory than is
    available (RANK_OVERHEAD_BYTES per rank, plus the weights each rank loads whole before taking its share)."""
    from kvbench.errors import NotEnoughMemoryError

    if world <= 1 or not device.startswith(("cpu", "auto")):
        return
    import torch

    if device == "auto" and torch.cuda.is_available():
        return
    from kvbench.devices import available_memory_bytes

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if world > cores:
        raise KVBenchError(
            f"--tp {world} on the CPU runs {world} rank processes, and this machine gives kvbench {cores} core"
            f"{'s' if cores != 1 else ''}: use --tp {cores} or less (on CUDA, one GPU per rank)"
        )
    need = world * (RANK_OVERHEAD_BYTES + max(0, weights_bytes))
    free = available_memory_bytes(torch.device("cpu"))
    if free is not None and need > free:
        gib = 2**30
        raise NotEnoughMemoryError(
            f"--tp {world} on the CPU needs about {need / gib:.1f} GiB ({world} ranks x (~0.4 GiB each + "
            f"{weights_bytes / gib:.2f} GiB of weights, loaded whole by every rank)), more than the "
            f"{free / gib:.1f} GiB available: lower --tp"
        )


def weights_bytes(model) -> int:
    """The bytes of the weights every rank loads, for check_ranks_fit: our GPT-2's parameters in fp32 from its
    config, or a Hugging Face directory's weight files as stored (0 for a hub id: not known before loading)."""
    if isinstance(model, str):
        folder = Path(model).expanduser()
        if not folder.is_dir():
            return 0
        return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    c, v = model.n_embd, model.vocab_size
    return 4 * ((v + model.block_size) * c + model.n_layer * 12 * c * c)


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
        return _outcome(Ended(codes, _read_ends(ends), order, signalled, stopped_by), argv)
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
        raise RanksFailed(f"rank {r} was killed by {sig}{why}, so the run lost it{plugins}", PEER_LOST)
    if silent and run.stopped_by is None:
        r = silent[0]
        raise RanksFailed(
            f"rank {r} left the run early: it exited with status {run.codes[r]} without a word (os._exit() or a "
            f"crash in native code){plugins}",
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
