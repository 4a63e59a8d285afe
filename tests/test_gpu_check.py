"""scripts/gpu_check.sh (make bench-gpu) end to end in its CPU mode: every stage runs, in order, inside the global
deadline, and leaves its files where the GPU run will leave them."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("preflight", "seed", "verify", "compiled", "xl")


def run_script(out: Path, budget: int) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    env["GPU_CHECK_BUDGET"] = str(budget)
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=budget + 120,
        check=False,
    )
    return proc, time.monotonic() - t0


def status_lines(out: Path) -> dict[str, str]:
    lines = (out / "status.txt").read_text().splitlines()
    return {line.split()[0]: line for line in lines if line.split() and line.split()[0] in STAGES}


@pytest.mark.slow
def test_cpu_mode_runs_every_stage(tmp_path):
    """The stages' structure, given time enough for all of them even on a busy machine (the CPU mode's own budget,
    58 s, is what a quiet 2-core machine needs; how long it takes is no verdict here)."""
    out = tmp_path / "gpu"
    proc, _ = run_script(out, budget=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = status_lines(out)
    assert list(status) == list(STAGES), status  # in this order, none skipped
    assert all(" rc=0 " in line for line in status.values()), status
    for stage in STAGES:
        assert (out / "logs" / f"{stage}.out").is_file() and (out / "logs" / f"{stage}.err").is_file(), stage

    env = (out / "env.txt").read_text()
    for needle in ("torch ", "transformers ", "sdpa ", "cudnn_version", "sdpa choice for gpt2 shapes"):
        assert needle in env, needle

    expected = {  # stage -> (engine, cache) rows at each prompt length
        "seed": {("kvbench", c) for c in ("none", "dynamic", "static", "static-graph")}
        | {("hf", c) for c in ("none", "dynamic", "static")},
        "compiled": {("kvbench", c) for c in ("none", "static", "static-graph")} | {("hf-compiled", "static")},
        "xl": {("kvbench", c) for c in ("none", "static", "static-graph")},
    }
    for stage, pairs in expected.items():
        s = pd.read_csv(out / stage / "summary.csv")
        for p, grp in s.groupby("prompt_len"):
            assert set(zip(grp.engine, grp.cache, strict=True)) == pairs, (stage, p)
        assert (s.status == "ok").all() and (s.token_agreement == 1.0).all(), stage
        meta = json.loads((out / stage / "meta.json").read_text())
        assert meta["status"] == "complete" and meta["dtype"] == "fp32", stage
        assert (out / stage / "latency.png").is_file(), stage
    assert sorted(pd.read_csv(out / "seed" / "summary.csv").prompt_len.unique()) == [8, 32]

    verify = json.loads((out / "verify.json").read_text())
    assert verify["passed"] and {c["cache"] for c in verify["checks"]} == {
        "dynamic",
        "static",
        "static-graph",
        "paged",
    }
    targets = (out / "targets.txt").read_text()
    for stage in ("seed", "compiled", "xl"):
        assert f"{stage} gpt2-tiny prompt" in targets and "static-graph TPOT" in targets, stage
    assert "n/a (cpu structure check" in targets


@pytest.mark.slow
def test_the_deadline_holds_by_skipping_what_does_not_fit(tmp_path):
    out = tmp_path / "gpu"
    budget = 24  # the first two stages keep back more than that for the later ones, so they cannot start
    proc, wall = run_script(out, budget)
    # a timing that must be read: the deadline; the margin covers the closing summary on a busy machine
    assert wall < budget + 15, f"took {wall:.0f} s of a {budget} s budget"
    status = status_lines(out)
    if status["preflight"].startswith("preflight failed"):  # a busy machine: the imports outlasted its 18 s limit
        assert "preflight rc=124 " in (out / "status.txt").read_text(), status
        assert list(status) == ["preflight"], status  # and nothing else started
        return
    assert status["preflight"].split()[1] == "rc=0", status
    skipped = [s for s, line in status.items() if "skipped: out of time" in line]
    # they cannot fit beside what is kept for the stages after them
    assert "seed" in skipped and "verify" in skipped, status


@pytest.mark.slow
def test_a_stage_stopped_by_sigterm_keeps_its_rows(tmp_path):
    """What gpu_check's `timeout -s TERM` does to a bench stage, with a real signal from outside the process."""
    import signal

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        *"-m kvbench bench --model gpt2-tiny --weights random --device cpu --threads 1".split(),
        *"--prompt-len 8,16,32,64,128,256 --new-tokens 24 --caches none,static --engine kvbench --repeats 3".split(),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # the command sets it itself
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # generous: a busy machine is slow to finish the first two
    while time.monotonic() < deadline and proc.poll() is None:
        f = out / "summary.csv"
        if f.is_file() and len(f.read_text().splitlines()) >= 3:  # header + two finished configurations
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the sweep ended (or took 300 s for two rows) before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    s = pd.read_csv(out / "summary.csv")
    assert 2 <= len(s) < 12 and (s.status == "ok").all()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "interrupted" and meta["configurations_completed"] == len(s)
    assert meta["host"]["huge_pages"]["THP_MEM_ALLOC_ENABLE"] == "1"  # set by the command before torch loaded
    assert (out / "latency.png").is_file() and (out / "speedup.png").is_file()
