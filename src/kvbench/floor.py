"""The bandwidth floor of a decode step: the bytes one step must move, over the device's measured read bandwidth.

At batch 1 a decode step does little arithmetic per byte: every weight matrix is read once for one token (a
matrix-vector product) and attention reads every cached key and value once. So a step cannot be faster than

    floor = bytes the step must read / the device's read bandwidth

and a measured time per output token (TPOT) divided by it (`x_floor`) says how much of the step is overhead: launch
latency, Python, extra copies, kernels that stream below bandwidth. What one step must read, for a batch of B
sequences at context L (the key slots this step attends over, the new token included), in the model's dtype:

    weights   every block's parameters, ln_f, and lm_head (V x C: tied to wte, read whole) + the B embedding rows
    kv        2 (K and V) x layers x B x L x C x element size
plus what a design moves on top (`design_bytes`): torch.cat re-copies the history every step (reads L-1 slots, writes
L); a static-graph step attends over its whole buffer (max_len slots, masked) instead of L; the paged cache gathers
its blocks into a contiguous copy (reads L, writes L); the int8 cache reads int8 + scales and writes a dequantised
copy. Writes are counted as traffic too: they cost bandwidth like reads. docs/performance.md works an example.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kvbench.model import GPTConfig

GB = 1e9


@dataclass
class Bandwidth:
    """Measured once per run: a large read-only reduction and a copy; the floor uses `read`."""

    read_gbps: float  # bytes read / s by x.sum() over a tensor larger than any cache level
    copy_gbps: float  # (bytes read + bytes written) / s by y.copy_(x)
    nbytes: int  # size of the tensor streamed
    device: str
    used: str = "read"  # which of the two the floor divides by

    @property
    def gbps(self) -> float:
        return self.read_gbps if self.used == "read" else self.copy_gbps


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 7) -> Bandwidth:
    """Median of `repeats` synchronised runs of each kernel, after a warm-up run of the same size."""
    from kvbench.devices import synchronize

    if nbytes is None:
        nbytes = (2 << 30) if device.type == "cuda" else (512 << 20)  # well past the L2 / last-level cache
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)

    def timed(fn) -> float:
        fn()  # warm-up: first touch of pages, kernel selection
        times = []
        for _ in range(repeats):
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    read_s = timed(lambda: x.sum())
    copy_s = timed(lambda: y.copy_(x))
    return Bandwidth(nbytes / read_s / GB, 2 * nbytes / copy_s / GB, nbytes, str(device))


@dataclass
class StepBytes:
    """Bytes one decode step moves, by where they come from."""

    weights: int
    kv: int  # K and V read by attention (the slots it attends over)
    kv_write: int  # this token's K and V written
    design: int  # what the design moves on top (copies, gathers, dequantisation)
    note: str

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.kv_write + self.design


def weight_bytes(cfg: GPTConfig, elt: int, batch: int = 1) -> int:
    """Parameters one decode step reads: all blocks, ln_f and the tied lm_head (V x C) once; from wte and wpe only
    the B rows of this step's tokens and positions."""
    C, V = cfg.n_embd, cfg.vocab_size
    per_block = (
        2 * 2 * C  # ln_1, ln_2: weight + bias
        + C * 3 * C + 3 * C  # c_attn
        + C * C + C  # attn.c_proj
        + C * 4 * C + 4 * C  # mlp.c_fc
        + 4 * C * C + C  # mlp.c_proj
    )  # fmt: skip
    return elt * (cfg.n_layer * per_block + 2 * C + V * C + 2 * batch * C)


# What each design moves per step on top of attention's read of L slots. `slots_read` is how many key slots
# attention reads; `extra(L, per_slot)` the design's own traffic, per_slot = bytes of one slot's K and V (all layers).
DESIGNS = {
    "dynamic": ("torch.cat re-copies the history: reads L-1 slots, writes L", lambda L, cap, s, q: (L - 1 + L) * s),
    "static": ("reads the filled prefix in place", lambda L, cap, s, q: 0),
    "static-graph": ("attends over its whole buffer (max_len slots, masked)", lambda L, cap, s, q: (cap - L) * s),
    "paged": ("gathers its blocks into a contiguous copy: reads L, writes L", lambda L, cap, s, q: 2 * L * s),
    "int8": ("reads int8 + scales, writes the dequantised copy", lambda L, cap, s, q: L * q + L * s),
    "hf:dynamic": ("transformers' DynamicCache: torch.cat like ours", lambda L, cap, s, q: (L - 1 + L) * s),
    "hf:static": ("transformers' StaticCache: attention over the whole max_cache_len buffer",
                  lambda L, cap, s, q: (cap - L) * s),
}  # fmt: skip


def step_bytes(cfg: GPTConfig, elt: int, batch: int, context: int, capacity: int, design: str) -> StepBytes:
    """Bytes of one decode step at `context` key slots (new token included) for `design` (a cache name, or
    hf:dynamic / hf:static for transformers' caches). Unknown designs (plugins) count weights and KV only."""
    per_slot = 2 * cfg.n_layer * batch * cfg.n_embd * elt  # K + V of one token position, all layers
    int8_slot = (
        2 * cfg.n_layer * batch * (cfg.n_embd + cfg.n_head * (2 if elt == 2 else 4))
    )  # int8 + a scale per head
    note, extra = DESIGNS.get(design, ("design traffic unknown: weights and KV only", lambda L, cap, s, q: 0))
    return StepBytes(
        weights=weight_bytes(cfg, elt, batch),
        kv=context * per_slot,
        kv_write=per_slot,
        design=int(extra(context, max(capacity, context), per_slot, int8_slot)),
        note=note,
    )


def decode_floor_ms(
    cfg: GPTConfig, elt: int, batch: int, prompt_len: int, new_tokens: int, design: str, bw: Bandwidth,
    capacity: int | None = None,
) -> tuple[float, StepBytes]:  # fmt: skip
    """The floor of the median decode step of a run: decode steps attend over prompt+1 .. prompt+new-1 slots, so the
    median step is at context prompt + new/2 (bytes are linear in the context). capacity: the allocated max_len."""
    context = prompt_len + new_tokens // 2
    b = step_bytes(cfg, elt, batch, context, capacity or prompt_len + new_tokens, design)
    return 1e3 * b.total / (bw.gbps * GB), b


def crossover_context(cfg: GPTConfig, elt: int, batch: int = 1) -> int:
    """The context at which attention's K/V read equals the weight read: past it, reading the cache is the step."""
    per_slot = 2 * cfg.n_layer * batch * cfg.n_embd * elt
    return -(-weight_bytes(cfg, elt, batch) // per_slot)
