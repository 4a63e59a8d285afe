"""`kvbench bench --hf`: transformers' caches on any Hugging Face causal LM, through the GPT-2 bench's machinery.

The sweep (`bench.run_sweep`), its rows, cold/warm rules, CSV files, meta.json and plots are the GPT-2 bench's;
only the engine differs: `HFModelEngine` runs the model's own `generate` with each cache in HF_BENCH_CACHES and
times it exactly as the `hf` engine does on GPT-2 (hf_engine.py: a LogitsProcessor synchronises and stamps the
clock once per token; ttft is the prefill and the first token, each step one decode token).

`static-compiled` is transformers' StaticCache with `generate`'s own torch.compile of the decode step (mode
reduce-overhead, CUDA graphs on a GPU). Compilation happens in the first run of each shape, the cold run, which
the bench reports apart from the warm medians; on the CPU it takes tens of seconds per shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvbench.bench import RunTiming
from kvbench.devices import synchronize
from kvbench.errors import KVBenchError
from kvbench.hf_engine import _cache_nbytes, _token_clock
from kvbench.hf_models import LoadedHF, quiet_transformers, returned_cache

# Cache names -> the generate arguments that select them. One registry: --caches choices and the sweep read it.
HF_BENCH_CACHES: dict[str, dict] = {
    # the whole sequence recomputed every step
    "none": {"use_cache": False},
    # DynamicCache: torch.cat growth (sliding-window layers where the model has them)
    "dynamic": {"cache_implementation": "dynamic"},
    # StaticCache, eager
    "static": {"cache_implementation": "static", "disable_compile": True},
    # StaticCache and generate's torch.compile of the decode step (the config is made per run)
    "static-compiled": {"cache_implementation": "static", "compile_config": None},
}


def parse_hf_bench_caches(names: list[str] | None) -> list[str]:
    if not names or names == ["all"]:
        return list(HF_BENCH_CACHES)
    bad = [n for n in names if n not in HF_BENCH_CACHES]
    if bad:
        raise KVBenchError(
            f"unknown cache {', '.join(map(repr, bad))} for bench --hf; caches: {', '.join(HF_BENCH_CACHES)}"
        )
    return list(dict.fromkeys(names))


def _generate_kwargs(cache: str) -> dict:
    kw = dict(HF_BENCH_CACHES[cache])
    if "compile_config" in kw:
        from kvbench.hf_verify import _compile_config

        kw["compile_config"] = _compile_config()
    return kw


class HFModelEngine:
    """transformers' generate on a Hugging Face model, one of HF_BENCH_CACHES per run; named `hf` in the rows."""

    name = "hf"

    def __init__(self, loaded: LoadedHF) -> None:
        self.loaded = loaded

    def supports(self, cache: str) -> bool:
        return cache in HF_BENCH_CACHES

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, new_tokens: int, cache: str) -> RunTiming:
        """Greedy-generate exactly `new_tokens` for the (B, T) prompt `ids`, timed per token."""
        from transformers import LogitsProcessorList

        model, device = self.loaded.model, ids.device
        clock = _token_clock(device)
        with quiet_transformers():
            synchronize(device)
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=self.loaded.pad_token_id,
                logits_processor=LogitsProcessorList([clock]),
                return_dict_in_generate=True,
                **_generate_kwargs(cache),
            )
            synchronize(device)
            t1 = time.perf_counter()
        stamps = clock.stamps[:new_tokens]
        assert len(stamps) == new_tokens, (
            f"generate produced {len(stamps)} token stamps, expected {new_tokens}"
        )
        seq = out.sequences[:, ids.size(1) :]
        return RunTiming(
            ttft_s=stamps[0] - t0,
            step_s=[b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            total_s=t1 - t0,
            cache_bytes=_cache_nbytes(returned_cache(out)),
            bytes_copied=None,
            tokens=seq.tolist(),
        )


# --- what the sweep and the recorder read from a model -------------------------------------------------------------
@dataclass
class HFBenchConfig:
    """The fields of GPTConfig that `bench.run_sweep` and `report.BenchRecorder` read, for a transformers model."""

    name: str
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int  # the configured maximum length (prompt + new tokens are checked against it)
    vocab_size: int
    n_kv_head: int
    head_dim: int

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V of every layer, for one token (sliding-window layers counted in full)."""
        return 2 * self.n_layer * self.n_kv_head * self.head_dim * element_size


@dataclass
class SweepModel:
    """`bench.run_sweep` reads a model's `config` and the device and element size of `lm_head.weight`."""

    config: HFBenchConfig
    lm_head: torch.nn.Module


@dataclass
class BenchLoaded:
    """What `report.BenchRecorder` reads from a loaded model: config, weights, random."""

    config: HFBenchConfig
    weights: str
    random: bool
    model: SweepModel


def bench_view(loaded: LoadedHF) -> BenchLoaded:
    info = loaded.info
    config = HFBenchConfig(
        name=loaded.label,
        n_layer=info.n_layers,
        n_head=info.n_heads,
        n_embd=info.hidden_size,
        block_size=info.context if info.context is not None else 2**31 - 1,
        vocab_size=info.vocab_size,
        n_kv_head=info.n_kv_heads,
        head_dim=info.head_dim,
    )
    head = loaded.model.get_output_embeddings()
    assert head is not None and hasattr(head, "weight"), (
        f"{info.architecture} has no output embedding to read"
    )
    return BenchLoaded(config, loaded.weights, loaded.random, SweepModel(config, head))
