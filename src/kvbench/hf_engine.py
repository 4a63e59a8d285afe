"""Transformers' own `generate` on our weights: the library users would otherwise reach for, timed beside ours.

The Hugging Face model is built from our GPT by the inverse of the weight port (a plain copy: same names and
(in, out) layouts), so both engines run the same weights, prompt ids and dtype. Decoding is greedy with
exactly N new tokens (min_new_tokens = max_new_tokens, no end-of-text stop), SDPA attention, and no automatic
torch.compile (`disable_compile=True`), so HF's static cache is timed eagerly like ours.

What HF's numbers include. A `LogitsProcessor` is called once per generated token, right after that token's
forward pass and before its argmax; it synchronises the device and stamps the clock. So:
- ttft: from entering `generate` (device synchronised) to the first stamp: input checks, cache allocation, input
  preparation and the prefill forward;
- step i: from stamp i-1 to stamp i: the previous token's argmax, HF's stopping criteria and bookkeeping, the
  cache update, input preparation and one decode forward;
- total: the whole `generate` call, synchronised at both ends (so it also includes the last argmax).
Ours (`generation.generate`) times forward + sample per step; its total is likewise the whole call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvbench.devices import synchronize
from kvbench.model import GPT
from kvbench.weights import to_hf_model

# Our cache names -> the transformers `generate` arguments that select the equivalent cache.
HF_CACHES: dict[str, dict] = {
    "none": {"use_cache": False},  # full recompute every step
    "dynamic": {"use_cache": True},  # transformers' DynamicCache (torch.cat growth)
    "static": {"use_cache": True, "cache_implementation": "static"},  # preallocated StaticCache
}


def build_hf_model(model: GPT):
    """transformers' GPT2LMHeadModel with `model`'s weights, device and dtype, SDPA attention (the inverse port)."""
    return to_hf_model(model, attn_implementation="sdpa")


@dataclass
class HFTiming:
    tokens: list[list[int]]  # (B, N) generated ids
    ttft_s: float
    step_s: list[float]
    total_s: float
    cache_bytes: int | None  # bytes of HF's cache tensors at the end (None without a cache)


def _token_clock(device: torch.device):
    from transformers import LogitsProcessor

    class TokenClock(LogitsProcessor):
        """Stamps a synchronised clock each time HF has the logits of a new token."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            synchronize(device)
            self.stamps.append(time.perf_counter())
            return scores

    return TokenClock()


def _cache_nbytes(cache) -> int | None:
    """Bytes of K/V tensors held by a transformers Cache (layers[i].keys/values in transformers 5)."""
    if cache is None:
        return None
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


def _returned_cache(out):
    """The cache `generate` returned: the `cache` field in recent transformers, `past_key_values` before (reading
    the old name where the new one exists only triggers a deprecation warning)."""
    names = getattr(type(out), "__dataclass_fields__", {})
    return getattr(out, "cache" if "cache" in names else "past_key_values", None)


@torch.inference_mode()
def hf_generate(hf_model, ids: torch.Tensor, new_tokens: int, cache: str) -> HFTiming:
    """Greedy-generate exactly `new_tokens` for the (B, T) prompt `ids` with HF's cache named `cache`."""
    from transformers import LogitsProcessorList

    device = ids.device
    clock = _token_clock(device)
    synchronize(device)
    t0 = time.perf_counter()
    out = hf_model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
        disable_compile=True,
        return_dict_in_generate=True,
        **HF_CACHES[cache],
    )
    synchronize(device)
    t1 = time.perf_counter()
    stamps = clock.stamps[:new_tokens]
    assert len(stamps) == new_tokens, f"HF produced {len(stamps)} token stamps, expected {new_tokens}"
    seq = out.sequences[:, ids.size(1) :]
    assert seq.size(1) == new_tokens, f"HF generated {seq.size(1)} tokens, expected {new_tokens}"
    return HFTiming(
        tokens=seq.tolist(),
        ttft_s=stamps[0] - t0,
        step_s=[b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        total_s=t1 - t0,
        cache_bytes=_cache_nbytes(_returned_cache(out)),
    )
