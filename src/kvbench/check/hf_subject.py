"""A Hugging Face causal LM with one of transformers' caches (hf/caches.py) as a check subject.

The model is its own reference: transformers' no-cache path on the same model object, `generate(use_cache=False)`
for greedy tokens and one forward with `use_cache=False` over a whole prefix for single steps, the inputs built as
`generate` builds them (ids and an attention mask; the model derives its own positions). Every cached run goes
through `generate` exactly as a user calls it, with the cache selected by name.
"""

from __future__ import annotations

import torch

from kvbench.check.judge import tolerance
from kvbench.check.subject import NoCache, Run
from kvbench.hf.caches import HF_CACHES, generate_kwargs, reuse_kwargs
from kvbench.hf.models import LoadedHF, cache_kwarg, returned_cache

NO_CACHE_SOURCE = "generate(use_cache=False)"


@torch.no_grad()  # as generate itself runs: a cache it returns can be reset() and reused by the caller
def generate_run(loaded: LoadedHF, prompts: list[list[int]], new: int, **kwargs) -> Run:
    """Greedy `generate` of exactly `new` tokens for `prompts`, left-padded with an attention mask."""
    model = loaded.model
    device = next(model.parameters()).device
    T = max(map(len, prompts))
    ids = torch.tensor([[loaded.pad_token_id] * (T - len(p)) + p for p in prompts], device=device)  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=device)  # (B, T)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
        pad_token_id=loaded.pad_token_id, return_dict_in_generate=True, output_logits=True, **kwargs,
    )  # fmt: skip
    logits = torch.stack([step.float().cpu() for step in out.logits], dim=1)  # (B, N, V)
    assert logits.shape[1] == new, f"generate returned {logits.shape[1]} logit steps, expected {new}"
    cache = returned_cache(out)
    layers = [type(x).__name__ for x in getattr(cache, "layers", [])] if cache is not None else []
    return Run(out.sequences[:, T:].tolist(), logits, layers)


@torch.no_grad()
def full_logits(loaded: LoadedHF, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """One no-cache forward over prompt + tokens[:-1]: (T + N - 1, V) fp32 on the CPU; row T-1+i predicts step i."""
    device = next(loaded.model.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)  # (1, T + N - 1)
    out = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return out.logits[0].float().cpu()


class HFModel:
    """A loaded Hugging Face model as the model under test; its no-cache runs memoised, shared by every cache."""

    reference_name = None  # the model is its own reference

    def __init__(self, loaded: LoadedHF) -> None:
        self.loaded = loaded
        self.dtype = next(loaded.model.parameters()).dtype
        self.device = next(loaded.model.parameters()).device
        self._full: dict[tuple, torch.Tensor] = {}
        self._nocache: dict[tuple, Run] = {}

    def full_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        key = (tuple(prompt), tuple(tokens))
        if key not in self._full:
            self._full[key] = full_logits(self.loaded, prompt, tokens)
        return self._full[key]

    def no_cache(self, prompt: list[int], new: int, cached: list[int]) -> NoCache:
        key = (tuple(prompt), new)
        if key not in self._nocache:
            self._nocache[key] = generate_run(self.loaded, [prompt], new, use_cache=False)
        ref = self._nocache[key]
        return NoCache(ref.tokens[0], ref.logits[0], f"{new} tokens vs {NO_CACHE_SOURCE}", NO_CACHE_SOURCE)


class HFSubject:
    """The model with transformers' cache `cache` (a name in HF_CACHES)."""

    # transformers raises many types (ValueError, RuntimeError, IndexError, ...): each is a failed row
    crashes = (Exception,)

    def __init__(self, model: HFModel, cache: str) -> None:
        self.model, self.cache, self.spec = model, cache, HF_CACHES[cache]
        self.cached = self.spec.build is not None
        self.tol = tolerance(model.dtype, lossy=self.spec.lossy)
        self.reference_tol = self.tol
        self.cache_layers: list[str] | None = None  # what the first cached run built

    def unavailable(self) -> str | None:
        info = self.model.loaded.info
        if not info.kv_layers:
            return f"{info.model_type} keeps a recurrent state, no KV cache"
        return self.spec.unavailable(info, self.model.device) if self.spec.unavailable else None

    def generate(self, prompts: list[list[int]], new: int) -> Run:
        res = generate_run(self.model.loaded, prompts, new, **generate_kwargs(self.cache))
        if self.cache_layers is None:
            self.cache_layers = res.cache_layers
        return res

    def reused(self, prev: list[int], prompt: list[int], new: int) -> tuple[Run, str]:
        obj = self.spec.build(self.model.loaded.model, max(len(prev), len(prompt)) + new)
        kw = {cache_kwarg(): obj, **reuse_kwargs(self.cache)}
        generate_run(self.model.loaded, [prev], new, **kw)
        obj.reset()
        return generate_run(
            self.model.loaded, [prompt], new, **kw
        ), f"a {type(obj).__name__} reset() and reused"
