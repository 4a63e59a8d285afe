"""The serving cache: one paged KV pool shared by every request, with automatic prefix caching and a host tier.

    device tier   k, v: (L, N, block_size, H, Dh) on the model's device; N = --kv-blocks
    host tier     host_k, host_v: (L, M, block_size, H, Dh) CPU tensors of their own; M = --host-blocks (0: none)

A block is in one of three states on the device:
    held       refs > 0: one or more running requests read it (a shared prefix is held by every request on it)
    cached     refs == 0, hashed: it holds a full block of a past request's tokens; kept for a later hit, evictable
    free       refs == 0, holding nothing reusable

Prefix caching is vLLM's design: only full blocks are hashed, and a block's hash covers its parent's hash and its own
tokens, so a hash names the whole prefix up to the block's end; equal tokens after different prefixes never share a
block. A new request walks its prompt block by block and stops at the first block found in neither tier; at most
(prompt - 1) // block_size blocks are looked up, so the last prompt token is always computed (its logits are the
first token's).

    hash(b0) = H(ROOT, tokens 0..15)   hash(b1) = H(hash(b0), tokens 16..31)   ...

Allocation takes a free block, else evicts the least recently used cached block (its hash forgotten on the device);
with a host tier the evicted block is first copied to a host slot (swap out), evicting the host's least recently
used slot when full. A later hit on a host slot copies it back into a newly allocated device block (swap in).
`reset` forgets every cached block of both tiers that no request holds.

The pool is not thread-safe: one thread (the engine's loop) owns it. Every method is a plain operation on the
state above; the faults of `kvbench serve --fault` are subclasses overriding one of them (serve/faults.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ROOT_HASH = b"kvbench-prefix-root"  # the parent hash of a prompt's first block


class PoolExhausted(RuntimeError):
    """No block is free or evictable: the engine's admission promised otherwise (a serving bug, not bad input)."""


@dataclass
class PoolCounters:
    """What the pool did since it started (Prometheus counters, never reset)."""

    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of those, tokens whose K/V came from the cache (either tier)
    host_hits: int = 0  # of those, tokens that came back from the host tier
    swap_in_blocks: int = 0  # host -> device block copies
    swap_out_blocks: int = 0  # device -> host block copies
    evictions: int = 0  # cached device blocks taken for new data


@dataclass(frozen=True)
class Match:
    """Where a prompt's leading full blocks are cached: device block ids, then host slots (in prompt order: a host
    hit follows the device hits, since the walk takes either tier block by block and stops at the first miss)."""

    kinds: tuple[str, ...]  # "device" or "host", one per leading block found
    ids: tuple[int, ...]  # the device block or host slot of each

    @property
    def device_hits(self) -> int:
        return self.kinds.count("device")


class KVPool:
    """The device tier, the host tier and the prefix cache over them (module docstring)."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        host_blocks: int = 0,
    ) -> None:
        assert num_blocks >= 1 and block_size >= 1 and host_blocks >= 0, (num_blocks, block_size, host_blocks)
        shape = (n_layer, num_blocks, block_size, n_head, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, N, block_size, H, Dh)
        self.v = torch.zeros_like(self.k)
        host = (n_layer, host_blocks, block_size, n_head, head_dim)
        self.host_k = torch.zeros(host, dtype=dtype, device="cpu")  # (L, M, block_size, H, Dh)
        self.host_v = torch.zeros_like(self.host_k)
        self.num_blocks, self.block_size, self.host_blocks = num_blocks, block_size, host_blocks
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # blocks holding nothing reusable, handed out first-in
        self.hash_of: dict[int, bytes] = {}  # device block -> its hash (cached or held)
        self.by_hash: dict[bytes, int] = {}  # hash -> the device block holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, least recently used first
        self.host_by_hash: OrderedDict[bytes, int] = OrderedDict()  # hash -> host slot, least recently used first
        self.host_free: deque[int] = deque(range(host_blocks))
        self.counters = PoolCounters()

    # --- hashing ------------------------------------------------------------------------------------------------------
    def block_hash(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        """The hash of a full block: its parent's hash and its own tokens (so it names the whole prefix)."""
        return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()

    def prefix_hashes(self, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """The chained hashes of the first `blocks` full blocks of `tokens`."""
        out: list[bytes] = []
        parent = ROOT_HASH
        for i in range(blocks):
            parent = self.block_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            out.append(parent)
        return out

    # --- state --------------------------------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        """Blocks held by running requests."""
        return sum(1 for r in self.refs if r > 0)

    @property
    def cached(self) -> int:
        """Device blocks holding a hashed full block (held or not)."""
        return len(self.by_hash)

    @property
    def host_used(self) -> int:
        return len(self.host_by_hash)

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block, all layers."""
        return 2 * self.k[:, 0].nbytes

    # --- the prefix cache ------------------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes]) -> Match:
        """The leading blocks of `hashes` found in either tier, without touching anything."""
        kinds: list[str] = []
        ids: list[int] = []
        for h in hashes:
            if h in self.by_hash:
                kinds.append("device")
                ids.append(self.by_hash[h])
            elif h in self.host_by_hash:
                kinds.append("host")
                ids.append(self.host_by_hash[h])
            else:
                break
        return Match(tuple(kinds), tuple(ids))

    def acquire(self, hashes: Sequence[bytes], prompt_tokens: int) -> tuple[list[int], int]:
        """Hold the cached leading blocks of a new request's prompt (`hashes`: its full blocks that may be looked
        up): device hits gain a holder, host hits are copied into new device blocks. Returns (device blocks in
        prompt order, tokens of them from the host tier) and counts the lookup (`prompt_tokens` queried)."""
        m = self.match(hashes)
        for kind, block in zip(m.kinds, m.ids, strict=True):  # hold device hits first: no swap-in may evict one
            if kind == "device":
                self.hold(block)
        for h, kind in zip(hashes, m.kinds, strict=False):  # nor may a swap-out take a host hit's slot
            if kind == "host":
                del self.host_by_hash[h]
        blocks, host = [], 0
        for h, kind, at in zip(hashes, m.kinds, m.ids, strict=False):
            if kind == "device":
                blocks.append(at)
                continue
            block = self.allocate()
            self.swap_in(at, block)
            self.host_by_hash[h] = at  # back in the host LRU, most recently used
            self.commit(block, h)
            blocks.append(block)
            host += self.block_size
        hit = len(blocks) * self.block_size
        self.counters.queries += prompt_tokens
        self.counters.hits += hit
        self.counters.host_hits += host
        return blocks, host

    def hold(self, block: int) -> None:
        """One more holder of `block` (a cached block leaves the evictable list)."""
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def commit(self, block: int, h: bytes) -> None:
        """`block`, now full, holds the prefix named `h`: cache it, unless another block already holds that prefix
        (then this one stays a private copy and goes back to the free list when released)."""
        if h in self.by_hash or block in self.hash_of:
            return
        self.by_hash[h] = block
        self.hash_of[block] = h

    # --- allocation and release ---------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block for new K/V, held once: a free block, else the least recently used cached one (copied to the host
        tier first when there is one)."""
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self.evict(block)
        else:
            raise PoolExhausted(f"all {self.num_blocks} KV blocks are held by running requests")
        assert self.refs[block] == 0, f"block {block} handed out while {self.refs[block]} requests hold it"
        self.refs[block] = 1
        return block

    def evict(self, block: int) -> None:
        """Forget a cached block's hash on the device, keeping a copy in the host tier when there is one."""
        h = self.hash_of.pop(block)
        del self.by_hash[h]
        self.counters.evictions += 1
        if self.host_blocks and h not in self.host_by_hash:
            slot = self._host_slot()
            if slot is not None:
                self.swap_out(block, slot)
                self.host_by_hash[h] = slot

    def release(self, blocks: Sequence[int]) -> None:
        """A request is done with `blocks`: one holder fewer each; a block nobody holds stays cached (evictable, most
        recently used last) when it holds a hashed prefix, else it is free."""
        for block in blocks:
            self.unref(block)

    def unref(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} released more times than it was held"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free.append(block)

    # --- the host tier ------------------------------------------------------------------------------------------------
    def _host_slot(self) -> int | None:
        """A host slot for a block being swapped out: a free one, else the least recently used (its copy dropped)."""
        if self.host_free:
            return self.host_free.popleft()
        if self.host_by_hash:
            _, slot = self.host_by_hash.popitem(last=False)
            return slot
        return None  # every slot pinned by a request being admitted

    def swap_out(self, block: int, slot: int) -> None:
        """Copy device block `block` (every layer's K and V) into host slot `slot`."""
        self.host_k[:, slot].copy_(self.k[:, block])
        self.host_v[:, slot].copy_(self.v[:, block])
        self.counters.swap_out_blocks += 1

    def swap_in(self, slot: int, block: int) -> None:
        """Copy host slot `slot` into device block `block`."""
        self.k[:, block].copy_(self.host_k[:, slot])
        self.v[:, block].copy_(self.host_v[:, slot])
        self.counters.swap_in_blocks += 1

    # --- reset --------------------------------------------------------------------------------------------------------
    def reset(self) -> tuple[int, int]:
        """Forget every cached block no request holds, in both tiers: (device blocks, host slots) forgotten. A block
        a running request holds keeps its hash until released."""
        return self.reset_device(), self.reset_host()

    def reset_device(self) -> int:
        n = len(self.evictable)
        for block in self.evictable:
            del self.by_hash[self.hash_of.pop(block)]
            self.free.append(block)
        self.evictable.clear()
        return n

    def reset_host(self) -> int:
        n = len(self.host_by_hash)
        self.host_free.extend(self.host_by_hash.values())
        self.host_by_hash.clear()
        return n
