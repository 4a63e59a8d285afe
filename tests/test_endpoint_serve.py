"""`kvbench verify --endpoint` against a real `kvbench serve`: the honest server passes every check, and each server
fault (`serve --fault NAME`) fails, exit 1, the checks that catch it, observed from outside over HTTP only."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.serve.faults import SERVER_FAULTS
from serve_client import Server

POOL = [
    "--model",
    "gpt2-tiny",
    "--weights",
    "random",
    "--kv-blocks",
    "64",
    "--host-blocks",
    "256",
]  # a host tier larger than the device pool, as offload tiers are
# the rows each fault fails; every other row passes (or is a near-tie)
CAUGHT = {
    "hit-without-copy": {"evicted:repeat", "evicted:shared-prefix"},
    "hash-without-parent": {"warm-cold:moved-block", "accounting:cached-tokens"},
    "reset-keeps-host-tier": {"evicted:reset"},
    "freed-block-reused": {"batch-invariance:shared-prefix"},
}


# new tokens a request: 6 shows every fault but one; freed-block-reused needs the request that shares a prefix to
# still be decoding, and allocating blocks, after its neighbours finish, which on a loaded machine takes longer
NEW = {"freed-block-reused": "48"}


def verify(url: str, new: str = "6") -> tuple[int, dict[str, bool]]:
    r = CliRunner().invoke(app, ["verify", "--endpoint", url, "-n", new, "--json"])
    doc = json.loads(r.stdout)
    return r.exit_code, {row["name"]: row["passed"] for row in doc["checks"] if not row["skipped"]}


def test_every_server_fault_has_the_checks_that_catch_it_named_here():
    assert set(CAUGHT) == set(SERVER_FAULTS)


def test_the_honest_server_passes_every_check():
    s = Server(*POOL)
    try:
        code, rows = verify(s.url)
    finally:
        s.close()
    assert code == 0 and len(rows) == 13 and all(rows.values()), rows


@pytest.mark.parametrize("fault", sorted(CAUGHT))
def test_each_server_fault_fails_the_checks_that_catch_it(fault):
    s = Server(*POOL, "--fault", fault)
    try:
        code, rows = verify(s.url, NEW.get(fault, "6"))
    finally:
        s.close()
    assert code == 1
    assert {name for name, ok in rows.items() if not ok} >= CAUGHT[fault], rows


@pytest.mark.parametrize("fault", [None, "hash-without-parent"])
def test_prompts_are_laid_out_in_the_block_size_metrics_state(fault):
    """A server with blocks of 4: the checks lay their prompts out in its blocks (read from /metrics), the honest
    server passes and a block hashed without its parent is still caught."""
    s = Server(*POOL, "--block-size", "4", *(("--fault", fault) if fault else ()))
    try:
        r = CliRunner().invoke(app, ["verify", "--endpoint", s.url, "-n", "6", "--json"])
    finally:
        s.close()
    doc = json.loads(r.stdout)
    assert any("blocks of 4 tokens (kvbench_kv_block_size)" in n for n in doc["notes"]), doc["notes"]
    failed = {row["name"] for row in doc["checks"] if not row["passed"] and not row["skipped"]}
    assert (r.exit_code, failed) == ((0, set()) if fault is None else (1, CAUGHT[fault])), failed
