"""kvbench's operators: `kvbench::gemv` and `kvbench::decode_attention`, what `--compile max`'s step calls.

Inductor cannot see into a ctypes call, so inside a compiled step the C kernels of model/gemv.py are operators: a
schema, a shape rule for tracing (fake tensors), and a CPU kernel. model/matmul.py and model/attention.py decide
where a step calls them (frozen_weights, own_attention); this module says what runs when it does.

The CPU kernel is registered from C++ where it can be built (operators.cpp, once per torch and C++ compiler, under
$KVBENCH_CACHE_DIR/operators/<key>/): Inductor's generated C++ calls an operator through the dispatcher, and a kernel
registered from Python turns each call into a trip through the interpreter, about 20 us, for 61 calls a gpt2 step.
The C++ kernel calls the very C functions gemv.py built, checked and tuned (`prepare` binds them before each compiled
step), and is held to them bit for bit on first load; its GEMV reads a matrix as gemv.between_calls says a call
between other kernels should. Until it loads, and wherever it cannot be built (no C++
compiler, no torch headers, a build that fails), the kernels are the Python ones below; `unavailable()` says why.

    operator                         kernel                 what it computes
    kvbench::gemv(x, W, b)           gemv.c kv_gemv_f32     x (..., in) one row, W (out, in), b (out,) or None
    kvbench::decode_attention(...)   gemv.c kv_attend_f32   q (B, H, 1, Dh) over K, V (B, H, L, Dh), allowed (B, 1, 1, L)
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, cast

import torch

from kvbench.cachedir import cache_root
from kvbench.model import gemv
from kvbench.model.native import compile_library

SOURCE = Path(__file__).with_name("operators.cpp")
FLAGS = ("-O2", "-std=c++20", "-fPIC", "-shared", "-w")  # -w: torch's headers warn by the screenful under some g++

_defs = torch.library.Library("kvbench", "FRAGMENT")
_defs.define("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_defs.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor allowed) -> Tensor")
_python_calls = {"gemv": 0, "decode_attention": 0}  # calls the Python kernels ran in this process
_checked = {"gemv": 0, "decode_attention": 0}  # calls the C++ kernels ran for their own check (`_agrees`)


@torch.library.register_fake("kvbench::gemv", lib=_defs)
def _gemv_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.size(0)))


@torch.library.register_fake("kvbench::decode_attention", lib=_defs)
def _attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)  # (B, H, 1, Dh), contiguous


def _gemv_python(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = gemv.library()
    assert kernel is not None, "model/matmul.py calls the operator only where the kernel was built"
    _python_calls["gemv"] += 1
    rows, prefetch = kernel.between  # as a call between other kernels reads (gemv.between_calls)
    return gemv.gemv(x, weight, bias, dataclasses.replace(kernel, rows=rows, prefetch=prefetch))


def _attention_python(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    _python_calls["decode_attention"] += 1
    return gemv.attend(q, k, v, allowed)


def _python_kernels() -> torch.library.Library:
    """The Python CPU kernels, registered; they stay while the returned Library lives."""
    lib = torch.library.Library("kvbench", "IMPL", "CPU")
    lib.impl("gemv", _gemv_python)
    lib.impl("decode_attention", _attention_python)
    return lib


_python: torch.library.Library | None = _python_kernels()


def compiler() -> str | None:
    """The C++ compiler: $CXX, else c++ or g++ on PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _torch_flags() -> list[str]:
    """What a file using torch's C++ API compiles and links with: torch's headers, its ABI, its libraries."""
    from torch.utils import cpp_extension  # here: it imports setuptools, which only this build needs

    abi = int(torch.compiled_with_cxx11_abi())
    libs = cpp_extension.library_paths()
    return [
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
    ]


def build(cxx: str | None, root: Path) -> tuple[Path | None, str]:
    """Compile operators.cpp with `cxx` under `root` (once per source, compiler and torch): (the library, "") or
    (None, why not, in one line)."""
    if not cxx:
        return None, "no C++ compiler ($CXX, c++ or g++) on PATH"
    torch_flags = _torch_flags()
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, *FLAGS, *torch_flags, torch.__version__]).encode())
    out = root / "operators" / key.hexdigest()[:20] / "libkvops.so"
    if out.is_file():
        return out, ""
    why = compile_library(cxx, SOURCE, out, FLAGS, [*torch_flags, "-lc10", "-ltorch_cpu"], timeout=300)
    return (None, why) if why else (out, "")


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    """(the C++ kernels' library, loaded in place of the Python kernels, or None; why not), once per process. The
    library's kernels answer every later call of the operators in this process: they cannot be unloaded."""
    global _python
    kernel = gemv.library()
    if kernel is None or kernel.attend_fn is None:
        return None, f"kvbench's C kernels are not built: {gemv.unavailable()}"
    path, why = build(compiler(), cache_root())
    if path is None:
        return None, why
    assert _python is not None
    _python._destroy()  # first: loading registers the C++ kernels, which must not override (and warn about) these
    lib, why = _open(path)
    if lib is None:  # a cached library damaged since it was written: built again, once
        path.unlink(missing_ok=True)
        path, why = build(compiler(), cache_root())
        lib, why = (None, why) if path is None else _open(path)
    if lib is None:
        _python = _python_kernels()
        return None, why
    _bind(lib, kernel)
    agrees = _agrees(kernel)
    _checked.update(gemv=lib.kv_gemv_calls(), decode_attention=lib.kv_attend_calls())
    if not agrees:
        return lib, f"{path}'s kernels disagree with gemv.py's calls of the same C: not used"
    return lib, ""


def _open(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """Load the library at `path` (registering its kernels with the dispatcher) and type its two functions: (it, "")
    or (None, why not)."""
    try:
        torch.ops.load_library(str(path))
        lib = ctypes.CDLL(str(path))
        lib.kv_bind.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
        lib.kv_bind.restype = None
        lib.kv_gemv_calls.restype = lib.kv_attend_calls.restype = ctypes.c_long
    except (OSError, AttributeError) as e:
        return None, f"{path} was built but does not load: {e}"
    return lib, ""


def _bind(lib: ctypes.CDLL, kernel: gemv.Kernel) -> None:
    """Point the C++ kernels at `kernel`'s C functions and its way of reading rows between other kernels (once per
    kernel: each compiled step asks, and a ctypes call costs ~0.07 ms after a step's reads have gone through the
    caches)."""
    global _bound
    if _bound is not None and _bound[0] is lib and _bound[1] is kernel:
        return
    gemv_fn, attend_fn = cast(Any, kernel.fn), cast(Any, kernel.attend_fn)  # ctypes functions (gemv._load)
    address, attend = (ctypes.cast(f, ctypes.c_void_p).value for f in (gemv_fn, attend_fn))
    lib.kv_bind(address, attend, *kernel.between)
    _bound = (lib, kernel)


_bound: tuple[ctypes.CDLL, gemv.Kernel] | None = None  # the library bound last, and to which kernel


def _agrees(kernel: gemv.Kernel) -> bool:
    """The operators, through the dispatcher, against `kernel`'s C functions called directly: bit for bit (how a
    GEMV reads its rows does not change its bits). Directly, not through gemv.gemv and gemv.attend: whatever stands
    in for those when the kernels first load (a test's stand-in) is not what the C++ kernels call."""
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(131, generator=g), torch.randn(37, 131, generator=g), torch.randn(37, generator=g)
    q, k, v = (torch.randn(2, 3, n, 64, generator=g) for n in (1, 7, 7))  # (B, H, 1 or L, Dh)
    allowed = torch.tensor([[True] * 5 + [False] * 2, [False] * 2 + [True] * 4 + [False]]).view(2, 1, 1, 7)
    threads = torch.get_num_threads()
    same = []
    with torch.no_grad():
        for bias in (b, None):
            y = torch.empty(37)
            kernel(
                w.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), 37, 131, threads
            )
            same.append((torch.ops.kvbench.gemv(x.view(1, 1, 131), w, bias), y.view(1, 1, 37)))
        out, scratch = torch.empty(2, 3, 1, 64), torch.empty(2 * 3 * 7)
        assert kernel.attend_fn is not None  # _loaded checks before it loads the library
        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), allowed.data_ptr(), out.data_ptr(), 2, 3, 7, 64)
        kernel.attend_fn(*args, scratch.data_ptr(), threads)
        same.append((torch.ops.kvbench.decode_attention(q, k, v, allowed), out))
    return all(a.shape == b_.shape and torch.equal(a, b_) for a, b_ in same)


def prepare() -> bool:
    """Before a compiled step runs (outside its trace): whether it may call the operators. Loads the C++ kernels
    on first use where they build, and binds them to the kernel gemv.py has now; False where they loaded but
    disagreed with it (the step then runs without the operators). The Python kernels need nothing."""
    lib, why = _loaded()
    if lib is None:
        return True
    if why:
        return False
    kernel = gemv.library()
    if kernel is not None and kernel.attend_fn is not None:
        _bind(lib, kernel)
    return True


def way() -> tuple[int, int] | None:
    """(rows, prefetch): how the operators' GEMV reads a matrix (gemv.between_calls), where the kernel is built."""
    kernel = gemv.library()
    return None if kernel is None else kernel.between


def kernels() -> str | None:
    """What answers the operators' calls in this process: "c++", "python", or "none" (the C++ kernels loaded but
    disagreed with gemv.py's: compiled steps do not call the operators); None before any `prepare`."""
    if not _loaded.cache_info().currsize:
        return None
    lib, why = _loaded()
    return "python" if lib is None else "none" if why else "c++"


def unavailable() -> str | None:
    """Why the operators' kernels are not the C++ ones, where they are not (loading them if not tried yet: on a
    machine's first use, seconds of a C++ build)."""
    lib, why = _loaded()
    return why or None


def calls(name: str) -> int:
    """Calls of the operator `name` ("gemv" or "decode_attention") run in this process, in either kernel (bench
    reports which attention a compiled step ran: calls inside compiled code are invisible to a TorchFunctionMode)."""
    lib, why = _loaded() if _loaded.cache_info().currsize else (None, "")
    if lib is None:
        return _python_calls[name]
    ran = lib.kv_gemv_calls() if name == "gemv" else lib.kv_attend_calls()
    return _python_calls[name] + ran - _checked[name]
