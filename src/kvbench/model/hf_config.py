"""transformers' GPT2Config for our GPT-2's config: what the reference port (model/weights.py) and the `hf` engine
(hf/engine.py) build transformers' GPT2LMHeadModel from."""

from __future__ import annotations

from kvbench.model.gpt2 import GPTConfig


def hf_gpt2_config(c: GPTConfig, attn_implementation: str = "sdpa"):
    """transformers' GPT2Config for our config: the same shapes, GPT-2's tanh GELU, no dropout, no special tokens
    (generation stops where it is told, pad id 0)."""
    # here, not at the top: transformers takes seconds to import, and only the commands that compare with it need it
    from transformers import GPT2Config

    # attn_implementation: taken by the __init__ transformers wraps around its config dataclasses, not in their types
    return GPT2Config(  # type: ignore[call-arg]
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        layer_norm_epsilon=c.layer_norm_epsilon,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation=attn_implementation,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
