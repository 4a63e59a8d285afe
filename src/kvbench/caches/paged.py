"""The `paged` cache: vLLM-style paging. A pool of fixed-size blocks per layer, a block table per sequence.

A static cache reserves max_len slots for every sequence up front; a sequence that stops early, or is short, wastes
the rest. Paging hands out blocks of `block_size` tokens (16 by default) as a sequence grows and takes them back when
it finishes, so a sequence holds at most block_size - 1 unused slots (its last block's tail).

    pool (per layer):  k_pool, v_pool  (num_blocks, block_size, H, Dh)
    block table:       seq b's token t lives in block tables[b][t // block_size], row t % block_size
    a device copy:     block_table (B, max_blocks) long, for the vectorised writes and reads

Attention reads through the block table: the sequence's blocks are gathered, in table order, into the
(B, H, S, Dh) view PyTorch's SDPA consumes. The values are exactly the ones written, so the cache is exact. Without a
paged-attention kernel (vLLM's reads the blocks in place) the gather copies the history every step; `bytes_copied`
counts that copy, so `bench` shows what the kernel would save.

Two interfaces: the per-layer cache contract (`update`: every sequence appends the same T columns, as generation's
left-padded batch does) and the per-sequence one a scheduler would use (`append`, `read`, `free`), which lets
sequences of a batch hold different lengths.

Copy-on-write (fork, reorder): a block may have several holders (a fork and its original, or rows that reorder
repeated), counted by the allocator. Forking or repeating a row copies no block; a write into a block that another
holder shares first gives the writer a private copy of that one block (the update counts the copy in
`bytes_copied`), so no write ever shows in another holder. A shared pool (`BlockPool`) doubles when a write finds it
full; `nbytes` of each holder is the whole shared pool.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvbench.caches.base import CacheSpec, LayerCache, Traffic
from kvbench.errors import CacheOverflowError
from kvbench.model.gpt2 import GPTConfig

BLOCK_SIZE = 16  # tokens per block, vLLM's default


class BlockAllocator:
    """A free list of block ids with a reference count per block in use. Freed blocks are reused first (LIFO), as a
    warm cache would want. A block is shared (count > 1) by forks and repeated reorder rows; it goes back to the
    free list when its last holder frees it."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1, f"num_blocks must be >= 1, got {num_blocks}"
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._refs: dict[int, int] = {}  # block in use -> holders

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def refs(self, block: int) -> int:
        """Holders of `block` (0: free)."""
        return self._refs.get(block, 0)

    def allocate(self) -> int:
        if not self._free:
            raise CacheOverflowError(
                f"paged KV cache pool exhausted: all {self.num_blocks} blocks in use "
                f"(free finished sequences or allocate a larger pool)"
            )
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks`."""
        for block in blocks:
            assert block in self._refs, f"block {block} shared but not allocated"
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; a block nobody holds is free again."""
        for block in blocks:
            assert block in self._refs, f"block {block} freed but not allocated"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                self._free.append(block)

    def grow(self, n: int) -> None:
        """`n` more block ids, handed out after the blocks already free."""
        self._free[:0] = range(self.num_blocks + n - 1, self.num_blocks - 1, -1)
        self.num_blocks += n


class BlockPool:
    """One layer's block storage and its allocator, shared by a cache and its forks (copy-on-write).

    A pool that has never been shared keeps its size (the allocator's exhausted error is a scheduler's signal). Once
    shared by `fork`, or reordered to a larger batch, the holders together can need more blocks than it was sized
    for, so it doubles when a write finds no free block.
    """

    def __init__(self, num_blocks: int, block_size: int, n_head: int, head_dim: int, dtype, device) -> None:
        self.k = torch.zeros(num_blocks, block_size, n_head, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)  # (num_blocks, block_size, H, Dh)
        self.allocator = BlockAllocator(num_blocks)
        self.elastic = False

    def allocate(self) -> int:
        if self.elastic and self.allocator.num_free == 0:
            n = self.allocator.num_blocks
            self.k = torch.cat([self.k, torch.zeros_like(self.k)])  # (2 * num_blocks, block_size, H, Dh)
            self.v = torch.cat([self.v, torch.zeros_like(self.v)])
            self.allocator.grow(n)
        return self.allocator.allocate()


class PagedCache(LayerCache):
    """One layer's paged cache for a batch of `batch` sequences, over a pool of `num_blocks` blocks."""

    def __init__(
        self, batch, n_head, head_dim, num_blocks, dtype, device, block_size: int = BLOCK_SIZE, max_len=None
    ) -> None:
        super().__init__()
        self.batch, self.block_size = batch, block_size
        self.pool = BlockPool(num_blocks, block_size, n_head, head_dim, dtype, device)
        self.tables: list[list[int]] = [[] for _ in range(batch)]  # block ids per sequence, in token order
        self.seq_lens = [0] * batch
        self.capacity: int = max_len if max_len is not None else num_blocks * block_size // batch
        max_blocks = -(-self.capacity // block_size)
        self.block_table = torch.zeros(batch, max_blocks, dtype=torch.long, device=device)  # (B, max_blocks)

    @property
    def k_pool(self) -> torch.Tensor:
        return self.pool.k  # (num_blocks, block_size, H, Dh)

    @property
    def v_pool(self) -> torch.Tensor:
        return self.pool.v

    @property
    def allocator(self) -> BlockAllocator:
        return self.pool.allocator

    # --- block accounting -------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block (this layer)."""
        return 2 * self.k_pool[0].nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks the sequences hold right now (the memory paging actually reserves)."""
        return self.allocator.num_used * self.block_bytes

    def _grow(self, seq: int, new_len: int) -> None:
        if new_len > self.capacity:
            raise CacheOverflowError(
                f"paged KV cache overflow: sequence {seq} would hold {new_len} tokens, capacity {self.capacity} "
                f"(allocate max_len >= prompt length + new tokens)"
            )
        table = self.tables[seq]
        first_new = len(table)
        while len(table) * self.block_size < new_len:
            table.append(self.pool.allocate())
        if len(table) > first_new:  # one small host-to-device copy per new block, not per token
            self.block_table[seq, first_new : len(table)] = torch.tensor(table[first_new:], dtype=torch.long)

    def _own(self, seq: int, start: int, end: int) -> None:
        """Copy-on-write: before columns start..end-1 of `seq` are written, a block there that another holder shares
        (a fork, or a row repeated by reorder) is replaced by a private copy of its filled rows (counted in
        bytes_copied: history copied by the update). Only the blocks written are copied."""
        table = self.tables[seq]
        for i in range(start // self.block_size, min(len(table), -(-end // self.block_size))):
            shared = table[i]
            if self.allocator.refs(shared) == 1:
                continue
            block = self.pool.allocate()
            filled = max(0, min(self.block_size, start - i * self.block_size))  # rows holding history
            self.pool.k[block, :filled] = self.pool.k[shared, :filled]
            self.pool.v[block, :filled] = self.pool.v[shared, :filled]
            self.bytes_copied += 2 * self.pool.k[shared, :filled].nbytes
            self.allocator.free([shared])
            table[i] = block
            self.block_table[seq, i] = block

    def _slots(self, seq: int | slice, start: int, end: int) -> torch.Tensor:
        """Flat pool rows (block * block_size + offset) of columns start..end-1. (B, T) for a slice, (T,) for one."""
        cols = torch.arange(start, end, device=self.block_table.device)  # (T,)
        blocks = self.block_table[seq][..., cols // self.block_size]  # (B, T) or (T,)
        return blocks * self.block_size + cols % self.block_size

    def _flat(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.view(-1, *pool.shape[2:])  # (num_blocks * block_size, H, Dh)

    # --- the per-sequence interface (a scheduler's view) --------------------------------------------------------
    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T tokens to sequence `seq`. k, v: (H, T, Dh)."""
        start = self.seq_lens[seq]
        end = start + k.size(1)
        self._own(seq, start, end)
        self._grow(seq, end)
        slots = self._slots(seq, start, end)  # (T,)
        self._flat(self.k_pool).index_copy_(0, slots, k.transpose(0, 1))  # rows (T, H, Dh)
        self._flat(self.v_pool).index_copy_(0, slots, v.transpose(0, 1))
        self.seq_lens[seq] = end

    def read(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `seq`'s keys and values through its block table: (H, length, Dh) each."""
        n = self.seq_lens[seq]
        nb = -(-n // self.block_size)
        idx = self.block_table[seq, :nb]  # (nb,)
        k = self.k_pool[idx].view(nb * self.block_size, *self.k_pool.shape[2:])[:n]  # (n, H, Dh)
        v = self.v_pool[idx].view(nb * self.block_size, *self.v_pool.shape[2:])[:n]
        return k.transpose(0, 1), v.transpose(0, 1)  # (H, n, Dh)

    def free(self, seq: int) -> None:
        """Sequence `seq` finished: its blocks go back to the pool."""
        self.allocator.free(self.tables[seq])
        self.tables[seq] = []
        self.seq_lens[seq] = 0
        self.length = max(self.seq_lens)

    # --- the per-layer cache contract (every sequence appends the same columns) ----------------------------------
    def update(self, k, v, positions):
        B, H, T, Dh = k.shape
        assert B == self.batch, f"batch {B} != cache batch {self.batch}"
        start = self.length
        assert all(n == start for n in self.seq_lens), f"batched update needs equal lengths, got {self.seq_lens}"
        end = start + T
        for b in range(B):
            self._own(b, start, end)
            self._grow(b, end)
        slots = self._slots(slice(None), start, end).reshape(-1)  # (B * T,)
        self._flat(self.k_pool).index_copy_(0, slots, k.transpose(1, 2).reshape(B * T, H, Dh))
        self._flat(self.v_pool).index_copy_(0, slots, v.transpose(1, 2).reshape(B * T, H, Dh))
        self.seq_lens = [end] * B
        self.length = end
        # Read through the block table: gather each sequence's blocks in order (a copy: see the module doc).
        nb = -(-end // self.block_size)
        idx = self.block_table[:, :nb]  # (B, nb)
        k_all = self.k_pool[idx].view(B, nb * self.block_size, H, Dh)[:, :end].transpose(1, 2)  # (B, H, end, Dh)
        v_all = self.v_pool[idx].view(B, nb * self.block_size, H, Dh)[:, :end].transpose(1, 2)
        self.bytes_copied += 2 * B * H * start * Dh * k.element_size()  # history re-read into a new tensor
        return k_all, v_all

    def reset(self) -> None:
        super().reset()
        for seq in range(self.batch):
            self.free(seq)

    # --- the lifecycle ---------------------------------------------------------------------------------------------
    def crop(self, length: int) -> None:
        """Every sequence keeps at most `length` tokens; blocks wholly past them go back to the pool (or lose one
        holder, when shared)."""
        n = self.check_crop(length)
        for seq, table in enumerate(self.tables):
            self.seq_lens[seq] = min(self.seq_lens[seq], n)
            keep = -(-self.seq_lens[seq] // self.block_size)
            self.allocator.free(table[keep:])
            del table[keep:]
        self.length = n

    def fork(self) -> PagedCache:
        """Shares the pool and every block (one more holder each): the fork holds no new block until it writes, and
        then copies only the block it writes (copy-on-write, `_own`); the same holds for this cache."""
        other = copy.copy(self)
        other.tables = [list(t) for t in self.tables]
        other.seq_lens = list(self.seq_lens)
        other.block_table = self.block_table.clone()
        for table in self.tables:
            self.allocator.share(table)
        self.pool.elastic = True  # two holders may now need more blocks than one was given
        return other

    def __del__(self) -> None:
        # A fork dropped without reset gives its holds back, so its sharers stop copying blocks nobody else reads.
        # Only a shared pool needs it (an unshared one goes with its cache).
        try:
            if self.pool.elastic:
                for table in self.tables:
                    self.allocator.free(table)
                self.tables = []
        except Exception:  # half-built or interpreter shutdown: nothing to give back to
            pass

    def reorder(self, index: torch.Tensor) -> None:
        """Row i takes old row index[i]'s block table; a repeated row shares its blocks (copy-on-write on the first
        write), a dropped row's blocks lose a holder."""
        idx = self.check_index(index, self.batch, self.block_table.device)
        rows = idx.tolist()
        tables = [list(self.tables[r]) for r in rows]
        for table in tables:
            self.allocator.share(table)
        for table in self.tables:
            self.allocator.free(table)
        if len(rows) > self.batch:
            self.pool.elastic = True
        self.tables, self.seq_lens = tables, [self.seq_lens[r] for r in rows]
        self.block_table = self.block_table.index_select(0, idx)  # (len(idx), max_blocks)
        self.batch = len(rows)

    @property
    def nbytes(self) -> int:
        """The pool's storage (reserved whether or not blocks are in use). See `used_bytes` for what is held."""
        return self.k_pool.nbytes + self.v_pool.nbytes


def make_paged_cache(
    config: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
) -> PagedCache:
    """The registry's factory: a pool large enough for every sequence to reach max_len (generation never waits)."""
    num_blocks = batch * -(-max_len // BLOCK_SIZE)
    return PagedCache(batch, config.n_head, config.head_dim, num_blocks, dtype, device, max_len=max_len)


SPEC = CacheSpec(
    "paged",
    "vLLM-style pool of 16-token blocks + block table per sequence; reads gather through the table",
    make_paged_cache,
    traffic=Traffic(
        f"gathers its {BLOCK_SIZE}-token blocks (L rounded up) into a contiguous copy: reads and writes them",
        extra=lambda L, slot, q8: 2 * (-(-L // BLOCK_SIZE) * BLOCK_SIZE) * slot,
    ),
    memory_note=f"the pool rounds each sequence up to whole blocks of {BLOCK_SIZE} tokens, reserved up front for "
    "max_len; the per-layer block table (B x blocks int64) is not part of nbytes",
)


@dataclass
class PagedMemoryReport:
    """KV memory of a batch of mixed lengths, all layers: static's max-length reservation vs paging's blocks."""

    lengths: list[int]  # tokens each sequence actually holds
    max_len: int  # what a static cache must reserve per sequence (the longest any sequence may grow)
    block_size: int
    needed_bytes: int  # exactly the tokens held, no waste
    static_bytes: int  # batch x max_len slots
    paged_bytes: int  # blocks held, measured on a real PagedCache
    blocks_used: int  # per layer

    @property
    def static_waste(self) -> float:
        return 1 - self.needed_bytes / self.static_bytes

    @property
    def paged_waste(self) -> float:
        return 1 - self.needed_bytes / self.paged_bytes

    @property
    def saving(self) -> float:
        """Fraction of the static reservation that paging does not reserve."""
        return 1 - self.paged_bytes / self.static_bytes


def paged_memory_report(
    config: GPTConfig,
    lengths: list[int],
    max_len: int,
    dtype: torch.dtype = torch.float16,
    block_size: int = BLOCK_SIZE,
) -> PagedMemoryReport:
    """Fill a one-layer PagedCache with sequences of `lengths` tokens (one append per token, as decoding does)
    and report the blocks it holds, scaled to all layers, against a static cache's batch x max_len reservation."""
    assert all(0 <= n <= max_len for n in lengths), f"lengths {lengths} must be within 0..max_len={max_len}"
    B, H, Dh = len(lengths), config.n_head, config.head_dim
    elt = torch.empty(0, dtype=dtype).element_size()
    per_token = config.kv_bytes_per_token(elt)  # all layers
    num_blocks = B * -(-max_len // block_size)
    cache = PagedCache(B, H, Dh, num_blocks, dtype, "cpu", block_size=block_size, max_len=max_len)
    one = torch.zeros(H, 1, Dh, dtype=dtype)
    for seq, n in enumerate(lengths):
        for _ in range(n):
            cache.append(seq, one, one)
    return PagedMemoryReport(
        lengths=list(lengths),
        max_len=max_len,
        block_size=block_size,
        needed_bytes=sum(lengths) * per_token,
        static_bytes=B * max_len * per_token,
        paged_bytes=cache.used_bytes * config.n_layer,
        blocks_used=cache.allocator.num_used,
    )
