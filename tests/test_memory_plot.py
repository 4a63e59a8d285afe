"""`kvbench memory --plot`: a real PNG is written, and the chart's marks are the planner's own max context."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvbench.cli.app import app

runner = CliRunner()


def test_plot_writes_png_whose_marks_are_the_planners_max_context(tmp_path):
    png = tmp_path / "capacity.png"
    argv = [
        *"memory -m llama-3-8b -m mistral-7b-v0.1 --gpu h100 --ctx 8k,32k --batch 1,16 --plot".split(),
        str(png),
        "--json",
    ]
    r = runner.invoke(app, argv)
    assert r.exit_code == 0, r.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    doc = json.loads(r.stdout)
    series = {(s["model"], s["batch"]): s for s in doc["plot"]["series"]}
    assert set(series) == {(m, b) for m in ("llama-3-8b", "mistral-7b-v0.1") for b in (1, 16)}
    for p in doc["plans"]:
        for row in p["rows"]:
            s = series[(p["model"]["name"], row["batch"])]
            assert s["max_ctx"] == row["max_ctx"]  # None for mistral's sliding window: it never stops fitting
    # by hand: llama-3-8b caches 131,072 B per token; the longest context of 16 sequences that fits
    available = doc["plans"][0]["gpu"]["available"]
    assert series[("llama-3-8b", 16)]["max_ctx"] == available // (16 * 131_072)
    s = series[("llama-3-8b", 1)]
    assert all(kv == c * 131_072 / 2**30 for c, kv in zip(s["contexts"], s["kv_gib"], strict=True))
    assert s["contexts"][0] == 1024 and s["contexts"][-1] >= 2 * s["max_ctx"] - 1


def test_plot_needs_a_gpu_and_a_png_name(tmp_path):
    for extra, message in [
        ([], "--plot draws against a GPU's memory"),
        (["--gpu", "h100"], "must name a .png"),
    ]:
        name = "c.png" if not extra else "c.svg"
        r = runner.invoke(app, ["memory", "-m", "llama-3-8b", "--ctx", "8k", *extra, "--plot", str(tmp_path / name)])
        assert r.exit_code == 2 and message in r.stderr, r.stderr
