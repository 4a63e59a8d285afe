"""Is a loaded model a causal decoder? Measured, not assumed from its family: the checks compare a cache against
recomputing the prefix, which means something only when a token's logits do not depend on later tokens.

    refuse_non_causal(loaded)   one forward over 12 seeded tokens and one over their first 6: the 6 shared
                                positions must agree (the logits tolerance of the model's dtype; 4x it in fp16 and
                                bf16); otherwise, or when the forward itself raises, one line (exit 2) naming what
                                was measured

Caught this way: encoders run as decoders without their decoder flag (transformers only warns), prefix LMs whose
every input token attends to every other (CPM-Ant), bidirectional permutation LMs (XLNet), and models that cannot
run on their own (a speculative-decoding drafter that needs its target's keys and values).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvbench.check.judge import allclose_err, tolerance
from kvbench.errors import KVBenchError, one_line
from kvbench.memory.config import quiet_transformers

if TYPE_CHECKING:
    from kvbench.hf.models import LoadedHF

PROBE_TOKENS, PREFIX = 12, 6
LOW_PRECISION_SLACK = 4
# A family whose causal-LM class runs as a decoder only with a config flag: the flag, for the refusal's hint.
DECODER_FLAGS = {"is_decoder": True, "causal": True, "attn_type": "uni"}


@torch.no_grad()
def refuse_non_causal(loaded: LoadedHF) -> None:
    """Raise KVBenchError unless the model's no-cache forward is prefix-consistent (see the module docstring)."""
    model, info = loaded.model, loaded.info
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    low = min(8, info.vocab_size - 1)  # clear of the special ids tiny configs put at 0..6
    ids = torch.randint(low, info.vocab_size, (1, PROBE_TOKENS), generator=gen).to(device)
    try:
        with quiet_transformers():
            full = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            part = model(input_ids=ids[:, :PREFIX], attention_mask=torch.ones_like(ids[:, :PREFIX]), use_cache=False)
    except Exception as e:  # transformers raises many types; any of them means the model cannot run alone
        what = str(e) if isinstance(e, KVBenchError) else f"its forward over {PROBE_TOKENS} tokens raised {one_line(e)}"
        raise KVBenchError(f"--hf {loaded.source}: {info.architecture} cannot run on its own: {what}") from None
    got, want = full[0, :PREFIX].float().cpu(), part.logits[0].float().cpu()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return  # nothing to judge here: every check then fails on the non-finite logits, saying so
    dtype = next(model.parameters()).dtype
    tol = tolerance(dtype)
    # fp16/bf16: kernels for 6 and 12 tokens round differently; a refusal there needs 4x the logits tolerance
    slack = 1 if dtype == torch.float32 else LOW_PRECISION_SLACK
    ok, err = allclose_err(got, want, slack * tol.rtol, slack * tol.atol)
    if ok:
        return
    bound = slack * (tol.atol + tol.rtol * want.abs().amax(-1))
    pos = int(((got - want).abs().amax(-1) > bound).nonzero()[0, 0])
    raise KVBenchError(
        f"--hf {loaded.source}: {info.model_type} is not a causal decoder here: the logits of its first {PREFIX} "
        f"tokens change by up to {err:.3g} (from position {pos}) when {PROBE_TOKENS - PREFIX} more tokens follow, so "
        f"they attend to later tokens and no cache can equal recomputation{_hint(model)}"
    )


def _hint(model: Any) -> str:
    """'; its config has is_decoder: false (set it to true to run the model as a decoder)' where a flag says so."""
    cfg = model.config
    off = [(k, v) for k, v in DECODER_FLAGS.items() if hasattr(cfg, k) and getattr(cfg, k) != v]
    if not off:
        return ""
    has = ", ".join(f"{k}: {_json(getattr(cfg, k))}" for k, _ in off)
    want = " or ".join(f"{k}: {_json(v)}" for k, v in off)
    return f"; its config has {has} ({want} runs it as a decoder)"


def _json(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, str) else str(v)
