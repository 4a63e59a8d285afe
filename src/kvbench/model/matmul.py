"""How the model's projections run: one rule for every weight matrix of the forward (the four per block, lm_head).

At batch 1 a decode step is a matrix-vector product per weight matrix, so its time is how fast the kernel streams
the weights from memory. On the CPU, ATen sends `addmm` / `linear` to MKL, and on AMD's EPYC (AVX-512) MKL streams
these shapes at about half the memory's bandwidth: gpt2's 48 block matrices took 19.0 ms a step through MKL and
11.0 ms through oneDNN's inner product, the lm_head (50,257 x 768, 154 MB) 10.9 vs 3.7 ms (2-core AMD EPYC, fp32,
2 threads, 2026-12-05; scripts/cpu_matmul.py measures it on any machine). oneDNN picks its kernels by the ISA the
CPU reports, not by its vendor, and is what Inductor itself calls for a CPU linear. For one row in float32 (a decode
step at batch 1) kvbench's own GEMV (model/gemv.py) streams faster still and costs a fifth of oneDNN's call.

So on the CPU, in float32 or bfloat16, when no gradient is wanted (and, under torch.compile, only where the weights
are frozen: `frozen_weights`), a projection is
- route "gemv" (the default): one float32 row, contiguous, over a contiguous (out, in) weight: model/gemv.py's
  kernel, outside torch.compile and, as the operator `kvbench::gemv` (model/operators.py), inside
  `--compile max`'s frozen step;
  anything else as "onednn". Where the kernel cannot be built, the route is "onednn";
- route "onednn": oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`) over an (out, in) weight.
Both stream that layout only: over Conv1D's (in, out) matrix seen transposed oneDNN is no faster than MKL
(17.5 GB/s). So a model loaded for the CPU lays its Conv1D weights out (out, in) in memory (`out_in_layout`,
GPT.lay_out): the parameter keeps GPT-2's (in, out) shape, names and values, as a transposed view of that storage,
so checkpoints port as before. Everywhere else (CUDA, fp16, training, `--compile default`'s tracing, a torch
without oneDNN) a projection is ATen's `addmm`. All accumulate fp32 in fp32 and differ by rounding only (verify
holds every cache to transformers at 1e-5 on each).

On the gemv route the one-row step goes further (`fused_row`; model/gpt2.py decides which modules): over static
caches the whole step is one C call; over any other cache, ln_1 with c_attn, and everything after attention (c_proj,
the residual, ln_2, the MLP and its residual), are one C call each, and ln_f with lm_head one more.

`KVBENCH_CPU_MATMUL=onednn` or `aten` (or `set_route`) chooses another route, for an A/B of the same step.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvbench.errors import KVBenchError
from kvbench.model import gemv, operators

ROUTE_ENV = "KVBENCH_CPU_MATMUL"
ROUTES = ("gemv", "onednn", "aten")
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
_route: str | None = None  # None: read ROUTE_ENV on first use
_frozen = False  # inside `frozen_weights`: Inductor traces a step whose weights are constants
_frozen_gemv = False  # and one-row projections there are kvbench's GEMV, as the operator kvbench::gemv


@contextmanager
def frozen_weights() -> Iterator[None]:
    """Around a compiled step whose weights Inductor freezes (`--compile max`): the oneDNN route is traced too, and
    Inductor lowers it to its C++ GEMM templates over the packed constant weights (on gpt2, 2-core AMD EPYC, fp32:
    12.8 ms a decode step against 18.3 ms tracing ATen's addmm, 2026-12-05). Inductor lowers the op only over
    constant weights, so a step that reads the weights as inputs (`--compile default`) traces addmm. On the gemv
    route a one-row float32 projection there is kvbench's GEMV instead, as the operator `kvbench::gemv` that
    Inductor calls and cannot see into: its templates streamed gpt2's matrices at 24-26 GB/s where the GEMV
    streams at 0.9-0.97x a sum's rate (docs/performance.md). Whether the kernel is built is decided here, outside
    the trace."""
    global _frozen, _frozen_gemv
    before = _frozen, _frozen_gemv
    # route() builds the kernel, or falls back, on first use; prepare() loads the operator's C++ kernel
    _frozen, _frozen_gemv = True, route() == "gemv" and operators.prepare()
    try:
        yield
    finally:
        _frozen, _frozen_gemv = before


def route() -> str:
    """The CPU route in use: "gemv", "onednn" or "aten" (ROUTE_ENV, read on first use)."""
    return _route if _route is not None else set_route(None)


def set_route(name: str | None) -> str:
    """Choose the CPU route ("gemv", "onednn" or "aten"; None: as ROUTE_ENV says, default gemv) and return the one
    that runs: "gemv" where its kernel cannot be built is "onednn" (gemv.unavailable() says why), and either in a
    torch without oneDNN (some ARM builds) is "aten"."""
    global _route
    chosen = name if name is not None else os.environ.get(ROUTE_ENV, "").strip().lower() or "gemv"
    if chosen not in ROUTES:
        raise KVBenchError(f"{ROUTE_ENV}={chosen!r}: expected one of {', '.join(ROUTES)}")
    if not torch.backends.mkldnn.is_available():
        chosen = "aten"  # gemv runs beside oneDNN (prefill, batches), and neither is there
    elif chosen == "gemv" and gemv.library() is None:
        chosen = "onednn"
    _route = chosen
    return chosen


def out_in_layout(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights on `device` in `dtype` should be stored (out, in) in memory: where gemv or oneDNN runs."""
    return device.type == "cpu" and dtype in _ONEDNN_DTYPES and route() != "aten"


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in _ONEDNN_DTYPES
        and weight.dtype == x.dtype
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))  # no backward there
        and (_frozen or not torch.compiler.is_compiling())  # traced only where Inductor can lower it
        and route() != "aten"
    )


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Where kvbench's GEMV runs, given the oneDNN route's conditions: one float32 row and contiguous operands, on
    the gemv route; in a traced step only where `frozen_weights` says (as an operator: a ctypes call is opaque to
    torch.compile)."""
    return (
        route() == "gemv"
        and x.dtype == torch.float32
        and x.numel() == x.size(-1) == weight.size(1)  # one row, of the weight's width: the kernel trusts both
        and x.is_contiguous()
        and weight.is_contiguous()
        and (bias is None or (bias.is_contiguous() and bias.dtype == torch.float32 and bias.shape == weight.shape[:1]))
        and (_frozen_gemv or not torch.compiler.is_compiling())
    )


def fused_row(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Where the one-row step may run as gemv.py's fused calls (the whole step; a LayerNorm and c_attn; everything
    after attention; ln_f and lm_head): the gemv route, one float32 row on the CPU, contiguous, with every weight of
    the call (out, in) contiguous, and no gradient wanted, outside torch.compile. The model decides which of its
    modules may be fused (Block._stock, GPT._fused_head, GPT._fused_step); this says where the product may be."""
    return (
        route() == "gemv"
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.numel() == x.size(-1)
        and x.is_contiguous()
        and all(w.dtype == torch.float32 and w.is_contiguous() for w in weights)
        and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))
        and not torch.compiler.is_compiling()
        and (kernel := gemv.library()) is not None
        and kernel.tail_fn is not None
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias: x (..., in), weight (out, in) in any strides, bias (out,) -> (..., out)."""
    if _onednn(x, weight):
        if _gemv(x, weight, bias):
            if torch.compiler.is_compiling():  # `--compile max`'s step (frozen_weights)
                return torch.ops.kvbench.gemv(x, weight, bias)
            return gemv.gemv(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    *lead, n_in = x.shape
    x2 = x.reshape(-1, n_in)  # (N, in)
    y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())  # (N, out)
    return y.view(*lead, y.size(-1))
