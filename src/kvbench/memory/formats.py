"""Storage formats: bytes per cached element (with a quantized cache's scales) and per weight."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.dtypes import canonical


@dataclass(frozen=True)
class KVFormat:
    """How one cached element is stored, including the metadata a quantized cache needs to dequantize it."""

    name: str  # CLI name: fp32, fp16, bf16, fp8, int8, int4
    bits: int  # bits per stored element
    group_size: int | None  # elements of one K or V vector that share a scale (None: no per-group metadata)
    meta_bytes: int  # bytes of metadata per group: fp16 scale (int8), fp16 scale + fp16 zero point (int4)
    note: str  # the overhead, stated in words

    def vector_bytes(self, n: int) -> int:
        """Bytes to store one cached vector of n elements (one head's K or V, or one MLA latent)."""
        data = -(-n * self.bits // 8)  # ceil: a half-filled int4 byte is still a byte
        groups = 0 if self.group_size is None else -(-n // self.group_size)
        return data + groups * self.meta_bytes

    def working(self, n: int) -> str:
        """The bytes of one n-element vector, as arithmetic."""
        if self.group_size is None:
            b = self.bits / 8
            return f"{n} x {b:g} B"
        groups = -(-n // self.group_size)
        return f"({n} x {self.bits}/8 B + ceil({n}/{self.group_size}) = {groups} groups x {self.meta_bytes} B scales)"


KV_FORMATS: dict[str, KVFormat] = {
    "fp32": KVFormat("fp32", 32, None, 0, "4 B per element, no scales"),
    "fp16": KVFormat("fp16", 16, None, 0, "2 B per element, no scales"),
    "bf16": KVFormat("bf16", 16, None, 0, "2 B per element, no scales"),
    "fp8": KVFormat(
        "fp8",
        8,
        None,
        0,
        "1 B per element (e4m3); one fp32 scale per layer for K and one for V, not per token (8 B per layer, ignored)",
    ),
    "int8": KVFormat(
        "int8",
        8,
        64,
        2,
        "1 B per element + one fp16 scale per group of 64 elements along the vector (+2 B per 64 B, +3.1%)",
    ),
    "int4": KVFormat(
        "int4",
        4,
        64,
        4,
        "0.5 B per element + fp16 scale and fp16 zero point per group of 64 elements (+4 B per 32 B, +12.5%); "
        "like transformers' QuantizedCache (q_group_size=64), minus its full-precision residual window",
    ),
}

# Bits per weight. Quantized weights also carry group scales (int4 at group 128 with fp16 scale + zero: +3%); the
# weights figure here is the bare parameter storage, which is what `--weights-dtype` sizes.
WEIGHT_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}


def get_kv_format(name: str) -> KVFormat:
    """Any spelling kvbench.dtypes accepts (float16, half, bfloat16, ...) -> its format."""
    return KV_FORMATS[canonical(name, "--kv-dtype", tuple(KV_FORMATS))]


def weight_dtype(name: str) -> str:
    """The canonical name of a --weights-dtype spelling (kvbench.dtypes)."""
    return canonical(name, "--weights-dtype", tuple(WEIGHT_BITS))


def weight_bits(name: str) -> int:
    return WEIGHT_BITS[weight_dtype(name)]
