"""Our GPT-2 against Hugging Face's GPT2LMHeadModel holding the same weights: the independent reference."""

import math

import pytest
import torch

from kvbench.decode.generate import left_pad
from kvbench.model.gpt2 import GPT, PRESETS
from kvbench.model.weights import load_model


@pytest.fixture(scope="module")
def pair(hf_dir):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ours = load_model(None, str(hf_dir), torch.device("cpu"), torch.float32).model
    return ours, hf


def test_ported_weights_give_hf_logits(pair):
    ours, hf = pair
    ids = torch.randint(0, 500, (2, 40))
    positions = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        got = ours(ids, positions)
        want = hf(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_left_padded_batch_matches_hf_attention_mask(pair):
    """Our padding mask and per-sequence positions against HF's attention_mask + position_ids."""
    ours, hf = pair
    prompts = [[5, 6, 7], list(range(10, 22)), [30, 31, 32, 33, 34, 35, 36]]
    batch = left_pad(prompts, "cpu")
    with torch.no_grad():
        got = ours(batch.ids, batch.positions, None, batch.padding)
        want = hf(batch.ids, attention_mask=batch.padding, position_ids=batch.positions).logits
    real = batch.padding.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    # and each sequence alone gives the same last-token logits as in the batch
    for b, p in enumerate(prompts):
        with torch.no_grad():
            solo = ours(torch.tensor([p]), torch.arange(len(p))[None])[:, -1]
        torch.testing.assert_close(got[b, -1], solo[0], rtol=1e-5, atol=1e-5)


def test_output_depends_on_positions(tiny_model):
    """Learned positions matter: the same tokens at other positions give other logits (so position bugs show)."""
    ids = torch.randint(0, 500, (1, 8))
    with torch.no_grad():
        a = tiny_model(ids, torch.arange(8)[None])
        b = tiny_model(ids, torch.arange(8, 16)[None])
    assert (a - b).abs().max() > 1e-2


def test_random_init_is_gpt2_style_and_seeded():
    cfg = PRESETS["gpt2-tiny"]
    m1, m2 = GPT(cfg).init_weights(seed=3), GPT(cfg).init_weights(seed=3)
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2), n
    assert m1.lm_head.weight.data_ptr() == m1.transformer.wte.weight.data_ptr()  # tied
    c_proj = m1.transformer.h[0].mlp.c_proj.weight
    c_fc = m1.transformer.h[0].mlp.c_fc.weight
    assert abs(c_fc.std().item() - 0.02) < 0.002
    assert abs(c_proj.std().item() - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.002
    assert torch.all(m1.transformer.h[0].ln_1.weight == 1)


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_presets_have_gpt2_parameter_counts(name):
    """Parameter counts of the released checkpoints (tied lm_head counted once), without allocating weights."""
    c = PRESETS[name]
    C, L = c.n_embd, c.n_layer
    per_block = 4 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    total = c.vocab_size * C + c.block_size * C + L * per_block + 2 * C
    want = {
        "gpt2": 124_439_808,
        "gpt2-medium": 354_823_168,
        "gpt2-large": 774_030_080,
        "gpt2-xl": 1_557_611_200,
    }
    assert total == want[name]
