"""What the planner's arithmetic takes: a model's shape, a GPU, how a cached element is stored, a memory bandwidth.

`ModelSpec` and `GPUSpec` hold the shapes the arithmetic needs, and nothing else. A storage format (`KVFormat`)
gives the bytes of one cached vector with a quantized cache's scales, and `WEIGHT_BITS` the bits of one weight.
A bandwidth (`PeakBandwidth`) is a published peak figure (configs/gpus.toml) or --bandwidth, read from text such as
3.35TB/s: TB/s, GB/s, MB/s are powers of 10 (3.35TB/s = 3.35e12 bytes/s, as datasheets write them); TiB/s, GiB/s,
MiB/s are powers of 2. It is held as whole bytes per second, computed exactly from the decimal text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbench.dtypes import canonical
from kvbench.errors import KVBenchError

WINDOW_KINDS = ("sliding", "chunked")  # how a capped layer attends: the last w tokens, or its w-token chunk


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder LLM, as far as its KV cache and weights are concerned."""

    name: str  # preset key, or the config.json path
    source: str  # where the numbers come from: the Hugging Face repo id of the config.json, or the file path
    family: str  # model_type of the language model (llama, gemma2, deepseek_v3, ...)
    n_layers: int  # decoder layers, each with its own cache
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (= n_heads for MHA, 1 for MQA, in between for GQA)
    head_dim: int  # per-head width of K and V (read from the config, not hidden_size / n_heads)
    hidden_size: int  # residual width
    max_context: int | None  # tokens the model was trained for (max_position_embeddings); None if unknown
    params: int | None  # parameters of the language model (all experts of an MoE); None if unknown
    params_estimated: bool = False  # True when params was estimated from the config rather than published
    sliding_window: int | None = None  # tokens a windowed layer attends to (and so must cache)
    sliding_layers: tuple[int, ...] = ()  # indices of the windowed layers; the rest attend to everything
    window_kind: str = "sliding"  # sliding: the last `sliding_window` tokens; chunked: its own chunk of that size
    kv_lora_rank: int | None = None  # MLA: width of the compressed K/V latent cached per token per layer
    qk_rope_head_dim: int | None = None  # MLA: width of the decoupled RoPE key, cached beside the latent
    qk_nope_head_dim: int | None = None  # MLA: per-head K width without RoPE (only for the "expanded" comparison)
    v_head_dim: int | None = None  # MLA: per-head V width (only for the "expanded" comparison)
    wrapper: str | None = None  # multimodal: the outer model_type (llava, gemma3, ...) around this language model
    vision_params: int | None = None  # multimodal: vision tower + projector parameters, stated, not in `params`
    resolved_by: str = ""  # how a config.json was read: transformers' config class, or kvbench's own reader
    note: str = ""  # anything a reader of the numbers should know
    # Recurrent layers (Mamba, RWKV, xLSTM, linear attention): a fixed-size state per sequence instead of K/V.
    # n_layers above counts the attention layers only (0 for a model with none: then no KV cache at all).
    model_layers: int | None = None  # the decoder's layers, when not every one caches K/V
    state_layers: int = 0  # layers that keep a recurrent state (a hybrid's attention layers may keep one too)
    state_elements: int | None = None  # that state's elements per sequence, all layers (None: not sized)
    state_working: str = ""  # how state_elements was computed, with the config's numbers
    # (key/value heads, head_dim) of each attention layer where the config sets them per layer (transformers 5.x
    # per_layer_config: Gemma 4's full-attention layers have their own head_dim); empty: every layer has
    # n_kv_heads x head_dim
    layer_kv: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        assert self.n_layers >= 0 and self.hidden_size > 0, f"{self.name}: layers {self.n_layers}"
        for f in ("n_heads", "n_kv_heads", "head_dim") if self.n_layers else ():
            assert getattr(self, f) > 0, f"{self.name}: {f} must be positive, got {getattr(self, f)}"
        assert self.n_layers or self.state_layers, f"{self.name}: neither attention nor recurrent layers"
        assert all(0 <= i < self.n_layers for i in self.sliding_layers), f"{self.name}: window layer out of range"
        assert not self.sliding_layers or self.sliding_window, f"{self.name}: windowed layers without a window"
        assert self.window_kind in WINDOW_KINDS, f"{self.name}: window kind {self.window_kind!r}"
        assert not self.layer_kv or (len(self.layer_kv) == self.n_layers and not self.is_mla), (
            f"{self.name}: per-layer K/V shapes for {len(self.layer_kv)} of {self.n_layers} layers"
        )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def kv_cache(self) -> bool:
        """False for a model with no attention layer (every layer keeps a recurrent state instead)."""
        return self.n_layers > 0

    @property
    def attention(self) -> str:
        """MHA, GQA, MQA or MLA; "none" when no layer attends."""
        if not self.kv_cache:
            return "none"
        if self.is_mla:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    @property
    def kv_shape(self) -> str:
        """What one layer caches per token."""
        if not self.kv_cache:
            return "-"
        if self.is_mla:
            return f"latent {self.kv_lora_rank}+{self.qk_rope_head_dim}"
        shapes = dict.fromkeys(self.layer_kv or [(self.n_kv_heads, self.head_dim)])
        return " / ".join(f"{h}x{d}" for h, d in shapes) + (" by layer" if len(shapes) > 1 else "")

    def layer_shape(self, layer: int | None = None, kv_heads: int | None = None) -> tuple[int, int]:
        """(key/value heads, head_dim) of layer `layer` (None: the model-wide values); `kv_heads`: the heads one
        GPU holds of the model-wide n_kv_heads under tensor parallelism, scaled to this layer's heads."""
        heads, dim = self.layer_kv[layer] if self.layer_kv and layer is not None else (self.n_kv_heads, self.head_dim)
        if kv_heads is not None and kv_heads != self.n_kv_heads:
            heads = max(1, heads * kv_heads // self.n_kv_heads)
        return heads, dim

    @property
    def n_windowed(self) -> int:
        return len(self.sliding_layers)

    @property
    def n_full(self) -> int:
        return self.n_layers - self.n_windowed

    @property
    def window_label(self) -> str:
        """'sliding-window' or 'chunked-attention', for notes and captions."""
        return "sliding-window" if self.window_kind == "sliding" else "chunked-attention"

    def layer_vectors(self, kv_heads: int | None = None, layer: int | None = None) -> tuple[int, int]:
        """(vectors, elements per vector) one layer caches per token: 2 x kv_heads of head_dim, or one MLA latent.
        `layer`: that layer's own shape where they differ (layer_kv)."""
        if self.kv_lora_rank is not None:  # MLA
            assert self.qk_rope_head_dim is not None, f"{self.name}: an MLA latent without its RoPE key width"
            return 1, self.kv_lora_rank + self.qk_rope_head_dim
        heads, dim = self.layer_shape(layer, kv_heads)
        return 2 * heads, dim

    def tokens_held(self, layer: int, ctx: int) -> int:
        """Tokens layer `layer` must keep for a sequence of ctx tokens: all of them, or the window."""
        if layer in self.sliding_layers:
            assert self.sliding_window is not None  # __post_init__: windowed layers have a window
            return min(ctx, self.sliding_window)
        return ctx

    def held(self, ctx: int) -> int:
        """Tokens held per sequence summed over layers: full layers hold ctx, windowed ones min(ctx, window)."""
        windowed = 0
        if self.sliding_layers:
            assert self.sliding_window is not None  # __post_init__: windowed layers have a window
            windowed = self.n_windowed * min(ctx, self.sliding_window)
        return self.n_full * ctx + windowed


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: the memory the driver reports, which is what a plan has to fit in."""

    name: str  # preset key (t4, a100-80gb, ...)
    label: str  # the product name
    memory: int  # bytes, as nvidia-smi reports memory.total
    nominal: str  # the marketing capacity, for reference
    aliases: tuple[str, ...] = ()  # other names accepted by --gpu
    bandwidth: int | None = None  # published memory bandwidth, bytes/s (None: not listed)
    bandwidth_text: str = ""  # as gpus.toml writes it, e.g. 3.35TB/s
    bandwidth_source: str = ""  # the datasheet the figure is from


@dataclass(frozen=True)
class KVFormat:
    """How one cached element is stored, including the metadata a quantized cache needs to dequantize it."""

    name: str  # CLI name: fp32, fp16, bf16, fp8, int8, int4
    bits: int  # bits per stored element
    group_size: int | None  # elements of one K or V vector that share a scale (None: no per-group metadata)
    meta_bytes: int  # bytes of metadata per group: fp16 scale (int8), fp16 scale + fp16 zero point (int4)
    note: str  # the overhead, stated in words

    def vector_bytes(self, n: int) -> int:
        """Bytes to store one cached vector of n elements (one head's K or V, or one MLA latent)."""
        data = -(-n * self.bits // 8)  # ceil: a half-filled int4 byte is still a byte
        groups = 0 if self.group_size is None else -(-n // self.group_size)
        return data + groups * self.meta_bytes


KV_FORMATS: dict[str, KVFormat] = {
    "fp32": KVFormat("fp32", 32, None, 0, "4 B per element, no scales"),
    "fp16": KVFormat("fp16", 16, None, 0, "2 B per element, no scales"),
    "bf16": KVFormat("bf16", 16, None, 0, "2 B per element, no scales"),
    "fp8": KVFormat(
        "fp8",
        8,
        None,
        0,
        "1 B per element (e4m3); one fp32 scale per layer for K and one for V, not per token (8 B per layer, ignored)",
    ),
    "int8": KVFormat(
        "int8",
        8,
        64,
        2,
        "1 B per element + one fp16 scale per group of 64 elements along the vector (+2 B per 64 B, +3.1%)",
    ),
    "int4": KVFormat(
        "int4",
        4,
        64,
        4,
        "0.5 B per element + fp16 scale and fp16 zero point per group of 64 elements (+4 B per 32 B, +12.5%); "
        "like transformers' QuantizedCache (q_group_size=64), minus its full-precision residual window",
    ),
}

# Bits per weight. Quantized weights also carry group scales (int4 at group 128 with fp16 scale + zero: +3%); the
# weights figure here is the bare parameter storage, which is what `--weights-dtype` sizes.
WEIGHT_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}


def get_kv_format(name: str) -> KVFormat:
    """Any spelling kvbench.dtypes accepts (float16, half, bfloat16, ...) -> its format."""
    return KV_FORMATS[canonical(name, "--kv-dtype", tuple(KV_FORMATS))]


def weight_dtype(name: str) -> str:
    """The canonical name of a --weights-dtype spelling (kvbench.dtypes)."""
    return canonical(name, "--weights-dtype", tuple(WEIGHT_BITS))


def weight_bits(name: str) -> int:
    return WEIGHT_BITS[weight_dtype(name)]


_RATE_RE = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?i?b)\s*/\s*s$")
_RATE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
MAX_RATE = 10**15  # 1 PB/s: far above any memory today, low enough to catch a unit typo


@dataclass(frozen=True)
class PeakBandwidth:
    """The bandwidth a decode floor divides by."""

    name: str  # GPU preset key, or "custom" for --bandwidth
    label: str  # product name, or "--bandwidth 3.35TB/s"
    bytes_per_s: int  # bytes per second
    text: str  # as written in gpus.toml or on the command line
    source: str  # where the figure comes from: the datasheet cited in gpus.toml, or "--bandwidth"


def parse_bandwidth(text: str, what: str = "--bandwidth") -> int:
    """'3.35TB/s' -> 3_350_000_000_000 bytes/s; '2TiB/s' -> 2 x 2^40. Zero, negative, nan or no unit: one line."""
    tok = str(text).strip().lower().replace("_", "")
    m = _RATE_RE.match(tok)
    if not m or m.group(3) not in _RATE_UNITS:
        raise KVBenchError(
            f"cannot read {what} {text!r}: use a rate such as 3.35TB/s, 3350GB/s or 2TiB/s "
            "(TB = 10^12 bytes, TiB = 2^40)"
        )
    sign, number, unit = m.groups()
    whole, _, frac = number.partition(".")
    value = int((whole or "0") + frac) * _RATE_UNITS[unit] // 10 ** len(frac)
    if sign == "-" or value < 1:
        raise KVBenchError(f"{what} {text!r} must be positive")
    if value > MAX_RATE:
        raise KVBenchError(f"{what} {text!r} is more than 1 PB/s; give the memory's real bandwidth")
    return value


def fmt_rate(bytes_per_s: float) -> str:
    """3.35e12 -> '3.35 TB/s' (decimal units, as datasheets print them)."""
    for unit, size in (("TB/s", 10**12), ("GB/s", 10**9), ("MB/s", 10**6), ("KB/s", 10**3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.4g} {unit}"
    return f"{bytes_per_s:.0f} B/s"
