"""A tiny random configuration of any transformers model type, for checking kvbench itself across the zoo.

    tiny_config("llama")  ->  a config.json dict: hidden 64, 2 layers, 4 heads, 2 key/value heads (where the model
                              has the field), intermediate 128, vocab 1024, positions 512, windows and chunks 16

It starts from transformers' own defaults (`AutoConfig.for_model(model_type)`) and shrinks every size field by its
name, nested language, vision and audio configs included. A per-layer list (`layer_types`, `layers_block_type`, ...)
keeps the first layer of every distinct kind, so a hybrid model keeps one layer of each (sliding and full, linear
and full, dense and MoE); per-layer index lists are remapped onto the kept layers. The decoder of an encoder-decoder
family and a BERT-like encoder are written as `AutoModelForCausalLM` uses them as decoders (`is_decoder` set).
`FIXES` holds what a type's default config leaves unusable (None where its model needs a number).

`tiny_config(model_type, tp=N)` is the same config split-able over N tensor-parallel ranks where the family allows:
attention heads and key/value heads multiples of N (at N = 2 the defaults already are). A family built on one
key/value head keeps it (its model reads no other count), and `verify --tp` refuses it in one line.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

HIDDEN, FF, MOE_FF, LAYERS, HEADS, HEAD_DIM, VOCAB, POSITIONS, WINDOW = 64, 128, 32, 2, 4, 16, 1024, 512, 16
MAX_LAYERS = 4  # a hybrid keeps one layer of each kind, up to this many


def _names(text: str) -> tuple[str, ...]:
    """Config field names written as a paragraph of words, in order."""
    return tuple(text.split())


HEAD_DIMS = _names("head_dim attention_head_dim d_head kv_channels swa_head_dim attention_head_size dim_head")
HIDDEN_SIZES = _names("""
    hidden_size d_model n_embd dim embed_dim hidden_dim emb_dim word_embed_proj_dim embedding_size embedding_dim
    input_embedding_size output_embedding_size lru_width attention_hidden_size d_embed text_hidden_size
    hidden_size_global projection_dim out_hidden_size output_dim downsample_hidden_size encoder_cross_output_size
    adapter_in_dim adapter_out_dim adapter_input_size adapter_output_size backbone_hidden_size
""")
FF_SIZES = _names("""
    intermediate_size ffn_dim n_inner decoder_ffn_dim encoder_ffn_dim dff ffn_hidden_size dim_ff feed_forward_size
    intermediate_size_mlp d_inner d_ff dense_intermediate_size prefix_dense_intermediate_size
""")
MOE_FF_SIZES = _names("""
    moe_intermediate_size shared_expert_intermediate_size expert_ffn_hidden_size moe_shared_expert_intermediate_size
    shared_intermediate_size shared_experts_intermediate_size
""")
HEAD_COUNTS = _names("""
    num_attention_heads n_head n_heads decoder_attention_heads encoder_attention_heads num_heads attention_heads
    num_decoder_attention_heads num_encoder_attention_heads swa_num_attention_heads
""")
POSITION_COUNTS = _names("""
    max_position_embeddings n_positions n_ctx max_target_positions max_seq_len seq_length max_sequence_length
    context_length max_source_positions
""")
WINDOWS = _names("""
    sliding_window sliding_window_size window_size attention_window_size local_attention_window_len
    attention_chunk_size
""")
# field names -> the tiny value (a callable: from the original value)
SIZES: dict[str, Any] = {
    **dict.fromkeys(HIDDEN_SIZES, HIDDEN),
    **dict.fromkeys(FF_SIZES, FF),
    **dict.fromkeys(MOE_FF_SIZES, MOE_FF),
    **dict.fromkeys(HEAD_COUNTS, HEADS),
    **dict.fromkeys(HEAD_DIMS, HEAD_DIM),
    **dict.fromkeys(POSITION_COUNTS, POSITIONS),
    **dict.fromkeys(WINDOWS, WINDOW),
    **dict.fromkeys(_names("num_experts num_local_experts n_routed_experts moe_num_experts"), lambda v: min(v, 4)),
    **dict.fromkeys(
        _names("num_experts_per_tok num_experts_per_token moe_topk moe_k top_k_experts"), lambda v: min(v, 2)
    ),
    **dict.fromkeys(
        _names("n_shared_experts num_shared_experts moe_num_shared_experts first_k_dense_replace num_dense_layers"),
        lambda v: min(v, 1),
    ),
    **dict.fromkeys(_names("n_group topk_group num_expert_group"), 1),
    **dict.fromkeys(_names("index_topk_blocks index_local_blocks index_block_size"), lambda v: min(v, 4)),
    "num_nextn_predict_layers": 0,
    "rotary_dim": HEAD_DIM // 2,
    # multi-head latent attention (DeepSeek): small ranks
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    # sparse-attention indexers: top-k of 8 keys
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "indexer_n_heads": 4,
    "indexer_head_dim": 16,
    "indexer_kv_heads": 1,
    # linear attention and state-space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "state_size": 16,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "mamba_n_groups": 1,
    "mamba_ngroups": 1,
    "mamba_chunk_size": 16,
    "mamba_dt_rank": 8,
    "time_step_rank": 8,
    "mamba_d_ssm": 128,
}
LAYER_COUNTS = _names("""
    num_hidden_layers n_layer num_layers n_layers decoder_layers encoder_layers num_decoder_layers num_encoder_layers
""")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "num_query_groups")
VOCABS = ("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size")
SPECIAL_IDS = {
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
    "sep_token_id": 3,
    "cls_token_id": 4,
    "mask_token_id": 5,
    "unk_token_id": 6,
    "eod_token_id": 2,
    "forced_eos_token_id": 2,
}
KIND_LISTS = _names("layer_types layers_block_type block_types attention_layers attn_layers mlp_layer_types")
INDEX_LISTS = _names("""
    moe_layers full_attn_idxs mlp_only_layers hybrid_layer_ids attn_layer_indices local_layer_ids ple_layer_ids
    mtp_local_layer_ids index_layers
""")
# per-layer lists whose values are layer indices (each layer's source of K/V): kept layers re-indexed, a source cut
# away replaced by the layer itself
LAYER_REFS = _names("kv_source_layers")
TEXT_CONFIGS = ("text_config", "decoder_config", "language_config", "llm_config")
UNTOUCHED = ("rope_scaling", "rope_parameters", "quantization_config")
DROPPED = _names("""
    _name_or_path architectures transformers_version id2label label2id dtype torch_dtype task_specific_params
    _attn_implementation_autoset tie_encoder_decoder problem_type chunk_size_feed_forward output_attentions
    output_hidden_states return_dict
""")

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# What a type's default config leaves unusable, or the layer layout a hybrid needs to keep one layer of each kind.
FIXES: dict[str, dict] = {
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "use_mamba_kernels": False,
    },
    "bamba": {"attn_layer_indices": [1]},
    "kolibri1_1": {"index_num_heads": 1},  # at most the query heads one key head serves
    "zamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "use_mamba_kernels": False,
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
    },
    "zamba2": {
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
        "mamba_headdim": 16,
        "n_mamba_heads": 8,
        "kv_channels": HIDDEN // HEADS,
        "num_query_groups": HEADS,
        "chunk_size": 16,
        "use_mamba_kernels": False,
    },
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "chunk_size": 16},
    "nemotron_h": {
        "layers_block_type": ["linear_attention", "full_attention", "moe"],
        "num_hidden_layers": 3,
        "n_groups": 1,
        "chunk_size": 16,
        "mtp_layers_block_type": ["full_attention", "moe"],
    },
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
        "intermediate_size": [FF] * 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
    },
    "xlstm": {"hidden_size": 256, "embedding_dim": 256, "num_blocks": LAYERS, "chunk_size": 16},  # widths of 64k
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 2, "L_cycles": 1, "L_bp_cycles": [1], "num_hidden_layers": 4},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "attention_layers": ["global", "local"]},
    "reformer": {
        "attn_layers": ["local", "local"],
        "axial_pos_shape": [16, 32],
        "axial_pos_embds_dim": [32, 32],
        "local_attn_chunk_length": 16,
        "lsh_attn_chunk_length": 16,
        "num_buckets": 8,
        "is_decoder": True,
    },
    "longcat_flash": {"zero_expert_num": 2},
    "llama4_text": {"interleave_moe_layer_step": 1, "intermediate_size_mlp": FF},
    "cohere_compass_text": {"rope_parameters": {"full_attention": ROPE, "sliding_attention": ROPE}},
    "dbrx": {
        "attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
        "ffn_config": {"hidden_size": HIDDEN, "ffn_hidden_size": FF, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "num_experts_per_tok": 2},
    "blt": {"encoder_hash_byte_group_vocab": 1000},
    "dory": {
        "num_hidden_layers": 6,
        "n_input_layers": 2,
        "n_recurrent_layers": 2,
        "n_output_layers": 2,
        "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
    },
    "xmod": {"default_language": "en_XX"},
    "dots3_note_text": {"head_dim": 24},  # its sliding-window layers: qk_nope_head_dim + qk_rope_head_dim
    "dots3_note": {"text_config": {"head_dim": 24}},
}
_INDEXER = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 2,
    "hc_lowrank": 8,
    "ple_embed_dim": HIDDEN,
    "ngram_vocab_size_base": 1000,
    "split_ngram_parts": 4,
}
FIXES.update({"qwen4_exp_text": _INDEXER, "qwen4_exp": {"text_config": _INDEXER}})
# types whose default config raises in transformers itself: the arguments that make it valid
INIT: dict[str, dict] = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}
# a causal-LM class that runs bidirectionally unless is_decoder is set (transformers only warns)
NEEDS_DECODER_FLAG = ("bert-generation",)


def model_types(tp_plan: bool = False) -> list[str]:
    """Every model type transformers maps to a causal LM class, in its own order; with `tp_plan`, those whose
    config class declares a tensor-parallel plan (`base_model_tp_plan`: what `verify --hf --tp` can split)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return [t for t in types if getattr(CONFIG_MAPPING[t], "base_model_tp_plan", None)] if tp_plan else types


def tiny_config(model_type: str, as_decoder: bool = True, tp: int = 1) -> dict:
    """The tiny config.json of `model_type` (see the module docstring). `as_decoder=False` keeps the family's
    own `is_decoder` / `is_encoder_decoder` flags (what `verify --hf` should refuse); `tp`: heads and key/value
    heads that divide over `tp` ranks."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    config = AutoConfig.for_model(model_type, **INIT.get(model_type, {}))
    tiny = _merge(shrink(config.to_dict(), tp=tp), FIXES.get(model_type, {}))
    tiny["model_type"] = model_type
    if as_decoder and tiny.get("is_encoder_decoder"):
        tiny.update(is_encoder_decoder=False, is_decoder=True, add_cross_attention=False)
    bert_like = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in NEEDS_DECODER_FLAG
    if as_decoder and bert_like and "is_decoder" in tiny:
        tiny.update(is_decoder=True, add_cross_attention=False)
    return tiny


def shrink(d: dict, text: bool = True, tp: int = 1) -> dict:
    """One config dict made tiny: sizes by field name, nested configs likewise, per-layer lists cut; head counts
    that divide over `tp` ranks."""
    d = {k: v for k, v in copy.deepcopy(d).items() if k not in DROPPED}
    heads, kv_heads = math.lcm(HEADS, tp), math.lcm(2, tp)  # 4 and 2 up to tp 2; kv_heads divides heads
    count_key = next((k for k in LAYER_COUNTS if type(d.get(k)) is int), None)
    n = d[count_key] if count_key else 0
    keep = _kept_layers(d, n)
    mla = type(d.get("kv_lora_rank")) is int
    gqa = any(type(d.get(k)) is int for k in SIZES if SIZES[k] == HEADS)
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and k.endswith("_config") and k not in UNTOUCHED:
            out[k] = shrink(v, text=k in TEXT_CONFIGS, tp=tp)
        elif k in LAYER_COUNTS and type(v) is int:
            out[k] = len(keep) if k == count_key else min(v, LAYERS)
        elif k in KV_HEADS and gqa and (type(v) is int or (v is None and k == "num_key_value_heads")):
            out[k] = heads if mla else (1 if v == 1 else kv_heads)  # MLA expands keys per query head; 1 stays MQA
        elif k in HEAD_COUNTS and type(v) is int:
            out[k] = heads
        elif k in VOCABS and type(v) is int:
            out[k] = min(v, VOCAB) if text else v
        elif k in SIZES and type(v) is int:
            out[k] = SIZES[k](v) if callable(SIZES[k]) else SIZES[k]
        else:
            out[k] = v
    if out.get("head_dim", 0) is None and gqa and type(out.get("hidden_size")) is int:
        out["head_dim"] = HEAD_DIM  # left open by the default config, read unguarded by several models
    if type(d.get("qk_rope_head_dim")) is int and d.get("head_dim") == d.get("qk_rope_head_dim"):
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA configs whose head_dim is the rotary part
    if type(d.get("num_kv_shared_layers")) is int and n:
        out["num_kv_shared_layers"] = len(keep) if d["num_kv_shared_layers"] == n else min(1, d["num_kv_shared_layers"])
    if text and type(out.get("vocab_size")) is int:
        _special_ids_in(out, out["vocab_size"])
    if n and len(keep) < n:
        _cut_layers(out, n, keep, tp)
    return out


def _kept_layers(d: dict, n: int) -> list[int]:
    """The first layer of every distinct combination of the per-layer kind lists, at least LAYERS of them."""
    lists = [d[k] for k in KIND_LISTS if isinstance(d.get(k), list) and len(d[k]) == n]
    if not lists:
        return list(range(min(n, LAYERS)))
    seen, keep = set(), []
    for i in range(n):
        kind = tuple(json.dumps(lst[i]) for lst in lists)
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    keep = keep[:MAX_LAYERS]
    keep += [i for i in range(n) if i not in keep][: max(0, LAYERS - len(keep))]
    return sorted(keep)


def _cut_layers(out: dict, n: int, keep: list[int], tp: int) -> None:
    for k, v in list(out.items()):
        if k in INDEX_LISTS and isinstance(v, list):
            out[k] = [j for j, i in enumerate(keep) if i in v]
        elif k in LAYER_REFS and isinstance(v, list) and len(v) == n:
            out[k] = [keep.index(v[i]) if v[i] in keep else j for j, i in enumerate(keep)]
        elif isinstance(v, list) and len(v) == n:
            out[k] = [FF] * len(keep) if k == "intermediate_size" else [v[i] for i in keep]
    overrides = out.get("per_layer_config")
    if isinstance(overrides, dict):  # Gemma 4: a layer's own head_dim etc., kept different from the global value
        width = max(map(len, overrides), default=1)
        out["per_layer_config"] = {
            str(j).zfill(width): _layer_override(overrides[key], tp)
            for j, i in enumerate(keep)
            for key in overrides
            if int(key) == i
        }


def _layer_override(v: dict, tp: int) -> dict:
    """A layer's own values, shrunk, and kept different from the global ones where they were (head_dim 32, not 16)."""
    tiny = shrink(v, tp=tp)
    for k, x in v.items():
        if type(x) is int and k in HEAD_DIMS:
            tiny[k] = 2 * HEAD_DIM
        elif type(x) is int and k in KV_HEADS:
            tiny[k] = math.lcm(HEADS, tp)  # per-layer MLA overrides keep key/value heads = query heads
        elif type(x) is int and k == "kv_lora_rank":
            tiny[k] = 16
    return tiny


def _special_ids_in(out: dict, vocab: int) -> None:
    for k, small in SPECIAL_IDS.items():
        v = out.get(k)
        if type(v) is int and v >= vocab:
            out[k] = small
        elif isinstance(v, list) and any(type(x) is int and x >= vocab for x in v):
            out[k] = [x for x in v if type(x) is int and x < vocab][:1] or [small]


def _merge(base: dict, fix: dict) -> dict:
    out = dict(base)
    for k, v in fix.items():
        nested = isinstance(v, dict) and isinstance(out.get(k), dict) and k.endswith("_config")
        out[k] = _merge(out[k], v) if nested else v
    return out
