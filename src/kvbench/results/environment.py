"""Whether two runs are comparable: their identity (what the user or the software chose: device, dtype, library
versions, threads, huge pages asked for) must match, and their context (what was measured on the machine at run
time: huge pages given, read bandwidth) is shown side by side, and warned about when it differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KVBenchError

# Identity: what the user or the software chose for a run. Timings are comparable only when it is the same, so a
# difference is refused (unless --allow-env-change). The kvbench version and git commit are left out on purpose:
# they are what a comparison is about.
IDENTITY = (
    ("device", ("device",)),
    ("device name", ("device_name",)),
    ("dtype", ("dtype",)),
    ("python", ("versions", "python")),
    ("torch", ("versions", "torch")),
    ("transformers", ("versions", "transformers")),
    ("numpy", ("versions", "numpy")),
    ("CUDA", ("versions", "cuda")),
    ("torch threads", ("versions", "torch_threads")),
    ("THP_MEM_ALLOC_ENABLE", ("host", "huge_pages", "THP_MEM_ALLOC_ENABLE")),  # huge pages asked for, as set
)
# Context: what was measured or found on the machine at run time (whether the kernel actually gave huge pages to a
# fresh buffer depends on fragmentation and load; the read bandwidth moves with load). Shown side by side and
# warned about when it differs, never a reason to refuse.
CONTEXT = (
    ("huge pages in use", ("host", "huge_pages", "in_use")),
    ("huge pages advised", ("host", "huge_pages", "advised")),
    ("kernel THP mode", ("host", "huge_pages", "system")),
    ("read bandwidth (GB/s)", ("floor", "bandwidth", "gbps")),
)


@dataclass
class EnvChange:
    name: str  # e.g. "torch", "dtype"
    baseline: str | None
    candidate: str | None


@dataclass
class ContextField:
    """A measured fact about the machine in both runs; `differs` when it changed (a number: by more than the
    comparison's threshold)."""

    name: str
    baseline: object
    candidate: object
    differs: bool


def _dig(doc: dict, path: tuple[str, ...]):
    for k in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return doc


def environment_changes(base_meta: dict, cand_meta: dict) -> list[EnvChange]:
    """Every identity field whose value differs between the two meta.json files."""
    changes = []
    for name, path in IDENTITY:
        b, c = _dig(base_meta, path), _dig(cand_meta, path)
        if b != c:
            changes.append(EnvChange(name, None if b is None else str(b), None if c is None else str(c)))
    return changes


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def context_fields(base_meta: dict, cand_meta: dict, threshold: float) -> list[ContextField]:
    """The context fields either run recorded, side by side."""
    out = []
    for name, path in CONTEXT:
        b, c = _dig(base_meta, path), _dig(cand_meta, path)
        if b is None and c is None:
            continue
        if _is_number(b) and _is_number(c) and b > 0:
            differs = abs(c / b - 1) > threshold
        else:
            differs = b != c
        out.append(ContextField(name, b, c, differs))
    return out


def describe_changes(changes: list[EnvChange]) -> str:
    return "; ".join(f"{c.name} {c.baseline} -> {c.candidate}" for c in changes)


def describe_context(fields: list[ContextField]) -> str:
    def show(v) -> str:
        return f"{v:.1f}" if _is_number(v) and not isinstance(v, int) else str(v)

    return "; ".join(f"{f.name} {show(f.baseline)} -> {show(f.candidate)}" for f in fields)


def check_environment(
    base_meta: dict, cand_meta: dict, allow_env_change: bool, command: str = "kvbench compare"
) -> list[EnvChange]:
    """The identity changes between two runs; KVBenchError listing them unless they are allowed."""
    changes = environment_changes(base_meta, cand_meta)
    if changes and not allow_env_change:
        raise KVBenchError(
            f"the runs come from different environments ({describe_changes(changes)}); timings are not comparable. "
            f"Rerun both on the same machine and software, or compare anyway with {command} --allow-env-change"
        )
    return changes
