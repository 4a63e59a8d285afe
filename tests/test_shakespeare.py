"""gpt2-shakespeare, the checkpoint shipped with kvbench: transformers and kvbench load it alike, it reads The Tempest
far better than random weights do, and what it writes is made of words, where random weights write fragments."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPT, PRESETS
from kvbench.model.tokenizer import load_tokenizer
from kvbench.model.weights import checkpoint_dir, demo_model, load_model, peek_config
from kvbench.resources import BUNDLED_MODELS, TEMPEST_HELDOUT

CPU = torch.device("cpu")
NAME = "gpt2-shakespeare"
# Held-out perplexity the shipped checkpoint must stay under. Here, non-overlapping windows of 512: the shipped
# checkpoint (step 850) gives 199.9, random weights 50,534 (about the vocabulary: a flat distribution); the bound
# leaves room for a retrained checkpoint, and tells any trained model from an untrained one.
PPL_BOUND = 1000.0
# Words of plain English a trained model writes that the passage may lack; anything else must be in the passage.
COMMON = set(
    """a about after again all also am an and any are as at away be been before being both but by can come could
    day did do does done down each even ever every for from give go good great had has have he her here him his how
    i if in into is it its know let like little long love made make man may me more most much must my never new no
    nor not now o of off old on one only or other our out own say see she shall should so some such sweet than that
    the thee their them then there these they thine this those thou thus thy time to too true two unto up upon us very
    was way we well were what when where which while who why will with word world would ye yet you your""".split()
)


@pytest.fixture(scope="module")
def trained() -> GPT:
    return load_model(NAME, "auto", CPU, torch.float32).model


@pytest.fixture(scope="module")
def passage() -> str:
    return TEMPEST_HELDOUT.read_text(encoding="utf-8")


@torch.inference_mode()
def perplexity(model: GPT, ids: list[int], window: int = 512) -> float:
    """Non-overlapping windows' mean next-token loss, exponentiated (the training script's held-out measure)."""
    losses = []
    for s in range(0, len(ids) - 1, window):
        x = torch.tensor(ids[s : s + window + 1])[None]
        logits = model(x[:, :-1], torch.arange(x.size(1) - 1)[None])
        losses.append(F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item())
    return math.exp(sum(losses) / (len(ids) - 1))


def test_bundled_checkpoint_is_the_preset_and_loads_offline_never_random(monkeypatch):
    import kvbench.model.weights as weights

    monkeypatch.setattr(weights, "hub_reachable", lambda *a, **k: pytest.fail("the hub was asked"))
    lm = load_model(NAME, "auto", CPU, torch.float32)
    assert not lm.random and lm.warning is None and lm.weights == f"bundled:{NAME}"
    got, want = lm.config, PRESETS[NAME]
    assert (got.n_layer, got.n_head, got.n_embd, got.block_size, got.vocab_size) == (
        want.n_layer,
        want.n_head,
        want.n_embd,
        want.block_size,
        want.vocab_size,
    )
    assert peek_config(NAME, "auto").block_size == want.block_size
    assert checkpoint_dir(NAME, "auto") == BUNDLED_MODELS[NAME]
    assert load_model(NAME, "random", CPU, torch.float32).random  # asked for, random it is
    with pytest.raises(KVBenchError, match="no hub weights"):
        load_model(NAME, "hub", CPU, torch.float32)


def test_transformers_loads_the_bundled_folder_as_is_with_our_logits(trained, passage):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(BUNDLED_MODELS[NAME], attn_implementation="eager").eval()
    assert next(hf.parameters()).dtype == torch.float32  # config.json's dtype, though stored in float16
    ids = torch.tensor(load_tokenizer().encode(passage)[:200])[None]
    with torch.inference_mode():
        ours = trained(ids, torch.arange(ids.size(1))[None])
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_heldout_perplexity_is_far_below_random_weights(trained, passage):
    ids = load_tokenizer().encode(passage)
    assert 2_800 <= len(ids) <= 3_300, len(ids)  # "about 3,000 tokens" (data/README.md)
    ppl = perplexity(trained, ids)
    random_ppl = perplexity(GPT(PRESETS[NAME]).init_weights(seed=0).eval(), ids)
    assert ppl < PPL_BOUND, ppl
    assert random_ppl > 20 * PPL_BOUND, random_ppl  # the bound tells a trained model from an untrained one


def corpus_share(model: GPT, passage: str) -> tuple[float, list[str]]:
    """The share of alphabetic words in 80 sampled tokens (seeded) that are in the passage or in COMMON."""
    from kvbench.decode.generate import Sampler, generate

    tok = load_tokenizer()
    res = generate(model, [tok.encode("ROMEO:\n")], 80, "static", sampler=Sampler(0.8, 40, seed=1))
    words = re.findall(r"[A-Za-z]+", tok.decode(res.tokens[0]))
    known = {w.lower() for w in re.findall(r"[A-Za-z]+", passage)} | COMMON
    return sum(w.lower() in known for w in words) / max(1, len(words)), words


def test_generated_text_is_made_of_words_random_weights_are_not(trained, passage):
    share, words = corpus_share(trained, passage)
    assert len(words) >= 15 and share >= 0.75, (share, words)
    noise, words = corpus_share(GPT(PRESETS[NAME]).init_weights(seed=0).eval(), passage)
    assert noise < 0.25, (noise, words)  # the check fails on random weights (they write 2-4%)


def test_demo_model_is_shakespeare_offline_gpt2_when_cached(monkeypatch):
    import kvbench.model.weights as weights

    monkeypatch.setattr(weights, "hub_snapshot", lambda *a, **k: None)
    monkeypatch.setattr(weights, "hub_reachable", lambda *a, **k: False)
    assert demo_model() == NAME
    monkeypatch.setattr(weights, "hub_reachable", lambda *a, **k: True)
    assert demo_model() == "gpt2"


def test_memory_plans_the_bundled_model():
    import json

    r = CliRunner().invoke(app, ["memory", "-m", NAME, "--ctx", "512", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    model = doc["models"][0] if "models" in doc else doc
    assert NAME in json.dumps(model)
    assert "3,072 B" in CliRunner().invoke(app, ["memory", "-m", NAME, "--ctx", "512"]).stdout  # 2 x 6 x 4 x 32 x 2
