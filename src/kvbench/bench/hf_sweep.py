"""`kvbench bench --hf`: transformers' caches on any Hugging Face causal LM, through the GPT-2 bench's machinery.

The sweep (`bench.run_sweep`), its rows, cold/warm rules, token agreement, CSV files, meta.json and plots are the
GPT-2 bench's; what differs lives here:

- `HFModelEngine` implements the engine API of bench/engines.py on the model. `configure` prepares one configuration once:
  the `generate` arguments of its cache and, for `static-compiled`, the one CompileConfig every run of the
  configuration shares, so transformers compiles in the first run of each shape (the cold run) and reuses the
  compiled step in the warm ones. transformers allocates its cache inside every `generate` call, as its users get
  it (part of TTFT), exactly as the `hf` engine on GPT-2; runs are timed the same way (hf/engine.py: a
  LogitsProcessor synchronises and stamps the clock once per token).
- The token reference is the model's own `none`: `generate(use_cache=False)` on the same prompt ids in the same run.
  A flip is judged with one no-cache forward of the model over the prompt and the reference tokens before it,
  within verify's tolerance for a cache against its own no-cache path (TOLERANCES: same model, same code, only the
  cache differs).
- Settings: bench's keys, file and checks, with transformers' cache names (hf/caches.py, those it times) and the one engine; the
  model's context and the device's memory are checked on its meta-device build (load_hf's `check`) before any weight is read.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench import devices
from kvbench.bench.engines import InOneProcess, RunTiming, weight_bytes
from kvbench.bench.rules import bench_hf_rules, bench_hf_tp_rules, bench_rules
from kvbench.bench.settings import (
    BenchSettings,
    check_fits_context,
    oversized_batches,
    read_settings,
    settings_dict,
)
from kvbench.check.hf_subject import HFModel, forward_inputs
from kvbench.check.judge import tolerance
from kvbench.hf.caches import HF_CACHES, TIMED, compiles, generate_kwargs, parse_bench_caches
from kvbench.hf.engine import compiled_decode, timed_generate
from kvbench.hf.models import HFShape, LoadedHF
from kvbench.memory.config import quiet_transformers

TOKEN_REFERENCE = (
    "token_agreement: fraction of a row's generated tokens equal to those of the model's own none "
    "(transformers' generate with use_cache=False) for the same prompt ids in this run, worst of the row's runs; a "
    "flip whose top-2 logit gap (one no-cache forward of the model over the prompt and the reference tokens before "
    "it) is within twice the logit error at that token is a near-tie (rounding), as verify judges it"
)


# --- the engine ----------------------------------------------------------------------------------------------------
def _generate(loaded: LoadedHF, ids: torch.Tensor, new_tokens: int, kwargs: dict, record_logits: bool) -> RunTiming:
    """Greedy-generate exactly `new_tokens` for the (B, T) prompt `ids`, timed per token (hf_engine.timed_generate)."""
    with quiet_transformers():
        t = timed_generate(loaded.model, ids, new_tokens, loaded.pad_token_id, record_logits, **kwargs)
    return RunTiming(t.ttft_s, t.step_s, t.total_s, t.cache_bytes, None, t.tokens, t.logits, t.cache_slots)


class _HFModelConfiguration:
    """One cache on the model, its generate arguments fixed once (static-compiled: one CompileConfig for every run)."""

    capture_s = None  # static-compiled compiles inside its cold run; no time is measured apart

    def __init__(self, loaded: LoadedHF, cache: str) -> None:
        self.loaded, self.cache = loaded, cache
        self.kwargs = generate_kwargs(cache)

    def run(self, ids: torch.Tensor, new_tokens: int, record_logits: bool = False) -> RunTiming:
        return _generate(self.loaded, ids, new_tokens, self.kwargs, record_logits)

    def probe(self, ids: torch.Tensor) -> None:
        """Prefill + one decode step, eagerly (compiled code hides its attention calls; static-compiled traces the
        eager static path)."""
        cache = "static" if self.cache == "static-compiled" else self.cache
        _generate(self.loaded, ids, 2, generate_kwargs(cache), record_logits=False)


class HFModelEngine(InOneProcess):
    """transformers' generate on a Hugging Face model, one of its timed caches (hf/caches.py) per configuration; `hf` in the rows."""

    name = "hf"
    family = "hf"  # fill_relative: speedup over this engine's none, TPOT against the fastest transformers row
    token_reference = True  # its `none` rows are the reference of every row: the model against itself
    reference_label = "the model's own none"

    def __init__(self, loaded: LoadedHF) -> None:
        self.loaded = loaded
        self.configured: set[str] = set()  # the caches this engine has prepared (for describe)
        self.model = HFModel(loaded)
        self.no_caches = self.model.caches_unsupported  # why transformers' caches do not apply, or None

    def supports(self, cache: str) -> bool:
        return cache in TIMED and (cache == "none" or self.no_caches is None)

    def unjudged(self, longest: int) -> str | None:
        """Why a token flip in a run of `longest` tokens says nothing about the cache (verify's rule), or None."""
        return self.model.unjudged(longest)

    def weight_bytes(self) -> int:
        return weight_bytes(self.loaded.model)

    def configure(self, cache: str, batch: int, max_len: int) -> _HFModelConfiguration:
        self.configured.add(cache)
        return _HFModelConfiguration(self.loaded, cache)

    @torch.inference_mode()
    def reference_logits(self, ids: torch.Tensor, ref: list[list[int]], d: int) -> torch.Tensor:
        """(B, V) fp32: the model's logits for token d with no cache, one forward over the prompt and the reference
        tokens before d (what its `none` computed at that step)."""
        before_d = torch.tensor([r[:d] for r in ref], device=ids.device, dtype=ids.dtype)  # (B, d)
        x = torch.cat([ids, before_d], dim=1)  # (B, T + d)
        model = self.loaded.model
        # the vocabulary projection of the last position only, as generate asks for it, where the model takes it
        last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        with quiet_transformers():  # positions as generate feeds them (check/hf_subject.forward_inputs)
            out = model(
                input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, **last, **forward_inputs(model, x)
            )
        return out.logits[:, -1].float().cpu()

    @staticmethod
    def token_tolerance(cache: str, dtype: torch.dtype) -> tuple[float, float, bool]:
        """(rtol, atol, lossy): every cache here is exact, held to verify's rounding against its own no-cache path."""
        tol = tolerance(dtype)
        return tol.rtol, tol.atol, False

    def describe(self) -> str:
        text = (
            f"transformers' generate on {self.loaded.label}, greedy, exactly --new-tokens tokens; transformers "
            "allocates its cache inside every call"
        )
        if "static-compiled" in self.configured:
            done = "compiled" if compiled_decode(self.loaded.model) else "not compiled"
            text += f"; static-compiled: the decode step {done} in this run"
        return text


# --- settings and checks before any work ---------------------------------------------------------------------------
def hf_bench_settings(config: str | Path | None, given: dict) -> BenchSettings:
    """bench's settings for --hf: the TOML file and the options as for GPT-2, checked by the same rules
    (rules.bench_hf_rules, then rules.bench_rules), with transformers' cache names and the one engine."""
    raw = read_settings(config, given)
    bench_hf_rules(raw, given, config)
    raw.pop("engine", None)
    caches = raw.pop("caches", None)
    # bench_rules knows our registry's cache and engine names only: it checks everything else here, and the caches
    # are transformers' (parse_bench_caches)
    s = BenchSettings(**raw, caches=["none"], engine=["kvbench"])
    bench_rules(s)
    if caches is None and s.tp > 1:  # every timed cache but a compiled one (rules.bench_hf_tp_rules)
        caches = [c for c in TIMED if not compiles(c)]
    s.caches, s.engine = parse_bench_caches(caches), ["hf"]
    bench_hf_tp_rules(s.tp, s.caches)
    return s


def kv_bytes(shape: HFShape, tokens: int, element_size: int) -> int:
    """K and V of every layer for one sequence of `tokens` tokens; a sliding-window layer holds at most its window,
    a recurrent layer none (its fixed-size state is not a KV cache)."""
    info = shape.info
    widths = info.kv_widths or [info.n_kv_heads * info.head_dim] * len(info.layer_types)
    held = [info.kv_tokens(kind, tokens) for kind in info.layer_types]
    return sum(2 * w * h * element_size for w, h in zip(widths, held, strict=False))


def check_sizes_hf(s: BenchSettings, shape: HFShape, dtype: torch.dtype, device: torch.device) -> dict[int, str]:
    """Before any weight is loaded, as bench_settings.check_sizes does for GPT-2: every prompt length + new tokens
    within the model's context, and the weights + the KV cache within the device. Returns the batch sizes
    predicted not to fit (their rows are `oom`); refuses the sweep when none fits."""
    if shape.info.context is not None:
        check_fits_context(s, shape.info.context, shape.label)
    elem = torch.empty((), dtype=dtype).element_size()
    per_sequence = kv_bytes(shape, max(s.prompt_len) + s.new_tokens, elem)
    return oversized_batches(
        s,
        shape.parameters * elem,
        per_sequence,
        devices.device_memory_bytes(device),
        f" ({shape.label})",
        ", or --layers",
    )


def sweep_warnings_hf(s: BenchSettings, device: torch.device) -> list[str]:
    """What the sweep will not do, or will do slowly, said out loud."""
    notes = []
    if "none" not in s.caches:
        notes.append(
            "token_agreement and speedup_vs_none need the model's own `none` in the sweep (--caches none,...); "
            "without it those columns stay empty"
        )
    if "static-compiled" in s.caches and device.type != "cuda":
        notes.append(
            f"static-compiled compiles its decode step on the {device.type.upper()} in each prompt length's cold "
            "run (seconds to minutes each); its warm rows run the compiled step"
        )
    return notes


def bench_meta(loaded: LoadedHF, s: BenchSettings, layers: int | None, trust: bool) -> dict:
    """meta.json's additions: the model (`hf`), the token reference, and settings that say how to rerun."""
    settings = {k: v for k, v in settings_dict(s).items() if k not in ("model", "weights")}  # GPT-2's only
    return {
        "settings": {**settings, "hf": loaded.source, "layers": layers, "trust_remote_code": trust},
        "token_reference": TOKEN_REFERENCE,
        "hf": {**loaded.meta(), "caches": {n: HF_CACHES[n].summary for n in s.caches}},
    }


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
    kv_layers: int  # the layers that cache K/V (a hybrid's attention layers; 0 for a recurrent model)
    kv_elements: int  # K (or V) elements per token over those layers (HFModelInfo.kv_elements)

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V of every attention layer, for one token (sliding-window layers counted in full)."""
        return 2 * self.kv_elements * element_size


@dataclass
class SweepModel:
    """`bench.run_sweep` reads a model's `config` and the device and dtype of `lm_head.weight`."""

    config: HFBenchConfig
    lm_head: torch.nn.Module


@dataclass
class BenchLoaded:
    """What `report.BenchRecorder` reads from a loaded model: config, weights, random; `model` for the sweep."""

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
        kv_layers=info.kv_layers,
        kv_elements=info.kv_elements,
    )
    head = loaded.model.get_output_embeddings()
    assert head is not None and hasattr(head, "weight"), f"{info.architecture} has no output embedding to read"
    return BenchLoaded(config, loaded.weights, loaded.random, SweepModel(config, head))
