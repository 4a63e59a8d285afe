"""A run too large for the memory available is refused before any weight is loaded: one line, exit 3, the --json
error document; never the kernel's OOM killer (check/verify.py check_run_fits, as bench's own check)."""

import json

import pytest
from typer.testing import CliRunner

from kvbench.cli import app

TINY = ["-m", "gpt2-tiny", "-w", "random", "-d", "cpu"]


@pytest.fixture
def many_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("the key to fast inference is to know what the data is about\n" * 20_000)
    return path


CASES = {
    "verify": (["verify", *TINY, "--batch", "1000", "--prompt-len", "1000", "-n", "20"], "--batch 1000 x 1020 tokens"),
    "break": (["break", "position", *TINY, "--batch", "1000", "-n", "20"], "--batch 1000 x"),
    "generate": (["generate", *TINY, "--prompts-file", "{prompts}", "-n", "20"], "20,000 prompt(s) of up to"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_beyond_memory_is_refused_up_front(case, many_prompts, monkeypatch):
    monkeypatch.setattr("kvbench.devices.available_memory_bytes", lambda device: 16 << 30)  # any machine: 16 GiB
    args, words = CASES[case]
    args = [a.replace("{prompts}", str(many_prompts)) for a in args]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 3, r.output
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 3 and words in doc["error"] and "than the 16.0 GiB available" in doc["error"], doc
    assert "\n" not in doc["error"] and len(doc["error"]) < 400, doc["error"]


def test_the_default_runs_fit_a_small_machine(monkeypatch):
    """The check refuses what cannot fit, not what a 2-core, 24 GiB machine runs every day."""
    import torch

    from kvbench.check.verify import check_run_fits
    from kvbench.model.gpt2 import GPTConfig

    monkeypatch.setattr("kvbench.devices.available_memory_bytes", lambda device: 4 << 30)
    gpt2 = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)
    check_run_fits(gpt2, 3, 32 + 100, torch.float32, torch.device("cpu"))  # verify's defaults
    check_run_fits(gpt2, 1, 512 + 64, torch.float32, torch.device("cpu"), "1 prompt(s)", 1)  # generate, long prompt
