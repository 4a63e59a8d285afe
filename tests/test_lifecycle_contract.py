"""The lifecycle members of the per-layer cache contract (crop, fork, reorder) on every built-in design, on raw
tensors, and the optional lifecycle of a plugin."""

import textwrap

import pytest
import torch

from kvbench.caches import CACHES, get_cache_spec, make_caches, missing_lifecycle
from kvbench.caches.paged import PagedCache
from kvbench.decode import fixed_step
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPT, GPTConfig

DESIGNS = [n for n, s in CACHES.items() if s.factory is not None]
CFG = GPTConfig(block_size=64, vocab_size=50, n_layer=1, n_head=2, n_embd=16, name="lifecycle")
H, DH = CFG.n_head, CFG.head_dim
MAX_LEN = 40  # paged: 3 blocks of 16 per sequence


def _cache(name, batch=1):
    return make_caches(name, CFG, batch, MAX_LEN, torch.float32, "cpu")[0]


def _kv(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, DH, generator=g), torch.randn(B, H, T, DH, generator=g)


def _update(cache, k, v):
    """Write k, v (B, H, T, Dh) and return what attention read, cut to the filled columns: a copy, since static
    designs return views of buffers that later calls change."""
    start = cache.length
    positions = torch.arange(start, start + k.size(2)).expand(k.size(0), -1)
    ko, vo = cache.update(k, v, positions)
    return ko[:, :, : cache.length].clone(), vo[:, :, : cache.length].clone()


def _fill(cache, B, T, seed):
    """Prefill 2 columns, then one column at a time (decode steps), as generation writes."""
    k, v = _kv(B, T, seed)
    out = None
    for chunk in (slice(0, 2), *(slice(t, t + 1) for t in range(2, T))):
        out = _update(cache, k[:, :, chunk], v[:, :, chunk])
    return k, v, out


def _expect(name, cache_out, written):
    """int8 returns quantised values: compare with what an uncropped cache returned; others exactly."""
    return cache_out if name == "int8" else written


def test_every_builtin_design_has_the_lifecycle():
    for name in DESIGNS:
        assert missing_lifecycle(_cache(name)) == [], name
        assert missing_lifecycle(type(_cache(name))) == [], name


# --- crop ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DESIGNS)
def test_crop_keeps_the_prefix_and_the_next_update_writes_after_it(name):
    cache = _cache(name)
    k, v, (k10, v10) = _fill(cache, 1, 10, seed=0)
    cache.crop(6)
    assert cache.length == 6
    nk, nv = _kv(1, 3, seed=1)
    ko, vo = _update(cache, nk, nv)
    assert cache.length == 9 and ko.shape == (1, H, 9, DH)
    ref = torch.cat([_expect(name, k10, k)[:, :, :6], nk], 2)
    if name == "int8":  # the new columns are quantised too: same values a fresh int8 cache stores
        fresh = _cache(name)
        _update(fresh, k10[:, :, :6], v10[:, :, :6])
        ref_k, ref_v = _update(fresh, nk, nv)
        assert torch.equal(ko[:, :, :6], k10[:, :, :6]) and torch.equal(vo[:, :, :6], v10[:, :, :6])
        assert torch.equal(ko, ref_k) and torch.equal(vo, ref_v)
    else:
        assert torch.equal(ko, ref)
        assert torch.equal(vo, torch.cat([v[:, :, :6], nv], 2))


@pytest.mark.parametrize("name", DESIGNS)
def test_crop_zero_empties_a_usable_cache(name):
    cache = _cache(name)
    _fill(cache, 1, 5, seed=2)
    cache.crop(0)
    assert cache.length == 0
    nk, nv = _kv(1, 3, seed=3)
    ko, vo = _update(cache, nk, nv)
    assert cache.length == 3 and ko.shape == (1, H, 3, DH)
    if name != "int8":
        assert torch.equal(ko, nk) and torch.equal(vo, nv)


@pytest.mark.parametrize("name", DESIGNS)
@pytest.mark.parametrize("bad", [-1, 11])
def test_crop_outside_the_filled_columns_is_an_error_naming_both(name, bad):
    cache = _cache(name)
    _fill(cache, 1, 10, seed=4)
    with pytest.raises(
        KVBenchError, match=rf"crop\({bad}\) outside 0\.\.10: (the cache holds 10 tokens|10 tokens were written)"
    ):
        cache.crop(bad)
    assert cache.length == 10, "a refused crop changes nothing"


def test_static_graph_crop_zeroes_the_whole_buffer_tail():
    cache = _cache("static-graph")
    _fill(cache, 1, 10, seed=5)
    cache.crop(6)
    nk, nv = _kv(1, 1, seed=6)
    ko, vo = cache.update(nk, nv, torch.tensor([[6]]))  # a decode step: the whole (1, H, max_len, Dh) buffer
    assert ko.shape == (1, H, MAX_LEN, DH)
    assert not ko[:, :, 7:].any() and not vo[:, :, 7:].any(), "the forgotten columns are zero"


@pytest.mark.parametrize("runner", [False, True], ids=["model", "fixed-step"])
def test_static_graph_logits_after_crop_equal_a_fresh_run_over_the_kept_prefix(runner):
    model = GPT(CFG).init_weights(seed=0, std=0.1).eval()
    ids = torch.randint(0, CFG.vocab_size, (1, 10), generator=torch.Generator().manual_seed(7))
    nxt = torch.tensor([[4]])

    def run(caches, idx, positions):
        if not runner:
            return model(idx, positions, caches)
        return fixed_step.runner_for(model, caches)(idx, positions, caches)

    with torch.no_grad():
        caches = make_caches("static-graph", CFG, 1, MAX_LEN, torch.float32, "cpu")
        run(caches, ids[:, :2], torch.arange(2)[None])
        for t in range(2, 10):  # decode steps fill columns 2..9
            run(caches, ids[:, t : t + 1], torch.tensor([[t]]))
        first = caches[0].runner
        for c in caches:
            c.crop(6)
        got = run(caches, nxt, torch.tensor([[6]]))[:, -1]
        assert caches[0].runner is first, "crop keeps the buffers, so the runner is reused"
        fresh = make_caches("static-graph", CFG, 1, MAX_LEN, torch.float32, "cpu")
        run(fresh, ids[:, :6], torch.arange(6)[None])
        want = run(fresh, nxt, torch.tensor([[6]]))[:, -1]
        full = model(torch.cat([ids[:, :6], nxt], 1), torch.arange(7)[None])[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


# --- fork ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DESIGNS)
def test_fork_is_independent_both_ways(name):
    cache = _cache(name, batch=2)
    k, v, (k5, v5) = _fill(cache, 2, 5, seed=8)
    fork = cache.fork()
    assert fork is not cache and fork.length == 5
    ak, av = _kv(2, 2, seed=9)
    bk, bv = _kv(2, 3, seed=10)
    ok, ov = _update(cache, ak, av)
    fk, fv = _update(fork, bk, bv)
    assert cache.length == 7 and fork.length == 8
    assert torch.equal(ok[:, :, :5], k5) and torch.equal(fk[:, :, :5], k5)
    assert torch.equal(ov[:, :, :5], v5) and torch.equal(fv[:, :, :5], v5)
    if name != "int8":
        assert torch.equal(ok[:, :, 5:], ak) and torch.equal(fk[:, :, 5:], bk)
        assert torch.equal(ov[:, :, 5:], av) and torch.equal(fv[:, :, 5:], bv)
    # One more column each: each still reads its own history, untouched by the other's writes.
    ck, cv = _kv(2, 1, seed=11)
    ok2, ov2 = _update(cache, ck, cv)
    fk2, fv2 = _update(fork, ck, cv)
    assert torch.equal(ok2[:, :, :7], ok) and torch.equal(ov2[:, :, :7], ov)
    assert torch.equal(fk2[:, :, :8], fk) and torch.equal(fv2[:, :, :8], fv)


def test_paged_fork_shares_blocks_and_copies_only_the_block_written():
    cache = _cache("paged", batch=2)  # 16-token blocks
    _fill(cache, 2, 20, seed=12)  # 2 blocks per sequence: one full, one holding 4 tokens
    used = cache.allocator.num_used
    assert used == 4
    fork = cache.fork()
    assert cache.allocator.num_used == used, "a fork holds no new block until it writes"
    assert fork.tables == cache.tables
    copied = fork.bytes_copied
    _update(fork, *_kv(2, 1, seed=13))
    assert cache.allocator.num_used == used + 2, "one copied block per sequence: the one written"
    assert [t[0] for t in fork.tables] == [t[0] for t in cache.tables], "the full blocks stay shared"
    assert all(f[1] != c[1] for f, c in zip(fork.tables, cache.tables, strict=True))
    gather = 2 * 2 * H * 20 * DH * 4  # the read's gather of 20 history columns, K and V
    assert fork.bytes_copied - copied == gather + 2 * (2 * H * 4 * DH * 4), "+ 4 filled rows per copied block"
    before = cache.allocator.num_used
    _update(cache, *_kv(2, 1, seed=14))  # the original now owns its blocks alone: written in place
    assert cache.allocator.num_used == before
    fork.reset()
    assert cache.allocator.num_used == 4, "the fork's reset gives back its own blocks and its holds"


def test_paged_pool_grows_once_shared_and_full():
    cache = _cache("paged")  # 3 blocks: exactly one sequence's max_len
    _fill(cache, 1, 40, seed=15)
    assert cache.allocator.num_free == 0
    fork = cache.fork()
    fork.crop(17)
    k, _, _ = _fill(fork, 1, 3, seed=16)
    assert fork.length == 20 and cache.allocator.num_blocks == 6, "the shared pool doubled"
    read_k, _ = _update(cache, *_kv(1, 0, seed=17))  # a 0-token update reads the history back
    assert read_k.shape[2] == 40


# --- reorder ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DESIGNS)
def test_reorder_repeats_and_drops_rows_without_aliasing(name):
    cache = _cache(name, batch=3)
    _, _, (k4, v4) = _fill(cache, 3, 4, seed=18)  # rows differ: random per row
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.length == 4
    nk, nv = _kv(3, 1, seed=19)
    ko, vo = _update(cache, nk, nv)
    rows = [1, 1, 0]
    assert torch.equal(ko[:, :, :4], k4[rows]) and torch.equal(vo[:, :, :4], v4[rows])
    if name != "int8":
        assert torch.equal(ko[:, :, 4:], nk) and torch.equal(vo[:, :, 4:], nv)
    # Rows 0 and 1 came from the same old row: more writes to both keep them apart.
    mk, mv = _kv(3, 1, seed=20)
    mk[1], mv[1] = mk[0] + 1, mv[0] + 1
    ko2, vo2 = _update(cache, mk, mv)
    assert not torch.equal(ko2[0], ko2[1]) and not torch.equal(vo2[0], vo2[1])
    assert torch.equal(ko2[:, :, :5], ko) and torch.equal(vo2[:, :, :5], vo)


@pytest.mark.parametrize("name", DESIGNS)
def test_reorder_changes_the_batch_size(name):
    cache = _cache(name, batch=2)
    _, _, (k3, _) = _fill(cache, 2, 3, seed=21)
    cache.reorder(torch.tensor([1, 0, 1, 1]))
    ko, _ = _update(cache, *_kv(4, 1, seed=22))
    assert ko.shape == (4, H, 4, DH) and torch.equal(ko[:, :, :3], k3[[1, 0, 1, 1]])
    cache.reorder(torch.tensor([2]))
    ko, _ = _update(cache, *_kv(1, 1, seed=23))
    assert ko.shape == (1, H, 5, DH) and torch.equal(ko[0, :, :3], k3[1])


@pytest.mark.parametrize("name", DESIGNS)
@pytest.mark.parametrize(
    "index, message",
    [
        (torch.tensor([0, 3]), "row 3 outside 0..2"),
        (torch.tensor([-1]), "row -1"),
        (torch.tensor([], dtype=torch.long), "non-empty 1-D"),
        (torch.tensor([[0, 1]]), "non-empty 1-D"),
        (torch.tensor([0.0, 1.0]), "integer tensor"),
        (torch.tensor([True, False, True]), "integer tensor"),
        ([0, 1], "integer tensor"),
    ],
    ids=["past-batch", "negative", "empty", "2-d", "float", "bool", "list"],
)
def test_reorder_refuses_a_bad_index(name, index, message):
    cache = _cache(name, batch=3)
    _fill(cache, 3, 3, seed=24)
    with pytest.raises(KVBenchError, match=message):
        cache.reorder(index)
    assert cache.length == 3


@pytest.mark.parametrize("name", DESIGNS)
def test_reorder_accepts_any_integer_dtype(name):
    cache = _cache(name, batch=2)
    _, _, (k2, _) = _fill(cache, 2, 2, seed=25)
    cache.reorder(torch.tensor([1, 0], dtype=torch.int32))
    ko, _ = _update(cache, *_kv(2, 1, seed=26))
    assert torch.equal(ko[:, :, :2], k2[[1, 0]])


def test_static_graph_reorder_keeps_the_runner_for_the_same_batch_and_drops_it_otherwise():
    model = GPT(CFG).init_weights(seed=0, std=0.1).eval()
    caches = make_caches("static-graph", CFG, 2, MAX_LEN, torch.float32, "cpu")
    with torch.no_grad():
        runner = fixed_step.runner_for(model, caches)
        runner(torch.tensor([[1, 2], [3, 4]]), torch.arange(2).expand(2, 2), caches)
        for c in caches:
            c.reorder(torch.tensor([1, 1]))
        assert caches[0].runner is runner and runner.matches(model, caches), "same buffers, same graph"
        for c in caches:
            c.reorder(torch.tensor([0, 1, 0]))
        assert caches[0].runner is None
        again = fixed_step.runner_for(model, caches)
        assert again is not runner and again.matches(model, caches)
        logits = again(torch.tensor([[5], [5], [5]]), torch.full((3, 1), 2), caches)
        want = model(torch.tensor([[3, 4, 5]]), torch.arange(3)[None])[:, -1]
    for row in range(3):
        torch.testing.assert_close(logits[row, -1], want[0], rtol=1e-5, atol=1e-5)


def test_paged_reorder_shares_repeated_rows_until_written():
    cache = _cache("paged", batch=3)
    _fill(cache, 3, 4, seed=27)
    assert cache.allocator.num_used == 3
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.allocator.num_used == 2, "row 2's block went back; row 1's is held twice"
    assert cache.tables[0] == cache.tables[1]
    _update(cache, *_kv(3, 1, seed=28))
    assert cache.allocator.num_used == 3 and cache.tables[0] != cache.tables[1]


def test_paged_per_sequence_interface_copies_on_write_after_fork():
    cache = PagedCache(2, H, DH, num_blocks=8, dtype=torch.float32, device="cpu", block_size=4, max_len=16)
    g = torch.Generator().manual_seed(29)
    k, v = torch.randn(H, 6, DH, generator=g), torch.randn(H, 6, DH, generator=g)
    cache.append(0, k, v)
    fork = cache.fork()
    x, y = torch.randn(H, 1, DH, generator=g), torch.randn(H, 1, DH, generator=g)
    fork.append(0, x, x)
    assert torch.equal(cache.read(0)[0], k) and cache.seq_lens[0] == 6
    cache.append(0, y, y)  # the same column in the same (once shared) block
    assert torch.equal(fork.read(0)[0], torch.cat([k, x], 1))
    assert torch.equal(cache.read(0)[0], torch.cat([k, y], 1))
    fork.free(0)
    assert torch.equal(cache.read(0)[0], torch.cat([k, y], 1))


# --- plugins ---------------------------------------------------------------------------------------------------------
PLUGIN = textwrap.dedent(
    """
    import torch
    from kvbench.caches import LayerCache


    class Plain(LayerCache):
        '''Static buffers without the lifecycle.'''

        def __init__(self, config, batch, max_len, dtype, device):
            super().__init__()
            self.k = torch.zeros(batch, config.n_head, max_len, config.head_dim, dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
            self.capacity = max_len

        def update(self, k, v, positions):
            start, end = self.length, self.length + k.size(2)
            self.k[:, :, start:end], self.v[:, :, start:end] = k, v
            self.length = end
            return self.k[:, :, :end], self.v[:, :, :end]

        @property
        def nbytes(self):
            return self.k.nbytes + self.v.nbytes


    class CropOnly(Plain):
        '''Plain with crop.'''

        def crop(self, length):
            self.length = self.check_crop(length)


    class Bare:
        '''Not a LayerCache at all, and no lifecycle.'''

        capacity = None

        def __init__(self, config, batch, max_len, dtype, device):
            self.length = self.bytes_copied = self.nbytes = 0
            self.k = self.v = None

        def update(self, k, v, positions):
            self.k = k if self.k is None else torch.cat([self.k, k], 2)
            self.v = v if self.v is None else torch.cat([self.v, v], 2)
            self.length = self.k.size(2)
            return self.k, self.v

        def reset(self):
            self.length, self.k, self.v = 0, None, None
    """
)


@pytest.fixture
def lifecycle_plugins(plugin_files):
    plugin_files({"lifecycle_plugins.py": PLUGIN})
    return "lifecycle_plugins"


@pytest.mark.parametrize(
    "cls, missing",
    [
        ("Plain", ["crop", "fork", "reorder"]),
        ("CropOnly", ["fork", "reorder"]),
        ("Bare", ["crop", "fork", "reorder"]),
    ],
)
def test_a_plugin_without_the_lifecycle_loads_and_is_named_missing(lifecycle_plugins, cls, missing):
    ref = f"{lifecycle_plugins}:{cls}"
    spec = get_cache_spec(ref)  # loads: the contract probe passes without the lifecycle
    cache = spec.factory(CFG, 1, 8, torch.float32, torch.device("cpu"))
    assert missing_lifecycle(cache) == missing
    assert missing_lifecycle(cache.inner) == missing and missing_lifecycle(type(cache.inner)) == missing
    k, v = _kv(1, 3, seed=30)
    cache.update(k, v, torch.arange(3)[None])
    for member in missing:
        call = {
            "crop": lambda: cache.crop(1),
            "fork": cache.fork,
            "reorder": lambda: cache.reorder(torch.tensor([0])),
        }
        with pytest.raises(KVBenchError, match=rf"{ref}.*has no {member}"):
            call[member]()
    if "crop" not in missing:
        cache.crop(1)
        assert cache.length == 1
        with pytest.raises(KVBenchError, match=r"crop\(2\) outside 0\.\.1"):
            cache.crop(2)
