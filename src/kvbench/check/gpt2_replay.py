"""Our GPT-2 subject as a replay sees it (check/locate.py): the eager subject to rerun, the whole model as
reference, the heads this process holds, the forward with K/V recorded, and the taps (a forward pre-hook that hands
attention a tapping stand-in for its cache, and one on `c_proj` for each head's attention output).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, cast

import torch

from kvbench.caches.base import LayerCache
from kvbench.check.probe import Probe
from kvbench.model.gpt2 import GPT, Block


class _Whole(Protocol):
    gpt: GPT  # the whole model


class Replayed(Protocol):
    """What a replay reads of our GPT-2 subject (check/gpt2_subject.py GPT2Subject)."""

    compile: str
    gpt: GPT  # the model its cached runs go through (a rank's shard, or the whole model)

    @property
    def model(self) -> _Whole: ...


def _reads(mask: object) -> int | None:
    """The key slots attention reads this call, from the mask the model built (the fixed-shape step's too)."""
    n = getattr(mask, "n_valid", None)
    if n is not None:
        return int(n)
    allowed = getattr(mask, "allowed", None)  # (B, 1, 1, L)
    if allowed is None:
        return None
    cols = allowed.reshape(-1, allowed.size(-1)).any(0).nonzero()
    return int(cols.max()) + 1 if cols.numel() else 0


class _Tap:
    """Stands in for one layer's cache (or the fixed-shape step's slot writer) for one attention call: updates it
    and passes what it returns to the probe."""

    def __init__(self, cache: LayerCache, layer: int, probe: Probe, read: int | None) -> None:
        self.cache, self.layer, self.probe, self.read = cache, layer, probe, read
        self.visible = getattr(cache, "visible", None)  # the design's own policy: the model's mask asks it

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.update(k, v, positions)
        self.probe.kv(self.layer, k, v, self.read)
        return k, v

    @property
    def key_positions(self) -> torch.Tensor | None:
        """An evicting design's slot positions (the model masks by them), passed through."""
        return getattr(self.cache, "key_positions", None)


class GPT2Replay:
    """Our GPT-2 subject as a replay sees it: the eager subject to rerun, the whole model as reference, the heads
    this process holds."""

    def __init__(self, s: Replayed) -> None:
        from kvbench.model.tp import place, rank_heads

        self.subject = s
        if s.compile != "off":
            self.subject = copy.copy(s)
            self.subject.compile = "off"
        self.runner, self.whole = s.gpt, s.model.gpt
        at = place(self.runner)
        self.heads = rank_heads(self.whole.config.n_head, at.rank, at.world) if at.heads_split else None
        self.rank = at.rank if at.heads_split else None
        self.head: torch.nn.Module = self.runner.lm_head  # what the run samples from
        self.n_layers = len(self.runner.transformer.h)

    @torch.inference_mode()
    def forward(self, seq: list[int]) -> dict:
        gpt, cfg = self.whole, self.whole.config
        H, Dh, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        got: dict[int, list] = {}
        hooks = []
        for i, block in enumerate(gpt.transformer.h):
            attn = cast(Block, block).attn

            def kv(module: torch.nn.Module, args: tuple[Any, ...], out: Any, i: int = i) -> None:
                _, k, v = out[0].split(C, dim=-1)  # (n, C) each
                got[i] = [t.view(-1, H, Dh).transpose(0, 1).float() for t in (k, v)]  # (H, n, Dh)

            def y(module: torch.nn.Module, args: tuple[Any, ...], i: int = i) -> None:
                got[i].append(args[0][0].view(-1, H, Dh).float())  # (n, H, Dh)

            hooks += [attn.c_attn.register_forward_hook(kv), attn.c_proj.register_forward_pre_hook(y)]
        try:
            device = gpt.lm_head.weight.device
            ids = torch.tensor([seq], device=device)  # (1, n)
            gpt(ids, torch.arange(len(seq), device=device)[None])
        finally:
            for h in hooks:
                h.remove()
        return {i: tuple(t) for i, t in got.items()}

    @contextmanager
    def taps(self, probe: Probe) -> Iterator[None]:
        hooks = []
        for i, block in enumerate(self.runner.transformer.h):
            attn = cast(Block, block).attn

            def cache(module: torch.nn.Module, args: tuple[Any, ...], i: int = i) -> tuple[Any, ...] | None:
                if i == 0:
                    probe.next_call()
                x, positions, c, mask = args
                return None if c is None else (x, positions, _Tap(c, i, probe, _reads(mask)), mask)

            def y(module: torch.nn.Module, args: tuple[Any, ...], i: int = i) -> None:
                B, T, _ = args[0].shape
                probe.attn(i, args[0].view(B, T, -1, self.whole.config.head_dim))  # (B, T, h, Dh)

            hooks += [attn.register_forward_pre_hook(cache), attn.c_proj.register_forward_pre_hook(y)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
