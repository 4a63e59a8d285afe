"""The projections' one rule (model/matmul.py): oneDNN's inner product on the CPU over (out, in) weights, ATen's
addmm elsewhere. Both are held to each other and the whole model to transformers, with the layout GPT.lay_out gives."""

from __future__ import annotations

import pytest
import torch

from kvbench.errors import KVBenchError
from kvbench.model import matmul
from kvbench.model.gpt2 import GPT, PRESETS, Conv1D
from kvbench.model.weights import to_hf_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch built without oneDNN")


@pytest.fixture
def aten_then_back():
    yield
    matmul.set_route("onednn")


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 5, 64), (7, 64)])
def test_onednn_equals_addmm(shape, aten_then_back):
    layer = Conv1D(64, 96)
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias, std=0.1)
    x = torch.randn(shape)
    with torch.inference_mode():
        fast = layer(x)
        matmul.set_route("aten")
        slow = layer(x)
    assert fast.shape == slow.shape == (*shape[:-1], 96)
    assert torch.allclose(fast, slow, rtol=0, atol=1e-5)


@needs_onednn
def test_lay_out_keeps_shapes_values_and_the_checkpoint_format(tiny_config):
    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.lay_out()
    for m in model.modules():
        if isinstance(m, Conv1D):
            assert m.weight.shape[0] == m.weight.t().shape[1] and m.weight.t().is_contiguous()  # (in, out) view
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].shape == after[k].shape for k in before)
    # on a layout-agnostic device path the same model lays its weights back (in, out)
    matmul.set_route("aten")
    try:
        model.lay_out()
        assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, Conv1D))
    finally:
        matmul.set_route("onednn")


@needs_onednn
def test_a_laid_out_model_equals_transformers(tiny_config):
    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval().lay_out()
    ids = torch.randint(0, tiny_config.vocab_size, (2, 20))
    with torch.inference_mode():
        ours = model(ids, torch.arange(20).expand(2, -1))
        theirs = to_hf_model(model, "eager")(ids).logits
    assert (ours - theirs).abs().max() < 1e-5


def test_training_takes_the_differentiable_path(tiny_config):
    """oneDNN's op has no backward: with gradients on, every projection is addmm and gradients reach the weights."""
    model = GPT(tiny_config).init_weights(seed=0, std=0.1).lay_out()
    ids = torch.randint(0, tiny_config.vocab_size, (1, 8))
    model(ids, torch.arange(8)[None]).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_hf_engine_gets_its_own_in_out_layout(tiny_config):
    from kvbench.hf.engine import build_hf_model

    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval().lay_out()
    hf = build_hf_model(model)
    assert hf.transformer.h[0].attn.c_attn.weight.is_contiguous()
    assert hf.transformer.wte.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # the rest shared


def test_an_unknown_route_is_refused(monkeypatch, aten_then_back):
    monkeypatch.setenv(matmul.ROUTE_ENV, "mkl")
    with pytest.raises(KVBenchError, match="KVBENCH_CPU_MATMUL='mkl': expected one of onednn, aten"):
        matmul.set_route(None)
    monkeypatch.setenv(matmul.ROUTE_ENV, "ATEN")
    assert matmul.set_route(None) == "aten"


@needs_onednn
def test_bf16_runs_the_onednn_route():
    model = GPT(PRESETS["gpt2-tiny"]).init_weights(seed=0).eval().to(torch.bfloat16).lay_out()
    ids = torch.randint(0, 50257, (1, 6))
    with torch.inference_mode():
        fast = model(ids, torch.arange(6)[None]).float()
        matmul.set_route("aten")
        try:
            slow = model(ids, torch.arange(6)[None]).float()
        finally:
            matmul.set_route("onednn")
    assert (fast - slow).abs().max() < 0.1  # bf16 rounding of two summation orders
