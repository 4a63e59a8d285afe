"""The cache arithmetic: bytes per token per layer, per sequence, per GPU under tensor parallelism, and what a
torch.cat cache copies while a sequence grows.

    bytes/token = 2 (K and V) x layers x kv_heads x head_dim x bytes(dtype)          (MHA, GQA, MQA)
    bytes/token = (kv_lora_rank + qk_rope_head_dim) x layers x bytes(dtype)          (MLA: one latent, no K/V per head)

A sequence of n tokens holds n tokens in a full-attention layer and min(n, window) in a sliding-window or chunked
layer, so per-sequence bytes add the two kinds of layer. Quantized formats add their per-group scales. Growing a
torch.cat cache from n0 to n1 tokens copies its whole history at every step: the closed form of that sum, and the
common (n1^2 - n0^2) / 2 approximation of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KVBenchError
from kvbench.memory.spec import KVFormat, ModelSpec, get_kv_format

# How an inference engine splits the KV heads over tp GPUs (memory --tp-engine). vLLM replicates a KV head on tp / Hkv
# GPUs when tp exceeds the KV heads; transformers' own tensor parallelism splits every projection by heads and has no
# replication, so a model whose heads or KV heads do not divide by tp cannot run there (it loads without a warning
# and fails in its first forward: transformers #48307).
TP_ENGINES = ("vllm", "transformers")


def kv_heads_per_gpu(spec: ModelSpec, tp: int, engine: str = "vllm") -> int:
    """KV heads on each of tp GPUs under `engine`'s rule (TP_ENGINES): split evenly, or, under vLLM, one
    (replicated) per GPU when tp exceeds the KV heads."""
    assert tp >= 1 and engine in TP_ENGINES, (tp, engine)  # request.memory_rules
    if not spec.kv_cache:
        return 0  # no attention layer: nothing per head to split
    if spec.n_heads % tp:
        raise KVBenchError(f"--tp {tp}: {spec.name} has {spec.n_heads} attention heads, not divisible by {tp}")
    if spec.is_mla:
        return spec.n_kv_heads  # unused: the latent is not per head
    if spec.n_kv_heads >= tp:
        if spec.n_kv_heads % tp:
            raise KVBenchError(f"--tp {tp}: {spec.n_kv_heads} KV heads of {spec.name} do not split evenly")
        return spec.n_kv_heads // tp
    if engine == "transformers":
        raise KVBenchError(
            f"--tp {tp} --tp-engine transformers: {spec.name} has {spec.n_kv_heads} KV heads, fewer than {tp} GPUs; "
            "transformers' tensor parallelism does not replicate KV heads and cannot run it (it splits a head and "
            "fails in the first forward, transformers #48307); vLLM replicates them: --tp-engine vllm"
        )
    if tp % spec.n_kv_heads:
        raise KVBenchError(f"--tp {tp} is not a multiple of {spec.name}'s {spec.n_kv_heads} KV heads")
    return 1


def layer_bytes_per_token(spec: ModelSpec, fmt: KVFormat, kv_heads: int | None = None, layer: int | None = None) -> int:
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
    return sum(layer_bytes_per_token(spec, fmt, kv_heads, i) * spec.tokens_held(i, ctx) for i in range(spec.n_layers))


def state_element_bytes(fmt: KVFormat) -> int:
    """Bytes of one recurrent-state element: --kv-dtype when it is a plain float format (fp32, fp16, bf16); the
    quantized cache formats (fp8, int8, int4) do not apply to a recurrent state, which stays at 16 bits."""
    return fmt.bits // 8 if fmt.group_size is None and fmt.bits >= 16 else 2


def state_bytes(spec: ModelSpec, fmt: KVFormat, tp: int = 1) -> int:
    """One sequence's recurrent state (0 when there is none, or it is not sized), split evenly over tp GPUs."""
    if not spec.state_elements:
        return 0
    return -(-spec.state_elements * state_element_bytes(fmt) // tp)


def kind_bytes_per_token(spec: ModelSpec, fmt: KVFormat) -> dict[str, int]:
    """Bytes one token adds over the full-attention layers ("full") and over the windowed ones (their window kind):
    the two terms of a sequence's bytes, since a full layer holds every token and a windowed one at most its window.
    A model without attention layers has neither."""
    windowed = set(spec.sliding_layers)
    out: dict[str, int] = {}
    for kind in ("full", spec.window_kind):
        layers = [i for i in range(spec.n_layers) if (i in windowed) == (kind != "full")]
        if layers:
            out[kind] = sum(layer_bytes_per_token(spec, fmt, None, i) for i in layers)
    return out


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
    history_tokens: int = 0  # n0 + (n0+1) + ... + (n1-1) = (n1 - n0)(n0 + n1 - 1) / 2: history re-copied, per layer
    windowed: bool = False  # windowed layers re-copy at most their window, so exact_bytes is below the sum's


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
    assert 0 <= n0 < n1 and batch >= 1, (n0, n1, batch)  # request.memory_rules, request.copy_range_rules
    fmt = get_kv_format(kv_dtype)
    per_token = token_bytes(spec, fmt)
    windowed = set(spec.sliding_layers)
    exact = batch * sum(
        layer_bytes_per_token(spec, fmt, None, i) * _sum_held(n0, n1, spec.sliding_window if i in windowed else None)
        for i in range(spec.n_layers)
    )
    approx = per_token * (n1 * n1 - n0 * n0) // 2 * batch
    history = (n1 - n0) * (n0 + n1 - 1) // 2
    return CopyTraffic(
        n0, n1, batch, per_token, exact, approx, history_tokens=history, windowed=bool(spec.sliding_layers)
    )
