"""Plugin caches from outside the repository, and the shape of the caches package (no import cycles)."""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvbench import caches as registry
from kvbench.caches import get_cache_spec, make_caches, parse_cache_names
from kvbench.check.lifecycle import LIFECYCLE
from kvbench.cli import app
from kvbench.decode.generate import generate
from kvbench.errors import KVBenchError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvbench"
TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]
# a one-repeat bench of one short prompt on TINY
BENCH_SHORT = [*"--prompt-len 16 --new-tokens 4 --repeats 1 --warmup 0 --threads 1".split(), *TINY]


# --- the package ---------------------------------------------------------------------------------------------------
def _imports(path: Path, module: str) -> set[str]:
    """kvbench modules that `path` imports anywhere (top level or inside functions), resolved to module names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvbench")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbench"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return out


def test_package_has_no_import_cycle():
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n] if n in stack else [m, n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert "kvbench.caches.base" in graph and "kvbench.caches.dynamic" in graph


def test_designs_import_the_contract_never_the_registry():
    for path in (SRC / "caches").glob("*.py"):
        if path.name == "__init__.py":
            continue
        imported = _imports(path, path.stem)
        assert "kvbench.caches" not in {i for i in imported if i.count(".") == 1}, path.name


# --- the documented plugin -----------------------------------------------------------------------------------------
def _doc_plugin() -> str:
    text = (ROOT / "docs" / "caches.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if "class GrowingCache" in b)
    assert len(code.splitlines()) <= 45, "the documented plugin stays a short, complete example"
    return code


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """mycaches.growing (docs/caches.md's example, verbatim) and broken variants, importable for this test."""
    pkg = tmp_path / "mycaches"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    code = _doc_plugin()
    (pkg / "growing.py").write_text(code)
    # The classic write-pointer bug: on a decode step the pointer is left on the slot just written.
    buggy = code.replace("self.length = end\n", "self.length = end - 1 if k.size(2) == 1 else end\n")
    assert buggy != code
    (pkg / "pointer_bug.py").write_text(buggy)
    (pkg / "bad.py").write_text(
        textwrap.dedent(
            """
            import torch
            from kvbench.caches import CacheSpec, LayerCache
            from mycaches.growing import GrowingCache

            class NoLength:
                def __init__(self, config, batch, max_len, dtype, device):
                    self.capacity, self.nbytes, self.bytes_copied = None, 0, 0
                def update(self, k, v, positions):
                    return k, v
                def reset(self):
                    pass

            class WrongShape(GrowingCache):
                def update(self, k, v, positions):
                    k, v = super().update(k, v, positions)
                    return k[:, :, 0], v[:, :, 0]

            class Raises(GrowingCache):
                def update(self, k, v, positions):
                    raise ValueError("boom [/] :smile:")

            class BadInit(GrowingCache):
                def __init__(self, config, batch, max_len, dtype, device):
                    raise TypeError("no such argument")

            class LosesLength(GrowingCache):
                def update(self, k, v, positions):
                    out = super().update(k, v, positions)
                    self.length = -1
                    return out

            NOT_A_CACHE = 42
            SPEC = CacheSpec("mine", "a growing cache as a spec", GrowingCache)
            """
        )
    )
    (pkg / "fixed.py").write_text(FIXED)
    (pkg / "import_error.py").write_text("import this_module_does_not_exist\n")
    (pkg / "hostile.py").write_text(HOSTILE)
    for name, body in EXITS_ON_IMPORT.items():
        (pkg / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("mycaches")]:
        del sys.modules[name]
    for name in [n for n in registry.PLUGINS if n.startswith("mycaches")]:
        del registry.PLUGINS[name]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


# --- third-party code that misbehaves: contained, one line naming it ------------------------------------------------
EXITS_ON_IMPORT = {
    "bye": "import sys\nsys.exit(0)\n",
    "bye3": "import sys\nsys.exit(3)\n",
    "base_exception": "class Boom(BaseException):\n    pass\n\nraise Boom('not an Exception')\n",
    "chatty_import": "print('hello from the plugin module')\nfrom mycaches.growing import GrowingCache  # noqa\n",
}
HOSTILE = textwrap.dedent(
    """
    import sys
    import torch
    from kvbench.caches import CacheSpec
    from kvbench.errors import KVBenchError, NotEnoughMemoryError
    from mycaches.growing import GrowingCache

    class ExitInit(GrowingCache):
        def __init__(self, config, batch, max_len, dtype, device):
            sys.exit(0)

    class StrTolerance(GrowingCache):
        exact = False
        logit_atol = "0.1"

    class NegativeTolerance(GrowingCache):
        exact = False
        logit_atol = -1.0

    class NanTolerance(GrowingCache):
        exact = False
        logit_rtol = float("nan")

    class AgreementBelowZero(GrowingCache):
        exact = False
        min_greedy_agreement = -5

    class ExactYes(GrowingCache):
        exact = "yes"

    WeirdStorage = CacheSpec("weird", "stores K and V in a type kvbench does not know", GrowingCache,
                             storage_dtype="int3")

    class ExitUpdate(GrowingCache):
        def update(self, k, v, positions):
            sys.exit(0)

    class ExitReset(GrowingCache):
        def reset(self):
            sys.exit(1)

    class ExitLength(GrowingCache):
        @property
        def length(self):
            sys.exit(0)
        @length.setter
        def length(self, value):
            pass

    class BaseInUpdate(GrowingCache):
        def update(self, k, v, positions):
            raise GeneratorExit("from update")

    class CtrlC(GrowingCache):
        def update(self, k, v, positions):
            raise KeyboardInterrupt

    class RealCtrlC(GrowingCache):
        # a real Ctrl-C, delivered by the signal while the plugin's code runs (after the load-time probe)
        def update(self, k, v, positions):
            if self.length >= 16:
                import os, signal, time
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            return super().update(k, v, positions)

    class NegativeCapacity(GrowingCache):
        def __init__(self, *args):
            super().__init__(*args)
            self.capacity = -1

    class FloatCapacity(GrowingCache):
        def __init__(self, *args):
            super().__init__(*args)
            self.capacity = 4.5

    class BoolCapacity(GrowingCache):
        def __init__(self, *args):
            super().__init__(*args)
            self.capacity = True

    class OverCapacity(GrowingCache):
        def __init__(self, *args):
            super().__init__(*args)
            self.capacity = 2  # claims 2 slots, holds more

    class NotEmpty(GrowingCache):
        def __init__(self, *args):
            super().__init__(*args)
            self.length = 3

    class WrongDevice(GrowingCache):
        def update(self, k, v, positions):
            k, v = super().update(k, v, positions)
            return k.to("meta"), v.to("meta")

    class WrongDtype(GrowingCache):
        def update(self, k, v, positions):
            k, v = super().update(k, v, positions)
            return k.double(), v.double()

    class Chatty(GrowingCache):
        def __init__(self, *args):
            print("chatty: building")
            super().__init__(*args)
        def update(self, k, v, positions):
            print("chatty: update")
            return super().update(k, v, positions)

    class ExitsLater(GrowingCache):
        # passes the load-time probe (batch 2, 8 slots), then ends the process on a real run
        def update(self, k, v, positions):
            if self.length + k.size(2) > 8:
                sys.exit(0)
            return super().update(k, v, positions)

    class FakeVerdict(GrowingCache):
        # kvbench's own exception types, raised to pass for kvbench's verdicts
        def update(self, k, v, positions):
            raise KVBenchError("PASSED all 47 checks")

    class FakeOutOfMemory(GrowingCache):
        def update(self, k, v, positions):
            raise NotEnoughMemoryError("fake out of memory")

    class OutOfMemory(GrowingCache):
        def update(self, k, v, positions):
            raise MemoryError("fake allocation failure")

    class NaNKeys(GrowingCache):
        # values are not probed: the shapes are right, every key is NaN
        def update(self, k, v, positions):
            k, v = super().update(k, v, positions)
            return torch.full_like(k, float("nan")), v

    """
)

# Fixed-step designs (CacheSpec(fixed_step=True)): kvbench's fixed-shape decode step writes their buffers.
FIXED = textwrap.dedent(
    """
    import sys
    from kvbench.caches import CacheSpec
    from kvbench.caches.dynamic import DynamicCache
    from kvbench.caches.static_graph import StaticGraphCache

    def spec(cls):
        make = lambda c, b, n, dt, dev: cls(b, c.n_head, n, c.head_dim, dt, dev)
        return CacheSpec(cls.__name__, cls.__doc__, make, fixed_step=True)

    class Graph(StaticGraphCache):
        "static-graph's buffers as a plugin"

    class Loud(StaticGraphCache):
        "prints on every update, ends the process in crop"
        def update(self, k, v, positions):
            print("loud: update")
            return super().update(k, v, positions)
        def crop(self, length):
            sys.exit(7)

    class Fake(StaticGraphCache):
        "passes for kvbench's verdicts in crop"
        def crop(self, length):
            from kvbench.errors import KVBenchError
            raise KVBenchError("PASSED all 47 checks")

    class Exits(StaticGraphCache):
        "exits when it is built"
        def __init__(self, *args):
            sys.exit(7)

    GraphSpec, LoudSpec, FakeSpec, ExitInit = spec(Graph), spec(Loud), spec(Fake), spec(Exits)
    NotGraph = CacheSpec("dyn", "dynamic layers under a fixed step", lambda c, b, n, dt, dev: DynamicCache(),
                         fixed_step=True)
    """
)

# (reference, what the one line must say). Each is refused when the plugin is loaded: exit 2, nothing on stdout.
HOSTILE_CASES = [
    ("mycaches.bye:X", "cache plugin 'mycaches.bye:X': importing 'mycaches.bye' called sys.exit(0)"),
    ("mycaches.bye3:X", "importing 'mycaches.bye3' called sys.exit(3)"),
    ("mycaches.base_exception:X", "importing 'mycaches.base_exception' raised Boom: not an Exception"),
    ("mycaches.hostile:ExitInit", "constructing it called sys.exit(0)"),
    ("mycaches.hostile:StrTolerance", "logit_atol must be a finite number >= 0, got '0.1'"),
    ("mycaches.hostile:NegativeTolerance", "logit_atol must be a finite number >= 0, got -1.0"),
    ("mycaches.hostile:NanTolerance", "logit_rtol must be a finite number >= 0, got nan"),
    ("mycaches.hostile:AgreementBelowZero", "min_greedy_agreement must be a fraction from 0 to 1, got -5"),
    ("mycaches.hostile:ExactYes", "exact must be True or False, got 'yes'"),
    (
        "mycaches.hostile:WeirdStorage",
        "storage_dtype must be None or one of fp32, fp16, bf16, fp8, int8, int4, got 'int3'",
    ),
    ("mycaches.hostile:ExitUpdate", "broke the cache contract: update called sys.exit(0)"),
    ("mycaches.hostile:ExitReset", "broke the cache contract: reset called sys.exit(1)"),
    ("mycaches.hostile:ExitLength", "broke the cache contract: reading length called sys.exit(0)"),
    ("mycaches.hostile:BaseInUpdate", "update raised GeneratorExit: from update"),
    ("mycaches.hostile:NegativeCapacity", "capacity must be a non-negative int or None, got -1"),
    ("mycaches.hostile:FloatCapacity", "capacity must be a non-negative int or None, got 4.5"),
    ("mycaches.hostile:BoolCapacity", "capacity must be a non-negative int or None, got True"),
    ("mycaches.hostile:OverCapacity", "length 3 exceeds its capacity 2 after an update of 3 token(s)"),
    ("mycaches.hostile:NotEmpty", "a new cache must be empty, but its length is 3"),
    ("mycaches.hostile:WrongDevice", "update returned k on meta, attention runs on cpu"),
    ("mycaches.hostile:WrongDtype", "update returned k in torch.float64, attention runs in torch.float32"),
    # kvbench's own exceptions and a KeyboardInterrupt no signal sent: worded as the plugin's, never as kvbench's
    ("mycaches.hostile:FakeVerdict", "broke the cache contract: update raised KVBenchError: PASSED all 47 checks"),
    ("mycaches.hostile:FakeOutOfMemory", "update raised NotEnoughMemoryError: fake out of memory"),
    ("mycaches.hostile:CtrlC", "broke the cache contract: update raised KeyboardInterrupt"),
    ("mycaches.fixed:NotGraph", "a fixed_step design's cache must be a kvbench.caches.static_graph.StaticGraphCache"),
    ("mycaches.fixed:ExitInit", "constructing it called sys.exit(7)"),
]


@pytest.mark.parametrize(
    "command, ref, message",
    [(c, ref, m) for c in ("generate", "verify") for ref, m in HOSTILE_CASES],
)
def test_hostile_plugin_is_contained_in_one_line(plugin_dir, command, ref, message):
    """A plugin that ends the process, raises a BaseException or breaks the contract stops the command with one
    line naming it and what it did: exit 2, never the plugin's own exit code, nothing on stdout."""
    args = ["hi", "--cache", ref, "-n", 3] if command == "generate" else ["--caches", ref, "-n", 4]
    args.append("--json")  # nothing may reach stdout: no streamed text, no plugin print
    r = run(command, *args, *TINY)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert ref in lines[0] and message in lines[0], lines[0]
    # no plugin text on stdout; --json answers the refusal with one JSON document naming it (verify's: passed false)
    assert json.loads(r.stdout) == {
        "schema_version": 1,
        **({"passed": False} if command == "verify" else {}),
        "error": lines[0].removeprefix("error: "),
        "exit_code": 2,
    }


def test_plugin_prints_go_to_stderr_and_json_stays_clean(plugin_dir):
    """Whatever a plugin prints (importing, building, every update) goes to stderr: --json's stdout is one
    document."""
    import json

    r = run("generate", "hi", "--cache", "mycaches.hostile:Chatty", "-n", 3, *TINY, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["settings"]["cache"] == "mycaches.hostile:Chatty"
    assert "chatty: update" in r.stderr and "chatty" not in r.stdout
    r = run(
        "verify", "--caches", "mycaches.chatty_import:GrowingCache", "-n", 4, *TINY, "--json", "--reference", "none"
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["passed"] and "hello from the plugin module" in r.stderr


def test_a_real_ctrl_c_inside_a_plugin_still_interrupts(plugin_dir):
    """SIGINT delivered while a plugin's code runs is a real interrupt: exit 130, 'interrupted', never worded as
    the plugin's (a KeyboardInterrupt the plugin raises itself is, HOSTILE_CASES); --json prints its error
    document."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("this test process ignores SIGINT (started in the background): no Ctrl-C can reach it")
    r = run("generate", "a b c d e f g h i j k l m n o p", "--cache", "mycaches.hostile:RealCtrlC", "-n", 8, *TINY)
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines() == ["error: interrupted"], r.stderr
    r = run(
        "generate", "a b c d e f g h i j k l m n o p", "--cache", "mycaches.hostile:RealCtrlC", "-n", 8, *TINY, "--json"
    )
    assert r.exit_code == 130 and json.loads(r.stdout) == {
        "schema_version": 1,
        "error": "interrupted",
        "exit_code": 130,
    }


def test_a_keyboard_interrupt_a_plugin_raises_where_sigint_is_ignored_is_the_plugin_s(plugin_dir):
    """A process started in the background ignores SIGINT: no Ctrl-C can reach it, so a KeyboardInterrupt from a
    plugin's code there is the plugin's own, worded as such (exit 2), not an interrupt."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        r = run("generate", "hi", "--cache", "mycaches.hostile:CtrlC", "-n", 3, *TINY)
    finally:
        signal.signal(signal.SIGINT, old)
    assert r.exit_code == 2 and "update raised KeyboardInterrupt" in r.output, r.output


def test_a_plugin_out_of_memory_is_worded_as_the_plugin_s_and_stays_out_of_memory(plugin_dir, tmp_path):
    """An allocation failure inside a plugin is the machine's answer: exit 3 (a bench row `oom`), in one line
    naming the plugin."""
    ref = "mycaches.hostile:OutOfMemory"
    r = run("generate", "hi", "--cache", ref, "-n", 3, *TINY)
    assert r.exit_code == 3, r.output
    assert r.stderr.strip().splitlines() == [
        f"error: cache plugin {ref!r}: update ran out of memory (MemoryError: fake allocation failure)"
    ], r.stderr


@pytest.mark.parametrize(
    "ref, flag",
    [
        ("mycaches.fixed:FakeSpec", "crop(13) raised KVBenchError: PASSED all 47 checks"),
        ("mycaches.fixed:LoudSpec", "crop(13) called sys.exit(7) instead of raising an exception"),
    ],
)
def test_a_fixed_step_plugin_is_contained_and_checked_like_every_other(plugin_dir, tmp_path, ref, flag):
    """A fixed-step design's calls are contained as every plugin's: what it raises or exits with in crop is a
    failing rollback row naming it (verify, exit 1) or one line (generate with drafting, exit 2); what it prints
    goes to stderr, so --json stays one document; the JUnit report is written."""
    xml = tmp_path / "v.xml"
    r = run(
        "verify",
        "--caches",
        ref,
        "-n",
        6,
        "--prompt-len",
        8,
        *TINY,
        "--reference",
        "none",
        "--json",
        "--junit-xml",
        xml,
    )
    assert r.exit_code == 1, r.output
    rows = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert not rows["rollback"]["passed"] and f"cache plugin {ref!r}" in rows["rollback"]["detail"], rows
    assert flag in rows["rollback"]["detail"], rows["rollback"]
    assert all(c["passed"] for n, c in rows.items() if n != "rollback"), rows
    assert "loud: update" not in r.stdout and xml.is_file()
    r = run("generate", "a b a b a b a b a b", "--cache", ref, "-n", 8, "--draft", "prompt-lookup", *TINY)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: cache plugin {ref!r}"), r.stderr


def test_a_correct_fixed_step_plugin_runs_the_fixed_step_and_is_exact(plugin_dir, tiny_model):
    """static-graph's buffers as a plugin: generation goes through the fixed-shape decode step (its calls checked),
    and the tokens are greedy's through the built-in cache."""
    ref = "mycaches.fixed:GraphSpec"
    prompt = torch.randint(0, 500, (9,)).tolist()
    got = generate(tiny_model, [prompt], 12, cache=ref)
    assert got.tokens == generate(tiny_model, [prompt], 12, cache="static-graph").tokens
    caches = make_caches(ref, tiny_model.config, 1, 21, torch.float32, torch.device("cpu"))
    generate(tiny_model, [prompt], 12, cache=ref, caches=caches)
    assert caches[0].runner is not None and caches[0].runner.fixed_steps == 11, caches[0].runner


def test_plugin_that_exits_mid_run(plugin_dir, tmp_path):
    """A plugin that passes the probe and calls sys.exit() later: generate stops with one line (exit 2); verify
    fails its rows naming it (exit 1); bench records its rows as errors and finishes the sweep (every other row,
    the plots and meta.json kept, exit 1)."""
    import json

    ref = "mycaches.hostile:ExitsLater"
    r = run("generate", "hello there", "--cache", ref, "-n", 12, *TINY)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [
        f"error: cache plugin {ref!r} broke the cache contract: update called sys.exit(0) instead of raising an "
        "exception"
    ], r.stderr
    r = run("verify", "--caches", ref, "-n", 12, *TINY, "--json", "--reference", "none")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert all("update called sys.exit(0)" in c["detail"] for c in doc["checks"] if not c["passed"]), doc
    out = tmp_path / "run"
    r = run(
        "bench",
        "--caches",
        f"none,{ref}",
        "--engine",
        "kvbench",
        *BENCH_SHORT,
        "--out",
        out,
    )
    assert r.exit_code == 1, r.output
    import pandas as pd

    status = pd.read_csv(out / "summary.csv").set_index("cache").status
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "complete" and (out / "latency.png").is_file(), meta["status"]
    assert status["none"] == "ok" and "update called sys.exit(0)" in status[ref], status


def test_plugin_is_exact_like_a_builtin(plugin_dir, tiny_model):
    spec = get_cache_spec("mycaches.growing:GrowingCache")
    assert spec.exact and spec.summary.startswith("Buffers that double")
    prompt = torch.randint(0, 500, (37,)).tolist()
    ref = generate(tiny_model, [prompt], 60, cache="dynamic")
    got = generate(tiny_model, [prompt], 60, cache="mycaches.growing:GrowingCache")
    assert got.tokens == ref.tokens
    # 37 + 59 = 96 tokens cached: doublings 16 -> 64 (prefill) -> 128 copy the history once, not every step.
    per_token = 2 * tiny_model.config.n_head * tiny_model.config.head_dim * 4  # K + V, fp32, one layer
    assert got.bytes_copied == tiny_model.config.n_layer * 64 * per_token
    assert got.bytes_copied < ref.bytes_copied / 10


def test_verify_passes_an_exact_plugin(plugin_dir):
    r = run("verify", "--caches", "mycaches.growing:GrowingCache", *TINY, "--new-tokens", 12, "--json")
    assert r.exit_code == 0, r.output
    import json

    doc = json.loads(r.stdout)
    checks = {c["name"] for c in doc["checks"] if c["cache"] == "mycaches.growing:GrowingCache"}
    assert checks == {"logits", "greedy", "reference", "batched", "cache_state", *LIFECYCLE}
    # the lifecycle operations are optional for a plugin: rows that say which member it lacks
    assert all(c["skipped"] for c in doc["checks"] if c["name"] in ("rollback", "fork", "reorder")), doc["checks"]
    assert doc["passed"]


def test_verify_fails_a_plugin_with_a_write_pointer_bug(plugin_dir):
    r = run("verify", "--caches", "mycaches.pointer_bug:GrowingCache", *TINY, "--new-tokens", 12)
    assert r.exit_code == 1, r.output
    failed = r.stdout.split("FAILED", 1)[1].replace("\n", "")
    for check in ("logits", "reference", "batched"):
        assert f"{check}/mycaches.pointer_bug:GrowingCache" in failed


def test_a_plugin_with_a_write_pointer_bug_is_located(plugin_dir):
    """The pointer left on the slot just written: step 2 overwrites step 1's slot. The failing rows say which slot
    holds what, JSON and the grid's detail lines alike; the passing rows say nothing."""
    ref = "mycaches.pointer_bug:GrowingCache"
    args = ("verify", "--caches", ref, *TINY, "--new-tokens", 12, "--prompt-len", 9)
    r = run(*args, "--json")
    assert r.exit_code == 1, r.output
    rows = {c["name"]: c for c in json.loads(r.stdout)["checks"] if c["cache"] == ref}
    where = rows["logits"]["location"]
    assert where.startswith("step 2, layer 0, head 0 (+3 more), slot 9 (position 9): K differs from the reference"), (
        where
    )
    assert where.endswith("; it holds position 10's K; attention reads 10 slots where the sequence fills 11"), where
    assert all(c["location"] == "" for c in rows.values() if c["passed"] or c["skipped"]), rows
    r = run(*args)
    assert "location: " + rows["logits"]["location"][:60] in r.stdout.replace("\n", ""), r.stdout


def test_break_runs_faults_on_a_plugin(plugin_dir):
    r = run("break", "reset", "--cache", "mycaches.growing:GrowingCache", *TINY, "-n", 8, "--reference", "none")
    assert r.exit_code == 0, r.output
    assert "1 of 1 faults detected" in r.stdout
    r = run("break", "static-pointer", "--cache", "mycaches.growing:GrowingCache", *TINY)
    assert r.exit_code == 2 and "lives in the static cache" in r.stderr


def test_bench_gives_a_plugin_row(plugin_dir, tmp_path):
    out = tmp_path / "run"
    r = run(
        *"bench --caches none,mycaches.growing:GrowingCache --engine kvbench".split(),
        *BENCH_SHORT,
        "--out",
        out,
    )
    assert r.exit_code == 0, r.output
    summary = (out / "summary.csv").read_text()
    assert "mycaches.growing:GrowingCache" in summary


def test_a_spec_plugin_keeps_its_settings_under_its_reference(plugin_dir):
    spec = get_cache_spec("mycaches.bad:SPEC")
    assert spec.name == "mycaches.bad:SPEC" and spec.summary == "a growing cache as a spec"


@pytest.mark.parametrize(
    "ref, message",
    [
        ("mycaches.nope:X", "cannot import 'mycaches.nope' (ModuleNotFoundError"),
        ("mycaches.import_error:X", "cannot import 'mycaches.import_error' (ModuleNotFoundError"),
        ("mycaches.bad:Missing", "has no attribute 'Missing'"),
        ("mycaches.bad:NOT_A_CACHE", "is a int; expected a CacheSpec or a LayerCache class"),
        ("mycaches.bad:NoLength", "its cache object has no length"),
        ("mycaches.bad:WrongShape", "update returned k of shape (2, 2, 4), expected (2, 2, S, 4)"),
        ("mycaches.bad:Raises", "update raised ValueError: boom [/] :smile:"),
        ("mycaches.bad:BadInit", "constructing it raised TypeError: no such argument"),
        ("mycaches.bad:LosesLength", "length must be a non-negative int, got -1"),
        ("mycaches.bad:", "expected 'pkg.module:ClassOrSpec'"),
    ],
)
def test_a_broken_plugin_is_one_line_naming_it(plugin_dir, ref, message):
    with pytest.raises(KVBenchError, match=re.escape(message)):
        get_cache_spec(ref)
    r = run("verify", "--caches", ref, *TINY)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert ref in lines[0] and message in lines[0]


POLICIES = textwrap.dedent(
    """
    import torch
    from kvbench.caches.sink import SinkCache
    from kvbench.caches.static import StaticCache

    def grid(x):
        return torch.round(x * 64) / 64

    class Grid(StaticCache):
        \"\"\"K/V on a 1/64 grid, as declared.\"\"\"
        exact, logit_atol, logit_rtol, min_greedy_agreement = False, 0.5, 0.5, 0.5
        roundtrip = staticmethod(grid)
        def __init__(self, config, batch, max_len, dtype, device):
            super().__init__(batch, config.n_head, max_len, config.head_dim, dtype, device)
        def update(self, k, v, positions):
            return super().update(grid(k), grid(v), positions)

    class Half(Grid):
        roundtrip = staticmethod(lambda x: grid(x).half())
    class Wider(Grid):
        roundtrip = staticmethod(lambda x: grid(x).double())
    class Meta(Grid):
        roundtrip = staticmethod(lambda x: grid(x).to("meta"))
    class NaN(Grid):
        roundtrip = staticmethod(lambda x: grid(x) * float("nan"))
    class Random(Grid):
        roundtrip = staticmethod(lambda x: torch.round(x * 64 + torch.rand_like(x) - 0.5) / 64)
    class Raises(Grid):
        roundtrip = staticmethod(lambda x: 1 / 0)
    class Listed(Grid):
        roundtrip = staticmethod(lambda x: [grid(x)])

    def two_and_eight(q, k):
        return (k[:, None, :] < 2) | (k[:, None, :] > q[:, :, None] - 8)

    class Window(SinkCache):
        \"\"\"2 sinks and a window of 8, as declared.\"\"\"
        exact, logit_atol, logit_rtol, min_greedy_agreement = False, 100.0, 100.0, 0.0
        padding = False
        visible = staticmethod(two_and_eight)
        def __init__(self, config, batch, max_len, dtype, device):
            super().__init__(2, 8)

    class Nothing(Window):
        visible = staticmethod(lambda q, k: torch.zeros(q.size(0), q.size(1), k.size(1), dtype=torch.bool))
    class Flaky(Window):
        visible = staticmethod(lambda q, k: two_and_eight(q, k) & (torch.rand(q.size(0), q.size(1), k.size(1)) > 0.1))
    class Ints(Window):
        visible = staticmethod(lambda q, k: two_and_eight(q, k).int())
    class Late(Window):
        \"\"\"hides a query's own position only from position 12 on: past what the probe asks.\"\"\"
        visible = staticmethod(lambda q, k: two_and_eight(q, k) & ~((k[:, None, :] == q[:, :, None]) & (q[:, :, None] >= 12)))

    class NoSinksWindowOfOne(SinkCache):
        \"\"\"no sinks and a window of 1: a query reads only itself.\"\"\"
        exact, logit_atol, logit_rtol, min_greedy_agreement = False, 100.0, 100.0, 0.0
        padding = False
        visible = staticmethod(lambda q, k: k[:, None, :] > q[:, :, None] - 1)
        def __init__(self, config, batch, max_len, dtype, device):
            super().__init__(0, 1)
    """
)


@pytest.fixture
def policies(plugin_dir):
    (plugin_dir / "mycaches" / "policies.py").write_text(POLICIES)
    return "mycaches.policies"


@pytest.mark.parametrize(
    "cls, message",
    [
        ("Half", "its roundtrip returned torch.float16, expected its input's torch.float32"),
        ("Wider", "its roundtrip returned torch.float64, expected its input's torch.float32"),
        ("Meta", "its roundtrip returned a tensor on meta for an input on cpu"),
        ("NaN", "its roundtrip returned 48 non-finite values for finite inputs (NaN or inf)"),
        ("Random", "its roundtrip is not deterministic: two calls on the same inputs returned different values"),
        ("Raises", "its roundtrip call raised ZeroDivisionError: division by zero"),
        ("Listed", "its roundtrip returned list, expected a tensor of shape (2, 2, 3, 4)"),
        ("Nothing", "its visible hides a query's own position (the query at 0 may not read it)"),
        ("Flaky", "its visible "),  # hides a position now and then, or answers differently twice
        ("Ints", "its visible returned torch.int32, expected a boolean mask"),
    ],
)
def test_a_broken_policy_declaration_is_refused_when_the_plugin_loads(policies, cls, message):
    ref = f"{policies}:{cls}"
    with pytest.raises(KVBenchError, match=rf"^cache plugin '{re.escape(ref)}': {re.escape(message)}"):
        get_cache_spec(ref)


def test_a_broken_policy_is_one_line_and_exit_2_on_the_command_line(policies):
    for cls in ("Half", "Nothing"):
        r = run("verify", "--caches", f"{policies}:{cls}", *TINY, "-n", 4, "--reference", "none")
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
        assert f"cache plugin '{policies}:{cls}': its " in lines[0], lines


def test_policies_declared_right_load_and_pass(policies, tiny_model):
    from kvbench.check.verify import random_prompts, run_verify

    for cls in ("Grid", "Window"):
        spec = get_cache_spec(f"{policies}:{cls}")
        assert spec.roundtrip is not None or spec.visible is not None
    prompts = random_prompts(tiny_model.config.vocab_size, 8, 3, seed=0)
    rep = run_verify(tiny_model, [f"{policies}:Grid", f"{policies}:Window"], prompts, 16, reference="none")
    assert rep.passed, [r for r in rep.checks if not r.passed]


def test_a_policy_that_breaks_its_contract_after_the_probe_fails_its_rows_naming_it(policies, tiny_model):
    """Late hides a query's own position from position 12 on: it loads, and the policy rows that reach 12 fail,
    naming the plugin and what its visible did, not a storage difference."""
    from kvbench.check.verify import random_prompts, run_verify

    ref = f"{policies}:Late"
    prompts = random_prompts(tiny_model.config.vocab_size, 8, 3, seed=0)
    rep = run_verify(tiny_model, [ref], prompts, 8, reference="none", distortion=False)
    failed = [r for r in rep.checks if not r.passed and not r.skipped]
    assert failed and not rep.passed
    words = f"cache plugin '{ref}': its visible hides a query's own position (the query at 12 may not read it)"
    assert all(words in r.detail for r in failed), [(r.name, r.detail) for r in failed]


def test_an_evicting_plugin_that_a_crop_leaves_with_no_slot_still_crops_by_what_it_wrote(policies):
    """No sinks and a window of 1: crop(5) after 6 tokens forgets every slot; the plugin's own count of what it wrote
    is what the next crop is checked against (one past its newest slot would be nothing)."""
    (layer,) = make_caches(
        f"{policies}:NoSinksWindowOfOne", registry.GPTConfig(n_layer=1, n_head=2, n_embd=8), 1, 8, torch.float32, "cpu"
    )
    kv = torch.randn(1, 2, 1, 4)
    for t in range(6):
        layer.update(kv, kv, torch.tensor([[t]]))
    layer.crop(5)
    assert layer.length == 0 and layer.written == 5
    layer.crop(4)
    with pytest.raises(KVBenchError, match=r"crop\(5\) outside 0..4"):
        layer.crop(5)


def test_entry_point_plugins_join_all(plugin_dir, tmp_path, monkeypatch):
    """An installed package's `kvbench.caches` entry point is a cache name, and part of `all`."""
    dist = tmp_path / "mycaches-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mycaches\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvbench.caches]\ngrowing = mycaches.growing:GrowingCache\n")
    assert parse_cache_names("all")[-1] == "growing"
    spec = get_cache_spec("growing")
    layers = make_caches("growing", registry.GPTConfig(n_layer=2, n_head=2, n_embd=8), 1, 8, torch.float32, "cpu")
    assert spec.name == "growing" and len(layers) == 2
    registry.PLUGINS.pop("growing")


def test_memory_measure_allocates_a_plugin(plugin_dir):
    """memory --measure holds a plugin to the planner's prediction like any cache: GrowingCache rounds its buffer up
    to a power of two, so at 100 tokens it holds 128 slots per sequence."""
    import json

    r = run(
        "memory",
        "--measure",
        "-m",
        "gpt2-tiny",
        "--ctx",
        100,
        *"--device cpu --kv-dtype fp32 --caches static,mycaches.growing:GrowingCache --json".split(),
    )
    assert r.exit_code == 0, r.output
    rows = {row["cache"]: row for row in json.loads(r.stdout)["measure"][0]["rows"]}
    assert set(rows) == {"static", "mycaches.growing:GrowingCache"}
    assert rows["static"]["measured_bytes"] == rows["static"]["predicted_bytes"]
    assert rows["mycaches.growing:GrowingCache"]["measured_bytes"] == rows["static"]["measured_bytes"] * 128 // 100
    r = run("memory", "-m", "gpt2", "--caches", "static")
    assert r.exit_code == 2 and "--caches goes with --measure" in r.stderr


def test_a_plugin_whose_logits_are_not_finite(plugin_dir):
    """NaN keys from a plugin: verify fails its rows saying the cached run is not finite while the no-cache forward
    is (exit 1); break refuses to claim a fault caught on it, in one line (exit 2)."""
    import json

    ref = "mycaches.hostile:NaNKeys"
    r = run("verify", "--caches", ref, "-n", 4, *TINY, "--json", "--reference", "none")
    assert r.exit_code == 1, r.output
    rows = {c["name"]: c["detail"] for c in json.loads(r.stdout)["checks"] if not c["skipped"]}
    assert (
        "logits are not finite (" in rows["logits"]
        and "in the cached run (the no-cache forward is finite)" in (rows["logits"])
    ), rows
    assert all("logits are not finite (" in d for d in rows.values()), rows
    r = run("break", "reset", "--cache", ref, *TINY, "-n", 4, "--reference", "none")
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "while the model's no-cache forward is finite: that cache itself is broken" in (lines[0])
    ), r.stderr


# Writes that go around sys.stdout: to the interpreter's own stdout, a logging handler bound to it at import, and
# file descriptor 1 itself (what native code's printf does). A subprocess each: fd 1 is the process's, which pytest's
# capture and CliRunner both replace.
RAW_WRITERS = textwrap.dedent(
    """
    import logging, os, sys
    from kvbench.caches.dynamic import DynamicCache
    from kvbench.caches.static_graph import StaticGraphCache
    from kvbench.caches import CacheSpec

    log = logging.getLogger("raw")
    log.addHandler(logging.StreamHandler(sys.__stdout__))
    log.setLevel(logging.INFO)

    def loud(where):
        sys.__stdout__.write(f"RAW {where}\\n"); sys.__stdout__.flush()
        log.info("LOG %s", where)
        os.write(1, f"FD1 {where}\\n".encode())

    class C(DynamicCache):
        def __init__(self, config, batch, max_len, dtype, device):
            loud("init"); super().__init__()
        def update(self, k, v, positions):
            loud("update"); return super().update(k, v, positions)
        def crop(self, n):
            loud("crop"); super().crop(n)

    class G(StaticGraphCache):
        def update(self, k, v, positions):
            loud("update"); return super().update(k, v, positions)

    F = CacheSpec("g", "fixed step, loud", lambda c, b, n, dt, dev: G(b, c.n_head, n, c.head_dim, dt, dev),
                  fixed_step=True)
    """
)


def _kvbench(tmp_path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'src'}", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("generate", "a b a b a b a b a b", "-n", 8, "--no-stop", "--draft", "prompt-lookup", "--cache", "rw:C"),
        ("generate", "hi", "-n", 4, "--cache", "rw:F"),
        ("verify", "--caches", "rw:C,rw:F", "-n", 6, "--prompt-len", 8, "--reference", "none"),
    ],
)
def test_under_json_nothing_a_plugin_writes_reaches_stdout(tmp_path, args):
    """`sys.__stdout__`, a logging handler bound at import and file descriptor 1 itself all reach stderr under
    --json: stdout is the one document, which parses; the writes are on stderr."""
    (tmp_path / "rw.py").write_text(RAW_WRITERS)
    r = _kvbench(tmp_path, *args, *TINY, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc.get("passed", True) is True, doc
    for what in ("RAW", "LOG", "FD1"):
        assert what in r.stderr and what not in r.stdout, (what, r.stdout[:200], r.stderr[-500:])
    r = _kvbench(tmp_path, *args, *TINY)  # without --json stdout is the plugin's to write to as well
    assert r.returncode == 0 and "FD1" in r.stdout, r.stderr


@pytest.mark.slow
def test_a_plugin_that_calls_os_exit_cannot_be_contained(tmp_path):
    """What the docs say: os._exit ends the process on the spot, with the plugin's status and no document."""
    (tmp_path / "ox.py").write_text(
        "import os\nfrom kvbench.caches.dynamic import DynamicCache\n"
        "class C(DynamicCache):\n    def __init__(self, *a):\n        super().__init__()\n"
        "    def update(self, *a):\n        os._exit(9)\n"
    )
    r = _kvbench(tmp_path, "generate", "hi", "-n", 3, "--cache", "ox:C", *TINY, "--json")
    assert r.returncode == 9 and r.stdout == "", r
