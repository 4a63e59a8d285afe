"""A Hugging Face subject as a replay sees it (check/locate.py): the eager subject to rerun, the whole model as
reference, the key/value heads this process holds, the forward with K/V recorded, and the taps (a forward pre-hook
that hands each cache object the model is given a tapping `update`, and hooks on the attention modules, which know
their `layer_idx`, for their outputs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvbench.check.probe import Probe
from kvbench.hf.caches import HFCache
from kvbench.hf.models import LoadedHF

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from kvbench.hf.models import CausalLM


class _Whole(Protocol):
    loaded: LoadedHF  # the whole model


class Replayed(Protocol):
    """What a replay reads of a Hugging Face subject (check/hf_subject.py HFSubject)."""

    cache: str
    spec: HFCache
    loaded: LoadedHF  # the model its cached runs go through (a rank's shard, or the whole model)

    @property
    def model(self) -> _Whole: ...


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' attention modules: they know their layer (`layer_idx`)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and getattr(m, "layer_idx", None) is not None
    ]


class HFReplay:
    """A Hugging Face subject as a replay sees it: the eager subject to rerun (generate's compile off), the whole
    model as reference, the key/value heads this process holds."""

    def __init__(
        self, s: Replayed, forward_inputs: Callable[[CausalLM, torch.Tensor], dict[str, torch.Tensor]]
    ) -> None:
        # forward_inputs: the subject's (check/hf_subject.py): the inputs generate gives the forward besides the ids
        from kvbench.hf.caches import HF_CACHES

        self.forward_inputs = forward_inputs

        self.subject = s
        if "compile_config" in s.spec.generate_kwargs:  # the same cache, eager
            eager = next(
                n for n, c in HF_CACHES.items() if c.build is s.spec.build and "compile_config" not in c.generate_kwargs
            )
            self.subject = copy.copy(s)
            self.subject.cache, self.subject.spec = eager, HF_CACHES[eager]
        self.runner, self.whole = s.loaded.model, s.model.loaded
        self.head, self.n_layers = self.runner.get_output_embeddings(), len(_attention_modules(self.runner))
        self.heads = self.rank = None
        if s.loaded is not s.model.loaded:  # a tensor-parallel rank's shard
            import torch.distributed as dist

            from kvbench.model.tp import rank_heads

            self.rank = dist.get_rank()
            self.heads = rank_heads(self.whole.info.n_kv_heads, self.rank, dist.get_world_size())

    @torch.no_grad()
    def forward(self, seq: list[int]) -> dict:
        from transformers import DynamicCache

        from kvbench.hf.caches import text_config
        from kvbench.hf.introspect import cache_kwarg

        model = self.whole.model
        kv: dict[int, tuple] = {}
        ys: dict[int, torch.Tensor] = {}

        def update(
            key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            kv[layer_idx] = (key_states[0].float(), value_states[0].float())  # (H, n, Dh)
            return key_states, value_states  # the whole sequence's, as the no-cache forward attends

        cache = DynamicCache(config=text_config(model))
        cache.update = update  # type: ignore[method-assign]  # this object records the forward's K/V, caches nothing

        def y(module: Any, args: tuple[Any, ...], out: Any) -> None:  # a transformers attention module
            ys[module.layer_idx] = (out[0] if isinstance(out, tuple) else out)[0, :, None].float()  # (n, 1, C)

        hooks = [m.register_forward_hook(y) for m in _attention_modules(model)]
        try:
            ids = torch.tensor([seq], device=next(model.parameters()).device)  # (1, n)
            model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                use_cache=True,
                **{cache_kwarg(): cache},
                **self.forward_inputs(model, ids),
            )
        finally:
            for h in hooks:
                h.remove()
        return {i: (k, v, ys.get(i)) for i, (k, v) in kv.items()}

    @contextmanager
    def taps(self, probe: Probe) -> Iterator[None]:
        from transformers.cache_utils import Cache

        from kvbench.hf.introspect import cache_kwarg

        tap, tapped = _Tap(probe), []

        def give(
            module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> None:  # each cache object the model is given updates through the tap meanwhile
            for name in {cache_kwarg(), "past_key_values"}:
                cache = kwargs.get(name)
                if isinstance(cache, Cache) and not isinstance(cache.__dict__.get("update"), _TappedUpdate):
                    cache.update = _TappedUpdate(cache, tap)  # type: ignore[method-assign]  # this object's own
                    tapped.append(cache)

        def y(module: Any, args: tuple[Any, ...], out: Any) -> None:  # a transformers attention module
            t = out[0] if isinstance(out, tuple) else out  # (B, T, C)
            probe.attn(module.layer_idx, t[:, :, None], per_head=False)

        hooks = [self.runner.register_forward_pre_hook(give, with_kwargs=True)]
        # a shard's attention output is its heads' share before the all-reduce: compared on one process only
        hooks += [] if self.heads is not None else [m.register_forward_hook(y) for m in _attention_modules(self.runner)]
        try:
            yield
        finally:
            tap.probe = None
            for h in hooks:
                h.remove()
            for cache in tapped:
                cache.__dict__.pop("update", None)


class _Tap:
    """What the tapped caches of one replay share: the probe (None once the replay ends) and the last layer seen,
    so a layer index that does not grow starts the next forward call."""

    def __init__(self, probe: Probe) -> None:
        self.probe: Probe | None = probe
        self.last: int | None = None

    def saw(self, cache: Cache, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.probe is None:
            return
        if self.last is None or layer_idx <= self.last:
            self.probe.next_call()
        self.last = layer_idx
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        self.probe.kv(layer_idx, k, v, windowed=bool(getattr(layer, "is_sliding", False)))


class _TappedUpdate:
    """A transformers cache object's `update` while a replay taps it: its class's own update, what that returns
    handed to the probe. A fork (`copy.deepcopy`, as transformers users fork) gets its own, over the copy."""

    def __init__(self, cache: Cache, tap: _Tap) -> None:
        self.cache, self.tap = cache, tap

    def __call__(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = type(self.cache).update(self.cache, key_states, value_states, layer_idx, *args, **kwargs)
        self.tap.saw(self.cache, layer_idx, k, v)
        return k, v

    def __deepcopy__(self, memo: dict) -> _TappedUpdate:
        return _TappedUpdate(memo.get(id(self.cache), self.cache), self.tap)  # the copy is in memo by then
