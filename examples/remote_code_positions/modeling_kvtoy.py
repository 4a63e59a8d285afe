"""KVToy: a small GPT-2-style decoder whose position ids come from the cache length, not the attention mask.

With `positions_from_cache` (the default) the model ignores the `position_ids` that `generate` computes from the
attention mask and numbers each forward's tokens `past_length + arange(T)`, the way GPT-2's modelling code once did.
For one unpadded prompt that is exactly right, so a cached decode step and a cached greedy run match the no-cache
path. In a left-padded batch it is wrong: a row with p padding tokens sees its first real token at position p
instead of 0, and every later token shifted by p. The position table is learned, so a shifted position is a
different embedding and the output changes. (With rotary embeddings a constant shift cancels in q.k and the same
bug would be invisible.) `positions_from_cache=False` takes the `position_ids` it is given: the fixed model.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_kvtoy import KVToyConfig

# Recent transformers name the output's cache field `cache`; earlier 5.x releases `past_key_values`.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class KVToyAttention(nn.Module):
    def __init__(self, config: KVToyConfig, layer_idx: int):
        super().__init__()
        self.n_head, self.layer_idx = config.num_attention_heads, layer_idx
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, mask, cache):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)
        )  # (B,H,T,Dh)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, H, S, Dh): everything cached so far
        causal = mask is None and T > 1 and k.size(2) == T
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # (B, H, T, Dh)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class KVToyBlock(nn.Module):
    def __init__(self, config: KVToyConfig, layer_idx: int):
        super().__init__()
        C = config.hidden_size
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = KVToyAttention(config, layer_idx)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x, mask, cache):
        x = x + self.attn(self.ln_1(x), mask, cache)
        return x + self.mlp(self.ln_2(x))


class KVToyForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = KVToyConfig
    base_model_prefix = "kvtoy"

    def __init__(self, config: KVToyConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.n_positions, config.hidden_size)  # learned absolute positions
        self.h = nn.ModuleList(KVToyBlock(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_input_embeddings(self):
        return self.wte

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, **kwargs):  # fmt: skip
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        B, T = input_ids.shape
        past = int(cache.get_seq_length()) if cache is not None else 0
        if self.config.positions_from_cache or position_ids is None:
            # THE BUG: the cache length says where this forward starts, for every row alike; the attention mask
            # (where each row's real tokens start) is never consulted.
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)  # (B, T)
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        mask = create_causal_mask(self.config, x, attention_mask, cache, position_ids)
        for block in self.h:
            x = block(x, mask, cache)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: cache if use_cache else None})
