"""`kvbench memory --check`: the plan against transformers' own cache for the same config.

transformers builds the model on the meta device (shapes, no memory), allocates its `StaticCache` for the context,
and runs one decode step, so every layer's K and V tensors take the shapes the model's attention really writes.
Their bytes are summed per layer kind (full attention, sliding window, chunked) and held against the planner's.
Where they differ, one line says why: a different set of layers of that kind, more tokens held, or K/V wider than
the model needs (in transformers before 5.25, Falcon-40B's attention broadcast its 8 KV groups to all 128 heads
before caching them).
torch and transformers are imported here, only when --check is asked for.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.memory.config import Resolved, quiet_transformers
from kvbench.memory.formulas import bytes_per_sequence, layer_bytes_per_token
from kvbench.memory.spec import KVFormat, ModelSpec, get_kv_format
from kvbench.memory.units import fmt_int

CHECK_FORMATS = ("fp32", "fp16", "bf16")  # what transformers' StaticCache stores (its element count x these bytes)
_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
# Layers x contexts one --check may run: 16 contexts of the largest public models (~130 layers), about 20 s.
MAX_LAYER_STEPS = 2048


@dataclass
class KindCheck:
    """One layer kind: the planner's bytes and transformers' allocation, and why they differ if they do."""

    kind: str  # full, sliding, chunked (transformers' other layer types by their own name)
    label: str  # "full attention", "sliding window 4,096", ...
    planner_layers: int  # layers of this kind in the plan
    transformers_layers: int  # layers of this kind in transformers' cache
    planner_bytes: int  # the planner's cache bytes for these layers
    transformers_bytes: int  # nbytes of transformers' keys and values for these layers
    planner_layer_shape: str  # what one layer holds, in the planner's terms
    transformers_layer_shape: str  # keys and values of one layer, as transformers allocated them
    agrees: bool
    explanation: str  # one line: "agrees to the byte", or why not


@dataclass
class CacheCheck:
    """One model at one context: planner vs transformers, per layer kind."""

    model: str
    ctx: int
    batch: int
    kv_dtype: str
    checkable: bool  # False: transformers cannot build this model (the note says why)
    how: str  # what was built and allocated
    planner_bytes: int
    transformers_bytes: int | None
    agrees: bool | None
    kinds: list[KindCheck] = field(default_factory=list)
    planner_params: int | None = None  # the planner's parameter estimate (a config.json's)
    # numel() of the meta-device language model built from the same file
    transformers_params: int | None = None


def check_work(spec: ModelSpec, layers: int, contexts: int) -> None:
    """Refuse a check that would run for minutes: each context is one decode step through every layer of the meta
    model, and a layer on the meta device costs about 10 ms (torch's shape functions run in Python)."""
    steps = layers * contexts
    if steps > MAX_LAYER_STEPS:
        fix = "give fewer --ctx values or drop --check" if contexts > 1 else "drop --check (the plan needs none)"
        raise KVBenchError(
            f"--check runs transformers' {spec.name} on the meta device, every layer once per context (about 10 ms "
            f"a layer): {fmt_int(layers)} layers x {contexts} context{'s' if contexts > 1 else ''} is more than "
            f"the {fmt_int(MAX_LAYER_STEPS)} layer-steps it runs; {fix}"
        )


def check_format(kv_dtype: str) -> KVFormat:
    fmt = get_kv_format(kv_dtype)
    if fmt.name not in CHECK_FORMATS:
        raise KVBenchError(
            f"--check compares with transformers' StaticCache, which stores {', '.join(CHECK_FORMATS)}; "
            f"--kv-dtype {fmt.name} has no counterpart there"
        )
    return fmt


def preset_config(spec: ModelSpec) -> tuple[Any | None, str]:
    """transformers' config for a preset's shape (configs/models.toml), or (None, why not)."""
    # transformers and torch when the check runs: --check is parsed, and this module imported, without them
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if spec.family not in CONFIG_MAPPING:
        return None, f"transformers has no model_type {spec.family!r}"
    kw: dict[str, Any] = dict(
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        hidden_size=spec.hidden_size,
        head_dim=spec.head_dim,
        sliding_window=None,
        attention_chunk_size=None,
    )
    if spec.max_context:
        kw["max_position_embeddings"] = spec.max_context
    if spec.sliding_layers:
        kind = spec.window_kind
        kw["sliding_window" if kind == "sliding" else "attention_chunk_size"] = spec.sliding_window
        layers = set(spec.sliding_layers)
        kw["layer_types"] = [f"{kind}_attention" if i in layers else "full_attention" for i in range(spec.n_layers)]
    if spec.is_mla:  # head_dim means the RoPE width in DeepSeek's config classes: theirs, not the preset's
        del kw["head_dim"]
        kw.update(kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.qk_rope_head_dim)
        kw.update(qk_nope_head_dim=spec.qk_nope_head_dim, v_head_dim=spec.v_head_dim)
    if spec.family == "falcon":
        kw.update(num_kv_heads=spec.n_kv_heads, multi_query=spec.n_kv_heads == 1)
        kw["new_decoder_architecture"] = spec.n_kv_heads not in (1, spec.n_heads)
    cls = CONFIG_MAPPING[spec.family]
    kw = {k: v for k, v in kw.items() if not isinstance(getattr(cls, k, None), property)}  # Falcon's head_dim
    with quiet_transformers():
        config = AutoConfig.for_model(spec.family, **kw)
    # A preset carries the attention shape only; the MLP keeps its class defaults, which never touch the cache.
    # DeepSeek-V2's defaults do not run on the meta device (no experts per token; a 1407-wide expert that
    # grouped_mm cannot stride), so those two are made runnable.
    if getattr(config, "num_experts_per_tok", 1) is None:
        config.num_experts_per_tok = 1
    if getattr(config, "moe_intermediate_size", 16) % 16:
        config.moe_intermediate_size = -(-config.moe_intermediate_size // 16) * 16
    return config, ""


def _build(text_config: Any):
    """The language model on the meta device: every parameter and buffer a shape, none of them memory."""
    # transformers and torch when the check runs: --check is parsed, and this module imported, without them
    import torch
    from transformers import AutoModelForCausalLM

    with quiet_transformers(), torch.device("meta"):
        # bf16 because some MoE kernels only exist for it on meta; bytes are counted in the requested format.
        return AutoModelForCausalLM.from_config(text_config, dtype=torch.bfloat16).eval()


def _allocate(model: Any, text_config: Any, ctx: int, batch: int) -> list[tuple[str, tuple | None, tuple | None]]:
    """(layer type, K shape, V shape) of every layer of transformers' StaticCache after one decode step."""
    # transformers and torch when the check runs: --check is parsed, and this module imported, without them
    import torch
    from transformers import StaticCache
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(text_config)
    cache = StaticCache(config=text_config, max_cache_len=ctx)
    ids = torch.zeros((batch, 1), dtype=torch.long, device="meta")
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with quiet_transformers(), torch.no_grad():
        model(input_ids=ids, use_cache=True, **{kw: cache})
    out = []
    for layer_type, layer in zip(types, cache.layers, strict=True):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        out.append((layer_type, None if k is None else tuple(k.shape), None if v is None else tuple(v.shape)))
    return out


def _kind_label(kind: str, spec: ModelSpec, window: int | None) -> str:
    if kind == "full":
        return "MLA latent, full" if spec.is_mla else "full attention"
    if kind in ("sliding", "chunked") and window:
        return f"{'sliding window' if kind == 'sliding' else 'chunked attention'} {fmt_int(window)}"
    return kind


def _planner_side(spec: ModelSpec, fmt: KVFormat, ctx: int, batch: int) -> dict[str, tuple[list[int], int, str]]:
    """kind -> (layer indices, bytes, what one layer holds) as the planner counts them."""
    windowed = set(spec.sliding_layers)
    out: dict[str, tuple[list[int], int, str]] = {}
    for kind in ("full", spec.window_kind):
        layers = [i for i in range(spec.n_layers) if (i in windowed) == (kind != "full")]
        if layers:
            tokens = spec.tokens_held(layers[0], ctx)
            vectors, n = spec.layer_vectors(layer=layers[0])
            what = f"latent {n}" if spec.is_mla else f"K and V {vectors // 2}x{n}"
            out[kind] = (
                layers,
                sum(layer_bytes_per_token(spec, fmt, None, i) for i in layers) * tokens * batch,
                f"{what} x {fmt_int(tokens)} tokens",
            )
    return out


def _numel(shape: tuple | None) -> int:
    n = 1
    for d in shape or (0,):
        n *= d
    return n


def _transformers_side(layers: list[tuple[str, tuple | None, tuple | None]], elem: int) -> dict[str, tuple]:
    """kind -> (layer indices, bytes, K shape, V shape of its first layer) as transformers allocated them."""
    out: dict[str, list] = {}
    for i, (layer_type, k, v) in enumerate(layers):
        entry = out.setdefault(_KINDS.get(layer_type, layer_type), [[], 0, k, v])
        entry[0].append(i)
        entry[1] += (_numel(k) + _numel(v)) * elem
    return {kind: tuple(entry) for kind, entry in out.items()}


def _explain(spec: ModelSpec, ctx: int, p: tuple, t: tuple) -> str:
    """Why one layer kind differs, in one line."""
    p_layers, p_bytes, _ = p
    t_layers, t_bytes, k, v = t
    if p_layers != t_layers:
        return f"transformers counts {len(t_layers)} layers of this kind, the planner {len(p_layers)}"
    if k is None or v is None:
        return "transformers allocated no keys or values for these layers"
    tokens = spec.tokens_held(p_layers[0], ctx)
    if k[2] != tokens:
        return f"transformers holds {fmt_int(k[2])} tokens per layer here, the planner {fmt_int(tokens)}"
    if not spec.is_mla and k[1] != spec.n_kv_heads and k[3] == spec.head_dim:
        ratio = k[1] / spec.n_kv_heads
        return (
            f"transformers caches {k[1]} heads per layer where the model has {spec.n_kv_heads} KV heads: its "
            f"attention broadcasts the KV groups to every query head before caching ({ratio:g}x what the model "
            f"needs); the planner counts the {spec.n_kv_heads} heads the model computes"
        )
    return (
        f"transformers caches K {k[1]}x{k[3]} and V {v[1]}x{v[3]} per token per layer, the planner "
        f"{spec.kv_shape}: {t_bytes / max(p_bytes, 1):.3g}x"
    )


def _compare(spec: ModelSpec, fmt: KVFormat, ctx: int, batch: int, layers: list) -> list[KindCheck]:
    planner = _planner_side(spec, fmt, ctx, batch)
    theirs = _transformers_side(layers, fmt.bits // 8)
    rows = []
    for kind in list(planner) + [k for k in theirs if k not in planner]:
        p = planner.get(kind, ([], 0, "-"))
        t = theirs.get(kind, ([], 0, None, None))
        agrees = p[0] == t[0] and p[1] == t[1]
        k, v = t[2], t[3]
        shape = "-" if k is None or v is None else f"K {'x'.join(map(str, k))}, V {'x'.join(map(str, v))}"
        rows.append(
            KindCheck(
                kind=kind,
                label=_kind_label(kind, spec, spec.sliding_window if kind != "full" else None),
                planner_layers=len(p[0]),
                transformers_layers=len(t[0]),
                planner_bytes=p[1],
                transformers_bytes=t[1],
                planner_layer_shape=p[2],
                transformers_layer_shape=shape,
                agrees=agrees,
                explanation="agrees to the byte" if agrees else _explain(spec, ctx, p, t),
            )
        )
    return rows


def _unchecked(spec: ModelSpec, fmt: KVFormat, ctxs: list[int], batch: int, why: str) -> list[CacheCheck]:
    total = {c: bytes_per_sequence(spec, fmt, c) * batch for c in ctxs}
    how = f"not checkable: {why}"
    return [CacheCheck(spec.name, c, batch, fmt.name, False, how, total[c], None, None) for c in ctxs]


def check_plan(
    spec: ModelSpec,
    config: Any | None,
    contexts: list[int],
    batch: int = 1,
    kv_dtype: str = "fp16",
    why_not: str = "",
    params: bool = False,
) -> list[CacheCheck]:
    """For each context: the planner's bytes per layer kind against transformers' StaticCache for `config`.

    params: also compare the planner's parameter count with the meta model's numel() (for a config.json, whose
    fields are the model's own; a preset's config carries only the attention shape)."""
    fmt = check_format(kv_dtype)
    # transformers keeps the state in the same cache object: no K/V-only count to compare
    if spec.state_layers:
        what = "it has no KV cache" if not spec.kv_cache else "only its attention layers cache K/V"
        return _unchecked(
            spec,
            fmt,
            contexts,
            batch,
            f"{spec.family} keeps a recurrent state ({what}); --check "
            "compares K/V caches, so it does not apply to its recurrent layers",
        )
    if config is None:
        return _unchecked(spec, fmt, contexts, batch, why_not or "no transformers config for this model")
    text = config.get_text_config(decoder=True)
    check_work(spec, getattr(text, "num_hidden_layers", None) or spec.n_layers, len(contexts))
    try:
        model = _build(text)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, NotImplementedError) as e:
        return _unchecked(spec, fmt, contexts, batch, f"transformers cannot build it: {_first_line(e)}")
    try:
        out = [_check_one(spec, fmt, model, text, ctx, batch) for ctx in contexts]
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, NotImplementedError) as e:
        why = f"its forward does not run on the meta device: {_first_line(e)}"
        return _unchecked(spec, fmt, contexts, batch, why)
    if params and spec.params is not None:
        numel = sum(p.numel() for p in model.parameters())
        for c in out:
            c.planner_params, c.transformers_params = spec.params, numel
    return out


def _check_one(spec: ModelSpec, fmt: KVFormat, model: Any, text: Any, ctx: int, batch: int) -> CacheCheck:
    # transformers and torch when the check runs: --check is parsed, and this module imported, without them
    import transformers

    kinds = _compare(spec, fmt, ctx, batch, _allocate(model, text, ctx, batch))
    how = (
        f"transformers {transformers.__version__} {type(model).__name__} on the meta device, its StaticCache "
        f"allocated for each context, one decode step at batch {batch}; bytes = elements x {fmt.bits // 8} B "
        f"({fmt.name})"
    )
    mine, theirs = sum(k.planner_bytes for k in kinds), sum(k.transformers_bytes for k in kinds)
    return CacheCheck(spec.name, ctx, batch, fmt.name, True, how, mine, theirs, mine == theirs, kinds)


def check_resolved(resolved: Resolved, contexts: list[int], batch: int = 1, kv_dtype: str = "fp16") -> list[CacheCheck]:
    """--check for a config.json: transformers' config object from the same file (or why there is none)."""
    return check_plan(resolved.spec, resolved.config, contexts, batch, kv_dtype, resolved.why_not, params=True)


def check_preset(spec: ModelSpec, contexts: list[int], batch: int = 1, kv_dtype: str = "fp16") -> list[CacheCheck]:
    """--check for a preset: transformers' config class filled with the preset's fields."""
    check_format(kv_dtype)
    config, why = preset_config(spec)
    return check_plan(spec, config, contexts, batch, kv_dtype, why)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
