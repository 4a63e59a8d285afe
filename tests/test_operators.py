"""kvbench's operators (model/operators.py): what `--compile max`'s step calls for a projection and for attention.
Their CPU kernels are registered from C++ where operators.cpp builds, and are then what the dispatcher runs, the same
C as gemv.py's calls bit for bit and torch's product and SDPA to rounding; without a C++ compiler the Python kernels
answer, and the build says why in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kvbench.model import gemv, matmul, operators

needs_gemv = pytest.mark.skipif(
    gemv.library() is None, reason=f"kvbench's C kernels cannot be built: {gemv.unavailable()}"
)
needs_cxx = pytest.mark.skipif(operators.compiler() is None, reason="no C++ compiler on PATH")


def _cpu_kernel(name: str) -> str:
    """Where the dispatcher's CPU kernel of `name` was registered, as its table says."""
    line = next(ln for ln in torch._C._dispatch_dump(name).splitlines() if ln.startswith("CPU:"))
    return line.split("registered at ", 1)[1]


@needs_gemv
@needs_cxx
def test_the_cpp_kernels_answer_after_prepare_as_the_same_c_and_as_torch():
    """After `prepare` (what `--compile max` runs before a step) the dispatcher's CPU kernels are operators.cpp's,
    and they give gemv.py's ctypes calls' bits and torch's product and float64 SDPA to rounding, at any thread
    count."""
    with matmul.frozen_weights():
        assert matmul._frozen_gemv
    assert operators.kernels() == "c++", operators.unavailable()
    assert operators.unavailable() is None
    for name in ("kvbench::gemv", "kvbench::decode_attention"):
        assert "operators.cpp" in _cpu_kernel(name)
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(1, 1, 200, generator=g), torch.randn(77, 200, generator=g), torch.randn(77, generator=g)
    q, k, v = torch.randn(2, 4, 1, 64, generator=g), torch.randn(2, 4, 19, 64, generator=g), torch.randn(2, 4, 19, 64)
    cols = torch.arange(19)
    allowed = torch.stack([cols <= 11, (cols >= 3) & (cols <= 17)]).view(2, 1, 1, 19)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            calls = operators.calls("gemv")
            y = torch.ops.kvbench.gemv(x, w, b)
            assert operators.calls("gemv") == calls + 1
            assert y.shape == (1, 1, 77) and torch.equal(y, gemv.gemv(x, w, b))
            torch.testing.assert_close(y.double(), x.double() @ w.double().t() + b.double(), rtol=1e-5, atol=1e-5)
            assert torch.equal(torch.ops.kvbench.gemv(x, w, None), gemv.gemv(x, w, None))
            calls = operators.calls("decode_attention")
            a = torch.ops.kvbench.decode_attention(q, k, v, allowed)
            assert operators.calls("decode_attention") == calls + 1  # what bench reads to say a compiled step ran it
            assert a.shape == (2, 4, 1, 64) and torch.equal(a, gemv.attend(q, k, v, allowed))
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
            assert (a.double() - ref).abs().max() < 1e-6
    finally:
        torch.set_num_threads(before)


@needs_gemv
@needs_cxx
def test_a_head_seen_per_head_strided_is_read_as_its_values():
    """c_attn's output row seen as (B, H, 1, Dh) heads is strided; the kernel reads it by value, not by layout."""
    with matmul.frozen_weights():
        pass
    qkv = torch.randn(1, 1, 3 * 128)
    q = qkv[..., :128].view(1, 1, 2, 64).transpose(1, 2)  # (1, 2, 1, 64), strided
    k, v = torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64)
    allowed = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    got = torch.ops.kvbench.decode_attention(q, k, v, allowed)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), rtol=1e-5, atol=1e-6)


def test_the_build_says_why_it_cannot_in_one_line(tmp_path):
    """No compiler, a compiler that fails, one that cannot be run, a cache folder that cannot be written: no library,
    and one line why."""
    path, why = operators.build(None, tmp_path)
    assert path is None and why == "no C++ compiler ($CXX, c++ or g++) on PATH"
    path, why = operators.build("false", tmp_path)
    assert path is None and why.startswith("false failed to build operators.cpp") and "\n" not in why
    path, why = operators.build('g++ "-O2', tmp_path)  # $CXX with an unclosed quote
    assert path is None and why.startswith('cannot run g++ "-O2: ') and "\n" not in why
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path, why = operators.build("c++", blocker)
    assert path is None and why.startswith(f"cannot write under {blocker / 'operators'}") and "KVBENCH_CACHE_DIR" in why


@needs_gemv
def test_without_a_cpp_compiler_the_python_kernels_answer(tmp_path):
    """A process whose $CXX cannot build operators.cpp: `--compile max`'s preparation keeps the Python kernels,
    which run the same C; `unavailable` says why. (A fresh process: C++ kernels, once loaded, stay.)"""
    script = textwrap.dedent(
        """
        import json, torch
        from kvbench.model import gemv, matmul, operators
        with matmul.frozen_weights():
            frozen = matmul._frozen_gemv
        x, w = torch.randn(1, 1, 64), torch.randn(48, 64)
        line = next(ln for ln in torch._C._dispatch_dump("kvbench::gemv").splitlines() if ln.startswith("CPU:"))
        same = torch.equal(torch.ops.kvbench.gemv(x, w, None), gemv.gemv(x, w, None))
        print(json.dumps([frozen, operators.kernels() == "c++", operators.unavailable(), line, same]))
        """
    )
    env = {**os.environ, "CXX": "false", "KVBENCH_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    frozen, in_cpp, why, line, same = json.loads(done.stdout.splitlines()[-1])
    assert frozen is True and in_cpp is False and same is True
    assert why.startswith("false failed to build operators.cpp")
    assert "operators.py" in line and "operators.cpp" not in line


@needs_gemv
@needs_cxx
def test_a_damaged_cached_library_is_built_again(tmp_path):
    """A cached operators library damaged since it was written (here: not a library at all) is built again, once,
    and its C++ kernels answer. (A fresh process, as in the test above.)"""
    script = textwrap.dedent(
        """
        import json, sys
        from kvbench.cachedir import cache_root
        from kvbench.model import gemv, operators
        gemv.library()
        path, why = operators.build(operators.compiler(), cache_root())
        path.write_bytes(b"not a shared library")
        print(json.dumps([operators.prepare(), operators.kernels(), operators.unavailable(), path.stat().st_size]))
        """
    )
    env = {**os.environ, "KVBENCH_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    prepared, kernels, why, size = json.loads(done.stdout.splitlines()[-1])
    assert prepared is True and kernels == "c++" and why is None and size > 1000


@needs_gemv
@needs_cxx
def test_the_first_load_holds_the_kernels_to_the_c_itself_not_to_what_stands_in_for_gemv_py(tmp_path):
    """The C++ kernels are checked once, on the first `prepare` of a process, against the C functions themselves: a
    stand-in for gemv.gemv or gemv.attend at that moment (a test's counter) neither breaks the check nor is what the
    kernels are held to. (A fresh process: the first load happens once.)"""
    script = textwrap.dedent(
        """
        import json
        from kvbench.model import attention, gemv, operators
        gemv.library()  # built and checked first, as in any process that reaches a compiled step
        gemv.attend = gemv.gemv = lambda *a, **k: None
        with attention.own_attention():
            own = attention._own
        print(json.dumps([own, operators.kernels(), operators.unavailable()]))
        """
    )
    env = {**os.environ, "KVBENCH_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [True, "c++", None]
