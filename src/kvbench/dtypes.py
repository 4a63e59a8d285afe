"""Dtype names: the spellings users type (kvbench's, torch's, transformers' and vLLM's) -> one canonical name.

    canonical  also accepted
    fp32       float32, float
    fp16       float16, half
    bf16       bfloat16
    fp8        fp8_e4m3, float8_e4m3fn   (e4m3; the storage format of `memory --kv-dtype fp8`)
    int8, int4 (no other spelling)

Case-insensitive, with an optional `torch.` prefix (`torch.float16`, as torch prints a dtype). The canonical name is
what every command records in its CSV and JSON. `--dtype` (generate, verify, break, bench, their --hf paths and
bench's TOML `dtype`) takes the float formats plus `auto`; `memory --kv-dtype` and `--weights-dtype` take them all.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbench.errors import KVBenchError

SPELLINGS: dict[str, tuple[str, ...]] = {
    "fp32": ("fp32", "float32", "float"),
    "fp16": ("fp16", "float16", "half"),
    "bf16": ("bf16", "bfloat16"),
    "fp8": ("fp8", "fp8_e4m3", "float8_e4m3fn"),
    "int8": ("int8",),
    "int4": ("int4",),
}
FLOATS = ("fp32", "fp16", "bf16")  # what a model's weights and activations run in (`--dtype`)
_CANONICAL = {s: name for name, spellings in SPELLINGS.items() for s in spellings}


def accepted(names: Sequence[str], extra: Sequence[str] = ()) -> str:
    """The accepted spellings of `names` in one phrase: 'fp32 (float32, float), fp16 (float16, half), ... or auto'."""
    parts = [name + (f" ({', '.join(SPELLINGS[name][1:])})" if len(SPELLINGS[name]) > 1 else "") for name in names]
    parts += list(extra)
    return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]


def canonical(text: str, flag: str, names: Sequence[str] = FLOATS, extra: Sequence[str] = ()) -> str:
    """`text` as one of the canonical `names` (or one of `extra`, e.g. 'auto', lower-cased); anything else is one
    line naming `flag` and every accepted spelling."""
    key = text.strip().lower() if isinstance(text, str) else ""
    key = key.removeprefix("torch.")
    if key in extra:
        return key
    name = _CANONICAL.get(key)
    if name is not None and name in names:
        return name
    raise KVBenchError(
        f"unknown {flag} {text!r}; use {accepted(names, extra)} (case-insensitive; a torch. prefix is allowed)"
    )
