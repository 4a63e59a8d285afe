"""Facts of transformers that tests assert, each stated with the versions it holds for.

kvbench reads transformers' caches, plans and configs, and transformers changes them in most releases. A test that
asserts such a fact takes it from `since({version: value, ...})` (the value from each version on) and compares with
`holds`: on a release up to the locked one (requirements.lock, what CI installs) a mismatch fails, as any wrong
assertion does; on a newer release it is a stated difference (a skip naming the fact, what the release does and the
versions the old value held for), so a new transformers is a report to read, never a red suite.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypeVar

import pytest
import transformers
from packaging.version import Version

T = TypeVar("T")

LOCK = Path(__file__).resolve().parents[1] / "requirements.lock"
INSTALLED = Version(transformers.__version__)


def locked(package: str = "transformers") -> Version:
    """The version requirements.lock pins for `package`."""
    match = re.search(rf"^{re.escape(package)}==(\S+)", LOCK.read_text(), re.MULTILINE)
    assert match, f"{LOCK.name} pins no {package}"
    return Version(match.group(1))


def newer_than_locked() -> bool:
    return INSTALLED > locked()


def since(values: dict[str, T]) -> T:
    """The value for the installed transformers: `values` maps the first version a value holds for to the value."""
    first = sorted(values, key=Version)
    held = [v for v in first if Version(v) <= INSTALLED]
    assert held, f"no value stated for transformers {INSTALLED} (the oldest stated is {first[0]})"
    return values[held[-1]]


def holds(actual: object, expected: object, what: str) -> None:
    """Assert a fact of transformers; past the locked release a mismatch is a stated difference (a skip)."""
    if actual == expected:
        return
    if newer_than_locked():
        pytest.skip(
            f"transformers {INSTALLED} differs from {locked()} (the locked release): {what} is {actual!r}, "
            f"stated {expected!r} up to {locked()}"
        )
    raise AssertionError(f"{what}: {actual!r}, but transformers {INSTALLED} states {expected!r}")
