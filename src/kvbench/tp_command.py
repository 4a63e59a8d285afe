"""A command run with --tp N becomes ranks here: the one rule on what splits, then its ranks launched (kvbench's
launcher) or this process joined as one of them (started by kvbench's launcher or by torchrun).

    split = Split(tp, device, timeout_s, config=cfg)    our GPT-2 (its config), or hf=SOURCE for a Hugging Face model
    code = launch(split, argv)                          the launcher: refused before any rank starts, else the ranks'
                                                        verdict (their exit status)
    rank = join(split)                                  a rank: this process's Rank (None for --tp 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbench.distributed import Rank
    from kvbench.model.gpt2 import GPTConfig


@dataclass(frozen=True)
class Split:
    """What a --tp command splits over its ranks, and how they run."""

    tp: int  # the ranks (--tp)
    device: str  # --device as given (a rank on CUDA runs on cuda:LOCAL_RANK)
    timeout_s: float  # the collective timeout (--tp-timeout)
    config: GPTConfig | None = None  # our GPT-2's shape; or
    hf: str | None = None  # a Hugging Face source, split by transformers' own plan
    trust_remote_code: bool = False  # with hf

    def check_shape(self) -> None:
        """The one shape rule: heads, KV heads (and our MLP width) divide by --tp; a Hugging Face model has a plan."""
        assert (self.config is None) != (self.hf is None), "one model: our GPT-2's config or a Hugging Face source"
        if self.config is not None:
            from kvbench import validate

            cfg = self.config
            validate.tp_shape_rules(self.tp, cfg.name, cfg.n_head, cfg.n_head, 4 * cfg.n_embd)
        else:
            from kvbench.hf.tp import check_tp_model

            assert self.hf is not None
            check_tp_model(self.hf, self.tp, self.trust_remote_code)

    def check_fits(self) -> None:
        """On the CPU: ranks the machine's cores and memory can hold (distributed.check_ranks_fit)."""
        from kvbench.distributed import check_ranks_fit, weights_bytes

        check_ranks_fit(self.tp, self.device, weights_bytes(self.config if self.config is not None else self.hf))


def launch(split: Split, argv: list[str]) -> int:
    """Launch `python -m kvbench *argv` as split.tp ranks, once what cannot be split or held is refused; the ranks'
    verdict (rank 0's exit status) when they end; RanksFailed when they end without one (kvbench.launcher)."""
    from kvbench import console, launcher

    split.check_shape()
    split.check_fits()
    with console.stdout_inherited():  # rank 0 prints the --json document
        return launcher.launch(split.tp, argv)


def join(split: Split) -> Rank | None:
    """This process as one of split.tp ranks (the model's shape checked first, on every rank), on its own device
    (cuda:LOCAL_RANK on CUDA); None for --tp 1: the whole model in one process."""
    if split.tp == 1:
        return None
    from kvbench import distributed
    from kvbench.devices import resolve_device

    split.check_shape()
    return distributed.start(split.tp, resolve_device(split.device), split.timeout_s)
