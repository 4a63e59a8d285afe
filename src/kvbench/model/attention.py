"""Attention for the model's forward: torch's SDPA, and where `--compile max` traces a CPU decode step, kvbench's own.

Under `--compile max` Inductor generates every kernel of the step but attention, which it hands to ATen's CPU flash
SDPA: with a mask over a static cache's whole buffer, that read gpt2's 40 MB of K/V in 2.82 ms of a 21.6 ms step,
against 1.76-2.12 ms in the eager step's C (2-core Intel Xeon, prompt 512, 2026-12-07; docs/performance.md). So in
that trace a one-query attention over float32 CPU buffers is the operator `kvbench::decode_attention`
(model/operators.py), gemv.c's `kv_attend_f32` behind it: Inductor sees an opaque call with SDPA's inputs and output, and every matrix product
stays its own. Elsewhere (eager, `--compile default`, CUDA, a prefill, a mask that is not boolean) attention is SDPA.
gemv.py checks the kernel against SDPA before first use; where the library is not built, attention is SDPA.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from kvbench.model import gemv, operators

_own = False  # inside `own_attention`, with the kernel built


@contextmanager
def own_attention() -> Iterator[None]:
    """Around a step `--compile max` traces and runs: one-query attention there is kvbench's where the kernel is
    built. Decided here, outside the trace (Dynamo would trace the build's file checks)."""
    global _own
    kernel = gemv.library()
    before, _own = _own, kernel is not None and kernel.attend_fn is not None and operators.prepare()
    try:
        yield
    finally:
        _own = before


def _in_c(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> bool:
    """Where kvbench's attention runs: inside `--compile max`'s trace, one float32 query a row on the CPU over
    contiguous K/V buffers, under a boolean mask (B, 1, 1, L), no gradient wanted."""
    B, H, T, Dh = q.shape
    return (
        _own
        and torch.compiler.is_compiling()
        and T == 1
        and not is_causal
        and q.device.type == "cpu"
        and all(t.dtype == torch.float32 for t in (q, k, v))
        and k.shape == v.shape
        and k.shape[:2] == (B, H)
        and k.size(3) == Dh
        and k.is_contiguous()
        and v.is_contiguous()
        and mask is not None
        and mask.dtype == torch.bool
        and mask.shape == (B, 1, 1, k.size(2))
        and mask.is_contiguous()
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh) under `mask` or the causal rule) v: q (B, H, T, Dh), k and v (B, H, S, Dh), mask
    None or SDPA's (B, 1, T, S) -> (B, H, T, Dh)."""
    if _in_c(q, k, v, mask, is_causal):
        assert mask is not None
        return torch.ops.kvbench.decode_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
