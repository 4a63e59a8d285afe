"""Running a command as N tensor-parallel ranks on torch.distributed: started by its own launcher or by torchrun.

    kvbench verify --tp 2 ...        the command launches its ranks itself: torch's elastic launcher, standalone
                                     (a c10d rendezvous on localhost at a free port, so parallel jobs never collide),
                                     each rank `python -m kvbench <the same command line>`
    torchrun --nproc-per-node 2 -m kvbench verify --tp 2 ...
                                     each process is one rank already (how clusters run it; multi-node rendezvous
                                     flags are torchrun's own)

A rank joins the process group with gloo on the CPU and NCCL on CUDA (one GPU per rank: cuda:LOCAL_RANK), with a
collective timeout, so a rank that fails, exits or hangs ends every rank within that time. Rank 0 reports; the others
print nothing. Launched here, ranks other than 0 write to log files, and when the run fails the launcher prints one
line naming the rank that failed first and its own error line (a rank that only lost its peer says nothing). Ctrl-C
reaches every rank; the launcher stops them all before it returns.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import KVBenchError

# A rank whose collective failed because another rank failed, exited or hung first: it exits with this status and
# says nothing, so the run's one line names the rank that caused it (EX_TEMPFAIL).
PEER_LOST = 75
DEFAULT_TIMEOUT_S = 300  # a collective that waits longer means a rank is lost (loading gpt2-xl on one core: ~60 s)
# How long a rank whose step raised waits for the others to say they raised in it too (raised_together).
TOGETHER_TIMEOUT_S = 60
_TOGETHER: dict = {}  # "group": the process group raised_together asks on, made by start()


def in_rank() -> bool:
    """Is this process one rank of a launched group (our launcher or torchrun)?"""
    return "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ


def global_rank() -> int:
    """This process's rank in the launched group (0 outside one)."""
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    device: object  # torch.device: cuda:LOCAL_RANK on CUDA, else the CPU
    backend: str  # gloo | nccl


def start(world: int, device, timeout_s: float) -> Rank:
    """Join the process group as one of `world` ranks on `device` (a resolved torch.device's type decides the
    backend); the command line's --tp must match the launched world size."""
    import torch
    import torch.distributed as dist

    launched = int(os.environ["WORLD_SIZE"])
    if launched != world:
        raise KVBenchError(f"--tp {world}, but {launched} ranks were launched: give --tp {launched}")
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
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    wait = datetime.timedelta(seconds=min(timeout_s, TOGETHER_TIMEOUT_S))
    _TOGETHER["group"] = dist.new_group(backend="gloo", timeout=wait)  # every rank makes it, in the same order
    return Rank(dist.get_rank(), dist.get_world_size(), device, backend)


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
    """Did a collective fail because another rank failed, exited or timed out? (This rank's own error is not.)"""
    if not in_rank():
        return False
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and any(s in text for s in ("/gloo/", "Connection closed by peer", "NCCL"))
    )


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
def launch(world: int, argv: list[str]) -> int:
    """Run `python -m kvbench *argv` as `world` ranks on this machine and wait for them; the exit status is rank
    0's when every rank finished (its verdict: 0 or 1), otherwise the failing rank's, with one line naming it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # its own progress lines: one line of ours instead
    # one intra-op thread share per rank unless the user chose (ranks would otherwise oversubscribe the cores)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    logs = tempfile.mkdtemp(prefix="kvbench-ranks-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=f"kvbench-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port: parallel runs never collide
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=logs, redirects={r: Std.ALL for r in range(1, world)}),
    )
    # the launcher installs handlers for these (to stop every rank) and leaves them: a library caller's stay its own
    handled = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]
    before = (
        {sig: signal.getsignal(sig) for sig in handled} if threading.current_thread() is threading.main_thread() else {}
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "kvbench", *argv)
        return 0
    except ChildFailedError as e:
        codes = {r: 0 for r in range(world)} | {r: f.exitcode for r, f in e.failures.items()}
        return _outcome(codes, Path(logs))
    except SignalException:
        from kvbench import console

        console.error("interrupted: every rank stopped")
        return 130
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        for sig, handler in before.items():
            if handler is not None:  # None: a handler not installed from Python, left as the launcher put it
                signal.signal(sig, handler)


def _outcome(codes: dict[int, int], logs: Path) -> int:
    """The run's exit status from each rank's, with the one line that names the rank that failed first."""
    from kvbench import console

    if all(c in (0, 1) for c in codes.values()):
        return codes[0]  # every rank finished: rank 0 holds the verdict
    if codes[0] in (0, 1) and all(c in (0, 1) or c < 0 for c in codes.values()):
        # rank 0 reports only once every rank's rows reached it: a rank stopped after that (the launcher stops the
        # others as soon as one exits 1, a failed verdict) had nothing left to do
        return codes[0]
    own = [r for r, c in sorted(codes.items()) if c not in (0, 1, PEER_LOST) and c > 0]
    killed = [r for r, c in sorted(codes.items()) if c < 0]
    early = [r for r, c in sorted(codes.items()) if c in (0, 1)]
    if own:
        r = own[0]
        if r != 0:  # rank 0's own line is already on the terminal
            console.error(f"rank {r}: {_error_line(logs, r) or f'exited with status {codes[r]}'}")
        return codes[r]
    if killed:
        r = killed[0]
        console.error(
            f"rank {r} did not reach a collective within the timeout (--tp-timeout) and was stopped: "
            f"{_error_line(logs, r) or 'no error of its own (a hang, or killed from outside)'}"
        )
        return 70
    console.error(
        f"rank {', '.join(map(str, early))} left the run early (exit {codes[early[0]]}) while the others waited in a "
        "collective"
    )
    return 70


def _error_line(logs: Path, rank: int) -> str | None:
    """The last `error: ...` line rank `rank` wrote to its stderr log, without the prefix."""
    for path in logs.glob(f"**/attempt_*/{rank}/stderr.log"):
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.startswith("error: ")]
        if lines:
            return lines[-1].removeprefix("error: ")
    return None
