"""The decode floor a plan predicts: the bytes one decode step must move, over the memory's bandwidth.

A decode step reads every weight once and the K/V of every sequence at its context, and writes this token's K/V;
with little arithmetic per byte, it cannot run faster than

    floor = (weights + K/V read + K/V write) / bandwidth        per GPU, every GPU in parallel under tensor parallel

so `batch / floor` is a ceiling on tokens per second for the batch (and `1 / floor` per sequence). The terms match
the ones `kvbench bench` calls step bytes (bench/floor.py): K/V read is the cache at `ctx` tokens (this step's
token included), the write is one more token's K/V. Not counted: activations, logits, the design's own extra
traffic (copies, dequantisation), tensor-parallel communication, and the re-write of a recurrent state (it is read
once, as part of the cache). Weights are all the parameters, once: a step reads only its batch's rows of an input
embedding table (bench counts those rows), and an MoE step reads only the experts its tokens route to.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.memory.bandwidth import PeakBandwidth, rate_working
from kvbench.memory.formats import get_kv_format
from kvbench.memory.formulas import bytes_per_sequence
from kvbench.memory.units import fmt_bytes, fmt_int, fmt_tokens


@dataclass
class DecodeFloor:
    """One context and batch: the bytes a decode step moves on one GPU, and the time and rate they allow."""

    weights_bytes: int  # weights on one GPU, each read once per step
    kv_read_bytes: int  # the cache of every sequence at ctx on one GPU (K/V, and any recurrent state)
    kv_write_bytes: int  # this step's token: its K/V for every sequence on one GPU
    step_bytes: int  # weights + kv_read + kv_write
    bandwidth: int  # bytes/s divided by
    floor_ms: float  # step_bytes / bandwidth, in milliseconds: no step is faster
    tokens_per_s_per_sequence: float  # 1 / floor: each sequence gains one token per step
    tokens_per_s: float  # batch / floor: the whole batch's tokens per second (aggregate)
    working: str  # the arithmetic with the numbers substituted


def floor_for(
    batch: int, ctx: int, weights: int, kv_read: int, write_per_seq: int, bw: PeakBandwidth
) -> DecodeFloor:
    """The floor of one step of `batch` sequences at `ctx` tokens, from per-GPU bytes."""
    write = batch * write_per_seq
    total = weights + kv_read + write
    seconds = total / bw.bytes_per_s
    per_seq = 1 / seconds
    working = (
        f"  decode floor at {fmt_tokens(ctx)} x {batch}: (weights {fmt_int(weights)} B + K/V read {fmt_int(kv_read)} B "
        f"+ K/V write {batch} x {fmt_int(write_per_seq)} B) = {fmt_int(total)} B ({fmt_bytes(total)}) / "
        f"{fmt_int(bw.bytes_per_s)} B/s = {seconds * 1e3:.4g} ms per step; 1 / {seconds * 1e3:.4g} ms = "
        f"{per_seq:,.4g} tokens/s per sequence, x {batch} = {batch * per_seq:,.4g} tokens/s aggregate"
    )
    return DecodeFloor(
        weights_bytes=weights, kv_read_bytes=kv_read, kv_write_bytes=write, step_bytes=total,
        bandwidth=bw.bytes_per_s, floor_ms=seconds * 1e3, tokens_per_s_per_sequence=per_seq,
        tokens_per_s=batch * per_seq, working=working,
    )  # fmt: skip


def attach_floors(plan, bw: PeakBandwidth | None) -> None:
    """Give every row of `plan` (a ModelPlan) its decode floor, and the plan the line saying how; a model without
    a parameter count gets a note instead (its weights, most of a step's bytes, are unknown)."""
    if bw is None:
        return
    plan.bandwidth = bw
    if plan.weights_bytes is None:
        plan.notes.append("no parameter count for this model, so no decode floor (its weights are unknown)")
        return
    spec, fmt = plan.model, get_kv_format(plan.kv_dtype)
    weights = -(-plan.weights_bytes // plan.tp)
    write = bytes_per_sequence(spec, fmt, 1, plan.kv_heads_per_gpu) if spec.kv_cache else 0
    where = " per GPU, every GPU at once (communication not counted)" if plan.tp > 1 else ""
    plan.working.append(
        f"decode floor per step = (weights + K/V of every sequence at the context + this token's K/V write "
        f"{fmt_int(write)} B per sequence){where} / bandwidth {rate_working(bw)}"
    )
    for r in plan.rows:
        r.decode_floor = floor_for(r.batch, r.ctx, weights, r.bytes_per_gpu, write, bw)
        r.working.append(r.decode_floor.working)
