"""GPT-2's BPE through tiktoken from the ranks file shipped in the package (offline)."""

import hashlib

import pytest

from kvbench.errors import KVBenchError
from kvbench.model.tokenizer import load_tokenizer


def test_hello_world(ranks_file):
    tok = load_tokenizer(ranks_file)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("<|endoftext|>") == [50256] == [tok.eot_id]


def test_round_trip(ranks_file):
    tok = load_tokenizer(ranks_file)
    text = "The KV cache keeps past keys and values: naïve décodage, 漢字, emoji 🙂."
    assert tok.decode(tok.encode(text)) == text


BUNDLED_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # openai/whisper's gpt2.tiktoken


def test_bundled_ranks_are_gpt2s(ranks_file):
    assert hashlib.sha256(ranks_file.read_bytes()).hexdigest() == BUNDLED_SHA256


def test_default_is_the_bundled_file_and_downloads_nothing(monkeypatch):
    import tiktoken

    def no_download(*a, **k):
        raise AssertionError("the default tokenizer must not reach tiktoken's download")

    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    tok = load_tokenizer()
    assert tok.source == "bundled:gpt2.tiktoken"
    assert tok.encode("Hello world") == [15496, 995]


def test_source_order(ranks_file, tmp_path, monkeypatch):
    """--tokenizer > $KVBENCH_TOKENIZER > the bundled file."""
    copy = tmp_path / "env.tiktoken"
    copy.write_bytes(ranks_file.read_bytes())
    monkeypatch.setenv("KVBENCH_TOKENIZER", str(copy))
    assert load_tokenizer().source == str(copy)
    assert load_tokenizer(ranks_file).source == str(ranks_file)
    monkeypatch.setenv("KVBENCH_TOKENIZER", str(tmp_path / "missing.tiktoken"))
    with pytest.raises(KVBenchError, match="not found"):
        load_tokenizer()  # a broken $KVBENCH_TOKENIZER is an error, never silently replaced


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(KVBenchError, match="not found"):
        load_tokenizer(tmp_path / "missing.tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("this is not a ranks file\n")
    with pytest.raises(KVBenchError, match="malformed tokenizer file"):
        load_tokenizer(bad)
    with pytest.raises(KVBenchError, match="neither vocab.json"):
        load_tokenizer(tmp_path)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what vocab.json and merges.txt are written in)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    out, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b], n = chr(256 + n), n + 1
    return out


def test_vocab_json_and_merges_txt_directory(ranks_file, tmp_path):
    """Hugging Face's format (vocab.json + merges.txt), written from the ranks file, loads to the same encoding."""
    import json

    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(ranks_file))
    u = _byte_to_unicode()

    def s(token: bytes) -> str:
        return "".join(u[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        # any split into two lower-ranked tokens rebuilds the same ranks (the merge list only concatenates)
        a, b = next(
            (token[:i], token[i:])
            for i in range(1, len(token))
            if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
        )
        merges.append(f"{s(a)} {s(b)}")
    vocab = {s(t): r for t, r in ranks.items()} | {"<|endoftext|>": 50256}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")

    from_dir, from_ranks = load_tokenizer(tmp_path), load_tokenizer(ranks_file)
    text = "Hello world: the KV cache keeps past keys and values, naïve 漢字 🙂"
    assert from_dir.encode("Hello world") == [15496, 995]
    assert from_dir.encode(text) == from_ranks.encode(text)
    assert from_dir.source == str(tmp_path)
