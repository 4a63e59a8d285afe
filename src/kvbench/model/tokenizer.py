"""GPT-2's byte-pair encoding through tiktoken, from the ranks file shipped with kvbench or from local files.

Sources, first match wins: an explicit path (`--tokenizer PATH`), then $KVBENCH_TOKENIZER, then the ranks bundled in
the package (`kvbench/data/gpt2.tiktoken`, see its README). Nothing is downloaded. A path is a `.tiktoken` ranks
file, or a directory holding `vocab.json` + `merges.txt` (as Hugging Face ships GPT-2) or `encoder.json` +
`vocab.bpe` (as OpenAI does). Each file is read through `kvbench.files`: a regular file of at most 64 MiB.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from kvbench import files
from kvbench.errors import KVBenchError
from kvbench.resources import GPT2_RANKS

ENDOFTEXT = "<|endoftext|>"
EOT_ID = 50256
ENV_VAR = "KVBENCH_TOKENIZER"


@dataclass
class Tokenizer:
    encoding: tiktoken.Encoding
    source: str  # where the ranks came from, recorded in outputs

    @property
    def eot_id(self) -> int:
        return EOT_ID

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special={ENDOFTEXT})

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def _encoding_from_ranks(ranks: dict[bytes, int], label: str):
    if len(ranks) != EOT_ID:
        raise KVBenchError(f"{label}: expected GPT-2's {EOT_ID} BPE ranks, found {len(ranks)}")
    if sorted(ranks.values()) != list(range(EOT_ID)):
        raise KVBenchError(f"{label}: GPT-2's BPE ranks are 0 to {EOT_ID - 1}, each once; this file's are not")
    return tiktoken.Encoding(
        name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={ENDOFTEXT: EOT_ID}
    )


def _malformed(label: str, why: str) -> KVBenchError:
    return KVBenchError(f"malformed tokenizer file {label}: {why}")


def _ranks_file(path: Path, label: str) -> dict[bytes, int]:
    """A `.tiktoken` file: one `base64-token rank` pair a line (read here, not by tiktoken, which would keep a copy
    of any local file in its download cache and serve that copy after the file changes)."""
    data = files.read_bytes(path, label, files.TOKENIZER_BYTES, "a tokenizer file", fix=_FIX)
    ranks = {}
    for n, row in enumerate(data.splitlines(), 1):
        if not row:
            continue
        parts = row.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0])] = int(parts[1])
        except (ValueError, binascii.Error):
            raise _malformed(label, f"line {n} is not a base64 token and a rank") from None
    return ranks


def _data_gym_byte_map() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, as vocab.json and merges.txt write tokens."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    out, n = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + n)], n = b, n + 1
    return out


def _data_gym_ranks(vocab: Path, merges: Path, label: str) -> dict[bytes, int]:
    """vocab.json + merges.txt (or encoder.json + vocab.bpe): the merges give the ranks, the vocabulary must agree."""
    byte_of = _data_gym_byte_map()

    def token(text: str, where: str) -> bytes:
        try:
            return bytes(byte_of[c] for c in text)
        except KeyError:
            raise _malformed(where, f"{text!r} is not written in GPT-2's byte alphabet") from None

    bound, noun = files.TOKENIZER_BYTES, "a tokenizer file"
    merges_label, vocab_label = f"{label}/{merges.name}", f"{label}/{vocab.name}"
    lines = files.read_text(merges, merges_label, bound, noun).removeprefix("\ufeff").split("\n")
    ranks = {bytes([b]): i for i, b in enumerate(byte_of.values())}
    for n, row in enumerate(lines, 1):
        row = row.rstrip("\r")
        if not row.strip() or (n == 1 and row.startswith("#")):
            continue
        pair = row.split()
        if len(pair) != 2:
            raise _malformed(merges_label, f"line {n} is not two tokens to merge")
        ranks[token(pair[0], merges_label) + token(pair[1], merges_label)] = len(ranks)
    encoder = files.load_json(vocab, vocab_label, bound, noun)
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise _malformed(vocab_label, "expected a JSON object of token -> id")
    listed = {token(k, vocab_label): v for k, v in encoder.items() if k not in (ENDOFTEXT, "<|startoftext|>")}
    if listed != ranks:
        raise _malformed(label, f"{vocab.name} and {merges.name} disagree on the tokens and their ranks")
    return ranks


_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))
_FIX = "give a .tiktoken ranks file or a directory with vocab.json + merges.txt"


def _from_path(path: Path, label: str):
    if path.is_dir():
        for vocab, merges in _PAIRS:
            if (path / vocab).exists() and (path / merges).exists():
                ranks = _data_gym_ranks(path / vocab, path / merges, label)
                break
        else:
            raise KVBenchError(
                f"tokenizer directory {label} has neither vocab.json + merges.txt nor encoder.json + vocab.bpe"
            )
    else:
        ranks = _ranks_file(path, label)
    return _encoding_from_ranks(ranks, label)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """From `path` (--tokenizer), else $KVBENCH_TOKENIZER, else the ranks file shipped with kvbench."""
    if path is not None:
        label = f"--tokenizer {path}"
    elif os.environ.get(ENV_VAR):
        path = os.environ[ENV_VAR]
        label = f"{ENV_VAR}={path}"
    else:
        return Tokenizer(_from_path(GPT2_RANKS, str(GPT2_RANKS)), "bundled:gpt2.tiktoken")
    p = Path(path).expanduser()
    return Tokenizer(_from_path(p, label), str(p))
