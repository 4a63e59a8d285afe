"""The engines bench times: our generation loop, transformers' `generate` eager and compiled, and peers (CTranslate2).

An engine prepares one *configuration* (a cache at a batch size and a maximum length) once, and the sweep then runs
that configuration's cold run, warm-ups and timed repeats on it: our caches are allocated once and reset between
runs (so `static-graph` captures its CUDA graph once, in the cold run, and replays it in every later run), exactly
as a serving loop would reuse them. transformers allocates its own cache inside every `generate` call, as its users
get it; that allocation is part of its TTFT.

    kvbench       generation.generate on our GPT-2; every registered cache and plugin
    hf            transformers' generate, eager (disable_compile=True): none, dynamic, static
    hf-compiled   transformers' generate with its static cache and its default automatic torch.compile
    ct2-fp32      CTranslate2's Generator on the same weights, float32 (`ct2` names it and ct2-int8 together)
    ct2-int8      the same with int8 weights
    llamacpp-*    llama.cpp (llama-cpp-python) on a GGUF of the same weights: f32 (float32 weights and cache), f16
                  (float16 weights and cache), f16-kv-q8_0 and f16-kv-q4_0 (quantised caches); `llamacpp` names all

An engine also says how its rows' tokens are judged (bench/agreement.py): `token_reference` is True for the engine whose
`none` rows are the sweep's token reference (kvbench here; `bench --hf`'s engine on its own model, bench/hf_sweep.py),
`reference_logits(ids, ref, d)` gives that reference's logits at a flip, and `token_tolerance(cache, dtype)` the
rounding a correct path may show there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvbench.bench.agreement import reference_logits
from kvbench.bench.floor import weight_bytes as floor_weight_bytes
from kvbench.caches import get_cache_spec, make_caches
from kvbench.caches.base import UNKNOWN_TRAFFIC, Traffic
from kvbench.caches.static_graph import StaticGraphCache
from kvbench.check.judge import tolerance
from kvbench.decode.fixed_step import FixedShapeDecoder
from kvbench.decode.generate import generate
from kvbench.devices import synchronize
from kvbench.hf.caches import HF_CACHES
from kvbench.hf.engine import ENGINE_CACHES as HF_ENGINE_CACHES
from kvbench.hf.engine import build_hf_model, compiled_decode, hf_generate
from kvbench.model import operators
from kvbench.peers import PEERS, PeerSpec

if TYPE_CHECKING:
    from kvbench.bench.rows import SummaryRow
    from kvbench.model.gpt2 import GPT
    from kvbench.peers import PeerRunner


@dataclass
class RunTiming:
    """One whole generation, timed. total_s: the whole call, device synchronised at both ends."""

    ttft_s: float
    step_s: list[float]
    total_s: float
    cache_bytes: int | None
    bytes_copied: int | None
    tokens: list[list[int]]
    logits: list[torch.Tensor] | None = None  # (B, V) fp32 per token; only in the untimed run that explains flips
    cache_slots: int | None = None  # token slots per sequence of transformers' cache at the end (None: not read)


class Configuration(Protocol):
    """What an engine's `configure` returns: one configuration, prepared once, run many times."""

    @property
    def capture_s(self) -> float | None:
        """Seconds spent capturing CUDA graphs (None: none captured, or not measured apart)."""

    def run(self, ids: torch.Tensor, new_tokens: int, record_logits: bool = False) -> RunTiming:
        """One whole generation of `new_tokens` for the (B, T) prompt `ids`, timed."""

    def probe(self, ids: torch.Tensor) -> None:
        """Prefill + one decode step through the same code path, eagerly (backends.watch_sdpa)."""


class Engine(Protocol):
    """What the sweep reads of an engine: the ones here, bench/hf_sweep.py's HFModelEngine, and bench/tp.py's
    RankEngine (one of them as one rank of a tensor-parallel group)."""

    @property
    def has_floor(self) -> bool: ...
    @property
    def failure_ends_sweep(self) -> bool: ...
    @property
    def token_reference(self) -> bool: ...
    @property
    def reference_label(self) -> str: ...
    @property
    def profiled(self) -> bool: ...

    def supports(self, cache: str) -> bool: ...

    def configure(self, cache: str, batch: int, max_len: int) -> Configuration: ...

    def weight_bytes(self) -> int: ...

    def describe(self) -> str: ...

    def reference_logits(self, ids: torch.Tensor, ref: list[list[int]], d: int) -> torch.Tensor: ...

    def token_tolerance(self, cache: str, dtype: torch.dtype) -> tuple[float, float, bool]: ...

    def rank_rows(self, conf: Configuration, ids: torch.Tensor, new_tokens: int, row: SummaryRow) -> list | None: ...


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied or shared weights); of a model
    split by transformers' tensor parallelism, this rank's shards (a DTensor's local tensor)."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


class InOneProcess:
    """How an engine in one process takes part in a sweep (bench/tp.py's RankEngine: as one rank of a group)."""

    has_floor = True  # its rows get the bandwidth floor (the device's read bandwidth, measured once)
    weight_element_size: int | None = None  # bytes a weight the floor counts (None: the model's dtype)
    kv_element_size: float | None = None  # bytes a K or V element the floor counts (None: the model's dtype)
    failure_ends_sweep = False  # a configuration that raises (oom, a plugin) is a failed row, and the sweep goes on
    profiled = True  # --profile traces its rows: its step is torch's operators, which torch.profiler sees

    def rank_rows(self, conf: Configuration, ids: torch.Tensor, new_tokens: int, row: SummaryRow) -> list | None:
        """Every rank's row of a finished configuration (tp.csv); None in one process."""
        return None


# --- ours ------------------------------------------------------------------------------------------------------------
class _KVBenchConfiguration:
    """One cache configuration of our loop: the caches allocated once, reset by `generate` before every run."""

    def __init__(self, model: GPT, cache: str, batch: int, max_len: int, compile: str = "off") -> None:
        w = model.lm_head.weight
        self.model, self.cache, self.compile = model, cache, compile
        self.caches = make_caches(cache, model.cache_config, batch, max_len, w.dtype, w.device)

    def run(self, ids: torch.Tensor, new_tokens: int, record_logits: bool = False) -> RunTiming:
        prompts = ids.tolist()
        device = ids.device
        synchronize(device)
        t0 = time.perf_counter()
        r = generate(
            self.model,
            prompts,
            new_tokens,
            cache=self.cache,
            caches=self.caches,
            record_logits=record_logits,
            compile=self.compile,
        )
        synchronize(device)
        total = time.perf_counter() - t0
        return RunTiming(r.ttft_s, r.step_s, total, r.cache_bytes, r.bytes_copied, r.tokens, r.logits)

    @property
    def capture_s(self) -> float | None:
        """Seconds spent capturing CUDA graphs for these caches (None: this cache captures none here)."""
        runner = getattr(self.caches[0], "runner", None) if self.caches else None
        if runner is None or not getattr(runner, "captures", 0):
            return None
        return runner.capture_s

    def probe(self, ids: torch.Tensor) -> None:
        """Prefill + one decode step through the same code path, eagerly (no CUDA graph, no compile) on fresh
        caches, so every attention call is visible to `backends.watch_sdpa`."""
        w = self.model.lm_head.weight
        B, T = ids.shape
        caches = make_caches(self.cache, self.model.cache_config, B, T + 2, w.dtype, w.device)
        if get_cache_spec(self.cache).fixed_step:
            assert caches is not None and isinstance(caches[0], StaticGraphCache), f"{self.cache}: StaticGraphCache"
            caches[0].runner = FixedShapeDecoder(self.model, caches, graph=False)
        generate(self.model, ids.tolist(), 2, cache=self.cache, caches=caches)


class _OnOurGPT(InOneProcess):
    """Engines on our GPT-2: kvbench's `none` is their token reference, its logits our model's no-cache forward."""

    model: GPT
    family: str
    reference_label = "kvbench's none"

    def reference_logits(self, ids: torch.Tensor, ref: list[list[int]], d: int) -> torch.Tensor:
        return reference_logits(self.model, ids, ref, d)

    def token_tolerance(self, cache: str, dtype: torch.dtype) -> tuple[float, float, bool]:
        """(rtol, atol, lossy): the rounding a correct path may show, as verify allows it: our caches against our
        no-cache path, transformers against it as a reference implementation; a lossy cache within its own
        documented error."""
        spec = get_cache_spec(cache)
        lossy = None if spec.exact else (spec.logit_rtol, spec.logit_atol)
        tol = tolerance(dtype, lossy, reference=self.family == "hf")
        return tol.rtol, tol.atol, tol.lossy


class KVBenchEngine(_OnOurGPT):
    """Our generation loop (generation.generate) on our GPT; every registered cache and plugin."""

    name = "kvbench"
    family = "kvbench"  # rows of a family share a `none` baseline
    token_reference = True  # its `none` rows are every row's token reference

    def __init__(self, model: GPT, compile: str = "off") -> None:
        self.model, self.compile = model, compile  # compile: how a fixed-shape decode step runs (--compile)
        if compile == "max" and model.lm_head.weight.device.type == "cpu":
            operators.prepare()  # its C++ kernels built (once per machine) and loaded before anything is timed

    @staticmethod
    def supports(cache: str) -> bool:
        return True  # every registered cache and plugin runs through our loop (names validated up front)

    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    @staticmethod
    def traffic(cache: str) -> Traffic | None:
        """What a decode step of `cache` moves (the floor); None for the no-cache path (no floor)."""
        spec = get_cache_spec(cache)
        return None if spec.factory is None else spec.traffic or UNKNOWN_TRAFFIC

    def configure(self, cache: str, batch: int, max_len: int) -> _KVBenchConfiguration:
        return _KVBenchConfiguration(self.model, cache, batch, max_len, self.compile)

    def describe(self) -> str:
        return "kvbench's generation loop on its own GPT-2; caches allocated once per configuration"


# --- transformers ----------------------------------------------------------------------------------------------------
class _HFConfiguration:
    capture_s = None

    def __init__(self, hf: Any, cache: str, compile: bool) -> None:
        self.hf, self.cache, self.compile = hf, cache, compile

    def run(self, ids: torch.Tensor, new_tokens: int, record_logits: bool = False) -> RunTiming:
        r = hf_generate(self.hf, ids, new_tokens, self.cache, compile=self.compile, record_logits=record_logits)
        return RunTiming(r.ttft_s, r.step_s, r.total_s, r.cache_bytes, None, r.tokens, r.logits)

    def probe(self, ids: torch.Tensor) -> None:
        """Prefill + one decode step, eagerly (compiled code hides its attention calls; the compiled graph makes
        the same SDPA calls as the eager static path it was traced from)."""
        hf_generate(self.hf, ids, 2, self.cache, compile=False)


class HFEngine(_OnOurGPT):
    """transformers' generate on the same weights, eagerly (see hf/engine.py for what its numbers include)."""

    name = "hf"
    family = "hf"
    compile = False
    token_reference = False

    def __init__(self, model: GPT, hf: Any = None) -> None:
        self.model = model
        self.hf = hf if hf is not None else build_hf_model(model)

    @staticmethod
    def supports(cache: str) -> bool:
        return cache in HF_ENGINE_CACHES

    def weight_bytes(self) -> int:
        return weight_bytes(self.hf)

    @staticmethod
    def traffic(cache: str) -> Traffic | None:
        """What a decode step of transformers' `cache` moves; None for its no-cache path (no floor)."""
        return HF_CACHES[cache].traffic if cache in HF_ENGINE_CACHES else None

    def configure(self, cache: str, batch: int, max_len: int) -> _HFConfiguration:
        return _HFConfiguration(self.hf, cache, self.compile)

    def describe(self) -> str:
        return "transformers' generate, eager (disable_compile=True), SDPA attention, weights shared with kvbench"


class HFCompiledEngine(HFEngine):
    """transformers' static cache with its default automatic compile: what `cache_implementation="static"` gives
    its users. The first call of each shape compiles; bench reports it as the cold run."""

    name = "hf-compiled"
    compile = True

    @staticmethod
    def supports(cache: str) -> bool:
        return cache == "static"

    def describe(self) -> str:
        if compiled_decode(self.hf):
            return (
                "transformers' generate with cache_implementation='static' and its default torch.compile of the "
                "decode forward (CompileConfig(): inductor, mode reduce-overhead); compiled in this run"
            )
        return (
            "transformers' generate with cache_implementation='static'; transformers did not compile here (it "
            f"compiles automatically only on CUDA, XPU, TPU and Neuron devices; this is {self.hf.device.type}), "
            "so these rows ran its static cache eagerly"
        )


# --- peers -------------------------------------------------------------------------------------------------------------
# A peer (peers/PEERS: CTranslate2) runs its own cache, which grows with the sequence as `dynamic`'s does, so its rows
# appear under --caches dynamic. TTFT is the call's start to the first token (the generation callback), TPOT the time
# between two tokens' callbacks; the floor reads the weights in the peer's own type (4 bytes a weight in float32, 1
# in int8) and the K/V of the context (what its cache moves on top is not stated, so counted as nothing); tokens are
# judged as verify judges an independent implementation, or as a lossy path (int8 weights).
PEER_CACHE = "dynamic"  # the rows a peer's own cache appears under
# int8 weights move a correct path's logits by ~1% of their scale: a flip within this is the quantisation's
LOSSY_LOGITS = (0.05, 0.1)


class _PeerConfiguration:
    capture_s = None

    def __init__(self, peer: PeerRunner) -> None:
        self.peer = peer

    def run(self, ids: torch.Tensor, new_tokens: int, record_logits: bool = False) -> RunTiming:
        g = self.peer.generate(ids.tolist(), new_tokens, record_logits)
        logits = None if g.logits is None else list(g.logits.unbind(1))  # (B, V) per token
        return RunTiming(g.ttft_s, g.step_s, g.total_s, None, None, g.tokens, logits)

    def probe(self, ids: torch.Tensor) -> None:
        """A peer makes no SDPA call of torch's: nothing to watch."""


class PeerEngine(_OnOurGPT):
    """A peer (peers/PEERS) on our model's weights; one subclass per peer, so the registry holds classes."""

    spec: PeerSpec
    token_reference = False
    profiled = False  # its step runs in CTranslate2's or llama.cpp's own code, which torch.profiler does not see

    def __init__(self, model: GPT, threads: int | None = None) -> None:
        from kvbench.peers import load

        self.model = model
        self.peer = load(model, self.spec, threads or torch.get_num_threads())

    @classmethod
    def supports(cls, cache: str) -> bool:
        return cache == PEER_CACHE

    @classmethod
    def traffic(cls, cache: str) -> Traffic | None:
        return Traffic(f"{cls.spec.name}'s own cache: weights and K/V of L slots only") if cls.supports(cache) else None

    def weight_bytes(self) -> int:
        return floor_weight_bytes(self.model.config, self.spec.weight_bytes)

    def configure(self, cache: str, batch: int, max_len: int) -> _PeerConfiguration:
        return _PeerConfiguration(self.peer)

    def describe(self) -> str:
        return f"{self.spec.summary}; {self.peer.describe()}"

    def token_tolerance(self, cache: str, dtype: torch.dtype) -> tuple[float, float, bool]:
        tol = tolerance(dtype, None if self.spec.exact else LOSSY_LOGITS, reference=True)
        return tol.rtol, tol.atol, tol.lossy

    def rank_rows(self, conf: object, ids: torch.Tensor, new_tokens: int, row: SummaryRow) -> list | None:
        return None


def _engine_class(peer: PeerSpec) -> type[PeerEngine]:
    attrs = {
        "spec": peer,
        "name": peer.name,
        "family": peer.name,
        "weight_element_size": peer.weight_bytes,
        "kv_element_size": peer.kv_bytes,
    }
    return type(f"PeerEngine_{peer.name}", (PeerEngine,), attrs)


# One registry of engines: the CLI's --engine choices and the sweep iterate it (a peer family such as `ct2` stands
# for its peers, peers.FAMILIES).
ENGINES: dict[str, type[KVBenchEngine] | type[HFEngine] | type[PeerEngine]] = {
    "kvbench": KVBenchEngine,
    "hf": HFEngine,
    "hf-compiled": HFCompiledEngine,
    **{name: _engine_class(p) for name, p in PEERS.items()},
}


def build_engines(model: GPT, names: list[str], compile: str = "off") -> dict[str, Engine]:
    """The engines named, built once; hf and hf-compiled share one transformers model (and our weights).
    `compile` (--compile) applies to our engine's fixed-shape decode step; transformers' engines keep their own."""
    engines: dict[str, Engine] = {}
    hf = None
    for name in names:
        cls = ENGINES[name]
        if issubclass(cls, HFEngine):
            engines[name] = built = cls(model, hf)
            hf = built.hf
        elif issubclass(cls, PeerEngine):
            engines[name] = cls(model)
        else:
            engines[name] = cls(model, compile)
    return engines
