"""Our GPT-2 over its layer caches, driven one forward call at a time by a caller that chooses every token (the
checks' sessions, teacher-forced distortion).

The path owns the positions: a call's T tokens take positions held + arange(T), where `held` counts every token
written before (a filled context, earlier calls), whatever the caches keep: an eviction design holds fewer slots
than the positions it has seen.
"""

from __future__ import annotations

import torch

from kvbench.caches.base import LayerCache
from kvbench.model.gpt2 import EXACT_MASK, GPT, MaskRule


class CachePath:
    def __init__(
        self,
        model: GPT,
        caches: list[LayerCache],
        held: int = 0,
        mask_rule: MaskRule = EXACT_MASK,
        last_only: bool = False,
    ) -> None:
        self.model, self.caches, self.held = model, caches, held
        self.mask_rule, self.last_only = mask_rule, last_only  # last_only: logits of each row's last token only

    @torch.inference_mode()
    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        """The logits of `ids` (B, T) written after what the path holds: (B, T, V), or (B, 1, V) with last_only."""
        device = self.model.lm_head.weight.device
        x = torch.tensor(ids, device=device)  # (B, T)
        pos = (self.held + torch.arange(x.size(1), device=device)).expand_as(x)  # (B, T)
        self.held += x.size(1)
        return self.model(x, pos, self.caches, mask_rule=self.mask_rule, last_only=self.last_only)
