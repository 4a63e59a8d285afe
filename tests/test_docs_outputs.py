"""scripts/docs_outputs.py's comparison, on hand-written blocks (no command runs): a block marked `(timings vary)`
is held to its shape, every number masked; any other block to its text, timing figures ignored."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

BLOCK = [
    "bench: gpt2 (random(seed=0, std=0.02)) on CPU (x86_64, 1 threads), fp32, 16 new tokens",
    "cache   TTFT ms  TPOT ms     p90  floor ms  x floor  total s",
    "────────────────────────────────────────────────────────────",
    "none      843.3   783.81  790.18         -        -   12.532",
    "static    806.3    48.06   50.50     34.98    1.37x    1.536",
]


@pytest.fixture(scope="module")
def docs_outputs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_outputs_script", ROOT / "scripts" / "docs_outputs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def replaced(lines: list[str], index: int, line: str) -> list[str]:
    return [*lines[:index], line, *lines[index + 1 :]]


FIGURES_MOVED = replaced(
    replaced(BLOCK, 3, "none     1843.3  1783.81 1790.18         -        -  112.532"),
    4,
    "static    96.3     8.06   -0.50  1,034.98    0.37x    1e-06",
)
WIDER = [line + "─" * 4 if line.startswith("─") else line for line in BLOCK]


@pytest.mark.parametrize(
    ("new", "differs"),
    [
        (BLOCK, False),
        (FIGURES_MOVED, False),  # every figure changed, a column wider
        (WIDER, False),  # the rule under a widened header
        (replaced(BLOCK, 1, "cache   TTFT ms  TPOT ms     p50  floor ms  x floor  total s"), True),  # a label
        (replaced(BLOCK, 4, "paged     806.3    48.06   50.50     34.98    1.37x    1.536"), True),  # a row's name
        (replaced(BLOCK, 4, "static    806.3    48.06   50.50     34.98    1.37x"), True),  # a column lost
        (BLOCK[:-1], True),  # a row lost
        (replaced(BLOCK, 0, BLOCK[0].replace("fp32", "fp16")), True),  # a name that holds digits is text
    ],
)
def test_timings_vary_blocks_keep_their_shape(docs_outputs: ModuleType, new: list[str], differs: bool) -> None:
    assert docs_outputs.differs(BLOCK, new, vary=True) is differs


def test_other_blocks_ignore_only_timing_figures(docs_outputs: ModuleType) -> None:
    timed = replaced(BLOCK, 0, BLOCK[0] + ", took 1.5 s")
    assert not docs_outputs.differs(timed, replaced(timed, 0, BLOCK[0] + ", took 12.25 s"), vary=False)
    assert docs_outputs.differs(BLOCK, FIGURES_MOVED, vary=False)  # a figure of a block that does not vary


def test_a_marker_names_its_options(docs_outputs: ModuleType) -> None:
    opts = docs_outputs.parse_marker("kvbench bench -n 16 (timings vary; head 6)")
    assert opts["command"] == "kvbench bench -n 16" and opts["vary"] and opts["head"] == 6
    assert not docs_outputs.parse_marker("kvbench memory --ctx 8k")["vary"]
