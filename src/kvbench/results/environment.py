"""The environment of a run: what meta.json records about the machine, and whether two runs are comparable.

The host: the CPU, how many cores the process may use, the load average when the run started and when it ended,
and on CUDA the other processes on the device and its clocks; and the warning compare gives when two runs started
under loads more than a core apart. The GPU facts come from NVML through `nvidia-ml-py` (imported as pynvml) when it
is installed; without it, or where NVML cannot answer, each fact is null and `note` says why. Nothing here raises
while a run records: a fact that cannot be read is recorded as unknown, never a reason to stop a run.

Comparable: two runs' identity (what the user or the software chose: device, dtype, library versions, threads, huge
pages asked for) must match, and their context (what was measured on the machine at run time: huge pages given, read
bandwidth) is shown side by side, and warned about when it differs.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.host import usable_cpus

LOAD_APART = 1.0  # compare warns when the runs' 1-minute load averages at start differ by more (one core)


REPO_ROOT = Path(__file__).resolve().parents[2]  # src/ (the checkout, where kvbench runs from one)


def git_revision() -> dict[str, Any]:
    """The source tree's commit and whether it had uncommitted changes; None where git is unavailable."""

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    rev = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if rev else None
    return {"commit": rev, "dirty": bool(status) if status is not None else None}


def load_average() -> dict[str, float] | None:
    """The 1-, 5- and 15-minute load averages now; None where the platform has none."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def cpu_facts() -> dict:
    """meta.json host fields: the CPU model and ISA, how our projections run on it (model/matmul.py), the cores
    usable, and the load average at the start."""
    from kvbench.devices import cpu_isa, cpu_model
    from kvbench.model import gemv
    from kvbench.model.matmul import route

    kernel = gemv.library()
    return {
        "cpu_model": cpu_model(),
        "cpu_isa": cpu_isa(),
        "cpu_matmul": route(),
        "cpu_gemv_unavailable": gemv.unavailable(),  # why the route is not kvbench's GEMV, where it could not be built
        "cpu_gemv_rows": None if kernel is None else kernel.rows,  # rows read side by side, as tuned on this machine
        "cpu_gemv_prefetch": None if kernel is None else kernel.prefetch,  # bytes ahead each row stream asks for
        "cpus_usable": usable_cpus(),
        "load_average": {"start": load_average()},
    }


def cuda_facts(device) -> dict:
    """The other processes on `device` (pid, name, MiB) and its SM and memory clocks (MHz, now and maximum),
    through NVML; null with a `note` saying why where they cannot be read."""
    try:
        import pynvml
    except ImportError:
        return {"processes": None, "clocks": None, "note": "nvidia-ml-py is not installed: not read"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"processes": None, "clocks": None, "note": f"NVML did not start: {e}"}
    try:
        handle = _handle(pynvml, device)
        out: dict[str, Any] = {"processes": _processes(pynvml, handle), "clocks": _clocks(pynvml, handle), "note": None}
    except pynvml.NVMLError as e:
        out = {"processes": None, "clocks": None, "note": f"NVML could not read the device: {e}"}
    finally:
        pynvml.nvmlShutdown()
    return out


def _handle(pynvml, device):
    """The NVML handle of a torch device: by UUID (CUDA_VISIBLE_DEVICES renumbers devices; NVML does not)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _processes(pynvml, handle) -> list[dict]:
    procs = []
    for get in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
        procs += [p for p in get(handle) if p.pid != os.getpid()]
    out = []
    for p in {p.pid: p for p in procs}.values():
        try:
            name = pynvml.nvmlSystemGetProcessName(p.pid)
            name = name.decode() if isinstance(name, bytes) else name
        except pynvml.NVMLError:
            name = None
        used = getattr(p, "usedGpuMemory", None)
        out.append({"pid": p.pid, "name": name, "memory_mib": None if used is None else round(used / 2**20, 1)})
    return out


def _clocks(pynvml, handle) -> dict:
    out = {}
    for name, kind in (("sm", pynvml.NVML_CLOCK_SM), ("memory", pynvml.NVML_CLOCK_MEM)):
        for when, get in (
            ("mhz", pynvml.nvmlDeviceGetClockInfo),
            ("max_mhz", pynvml.nvmlDeviceGetMaxClockInfo),
        ):
            try:
                out[f"{name}_{when}"] = get(handle, kind)
            except pynvml.NVMLError:
                out[f"{name}_{when}"] = None
    return out


def _load_at_start(meta: dict) -> float | None:
    host = meta.get("host")
    load = host.get("load_average") if isinstance(host, dict) else None
    start = load.get("start") if isinstance(load, dict) else None
    value = start.get("1m") if isinstance(start, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def load_warning(base_meta: dict, cand_meta: dict) -> str | None:
    """A line when the two runs started under 1-minute load averages more than LOAD_APART apart; None otherwise,
    and where either run did not record its load."""
    b, c = _load_at_start(base_meta), _load_at_start(cand_meta)
    if b is None or c is None or abs(c - b) <= LOAD_APART:
        return None
    return (
        f"the machine's load differed between the runs (1-minute load average at the start {b:.2f} in the "
        f"baseline, {c:.2f} in the candidate, more than {LOAD_APART:g} core apart); timings may differ for that "
        "reason too"
    )


def tp_warning(base_meta: dict, cand_meta: dict) -> str | None:
    """A line when either run is tensor-parallel on gloo (bench --tp on a CPU), whose timings measure no speed."""
    gloo = [
        role for role, m in (("baseline", base_meta), ("candidate", cand_meta)) if dig(m, ("tp", "backend")) == "gloo"
    ]
    if not gloo:
        return None
    return (
        f"the {' and the '.join(gloo)} ran tensor-parallel on gloo (a CPU), where each all-reduce costs about a "
        "millisecond of a shared core: such timings are not a speed measurement, and neither is their comparison"
    )


# Identity: what the user or the software chose for a run. Timings are comparable only when it is the same, so a
# difference is refused (unless --allow-env-change). The kvbench version and git commit are left out on purpose:
# they are what a comparison is about.
IDENTITY = (
    ("device", ("device",)),
    ("device name", ("device_name",)),
    ("dtype", ("dtype",)),
    ("python", ("versions", "python")),
    ("torch", ("versions", "torch")),
    ("transformers", ("versions", "transformers")),
    ("numpy", ("versions", "numpy")),
    ("CUDA", ("versions", "cuda")),
    ("torch threads", ("versions", "torch_threads")),
    ("THP_MEM_ALLOC_ENABLE", ("host", "huge_pages", "THP_MEM_ALLOC_ENABLE")),  # huge pages asked for, as set
    # bench --tp: rank 0's timings include the collectives between ranks, which one process has none of
    ("tensor-parallel ranks", ("settings", "tp")),
)
# What an identity field means where a run's meta.json does not record it (a run from before the field existed).
IDENTITY_DEFAULTS = {"tensor-parallel ranks": 1}
# Context: what was measured or found on the machine at run time (whether the kernel actually gave huge pages to a
# fresh buffer depends on fragmentation and load; the read bandwidth moves with load). Shown side by side and
# warned about when it differs, never a reason to refuse.
CONTEXT = (
    ("huge pages in use", ("host", "huge_pages", "in_use")),
    ("huge pages advised", ("host", "huge_pages", "advised")),
    ("kernel THP mode", ("host", "huge_pages", "system")),
    ("read bandwidth (GB/s)", ("floor", "bandwidth", "gbps")),
)


@dataclass
class EnvChange:
    name: str  # e.g. "torch", "dtype"
    baseline: str | None
    candidate: str | None


@dataclass
class ContextField:
    """A measured fact about the machine in both runs; `differs` when it changed (a number: by more than the
    comparison's threshold)."""

    name: str
    baseline: object
    candidate: object
    differs: bool


def dig(doc: Any, path: tuple[str, ...]) -> Any:
    """The member of a JSON document at `path` (keys, outermost first); None where any step is missing."""
    for k in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return doc


def environment_changes(base_meta: dict, cand_meta: dict) -> list[EnvChange]:
    """Every identity field whose value differs between the two meta.json files."""
    changes = []
    for name, path in IDENTITY:
        b, c = (dig(meta, path) for meta in (base_meta, cand_meta))
        b, c = (IDENTITY_DEFAULTS.get(name) if v is None else v for v in (b, c))
        if b != c:
            changes.append(EnvChange(name, None if b is None else str(b), None if c is None else str(c)))
    return changes


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def context_fields(base_meta: dict, cand_meta: dict, threshold: float) -> list[ContextField]:
    """The context fields either run recorded, side by side."""
    out = []
    for name, path in CONTEXT:
        b, c = dig(base_meta, path), dig(cand_meta, path)
        if b is None and c is None:
            continue
        if _is_number(b) and _is_number(c) and b > 0:
            differs = abs(c / b - 1) > threshold
        else:
            differs = b != c
        out.append(ContextField(name, b, c, differs))
    return out


def describe_changes(changes: list[EnvChange]) -> str:
    return "; ".join(f"{c.name} {c.baseline} -> {c.candidate}" for c in changes)


def describe_context(fields: list[ContextField]) -> str:
    def show(v) -> str:
        return f"{v:.1f}" if _is_number(v) and not isinstance(v, int) else str(v)

    return "; ".join(f"{f.name} {show(f.baseline)} -> {show(f.candidate)}" for f in fields)


def check_environment(
    base_meta: dict, cand_meta: dict, allow_env_change: bool, command: str = "kvbench compare"
) -> list[EnvChange]:
    """The identity changes between two runs; KVBenchError listing them unless they are allowed."""
    changes = environment_changes(base_meta, cand_meta)
    if changes and not allow_env_change:
        raise KVBenchError(
            f"the runs come from different environments ({describe_changes(changes)}); timings are not comparable. "
            f"Rerun both on the same machine and software, or compare anyway with {command} --allow-env-change"
        )
    return changes


def operator_facts() -> dict:
    """meta.json host fields of a run whose CPU steps are compiled with `--compile max`: what answered their calls of
    kvbench's operators (model/operators.py), "c++", "python" or "none", why not C++, and how their GEMV reads."""
    from kvbench.model import operators

    operators.prepare()  # where the run has not yet: builds operators.cpp once per machine
    way = operators.way()
    return {
        "cpu_operators": operators.kernels(),
        "cpu_operators_unavailable": operators.unavailable(),
        # how their GEMV reads a matrix: rows side by side, bytes ahead (model/gemv.py between_calls)
        "cpu_operators_gemv_rows": None if way is None else way[0],
        "cpu_operators_gemv_prefetch": None if way is None else way[1],
    }
