"""What `verify` checks: a subject is one model with one cache design. The checks (check/suite.py) are written once
against this protocol; our GPT-2 with one of our caches (check/gpt2_subject.py) and a Hugging Face model with one of
transformers' caches (check/hf_subject.py) implement it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from kvbench.check.judge import Tolerance

if TYPE_CHECKING:
    from kvbench.check.probe import Probe


class Unsupported(Exception):
    """An operation the cache's own library declares it cannot do at this point: the check is a skip row saying so."""


@dataclass
class Run:
    """A greedy run: what each sequence generated and the logits each token was chosen from."""

    tokens: list[list[int]]  # (B, N) generated ids
    logits: torch.Tensor  # (B, N, V) fp32 on the CPU
    cache_layers: list[str] = field(default_factory=list)  # class names of the cache's layers, where known
    cache: object = None  # the cache object the run returned, where the library returns one (transformers)


@dataclass
class NoCache:
    """The no-cache path's tokens for a prompt, the (N, V) logits they were chosen from, and what they are."""

    tokens: list[int]
    rows: torch.Tensor
    words: str  # what the greedy check compared, e.g. "40 greedy tokens vs no cache"
    source: str  # the no-cache path's name, e.g. "generate(use_cache=False)"


class Model(Protocol):
    """The model under test, shared by its subjects: its no-cache forward and, where there is one, an independent
    implementation of the same weights."""

    dtype: torch.dtype
    reference_name: str | None  # the independent implementation, or None when the model is its own reference

    def full_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """One no-cache forward over prompt + tokens[:-1]: (T + N - 1, V) fp32 on the CPU; row T-1+i predicts
        step i."""

    def no_cache(self, prompt: list[int], new: int, cached: list[int]) -> NoCache:
        """The no-cache path's N tokens for `prompt` (`cached`: the tokens the cached run chose, for a path that
        reads them teacher-forced)."""

    def unjudged(self, longest: int) -> str | None:
        """Why a difference in a run of `longest` tokens (prompt + new) cannot be judged exact, or None: the model
        makes a discontinuous choice over keys (a sparse top-k indexer), so rounding may change which it keeps."""

    def left_padding_note(self) -> str:
        """Why padded rows may differ on the no-cache path, in words (what the model lacks)."""


@runtime_checkable
class ReferencedModel(Model, Protocol):
    """A model with an independent implementation of the same weights (reference_name set): the reference row."""

    def reference_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """The independent implementation's (T + N - 1, V) logits over the same tokens."""

    def continuation(self, prompt: list[int], new: int) -> list[int]:
        """Any N tokens that follow `prompt` (the no-cache path is held to the reference over them)."""


class Session(Protocol):
    """One live cache of a subject, driven a forward at a time (the lifecycle checks)."""

    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        """Write (B, T) tokens after what the cache holds, every row the same count; (B, T, V) fp32 logits on the
        CPU."""

    def prepare_rollback(self, most: int) -> None:
        """Prepare a fresh cache for drafts that may be rolled back, as the library's own speculative decoding
        does: no rollback will remove more than `most` tokens, all written by the last forward."""

    def crop(self, length: int) -> None:
        """Keep the first `length` columns (speculative decoding's rollback)."""

    def fork(self) -> Session:
        """An independent session holding the same tokens (prefix reuse)."""

    def reorder(self, index: list[int]) -> None:
        """Hold rows `index` of the batch, in that order (beam search)."""


class Subject(Protocol):
    """One model with one cache design, as a check drives it."""

    cache: str  # the name rows carry
    cached: bool  # False: the model's no-cache path
    tol: Tolerance  # cached vs recomputed logits
    reference_tol: Tolerance  # against the model's independent implementation
    crashes: tuple[type[BaseException], ...]  # what a run may raise and a row reports as a failure

    @property
    def model(self) -> Model: ...

    def unavailable(self) -> str | None:
        """Why this subject cannot run here (a skip row), or None."""

    def known(self, check: str, detail: str) -> str | None:
        """A known defect of a library under this subject that explains a failing `check` (its row's `detail`): the
        row is reported as that library's and not judged; None for a failure that is the subject's own."""

    def generate(self, prompts: list[list[int]], new: int) -> Run:
        """Greedy generation of exactly `new` tokens, left-padded, through this cache (a fresh one)."""

    def reused(self, prev: list[int], prompt: list[int], new: int) -> tuple[Run, str]:
        """Generate for `prev`, then for `prompt` on the same cache objects, prepared for reuse as this design
        does; the run for `prompt` and what was reused, in words."""

    def open(self, batch: int, max_len: int) -> Session:
        """A fresh cache for `batch` rows of up to `max_len` tokens."""

    def generation_features(self, check: str) -> list[tuple[str, Callable, Callable]]:
        """The generation features built on `check`'s operation: (name, run, reference), each a function of
        (prompt, new) returning N tokens that must be equal."""

    def missing_lifecycle(self, members: tuple[str, ...]) -> str | None:
        """Why the operations `members` cannot run on this cache (a skip row), or None."""

    def replay(self) -> Replay:
        """This subject as a replay of a failing row sees it (check/locate.py)."""


class Replay(Protocol):
    """A subject as check/locate.py replays it: what it reruns, what it is held to, and where it is tapped."""

    subject: Any  # the subject the replay reruns: this one, or its eager twin when this one is compiled
    head: torch.nn.Module  # the output projection its runs sample from (the tokens each call chose)
    n_layers: int
    heads: range | None  # the heads (key/value heads) this process holds of the whole model's, None: all of them
    rank: int | None  # this process's tensor-parallel rank, None in one process

    def forward(self, seq: list[int]) -> dict:
        """The whole model's no-cache forward over `seq`, recorded: {layer: (K (H, n, Dh), V (H, n, Dh), Y)} fp32,
        Y each position's attention output per head (n, H, Dh), or (n, 1, C), or None."""

    def taps(self, probe: Probe) -> AbstractContextManager[None]:
        """While open, every forward call of the subject's runs hands `probe` what attention read and computed."""
