"""Tiny random models shared by tests: our GPT-2 with varied greedy output, and Hugging Face configurations.

The Hugging Face ones: 2 layers, 4 query heads of 16, a vocabulary of 256; init std 0.1 so greedy output varies (at
transformers' default 0.02 a tiny random model repeats one token, which hides position bugs). Each test passes what it
changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SHAPE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.1,
)
# SHAPE with 2 key/value heads (GQA) and Llama's token ids, given to every family alike
COMMON: dict[str, Any] = dict(SHAPE, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)

# a tiny Llama's config.json, as the memory planner reads one
LLAMA_JSON: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_size": 64,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}


def tiny_llama(**changes: Any) -> Any:
    """A LlamaConfig of COMMON with `changes` applied."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**COMMON, **changes})


def tiny_families(window: int) -> dict[str, Any]:
    """Llama and Qwen2 (full attention), Mistral (every layer windowed), Gemma2 (sliding and full layers alternate)."""
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    return {
        "llama": tiny_llama(),
        "qwen2": Qwen2Config(**COMMON),
        "mistral": MistralConfig(**COMMON, sliding_window=window),
        "gemma2": Gemma2Config(**COMMON, sliding_window=window, head_dim=16),
    }


class ByFamily(dict):
    """A family's entry, built the first time a test asks for it: a run of the default tier, which leaves the
    slow tier's families out, builds only the families it uses."""

    def __init__(self, build: Callable[[str], Any]) -> None:
        super().__init__()
        self.build = build

    def __missing__(self, family: str) -> Any:
        self[family] = self.build(family)
        return self[family]


def varied_gpt() -> Any:
    """Our GPT-2 at 2 layers, 4 heads of 16 and a vocabulary of 256, seeded, weights at std 0.1: varied greedy
    output, so a wrong history shows."""
    import torch

    from kvbench.model.gpt2 import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=128, vocab_size=256, n_layer=2, n_head=4, n_embd=64)).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m
