"""Our GPT-2 with one of our caches (built-in or plugin) as a check subject, through `generate`, the very loop
`kvbench generate` runs; an injected fault (`kvbench break`) passes its rules and caches into that loop.

The no-cache path as one forward. The `none` loop runs N forwards over prefixes of length T, T+1, ...; causal
attention makes row T-1+i of ONE forward over prompt + generated tokens exactly what that loop computes at step i
(position j never reads a later token). So greedy compares the cached tokens with the argmax of those rows: if every
row's argmax is the cached token, the `none` loop produces the same N tokens; the first row where it is not is the
first divergent step. The no-cache path itself is held to an independent implementation, transformers'
GPT2LMHeadModel with the same weights, by the `reference` row of cache `none`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvbench.caches import get_cache_spec, make_caches
from kvbench.caches.base import LayerCache
from kvbench.caches.plugins import missing_lifecycle
from kvbench.check.gpt2_replay import GPT2Replay
from kvbench.check.judge import tolerance
from kvbench.check.subject import NoCache, Run
from kvbench.decode.generate import EXACT, DecodeRules, GenerationResult, generate
from kvbench.decode.path import CachePath
from kvbench.decode.speculative import speculative_generate
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPT, GPTConfig
from kvbench.model.weights import to_hf_model

if TYPE_CHECKING:  # transformers takes a second to import and to exit: `generate` reads this module
    from transformers import GPT2LMHeadModel

REFERENCE = "transformers GPT2LMHeadModel (eager, fp32)"


class Injection(Protocol):
    """What a check runs with in place of the correct code (faults.Fault): the loop's rules, and optionally a layer
    cache factory (config, batch, max_len, dtype, device) in place of the design's own."""

    @property
    def rules(self) -> DecodeRules: ...

    @property
    def layer_cache(self) -> Callable[[GPTConfig, int, int, torch.dtype, torch.device], LayerCache] | None: ...


def fresh_caches(model: GPT, cache: str, batch: int, max_len: int, fault: Injection | None = None) -> list | None:
    """The caches a check runs on: the design's own, or the injected fault's layer cache (`kvbench break`)."""
    w = model.lm_head.weight
    if fault is not None and fault.layer_cache is not None:
        return [
            fault.layer_cache(model.cache_config, batch, max_len, w.dtype, w.device)
            for _ in range(model.config.n_layer)
        ]
    return make_caches(cache, model.cache_config, batch, max_len, w.dtype, w.device)


def run(
    model: GPT,
    prompts: list[list[int]],
    new: int,
    cache: str,
    fault: Injection | None = None,
    caches: list | None = None,
    compile: str = "off",
) -> GenerationResult:
    """Greedy generation with logits recorded, through `generate`; with `fault`, the same loop with the fault's
    rules and caches passed in."""
    if caches is None:
        caches = fresh_caches(model, cache, len(prompts), max(map(len, prompts)) + new, fault)
    rules = EXACT if fault is None else fault.rules
    return generate(model, prompts, new, cache=cache, record_logits=True, caches=caches, rules=rules, compile=compile)


def as_run(res: GenerationResult) -> Run:
    assert res.logits is not None, "a check's run records its logits"
    return Run(res.tokens, torch.stack(res.logits, dim=1))  # (B, N, V)


@torch.inference_mode()
def full_logits(model: GPT, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """One no-cache forward over prompt + tokens[:-1]: (T + N - 1, V) fp32 on the CPU; row T-1+i predicts step i."""
    device = model.lm_head.weight.device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)  # (1, T + N - 1)
    pos = torch.arange(ids.size(1), device=device)[None]  # (1, T + N - 1)
    return model(ids, pos)[0].float().cpu()


def hf_reference(model: GPT, hf_dir: str | None = None) -> GPT2LMHeadModel:
    """transformers' GPT2LMHeadModel in fp32 with eager attention (matmul + softmax, not SDPA, so it shares no
    attention kernel with us), on our model's device. From `hf_dir` when our weights came from that Hugging Face
    directory (so a bug in our port cannot hide); otherwise our weights copied into it (the inverse port:
    same names and layouts)."""
    if hf_dir is None:
        return to_hf_model(model, attn_implementation="eager", dtype=torch.float32)
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    # transformers wraps `to` with functools.wraps(nn.Module.to), which its types leave unbound (self unfilled)
    return hf.to(model.lm_head.weight.device).eval()  # type: ignore[arg-type]


@torch.inference_mode()
def hf_logits(hf: GPT2LMHeadModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's logits over prompt + tokens[:-1], (T + N - 1, V) fp32 on the CPU."""
    ids = torch.tensor([prompt + tokens[:-1]], device=next(hf.parameters()).device)
    return hf(input_ids=ids, use_cache=False).logits[0].float().cpu()


class GPT2Model:
    """Our GPT-2 as the model under test: its no-cache forward (memoised per sequence, shared by every cache) and
    transformers' GPT2LMHeadModel on the same weights as its independent reference (`reference="hf"`)."""

    def __init__(self, model: GPT, reference: str = "hf", hf_dir: str | None = None) -> None:
        self.gpt, self.hf_dir = model, hf_dir
        self.dtype = model.lm_head.weight.dtype
        self.hf = hf_reference(model, hf_dir) if reference == "hf" else None
        self.reference_name = REFERENCE if self.hf is not None else None
        self._full: dict[tuple, torch.Tensor] = {}
        self._ref: dict[tuple, torch.Tensor] = {}

    def full_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        key = (tuple(prompt), tuple(tokens))
        if key not in self._full:
            self._full[key] = full_logits(self.gpt, prompt, tokens)
        return self._full[key]

    def no_cache(self, prompt: list[int], new: int, cached: list[int]) -> NoCache:
        rows = self.full_logits(prompt, cached)[len(prompt) - 1 :]  # (N, V)
        return NoCache(rows.argmax(-1).tolist(), rows, f"{new} greedy tokens vs no cache", "no cache")

    def reference_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        key = (tuple(prompt), tuple(tokens))
        if key not in self._ref:
            assert self.hf is not None, "reference logits need the reference model (reference='hf')"
            self._ref[key] = hf_logits(self.hf, prompt, tokens)
        return self._ref[key]

    def unjudged(self, longest: int) -> str | None:
        return None  # dense attention: every difference is judged

    def left_padding_note(self) -> str:
        return "with no cache at all: suspect the padding mask or the position ids (our GPT-2 takes both)"

    def continuation(self, prompt: list[int], new: int) -> list[int]:
        """Tokens a cached run already produced for `prompt` (any tokens do), else a dynamic-cache run's."""
        seen = next((list(t) for p, t in self._full if p == tuple(prompt) and len(t) == new), None)
        return seen if seen is not None else run(self.gpt, [prompt], new, "dynamic").tokens[0]


class GPT2Subject:
    """Our GPT-2 with cache `cache`, optionally with a fault injected and a compiled fixed-shape step. `runner`: the
    model the cached runs go through when it is not the model under test itself (a tensor-parallel rank's shard,
    held to the whole model in this process)."""

    # an invariant tripped inside a run (a model assert, a cache overflow): a failed row, not a traceback
    crashes: tuple[type[BaseException], ...] = (KVBenchError, AssertionError, RuntimeError)

    def __init__(
        self,
        model: GPT2Model,
        cache: str,
        fault: Injection | None = None,
        compile: str = "off",
        runner: GPT | None = None,
        tp: int = 1,
    ) -> None:
        spec = get_cache_spec(cache)
        self.model, self.cache, self.fault, self.compile = model, cache, fault, compile
        self.gpt = runner if runner is not None else model.gpt
        self.cached, self.exact = spec.factory is not None, spec.exact
        self.pads = spec.padding  # it takes a left-padded batch
        self.last_caches: list | None = None  # the layer caches of the last run or session (check/policy.py reads them)
        lossy = None if spec.exact else (spec.logit_rtol, spec.logit_atol)
        own: dict[str, Any] = dict(
            lossy=lossy, min_agreement=spec.min_greedy_agreement, source="its logit_atol, logit_rtol"
        )
        self.tol = tolerance(model.dtype, tp=tp, **own)
        self.reference_tol = tolerance(model.dtype, reference=True, **own)
        # judged by its =policy rows (which run beside these in one process; under --tp rank_cache holds each rank's
        # stored values to the policy), not by its loose bound
        self.by_policy = spec.held_to_policy
        self.policy_judge = "the =policy rows" if tp == 1 else "rank_cache (each rank's stored values, every step)"

    def known(self, check: str, detail: str) -> str | None:
        """Every part of our GPT-2 and its caches is kvbench's own: no failure is another library's. A design held
        to its declared policy is judged by its =policy rows; a loose row past its bound is what the policy costs
        against full precision (reported, with its distortion), not a verdict. A run that raised stays a failure."""
        if not self.by_policy or detail.startswith("the run raised"):
            return None
        return (
            f"held exactly to its policy by {self.policy_judge}; past the loose bound is the policy's cost (distortion)"
        )

    def unavailable(self) -> str | None:
        return None

    def generate(self, prompts: list[list[int]], new: int) -> Run:
        caches = fresh_caches(self.gpt, self.cache, len(prompts), max(map(len, prompts)) + new, self.fault)
        self.last_caches = caches
        return as_run(run(self.gpt, prompts, new, self.cache, self.fault, caches, self.compile))

    def reused(self, prev: list[int], prompt: list[int], new: int) -> tuple[Run, str]:
        gpt = self.gpt
        caches = fresh_caches(gpt, self.cache, 1, max(len(prev), len(prompt)) + new, self.fault)
        self.last_caches = caches
        run(gpt, [prev], new, self.cache, self.fault, caches, self.compile)
        res = run(gpt, [prompt], new, self.cache, self.fault, caches, self.compile)  # generate resets them
        return as_run(res), "reused after another prompt"

    def open(self, batch: int, max_len: int) -> GPT2Session:
        caches = fresh_caches(self.gpt, self.cache, batch, max_len, self.fault)
        assert caches is not None, f"{self.cache} holds no cache to drive"
        self.last_caches = caches
        return GPT2Session(self, caches)

    def generation_features(self, check: str) -> list[tuple[str, Callable, Callable]]:
        """`rollback`: `generate --draft prompt-lookup` (drafts verified in one forward, the rest cropped) against
        plain greedy through the same cache. Not with an injected fault, whose caches the feature does not use."""
        if check != "rollback" or self.fault is not None:
            return []
        gpt = self.gpt

        def drafted(prompt: list[int], new: int) -> list[int]:
            return speculative_generate(gpt, [prompt], new, self.cache).generation.tokens[0]

        def plain(prompt: list[int], new: int) -> list[int]:
            return run(gpt, [prompt], new, self.cache).tokens[0]

        return [("generate --draft prompt-lookup", drafted, plain)]

    def replay(self) -> GPT2Replay:
        """This subject as a replay of a failing row sees it (check/locate.py)."""
        return GPT2Replay(self)

    def missing_lifecycle(self, members: tuple[str, ...]) -> str | None:
        caches = fresh_caches(self.gpt, self.cache, 1, 1, self.fault)
        assert caches is not None, f"{self.cache} holds no cache to probe"
        layer = caches[0]
        lacks = [m for m in members if m in missing_lifecycle(layer)]
        name = type(getattr(layer, "inner", layer)).__name__
        return f"{name} has no {', '.join(lacks)} (an optional member of the cache contract)" if lacks else None


class GPT2Session(CachePath):
    """Our GPT-2 driven one forward at a time over its own caches (decode.path: the session counts the tokens it
    wrote, positions held + arange(T) per call), under the subject's mask rule; logits (B, T, V) in fp32 on the CPU."""

    def __init__(self, subject: GPT2Subject, caches: list[LayerCache], held: int = 0) -> None:
        rules = subject.fault.rules if subject.fault is not None else EXACT
        super().__init__(subject.gpt, caches, held, mask_rule=rules.mask)
        self.subject = subject

    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        return super().forward(ids).float().cpu()

    def prepare_rollback(self, most: int) -> None:
        """Nothing to prepare: every design can crop at any length."""

    def crop(self, length: int) -> None:
        for c in self.caches:
            c.crop(length)
        self.held = length

    def fork(self) -> GPT2Session:
        copy = GPT2Session(self.subject, [c.fork() for c in self.caches], self.held)
        self.subject.last_caches = copy.caches  # the copy is what a fork check writes into last
        return copy

    def reorder(self, index: list[int]) -> None:
        idx = torch.tensor(index, device=self.model.lm_head.weight.device)
        for c in self.caches:
            c.reorder(idx)
