"""Time a gpt2 decode step's matrix-vector products on this CPU, route by route: what model/matmul.py chooses from.

    python scripts/cpu_matmul.py                  # gpt2's shapes, this machine's threads
    python scripts/cpu_matmul.py --threads 2 --copies 3 --repeats 20

At batch 1 each weight matrix is read once per token, so each route's time is how fast its kernel streams the
weights from memory. Measured, per step, with the same random fp32 weights in every route:

    blocks   the 48 block matrices (12 layers x c_attn 768x2304, attn c_proj 768x768, c_fc 768x3072, mlp c_proj
             3072x768), 340 MB
    lm_head  the tied output layer, 50,257 x 768, 154 MB

through these routes:

    aten (in, out)      torch.addmm over Conv1D's (in, out) matrix: what ATen (MKL on x86) runs for GPT-2 as stored
    aten (out, in)      torch.nn.functional.linear over an (out, in) copy
    onednn (in, out)^T  oneDNN's inner product (mkldnn._linear_pointwise) over the (in, out) matrix seen transposed
    onednn (out, in)    the same over an (out, in) matrix: model/matmul.py's route "onednn"
    gemv R rows, K KiB  kvbench's own kernel (model/gemv.py) over an (out, in) matrix, each way it can read the
                        rows (R side by side, prefetching K KiB ahead); `*` marks the way tuned for this machine,
                        the default route's (the rows are left out, with the reason, where it does not build)

and then what a small operator costs in an eager step: a LayerNorm of one row (gpt2's, 768 wide) timed alone, and
right after each block GEMV, whose stream of weights has evicted from the caches what the LayerNorm's call reads.

`--copies` sets of weights are cycled so that no call finds its matrix in the last-level cache (a decode step reads
~500 MB between two reads of one matrix). Median and range of `--repeats` timed passes after `--warmup`; GB/s is the
bytes read over the median. Prints one table and a line; writes nothing.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from kvbench.model import gemv

C, V, LAYERS = 768, 50257, 12
SHAPES = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]  # (in, out) of c_attn, attn c_proj, c_fc, mlp c_proj


def _timed(fn, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def _layer_norm_cold(gemvs: list, repeats: int) -> tuple[float, float]:
    """Median us of a one-row LayerNorm alone, and right after each of `gemvs` (calls that take no argument)."""
    ln = torch.nn.LayerNorm(C)
    x = torch.randn(1, 1, C)
    alone, after = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        ln(x)
        alone.append((time.perf_counter() - t) * 1e6)
    for _ in range(max(1, repeats // 5)):
        for call in gemvs:
            call()
            t = time.perf_counter()
            ln(x)
            after.append((time.perf_counter() - t) * 1e6)
    return statistics.median(alone), statistics.median(after)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--copies", type=int, default=3, help="weight sets cycled, so none is read from cache")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    for flag, value in (("--copies", args.copies), ("--repeats", args.repeats), ("--threads", args.threads)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("error: this torch has no oneDNN (torch.backends.mkldnn); only ATen's route exists here")
    torch.manual_seed(0)
    # copies x layers x 4 matrices, each (in, out) as GPT-2's Conv1D stores it, and its (out, in) transpose
    w_io = [[[torch.randn(i, o) * 0.02 for i, o in SHAPES] for _ in range(LAYERS)] for _ in range(args.copies)]
    w_oi = [[[w.t().contiguous() for w in layer] for layer in copy] for copy in w_io]
    bias = [torch.zeros(o) for _, o in SHAPES]
    head_oi = [torch.randn(V, C) * 0.02 for _ in range(args.copies)]  # wte: (vocab, C), the lm_head as (out, in)
    head_io = [h.t().contiguous() for h in head_oi]
    x = {C: torch.randn(1, C), 4 * C: torch.randn(1, 4 * C)}
    lp = torch.ops.mkldnn._linear_pointwise

    def blocks(op, weights):
        turn = [0]

        def run():
            for layer in weights[turn[0] % len(weights)]:
                for w, (n_in, _), b in zip(layer, SHAPES, bias, strict=True):
                    op(x[n_in], w, b)
            turn[0] += 1

        return run

    def head(op, weights):
        turn = [0]

        def run():
            op(x[C], weights[turn[0] % len(weights)], None)
            turn[0] += 1

        return run

    def addmm(xx, w, b):
        return torch.mm(xx, w) if b is None else torch.addmm(b, xx, w)

    routes = {
        "aten (in, out)": (addmm, w_io, head_io),
        "aten (out, in)": (torch.nn.functional.linear, w_oi, head_oi),
        "onednn (in, out)^T": (lambda xx, w, b: lp(xx, w.t(), b, "none", [], ""), w_io, head_io),
        "onednn (out, in)": (lambda xx, w, b: lp(xx, w, b, "none", [], ""), w_oi, head_oi),
    }
    kernel = gemv.library()
    if kernel is not None:
        for way in gemv.WAYS:
            mark = "*" if way == (kernel.rows, kernel.prefetch) else ""
            name = f"gemv {way[0]} row{'s' * (way[0] > 1)}, {way[1] >> 10} KiB{mark}"
            routes[name] = (functools.partial(gemv.gemv, kernel=gemv.Kernel(kernel.fn, *way)), w_oi, head_oi)
    block_mb = sum(i * o for i, o in SHAPES) * LAYERS * 4 / 1e6
    head_mb = V * C * 4 / 1e6
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"gpt2 fp32 batch-1 projections, {torch.get_num_threads()} threads, {cpu}, torch {torch.__version__}")
    print(f"{'route':<22} {'48 block GEMVs, ms':<20} {'GB/s':>5}   {'lm_head, ms':<17} {'GB/s':>5}")
    with torch.inference_mode():
        for name, (op, w_blocks, w_head) in routes.items():
            tb = _timed(blocks(op, w_blocks), args.warmup, args.repeats)
            th = _timed(head(op, w_head), args.warmup, args.repeats)
            mb, mh = statistics.median(tb), statistics.median(th)
            cells = (f"{mb:.2f} ({min(tb):.1f}-{max(tb):.1f})", f"{mh:.2f} ({min(th):.1f}-{max(th):.1f})")
            print(f"{name:<22} {cells[0]:<20} {block_mb / mb:5.1f}   {cells[1]:<17} {head_mb / mh:5.1f}")
        project = torch.nn.functional.linear if kernel is None else gemv.gemv  # the default route
        calls = [
            functools.partial(project, x[n_in], w, b)
            for copy in w_oi
            for layer in copy
            for w, (n_in, _), b in zip(layer, SHAPES, bias, strict=True)
        ]
        warm, cold = _layer_norm_cold(calls, args.repeats)
    if kernel is None:
        print(f"gemv (out, in): not run, {gemv.unavailable()}")
    print(f"a LayerNorm of one row: {warm:.1f} us alone, {cold:.1f} us right after each block GEMV (medians)")


if __name__ == "__main__":
    main()
