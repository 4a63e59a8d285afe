"""The KV-cache capacity planner: bytes per token, per sequence, per batch and per GPU for real models.

Every number comes with its working. Model shapes come from `configs/models.toml` (each preset cites the Hugging
Face config.json it was copied from) or from any `config.json`, resolved through transformers' own config classes;
GPUs from `configs/gpus.toml`. The planner imports the standard library alone: torch and transformers are imported
only to resolve a config.json (`config`) or to check a plan against transformers' own cache (`check`), matplotlib
only to draw --plot (`plot`).

The three ways public calculators get this wrong, and what the planner does instead:
  - head_dim taken as hidden_size / heads: wrong for Gemma 2 (3584 / 16 = 224, the model uses 256); we read head_dim.
  - KV heads ignored: 4x too high for Llama-3-8B (32 query heads share 8 KV heads); we use num_key_value_heads.
  - MLA treated as per-head K and V: DeepSeek-V2/V3 cache one 576-element latent per token per layer.

One job per module, lower layers first:
  units       parsing sizes and token counts from the command line, bounds, formatting
  spec        what the arithmetic takes: ModelSpec, GPUSpec, storage formats (fp16 ... int4 with group scales),
              weight widths, memory bandwidth (gpus.toml's published figures and --bandwidth)
  presets     configs/models.toml and configs/gpus.toml, looked up by name
  state       which layers of a config keep a recurrent state instead of K/V, and its size per sequence
  hf_fields   a config's fields -> ModelSpec (layers, heads, windows, MLA) and its parameter count
  config      a config.json: --model as a preset, local path or hub id; every field checked; resolved through
              transformers' config classes (or kvbench's own reader as a fallback)
  formulas    bytes per token, per sequence and per GPU; what a torch.cat cache copies while it grows
  planner     the plan across contexts, the GPU budget, and the decode floor over a bandwidth
  plot        --plot: the capacity chart's numbers, and its drawing (matplotlib)
  check       the plan against transformers' own cache, allocated on the meta device
  request     one `kvbench memory` command line, checked and resolved before any work
"""
