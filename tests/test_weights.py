"""Weight sources: local Hugging Face directories (safetensors and .bin), random init, auto/hub offline."""

import json
import time

import pytest
import torch

from kvbench.errors import KVBenchError
from kvbench.model.weights import hub_reachable, load_model

CPU = torch.device("cpu")


def test_pytorch_model_bin_loads_like_safetensors(hf_dir, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(str(hf_dir / "model.safetensors"))
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    torch.save(sd, tmp_path / "pytorch_model.bin")
    a = load_model(None, str(hf_dir), CPU, torch.float32).model
    b = load_model(None, str(tmp_path), CPU, torch.float32).model
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


def test_weights_source_is_recorded(hf_dir):
    lm = load_model(None, str(hf_dir), CPU, torch.float32)
    assert lm.weights == str(hf_dir) and not lm.random and lm.warning is None
    assert lm.config.n_layer == 3 and lm.config.block_size == 128


def test_missing_path_is_named(tmp_path):
    with pytest.raises(KVBenchError, match="not found"):
        load_model(None, str(tmp_path / "nope"), CPU, torch.float32)


def test_directory_without_weights_is_named(hf_dir, tmp_path):
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(KVBenchError, match="no model.safetensors or pytorch_model.bin"):
        load_model(None, str(tmp_path), CPU, torch.float32)


def test_non_gpt2_config_is_refused_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(KVBenchError, match=r"config.json is not a GPT-2 config \(model_type='llama'"):
        load_model(None, str(tmp_path), CPU, torch.float32)


def test_checkpoint_with_wrong_shapes_is_refused(hf_dir, tmp_path):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["n_embd"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    with pytest.raises(KVBenchError, match="has shape"):
        load_model(None, str(tmp_path), CPU, torch.float32)


def test_model_must_agree_with_checkpoint(hf_dir):
    with pytest.raises(KVBenchError, match="does not match the checkpoint"):
        load_model("gpt2", str(hf_dir), CPU, torch.float32)


def test_auto_offline_falls_back_to_random_quickly_with_warning(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    lm = load_model("gpt2-tiny", "auto", CPU, torch.float32)
    assert lm.random and lm.weights.startswith("random(")
    lm = load_model("gpt2", "auto", CPU, torch.float32)
    assert lm.random and "meaningless" in lm.warning
    # seconds even on a busy machine, not the minutes of a plain from_pretrained's retries
    assert time.perf_counter() - t0 < 90
    assert hub_reachable() is False


def test_hub_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    with pytest.raises(KVBenchError, match="not in the local Hugging Face cache"):
        load_model("gpt2", "hub", CPU, torch.float32)


def test_random_weights_are_seeded():
    a = load_model("gpt2-tiny", "random", CPU, torch.float32, seed=1).model
    b = load_model("gpt2-tiny", "random", CPU, torch.float32, seed=1).model
    c = load_model("gpt2-tiny", "random", CPU, torch.float32, seed=2).model
    w = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])
