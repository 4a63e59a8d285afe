"""KVToy's config: a GPT-2-shaped decoder with learned absolute positions (see modeling_kvtoy.py)."""

from transformers import PretrainedConfig


class KVToyConfig(PretrainedConfig):
    model_type = "kvtoy"

    def __init__(
        self,
        vocab_size: int = 256,
        n_positions: int = 128,  # rows of the position table: no position past n_positions - 1
        hidden_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        initializer_range: float = 0.1,
        positions_from_cache: bool = True,  # the bug: positions = cache length + arange(T), mask ignored
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.max_position_embeddings = n_positions
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.initializer_range = initializer_range
        self.positions_from_cache = positions_from_cache
        super().__init__(**kwargs)
