"""Defects of the libraries under a `verify --hf` row that kvbench knows, each with the versions it holds for and a
plain reproducer (docs/verify.md#known-defects-of-the-libraries-kvbench-runs). A failing row that one of them explains
is reported as that library's, with what was measured, and never decides the model's verdict: the model under test
did not cause it and cannot fix it. A defect fixed upstream stops matching by version, and a row that passes is
never touched.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    from kvbench.hf.introspect import HFModelInfo


def installed(package: str) -> Version | None:
    """The installed version of `package`, or None when it is not installed or its version is unreadable (a
    package uninstalled with its files left behind reads as 'N/A')."""
    try:
        return Version(importlib.metadata.version(package))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


@dataclass(frozen=True)
class KnownDefect:
    library: str  # the distribution whose defect it is (its installed version is what `versions` reads)
    versions: str  # the versions it holds for, a PEP 440 specifier set ("" for every version seen so far)
    checks: tuple[str, ...]  # the checks it makes fail
    what: str  # the defect, in one line
    reproducer: str  # where the plain reproducer is
    upstream: str = ""  # its upstream status, when known
    signature: str = ""  # words the failing row's detail carries ("": any failure of those checks)
    applies: Callable[[HFModelInfo], bool] = lambda info: True  # the models it reaches

    def explains(self, check: str, detail: str, info: HFModelInfo) -> bool:
        version = installed(self.library)
        in_range = version is not None and SpecifierSet(self.versions).contains(version, prereleases=True)
        return check in self.checks and self.signature in detail and in_range and self.applies(info)

    def words(self) -> str:
        version = installed(self.library)
        upstream = f"; upstream: {self.upstream}" if self.upstream else ""
        return (
            f"a known defect of {self.library} {version} (holds for {self.versions or 'every version seen'}): "
            f"{self.what} (reproducer: {self.reproducer}{upstream})"
        )


STATIC_ROLLBACK_ON_RECURRENT = KnownDefect(
    "transformers",
    ">=5.24",
    ("rollback",),
    "recording a linear-attention layer's past (activate_past_recording) turns StaticCache.is_compileable off, and "
    "create_causal_mask then skips a one-token query's mask, so the decode step attends to the StaticCache's empty "
    "slots (before 5.25 most hybrids declared these caches not croppable and the row was skipped; LFM2's "
    "convolution layers did not, and failed the same way)",
    "docs/verify.md#known-defects-of-the-libraries-kvbench-runs",
    applies=lambda info: any("recurrent" in t for t in info.layer_types),
)

STATIC_PROMPT_LOOKUP_OVERRUN = KnownDefect(
    "transformers",
    ">=5.24",
    ("rollback",),
    "prompt-lookup decoding writes a draft proposed near the end of max_new_tokens past the last slot of the "
    "StaticCache generate allocates (index_copy_ out of bounds); plain static greedy and prompt lookup on a "
    "DynamicCache are fine and equal (seen on 5.24.0 and 5.25.0; not on 5.18.0)",
    "docs/verify.md#the-lifecycle-checks-rollback-fork-reorder-chunked-prefill",
    signature="generate(prompt_lookup_num_tokens=3) raised IndexError: index_copy_()",
)

QUANTO_DEEPCOPY = KnownDefect(
    "optimum-quanto",
    "",
    ("fork",),
    "copy.deepcopy of a QuantizedCache with the quanto backend raises: quanto's quantized tensors are wrapper "
    "subclasses that implement no clone(), which torch's default __deepcopy__ needs",
    "docs/verify.md#known-defects-of-the-libraries-kvbench-runs",
    signature="deepcopy",
)


# transformers' continuous batching calls every model's forward with its PagedAttentionCache, whatever the model's
# code does with a cache: a model written for the Cache classes fails every request inside the generation loop. Each
# way it fails is a signature of the one defect (reproduced in docs/verify-hf.md).
PAGED_UNSUPPORTED_WHAT = (
    "generate_batch runs any model and checks nothing up front, but continuous batching works only for a model whose "
    "code passes the batch's kwargs down to PagedAttentionCache.update and calls nothing else of it: a model that "
    "calls another Cache member (get_seq_length, layers, is_initialized), calls update without the kwargs or drops "
    "them on the way (KeyError 'cu_seq_lens_k'), or uses the mask create_causal_mask returns (None for a "
    "PagedAttentionCache: MPT) fails every request in the generation loop, each coming back failed (seen on 5.25.0)"
)
PAGED_REPRODUCER = "docs/verify-hf.md#models-continuous-batching-cannot-run"
PAGED_UNSUPPORTED = tuple(
    KnownDefect("transformers", ">=5.25", ("batch", "reuse"), PAGED_UNSUPPORTED_WHAT, PAGED_REPRODUCER, signature=s)
    for s in (
        "'PagedAttentionCache' object has no attribute",
        "PagedAttentionCache.update() missing",
        "KeyError: 'cu_seq_lens_k' (in PagedAttentionCache.update",
        "'NoneType' object has no attribute 'to' (in MptModel.forward",
    )
)
PAGED_EAGER_SINKS = KnownDefect(
    "transformers",
    ">=5.25",
    ("batch", "reuse"),
    "eager_paged_attention_forward, the eager attention continuous batching runs, takes any layer with a `sinks` "
    "attribute for a layer with attention sinks; MiMo-V2-Flash's full-attention layers hold sinks = None (its own "
    "eager attention checks `is not None`), so every request fails on None.reshape (seen on 5.25.0)",
    PAGED_REPRODUCER,
    signature="attribute 'reshape' (in eager_paged_attention_forward",
)


def known_defect(defects: tuple[KnownDefect, ...], check: str, detail: str, info: HFModelInfo) -> str | None:
    """The words of the first of `defects` that explains a failing `check` (its row's `detail`) on this model, or
    None."""
    return next((d.words() for d in defects if d.explains(check, detail, info)), None)
