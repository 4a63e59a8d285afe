"""A lossy cache's cost (check/distortion.py): the figures against an independent computation, zero for exact caches,
positive and bounded for int8 and larger for a coarser quantiser, both paths fed the full-precision path's tokens,
the depth bins; verify's `distortion` member and line, bench's columns, distortion.csv and distortion.png."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import io
import json

import jsonschema
import pandas as pd
import pytest
import torch
from rich.console import Console
from scipy.special import rel_entr
from typer.testing import CliRunner

from kvbench.caches import make_caches
from kvbench.caches.int8 import make_int8_cache
from kvbench.caches.static import StaticCache
from kvbench.check.distortion import (
    RANDOM_NOTE,
    CachePath,
    Steps,
    depth_bin,
    measure_layers,
    step_figures,
    summarise,
    teacher_forced,
)
from kvbench.check.verify import random_prompts, run_verify
from kvbench.cli import app
from kvbench.jsonio import load_schema
from tiny import tiny_llama

TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]


# --- the figures -------------------------------------------------------------------------------------------------
def test_step_figures_match_scipy_and_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(3, 4, 11, generator=g), torch.randn(3, 4, 11, generator=g)
    q_logits[0, 0] = p_logits[0, 0]  # one step where the two are equal
    kl, top1, dp = step_figures(p_logits, q_logits)
    p, q = p_logits.double().softmax(-1), q_logits.double().softmax(-1)
    want_kl = torch.tensor(rel_entr(p.numpy(), q.numpy()).sum(-1))
    assert torch.allclose(kl, want_kl, rtol=1e-12, atol=1e-15) and kl[0, 0] == 0 and (kl[1:] > 0).all()
    for b in range(3):
        for i in range(4):
            t = int(p[b, i].argmax())
            assert bool(top1[b, i]) == (int(q[b, i].argmax()) == t)
            assert float(dp[b, i]) == pytest.approx(abs(float(q[b, i, t] - p[b, i, t])), abs=1e-15)
    assert top1[0, 0] and not top1.all()  # these random logits disagree somewhere


def test_a_token_ruled_out_makes_kl_infinite_only_where_the_reference_gives_it_probability():
    p = torch.tensor([[0.0, 1.0, float("-inf")]])  # p gives token 2 no probability
    kl, _, _ = step_figures(p, torch.tensor([[0.0, 1.0, 3.0]]))
    assert torch.isfinite(kl).all()
    kl, _, _ = step_figures(p, torch.tensor([[float("-inf"), 1.0, 0.0]]))  # q rules out token 0, which p allows
    assert torch.isinf(kl).all()


@pytest.mark.parametrize(("depth", "bin_"), [(1, (1, 1)), (31, (16, 31)), (32, (32, 63)), (1057, (1024, 2047))])
def test_depth_bins_are_powers_of_two(depth, bin_):
    assert depth_bin(depth) == bin_


def test_summary_pools_steps_by_depth_and_sequences():
    kl = torch.tensor([[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]], dtype=torch.float64)  # (B=2, N=4)
    top1 = torch.tensor([[True, True, False, True], [True, False, False, True]])
    dp = kl / 10
    d = summarise("x", Steps(kl, top1, dp, [30, 31, 32, 33]), "ref", "note", kv_bytes=25, ref_bytes=100)
    assert [(b.depth_from, b.depth_to, b.steps) for b in d.by_depth] == [(16, 31, 4), (32, 63, 4)]
    assert d.by_depth[0].kl_mean == (0 + 1 + 4 + 5) / 4 and d.by_depth[1].kl_max == 7
    assert d.by_depth[0].top1_agreement == 3 / 4 and d.by_depth[1].top1_agreement == 2 / 4
    assert d.kl_mean == 3.5 and d.kl_max == 7 and d.top1_agreement == 5 / 8 and d.mean_abs_dp == pytest.approx(0.35)
    assert d.per_step == {
        "depth": [30, 31, 32, 33],
        "kl": [2, 3, 4, 5],
        "top1": [1, 0.5, 0, 1],
        "abs_dp": d.per_step["abs_dp"],
    }
    doc = d.as_dict()
    assert doc["bytes_saved"] == 75 and doc["bytes_saved_fraction"] == 0.75 and d.sequences == 2 and d.steps == 4


# --- measured on a model -----------------------------------------------------------------------------------------
class CoarseCache(StaticCache):
    """A static cache that stores K and V rounded to multiples of 0.25: a far coarser quantiser than int8's."""

    def update(self, k, v, positions):
        return super().update((k * 4).round() / 4, (v * 4).round() / 4, positions)


class Recorder:
    """A path that records the tokens it is fed."""

    def __init__(self, path) -> None:
        self.path, self.fed = path, []

    def forward(self, ids):
        self.fed.append(ids)
        return self.path.forward(ids)


def _paths(model, first, new, lossy_factory):
    B, size = len(first), len(first[0]) + new - 1
    cfg = model.cache_config
    full = make_caches("static", cfg, B, size, torch.float32, "cpu")
    lossy = [lossy_factory(cfg, B, size, torch.float32, torch.device("cpu")) for _ in range(cfg.n_layer)]
    return Recorder(CachePath(model, full)), Recorder(CachePath(model, lossy))


def test_exact_caches_cost_nothing_int8_a_little_and_a_coarse_quantiser_more(tiny_model):
    prompts = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1)).tolist()
    for cache in ("dynamic", "paged"):
        d = measure_layers(tiny_model, cache, prompts, 20)
        assert d.kl_max < 1e-12 and d.top1_agreement == 1 and d.max_abs_dp < 1e-9, (cache, d)
    int8 = measure_layers(tiny_model, "int8", prompts, 20)
    assert 0 < int8.kl_mean <= int8.kl_max < 1e-2 and int8.top1_agreement >= 0.9 and int8.mean_abs_dp > 0, int8
    assert [(b.depth_from, b.steps) for b in int8.by_depth] == [(8, 2 * 4), (16, 2 * 16)]  # depths 12..31
    Dh = tiny_model.config.head_dim  # int8 stores Dh bytes + one fp32 scale per token per head, fp32 4 x Dh
    assert int8.kv_bytes / int8.reference_kv_bytes == (Dh + 4) / (4 * Dh), int8

    full, coarse = _paths(
        tiny_model, prompts, 20, lambda cfg, B, n, dt, dev: CoarseCache(B, cfg.n_head, n, cfg.head_dim, dt, dev)
    )
    steps = teacher_forced(full, coarse, prompts, 20)
    assert steps.kl.mean() > 10 * int8.kl_mean and not steps.top1.all()  # a coarser quantiser costs more
    # both paths were fed the full-precision path's greedy tokens, also where the coarse path would choose another
    assert coarse.fed == full.fed and len(full.fed) == 20 and full.fed[0] == prompts


def test_teacher_forcing_follows_the_full_precision_path(tiny_model):
    prompts = [torch.randint(0, 500, (10,), generator=torch.Generator().manual_seed(2)).tolist()]
    full, lossy = _paths(tiny_model, prompts, 6, make_int8_cache)
    teacher_forced(full, lossy, prompts, 6)
    ref = make_caches("static", tiny_model.cache_config, 1, 16, torch.float32, "cpu")
    logits = tiny_model(torch.tensor(prompts), torch.arange(10)[None], ref)[0, -1]
    assert full.fed[1] == [[int(logits.argmax())]]  # step 1 feeds the full-precision path's greedy token


# --- verify ------------------------------------------------------------------------------------------------------
def test_verify_reports_each_lossy_cache_and_only_those(tiny_model):
    prompts = random_prompts(500, 10, 2, seed=0)
    rep = run_verify(
        tiny_model, ["dynamic", "int8"], prompts, 8, reference="none", checks=("logits",), random_weights=True
    )
    assert list(rep.distortion) == ["int8"], rep.distortion
    d = rep.distortion["int8"]
    assert (
        d["steps"] == 8
        and sum(b["steps"] for b in d["by_depth"]) == 8
        and d["per_step"]["depth"] == list(range(10, 18))
    )
    assert d["note"] == RANDOM_NOTE and d["reference"].startswith("static") and 0 < d["bytes_saved_fraction"] < 1
    schema = load_schema("verify")
    doc = {"schema_version": 1, "passed": rep.passed, "model": "m", "weights": "w", "device": "cpu", "dtype": "fp32"}
    jsonschema.Draft202012Validator(schema).validate({**doc, **_asdict(rep)})

    from kvbench.cli import verify_render

    screen = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    verify_render.out, old = screen, verify_render.out
    try:
        verify_render.render_verify(rep, {"model": "m", "weights": "w", "device": "cpu", "dtype": "fp32"})
    finally:
        verify_render.out = old
    text = screen.export_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("distortion int8: KL mean"))
    assert "top-1" in line and all(len(ln) <= 80 for ln in text.splitlines()), text
    assert "describe this model only" in " ".join(text.split()), text


def _asdict(rep):
    from dataclasses import asdict

    return asdict(rep)


# --- bench -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_columns_csv_and_plot(tmp_path):
    """A prefill sweep end to end (the default tier checks the same on test_render's bench run)."""
    out = tmp_path / "run"
    args = "--engine kvbench --caches none,dynamic,int8 --prompt-len 6,12 -n 5 --repeats 1 --warmup 0 --out"
    r = CliRunner().invoke(app, ["bench", *TINY, *args.split(), str(out)])
    assert r.exit_code == 0, r.output
    s = pd.read_csv(out / "summary.csv").set_index(["cache", "prompt_len"]).sort_index()
    lossy, exact = s.loc["int8"], s.drop(index="int8", level="cache")
    assert (lossy.kl_mean > 0).all() and (lossy.top1_agreement <= 1).all() and (lossy.mean_abs_dp > 0).all()
    assert exact[["kl_mean", "top1_agreement", "mean_abs_dp"]].isna().all().all()  # empty for exact caches
    steps = pd.read_csv(out / "distortion.csv")
    assert len(steps) == 2 * 5 and set(steps.cache) == {"int8"}
    assert (steps.depth == steps.prompt_len + steps.token - 1).all()
    for p in (6, 12):  # the summary's figures are its tokens' means
        assert s.loc[("int8", p), "kl_mean"] == pytest.approx(steps[steps.prompt_len == p].kl.mean(), rel=1e-5)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["distortion"]["note"] == RANDOM_NOTE and "distortion.png" in meta["plots"]
    assert set(meta["distortion"]["rows"]) == {"kvbench int8 prompt 6 batch 1", "kvbench int8 prompt 12 batch 1"}
    assert (out / "distortion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "distortion int8 prompt 6: KL mean" in r.stdout and "describe this model only" in r.stdout


def test_bench_without_a_lossy_cache_writes_no_distortion(tmp_path):
    from kvbench.results.report import BenchRecorder

    rec = BenchRecorder.__new__(BenchRecorder)
    rec.run_dir, rec.distortion_rows = tmp_path, []
    assert rec._distortion_plot() == [] and rec._distortion_csv() == []


@pytest.mark.slow
def test_long_contexts_on_gpt2_long(tmp_path):
    """The depth axis of long contexts: bench --fill random at 1k and 4k on gpt2-long, int8 against static."""
    out = tmp_path / "run"
    args = "-m gpt2-long --fill random --prompt-len 1k,4k --caches int8 -n 4 --repeats 1 --warmup 0 --out"
    r = CliRunner().invoke(app, ["bench", "--device", "cpu", *args.split(), str(out)])
    assert r.exit_code == 0, r.output
    s = pd.read_csv(out / "summary.csv")
    assert (s.kl_mean > 0).all() and (s.kl_mean < 1e-2).all() and (s.top1_agreement >= 0.75).all()
    steps = pd.read_csv(out / "distortion.csv")
    assert (steps.depth == steps.context + steps.token).all() and len(steps) == 8
    rows = json.loads((out / "meta.json").read_text())["distortion"]["rows"]
    assert [b["depth_from"] for b in rows["int8 context 1024"]["by_depth"]] == [1024]
    assert [b["depth_from"] for b in rows["int8 context 4096"]["by_depth"]] == [4096]
    assert rows["int8 context 4096"]["bytes_saved_fraction"] == pytest.approx(1 - 68 / 256, abs=1e-3)


@pytest.mark.slow
def test_verify_hf_quantized_cache_reports_its_distortion(tmp_path):
    """transformers' quantized cache (the fp8 backend, where this transformers has it) on a tiny Llama: its
    distortion against transformers' dynamic cache, positive, bytes not read."""
    from transformers import LlamaForCausalLM, cache_utils

    if not hasattr(cache_utils, "Fp8QuantizedLayer"):
        pytest.skip("this transformers has no fp8 cache backend")
    torch.manual_seed(0)
    cfg = tiny_llama()
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    args = "--caches dynamic,quantized-fp8 --prompt-len 12 -n 10 --json"
    r = CliRunner().invoke(app, ["verify", "--hf", str(tmp_path / "llama"), *args.split()])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)["distortion"]
    assert set(d) == {"quantized-fp8"} and d["quantized-fp8"]["reference"].startswith("dynamic"), d
    fp8 = d["quantized-fp8"]
    assert fp8["kl_mean"] > 0 and fp8["kv_bytes"] is None and fp8["steps"] == 10, fp8


def test_plot_labels_the_bytes_saved_and_leaves_zeros_off_its_log_axes(tmp_path):
    """An eviction design is exact until it evicts: its zero KL and |Δp| bins are left off the log axes, not drawn
    at an axis' edge, and the title says so."""
    from kvbench.results import distortion_plot

    rows = [
        {"cache": c, "depth": d, "kl": kl, "top1_agreement": 1.0, "abs_dp": kl / 2}
        for d in range(20, 200)
        for c, kl in (("int8", 1e-3), ("evicting", 0.0 if d < 100 else 0.05))
    ]
    meta = {"distortion": {"note": RANDOM_NOTE, "rows": {"a": {"cache": "int8", "bytes_saved_fraction": 0.72}}}}
    drawn = {}
    real_savefig = distortion_plot.plt.Figure.savefig

    def savefig(fig, path, **kw):
        drawn["title"] = fig._suptitle.get_text()
        drawn["lines"] = {ln.get_label(): list(ln.get_xdata()) for ln in fig.axes[0].get_lines()}
        return real_savefig(fig, path, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distortion_plot.plt.Figure, "savefig", savefig)
        path = distortion_plot.distortion_figure(pd.DataFrame(rows), meta, tmp_path / "distortion.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert "left off its log axis" in drawn["title"] and "describe this model only" in " ".join(drawn["title"].split())
    assert set(drawn["lines"]) == {"int8: 72% fewer K/V bytes", "evicting"}
    int8 = drawn["lines"]["int8: 72% fewer K/V bytes"]
    assert min(drawn["lines"]["evicting"]) >= 64 and len(int8) == 4  # bins 16.., 32.., 64.., 128..: zeros before 64


@pytest.fixture
def lossy_plugin(plugin_files):
    """A plugin design declaring exact=False (a static cache storing K and V rounded to multiples of 0.25), as any
    new lossy design does: the distortion code knows no design by name."""
    plugin_files(
        {
            "lossyplug/__init__.py": "",
            "lossyplug/caches.py": '''
            """A lossy plugin for the tests."""
            from kvbench.caches.static import StaticCache

            class Coarse(StaticCache):
                """K and V rounded to multiples of 0.25."""
                exact = False
                logit_atol = 100.0
                logit_rtol = 1.0
                min_greedy_agreement = 0.0

                def __init__(self, config, batch, max_len, dtype, device):
                    super().__init__(batch, config.n_head, max_len, config.head_dim, dtype, device)

                def update(self, k, v, positions):
                    return super().update((k * 4).round() / 4, (v * 4).round() / 4, positions)
            ''',
        }
    )
    return "lossyplug.caches:Coarse"


def test_any_design_declaring_exact_false_is_measured(lossy_plugin, tiny_model):
    """verify's and bench's passes pick up a plugin's lossy design as they pick up int8."""
    prompts = random_prompts(500, 8, 2, seed=0)
    rep = run_verify(tiny_model, ["int8", lossy_plugin], prompts, 12, reference="none", checks=("logits",))
    d = rep.distortion
    assert list(d) == ["int8", lossy_plugin] and rep.passed, d
    assert d[lossy_plugin]["kl_mean"] > 10 * d["int8"]["kl_mean"] > 0 and d[lossy_plugin]["bytes_saved"] == 0
    coarse = measure_layers(tiny_model, lossy_plugin, prompts[:1], 6)
    assert coarse.kl_mean > 0 and coarse.steps == 6 and coarse.bytes_saved == 0


@pytest.mark.slow
def test_verify_json_carries_a_plugins_distortion(lossy_plugin):
    """The command end to end: --json's distortion member, valid against the schema, the weights' note in it."""
    args = ["verify", *TINY, "--caches", lossy_plugin, "--prompt-len", "8", "-n", "12", "--reference", "none", "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema.Draft202012Validator(load_schema("verify")).validate(doc)
    assert list(doc["distortion"]) == [lossy_plugin] and doc["distortion"][lossy_plugin]["note"] == RANDOM_NOTE
