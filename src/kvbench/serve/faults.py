"""The registry of server faults behind `kvbench serve --fault NAME` (and `kvbench break NAME`).

Each fault is a subclass of the serving pool (serve/pool.py) overriding one of its operations; `serve --fault`
hands the engine that class instead of KVPool, so the engine, the pool and the server hold no fault switch.
    freed-block-reused      FreedSharedBlock      a shared block freed when one holder finishes, handed out next
    hit-without-copy        HitWithoutCopy        a host-tier hit counted and mapped, its K/V never copied back
    hash-without-parent     HashWithoutParent     a block's hash covers its own tokens only, not its prefix
    reset-keeps-host-tier   ResetKeepsHostTier    reset_prefix_cache clears the device tier only
Each one's scenario, the check that catches it, lives in serve/scenarios.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbench.errors import KVBenchError
from kvbench.serve.pool import ROOT_HASH, KVPool


class FreedSharedBlock(KVPool):
    """Release ignores the other holders of a shared block: the first request to finish frees it (its hash
    forgotten, first in the free list), so the next allocation hands it out while another request still reads it."""

    def unref(self, block: int) -> None:
        if self.refs[block] > 1:
            self.refs[block] = 0
            if block in self.hash_of:
                del self.by_hash[self.hash_of.pop(block)]
            self.free.appendleft(block)
        elif self.refs[block] == 1:
            super().unref(block)


class HitWithoutCopy(KVPool):
    """A host-tier hit maps a device block and counts the swap, but never copies the K/V back: the request reads
    whatever that block held before."""

    def swap_in(self, slot: int, block: int) -> None:
        self.counters.swap_in_blocks += 1


class HashWithoutParent(KVPool):
    """A block's hash covers its own tokens only: equal blocks after different prefixes share one block, whose
    K/V were computed after the first prefix (and at its positions)."""

    def block_hash(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        return super().block_hash(ROOT_HASH, tokens)


class ResetKeepsHostTier(KVPool):
    """reset_prefix_cache forgets the device tier's cached blocks only: the host tier still answers, and the next
    request reports cached tokens after a reset."""

    def reset(self) -> tuple[int, int]:
        return self.reset_device(), 0


@dataclass(frozen=True)
class ServerFault:
    name: str
    summary: str  # the bug in one line
    where: str  # the operation it lives in
    signature: str  # how it shows from outside the server
    fix: str  # the one-line fix
    dormant_where: str  # where it cannot fire
    pool: type[KVPool]  # the buggy pool the engine is given
    check: str  # the scenario that shows it (serve/scenarios.py CHECKS)
    host_tier: bool = False  # fires only with a host tier (--host-blocks > 0)


# One registry of server faults: serve --fault, break's choices and the tests iterate this dict.
SERVER_FAULTS: dict[str, ServerFault] = {
    "freed-block-reused": ServerFault(
        "freed-block-reused",
        "a shared block is freed when one holder finishes, while another still reads it",
        "the pool's release (a KVPool subclass, FreedSharedBlock): the reference count is ignored",
        "a request sharing a prefix with one that finished first reads another allocation's K/V: its tokens go "
        "wrong once it allocates its next block",
        "decrement the block's count; free (or make evictable) only when no request holds it",
        "a prefix held by one request at a time: every warm request that runs alone",
        FreedSharedBlock,
        "shared-prefix",
    ),
    "hit-without-copy": ServerFault(
        "hit-without-copy",
        "a host-tier hit is counted, but its K/V are never copied back",
        "the pool's swap-in (a KVPool subclass, HitWithoutCopy)",
        "a prompt evicted to the host tier comes back with cached_tokens right and its tokens wrong",
        "copy the host slot's K and V of every layer into the device block before the request reads it",
        "a server without a host tier, and every device-tier hit",
        HitWithoutCopy,
        "host-hit",
        host_tier=True,
    ),
    "hash-without-parent": ServerFault(
        "hash-without-parent",
        "a block's hash covers only its own tokens, not the prefix before them",
        "the pool's block hash (a KVPool subclass, HashWithoutParent)",
        "a prompt whose first block appeared later in an earlier prompt reports it cached, and reads K/V computed "
        "after another prefix at other positions",
        "chain the hash: H(parent block's hash, this block's tokens)",
        "prompts that share blocks only as true prefixes (the same tokens from the start)",
        HashWithoutParent,
        "distinct-prefix",
    ),
    "reset-keeps-host-tier": ServerFault(
        "reset-keeps-host-tier",
        "reset_prefix_cache clears the device tier only; the host tier still answers",
        "the pool's reset (a KVPool subclass, ResetKeepsHostTier)",
        "after a reset a repeated prompt still reports cached_tokens > 0 (a cold run is not cold)",
        "reset forgets the unreferenced cached blocks of both tiers",
        "a server without a host tier, and a reset while nothing was evicted to the host",
        ResetKeepsHostTier,
        "reset",
        host_tier=True,
    ),
}


def get_server_fault(name: str) -> ServerFault:
    name = name.strip()
    if name not in SERVER_FAULTS:
        raise KVBenchError(f"unknown server fault {name!r}; known server faults: {', '.join(SERVER_FAULTS)}")
    return SERVER_FAULTS[name]


def pool_class(fault: str | None) -> type[KVPool]:
    """The pool `kvbench serve` runs: KVPool, or the named fault's subclass."""
    return KVPool if fault is None else get_server_fault(fault).pool


def server_fault_rules(name: str, cache: str | None, tp: int) -> ServerFault:
    """`kvbench break NAME` for a server fault: it runs the serving engine in one process over its own pool, so a
    --cache or a --tp is refused by name."""
    f = get_server_fault(name)
    if cache is not None:
        raise KVBenchError(f"the {f.name} server fault lives in kvbench serve's pool, not in a cache: drop --cache")
    if tp > 1:
        raise KVBenchError(f"the {f.name} server fault runs kvbench serve's engine in one process: drop --tp")
    return f
