"""Tensor parallelism (model/tp.py, kvbench.distributed, check/tp.py): real ranks on torch.distributed (gloo), each
launched by kvbench itself or by torchrun, every check held to the whole model in one process; the shard alone,
in-process, against the whole model; refusals before any rank starts; a rank that fails, hangs or leaves early
named in one line; the faults that fire only across ranks.

One launch of two ranks (the main rows on our GPT-2) runs in the default tier; the rest is `slow`."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from facts import holds, since
from kvbench.model.gpt2 import GPT, GPTConfig
from tiny import SHAPE

TINY = ["-m", "gpt2-tiny", "-w", "random", "-d", "cpu"]
SMALL = ["--prompt-len", "12", "-n", "8"]


def kvbench(*args, env=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        **kw,
    )


def test_verify_tp2_passes_every_main_row_and_records_the_split(tmp_path):
    r = kvbench(
        "verify",
        "--tp",
        2,
        *TINY,
        *SMALL,
        "--caches",
        "dynamic,static",
        "--reference",
        "none",
        "--json",
        "--junit-xml",
        tmp_path / "v.xml",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # rank 0 alone prints: one document
    assert doc["passed"] and doc["tp"] == 2
    rows = {(c["name"], c["cache"]): c for c in doc["checks"]}
    for cache in ("dynamic", "static"):
        for check in (
            "logits",
            "greedy",
            "batched",
            "cache_state",
            "rollback",
            "fork",
            "reorder",
            "chunked_prefill",
        ):
            assert rows[(check, cache)]["passed"] and not rows[(check, cache)]["skipped"], (check, cache)
        rank_cache = rows[("rank_cache", cache)]
        assert rank_cache["passed"] and "rank 0's cache (heads 0-1)" in rank_cache["detail"]
    assert any("tensor parallel" in n for n in doc["notes"])
    held = {(b["rank"], b["cache"]): b for b in doc["rank_cache_bytes"]}
    assert set(held) == {(r, c) for r in (0, 1) for c in ("dynamic", "static")}
    for b in held.values():  # each rank holds half the heads: the planner's per-GPU figure, to the byte
        assert b["measured_bytes"] == b["planned_bytes"] == 2 * 2 * 2 * 32 * 4 * b["tokens"], b
    assert (tmp_path / "v.xml").read_text().count("<testcase") == len(doc["checks"])


# --- the shard alone, in one process (a world of one rank is the whole model) ------------------------------------------
def test_a_world_of_one_rank_is_the_whole_model_bit_for_bit(monkeypatch):
    from kvbench.model import tp

    monkeypatch.setattr(tp.COLLECTIVES, "all_reduce", lambda y: None)  # one rank: the sum is its own
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=128)
    model = GPT(cfg).init_weights(seed=0, std=0.1).eval().lay_out()  # as loaded: weights laid out for the CPU
    part = tp.shard(model, 0, 1)
    ids = torch.randint(0, 128, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        assert torch.equal(part(ids, pos), model(ids, pos))
    assert part.cache_config.n_head == 4 and (part.cache_config.tp_rank, part.cache_config.tp_size) == (0, 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_its_contiguous_slice_of_the_heads(rank):
    from kvbench.model import tp

    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=64, block_size=16, vocab_size=32)
    model = GPT(cfg).init_weights(seed=0, std=0.1)
    part = tp.shard(model, rank, 2)
    attn, whole = part.transformer.h[0].attn, model.transformer.h[0].attn
    heads = tp.rank_heads(4, rank, 2)
    assert list(heads) == [2 * rank, 2 * rank + 1] and attn.n_head == 2
    cols = tp.head_columns(64, 16, heads)
    assert torch.equal(attn.c_attn.weight, whole.c_attn.weight[:, cols])
    assert torch.equal(attn.c_proj.weight, whole.c_proj.weight[32 * rank : 32 * (rank + 1)])
    assert part.cache_config.n_head == 2 and part.cache_config.head_dim == 16


# --- refused before any rank starts ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["verify", "--tp", "3", *TINY], "4 attention heads do not divide over 3 ranks"),
        (["verify", "--tp", "0", *TINY], "--tp must be >= 1"),
        (["verify", "--tp", "2", "--tp-timeout", "0", *TINY], "--tp-timeout must be >= 1"),
        (
            ["verify", "--tp", "2", "--compile", "default", "--caches", "static-graph", *TINY],
            "--compile default with --tp 2",
        ),
        (["break", "tp-rank-crop", *TINY], "fires only across tensor-parallel ranks"),
    ],
    ids=["heads", "zero", "timeout", "compile", "break-tp-fault-alone"],
)
def test_what_cannot_be_split_is_refused_in_one_line(args, message):
    from typer.testing import CliRunner

    from kvbench.cli import app

    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Tiny Llama (2 and 1 KV heads), Qwen2 with a sliding window and Mistral, saved with save_pretrained."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    root = tmp_path_factory.mktemp("tp-hf")
    common = dict(SHAPE, head_dim=16, max_position_embeddings=128)
    window = dict(num_key_value_heads=2, sliding_window=8)
    models = {
        "llama": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, **common)),
        "llama-kv1": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=1, **common)),
        "qwen2-sw": (
            Qwen2ForCausalLM,
            Qwen2Config(
                use_sliding_window=True, max_window_layers=0, layer_types=["sliding_attention"] * 2, **window, **common
            ),
        ),
        "mistral-sw": (MistralForCausalLM, MistralConfig(**window, **common)),
    }
    torch.manual_seed(0)
    for name, (cls, cfg) in models.items():
        cls(cfg).save_pretrained(root / name)
    return root


def test_one_kv_head_at_tp2_is_refused_before_any_rank_starts(hf_models, monkeypatch):
    from typer.testing import CliRunner

    from kvbench import launcher
    from kvbench.cli import app

    monkeypatch.setattr(launcher, "launch", lambda *a: pytest.fail("ranks were launched"))
    r = CliRunner().invoke(app, ["verify", "--hf", str(hf_models / "llama-kv1"), "--tp", "2", "-d", "cpu"])
    assert r.exit_code == 2, r.output
    assert "1 key/value heads do not divide over 2 ranks" in r.stderr and "#48307" in r.stderr, r.stderr


def test_a_missing_accelerate_names_the_extra(hf_models, monkeypatch):
    import importlib.util

    from typer.testing import CliRunner

    from kvbench.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real(n, *a))
    r = CliRunner().invoke(app, ["verify", "--hf", str(hf_models / "llama"), "--tp", "2", "-d", "cpu"])
    assert r.exit_code == 2 and 'pip install "kvbench[tp]"' in r.stderr, r.output


# --- the slow tier: every cache, real checkpoints' architectures, failures, faults ----------------------------------
@pytest.mark.slow
def test_every_builtin_cache_passes_under_tp2():
    r = kvbench("verify", "--tp", 2, *TINY, *SMALL, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    caches = {c["cache"] for c in doc["checks"]}
    assert {"dynamic", "static", "static-graph", "paged", "int8"} <= caches
    assert doc["passed"], [c for c in doc["checks"] if not c["passed"]]


@pytest.mark.slow
@pytest.mark.parametrize("name, window", [("llama", None), ("qwen2-sw", 8), ("mistral-sw", 8)])
def test_hugging_face_models_pass_under_transformers_tp(hf_models, name, window):
    """Each rank's dynamic cache, measured after generate, is the planner's figure to the byte: 1 of the 2 KV heads,
    and for a windowed layer the W - 1 tokens transformers keeps between forwards (19 tokens held: 7)."""
    args = ["--hf", hf_models / name, "--tp", 2, "-d", "cpu", *SMALL, "--caches", "dynamic,static", "--json"]
    r = kvbench("verify", *args)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    judged = [c for c in doc["checks"] if not c["skipped"]]
    assert doc["passed"] and {c["name"] for c in judged} >= {"logits", "greedy", "rank_cache"}
    (r0, r1) = sorted(doc["rank_cache_bytes"], key=lambda b: b["rank"])  # the dynamic cache on each rank
    for b in (r0, r1):  # 2 layers x K and V x 1 of 2 KV heads x 16 x 4 B per token held
        held = b["tokens"] if window is None else min(b["tokens"], window - 1)
        assert b["measured_bytes"] == b["planned_bytes"] == 2 * 2 * 1 * 16 * 4 * held, b
        assert b["tokens"] > (window or 0), "the run passes the window"


def _plugin(tmp_path, body: str) -> dict:
    """A cache plugin package `tpplug` (a dynamic cache that misbehaves on rank 1) on PYTHONPATH for the ranks."""
    (tmp_path / "tpplug").mkdir()
    (tmp_path / "tpplug" / "__init__.py").write_text(
        textwrap.dedent(
            """
            import os, sys, time
            from kvbench.caches.dynamic import DynamicCache
            from kvbench.model.tp import config_place

            class C(DynamicCache):
                def __init__(self, config, batch, max_len, dtype, device):
                    super().__init__()
                    self.rank = config_place(config).rank

                def update(self, k, v, positions):
            """
        )
        + textwrap.indent(textwrap.dedent(body), " " * 8)
        + "        return super().update(k, v, positions)\n"
    )
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, code, line",
    [
        (
            "if self.rank == 1 and self.length > 0: raise RuntimeError('boom on rank one')\n",
            2,
            "error: rank 1: cache plugin 'tpplug:C' broke the cache contract: update raised RuntimeError: boom on rank one",
        ),
        (
            "if self.rank == 1 and self.length > 0: time.sleep(120)\n",
            75,
            "error: rank 1 hung: it did not reach a collective that rank 0 waited in for --tp-timeout (10 s)",
        ),
        ("if self.rank == 1 and self.length > 0: os._exit(0)\n", 75, "error: rank 1 left the run early"),
    ],
    ids=["fails", "hangs", "exits"],
)
def test_a_rank_that_fails_hangs_or_leaves_ends_the_run_in_one_line(tmp_path, body, code, line):
    env = _plugin(tmp_path, body)
    t0 = time.monotonic()
    r = kvbench(
        "verify",
        "--tp",
        2,
        *TINY,
        *SMALL,
        "--caches",
        "tpplug:C",
        "--reference",
        "none",
        "--tp-timeout",
        10,
        env=env,
        timeout=240,
    )
    assert r.returncode == code, (r.returncode, r.stderr)
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert errors == [errors[0]] and errors[0].startswith(line), r.stderr
    assert time.monotonic() - t0 < 120  # the collective timeout bounds it, not the rank's own sleep
    assert not _leftover(tmp_path)


def _leftover(marker) -> list[str]:
    """kvbench processes still running that were started for this test (their command line names `marker`)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [x for x in out.splitlines() if "kvbench" in x and str(marker) in x and "ps -eo" not in x]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **_plugin(tmp_path, "time.sleep(0.5)\n")}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbench",
            "verify",
            "--tp",
            "2",
            *TINY,
            *SMALL,
            "--caches",
            "tpplug:C",
            "--reference",
            "none",
            "--junit-xml",
            str(tmp_path / "ctrl-c.xml"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    time.sleep(20)  # the ranks are running their checks
    os.killpg(p.pid, signal.SIGINT)  # what a terminal sends the whole foreground group on Ctrl-C
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    time.sleep(2)
    assert not _leftover(tmp_path / "ctrl-c.xml")


@pytest.mark.slow
def test_torchrun_starts_the_same_command_as_one_rank_each():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [
        "-m",
        "kvbench",
        "verify",
        "--tp",
        "2",
        *TINY,
        *SMALL,
        "--caches",
        "dynamic",
        "--reference",
        "none",
        "--json",
    ]
    r = subprocess.run([*torchrun, *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["passed"]  # one document: the other rank printed nothing
    wrong = subprocess.run([*torchrun, *args[:4], "4", *args[5:]], capture_output=True, text=True, env=env)
    assert wrong.returncode != 0 and "--tp 4, but torchrun launched 2 ranks (WORLD_SIZE=2)" in wrong.stderr


# Where each rank sees the fault first (check/locate.py): a head the model numbers whole and the rank's own, the slot,
# what it holds; or the rank whose attention reads slots the sequence does not fill.
TP_LOCATIONS = {
    "tp-neighbour-slice": [
        "logits: rank 0: step 0 (prefill), layer 0, head 0 (rank 0's head 0) (+1 more), slot 0 (position 0): K differs",
        "; it holds head 2's K; rank 1: step 0 (prefill), layer 0, head 2 (rank 1's head 0) (+1 more), slot 0",
        "; it holds head 0's K",
    ],
    "tp-rank-crop": [  # rank 1's own fault (layer 0) first, then what the all-reduce carried into rank 0's layer 1
        "rollback: rank 1: forward 5 of the rollback scenario, the first after crop(24), layer 0: K/V equal, but "
        "attention reads 28 slots where the sequence fills 25",
        "; rank 0: forward 5 of the rollback scenario, the first after crop(24), layer 1,",
    ],
}


@pytest.mark.slow
def test_a_transformers_cache_bug_under_tp_is_located_on_each_rank(hf_models, tmp_path):
    """transformers' DynamicLayer storing the previous token's V on decode steps, in every rank (sitecustomize on
    PYTHONPATH): each rank names its own KV head and the model's, the slot, and what it holds."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            from transformers.cache_utils import DynamicLayer

            real = DynamicLayer.update

            def lagging(self, key_states, value_states, *args, **kwargs):
                if key_states.size(-2) == 1 and self.is_initialized:
                    value_states = self.values[..., -1:, :]
                return real(self, key_states, value_states, *args, **kwargs)

            DynamicLayer.update = lagging
            """
        )
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = ("verify", "--hf", hf_models / "llama", "--tp", 2, "-d", "cpu", *SMALL, "--caches", "dynamic", "--json")
    r = kvbench(*args, env=env)
    assert r.returncode == 1, r.stderr
    rows = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    where = rows["logits"]["location"]  # a 12-token prompt: step 1 writes slot 12
    assert where.startswith("rank 0: step 1, layer 0, head 0 (rank 0's head 0), slot 12 (position 12): V differs"), (
        where
    )
    assert "; it holds position 11's V; rank 1: step 1, layer 0, head 1 (rank 1's head 0), slot 12 " in where, where
    assert where.endswith("; it holds position 11's V"), where


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["tp-neighbour-slice", "tp-rank-crop"])
def test_faults_that_fire_only_across_ranks_are_caught_only_by_the_tp_rows(fault):
    r = kvbench("break", fault, "--tp", 2, *TINY, "-n", 8, "--reference", "none", "--json")
    assert r.returncode == 0, r.stderr
    (bug,) = json.loads(r.stdout)["bugs"]
    assert bug["detected"] and bug["caught_by"], bug
    for part in TP_LOCATIONS[fault]:
        assert part in bug["location"], (part, bug["location"])
    assert "in one process (tp 1) the faulty code passes 8 of 8 verify checks" in bug["dormant_shown"]


# --- a Hugging Face model's rank_cache: which heads each rank's cache layer holds (check/tp.py) ----------------------
class _Layer:
    """A transformers cache layer's plain keys and values, (B, H, slots, Dh)."""

    def __init__(self, k: torch.Tensor) -> None:
        self.keys, self.values = k, 2 * k

    def get_seq_length(self) -> int:
        return self.keys.size(2)


def test_a_rank_holds_its_share_of_a_layers_heads_or_every_head_where_the_plan_keeps_attention_whole():
    """transformers' plan splits some models' attention by head and keeps others' whole on every rank (a plan of
    the experts alone, or a split projection's output gathered): rank_cache compares what each layer holds."""
    from kvbench.check.rank_slices import HeldLayer, compare_slices, held_heads

    whole = [torch.randn(1, 4, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    want = [HeldLayer(_Layer(k)) for k in whole]
    split = [HeldLayer(_Layer(k[:, 2:])) for k in whole]  # rank 1 of 2: heads 2-3 of each layer
    assert held_heads(split, want, 1, 2) == [range(2, 4)] * 2
    mixed = [HeldLayer(_Layer(whole[0])), split[1]]  # layer 0 kept whole, layer 1 split
    heads = held_heads(mixed, want, 1, 2)
    assert heads == [range(4), range(2, 4)]
    row = compare_slices("dynamic", mixed, want, heads, 1e-5, 1e-5, 1)
    assert row.passed and "heads by layer 0-3, 2-3" in row.detail, row.detail
    wrong = [HeldLayer(_Layer(whole[0])), HeldLayer(_Layer(whole[1][:, :2]))]  # layer 1 holds rank 0's heads
    row = compare_slices("dynamic", wrong, want, held_heads(wrong, want, 1, 2), 1e-5, 1e-5, 1)
    assert not row.passed and "layer 1 K differs first at head 2" in row.detail, row.detail
    odd = [HeldLayer(_Layer(whole[0][:, :3])), split[1]]
    assert held_heads(odd, want, 0, 2) == (
        "rank 0's cache layer 0 holds 3 heads: neither its 1/2 share of the one-process cache's 4 nor all of them"
    )


def test_a_quantized_layer_is_not_read_as_plain_keys_and_values():
    """transformers' fp8 cache layer keeps its tokens quantized; its `keys` is an empty placeholder."""
    from transformers import cache_utils

    if not hasattr(cache_utils, "Fp8QuantizedLayer"):
        pytest.skip("transformers before 5.21 has no Fp8QuantizedLayer")
    from transformers.cache_utils import DynamicLayer, Fp8QuantizedLayer

    from kvbench.check.rank_slices import plain_layer

    k = torch.randn(1, 2, 3, 4)
    fp8, plain = Fp8QuantizedLayer(), DynamicLayer()
    for layer in (fp8, plain):
        layer.update(k, k)
        layer.update(k, k)
    assert plain_layer(plain) and not plain_layer(fp8)


@pytest.mark.parametrize(
    "model_type, splits",
    [
        ("llama", True),  # layers.*.self_attn.k_proj
        ("gpt_neox", True),  # layers.*.attention.query_key_value
        ("codegen", since({"4.0": None, "5.24": True})),  # h.*.attn.qkv_proj; no plan before 5.24
        ("deepseek_v2", True),  # layers.*.self_attn.kv_b_proj
        # the experts alone; 5.25's plan splits attention too; no plan before 5.21
        ("afmoe", since({"4.0": None, "5.21": False, "5.25": True})),
        ("deepseek_v4", since({"4.0": None, "5.21": False})),  # the experts alone: one shared KV head, replicated
        ("nemotron_h", since({"4.0": None, "5.21": False})),  # layers.*.mixer.experts
    ],
)
def test_a_plan_that_names_no_attention_module_keeps_attention_whole(model_type, splits):
    """`splits` None: the release declares no tensor-parallel plan for the type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kvbench.hf.tp import splits_attention

    plan = CONFIG_MAPPING[model_type].base_model_tp_plan
    holds(None if plan is None else splits_attention(plan), splits, f"{model_type}'s plan splits attention")


def test_rank_cache_skips_a_cache_of_layers_without_plain_keys_and_values(monkeypatch):
    """A linear-attention (or quantized) layer holds no keys and values to slice: rank_cache is skipped, saying
    which layers, and no bytes are compared (the row and the bytes travel together to rank 0)."""
    from types import SimpleNamespace

    from transformers import cache_utils

    if not hasattr(cache_utils, "Fp8QuantizedLayer"):
        pytest.skip("transformers before 5.21 has no Fp8QuantizedLayer")
    from transformers.cache_utils import DynamicLayer, Fp8QuantizedLayer

    from kvbench.check import hf_subject, tp
    from kvbench.check.judge import tolerance

    k = torch.randn(1, 2, 3, 4)
    layers = [DynamicLayer(), Fp8QuantizedLayer()]
    for layer in layers:
        layer.update(k, k)
    run = SimpleNamespace(tokens=[[5, 6]], cache=SimpleNamespace(layers=layers))
    monkeypatch.setattr(hf_subject, "generate_run", lambda *a, **kw: run)
    subject = SimpleNamespace(cache="dynamic", loaded=None, model=SimpleNamespace(loaded=None), cached=True)
    subject.tol = tolerance(torch.float32, tp=2)
    row, held = tp.hf_rank_cache(subject, [1, 2, 3], 2, SimpleNamespace(rank=0, world=2))
    assert row.skipped and "DynamicLayer, Fp8QuantizedLayer holds no plain keys" in row.detail and held is None


def test_the_planners_figure_is_left_out_where_the_planner_cannot_size_the_model(tmp_path):
    """`memory` refuses a layer kind it cannot size (DSA's indexed attention): verify --tp reports no bytes for it
    rather than refusing the run."""
    from types import SimpleNamespace

    from kvbench.check.tp import planned_hf_rank_bytes
    from kvbench.hf.tiny import tiny_config

    for name in ("llama", "axk2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(tiny_config(name), default=str))
    llama = planned_hf_rank_bytes(SimpleNamespace(source=str(tmp_path / "llama")), 10, 2, torch.float32)
    assert llama == 2 * 2 * 1 * 16 * 4 * 10  # 2 layers x K and V x 1 of 2 KV heads x head_dim 16 x 4 B
    assert planned_hf_rank_bytes(SimpleNamespace(source=str(tmp_path / "axk2")), 10, 2, torch.float32) is None


def test_a_check_that_raises_on_a_rank_ends_the_run_naming_the_check(monkeypatch):
    """Under --tp a check that raised on one rank cannot become a row (the other ranks would wait in a collective
    this rank never reaches): the run ends, exit 70, with a line naming the check, the cache and the exception, not
    a kvbench bug. Where every rank raised in the same check (a Hugging Face model's own defect: every rank runs the
    same code), it is that check's failed row on each, as without --tp."""
    from types import SimpleNamespace

    from kvbench import distributed
    from kvbench.check.suite import _guarded
    from kvbench.check.tp import IN_STEP
    from kvbench.cli.app import BUG, exit_code
    from kvbench.errors import CheckRaised, KVBenchError

    def boom():
        raise RuntimeError("The size of tensor a (13) must match the size of tensor b (16)")

    rank = SimpleNamespace(cache="dynamic", crashes=IN_STEP)
    with pytest.raises(CheckRaised) as e:
        _guarded(rank, ["rollback"], boom)
    code, line = exit_code(e.value)
    assert code == BUG and line is not None and "kvbench bug" not in line
    assert line.startswith("rollback/dynamic raised RuntimeError: The size of tensor a (13)"), line
    assert "verify without --tp reports it as a failed row" in line
    with pytest.raises(KVBenchError):  # a refusal stays a refusal
        _guarded(rank, ["logits"], lambda: (_ for _ in ()).throw(KVBenchError("no")))
    asked = []
    monkeypatch.setattr(distributed, "raised_together", lambda step: asked.append(step) or step == "rollback/dynamic")
    hf = SimpleNamespace(cache="dynamic", crashes=IN_STEP, together=True)
    (row,) = _guarded(hf, ["rollback"], boom)
    assert not row.passed and row.detail.endswith("(on every rank)") and asked == ["rollback/dynamic"]
    with pytest.raises(CheckRaised):  # another rank did not raise in it
        _guarded(SimpleNamespace(cache="static", crashes=IN_STEP, together=True), ["rollback"], boom)
    alone = SimpleNamespace(cache="dynamic", crashes=(Exception,))  # one process: the check's failed row
    (row,) = _guarded(alone, ["rollback"], boom)
    assert not row.passed and row.detail.startswith("the run raised RuntimeError: The size of tensor a (13)")


@pytest.mark.slow
def test_a_check_that_raises_on_every_rank_is_its_failed_row_located_up_to_the_raise(tmp_path):
    """Doge under transformers' plan: its dynamic mask keeps every head on each rank while the attention is split by
    head, so every forward raises on every rank. Each check is its failed row, and its location is found by the same
    replay as in one process (every rank raises at the same call, so their collectives stay paired): the K/V and
    attention outputs equal the reference until the layer that raised."""
    from kvbench.hf.models import load_hf
    from kvbench.hf.tiny import tiny_config

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(tiny_config("doge", tp=2), default=str))
    load_hf(
        str(tmp_path / "config" / "config.json"), torch.device("cpu"), torch.float32, init_std=0.02
    ).model.save_pretrained(tmp_path / "doge")
    r = kvbench("verify", "--hf", tmp_path / "doge", "--tp", 2, "-d", "cpu", "-n", 4, "--caches", "dynamic", "--json")
    assert r.returncode == 1, r.stderr
    failed = [c for c in json.loads(r.stdout)["checks"] if not c["passed"]]
    assert {c["name"] for c in failed} >= {"logits", "greedy", "batched", "rollback", "rank_cache"}, failed
    for c in failed:
        assert c["detail"].startswith("the run raised RuntimeError") and "(on every rank)" in c["detail"], c
        if c["name"] != "rank_cache":  # a run of the suite's, replayed
            assert c["location"].startswith("K/V and attention outputs equal the reference until the run raised in")


def test_rank_bytes_that_differ_from_the_planner_say_why():
    """A design whose layout the planner's generic format does not model (paged: whole blocks of 16 tokens) shows
    the difference and its own reason; the exact designs say "equal to the byte"."""
    from kvbench.check.tp import RankBytes, rank_bytes_notes

    held = [RankBytes(r, "static", 131, 134_144, 134_144) for r in (0, 1)]
    held += [RankBytes(r, "paged", 131, 147_456, 134_144) for r in (0, 1)]
    static, paged = rank_bytes_notes(held)
    assert static == "static cache per rank at 131 tokens: rank 0 134,144 B, rank 1 134,144 B; equal to the byte " + (
        "(planner: 134,144 B)"
    )
    assert paged.startswith("paged cache per rank at 131 tokens: rank 0 147,456 B, rank 1 147,456 B; planner: ")
    assert "134,144 B (+13,312 B on rank 0: the pool rounds each sequence up to whole blocks of 16 tokens" in paged
