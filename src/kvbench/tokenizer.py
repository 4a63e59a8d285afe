"""GPT-2's byte-pair encoding through tiktoken, from the ranks file shipped with kvbench or from local files.

Sources, first match wins: an explicit path (`--tokenizer PATH`), then $KVBENCH_TOKENIZER, then the ranks bundled in
the package (`kvbench/data/gpt2.tiktoken`, see its README). Nothing is downloaded. A path is a `.tiktoken` ranks
file, or a directory holding `vocab.json` + `merges.txt` (as Hugging Face ships GPT-2) or `encoder.json` +
`vocab.bpe` (as OpenAI does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.resources import GPT2_RANKS

ENDOFTEXT = "<|endoftext|>"
EOT_ID = 50256
ENV_VAR = "KVBENCH_TOKENIZER"


@dataclass
class Tokenizer:
    encoding: object  # tiktoken.Encoding
    source: str  # where the ranks came from, recorded in outputs

    @property
    def eot_id(self) -> int:
        return EOT_ID

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special={ENDOFTEXT})

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def decode_token(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token_id)


def _encoding_from_ranks(ranks: dict[bytes, int]):
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    if len(ranks) != EOT_ID:
        raise KVBenchError(f"expected GPT-2's {EOT_ID} BPE ranks, found {len(ranks)}")
    return tiktoken.Encoding(
        name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={ENDOFTEXT: EOT_ID}
    )


def _from_path(path: Path):
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe

    if not path.exists():
        raise KVBenchError(f"tokenizer path not found: {path}")
    try:
        if path.is_dir():
            for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
                if (path / vocab).is_file() and (path / merges).is_file():
                    ranks = data_gym_to_mergeable_bpe_ranks(str(path / merges), str(path / vocab))
                    break
            else:
                raise KVBenchError(
                    f"tokenizer directory {path} has neither vocab.json + merges.txt nor encoder.json + vocab.bpe"
                )
        else:
            ranks = load_tiktoken_bpe(str(path))
    except KVBenchError:
        raise
    except Exception as e:  # tiktoken raises ValueError, binascii.Error, KeyError... on malformed files
        raise KVBenchError(f"malformed tokenizer file {path}: {type(e).__name__}: {e}") from None
    return _encoding_from_ranks(ranks)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    if path is None and os.environ.get(ENV_VAR):
        path = os.environ[ENV_VAR]
    if path is not None:
        p = Path(path).expanduser()
        return Tokenizer(_from_path(p), str(p))
    return Tokenizer(_from_path(GPT2_RANKS), "bundled:gpt2.tiktoken")
