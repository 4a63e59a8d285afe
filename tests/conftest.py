"""Shared fixtures: tiny seeded GPT-2s on the CPU, a Hugging Face reference saved to tmp_path, the ranks file.

Every test process runs torch on one intra-op thread, and so does every process a test starts (it inherits the
environment): on a small, shared machine two spinning OpenMP threads make a tiny model 4 to 19 times slower. A test
about threads sets its own (`bench --threads N`)."""

import os
import shutil
import sys
import tempfile
import textwrap

os.environ["HF_HUB_OFFLINE"] = "1"  # a test never reaches the network
os.environ.pop("KVBENCH_TOKENIZER", None)  # tests see the default tokenizer source unless they set it
os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every child process
os.environ["MKL_NUM_THREADS"] = "1"
# Every bench sweep measures the device's bandwidth, streaming a tensor past the last-level cache (512 MiB or
# more); the tests check the probe's plumbing and arithmetic, so every sweep streams 16 MiB, here and in child
# processes. A test of the probe's own size passes the size it means.
os.environ["KVBENCH_PROBE_BYTES"] = str(16 << 20)
# Remote code (--trust-remote-code) is copied into a modules folder of this process's own, not into ~/.cache where
# other test runs on the machine copy theirs (transformers reads the variable when it is first imported).
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="kvbench-test-hf-modules-")
# Peer engines' converted models (peers/ct2.py) go to a folder of this run's own, never to ~/.cache/kvbench.
os.environ["KVBENCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvbench-test-cache-")

from pathlib import Path

import pytest
import torch

from kvbench.model.gpt2 import GPT, GPTConfig

torch.set_num_threads(1)
_MODULES = os.environ["HF_MODULES_CACHE"]

# A small, non-default shape (3 layers, 4 heads of 16, short context, small vocabulary) so shape bugs show.
TINY = dict(n_layer=3, n_head=4, n_embd=64, block_size=128, vocab_size=500)


def pytest_unconfigure(config):
    shutil.rmtree(_MODULES, ignore_errors=True)
    shutil.rmtree(os.environ["KVBENCH_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_config() -> GPTConfig:
    return GPTConfig(**TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config) -> GPT:
    # std 0.1, not GPT-2's 0.02: at 0.02 a small random model's greedy output is one token repeated, hiding bugs.
    return GPT(tiny_config).init_weights(seed=0, std=0.1).eval()


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    """A Hugging Face GPT2LMHeadModel (random init, std 0.1) saved with save_pretrained: the independent reference."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    cfg = GPT2Config(
        n_layer=TINY["n_layer"],
        n_head=TINY["n_head"],
        n_embd=TINY["n_embd"],
        n_positions=TINY["block_size"],
        vocab_size=TINY["vocab_size"],
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg).eval()
    d = tmp_path_factory.mktemp("hf-gpt2")
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def ranks_file() -> Path:
    """GPT-2's ranks file as shipped inside the package (present in every clone and every install)."""
    from kvbench.resources import GPT2_RANKS

    return GPT2_RANKS


@pytest.fixture
def plugin_files(tmp_path, monkeypatch):
    """Write modules (relative path -> source, dedented) under tmp_path, importable for the test; afterwards each
    top-level package or module written is dropped from sys.modules, and its caches from the plugin registry."""
    written: set[str] = set()

    def write(files: dict[str, str]) -> None:
        for rel, source in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
            written.add(rel.split("/")[0].removesuffix(".py"))
        monkeypatch.syspath_prepend(str(tmp_path))

    yield write
    from kvbench.caches import PLUGINS

    for name in [m for m in sys.modules if m.split(".")[0] in written]:
        del sys.modules[name]
    for name in [n for n in PLUGINS if n.split(":")[0].split(".")[0] in written]:
        del PLUGINS[name]


@pytest.fixture
def lifecycle_plugins(plugin_files):
    """Cache plugins for the lifecycle: the dynamic cache as a plugin, one whose crop truncates K but not V, and
    one with no lifecycle operations (package lcplugins.caches)."""
    plugin_files(
        {
            "lcplugins/__init__.py": "",
            "lcplugins/caches.py": '''
            """Lifecycle plugins for the tests."""
            import torch
            from kvbench.caches import LayerCache
            from kvbench.caches.dynamic import DynamicCache

            class Dynamic(DynamicCache):
                """The dynamic cache as a plugin (its crop runs through CheckedCache)."""
                def __init__(self, config, batch, max_len, dtype, device):
                    super().__init__()

            class CropKeysOnly(DynamicCache):
                """A dynamic cache whose crop truncates K but not V."""
                def __init__(self, config, batch, max_len, dtype, device):
                    super().__init__()
                def crop(self, length):
                    self.k = self.k[:, :, :length]
                    self.length = length

            class AppendOnly(LayerCache):
                """torch.cat append with no lifecycle operations."""
                def __init__(self, config, batch, max_len, dtype, device):
                    super().__init__()
                    self.k = self.v = None
                def update(self, k, v, positions):
                    self.k = k if self.k is None else torch.cat([self.k, k], 2)
                    self.v = v if self.v is None else torch.cat([self.v, v], 2)
                    self.length = self.k.size(2)
                    return self.k, self.v
                def reset(self):
                    super().reset()
                    self.k = self.v = None
                @property
                def nbytes(self):
                    return 0 if self.k is None else self.k.nbytes + self.v.nbytes
            ''',
        }
    )
    return "lcplugins.caches"
