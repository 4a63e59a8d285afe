"""A quantized cache whose backend package cannot be used is a skip row naming the package, never a failing row:
optimum-quanto uninstalled with the extension it built left behind (optimum/quanto/ then imports as an empty
namespace package, with no installed distribution), or installed with a version that is not one (transformers reads
'N/A' for such a package and raises InvalidVersion on it in every quanto row)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.metadata
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.hf.caches import _backend_missing
from tiny import tiny_llama

QUANTO = ("optimum-quanto", "optimum.quanto", "optimum_quanto")  # the names a version lookup may use


def _quanto_version(monkeypatch, answer):
    """importlib.metadata.version as on a machine where optimum-quanto's distribution answers `answer`: a version
    string, or an exception class to raise."""
    real = importlib.metadata.version

    def version(name):
        if name not in QUANTO:
            return real(name)
        if isinstance(answer, type):
            raise answer(name)
        return answer

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize(
    "answer, why",
    [
        (
            importlib.metadata.PackageNotFoundError,
            r"^its backend is not installed: optimum.quanto imports \(from .*optimum.quanto\) but no optimum-quanto "
            r"package is installed, files left behind by an uninstall; pip install optimum-quanto",
        ),
        ("N/A", r"^its backend is unusable: optimum-quanto is installed with version 'N/A'; pip install"),
        ("0.2.7", None),
    ],
    ids=["uninstalled-files-left", "version-not-a-version", "installed"],
)
def test_a_backend_that_cannot_be_versioned_is_missing(monkeypatch, answer, why):
    pytest.importorskip("optimum.quanto")
    _quanto_version(monkeypatch, answer)
    got = _backend_missing("quanto")
    if why is None:
        assert got is None
    else:
        assert got is not None and re.search(why, got), got


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama whose K/V width (2 key/value heads x 32) fills quanto's groups of 64 values."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_llama(hidden_size=128, num_hidden_layers=1, max_position_embeddings=64)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def test_verify_skips_quanto_rows_when_its_version_is_not_one(monkeypatch, llama):
    """What transformers does with a half-uninstalled optimum-quanto (its version read as 'N/A'): before kvbench
    checked the backend's version every quanto row failed with InvalidVersion."""
    pytest.importorskip("optimum.quanto")
    _quanto_version(monkeypatch, "N/A")
    argv = ["verify", "--hf", str(llama), "-d", "cpu", "-n", "4", "--prompt-len", "8"]
    r = CliRunner().invoke(app, [*argv, "--caches", "quantized-quanto", "--json"])
    assert r.exit_code == 5, r.output  # nothing checked
    doc = json.loads(r.stdout)
    rows = doc["checks"]
    assert doc["nothing_checked"] is True and rows, r.stdout
    assert all(c["skipped"] and "optimum-quanto is installed with version 'N/A'" in c["detail"] for c in rows), rows
    assert "InvalidVersion" not in r.output
