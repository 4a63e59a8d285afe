"""`kvbench serve`'s rules: every option checked before the model loads, and the pool held to the memory there is.

A rule that names a registry's entry (--fault) lives here, above serve/faults.py; the generic checks are
validate.py's.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvbench import validate
from kvbench.errors import KVBenchError, NotEnoughMemoryError
from kvbench.model.gpt2 import GPTConfig
from kvbench.serve.faults import get_server_fault

MAX_BLOCKS = 1 << 24  # --kv-blocks, --host-blocks: 16M blocks of 16 tokens are 268M tokens, past any machine
MAX_BLOCK_SIZE = 1024  # --block-size: GPT-2's whole context in one block
MAX_BATCH = 1024  # --max-batch: requests decoded in one forward


class ServeChoices(Protocol):
    kv_blocks: int
    block_size: int
    host_blocks: int
    max_batch: int
    port: int
    host: str
    seed: int
    fault: str | None


def serve_rules(o: ServeChoices) -> None:
    """The options' ranges and the fault's name (cli/serve.py ServeOptions), before any work."""
    validate.integer("--kv-blocks", o.kv_blocks, 1, MAX_BLOCKS)
    validate.integer("--block-size", o.block_size, 1, MAX_BLOCK_SIZE)
    validate.integer("--host-blocks", o.host_blocks, 0, MAX_BLOCKS)
    validate.integer("--max-batch", o.max_batch, 1, MAX_BATCH)
    validate.integer("--port", o.port, 0, 65535, "0 picks a free port")
    validate.seed(o.seed)
    if not o.host.strip():
        raise KVBenchError("--host is empty; give an address to listen on, e.g. 127.0.0.1 (the default)")
    if o.fault is not None:
        get_server_fault(o.fault)


def pool_bytes(cfg: GPTConfig, blocks: int, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `blocks` blocks, every layer."""
    return cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * blocks * block_size


def pool_fits(cfg: GPTConfig, o: ServeChoices, dtype: torch.dtype, device: torch.device) -> None:
    """The device tier and the host tier against the memory available now, before either is allocated: a pool too
    large is one line and exit 3, not the kernel's OOM killer. On the CPU both tiers take the same memory, so their
    sum must fit as well as each."""
    from kvbench.devices import available_memory_bytes

    gib = 2**30
    cpu = torch.device("cpu")
    tiers = [("--kv-blocks", o.kv_blocks, device), ("--host-blocks", o.host_blocks, cpu)]
    for flag, blocks, where in tiers:
        need = pool_bytes(cfg, blocks, o.block_size, dtype)
        free = available_memory_bytes(where)
        if free is not None and need > free:
            raise NotEnoughMemoryError(
                f"{flag} {blocks:,} blocks of {o.block_size} tokens of {cfg.name}'s K/V need {need / gib:.1f} GiB on "
                f"{where.type}, more than the {free / gib:.1f} GiB available; use fewer {flag}"
            )
    if device.type == "cpu" and o.host_blocks:
        need = pool_bytes(cfg, o.kv_blocks + o.host_blocks, o.block_size, dtype)
        free = available_memory_bytes(cpu)
        if free is not None and need > free:
            raise NotEnoughMemoryError(
                f"--kv-blocks {o.kv_blocks:,} and --host-blocks {o.host_blocks:,} blocks of {o.block_size} tokens of "
                f"{cfg.name}'s K/V need {need / gib:.1f} GiB of CPU memory together (the device is the CPU), more "
                f"than the {free / gib:.1f} GiB available; use fewer of either"
            )
