"""The `int8` cache: keys and values stored as int8 with one scale per token per head, dequantised for attention.

Layout (per layer, preallocated like the static cache):
    k_q, v_q          int8   (B, H, max_len, Dh)
    k_scale, v_scale  (B, H, max_len, 1), fp16 when the model runs in fp16, else fp32
Quantisation is symmetric absmax per (sequence, head, token) row of Dh values:
    scale = max|x| / 127,   q = round(x / scale) clamped to [-127, 127],   x' = q * scale
so |x - x'| <= scale / 2 for every element (scale is rounded to its storage dtype first and q computed from the
stored scale, so the bound holds for what is stored). A row of zeros gets scale 0 and dequantises to zeros.

Memory per token per head: Dh bytes + one scale, against 2 * Dh bytes in fp16. For GPT-2 (Dh = 64) with fp16 scales
that is 66 / 128 = 0.516 of an fp16 cache (0.266 of an fp32 cache with fp32 scales: 68 / 256).

Not exact: attention reads x', not x. The tolerance `verify` applies to it is set in its SPEC below from
the measurements in docs/performance.md. The dequantised (B, H, S, Dh) copy is built every step; `bytes_copied`
counts it, as it counts torch.cat's copy.
"""

from __future__ import annotations

import copy

import torch

from kvbench.caches.base import CacheSpec, LayerCache, Traffic
from kvbench.model.gpt2 import GPTConfig

QMAX = 127  # symmetric: -127..127 (-128 unused, so the range is symmetric around zero)


def scale_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """fp16 scales for an fp16 model (2 bytes); fp32 otherwise (bf16's 8-bit mantissa is too coarse for a scale)."""
    return torch.float16 if dtype == torch.float16 else torch.float32


def quantize(x: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., Dh) -> (q int8 (..., Dh), scale (..., 1) in scale_dtype), symmetric absmax over the last dim."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).to(scale_dtype)  # (..., 1), rounded as stored
    s = scale.float()
    q = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    q = q.round().clamp(-QMAX, QMAX).to(torch.int8)  # (..., Dh)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., Dh) int8, scale (..., 1) -> (..., Dh) in dtype."""
    return (q.float() * scale.float()).to(dtype)


class Int8Cache(LayerCache):
    """Preallocated int8 K/V with per-token, per-head scales; update returns dequantised (B, H, length, Dh) tensors."""

    def __init__(self, batch, n_head, max_len, head_dim, dtype, device) -> None:
        super().__init__()
        self.dtype = dtype
        self.k_q = torch.zeros(batch, n_head, max_len, head_dim, dtype=torch.int8, device=device)  # (B, H, L, Dh)
        self.v_q = torch.zeros_like(self.k_q)
        sdt = scale_dtype_for(dtype)
        self.k_scale = torch.zeros(batch, n_head, max_len, 1, dtype=sdt, device=device)  # (B, H, L, 1)
        self.v_scale = torch.zeros_like(self.k_scale)
        self.capacity = max_len

    def update(self, k, v, positions):
        start, end = self.check_capacity(k.size(2), "int8")
        for x, q_buf, s_buf in ((k, self.k_q, self.k_scale), (v, self.v_q, self.v_scale)):
            q, s = quantize(x, s_buf.dtype)  # (B, H, T, Dh), (B, H, T, 1)
            q_buf[:, :, start:end].copy_(q)
            s_buf[:, :, start:end].copy_(s)
        self.length = end
        k_out = dequantize(self.k_q[:, :, :end], self.k_scale[:, :, :end], self.dtype)  # (B, H, end, Dh)
        v_out = dequantize(self.v_q[:, :, :end], self.v_scale[:, :, :end], self.dtype)
        self.bytes_copied += k_out[:, :, :start].nbytes + v_out[:, :, :start].nbytes  # history re-materialised
        return k_out, v_out

    # The lifecycle acts on the stored int8 values and scales: exact for what is stored (nothing re-quantised).
    _BUFFERS = ("k_q", "v_q", "k_scale", "v_scale")

    def crop(self, length: int) -> None:
        self.length = self.check_crop(length)  # update dequantises the first `length` columns only

    def fork(self) -> Int8Cache:
        other = copy.copy(self)
        for name in self._BUFFERS:
            setattr(other, name, getattr(self, name).clone())
        return other

    def reorder(self, index: torch.Tensor) -> None:
        idx = self.check_index(index, self.k_q.size(0), self.k_q.device)
        for name in self._BUFFERS:  # (len(idx), H, L, Dh) and (len(idx), H, L, 1), new tensors
            setattr(self, name, getattr(self, name).index_select(0, idx))

    @property
    def nbytes(self) -> int:
        return self.k_q.nbytes + self.v_q.nbytes + self.k_scale.nbytes + self.v_scale.nbytes


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What the cache stores for K or V (B, H, T, Dh), as attention reads it: quantised per (sequence, head, token)
    row with its scale in the scale dtype, then dequantised (the declaration verify holds it to)."""
    q, scale = quantize(x, scale_dtype_for(x.dtype))
    return dequantize(q, scale, x.dtype)


def make_int8_cache(config: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device) -> Int8Cache:
    return Int8Cache(batch, config.n_head, max_len, config.head_dim, dtype, device)


SPEC = CacheSpec(
    "int8",
    "int8 K/V with per-token, per-head absmax scales, dequantised for attention (lossy)",
    make_int8_cache,
    exact=False,
    roundtrip=roundtrip,
    # Measured in fp32 on random weights (docs/performance.md): max |logit error| 0.0017-0.09, at most 1.5% of
    # the logit scale, and greedy agreement >= 0.98 (every flip a near-tie) over gpt2 (std 0.02 and 0.05),
    # gpt2-tiny (std 0.02 and 0.1) and the test config. A real bug (wrong slot, lost scale) moves logits by O(1).
    logit_atol=0.1,
    logit_rtol=0.05,
    min_greedy_agreement=0.9,
    traffic=Traffic(
        "reads int8 + scales of L slots, writes one dequantised copy in the model's dtype (attention reads it)",
        extra=lambda L, slot, q8: L * q8 + L * slot,
        write=lambda slot, q8: q8,
    ),
    memory_note="int8 values plus one scale per token per head (fp16 scales for an fp16 model, fp32 otherwise)",
    storage_dtype="int8",
)
