"""`kvbench verify --hf`: the exactness checks on any Hugging Face causal LM, through transformers' own caches.

The reference is transformers' own no-cache path on the same model object: `generate(use_cache=False)` for greedy
tokens, and one forward with `use_cache=False` over a whole prefix for single steps. Every cached run goes through
`generate` exactly as a user calls it, with the cache selected by name (HF_CACHES). Four checks per cache:
    logits       the first cached decode step against one full forward over the same prefix (fp32: 1e-5 relative
                 to the row's largest logit, as for our own caches)
    greedy       N tokens through generate with the cache against generate with use_cache=False
    batched      prompts of different lengths, left-padded with an attention mask and decoded together, against
                 each prompt decoded alone through the same cache
    cache_state  one cache object: a prompt, reset(), a second prompt, against a fresh cache for the second prompt
The rows, tolerances, near-tie rule and report are those of `check/verify.py` (CheckRow, VerifyReport). A cache that
cannot run here (offloading without CUDA, a quantization backend that is not installed, a quantized cache on a
model with sliding-window layers) is one row marked skipped, with the reason.

Lossy caches (quantized) are held to a bound on every step's logits against the no-cache forward over the same
tokens (teacher-forced, so one early flip does not turn the rest into noise): |diff| <= rtol x the row's largest
logit + atol. The token agreement with the no-cache tokens is reported beside it, not judged: on random weights
the top two logits are often close, and any rounding flips them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbench.check.verify import (
    CACHED,
    NO_CACHE,
    SHORT_TOKENS,
    TOLERANCES,
    CheckRow,
    VerifyReport,
    _allclose_err,
    not_finite,
    token_verdict,
)
from kvbench.errors import KVBenchError, one_line
from kvbench.hf.models import LoadedHF, cache_kwarg, check_length, quiet_transformers, returned_cache

CHECKS = ("logits", "greedy", "batched", "cache_state")


# --- the caches transformers offers --------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFCache:
    name: str
    summary: str  # what transformers builds, in one line
    generate_kwargs: dict  # what selects it in generate
    build: Callable | None = None  # (model, max_len) -> a Cache object, for cache_state; None: no cache
    lossy: tuple[float, float] | None = None  # (rtol, atol) of the logit bound; None: exact
    unavailable: Callable | None = None  # (loaded, device) -> why it cannot run here, or None
    default_on_cpu: bool = True  # False: only when named in --caches on the CPU (too slow to run by default)


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def _dynamic(model, max_len, offloading=False):
    from transformers import DynamicCache

    return DynamicCache(config=_text_config(model), offloading=offloading)


def _static(model, max_len, offloading=False):
    from transformers import StaticCache

    return StaticCache(config=_text_config(model), max_cache_len=max_len, offloading=offloading)


def _compile_config():
    from transformers import CompileConfig

    cfg = CompileConfig()
    # generate compiles on CUDA by default; this lets it compile on the CPU too
    cfg._compile_all_devices = True
    return cfg


def _needs_cuda(loaded, device) -> str | None:
    if device.type != "cuda":
        return "needs CUDA (offloading moves each layer's cache between the GPU and the CPU)"
    return None


def _quantized(backend: str) -> HFCache:
    def build(model, max_len):
        from transformers import QuantizedCache

        return QuantizedCache(backend=backend, config=_text_config(model))

    def unavailable(loaded, device) -> str | None:
        import importlib.util

        import transformers
        from transformers import cache_utils

        if loaded.info.windowed:
            return "QuantizedCache holds full-attention layers only; this model has sliding-window layers"
        if loaded.info.recurrent:
            return "QuantizedCache holds full-attention layers only; this model has recurrent layers"
        if backend == "fp8" and not hasattr(cache_utils, "Fp8QuantizedLayer"):
            return (
                f"transformers {transformers.__version__} has no fp8 cache backend (later versions have it)"
            )
        packages = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
        module, pip = packages.get(backend, (None, None))
        try:
            missing = module is not None and importlib.util.find_spec(module) is None
        except ModuleNotFoundError:  # the parent package (optimum) is absent
            missing = True
        if missing:
            return f"its backend is not installed: pip install {pip}"
        return None

    # Sanity bounds, not quality measures: a wrong position, a stale or a missing token moves logits by about the
    # row's scale, far beyond these. Measured worst steps on random Llama, Qwen2 and GPT-2 models (2-4 layers,
    # width 128, 40 new tokens), init std 0.02 / 0.05 / 0.1: fp8 (e4m3, one scale per tensor) 2.7% / 19.5% / 18.1%
    # of the row scale; quanto and hqq (4 bits, transformers' defaults) 5.9% / 13.9% / 56.7%.
    rtol = 0.3 if backend == "fp8" else 0.6
    return HFCache(
        f"quantized-{backend}",
        f"QuantizedCache, {backend} backend (transformers' defaults)",
        {"cache_implementation": "quantized", "cache_config": {"backend": backend}},
        build,
        lossy=(rtol, 0.1),
        unavailable=unavailable,
    )


# One registry of transformers' caches: --caches choices, the default run and test parametrisation iterate it.
HF_CACHES: dict[str, HFCache] = {
    c.name: c
    for c in (
        HFCache(
            "none",
            "use_cache=False: the whole sequence every step (batched check only)",
            {"use_cache": False},
        ),
        HFCache(
            "dynamic",
            "DynamicCache (torch.cat growth; sliding-window layers where the model has them)",
            {"cache_implementation": "dynamic"},
            _dynamic,
        ),
        HFCache(
            "static",
            "StaticCache, eager (preallocated; sliding-window layers where the model has them)",
            {"cache_implementation": "static", "disable_compile": True},
            _static,
        ),
        HFCache(
            "static-compiled",
            "StaticCache with generate's torch.compile of the decode step",
            {"cache_implementation": "static", "compile_config": None},  # made per run (_generate_kwargs)
            _static,
            default_on_cpu=False,
        ),
        HFCache(
            "offloaded",
            "DynamicCache with offloading (each layer's cache kept on the CPU between uses)",
            {"cache_implementation": "offloaded"},
            lambda m, n: _dynamic(m, n, offloading=True),
            unavailable=_needs_cuda,
        ),
        HFCache(
            "offloaded_static",
            "StaticCache with offloading",
            {"cache_implementation": "offloaded_static", "disable_compile": True},
            lambda m, n: _static(m, n, offloading=True),
            unavailable=_needs_cuda,
        ),
        _quantized("quanto"),
        _quantized("hqq"),
        _quantized("fp8"),
    )
}


def parse_hf_cache_names(text: str | None, device: torch.device) -> list[str]:
    """--caches for --hf: comma-separated names from HF_CACHES, or all / None for the default set (every cache,
    but static-compiled only on CUDA unless named)."""
    if text is None or text.strip() == "all":
        return [n for n, c in HF_CACHES.items() if device.type == "cuda" or c.default_on_cpu]
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in HF_CACHES]
    if bad or not names:
        raise KVBenchError(
            f"unknown cache {', '.join(map(repr, bad)) or repr(text)} for --hf; caches: {', '.join(HF_CACHES)}"
        )
    return list(dict.fromkeys(names))


def _generate_kwargs(cache: HFCache) -> dict:
    kw = dict(cache.generate_kwargs)
    if "compile_config" in kw:
        kw["compile_config"] = _compile_config()
    if "cache_config" in kw:
        kw["cache_config"] = dict(kw["cache_config"])
    return kw


# --- runs ----------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    tokens: list[list[int]]  # (B, N) generated ids
    logits: torch.Tensor  # (B, N, V) fp32 on the CPU: the raw logits each token was chosen from
    cache_layers: list[str] = field(default_factory=list)  # class names of the cache's layers


@torch.no_grad()  # as generate itself runs: a cache it returns can be reset() and reused by the caller
def generate_run(loaded: LoadedHF, prompts: list[list[int]], new: int, **kwargs) -> Run:
    """Greedy `generate` of exactly `new` tokens for `prompts`, left-padded with an attention mask."""
    model = loaded.model
    device = next(model.parameters()).device
    T = max(map(len, prompts))
    ids = torch.tensor([[loaded.pad_token_id] * (T - len(p)) + p for p in prompts], device=device)  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=device)  # (B, T)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        num_beams=1,
        pad_token_id=loaded.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    logits = torch.stack([step.float().cpu() for step in out.logits], dim=1)  # (B, N, V)
    assert logits.shape[1] == new, f"generate returned {logits.shape[1]} logit steps, expected {new}"
    cache = returned_cache(out)
    layers = [type(x).__name__ for x in getattr(cache, "layers", [])] if cache is not None else []
    return Run(out.sequences[:, T:].tolist(), logits, layers)


@torch.no_grad()
def full_logits(loaded: LoadedHF, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """One no-cache forward over prompt + tokens[:-1]: (T + N - 1, V) fp32 on the CPU; row T-1+i predicts step i."""
    model = loaded.model
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)  # (1, T + N - 1)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float().cpu()


# --- comparisons ---------------------------------------------------------------------------------------------------
def _tol(cache: HFCache, dtype: torch.dtype) -> tuple[float, float, str]:
    rtol, atol = TOLERANCES[dtype]
    if cache.lossy is not None:
        rtol, atol = max(rtol, cache.lossy[0]), max(atol, cache.lossy[1])
        return rtol, atol, f"lossy: atol {atol:g} + rtol {rtol:g} x row scale"
    return rtol, atol, f"rtol {rtol:g}, atol {atol:g}"


def compare_tokens(
    name: str, cache: str, dtype: torch.dtype, want: list[int], got: list[int], want_rows: torch.Tensor,
    got_rows: torch.Tensor, what: str, want_where: str = NO_CACHE, got_where: str = CACHED,
) -> CheckRow:  # fmt: skip
    """Exact: `got` tokens identical to `want`; in fp16/bf16 a flip at a near-tie (top-2 gap <= 2 x the logit error
    at that step) is reported and passes. Rows (N, V) are the logits each token was chosen from."""
    broken = not_finite([(want_where, want_rows), (got_where, got_rows)])
    if broken:
        return CheckRow(
            name, cache, False, None, None, "finite logits", f"{what}{'; ' if what else ''}{broken}"
        )
    n = min(len(want), len(got))
    first = next((i for i in range(n) if want[i] != got[i]), None)
    upto = n if first is None else first + 1  # inputs are identical up to and including the divergent step
    err = float((want_rows[:upto] - got_rows[:upto]).abs().max())
    return token_verdict(name, cache, dtype, want, got, want_rows, got_rows, first, err, n, what)


def _bounded(
    name: str, cache: HFCache, dtype: torch.dtype, got_rows: torch.Tensor, ref_rows: torch.Tensor, what: str
) -> tuple[CheckRow, float]:
    """A lossy cache: every step's logits within its bound of the no-cache forward over the same tokens.
    Returns the row and the worst step's error as a fraction of that step's largest logit."""
    rtol, atol, tol = _tol(cache, dtype)
    broken = not_finite([(NO_CACHE, ref_rows), (CACHED, got_rows)])
    if broken:
        return CheckRow(
            name, cache.name, False, None, None, tol, f"{what}{'; ' if what else ''}{broken}"
        ), 0.0
    ok, err = _allclose_err(got_rows, ref_rows, rtol, atol)
    rel = float(((got_rows - ref_rows).abs().amax(-1) / ref_rows.abs().amax(-1)).max())
    row = CheckRow(name, cache.name, ok, err, None, tol, f"{what}; worst step {rel:.1%} of its row scale")
    return row, rel


# --- the checks ----------------------------------------------------------------------------------------------------
def check_logits(loaded: LoadedHF, cache: HFCache, dtype, prompt: list[int], res: Run) -> CheckRow:
    """Decode step 1 of `res` against one no-cache forward over exactly prompt + token 0."""
    rtol, atol, tol = _tol(cache, dtype)
    ref = full_logits(loaded, prompt, res.tokens[0][:2])[-1]  # prompt + token 0 -> predicts token 1
    broken = not_finite([(NO_CACHE, ref), (CACHED, res.logits[0, 1])])
    if broken:
        return CheckRow("logits", cache.name, False, None, None, tol, broken)
    ok, err = _allclose_err(res.logits[0, 1], ref, rtol, atol)
    rel = err / float(ref.abs().max())
    return CheckRow(
        "logits", cache.name, ok, err, None, tol,
        f"step 1 vs a no-cache forward of {len(prompt) + 1} tokens; {rel:.1e} of the row scale",
    )  # fmt: skip


def check_greedy(loaded: LoadedHF, cache: HFCache, dtype, prompt: list[int], res: Run, ref: Run) -> CheckRow:
    n = len(res.tokens[0])
    if cache.lossy is None:
        return compare_tokens(
            "greedy", cache.name, dtype, ref.tokens[0], res.tokens[0], ref.logits[0], res.logits[0],
            f"{n} tokens vs generate(use_cache=False)",
        )  # fmt: skip
    T = len(prompt)
    forced = full_logits(loaded, prompt, res.tokens[0])[T - 1 :]  # (N, V): no cache, on its own tokens
    agree = sum(a == b for a, b in zip(ref.tokens[0], res.tokens[0], strict=True))
    return _bounded(
        "greedy", cache, dtype, res.logits[0], forced,
        f"{n} steps vs no cache on the same tokens; {agree} of {n} tokens as generate(use_cache=False)",
    )[0]  # fmt: skip


def check_batched(
    loaded: LoadedHF, cache: HFCache, dtype, prompts: list[list[int]], batch: Run, solo: list[Run]
) -> CheckRow:
    """Each row of the left-padded batch against the same prompt alone (exact), or, for a lossy cache (whose
    quantisation scales may span the batch), against the no-cache forward of that prompt alone on the batch's
    tokens."""
    lens = [len(p) for p in prompts]
    n = len(batch.tokens[0])
    what = f"lengths {', '.join(map(str, lens))} left-padded vs alone, {n} tokens"
    runs = [("the padded batch", batch.logits)]
    runs += (
        []
        if cache.lossy is not None
        else [
            (f"the prompt of length {length} alone", s.logits) for length, s in zip(lens, solo, strict=True)
        ]
    )
    broken = not_finite(runs)
    if broken:
        model_itself = ": the model itself is not finite (check its weights)" if cache.build is None else ""
        return CheckRow(
            "batched", cache.name, False, None, None, "finite logits", f"{what}; {broken}{model_itself}"
        )
    if cache.lossy is not None:
        rows = [
            _bounded(
                "batched",
                cache,
                dtype,
                batch.logits[b],
                full_logits(loaded, p, batch.tokens[b])[len(p) - 1 :],
                "",
            )  # fmt: skip
            for b, p in enumerate(prompts)
        ]
        unjudged = next(
            (r for r, _ in rows if r.max_abs_diff is None), None
        )  # a reference that is not finite
        if unjudged is not None:
            return CheckRow(
                "batched", cache.name, False, None, None, unjudged.tolerance, what + unjudged.detail
            )
        bad = [lens[b] for b, (r, _) in enumerate(rows) if not r.passed]
        what = what.replace("vs alone", "vs no cache alone on the same tokens")
        what += f"; beyond the bound for length {', '.join(map(str, bad))}" if bad else ""
        what += f"; worst step {max(rel for _, rel in rows):.1%} of its row scale"
        err = max(r.max_abs_diff for r, _ in rows)
        return CheckRow("batched", cache.name, not bad, err, None, rows[0][0].tolerance, what)
    rows = [
        compare_tokens(
            "batched", cache.name, dtype, s.tokens[0], batch.tokens[b], s.logits[0], batch.logits[b], ""
        )
        for b, s in enumerate(solo)
    ]
    bad = [b for b, r in enumerate(rows) if not r.passed]
    firsts = [r.first_divergence for r in rows if r.first_divergence is not None]
    if bad:
        what += "; differs for length " + ", ".join(
            f"{lens[b]} (from step {rows[b].first_divergence})" for b in bad
        )
        if 0 not in bad:  # the longest prompt has no padding
            what += "; only padded rows differ: suspect position ids or the padding mask"
    else:
        what += "".join(f"; length {lens[b]}{r.detail}" for b, r in enumerate(rows) if "near-tie" in r.detail)
    return CheckRow(
        "batched", cache.name, not bad, max(r.max_abs_diff for r in rows), min(firsts) if firsts else None,
        rows[0].tolerance, what,
    )  # fmt: skip


def check_cache_state(
    loaded: LoadedHF, cache: HFCache, dtype, prev: list[int], prompt: list[int], fresh: Run, new: int
) -> CheckRow:
    """One cache object through `prev`, reset(), then `prompt`, against a fresh cache for `prompt`: identical."""
    obj = cache.build(loaded.model, max(len(prev), len(prompt)) + new)
    kw = {cache_kwarg(): obj}
    if "compile_config" in cache.generate_kwargs:
        kw["compile_config"] = _compile_config()
    else:
        kw["disable_compile"] = True
    generate_run(loaded, [prev], new, **kw)
    obj.reset()
    reused = generate_run(loaded, [prompt], new, **kw)
    return compare_tokens(
        "cache_state", cache.name, dtype, fresh.tokens[0], reused.tokens[0], fresh.logits[0], reused.logits[0],
        f"a {type(obj).__name__} reset() and reused vs fresh, {new} tokens", "a fresh cache", "the reused cache",
    )  # fmt: skip


# --- the runner ----------------------------------------------------------------------------------------------------
def _guarded(cache: str, names: list[str], fn: Callable[[], list[CheckRow]]) -> list[CheckRow]:
    """A run that raises is a failed check, reported with the exception, never a traceback."""
    try:
        return fn()
    except Exception as e:  # transformers raises many types (ValueError, RuntimeError, IndexError, ...)
        why = f"the run raised {one_line(e)}"
        return [CheckRow(n, cache, False, None, None, "runs without error", why) for n in names]


def _skipped(cache: str, why: str) -> CheckRow:
    return CheckRow("-", cache, True, None, None, "skipped", why, skipped=True)


def run_hf_verify(
    loaded: LoadedHF,
    caches: list[str],
    prompts: list[list[int]],
    new_tokens: int = 100,
    checks: tuple[str, ...] = CHECKS,
    short_tokens: int = SHORT_TOKENS,
    on_row: Callable[[CheckRow], None] | None = None,
) -> VerifyReport:
    """Run `checks` for every cache in `caches` (names in HF_CACHES) on `prompts` (prompts[0] is the single-prompt
    checks' prompt; all of them form the batch; prompts[1] is cache_state's second prompt)."""
    if new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (the logits check needs a decode step), got {new_tokens}"
        )
    lens = [len(p) for p in prompts]
    if len(prompts) < 2 or len(set(lens)) < 2:
        raise KVBenchError(f"the batched check needs >= 2 prompts of different lengths, got lengths {lens}")
    unknown = [c for c in caches if c not in HF_CACHES]
    assert not unknown, f"unknown caches {unknown}"
    check_length(
        loaded.info, max(lens) + new_tokens, f"longest prompt {max(lens)} + new tokens {new_tokens}",
        "lower --prompt-len or --new-tokens",
    )  # fmt: skip
    with quiet_transformers():
        return _run(loaded, caches, prompts, new_tokens, checks, short_tokens, on_row)


def _run(loaded, caches, prompts, new_tokens, checks, short_tokens, on_row) -> VerifyReport:
    from kvbench.devices import dtype_name

    model = loaded.model
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    prompt, short = prompts[0], min(short_tokens, new_tokens)
    lens = [len(p) for p in prompts]
    rows: list[CheckRow] = []
    layers_seen: dict[str, list[str]] = {}

    def add(row: CheckRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    reference: dict[tuple, Run] = {}

    def nocache(p: list[int], n: int) -> Run:
        key = (tuple(p), n)
        if key not in reference:
            reference[key] = generate_run(loaded, [p], n, use_cache=False)
        return reference[key]

    no_kv = (
        f"{loaded.info.model_type} keeps a recurrent state, no KV cache"
        if not loaded.info.kv_layers
        else None
    )
    for name in caches:
        cache = HF_CACHES[name]
        why = no_kv or (cache.unavailable(loaded, device) if cache.unavailable else None)
        if why:
            add(_skipped(name, why))
            continue
        cached = cache.build is not None
        single = [c for c in ("logits", "greedy") if cached and c in checks]
        multi = [c for c in ("batched", "cache_state") if c in checks and (cached or c == "batched")]

        def single_rows(cache=cache) -> list[CheckRow]:
            res = generate_run(loaded, [prompt], new_tokens, **_generate_kwargs(cache))
            layers_seen.setdefault(cache.name, res.cache_layers)
            out = []
            if "logits" in checks:
                out.append(check_logits(loaded, cache, dtype, prompt, res))
            if "greedy" in checks:
                out.append(check_greedy(loaded, cache, dtype, prompt, res, nocache(prompt, new_tokens)))
            return out

        solo: dict[int, Run] = {}

        def alone(i: int, cache=cache, solo=solo) -> Run:
            if i not in solo:
                solo[i] = generate_run(loaded, [prompts[i]], short, **_generate_kwargs(cache))
            return solo[i]

        def batched_rows(cache=cache, alone=alone) -> list[CheckRow]:
            batch = generate_run(loaded, prompts, short, **_generate_kwargs(cache))
            return [
                check_batched(loaded, cache, dtype, prompts, batch, [alone(i) for i in range(len(prompts))])
            ]

        def cache_state_rows(cache=cache, alone=alone) -> list[CheckRow]:
            return [check_cache_state(loaded, cache, dtype, prompts[0], prompts[1], alone(1), short)]

        for names, fn in (
            (single, single_rows),
            ([c for c in multi if c == "batched"], batched_rows),
            ([c for c in multi if c == "cache_state"], cache_state_rows),
        ):
            if names:
                for row in _guarded(name, names, fn):
                    add(row)

    info = loaded.info
    notes = [
        f"{len(prompts)} seeded prompts of lengths {', '.join(map(str, lens))}; logits and greedy use the first "
        f"with {new_tokens} new tokens; batched and cache_state use {short} new tokens",
        "reference: transformers' own no-cache path on the same model (generate and forward with use_cache=False)",
        f"model: {info.architecture}, {_model_layers(info)}, {info.attn_implementation} attention, "
        f"{info.positions_summary()}, transformers {info.transformers_version}",
    ]
    if layers_seen:
        notes.append(
            "cache layers built: " + "; ".join(f"{n}: {_count(ls)}" for n, ls in layers_seen.items() if ls)
        )
    if info.windowed:
        windows = sorted({t for t in info.layer_types if t != "full"})
        notes.append(
            f"sliding-window layers ({', '.join(windows)}): transformers builds them inside DynamicCache and "
            "StaticCache (its older sliding_window and hybrid cache names are aliases of these); prompt + new "
            f"tokens ({max(lens) + new_tokens}) {'exceed' if max(lens) + new_tokens > _window(info) else 'fit in'} "
            "the window"
        )
    if dtype != torch.float32:
        notes.append(
            "low precision: cached and recomputed paths round differently, so a token may flip at a near-tie; "
            "such a flip (top-2 gap <= 2 x logit error at that step) is reported, not failed"
        )
    notes.extend(loaded.notes)
    judged = [r for r in rows if not r.skipped]
    return VerifyReport(
        passed=all(r.passed for r in judged),
        checks=rows,
        dtype=dtype_name(dtype),
        new_tokens=new_tokens,
        prompt_len=len(prompt),
        batch_lens=lens,
        reference="transformers no-cache path (use_cache=False)",
        notes=notes,
    )


def _model_layers(info) -> str:
    """'2 full attention layers, 4 heads (2 key/value)'; a model with recurrent layers says so, and how many of its
    layers cache K/V (none: it has no KV cache, so the cache checks do not apply)."""
    heads = f"{info.n_heads} heads ({info.n_kv_heads} key/value)"
    if not info.recurrent:
        return f"{info.layers_summary()} attention layers, {heads}"
    if not info.kv_layers:
        return (
            f"{info.layers_summary()} layers: no attention, so no KV cache (a fixed-size state per sequence)"
        )
    return f"layers {info.layers_summary()}: {info.kv_layers} of {info.n_layers} cache K/V, {heads}"


def _count(names: list[str]) -> str:
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{n} x{c}" for n, c in counts.items())


def _window(info) -> int:
    sizes = [int(t[len("sliding(") : -1]) for t in info.layer_types if t.startswith("sliding(")]
    return min(sizes) if sizes else 0
