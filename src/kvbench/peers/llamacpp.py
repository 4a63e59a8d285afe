"""llama.cpp on kvbench's weights (through llama-cpp-python): written as a GGUF once, cached on disk, run token by token.

The GGUF is written here with llama.cpp's own `gguf` package, tensor for tensor as llama.cpp's converter writes a
GPT-2 (`convert_hf_to_gguf.py`, class GPT2Model): architecture `gpt2`, the four Conv1D matrices transposed to
(out, in), lm_head left out (llama.cpp ties it to token_embd when `output` is absent, as GPT-2 does). In a float16
GGUF the matrices and embeddings are float16 and the norms and biases float32, as the converter writes them. No
tokenizer files are needed: the vocabulary is the ids as token strings (CTranslate2's peer does the same), so
prompts and results are ids on both sides and GPT-2's tokenizer stays kvbench's. The file is keyed by a hash of the
weights, its type and gguf's version, under $KVBENCH_CACHE_DIR (default ~/.cache/kvbench)/llamacpp/, written to a
temporary name and renamed, so an interrupted conversion never leaves half a model.

Generation is llama-cpp-python's `Llama.eval` over kvbench's ids: the prompt in one batch, then one token a call,
each chosen greedily from the last position's logits (`llama_get_logits_ith(ctx, -1)`, float32 over the whole
vocabulary); llama.cpp's sampler is not involved. The KV cache is llama.cpp's own, in the type the peer names
(`type_k` / `type_v`: f32, f16, q8_0, q4_0), attended with llama.cpp's flash attention (its default on a CPU, and
what a quantised V cache needs) except in the float32 row, llama.cpp at its most exact. Prompts of a batch run one after another on one context (llama-cpp-python's `Llama`
holds one sequence), the cache cleared between them. Its prefix cache is llama-cpp-python's own prompt reuse: the
context keeps the K/V of what it evaluated, and a call whose tokens start with them evaluates only the rest
(`n_tokens` set to the shared length, the rest of the cache dropped).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvbench.cachedir import CACHE_ENV, cache_root
from kvbench.errors import KVBenchError, one_line
from kvbench.peers import EXTRAS, PeerSpec
from kvbench.peers.common import Generation, token, weights_key

if TYPE_CHECKING:
    from kvbench.model.gpt2 import GPT

# ggml's type numbers (ggml.h: enum ggml_type), what llama-cpp-python's type_k / type_v take
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
MIN_CTX = 256  # positions of the first context made (grown to what a call needs)
# Conv1D weights, stored (in, out) by GPT-2: llama.cpp reads them (out, in)
TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def require(module: str = "llama_cpp") -> Any:
    """llama-cpp-python (or, for writing a GGUF, llama.cpp's `gguf` package), or one line naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise KVBenchError(
            f"llama.cpp is not installed ({module} is missing): pip install '{EXTRAS['llamacpp']}' (llama-cpp-python "
            "builds from source with a C++ compiler and CMake: docs/peers.md)"
        ) from None


def converted(model: GPT, weights: str) -> Path:
    """The GGUF of `model`'s weights in `weights` ("f32" or "f16"), written now or found in the cache."""
    gguf = require("gguf")
    version = getattr(gguf, "__version__", None) or _dist_version("gguf")
    out = cache_root() / "llamacpp" / f"gguf-{version}" / f"{weights_key(model)}-{weights}.gguf"
    if out.is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".part")
        os.close(fd)
        try:
            _write_gguf(model, Path(tmp), weights, gguf)
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)  # as any file written here, not mkstemp's owner-only
            os.replace(tmp, out)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as e:
        raise KVBenchError(
            f"cannot write llama.cpp's GGUF under {out.parent}: {e.strerror or e}; set {CACHE_ENV} to a writable folder"
        ) from None
    return out


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _write_gguf(model: GPT, path: Path, weights: str, gguf: Any) -> None:
    cfg = model.config
    half = weights == "f16"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_name("kvbench gpt2")
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.block_size)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(4 * cfg.n_embd)
    w.add_head_count(cfg.n_head)
    w.add_layer_norm_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if half else gguf.LlamaFileType.ALL_F32)
    vocab = cfg.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([token(i, vocab) for i in range(vocab)])
    w.add_token_types([gguf.TokenType.NORMAL] * (vocab - 1) + [gguf.TokenType.CONTROL])
    # llama.cpp refuses a BPE vocabulary without merges, and gguf writes no empty list: one merge that holds in
    # this vocabulary ("1" + "2" -> "12"), never used, since kvbench hands llama.cpp ids and never text
    w.add_token_merges(["1 2"])
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GPT2, cfg.n_layer)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied to wte: llama.cpp uses token_embd where `output` is absent
            continue
        base, _, kind = name.rpartition(".")
        mapped = names.get_name(base)
        if mapped is None:  # a buffer that is no weight (a causal mask)
            continue
        a = t.detach().to("cpu", torch.float32)
        if name.endswith(TRANSPOSED):
            a = a.t()
        arr = a.contiguous().numpy()
        if half and arr.ndim == 2:
            arr = arr.astype(np.float16)
        w.add_tensor(f"{mapped}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _load(llama_cpp: Any, path: Path, peer: PeerSpec, n_ctx: int, threads: int) -> Any:
    kv = KV_TYPES[peer.kv]
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=0,
        type_k=kv,
        type_v=kv,
        flash_attn=peer.flash_attention,
        verbose=False,
    )


class LlamaCppModel:
    """One loaded llama.cpp context over `model`'s weights, its GGUF in `peer.compute`, its KV cache in `peer.kv`."""

    def __init__(self, model: GPT, peer: PeerSpec, threads: int) -> None:
        llama_cpp = require()
        w = model.lm_head.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise KVBenchError(
                f"{peer.name} runs kvbench's float32 weights on the CPU here: use --device cpu --dtype fp32"
            )
        self.llama_cpp = llama_cpp
        self.vocab_size = model.config.vocab_size
        self.positions = model.config.block_size
        self.threads = threads
        self.peer = peer
        self.path = converted(model, peer.compute)
        self.n_ctx = min(MIN_CTX, self.positions)
        try:
            self.llm = self._load()
        except (ValueError, RuntimeError):  # a cached file damaged since it was written: write it again, once
            self.path.unlink(missing_ok=True)
            self.path = converted(model, peer.compute)
            try:
                self.llm = self._load()
            except (ValueError, RuntimeError) as e:
                raise KVBenchError(f"llama.cpp cannot load {self.path}: {one_line(e)}") from None

    def _load(self) -> Any:
        return _load(self.llama_cpp, self.path, self.peer, self.n_ctx, self.threads)

    def _fit(self, length: int) -> None:
        """A context whose cache holds `length` positions: the next power of two up to the model's, made anew (the
        cache is allocated whole when a context is made, so it is sized to what runs, not to gpt2-long's 65,536)."""
        if length > self.positions:
            raise KVBenchError(
                f"{self.peer.name}: {length} positions is beyond the model's {self.positions}; lower the prompt or "
                "--new-tokens"
            )
        if length > self.n_ctx:
            self.n_ctx = min(self.positions, 1 << (length - 1).bit_length())
            self.llm = self._load()

    def describe(self) -> str:
        return f"Llama.eval token by token on {self.path}"

    def _last_logits(self) -> np.ndarray:
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy()  # (V,)

    def _eval(self, ids: list[int]) -> np.ndarray:
        self.llm.eval(ids)
        return self._last_logits()

    def _one(self, prompt: list[int], new_tokens: int, keep: int) -> tuple[list[int], list[np.ndarray], list[float]]:
        """Greedy generation after `prompt`, reusing the first `keep` positions already in the context's cache."""
        self.llm.n_tokens = keep  # the next eval drops the cache past it
        marks = [time.perf_counter()]
        row = self._eval(prompt[keep:])
        tokens, rows = [], []
        for i in range(new_tokens):
            tok = int(row.argmax())
            tokens.append(tok)
            rows.append(row)
            marks.append(time.perf_counter())
            if i + 1 < new_tokens:
                row = self._eval([tok])
        return tokens, rows, marks

    def generate(
        self, prompts: list[list[int]], new_tokens: int, record_logits: bool = False, prefix: list[int] | None = None
    ) -> Generation:
        """Greedy generation of `new_tokens` after each prompt. With `prefix`, after `prefix` + prompt: where the
        context's cache starts with the prefix (a previous call evaluated it), its K/V are reused and only the rest is
        evaluated (warm); otherwise the whole sequence is evaluated from an empty cache (cold), which keeps it."""
        t0 = time.perf_counter()
        all_tokens, all_rows, ttft, steps = [], [], None, []
        self._fit(max(len(prefix or []) + len(p) for p in prompts) + new_tokens)
        for p in prompts:
            seq = (prefix or []) + p
            keep = len(prefix) if prefix and self._holds(prefix) else 0  # cold: the whole sequence from empty
            tokens, rows, marks = self._one(seq, new_tokens, keep)
            all_tokens.append(tokens)
            all_rows.append(rows)
            if ttft is None:
                ttft = marks[1] - marks[0]
                steps = [b - a for a, b in zip(marks[1:], marks[2:], strict=False)]
        total = time.perf_counter() - t0
        logits = None
        if record_logits:
            logits = torch.from_numpy(np.array(all_rows, dtype=np.float32))  # (B, N, V)
        return Generation(all_tokens, logits, ttft or total, steps, total)

    def _holds(self, prefix: list[int]) -> bool:
        """The context's cache starts with `prefix` (what a previous call evaluated)."""
        n = len(prefix)
        return self.llm.n_tokens >= n and [int(t) for t in self.llm.input_ids[:n]] == list(prefix)
