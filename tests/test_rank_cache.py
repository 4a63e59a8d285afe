"""rank_cache under `verify --tp 2` (check/tp.py): a cache exact in one process that is wrong on one rank fails,
whether or not the logits can see it, and whether it keys off the shard's config or off the process's rank; a
correct design, lossy or evicting, passes."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvbench.check.judge import CheckRow
from kvbench.check.tp import merge

PLUGINS = textwrap.dedent(
    '''
    import torch
    import torch.distributed as dist
    from kvbench.caches.static import StaticCache
    from kvbench.model.tp import config_place


    def process_rank():
        return dist.get_rank() if dist.is_initialized() else 0


    def grid(x):
        return torch.round(x * 64) / 64


    class Base(StaticCache):
        """a static cache"""
        def __init__(self, config, batch, max_len, dtype, device):
            super().__init__(batch, config.n_head, max_len, config.head_dim, dtype, device)
            self.shard_rank = config_place(config).rank  # a shard's config says its rank


    class ShiftAll(Base):
        """on the process of rank 1, every key 0.02 higher: softmax cannot see a constant shift"""
        def update(self, k, v, positions):
            return super().update(k + 0.02 if process_rank() == 1 else k, v, positions)


    class ShiftHead(Base):
        """on rank 1's shard, its first head's keys 0.02 higher"""
        def update(self, k, v, positions):
            if self.shard_rank == 1:
                k = k.clone()
                k[:, 0] += 0.02
            return super().update(k, v, positions)


    class Stale(Base):
        """on the process of rank 1, attention is given one slot past the length, holding a stale value (masked)"""
        def update(self, k, v, positions):
            k, v = super().update(k, v, positions)
            if process_rank() == 1 and self.length < self.k.size(2):
                self.k[:, :, self.length] = 7.0
                return self.k[:, :, : self.length + 1], self.v[:, :, : self.length + 1]
            return k, v


    class Swap(Base):
        """on rank 1's shard, its two heads' K and V handed to attention swapped"""
        def update(self, k, v, positions):
            k, v = super().update(k, v, positions)
            if self.shard_rank == 1:
                k, v = k.flip(1), v.flip(1)
            return k, v


    class Grid(Base):
        """K and V rounded to a 1/64 grid, as its policy declares"""
        exact, logit_atol, logit_rtol, min_greedy_agreement = False, 0.5, 0.5, 0.5
        roundtrip = staticmethod(grid)

        def update(self, k, v, positions):
            return super().update(grid(k), grid(v), positions)


    class GridOff(Grid):
        """on a 1/64 grid, but on rank 1 one stored key is 0.05 off it (3 grid steps) past 20 tokens"""
        def update(self, k, v, positions):
            k, v = super().update(k, v, positions)
            if self.shard_rank == 1 and self.length > 20:
                k = k.clone()
                k[:, 0, 15, 0] += 0.05
            return k, v
    '''
)

WRONG = {
    "ShiftAll": "vs what it was given",
    "ShiftHead": "vs what it was given",
    "Stale": "it depends on the process it runs in",
    "Swap": "vs what it was given",
    "GridOff": "vs what it was given",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugins")
    (d / "onerank.py").write_text(PLUGINS)
    caches = ",".join(["sink", "sink-1-1", "int8", "onerank:Grid", *(f"onerank:{c}" for c in WRONG)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(d)}
    args = "verify --tp 2 -m gpt2-tiny -w random -d cpu -n 24 --prompt-len 8 --reference none --json"
    r = subprocess.run(
        [sys.executable, "-m", "kvbench", *args.split(), "--caches", caches],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 1, r.stderr  # the corrupt caches fail; nothing raised
    return {(c["name"], c["cache"]): c for c in json.loads(r.stdout)["checks"]}


@pytest.mark.slow
@pytest.mark.parametrize("cache, words", sorted(WRONG.items()))
def test_a_cache_wrong_on_one_rank_fails_rank_cache(report, cache, words):
    row = report[("rank_cache", f"onerank:{cache}")]
    assert not row["passed"] and words in row["detail"], row


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["ShiftAll", "ShiftHead", "Stale"])
def test_the_corruptions_the_logits_cannot_see_pass_every_other_row(report, cache):
    """The point of rank_cache: these pass every row that reads logits or tokens."""
    rows = [r for (name, c), r in report.items() if c == f"onerank:{cache}" and name != "rank_cache"]
    assert rows and all(r["passed"] for r in rows), rows


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["sink", "int8", "onerank:Grid"])
def test_a_correct_design_passes_rank_cache_lossy_and_evicting_alike(report, cache):
    row = report[("rank_cache", cache)]
    assert row["passed"] and not row["skipped"], row


@pytest.mark.slow
def test_a_design_held_to_its_policy_is_not_failed_by_its_loose_bound_under_tp(report):
    """sink-1-1 strays far from full attention by design: under --tp its stored values are held to its policy by
    rank_cache, and a loose row past its bound is its cost, not a failure (the =policy rows run in one process)."""
    rows = {name: r for (name, c), r in report.items() if c == "sink-1-1"}
    assert rows["rank_cache"]["passed"] and not rows["rank_cache"]["skipped"], rows["rank_cache"]
    assert all(r["passed"] for r in rows.values()), rows
    for r in rows.values():
        if r["skipped"] and r["detail"].startswith("not judged: held exactly"):
            assert "by rank_cache" in r["detail"], r


def test_the_earliest_difference_comes_first_whichever_rank_found_it():
    """A rank's own fault (rank 1, layer 0) before what the all-reduce carried into rank 0's layer 1."""
    rows = [
        [CheckRow(name="logits", cache="c", passed=False, detail="d0", location="step 5, layer 1, head 0")],
        [CheckRow(name="logits", cache="c", passed=False, detail="d1", location="step 5, layer 0, head 2")],
    ]
    (row,) = merge(rows)
    assert row.location == "rank 1: step 5, layer 0, head 2; rank 0: step 5, layer 1, head 0", row.location
    assert row.detail == "rank 1: d1; rank 0: d0", row.detail


def test_a_gpt2_checkpoint_under_tp_is_pointed_at_kvbenchs_own_split(hf_dir):
    """transformers has no tensor-parallel plan for GPT-2; kvbench's own GPT-2 splits it, on the same weights."""
    from typer.testing import CliRunner

    from kvbench.cli import app

    r = CliRunner().invoke(app, ["verify", "--hf", str(hf_dir), "--tp", "2", "-d", "cpu", "-n", "4"])
    assert r.exit_code == 2, r.output
    assert "gpt2 has no tensor-parallel plan in transformers" in r.output
    assert f"verify -m {hf_dir} --tp 2" in " ".join(r.output.split()), r.output


def test_a_fault_only_the_policy_rows_catch_is_skipped_under_tp():
    """The =policy rows run in one process; under --tp a fault hiding under a lossy bound would slip through as
    undetected, so it is skipped with its reason (refused when named alone)."""
    from kvbench.check.faults import FAULTS, select_faults
    from kvbench.errors import KVBenchError

    hidden = sorted(n for n, f in FAULTS.items() if f.policy_only)
    assert hidden == ["int8-reorder-scales", "int8-requantised-fork", "sink-evicts-one-more"]
    runs, why = select_faults("all", "int8", tp=2)
    assert {"int8-reorder-scales", "int8-requantised-fork"} <= set(why) and not set(hidden) & set(runs)
    assert "only the =policy rows catch it" in why["int8-reorder-scales"]
    runs, _ = select_faults("all", "int8", tp=1)
    assert {"int8-reorder-scales", "int8-requantised-fork"} <= set(runs)
    with pytest.raises(KVBenchError, match="run it without --tp"):
        select_faults("int8-reorder-scales", "int8", tp=2)
