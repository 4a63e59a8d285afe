"""Caches from outside the repository: `pkg.module:ClassOrSpec` references and the `kvbench.caches` entry points.

A plugin is either a `CacheSpec` (full control: summary, tolerances, a decode runner) or a `LayerCache` subclass
whose constructor takes the factory signature `(config, batch, max_len, dtype, device)`; a class is wrapped in a
spec (summary from its docstring, `exact`/`logit_atol`/`logit_rtol`/`min_greedy_agreement` from class attributes
when it sets them). Either way the plugin gets what built-in caches get: generate, verify, break, bench and
`memory --measure`.

A plugin is held to the contract when it is loaded (a small probe on the CPU: attributes present, `update` returns
(B, H, S, Dh) tensors with S >= length; a declared `roundtrip` or `visible` of the right shape, dtype and device,
finite, letting each query read itself, and the same twice) and on every call after that (`CheckedCache`,
`_checked_policy`), so a plugin that breaks the contract fails with one line naming it and what it broke, never a
traceback from inside it.

The lifecycle members (`crop`, `fork`, `reorder`) are optional: a plugin without them loads and runs, and
`missing_lifecycle` names what it lacks, so verify's lifecycle checks give those a skip row. Those it has are
checked like the rest (arguments validated before the call, the length it reports after).

A plugin's code is contained (kvbench.thirdparty): importing its module, building its cache, and every call into
its cache, a fixed-step design's included (`CacheSpec(fixed_step=True)`: its caches must be `StaticGraphCache`s,
whose buffers kvbench's fixed-shape decode step writes, decode/fixed_step.py). Whatever it raises, including
`sys.exit()`, other BaseExceptions and kvbench's own exception types, becomes one PluginError naming the plugin and
what it was doing (Ctrl-C still interrupts; an allocation failure stays out of memory, worded as the plugin's), and
what it prints goes to stderr, so stdout stays kvbench's own (one JSON document under --json).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Callable
from importlib import metadata

import torch

from kvbench.caches.base import LIFECYCLE, CacheSpec, LayerCache, Traffic
from kvbench.caches.static_graph import StaticGraphCache
from kvbench.dtypes import SPELLINGS
from kvbench.errors import KVBenchError, is_out_of_memory, one_line
from kvbench.model.gpt2 import GPTConfig, Visible
from kvbench.thirdparty import contained, did

ENTRY_POINT_GROUP = "kvbench.caches"
ATTRIBUTES = ("update", "reset", "length", "capacity", "nbytes", "bytes_copied")
SPEC_FIELDS = ("exact", "logit_atol", "logit_rtol", "min_greedy_agreement", "roundtrip", "visible", "padding", "holds")
_PROBE = GPTConfig(block_size=16, vocab_size=16, n_layer=1, n_head=2, n_embd=8, name="probe")


class PluginError(KVBenchError):
    """A cache plugin could not be loaded or broke the cache contract."""


def is_reference(name: str) -> bool:
    return ":" in name


def entry_point_names() -> dict[str, metadata.EntryPoint]:
    """Installed plugins, by entry-point name."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_reference(ref: str) -> CacheSpec:
    """`pkg.module:Name` -> a checked CacheSpec named `ref`."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise PluginError(f"cache plugin {ref!r}: expected 'pkg.module:ClassOrSpec'")

    def cannot_import(e: BaseException) -> PluginError:
        if isinstance(e, Exception):  # any error while importing someone else's module is theirs
            return PluginError(f"cache plugin {ref!r}: cannot import {module_name!r} ({one_line(e)})")
        return PluginError(f"cache plugin {ref!r}: {did(f'importing {module_name!r}', e)}")

    with contained(cannot_import):
        module = importlib.import_module(module_name)

    def cannot_read(part: str, e: BaseException) -> PluginError:
        return PluginError(f"cache plugin {ref!r}: {did(f'reading {part!r}', e)}")

    obj = module
    for part in attr.split("."):
        with contained(functools.partial(cannot_read, part)):
            found = hasattr(obj, part)
            obj = getattr(obj, part) if found else obj
        if not found:
            raise PluginError(f"cache plugin {ref!r}: module {module_name!r} has no attribute {attr!r}")
    return wrap(obj, ref)


def load_entry_point(ep: metadata.EntryPoint) -> CacheSpec:
    def cannot_load(e: BaseException) -> PluginError:
        what = one_line(e) if isinstance(e, Exception) else did("loading it", e)
        return PluginError(f"cache plugin {ep.name!r} (entry point {ep.value}): cannot load it ({what})")

    with contained(cannot_load):
        obj = ep.load()
    return wrap(obj, ep.name)


def wrap(obj: object, name: str) -> CacheSpec:
    """A CacheSpec (renamed to `name`) or a LayerCache class wrapped in one; probed before it is used."""
    if isinstance(obj, CacheSpec):
        spec = dataclasses.replace(obj, name=name)
    elif isinstance(obj, type):
        fields = {f: getattr(obj, f) for f in SPEC_FIELDS if f in vars(obj) or _inherited(obj, f)}
        summary = (obj.__doc__ or obj.__name__).strip().splitlines()[0]
        spec = CacheSpec(name, summary, obj, **fields)
    else:
        raise PluginError(
            f"cache plugin {name!r} is a {type(obj).__name__}; expected a CacheSpec or a LayerCache class"
        )
    if spec.factory is None:
        raise PluginError(f"cache plugin {name!r}: its CacheSpec has no factory")
    _check_stated(spec, name)
    visible = _checked_policy(spec.visible, name, "visible")
    checked = dataclasses.replace(
        spec,
        factory=_checked_factory(spec.factory, name, spec.fixed_step, visible),
        roundtrip=_checked_policy(spec.roundtrip, name, "roundtrip"),
        visible=visible,
    )
    probe(checked)
    probe_policy(checked)
    return checked


def _check_stated(spec: CacheSpec, name: str) -> None:
    """What a plugin states about itself is what verify and the floor trust: it must be of the right kind."""

    def bad(field: str, value: object, want: str) -> PluginError:
        return PluginError(f"cache plugin {name!r}: {field} must be {want}, got {value!r}")

    for field in ("exact", "fixed_step"):
        if not isinstance(getattr(spec, field), bool):
            raise bad(field, getattr(spec, field), "True or False")
    for field in ("logit_atol", "logit_rtol"):
        v = getattr(spec, field)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise bad(field, v, "a finite number >= 0")
    v = spec.min_greedy_agreement
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
        raise bad("min_greedy_agreement", v, "a fraction from 0 to 1")
    if spec.traffic is not None and not isinstance(spec.traffic, Traffic):
        raise bad("traffic", spec.traffic, "a kvbench.caches.Traffic or None")
    for field in ("roundtrip", "visible", "holds"):  # its policy (check/policy.py) and what it holds (the planner)
        value = getattr(spec, field)
        if value is not None and not callable(value):
            raise bad(field, value, "a function or None")
    if not isinstance(spec.padding, bool):
        raise bad("padding", spec.padding, "True or False")
    if spec.storage_dtype is not None and spec.storage_dtype not in SPELLINGS:
        raise bad("storage_dtype", spec.storage_dtype, f"None or one of {', '.join(SPELLINGS)}")


def _checked_policy(fn, name: str, field: str):
    """A plugin's declared roundtrip or visible, contained and held to what verify's policy rows and the model's
    mask need of it, at every call: roundtrip (B, H, T, Dh) -> the same shape, dtype and device, finite where its
    input is; visible (q (B, T), k (B, S)) -> a (B, T, S) bool mask on the queries' device that lets every query read
    its own position. Whether it gives the same answer twice is probed when the plugin is loaded (`probe_policy`)."""
    if fn is None:
        return None

    def fail(what: str) -> PluginError:
        return PluginError(f"cache plugin {name!r}: its {field} {what}")

    def call(*args):
        with contained(lambda e: fail(did("call", e))):
            out = fn(*args)
        first = args[0]
        want = first.shape if field == "roundtrip" else (*first.shape, args[1].size(-1))
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise fail(f"returned {shape}, expected a tensor of shape {tuple(want)}")
        dtype = first.dtype if field == "roundtrip" else torch.bool
        if out.dtype != dtype:
            words = f"its input's {dtype}" if field == "roundtrip" else "a boolean mask"
            raise fail(f"returned {out.dtype}, expected {words}")
        if out.device != first.device:
            raise fail(f"returned a tensor on {out.device} for an input on {first.device}")
        if field == "roundtrip":
            broken = ~torch.isfinite(out) & torch.isfinite(first)
            if bool(broken.any()):
                raise fail(f"returned {int(broken.sum())} non-finite values for finite inputs (NaN or inf)")
        else:
            q, k = first, args[1]
            hidden = (k[:, None, :] == q[:, :, None]) & ~out  # (B, T, S): a query's own position, not read
            if bool(hidden.any()):
                b, t, _ = (int(i) for i in hidden.nonzero()[0])
                raise fail(
                    f"hides a query's own position (the query at {int(q[b, t])} may not read it): every query "
                    "reads at least itself"
                )
        return out

    return call


def probe_policy(spec: CacheSpec) -> None:
    """A declared roundtrip and visible called on the probe's inputs (each call checked, `_checked_policy`), twice:
    the same answer both times, since the policy rows replay it as the reference of every step."""
    B, H, Dh = 2, _PROBE.n_head, _PROBE.head_dim
    g = torch.Generator().manual_seed(0)
    q, k = torch.arange(5).expand(B, 5), torch.arange(5).expand(B, 5)  # a prefill's queries over their own keys
    decode = torch.full((B, 1), 7), torch.arange(8).expand(B, 8)  # one query over a longer past
    calls: list[tuple[str, Callable | None, tuple[torch.Tensor, ...]]] = [
        ("roundtrip", spec.roundtrip, (torch.randn(B, H, 3, Dh, generator=g) * 3,)),
        *(("visible", spec.visible, args) for args in ((q, k), decode)),
    ]
    for field, fn, args in calls:
        if fn is None:
            continue
        first, again = fn(*(a.clone() for a in args)), fn(*(a.clone() for a in args))
        if not torch.equal(first, again):
            raise PluginError(
                f"cache plugin {spec.name!r}: its {field} is not deterministic: two calls on the same inputs "
                "returned different values (the policy rows hold the design to it at every step)"
            )


def _inherited(cls: type, field: str) -> bool:
    return any(field in vars(base) for base in cls.__mro__[1:] if base not in (LayerCache, object))


def _checked_factory(factory, name: str, fixed_step: bool, visible: Visible | None = None):
    def fail(what: str) -> PluginError:
        return PluginError(f"cache plugin {name!r}: {what}")

    def build(config, batch, max_len, dtype, device):
        with contained(lambda e: fail(did("constructing it", e))):
            cache = factory(config, batch, max_len, dtype, device)
        if fixed_step and not isinstance(cache, StaticGraphCache):
            raise fail(
                f"a fixed_step design's cache must be a kvbench.caches.static_graph.StaticGraphCache (the fixed-shape "
                f"decode step writes its buffers), its factory returned a {type(cache).__name__}"
            )
        missing = [a for a in ATTRIBUTES if not _has(cache, a)]
        if missing:
            raise fail(f"its cache object has no {', '.join(missing)}")
        checked = CheckedCache(cache, name, visible)
        _ = checked.capacity  # read once here: a negative or non-integer capacity is refused before any run
        if checked.length != 0:
            raise checked._fail(f"a new cache must be empty, but its length is {checked.length}")
        return checked

    return build


class _Raised(Exception):
    """Reading an attribute of a plugin's object raised something other than AttributeError."""


def _has(obj: object, attr: str) -> bool:
    """Does the plugin's object have `attr`? One that raises (or exits) when read has it: the call-time check
    reports what it raises. A real Ctrl-C still interrupts."""
    try:
        with contained(lambda e: e if isinstance(e, AttributeError) else _Raised()):  # its prints to stderr
            getattr(obj, attr)
    except AttributeError:
        return False
    except _Raised:
        return True
    return True


def missing_lifecycle(cache_or_class: object) -> list[str]:
    """The lifecycle members (base.LIFECYCLE: crop, fork, reorder) a cache or cache class lacks, in that order.

    A member is missing when it is absent, not callable, or inherited unchanged from `LayerCache` (whose versions
    raise NotImplementedError). A checked plugin cache is judged by the plugin's own object."""
    target = cache_or_class
    while not isinstance(target, type) and hasattr(target, "inner"):  # a checked or recorded cache: the one inside
        target = target.inner
    cls = target if isinstance(target, type) else type(target)
    missing = []
    for name in LIFECYCLE:
        own = not isinstance(target, type) and name in getattr(target, "__dict__", {})  # set on the instance
        member = getattr(cls, name, None)
        if not own and (not callable(member) or member is getattr(LayerCache, name)):
            missing.append(name)
    return missing


class CheckedCache(LayerCache):
    """A plugin's cache behind the contract: every call checked and contained (see `contained`), every failure one
    line naming the plugin."""

    def __init__(self, inner, name: str, visible: Visible | None = None) -> None:
        # visible: the design's declared policy (checked), which this cache states to the model's mask; a design
        # that declares one evicts, so an update may drop tokens and each slot's position is read from key_positions
        self.inner, self.name, self.visible = inner, name, visible
        self.evicts = visible is not None

    def _fail(self, what: str) -> PluginError:
        return PluginError(f"cache plugin {self.name!r} broke the cache contract: {what}")

    def _calling(self, doing: str) -> contained:
        return contained(lambda e: self._raised(doing, e))

    def _raised(self, doing: str, e: BaseException) -> PluginError:
        if is_out_of_memory(e):  # the machine's answer, not a broken contract (contained keeps it out of memory)
            return PluginError(f"cache plugin {self.name!r}: {did(doing, e)}")
        return self._fail(did(doing, e))

    def _get(self, attr: str):
        with self._calling(f"reading {attr}"):
            return getattr(self.inner, attr)

    def update(self, k, v, positions):
        B, H, T, Dh = k.shape
        before = self.length
        with self._calling("update"):
            out = self.inner.update(k, v, positions)
        if not (isinstance(out, tuple | list) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            raise self._fail(f"update must return (k, v) tensors, returned {type(out).__name__}")
        k_out, v_out = out
        length = self.length
        for label, t in (("k", k_out), ("v", v_out)):
            if t.dim() != 4 or tuple(t.shape[:2]) != (B, H) or t.size(3) != Dh:
                raise self._fail(f"update returned {label} of shape {tuple(t.shape)}, expected ({B}, {H}, S, {Dh})")
            if t.size(2) < length:
                raise self._fail(f"update returned {t.size(2)} {label} slots but length is {length}")
            if t.dtype != k.dtype:
                raise self._fail(f"update returned {label} in {t.dtype}, attention runs in {k.dtype}")
            if t.device != k.device:
                raise self._fail(f"update returned {label} on {t.device}, attention runs on {k.device}")
        if k_out.shape != v_out.shape:
            raise self._fail(f"update returned k {tuple(k_out.shape)} and v {tuple(v_out.shape)} of different shapes")
        if self.evicts:
            self._check_positions(B, k_out.size(2))
        elif length < before:
            raise self._fail(f"length went from {before} to {length!r} after an update of {T} token(s)")
        capacity = self.capacity
        if capacity is not None and length > capacity:
            raise self._fail(f"length {length} exceeds its capacity {capacity} after an update of {T} token(s)")
        return k_out, v_out

    def _check_positions(self, B: int, S: int) -> None:
        pos = self._get("key_positions")
        if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != (B, S) or pos.is_floating_point():
            shape = tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__
            raise self._fail(f"an evicting cache's key_positions is {shape} after update, expected ({B}, {S}) integers")

    @property
    def key_positions(self) -> torch.Tensor | None:
        """The position of each slot the last update returned, (B, S): an evicting design's only."""
        return self._get("key_positions") if self.evicts else None

    @property
    def written(self) -> int:
        """Tokens written so far (an evicting design: its own count when it keeps one as an int `written`, as
        SinkCache does, since a crop can leave it no slot; else one past the latest position it holds)."""
        own = self._get("written") if _has(self.inner, "written") else None
        if isinstance(own, int) and not isinstance(own, bool) and own >= 0:
            return own
        pos = self.key_positions
        return self.length if pos is None or pos.numel() == 0 else int(pos.max()) + 1

    def reset(self) -> None:
        with self._calling("reset"):
            self.inner.reset()

    def check_capacity(self, n_new: int, kind: str) -> tuple[int, int]:
        return LayerCache.check_capacity(self, n_new, kind)  # on the checked length and capacity

    # --- the lifecycle: optional for a plugin; its arguments are checked here, against the contract ----------------
    def _lifecycle(self, member: str):
        if member in missing_lifecycle(self.inner):
            raise self._fail(f"it has no {member} (optional; see missing_lifecycle)")
        return getattr(self.inner, member)

    def crop(self, length: int) -> None:
        n = self.check_crop(length, self.written if self.evicts else None)
        crop = self._lifecycle("crop")
        with self._calling(f"crop({n})"):
            crop(n)
        if self.length > n if self.evicts else self.length != n:  # an evicting cache holds at most the first n
            raise self._fail(f"length is {self.length} after crop({n})")

    def fork(self) -> CheckedCache:
        fork, length = self._lifecycle("fork"), self.length
        with self._calling("fork"):
            other = fork()
        if other is self.inner:
            raise self._fail("fork returned the cache itself, not an independent copy")
        missing = [a for a in ATTRIBUTES if not _has(other, a)]
        if missing:
            raise self._fail(f"fork returned an object with no {', '.join(missing)}")
        checked = CheckedCache(other, self.name, self.visible)
        if checked.length != length:
            raise self._fail(f"fork holds {checked.length} tokens, the cache it was forked from {length}")
        return checked

    def reorder(self, index: torch.Tensor) -> None:
        # Shape, dtype and sign here; the batch is the plugin's own, so rows past it are its own check.
        idx, length = self.check_index(index, None, None), self.length
        reorder = self._lifecycle("reorder")
        with self._calling("reorder"):
            reorder(idx)
        if self.length != length:
            raise self._fail(f"length went from {length} to {self.length} in reorder")

    def _set(self, attr: str, value: object) -> None:
        with self._calling(f"setting {attr}"):
            setattr(self.inner, attr, value)

    # the counters and the capacity: read from the plugin's object and checked, set on it (contained)
    length = property(  # type: ignore[assignment]
        lambda self: self._int("length"), lambda self, value: self._set("length", value)
    )
    bytes_copied = property(  # type: ignore[assignment]
        lambda self: self._int("bytes_copied"), lambda self, value: self._set("bytes_copied", value)
    )
    capacity = property(  # type: ignore[assignment]
        lambda self: self._capacity(), lambda self, value: self._set("capacity", value)
    )

    def _capacity(self) -> int | None:
        cap = self._get("capacity")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise self._fail(f"capacity must be a non-negative int or None, got {cap!r}")
        return cap

    @property
    def nbytes(self) -> int:
        return self._int("nbytes")

    def _int(self, attr: str) -> int:
        value = self._get(attr)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._fail(f"{attr} must be a non-negative int, got {value!r}")
        return value

    @property
    def runner(self):
        """A fixed-step design's decode runner (decode/fixed_step.py), kept on the plugin's StaticGraphCache; other
        designs have none."""
        if not isinstance(self.inner, StaticGraphCache):
            raise AttributeError("runner")
        with self._calling("reading runner"):
            return getattr(self.inner, "runner", None)

    @runner.setter
    def runner(self, value) -> None:
        with self._calling("setting runner"):
            self.inner.runner = value

    def __getattr__(self, attr: str):  # anything else (a design's own tensors) reads through
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)


def probe_layer(spec: CacheSpec) -> LayerCache:
    """One layer of the design on the probe's tiny CPU config: what it implements can be asked of it."""
    assert spec.factory is not None, f"{spec.name} holds no cache to probe"
    return spec.factory(_PROBE, 1, 4, torch.float32, torch.device("cpu"))


def probe(spec: CacheSpec) -> None:
    """Prefill 3 tokens and decode 1 on a tiny CPU config: catches a broken plugin before a long run starts.
    Shapes and members only: whether the values (and the write pointer) are right is what `verify` checks."""
    B, H, Dh = 2, _PROBE.n_head, _PROBE.head_dim
    assert spec.factory is not None, f"{spec.name} holds no cache to probe"
    cache = spec.factory(_PROBE, B, 8, torch.float32, torch.device("cpu"))
    assert isinstance(cache, CheckedCache), f"{spec.name}: probe a spec whose factory is checked (wrap)"
    g = torch.Generator().manual_seed(0)
    for start, T in ((0, 3), (3, 1)):
        k, v = (torch.randn(B, H, T, Dh, generator=g) for _ in range(2))
        positions = torch.arange(start, start + T).expand(B, T)
        cache.update(k, v, positions)
    cache.reset()
    if cache.length != 0:
        raise PluginError(
            f"cache plugin {spec.name!r} broke the cache contract: length is {cache.length} after reset()"
        )
