"""Transparent huge pages: the variable the `kvbench` command sets, and the kernel's own account of the pages."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.bench import hugepages

ROOT = Path(__file__).resolve().parents[1]
THP_WORKS = hugepages.system_mode() in ("always", "madvise") and Path("/proc/self/smaps").is_file()


def test_request_sets_the_variable_only_before_torch_and_only_when_unset(monkeypatch):
    env: dict[str, str] = {}
    monkeypatch.delitem(sys.modules, "torch")  # as in a fresh `kvbench` process; restored after the test
    assert hugepages.request(env) is True and env == {hugepages.ENV: "1"}
    env = {hugepages.ENV: "0"}
    assert hugepages.request(env) is False and env == {hugepages.ENV: "0"}  # the user's choice stands


def test_an_empty_variable_counts_as_unset(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    env = {hugepages.ENV: " "}
    assert hugepages.request(env) is True and env == {hugepages.ENV: "1"}


@pytest.mark.parametrize("value", ["abc", "2", "yes", " 1", "true"])
def test_a_value_torch_would_ignore_stops_every_command_with_one_line(value):
    """torch reads only 0 and 1 and ignores anything else with a warning mid-run; kvbench refuses it up front."""
    from typer.testing import CliRunner

    from kvbench.cli import app

    r = CliRunner().invoke(app, ["memory", "--model", "gpt2", "--ctx", "1k"], env={hugepages.ENV: value})
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "use 1 (huge pages" in r.stderr and repr(value) in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("value", ["", "0", "1"])
def test_zero_one_and_empty_are_accepted(value):
    hugepages.check({hugepages.ENV: value})
    hugepages.check({})


def test_request_does_nothing_once_torch_is_loaded():
    import torch  # noqa: F401

    env: dict[str, str] = {}
    assert hugepages.request(env) is False and env == {}


@pytest.mark.parametrize(
    "text, mode",
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never", "always"),
        ("always madvise [never]", "never"),
        ("", None),
        ("no brackets here", None),
    ],
)
def test_system_mode_reads_the_bracketed_choice(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert hugepages.system_mode(f) == mode


def test_system_mode_without_thp_is_none(tmp_path):
    assert hugepages.system_mode(tmp_path / "absent") is None


def test_the_mapping_that_holds_the_address_is_read(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "Size:               4096 kB\n"
        "AnonHugePages:      2048 kB\n"
        "VmFlags: rd wr mr mw me ac hg\n"
        "7f0000400000-7f0000800000 rw-p 00000000 00:00 0 \n"
        "Size:               4096 kB\n"
        "AnonHugePages:         0 kB\n"
        "VmFlags: rd wr mr mw me ac\n"
    )
    assert hugepages._mapping_at(0x7F0000000010, smaps)["AnonHugePages"] == "2048 kB"
    assert hugepages._mapping_at(0x7F0000400010, smaps)["AnonHugePages"] == "0 kB"
    assert hugepages._mapping_at(0x10, smaps) is None
    assert hugepages._mapping_at(0x10, tmp_path / "absent") is None
    assert "hg" in hugepages._mapping_at(0x7F0000000010, smaps)["VmFlags"].split()
    assert "hg" not in hugepages._mapping_at(0x7F0000400010, smaps)["VmFlags"].split()


def _fresh_process(env_value: str | None) -> dict:
    """What `status()` says in a new Python that asks for huge pages before importing torch, like `kvbench`."""
    env = {k: v for k, v in os.environ.items() if k != hugepages.ENV}
    env["PYTHONPATH"] = str(ROOT / "src")
    if env_value is not None:
        env[hugepages.ENV] = env_value
    code = (
        "import json; from kvbench.bench import hugepages; hugepages.request(); print(json.dumps(hugepages.status()))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not THP_WORKS, reason="needs Linux transparent huge pages (always or madvise) and /proc")
def test_a_fresh_process_asks_for_huge_pages_and_zero_does_not():
    """What the software chose is asserted exactly (the allocator's madvise, smaps flag "hg"); whether the kernel
    granted huge pages depends on fragmentation and load, so only its type is."""
    on = _fresh_process(None)
    assert on[hugepages.ENV] == "1" and on["advised"] is True
    assert isinstance(on["in_use"], bool)
    off = _fresh_process("0")
    assert off[hugepages.ENV] == "0" and off["advised"] is False
    if hugepages.system_mode() == "madvise":  # nothing asked for them: the kernel gives none
        assert off["in_use"] is False
    else:  # "always" may give them without asking
        assert isinstance(off["in_use"], bool)


def test_importing_the_command_line_leaves_torch_unloaded_so_main_can_ask_first():
    """`kvbench` imports every command's module before `main` asks for huge pages: a module-level import that
    reaches torch (a registry, a rule that reads one) would make the request a silent no-op."""
    env = {k: v for k, v in os.environ.items() if k != hugepages.ENV}
    env["PYTHONPATH"] = str(ROOT / "src")
    code = (
        "import os, sys; import kvbench.cli; from kvbench.bench import hugepages; "
        "print('torch' in sys.modules, hugepages.request(), os.environ.get(hugepages.ENV))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "1"], out.stdout


@pytest.mark.skipif(not THP_WORKS, reason="needs Linux transparent huge pages (always or madvise) and /proc")
def test_the_paired_floor_reads_private_memory_advised_as_torch_advises_its_buffers(monkeypatch):
    """bench's reads beside each timed run (floor.read_now) map memory of their own: private, and advised for huge
    pages where torch's buffers are (ENV 1). In mmap's default, shared memory, which never gets huge pages, those
    reads ran at 49-51 GB/s beside weights read at 58-66: a floor too high, and every x paired too low."""
    import torch

    from kvbench.bench import floor

    flags: list[list[str]] = []
    real = floor._read_mapped

    def spy(mm, kernel, repeats):
        x = torch.frombuffer(mm, dtype=torch.float32)
        fields = hugepages._mapping_at(x.data_ptr())
        del x  # no view of the mapping may outlive its read
        assert fields is not None and "VmFlags" in fields
        flags.append(fields["VmFlags"].split())
        return real(mm, kernel, repeats)

    monkeypatch.setattr(floor, "_read_mapped", spy)
    bw = floor.Bandwidth(read_gbps=1.0, copy_gbps=1.0, nbytes=8 << 20, device="cpu")
    for value, advised in (("1", True), ("0", False)):
        monkeypatch.setenv(hugepages.ENV, value)
        flags.clear()
        assert floor.read_now(bw, repeats=1) > 0
        assert "sh" not in flags[0]  # private
        assert ("hg" in flags[0]) is advised


def test_advice_a_kernel_refuses_leaves_the_read_in_the_pages_it_has():
    """A kernel built without transparent huge pages answers MADV_HUGEPAGE with EINVAL: the paired floor's read goes
    on in ordinary pages rather than ending the run."""
    import errno
    import mmap

    class Refusing:
        def madvise(self, option):
            raise OSError(errno.EINVAL, "Invalid argument")

    if hasattr(mmap, "MADV_HUGEPAGE"):
        hugepages.advise(Refusing(), {hugepages.ENV: "1"})  # type: ignore[arg-type]
    hugepages.advise(Refusing(), {hugepages.ENV: "0"})  # type: ignore[arg-type]  # not asked at all
