"""llama.cpp as a peer engine: the GGUF kvbench writes of its own weights (read back with llama.cpp's gguf reader,
tensor for tensor), and, where llama-cpp-python is installed (it builds from source: not in the dev extra), verify and
bench over llama.cpp's own caches against transformers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.model.gpt2 import GPT, PRESETS
from kvbench.peers import FAMILIES, PEERS, expand

gguf = pytest.importorskip("gguf")
TINY = ["--model", "gpt2-tiny", "--weights", "random"]


@pytest.fixture(scope="module")
def model() -> GPT:
    return GPT(PRESETS["gpt2-tiny"]).init_weights(seed=0, std=0.05).eval()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kvbench-cache"))


def prompts(n: int = 3, longest: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50256, (longest - 6 * i,), generator=g).tolist() for i in range(n)]


def test_the_family_names_its_four_peers():
    assert (
        expand(["llamacpp"])
        == FAMILIES["llamacpp"]
        == [
            "llamacpp-f32",
            "llamacpp-f16",
            "llamacpp-f16-kv-q8_0",
            "llamacpp-f16-kv-q4_0",
        ]
    )
    assert not any(PEERS[p].exact for p in FAMILIES["llamacpp"])  # held to KL bounds, float32 included
    bounds = [PEERS[p].max_kl for p in FAMILIES["llamacpp"]]
    assert bounds == sorted(bounds)  # fewer bits, a looser bound
    # the floor's bytes: ggml's q8_0 block is 32 int8 + an fp16 scale, q4_0 32 nibbles + an fp16 scale
    assert PEERS["llamacpp-f16-kv-q8_0"].kv_bytes * 32 == 34 and PEERS["llamacpp-f16-kv-q4_0"].kv_bytes * 32 == 18


@pytest.mark.parametrize("weights", ["f32", "f16"])
def test_the_gguf_holds_the_models_weights_as_llama_cpp_reads_gpt2(model, weights):
    """Read back with gguf's own reader: GPT-2's architecture keys, the ids as the vocabulary, and every tensor the
    model's (Conv1D matrices transposed to (out, in), lm_head tied and left out); float16 for the matrices and
    embeddings of an f16 file, float32 for norms and biases, as llama.cpp's converter writes them."""
    from kvbench.peers.llamacpp import converted

    r = gguf.GGUFReader(str(converted(model, weights)))
    cfg = model.config

    def field(name):
        return r.fields[name].contents()

    assert field("general.architecture") == "gpt2"
    dims = (field("gpt2.block_count"), field("gpt2.embedding_length"), field("gpt2.attention.head_count"))
    assert dims == (cfg.n_layer, cfg.n_embd, cfg.n_head)
    assert field("gpt2.context_length") == cfg.block_size and field("gpt2.feed_forward_length") == 4 * cfg.n_embd
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == cfg.vocab_size and tokens[:3] == ["0", "1", "2"] and tokens[-1] == "<|endoftext|>"
    assert field("tokenizer.ggml.eos_token_id") == cfg.vocab_size - 1
    tensors = {t.name: t for t in r.tensors}
    assert "output.weight" not in tensors and len(tensors) == 4 + 12 * cfg.n_layer
    sd = model.state_dict()
    pairs = [
        ("token_embd.weight", sd["transformer.wte.weight"]),
        ("position_embd.weight", sd["transformer.wpe.weight"]),
        ("blk.1.attn_qkv.weight", sd["transformer.h.1.attn.c_attn.weight"].t()),
        ("blk.1.attn_qkv.bias", sd["transformer.h.1.attn.c_attn.bias"]),
        ("blk.0.ffn_down.weight", sd["transformer.h.0.mlp.c_proj.weight"].t()),
        ("blk.0.ffn_norm.weight", sd["transformer.h.0.ln_2.weight"]),
        ("output_norm.bias", sd["transformer.ln_f.bias"]),
    ]
    for name, want in pairs:
        t = tensors[name]
        half = weights == "f16" and want.dim() == 2
        assert t.tensor_type.name == ("F16" if half else "F32"), name
        got = np.asarray(t.data).reshape(tuple(want.shape))
        expect = want.numpy().astype(np.float16 if half else np.float32)
        assert np.array_equal(got, expect), name


def test_the_gguf_is_cached_by_weights_and_type(model):
    from kvbench.peers.llamacpp import converted

    first = converted(model, "f32")
    stamp = first.stat().st_mtime_ns
    assert converted(model, "f32") == first and first.stat().st_mtime_ns == stamp
    assert converted(model, "f16") != first
    other = GPT(PRESETS["gpt2-tiny"]).init_weights(seed=1, std=0.05).eval()
    assert converted(other, "f32") != first
    assert not list(first.parent.glob("*.part"))  # nothing half-written left behind


def test_an_unwritable_cache_folder_is_one_line(tmp_path, monkeypatch, model):
    from kvbench.errors import KVBenchError
    from kvbench.peers.llamacpp import converted

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(KVBenchError, match="cannot write llama.cpp's GGUF under .*; set KVBENCH_CACHE_DIR"):
        converted(model, "f32")


def test_a_missing_llama_cpp_names_its_extra():
    code = (
        "import sys; sys.modules['llama_cpp'] = None\n"
        "from kvbench.cli import main\n"
        "sys.argv = ['kvbench', 'verify', '--model', 'gpt2-tiny', '--weights', 'random', '--engine', 'llamacpp-f32',"
        " '-n', '4']\n"
        "main()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "pip install 'kvbench[llamacpp]'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_refuses_a_batch_for_llama_cpp():
    r = CliRunner().invoke(app, ["bench", *TINY, "--engine", "llamacpp", "--caches", "dynamic", "--batch", "1,4"])
    assert r.exit_code == 2 and "llama.cpp's peer decodes one sequence at a time" in r.output, r.output


# --- with llama.cpp itself (llama-cpp-python: pip install 'kvbench[llamacpp]') ---------------------------------------
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'kvbench[llamacpp]'; it builds from source)",
)


@needs_llama_cpp
def test_llama_cpp_caches_within_their_bounds_and_prefix_cache_warm_equals_cold(model):
    from kvbench.check.peer_verify import run_peer_verify

    peers = [PEERS[p] for p in FAMILIES["llamacpp"]]
    report = run_peer_verify(model, peers, prompts(), 10, threads=1)
    by = {(r.cache, r.name): r for r in report.checks}
    assert report.passed and len(by) == 16, [r for r in report.checks if not r.passed]
    for peer in FAMILIES["llamacpp"]:
        assert "warm vs cold: bit-identical" in by[peer, "prefix-cache"].detail, by[peer, "prefix-cache"]
        assert "mean KL" in by[peer, "logits"].detail and "top-1" in by[peer, "logits"].detail
    kl = {p: report.distortion[p]["kl_mean"] for p in FAMILIES["llamacpp"]}
    assert 0 < kl["llamacpp-f32"] < kl["llamacpp-f16-kv-q8_0"] < kl["llamacpp-f16-kv-q4_0"], kl  # fewer bits, more KL


@needs_llama_cpp
def test_llama_cpp_f32_held_exact_fails_with_its_distortion(model):
    """Its float32 GGUF is not exact to fp32's tolerance (ggml's GELU goes through a float16 table): held exact, as a
    deployment claiming exactness would be, its rows fail with their figures."""
    from kvbench.check.peer_verify import run_peer_verify

    report = run_peer_verify(model, [PEERS["llamacpp-f32"]], prompts(), 10, hold_exact=True, threads=1)
    failed = {r.name for r in report.checks if not r.passed}
    assert not report.passed and {"logits", "batched", "prefix-cache"} <= failed
    logits = next(r for r in report.checks if r.name == "logits")
    assert "held exact" in logits.tolerance and "mean KL" in logits.detail and "worst depth" in logits.detail
    assert logits.max_abs_diff > 1e-4


@needs_llama_cpp
def test_a_llama_cpp_peer_on_other_weights_fails_its_bound(model):
    """A conversion that lost something (one layer's attention weights off by 20%) fails against the reference on the
    original weights, though its prefix cache still agrees with itself."""
    from kvbench.check.peer_verify import Reference, check_logits, check_prefix_cache
    from kvbench.peers import load

    wrong = GPT(PRESETS["gpt2-tiny"]).init_weights(seed=0, std=0.05).eval()
    with torch.no_grad():
        wrong.transformer.h[1].attn.c_attn.weight.mul_(1.2)
    peer = PEERS["llamacpp-f32"]
    runner = load(wrong, peer, 1)
    row, figures = check_logits(peer, runner, Reference(model), prompts()[0], 8, False, "")
    assert not row.passed and "mean KL" in row.detail and figures is not None and figures.kl_mean > peer.max_kl
    row = check_prefix_cache(peer, runner, Reference(model), prompts()[0], 6, False, "")
    assert not row.passed and "warm vs cold: bit-identical" in row.detail


@needs_llama_cpp
def test_bench_times_llama_cpp_beside_kvbench(tmp_path):
    out = tmp_path / "run"
    args = ["bench", *TINY, "--engine", "kvbench,llamacpp", "--caches", "none,dynamic", "--prompt-len", "16"]
    r = CliRunner().invoke(app, [*args, "-n", "6", "--repeats", "1", "--threads", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(out / "summary.csv").set_index("engine")
    for peer in FAMILIES["llamacpp"]:
        row = rows.loc[peer]
        assert row["cache"] == "dynamic" and row["status"] == "ok" and row["tpot_ms_median"] > 0, row
        assert row["floor_ms"] > 0 and row["x_floor"] > 0
    assert rows.loc["llamacpp-f32", "token_agreement"] == 1.0
    # float16 weights: half the bytes a step reads from the weights; a q4_0 cache stores less than float16's
    assert rows.loc["llamacpp-f16", "step_bytes"] < rows.loc["llamacpp-f32", "step_bytes"] * 0.6
    assert rows.loc["llamacpp-f16-kv-q4_0", "step_bytes"] < rows.loc["llamacpp-f16", "step_bytes"]


@needs_llama_cpp
def test_a_damaged_cached_gguf_is_written_again(model):
    from kvbench.peers import load
    from kvbench.peers.llamacpp import converted

    path = converted(model, "f32")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 3)  # an interrupted copy, a full disk
    runner = load(model, PEERS["llamacpp-f32"], 1)
    assert runner.path == path and path.stat().st_size == size
    assert runner.generate([[1, 2, 3]], 2).tokens == runner.generate([[1, 2, 3]], 2).tokens
