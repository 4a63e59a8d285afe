"""Transformers' own `generate` on our weights: the library users would otherwise reach for, timed beside ours.

The Hugging Face model is built on the meta device (no random init, no host copy) and then given our GPT's own
tensors (`load_state_dict(assign=True)`: same names, same (in, out) Conv1D layouts, lm_head tied), so both engines
run the very same weight memory, prompt ids and dtype, and the weights are counted once. Decoding is greedy with
exactly N new tokens (min_new_tokens = max_new_tokens, no end-of-text stop) and SDPA attention.

Two ways to run transformers' static cache, as users get them:
- `hf` engine: `disable_compile=True`, so every cache (static included) runs eagerly, like ours;
- `hf-compiled` engine: `cache_implementation="static"` with transformers' default automatic compile of the decode
  forward (`CompileConfig()`: inductor, mode "reduce-overhead"). transformers compiles automatically only on CUDA
  (and XPU/TPU/Neuron) devices; on the CPU this row runs the static cache eagerly, and meta.json says so.

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
from typing import Any

import torch
from transformers import GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

from kvbench.devices import synchronize
from kvbench.hf.caches import generate_kwargs
from kvbench.model.gpt2 import GPT
from kvbench.model.hf_config import hf_gpt2_config


def fixed_length(
    ids: torch.Tensor,
    new: int,
    pad_token_id: int,
    mask: torch.Tensor | None = None,
    beams: int = 1,
    logits: bool = False,
) -> dict[str, Any]:
    """`generate`'s arguments for exactly `new` tokens after the (B, T) prompt `ids` (min = max new tokens, so no
    end-of-text stop), greedy, or a greedy beam search with `beams`; `mask` (B, T) where rows are left-padded;
    `logits`: keep each step's logits. generate then returns an output whose `.sequences` are (B, T + new)."""
    prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids) if mask is None else mask}
    search = {"do_sample": False, "num_beams": beams, "max_new_tokens": new, "min_new_tokens": new}
    return prompt | search | {"pad_token_id": pad_token_id, "return_dict_in_generate": True, "output_logits": logits}


# Our caches that transformers has by the same name (hf/caches.py selects each in generate).
ENGINE_CACHES = ("none", "dynamic", "static")


def build_hf_model(model: GPT):
    """transformers' GPT2LMHeadModel holding `model`'s own weight tensors (shared, not copied, except where our
    model lays a weight out otherwise: then transformers gets it (in, out)), SDPA attention.

    Built on the meta device, so transformers' random init never runs and nothing is allocated on the host; then
    every parameter is assigned from our state dict: already on the device, already in the target dtype."""
    cfg = hf_gpt2_config(model.config, "sdpa")
    with torch.device("meta"):
        hf = GPT2LMHeadModel(cfg)
    # lm_head is tied to wte; a weight our model lays out (out, in) for its CPU kernels (GPT.lay_out) is copied into
    # the (in, out) layout transformers' Conv1D was written for, so its engine runs as its users get it
    sd = {k: t.contiguous() for k, t in model.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    assert list(missing) == ["lm_head.weight"] and not unexpected, (
        f"HF port mismatch: missing {missing}, unexpected {unexpected}"
    )
    hf.tie_weights()
    on_meta = [n for n, t in (*hf.named_parameters(remove_duplicate=False), *hf.named_buffers()) if t.is_meta]
    assert not on_meta, f"HF model tensors left without storage: {on_meta}"
    return hf.eval()


def compiled_decode(hf_model) -> bool:
    """Whether transformers has compiled this model's decode forward (its automatic compile has run)."""
    return getattr(hf_model, "_compiled_call", None) is not None


@dataclass
class HFTiming:
    tokens: list[list[int]]  # (B, N) generated ids
    ttft_s: float
    step_s: list[float]
    total_s: float
    cache_bytes: int | None  # bytes of HF's cache tensors at the end (None without a cache)
    logits: list[torch.Tensor] | None = None  # (B, V) fp32 on the CPU per generated token, when recorded
    cache_slots: int | None = None  # token slots of the cache's largest layer at the end (None without a cache)


def _token_clock(device: torch.device):
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


def _cache_slots(cache) -> int | None:
    """Token slots of a transformers Cache's largest layer: what a growing layer holds, a static one is sized for."""
    layers = getattr(cache, "layers", None) or []
    slots = [k.size(-2) for x in layers if isinstance(k := getattr(x, "keys", None), torch.Tensor)]
    return max(slots) if slots else None


def _returned_cache(out):
    """The cache `generate` returned: the `cache` field in recent transformers, `past_key_values` before (reading
    the old name where the new one exists only triggers a deprecation warning)."""
    names = getattr(type(out), "__dataclass_fields__", {})
    return getattr(out, "cache" if "cache" in names else "past_key_values", None)


@torch.inference_mode()
def timed_generate(
    model,
    ids: torch.Tensor,
    new_tokens: int,
    pad_token_id: int,
    record_logits: bool = False,
    **generate_kwargs,
) -> HFTiming:
    """Greedy `model.generate` of exactly `new_tokens` for the (B, T) prompt `ids`, the clock stamped (device
    synchronised) once per token; `generate_kwargs` pick the cache and compile settings. Shared by the `hf` engines
    on our GPT-2 and `bench --hf`'s engine on any model."""
    device = ids.device
    clock = _token_clock(device)
    synchronize(device)
    t0 = time.perf_counter()
    out = model.generate(
        **fixed_length(ids, new_tokens, pad_token_id, logits=record_logits),
        logits_processor=LogitsProcessorList([clock]),
        **generate_kwargs,
    )
    synchronize(device)
    t1 = time.perf_counter()
    stamps = clock.stamps[:new_tokens]
    assert len(stamps) == new_tokens, f"generate produced {len(stamps)} token stamps, expected {new_tokens}"
    seq = out.sequences[:, ids.size(1) :]  # (B, new_tokens)
    assert seq.size(1) == new_tokens, f"generate produced {seq.size(1)} tokens, expected {new_tokens}"
    return HFTiming(
        tokens=seq.tolist(),
        ttft_s=stamps[0] - t0,
        step_s=[b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        total_s=t1 - t0,
        cache_bytes=_cache_nbytes(_returned_cache(out)),
        logits=[x.float().cpu() for x in out.logits] if record_logits else None,  # (B, V) per token
        cache_slots=_cache_slots(_returned_cache(out)),
    )


def hf_generate(
    hf_model,
    ids: torch.Tensor,
    new_tokens: int,
    cache: str,
    compile: bool = False,
    record_logits: bool = False,
) -> HFTiming:
    """Greedy-generate exactly `new_tokens` for the (B, T) prompt `ids` with HF's cache named `cache`.

    compile: leave transformers' automatic compile on (its default for a static cache on CUDA); False runs eagerly.
    record_logits: also return each token's logits (for explaining token flips; never in a timed run)."""
    kwargs = {**generate_kwargs(cache), "disable_compile": not compile}
    return timed_generate(hf_model, ids, new_tokens, 0, record_logits, **kwargs)
