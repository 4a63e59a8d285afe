"""The bandwidth floor of a decode step: the bytes one step must move, over the device's measured read bandwidth.

At batch 1 a decode step does little arithmetic per byte: every weight matrix is read once for one token (a
matrix-vector product) and attention reads every cached key and value once. So a step cannot be faster than

    floor = bytes the step must move / the device's read bandwidth

and a measured time per output token (TPOT) divided by it (`x_floor`) says how far the step is from that limit:
launch latency, Python, extra copies, kernels that stream below bandwidth. What one step moves, for a batch of B
sequences at context L (the key slots that hold tokens, this step's included), in the model's dtype:

    weights   every block's parameters, ln_f, and lm_head (V x C, tied to wte: read whole) + the B rows of wte and
              wpe this step's tokens and positions use
    kv        K and V of the slots attention reads: 2 x layers x B x slots x C x element size
    kv_write  this token's K and V, written into the cache
    design    what the design moves on top (its spec's `Traffic`, caches/base.py)

Writes count as traffic too: they cost bandwidth like reads. The floor is the design's own minimum, not what an
implementation happens to allocate on the way: `int8` dequantises through fp32 temporaries, and that extra
traffic is overhead that `x_floor` shows, not part of the floor. docs/performance.md works an example.
"""

from __future__ import annotations

import math
import mmap
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvbench import validate
from kvbench.bench import hugepages
from kvbench.caches.base import UNKNOWN_TRAFFIC, Traffic
from kvbench.caches.int8 import scale_dtype_for
from kvbench.devices import synchronize
from kvbench.model.gpt2 import GPTConfig

GB = 1e9
CPU_PROBE_BYTES = 512 << 20  # at least this much, and at least twice the last-level cache the OS reports
CUDA_PROBE_BYTES = 2 << 30  # far past any GPU's L2 (tens of MB), at most a quarter of the free memory
PROBE_ENV = validate.PROBE_ENV  # the probe's size in bytes, overriding probe_bytes


@dataclass
class Bandwidth:
    """Measured once per run: a large read-only reduction and a copy. The floor divides by `read`: a decode step
    mostly reads (weights, cached K/V)."""

    # median bytes read / s by the faster read kernel over a tensor far larger than the caches
    read_gbps: float
    copy_gbps: float  # median (bytes read + bytes written) / s copying one half of that tensor into the other
    nbytes: int  # size of the tensor streamed
    device: str
    used: str = "read"  # which of the two the floor divides by
    read_range: tuple[float, float] = (math.nan, math.nan)  # slowest and fastest repeat, GB/s
    copy_range: tuple[float, float] = (math.nan, math.nan)
    repeats: int = 0
    llc_bytes: int | None = None  # the last-level cache the OS (CPU) or driver (CUDA L2) reports
    read_kernel: str = "sum"  # which read kernel read_gbps comes from (sum, or mv: a matrix-vector product)
    read_by_kernel: dict = field(default_factory=dict)  # median GB/s of each read kernel tried

    @property
    def gbps(self) -> float:
        return self.read_gbps if self.used == "read" else self.copy_gbps

    def as_dict(self) -> dict:
        return {**asdict(self), "gbps": self.gbps}


STEADY_SWING = 1.25  # fastest / slowest repeat of a run's read probes beyond which its floor is called unsteady


def unsteady(floor_meta: dict) -> str | None:
    """What to say of a run whose read bandwidth moved while it was probed (meta.json's `floor`: the first probe,
    interleaved each prompt length's pooled rounds, and the reads beside each timed run), or None when its fastest
    read is within STEADY_SWING of its slowest. A machine that shares its memory with other work can move far: a
    2-core AMD EPYC VM read 512 MiB at 34-35 GB/s for twenty seconds, then at 55-63 GB/s and 35 by turns
    (2026-12-06), and one compiled decode step moved between 16 and 21 ms within a run with it. x floor is then no
    better known than that ratio. The reads beside the runs count: on that VM (2026-12-07) every probe of a run read
    29.8-36.5 GB/s while its timed runs met 33-66."""
    probes = [floor_meta.get("bandwidth") or {}, *(floor_meta.get("by_prompt_len") or {}).values()]
    ranges = [b["read_range"] for b in probes if b.get("read_range")]
    ranges += [(g, g) for run in (floor_meta.get("paired_read_gbps") or {}).values() for g in run]
    lows, highs = [lo for lo, _ in ranges if lo == lo and lo > 0], [hi for _, hi in ranges if hi == hi]  # no NaN
    if not lows or not highs or max(highs) / min(lows) <= STEADY_SWING:
        return None
    lo, hi = min(lows), max(highs)
    return (
        f"the device's read bandwidth moved between {lo:.1f} and {hi:.1f} GB/s (x{hi / lo:.2f}) while this run "
        "probed it: its memory is shared with other work, so each row's x floor is uncertain by as much and rows "
        "timed minutes apart may differ by it; x paired, which holds each run to the bandwidth read beside it, "
        "follows the drift better; rerun on a quiet machine before holding a row to either"
    )


def pooled(probes: list[Bandwidth]) -> Bandwidth:
    """Several probes of one device as one: the median of their medians, the extremes of their ranges. An
    interleaved sweep probes once per round, so its floor moves with the drift its rows met."""
    first = probes[0]
    med = statistics.median
    kernels = {k: med(p.read_by_kernel.get(k, math.nan) for p in probes) for k in first.read_by_kernel}
    return Bandwidth(
        med(p.read_gbps for p in probes),
        med(p.copy_gbps for p in probes),
        first.nbytes,
        first.device,
        used=first.used,
        read_range=(min(p.read_range[0] for p in probes), max(p.read_range[1] for p in probes)),
        copy_range=(min(p.copy_range[0] for p in probes), max(p.copy_range[1] for p in probes)),
        repeats=sum(p.repeats for p in probes),
        llc_bytes=first.llc_bytes,
        read_kernel=first.read_kernel,
        read_by_kernel=kernels,
    )


def _last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports (sysfs), or None."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in (e for e in os.listdir(base) if e.startswith("index")):
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        return None
    return max(sizes) if sizes else None


def probe_bytes(device_type: str, llc_bytes: int | None, memory_bytes: int | None) -> int:
    """How large a tensor the probe streams. CPU: CPU_PROBE_BYTES or twice the last-level cache, whichever is
    larger (a stream twice the cache's size finds little of itself there on the next pass), capped at an eighth
    of the memory. CUDA: CUDA_PROBE_BYTES, capped at a quarter of the free memory."""
    if device_type == "cuda":
        want = CUDA_PROBE_BYTES
        cap = memory_bytes // 4 if memory_bytes else want
    else:
        want = max(CPU_PROBE_BYTES, 2 * (llc_bytes or 0))
        cap = memory_bytes // 8 if memory_bytes else want
    return max(min(want, cap), 1 << 20) // 4 * 4


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 7) -> Bandwidth:
    """Median of `repeats` synchronised runs of each kernel, after a warm-up run of the same size. One tensor of
    `nbytes` (default: probe_bytes, or $KVBENCH_PROBE_BYTES): two read kernels stream all of it, a sum and a
    matrix-vector product (the kernel a batch-1 decode step runs; on some CPUs the only one that reaches the memory's
    bandwidth), and the faster is the read bandwidth; the copy moves its first half onto its second (so the memory
    touched, and the page faults of a first touch, are those of one tensor)."""
    if device.type == "cuda":
        llc = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
        memory = torch.cuda.mem_get_info(device)[0]
    else:
        llc = _last_level_cache_bytes()
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = None
    if nbytes is None:
        nbytes = validate.probe_bytes_setting(os.environ.get(PROBE_ENV, "")) or probe_bytes(device.type, llc, memory)
    n = nbytes // 8 * 2  # float32 elements, an even count
    nbytes = 4 * n
    x = torch.ones(n, dtype=torch.float32, device=device)
    src, dst = x[: n // 2], x[n // 2 :]

    def timed(fn: Callable[[], object]) -> list[float]:
        return _timed(fn, device, repeats)

    reads = {k: [nbytes / t / GB for t in timed(fn)] for k, fn in _read_kernels(x).items()}
    kernel = max(reads, key=lambda k: statistics.median(reads[k]))
    read = reads[kernel]
    copy = [nbytes / t / GB for t in timed(lambda: dst.copy_(src))]  # half read + half written
    return Bandwidth(
        statistics.median(read),
        statistics.median(copy),
        nbytes,
        str(device),
        read_range=(min(read), max(read)),
        copy_range=(min(copy), max(copy)),
        repeats=repeats,
        llc_bytes=llc,
        read_kernel=kernel,
        read_by_kernel={k: statistics.median(v) for k, v in reads.items()},
    )


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds of `repeats` synchronised calls of fn, after one warm-up call (first touch of pages, kernel choice)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def _read_kernels(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The two ways the probe reads all of the flat float32 tensor x: a sum, and a matrix-vector product."""
    n = x.numel()
    cols = 1024 if n % 1024 == 0 else 2
    matrix, vec = x.view(-1, cols), torch.ones(cols, dtype=torch.float32, device=x.device)  # (n / cols, cols)
    return {"sum": lambda: x.sum(), "mv": lambda: torch.mv(matrix, vec)}


def read_now(bw: Bandwidth, repeats: int = 3) -> float:
    """The CPU's read bandwidth now, in GB/s: the median of `repeats` reads of fresh memory of the size the run's
    first probe `bw` streamed, by the read kernel that won it. A tenth of that probe's work (no copy, one kernel), so
    bench can take one between any two timed runs (the paired floor, bench/sweep.py). The memory is mapped for the
    read and unmapped after it, never the C allocator's: a heap keeps what a small probe frees, and the rows' peak
    resident set would count it. It gets the pages torch gives the weights (bench/hugepages.py)."""
    assert torch.device(bw.device).type == "cpu", "the paired reads run on the CPU"
    with _private_map(bw.nbytes) as mm:
        hugepages.advise(mm)
        times = _read_mapped(mm, bw.read_kernel, repeats)  # every tensor over `mm` gone before it is unmapped
    return statistics.median(bw.nbytes / t / GB for t in times)


def _private_map(nbytes: int) -> mmap.mmap:
    """Anonymous private memory: not mmap's default on POSIX, shared memory, which Linux backs with huge pages only
    where shmem_enabled allows (`never` by default). Windows has neither flag: there an anonymous map is the
    process's own."""
    if hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


def _read_mapped(mm: mmap.mmap, kernel: str, repeats: int) -> list[float]:
    x = torch.frombuffer(mm, dtype=torch.float32).fill_(1.0)  # (nbytes / 4,), its pages touched
    return _timed(_read_kernels(x)[kernel], x.device, repeats)


@dataclass
class StepBytes:
    """Bytes one decode step moves, by where they come from."""

    weights: int
    kv: int  # K and V read by attention (the slots it attends over)
    kv_write: int  # this token's K and V written
    design: int  # what the design moves on top (copies, gathers, dequantisation)
    note: str
    context: int  # slots holding tokens, this step's included
    slots: int  # key slots attention reads (context, or the whole buffer)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.kv_write + self.design

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def weight_bytes(cfg: GPTConfig, elt: int, batch: int = 1) -> int:
    """Parameters one decode step reads: all blocks, ln_f and the tied lm_head (V x C) once; from wte and wpe only
    the B rows of this step's tokens and positions."""
    C, V = cfg.n_embd, cfg.vocab_size
    per_block = (
        2 * 2 * C  # ln_1, ln_2: weight + bias
        + (C * 3 * C + 3 * C)  # c_attn
        + (C * C + C)  # attn.c_proj
        + (C * 4 * C + 4 * C)  # mlp.c_fc
        + (4 * C * C + C)  # mlp.c_proj
    )
    return elt * (cfg.n_layer * per_block + 2 * C + V * C + 2 * batch * C)


def step_bytes(
    cfg: GPTConfig,
    dtype: torch.dtype,
    batch: int,
    context: int,
    capacity: int,
    traffic: Traffic | None,
    weight_elt: int | None = None,
    kv_elt: float | None = None,
) -> StepBytes:
    """Bytes of one decode step at `context` slots (this token included) for a design moving `traffic` (None: a
    design that does not say, counted as weights and K/V only). capacity: the slots the cache's buffer holds.
    weight_elt: bytes a weight, where an engine stores its weights in another type (a peer's int8); default dtype's.
    kv_elt: bytes a K or V element, where an engine's cache stores another type (llama.cpp's q8_0: 34/32)."""
    elt = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=scale_dtype_for(dtype)).element_size()
    L, cap = context, max(capacity, context)
    slot = round(2 * cfg.n_layer * batch * cfg.n_embd * (kv_elt or elt))  # K + V of one token position, all layers
    q8 = 2 * cfg.n_layer * batch * (cfg.n_embd + cfg.n_head * scale)  # int8 + one scale per head
    t = traffic or UNKNOWN_TRAFFIC
    slots = cap if t.whole_buffer else (t.slots(L) if t.slots is not None else L)
    return StepBytes(
        weights=weight_bytes(cfg, weight_elt or elt, batch),
        kv=slots * slot,
        kv_write=t.write(slot, q8),
        design=t.extra(L, slot, q8),
        note=t.note,
        context=L,
        slots=slots,
    )


def median_step_context(prompt_len: int, new_tokens: int) -> int:
    """Context of the median decode step of a generation: decode steps attend over prompt+1 .. prompt+new-1 slots
    (the first token comes from the prefill), so the median is prompt + new/2; bytes are linear in the context."""
    return prompt_len + new_tokens // 2


def floor_ms(b: StepBytes, bw: Bandwidth) -> float:
    return 1e3 * b.total / (bw.gbps * GB)


@dataclass
class Paired:
    """x floor with each timed run held to the bandwidth read beside it, where the run-wide probe's median cannot
    follow a memory whose bandwidth moves within the run (`unsteady`). Each step of a timed run over the floor at
    the mean of the reads just before and just after that run; the row reports the median step and the fastest and
    slowest run's median."""

    x_floor: float
    x_floor_min: float  # the fastest run's median step, so held
    x_floor_max: float
    read_gbps: float  # median over the runs of the bandwidth each was held to


def paired(b: StepBytes, run_steps_ms: list[list[float]], run_gbps: list[float]) -> Paired:
    """x floor with each timed run's decode steps (ms) held to the read bandwidth beside that run (GB/s): every
    step over the floor at its run's bandwidth, pooled, and the median, as x floor pools the steps (a compiling
    first step stays one outlier); the extremes are the runs' own medians."""
    assert run_gbps, "at least one timed run"
    per_run = [
        [ms * gbps * GB / (1e3 * b.total) for ms in steps] for steps, gbps in zip(run_steps_ms, run_gbps, strict=True)
    ]
    medians = [statistics.median(xs) for xs in per_run]
    pooled = statistics.median(x for xs in per_run for x in xs)
    return Paired(pooled, min(medians), max(medians), statistics.median(run_gbps))


def decode_floor_ms(
    cfg: GPTConfig,
    dtype: torch.dtype,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    traffic: Traffic | None,
    bw: Bandwidth,
    capacity: int | None = None,
    weight_elt: int | None = None,
    kv_elt: float | None = None,
) -> tuple[float, StepBytes]:
    """The floor of the median decode step of a generation. capacity: the buffer's slots (default prompt + new)."""
    context = median_step_context(prompt_len, new_tokens)
    b = step_bytes(cfg, dtype, batch, context, capacity or prompt_len + new_tokens, traffic, weight_elt, kv_elt)
    return floor_ms(b, bw), b


def crossover_context(cfg: GPTConfig, elt: int, batch: int = 1) -> int:
    """The context at which attention's K/V read equals the weight read: past it, reading the cache is the step."""
    per_slot = 2 * cfg.n_layer * batch * cfg.n_embd * elt
    return -(-weight_bytes(cfg, elt, batch) // per_slot)
