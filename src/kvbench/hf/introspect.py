"""What kvbench reads from transformers itself, rather than assumes: a loaded model's facts (`describe`, as
`HFModelInfo`) and the version differences of its generation API (`cache_kwarg`, `returned_cache`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import transformers
from transformers import DynamicCache, GenerationMixin, cache_utils

from kvbench.memory.state import RECURRENT_TYPES

# Config attributes that bound the sequence length, most common first (GPT-2's n_positions is mapped onto the
# first by its config class).
# Config attributes naming how many keys a sparse-attention indexer keeps per query.
SPARSE_TOPK_KEYS = ("index_topk", "indexer_budget")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


@dataclass
class HFModelInfo:
    """What the cache checks and the bench need to know about a model, read from the model itself."""

    architecture: str  # the model class, e.g. LlamaForCausalLM
    model_type: str  # config.model_type
    n_layers: int  # decoder layers actually loaded
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA: fewer than n_heads); layer 0's where they vary (kv_widths)
    head_dim: int  # layer 0's where it varies
    hidden_size: int
    vocab_size: int
    context: int | None  # the configured maximum sequence length, if the config has one
    learned_positions: bool  # a position-embedding table: there is no position past `context`
    # per layer, as transformers' DynamicCache builds them: "full" or "sliding(W)" (K/V), "recurrent" (a fixed-size
    # state: Mamba, RWKV, xLSTM, linear attention), "recurrent+full" / "recurrent+sliding(W)" (both: a hybrid
    # layer), "none" (no sequence mixing: an MLP-only layer)
    layer_types: list[str]
    attn_implementation: str  # eager, sdpa, ...
    transformers_version: str
    # per layer: key/value heads x head_dim (transformers 5.x configs may set head_dim or the heads per layer)
    kv_widths: list[int] = field(default_factory=list)
    # a sparse-attention indexer (DeepSeek's DSA and kin): each query attends to the top `sparse_topk` keys only
    sparse_topk: int | None = None
    # per layer, the kinds the config names as transformers' caches read them (`full_attention`,
    # `sliding_attention`, `indexed_attention`, ...): QuantizedCache refuses every kind but full_attention
    config_layer_types: list[str] = field(default_factory=list)

    @property
    def kv_elements(self) -> int:
        """K or V elements one token adds over every layer that caches K/V."""
        widths = self.kv_widths or [self.n_kv_heads * self.head_dim] * self.n_layers
        return sum(w for t, w in zip(self.layer_types, widths, strict=False) if self.kv_tokens(t, 1))

    @property
    def head_dims(self) -> str:
        """'head_dim 16' or, where layers differ, 'head_dim 16 / 32 by layer'."""
        dims = sorted({w // max(self.n_kv_heads, 1) for w in self.kv_widths} or {self.head_dim})
        return f"head_dim {' / '.join(map(str, dims))}" + (" by layer" if len(dims) > 1 else "")

    @property
    def windowed(self) -> bool:
        return any("sliding(" in t for t in self.layer_types)

    @property
    def recurrent(self) -> bool:
        """Some layer keeps a recurrent state."""
        return any(t.startswith("recurrent") for t in self.layer_types)

    @property
    def kv_layers(self) -> int:
        """Layers that cache K and V (0: no KV cache at all, a purely recurrent model)."""
        return sum(1 for t in self.layer_types if self.kv_tokens(t, 1))

    @staticmethod
    def kv_tokens(layer_type: str, tokens: int) -> int:
        """Tokens one layer of this type holds in its KV cache after `tokens` tokens."""
        kind = layer_type.removeprefix("recurrent+")
        if kind.startswith("sliding("):
            return min(int(kind[len("sliding(") : -1]), tokens)
        return tokens if kind == "full" else 0

    def layers_summary(self) -> str:
        """'2 full' / '2 sliding(8)' / '1 sliding(8) + 1 full' in layer order of first appearance."""
        counts: dict[str, int] = {}
        for t in self.layer_types:
            counts[t] = counts.get(t, 0) + 1
        return " + ".join(f"{n} {t}" for t, n in counts.items())

    def positions_summary(self) -> str:
        if self.context is None:
            return "no configured maximum length"
        kind = "learned absolute positions" if self.learned_positions else "no position table"
        return f"context {self.context} ({kind})"


def cache_kwarg() -> str:
    """The keyword `generate` and the models take a Cache object by: `cache` in recent transformers,
    `past_key_values` before (the old name still works there, with a deprecation warning)."""
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(out):
    """The cache a `generate` or forward output carries, under either name (see cache_kwarg)."""
    names = getattr(type(out), "__dataclass_fields__", {})
    return getattr(out, "cache" if "cache" in names else "past_key_values", None)


@torch.no_grad()
def measured_no_cache(model) -> str | None:
    """Why the model keeps no KV cache, measured (not read from its forward's signature, which `**kwargs` hides):
    a two-token forward with `use_cache=True` returns no cache, and one given a DynamicCache leaves it empty. None
    when either shows a cache, or when the forward raises for another reason than refusing those keywords (the
    checks then run and report what it raises)."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)  # (1, 2)
    plain = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": True}
    refused = []
    for given in (None, _empty_cache(model)):
        kw = plain if given is None else {**plain, cache_kwarg(): given}
        try:
            out = model(**kw)
        except Exception as e:  # a forward that takes no such keyword refuses it; anything else is the checks' to show
            if "unexpected keyword argument" not in str(e):
                return None
            refused.append(e)
            continue
        if returned_cache(out) is not None or (given is not None and held_tokens(given) > 0):
            return None
    if len(refused) == 2:
        return "its forward takes neither use_cache nor a cache"
    return "a forward with use_cache=True returns no cache and leaves the cache it is given empty"


def held_tokens(cache) -> int:
    """The most tokens any layer of a transformers Cache holds. Not `cache.get_seq_length()`: from transformers
    5.25 it reads layer 0 alone, which in a hybrid may be a recurrent layer counting nothing (RecurrentGemma keeps
    its state in module buffers) or counting in a 0-dim tensor."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return int(cache.get_seq_length())
    return max(int(x.get_seq_length()) if hasattr(x, "get_seq_length") else 0 for x in layers)


def _empty_cache(model) -> DynamicCache:
    try:
        return DynamicCache(config=model.config.get_text_config(decoder=True))
    except Exception:  # a custom config DynamicCache cannot read: the layers are made as they are used
        return DynamicCache()


def describe(model) -> HFModelInfo:
    """Read the facts the checks depend on from the loaded model (not from guesses about its family)."""
    cfg = model.config.get_text_config(decoder=True)
    n_layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = [int(h or 0) for h in per_layer(cfg, "num_attention_heads", n_layers)]
    kv = [int(k or h) for k, h in zip(per_layer(cfg, "num_key_value_heads", n_layers), heads, strict=True)]
    dims = [
        int(d or (hidden // h if h else 0)) for d, h in zip(per_layer(cfg, "head_dim", n_layers), heads, strict=True)
    ]
    n_heads, n_kv, head_dim = (heads or [0])[0], (kv or [0])[0], (dims or [0])[0]
    # a length <= 0 means "no limit" (XLNet's max_position_embeddings is -1)
    context = next((v for k in CONTEXT_KEYS if type(v := getattr(cfg, k, None)) is int and v > 0), None)
    try:
        layer_types = [_layer_type(layer) for layer in DynamicCache(config=cfg).layers]
    except Exception:  # a custom config DynamicCache cannot read: every layer is taken as full attention
        layer_types = []
    # no layer_types: DynamicCache would say "full"
    if str(getattr(cfg, "model_type", "")) in RECURRENT_TYPES:
        layer_types = ["recurrent"] * n_layers
    if len(layer_types) != n_layers:
        layer_types = ["full"] * n_layers
    return HFModelInfo(
        architecture=type(model).__name__,
        model_type=str(getattr(model.config, "model_type", "?")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=int(cfg.vocab_size),
        context=context,
        learned_positions=_has_position_table(model, context),
        layer_types=layer_types,
        attn_implementation=str(getattr(model.config, "_attn_implementation", None) or "default"),
        transformers_version=transformers.__version__,
        kv_widths=[k * d for k, d in zip(kv, dims, strict=True)],
        sparse_topk=next((v for k in SPARSE_TOPK_KEYS if type(v := getattr(cfg, k, None)) is int), None),
        config_layer_types=_config_layer_types(cfg),
    )


def _config_layer_types(cfg) -> list[str]:
    """The layer kinds transformers' caches read from a config (cache_utils.get_layer_types_and_kwargs); none
    where this transformers has no such reader or cannot read the config."""
    read = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    try:
        return [str(t) for t in read(cfg)[0]] if read is not None else []
    except Exception:  # a custom config the reader does not understand
        return []


def per_layer(cfg, name: str, n_layers: int) -> list:
    """Config attribute `name` for each of `n_layers` layers (None where absent). A transformers 5.x config may hold
    an attribute per layer (`per_layer_config`, e.g. Gemma 4's head_dim), and reading it globally then raises."""
    if name in (getattr(cfg, "per_layer_attributes", None) or ()):
        return [getattr(layer, name, None) for layer in cfg.per_layer_config][:n_layers]
    return [getattr(cfg, name, None)] * n_layers


def _layer_type(layer) -> str:
    """One layer of transformers' DynamicCache, in HFModelInfo.layer_types' words."""
    state = isinstance(layer, getattr(cache_utils, "LinearAttentionCacheLayerMixin", ()))
    if not isinstance(layer, cache_utils.DynamicLayer):
        return "recurrent" if state else "none"
    window = getattr(layer, "sliding_window", None)
    kind = f"sliding({window})" if window else "full"
    return f"recurrent+{kind}" if state else kind


def _has_position_table(model, context: int | None) -> bool:
    """A learned absolute position embedding: an nn.Embedding other than the token embedding with (about)
    `context` rows (OPT keeps 2 extra)."""
    if context is None:
        return False
    tokens = model.get_input_embeddings()
    return any(
        isinstance(m, torch.nn.Embedding) and m is not tokens and context <= m.num_embeddings <= context + 2
        for m in model.modules()
    )
