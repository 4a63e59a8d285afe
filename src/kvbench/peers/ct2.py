"""CTranslate2 on kvbench's weights: converted once, cached on disk, run through its Generator.

The conversion is CTranslate2's own `TransformersConverter` over transformers' GPT2LMHeadModel holding our weights
(model/weights.to_hf_model). It needs no tokenizer files: CTranslate2 keys its vocabulary by token strings, and
kvbench hands it the ids as strings ("0" .. "50255", "<|endoftext|>" for 50256), so prompts and results are ids on
both sides and GPT-2's tokenizer stays kvbench's. The converted model is keyed by a hash of the weights and
CTranslate2's version, under $KVBENCH_CACHE_DIR (default ~/.cache/kvbench)/ct2/, written to a temporary folder and
renamed, so an interrupted conversion never leaves a half model to load. int8 is CTranslate2's quantisation at
load time (`compute_type="int8_float32"`) of the same float32 model.

Generation is greedy (`sampling_topk=1`), never stops at <|endoftext|> (`end_token=[]`, as kvbench's loop), and
`min_length` is never set (with it CTranslate2 returns the end token's logit as -FLT_MAX). Logits come back per
generated step (`return_logits_vocab`), the cached path's; `forward_batch` is its forward without a cache. Its prefix
cache is `static_prompt` with `cache_static_prompt=True`: the prefix's K/V kept by the generator between calls.
Times per step come from the generation callback, called as each step's token is chosen.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvbench.cachedir import CACHE_ENV, cache_root
from kvbench.errors import KVBenchError, one_line
from kvbench.peers import EXTRAS, PeerSpec
from kvbench.peers.common import EOT, Generation, token, weights_key

if TYPE_CHECKING:
    from kvbench.model.gpt2 import GPT


def require() -> Any:
    """The ctranslate2 module, imported on first use with its own OpenMP runtime (`_own_openmp`)."""
    try:
        with _own_openmp():
            import ctranslate2
    except ImportError:
        raise KVBenchError(f"CTranslate2 is not installed: pip install '{EXTRAS['ct2']}'") from None
    return ctranslate2


@contextmanager
def _own_openmp() -> Iterator[None]:
    """Around ctranslate2's first import: its library binds its own symbols first (RTLD_DEEPBIND), where the
    platform has the flag.

    CTranslate2's wheel ships its own libgomp, but a library resolves GOMP_parallel in the global scope first, and
    torch has put its libgomp there. So by default CTranslate2's worker thread runs its OpenMP team in torch's
    runtime, which then manages more threads than there are cores; from then on every runtime team in the process
    spins only briefly before sleeping, and each parallel region pays a wake-up. On a 2-core Intel Xeon VM
    (2026-12-06) one CTranslate2 generation made a 2-thread region of torch's cost ~80 us instead of ~6, and
    kvbench's and transformers' decode steps 15-25% slower for the rest of the process. Bound to its own libgomp,
    it leaves torch's runtime as it was (docs/peers.md)."""
    if "ctranslate2" in sys.modules or not hasattr(os, "RTLD_DEEPBIND"):
        yield
        return
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_DEEPBIND)
    try:
        yield
    finally:
        sys.setdlopenflags(flags)


class _IdVocabulary:
    """What CTranslate2's converter reads of a tokenizer: the ids as token strings, <|endoftext|> the special one."""

    bos_token = eos_token = unk_token = EOT

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {token(i, self.vocab_size): i for i in range(self.vocab_size)}


def converted(model: GPT) -> Path:
    """The CTranslate2 model of `model`'s weights (float32), converted now or found in the cache."""
    ct2 = require()
    out = cache_root() / "ct2" / ct2.__version__ / weights_key(model)
    if (out / "model.bin").is_file():
        return out
    try:
        return _convert(model, out)
    except OSError as e:
        raise KVBenchError(
            f"cannot write CTranslate2's converted model under {out.parent}: {e.strerror or e}; set "
            f"{CACHE_ENV} to a writable folder"
        ) from None


def _convert(model: GPT, out: Path) -> Path:
    from ctranslate2.converters import TransformersConverter

    from kvbench.memory.config import quiet_transformers
    from kvbench.model.weights import to_hf_model

    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight.device.type == "cpu", "peers' rules"
    hf = to_hf_model(model, "eager", share=True)  # read once by the converter: kvbench's own tensors, not a copy
    vocab = _IdVocabulary(model.config.vocab_size)

    class Converter(TransformersConverter):
        def load_model(self, model_class: Any, name: str, **kwargs: Any) -> Any:
            return hf

        def load_tokenizer(self, tokenizer_class: Any, name: str, **kwargs: Any) -> Any:
            return vocab

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp, quiet_transformers():
        hf.config.save_pretrained(tmp)  # the converter reads the config from the folder
        staged = Path(tmp) / "model"
        Converter(tmp).convert(str(staged), force=True)
        try:
            staged.rename(out)
        except OSError:  # another process converted the same weights meanwhile
            if not (out / "model.bin").is_file():
                raise
            shutil.rmtree(staged, ignore_errors=True)
    return out


class CT2Model:
    """One loaded CTranslate2 generator over `model`'s weights, in `peer.compute`, on `threads` CPU threads."""

    def __init__(self, model: GPT, peer: PeerSpec, threads: int) -> None:
        ct2 = require()
        w = model.lm_head.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise KVBenchError(
                f"{peer.name} runs kvbench's float32 weights on the CPU here: use --device cpu --dtype fp32"
            )
        self.vocab_size = model.config.vocab_size
        self.peer = peer
        self.path = converted(model)
        try:
            self.generator = self._load(ct2, threads)
        except RuntimeError:  # a cached model damaged since it was written: convert it again, once
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = converted(model)
            try:
                self.generator = self._load(ct2, threads)
            except RuntimeError as e:
                raise KVBenchError(f"CTranslate2 cannot load {self.path}: {one_line(e)}") from None

    def describe(self) -> str:
        return f"greedy generate_batch on {self.path}"

    def _load(self, ct2: Any, threads: int) -> Any:
        return ct2.Generator(
            str(self.path), device="cpu", compute_type=self.peer.compute, intra_threads=threads, inter_threads=1
        )

    def _tokens(self, ids: list[list[int]]) -> list[list[str]]:
        return [[token(i, self.vocab_size) for i in row] for row in ids]

    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        """Logits (B, T, V) of CTranslate2's forward without a cache (equal-length rows)."""
        out = self.generator.forward_batch(self._tokens(ids))
        return torch.from_numpy(np.array(out, copy=True)).float()

    def generate(
        self, prompts: list[list[int]], new_tokens: int, record_logits: bool = False, prefix: list[int] | None = None
    ) -> Generation:
        """Greedy generation of `new_tokens` after each prompt (after `prefix` + prompt, the prefix's K/V kept by the
        generator between calls, with `prefix`)."""
        marks: dict[int, float] = {}

        def mark(step: Any) -> bool:
            marks.setdefault(step.step, time.perf_counter())
            return False

        extra = {"static_prompt": self._tokens([prefix])[0], "cache_static_prompt": True} if prefix else {}
        # Prompts of different lengths: CTranslate2 forwards the shortest length at once and decodes the rest of each
        # longer prompt as forced steps. Where the shortest is one token (CTranslate2 4.8.5) those forced tokens come
        # back as generated ones and count against max_length, so the batch is asked for its prompts in the result:
        # each sequence is then its prompt and its tokens, its logits one per step after its first token.
        lengths = [len(p) for p in prompts]
        forced = len(set(lengths)) > 1 and min(lengths) == 1
        t0 = time.perf_counter()
        results = self.generator.generate_batch(
            self._tokens(prompts),
            max_length=new_tokens + (max(lengths) - 1 if forced else 0),
            sampling_topk=1,
            end_token=[],
            include_prompt_in_result=forced,
            return_logits_vocab=record_logits,
            callback=mark,
            **extra,
        )
        total = time.perf_counter() - t0
        # where each sequence's generated tokens start in its result, and its logits' steps
        starts = [(n, n - 1) if forced else (0, None) for n in lengths]
        tokens = [list(r.sequences_ids[0][t : t + new_tokens]) for r, (t, _) in zip(results, starts, strict=True)]
        logits = None
        if record_logits:
            # otherwise, a longer prompt's forced steps come first in its logits: the last N are the generated tokens'
            generated = [
                r.logits[0][-new_tokens:] if at is None else r.logits[0][at : at + new_tokens]
                for r, (_, at) in zip(results, starts, strict=True)
            ]
            logits = torch.stack(
                [torch.stack([torch.from_numpy(np.array(s, copy=True)) for s in rows]) for rows in generated]
            ).float()  # (B, N, V)
        times = [marks[k] for k in sorted(marks)][-new_tokens:]
        steps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return Generation(tokens, logits, (times[0] if times else t0 + total) - t0, steps, total)
