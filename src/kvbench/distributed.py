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
process that launched it is gone (`stop_with_launcher`). Rank 0 reports; the others print nothing. Launched by kvbench
(kvbench.launcher), every rank writes how it ended to a file the launcher reads (`record_end`), and the launcher says
the run's one line (`RanksFailed` with the run's exit status). A command becomes ranks through kvbench.tp_command.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import os
import signal
import sys
import threading
import time
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
    # the group is torn down before the interpreter is: a rank that exits with gloo's threads still running can
    # abort in native code ("terminate called without an active exception") after its work is done
    atexit.register(finish)
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


_FAULTS: dict = {}  # "file": where this rank's Python stacks go if it crashes (record_faults)


def fault_file(folder: Path, rank: int) -> Path:
    return folder / f"fault-{rank}.txt"


def record_faults() -> None:
    """Under kvbench's launcher: a crash in native code (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) writes every
    thread's Python stack to a file of the launcher's folder (faulthandler), which the launcher's line points at;
    never to the terminal."""
    folder = status_dir()
    if folder is None or _FAULTS:
        return
    try:
        _FAULTS["file"] = fault_file(folder, int(os.environ.get("RANK", "0"))).open("w")
    except OSError:  # the launcher's folder is gone: nobody would read it
        return
    faulthandler.enable(_FAULTS["file"], all_threads=True)


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


# --- what the machine holds ----------------------------------------------------------------------------------------
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
    from kvbench.host import cores as usable_cores

    cores = usable_cores()
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
