"""GPT-2 exactly as OpenAI's, written from scratch, with explicit positions, a per-layer KV cache and a padding mask.

Learned absolute positions, pre-LayerNorm blocks, tanh-GELU, tied `lm_head`, 1024 context. Parameter names and
layouts are GPT-2's own (`wte`, `wpe`, `h`, `ln_1`, `attn.c_attn`, `c_proj`, `mlp.c_fc`, `ln_f`, `lm_head`; the four
projections as Conv1D, weights (in, out)), so a Hugging Face checkpoint ports with a plain copy (see `model/weights.py`).

Symbols used in shape comments:
    B batch, T tokens in this forward call, C embedding width, H heads, Dh head dim (C // H),
    S key/value slots attention reads this call (past + T for most caches), V vocabulary.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvbench.model import gemv
from kvbench.model.attention import attention
from kvbench.model.matmul import fused_row, linear, out_in_layout


@dataclass
class GPTConfig:
    block_size: int = 1024  # max context (number of learned position embeddings)
    vocab_size: int = 50257  # GPT-2 BPE vocabulary incl. <|endoftext|>
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads (GPT-2 is multi-head: every head has its own K and V)
    n_embd: int = 768  # residual width C
    layer_norm_epsilon: float = 1e-5  # as in GPT-2's config.json
    name: str = field(default="custom", compare=False)  # preset name or config path, for reports

    def __post_init__(self) -> None:
        assert self.n_embd % self.n_head == 0, f"n_embd {self.n_embd} not divisible by n_head {self.n_head}"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V for one token across all layers: 2 x layers x heads x head_dim x bytes."""
        return 2 * self.n_layer * self.n_head * self.head_dim * element_size


# One registry of model presets: CLI choices, benchmark sweeps and tests iterate this dict.
PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, name="gpt2"),  # 124M
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, name="gpt2-medium"),  # 355M
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280, name="gpt2-large"),  # 774M
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600, name="gpt2-xl"),  # 1.56B
    # Not a released checkpoint: a 2-layer toy with GPT-2's vocabulary, for fast tests and smoke runs.
    "gpt2-tiny": GPTConfig(n_layer=2, n_head=4, n_embd=128, name="gpt2-tiny"),
    # Not a released checkpoint: GPT-2 124M's widths with 65,536 learned positions, for timing decode at long
    # context (random weights only; `bench --fill random`).
    "gpt2-long": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=65536, name="gpt2-long"),
    # Not OpenAI's: a small GPT-2 trained on Shakespeare by scripts/train_tiny.py, shipped with kvbench
    # (kvbench/data/gpt2-shakespeare), so demos and `verify --text` read as language offline.
    "gpt2-shakespeare": GPTConfig(n_layer=6, n_head=4, n_embd=128, block_size=512, name="gpt2-shakespeare"),
}


class Conv1D(nn.Module):
    """GPT-2's own linear layer: y = x @ W + b with W stored (in, out), as in OpenAI's checkpoint and Hugging Face's
    port of it. How the product runs (oneDNN over the transposed view on the CPU, ATen's addmm elsewhere) is
    model/matmul.py's one rule."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))  # (in, out)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight.t(), self.bias)  # (..., in) -> (..., out)


class Head(nn.Linear):
    """lm_head: nn.Linear without a bias (weight (V, C), tied to wte), its product by model/matmul.py's rule."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)  # (..., C) -> (..., V)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        # the heads this module computes: all of them (a tensor-parallel shard holds a slice, model/tp.py)
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)  # fused Q, K, V
        self.c_proj: nn.Module = Conv1D(cfg.n_embd, cfg.n_embd)  # a RowParallel on a tensor-parallel shard

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache, mask: AttentionMask) -> torch.Tensor:
        return self.c_proj(self.attend(self.c_attn(x), positions, cache, mask))  # (B, T, C)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cache, mask: AttentionMask) -> torch.Tensor:
        """Attention from c_attn's output qkv (B, T, 3 * H * Dh), before c_proj -> (B, T, H * Dh)."""
        B, T, _ = qkv.shape
        H, Dh = self.n_head, self.head_dim
        q, k, v = qkv.split(H * Dh, dim=2)  # each (B, T, H * Dh)
        q, k, v = (t.view(B, T, H, Dh).transpose(1, 2) for t in (q, k, v))  # (B, H, T, Dh)
        if cache is not None:
            # The one line of cache code in attention: store this call's K/V, get back what to attend over.
            k, v = cache.update(k, v, positions)  # (B, H, S, Dh)
        attn_mask, is_causal = mask.for_keys(k.size(2), cache)  # as this layer's cache states its slots
        y = attention(q, k, v, attn_mask, is_causal)  # (B, H, T, Dh): SDPA, or kvbench's own (model/attention.py)
        return y.transpose(1, 2).contiguous().view(B, T, H * Dh)  # (B, T, H * Dh)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj: nn.Module = Conv1D(4 * cfg.n_embd, cfg.n_embd)  # a RowParallel on a tensor-parallel shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's tanh-GELU


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, cache, mask) -> torch.Tensor:
        if x.numel() == x.size(-1) and self._stock() and fused_row(x, *self._weights()):
            return self._fused(x, positions, cache, mask)
        x = x + self.attn(self.ln_1(x), positions, cache, mask)  # pre-LayerNorm residual blocks
        x = x + self.mlp(self.ln_2(x))
        return x

    def _fused(self, x, positions, cache, mask) -> torch.Tensor:
        """The same block for one row (B = T = 1) on the CPU, as two C calls around the cache's own update and
        attention (model/gemv.py): ln_1 and c_attn, then c_proj, the residual, ln_2, the MLP and its residual. The
        same sums, rounded alike to within a float's last bits; between two projections the Python in between runs
        with cold caches, so fewer calls make a faster step (docs/performance.md). Over static caches the whole
        step is one call instead (GPT._fused_step)."""
        attn = cast(CausalSelfAttention, self.attn)
        ln_1, ln_2 = (
            (self.ln_1.weight, self.ln_1.bias, self.ln_1.eps),
            (self.ln_2.weight, self.ln_2.bias, self.ln_2.eps),
        )
        qkv = gemv.ln_gemv(x, *ln_1, *_pair(attn.c_attn))  # (1, 1, 3C)
        a = attn.attend(qkv, positions, cache, mask)  # (1, 1, C)
        return gemv.block_tail(x, a, _pair(attn.c_proj), ln_2, *self._mlp_pairs())  # (1, 1, C)

    def _mlp_pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        mlp = cast(MLP, self.mlp)
        return _pair(mlp.c_fc), _pair(mlp.c_proj)

    def _step_layer(self) -> tuple[torch.Tensor, ...]:
        """This block's tensors for gemv.step_static, in STEP_LAYER's order but for the cache buffers K and V (the
        fifth and sixth)."""
        attn = cast(CausalSelfAttention, self.attn)
        fc, proj = self._mlp_pairs()
        ln_1, ln_2 = (self.ln_1.weight, self.ln_1.bias), (self.ln_2.weight, self.ln_2.bias)
        return (*ln_1, *_pair(attn.c_attn), *_pair(attn.c_proj), *ln_2, *fc, *proj)

    def _weights(self) -> tuple[torch.Tensor, ...]:
        """The (out, in) matrices the fused calls read (contiguous only where GPT.lay_out laid them out); asked only
        of a stock block."""
        attn, mlp = cast(CausalSelfAttention, self.attn), cast(MLP, self.mlp)
        return tuple(_pair(m)[0] for m in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj))

    def _stock(self) -> bool:
        """Is every part of the block the stock one, with no hooks: the fused calls stand for exactly these modules
        (a tensor-parallel shard's RowParallel, a subclass, a hook that reads c_attn's output keep the modules' own
        path)."""
        attn, mlp = self.attn, self.mlp
        parts = (
            (self.ln_1, nn.LayerNorm),
            (self.ln_2, nn.LayerNorm),
            (attn, CausalSelfAttention),
            (mlp, MLP),
            (getattr(attn, "c_attn", None), Conv1D),
            (getattr(attn, "c_proj", None), Conv1D),
            (getattr(mlp, "c_fc", None), Conv1D),
            (getattr(mlp, "c_proj", None), Conv1D),
        )
        return _no_global_hooks() and all(type(m) is t and not _hooked(m) for m, t in parts)


def _in_place(cache, mask: AttentionMask) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(k, v, slot) where a one-row step may write this layer's K/V into the cache's buffers itself and read every
    slot up to it (`LayerCache.in_place_slot`: the stock static cache, batch 1, float32), with no mask to apply
    (no padding, the exact rule); else None."""
    ask = getattr(cache, "in_place_slot", None)  # a cache is anything with update (a step's slot writer, a plugin)
    got = ask() if ask is not None else None
    if got is None:
        return None
    k, v, slot = got
    ok = k.size(0) == 1 and k.dtype == v.dtype == torch.float32 and k.device.type == v.device.type == "cpu"
    ok = ok and k.is_contiguous() and v.is_contiguous()
    return got if ok and mask.for_keys(slot + 1, cache) == (None, False) else None


def _pair(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A Conv1D's (weight as (out, in), bias)."""
    conv = cast(Conv1D, m)
    return conv.weight.t(), conv.bias


def _hooked(m: nn.Module | None) -> bool:
    return m is None or bool(m._forward_hooks or m._forward_pre_hooks)


def _no_global_hooks() -> bool:
    from torch.nn.modules import module

    return not (module._global_forward_hooks or module._global_forward_pre_hooks)


class _StepPlan:
    """What GPT._fused_step checks of the modules before the whole-step C call, found once and kept while it holds:
    the same modules (none replaced, added, removed or hooked), the same parameters, each in the same storage, shape,
    strides and dtype, and the same LayerNorm eps. Each decode step asks, so `holds` compares in C loops (map over
    attribute getters, lists compared whole) rather than walking the modules in Python: on gpt2, 0.21 ms warm against
    0.27 for the walk, and ~0.6 ms either way right after a step has streamed its matrices through the caches (the
    objects it reads are no longer in them; 2-core AMD EPYC, 2026-12-08). The caches, the row and the route are
    checked every step."""

    def __init__(self, model: GPT, layers: list[tuple[torch.Tensor, ...]], heads: tuple[int, int]) -> None:
        ln_f = model.transformer.ln_f
        self.parts = _parts(model)
        self.params = _params(self.parts)
        self.children = [dict(d) for d in _children(model, self.parts)]  # copies: what each module had below it
        self.owned = _owned(self.parts)
        self.layout = _layouts(self.params)
        self.norms = [m for m in self.parts if type(m) is nn.LayerNorm]
        self.eps = ln_f.eps
        self.layers = layers  # each block's STEP_LAYER tensors but K and V
        self.heads = heads  # (H, Dh) of each layer's cache buffers
        self.ln_f, self.head = (ln_f.weight, ln_f.bias), model.lm_head.weight
        # step_static's table with zeros for K and V: the weights' addresses stay while the plan holds (their storage)
        self.table: list[int] = []
        for layer in layers:
            self.table += [t.data_ptr() for t in layer[:4]] + [0, 0] + [t.data_ptr() for t in layer[4:]]
        self.kv: list[int] = []  # the K and V addresses of the last table made
        self.made: torch.Tensor | None = None

    @classmethod
    def of(cls, model: GPT, x: torch.Tensor) -> _StepPlan | None:
        """The plan for `model`, or None where its modules cannot run as one call."""
        blocks = list(model.transformer.h)
        if not (model._fused_head(x) and all(type(b) is Block and not _hooked(b) and b._stock() for b in blocks)):
            return None
        if not all(fused_row(x, *cast(Block, b)._weights()) for b in blocks):
            return None
        attn = cast(CausalSelfAttention, cast(Block, blocks[0]).attn)
        plan = cls(model, [cast(Block, b)._step_layer() for b in blocks], (attn.n_head, attn.head_dim))
        return plan if all(m.eps == plan.eps for m in plan.norms) else None  # the C step takes one eps

    def holds(self, model: GPT) -> bool:
        parts = self.parts
        return (
            _children(model, parts) == self.children  # so `parts` are still every module below the model
            and not any(map(_FORWARD_HOOKS, parts))
            and not any(map(_FORWARD_PRE_HOOKS, parts))
            and _no_global_hooks()
            and _owned(parts) == self.owned  # so `params` are still every parameter, by name
            and _layouts(self.params) == self.layout
            and list(map(_EPS, self.norms)) == [self.eps] * len(self.norms)
        )

    def table_for(self, kv: list[int]) -> torch.Tensor:
        """step_static's table with each layer's K and V at `kv` (K0, V0, K1, V1, ...): the last one made where the
        buffers are the same (every step of a generation)."""
        if kv != self.kv or self.made is None:
            table = list(self.table)
            table[4 :: gemv.STEP_WIDTH], table[5 :: gemv.STEP_WIDTH] = kv[0::2], kv[1::2]
            self.kv, self.made = kv, torch.tensor(table, dtype=torch.int64)
        return self.made

    def wants_gradient(self) -> bool:
        """Is a gradient wanted of any parameter (asked each step: requires_grad changes no layout)?"""
        return torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, self.params))


_SUBMODULES, _PARAMETERS = operator.attrgetter("_modules"), operator.attrgetter("_parameters")
_FORWARD_HOOKS, _FORWARD_PRE_HOOKS = operator.attrgetter("_forward_hooks"), operator.attrgetter("_forward_pre_hooks")
_EPS, _REQUIRES_GRAD = operator.attrgetter("eps"), operator.attrgetter("requires_grad")
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")


def _parts(model: GPT) -> tuple[nn.Module, ...]:
    """Every module below the model, depth first (not the model itself: a plan that held it would keep it alive in a
    cycle). model.modules() walks the same tree, building each one's dotted name on the way."""
    parts: list[nn.Module] = []
    todo = [m for m in reversed(model._modules.values()) if m is not None]
    while todo:
        m = todo.pop()
        parts.append(m)
        todo.extend(c for c in reversed(m._modules.values()) if c is not None)
    return tuple(parts)


def _params(parts: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(p for m in parts for p in m._parameters.values() if p is not None)


def _children(model: GPT, parts: tuple[nn.Module, ...]) -> list[dict]:
    """Each module's submodules by name (its own dict), the model's first: a list equal to the copies of an earlier
    one means the same tree below the model (a dict of modules compares its values by identity)."""
    return list(map(_SUBMODULES, (model, *parts)))


def _owned(parts: tuple[nn.Module, ...]) -> tuple[list, list[int]]:
    """Every part's parameter names, and the identity of what each holds (None included), in order."""
    own = list(map(_PARAMETERS, parts))
    return list(chain.from_iterable(own)), list(map(id, chain.from_iterable(map(dict.values, own))))


def _layouts(params: tuple[torch.Tensor, ...]) -> tuple[list, list, list]:
    """Each parameter's address, strides, and (shape, dtype)."""
    return (
        list(map(torch.Tensor.data_ptr, params)),
        list(map(torch.Tensor.stride, params)),
        list(map(_SHAPE_DTYPE, params)),
    )


class MaskRule:
    """What SDPA is given for T queries over S key slots, from the mask the forward call built: the correct rule
    passes it through. A different rule (`kvbench break mask`) is passed in by the caller; the model holds none."""

    def adjust(
        self, T: int, S: int, attn_mask: torch.Tensor | None, is_causal: bool
    ) -> tuple[torch.Tensor | None, bool]:
        return attn_mask, is_causal


EXACT_MASK = MaskRule()

# A layer cache's visibility (caches/base.py LayerCache.visible): which key positions each query position may still
# read, (q_pos (B, T), k_pos (B, S)) -> (B, T, S) bool on top of the causal rule. A cache without one (None) is read
# by the causal rule alone.
Visible = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class AttentionMask:
    """Which key slots each query of this forward call may read, built once per call and shared by all layers.

    One rule: a slot is read when it comes at or before the query (causal), holds a real token, and its position is
    visible to the query's by the layer cache's own policy (`cache.visible`, None for a cache that reads every
    token it keeps); a query that may read nothing reads its own slot (never an empty row: such rows are padding's and are
    never sampled from). Where a slot sits is its column (queries are the last T of `n_valid` filled columns, aligned
    bottom-right, and column c of a row holds position c, its padding-counted position when padded by `padding`
    (B, n_valid)); a cache that evicts says which position each slot holds instead (`key_positions`, (B, S), -1 for
    an unused slot), and then slots and queries are placed by position. Columns >= n_valid (a fixed-size buffer's
    unfilled tail) are never read.
    The degenerate case is SDPA's own: no padding, every slot filled, no policy and no eviction gives no mask at all
    (prefill T == S: the causal flag; a decode step T == 1: every cached key is in the past).
    """

    def __init__(
        self,
        T: int,
        n_valid: int,
        padding: torch.Tensor | None,
        rule: MaskRule = EXACT_MASK,
        positions: torch.Tensor | None = None,
    ):
        self.T, self.n_valid, self.padding, self.rule = T, n_valid, padding, rule
        self.positions = positions  # this call's queries (B, T)
        self._built: dict[int, tuple[torch.Tensor | None, bool]] = {}

    def for_keys(self, S: int, cache=None) -> tuple[torch.Tensor | None, bool]:
        """(attn_mask, is_causal) for SDPA over S key slots, as `cache` (this layer's, or None) states its slots. Every
        layer's cache is of one design, so a mask over columns is built once per S and shared."""
        key_positions = getattr(cache, "key_positions", None)
        if key_positions is not None:  # an evicting cache's slots: its own, layer by layer
            assert self.padding is None, "an evicting cache takes no left padding"
            mask, _ = self._allowed(S, key_positions, cache)
            return self.rule.adjust(self.T, S, mask, False)
        assert S >= self.n_valid, f"attention got {S} key slots but {self.n_valid} are filled"
        if S not in self._built:
            self._built[S] = self._allowed(S, None, cache)
        return self.rule.adjust(self.T, S, *self._built[S])

    def _allowed(self, S: int, key_positions: torch.Tensor | None, cache) -> tuple[torch.Tensor | None, bool]:
        policy: Visible | None = getattr(cache, "visible", None)  # None: the cache reads by the causal rule alone
        filled = key_positions is None and self.padding is None and S == self.n_valid
        if policy is None and filled and self.T in (1, S):  # the degenerate case: SDPA's own causal rule, no mask
            return None, self.T > 1
        q_at, k_at, real, k_pos = self._places(S, key_positions)
        seen = None
        if policy is not None:
            assert self.positions is not None, "a cache's visibility needs the queries' positions"
            seen = policy(self.positions, k_pos)  # (B, T, S)
        allowed = (k_at[:, None, :] <= q_at[:, :, None]) & real[:, None, :]  # (B, T, S) causal, real tokens
        if seen is not None:
            allowed = allowed & seen
        own = k_at[:, None, :] == q_at[:, :, None]  # (B, T, S) the query's own slot
        allowed = allowed | (~allowed.any(-1, keepdim=True) & own)
        return allowed[:, None], False  # (B, 1, T, S)

    def _places(self, S: int, key_positions: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """(q_at (B, T), k_at (B, S), real (B, S), k_pos (B, S)): where each query and slot sits for the causal rule,
        which slots hold real tokens, and the positions the cache's policy is asked about (B may be 1)."""
        if key_positions is not None:
            assert self.positions is not None, "an evicting cache needs the queries' positions"
            return self.positions, key_positions, key_positions >= 0, key_positions
        device = self.padding.device if self.padding is not None else None
        cols = torch.arange(S, device=device)[None]  # (1, S)
        q_cols = self.n_valid - self.T + torch.arange(self.T, device=device)[None]  # (1, T)
        if self.padding is None:
            k_pos = cols if self.positions is None else cols.expand(self.positions.size(0), S)  # (B, S)
            return q_cols, cols, torch.ones_like(cols, dtype=torch.bool), k_pos
        pad = F.pad(self.padding, (0, max(S - self.padding.size(1), 0)))  # (B, S)
        k_pos = (pad.cumsum(-1) - 1)[:, :S]  # (B, S) padding-counted positions
        return q_cols, cols, pad.bool(), k_pos


class Transformer(nn.ModuleDict):
    """GPT's `transformer`: a ModuleDict (its parameters keep GPT-2's names), with its members' types declared."""

    wte: nn.Embedding
    wpe: nn.Embedding
    h: nn.ModuleList
    ln_f: nn.LayerNorm


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = Transformer(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
            )
        )
        self.lm_head = Head(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        # the shape one layer's cache holds (make_caches): the model's own; a tensor-parallel shard's holds its heads
        self.cache_config = cfg

    def init_weights(self, seed: int = 0, std: float = 0.02) -> GPT:
        """GPT-2 initialisation: N(0, std) weights, zero biases, unit LayerNorms; residual projections scaled by
        1/sqrt(2 * n_layer). Seeded, drawn in fp32 by a generator on the parameters' own device (no host round trip:
        gpt2-xl's 1.6B values take seconds on a GPU, half a minute on one CPU thread), then rounded to the
        parameters' dtype. A seed gives the same weights on every CPU and on every CUDA device, but CPU and CUDA
        generators draw different numbers."""
        device = self.lm_head.weight.device
        g = torch.Generator(device=device).manual_seed(seed)
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln_" in name or name.startswith("transformer.ln_f"):
                    p.fill_(1.0)
                else:
                    s = resid_std if name.endswith("c_proj.weight") else std
                    p.copy_(torch.randn(p.shape, generator=g, device=device) * s)
        return self

    def _apply(self, fn, recurse=True):
        """Under .to(), .half(), .cuda() and the like: the whole-step call's kept checks hold views of the old
        parameters, so they go with them (else a model moved off the CPU would keep its CPU weights alive)."""
        self._step_plan = None
        return super()._apply(fn, recurse)

    def lay_out(self) -> GPT:
        """Store every Conv1D weight in the memory layout its device's kernels stream fastest (model/matmul.py): on
        the CPU (out, in), the parameter a transposed view of it; elsewhere (in, out). Same shapes, same values."""
        w = self.lm_head.weight
        out_in = out_in_layout(w.device, w.dtype)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, Conv1D) and m.weight.t().is_contiguous() != out_in:
                    m.weight.data = m.weight.data.t().contiguous().t() if out_in else m.weight.data.contiguous()
        return self

    @classmethod
    def empty(cls, cfg: GPTConfig, device: torch.device | str, dtype: torch.dtype) -> GPT:
        """A GPT with uninitialised parameters allocated directly on `device` in `dtype`: built on the meta device
        (no default init, no host copy), then given storage. Fill it with `init_weights` or a checkpoint."""
        with torch.device("meta"):
            net = cls(cfg)
        net = net.to(dtype=dtype).to_empty(device=device)
        net.lm_head.weight = net.transformer.wte.weight  # to_empty gives each module its own tensor: tie again
        return net

    def forward(
        self,
        idx: torch.Tensor,
        positions: torch.Tensor,
        caches: list | None = None,
        padding_mask: torch.Tensor | None = None,
        last_only: bool = False,
        mask_rule: MaskRule = EXACT_MASK,
    ) -> torch.Tensor:
        """Logits for every input token.

        idx: (B, T) token ids; positions: (B, T) absolute positions, owned by the caller (never guessed here from a
        length: that guess is the classic position bug); caches: one cache object per layer, or None to attend only within
        `idx` (the no-cache path); padding_mask: (B, past + T), 1 for real tokens and 0 for padding, over every
        column the caches hold plus this call's. Returns (B, T, V), or (B, 1, V) for the last token with
        `last_only` (what generation samples from: it skips the vocabulary projection of every other position).
        mask_rule: what attention hands SDPA from the mask built here (MaskRule; the exact one by default). Which
        slots a query may read beyond the causal rule is each layer cache's to say (`AttentionMask`).
        """
        B, T = idx.shape
        assert positions.shape == (B, T), f"positions {tuple(positions.shape)} must match idx {(B, T)}"
        past = caches[0].length if caches is not None else 0
        if padding_mask is not None:
            assert padding_mask.shape == (B, past + T), f"padding_mask {tuple(padding_mask.shape)} != {(B, past + T)}"
        mask = AttentionMask(T, past + T, padding_mask, mask_rule, positions)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)  # (B, T, C)
        if caches is not None and x.numel() == x.size(-1):
            logits = self._fused_step(x, caches, mask)
            if logits is not None:
                return logits  # (1, 1, V)
        for i, block in enumerate(self.transformer.h):
            x = block(x, positions, None if caches is None else caches[i], mask)
        if last_only:
            x = x[:, -1:]  # (B, 1, C): LayerNorm is per row
        ln_f = self.transformer.ln_f
        if self._fused_head(x):
            return gemv.ln_gemv(x, ln_f.weight, ln_f.bias, ln_f.eps, self.lm_head.weight, None)  # (1, 1, V)
        return self.lm_head(ln_f(x))  # (B, T, V) or (B, 1, V)

    def _fused_step(self, x: torch.Tensor, caches: list, mask: AttentionMask) -> torch.Tensor | None:
        """The whole one-row step as one C call (gemv.step_static), where every block is the stock one without hooks
        (and so are ln_f and lm_head), every LayerNorm has one eps, and every layer's cache is the stock static
        one writing at the same slot with no mask to apply (`_in_place`); each cache then counts the token. None
        elsewhere: the blocks run one by one. What it checks of the modules is kept (`_StepPlan`) while they hold."""
        slots = [_in_place(c, mask) for c in caches]  # first: other caches say None at once, before the blocks' checks
        if any(s is None for s in slots) or len({s[2] for s in slots if s}) != 1:
            return None
        if not fused_row(x):  # first: the row, the route, and never inside torch.compile's tracing
            return None
        plan = getattr(self, "_step_plan", None)
        if plan is None or not plan.holds(self):
            plan = self._step_plan = _StepPlan.of(self, x)
        if plan is None or plan.wants_gradient():
            return None
        # the C code trusts these: each layer's buffers (1, H, L, Dh) for this model's heads, one L, the slot in it
        shapes = {(tuple(s[0].shape), tuple(s[1].shape)) for s in slots if s}
        (k_shape, v_shape), slot = next(iter(shapes)), cast(tuple, slots[0])[2]
        if len(shapes) != 1 or k_shape != v_shape or len(k_shape) != 4 or not 0 <= slot < k_shape[2]:
            return None
        if (k_shape[1], k_shape[3]) != plan.heads or len(slots) != len(plan.layers):
            return None
        kv = [t.data_ptr() for s in slots if s for t in s[:2]]
        layers = [(*w[:4], s[0], s[1], *w[4:]) for w, s in zip(plan.layers, slots, strict=True) if s]
        logits = gemv.step_static(x, layers, slot, plan.eps, plan.ln_f, plan.head, table=plan.table_for(kv))
        for c in caches:
            c.wrote_in_place(slot + 1)
        return logits

    def _fused_head(self, x: torch.Tensor) -> bool:
        """ln_f and lm_head as one C call (model/gemv.py) for one row on the CPU, where both are the stock
        modules without hooks."""
        ln_f, head = self.transformer.ln_f, self.lm_head
        return (
            x.numel() == x.size(-1)
            and fused_row(x, head.weight)
            and type(ln_f) is nn.LayerNorm
            and type(head) is Head
            and head.bias is None
            and not (_hooked(ln_f) or _hooked(head))
            and _no_global_hooks()
        )
