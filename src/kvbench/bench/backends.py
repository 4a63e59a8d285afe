"""Which attention kernel PyTorch's SDPA actually picks, and the library versions that decide it.

`F.scaled_dot_product_attention` chooses a backend per call from the inputs (dtype, shapes, mask, causal flag) and
what is enabled: flash, memory-efficient, cuDNN, or the math fallback. The choice changes cold timings (cuDNN builds
a plan per new shape) and warm ones, so bench records it. `watch_sdpa` runs a function under a `TorchFunctionMode`
that sees every SDPA call, asks PyTorch's own selector (`torch._fused_sdp_choice`, the function SDPA dispatches
through) which backend those exact arguments get, and returns the backends seen per phase: the prefill's forward
(the first call of each layer) and the decode steps after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

_NAMES = {
    "MATH": "math",
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "efficient",
    "CUDNN_ATTENTION": "cudnn",
    "OVERRIDEABLE": "overrideable",
    "ERROR": "none-fits",
}


def sdpa_settings() -> dict:
    """The SDPA backends enabled in this process and the cuDNN version (None without cuDNN)."""
    cuda = torch.backends.cuda
    enabled = {}
    for name, fn in (
        ("flash", "flash_sdp_enabled"),
        ("efficient", "mem_efficient_sdp_enabled"),
        ("cudnn", "cudnn_sdp_enabled"),
        ("math", "math_sdp_enabled"),
    ):
        getter = getattr(cuda, fn, None)
        enabled[name] = bool(getter()) if getter is not None else None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"enabled": enabled, "cudnn_version": cudnn}


def _choice(args: tuple, kwargs: dict) -> str:
    """The backend PyTorch's SDPA selector picks for these arguments."""
    chooser = getattr(torch, "_fused_sdp_choice", None)
    if chooser is None:
        return "unknown"
    q = args[0]
    try:
        code = chooser(*args, **kwargs)
        name = _NAMES.get(SDPBackend(code).name, SDPBackend(code).name.lower())
    except (TypeError, RuntimeError, ValueError):
        return "unknown"
    return f"{name} (cpu)" if q.device.type == "cpu" and name == "flash" else name


KVBENCH_C = "kvbench C (cpu)"  # attention in kvbench's fused block call, not SDPA


class _SDPAWatch(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []  # the backend of every SDPA call, in order

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append(_choice(args, kwargs))
        return func(*args, **kwargs)


def c_attention_calls() -> int:
    """One-query attentions kvbench's C has run in this process: a compiled step's `kvbench::decode_attention`
    (model/operators.py), which `watch_sdpa` cannot see. Read before and after timed runs."""
    from kvbench.model import operators

    return operators.calls("decode_attention")


def watch_sdpa(fn: Callable[[], object], prefill_calls: int, compiled_in_c: bool = False) -> dict[str, str]:
    """Run `fn` (a generation) and return {"prefill": backends, "decode": backends}: the first `prefill_calls` SDPA
    calls (one per layer: the prefill's forward) and the rest, each a '+'-joined sorted list ('' if none). Run it
    eagerly: calls replayed from a CUDA graph or made inside compiled code are not seen. A decode step whose blocks
    ran as one C call (model/gemv.py's step_static: its attention is kvbench's own) adds KVBENCH_C; where the timed
    runs' compiled decode steps ran kvbench's attention (`compiled_in_c`, from `c_attention_calls`), decode is
    KVBENCH_C alone, whatever the eager probe saw."""
    from kvbench.model import gemv

    before = gemv.step_calls
    with _SDPAWatch() as watch:
        fn()
    split = {"prefill": watch.calls[:prefill_calls], "decode": watch.calls[prefill_calls:]}
    if gemv.step_calls > before:  # one-row steps only: never a prefill's
        split["decode"].append(KVBENCH_C)
    if compiled_in_c:
        split["decode"] = [KVBENCH_C]
    return {phase: "+".join(sorted(set(names))) for phase, names in split.items()}
