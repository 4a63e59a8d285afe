"""Lossy caches held to their declared policy (check/policy.py): int8's roundtrip and the sink cache's visibility pass
every policy row at the exact tolerance; faults that hide under the loose bound fail the policy rows, with where; a
plugin written outside the repository declares its own policy and is held to it the same way."""

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import get_cache_spec
from kvbench.caches.dynamic import DynamicCache
from kvbench.caches.sink import SinkCache, visible
from kvbench.check.faults import FAULTS
from kvbench.check.policy import POLICY_CHECKS
from kvbench.check.verify import random_prompts, run_verify
from kvbench.cli import app
from kvbench.errors import KVBenchError
from tiny import tiny_llama

N = 40  # past the sink cache's 4 + 32 tokens with the 32-token prompt: eviction happens


@pytest.fixture(scope="module")
def prompts(tiny_config):
    return random_prompts(tiny_config.vocab_size, 32, 3, seed=0)


@pytest.fixture(scope="module")
def report(tiny_model, prompts):
    return run_verify(tiny_model, ["int8", "sink"], prompts, N, reference="none")


def _rows(report, cache, policy):
    return {r.name: r for r in report.checks if r.cache == cache and r.policy == policy}


@pytest.mark.parametrize("cache", ["int8", "sink"])
def test_a_declared_policy_passes_every_policy_row_at_the_exact_tolerance(report, cache):
    rows = _rows(report, cache, policy=True)
    assert set(rows) == set(POLICY_CHECKS)
    for name, r in rows.items():
        if cache == "sink" and name == "batched":
            assert r.skipped and "left-padded" in r.detail
            continue
        assert r.passed and not r.skipped, r
        assert r.tolerance in ("rtol 1e-05, atol 1e-05", "identical tokens"), r  # exact: no lossy bound
    loose = _rows(report, cache, policy=False)
    assert loose["logits"].tolerance.startswith("lossy")  # the loose rows stay beside them


def test_int8_matches_its_reference_bit_for_bit_and_counts_the_one_forward_flips(report):
    rows = _rows(report, "int8", policy=True)
    assert rows["logits"].max_abs_diff == 0.0  # the same floats round the same way, step for step
    assert "one no-cache forward with the policy inside" in rows["logits"].detail


def test_the_sink_visibility_keeps_the_sinks_and_the_last_window():
    q = torch.tensor([[10]])
    k = torch.arange(11)[None]
    assert visible(2, 4, q, k)[0, 0].tolist() == [True, True] + [False] * 5 + [True] * 4


def test_the_sink_cache_holds_sinks_plus_window_between_steps():
    c = SinkCache(2, 4)
    k = torch.randn(1, 1, 6, 3)
    c.update(k, k, torch.arange(6)[None])  # a prefill reads all six
    assert c.key_positions[0].tolist() == list(range(6))
    c.update(k[:, :, :1], k[:, :, :1], torch.tensor([[6]]))  # query 6 reads 0, 1 and 3..6
    assert c.key_positions[0].tolist() == [0, 1, 3, 4, 5, 6] and c.length == 6
    with pytest.raises(KVBenchError, match="evicted already"):  # query 5 would read position 2, evicted at 6
        c.crop(5)
    c.crop(6)  # query 6 reads 3..5 again: all held
    assert c.key_positions[0].tolist() == [0, 1, 3, 4, 5] and c.length == 5


EDGES = [(s, w) for s in (0, 1, 4) for w in (1, 2, 3, 32)]


class _Stating(DynamicCache):
    """A dynamic cache (every token kept) that states the visibility it is given."""

    def __init__(self, rule) -> None:
        super().__init__()
        self.visible = rule


def _streaming(sink: int, window: int):
    """StreamingLLM written out by hand: query q reads the first `sink` positions and the last `window` up to q."""

    def reads(q_pos, k_pos):
        q, k = q_pos[:, :, None], k_pos[:, None, :]
        return (k < sink) | ((k > q - window) & (k <= q))

    return reads


@pytest.mark.parametrize("sink, window", EDGES)
@pytest.mark.parametrize("prompt_len", [1, 5])
@torch.inference_mode()
def test_a_sink_cache_holds_and_reads_what_a_streaming_cache_must(tiny_model, sink, window, prompt_len):
    """Between decode steps the cache holds exactly the sinks and the last W positions, and every step's logits equal
    one forward over caches that keep every token and state the rule written out by hand (not the design's)."""
    spec = get_cache_spec(f"sink-{sink}-{window}")
    ids = torch.randint(
        0, tiny_model.config.vocab_size, (1, prompt_len + 12), generator=torch.Generator().manual_seed(1)
    )
    n = ids.size(1)
    caches = [spec.factory(tiny_model.config, 1, n, torch.float32, "cpu") for _ in range(tiny_model.config.n_layer)]
    steps = [tiny_model(ids[:, :prompt_len], torch.arange(prompt_len)[None], caches)[0, -1]]
    for t in range(prompt_len, n):
        steps.append(tiny_model(ids[:, t : t + 1], torch.tensor([[t]]), caches)[0, -1])
        want = [k for k in range(t + 1) if k < sink or k > t - window]
        for c in caches:
            assert c.key_positions[0].tolist() == want, (t, c.key_positions)
            assert c.length == len(want) <= sink + window and c.written == t + 1
    hand_caches = [_Stating(_streaming(sink, window)) for _ in range(tiny_model.config.n_layer)]
    hand = tiny_model(ids, torch.arange(n)[None], hand_caches)[0, prompt_len - 1 :]
    full = tiny_model(ids, torch.arange(n)[None])[0, prompt_len - 1 :]
    got = torch.stack(steps)
    torch.testing.assert_close(got, hand, rtol=1e-5, atol=1e-5)
    if prompt_len + 12 > sink + window:  # it evicted: the hand rule is not full attention, so the test can tell
        assert (got - full).abs().max() > 1e-3


def test_every_sink_edge_passes_its_policy_rows(tiny_model):
    names = [f"sink-{s}-{w}" for s, w in EDGES]
    prompts = random_prompts(tiny_model.config.vocab_size, 8, 3, seed=0)
    rep = run_verify(tiny_model, names, prompts, 16, reference="none", distortion=False)
    policy = [r for r in rep.checks if r.policy and not r.skipped]
    assert {r.cache for r in policy} == set(names) and len(policy) == len(names) * (len(POLICY_CHECKS) - 1)
    assert all(r.passed for r in policy), [(r.cache, r.name, r.location) for r in policy if not r.passed]


def test_a_crop_that_leaves_a_sink_cache_no_slot_keeps_counting_what_was_written():
    """No sinks and a window of 1: a crop to the newest position forgets every slot; the cache still knows the next
    query's position, so another crop is checked against it and the next update continues."""
    c = SinkCache(0, 1)
    kv = torch.randn(1, 2, 1, 4)
    for t in range(6):
        c.update(kv, kv, torch.tensor([[t]]))
    assert c.key_positions[0].tolist() == [5] and c.written == 6
    c.crop(5)  # query 5 reads only itself: nothing held is needed
    assert c.length == 0 and c.written == 5
    with pytest.raises(KVBenchError, match=r"crop\(6\) outside 0..5"):
        c.crop(6)
    c.crop(4)
    assert c.written == 4 and c.length == 0
    c.update(kv, kv, torch.tensor([[4]]))
    assert c.key_positions[0].tolist() == [4] and c.written == 5
    f = c.fork()
    assert f.written == 5 and f.key_positions[0].tolist() == [4]


def test_a_design_held_to_its_policy_is_judged_by_it_not_by_a_loose_bound(tiny_model, prompts):
    """sink-0-1 reads one token per query: far from full attention by declaration (its loose rows are past sink's
    bound), exact to its policy. The verdict is its =policy rows'; the loose rows past the bound are reported (with
    what they measured) and its distortion says what the policy costs."""
    rep = run_verify(tiny_model, ["sink-0-1"], prompts, 16, reference="none")
    loose = _rows(rep, "sink-0-1", policy=False)
    past = [r for r in loose.values() if r.skipped and r.detail.startswith("not judged: held exactly to its policy")]
    assert {"logits", "greedy"} <= {r.name for r in past}, loose  # the bound would have failed them
    assert all("measured: max |dlogit|" in r.detail for r in past if r.name == "logits"), past
    assert all(r.passed for r in _rows(rep, "sink-0-1", policy=True).values())
    assert rep.passed and rep.distortion["sink-0-1"]["kl_mean"] > 0


def test_only_a_design_whose_policy_rows_run_has_its_loose_rows_set_aside(tiny_model):
    from kvbench.check.gpt2_subject import GPT2Model, GPT2Subject

    target = GPT2Model(tiny_model, reference="none")
    sink, int8 = GPT2Subject(target, "sink-2-3"), GPT2Subject(target, "int8")
    assert sink.known("greedy", "12 greedy tokens vs no cache; 0% agree") and int8.known("logits", "decode steps")
    assert sink.known("logits", "the run raised RuntimeError: boom") is None  # a crash is the design's own failure
    # under --tp no =policy rows run: rank_cache holds each rank's stored values to the policy instead
    assert "by rank_cache" in GPT2Subject(target, "sink-2-3", tp=2).known("greedy", "0% agree")
    assert GPT2Subject(target, "static").known("logits", "x") is None


def test_a_lossy_plugin_that_declares_no_policy_is_still_judged_by_its_bound(tiny_model, prompts, int4_plugin):
    rep = run_verify(tiny_model, [f"{int4_plugin}:Int4Unbounded"], prompts, 8, reference="none", distortion=False)
    assert not any(r.policy for r in rep.checks)
    failed = [r for r in rep.checks if not r.passed and not r.skipped]
    assert failed and not rep.passed and "logits" in {r.name for r in failed}, rep.checks


@pytest.mark.parametrize("visible", [lambda q, k: torch.zeros(q.size(0), q.size(1), k.size(1), dtype=torch.bool), None])
def test_the_two_mask_paths_agree_on_every_query_even_one_that_may_read_nothing(visible):
    """The mask built by column (a cache that keeps every slot: the policy's reference) and the one built by position
    (a cache that evicts) give a query the same keys; a query its visibility leaves nothing reads itself on both."""
    from kvbench.model.gpt2 import AttentionMask

    q = torch.tensor([[2, 3, 4]])  # three queries over keys 0..4
    rule = visible or (lambda q, k: k[:, None, :] > q[:, :, None] - 2)
    mask = AttentionMask(3, 5, None, positions=q)
    by_column, _ = mask.for_keys(5, _Stating(rule))
    evicting = _Stating(rule)
    evicting.key_positions = torch.arange(5)[None]
    by_position, _ = mask.for_keys(5, evicting)
    assert torch.equal(by_column, by_position), (by_column, by_position)
    if visible is not None:
        assert torch.equal(by_position[0, 0], torch.eye(5, dtype=torch.bool)[2:])  # each reads its own position


def test_the_sink_cache_saves_memory_by_design():
    spec = get_cache_spec("sink-4-64")  # S and W in the name
    assert spec.name == "sink-4-64" and spec.visible is not None and not spec.padding
    assert spec.holds(1000) == 68 and spec.holds(10) == 10


def test_memory_measure_plans_the_tokens_a_sink_cache_holds():
    from kvbench.bench.measure_memory import measure_caches

    rep = measure_caches("gpt2-tiny", 2, 256, "fp16", "cpu", ["sink-4-8", "dynamic"])
    sink, dynamic = rep.rows
    L, H, Dh = 2, 4, 32  # gpt2-tiny
    assert sink.predicted_bytes == 2 * L * 2 * H * 12 * Dh * 2  # K and V, layers, batch 2, 4 + 8 tokens, fp16
    assert sink.measured_bytes - sink.predicted_bytes == L * 2 * 12 * 8  # one int64 position per slot
    assert dynamic.exact and dynamic.predicted_bytes == 2 * L * 2 * H * 256 * Dh * 2
    assert "12 tokens of 256 it holds" in sink.explanation


def test_generate_refuses_prompts_of_different_lengths_for_a_design_that_evicts():
    r = CliRunner().invoke(
        app,
        [*"generate -m gpt2-tiny -w random -d cpu --cache sink -n 4 --prompt hello".split(), "--prompt", "a b c d e"],
    )
    assert r.exit_code == 2 and "takes no left-padded batch" in r.output and "Traceback" not in r.output
    one = CliRunner().invoke(app, "generate -m gpt2-tiny -w random -d cpu --cache sink -n 4 --prompt hello".split())
    assert one.exit_code == 0, one.output


@pytest.mark.parametrize("fault", ["int8-requantised-fork"])
def test_a_fault_under_the_loose_bound_fails_only_the_policy_rows_with_where(tiny_model, prompts, fault):
    from kvbench.check.breaking import break_fault

    r = break_fault(tiny_model, fault, prompts, N, reference="none")
    failed = [c for c in r.checks if not c.passed]
    assert failed and all(c.policy for c in failed), [(c.name, c.policy) for c in failed]
    where = "forward 2 of the fork scenario, layer 0 K differs first at head 0, slot 0 (position 0)"
    assert [c.location.split(":")[0] for c in failed] == [where], [c.location for c in failed]
    assert r.detected and all(name.endswith("=policy") for name in r.caught_by)


# --- the slow tier: every lossy fault through the CLI; plugins ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fault", [n for n, f in FAULTS.items() if f.cache in ("int8", "sink")])
def test_every_lossy_fault_passes_the_loose_rows_and_is_caught_by_the_policy(fault):
    r = CliRunner().invoke(
        app,
        ["break", fault, "-m", "gpt2-tiny", "-w", "random", "-d", "cpu", "-n", "60", "--reference", "none", "--json"],
    )
    assert r.exit_code == 0, r.output
    (bug,) = json.loads(r.stdout)["bugs"]
    failed = [c for c in bug["checks"] if not c["passed"]]
    assert failed and all(c["policy"] for c in failed), failed
    # the step (logits, greedy), the moment (batched, cache_state) or a scenario's forward that read it, then where
    assert all(
        re.match(r"(step \d+|the .+|forward \d+ of the \w+ scenario), layer \d+ ", c["location"]) for c in failed
    ), failed


PLUGIN = '''
import torch
from kvbench.caches import LayerCache

def quantise(x):
    """x (..., Dh) -> int4 per row: q in -7..7 and one fp32 scale."""
    scale = x.abs().amax(-1, keepdim=True) / 7
    q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0).round().clamp(-7, 7)
    return q.to(torch.int8), scale

def roundtrip(x):
    q, scale = quantise(x)
    return (q.float() * scale).to(x.dtype)

class Int4Tokens(LayerCache):
    """int4 K/V with one scale per token and head (a plugin written outside kvbench)."""
    exact = False
    logit_atol, logit_rtol, min_greedy_agreement = 5.0, 1.0, 0.0
    roundtrip = staticmethod(roundtrip)

    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__()
        self.q = self.s = None
        self.dtype = dtype

    def _deq(self, i):
        return (self.q[i].float() * self.s[i]).to(self.dtype)

    def update(self, k, v, positions):
        (qk, sk), (qv, sv) = quantise(k), quantise(v)
        if self.q is None:
            self.q, self.s = [qk, qv], [sk, sv]
        else:
            self.q = [torch.cat([self.q[0], qk], 2), torch.cat([self.q[1], qv], 2)]
            self.s = [torch.cat([self.s[0], sk], 2), torch.cat([self.s[1], sv], 2)]
        self.length = self.q[0].size(2)
        return self._deq(0), self._deq(1)

    def reset(self):
        super().reset()
        self.q = self.s = None

    def crop(self, length):
        n = self.check_crop(length)
        self.q, self.s = [t[:, :, :n] for t in self.q], [t[:, :, :n] for t in self.s]
        self.length = n

    def fork(self):
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.q, other.s = [t.clone() for t in self.q], [t.clone() for t in self.s]
        return other

    def reorder(self, index):
        idx = self.check_index(index, self.q[0].size(0), self.q[0].device)
        self.q, self.s = [t.index_select(0, idx) for t in self.q], [t.index_select(0, idx) for t in self.s]

    @property
    def nbytes(self):
        return 0 if self.q is None else sum(t.nbytes for t in self.q + self.s)

class StaleScalesReorder(Int4Tokens):
    """reorder moves the values, not the scales."""
    def reorder(self, index):
        idx = self.check_index(index, self.q[0].size(0), self.q[0].device)
        self.q = [t.index_select(0, idx) for t in self.q]

class RoundsTwiceFork(Int4Tokens):
    """fork quantises the dequantised copy again, in fp16."""
    def fork(self):
        other = super().fork()
        for i in range(2):
            q, s = quantise(self._deq(i).half().float())
            other.q[i], other.s[i] = q, s.half().float()
        return other

from kvbench.caches.sink import SinkCache

def keeps_two_and_eight(q, k):
    return (k[:, None, :] < 2) | (k[:, None, :] > q[:, :, None] - 8)

class TwoAndEight(SinkCache):
    """2 sinks and a window of 8 (an eviction plugin)."""
    exact = False
    logit_atol, logit_rtol, min_greedy_agreement = 50.0, 5.0, 0.0
    visible = staticmethod(keeps_two_and_eight)
    padding = False

    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__(2, 8)

class Int4Unbounded(Int4Tokens):
    """the same int4 storage with no declared policy and a bound it cannot meet: judged by the bound alone."""
    roundtrip = None
    logit_atol, logit_rtol, min_greedy_agreement = 1e-6, 0.0, 1.0

import os

def grid(x):
    return torch.round(x * 64) / 64

class OffGrid(LayerCache):
    """K/V on a 1/64 grid, one stored value of layer OFF_LAYER (head 1, position 20) OFF_BY off the grid once the
    sequence holds more than 24 tokens: too small to move a logit by 1e-5."""
    exact = False
    logit_atol, logit_rtol, min_greedy_agreement = 0.5, 0.5, 0.5
    roundtrip = staticmethod(grid)
    layers = 0

    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__()
        self.k = self.v = None
        self.layer = -1 if config.name == "probe" else OffGrid.layers % config.n_layer  # made n_layer at a time
        OffGrid.layers += config.name != "probe"

    def update(self, k, v, positions):
        k, v = grid(k), grid(v)
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        self.length = self.k.size(2)
        out = self.k
        if self.layer == int(os.environ["OFF_LAYER"]) and self.length > 24:
            out = self.k.clone()
            out[:, 1, 20, 0] += float(os.environ["OFF_BY"])
        return out, self.v

    @property
    def nbytes(self):
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

class NudgesAHeldKey(TwoAndEight):
    """2 sinks and a window of 8, exactly as declared, but once past position 30 the third-newest K it returns at
    the last layer is 1e-3 off."""
    layers = 0

    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__(config, batch, max_len, dtype, device)
        self.last = config.name != "probe" and NudgesAHeldKey.layers % config.n_layer == config.n_layer - 1
        NudgesAHeldKey.layers += config.name != "probe"

    def update(self, k, v, positions):
        k, v = super().update(k, v, positions)
        if self.last and int(positions[0, -1]) > 30:
            k = k.clone()
            k[:, 1, -3, 2] += 1e-3
        return k, v

class EvictsEarly(TwoAndEight):
    """evicts one position more than it declares."""
    def _evict(self, first_query):
        super()._evict(first_query + 1)
'''


@pytest.fixture
def int4_plugin(plugin_files):
    plugin_files({"int4plug.py": PLUGIN})
    return "int4plug"


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls, passes, check",
    [("Int4Tokens", True, None), ("StaleScalesReorder", False, "reorder"), ("RoundsTwiceFork", False, "fork")],
)
def test_a_plugin_quantiser_is_held_to_its_declared_roundtrip(tiny_model, prompts, int4_plugin, cls, passes, check):
    rep = run_verify(tiny_model, [f"{int4_plugin}:{cls}"], prompts, N, reference="none")
    loose = [r for r in rep.checks if not r.policy and not r.skipped]
    policy = {r.name: r for r in rep.checks if r.policy}
    assert all(r.passed for r in loose), [r for r in loose if not r.passed]  # under its own loose bound
    if passes:
        assert all(r.passed for r in policy.values()), [r for r in policy.values() if not r.passed]
    else:
        where = rf"forward \d+ of the {check} scenario, layer 0 K differs first"
        assert not policy[check].passed and re.match(where, policy[check].location), policy[check]


@pytest.mark.slow
@pytest.mark.parametrize("cls, passes", [("TwoAndEight", True), ("EvictsEarly", False)])
def test_a_plugin_eviction_is_held_to_its_declared_visibility(tiny_model, prompts, int4_plugin, cls, passes):
    rep = run_verify(tiny_model, [f"{int4_plugin}:{cls}"], prompts, N, reference="none")
    policy = {r.name: r for r in rep.checks if r.policy and not r.skipped}
    assert all(r.passed for r in rep.checks if not r.policy), [r for r in rep.checks if not r.passed and not r.policy]
    if passes:
        assert all(r.passed for r in policy.values()), [r for r in policy.values() if not r.passed]
    else:
        assert not policy["logits"].passed, policy["logits"]
        assert re.match(r"step \d+, layer 0 no longer holds position \d+", policy["logits"].location), policy["logits"]


@pytest.mark.parametrize(
    "cls, env, where",
    [
        # 0.64 of a grid step at the last layer, 1e-4 at the first: neither moves a logit past the exact tolerance
        ("OffGrid", {"OFF_LAYER": "2", "OFF_BY": "0.01"}, r"step 17, layer 2 K differs first at head 1, slot 20 "),
        ("OffGrid", {"OFF_LAYER": "0", "OFF_BY": "1e-4"}, r"step 17, layer 0 K differs first at head 1, slot 20 "),
        ("NudgesAHeldKey", {}, r"step 24, layer 2 K differs first at head 1, slot 7 \(position 29\)"),
    ],
)
def test_a_stored_value_off_its_policy_fails_and_is_located_though_no_logit_moves(
    tiny_model, int4_plugin, monkeypatch, cls, env, where
):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    prompts = random_prompts(tiny_model.config.vocab_size, 8, 3, seed=0)
    rep = run_verify(tiny_model, [f"{int4_plugin}:{cls}"], prompts, 32, reference="none", distortion=False)
    logits = _rows(rep, f"{int4_plugin}:{cls}", policy=True)["logits"]
    assert not logits.passed and "first off at step" not in logits.detail, logits  # the logits alone pass
    assert re.match(where + r".*\|delta\| ", logits.location), logits.location
    assert "a stored K or V is not the policy's" in logits.detail


def test_the_stored_values_are_compared_at_every_layer_update_as_a_copy(report):
    for cache in ("int8", "sink"):
        rows = _rows(report, cache, policy=True)
        for name in ("logits", "cache_state", "rollback", "fork", "reorder", "chunked_prefill"):
            assert re.search(r"every stored K and V is the policy's \(\d+ layer updates", rows[name].detail), rows[name]


# --- transformers' QuantizedCache (quanto) held to its own schedule -------------------------------------------------
@pytest.fixture(scope="module")
def quanto_llama(tmp_path_factory):
    pytest.importorskip("optimum.quanto")
    from transformers import AutoModelForCausalLM

    from kvbench.hf.models import load_hf

    torch.manual_seed(0)
    # 2 key/value heads x 32 = 64 values per token and layer: one quanto group (hf/caches.py QUANTO_GROUP)
    cfg = tiny_llama(hidden_size=128, max_position_embeddings=512, initializer_range=0.02)
    d = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return load_hf(str(d), torch.device("cpu"), torch.float32)


def _quanto_policy(loaded, new=40):
    from kvbench.check.hf_verify import run_hf_verify

    prompts = random_prompts(256, 32, 3, seed=0)
    rep = run_hf_verify(loaded, ["quantized-quanto"], prompts, new, checks=("logits",))
    return {r.name: r for r in rep.checks if r.policy}, {r.name: r for r in rep.checks if not r.policy}


@pytest.mark.slow
def test_quanto_matches_its_schedule_exactly_where_full_precision_does_not(quanto_llama):
    policy, loose = _quanto_policy(quanto_llama, new=150)  # past the 128-token residual: a flush happens
    assert policy["logits"].passed and policy["logits"].max_abs_diff == 0.0, policy["logits"]
    assert loose["logits"].max_abs_diff > 1e-3  # the policy's own loss, which only the loose row allows
    assert policy["reorder"].passed and "absent in transformers" in policy["reorder"].detail


@pytest.mark.slow
def test_the_quanto_reorder_defect_is_caught_by_the_policy_row(quanto_llama, monkeypatch):
    """transformers before PR #48700: reorder_cache reordered the full-precision residual only, leaving the
    quantised states in the old batch order. Put back, the policy's reorder row fails and says so."""
    from transformers.cache_utils import QuantizedLayer

    def residual_only(self, beam_idx):
        if self.keys is not None and self.keys.numel() > 0:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    monkeypatch.setattr(QuantizedLayer, "reorder_cache", residual_only)
    policy, _ = _quanto_policy(quanto_llama)
    assert not policy["reorder"].passed and "is present in transformers" in policy["reorder"].detail
    # the two rows' quantised prefix is read in the old order: row 0 holds row 1's K from the first slot
    where = "the decode step after reorder_cache([1, 0]), layer 0 K differs first at row 0, head 0, slot 0: |delta| "
    assert policy["reorder"].location.startswith(where), policy["reorder"].location
    assert policy["logits"].passed  # the defect lives in reorder only


@pytest.mark.slow
def test_a_quantised_cache_that_strays_from_its_schedule_is_located(quanto_llama, monkeypatch):
    """A QuantizedLayer that returns slot 40's V off by 1e-3 of itself once it holds more than 40 tokens (far inside
    the loose bound): the logits policy row fails at the first step that reads it and names the layer, tensor and
    slot the step read otherwise than the schedule's reference."""
    from transformers.cache_utils import QuantizedLayer

    update = QuantizedLayer.update

    def strays(self, k, v, *args, **kwargs):
        K, V = update(self, k, v, *args, **kwargs)
        if V.shape[-2] > 40:
            V = V.clone()
            V[..., 40, :] *= 1.001
        return K, V

    monkeypatch.setattr(QuantizedLayer, "update", strays)
    policy, loose = _quanto_policy(quanto_llama)
    assert loose["logits"].passed and not policy["logits"].passed, (loose["logits"], policy["logits"])
    # the prompt is 32 tokens: the step that first holds 41 reads slot 40 (step 9)
    where = "step 9, layer 0 V differs first at row 0, head 0, slot 40: |delta| "
    assert policy["logits"].location.startswith(where), policy["logits"].location


def test_quanto_is_skipped_where_a_token_fills_no_quantisation_group():
    """quanto quantises groups of 64 values: 2 key/value heads x 16 per token cannot form one, and transformers'
    QuantizedCache then raises on calls of an odd token count. A skip naming why, not a crash row."""
    from types import SimpleNamespace

    from kvbench.hf.caches import HF_CACHES

    info = SimpleNamespace(
        windowed=False, recurrent=False, config_layer_types=["full_attention"], n_kv_heads=2, head_dim=16
    )
    why = HF_CACHES["quantized-quanto"].unavailable(info, torch.device("cpu"))
    assert why is not None and "groups of 64 values" in why and "32 per token" in why
    info.head_dim = 32
    assert "groups of 64" not in (HF_CACHES["quantized-quanto"].unavailable(info, torch.device("cpu")) or "")


def test_an_eviction_design_runs_when_named_not_by_default():
    """sink strays from full attention by design (its policy rows judge it): in --caches all and when named, not in
    the default set, so `kvbench verify` on a deep model is not failed by the policy's own cost."""
    from kvbench.caches import parse_cache_names

    assert "sink" not in parse_cache_names(None) and "int8" in parse_cache_names(None)
    assert "sink" in parse_cache_names("all") and parse_cache_names("sink,dynamic") == ["sink", "dynamic"]
