"""kvbench's own CPU GEMV: the one-row float32 projection of a batch-1 decode step, from gemv.c.

At batch 1 a decode step is a matrix-vector product per weight matrix, and on the CPU its time is how fast the
kernel streams the (out, in) matrix. oneDNN's inner product streams gpt2's matrices at 19-28 GB/s with two threads
and costs about 20 us a call, where a sum reads the same bytes at 30-50 (2-core AMD EPYC, 2026-12-06). gemv.c reads
each row in order and sums it in SIMD lanes: 30-49 GB/s on the same matrices, 4 us a call for a small one
(docs/performance.md). How best to read the rows depends on the CPU: one at a time or four side by side (on a 2-core
Intel Xeon, 2026-12-06, four read gpt2's block matrices 12-20% faster; on the AMD EPYC one row ran at a sum's rate),
and whether each stream asks for its bytes 16 or 32 KiB ahead (on the same Xeon, later that day, a gpt2 decode
step's 494 MB took 20.1 ms one row at a time 32 KiB ahead, 22.6 four rows without, 26.1 one row without). So the
first build on a machine times every way (`tune`) and keeps the fastest, or one row without prefetching where it
is within 5% of the fastest (`choose`); all give the same bits.

It is compiled once per machine, for its CPU (`-march=native`), with the C compiler on PATH ($CC, else cc, else gcc)
into $KVBENCH_CACHE_DIR/gemv/<key>/ (the library, and `tuning.json`: the tuning's times and choice), checked against
torch before first use, and loaded with ctypes (the call releases the GIL). Without a compiler, or where the build or
the check fails, `library()` is None, `unavailable()` says why, and model/matmul.py runs oneDNN instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench.cachedir import cache_root
from kvbench.host import cores
from kvbench.model.native import compile_library

SOURCE = Path(__file__).with_name("gemv.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
LIBS = ("-lm",)  # after the source: sqrtf, floorf
SYMBOL = "kv_gemv_f32"
LN_SYMBOL = "kv_ln_gemv_f32"  # a LayerNorm, then a projection
TAIL_SYMBOL = "kv_block_tail_f32"  # a GPT-2 block after attention
STEP_SYMBOL = "kv_step_f32"  # a whole GPT-2 decode step over static caches' buffers
ATTEND_SYMBOL = "kv_attend_f32"  # one query's attention over (B, H, L, Dh) buffers, under a mask of slots
ROW_GROUPS = (1, 4)  # rows a thread reads side by side: gemv.c's two loops
PREFETCH = (0, 16 << 10, 32 << 10)  # bytes ahead each row stream asks for (0: the hardware prefetcher alone)
WAYS = tuple((rows, ahead) for rows in ROW_GROUPS for ahead in PREFETCH)  # what `tune` chooses from
PLAIN = (1, 0)  # one row at a time, the hardware prefetcher alone: what `tune` keeps unless another way beats it
TIE = 0.05  # by more than this share of its time
# what `tune` times: one gpt2 decode step's matrices (out, in), its 12 blocks' four and the lm_head: 494 MB, the bytes
# a step streams between two reads of one matrix (more than most last-level caches: a smaller set is partly read from
# there and can choose a way that is not the fastest from memory)
TUNE_SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072)) * 12 + ((50257, 768),)
TUNE_ROUNDS = 7
step_calls = 0  # step_static calls in this process: attention that ran in C, not SDPA (bench's backends.py reads it)


@dataclass(frozen=True)
class Kernel:
    """The built C function and how a thread reads its rows on this machine: `rows` at a time (one of ROW_GROUPS),
    each stream asking for the bytes `prefetch` ahead (one of PREFETCH)."""

    fn: Callable[..., None]  # kv_gemv_f32(W, x, b, y, out, in, threads, rows, prefetch): pointers, then sizes
    rows: int
    prefetch: int = 0
    between: tuple[int, int] = PLAIN  # (rows, prefetch) of a call between other kernels' calls (`between_calls`)
    ln_fn: Callable[..., None] | None = None  # kv_ln_gemv_f32(x, g, gb, eps, W, b, ln, y, out, in, threads, ...)
    tail_fn: Callable[..., None] | None = None  # kv_block_tail_f32(x, a, Wo, bo, g, gb, eps, Wf, bf, Wp, bp, ...)
    step_fn: Callable[..., None] | None = None  # kv_step_f32(x, table, n_layer, L, slot, H, eps, ...)
    attend_fn: Callable[..., None] | None = None  # kv_attend_f32(q, K, V, allowed, out, B, H, L, Dh, scratch, ...)

    def __call__(self, w: int, x: int, b: int | None, y: int, n_out: int, n_in: int, threads: int) -> None:
        self.fn(w, x, b, y, n_out, n_in, threads, self.rows, self.prefetch)


def compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """What -march=native compiles for: the machine and, on Linux, the CPU's model name and flags."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        text += "".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        pass
    return text


def build(cc: str | None, root: Path) -> tuple[Kernel | None, str]:
    """Compile gemv.c with `cc` under `root` (once per source, compiler, flags and CPU), load it, check it and tune
    it: (the kernel, "") or (None, why not). A cached library that no longer loads is built again."""
    if not cc:
        return None, "no C compiler ($CC, cc or gcc) on PATH"
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), cc, *FLAGS, *LIBS, _cpu_identity(), torch.__version__]).encode()
    ).hexdigest()[:20]
    out = root / "gemv" / key / "libkvgemv.so"
    if not out.is_file():
        why = _compile(cc, out)
        if why:
            return None, why
    fns = _load(out)
    if fns is None:  # a cached library damaged since it was written: built again, once
        why = _compile(cc, out)
        if why:
            return None, why
        fns = _load(out)
        if fns is None:
            return None, f"{out} was built but does not load"
    if not all(_agrees(Kernel(fns[0], *way)) for way in WAYS):
        return None, f"{out} disagrees with torch's product: not used"
    (rows, prefetch), ms = _tuned(fns[0], out.with_name("tuning.json"))
    kernel = Kernel(fns[0], rows, prefetch, between_calls(ms), *fns[1:])
    if not _fused_agree(kernel):
        return None, f"{out}'s fused block calls disagree with torch's: not used"
    return kernel, ""


def _load(path: Path) -> tuple[Callable[..., None], ...] | None:
    """The library's five functions (the GEMV, LayerNorm then GEMV, a block after attention, a whole step, attention),
    typed; None when it does not load."""
    names = (SYMBOL, LN_SYMBOL, TAIL_SYMBOL, STEP_SYMBOL, ATTEND_SYMBOL)
    try:
        lib = ctypes.CDLL(str(path))
        fn, ln_fn, tail_fn, step_fn, attend_fn = (getattr(lib, n) for n in names)
    except (OSError, AttributeError):
        return None
    P, long, way = ctypes.c_void_p, ctypes.c_long, [ctypes.c_int, ctypes.c_int, ctypes.c_long]  # threads, rows, ahead
    fn.argtypes = [P] * 4 + [long, long, *way]
    ln_fn.argtypes = [P, P, P, ctypes.c_float, P, P, P, P, long, long, *way]
    tail_fn.argtypes = [P, P, P, P, P, P, ctypes.c_float, P, P, P, P, P, P, P, P, long, long, *way]
    # x, table, n_layer, L, slot, H, eps, ln_f weight and bias, head, logits, V, scratch, C, F
    step_fn.argtypes = [P, P, long, long, long, long, ctypes.c_float, P, P, P, P, long, P, long, long, *way]
    # q, K, V, allowed, out, B, H, L, Dh, scratch, threads
    attend_fn.argtypes = [P] * 5 + [long] * 4 + [P, ctypes.c_int]
    for f in (fn, ln_fn, tail_fn, step_fn, attend_fn):
        f.restype = None
    return fn, ln_fn, tail_fn, step_fn, attend_fn


def _compile(cc: str, out: Path) -> str:
    """Build the library at `out`: "" or why it failed, in one line."""
    return compile_library(cc, SOURCE, out, FLAGS, LIBS, timeout=120)


def tune(fn: Callable[..., None], record: Path) -> tuple[int, int]:
    """How a thread reads its rows on this machine, (rows, prefetch): `choose` over each way's time streaming a gpt2
    decode step's matrices, timed once (~1 s) and kept in `record` (JSON: each way's median in ms, the choice, the
    threads); a record without every way's time is timed again, one that cannot be written is only not kept."""
    return _tuned(fn, record)[0]


def _tuned(fn: Callable[..., None], record: Path) -> tuple[tuple[int, int], dict[tuple[int, int], float]]:
    """`tune`'s choice, and each way's median ms as the record keeps them (rounded to the microsecond)."""
    kept = kept_times(record)
    if kept is not None:
        return choose(kept), kept
    ms, threads = _time_ways(fn)
    way = choose(ms)
    doc = {
        "rows": way[0],
        "prefetch": way[1],
        "median_ms": {_label(w): round(t, 3) for w, t in ms.items()},
        "threads": threads,
    }
    tmp = record.with_name(f".{record.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, record)
    except OSError:
        pass
    return way, {w: round(t, 3) for w, t in ms.items()}


def kept_times(record: Path) -> dict[tuple[int, int], float] | None:
    """Each way's median ms as the tuning record keeps them; None where it holds no valid time for every way."""
    try:
        kept = json.loads(record.read_text())["median_ms"]
        ms = {way: kept[_label(way)] for way in WAYS}
        if all(type(t) in (int, float) and t > 0 for t in ms.values()):  # not `true`, which equals 1
            return ms
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def between_calls(ms: dict[tuple[int, int], float]) -> tuple[int, int]:
    """The way to read a matrix called on its own between other kernels (`--compile max`'s operator,
    model/operators.py): the fastest of the tuning's ways that ask ahead. In the compiled gpt2 step on a 2-core AMD
    EPYC VM (2026-12-07, its ways taking turns in one process for 20 rounds), four rows 32 KiB ahead took 17.18 ms a
    step against 18.90 for one row without in the memory's usual state and 14.24 against 14.97 in its fast state,
    where the tuning's calls, back to back, chose one row without (and the whole-step call was fastest so). Timed
    back to back, or with attention between, the calls did not show it: the tuning cannot time this pattern."""
    return min((w for w in WAYS if w[1] > 0), key=lambda w: ms[w])


def choose(ms: dict[tuple[int, int], float]) -> tuple[int, int]:
    """The way to keep, from each way's median ms: the fastest, unless PLAIN is within TIE of it. Timed once, ways
    can tie within the noise, and then which is fastest is chance. On a 2-core AMD EPYC VM (2026-12-07) all ways
    but four rows without prefetching were within 6% of each other while the memory read 33-36 GB/s (one tuning
    chose four rows 32 KiB ahead by 2%); while it read 60-67, one row without prefetching streamed at 46-54 GB/s
    and four rows 32 KiB ahead at 38-46. Where prefetching wins it wins by more (a 2-core Intel Xeon: 20.1 ms
    against 26.1)."""
    fastest = min(ms, key=lambda w: ms[w])
    return PLAIN if ms[PLAIN] <= ms[fastest] * (1 + TIE) else fastest


def _label(way: tuple[int, int]) -> str:
    """A way's key in the tuning record: "4 rows, 16384 B ahead"."""
    rows, ahead = way
    return f"{rows} row{'s' * (rows > 1)}, {ahead} B ahead"


def _time_ways(fn: Callable[..., None]) -> tuple[dict[tuple[int, int], float], int]:
    """Median ms of one pass over TUNE_SHAPES per way of reading, the ways taking turns for TUNE_ROUNDS rounds after
    one warm-up pass each, on every core this process may use (a benchmark's threads), whichever process builds the
    library first."""
    mats = [torch.full(shape, 0.01) for shape in TUNE_SHAPES]  # (out, in) each
    x, y = torch.ones(max(n_in for _, n_in in TUNE_SHAPES)), torch.empty(max(n for n, _ in TUNE_SHAPES))
    threads = cores()

    def one_pass(rows: int, ahead: int) -> float:
        t0 = time.perf_counter()
        for w in mats:
            fn(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), w.size(0), w.size(1), threads, rows, ahead)
        return (time.perf_counter() - t0) * 1e3

    times: dict[tuple[int, int], list[float]] = {way: [] for way in WAYS}
    for rnd in range(TUNE_ROUNDS + 1):
        for way in WAYS:
            t = one_pass(*way)
            if rnd:  # the first round warms up
                times[way].append(t)
    return {way: statistics.median(t) for way, t in times.items()}, threads


def _agrees(fn) -> bool:
    """The built kernel (called as `Kernel` is) against torch on odd sizes, with and without a bias, before any
    model uses it."""
    g = torch.Generator().manual_seed(0)
    for n_out, n_in, biased in ((37, 131, True), (64, 768, False)):
        w, x, b = (torch.randn(s, generator=g) for s in ((n_out, n_in), (n_in,), (n_out,)))
        y = torch.empty(n_out)
        fn(w.data_ptr(), x.data_ptr(), b.data_ptr() if biased else None, y.data_ptr(), n_out, n_in, 2)
        ref = w.double() @ x.double() + (b.double() if biased else 0)
        if not torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4):
            return False
    return True


def _fused_agree(kernel: Kernel) -> bool:
    """The fused calls and attention against torch's own LayerNorm, linear, SDPA, GELU and additions on a small model
    (C 48 in 4 heads, MLP 192, odd enough to leave tails; two layers, 5 cached tokens in caches of 9, a vocabulary of
    37), before any model uses them."""
    F_ = torch.nn.functional
    g = torch.Generator().manual_seed(1)
    C, F, H, L, slot, V = 48, 192, 4, 9, 5, 37

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / (shape[-1] ** 0.5 if len(shape) == 2 else 1)

    shapes = ((C,), (C,), (3 * C, C), (3 * C,), (1, H, L, C // H), (1, H, L, C // H), (C, C), (C,), (C,), (C,))
    layers = [tuple(rand(*s) for s in (*shapes, (F, C), (F,), (C, F), (C,))) for _ in range(2)]
    x, a, gf, bf_ = rand(C), rand(C), rand(C), rand(C)
    head = rand(V, C)

    def ln(t: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F_.layer_norm(t, (C,), w, b, 1e-5)

    def after(layer: Layer, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # torch's block after attention
        x1 = x + F_.linear(a, layer[6], layer[7])
        hidden = F_.gelu(F_.linear(ln(x1, layer[8], layer[9]), layer[10], layer[11]), approximate="tanh")
        return x1 + F_.linear(hidden, layer[12], layer[13])

    first = layers[0]

    def pair(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return first[i], first[i + 1]

    with torch.no_grad():
        got = [
            (
                ln_gemv(x, first[0], first[1], 1e-5, first[2], first[3], kernel),
                F_.linear(ln(x, *first[:2]), *first[2:4]),
            ),
            (
                block_tail(x, a, pair(6), (first[8], first[9], 1e-5), pair(10), pair(12), kernel),
                after(first, x, a),
            ),
        ]
        y, rows = x, []
        for layer in layers:  # torch's step, on copies of the caches
            q, kn, vn = (t.view(1, H, 1, C // H) for t in F_.linear(ln(y, *layer[:2]), *layer[2:4]).split(C))
            keys, values = (torch.cat([c[:, :, :slot], new], 2) for c, new in ((layer[4], kn), (layer[5], vn)))
            y = after(layer, y, F_.scaled_dot_product_attention(q, keys, values).reshape(C))
            rows += [(layer[4][:, :, slot], kn[:, :, 0]), (layer[5][:, :, slot], vn[:, :, 0])]
        logits = F_.linear(ln(y, gf, bf_), head)
        got.append((step_static(x.view(1, 1, C), layers, slot, 1e-5, (gf, bf_), head, kernel).view(V), logits))
        got += rows  # each layer's row of K/V, written at `slot`
        # attention under a mask: a row that sees slots [0, slot], one left-padded that sees [2, slot)
        q, keys, values = rand(2, H, 1, C // H), rand(2, H, L, C // H), rand(2, H, L, C // H)
        cols = torch.arange(L)
        allowed = torch.stack([cols <= slot, (cols >= 2) & (cols < slot)]).view(2, 1, 1, L)
        sdpa = F_.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
        got.append((attend(q, keys, values, allowed, kernel), sdpa))
    return all(torch.allclose(mine, theirs, rtol=1e-5, atol=1e-5) for mine, theirs in got)


@functools.cache
def _built() -> tuple[Kernel | None, str]:
    """(the kernel or None, why not), built and checked on first use in this process."""
    return build(compiler(), cache_root())


def library() -> Kernel | None:
    """The kernel, built, checked and tuned on first use in this process; None where it cannot be (see
    `unavailable`)."""
    return _built()[0]


def unavailable() -> str | None:
    """Why `library()` is None (building it if that was not tried yet), or None when it is available."""
    lib, why = _built()
    return None if lib is not None else why


def reset() -> None:
    """Forget the loaded kernel: the next `library()` looks again (after $CC or $KVBENCH_CACHE_DIR change)."""
    _built.cache_clear()


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel | None = None
) -> torch.Tensor:
    """x (..., in) holding one row, contiguous; weight (out, in) contiguous; bias (out,) contiguous or None; all
    float32 on the CPU (model/matmul.py checks) -> (..., out). `kernel`: the one tuned for this machine unless given
    (scripts/cpu_matmul.py times every way of reading)."""
    n_out, n_in = weight.shape
    y = torch.empty(n_out, dtype=x.dtype)
    if kernel is None:
        kernel = library()
    assert kernel is not None, "model/matmul.py routes here only where the kernel was built"
    b = None if bias is None else bias.data_ptr()
    args = (weight.data_ptr(), x.data_ptr(), b, y.data_ptr(), n_out, n_in, torch.get_num_threads())
    _call(kernel.fn, "kvbench::gemv", *args, kernel.rows, kernel.prefetch)
    return y.view(*x.shape[:-1], n_out)


def ln_gemv(
    x: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """weight @ layer_norm(x) + bias for x (..., in) holding one row: the LayerNorm's weight and bias (in,), weight
    (out, in), bias (out,) or None, all contiguous float32 on the CPU -> (..., out). One call for ln_1 and c_attn, or
    ln_f and lm_head."""
    kernel = kernel if kernel is not None else library()
    assert kernel is not None and kernel.ln_fn is not None, "the model runs fused calls only where they were built"
    n_out, n_in = weight.shape
    buf = torch.empty(n_in + n_out, dtype=x.dtype)  # LN(x), then y
    ptr = buf.data_ptr()
    b = None if bias is None else bias.data_ptr()
    args = (x.data_ptr(), ln_weight.data_ptr(), ln_bias.data_ptr(), eps, weight.data_ptr(), b, ptr, ptr + 4 * n_in)
    _call(kernel.ln_fn, "kvbench::ln_gemv", *args, n_out, n_in, torch.get_num_threads(), kernel.rows, kernel.prefetch)
    return buf[n_in:].view(*x.shape[:-1], n_out)


Pair = tuple[torch.Tensor, torch.Tensor]  # a projection's (weight (out, in), bias (out,))


def block_tail(
    x: torch.Tensor,
    a: torch.Tensor,
    attn_proj: Pair,
    ln: tuple[torch.Tensor, torch.Tensor, float],
    fc: Pair,
    mlp_proj: Pair,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """A GPT-2 block after attention, for one row: x + c_proj(a), then that + mlp.c_proj(gelu(mlp.c_fc(ln_2(...)))).
    x, a (..., C) contiguous; `ln` ln_2's (weight, bias, eps); all float32 on the CPU -> (..., C)."""
    kernel = kernel if kernel is not None else library()
    assert kernel is not None and kernel.tail_fn is not None, "the model runs fused calls only where they were built"
    C, F = x.size(-1), fc[0].size(0)
    buf = torch.empty(3 * C + F, dtype=x.dtype)  # x1, LN(x1), the MLP's hidden row, y
    p = buf.data_ptr()
    args = (
        x.data_ptr(),
        a.data_ptr(),
        attn_proj[0].data_ptr(),
        attn_proj[1].data_ptr(),
        ln[0].data_ptr(),
        ln[1].data_ptr(),
        ln[2],
        fc[0].data_ptr(),
        fc[1].data_ptr(),
        mlp_proj[0].data_ptr(),
        mlp_proj[1].data_ptr(),
        p,
        p + 4 * C,
        p + 8 * C,
        p + 4 * (2 * C + F),
    )
    _call(kernel.tail_fn, "kvbench::block_tail", *args, C, F, torch.get_num_threads(), kernel.rows, kernel.prefetch)
    return buf[2 * C + F :].view(x.shape)


Layer = tuple[torch.Tensor, ...]  # step_static's 14 tensors of a layer, in gemv.c's table order (STEP_LAYER)
STEP_LAYER = (
    "ln_1 w, ln_1 b, c_attn W, c_attn b, K, V, c_proj W, c_proj b, ln_2 w, ln_2 b, c_fc W, c_fc b, mlp W, mlp b"
)
STEP_WIDTH = len(STEP_LAYER.split(", "))  # 14 a layer; K and V the fifth and sixth


def step_table(layers: list[Layer]) -> torch.Tensor:
    """step_static's table: the address of each layer's tensors, in STEP_LAYER's order (int64, 14 a layer)."""
    return torch.tensor([t.data_ptr() for layer in layers for t in layer], dtype=torch.int64)


def step_static(
    x: torch.Tensor,
    layers: list[Layer],
    slot: int,
    eps: float,
    ln_f: tuple[torch.Tensor, torch.Tensor],
    head: torch.Tensor,
    kernel: Kernel | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """A whole GPT-2 decode step for one row over static caches, to its logits: x (1, 1, C) the token's embedding;
    each layer's tensors as STEP_LAYER names them (matrices (out, in), K and V (1, H, L, Dh) buffers), the row's K/V
    written at column `slot` and attention reading columns [0, slot]; every LayerNorm's `eps`; ln_f's (weight,
    bias); head (V, C). All contiguous float32 on the CPU -> (1, 1, V). `table`: their addresses (`step_table`),
    where the caller kept them."""
    kernel = kernel if kernel is not None else library()
    assert kernel is not None and kernel.step_fn is not None, "the model runs fused calls only where they were built"
    k = layers[0][4]
    _, H, L, _ = k.shape
    C, F, V = x.size(-1), layers[0][10].size(0), head.size(0)
    table = step_table(layers) if table is None else table
    logits = torch.empty(V, dtype=x.dtype)
    scratch = torch.empty(8 * C + F + H * (slot + 1), dtype=x.dtype)
    args: tuple = (x.data_ptr(), table.data_ptr(), len(layers), L, slot, H, eps, ln_f[0].data_ptr(), ln_f[1].data_ptr())
    args += (head.data_ptr(), logits.data_ptr(), V, scratch.data_ptr(), C, F)
    _call(kernel.step_fn, "kvbench::step", *args, torch.get_num_threads(), kernel.rows, kernel.prefetch)
    global step_calls
    step_calls += 1
    return logits.view(1, 1, V)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, kernel: Kernel | None = None
) -> torch.Tensor:
    """SDPA with a boolean mask for one query a row, reading only the slots each row may see: q (B, H, 1, Dh); k, v
    (B, H, L, Dh) contiguous; allowed (B, 1, 1, L) bool contiguous, True where a slot is seen; all float32 on the
    CPU -> (B, H, 1, Dh). A row that sees no slot gets zeros, as SDPA gives on the CPU (torch 2.13)."""
    kernel = kernel if kernel is not None else library()
    assert kernel is not None and kernel.attend_fn is not None, "attention runs in C only where it was built"
    B, H, L, Dh = k.shape
    q = q.contiguous()  # (B, H, 1, Dh): c_attn's row seen per head is strided
    out = torch.empty(B, H, 1, Dh, dtype=q.dtype)
    scratch = torch.empty(B * H * L, dtype=q.dtype)  # each (row, head)'s scores
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), allowed.data_ptr(), out.data_ptr(), B, H, L, Dh)
    _call(kernel.attend_fn, "kvbench::attend", *args, scratch.data_ptr(), torch.get_num_threads())
    return out


def _call(fn: Callable[..., None], name: str, *args) -> None:
    """`fn(*args)`, named `name` for `bench --profile` where the profiler runs (a ctypes call is no operator)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            fn(*args)
    else:
        fn(*args)
