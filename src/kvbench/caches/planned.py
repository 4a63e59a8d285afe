"""Our GPT-2 and our cache designs as the planner sees them: a GPTConfig as a ModelSpec, a design's storage as the
planner's KV format. Both are types only here (no torch is imported): `memory --measure` and `verify --tp` hold real
caches against the planner through these two."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.memory.spec import KVFormat, ModelSpec, get_kv_format

if TYPE_CHECKING:
    from kvbench.caches.base import CacheSpec
    from kvbench.model.gpt2 import GPTConfig


def spec_from_gpt_config(cfg: GPTConfig) -> ModelSpec:
    """Our GPT-2's shape as the planner sees it (MHA: one K/V head per query head)."""
    return ModelSpec(
        name=cfg.name,
        source="kvbench.model.gpt2.PRESETS",
        family="gpt2",
        n_layers=cfg.n_layer,
        n_heads=cfg.n_head,
        n_kv_heads=cfg.n_head,
        head_dim=cfg.head_dim,
        hidden_size=cfg.n_embd,
        max_context=cfg.block_size,
        params=None,
    )


def planner_format(design: CacheSpec, fmt: KVFormat) -> KVFormat:
    """The planner's storage format that models `design`: the one of the element type the design stores K and V in
    (int8: the planner's int8, whose fp16 scale per 64 elements is an int8 cache's scale per head of GPT-2), else
    `fmt`, the --kv-dtype asked for."""
    return get_kv_format(design.storage_dtype) if design.storage_dtype else fmt
