"""The --tp launcher (kvbench.launcher), the environment it reads (kvbench.distributed) and where a command becomes
ranks (kvbench.tp_command): how a launched run ends when a rank fails, is killed, exits or hangs (one line naming the rank, the run's exit status, the --json document and the JUnit file
the launcher's), which process is a rank (torchrun's variables checked, --tp held to WORLD_SIZE, a kvbench a rank
starts runs plain), SIGTERM and SIGHUP handled as Ctrl-C by every command, ranks that stop with their launcher,
and the CPU's limits on --tp.

The launcher's rules are one table over what the launcher knows (`_outcome`); real launches of two ranks with a
cache plugin that misbehaves on one rank prove the wiring, in the slow tier."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench import distributed, launcher
from kvbench.distributed import PEER_LOST, RanksFailed
from kvbench.errors import KVBenchError
from kvbench.launcher import Ended, _outcome, _Signalled

TINY = ["-m", "gpt2-tiny", "-w", "random", "-d", "cpu"]
SMALL = ["--prompt-len", "8", "-n", "8", "--reference", "none"]
TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", *distributed.TORCHRUN_VARS, "GROUP_RANK", distributed.LAUNCHER_ENV)


def kvbench(*args, env=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *map(str, args)],
        capture_output=True,
        text=True,
        env={**base, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=timeout,
        **kw,
    )


def errors(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("error:")]


# --- the launcher's rules: what it knows when the ranks are gone -> the run's line and status ---------------------------
def end(kind: str, code: int, line: str | None = None, t: float = 0.0, documents: int = 0, where=None) -> dict:
    return {"kind": kind, "code": code, "line": line, "time": t, "documents": documents, "where": where}


PLUGIN_ARGV = ["verify", "--tp", "2", "--caches", "dynamic,p:C", "--tp-timeout", "10"]
SIGKILL, SIGSEGV, SIGTERM = -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGTERM


@pytest.mark.parametrize(
    "codes, ends, stopped, by, want, line",
    [
        # rank 0 printed PASSED, then a rank ended oddly in teardown: the verdict stands
        ({0: 0, 1: 75}, {0: end("done", 0, documents=1), 1: end("lost", 75)}, set(), None, 0, None),
        ({0: 1, 1: SIGTERM}, {0: end("done", 1)}, {1}, None, 1, None),
        ({0: 0, 1: SIGKILL}, {0: end("done", 0)}, set(), None, 0, None),
        # a rank's own error: its line, its status (rank 0's lost peer says nothing)
        (
            {0: 75, 1: 2},
            {0: end("lost", 75, t=2), 1: end("error", 2, "cache plugin 'p:C' raised", t=1)},
            set(),
            None,
            2,
            "rank 1: cache plugin 'p:C' raised",
        ),
        # the same refusal on every rank: said once, as rank 0's
        (
            {0: 2, 1: 2},
            {0: end("error", 2, "fp16 on the CPU", t=2), 1: end("error", 2, "fp16 on the CPU", t=1)},
            set(),
            None,
            2,
            "fp16 on the CPU",
        ),
        # killed by a signal not the launcher's: named with it, even when the launcher stopped rank 0 with SIGTERM
        ({0: 75, 1: SIGKILL}, {0: end("lost", 75)}, set(), None, PEER_LOST, "rank 1 was killed by SIGKILL"),
        ({0: SIGTERM, 1: SIGSEGV}, {}, {0}, None, PEER_LOST, "rank 1 was killed by SIGSEGV"),
        ({0: SIGKILL, 1: 75}, {1: end("lost", 75)}, set(), None, PEER_LOST, "rank 0 was killed by SIGKILL"),
        # left without a word: os._exit(9) is not exit 9, os._exit(0) on rank 0 is not a verdict
        (
            {0: 75, 1: 9},
            {0: end("lost", 75)},
            set(),
            None,
            PEER_LOST,
            "rank 1 left the run early: it exited with status 9",
        ),
        ({0: 0, 1: SIGTERM}, {}, {1}, None, PEER_LOST, "rank 0 left the run early: it exited with status 0"),
        # a hang: rank 0 waited out --tp-timeout, the launcher stopped rank 1 where it was
        (
            {0: 75, 1: 143},
            {0: end("lost", 75), 1: end("stopped", 143, "terminated", where="p line 12, in update")},
            {1},
            None,
            PEER_LOST,
            "rank 1 hung: it did not reach a collective that rank 0 waited in for --tp-timeout (10 s), and was "
            "stopped; it was at p line 12, in update when stopped; cache plugin loaded: p:C",
        ),
        ({0: 75, 1: SIGTERM}, {0: end("lost", 75)}, {1}, None, PEER_LOST, "rank 1 hung"),
        # the launcher itself stopped by a signal: 128 + the signal
        ({0: 0, 1: 0}, {0: end("stopped", 143), 1: end("stopped", 143)}, set(), signal.SIGTERM, 143, "terminated"),
        ({0: 0, 1: 0}, {}, set(), signal.SIGINT, 130, "interrupted: every rank stopped"),
        ({0: 0, 1: 0}, {0: end("done", 0, documents=1)}, set(), signal.SIGINT, 0, None),  # after the verdict
    ],
    ids=[
        "teardown-race",
        "failed-verdict",
        "verdict-then-killed",
        "own-error",
        "same-refusal",
        "sigkill",
        "sigsegv-rank0-stopped",
        "sigkill-rank0",
        "os-exit-9",
        "os-exit-0-rank0",
        "hang",
        "hang-default-sigterm",
        "launcher-sigterm",
        "launcher-ctrl-c",
        "ctrl-c-after-verdict",
    ],
)
def test_the_run_ends_in_the_line_of_the_rank_that_ended_it(codes, ends, stopped, by, want, line):
    signalled = _Signalled()
    signalled.seen, signalled.ranks = bool(stopped), set(stopped)
    run = Ended(codes, {r: {"rank": r, **e} for r, e in ends.items()}, sorted(codes, key=codes.get), signalled, by)
    if line is None:
        assert _outcome(run, PLUGIN_ARGV) == want
        return
    with pytest.raises(RanksFailed) as e:
        _outcome(run, PLUGIN_ARGV)
    assert e.value.code == want and str(e.value).startswith(line), str(e.value)
    assert e.value.code != 70  # never "a kvbench bug" for what a rank or a signal did


STACKS = """Fatal Python error: Segmentation fault

Thread 0x00007f0000000001 (most recent call first):
  File "/work/p/src/kvbench/distributed.py", line 247 in watch
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f0000000002 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2850 in all_reduce
  File "/v/lib/python3.11/site-packages/transformers/integrations/tensor_parallel.py", line 512 in _prepare_output_fn
{own}  File "<frozen runpy>", line 88 in _run_code

Extension modules: torch._C (total: 1)
"""


@pytest.mark.parametrize(
    "own, want",
    [
        (
            '  File "/work/p/src/kvbench/check/hf_verify.py", line 40 in step\n',
            " in torch/distributed/distributed_c10d.py line 2850, in all_reduce (called from hf_verify.py line 40, "
            "in step)",
        ),
        ("", " in torch/distributed/distributed_c10d.py line 2850, in all_reduce"),
    ],
    ids=["own-caller", "libraries-only"],
)
def test_a_crashed_rank_is_placed_at_the_crashing_threads_innermost_frame(tmp_path, own, want):
    """The crashing thread's frame, not the first thread faulthandler lists; the innermost frame of one's own code
    (kvbench, a plugin, a script) as the caller where the crash is inside installed packages."""
    (tmp_path / "ends").mkdir()
    distributed.fault_file(tmp_path / "ends", 1).write_text(STACKS.replace("{own}", own))
    at, kept = launcher.crash_report(tmp_path, 1)
    assert at == want
    path = Path(kept.removeprefix(" (its stacks: ").removesuffix(")"))
    assert path.read_text().startswith("Fatal Python error: Segmentation fault"), kept
    path.unlink()
    assert launcher.crash_report(tmp_path, 0) == ("", "")  # a rank that left nothing (SIGKILL, os._exit)


def test_the_launchers_line_names_the_plugins_and_the_timeout_only_when_given():
    assert launcher._plugins(["verify", "--caches", "dynamic,static"]) == ""
    assert launcher._plugins(["break", "-c", "a.b:C"]) == "; cache plugin loaded: a.b:C"
    assert launcher._plugins(["bench", "--caches=x:A,y:B"]) == "; cache plugins loaded: x:A, y:B"
    assert launcher._timeout(["verify"]) == "" and launcher._timeout(["--tp-timeout=7"]) == " (7 s)"


# --- which process is a rank ----------------------------------------------------------------------------------------
RANK_ENV = {
    "TORCHELASTIC_RUN_ID": "job",
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29555",
}


@pytest.fixture
def environ(monkeypatch):
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)

    def put(**env):
        for k, v in env.items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)

    return put


def test_a_process_without_torchruns_marker_is_no_rank_whatever_else_is_set(environ):
    environ(RANK="junk", WORLD_SIZE="junk", MASTER_ADDR="")
    assert distributed.role(1) == distributed.Role(False, None, 1, None)
    assert distributed.role(2).launches and distributed.role(2).writes_errors


@pytest.mark.parametrize(
    "env, tp, message",
    [
        ({}, 1, "--tp 1, but torchrun launched 2 ranks (WORLD_SIZE=2): give --tp 2"),
        ({}, 4, "--tp 4, but torchrun launched 2 ranks (WORLD_SIZE=2): give --tp 2"),
        ({"WORLD_SIZE": "junk"}, 2, "WORLD_SIZE is 'junk', not a whole number, and TORCHELASTIC_RUN_ID says"),
        ({"MASTER_ADDR": None}, 2, "MASTER_ADDR is not set, and TORCHELASTIC_RUN_ID says"),
        ({"LOCAL_RANK": None}, 2, "LOCAL_RANK is not set"),
        ({"RANK": "2"}, 2, "RANK is 2, not from 0 to 1"),
        ({"MASTER_PORT": "0"}, 2, "MASTER_PORT is 0, not from 1 to 65535"),
    ],
    ids=["tp1-under-torchrun", "tp4", "junk-world", "no-master-addr", "no-local-rank", "rank-too-big", "port"],
)
def test_a_torchrun_environment_is_checked_variable_by_variable(environ, env, tp, message):
    environ(**{**RANK_ENV, **env})
    with pytest.raises(KVBenchError) as e:
        distributed.role(tp)
    assert str(e.value).startswith(message), str(e.value)


def test_a_torchrun_rank_of_the_right_world_is_a_rank(environ):
    environ(**{**RANK_ENV, "RANK": "1"})
    r = distributed.role(2)
    assert (r.launches, r.rank, r.world, r.launcher, r.reports) == (False, 1, 2, "torchrun", False)
    environ(WORLD_SIZE="1", RANK="0")
    assert distributed.role(1).rank is None  # a world of one rank: the whole model, no group


def test_junk_and_mismatches_are_one_line_exit_2_before_any_work():
    r = kvbench("verify", *TINY, "--json", env={**RANK_ENV, "WORLD_SIZE": "junk"}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert errors(r.stderr) == [errors(r.stderr)[0]] and "WORLD_SIZE is 'junk'" in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 2 and doc["error"] == errors(r.stderr)[0].removeprefix("error: ")
    r = kvbench("break", *TINY, env={**RANK_ENV, "MASTER_ADDR": ""}, timeout=120)
    assert r.returncode == 2 and "MASTER_ADDR is empty" in r.stderr, r.stderr


def test_a_complete_torchrun_environment_with_no_other_rank_is_refused_not_a_lost_peer():
    """Every variable set by hand, no torchrun and no other rank: joining the group fails within --tp-timeout, and
    that is a refusal naming the address (exit 2), never exit 75 with no line."""
    r = kvbench("verify", "--tp", 2, *TINY, *SMALL, "--tp-timeout", 3, env=RANK_ENV, timeout=180)
    assert r.returncode == 2, r.stderr
    (line,) = errors(r.stderr)
    assert "rank 0 of 2 could not join the process group at 127.0.0.1:29555" in line, r.stderr


def test_kvbench_started_by_a_rank_as_a_tool_runs_as_a_plain_process():
    """The parent (here a shell standing in for a torchrun rank) has the same TORCHELASTIC_RUN_ID: kvbench inherited
    the variables without being a rank, so --tp 1 is not held to WORLD_SIZE=2 and the command's own rules run (a
    refusal of --batch 1 shows role() let it through)."""
    cmd = [sys.executable, "-m", "kvbench", "verify", *TINY, "--batch", "1"]
    script = " ".join(f"'{c}'" for c in cmd) + "; exit $?"  # not the shell's last command: it must not exec
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={**base, **RANK_ENV}, timeout=120)
    assert r.returncode == 2 and "--batch must be >= 2" in r.stderr, r.stderr
    alone = kvbench("verify", *TINY, "--batch", "1", env=RANK_ENV, timeout=120)  # the same, as a rank: refused
    assert alone.returncode == 2 and "--tp 1, but torchrun launched 2 ranks" in alone.stderr, alone.stderr


# --- the CPU's limits -------------------------------------------------------------------------------------------------
def _config(tmp_path: Path, **fields) -> Path:
    cfg = {"model_type": "gpt2", "n_embd": 64, "n_head": 64, "n_layer": 1, "vocab_size": 100, "n_positions": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, **fields}))
    return path


SHAPES = [  # (n_head, n_embd, tp, refused with)
    (4, 64, 2, None),
    (3, 48, 2, "3 attention heads do not divide over 2 ranks"),
    (4, 64, 1, None),  # one rank: nothing is split
]


@pytest.mark.parametrize("heads, width, tp, refused", SHAPES)
def test_a_command_becomes_ranks_only_for_a_model_that_splits(heads, width, tp, refused):
    from kvbench.model.gpt2 import GPTConfig
    from kvbench.tp_command import Split, join

    split = Split(tp, "cpu", 60.0, config=GPTConfig(n_layer=1, n_head=heads, n_embd=width, block_size=32))
    if refused is None:
        split.check_shape()
    else:
        with pytest.raises(KVBenchError, match=refused):
            split.check_shape()
    if tp == 1:
        assert join(split) is None  # the whole model in this process: no group joined


def test_more_ranks_than_cores_is_refused_before_any_rank_starts(tmp_path):
    cores = len(os.sched_getaffinity(0))
    tp = 64 if cores < 64 else 128
    r = kvbench("verify", "--tp", tp, "-m", _config(tmp_path, n_head=tp, n_embd=tp), "-w", "random", "-d", "cpu")
    assert r.returncode == 2, r.stderr
    assert errors(r.stderr) == [
        f"error: --tp {tp} on the CPU runs {tp} rank processes, and this machine gives kvbench {cores} "
        f"core{'s' if cores != 1 else ''}: use --tp {cores} or less (on CUDA, one GPU per rank)"
    ], r.stderr


def test_ranks_that_would_not_fit_in_memory_are_refused_before_any_rank_starts(tmp_path):
    """Every rank loads the whole model before taking its share: 2 ranks of a 48-layer, 8192-wide model need about
    2 x 155 GB, more than any machine this runs on has available."""
    big = _config(tmp_path, n_embd=8192, n_head=64, n_layer=48)
    r = kvbench("verify", "--tp", 2, "-m", big, "-w", "random", "-d", "cpu", *SMALL, "--json")
    assert r.returncode == 3, r.stderr
    (line,) = errors(r.stderr)
    assert line.startswith("error: --tp 2 on the CPU needs about") and "lower --tp" in line, line
    assert json.loads(r.stdout)["exit_code"] == 3


# --- SIGTERM and SIGHUP: as Ctrl-C, in every command -----------------------------------------------------------------
SLOW_PLUGIN = """
import os, time
from kvbench.caches.dynamic import DynamicCache
from kvbench.model.tp import config_place

class Slow(DynamicCache):
    '''A dynamic cache that says where it runs (a file named by its pid) and takes its time.'''
    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__()
        self.rank = config_place(config).rank

    def update(self, k, v, positions):
        open(os.path.join(os.environ["MARKS"], f"{self.rank}-{os.getpid()}"), "w").close()
        time.sleep(0.3)
        return super().update(k, v, positions)
"""


def _slow(tmp_path: Path) -> dict:
    (tmp_path / "slowplug.py").write_text(SLOW_PLUGIN)
    (tmp_path / "marks").mkdir()
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "MARKS": str(tmp_path / "marks")}


def _start(tmp_path: Path, *args, background: bool = False) -> subprocess.Popen:
    """kvbench on the slow plugin; `background`: with SIGINT ignored, as a shell starts a job with `&` (and as
    pytest-xdist's workers start their children), where no Ctrl-C can reach it."""
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    return subprocess.Popen(
        [sys.executable, "-m", "kvbench", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**base, "OMP_NUM_THREADS": "1", **_slow(tmp_path)},
        preexec_fn=functools.partial(_child_signals, background),
    )


def _child_signals(background: bool) -> None:
    """In the child, before exec: SIGHUP at its default action (under nohup this run inherited it ignored, and
    kvbench keeps an ignored SIGHUP ignored), and SIGINT ignored for a background job."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if background:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _wait_for_marks(tmp_path: Path, n: int, p: subprocess.Popen, timeout: float = 240) -> list[int]:
    """The pids of the `n` processes running the slow cache, once each has run it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = {m.name.split("-")[0]: int(m.name.split("-")[1]) for m in (tmp_path / "marks").iterdir()}
        if len(ranks) >= n:
            return list(ranks.values())
        assert p.poll() is None, p.communicate()
        time.sleep(0.2)
    pytest.fail("the cache never ran")


@pytest.mark.parametrize(
    "command, sig",
    [
        (["verify", *TINY, "-n", "200", "--prompt-len", "8", "--reference", "none"], signal.SIGTERM),
        (["break", "position", *TINY, "-n", "200", "--reference", "none"], signal.SIGHUP),
        (["generate", "hi", *TINY, "-n", "200"], signal.SIGTERM),
    ],
    ids=["verify-sigterm", "break-sighup", "generate-sigterm"],
)
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_sigterm_and_sighup_end_a_command_as_ctrl_c_does(tmp_path, command, sig, background):
    """Wherever the signal lands, inside a plugin's code included, and whether or not SIGINT is ignored."""
    name = command[0]
    cache = ["--cache", "slowplug:Slow"] if name in ("break", "generate") else ["--caches", "slowplug:Slow"]
    junit = ["--junit-xml", str(tmp_path / "r.xml")] if name != "generate" else []
    p = _start(tmp_path, *command, *cache, "--json", *junit, background=background)
    _wait_for_marks(tmp_path, 1, p)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    line = "terminated" if sig == signal.SIGTERM else "terminated (SIGHUP)"
    assert p.returncode == 128 + sig, err
    assert errors(err) == [f"error: {line}"], err
    doc = json.loads(out)
    assert doc["error"] == line and doc["exit_code"] == 128 + sig, doc
    if junit:
        xml = (tmp_path / "r.xml").read_text()
        assert f'<error message="{line}">' in xml and 'errors="1"' in xml, xml


# --- real launches: the slow tier -------------------------------------------------------------------------------------
MISBEHAVING = """
import os, signal, time
from kvbench.caches.static import StaticCache
from kvbench.model.tp import config_place

class C(StaticCache):
    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__(batch, config.n_head, max_len, config.head_dim, dtype, device)
        self.rank, self.calls = config_place(config).rank, 0

    def update(self, k, v, positions):
        self.calls += 1
        if self.rank == int(os.environ["BAD_RANK"]) and self.calls > 3:
            {body}
        return super().update(k, v, positions)
"""


def _misbehaving(tmp_path: Path, body: str, rank: int) -> dict:
    (tmp_path / "badplug.py").write_text(MISBEHAVING.replace("{body}", body))
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "BAD_RANK": str(rank)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, rank, code, line",
    [
        ("os.kill(os.getpid(), signal.SIGKILL)", 1, 75, "rank 1 was killed by SIGKILL"),
        ("import ctypes; ctypes.string_at(0)", 1, 75, "rank 1 was killed by SIGSEGV"),
        ("os.abort()", 1, 75, "rank 1 was killed by SIGABRT"),
        ("os._exit(9)", 1, 75, "rank 1 left the run early: it exited with status 9"),
        ("os.kill(os.getpid(), signal.SIGKILL)", 0, 75, "rank 0 was killed by SIGKILL"),
        ("os._exit(0)", 0, 75, "rank 0 left the run early: it exited with status 0"),
        ("raise ValueError('rank one boom')", 1, 2, "rank 1: cache plugin 'badplug:C' broke the cache contract"),
        ("time.sleep(600)", 1, 75, "rank 1 hung: it did not reach a collective that rank 0 waited in"),
    ],
    ids=["sigkill", "sigsegv", "abort", "os-exit-9", "sigkill-rank0", "os-exit-0-rank0", "raises", "hangs"],
)
def test_a_lost_rank_is_named_with_how_and_the_reports_are_the_runs(tmp_path, body, rank, code, line):
    """The line on stderr, the --json document on stdout and the JUnit file all carry the launcher's line and the
    run's exit status, whichever rank failed (rank 0 included), and no rank is left running."""
    env = _misbehaving(tmp_path, body, rank)
    xml = tmp_path / "r.xml"
    args = ["verify", "--tp", 2, *TINY, *SMALL, "--caches", "badplug:C", "--tp-timeout", 10, "--json"]
    r = kvbench(*args, "--junit-xml", xml, env=env, timeout=400)
    assert r.returncode == code, r.stderr
    (said,) = errors(r.stderr)
    assert said.startswith(f"error: {line}"), said
    if code == 75:
        assert said.endswith("cache plugin loaded: badplug:C"), said
    doc = json.loads(r.stdout)  # one document, the run's
    assert doc == {"schema_version": 1, "passed": False, "error": said.removeprefix("error: "), "exit_code": code}
    assert f'<error message="{said.removeprefix("error: ")}"' in xml.read_text().replace("&apos;", "'")


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_that_crashes_in_native_code_is_named_with_where_and_its_stacks_are_kept(tmp_path, rank):
    """A SIGSEGV in a rank: the line names the Python frame it crashed in (faulthandler in the rank, written to the
    launcher's folder, never the terminal) and a file kept after the run, with every thread's stack and, for ranks
    other than 0 (whose output is the terminal's), the end of that rank's own output."""
    body = "import ctypes, sys; print('last words of the rank', file=sys.stderr, flush=True); ctypes.string_at(0)"
    env = _misbehaving(tmp_path, body, rank) | {"TMPDIR": str(tmp_path)}
    line_no = MISBEHAVING.splitlines().index("            {body}") + 1
    args = ["verify", "--tp", 2, *TINY, *SMALL, "--caches", "badplug:C", "--tp-timeout", 10]
    r = kvbench(*args, env=env, timeout=400)
    assert r.returncode == 75, r.stderr
    (said,) = errors(r.stderr)
    what = "stacks and last output" if rank else "stacks"
    want = f"error: rank {rank} was killed by SIGSEGV in ctypes/__init__.py line "  # the innermost frame, then the caller's
    assert said.startswith(want), said
    want = f", in string_at (called from badplug.py line {line_no}, in update), so the run lost it (its {what}: "
    assert want in said, said
    assert "Fatal Python error" not in r.stderr, r.stderr  # the stacks are in the file, not on the terminal
    (kept,) = tmp_path.glob(f"kvbench-rank{rank}-lost-*.txt")
    assert said.endswith(f"{kept}); cache plugin loaded: badplug:C"), said
    text = kept.read_text()
    assert "Segmentation fault" in text and f'badplug.py", line {line_no} in update' in text, text
    assert ("last words of the rank" in text) == (rank != 0), text


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_with_143_and_its_reports(tmp_path):
    xml = tmp_path / "r.xml"
    p = _start(tmp_path, "verify", "--tp", 2, *TINY, *SMALL, "--caches", "slowplug:Slow", "--json", "--junit-xml", xml)
    pids = _wait_for_marks(tmp_path, 2, p)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert errors(err) == ["error: terminated (SIGTERM): every rank stopped"], err
    assert json.loads(out)["exit_code"] == 143 and "terminated (SIGTERM)" in xml.read_text()
    _assert_gone(pids)


def _assert_gone(pids: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _running(pid)]
        time.sleep(0.5)
    assert not alive, f"ranks still running: {alive}"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; its new parent has not reaped it yet


@pytest.mark.slow
def test_ranks_stop_when_their_launcher_is_killed(tmp_path):
    """SIGKILL to the launcher alone: it cannot stop its ranks, so each rank stops itself (PR_SET_PDEATHSIG, and a
    watch on its parent): no orphan goes on to print a verdict."""
    p = _start(tmp_path, "verify", "--tp", 2, *TINY, *SMALL, "-n", 40, "--caches", "slowplug:Slow")
    pids = _wait_for_marks(tmp_path, 2, p)
    p.kill()
    p.communicate(timeout=60)
    _assert_gone(pids)


@pytest.mark.slow
def test_torchrun_with_the_default_tp_is_refused_not_run_twice():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    r = subprocess.run(
        [*torchrun, "-m", "kvbench", "verify", *TINY, *SMALL, "--caches", "dynamic", "--json"],
        capture_output=True,
        text=True,
        env={**base, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert r.returncode != 0 and "--tp 1, but torchrun launched 2 ranks (WORLD_SIZE=2): give --tp 2" in r.stderr
    assert '"passed": true' not in r.stdout


@pytest.mark.slow
def test_a_bench_ended_by_a_ranks_error_leaves_a_final_status(tmp_path):
    env = _misbehaving(tmp_path, "raise ValueError('rank one boom')", 1)
    out = tmp_path / "run"
    args = ["bench", "--tp", 2, *TINY, "--prompt-len", 8, "-n", 6, "--repeats", 1, "--warmup", 0]
    r = kvbench(*args, "--caches", "none,badplug:C,static", "--out", out, "--json", env=env, timeout=400)
    assert r.returncode == 2, r.stderr
    assert json.loads(r.stdout)["error"].startswith("rank 1: cache plugin 'badplug:C'"), r.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] in ("failed", "interrupted"), meta["status"]  # rank 0: its peer lost, or stopped first
    assert meta["configurations_completed"] >= 1
