"""The ways an engine runs a request cold: one registry, `--reset NAME` chooses.

A reset either empties the engine's prefix cache with a request of its own before the cold run (`path`: every
cached prefix is gone, so the next requests start cold too), or asks for the cold run in the request itself
(`fields`: that request reuses nothing, and the cache is left as it was). `none`: the engine has no way; a cold run
is then the first request of a prompt nothing sent before began with.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Reset:
    name: str
    summary: str  # which engines, in words
    path: str | None = None  # POSTed (from the server's root) before a cold run: empties the whole prefix cache
    fields: dict = field(default_factory=dict)  # added to a cold request's body: that request reuses nothing

    @property
    def available(self) -> bool:
        return self.path is not None or bool(self.fields)

    @property
    def clears_all(self) -> bool:
        """After it, nothing is cached (a POST), not only the cold request's own prompt."""
        return self.path is not None

    @property
    def how(self) -> str:
        if self.path is not None:
            return f"POST {self.path}"
        if self.fields:
            return ", ".join(f'"{k}": {str(v).lower()}' for k, v in self.fields.items()) + " in the cold request"
        return "none (a cold run is a prompt's first request)"


RESETS: dict[str, Reset] = {
    r.name: r
    for r in (
        Reset("kvbench", "kvbench serve: POST /reset_prefix_cache", path="/reset_prefix_cache"),
        Reset("vllm", "vLLM: POST /reset_prefix_cache (with VLLM_SERVER_DEV_MODE=1)", path="/reset_prefix_cache"),
        Reset("sglang", "SGLang: POST /flush_cache", path="/flush_cache"),
        Reset(
            "llamacpp",
            'llama.cpp\'s llama-server: "cache_prompt": false in the request',
            fields={"cache_prompt": False},
        ),
        Reset("none", "no reset: a cold run is the first request of an unseen prompt"),
    )
}


def get_reset(name: str) -> Reset:
    from kvbench.errors import KVBenchError

    if name not in RESETS:
        raise KVBenchError(f"unknown --reset {name!r}; use {', '.join(RESETS)}")
    return RESETS[name]
