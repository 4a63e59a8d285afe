"""What meta.json records about the machine a run shared: the CPU, how many cores the process may use, the load
average when the run started and when it ended, and on CUDA the other processes on the device and its clocks; and
the warning compare gives when two runs started under loads more than a core apart.

The GPU facts come from NVML through `nvidia-ml-py` (imported as pynvml) when it is installed; without it, or where
NVML cannot answer, each fact is null and `note` says why. Nothing here raises: a fact that cannot be read is
recorded as unknown, never a reason to stop a run.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

LOAD_APART = 1.0  # compare warns when the runs' 1-minute load averages at start differ by more (one core)


def cpu_model() -> str | None:
    """/proc/cpuinfo's first `model name`, else platform.processor(); None where neither says."""
    try:
        for text in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = text.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def usable_cpus() -> int | None:
    """The cores this process may run on (its affinity mask); None where the platform does not say."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def load_average() -> dict[str, float] | None:
    """The 1-, 5- and 15-minute load averages now; None where the platform has none."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def cpu_facts() -> dict:
    """meta.json host fields: the CPU model, the cores usable, and the load average at the start."""
    return {"cpu_model": cpu_model(), "cpus_usable": usable_cpus(), "load_average": {"start": load_average()}}


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
        out = {"processes": _processes(pynvml, handle), "clocks": _clocks(pynvml, handle), "note": None}
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
        out.append(
            {"pid": p.pid, "name": name, "memory_mib": None if used is None else round(used / 2**20, 1)}
        )
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
