"""bench --profile: one more warm run per configuration under torch.profiler. The trace is real Chrome trace-event
JSON, the operator counts are GPT-2's own (counted by hand from the architecture), meta.json lists every trace,
and the option is refused where it does not apply."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.bench.profile import trace_name
from kvbench.bench.settings import load_settings
from kvbench.cli import app
from kvbench.errors import KVBenchError
from kvbench.model import matmul

TINY = ["--model", "gpt2-tiny", "--weights", "random", "--device", "cpu"]


def linear_calls(route: str, cache: str, new: int) -> dict[str, int]:
    """{operator: calls} of the projections of a run of `new` tokens on gpt2-tiny (2 blocks of 4 biased linears, and
    lm_head), one forward per token, on each CPU route (model/matmul.py): ATen's addmm for the biased ones and mm for
    lm_head; oneDNN's inner product for all; or, on the gemv route, kvbench's fused calls for one row (ln_f with
    lm_head over the last position; a whole decode step over static caches, in one call), oneDNN's for the
    rest (the prefill's, every forward of `none`)."""
    if route == "aten":
        return {"aten::addmm": new * 2 * 4, "aten::mm": new}
    if route == "onednn":
        return {"mkldnn::_linear_pointwise": new * (2 * 4 + 1)}
    steps = 0 if cache == "none" else new - 1
    assert cache in ("none", "static"), "the caches this test runs"
    calls = {
        "mkldnn::_linear_pointwise": (new - steps) * 2 * 4,
        "kvbench::ln_gemv": new - steps,  # ln_f and lm_head, over the last row of a forward that is not a step
        "kvbench::step": steps,  # a decode step over static caches: one call
    }
    return {op: n for op, n in calls.items() if n}


@pytest.fixture(params=["aten", "gemv", "onednn"])
def cpu_route(request):
    before = matmul.route()
    matmul.set_route(request.param)
    yield matmul.route()
    matmul.set_route(before)


def test_profile_writes_a_trace_per_configuration_and_gpt2s_operator_counts(tmp_path, cpu_route):
    out, new = tmp_path / "run", 6
    result = CliRunner().invoke(
        app,
        [
            "bench",
            *TINY,
            "--prompt-len",
            "12",
            "--new-tokens",
            str(new),
            *"--caches none,static --engine kvbench --repeats 1 --warmup 1 --out".split(),
            str(out),
            "--profile",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "profile: top operators by self time" in result.output
    meta = json.loads((out / "meta.json").read_text())
    assert set(meta["profiles"]) == {"kvbench none prompt 12 batch 1", "kvbench static prompt 12 batch 1"}
    for key, rel in meta["profiles"].items():
        trace = json.loads((out / rel).read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        cache = key.split()[1]  # "kvbench none prompt 12 batch 1"
        assert {*linear_calls(cpu_route, cache, new), "aten::scaled_dot_product_attention"} <= names
    ops = pd.read_csv(out / "profile_ops.csv")
    assert set(ops.cache) == {"none", "static"}
    for cache, g in ops.groupby("cache"):
        assert g.share.sum() == pytest.approx(1.0, abs=1e-3)  # the top operators and the rest
        assert (g.self_cpu_ms >= 0).all() and (g.self_device_ms == 0).all()  # a CPU run
        calls = g.set_index("op").calls
        for op, n in linear_calls(cpu_route, cache, new).items():
            assert calls[op] == n, (op, cache)
    # the timed rows are not the profiled run: summary.csv holds the one timed repeat
    s = pd.read_csv(out / "summary.csv")
    assert (s.repeats == 1).all()


def test_trace_names_are_safe_file_names():
    assert trace_name("kvbench", "mycaches.x:Cache", 16, 4) == "kvbench-mycaches.x-Cache-prompt16-batch4.trace.json"


def test_profile_from_toml_and_where_it_does_not_apply(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("profile = true\n")
    assert load_settings(f, {}).profile is True
    f.write_text('profile = "yes"\n')
    with pytest.raises(KVBenchError, match="profile must be true or false"):
        load_settings(f, {})
    with pytest.raises(KVBenchError, match="--profile traces prefill sweeps"):
        load_settings(None, dict(profile=True, fill="random"))


def test_the_profiler_prints_nothing_of_its_own(capfd, tiny_model, tmp_path):
    """torch's profiler backend writes a line at every start and stop to the process's stderr (fd 2) unless told
    otherwise: a profiled run leaves stderr to kvbench."""
    from kvbench.bench.engines import KVBenchEngine
    from kvbench.bench.profile import profile_run

    conf = KVBenchEngine(tiny_model).configure("static", 1, 12)
    ids = torch.zeros(1, 8, dtype=torch.long)
    key = {"engine": "kvbench", "cache": "static", "prompt_len": 8, "batch": 1}
    capfd.readouterr()
    profiled = profile_run(lambda: conf.run(ids, 4), ids.device, tmp_path, key)
    out, err = capfd.readouterr()
    assert out == "" and err == "", err
    assert profiled.trace.is_file() and profiled.ops
