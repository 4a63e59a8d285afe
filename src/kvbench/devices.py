"""Device and dtype resolution, synchronisation, and peak-memory readers."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from kvbench.dtypes import canonical
from kvbench.errors import KVBenchError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without CUDA is an error, not a silent fallback."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise KVBenchError(f"--device {name}: CUDA is not available on this machine (use --device cpu or auto)")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise KVBenchError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
        return dev
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps" and torch.backends.mps.is_available():
        return torch.device("mps")
    raise KVBenchError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Any spelling of fp32, fp16 or bf16 (kvbench.dtypes: float16, half, torch.bfloat16, ...); 'auto' -> fp16 on
    CUDA, fp32 elsewhere. fp16 on a CPU is refused: PyTorch has no fast CPU fp16 kernels."""
    name = canonical(name, "--dtype", tuple(DTYPES), extra=("auto",))
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if name == "fp16" and device.type == "cpu":
        raise KVBenchError(
            "--dtype fp16 on the CPU: PyTorch's CPU fp16 kernels are very slow or missing; "
            "use --dtype fp32 (or bf16) on the CPU, or --device cuda"
        )
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a clock read after it measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    isa = torch.backends.cpu.get_cpu_capability()
    return f"CPU ({cpu_model() or platform.machine()}, {isa}, {torch.get_num_threads()} threads)"


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


# the instruction-set extensions a CPU's kernels choose between (x86 and ARM), as /proc/cpuinfo names them
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu_isa() -> dict:
    """What a CPU kernel can use: torch's CPU capability (the ISA its own kernels dispatch to: DEFAULT, AVX2, AVX512,
    ...) and the extensions /proc/cpuinfo lists among ISA_FLAGS (None where it cannot be read)."""
    flags: list[str] | None = None
    try:
        for text in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = text.partition(":")
            if key.strip() in ("flags", "Features"):
                have = set(value.split())
                flags = [f for f in ISA_FLAGS if f in have]
                break
    except OSError:
        pass
    return {"torch_capability": torch.backends.cpu.get_cpu_capability(), "flags": flags}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak. CUDA: the allocator's peak statistics (its cache of free blocks is left alone, so a run
    after this one finds what the run before left, as it would in a serving loop). CPU on Linux: the process's
    peak resident set size (VmHWM), through /proc/self/clear_refs; elsewhere the CPU peak cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for row in f:
                if row.startswith(field + ":"):
                    return int(row.split()[1])  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_peak_resettable() -> bool:
    """Whether reset_peak_memory can reset the CPU peak here (Linux /proc)."""
    return os.access("/proc/self/clear_refs", os.W_OK) and _proc_status_kib("VmHWM") is not None


def memory_in_use(device: torch.device) -> float:
    """Bytes in use now: CUDA, allocated by PyTorch's allocator; CPU, the process's resident set size (NaN where
    /proc is unavailable)."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    kib = _proc_status_kib("VmRSS")
    return float("nan") if kib is None else kib * 1024.0


def memory_peak(device: torch.device) -> float:
    """Peak bytes since the last reset_peak_memory: CUDA max allocated; CPU the peak resident set size."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    kib = _proc_status_kib("VmHWM")
    return float("nan") if kib is None else kib * 1024.0


def device_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory free for this run now: CUDA, free device memory; CPU, the kernel's MemAvailable (Linux), else the
    free pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for row in f:
                if row.startswith("MemAvailable:"):
                    return int(row.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
