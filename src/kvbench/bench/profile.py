"""bench --profile: one more warm run of a configuration under torch.profiler, after its timed repeats (never one
of them: the profiler's own overhead would be in the medians).

Each configuration's trace is a Chrome trace-event JSON file (open it in https://ui.perfetto.dev or
chrome://tracing) under the run folder's profile/, and its operators by self time become rows of profile_ops.csv:
what the decode loop spends its time in, kernel by kernel on CUDA (self device time) or op by op on the CPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kvbench.rows import CsvRow

TOP = 20  # operators per configuration kept in profile_ops.csv (by self time); the rest are summed as "(other)"


@dataclass
class OpRow(CsvRow):
    engine: str
    cache: str
    prompt_len: int
    batch: int
    op: str  # the operator's name as torch.profiler records it (aten::mm, a kernel, a record_function label)
    calls: int
    self_cpu_ms: float  # time in the operator itself, its children excluded, on the CPU (host) side
    self_device_ms: float  # the same on the accelerator (CUDA kernels it launched); 0 on a CPU run
    share: float  # of the run's total self time on the side that dominates (device on CUDA, else CPU)


@dataclass
class Profiled:
    trace: Path  # the Chrome/Perfetto trace file
    ops: list[OpRow]


def trace_name(engine: str, cache: str, prompt_len: int, batch: int) -> str:
    """A file name for a configuration's trace: its key, with anything but letters, digits, '.', '_', '-' as '-'."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{engine}-{cache}-prompt{prompt_len}-batch{batch}") + ".trace.json"


def profile_run(run: Callable[[], object], device: torch.device, folder: Path, key: dict) -> Profiled:
    """Run `run()` (one whole generation) under torch.profiler; write its trace into `folder`; return it and the
    operators by self time. key: the configuration's engine, cache, prompt_len and batch."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # Kineto, the profiler's backend, writes a line to stderr at every start and stop unless its log level is
    # above 5; read when the profiler first starts, so set here (a level the user chose is kept)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=activities) as prof:
        run()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / trace_name(key["engine"], key["cache"], key["prompt_len"], key["batch"])
    tmp = path.with_suffix(".partial")
    prof.export_chrome_trace(str(tmp))
    tmp.replace(path)  # a kill while writing leaves no half trace under the final name
    return Profiled(path, top_ops(prof.key_averages(), key, device.type == "cuda"))


def top_ops(averages: Any, key: dict, on_device: bool) -> list[OpRow]:
    """The TOP operators by self time (device time on CUDA, CPU time otherwise), and the rest as one row."""

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    def side(e: Any) -> float:
        return device_us(e) if on_device else float(e.self_cpu_time_total)

    events = sorted(averages, key=side, reverse=True)
    total = sum(side(e) for e in events) or 1.0
    rows = [
        OpRow(
            **key,
            op=e.key,
            calls=int(e.count),
            self_cpu_ms=e.self_cpu_time_total / 1e3,
            self_device_ms=device_us(e) / 1e3,
            share=side(e) / total,
        )
        for e in events[:TOP]
    ]
    rest = events[TOP:]
    if rest:
        rows.append(
            OpRow(
                **key,
                op=f"(other: {len(rest)} operators)",
                calls=sum(int(e.count) for e in rest),
                self_cpu_ms=sum(e.self_cpu_time_total for e in rest) / 1e3,
                self_device_ms=sum(device_us(e) for e in rest) / 1e3,
                share=sum(side(e) for e in rest) / total,
            )
        )
    return rows
