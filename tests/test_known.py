"""Known defects of the libraries under `verify --hf` (hf/known.py): a failing row one of them explains is reported
as that library's and not judged; out of its versions, on another check, another failure or another model, it
explains nothing."""

from types import SimpleNamespace

import pytest
import transformers

from kvbench.hf.caches import HF_CACHES
from kvbench.hf.known import KnownDefect, installed, known_defect

HYBRID = SimpleNamespace(layer_types=["recurrent", "full"])
PLAIN = SimpleNamespace(layer_types=["full", "full"])


def defect(versions: str, **kw) -> KnownDefect:
    return KnownDefect("transformers", versions, ("rollback",), "it breaks", "docs/x.md", **kw)


@pytest.mark.parametrize(
    "versions, check, detail, info, explains",
    [
        (f"=={transformers.__version__}", "rollback", "first off at row 6", PLAIN, True),
        (">=0.1", "rollback", "", PLAIN, True),
        ("<0.1", "rollback", "first off at row 6", PLAIN, False),  # fixed before the installed release
        (">=99", "rollback", "first off at row 6", PLAIN, False),  # not yet
        (">=0.1", "fork", "first off at row 6", PLAIN, False),  # another check
    ],
)
def test_a_defect_explains_its_checks_in_its_versions(versions, check, detail, info, explains):
    assert defect(versions).explains(check, detail, info) is explains


def test_a_defect_explains_only_its_own_failure_on_the_models_it_reaches():
    d = defect("", signature="raised IndexError", applies=lambda info: "recurrent" in info.layer_types)
    assert d.explains("rollback", "the run raised IndexError: list index", HYBRID)
    assert not d.explains("rollback", "first off at row 6", HYBRID)  # another failure is the model's
    assert not d.explains("rollback", "the run raised IndexError: list index", PLAIN)


def test_a_library_not_installed_or_unreadable_explains_nothing(monkeypatch):
    import importlib.metadata

    assert installed("not-a-distribution-kvbench-knows") is None
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "N/A")  # files left behind by an uninstall
    assert installed("transformers") is None
    assert not defect("").explains("rollback", "", PLAIN)


def test_the_words_name_the_library_its_version_and_the_reproducer():
    words = known_defect((defect(">=0.1", upstream="fixed in 9.9"),), "rollback", "", PLAIN)
    assert words.startswith(f"a known defect of transformers {transformers.__version__} (holds for >=0.1): it breaks")
    assert "reproducer: docs/x.md" in words and "upstream: fixed in 9.9" in words
    assert known_defect((defect("<0.1"),), "rollback", "", PLAIN) is None


def test_every_known_defect_points_at_a_reproducer_that_exists():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for cache in HF_CACHES.values():
        for d in cache.known:
            page, _, anchor = d.reproducer.partition("#")
            headings = re.findall(r"^#+ (.+)$", (root / page).read_text(), re.MULTILINE)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, d
