"""What every peer engine shares: the key of a model's weights (converted models are cached under it), the ids as token
strings, and what a generation returns."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvbench.model.gpt2 import GPT

EOT = "<|endoftext|>"


def weights_key(model: GPT) -> str:
    """A hash of the weights' names, shapes and float32 bytes: the same weights give the same key anywhere."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def token(i: int, vocab_size: int) -> str:
    """Id `i` as a peer's token string: the last id is GPT-2's <|endoftext|>, every other its decimal digits."""
    return EOT if i == vocab_size - 1 else str(i)


@dataclass
class Generation:
    """A peer's greedy generation: its tokens, each step's logits, and when each token came."""

    tokens: list[list[int]]  # (B, N) generated ids
    logits: torch.Tensor | None  # (B, N, V) float32: each step's logits from the cached path (record_logits)
    ttft_s: float  # the call's start to the first token
    step_s: list[float]  # each later token's time after the one before
    total_s: float

    @property
    def rows(self) -> torch.Tensor:
        """The (B, N, V) logits, which a generation with `record_logits` has."""
        assert self.logits is not None, "generate(..., record_logits=True)"
        return self.logits
