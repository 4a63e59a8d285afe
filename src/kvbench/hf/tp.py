"""A Hugging Face causal LM split over tensor-parallel ranks by transformers' own plan (`verify --hf SOURCE --tp N`).

transformers shards a model whose config class declares `base_model_tp_plan` when it is loaded with
`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` inside a process group: the attention
projections column-wise by head, the output projections row-wise, so rank r holds KV heads [r*Hkv/N, (r+1)*Hkv/N)
and its cache holds exactly those. A plan that names no attention module (one that splits only the MLP or the
experts) keeps attention whole on every rank, and every rank's cache holds every head. What transformers does not
check, kvbench refuses before any rank starts: a model with no plan, heads or KV heads that do not divide by N where
the plan splits attention (transformers loads those without a warning and fails in the first forward, transformers
#48307), weights that would differ between ranks (a bare config.json), and a missing `accelerate`, which
transformers' TP loading needs.
"""

from __future__ import annotations

import importlib.util

from kvbench import validate
from kvbench.errors import KVBenchError

INSTALL = 'pip install "kvbench[tp]"'


def check_tp_model(source: str, tp: int, trust_remote_code: bool) -> None:
    """Everything that can be refused before the ranks start: one line naming what and why."""
    from pathlib import Path

    from kvbench.hf.models import resolve_source

    if importlib.util.find_spec("accelerate") is None:
        raise KVBenchError(
            f"--tp with --hf loads through transformers' tensor parallelism, which needs accelerate: {INSTALL}"
        )
    r = resolve_source(source, None, trust_remote_code)
    if r.weights is None:
        raise KVBenchError(
            f"--hf {source} --tp {tp}: a config.json gives each rank random weights of its own; save the model "
            f"(save_pretrained) and pass its directory, so every rank loads the same weights"
        )
    config = r.config
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        ours = (
            f"; kvbench splits GPT-2 itself: verify -m {source} --tp {tp} (its own GPT-2 on these weights)"
            if config.model_type == "gpt2"
            else ""
        )
        raise KVBenchError(
            f"--hf {source} --tp {tp}: {config.model_type} has no tensor-parallel plan in transformers "
            f"(its config declares no base_model_tp_plan), so transformers cannot split it{ours}"
        )
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    if heads is not None and splits_attention(plan):
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        validate.tp_shape_rules(tp, f"{Path(source).name} ({config.model_type})", heads, kv_heads)


def splits_attention(plan: dict[str, str]) -> bool:
    """Does a tensor-parallel plan name an attention module (`layers.*.self_attn.k_proj`, `h.*.attn.qkv_proj`,
    `layers.*.attention.query_key_value`, ...)? A plan that does not keeps attention whole on every rank."""
    return any(part.endswith(("attn", "attention")) for key in plan for part in key.split("."))
