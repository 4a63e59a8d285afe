"""kvbench: build, verify, break and measure the KV cache of autoregressive decoding on GPT-2."""

__version__ = "0.1.0"
