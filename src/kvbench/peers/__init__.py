"""Peer engines: the decoders people run on CPUs, given the same weights as kvbench's GPT-2, so bench times them beside
our loop and verify holds their caches to the same reference.

One registry (`PEERS`): a peer's name on the command line -> how it runs. A name may also be a family standing for
several peers (`FAMILIES`: `ct2` is CTranslate2 in float32 and with int8 weights, two rows). Each peer states whether
it is exact (held to the fp32 reference tolerance) or lossy (judged by its distortion against the reference: KL
divergence (held to the bound it states), top-1 agreement and |Δp| by depth).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvbench.errors import KVBenchError

if TYPE_CHECKING:
    from kvbench.model.gpt2 import GPT
    from kvbench.peers.common import Generation


@dataclass(frozen=True)
class PeerSpec:
    name: str  # the engine's name in bench and verify rows
    family: str  # the package it runs on: ct2 (CTranslate2), llamacpp (llama.cpp through llama-cpp-python)
    compute: str  # the peer's own name for its weights' type: ct2's compute_type, a GGUF's type
    exact: bool  # held to the fp32 reference tolerance; otherwise lossy, judged by `max_kl`
    summary: str
    max_kl: float = 0.0  # lossy: the largest mean KL divergence (nats) from the reference it is held to
    weight_bytes: int = 4  # bytes per weight a decode step reads (the floor)
    kv: str = "f32"  # the KV cache's type (llama.cpp's type_k / type_v; CTranslate2 keeps float32)
    kv_bytes: float = 4.0  # bytes per K or V element the cache stores, block scales included (the floor)
    flash_attention: bool = True  # llama.cpp: attend with its flash-attention kernel (a quantised V cache needs it)
    batches: bool = True  # decodes several sequences in one call (llama-cpp-python's Llama holds one sequence)


# A lossy peer is held to a mean KL divergence from the reference, llama.cpp's measure of a quantised model (top-1
# agreement is reported beside it, not judged: on random weights the distributions are nearly flat, so top tokens
# flip at near-ties whatever the quantisation). int8 weights with per-row scales stay far below the bound on gpt2
# (docs/peers.md); a wrong scale or a broken cache moves KL by orders of magnitude.
PEERS: dict[str, PeerSpec] = {
    "ct2-fp32": PeerSpec("ct2-fp32", "ct2", "float32", True, "CTranslate2, float32 weights and cache"),
    "ct2-int8": PeerSpec(
        "ct2-int8",
        "ct2",
        "int8_float32",
        False,
        "CTranslate2, int8 weights (per-row scales), float32 activations and cache",
        max_kl=0.05,
        weight_bytes=1,
    ),
}
# llama.cpp: a float32 GGUF with a float32 cache, and a float16 GGUF with the cache types people serve it with.
# ggml's blocks of 32: q8_0 stores 32 int8 + one fp16 scale (34 bytes), q4_0 32 nibbles + one fp16 scale (18 bytes).
# The float32 row is llama.cpp at its most exact: float32 weights and cache, its plain attention (its flash-attention
# kernel rounds more); the others run flash attention, llama.cpp's default on a CPU and what a quantised V cache
# needs. None is exact to fp32's tolerance, the float32 one included: ggml computes GELU through a float16 table
# (GGML_GELU_FP16), ~3e-4 of the logits' scale on gpt2 (docs/peers.md). So each is held to a mean KL bound, about 6
# to 17x above the largest it measures here (verify -n 32 on gpt2-tiny and gpt2 with random weights and on the trained
# gpt2-shakespeare), so a cache that breaks (llama.cpp's quantised-cache regressions move KL by orders of magnitude)
# fails its row, with its KL and top-1 by depth.
for _name, _weights, _kv, _kv_bytes, _max_kl, _words in (
    ("llamacpp-f32", "f32", "f32", 4.0, 2e-6, "float32 GGUF, float32 KV cache"),
    ("llamacpp-f16", "f16", "f16", 2.0, 4e-5, "float16 GGUF, float16 KV cache (llama.cpp's default cache type)"),
    ("llamacpp-f16-kv-q8_0", "f16", "q8_0", 34 / 32, 2e-3, "float16 GGUF, q8_0 KV cache (blocks of 32, fp16 scale)"),
    ("llamacpp-f16-kv-q4_0", "f16", "q4_0", 18 / 32, 0.1, "float16 GGUF, q4_0 KV cache (blocks of 32, fp16 scale)"),
):
    PEERS[_name] = PeerSpec(
        _name,
        "llamacpp",
        _weights,
        False,
        f"llama.cpp, {_words}",
        max_kl=_max_kl,
        weight_bytes=4 if _weights == "f32" else 2,
        kv=_kv,
        kv_bytes=_kv_bytes,
        flash_attention=_name != "llamacpp-f32",
        batches=False,
    )
FAMILIES: dict[str, list[str]] = {
    "ct2": ["ct2-fp32", "ct2-int8"],
    "llamacpp": [n for n in PEERS if n.startswith("llamacpp-")],
}
EXTRAS = {"ct2": "kvbench[ct2]", "llamacpp": "kvbench[llamacpp]"}
# the class that runs each family's peers, imported when a peer is built (each imports its own package)
RUNNERS = {"ct2": "kvbench.peers.ct2:CT2Model", "llamacpp": "kvbench.peers.llamacpp:LlamaCppModel"}


class PeerRunner(Protocol):
    """A peer loaded on kvbench's weights: greedy generation from ids, its logits per step, its prefix cache."""

    def generate(
        self, prompts: list[list[int]], new_tokens: int, record_logits: bool = False, prefix: list[int] | None = None
    ) -> Generation: ...

    def describe(self) -> str: ...


def load(model: GPT, peer: PeerSpec, threads: int) -> PeerRunner:
    """`peer` on `model`'s weights (converted once, cached), on `threads` CPU threads."""
    module, _, name = RUNNERS[peer.family].partition(":")
    runner: PeerRunner = getattr(importlib.import_module(module), name)(model, peer, threads)
    return runner


def expand(names: list[str]) -> list[str]:
    """Families replaced by their peers, in order, each name once."""
    out: list[str] = []
    for name in names:
        out += [n for n in FAMILIES.get(name, [name]) if n not in out]
    return out


def spec(name: str) -> PeerSpec:
    if name not in PEERS:
        raise KVBenchError(f"unknown peer engine {name!r}; peers: {', '.join([*FAMILIES, *PEERS])}")
    return PEERS[name]


def is_peer(name: str) -> bool:
    return name in PEERS or name in FAMILIES
