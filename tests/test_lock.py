"""requirements.lock (make lock): every dependency pyproject.toml declares pinned, for every Python kvbench supports,
torch left to TORCH_SPEC; and this environment holds what it pins (make install), a newer release installed over it
being a stated difference."""

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"


def pins() -> list[tuple[str, str, Marker | None]]:
    """(name, version, marker) per line of the lock."""
    out = []
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spec, _, marker = line.partition(";")
        name, _, version = spec.strip().partition("==")
        assert version, f"{line!r}: the lock pins every package with =="
        out.append((canonicalize_name(name), version, Marker(marker.strip()) if marker.strip() else None))
    return out


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_every_declared_dependency_is_pinned_for_every_python(python):
    env = {"python_version": python, "python_full_version": f"{python}.0"}
    here = {name for name, _, marker in pins() if marker is None or marker.evaluate(env)}
    for req in declared():
        name = canonicalize_name(req.name)
        if name == "torch" or (req.marker is not None and not req.marker.evaluate(env)):
            continue
        assert name in here, f"{req.name} is declared but the lock pins no version of it for Python {python}"


def test_torch_and_the_cuda_build_are_left_to_torch_spec():
    names = [name for name, _, _ in pins()]
    assert "torch" not in names
    assert not [n for n in names if re.match(r"(nvidia-|cuda-|triton)", n)], names


def test_the_pins_satisfy_the_declared_ranges():
    """The lock is a resolution of pyproject.toml's ranges, not a list that drifted away from them."""
    locked = {(name, marker is None or marker.evaluate()): version for name, version, marker in pins()}
    for req in declared():
        version = locked.get((canonicalize_name(req.name), True))
        if version is not None:
            assert req.specifier.contains(version, prereleases=True), f"{req}: the lock pins {version}"


def test_this_environment_holds_the_locked_versions():
    """make install installs exactly the lock. A package newer than its pin (the newest transformers installed over
    the lock, as scripts/compat.sh does) is a stated difference, a skip naming it; one missing or older than its pin
    is an install that went wrong."""
    from packaging.version import Version

    missing, older, newer = [], [], []
    for name, version, marker in pins():
        if marker is not None and not marker.evaluate():
            continue
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{name} (the lock pins {version})")
            continue
        if Version(installed) < Version(version):
            older.append(f"{name} {installed} (the lock pins {version})")
        elif Version(installed) > Version(version):
            newer.append(f"{name} {installed} (the lock pins {version})")
    assert not missing and not older, f"not the lock: missing {missing}, older {older}; make install restores it"
    if newer:
        pytest.skip("installed over the lock: " + ", ".join(newer))
