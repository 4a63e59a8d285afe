"""The KV-cache capacity planner: bytes per token, per sequence, per batch and per GPU for real models.

Every number comes with its working. Model shapes come from `configs/models.toml` (each preset cites the Hugging
Face config.json it was copied from) or from any `config.json`, resolved through transformers' own config classes;
GPUs from `configs/gpus.toml`. Presets load with the standard library alone: torch and transformers are imported
only to resolve a config.json (`resolve`) or to check a plan against transformers' own cache (`check`).

The three ways public calculators get this wrong, and what the planner does instead:
  - head_dim taken as hidden_size / heads: wrong for Gemma 2 (3584 / 16 = 224, the model uses 256); we read head_dim.
  - KV heads ignored: 4x too high for Llama-3-8B (32 query heads share 8 KV heads); we use num_key_value_heads.
  - MLA treated as per-head K and V: DeepSeek-V2/V3 cache one 576-element latent per token per layer.

One job per module:
  units       parsing sizes and token counts from the command line, bounds, formatting
  formats     storage formats (fp16 ... int4 with group scales) and weight widths
  spec        ModelSpec and GPUSpec: the shapes the arithmetic needs
  presets     configs/models.toml and configs/gpus.toml, looked up by name
  config_json reading a config.json and checking every field it uses
  resolve     a config.json through transformers' config classes (or kvbench's own reader as a fallback)
  hf_fields   resolved fields -> ModelSpec: layers, heads, windows, MLA
  params      parameter counts: dense, MoE, MLA, vision towers
  formulas    bytes per token, per sequence, per GPU, and their working
  planner     the plan across contexts and the GPU budget
  bandwidth   memory bandwidth: gpus.toml's published figures and --bandwidth, read from text such as 3.35TB/s
  decode_floor a step's bytes over the bandwidth: the floor per step and the tokens/s ceiling
  capacity    the numbers behind --plot; capacity_plot draws them (matplotlib)
  model_source --model as a preset, a local directory or config.json, or a hub id
  traffic     what a torch.cat cache copies while it grows
  check       the plan against transformers' own cache, allocated on the meta device
  request     one `kvbench memory` command line, checked and resolved before any work
  jsonify     dataclasses -> JSON for --json
"""

from __future__ import annotations

from kvbench.memory.formats import KV_FORMATS, WEIGHT_BITS, KVFormat, get_kv_format, weight_bits
from kvbench.memory.formulas import bytes_per_sequence, kv_heads_per_gpu, layer_bytes_per_token
from kvbench.memory.jsonify import to_jsonable
from kvbench.memory.params import estimate_params, estimate_vision_params
from kvbench.memory.planner import (
    DEFAULT_OVERHEAD,
    GPUBudget,
    ModelPlan,
    PlanRow,
    gpu_budget,
    max_context,
    plan,
)
from kvbench.memory.presets import GPUS_TOML, MODELS_TOML, get_gpu, get_model, load_gpus, load_presets
from kvbench.memory.request import DEFAULT_MEASURE_CTX, Options, Request, parse_request, plan_request
from kvbench.memory.resolve import resolve_config
from kvbench.memory.spec import GPUSpec, ModelSpec
from kvbench.memory.traffic import CopyTraffic, copy_traffic
from kvbench.memory.units import (
    MAX_TOKENS,
    GiB,
    KiB,
    MiB,
    TiB,
    check_tokens,
    fmt_bytes,
    fmt_int,
    fmt_params,
    fmt_tokens,
    parse_bytes,
    parse_ctx,
    parse_overhead,
)


def spec_from_hf_config(path) -> ModelSpec:
    """Any Hugging Face config.json as a ModelSpec (imports transformers; see `resolve`)."""
    return resolve_config(path).spec


__all__ = [
    "DEFAULT_MEASURE_CTX", "DEFAULT_OVERHEAD", "GPUS_TOML", "KV_FORMATS", "MAX_TOKENS", "MODELS_TOML",
    "WEIGHT_BITS", "CopyTraffic", "GPUBudget", "GPUSpec", "GiB", "KVFormat", "KiB", "MiB", "ModelPlan", "ModelSpec",
    "Options", "PlanRow", "Request", "TiB", "bytes_per_sequence", "check_tokens",
    "copy_traffic", "estimate_params", "estimate_vision_params", "fmt_bytes", "fmt_int", "fmt_params",
    "fmt_tokens", "get_gpu", "get_kv_format", "get_model", "gpu_budget", "kv_heads_per_gpu",
    "layer_bytes_per_token", "load_gpus", "load_presets", "max_context", "parse_bytes", "parse_ctx",
    "parse_overhead", "parse_request", "plan", "plan_request", "resolve_config", "spec_from_hf_config",
    "to_jsonable", "weight_bits",
]  # fmt: skip
