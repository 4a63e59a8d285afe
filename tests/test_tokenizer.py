"""GPT-2's BPE through tiktoken from the shared ranks file (offline)."""

import pytest

from kvbench.errors import KVBenchError
from kvbench.tokenizer import load_tokenizer


def test_hello_world(ranks_file):
    tok = load_tokenizer(ranks_file)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("<|endoftext|>") == [50256] == [tok.eot_id]


def test_round_trip(ranks_file):
    tok = load_tokenizer(ranks_file)
    text = "The KV cache keeps past keys and values: naïve décodage, 漢字, emoji 🙂."
    assert tok.decode(tok.encode(text)) == text


def test_env_var_source(ranks_file, monkeypatch):
    monkeypatch.setenv("KVBENCH_TOKENIZER", str(ranks_file))
    assert load_tokenizer().source == str(ranks_file)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(KVBenchError, match="not found"):
        load_tokenizer(tmp_path / "missing.tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("this is not a ranks file\n")
    with pytest.raises(KVBenchError, match="malformed tokenizer file"):
        load_tokenizer(bad)
    with pytest.raises(KVBenchError, match="neither vocab.json"):
        load_tokenizer(tmp_path)
