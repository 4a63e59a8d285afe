"""The KV-cache capacity planner: bytes per token, per sequence, per batch and per GPU for real models.

Pure Python (stdlib only, no torch), so `kvbench memory` runs anywhere. Every number comes with its working:

    bytes/token = 2 (K and V) x layers x kv_heads x head_dim x bytes(dtype)          (MHA, GQA, MQA)
    bytes/token = (kv_lora_rank + qk_rope_head_dim) x layers x bytes(dtype)          (MLA: one latent, no K/V per head)

A sequence of n tokens holds n tokens in a full-attention layer and min(n, window) in a sliding-window layer, so
per-sequence bytes are summed layer by layer. Quantized caches add their per-group scales. Model shapes come from
`configs/models.toml` (each preset cites the Hugging Face config.json it was copied from) or from any `config.json`;
GPUs from `configs/gpus.toml`.

The three ways public calculators get this wrong, and what this module does instead:
  - head_dim taken as hidden_size / heads: wrong for Gemma 2 (3584 / 16 = 224, the model uses 256); we read head_dim.
  - KV heads ignored: 4x too high for Llama-3-8B (32 query heads share 8 KV heads); we use num_key_value_heads.
  - MLA treated as per-head K and V: DeepSeek-V2/V3 cache one 576-element latent per token per layer.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.resources import config_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MODELS_TOML = config_file("models.toml")
GPUS_TOML = config_file("gpus.toml")

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

DEFAULT_OVERHEAD = (
    "10%"  # reserve for activations, CUDA context and allocator slack (vLLM's default leaves 10%)
)


# --- storage formats ------------------------------------------------------------------------------------------------
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

    def working(self, n: int) -> str:
        """The bytes of one n-element vector, as arithmetic."""
        if self.group_size is None:
            b = self.bits / 8
            return f"{n} x {b:g} B"
        groups = -(-n // self.group_size)
        return f"({n} x {self.bits}/8 B + ceil({n}/{self.group_size}) = {groups} groups x {self.meta_bytes} B scales)"


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
    key = name.strip().lower()
    if key not in KV_FORMATS:
        raise KVBenchError(f"unknown --kv-dtype {name!r}; use one of {', '.join(KV_FORMATS)}")
    return KV_FORMATS[key]


def weight_bits(name: str) -> int:
    key = name.strip().lower()
    if key not in WEIGHT_BITS:
        raise KVBenchError(f"unknown --weights-dtype {name!r}; use one of {', '.join(WEIGHT_BITS)}")
    return WEIGHT_BITS[key]


# --- model and GPU specs -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder LLM, as far as its KV cache and weights are concerned."""

    name: str  # preset key, or the config.json path
    source: str  # where the numbers come from: the Hugging Face repo id of the config.json, or the file path
    family: str  # model_type in the config.json (llama, gemma2, deepseek_v3, ...)
    n_layers: int  # decoder layers, each with its own cache
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (= n_heads for MHA, 1 for MQA, in between for GQA)
    head_dim: int  # per-head width of K and V (read from the config, not hidden_size / n_heads)
    hidden_size: int  # residual width
    max_context: int | None  # tokens the model was trained for (max_position_embeddings); None if unknown
    params: int | None  # total parameters (all experts of an MoE); None if unknown
    params_estimated: bool = False  # True when params was estimated from the config rather than published
    sliding_window: int | None = None  # tokens a sliding-window layer attends to (and so must cache)
    sliding_layers: tuple[
        int, ...
    ] = ()  # indices of the layers that use the window; the rest attend to everything
    kv_lora_rank: int | None = None  # MLA: width of the compressed K/V latent cached per token per layer
    qk_rope_head_dim: int | None = None  # MLA: width of the decoupled RoPE key, cached beside the latent
    qk_nope_head_dim: int | None = (
        None  # MLA: per-head K width without RoPE (only for the "expanded" comparison)
    )
    v_head_dim: int | None = None  # MLA: per-head V width (only for the "expanded" comparison)
    note: str = ""  # anything a reader of the numbers should know

    def __post_init__(self) -> None:
        for f in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size"):
            assert getattr(self, f) > 0, f"{self.name}: {f} must be positive, got {getattr(self, f)}"
        assert all(0 <= i < self.n_layers for i in self.sliding_layers), (
            f"{self.name}: sliding layer out of range"
        )
        assert not self.sliding_layers or self.sliding_window, f"{self.name}: sliding layers without a window"

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention(self) -> str:
        """MHA, GQA, MQA or MLA."""
        if self.is_mla:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    @property
    def kv_shape(self) -> str:
        """What one layer caches per token, in the seed's notation."""
        if self.is_mla:
            return f"latent {self.kv_lora_rank}+{self.qk_rope_head_dim}"
        return f"{self.n_kv_heads}x{self.head_dim}"

    def layer_vectors(self, kv_heads: int | None = None) -> tuple[int, int]:
        """(vectors, elements per vector) one layer caches per token: 2 x kv_heads of head_dim, or one MLA latent."""
        if self.is_mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * (self.n_kv_heads if kv_heads is None else kv_heads), self.head_dim

    def tokens_held(self, layer: int, ctx: int) -> int:
        """Tokens layer `layer` must keep for a sequence of ctx tokens: all of them, or the window."""
        if layer in self.sliding_layers:
            return min(ctx, self.sliding_window)
        return ctx


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: the memory the driver reports, which is what a plan has to fit in."""

    name: str  # preset key (t4, a100-80gb, ...)
    label: str  # the product name
    memory: int  # bytes, as nvidia-smi reports memory.total
    nominal: str  # the marketing capacity, for reference
    aliases: tuple[str, ...] = ()  # other names accepted by --gpu


# --- parsing user input --------------------------------------------------------------------------------------------
_CTX_RE = re.compile(r"^(\d+(?:\.\d+)?)([km]?)$")


def parse_ctx(text: str) -> list[int]:
    """'8k,32k,128k' -> [8192, 32768, 131072]. k = 1024 tokens, m = 1024k; plain integers too."""
    if text is None or not str(text).strip():
        raise KVBenchError("--ctx is empty; give context lengths such as 8k,32k,128k")
    out: list[int] = []
    for raw in str(text).split(","):
        tok = raw.strip().lower().replace("_", "")
        m = _CTX_RE.match(tok)
        if not m:
            raise KVBenchError(
                f"cannot read context length {raw.strip()!r}: use whole tokens, optionally with k (x1024) "
                f"or m (x1048576), e.g. --ctx 8k,32k,128k or --ctx 4096"
            )
        number, unit = m.groups()
        scale = {"": 1, "k": 1024, "m": 1024 * 1024}[unit]
        value = float(number) * scale
        if value != int(value):
            raise KVBenchError(f"context length {raw.strip()!r} is not a whole number of tokens ({value:g})")
        if int(value) < 1:
            raise KVBenchError(f"context length {raw.strip()!r} must be at least 1 token")
        out.append(int(value))
    return out


_BYTES_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]*)$")
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 10**3,
    "m": MiB,
    "mib": MiB,
    "mb": 10**6,
    "g": GiB,
    "gib": GiB,
    "gb": 10**9,
    "t": TiB,
    "tib": TiB,
    "tb": 10**12,
}


def parse_bytes(text: str, what: str = "--gpu-mem") -> int:
    """'80GiB' -> 85899345920. GiB/MiB/KiB (and bare G/M/K) are powers of 2; GB/MB/KB are powers of 10."""
    tok = str(text).strip().lower().replace("_", "")
    m = _BYTES_RE.match(tok)
    if not m or m.group(2) not in _BYTE_UNITS:
        raise KVBenchError(
            f"cannot read {what} {text!r}: use a size such as 80GiB, 81920MiB or 80GB (GB = 10^9 bytes)"
        )
    value = float(m.group(1)) * _BYTE_UNITS[m.group(2)]
    if value < 1:
        raise KVBenchError(f"{what} {text!r} must be positive")
    return int(value)


def parse_overhead(text: str, gpu_memory: int) -> tuple[int, str]:
    """'10%' of the GPU, or an absolute size ('4GiB'). Returns (bytes, how it was worked out)."""
    tok = str(text).strip()
    if tok.endswith("%"):
        try:
            pct = float(tok[:-1])
        except ValueError:
            raise KVBenchError(
                f"cannot read --overhead {text!r}: use a percentage (10%) or a size (4GiB)"
            ) from None
        if not 0 <= pct < 100:
            raise KVBenchError(f"--overhead {text!r} must be between 0% and 100%")
        n = int(gpu_memory * pct / 100)
        return n, f"{pct:g}% of {fmt_bytes(gpu_memory)} = {fmt_bytes(n)}"
    n = parse_bytes(tok, "--overhead")
    return n, fmt_bytes(n)


def fmt_bytes(n: float) -> str:
    """Binary units, exact when the value is whole in that unit: 131072 -> '128 KiB', 17179869184 -> '16 GiB'."""
    n = float(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}" if v < 100 else f"{v:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_tokens(n: int) -> str:
    """8192 -> '8k', 131072 -> '128k', 1000 -> '1000'."""
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}m"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def fmt_int(n: int) -> str:
    return f"{n:,}"


# --- presets --------------------------------------------------------------------------------------------------------
_MODEL_REQUIRED = (
    "source",
    "family",
    "layers",
    "heads",
    "kv_heads",
    "head_dim",
    "hidden",
    "max_context",
    "params",
)
_MODEL_OPTIONAL = (
    "sliding_window",
    "sliding_layers",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "note",
)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise KVBenchError(f"preset file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise KVBenchError(f"{path} is not valid TOML: {e}") from None


def _check_keys(
    table: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...], where: str
) -> None:
    unknown = [k for k in table if k not in required and k not in optional]
    if unknown:
        raise KVBenchError(
            f"unknown key {unknown[0]!r} in {where}; known keys: {', '.join(required + optional)}"
        )
    missing = [k for k in required if k not in table]
    if missing:
        raise KVBenchError(f"missing key {missing[0]!r} in {where}")


def _positive_int(value: Any, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KVBenchError(f"{key} = {value!r} in {where} must be a positive integer")
    return value


def _sliding_layers(value: Any, n_layers: int, where: str) -> tuple[int, ...]:
    """'all', 'even' (0, 2, 4, ... as Gemma 2), or an explicit list of layer indices."""
    if value == "all":
        return tuple(range(n_layers))
    if value == "even":
        return tuple(range(0, n_layers, 2))
    if isinstance(value, list) and all(isinstance(i, int) and 0 <= i < n_layers for i in value):
        return tuple(sorted(set(value)))
    raise KVBenchError(f"sliding_layers = {value!r} in {where}: use 'all', 'even' or a list of layer indices")


def load_presets(path: Path | None = None) -> dict[str, ModelSpec]:
    """Every model in configs/models.toml, by name. Unknown or missing keys are errors naming the key and file."""
    path = Path(path) if path else MODELS_TOML
    data = _read_toml(path)
    presets: dict[str, ModelSpec] = {}
    for name, t in data.items():
        where = f"[{name}] of {path}"
        if not isinstance(t, dict):
            raise KVBenchError(f"top-level key {name!r} in {path} must be a [table] describing one model")
        _check_keys(t, _MODEL_REQUIRED, _MODEL_OPTIONAL, where)
        ints = {
            k: _positive_int(t[k], k, where) for k in ("layers", "heads", "kv_heads", "head_dim", "hidden")
        }
        ints.update({k: _positive_int(t[k], k, where) for k in ("max_context", "params")})
        opt = {k: _positive_int(t[k], k, where) for k in _MODEL_OPTIONAL[2:6] if k in t}
        window = (
            _positive_int(t["sliding_window"], "sliding_window", where) if "sliding_window" in t else None
        )
        if (window is None) != ("sliding_layers" not in t):
            raise KVBenchError(f"{where}: sliding_window and sliding_layers go together")
        layers = _sliding_layers(t["sliding_layers"], ints["layers"], where) if window else ()
        if ("kv_lora_rank" in opt) != ("qk_rope_head_dim" in opt):
            raise KVBenchError(f"{where}: an MLA model needs both kv_lora_rank and qk_rope_head_dim")
        presets[name] = ModelSpec(
            name=name,
            source=str(t["source"]),
            family=str(t["family"]),
            n_layers=ints["layers"],
            n_heads=ints["heads"],
            n_kv_heads=ints["kv_heads"],
            head_dim=ints["head_dim"],
            hidden_size=ints["hidden"],
            max_context=ints["max_context"],
            params=ints["params"],
            sliding_window=window,
            sliding_layers=layers,
            kv_lora_rank=opt.get("kv_lora_rank"),
            qk_rope_head_dim=opt.get("qk_rope_head_dim"),
            qk_nope_head_dim=opt.get("qk_nope_head_dim"),
            v_head_dim=opt.get("v_head_dim"),
            note=str(t.get("note", "")),
        )
    return presets


def load_gpus(path: Path | None = None) -> dict[str, GPUSpec]:
    """Every GPU in configs/gpus.toml, by name."""
    path = Path(path) if path else GPUS_TOML
    data = _read_toml(path)
    gpus: dict[str, GPUSpec] = {}
    for name, t in data.items():
        where = f"[{name}] of {path}"
        if not isinstance(t, dict):
            raise KVBenchError(f"top-level key {name!r} in {path} must be a [table] describing one GPU")
        _check_keys(t, ("label", "memory", "nominal"), ("aliases",), where)
        aliases = t.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise KVBenchError(f"aliases in {where} must be a list of strings")
        gpus[name] = GPUSpec(
            name=name,
            label=str(t["label"]),
            memory=parse_bytes(t["memory"], f"memory in {where}"),
            nominal=str(t["nominal"]),
            aliases=tuple(a.lower() for a in aliases),
        )
    return gpus


def _close(name: str, choices: list[str]) -> str:
    key = name.lower()
    close = [c for c in choices if c.startswith(key) or key.startswith(c)]  # mistral-7b -> both versions
    close += [c for c in difflib.get_close_matches(key, choices, n=4, cutoff=0.5) if c not in close]
    close = close[:4]
    return f"; did you mean {', '.join(close)}?" if close else ""


def get_model(name: str, presets: dict[str, ModelSpec] | None = None) -> ModelSpec:
    presets = load_presets() if presets is None else presets
    key = name.strip().lower()
    if key in presets:
        return presets[key]
    raise KVBenchError(
        f"unknown model {name!r}{_close(key, list(presets))} (`kvbench memory --all` lists every preset; "
        f"--config PATH reads any config.json)"
    )


def get_gpu(name: str, gpus: dict[str, GPUSpec] | None = None) -> GPUSpec:
    gpus = load_gpus() if gpus is None else gpus
    key = name.strip().lower().removeprefix("nvidia").strip(" -")
    for g in gpus.values():
        if key == g.name or key in g.aliases:
            return g
    canonical = {n: n for n in gpus} | {a: g.name for g in gpus.values() for a in g.aliases}
    close = _close(key, list(canonical)).removeprefix("; did you mean ").removesuffix("?").split(", ")
    close = list(dict.fromkeys(canonical[c] for c in close if c))  # aliases shown by their preset's name
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise KVBenchError(f"unknown GPU {name!r}{hint} (known: {', '.join(gpus)}; or give --gpu-mem 80GiB)")


# --- Hugging Face config.json --------------------------------------------------------------------------------------
# model_types that are not decoder-only LLMs; their config.json has layers and heads too, so reject them by name.
_NOT_DECODERS = {
    "bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta", "camembert",
    "mpnet", "longformer", "ernie", "modernbert", "t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian",
    "whisper", "vit", "clip", "siglip", "wav2vec2", "hubert", "beit", "swin", "convnext", "detr",
}  # fmt: skip
# Fields of hybrid models whose layers are not all attention layers (Mamba, linear attention): not sized here.
_HYBRID_FIELDS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_period", "attn_layer_indices")
_LAYER_TYPES_FULL = {"full_attention"}
_LAYER_TYPES_WINDOW = {"sliding_attention", "chunked_attention"}


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if cfg.get(k) is not None:
            return k, cfg[k]
    return None, None


def _cfg_int(cfg: dict[str, Any], keys: tuple[str, ...], path: Path, required: bool = True) -> int | None:
    key, value = _first(cfg, keys)
    if key is None:
        if required:
            raise KVBenchError(f"{path}: no {' / '.join(keys)} field; cannot size the KV cache without it")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KVBenchError(f"{path}: {key} = {value!r} is not a positive integer")
    return value


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    """Read any Hugging Face config.json into a ModelSpec, or refuse it naming the field it cannot interpret."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise KVBenchError(f"--config {path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KVBenchError(f"--config {path}: not a JSON file ({e})") from None
    if not isinstance(cfg, dict):
        raise KVBenchError(f"--config {path}: expected a JSON object (a Hugging Face config.json)")
    # Multimodal wrappers (LLaVA, Gemma 3, Mllama, ...) keep the language model under text_config.
    if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
        cfg = {**cfg["text_config"], "_outer_model_type": cfg.get("model_type")}
    model_type = str(cfg.get("model_type", "unknown"))
    if cfg.get("is_encoder_decoder"):
        raise KVBenchError(
            f"{path}: is_encoder_decoder is true ({model_type}); this planner sizes decoder-only LLMs"
        )
    if model_type in _NOT_DECODERS:
        raise KVBenchError(f"{path}: model_type {model_type!r} is not a decoder-only LLM; nothing to plan")
    archs = cfg.get("architectures") or []
    if archs and not any(re.search(r"(CausalLM|LMHeadModel|ForConditionalGeneration)$", a) for a in archs):
        raise KVBenchError(f"{path}: architectures {archs} has no causal LM (…ForCausalLM / …LMHeadModel)")
    for f in _HYBRID_FIELDS:
        if cfg.get(f) is not None:
            raise KVBenchError(
                f"{path}: field {f!r} marks a hybrid (non-attention) layer stack; not supported"
            )

    n_layers = _cfg_int(cfg, ("num_hidden_layers", "n_layer", "num_layers"), path)
    n_heads = _cfg_int(cfg, ("num_attention_heads", "n_head", "num_heads"), path)
    hidden = _cfg_int(cfg, ("hidden_size", "n_embd", "d_model"), path)

    # KV heads: GQA configs say so; Falcon's older configs say multi_query; everything else is MHA.
    if model_type == "falcon" and not cfg.get("new_decoder_architecture"):
        n_kv = 1 if cfg.get("multi_query", True) else (cfg.get("num_kv_heads") or n_heads)
    elif cfg.get("multi_query") is True:  # gpt_bigcode (StarCoder)
        n_kv = 1
    else:
        n_kv = (
            _cfg_int(cfg, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), path, False)
            or n_heads
        )
    if n_heads % n_kv:
        raise KVBenchError(f"{path}: {n_heads} attention heads are not a multiple of {n_kv} key/value heads")

    # head_dim: the config's own value when it has one (Gemma 2: 256, not hidden/heads = 224).
    head_dim = _cfg_int(cfg, ("head_dim",), path, required=False)
    if head_dim is None:
        if hidden % n_heads:
            raise KVBenchError(
                f"{path}: no head_dim field and hidden size {hidden} is not divisible by {n_heads} heads"
            )
        head_dim = hidden // n_heads

    # MLA (DeepSeek-V2/V3): the cache holds the kv_lora_rank latent plus the shared RoPE key.
    kv_lora = _cfg_int(cfg, ("kv_lora_rank",), path, required=False)
    rope = _cfg_int(cfg, ("qk_rope_head_dim",), path, required=False)
    if kv_lora is not None and rope is None:
        raise KVBenchError(f"{path}: kv_lora_rank is set (MLA) but qk_rope_head_dim is missing")

    max_ctx = _cfg_int(
        cfg,
        ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length"),
        path,
        False,
    )
    window, sliding = _hf_sliding(cfg, model_type, n_layers, path)
    params = estimate_params(cfg, n_layers, n_heads, n_kv, head_dim, hidden)
    return ModelSpec(
        name=str(path),
        source=str(path),
        family=model_type,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        hidden_size=hidden,
        max_context=max_ctx,
        params=params,
        params_estimated=params is not None,
        sliding_window=window if sliding else None,
        sliding_layers=sliding,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope if kv_lora is not None else None,
        qk_nope_head_dim=cfg.get("qk_nope_head_dim") if kv_lora is not None else None,
        v_head_dim=cfg.get("v_head_dim") if kv_lora is not None else None,
        note=""
        if max_ctx
        else "config.json gives no max_position_embeddings: beyond-context warnings are off",
    )


def _hf_sliding(
    cfg: dict[str, Any], model_type: str, n_layers: int, path: Path
) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) from a config.json, following how transformers builds its cache."""
    if cfg.get("use_sliding_window") is False:  # Qwen2: sliding_window is set but switched off
        return None, ()
    window = _cfg_int(cfg, ("sliding_window",), path, required=False)
    chunk = _cfg_int(cfg, ("attention_chunk_size",), path, required=False)
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise KVBenchError(f"{path}: layer_types must list one type per layer ({n_layers})")
        unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES_FULL | _LAYER_TYPES_WINDOW})
        if unknown:
            raise KVBenchError(f"{path}: layer_types contains {unknown[0]!r}, which this planner cannot size")
        if "chunked_attention" in layer_types and "sliding_attention" in layer_types:
            raise KVBenchError(f"{path}: layer_types mixes sliding and chunked attention; not supported")
        sliding = tuple(i for i, t in enumerate(layer_types) if t in _LAYER_TYPES_WINDOW)
        size = chunk if "chunked_attention" in layer_types else window
        if sliding and size is None:
            field_name = "attention_chunk_size" if "chunked_attention" in layer_types else "sliding_window"
            raise KVBenchError(f"{path}: layer_types has windowed layers but {field_name} is missing")
        return (size, sliding) if sliding else (None, ())
    if window is None:
        return None, ()
    if model_type == "gemma2":  # older Gemma 2 config.json: even layers slide, odd layers are global
        return window, tuple(range(0, n_layers, 2))
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:  # older Gemma 3: every pattern-th layer is global
        return window, tuple(i for i in range(n_layers) if (i + 1) % pattern)
    if cfg.get("use_sliding_window") is True and "max_window_layers" in cfg:  # Qwen2 with the window on
        return window, tuple(range(int(cfg["max_window_layers"]), n_layers))
    return window, tuple(range(n_layers))  # Mistral v0.1, Phi-3: every layer slides


def estimate_params(
    cfg: dict[str, Any], n_layers: int, n_heads: int, n_kv: int, head_dim: int, hidden: int
) -> int | None:
    """Parameters of a dense or MoE decoder from its config.json (None when the MLP size is not given).

    Embeddings (x2 when untied) + per layer: Q and O (hidden x heads*head_dim), K and V (hidden x kv*head_dim),
    the MLP (3 matrices when gated, as SwiGLU/GeGLU; 2 otherwise) times the experts, and the norms. Biases and
    MLA's low-rank projections are not counted: this is an estimate, and says so.
    """
    vocab = cfg.get("vocab_size")
    _, inter = _first(cfg, ("intermediate_size", "n_inner", "ffn_hidden_size"))
    if inter is None and cfg.get("model_type") in ("gpt2", "falcon", "gpt_bigcode"):
        inter = 4 * hidden
    if not isinstance(vocab, int) or not isinstance(inter, int):
        return None
    act = str(cfg.get("hidden_act") or cfg.get("hidden_activation") or cfg.get("activation_function") or "")
    gated = cfg.get("model_type") not in ("gpt2", "falcon", "gpt_bigcode", "gpt_neox", "phi") and act in (
        "silu",
        "swiglu",
        "gelu_pytorch_tanh",
        "gelu",
    )
    n_mats = 3 if gated else 2
    attn = 2 * hidden * n_heads * head_dim + 2 * hidden * n_kv * head_dim
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 1
    moe_inter = cfg.get("moe_intermediate_size") or inter
    mlp = n_mats * hidden * (inter if experts == 1 else moe_inter) * experts
    if experts > 1:
        mlp += hidden * experts + n_mats * hidden * moe_inter * (cfg.get("n_shared_experts") or 0)
    norms = 2 * hidden
    tied = cfg.get("tie_word_embeddings", True)
    return n_layers * (attn + mlp + norms) + vocab * hidden * (1 if tied else 2) + hidden


# --- the plan -------------------------------------------------------------------------------------------------------
@dataclass
class PlanRow:
    """One model at one context length."""

    ctx: int  # context length in tokens (prompt + generated)
    batch: int  # sequences
    tokens_held: int  # tokens held per sequence summed over layers (ctx x layers unless windows cap some)
    bytes_per_seq: int  # cache bytes for one sequence at ctx
    bytes_batch: int  # cache bytes for the batch
    bytes_per_gpu: int  # cache bytes each GPU holds under tensor parallelism (= bytes_batch at tp 1)
    beyond_max: bool  # ctx is past the context the model was trained for
    windowed: bool  # some layers are capped at their sliding window at this ctx
    fits: bool | None  # weights + cache + allowance fit in the GPU (None: no GPU given)
    max_batch: int | None  # most sequences of ctx tokens that fit next to the weights (None: no GPU)
    max_ctx: int | None  # longest context at `batch` that fits (None: no GPU, or unbounded)
    max_ctx_unbounded: (
        bool  # every layer is windowed and the window fits: context is not limited by the cache
    )
    working: list[str] = field(default_factory=list)  # the arithmetic, one line per step


@dataclass
class GPUBudget:
    """What a GPU has left for the KV cache."""

    name: str  # preset key or "custom"
    label: str  # product name or the --gpu-mem text
    memory: int  # bytes per GPU
    overhead: int  # bytes set aside for activations, CUDA context and allocator slack
    weights_per_gpu: int  # bytes of weights on each GPU
    available: int  # memory - overhead - weights: what the cache may use (negative: weights alone do not fit)
    working: str  # the arithmetic


@dataclass
class ModelPlan:
    """One model's cache across contexts, with the working."""

    model: ModelSpec  # the shape used
    kv_dtype: str  # storage format of the cache
    weights_dtype: str  # storage format of the weights
    tp: int  # tensor-parallel degree
    kv_heads_per_gpu: int  # KV heads each GPU holds (replicated when tp > kv_heads; all of MLA's latent)
    layer_bytes_per_token: int  # bytes one layer caches per token (whole model)
    bytes_per_token: int  # bytes per token over all layers, no window applied: the seed's "KiB / token"
    weights_bytes: int | None  # params x bytes(weights dtype), whole model
    rows: list[PlanRow]  # one per context
    gpu: GPUBudget | None  # the budget, when a GPU was given
    working: list[str]  # how bytes_per_token and the weights were computed
    warnings: list[str]  # beyond-trained-context and similar, one line each
    notes: list[str]  # facts about the model the numbers depend on (windows, MLA, quantization overhead)


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    """KV heads on each of tp GPUs: split evenly, or one (replicated) per GPU when tp exceeds the KV heads."""
    if tp < 1:
        raise KVBenchError(f"--tp {tp} must be at least 1")
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


def layer_bytes_per_token(spec: ModelSpec, fmt: KVFormat, kv_heads: int | None = None) -> int:
    vectors, n = spec.layer_vectors(kv_heads)
    return vectors * fmt.vector_bytes(n)


def bytes_per_sequence(spec: ModelSpec, fmt: KVFormat, ctx: int, kv_heads: int | None = None) -> int:
    """Cache bytes of one sequence of ctx tokens: each layer holds ctx tokens, or its window."""
    per_layer = layer_bytes_per_token(spec, fmt, kv_heads)
    return per_layer * sum(spec.tokens_held(i, ctx) for i in range(spec.n_layers))


def _per_token_working(spec: ModelSpec, fmt: KVFormat, kv_heads: int, total: int, label: str) -> str:
    if spec.is_mla:
        n = spec.kv_lora_rank + spec.qk_rope_head_dim
        return (
            f"{label}: ({spec.kv_lora_rank} kv_lora_rank + {spec.qk_rope_head_dim} qk_rope_head_dim) x "
            f"{spec.n_layers} layers x {fmt.working(n) if fmt.group_size else f'{fmt.bits / 8:g} B'} ({fmt.name})"
            f" = {fmt_int(total)} B = {fmt_bytes(total)}   [MLA: one latent per token per layer, no factor 2, "
            f"no KV heads]"
        )
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


def _max_ctx(
    spec: ModelSpec, fmt: KVFormat, kv_heads: int, batch: int, available: int
) -> tuple[int | None, bool]:
    """Longest context whose cache for `batch` sequences fits in `available` bytes: (tokens, unbounded)."""
    if available <= 0 or batch * bytes_per_sequence(spec, fmt, 1, kv_heads) > available:
        return 0, False
    hi = 1 << 40
    if batch * bytes_per_sequence(spec, fmt, hi, kv_heads) <= available:
        return None, True  # every layer is windowed: the cache stops growing
    lo = 1  # fits; hi does not. Bytes grow monotonically with ctx, so bisect.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if batch * bytes_per_sequence(spec, fmt, mid, kv_heads) <= available:
            lo = mid
        else:
            hi = mid
    return lo, False


def gpu_budget(
    gpu: GPUSpec | None, gpu_mem: int | None, overhead: str, weights_per_gpu: int, gpu_mem_text: str = ""
) -> GPUBudget | None:
    if gpu is None and gpu_mem is None:
        return None
    memory = gpu.memory if gpu else gpu_mem
    reserve, how = parse_overhead(overhead, memory)
    available = memory - reserve - weights_per_gpu
    label = f"{gpu.label} ({gpu.nominal})" if gpu else f"--gpu-mem {gpu_mem_text or fmt_bytes(memory)}"
    return GPUBudget(
        name=gpu.name if gpu else "custom",
        label=label,
        memory=memory,
        overhead=reserve,
        weights_per_gpu=weights_per_gpu,
        available=available,
        working=(
            f"{fmt_bytes(memory)} ({fmt_int(memory)} B) - allowance {how} for activations, CUDA context and "
            f"allocator slack - weights {fmt_bytes(weights_per_gpu)} per GPU = {fmt_bytes(available)} for the cache"
            if available >= 0
            else f"weights {fmt_bytes(weights_per_gpu)} per GPU + allowance {how} exceed {fmt_bytes(memory)}"
        ),
    )


def plan(
    spec: ModelSpec,
    contexts: list[int],
    batch: int = 1,
    kv_dtype: str = "fp16",
    weights_dtype: str = "bf16",
    tp: int = 1,
    gpu: GPUSpec | None = None,
    gpu_mem: int | None = None,
    overhead: str = DEFAULT_OVERHEAD,
    gpu_mem_text: str = "",
) -> ModelPlan:
    """Bytes per token, per sequence, per batch and per GPU for `spec` at each context, with the working."""
    if batch < 1:
        raise KVBenchError(f"--batch {batch} must be at least 1")
    if not contexts:
        raise KVBenchError("no context lengths given; use --ctx 8k,32k,128k")
    for c in contexts:
        if c < 1:
            raise KVBenchError(f"context length {c} must be at least 1 token")
    fmt = get_kv_format(kv_dtype)
    wbits = weight_bits(weights_dtype)
    kvh = kv_heads_per_gpu(spec, tp)

    per_layer = layer_bytes_per_token(spec, fmt)
    per_token = per_layer * spec.n_layers
    working = [_per_token_working(spec, fmt, spec.n_kv_heads, per_token, "per token")]
    per_layer_gpu = layer_bytes_per_token(spec, fmt, kvh)
    if tp > 1:
        if spec.is_mla:
            working.append(
                f"per GPU (tp {tp}): the MLA latent is shared by all heads, so tensor parallelism cannot split it; "
                f"every rank holds the whole {fmt_bytes(per_token)}/token"
            )
        elif kvh * tp > spec.n_kv_heads:
            working.append(
                _per_token_working(spec, fmt, kvh, per_layer_gpu * spec.n_layers, f"per GPU (tp {tp})")
                + f"   [{spec.n_kv_heads} KV heads < tp {tp}: each head replicated on {tp // spec.n_kv_heads} GPUs]"
            )
        else:
            working.append(
                _per_token_working(spec, fmt, kvh, per_layer_gpu * spec.n_layers, f"per GPU (tp {tp})")
                + f"   [{spec.n_kv_heads} KV heads / tp {tp}]"
            )

    weights = None if spec.params is None else -(-spec.params * wbits // 8)
    if weights is not None:
        approx = "~" if spec.params_estimated else ""
        working.append(
            f"weights: {approx}{fmt_int(spec.params)} params x {wbits / 8:g} B ({weights_dtype}) = "
            f"{fmt_bytes(weights)}"
            + (f", {fmt_bytes(-(-weights // tp))} per GPU at tp {tp}" if tp > 1 else "")
            + (
                "  [estimated from config.json: embeddings, attention, MLP, norms; no biases]"
                if approx
                else ""
            )
        )
    weights_gpu = 0 if weights is None else -(-weights // tp)
    budget = gpu_budget(gpu, gpu_mem, overhead, weights_gpu, gpu_mem_text)
    if budget is not None:
        working.append(f"GPU budget: {budget.working}")

    notes: list[str] = []
    if spec.sliding_layers:
        n_sl = len(spec.sliding_layers)
        which = "every layer" if n_sl == spec.n_layers else f"{n_sl} of {spec.n_layers} layers"
        notes.append(
            f"{which} use a {fmt_int(spec.sliding_window)}-token sliding window: past that length those layers "
            f"hold only the last {fmt_int(spec.sliding_window)} tokens (a windowed cache; a cache that ignores "
            f"the window holds all of them)"
        )
    if spec.is_mla and spec.qk_nope_head_dim and spec.v_head_dim:
        expanded = (
            spec.n_layers
            * spec.n_kv_heads
            * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim)
        )
        notes.append(
            f"MLA caches the {spec.kv_lora_rank}+{spec.qk_rope_head_dim} latent (vLLM, SGLang, DeepSeek's own "
            f"code). Expanded to per-head K ({spec.qk_nope_head_dim}+{spec.qk_rope_head_dim}) and V "
            f"({spec.v_head_dim}) for {spec.n_kv_heads} heads, as transformers' eager attention caches it, it would "
            f"be {fmt_int(expanded)} elements/token, {expanded / (per_token / (fmt.bits / 8)):.0f}x more"
        )
    if fmt.group_size or fmt.name == "fp8":
        notes.append(f"{fmt.name} cache: {fmt.note}")
    if spec.note:
        notes.append(spec.note)

    warnings: list[str] = []
    rows: list[PlanRow] = []
    for ctx in contexts:
        held = sum(spec.tokens_held(i, ctx) for i in range(spec.n_layers))
        per_seq = per_layer * held
        per_gpu = per_layer_gpu * held * batch
        beyond = spec.max_context is not None and ctx > spec.max_context
        windowed = held < ctx * spec.n_layers
        lines = []
        if windowed:
            n_sl = len(spec.sliding_layers)
            full = spec.n_layers - n_sl
            lines.append(
                f"{fmt_tokens(ctx)}: {full} full layers x {fmt_int(ctx)} tokens + {n_sl} sliding layers x "
                f"min({fmt_int(ctx)}, {fmt_int(spec.sliding_window)}) tokens = {fmt_int(held)} layer-tokens x "
                f"{fmt_int(per_layer)} B = {fmt_int(per_seq)} B = {fmt_bytes(per_seq)} per sequence"
            )
        else:
            lines.append(
                f"{fmt_tokens(ctx)}: {fmt_int(per_token)} B/token x {fmt_int(ctx)} tokens = {fmt_int(per_seq)} B = "
                f"{fmt_bytes(per_seq)} per sequence"
            )
        if batch > 1:
            lines.append(f"  x {batch} sequences = {fmt_bytes(per_seq * batch)}")
        if tp > 1:
            lines.append(f"  per GPU at tp {tp}: {fmt_bytes(per_gpu)}")
        fits = max_batch = max_ctx = None
        unbounded = False
        if budget is not None:
            seq_gpu = per_layer_gpu * held
            fits = budget.available >= per_gpu
            max_batch = max(0, budget.available // seq_gpu) if budget.available > 0 else 0
            max_ctx, unbounded = _max_ctx(spec, fmt, kvh, batch, budget.available)
            lines.append(
                f"  fits: {fmt_bytes(per_gpu)} {'<=' if fits else '>'} {fmt_bytes(max(budget.available, 0))} available"
                f"; max batch {max_batch} at {fmt_tokens(ctx)}; "
                + (
                    "unbounded context (every layer windowed)"
                    if unbounded
                    else f"max context {fmt_int(max_ctx)}"
                )
                + f" at batch {batch}"
            )
        if beyond:
            warnings.append(
                f"{spec.name}: {fmt_int(ctx)} tokens is beyond the {fmt_int(spec.max_context)} it was trained for "
                f"(max_position_embeddings); computed anyway"
            )
        rows.append(
            PlanRow(
                ctx=ctx,
                batch=batch,
                tokens_held=held,
                bytes_per_seq=per_seq,
                bytes_batch=per_seq * batch,
                bytes_per_gpu=per_gpu,
                beyond_max=beyond,
                windowed=windowed,
                fits=fits,
                max_batch=max_batch,
                max_ctx=max_ctx,
                max_ctx_unbounded=unbounded,
                working=lines,
            )
        )
    if budget is not None and budget.available <= 0:
        warnings.append(f"{spec.name}: {budget.working}: no room for any cache")
    return ModelPlan(
        model=spec,
        kv_dtype=fmt.name,
        weights_dtype=weights_dtype,
        tp=tp,
        kv_heads_per_gpu=kvh,
        layer_bytes_per_token=per_layer,
        bytes_per_token=per_token,
        weights_bytes=weights,
        rows=rows,
        gpu=budget,
        working=working,
        warnings=warnings,
        notes=notes,
    )


# --- torch.cat copy traffic -----------------------------------------------------------------------------------------
@dataclass
class CopyTraffic:
    """The bytes a torch.cat cache copies while a sequence grows from n0 to n1 tokens, one token per step."""

    n0: int  # tokens in the cache after prefill
    n1: int  # tokens at the end
    batch: int  # sequences
    bytes_per_token: int  # cache bytes per token over all layers
    exact_bytes: int  # bytes/token x (n0 + (n0+1) + ... + (n1-1)) x batch (windowed layers capped)
    seed_approx_bytes: int  # the seed's bytes/token x (n1^2 - n0^2) / 2 x batch
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
    if n0 < 0 or n1 <= n0:
        raise KVBenchError(f"--from {n0} --to {n1}: need 0 <= from < to")
    if batch < 1:
        raise KVBenchError(f"--batch {batch} must be at least 1")
    fmt = get_kv_format(kv_dtype)
    per_layer = layer_bytes_per_token(spec, fmt)
    per_token = per_layer * spec.n_layers
    held = sum(
        _sum_held(n0, n1, spec.sliding_window if i in spec.sliding_layers else None)
        for i in range(spec.n_layers)
    )
    exact = per_layer * held * batch
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


# --- JSON -----------------------------------------------------------------------------------------------------------
def to_jsonable(obj: Any) -> Any:
    """Dataclasses (and lists of them) as plain dicts, for --json."""
    if isinstance(obj, list):
        return [to_jsonable(o) for o in obj]
    if hasattr(obj, "__dataclass_fields__"):
        d = asdict(obj)
        if isinstance(obj, ModelSpec):
            d["attention"] = obj.attention
            d["sliding_layers"] = list(obj.sliding_layers)
        if isinstance(obj, ModelPlan):
            d["model"] = to_jsonable(obj.model)
        return d
    return obj


__all__ = [
    "KV_FORMATS",
    "CopyTraffic",
    "GPUBudget",
    "GPUSpec",
    "KVFormat",
    "ModelPlan",
    "ModelSpec",
    "PlanRow",
    "bytes_per_sequence",
    "copy_traffic",
    "estimate_params",
    "fmt_bytes",
    "fmt_tokens",
    "get_gpu",
    "get_kv_format",
    "get_model",
    "kv_heads_per_gpu",
    "layer_bytes_per_token",
    "load_gpus",
    "load_presets",
    "parse_bytes",
    "parse_ctx",
    "plan",
    "spec_from_hf_config",
]
