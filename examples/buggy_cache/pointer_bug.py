"""A cache plugin with the classic write-pointer bug, to see where `kvbench verify` says it goes wrong:

    PYTHONPATH=examples/buggy_cache kvbench verify -m gpt2-tiny -w random --caches pointer_bug:PointerOneShort
"""

from kvbench.caches.static import StaticCache


class PointerOneShort(StaticCache):
    """kvbench's static cache with its write pointer left on the slot a decode step just wrote (one short)."""

    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__(batch, config.n_head, max_len, config.head_dim, dtype, device)

    def update(self, k, v, positions):
        out = super().update(k, v, positions)
        if k.size(2) == 1:  # BUG: the next token's K/V overwrite this one's
            self.length -= 1
        return out
