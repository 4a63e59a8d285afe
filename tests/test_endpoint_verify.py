"""`kvbench verify --endpoint` against an engine kvbench did not write (tests/foreign_engine.py): it passes an honest
engine, fails each engine that gets reuse wrong on purpose naming the check that caught it, and skips with one line
what an engine does not expose."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from foreign_engine import Running, Settings, save_tiny_model
from kvbench.cli import app
from kvbench.endpoint.accounting import NO_FIELD
from kvbench.jsonio import load_schema

RUN = ["-n", "6"]  # 6 new tokens a request: every check's scenario in a few seconds on the tiny model
WARM_COLD = [
    "warm-cold:repeat",
    "warm-cold:shared-prefix",
    "warm-cold:multi-turn",
    "warm-cold:interleaved",
    "warm-cold:moved-block",
]
EVICTED = ["evicted:repeat", "evicted:shared-prefix", "evicted:reset"]
BATCH = ["batch-invariance:distinct", "batch-invariance:shared-prefix"]
ACCOUNTING = ["accounting:cached-tokens", "accounting:reset", "accounting:counters"]
ALL = [*WARM_COLD, *EVICTED, *BATCH, *ACCOUNTING]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("foreign") / "model")


@contextmanager
def engine(model_dir: Path, **settings) -> Iterator[str]:
    with Running(model_dir, Settings(**settings)) as url:
        yield url


def verify(url: str, *args: str):
    return CliRunner().invoke(app, ["verify", "--endpoint", url, "--reset", "vllm", *RUN, *args])


def rows(result) -> dict[str, dict]:
    doc = json.loads(result.stdout)
    jsonschema.Draft202012Validator(load_schema("verify")).validate(doc)
    return {r["name"]: r for r in doc["checks"]}


def failed(by_name: dict[str, dict]) -> set[str]:
    return {n for n, r in by_name.items() if not r["passed"] and not r["skipped"]}


def test_an_honest_engine_passes_every_check_bit_identical(model_dir, tmp_path):
    with engine(model_dir) as url:
        r = verify(url, "--json", "--junit-xml", str(tmp_path / "v.xml"))
    assert r.exit_code == 0, r.output
    by_name = rows(r)
    assert list(by_name) == ALL
    assert not failed(by_name) and not any(x["skipped"] for x in by_name.values())
    for name in [*WARM_COLD, *EVICTED, *BATCH]:
        assert "bit-identical" in by_name[name]["detail"] and by_name[name]["max_abs_diff"] == 0, by_name[name]
    # the flood recomputed the evicted prompts: nothing of them was still cached
    evidence = json.loads(r.stdout)["endpoint"]["evidence"]
    assert evidence["evicted"]["cached_after"] == [0, 0], evidence
    assert "consistent with blocks of 16 (vllm:cache_config_info)" in by_name["accounting:cached-tokens"]["detail"]
    suite = ET.parse(tmp_path / "v.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == str(len(ALL)) and suite.get("failures") == "0"


@pytest.mark.parametrize(
    "settings, caught, clean",
    [
        (
            {"mode": "corrupt-warm"},
            [*WARM_COLD[:4], "batch-invariance:shared-prefix"],
            [*EVICTED, "batch-invariance:distinct", "warm-cold:moved-block"],
        ),
        (
            {"mode": "corrupt-host", "host_blocks": 400},
            EVICTED[:2],
            ["warm-cold:repeat", "evicted:reset", "batch-invariance:distinct"],
        ),
        ({"mode": "lie-cached"}, [*ACCOUNTING, "evicted:reset"], [*WARM_COLD, *EVICTED[:2]]),
        ({"mode": "lie-zero"}, ["accounting:cached-tokens", "accounting:counters"], WARM_COLD),
        ({"mode": "batch-variant"}, BATCH, WARM_COLD),
        ({"mode": "unchained"}, ["warm-cold:moved-block", "accounting:cached-tokens"], WARM_COLD[:4]),
        ({"mode": "reset-keeps-host", "host_blocks": 400}, ["evicted:reset"], EVICTED[:2]),
    ],
    ids=lambda x: x.get("mode") if isinstance(x, dict) else None,
)
def test_each_wrong_engine_fails_the_check_that_catches_it(model_dir, settings, caught, clean):
    # batch-variant shows only where requests overlap: longer neighbours keep them in flight on a loaded machine
    longer = ("-n", "24") if settings["mode"] == "batch-variant" else ()
    with engine(model_dir, **settings) as url:
        r = verify(url, "--json", *longer)
    assert r.exit_code == 1, r.output
    by_name = rows(r)
    assert set(caught) <= failed(by_name), {n: by_name[n]["detail"] for n in caught}
    assert not set(clean) & failed(by_name), {n: by_name[n]["detail"] for n in clean}


def test_a_failure_names_the_check_and_its_evidence(model_dir):
    with engine(model_dir, mode="corrupt-warm") as url:
        r = verify(url, "--checks", "warm-cold")
    assert r.exit_code == 1, r.output
    verdict = r.stdout.strip().splitlines()[-1]
    assert verdict.startswith("FAILED 4 of 5 checks: warm-cold:repeat/foreign-tiny"), verdict
    assert "warm run 1 vs cold" in r.stdout and "cached_tokens 0, 16, 16, 0" in r.stdout, r.stdout


def test_without_logprobs_the_runs_are_compared_as_tokens(model_dir):
    with engine(model_dir, mode="no-logprobs") as url:
        r = verify(url, "--json", "--checks", "warm-cold")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["endpoint"]["logprobs"] is False
    assert {x["tolerance"] for x in doc["checks"]} == {"identical token ids (the engine gives no logprobs)"}
    assert any(n.startswith("no logprobs: runs are compared as tokens or text") for n in doc["notes"]), doc["notes"]


def test_without_logprobs_a_corrupt_warm_hit_still_fails_on_its_tokens(model_dir):
    with engine(model_dir, mode="corrupt-warm", logprobs=False) as url:
        r = verify(url, "--json", "--checks", "warm-cold")
    assert r.exit_code == 1, r.output
    for row in rows(r).values():
        if not row["passed"]:
            assert "the engine gives no logprobs, so a near-tie cannot be told from a bug" in row["detail"], row


@pytest.mark.parametrize(
    "listed, second_turn", [("asked", "its completion"), ("never", "fresh tokens (the engine returns no token ids)")]
)
def test_a_completions_token_ids_where_the_engine_lists_them(model_dir, listed, second_turn):
    with engine(model_dir, token_ids=listed) as url:
        r = verify(url, "--json", "--checks", "warm-cold")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["endpoint"]["token_ids"] is (listed == "asked")
    multi_turn = rows(r)["warm-cold:multi-turn"]["detail"]
    assert f"then prompt + {second_turn} + more" in multi_turn, multi_turn


def test_text_prompts_where_the_engine_refuses_token_ids(model_dir):
    with engine(model_dir, token_prompts=False) as url:
        r = verify(url, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["endpoint"]["token_prompts"] is False
    assert "text prompts (it refused token ids)" in doc["notes"][0]


@pytest.mark.parametrize(
    "settings, args, skips",
    [
        (
            {"usage_details": False},
            [],
            {
                "accounting": NO_FIELD,
                "evicted:reset": "the engine's answers have no usage.prompt_tokens_details.cached_tokens to check after "
                "the reset",
            },
        ),
        (
            {"metrics": "none"},
            [],
            {
                "evicted": "the engine reports no KV pool size in /metrics (kvbench_kv_blocks_total, "
                "vllm:cache_config_info, sglang:max_total_num_tokens); give --evict-tokens N",
                "accounting:counters": "the engine counts no prefix-cache hits in /metrics "
                "(kvbench_prefix_cache_hits_total, vllm:prefix_cache_hits_total): it answers no /metrics",
            },
        ),
        ({"metrics": "none"}, ["--evict-tokens", "400"], {"accounting:counters": None}),
        (
            {"reset": "none"},
            ["--reset", "none"],
            {
                "warm-cold:shared-prefix": "--reset none: S+B cannot run cold once S+A was sent; name the engine's "
                "reset",
                "warm-cold:multi-turn": "--reset none: prompt + completion cannot run cold once the prompt was sent",
                "warm-cold:moved-block": "--reset none: B+D cannot run cold again once it was sent",
                "evicted:reset": "--reset none: no reset to check after the flood",
                "accounting:reset": "--reset none: no reset to check cached_tokens after",
            },
        ),
    ],
    ids=["no cached_tokens", "no /metrics", "no /metrics, --evict-tokens", "no reset"],
)
def test_what_an_engine_does_not_expose_is_a_skip_saying_so(model_dir, settings, args, skips):
    with engine(model_dir, **settings) as url:
        r = verify(url, "--json", *args)
    assert r.exit_code == 0, r.output
    by_name = rows(r)
    assert {n for n, x in by_name.items() if x["skipped"]} == set(skips), by_name
    for name, why in skips.items():
        assert why is None or by_name[name]["detail"] == why, by_name[name]["detail"]
    assert not failed(by_name)


@pytest.mark.parametrize("way", ["sglang", "llamacpp"])
def test_each_reset_way_runs_cold(model_dir, way):
    with engine(model_dir, reset=way) as url:
        r = verify(url, "--json", "--reset", way, "--checks", "warm-cold,accounting")
    assert r.exit_code == 0, r.output
    by_name = rows(r)
    assert not failed(by_name) and not any(x["skipped"] for x in by_name.values()), by_name
    assert by_name["warm-cold:repeat"]["detail"].count("cached_tokens 0, 16, 16, 0"), by_name["warm-cold:repeat"]


def test_the_kvbench_metric_names_are_read(model_dir):
    with engine(model_dir, metrics="kvbench") as url:
        r = verify(url, "--json", "--checks", "evicted,accounting")
    assert r.exit_code == 0, r.output
    evidence = json.loads(r.stdout)["endpoint"]["evidence"]["evicted"]
    assert evidence["pool_tokens"] == 24 * 16 and evidence["pool_from"].startswith("kvbench_kv_blocks_total"), evidence
    assert "kvbench_prefix_cache_hits_total" in rows(r)["accounting:counters"]["detail"]


def test_an_engine_that_exposes_nothing_checkable_is_nothing_checked(model_dir):
    with engine(model_dir, usage_details=False) as url:
        r = verify(url, "--checks", "accounting")
    assert r.exit_code == 5, r.output
    assert "NOTHING CHECKED" in r.stdout
