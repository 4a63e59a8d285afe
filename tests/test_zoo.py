"""verify --hf across transformers' model zoo, a fast subset: one type for each way a model can differ from a plain
decoder with transformers' caches (per-layer head_dim, positions of its own, no left padding, no KV cache, a cache of
its own, a recurrent state, sparse top-k attention, not causal at all, not runnable alone), each from the tiny config
`kvbench.hf.tiny` writes, checked against plain transformers where kvbench claims a defect. The whole zoo is
`make zoo` (scripts/zoo.py); its release watch, `zoo.py --baseline`, is tested here on hand-written tables."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from facts import since
from kvbench.check.hf_verify import run_hf_verify
from kvbench.check.verify import random_prompts
from kvbench.errors import KVBenchError
from kvbench.hf.introspect import cache_kwarg
from kvbench.hf.models import load_hf, run_bytes
from kvbench.hf.tiny import model_types, tiny_config

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
SHORT = ("logits", "greedy", "batched", "cache_state")


def _zoo_script():
    """scripts/zoo.py as a module: its main() and the functions behind --baseline, called in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("zoo_script", ROOT / "scripts" / "zoo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


zoo = _zoo_script()
zoo_table = sys.modules["zoo_table"]  # what zoo.py imports from beside it: the table and --baseline


def config_file(tmp_path: Path, model_type: str, as_decoder: bool = True) -> Path:
    path = tmp_path / model_type / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tiny_config(model_type, as_decoder=as_decoder), default=str))
    return path


def verify(tmp_path, model_type, caches=("none", "dynamic", "static"), checks=SHORT, prompt=10, new=8, **kw):
    loaded = load_hf(str(config_file(tmp_path, model_type, **kw)), CPU, torch.float32, init_std=0.05)
    prompts = random_prompts(loaded.info.vocab_size, prompt, 3, seed=0)
    report = run_hf_verify(loaded, list(caches), prompts, new, checks=checks, short_tokens=min(new, 16))
    return loaded, {(r.name, r.cache): r for r in report.checks}, report


def test_every_causal_lm_type_has_a_tiny_config():
    types = model_types()
    assert len(types) > 150 and {"llama", "gpt2", "gemma4_text", "mamba"} <= set(types)
    c = tiny_config("llama")
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (
        64,
        2,
        4,
        2,
    )
    hybrid = tiny_config("gemma3_text")  # one layer of each kind survives the cut
    assert sorted(set(hybrid["layer_types"])) == ["full_attention", "sliding_attention"]
    assert tiny_config("bart")["is_decoder"] and not tiny_config("bart")["is_encoder_decoder"]
    assert tiny_config("bart", as_decoder=False)["is_encoder_decoder"]


def test_layer_index_lists_follow_the_cut():
    """Lists of layer indices are re-indexed to the layers kept, and a list whose values name each layer's source of
    K/V points at kept layers (transformers' Kolibri validates both)."""
    from kvbench.hf.tiny import _cut_layers

    out = {"index_layers": [4, 14], "kv_source_layers": [0, 1, 2, 3, 4, 5, 6, 4], "moe_layers": [1, 4]}
    _cut_layers(out, 8, [0, 4, 7], tp=1)
    assert out == {"index_layers": [1], "kv_source_layers": [0, 1, 1], "moe_layers": [1]}
    out = {"kv_source_layers": [0, 1, 0, 3]}
    _cut_layers(out, 4, [1, 2], tp=1)  # layer 2's source (0) is cut away: it becomes its own source
    assert out == {"kv_source_layers": [0, 1]}
    if "kolibri1_1" in model_types():  # transformers 5.25+
        c = tiny_config("kolibri1_1")
        from transformers import AutoConfig

        AutoConfig.for_model(c.pop("model_type"), **c)  # its own validators accept the cut


def test_plain_decoder_passes_every_row(tmp_path):
    _, rows, report = verify(tmp_path, "llama")
    assert report.passed and not any(r.skipped for r in rows.values()), rows


def test_per_layer_head_dim_is_read_per_layer(tmp_path):
    """Gemma 4's full-attention layers have their own head_dim (config.per_layer_config): reading it globally
    raises in transformers 5.x."""
    loaded, rows, report = verify(tmp_path, "gemma4_text", caches=("dynamic",), checks=("logits", "greedy"))
    assert report.passed, rows
    info = loaded.info
    cfg = loaded.model.config.get_text_config(decoder=True)
    widths = [layer.num_key_value_heads * layer.head_dim for layer in cfg.per_layer_config]
    assert info.kv_widths == widths and len(set(widths)) == 2
    # the memory allowance counts each layer's own width: K and V of every layer, twice (see run_bytes)
    plain = run_bytes(info, 1, 10, 4) - run_bytes(info, 1, 0, 4)
    assert plain >= 2 * 2 * sum(widths) * 10 * 4
    assert any("head_dim 16 / 32 by layer" in n for n in report.notes)


def test_positions_are_fed_as_generate_feeds_them(tmp_path):
    """RoBERTa-family decoders count positions from padding_idx + 1 by default, while generate passes 0, 1, ...:
    the logits reference must feed what generate feeds (else every row fails at the scale of the logits)."""
    loaded, rows, _ = verify(tmp_path, "roberta", caches=("dynamic",), checks=("logits",))
    assert rows["logits", "dynamic"].passed, rows["logits", "dynamic"]
    ids = torch.tensor([[10, 11, 12, 13]])
    default = loaded.model(input_ids=ids).logits
    zero_based = loaded.model(input_ids=ids, position_ids=torch.arange(4)[None]).logits
    assert (default - zero_based).abs().max() > 0.05  # the two position conventions really differ


def test_a_model_without_left_padding_skips_the_cache_rows(tmp_path):
    _, rows, report = verify(tmp_path, "blenderbot", prompt=32, new=16)
    none = rows["batched", "none"]
    assert not none.passed and "blenderbot does not support left-padded batches" in none.detail
    assert "takes no position ids" in none.detail
    for cache in ("dynamic", "static"):
        row = rows["batched", cache]
        assert row.skipped and "see batched/none" in row.detail
        assert rows["logits", cache].passed and rows["greedy", cache].passed
    assert not report.passed  # the model's own defect fails the run, on its own row


def test_the_no_cache_baseline_runs_even_when_none_is_not_asked(tmp_path):
    _, rows, _ = verify(tmp_path, "blenderbot", caches=("dynamic",), checks=("batched",), prompt=32, new=16)
    # the model's own failure is reported even so: it is why the cache's row is skipped
    assert not rows["batched", "none"].passed and rows["batched", "dynamic"].skipped


@pytest.mark.parametrize(
    "model_type, reason",
    [
        ("openai-gpt", "has no KV cache: a forward with use_cache=True returns no cache"),
        ("minimax", "keeps a cache of its own"),
        ("mamba", "keeps a recurrent state, no KV cache"),
    ],
)
def test_models_that_do_not_use_transformers_caches_skip_with_the_reason(tmp_path, model_type, reason):
    _, rows, report = verify(tmp_path, model_type, caches=("dynamic", "static"), checks=("logits",))
    assert report.nothing_checked and not report.passed  # every row skipped: no pass
    for cache in ("dynamic", "static"):
        assert rows["-", cache].skipped and reason in rows["-", cache].detail


def test_sparse_top_k_attention_is_judged_exactly_within_top_k_and_explained_beyond(tmp_path):
    """A DSA indexer keeps the top 8 keys: beyond 8 keys a tie may pick differently in the cache and in the
    recomputation (not judged, with the measured figures); at most 8 keys it is dense, judged exactly."""
    _, rows, report = verify(tmp_path, "axk2", caches=("dynamic", "static"), prompt=4, new=4)
    assert report.passed and not any(r.skipped for r in rows.values()), rows
    _, rows, _ = verify(tmp_path, "axk2", caches=("dynamic", "static"), prompt=16, new=16)
    unjudged = [r for r in rows.values() if r.skipped]
    assert all("top 8 of up to" in r.detail and "measured:" in r.detail for r in unjudged)
    assert all(r.passed for r in rows.values())


def test_quantized_caches_skip_a_layer_kind_transformers_quantizes_not(tmp_path):
    """transformers' QuantizedCache raises on any layer kind but full attention, DSA's `indexed_attention`
    included: those rows skip with the kind named rather than fail (or, under --tp, end the run)."""
    from kvbench.hf.caches import HF_CACHES

    loaded, rows, report = verify(tmp_path, "axk2", caches=("quantized-fp8",), checks=("logits",))
    assert "indexed_attention" in loaded.info.config_layer_types
    row = rows["-", "quantized-fp8"]
    assert row.skipped and report.nothing_checked, row  # its one row skipped: nothing checked (exit 5)
    assert row.detail == "QuantizedCache holds full-attention layers only; this model has indexed_attention layers"
    llama = load_hf(str(config_file(tmp_path, "llama")), CPU, torch.float32).info
    assert set(llama.config_layer_types) == {"full_attention"}
    why = HF_CACHES["quantized-fp8"].unavailable(llama, CPU)
    if since({"4.0": False, "5.21": True}):  # transformers' fp8 backend
        assert why is None, why
    else:
        assert "has no fp8 cache backend" in why, why


@pytest.mark.parametrize(
    "model_type, as_decoder, message",
    [
        ("cpmant", True, "cpmant is not a causal decoder here"),
        (
            "bert-generation",
            False,
            "its config has is_decoder: false (is_decoder: true runs it as a decoder)",
        ),
        ("xlnet", True, "its config has attn_type: 'bi'"),
        ("xlm", True, "appends a mask token to every input in generate"),
        ("gemma4_assistant", True, "cannot run on its own: its forward over 12 tokens raised ValueError"),
    ],
)
def test_what_is_not_a_causal_decoder_is_refused_in_one_line(tmp_path, model_type, as_decoder, message):
    with pytest.raises(KVBenchError) as e:
        verify(tmp_path, model_type, caches=("dynamic",), checks=("logits",), as_decoder=as_decoder)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_gpt_neo_static_defect_matches_plain_transformers(tmp_path):
    """kvbench fails GPT-Neo's StaticCache and passes its DynamicCache; plain transformers, with no kvbench code,
    shows the same: a static-cache prefill differs from the no-cache forward (its local-attention window is taken
    from the end of the static buffer)."""
    from transformers import StaticCache

    loaded, rows, _ = verify(tmp_path, "gpt_neo", caches=("dynamic", "static"), checks=("logits",), prompt=20, new=8)
    assert rows["logits", "dynamic"].passed and not rows["logits", "static"].passed
    model = loaded.model
    ids = torch.randint(10, 1000, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        cache = StaticCache(config=model.config, max_cache_len=40)
        static = model(input_ids=ids, use_cache=True, **{cache_kwarg(): cache}).logits
    assert (plain - static).abs().max() > 1e-3


@pytest.mark.slow  # scripts/zoo.py twice, each type in a fresh Python
def test_the_sweep_writes_rows_as_it_goes_and_resumes(tmp_path):
    out = tmp_path / "zoo"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "zoo.py"),
        "--out",
        str(out),
        "--new-tokens",
        "4",
        "--caches",
        "none,dynamic",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    first = subprocess.run([*cmd, "--types", "openai-gpt,xlm"], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    rows = (out / "zoo.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith("openai-gpt,5,") and rows[2].startswith("xlm,2,"), rows
    summary = (out / "summary.md").read_text()
    assert "| nothing checked | 1 |" in summary and "| refused | 1 |" in summary
    assert "appends a mask token" in summary and "has no KV cache" in summary  # the refusal, the skip reason
    again = subprocess.run(
        [*cmd, "--types", "openai-gpt,xlm,cpmant"], capture_output=True, text=True, env=env, timeout=300
    )
    assert again.returncode == 0 and "openai-gpt" not in again.stdout and "cpmant: refused" in again.stdout
    assert len((out / "zoo.csv").read_text().splitlines()) == 4


@pytest.mark.slow  # scripts/zoo.py --tp 2: each type saved, then two ranks launched
def test_the_tp_sweep_saves_each_model_and_splits_it_over_two_ranks(tmp_path):
    """zoo.py --tp 2 runs the types with a tensor-parallel plan, each saved (every rank loads the same weights)
    and checked by `verify --hf DIR --tp 2`: CodeGen passes; Doge's plan keeps its dynamic mask's heads whole while
    it splits the attention by head, so every forward raises on every rank: each check its failed row, naming it;
    Sarvam-MoE's checkpoint holds q, k and v fused, and transformers shards the fused tensor before it splits it,
    so the split model does not load: refused, with transformers' line."""
    out = tmp_path / "zoo-tp"
    cmd = [sys.executable, str(ROOT / "scripts" / "zoo.py"), "--tp", "2", "--out", str(out)]
    cmd += ["--new-tokens", "4", "--caches", "dynamic", "--types", "codegen,doge,sarvam_moe"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert first.returncode == 0, first.stderr
    rows = list(csv.DictReader((out / "zoo.csv").open()))
    verdicts = [(r["type"], r["exit"], r["verdict"]) for r in rows]
    assert verdicts == [("codegen", "0", "pass"), ("doge", "1", "fail"), ("sarvam_moe", "2", "refused")], rows
    # every rank refuses; the launcher names the rank whose line came first (rank 0's own, or "rank 1: ...")
    refused = re.sub(r"^rank \d+: ", "", rows[2]["error"])
    assert refused.startswith("cannot load ") and "automatic conversion of the weights" in refused, rows[2]
    assert rows[1]["failing"].startswith("logits/dynamic greedy/dynamic") and "rank_cache/dynamic" in rows[1]["failing"]
    assert (out / "models" / "codegen" / "config.json").exists() and (out / "configs" / "doge" / "config.json").exists()
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# `kvbench verify --hf --tp 2` over transformers' causal-LM types with a tensor")
    assert "| pass | 1 |" in summary and "| fail | 1 |" in summary and "| refused | 1 |" in summary
    assert "Partial" not in summary
    recorded = json.loads((out / "zoo.json").read_text())
    settings = {k: v for k, v in recorded.items() if k not in zoo.RECORDED}
    assert settings == {"caches": "dynamic", "new_tokens": 4, "tp": 2}
    assert recorded["transformers"] and recorded["torch"]
    lines = (out / "zoo.csv").read_text().splitlines()
    (out / "zoo.csv").write_text("\n".join(lines[:2]) + "\n")  # two rows deleted: the summary of what is left
    partial = subprocess.run([*cmd, "--summary"], capture_output=True, text=True, env=env, timeout=120)
    assert partial.returncode == 0 and "1 of 3 types have a row" in partial.stdout, partial.stderr
    assert "Partial: 1 of 3 types have a row; the same command runs the other 2." in (out / "summary.md").read_text()
    gpt2 = subprocess.run([*cmd[:-1], "gpt2"], capture_output=True, text=True, env=env, timeout=120)
    assert gpt2.returncode == 2 and "whose config declares base_model_tp_plan (--tp)" in gpt2.stderr


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_json_stays_one_document_when_the_model_prints(tmp_path, monkeypatch):
    """Some models print() from their forward (Reformer warns about its inputs on stdout): with --json stdout is
    still one JSON document."""
    from transformers import LlamaForCausalLM
    from typer.testing import CliRunner

    from kvbench.cli import app

    forward = LlamaForCausalLM.forward

    def chatty(self, *args, **kwargs):
        print("Warning: a model that talks on stdout")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", chatty)
    r = CliRunner().invoke(
        app,
        [
            "verify",
            "--hf",
            str(config_file(tmp_path, "llama")),
            *"--device cpu --caches dynamic --new-tokens 4 --json".split(),
        ],
    )
    assert r.exit_code in (0, 1) and json.loads(r.stdout)["checks"], r.output
    assert "a model that talks on stdout" in r.stderr


@pytest.mark.slow  # a fresh Python
def test_json_stays_one_document_when_refused(tmp_path):
    """A refusal has no report: with --json stdout is one JSON document even so."""
    refused = _cli("verify", "--hf", str(config_file(tmp_path, "xlm")), "--json")
    assert refused.returncode == 2 and json.loads(refused.stdout)["error"].endswith("--hf cannot check it")
    assert refused.stderr.count("\n") == 1 and "appends a mask token" in refused.stderr


@pytest.mark.slow  # a fresh Python
def test_bench_hf_times_only_what_the_model_has(tmp_path):
    """bench --hf follows verify's rules: a model without a KV cache times `none` only, and says why."""
    r = _cli(
        "bench",
        "--hf",
        str(config_file(tmp_path, "openai-gpt")),
        *"--device cpu --prompt-len 8 --new-tokens 4 --repeats 1 --warmup 0 --caches none,dynamic,static --out".split(),
        str(tmp_path / "run"),
    )
    assert r.returncode == 0, r.stderr
    assert "dynamic, static not timed: OpenAIGPTLMHeadModel has no KV cache" in r.stderr
    rows = (tmp_path / "run" / "summary.csv").read_text().splitlines()
    assert len(rows) == 2 and ",none," in rows[1]


@pytest.mark.slow  # two fresh Pythons; --check builds transformers' cache on the meta device
def test_memory_plans_per_layer_head_dim_as_transformers_allocates_it(tmp_path):
    """Gemma 4 sets head_dim per layer: the planner counts each layer's own K/V shape, to the byte of transformers'
    own StaticCache (--check), and the per-token figure is the sum over layers of 2 x kv_heads x head_dim x 2 B."""
    from transformers import AutoConfig

    path = config_file(tmp_path, "gemma4_text")
    r = _cli("memory", "--config", str(path), "--ctx", "64,1k", "--check", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    cfg = AutoConfig.from_pretrained(path.parent)
    want = sum(2 * layer.num_key_value_heads * layer.head_dim * 2 for layer in cfg.per_layer_config)
    assert {layer.head_dim for layer in cfg.per_layer_config} == {16, 32}
    plan = doc["plans"][0] if "plans" in doc else doc
    assert plan["bytes_per_token"] == want, plan["bytes_per_token"]
    assert "agrees to the byte" in json.dumps(doc) and "differs" not in json.dumps(doc).lower()
    # an attribute the planner holds once for every layer, set per layer: refused by name
    r = _cli("memory", "--config", str(config_file(tmp_path, "dots3_note_text")), "--ctx", "1k")
    assert r.returncode == 2 and "sets kv_lora_rank per layer" in r.stderr and r.stderr.count("\n") == 1


def test_a_per_layer_mlp_width_list_is_a_valid_config_field(tmp_path):
    """Gemma 3n gives intermediate_size per layer, as a list of whole numbers."""
    from kvbench.memory.config import check_fields

    check_fields({"intermediate_size": [128, 256]}, tmp_path)
    for bad in ([128, "a"], [], [True]):
        with pytest.raises(KVBenchError, match="intermediate_size"):
            check_fields({"intermediate_size": bad}, tmp_path)


def _slow(*values):
    """A row of the slow tier: a fresh Python that imports transformers before it answers."""
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--new-tokens", "1"], "--new-tokens must be >= 2"),  # refused before any import
        _slow(["--types", ",,"], "--types names no model type"),
        _slow(["--out", "FILE"], "Not a directory"),
        _slow(["--out", "BADTABLE"], "is not a zoo table"),
        _slow(["--types", "LLAMA"], "unknown model type(s) LLAMA"),
        _slow(["--caches", "bogus"], "--caches: unknown cache 'bogus'"),
        _slow(["--out", "OTHER", "--new-tokens", "8"], "was made with other settings"),
    ],
)
def test_the_sweep_refuses_bad_input_in_one_line(tmp_path, args, message):
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "BADTABLE").mkdir()
    (tmp_path / "BADTABLE" / "zoo.csv").write_text("a,b\n1,2\n")
    (tmp_path / "OTHER").mkdir()  # a table made with --new-tokens 4: resuming it with 8 would mix two settings
    (tmp_path / "OTHER" / "zoo.csv").write_text(
        ",".join(("type", "exit", "seconds", "verdict", "failing", "skips", "error")) + "\n"
    )
    (tmp_path / "OTHER" / "zoo.json").write_text('{"caches": "none,dynamic,static", "new_tokens": 4}')
    args = [str(tmp_path / a) if a in ("FILE", "BADTABLE", "OTHER") else a for a in args]
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "zoo.py"), "--types", "xlm", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (tmp_path / "BADTABLE" / "zoo.csv").read_text() == "a,b\n1,2\n"  # nothing overwritten


@pytest.mark.parametrize(
    "override, message",
    [
        (
            {"num_key_value_heads": 3},
            "layer 1's 4 attention heads are not a multiple of its 3 key/value heads",
        ),
        _slow(
            {"head_dim": 10**30},
            "layer 1's head_dim = 1000000000000000000000000000000 must be a whole number",
        ),
        _slow(
            {"num_attention_heads": 3},
            "layer 1's 3 attention heads are not a multiple of its 2 key/value heads",
        ),
    ],
)
def test_memory_holds_each_layer_to_the_bounds_of_the_whole_model(tmp_path, override, message):
    """A value set for one layer gets the checks the same value set for the model gets: one line, exit 2."""
    config = tiny_config("gemma4_text")
    config["per_layer_config"] = {"01": {"head_dim": 32, **override}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config, default=str))
    r = _cli("memory", "--config", str(path), "--ctx", "1k")
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_an_exception_whose_first_line_introduces_the_next_keeps_it():
    from kvbench.errors import one_line

    e = ValueError("Validation error for field 'index_topk':\n    TypeError: must be an int\nmore")
    assert one_line(e) == "ValueError: Validation error for field 'index_topk': TypeError: must be an int"
    assert one_line(ValueError("first\nsecond")) == "ValueError: first" and one_line(ValueError()) == "ValueError"


# ---- zoo.py --baseline: the rows that moved between two sweeps, each classed (hand-written tables, no sweep) ----

NOT_CROPPABLE = "transformers declares this DynamicCache not croppable"
HEADER = "type,exit,seconds,verdict,failing,skips,error\n"
ENTRY = '[[triage]]\ntypes = ["a"]\n'


def _row(t, verdict="pass", failing="", skips="", error="", seconds="1.0"):
    code = {"pass": 0, "pass with skips": 0, "fail": 1, "nothing checked": 5, "refused": 2}.get(verdict, "")
    row = {"type": t, "exit": code, "seconds": seconds, "verdict": verdict}
    return row | {"failing": failing, "skips": skips, "error": error}


def _table(folder: Path, rows: list[dict], transformers: str | None = None) -> Path:
    """A zoo.csv of `rows` in `folder`, with a zoo.json recording `transformers` when given."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "zoo.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, zoo.FIELDS)
        w.writeheader()
        w.writerows(rows)
    if transformers:
        recorded = {"caches": "none,dynamic,static", "new_tokens": 32, "transformers": transformers, "torch": "2.13.0"}
        (folder / "zoo.json").write_text(json.dumps(recorded))
    return folder / "zoo.csv"


BASELINE = [
    _row("llama"),
    _row("gpt2"),
    _row("bamba", "pass with skips", skips=NOT_CROPPABLE),
    _row("jamba", "fail", failing="chunked_prefill/dynamic"),
    _row("xlm", "refused", error="/tmp/a/configs/xlm/config.json: xlm appends a mask token"),
    _row("gone"),
]
SWEEP = [
    _row("llama", seconds="9.9"),  # only the time moved: not a moved row
    _row("gpt2", "fail", failing="logits/static"),
    _row("bamba", "fail", failing="rollback/dynamic rollback/static"),
    _row("jamba", "fail", failing="chunked_prefill/dynamic rollback/static"),
    _row("xlm", "refused", error="zoo525/configs/xlm/config.json: xlm appends a mask token"),  # another --out only
    _row("fresh"),
]
TRIAGE = """
[[triage]]
types = ["bamba", "jamba"]
transformers = "5.25"
class = "kvbench reading"
note = "kvbench now passes recurrent_states_to_keep"

[[triage]]
types = ["bamba"]
transformers = "5.25"
class = "transformers defect"
note = "recording turns StaticCache's compileability off"
reproducer = "python results/zoo/repros-5.25/static_rec3.py results/zoo/configs/bamba"
"""


def _diff(tmp_path, capsys, sweep=SWEEP, release="5.25.0", triage=TRIAGE, against=False):
    """zoo.py --baseline over BASELINE (transformers 5.24.0, TRIAGE beside it) and `sweep` (`release`), the sweep
    named by --out, or by --against (then diff.md goes beside it)."""
    base = _table(tmp_path / "base", BASELINE, "5.24.0")
    (tmp_path / "base" / "triage.toml").write_text(triage)
    new = _table(tmp_path / "new", sweep, release)
    code = zoo.main(["--baseline", str(base), *(["--against", str(new)] if against else ["--out", str(new.parent)])])
    return code, capsys.readouterr().out


def test_the_diff_prints_each_moved_row_with_its_class_and_the_versions(tmp_path, capsys):
    code, out = _diff(tmp_path, capsys)
    assert "(transformers 5.24.0, torch 2.13.0)" in out and "(transformers 5.25.0, torch 2.13.0)" in out
    assert "5 rows moved (6 types in the sweep): 1 new, 1 removed, 4 triaged, 1 untriaged" in out
    lines = out.splitlines()
    assert "bamba: pass with skips -> fail" in lines and "  class: kvbench reading + transformers defect" in lines
    assert "  failing: +rollback/dynamic +rollback/static" in lines and f"  skip gone: {NOT_CROPPABLE}" in lines
    rows = "\n".join(lines)
    assert rows.count("\n  class: ") == 5  # gpt2, bamba, jamba, fresh, gone
    assert "jamba: fail -> fail\n  class: kvbench reading\n  failing: +rollback/static\n" in rows
    assert "gpt2: pass -> fail\n  class: worse, untriaged\n" in rows
    assert "fresh: (absent) -> pass\n  class: new type\ngone: pass -> (absent)\n  class: removed type\n" in rows
    assert not any(line.startswith(("llama", "xlm")) for line in lines)  # the seconds, the --out folder: not moves
    assert code == 1  # gpt2 is untriaged; a new or removed type is classed by that alone
    table = (tmp_path / "new" / "diff.md").read_text()
    assert "| gpt2 | worse, untriaged | pass -> fail | failing: +logits/static |  |" in table
    assert "| bamba | kvbench reading + transformers defect | pass with skips -> fail |" in table
    assert table.count("recording turns StaticCache's compileability off") == 1  # a finding once, cited by number
    assert "   - reproducer: `python results/zoo/repros-5.25/static_rec3.py results/zoo/configs/bamba`" in table


def test_the_diff_exits_0_once_every_moved_row_is_triaged(tmp_path, capsys):
    fixed = [_row("gpt2") if r["type"] == "gpt2" else r for r in SWEEP]
    code, out = _diff(tmp_path, capsys, fixed, against=True)
    assert code == 0 and "0 untriaged" in out and (tmp_path / "new" / "diff.md").exists(), out
    code, out = _diff(tmp_path, capsys, BASELINE)
    assert code == 0 and "nothing moved: the 6 types of the sweep have the baseline's rows" in out


def test_a_triage_entry_holds_for_its_release_only(tmp_path, capsys):
    code, out = _diff(tmp_path, capsys, SWEEP, "5.26.0")
    assert code == 1 and "bamba: pass with skips -> fail\n  class: worse, untriaged\n" in out, out
    code, out = _diff(tmp_path, capsys, SWEEP, "5.26.0", TRIAGE.replace('transformers = "5.25"\n', ""))
    assert code == 1 and "bamba: pass with skips -> fail\n  class: kvbench reading + transformers defect" in out


@pytest.mark.parametrize(
    "before, after, label",
    [
        (_row("t", "pass"), _row("t", "fail", failing="logits/static"), "worse"),
        (_row("t", "refused", error="not causal"), _row("t", "pass"), "better"),
        (_row("t", "pass with skips", skips=NOT_CROPPABLE), _row("t", "nothing checked", skips="no KV cache"), "worse"),
        (_row("t", "fail", failing="a/dynamic b/static"), _row("t", "fail", failing="b/static"), "better"),
        (_row("t", "fail", failing="b/static"), _row("t", "fail", failing="b/static a/dynamic"), "worse"),
        (_row("t", "fail", failing="a/dynamic"), _row("t", "fail", failing="b/static"), "changed"),
        (_row("t", "fail", failing="a/dynamic"), _row("t", "nothing checked", skips="no KV cache"), "changed"),
        (_row("t", "pass with skips", skips=f"x | {NOT_CROPPABLE}"), _row("t", "pass with skips", skips="x"), "better"),
        (_row("t", "refused", error="cannot load: A"), _row("t", "refused", error="cannot load: B"), "changed"),
    ],
)
def test_an_untriaged_row_gets_a_provisional_class(before, after, label):
    (row,) = zoo_table.moved({"t": before}, {"t": after}, [], None)
    assert row["classes"] == [label] and not row["triaged"]


@pytest.mark.parametrize(
    "where, text, message",
    [
        ("baseline", "type,verdict\nllama,pass\n", "is not a zoo table (columns type, exit, seconds"),
        ("baseline", f"{HEADER}llama,0,1\n", "line 2 does not have the 7"),
        ("baseline", f"{HEADER}llama,0,1,great,,,\n", "line 2: verdict 'great' is not one of pass"),
        ("baseline", f"{HEADER}a,0,1,pass,,,\na,0,1,pass,,,\n", "line 3: a has a row already"),
        ("baseline", None, "zoo.csv: file not found"),
        ("baseline", b"\xff\xfe", "is not UTF-8 text"),
        ("triage", f'{ENTRY}class = "kvbench reading"\nnote = "n"\nwhy = 1\n', "unknown key 'why'"),
        ("triage", f'{ENTRY}class = "transformers defect"\nnote = "n"\n', "needs a `reproducer`"),
        ("triage", f'{ENTRY}class = "bug"\nnote = "n"\n', "`class` must be one of"),
        ("triage", f'{ENTRY}class = "kvbench reading"\nnote = "n"\ntransformers = 5.25\n', "must be text, in quotes"),
        ("triage", '[[triage]]\ntypes = "a"\nclass = "kvbench reading"\nnote = "n"\n', "`types` must be a list"),
        ("triage", "[a\n", "is not valid TOML"),
    ],
)
def test_the_diff_refuses_a_table_or_triage_file_that_is_not_one_in_one_line(tmp_path, capsys, where, text, message):
    base = _table(tmp_path / "base", BASELINE)
    path = base if where == "baseline" else tmp_path / "base" / "triage.toml"
    if text is None:
        path.unlink()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    _table(tmp_path / "new", SWEEP)
    with pytest.raises(SystemExit) as e:
        zoo.main(["--baseline", str(base), "--out", str(tmp_path / "new")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_the_diff_refuses_bad_input_in_one_line_from_the_command_line(tmp_path):
    """The wiring, once: a garbled baseline is exit 2 and one line, no traceback, in a fresh Python; so is a
    baseline that is the sweep's own table."""
    garbled = tmp_path / "zoo.csv"
    garbled.write_text("type,exit\nllama,0\n")
    sweep = _table(tmp_path / "new", SWEEP)
    script = [sys.executable, str(ROOT / "scripts" / "zoo.py"), "--baseline"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for baseline, message in ((garbled, "is not a zoo table"), (sweep, "is the sweep's own table")):
        r = subprocess.run([*script, str(baseline), "--against", str(sweep)], capture_output=True, text=True, env=env)
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert "Traceback" not in r.stderr and not r.stdout


def test_the_committed_triage_file_is_valid_and_its_reproducers_exist():
    entries = zoo_table.read_triage(ROOT / "results" / "zoo" / "triage.toml", "triage.toml")
    assert {e["class"] for e in entries} == set(zoo_table.TRIAGE_CLASSES)
    for e in entries:
        scripts = re.findall(r"results/zoo/repros-[\w.]+/\w+\.py", e.get("reproducer", ""))
        assert not e.get("reproducer") or scripts, e
        assert all((ROOT / s).is_file() for s in scripts), scripts


def _options(tmp_path, **kw):
    import argparse

    args = {"caches": "none,dynamic", "new_tokens": 4, "tp": 1, "fresh": False, "summary": False} | kw
    return argparse.Namespace(**args)


def test_a_sweep_records_its_versions_and_a_resumed_one_keeps_its_release(tmp_path, capsys):
    import transformers

    path = tmp_path / "zoo.json"
    zoo._same_options(path, _options(tmp_path))
    recorded = json.loads(path.read_text())
    assert recorded["caches"] == "none,dynamic" and recorded["transformers"] == transformers.__version__
    assert recorded["torch"].split("+")[0] == torch.__version__.split("+")[0] and "kvbench_commit" in recorded
    (tmp_path / "zoo.csv").write_text(",".join(zoo.FIELDS) + "\n")
    zoo._same_options(path, _options(tmp_path))  # a resumed table, the same release: kept as made
    assert json.loads(path.read_text()) == recorded
    path.write_text(json.dumps(recorded | {"transformers": "5.0.0"}))
    with pytest.raises(SystemExit):
        zoo._same_options(path, _options(tmp_path))
    assert "was made with transformers 5.0.0 (zoo.json), this is" in capsys.readouterr().err
    zoo._same_options(path, _options(tmp_path, summary=True))  # --summary runs nothing: the rows stay as they are
    path.write_text('{"caches": "none,dynamic", "new_tokens": 4}')  # made before versions were recorded
    zoo._same_options(path, _options(tmp_path))
    assert json.loads(path.read_text()) == {"caches": "none,dynamic", "new_tokens": 4}  # nothing claimed for it
