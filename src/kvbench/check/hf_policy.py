"""transformers' lossy caches held to their own policy at the exact tolerance (`verify --hf`).

A quantised cache is judged by `verify`'s loose rows against full precision, where a bug smaller than the
quantisation noise hides. Here the design runs beside a reference that keeps plain tensors and follows the design's
own schedule with the backend's own functions: transformers' QuantizedLayer holds the prefill quantised, appends
decode tokens to a full-precision residual, and when the residual reaches `residual_length` quantises everything it
returns (dequantised history, residual and the new tokens) into one block. The reference does exactly that with the
backend layer's `_quantize` and `_dequantize` (optimum-quanto's), so a correct cache matches it to the dtype's
tolerance, and what is left against full precision is the policy's own loss.

    logits   greedy run, step for step, design vs reference (until their tokens part)
    reorder  a batch of two prefilled, reorder_cache([1, 0]), one decode step: the reference reorders eagerly. It
             answers whether the installed transformers has the defect of its PR #48700 (reorder_cache leaving the
             quantised states in the old batch order), reproduced in plain transformers in docs/caches.md.

A failing row is located: the K and V each layer's `update` returned to attention at the step that went wrong
(logits: the run replayed up to its first step off), design against reference, name the first layer, K or V, row,
head and slot that differ, or say the K/V are the policy's and attention reads them otherwise.

Caches with no reference here (hqq, fp8) keep the loose rows only; the report's notes say so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvbench.check.hf_subject import HFSubject, cache_kwarg, generate_run
from kvbench.check.judge import CheckRow, Tolerance, allclose_err, first_diff, first_off, tolerance
from kvbench.check.probe import first_bad

if TYPE_CHECKING:
    from transformers.cache_utils import Cache, DynamicLayer

    from kvbench.hf.models import CausalLM

# a cache object's builder: the design's, or its policy reference
Build = Callable[[], "Cache"]


def make_layer(backend: Any) -> DynamicLayer:
    """One layer of what transformers' QuantizedLayer attends over, in plain tensors: the stored part (quantised and
    dequantised by `backend`, a QuantizedLayer used only for its functions) and the full-precision residual; a
    transformers DynamicLayer, built at first use so this module imports without transformers' cache classes."""
    from transformers.cache_utils import DynamicLayer

    class Layer(DynamicLayer):
        def __init__(self) -> None:
            super().__init__()
            self.backend = backend
            self.stored: tuple[torch.Tensor, torch.Tensor] | None = None  # dequantised history (B, H, S, Dh)
            self.seen = 0  # tokens written

        def _roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b = self.backend
            rt = lambda x, axis: b._dequantize(b._quantize(x.contiguous(), axis=axis))  # noqa: E731
            return rt(k, b.axis_key), rt(v, b.axis_value)

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = key_states, value_states
            self.seen += k.shape[-2]
            if self.stored is None:  # the prefill: stored quantised, attended at full precision
                self.lazy_initialization(k, v)
                self.stored = self._roundtrip(k, v)
                self.keys, self.values = k[..., :0, :], v[..., :0, :]
                return k, v
            assert self.keys is not None and self.values is not None, "set with stored"
            K = torch.cat([self.stored[0], self.keys, k], dim=-2)  # (B, H, S + R + T, Dh)
            V = torch.cat([self.stored[1], self.values, v], dim=-2)
            if self.keys.shape[-2] + k.shape[-2] >= self.backend.residual_length:  # flushed into one block
                self.stored = self._roundtrip(K, V)
                self.keys, self.values = k[..., :0, :], v[..., :0, :]
            else:
                self.keys, self.values = torch.cat([self.keys, k], dim=-2), torch.cat([self.values, v], dim=-2)
            return K, V

        def get_seq_length(self) -> int:
            return self.seen

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.seen + query_length, 0

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:  # eager: the reference holds plain tensors
            if self.stored is None:
                return
            k, v = self.stored
            idx = beam_idx.to(k.device)
            self.stored = (k.index_select(0, idx), v.index_select(0, idx))
            assert self.keys is not None and self.values is not None, "set with stored"
            self.keys, self.values = self.keys.index_select(0, idx), self.values.index_select(0, idx)

    return Layer()


def _quanto(model: CausalLM) -> tuple[Build, Build]:
    """(the design, its reference): transformers' QuantizedCache with the quanto backend at its defaults, and a
    Cache of schedule layers over a QuantoQuantizedLayer of the same defaults."""
    from transformers.cache_utils import Cache, QuantizedCache, QuantoQuantizedLayer

    from kvbench.hf.caches import text_config

    config = text_config(model)

    def design() -> Cache:
        return QuantizedCache(backend="quanto", config=config)

    def reference() -> Cache:
        return Cache(layers=[make_layer(QuantoQuantizedLayer()) for _ in range(config.num_hidden_layers)])

    return design, reference


# One registry: transformers' lossy caches that have a policy reference here.
POLICIES: dict[str, Callable[[CausalLM], tuple[Build, Build]]] = {"quantized-quanto": _quanto}


def hf_policy_rows(
    subjects: Sequence[HFSubject],
    prompts: list[list[int]],
    new: int,
    on_row: Callable[[CheckRow], None] | None = None,
) -> tuple[list[CheckRow], list[str]]:
    """The policy rows of every lossy cache in `subjects` (HFSubjects) that runs here, and a note for those with no
    reference. Each row is judged at the exact tolerance of the model's dtype."""
    rows: list[CheckRow] = []
    loose = []
    for s in subjects:
        if not s.tol.lossy or s.unavailable():
            continue
        if s.cache not in POLICIES:
            loose.append(s.cache)
            continue
        design, reference = POLICIES[s.cache](s.loaded.model)
        tol = tolerance(s.model.dtype)
        for check in (_logits, _reorder):
            try:
                row = check(s, design, reference, prompts, new, tol)
            except s.crashes as e:  # the backend refuses a shape, transformers raises: a row, not a traceback
                row = CheckRow(
                    name=check.__name__.strip("_"),
                    cache=s.cache,
                    passed=False,
                    tolerance=tol.words,
                    detail=f"the run raised {type(e).__name__}: {e}",
                )
            row.policy = True
            rows.append(row)
            if on_row is not None:
                on_row(row)
    note = (
        [f"{', '.join(loose)}: no policy reference (only quantized-quanto has one): judged by the loose rows only"]
        if loose
        else []
    )
    return rows, note


def _recorded(cache: Cache) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Wrap each layer's `update` of `cache` (a transformers Cache) so the K and V it last returned to attention are
    kept: one dict per layer, its "kv" (K, V), each (B, H, slots, Dh)."""
    kept: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in cache.layers]
    for layer, box in zip(cache.layers, kept, strict=True):

        def update(
            k: torch.Tensor,
            v: torch.Tensor,
            *args: Any,
            _update: Callable[..., tuple[torch.Tensor, torch.Tensor]] = layer.update,  # type: ignore[union-attr]
            _box: dict[str, tuple[torch.Tensor, torch.Tensor]] = box,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            K, V = _update(k, v, *args, **kwargs)
            _box["kv"] = (K, V)
            return K, V

        layer.update = update  # type: ignore[method-assign,union-attr]  # this object's own
    return kept


def _where(
    got: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
    want: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
    tol: Tolerance,
    when: str,
) -> str:
    """The first layer, K or V, row, head and slot whose value the design returned to attention otherwise than the
    reference did, after `when`; else the K/V are the policy's and attention reads them otherwise."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if "kv" not in g or "kv" not in w:
            continue
        for name, a, b in zip("KV", g["kv"], w["kv"], strict=True):
            if a.shape != b.shape:
                return (
                    f"{when}layer {i} returns {name} of shape {tuple(a.shape)} where the policy's is {tuple(b.shape)}"
                )
            for row in range(a.size(0)):
                bad = first_bad(a[row].float(), b[row].float(), tol.rtol, tol.atol)  # (H, slots, Dh)
                if bad is not None:
                    slot, head, err, _ = bad
                    return f"{when}layer {i} {name} differs first at row {row}, head {head}, slot {slot}: |delta| {err:.3g}"
    return f"{when}K/V equal to the policy's; attention reads them otherwise"


def _logits(
    s: HFSubject, design: Build, reference: Build, prompts: list[list[int]], new: int, tol: Tolerance
) -> CheckRow:
    got = generate_run(s.loaded, [prompts[0]], new, **{cache_kwarg(): design()})
    want = generate_run(s.loaded, [prompts[0]], new, **{cache_kwarg(): reference()})
    upto = first_diff(want.tokens[0], got.tokens[0])
    n = len(got.tokens[0]) if upto is None else upto + 1
    ok, err = allclose_err(got.logits[0, :n], want.logits[0, :n], tol.rtol, tol.atol)
    detail = f"{len(got.tokens[0])} greedy steps vs the policy's reference (its schedule, the backend's functions)"
    row = CheckRow(name="logits", cache=s.cache, passed=ok, max_abs_diff=err, tolerance=tol.words, detail=detail)
    if not ok:
        step = first_off(got.logits[0, :n], want.logits[0, :n], tol)
        row.detail += f"; first off at step {step}"
        assert step is not None, "logits off somewhere"
        caches = design(), reference()
        kept = [_recorded(c) for c in caches]
        for c in caches:  # replayed up to the step that went wrong: the K/V that step read
            generate_run(s.loaded, [prompts[0]], step + 1, **{cache_kwarg(): c})
        row.location = _where(kept[0], kept[1], tol, f"step {step}, ")
    elif upto is not None:
        row.detail += f"; tokens part at step {upto} (a near-tie: the logits agree up to it)"
    return row


@torch.inference_mode()
def _reorder(
    s: HFSubject, design: Build, reference: Build, prompts: list[list[int]], new: int, tol: Tolerance
) -> CheckRow:
    """Two prompts of one length prefilled (into the quantised states), reorder_cache([1, 0]), one decode step."""
    import transformers

    model = s.loaded.model
    device = next(model.parameters()).device
    T = min(len(prompts[0]), len(prompts[1]))
    ids = torch.tensor([prompts[0][:T], prompts[1][:T]], device=device)  # (2, T)
    swap = torch.tensor([1, 0], device=device)  # (2,) a LongTensor
    step = ids[:, -1:].index_select(0, swap)  # (2, 1): each row's own last token, in the new order
    logits, kept = [], []
    for make in (design, reference):
        cache = make()
        model(input_ids=ids, use_cache=True, **{cache_kwarg(): cache})
        kept.append(_recorded(cache))  # the decode step's K/V, after the reorder
        cache.reorder_cache(swap)  # type: ignore[arg-type]  # typed LongTensor, a tensor's dtype at run time
        pos = torch.full((2, 1), T, device=device)
        out = model(input_ids=step, use_cache=True, position_ids=pos, **{cache_kwarg(): cache})
        logits.append(out.logits[:, -1].float().cpu())  # (2, V)
    ok, err = allclose_err(logits[0], logits[1], tol.rtol, tol.atol)
    verdict = "absent" if ok else "present"
    detail = (
        f"2 prompts of {T} tokens prefilled, reorder_cache([1, 0]), one decode step vs the reference reordered "
        f"eagerly: transformers PR #48700's defect (quantised states left unreordered) is {verdict} in "
        f"transformers {transformers.__version__}"
    )
    row = CheckRow(name="reorder", cache=s.cache, passed=ok, max_abs_diff=err, tolerance=tol.words, detail=detail)
    if not ok:
        row.location = _where(kept[0], kept[1], tol, "the decode step after reorder_cache([1, 0]), ")
    return row
