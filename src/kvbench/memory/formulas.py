"""The cache arithmetic: bytes per token per layer, per sequence, per GPU under tensor parallelism, and its working.

    bytes/token = 2 (K and V) x layers x kv_heads x head_dim x bytes(dtype)          (MHA, GQA, MQA)
    bytes/token = (kv_lora_rank + qk_rope_head_dim) x layers x bytes(dtype)          (MLA: one latent, no K/V per head)

A sequence of n tokens holds n tokens in a full-attention layer and min(n, window) in a sliding-window or chunked
layer, so per-sequence bytes add the two kinds of layer. Quantized formats add their per-group scales.
"""

from __future__ import annotations

from kvbench.errors import KVBenchError
from kvbench.memory.formats import KVFormat
from kvbench.memory.spec import ModelSpec
from kvbench.memory.units import fmt_bytes, fmt_int


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    """KV heads on each of tp GPUs: split evenly, or one (replicated) per GPU when tp exceeds the KV heads."""
    if tp < 1:
        raise KVBenchError(f"--tp {tp} must be at least 1")
    if not spec.kv_cache:
        return 0  # no attention layer: nothing per head to split
    if spec.n_heads % tp:
        raise KVBenchError(
            f"--tp {tp}: {spec.name} has {spec.n_heads} attention heads, not divisible by {tp}"
        )
    if spec.is_mla:
        return spec.n_kv_heads  # unused: the latent is not per head
    if spec.n_kv_heads >= tp:
        if spec.n_kv_heads % tp:
            raise KVBenchError(f"--tp {tp}: {spec.n_kv_heads} KV heads of {spec.name} do not split evenly")
        return spec.n_kv_heads // tp
    if tp % spec.n_kv_heads:
        raise KVBenchError(f"--tp {tp} is not a multiple of {spec.name}'s {spec.n_kv_heads} KV heads")
    return 1


def layer_bytes_per_token(
    spec: ModelSpec, fmt: KVFormat, kv_heads: int | None = None, layer: int | None = None
) -> int:
    """Bytes one layer caches per token (kv_heads: the heads one GPU holds, default all; layer: that layer's own
    shape where layers differ, spec.layer_kv; None: the model-wide shape)."""
    vectors, n = spec.layer_vectors(kv_heads, layer)
    return vectors * fmt.vector_bytes(n)


def token_bytes(spec: ModelSpec, fmt: KVFormat, kv_heads: int | None = None) -> int:
    """Bytes one token adds to the cache over every layer."""
    if not spec.layer_kv:
        return layer_bytes_per_token(spec, fmt, kv_heads) * spec.n_layers
    return sum(layer_bytes_per_token(spec, fmt, kv_heads, i) for i in range(spec.n_layers))


def bytes_per_sequence(spec: ModelSpec, fmt: KVFormat, ctx: int, kv_heads: int | None = None) -> int:
    """Cache bytes of one sequence of ctx tokens: each layer holds ctx tokens, or its window."""
    if not spec.layer_kv:
        return layer_bytes_per_token(spec, fmt, kv_heads) * spec.held(ctx)
    return sum(
        layer_bytes_per_token(spec, fmt, kv_heads, i) * spec.tokens_held(i, ctx) for i in range(spec.n_layers)
    )


def state_element_bytes(fmt: KVFormat) -> int:
    """Bytes of one recurrent-state element: --kv-dtype when it is a plain float format (fp32, fp16, bf16); the
    quantized cache formats (fp8, int8, int4) do not apply to a recurrent state, which stays at 16 bits."""
    return fmt.bits // 8 if fmt.group_size is None and fmt.bits >= 16 else 2


def state_bytes(spec: ModelSpec, fmt: KVFormat, tp: int = 1) -> int:
    """One sequence's recurrent state (0 when there is none, or it is not sized), split evenly over tp GPUs."""
    if not spec.state_elements:
        return 0
    return -(-spec.state_elements * state_element_bytes(fmt) // tp)


def state_working(spec: ModelSpec, fmt: KVFormat) -> str:
    """The recurrent state's bytes per sequence, as arithmetic."""
    if spec.state_elements is None:
        return f"recurrent state: {spec.state_working} (not counted below)"
    b = state_element_bytes(fmt)
    total = spec.state_elements * b
    held = fmt.name if b * 8 == fmt.bits else f"16-bit: --kv-dtype {fmt.name} applies to K/V only"
    return (
        f"recurrent state: {spec.state_working} x {b} B ({held}) = {fmt_int(total)} B = {fmt_bytes(total)} per "
        "sequence, the same at any context"
    )


def per_token_working(spec: ModelSpec, fmt: KVFormat, kv_heads: int, total: int, label: str) -> str:
    """The per-token formula with this model's numbers, one line."""
    if spec.is_mla:
        n = spec.kv_lora_rank + spec.qk_rope_head_dim
        return (
            f"{label}: ({spec.kv_lora_rank} kv_lora_rank + {spec.qk_rope_head_dim} qk_rope_head_dim) x "
            f"{spec.n_layers} layers x {fmt.working(n) if fmt.group_size else f'{fmt.bits / 8:g} B'} ({fmt.name})"
            f" = {fmt_int(total)} B = {fmt_bytes(total)}   [MLA: one latent per token per layer, no factor 2, "
            f"no KV heads]"
        )
    if spec.layer_kv:
        return _per_layer_working(spec, fmt, kv_heads, total, label)
    heads = f"{kv_heads} kv_heads" + (f" (of {spec.n_kv_heads})" if kv_heads != spec.n_kv_heads else "")
    if fmt.group_size:
        vec = f"{fmt.working(spec.head_dim)} per {spec.head_dim}-element head vector"
        return (
            f"{label}: 2 (K and V) x {spec.n_layers} layers x {heads} x {vec} ({fmt.name}) = "
            f"{fmt_int(total)} B = {fmt_bytes(total)}"
        )
    return (
        f"{label}: 2 (K and V) x {spec.n_layers} layers x {heads} x {spec.head_dim} head_dim x "
        f"{fmt.bits / 8:g} B ({fmt.name}) = {fmt_int(total)} B = {fmt_bytes(total)}"
    )


def _per_layer_working(spec: ModelSpec, fmt: KVFormat, kv_heads: int, total: int, label: str) -> str:
    """The per-token formula of a model whose layers differ in K/V shape: one term per distinct shape."""
    counts: dict[tuple[int, int], int] = {}
    for i in range(spec.n_layers):
        shape = spec.layer_shape(i, kv_heads)
        counts[shape] = counts.get(shape, 0) + 1
    size = lambda d: fmt.working(d) if fmt.group_size else f"{d} head_dim x {fmt.bits / 8:g} B"  # noqa: E731
    terms = " + ".join(f"{n} layers x {h} kv_heads x {size(d)}" for (h, d), n in counts.items())
    return f"{label}: 2 (K and V) x ({terms}) ({fmt.name}) = {fmt_int(total)} B = {fmt_bytes(total)}"


def tp_working(spec: ModelSpec, fmt: KVFormat, tp: int, kvh: int, per_token: int) -> str:
    """How the per-token bytes divide over tp GPUs (MLA's latent does not)."""
    if spec.is_mla:
        return (
            f"per GPU (tp {tp}): the MLA latent is shared by all heads, so tensor parallelism cannot split it; "
            f"every rank holds the whole {fmt_bytes(per_token)}/token"
        )
    line = per_token_working(spec, fmt, kvh, token_bytes(spec, fmt, kvh), f"per GPU (tp {tp})")
    if kvh * tp > spec.n_kv_heads:
        return (
            line
            + f"   [{spec.n_kv_heads} KV heads < tp {tp}: each head replicated on {tp // spec.n_kv_heads} GPUs]"
        )
    return line + f"   [{spec.n_kv_heads} KV heads / tp {tp}]"
