"""The fixed-shape decode step: one function over device buffers, optionally compiled and captured as a CUDA graph.

Why: at batch 1 a GPT-2 decode step is a few hundred tiny kernels, and on a fast GPU the CPU launching them takes
longer than the GPU running them. A CUDA graph records the launches once and replays them with one call. A graph
replays the exact kernels on the exact addresses it recorded, so the step must not change shape or allocate:

    everything that changes per token lives in device buffers the step reads:
        tokens (B, 1) and positions (B, 1)   copied in before each step
        column (1,)                           the cache slot this step writes = tokens cached so far
        padding (B, L)                        which columns are real tokens (all True without left padding)
    attention reads the WHOLE (B, H, L, Dh) buffer, L = max_len, under a mask computed on the device:
        allowed[b, s] = (s <= column) & padding[b, s]        (B, 1, 1, L)
    K/V are written with index_copy_ at `column` (a device index, no Python int baked in), so one compiled function
    and one graph serve every step.

A design opts in with `CacheSpec.fixed_step` (static-graph: its `StaticGraphCache` buffers). On CUDA the step is
warmed up on a side stream, captured once per cache set (batch size and max_len fixed by the allocation), and
replayed per token; the runner records how long warm-up + capture took (`capture_s`), and is rebuilt, never
replayed, once the model's parameters have new storage (`model.to(...)`) or the mask rule changes. Elsewhere the
same step runs eagerly, so CI tests its exactness on the CPU. `compile` (the `--compile` option) runs it through
`torch.compile` (inside the graph on CUDA):
    off       the eager step
    default   Inductor's default: LayerNorm, bias, GELU and residual adds fused, matrix products left to the BLAS;
    max       CPU only: the weights frozen into the compiled step as constants; a projection of one float32 row
              kvbench's GEMV as an opaque operator, any other matrix product autotuned between Inductor's C++ GEMM
              templates and ATen's (those reach Inductor as oneDNN linear ops over packed constants;
              model/matmul.py); one-query attention kvbench's C as an opaque operator (model/attention.py); and
              the kernels called from generated C++. Frozen weights are a copy the
              step no longer reads from the model, so this runner also keys on the parameters' version counters:
              an in-place change (`copy_`, `load_state_dict`) gets a new compilation.

The prefill (T > 1) runs the ordinary eager forward and writes the same buffers.
"""

from __future__ import annotations

import time
import types
import weakref
from collections.abc import Callable

import torch

from kvbench.caches.static_graph import StaticGraphCache
from kvbench.model.attention import own_attention
from kvbench.model.gpt2 import EXACT_MASK, GPT, MaskRule
from kvbench.model.matmul import frozen_weights

COMPILE_MODES = ("off", "default", "max")  # the --compile choices

# Inductor settings of the `max` mode (CPU): weights as constants, GEMMs autotuned over C++ templates and ATen, the
# ~150 kernels of a step called from generated C++ rather than Python (less overhead per kernel than the Python
# wrapper), and the autotuning tables kept off the terminal. Inductor's FX graph cache stays off here: it keys a frozen
# graph on the weights' shapes, and the weights its C++ GEMM templates pack into constants of their own are stored in
# the cache entry by value, so a second model of the same shapes (other weights, another process) was served the
# first one's packed weights and decoded wrong tokens (torch 2.13, oneDNN linears; tests/test_fast_caches.py).
MAX_OPTIONS = {
    "freezing": True,
    "fx_graph_cache": False,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "cpp_wrapper": True,
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}
WARMUP_STEPS = 3  # eager runs on a side stream before capture (lazy inits, cuBLAS handles, compilation)


class _SlotWriter:
    """Stands in for one layer's cache inside the fixed-shape step: writes K/V at the device index `column`.

    Holds the cache's tensors, not the cache, so a cache -> runner -> tensors chain has no reference cycle.
    """

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, column: torch.Tensor) -> None:
        self.k, self.v, self.column = k_buf, v_buf, column  # (B, H, L, Dh), (B, H, L, Dh), (1,)

    def update(self, k, v, positions):
        self.k.index_copy_(2, self.column, k)  # k: (B, H, 1, Dh) into column `column`
        self.v.index_copy_(2, self.column, v)
        return self.k, self.v  # (B, H, L, Dh)


class _DeviceMask:
    """The `AttentionMask` interface over a mask tensor computed on the device: nothing per-step in Python."""

    def __init__(self, allowed: torch.Tensor, rule: MaskRule) -> None:
        self.allowed, self.rule = allowed, rule  # (B, 1, 1, L) bool

    def for_keys(self, S: int, cache=None) -> tuple[torch.Tensor | None, bool]:
        assert S == self.allowed.size(-1), f"fixed-shape step got {S} key slots, buffer has {self.allowed.size(-1)}"
        assert getattr(cache, "key_positions", None) is None, "the fixed-shape step's buffers are columns: no eviction"
        assert getattr(cache, "visible", None) is None, "the fixed-shape step's caches read by the causal rule alone"
        return self.rule.adjust(1, S, self.allowed, False)


def fixed_decode_step(
    model: GPT,
    slots: list[_SlotWriter],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    column: torch.Tensor,
    padding: torch.Tensor,
    cols: torch.Tensor,
    mask_rule: MaskRule,
) -> torch.Tensor:
    """One decode step over fixed-size buffers; every input is a device tensor. Returns logits (B, 1, V).

    tokens, positions: (B, 1); column: (1,) slot to write; padding: (B, L) bool; cols: arange(L); mask_rule: what
    attention hands SDPA (model.MaskRule). A module-level function (not a method) so `torch.compile` guards on
    tensor shapes, not on a runner's identity.
    """
    allowed = (cols[None, :] <= column) & padding  # (B, L): filled columns that hold real tokens
    mask = _DeviceMask(allowed[:, None, None, :], mask_rule)  # (B, 1, 1, L)
    tr = model.transformer
    x = tr.wte(tokens) + tr.wpe(positions)  # (B, 1, C)
    for block, slot in zip(tr.h, slots, strict=True):
        x = block(x, positions, slot, mask)
    return model.lm_head(tr.ln_f(x))  # (B, 1, V)


_compiled_step = None
_frozen_step: tuple | None = None  # (weakref to the model, its frozen key, the step compiled for it)


def _compiled(mode: str, model: GPT, key: tuple) -> Callable[..., torch.Tensor]:
    """The compiled step. "default" is shared by every runner (its graph reads the weights as inputs). "max" is
    compiled from a fresh copy of the function for each model and weights version: its weights are constants, and
    Dynamo keeps compiled code per code object, so one shared by two models would serve the first one's weights.
    Runners of the same model and weights share it (other cache shapes add compilations to it, as for "default").
    Its Inductor settings are applied around each call (compilation happens inside the first one):
    `torch.compile(options=...)` does not apply freezing."""
    global _compiled_step, _frozen_step
    if mode == "max":
        if _frozen_step is not None and _frozen_step[0]() is model and _frozen_step[1] == key:
            return _frozen_step[2]
        # here, not at the top: Inductor takes seconds to import, and only --compile max uses its settings
        from torch._inductor import config as inductor_config

        # Dynamo's guards on the model's modules cost ~0.5 ms a call; this step is already keyed on everything of
        # the model it reads (identity, parameter storage and versions), so only tensor guards stay. That holds for
        # one graph only: where the step breaks into several (a plugin's code Dynamo cannot trace), the code after a
        # break inside a block is one resume function for every block, and without module guards the graph compiled
        # for the first block (its weights frozen in) would serve them all. So the step is traced whole, and a step
        # that cannot be is compiled again with every guard (correct, and slower by its breaks and guards).
        def compile_step(whole: bool) -> Callable[..., torch.Tensor]:
            """A new copy of the step compiled: traced whole with tensor guards only, or in pieces with every guard.
            A copy of its own, as Dynamo keeps compiled code (and counts recompilations) per code object."""
            f = fixed_decode_step
            fresh = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
            skip: dict[str, str | int | bool | Callable[..., object]] = {
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe
            }
            return torch.compile(fresh, dynamic=False, fullgraph=whole, options=skip if whole else None)

        compiled = compile_step(whole=True)

        def step(*args):
            nonlocal compiled
            with inductor_config.patch(MAX_OPTIONS), frozen_weights(), own_attention():
                try:
                    return compiled(*args)
                # both raised before anything of the step runs
                except torch._dynamo.exc.FailOnRecompileLimitHit:  # a ninth shape: Dynamo counts per code object
                    compiled = compile_step(whole=True)
                except torch._dynamo.exc.Unsupported:  # a step Dynamo cannot trace whole
                    compiled = compile_step(whole=False)
                return compiled(*args)

        _frozen_step = (weakref.ref(model), key, step)
        return step
    if _compiled_step is None:
        _compiled_step = torch.compile(fixed_decode_step, dynamic=False)
    return _compiled_step


def _model_key(model: GPT, mask_rule: MaskRule, frozen: bool = False) -> tuple:
    """What a captured graph depends on besides its buffers: the mask rule it was built with, and the storage of
    every parameter. A graph replays reads of the exact addresses it recorded, so after
    `model.to(...)` (new tensors; the old ones freed) it must be rebuilt, never replayed. Weights changed in place
    (`copy_`, `load_state_dict`) keep their storage, and the graph reads the new values; a step that froze the
    weights (`frozen`) holds copies, so there every parameter's version counter is part of the key too, and so is
    every module's plain setting (a LayerNorm's eps, `training`): that step skips Dynamo's guards on modules. A write
    through `.data` bumps no version counter, and a frozen step does not see it."""
    storage = tuple(
        (p.data_ptr(), p.dtype, p.device, tuple(p.shape), p._version if frozen else 0)
        for p in (*model.parameters(), *model.buffers())
    )
    settings = tuple(
        (type(m), tuple((k, v) for k, v in vars(m).items() if isinstance(v, (bool, int, float, str))))
        for m in model.modules()
        if frozen
    )
    return id(mask_rule), storage, settings


class FixedShapeDecoder:
    """Runs generation's forward calls over `StaticGraphCache` buffers: eager prefill, fixed-shape decode steps.

    Call it like the model: `runner(ids, positions, caches, padding) -> logits (B, T, V)`. With T == 1 it copies the
    inputs into its device buffers and replays the CUDA graph (capturing it on the first decode step), or runs the
    same step eagerly where there is no graph. It advances the caches' `length` itself (the graph cannot).
    """

    def __init__(
        self,
        model: GPT,
        caches: list,
        graph: bool | None = None,
        compile: str = "off",
        mask_rule: MaskRule = EXACT_MASK,
    ) -> None:
        # a StaticGraphCache per layer, or a plugin's behind its contract (caches/plugins.py CheckedCache)
        assert caches and all(isinstance(getattr(c, "inner", c), StaticGraphCache) for c in caches), caches
        B, H, L, Dh = caches[0].k.shape
        device = caches[0].k.device
        self.model = model
        self.mask_rule = mask_rule
        self.capacity = L
        self.use_graph = device.type == "cuda" if graph is None else graph
        assert not self.use_graph or device.type == "cuda", f"CUDA graphs need a CUDA device, caches on {device}"
        # the caller's promise (decode.rules.compile_mode): a known mode, max on the CPU only
        assert compile in COMPILE_MODES and (compile != "max" or device.type == "cpu"), (compile, device.type)
        self.compile_mode = compile
        self.compile = compile != "off"
        self.key = _model_key(model, mask_rule, frozen=compile == "max")
        self._step = _compiled(compile, model, self.key) if self.compile else fixed_decode_step
        # The device buffers the step (and the graph) reads. Their addresses never change.
        self.tokens = torch.zeros(B, 1, dtype=torch.long, device=device)  # (B, 1)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=device)  # (B, 1)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # (1,)
        self.padding = torch.ones(B, L, dtype=torch.bool, device=device)  # (B, L)
        self.cols = torch.arange(L, device=device)  # (L,)
        self.slots = [_SlotWriter(c.k, c.v, self.column) for c in caches]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # the graph's static output (B, 1, V)
        self.captures = 0  # graphs captured (1 on CUDA after the first decode step)
        # seconds spent warming up and capturing (device synchronised), over all captures
        self.capture_s = 0.0
        self.fixed_steps = 0  # decode steps run through the fixed-shape step (replays or eager)

    def matches(self, model: GPT, caches: list, mask_rule: MaskRule = EXACT_MASK, compile: str = "off") -> bool:
        """Built for this model with its current parameter storage, this mask rule and compile mode, and these cache
        buffers."""
        return (
            model is self.model
            and mask_rule is self.mask_rule
            and compile == self.compile_mode
            and self.key == _model_key(model, mask_rule, frozen=self.compile_mode == "max")
            and self._holds(caches)
        )

    def _holds(self, caches: list) -> bool:
        return len(caches) == len(self.slots) and all(
            c.k is s.k and c.v is s.v for c, s in zip(caches, self.slots, strict=True)
        )

    def _run(self) -> torch.Tensor:
        args = (self.tokens, self.positions, self.column, self.padding, self.cols, self.mask_rule)
        return self._step(self.model, self.slots, *args)

    def _capture(self) -> None:
        """The torch.cuda.CUDAGraph recipe: warm up on a side stream, then record one step into a graph.

        The warm-up steps run for real with the current inputs: they write this step's K/V into `column`, the
        same values the replay that follows writes again, so the cache is unchanged by them.
        """
        device = self.tokens.device
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._run()  # recorded, not run; its storage is the graph's static output
        self.graph = graph
        self.captures += 1
        torch.cuda.synchronize(device)
        self.capture_s += time.perf_counter() - t0

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list,
        padding: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        # prefill: the ordinary eager forward; once per generation, so check everything here
        if ids.size(1) != 1:
            assert self.matches(self.model, caches, self.mask_rule, self.compile_mode), (
                "fixed-shape runner is stale (model parameters moved, or other caches); get one from runner_for"
            )
            return self.model(ids, positions, caches, padding, last_only, mask_rule=self.mask_rule)
        assert self._holds(caches), "runner called with caches it was not built for"
        # n: tokens cached so far = the column this step writes
        n, _ = caches[0].check_capacity(1, "static-graph")
        self.tokens.copy_(ids)
        self.positions.copy_(positions)
        self.column.fill_(n)
        if padding is None:
            self.padding.fill_(True)
        else:
            assert padding.shape == (ids.size(0), n + 1), f"padding {tuple(padding.shape)} != {(ids.size(0), n + 1)}"
            self.padding[:, : n + 1].copy_(padding.bool())
        if self.use_graph:
            if self.graph is None:
                self._capture()
            assert self.graph is not None, "_capture records the graph"
            self.graph.replay()
            assert self.out is not None, "the graph's static output, recorded with it"
            logits = self.out.clone()  # the static output is overwritten by the next replay
        else:
            logits = self._run()
        for c in caches:
            c.length = n + 1
        self.fixed_steps += 1
        return logits


def runner_for(model: GPT, caches: list, mask_rule: MaskRule = EXACT_MASK, compile: str = "off") -> FixedShapeDecoder:
    """The runner for these `StaticGraphCache` buffers: reused while the model, its parameter storage, the mask
    rule, the compile mode and the buffers match (one capture per cache set); rebuilt (and re-captured) otherwise."""
    runner = caches[0].runner
    if runner is None or not runner.matches(model, caches, mask_rule, compile):
        runner = FixedShapeDecoder(model, caches, compile=compile, mask_rule=mask_rule)
        caches[0].runner = runner
    return runner
