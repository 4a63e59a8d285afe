"""Peer engines (CTranslate2) on kvbench's weights: verify --engine holds their caches to transformers, bench times
them beside our loop. Real CTranslate2 (the dev extra), converted from the tiny model's weights in this run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from typer.testing import CliRunner

from kvbench.check.peer_verify import Reference, check_logits, check_prefix_cache, run_peer_verify
from kvbench.cli import app
from kvbench.model.gpt2 import GPT, PRESETS
from kvbench.peers import PEERS, expand

# found, not imported: kvbench imports it (peers/ct2.py require), as the CLI does
if importlib.util.find_spec("ctranslate2") is None:
    pytest.skip("CTranslate2 is not installed (the dev extra)", allow_module_level=True)
TINY = ["--model", "gpt2-tiny", "--weights", "random"]


@pytest.fixture(scope="module")
def model() -> GPT:
    return GPT(PRESETS["gpt2-tiny"]).init_weights(seed=0, std=0.05).eval()


def prompts(n: int = 3, longest: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50256, (longest - 6 * i,), generator=g).tolist() for i in range(n)]


def test_families_expand_to_their_peers_once():
    assert expand(["ct2"]) == ["ct2-fp32", "ct2-int8"]
    assert expand(["ct2-int8", "ct2"]) == ["ct2-int8", "ct2-fp32"]


def test_ct2_fp32_is_exact_and_int8_within_its_bound(model):
    report = run_peer_verify(model, [PEERS["ct2-fp32"], PEERS["ct2-int8"]], prompts(), 10)
    by = {(r.cache, r.name): r for r in report.checks}
    assert report.passed and len(by) == 8
    for name in ("logits", "batched", "prefix-cache"):
        assert by["ct2-fp32", name].max_abs_diff < 1e-5  # an independent implementation, fp32
        int8 = by["ct2-int8", name]
        assert 1e-4 < int8.max_abs_diff < 0.5, int8  # int8 weights move the logits, boundedly
        assert "mean KL" in int8.detail and "top-1" in int8.detail
    assert by["ct2-fp32", "greedy"].first_divergence is None
    assert "warm vs cold: bit-identical" in by["ct2-fp32", "prefix-cache"].detail
    assert set(report.distortion) == {"ct2-int8"} and report.distortion["ct2-int8"]["kl_mean"] > 0


def test_a_batch_whose_shortest_prompt_is_one_token_is_exact(model):
    """Where the shortest prompt is one token, CTranslate2 4.8.5 returns a longer prompt's other tokens as generated
    ones: the runner asks for the prompts in the result and cuts each sequence to its own tokens and steps."""
    from kvbench.peers.ct2 import CT2Model

    short = [p[:n] for p, n in zip(prompts(), (3, 2, 1), strict=True)]
    runner = CT2Model(model, PEERS["ct2-fp32"], 1)
    batch = runner.generate(short, 4, record_logits=True)
    for i, p in enumerate(short):
        alone = runner.generate([p], 4, record_logits=True)
        assert batch.tokens[i] == alone.tokens[0] and len(batch.tokens[i]) == 4
        assert torch.allclose(batch.rows[i], alone.rows[0], rtol=0, atol=1e-5)
    report = run_peer_verify(model, [PEERS["ct2-fp32"]], short, 4)
    assert report.passed, [(r.name, r.detail) for r in report.checks if not r.passed]


def test_int8_held_exact_fails_with_its_distortion(model):
    report = run_peer_verify(model, [PEERS["ct2-int8"]], prompts(), 10, hold_exact=True)
    failed = {r.name for r in report.checks if not r.passed}
    assert not report.passed and {"logits", "batched", "prefix-cache"} <= failed
    logits = next(r for r in report.checks if r.name == "logits")
    assert "held exact" in logits.tolerance and "mean KL" in logits.detail and "worst depth" in logits.detail


def test_a_peer_on_other_weights_fails_the_logits_check(model):
    """A conversion that lost something (one layer's attention weights perturbed by 1%) is a failing row with its
    KL, not a pass: the reference is transformers on the original weights."""
    from kvbench.peers.ct2 import CT2Model

    wrong = GPT(PRESETS["gpt2-tiny"]).init_weights(seed=0, std=0.05).eval()
    with torch.no_grad():
        w = wrong.transformer.h[1].attn.c_attn.weight
        w.mul_(1.01)
    runner = CT2Model(wrong, PEERS["ct2-fp32"], 1)
    row, figures = check_logits(PEERS["ct2-fp32"], runner, Reference(model), prompts()[0], 8, False, "")
    assert not row.passed and row.max_abs_diff > 1e-4 and "mean KL" in row.detail
    assert figures is not None and figures.kl_mean > 0
    # the same runner's prefix cache is still self-consistent: warm equals cold, yet both are wrong
    row = check_prefix_cache(PEERS["ct2-fp32"], runner, Reference(model), prompts()[0], 6, False, "")
    assert not row.passed and "warm vs cold: bit-identical" in row.detail


def test_the_references_greedy_run_keeps_no_whole_forward_alive(model):
    """Each greedy step's forward is (T, V); the step keeps one row of it. Kept as a view, the row held the whole
    forward's storage, and a 300-token run on gpt2-tiny took 9.8 GB: each earlier forward must be gone by the next
    step."""
    ref = Reference(model)
    whole = ref.logits
    earlier: list[StorageWeakRef] = []

    def logits(seq: list[int]) -> torch.Tensor:
        out = whole(seq)  # (T, V)
        assert all(w.expired() for w in earlier), f"an earlier step's forward is alive at length {len(seq)}"
        earlier.append(StorageWeakRef(out.untyped_storage()))
        return out

    ref.logits = logits  # type: ignore[method-assign]
    prompt = prompts()[0]
    tokens, rows = ref.greedy(prompt, 5)
    assert len(earlier) == 5 and rows.shape == (5, model.config.vocab_size)
    assert tokens == [int(r.argmax()) for r in rows] and torch.equal(rows[0], whole(prompt)[-1])


def test_the_converted_model_is_cached_by_weights(model):
    from kvbench.peers.ct2 import converted

    first = converted(model)
    stamp = (first / "model.bin").stat().st_mtime_ns
    assert converted(model) == first and (first / "model.bin").stat().st_mtime_ns == stamp
    other = GPT(PRESETS["gpt2-tiny"]).init_weights(seed=1, std=0.05).eval()
    assert converted(other) != first
    assert not [p for p in first.parent.iterdir() if p.name.startswith("tmp")]  # no staging folder left behind


def test_verify_engine_from_the_command_line(tmp_path):
    junit = tmp_path / "peers.xml"
    r = CliRunner().invoke(app, ["verify", *TINY, "--engine", "ct2", "-n", "8", "--json", "--junit-xml", str(junit)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["passed"] and {c["cache"] for c in doc["checks"]} == {"ct2-fp32", "ct2-int8"}
    assert set(doc["engines"]) == {"ct2-fp32", "ct2-int8"} and "ct2-int8" in doc["distortion"]
    assert junit.read_text().count("<testcase") == 8
    r = CliRunner().invoke(app, ["verify", *TINY, "--engine", "ct2-int8", "--hold-exact", "-n", "6"])
    assert r.exit_code == 1 and "FAILED" in r.output and "mean KL" in r.output


@pytest.mark.parametrize(
    "args, says",
    [
        (["--engine", ""], "--engine is empty"),
        (["--engine", "ct3"], "unknown peer engine 'ct3'"),
        (["--engine", "ct2", "--dtype", "fp16"], "--dtype with --engine"),
        (["--engine", "ct2", "--caches", "static"], "--caches with --engine"),
        (["--engine", "ct2", "--hf", "gpt2"], "--hf with --engine"),
        (["--hold-exact"], "--hold-exact holds a peer engine"),
        # the text rows score kvbench's own caches: a file given with a peer was dropped without a word
        (["--engine", "ct2", "--text", "/no/such/file.txt"], "--text with --engine"),
        (["--engine", "ct2", "--window", "8"], "--window with --engine"),
        (["--engine", "ct2", "--dtype", "FP16"], "--dtype with --engine"),
        (["--engine", "ct2", "--dtype", "float64"], "unknown --dtype 'float64'"),
    ],
)
def test_verify_engine_bad_input_is_one_line(args, says):
    r = CliRunner().invoke(app, ["verify", *([] if "--hf" in args else TINY), *args])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("dtype", ["FP32", "float", "auto", " Float32 "])
def test_verify_engine_takes_every_spelling_of_float32(dtype):
    r = CliRunner().invoke(app, ["verify", *TINY, "--engine", "ct2-fp32", "--dtype", dtype, "-n", "4", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["passed"], r.output


def test_a_missing_peer_names_its_extra():
    code = (
        "import sys; sys.modules['ctranslate2'] = None\n"
        "from kvbench.cli import main\n"
        "sys.argv = ['kvbench', 'verify', '--model', 'gpt2-tiny', '--weights', 'random', '--engine', 'ct2', '-n', '4']\n"
        "main()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "pip install 'kvbench[ct2]'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_times_ct2_beside_kvbench(tmp_path):
    out = tmp_path / "run"
    args = ["bench", *TINY, "--engine", "kvbench,ct2", "--caches", "none,dynamic", "--prompt-len", "16", "-n", "6"]
    r = CliRunner().invoke(app, [*args, "--repeats", "1", "--threads", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(out / "summary.csv").set_index("engine")
    for peer in ("ct2-fp32", "ct2-int8"):
        row = rows.loc[peer]
        assert row["cache"] == "dynamic" and row["status"] == "ok" and row["tpot_ms_median"] > 0
        assert row["floor_ms"] > 0 and row["x_floor"] > 0
    assert rows.loc["ct2-fp32", "token_agreement"] == 1.0  # exact: kvbench none's tokens
    # int8 weights: a quarter of the bytes a step reads from the weights
    assert rows.loc["ct2-int8", "step_bytes"] < rows.loc["ct2-fp32", "step_bytes"] / 2
    meta = json.loads((out / "meta.json").read_text())
    assert "ct2-int8" in meta["engines"]
    import ctranslate2

    assert meta["versions"]["ctranslate2"] == ctranslate2.__version__  # what ran the peer's rows


@pytest.mark.parametrize(
    "args, says",
    [
        (["--engine", "ct2", "--fill", "random", "-m", "gpt2-tiny"], "drop ct2-fp32, ct2-int8"),
        (["--engine", "ct2", "--dtype", "fp16"], "peers run kvbench's float32 weights on the CPU"),
        (["--engine", "ct2", "--caches", "static"], "engine ct2-fp32 runs none of the caches asked for"),
    ],
)
def test_bench_peer_bad_input_is_one_line(args, says):
    r = CliRunner().invoke(app, ["bench", "--weights", "random", "--prompt-len", "8", *args])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output


def test_a_damaged_cached_model_is_converted_again(model):
    from kvbench.peers.ct2 import CT2Model, converted

    path = converted(model)
    (path / "model.bin").write_bytes(b"not a model")
    runner = CT2Model(model, PEERS["ct2-fp32"], 1)
    assert runner.path == path and (path / "model.bin").stat().st_size > 1000
    assert runner.generate([[1, 2, 3]], 2).tokens[0] == runner.generate([[1, 2, 3]], 2).tokens[0]


def test_an_unwritable_cache_folder_is_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(blocker / "cache"))
    r = CliRunner().invoke(
        app, ["verify", "--model", "gpt2-tiny", "--weights", "random", "--seed", "7", "--engine", "ct2-fp32"]
    )
    assert (
        r.exit_code == 2
        and "cannot write CTranslate2's converted model" in r.output
        and "KVBENCH_CACHE_DIR" in r.output
    )


def test_bench_batches_through_a_peer(tmp_path):
    out = tmp_path / "run"
    args = ["bench", *TINY, "--engine", "kvbench,ct2-fp32", "--caches", "none,dynamic", "--prompt-len", "12", "-n", "5"]
    r = CliRunner().invoke(app, [*args, "--batch", "1,3", "--repeats", "1", "--threads", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(out / "summary.csv")
    peer = rows[rows.engine == "ct2-fp32"].set_index("batch")
    assert list(peer.status) == ["ok", "ok"] and (peer.token_agreement == 1.0).all()


def _gomp_bindings(tmp_path, code: str) -> set[str]:
    """The libgomp files CTranslate2's library binds GOMP_parallel to when a fresh Python runs `code` (the dynamic
    loader's own report, LD_DEBUG=bindings; Python loads extensions with RTLD_NOW, so the import binds it)."""
    log = tmp_path / "ld"
    env = {**os.environ, "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(log)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=300)
    found = set()
    for part in tmp_path.glob("ld.*"):
        for line in part.read_text(errors="replace").splitlines():
            if "libctranslate2" in line.split(" to ")[0] and "`GOMP_parallel'" in line:
                found.add(line.split(" to ")[1].split(" [")[0])
        part.unlink()
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "RTLD_DEEPBIND"), reason="glibc's loader")
def test_ctranslate2_runs_its_openmp_teams_in_its_own_runtime_not_torchs(tmp_path):
    # imported plainly after torch, CTranslate2 binds torch's libgomp: its worker's team then counts against torch's
    # runtime, which throttles every team's spinning (docs/peers.md)
    plain = _gomp_bindings(tmp_path, "import torch, ctranslate2")
    torch_gomp = [p for p in plain if "/torch/" in p]
    if not torch_gomp:
        pytest.skip(f"this torch has no libgomp of its own to share: {plain}")
    # through kvbench, after torch as always, it binds the libgomp its wheel ships
    ours = _gomp_bindings(tmp_path, "import torch; from kvbench.peers.ct2 import require; require()")
    assert ours and all("ctranslate2" in p and "/torch/" not in p for p in ours), ours


def test_bench_profile_traces_the_torch_rows_and_not_a_peers(tmp_path):
    """torch's profiler sees none of a peer's step (CTranslate2's own code): its rows are not profiled, where they
    used to print leftovers as its top operators; a run of peers alone has nothing to profile."""
    out = tmp_path / "run"
    args = [*TINY, "--prompt-len", "8", "--new-tokens", "3", "--caches", "dynamic", "--repeats", "1", "--warmup", "0"]
    r = CliRunner().invoke(app, ["bench", *args, "--engine", "kvbench,ct2-fp32", "--out", str(out), "--profile"])
    assert r.exit_code == 0, r.output
    assert set(json.loads((out / "meta.json").read_text())["profiles"]) == {"kvbench dynamic prompt 8 batch 1"}
    assert set(pd.read_csv(out / "profile_ops.csv").engine) == {"kvbench"}
    assert len(pd.read_csv(out / "summary.csv")) == 2  # the peer's row is timed as before
    r = CliRunner().invoke(app, ["bench", *args, "--engine", "ct2", "--out", str(tmp_path / "p"), "--profile"])
    assert r.exit_code == 2 and "--profile with --engine ct2-fp32,ct2-int8" in r.output, r.output


def test_the_conversion_reads_kvbench_own_tensors_not_a_copy(model):
    """CTranslate2's converter reads transformers' model once: built on the meta device and given kvbench's own
    tensors, it costs no copy of the weights (gpt2-xl's first conversion was killed for memory on a 23 GB host)."""
    from kvbench.model.weights import to_hf_model

    hf = to_hf_model(model, "eager", share=True)
    ours = {p.data_ptr() for p in model.parameters()}
    assert not any(t.is_meta for t in (*hf.parameters(), *hf.buffers()))
    assert {p.data_ptr() for p in hf.parameters()} <= ours
    ids = torch.tensor([prompts()[0]])
    copy = to_hf_model(model, "eager")
    assert {p.data_ptr() for p in copy.parameters()}.isdisjoint(ours)
    with torch.inference_mode():
        assert torch.equal(hf(ids).logits, copy(ids).logits)
