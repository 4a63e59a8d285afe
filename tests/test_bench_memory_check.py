"""bench's memory check before any work: the weights, the largest KV cache and what a step holds beside it (the
logits, the prefill's activations) against the memory available now. A sweep that cannot fit is refused with exit 3
before anything is loaded; one that can is not.

The machine's memory is replaced by fixed figures (those of the 2-core, 23.5 GiB machine where a million-sequence
batch was killed by the kernel's OOM killer), and the bandwidth probe that starts every sweep is replaced by a
failure, so a check that let a sweep through would fail here at once instead of allocating anything."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pytest
import torch
from typer.testing import CliRunner

from kvbench import devices
from kvbench.bench import settings as bs
from kvbench.cli import app
from kvbench.errors import NotEnoughMemoryError

GIB = 2**30
TINY = ["--model", "gpt2-tiny", "--weights", "random", "--device", "cpu", "--repeats", "1", "--warmup", "0"]


@pytest.fixture
def machine(monkeypatch):
    """23.5 GiB of RAM of which 19.5 GiB available; no sweep may start."""
    memory = {"total": int(23.5 * GIB), "available": int(19.5 * GIB)}
    monkeypatch.setattr(devices, "device_memory_bytes", lambda device: memory["total"])
    monkeypatch.setattr(devices, "available_memory_bytes", lambda device: memory["available"])

    def started(*args, **kwargs):
        raise AssertionError("the sweep started: the memory check let it through")

    from kvbench.cli import bench as cli_bench

    monkeypatch.setattr(cli_bench, "measure_bandwidth", started)
    return memory


def test_a_batch_whose_step_does_not_fit_is_refused_up_front_with_exit_3(machine, tmp_path):
    """A million sequences of 10 tokens: a 19.1 GiB cache, under the machine's 23.5 GiB; a step's logits (a million
    x 50,257 fp32 values) are not. One line and one JSON error document naming the figures and the batch that fits."""
    out = tmp_path / "run"
    argv = [*TINY, *"--batch 1000000 --prompt-len 8 -n 2 --caches static --engine kvbench --json".split()]
    r = CliRunner().invoke(app, ["bench", *argv, "--out", str(out)])
    shown = f"exit {r.exit_code}\nstdout: {r.stdout!r}\nstderr: {r.stderr!r}"
    assert r.exit_code == 3, shown
    line = (
        "--batch 1000000 x 10 tokens needs a 19.1 GiB KV cache + 607.4 GiB for a step's logits and activations "
        "+ 0.0 GiB of weights = 626.5 GiB, more than the 19.5 GiB available; lower --batch (at most 31,083 fits), "
        "--prompt-len or --new-tokens"
    )
    assert r.stderr.strip().splitlines() == [f"error: {line}"], shown
    assert json.loads(r.stdout) == {"schema_version": 1, "error": line, "exit_code": 3}, shown
    assert not out.exists()


def _settings(**given) -> bs.BenchSettings:
    base = {"model": "gpt2-tiny", "weights": "random", "device": "cpu", "engine": "kvbench"}
    return bs.load_settings(None, {**base, **given})


def _check(s: bs.BenchSettings, weights_loaded: bool = False) -> dict[int, str]:
    return bs.check_sizes(s, bs.sweep_model_config(s), torch.float32, torch.device("cpu"), weights_loaded)


# (id, settings, available GiB, weights loaded, the batch sizes predicted not to fit; None: the sweep is refused)
CASES = [
    # the demo's and the tests' sweeps on a machine with little free: they fit
    ("demo-sweep", {"caches": "none,static", "prompt_len": "512", "new_tokens": 16}, 1, False, set()),
    ("default-sweep", {}, 1, False, set()),
    # 30,000 sequences of 10 tokens: 0.6 GiB of cache, 18.2 GiB of logits and activations
    ("step-beyond-available", {"batch": "30000", "prompt_len": "8", "new_tokens": 2}, 18, False, None),
    ("step-within-available", {"batch": "30000", "prompt_len": "8", "new_tokens": 2}, 19.5, False, set()),
    # a batch sweep: the sizes that fit run, the one that does not is an `oom` row
    ("batch-sweep", {"batch": "1,30000", "prompt_len": "8", "new_tokens": 2}, 18, False, {30000}),
    # `none` recomputes the whole sequence every step: its activations count prompt + new tokens
    (
        "prefill-activations",
        {"batch": "2000", "caches": "static", "prompt_len": "800", "new_tokens": 200},
        15,
        False,
        set(),
    ),
    ("none-recomputes", {"batch": "2000", "caches": "none", "prompt_len": "800", "new_tokens": 200}, 15, False, None),
    # with the weights already loaded (what is available excludes them), they are not counted again
    ("weights-loaded", {"model": "gpt2-xl", "batch": "1", "prompt_len": "8", "new_tokens": 2}, 1, True, set()),
    ("weights-not-loaded", {"model": "gpt2-xl", "batch": "1", "prompt_len": "8", "new_tokens": 2}, 1, False, None),
]


@pytest.mark.parametrize("case, given, available, loaded, oversized", CASES, ids=[c[0] for c in CASES])
def test_the_check_counts_a_steps_memory_against_what_is_available(machine, case, given, available, loaded, oversized):
    machine["available"] = int(available * GIB)
    s = _settings(**given)
    if oversized is None:
        with pytest.raises(NotEnoughMemoryError, match=rf"GiB, more than the {available:.1f} GiB available"):
            _check(s, loaded)
    else:
        assert set(_check(s, loaded)) == oversized
