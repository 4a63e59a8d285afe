"""The registry of injected KV-cache bugs behind `kvbench break`.

Each fault is a buggy rule or a buggy cache, passed from outside into the very loop `generate` runs (its
`DecodeRules`, decode/generate.py): the loop, the model and the caches hold no fault switch.
    position        RestartingPositions   positions restart at 0 every forward call (arange(T) per call)
    mask            CausalFlagInDecode    SDPA's causal flag on in a cached decode step (aligned top-left)
    padding         RightPadding          right padding, positions 0..T-1, no padding mask; logits at [:, -1]
    reset           NoReset               caches reused for a new prompt without reset()
    static-pointer  PointerOneShort       a StaticCache whose write pointer is left on the last written slot
    stale-rollback  StaleCrop             a DynamicCache whose crop lowers the count but keeps the rejected columns
    aliased-fork    AliasedFork           a StaticCache whose fork shares its storage
    reorder-keys-only  KeysOnlyReorder    a StaticCache whose reorder moves K rows but not V rows
    chunk-causal    ChunkCausal           SDPA's causal flag for a chunk of T > 1 queries over past + T keys
    int8-reorder-scales  HalfScalesReorder   an int8 reorder that rounds the scales it moves (lossy: policy rows)
    int8-requantised-fork  RequantisedFork  an int8 fork that quantises its copy twice (lossy: policy rows)
    sink-evicts-one-more  EvictsOneMore   a sink eviction one token early (lossy: policy rows)
    tp-neighbour-slice  NeighbourSlice    a rank's cache keeps the next rank's heads from a K/V hand-off (--tp only)
    tp-rank-crop    RankZeroCrop          a rollback cropped on rank 0 only (--tp only)
The bugs themselves live in check/fault_caches.py. Each fault's `demo` runs the correct and the faulty path side by side and measures the bug's signature;
check/breaking.py runs every `verify` check with the fault injected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.caches import get_cache_spec, sink
from kvbench.check.fault_caches import (
    AliasedFork,
    CausalFlagInDecode,
    ChunkCausal,
    KeysOnlyReorder,
    LayerFactory,
    NoReset,
    RestartingPositions,
    RightPadding,
    StaleCrop,
    evicts_one_more,
    half_scales_reorder,
    layer_factory,
    neighbour_slice,
    pointer_one_short,
    rank_zero_crop,
    requantised_fork,
)
from kvbench.check.gpt2_subject import GPT2Model, GPT2Subject, fresh_caches, run
from kvbench.check.lifecycle import SCENARIOS
from kvbench.decode.generate import (
    EXACT,
    DecodeRules,
)
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPT, Block


@dataclass(frozen=True)
class Fault:
    name: str
    summary: str  # the bug in one line
    where: str  # the line it lives at
    signature: str  # how it shows in output
    fix: str  # the one-line fix
    dormant_where: str  # where it cannot fire, so "it works there" proves nothing
    cache: str = "dynamic"  # the cache it is run against by default
    batched: bool = False  # needs a batch of prompts of different lengths
    # the bug lives outside the cache (generation, attention), so any cache can carry it
    any_cache: bool = True
    rules: DecodeRules = EXACT  # the loop's rules with the buggy one in
    # (config, batch, max_len, dtype, device) -> a buggy layer cache in place of the design's own; None: the design's
    layer_cache: LayerFactory | None = None
    # (model, fault, prompts, new, cache) -> (correct tokens, faulty tokens, dormant shown, signature measured)
    demo: Callable[..., tuple] | None = None
    tp: bool = False  # fires only across tensor-parallel ranks (break --tp 2 or more); in one process it is dormant
    fires_past: int = 0  # fires only once a run's context (prompt + new tokens) exceeds this many tokens
    # hides under a lossy design's own bound: only the =policy rows catch it, and they run in one process (not --tp)
    policy_only: bool = False

    def applies_to(self, cache: str) -> bool:
        return cache != "none" and (self.any_cache or cache == self.cache)


def _caches(model: GPT, cache: str, batch: int, max_len: int, fault: Fault | None = None) -> list:
    """fresh_caches of a design that holds a cache (a fault never runs on `none`: Fault.applies_to)."""
    caches = fresh_caches(model, cache, batch, max_len, fault)
    assert caches is not None, f"{cache} holds no cache"
    return caches


@torch.inference_mode()
def mask_signature(model: GPT, prompt: list[int]) -> dict:
    """The `mask` bug measured on the model's real layer-0 queries and keys for the first decode step (hook-free:
    prefill into a dynamic cache, recompute the next token's q/k by hand). SDPA with V = identity returns the
    attention weights themselves, so we read the distribution each causal flag produces."""
    device = model.lm_head.weight.device
    T = len(prompt)
    caches = _caches(model, "dynamic", 1, T + 1)
    ids = torch.tensor([prompt], device=device)
    logits = model(ids, torch.arange(T, device=device)[None], caches)
    nxt = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
    tr, block = model.transformer, model.transformer.h[0]
    assert isinstance(block, Block), type(block)
    attn = block.attn
    x = block.ln_1(tr.wte(nxt) + tr.wpe(torch.tensor([[T]], device=device)))  # (1, 1, C)
    B, H, Dh = x.size(0), attn.n_head, attn.head_dim  # the heads this model holds (a shard's: its slice)
    q, k, _ = attn.c_attn(x).split(H * Dh, dim=2)
    q, k = (t.view(B, 1, H, Dh).transpose(1, 2) for t in (q, k))  # (1, H, 1, Dh)
    keys = torch.cat([caches[0].k, k], dim=2)  # (1, H, S, Dh), S = T + 1
    S = keys.size(2)
    eye = torch.eye(S, device=device, dtype=q.dtype).expand(1, attn.n_head, S, S)  # V = one-hot per key
    right = F.scaled_dot_product_attention(q, keys, eye, is_causal=False)[:, :, 0].float()  # (1, H, S) weights
    wrong = F.scaled_dot_product_attention(q, keys, eye, is_causal=True)[:, :, 0].float()
    return {
        "keys": S,
        "mass_on_key0_wrong": float(wrong[..., 0].mean()),
        "mass_on_key0_right": float(right[..., 0].mean()),
        "keys_attended_wrong": int((wrong > 1e-6).sum(-1).max()),
        "keys_attended_right": int((right > 1e-6).sum(-1).min()),
    }


# --- what each fault does, shown beside the correct path: (correct tokens, faulty tokens, dormant shown, signature)
def demo_batched(model: GPT, f: Fault, prompts: list[list[int]], new: int, cache: str) -> tuple:
    """On the batch, showing its shortest prompt (the most padding); dormant: that prompt alone."""
    row = min(range(len(prompts)), key=lambda b: len(prompts[b]))
    correct = run(model, prompts, new, cache).tokens[row]
    faulty = run(model, prompts, new, cache, f).tokens[row]
    dormant = run(model, [prompts[row]], new, cache, f).tokens[0]
    shown = f"alone (a batch of one) the faulty path gives the correct tokens: {dormant == correct}"
    longest = max(map(len, prompts))
    return (
        correct,
        faulty,
        shown,
        f"{f.signature}; shown: the length-{len(prompts[row])} prompt of a batch padded to {longest}",
    )


def demo_reuse(model: GPT, f: Fault, prompts: list[list[int]], new: int, cache: str) -> tuple:
    """prompts[1], then prompts[0] on the same caches; dormant: a fresh cache."""
    prompt, other = prompts[0], prompts[1]
    # room for both prompts' tokens: the bug keeps the first one's, and a fixed-capacity cache must show stale
    # columns, not overflow
    caches = _caches(model, cache, 1, len(other) + len(prompt) + 2 * new)
    run(model, [other], new, cache, f, caches)
    stale = caches[0].length
    faulty = run(model, [prompt], new, cache, f, caches).tokens[0]
    correct = run(model, [prompt], new, cache).tokens[0]
    dormant = run(model, [prompt], new, cache, f).tokens[0]  # fresh caches: nothing stale
    shown = f"on a fresh cache the faulty path gives the correct tokens: {dormant == correct}"
    return (
        correct,
        faulty,
        shown,
        f"{f.signature}; shown: the prefill started with {stale} stale columns instead of 0",
    )


def _single(model: GPT, f: Fault, prompt: list[int], new: int, cache: str) -> tuple[list[int], list[int], list]:
    correct = run(model, [prompt], new, cache).tokens[0]
    caches = _caches(model, cache, 1, len(prompt) + new, f)
    return correct, run(model, [prompt], new, cache, f, caches).tokens[0], caches


def demo_single(model: GPT, f: Fault, prompts: list[list[int]], new: int, cache: str) -> tuple:
    """One prompt through the correct and the faulty cache; dormant: the faulty cache in one process."""
    correct, faulty, _ = _single(model, f, prompts[0], new, cache)
    shown = "shown below: every verify check passes in one process"
    return correct, faulty, shown, f"{f.signature}; shown: this rank's greedy tokens with the fault in"


def demo_eviction(model: GPT, f: Fault, prompts: list[list[int]], new: int, cache: str) -> tuple:
    """One prompt through the correct and the faulty cache; dormant: a run that fits the window (nothing evicted)."""
    correct, faulty, _ = _single(model, f, prompts[0], new, cache)
    held = sink.DEFAULT_SINK + sink.DEFAULT_WINDOW
    short = prompts[0][: held // 2]
    n = held - len(short)
    same = run(model, [short], n, cache).tokens == run(model, [short], n, cache, f).tokens
    shown = f"a run of {held} tokens (nothing evicted) gives the correct tokens through the faulty cache: {same}"
    return correct, faulty, shown, f"{f.signature}; shown: greedy tokens once the context passes {held}"


def demo_pointer(model: GPT, f: Fault, prompts: list[list[int]], new: int, cache: str) -> tuple:
    """One prompt; the cache's length after the run shows the pointer stuck."""
    correct, faulty, caches = _single(model, f, prompts[0], new, cache)
    shown = f"the prefill's token is right: {faulty[0] == correct[0]}"
    held = f"after {len(prompts[0]) + new - 1} tokens the cache holds {caches[0].length}"
    return correct, faulty, shown, f"{f.signature}; shown: {held}"


def _dormant_without_cache(model: GPT, f: Fault, prompt: list[int], new: int, correct: list[int]) -> str:
    dormant = run(model, [prompt], new, "none", f).tokens[0]
    return f"on the no-cache path the faulty code gives the correct tokens: {dormant == correct}"


def demo_positions(model: GPT, f: Fault, prompts: list[list[int]], new: int, cache: str) -> tuple:
    prompt = prompts[0]
    correct, faulty, _ = _single(model, f, prompt, new, cache)
    fed = f"decode steps fed position 0 instead of {len(prompt)}, {len(prompt) + 1}, ..."
    return (
        correct,
        faulty,
        _dormant_without_cache(model, f, prompt, new, correct),
        f"{f.signature}; shown: {fed}",
    )


def demo_mask(model: GPT, f: Fault, prompts: list[list[int]], new: int, cache: str) -> tuple:
    prompt = prompts[0]
    correct, faulty, _ = _single(model, f, prompt, new, cache)
    s = mask_signature(model, prompt)
    signature = (
        f"{f.signature}; shown (layer 0, first decode step): attention mass on key 0 "
        f"{s['mass_on_key0_wrong']:.2f} (correct: {s['mass_on_key0_right']:.2f}), attended to "
        f"{s['keys_attended_wrong']} of {s['keys']} keys"
    )
    return correct, faulty, _dormant_without_cache(model, f, prompt, new, correct), signature


def demo_lifecycle(check: str) -> Callable[..., tuple]:
    """A lifecycle fault shown by its check's own scenario (check/lifecycle.py) with the correct cache and with the
    faulty one; dormant: plain generation, which never crops, forks or reorders (nor writes a chunk after a prefix)."""

    def demo(model: GPT, f: Fault, prompts: list[list[int]], new: int, cache: str) -> tuple:
        target = GPT2Model(model, reference="none")
        short = min(new, 16)
        correct = SCENARIOS[check](GPT2Subject(target, cache), prompts, short).tokens
        faulty = SCENARIOS[check](GPT2Subject(target, cache, f), prompts, short).tokens
        plain = run(model, [prompts[0]], new, cache).tokens[0]
        dormant = run(model, [prompts[0]], new, cache, f).tokens[0]
        shown = f"plain generate through the faulty code gives the correct tokens: {dormant == plain}"
        return (
            correct,
            faulty,
            shown,
            f"{f.signature}; shown: the greedy choice at each of the {check} scenario's {len(correct)} positions",
        )

    return demo


# One registry of faults: CLI choices, `break all` and test parametrisation iterate this dict.
FAULTS: dict[str, Fault] = {
    "position": Fault(
        "position",
        "positions restart at 0 every forward call (arange(T) per call)",
        "the loop's position rule (generation.Positions), the positions fed to each forward",
        "fluent garbage: every cached decode step embeds its token at position 0",
        "positions = past + arange(T): the loop owns the positions and passes them in",
        "the no-cache path: it feeds the whole sequence every call, so arange(T) is accidentally right",
        rules=DecodeRules(positions=RestartingPositions()),
        demo=demo_positions,
    ),
    "mask": Fault(
        "mask",
        "SDPA's causal flag left on during cached decode",
        "the mask attention hands SDPA (model.MaskRule), in every layer",
        "SDPA aligns a non-square causal mask top-left: the one decode query attends only to key 0",
        "is_causal only when queries and keys are the same tokens (prefill); no mask for a one-token decode step",
        "the no-cache path and the prefill: there queries and keys are the same T tokens, so causal is right",
        rules=DecodeRules(mask=CausalFlagInDecode()),
        demo=demo_mask,
    ),
    "padding": Fault(
        "padding",
        "batched decode with right padding, logits gathered at [:, -1], no padding mask",
        "the loop's padding rule (generation.Padding, the batch layout)",
        "short prompts sample from a padding column and attend to pads: their output goes off the rails",
        "left-pad so every last token shares the last column; carry the padding mask into every step",
        "a batch of one, or of equal-length prompts: nothing is padded",
        batched=True,
        rules=DecodeRules(padding=RightPadding()),
        demo=demo_batched,
    ),
    "reset": Fault(
        "reset",
        "caches reused for a new prompt without reset()",
        "the loop's reuse rule (generation.CacheReuse), where passed-in caches are prepared",
        "the new prompt's prefill attends to the previous prompt's stale K/V",
        "reset() every layer's cache before a new prompt (or allocate fresh caches)",
        "the first prompt on a fresh cache, and every test that builds a new cache per run",
        rules=DecodeRules(reuse=NoReset()),
        demo=demo_reuse,
    ),
    "static-pointer": Fault(
        "static-pointer",
        "static-cache write pointer off by one: left on the last written slot",
        "caches.StaticCache.update (a subclass, PointerOneShort)",
        "each decode step overwrites the previous token's K/V: the cache never grows past the prompt",
        "self.length = end (one past the last written slot), not end - 1",
        "the prefill (the first token is always right) and every other cache",
        cache="static",
        any_cache=False,
        layer_cache=pointer_one_short,
        demo=demo_pointer,
    ),
    "stale-rollback": Fault(
        "stale-rollback",
        "crop lowers the count but attention still reads the rejected draft slots",
        "the cache's crop (a DynamicCache subclass, StaleCrop)",
        "after a rejected draft the next steps attend to tokens that were never accepted",
        "crop drops the columns past `length` (or a fixed buffer masks them); the next write lands at `length`",
        "every run that never rolls back: plain generate, and speculative decoding that accepts every draft",
        any_cache=False,
        layer_cache=layer_factory(StaleCrop),
        demo=demo_lifecycle("rollback"),
    ),
    "aliased-fork": Fault(
        "aliased-fork",
        "fork returns a cache over the same storage",
        "the cache's fork (a StaticCache subclass, AliasedFork)",
        "two continuations of one prefix overwrite each other's K/V: both go wrong after their first step",
        "fork copies the buffers (or shares them copy-on-write, copying before the first write)",
        "a prefix reused once, with the original never written again, and every run that never forks",
        cache="static",
        any_cache=False,
        layer_cache=layer_factory(AliasedFork),
        demo=demo_lifecycle("fork"),
    ),
    "reorder-keys-only": Fault(
        "reorder-keys-only",
        "beam reorder moves the rows of K but not those of V",
        "the cache's reorder (a StaticCache subclass, KeysOnlyReorder)",
        "after the first reorder a beam attends with its own keys to another beam's values",
        "reorder every per-row buffer (K, V, scales, block tables) with the same index",
        "greedy and sampling without beams, and a reorder that keeps every row in place (index 0..B-1)",
        cache="static",
        any_cache=False,
        layer_cache=layer_factory(KeysOnlyReorder),
        demo=demo_lifecycle("reorder"),
    ),
    "tp-neighbour-slice": Fault(
        "tp-neighbour-slice",
        "a K/V hand-off between tensor-parallel ranks keeps the next rank's head slice",
        "the rank's cache (a DynamicCache subclass, NeighbourSlice): the slice index of an all-gather",
        "every rank attends with another rank's keys and values: the all-reduced logits go wrong from the prefill",
        "keep parts[rank], this rank's own heads [r*H/N, (r+1)*H/N)",
        "one process (tp 1): the next rank is itself, so every single-device check passes",
        any_cache=False,
        layer_cache=neighbour_slice,
        demo=demo_single,
        tp=True,
    ),
    "tp-rank-crop": Fault(
        "tp-rank-crop",
        "a rollback (crop) applied on rank 0 only",
        "the rank's cache crop (a DynamicCache subclass, RankZeroCrop)",
        "after a rejected draft the other ranks still attend to it: the all-reduced logits go wrong after a rollback",
        "every rank crops its own slice to the same length (the rollback is a collective decision)",
        "one process (tp 1), and every run that never rolls back",
        any_cache=False,
        layer_cache=rank_zero_crop,
        demo=demo_lifecycle("rollback"),
        tp=True,
    ),
    "int8-reorder-scales": Fault(
        "int8-reorder-scales",
        "an int8 cache's reorder rounds the scales it moves (an fp16 copy)",
        "the int8 cache's reorder (an Int8Cache subclass, HalfScalesReorder)",
        "after a beam reorder every value is off by up to 1 part in 2,048: logits move far less than the loose "
        "bound; off the declared roundtrip",
        "reorder every per-row buffer in its own dtype (index_select on the scales as stored)",
        "greedy and sampling without beams, and the loose rows: the error hides under a lossy cache's own bound",
        cache="int8",
        any_cache=False,
        layer_cache=half_scales_reorder,
        demo=demo_lifecycle("reorder"),
        policy_only=True,
    ),
    "int8-requantised-fork": Fault(
        "int8-requantised-fork",
        "an int8 cache's fork quantises the dequantised values again (fp16 scales: double rounding)",
        "the int8 cache's fork (an Int8Cache subclass, RequantisedFork)",
        "the fork's values round twice: its continuation drifts by less than the loose bound; off the roundtrip",
        "fork copies the stored int8 values and scales as they are (nothing is quantised twice)",
        "every run that never forks, and the loose rows: the drift is smaller than the cache's own error",
        cache="int8",
        any_cache=False,
        layer_cache=requantised_fork,
        demo=demo_lifecycle("fork"),
        policy_only=True,
    ),
    "sink-evicts-one-more": Fault(
        "sink-evicts-one-more",
        "a sink cache's eviction keeps a window one token short",
        "the sink cache's eviction (a SinkCache subclass, EvictsOneMore)",
        "every query past the window loses the oldest position it should read: inside the loose bound of an eviction "
        "policy; off its declared visibility",
        "evict k <= q - W for the call's first query q (keep k > q - W), no earlier",
        "any context within S + W tokens (nothing is evicted), and the loose rows: eviction moves logits anyway",
        cache="sink",
        any_cache=False,
        layer_cache=evicts_one_more,
        demo=demo_eviction,
        fires_past=sink.DEFAULT_SINK + sink.DEFAULT_WINDOW,
        policy_only=True,
    ),
    "chunk-causal": Fault(
        "chunk-causal",
        "SDPA's causal flag for a chunk written after cached tokens",
        "the mask attention hands SDPA (model.MaskRule), for a block of T > 1 queries over past + T keys",
        "SDPA aligns the non-square causal mask top-left: the chunk attends to the first keys, not its own past",
        "a causal mask aligned bottom-right (query i reads keys <= past + i), or is_causal only when T == S",
        "a prompt prefilled in one call and one-token decode steps: plain generate never writes a chunk after a prefix",
        rules=DecodeRules(mask=ChunkCausal()),
        demo=demo_lifecycle("chunked_prefill"),
    ),
}


def get_fault(name: str) -> Fault:
    name = name.strip()
    if name not in FAULTS:
        raise KVBenchError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)} (or all)")
    return FAULTS[name]


def parse_fault_names(name: str) -> list[str]:
    return list(FAULTS) if name.strip() == "all" else [get_fault(name).name]


def select_faults(
    name: str, cache: str | None, tp: int = 1, context: tuple[int, int] | None = None
) -> tuple[list[str], dict[str, str]]:
    """(the faults `name` runs on `cache` across `tp` ranks, {fault skipped: why}): a fault that lives inside another
    cache design, that needs a left-padded batch on a cache that takes none (`CacheSpec.padding`), that fires only
    across tensor-parallel ranks when tp is 1, or that fires only past a longer context than the run's (`context`:
    the shown prompt's length and the new tokens). A single fault that cannot run is refused."""
    names = parse_fault_names(name)
    if cache == "none":
        raise KVBenchError("--cache none: the faults live in cached decoding; name a cache")
    why = {}
    for n in names:
        f = FAULTS[n]
        carrier = cache or f.cache
        if cache is not None and not f.applies_to(cache):
            why[n] = f"the bug lives inside the {f.cache} cache, not in {cache}"
        elif f.batched and not get_cache_spec(carrier).padding:
            why[n] = (
                f"it needs a left-padded batch, and {carrier} takes none: it evicts by position, so its slots are "
                "positions, not columns"
            )
        elif f.tp and tp == 1:
            why[n] = "it fires only across tensor-parallel ranks: run it with --tp 2 (or more)"
        elif f.policy_only and tp > 1:
            why[n] = (
                "it hides under the lossy design's own bound, and only the =policy rows catch it; they run in one "
                "process: run it without --tp"
            )
        elif context is not None and sum(context) <= f.fires_past:
            prompt, new = context
            why[n] = (
                f"it fires only past {f.fires_past} tokens of context, and this run's prompt of {prompt} token"
                f"{'s' * (prompt != 1)} and {new} new one{'s' * (new != 1)} stay within them, where the bug is dormant: "
                f"use --new-tokens {f.fires_past + 1 - prompt} or more"
            )
    if why and name.strip() != "all":
        f = FAULTS[name.strip()]
        if f.tp and tp == 1:
            raise KVBenchError(
                f"the {f.name} fault fires only across tensor-parallel ranks: run it with --tp 2 (or more)"
            )
        if cache is not None and not f.applies_to(cache):
            raise KVBenchError(f"the {f.name} fault lives in the {f.cache} cache; it cannot run on {cache!r}")
        raise KVBenchError(f"the {f.name} fault {why[f.name].removeprefix('it ')}")
    return [n for n in names if n not in why], why
