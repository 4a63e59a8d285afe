"""Peer engines: the decoders people run on CPUs, given the same weights as kvbench's GPT-2, so bench times them beside
our loop and verify holds their caches to the same reference.

One registry (`PEERS`): a peer's name on the command line -> how it runs. A name may also be a family standing for
several peers (`FAMILIES`: `ct2` is CTranslate2 in float32 and with int8 weights, two rows). Each peer states whether
it is exact (held to the fp32 reference tolerance) or lossy (judged by its distortion against the reference: KL
divergence (held to the bound it states), top-1 agreement and |Δp| by depth).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KVBenchError


@dataclass(frozen=True)
class PeerSpec:
    name: str  # the engine's name in bench and verify rows
    family: str  # the package it runs on: ct2 (CTranslate2), llamacpp (llama.cpp through llama-cpp-python)
    compute: str  # the peer's own name for its weights' type: ct2's compute_type, a GGUF's type
    exact: bool  # held to the fp32 reference tolerance; otherwise lossy, judged by `max_kl`
    summary: str
    max_kl: float = 0.0  # lossy: the largest mean KL divergence (nats) from the reference it is held to
    weight_bytes: int = 4  # bytes per weight a decode step reads (the floor)


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
FAMILIES: dict[str, list[str]] = {"ct2": ["ct2-fp32", "ct2-int8"]}
EXTRAS = {"ct2": "kvbench[ct2]"}


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
