"""What a torch.cat cache copies while a sequence grows: the closed form, and the common approximation of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.memory.formats import get_kv_format
from kvbench.memory.formulas import layer_bytes_per_token, token_bytes
from kvbench.memory.spec import ModelSpec
from kvbench.memory.units import fmt_bytes, fmt_int


@dataclass
class CopyTraffic:
    """The bytes a torch.cat cache copies while a sequence grows from n0 to n1 tokens, one token per step."""

    n0: int  # tokens in the cache after prefill
    n1: int  # tokens at the end
    batch: int  # sequences
    bytes_per_token: int  # cache bytes per token over all layers
    exact_bytes: int  # bytes/token x (n0 + (n0+1) + ... + (n1-1)) x batch (windowed layers capped)
    seed_approx_bytes: int  # the approximation bytes/token x (n1^2 - n0^2) / 2 x batch
    measured_bytes: int | None = None  # the `dynamic` cache's own bytes_copied counter, when it was run
    counter_note: str = ""  # where the counter ran, or why it did not
    working: list[str] = field(default_factory=list)  # the arithmetic


def _sum_held(n0: int, n1: int, window: int | None) -> int:
    """sum over t = n0 .. n1-1 of min(t, window): the history tokens re-copied, step by step."""

    def s(a: int, b: int) -> int:  # a + (a+1) + ... + (b-1)
        return (b - a) * (a + b - 1) // 2 if b > a else 0

    if window is None or window >= n1:
        return s(n0, n1)
    cut = max(n0, window)
    return s(n0, cut) + window * (n1 - cut)


def copy_traffic(spec: ModelSpec, n0: int, n1: int, batch: int = 1, kv_dtype: str = "fp16") -> CopyTraffic:
    """Closed form of what `torch.cat([k_past, k], dim=2)` copies growing the cache from n0 to n1 tokens.

    Step t (t tokens cached) copies all t tokens of K and V history in every layer into a new tensor, so the total is
    bytes_per_token_per_layer x sum over layers of (n0 + ... + n1-1) = bytes/token x (n1 - n0)(n0 + n1 - 1) / 2;
    the seed rounds it to bytes/token x (n1^2 - n0^2) / 2.
    """
    assert 0 <= n0 < n1 and batch >= 1, (n0, n1, batch)  # validate.memory_rules
    fmt = get_kv_format(kv_dtype)
    per_token = token_bytes(spec, fmt)
    windowed = set(spec.sliding_layers)
    exact = batch * sum(
        layer_bytes_per_token(spec, fmt, None, i)
        * _sum_held(n0, n1, spec.sliding_window if i in windowed else None)
        for i in range(spec.n_layers)
    )
    approx = per_token * (n1 * n1 - n0 * n0) // 2 * batch
    steps = (n1 - n0) * (n0 + n1 - 1) // 2
    b = f" x {batch} sequences" if batch > 1 else ""
    working = [
        f"step t copies the t cached tokens of K and V in every layer; t = {n0} .. {n1 - 1}",
        f"exact: {fmt_int(per_token)} B/token x ({n1} - {n0})({n0} + {n1} - 1)/2 = {fmt_int(per_token)} x "
        f"{fmt_int(steps)}{b} = {fmt_int(exact)} B = {fmt_bytes(exact)}"
        + ("   [windowed layers capped at the window]" if spec.sliding_layers else ""),
        f"seed's approximation: {fmt_int(per_token)} B/token x ({n1}^2 - {n0}^2)/2{b} = {fmt_int(approx)} B = "
        f"{fmt_bytes(approx)}",
    ]
    return CopyTraffic(n0, n1, batch, per_token, exact, approx, working=working)
