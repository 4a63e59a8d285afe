"""`bench --tp N`: what each rank of a tensor-parallel sweep holds and spends, gathered to rank 0 (tp.csv).

Every rank runs the same sweep on its shard of the model (model/tp.py for our GPT-2, transformers' own plan for
--hf); the collectives inside each forward keep the ranks in step. So a configuration that raises on one rank cannot
become a failed row while the others go on (they would pair their next collective with the wrong one): it ends the
run, and the launcher names the rank (kvbench.launcher). After each configuration every rank sends its row to
rank 0, which writes the run folder:

    ttft_ms, tpot_ms_median   this rank's own medians over the timed repeats (its clock, its runs)
    kv_cache_bytes            the K and V this rank's cache holds at the end of a run, beside
                              planned_kv_cache_bytes: the planner's figure for one rank (kvbench.memory: the heads a
                              rank holds) at the cache's slots per sequence (kv_slots), times the batch
    peak_mem_mib              this rank's weights + its peak above what was in use before the configuration
    collective_share          of one more run after the timed ones, the share of its time spent inside the
                              collectives, the device synchronised around each (the timed runs carry no such
                              synchronisation)

On the CPU the backend is gloo, and an all-reduce costs about a millisecond of a shared core: those timings are
not a speed measurement, and every row says so (`timing`); under NCCL, one GPU per rank, they measure.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from kvbench.devices import synchronize
from kvbench.rows import CsvRow

if TYPE_CHECKING:
    from kvbench.bench.engines import Configuration, Engine, RunTiming
    from kvbench.bench.rows import SummaryRow
    from kvbench.distributed import Rank
    from kvbench.hf.models import LoadedHF
    from kvbench.model.gpt2 import GPTConfig

GLOO_TIMING = (
    "not a speed measurement: gloo on a CPU, where each all-reduce costs about a millisecond of a shared core; these "
    "rows show each rank's memory and that the ranks ran in step (on CUDA, NCCL with one GPU per rank, the same "
    "command measures)"
)
NCCL_TIMING = "measured: NCCL, one GPU per rank"


@dataclass
class RankRow(CsvRow):
    """One rank's part of one configuration: a row of tp.csv."""

    engine: str
    cache: str
    prompt_len: int
    batch: int
    rank: int
    ranks: int  # the tensor-parallel size
    backend: str  # gloo | nccl
    device: str  # this rank's device
    ttft_ms: float  # this rank's median over the timed repeats
    tpot_ms_median: float  # this rank's decode steps of the timed repeats, pooled
    kv_slots: float  # token slots per sequence of this rank's cache at the end of a run (empty: no cache)
    kv_cache_bytes: float  # K and V this rank's cache holds at the end of a run, all layers, the whole batch
    planned_kv_cache_bytes: float  # the planner's figure for one rank at kv_slots x batch (empty: none)
    planned_equal: bool | None  # kv_cache_bytes == planned_kv_cache_bytes (None: no planner figure)
    peak_mem_mib: float  # weights_mib + this rank's peak above its use before the configuration
    weights_mib: float  # this rank's weights, each storage once
    collective_ms: float  # time inside the collectives during one more run after the timed ones
    collective_calls: int  # collectives in that run
    run_ms: float  # that run's whole generation
    collective_share: float  # collective_ms / run_ms
    timing: str  # GLOO_TIMING (not a speed measurement) or NCCL_TIMING


# RankRow's columns copied from this rank's summary row of the configuration
FROM_SUMMARY = ("engine", "cache", "prompt_len", "batch", "ttft_ms", "tpot_ms_median", "peak_mem_mib", "weights_mib")


@dataclass
class Clock:
    """Seconds spent inside collectives, and how many there were."""

    seconds: float = 0.0
    calls: int = 0


class Ranks:
    """This rank's part of a tensor-parallel sweep: `measure` runs once more with its collectives timed, makes its
    row and sends it to rank 0. Subclasses say how the collectives are timed and what the planner predicts."""

    split = ""  # how the model is split (meta.json)
    collectives = ""  # how the collectives are timed (meta.json)

    def __init__(self, rank: Rank, dtype: torch.dtype) -> None:
        self.rank = rank
        self.dtype = dtype

    @property
    def reports(self) -> bool:
        return self.rank.rank == 0

    def timing(self) -> str:
        return NCCL_TIMING if self.rank.backend == "nccl" else GLOO_TIMING

    def meta(self) -> dict:
        """meta.json's `tp`."""
        return {
            "ranks": self.rank.world,
            "backend": self.rank.backend,
            "split": self.split,
            "collectives": self.collectives,
            "timing": self.timing(),
            "rows": "tp.csv: a row per configuration and rank",
        }

    def engines(self, engines: Mapping[str, Engine]) -> dict[str, RankEngine]:
        """The sweep's engines, each run as this rank's part of the sweep."""
        return {name: RankEngine(e, self) for name, e in engines.items()}

    def in_step(self) -> None:
        """Wait until every rank is here (each rank's bookkeeping between runs takes its own time), so a run's
        clock starts with every rank ready."""
        import torch.distributed as dist

        synchronize(cast(torch.device, self.rank.device))
        dist.barrier()

    def clock(self) -> contextlib.AbstractContextManager[Clock]:
        raise NotImplementedError

    def slots(self, conf: Configuration, timing: RunTiming) -> int | None:
        raise NotImplementedError

    def planned(self, cache: str, slots: int) -> int | None:
        raise NotImplementedError

    def measure(self, conf: Configuration, ids: torch.Tensor, new_tokens: int, row: SummaryRow) -> list[RankRow] | None:
        """One more run of the configuration `conf` with the collectives timed; this rank's row beside `row` (its
        summary row); every rank's rows on rank 0, None on the others."""
        from kvbench.distributed import gather

        self.in_step()
        with self.clock() as clock:
            t = conf.run(ids, new_tokens)
        slots = self.slots(conf, t)
        planned = self.planned(row.cache, slots) if slots else None
        planned = None if planned is None else planned * row.batch
        measured = t.cache_bytes
        mine = RankRow(
            **{k: getattr(row, k) for k in FROM_SUMMARY},
            rank=self.rank.rank,
            ranks=self.rank.world,
            backend=self.rank.backend,
            device=str(self.rank.device),
            kv_slots=math.nan if slots is None else float(slots),
            kv_cache_bytes=math.nan if measured is None else float(measured),
            planned_kv_cache_bytes=math.nan if planned is None else float(planned),
            planned_equal=None if planned is None or measured is None else measured == planned,
            collective_ms=1e3 * clock.seconds,
            collective_calls=clock.calls,
            run_ms=1e3 * t.total_s,
            collective_share=clock.seconds / t.total_s if t.total_s > 0 else math.nan,
            timing=self.timing(),
        )
        return gather(mine)


class GPT2Ranks(Ranks):
    """Our GPT-2 split Megatron-style (model/tp.py): its row-parallel layers' all-reduces timed by COLLECTIVES."""

    split = "kvbench's GPT-2, Megatron-style (model/tp.py): each rank holds heads / ranks heads and their cache"
    collectives = (
        "the all-reduce after each row-parallel layer (two per layer per forward: model/tp.py COLLECTIVES), "
        "the device synchronised before and after each"
    )

    def __init__(self, rank: Rank, dtype: torch.dtype, config: GPTConfig) -> None:
        super().__init__(rank, dtype)
        self.config = config  # the whole model's GPTConfig: the planner splits its heads

    @contextlib.contextmanager
    def clock(self) -> Iterator[Clock]:
        from kvbench.model.tp import COLLECTIVES

        COLLECTIVES.seconds, COLLECTIVES.calls, COLLECTIVES.timing = 0.0, 0, True
        clock = Clock()
        try:
            yield clock
        finally:
            COLLECTIVES.timing = False
            clock.seconds, clock.calls = COLLECTIVES.seconds, COLLECTIVES.calls

    def slots(self, conf: Configuration, timing: RunTiming) -> int | None:
        caches = getattr(conf, "caches", None)
        if not caches:
            return None  # the no-cache path
        return caches[0].capacity or caches[0].length

    def planned(self, cache: str, slots: int) -> int | None:
        from kvbench.check.tp import planned_rank_bytes

        return planned_rank_bytes(self.config, cache, slots, self.rank.world, self.dtype)


# The functional collectives a DTensor's redistribution calls (torch.distributed.tensor): transformers' vocabulary-
# parallel embedding and gathered lm_head go through them; its row-parallel linear layers call all_reduce directly.
FUNCTIONAL = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor", "all_to_all_single")


class HFRanks(Ranks):
    """A Hugging Face model split by transformers' own plan (hf/tp.py): torch.distributed's collectives timed while
    the measuring run goes (each call, with its wait, between two device synchronisations)."""

    split = (
        "transformers' tensor-parallel plan (tp_plan='auto'): each rank holds KV heads / ranks heads and their cache"
    )
    collectives = (
        "every torch.distributed.all_reduce (transformers' row-parallel layers) and every functional collective "
        "a DTensor redistribution calls (vocabulary-parallel embedding, gathered lm_head), each waited for inside "
        "the timed span, the device synchronised before and after each"
    )

    def __init__(self, rank: Rank, dtype: torch.dtype, loaded: LoadedHF, layers: int | None) -> None:
        super().__init__(rank, dtype)
        self.loaded, self.layers = loaded, layers

    @contextlib.contextmanager
    def clock(self) -> Iterator[Clock]:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        clock = Clock()

        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                device = getattr(args[0], "device", None) if args else None
                if device is not None:
                    synchronize(device)
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                if hasattr(out, "wait"):  # an async work, or a functional collective's tensor: wait for it here
                    out.wait()
                if device is not None:
                    synchronize(device)
                clock.seconds += time.perf_counter() - t0
                clock.calls += 1
                return out

            return call

        patched = [(dist, "all_reduce")] + [(funcol, n) for n in FUNCTIONAL if hasattr(funcol, n)]
        saved = [(where, name, getattr(where, name)) for where, name in patched]
        for where, name, fn in saved:
            setattr(where, name, timed(fn))
        try:
            yield clock
        finally:
            for where, name, fn in saved:
                setattr(where, name, fn)

    def slots(self, conf: Configuration, timing: RunTiming) -> int | None:
        return timing.cache_slots

    def planned(self, cache: str, slots: int) -> int | None:
        """The planner's bytes for one rank (memory --model DIR --tp N --tp-engine transformers); None where it has
        no figure: a hub id, or --layers (the planner reads the whole config.json)."""
        from kvbench.check.tp import planned_hf_rank_bytes

        if self.layers is not None:
            return None
        return planned_hf_rank_bytes(self.loaded, slots, self.rank.world, self.dtype)


class RankEngine:
    """An engine as one rank of a tensor-parallel sweep: every run starts with every rank ready (Ranks.in_step), a
    configuration that raises ends the sweep (the other ranks are in its collectives), its rows have no floor (a
    rank's step is not one device's stream of the whole model), and each finished configuration sends this rank's
    row to rank 0 (Ranks.measure). Everything else is the engine's own."""

    has_floor = False
    failure_ends_sweep = True

    def __init__(self, engine: Engine, ranks: Ranks) -> None:
        self.engine, self.ranks = engine, ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def configure(self, cache: str, batch: int, max_len: int) -> InStep:
        return InStep(self.engine.configure(cache, batch, max_len), self.ranks)

    def rank_rows(self, conf: InStep, ids: torch.Tensor, new_tokens: int, row: SummaryRow) -> list[RankRow] | None:
        """After every timed run (the collectives' clock synchronises around each): every rank's row on rank 0."""
        return self.ranks.measure(conf.conf, ids, new_tokens, row)


class InStep:
    """A configuration whose every run starts when every rank is ready: its clock times the run alone."""

    def __init__(self, conf: Configuration, ranks: Ranks) -> None:
        self.conf, self.ranks = conf, ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conf, name)

    def run(self, ids: torch.Tensor, new_tokens: int, record_logits: bool = False) -> RunTiming:
        self.ranks.in_step()
        return self.conf.run(ids, new_tokens, record_logits=record_logits)
