"""kvbench's one-query attention (gemv.c's kv_attend_f32, model/attention.py): SDPA's answer for a boolean mask,
held to float64 SDPA, and used only where `--compile max` traces a CPU decode step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbench.model import attention, gemv

needs_gemv = pytest.mark.skipif(
    gemv.library() is None, reason=f"kvbench's C kernels cannot be built: {gemv.unavailable()}"
)


def _masks(L: int) -> torch.Tensor:
    """(4, 1, 1, L) rows: every slot up to L - 3; left padding (slots 3 to L - 2); holes (every third slot off, as
    an evicting or windowed rule leaves them); the last slot alone."""
    cols = torch.arange(L)
    rows = [cols <= L - 3, (cols >= 3) & (cols <= L - 2), (cols % 3 != 1) & (cols < L - 1), cols == L - 1]
    return torch.stack(rows).view(4, 1, 1, L)


@needs_gemv
@pytest.mark.parametrize("H, L, Dh", [(3, 43, 64), (4, 9, 12), (2, 130, 80)])
def test_the_c_attention_against_float64_sdpa_the_same_at_any_thread_count(H, L, Dh):
    """Heads of 64 (their own copy in the C code) and others, slot counts off the vector widths, every kind of
    mask row; stale values past each row's last slot are never read (NaN there changes nothing)."""
    g = torch.Generator().manual_seed(0)
    allowed = _masks(L)
    q, k, v = (torch.randn(4, H, n, Dh, generator=g) for n in (1, L, L))
    k[~allowed.view(4, 1, L, 1).expand_as(k)] = float("nan")  # a slot a row may not see: never in its result
    v[~allowed.view(4, 1, L, 1).expand_as(v)] = float("nan")
    ref = F.scaled_dot_product_attention(
        q.double(), k.nan_to_num().double(), v.nan_to_num().double(), attn_mask=allowed
    )
    before, got = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append(gemv.attend(q, k, v, allowed))
    finally:
        torch.set_num_threads(before)
    assert got[0].shape == (4, H, 1, Dh)
    assert (got[0].double() - ref).abs().max() < 1e-6
    assert all(torch.equal(got[0], other) for other in got[1:])  # bit for bit


@needs_gemv
def test_a_row_that_may_see_no_slot_gets_what_sdpa_gives():
    """A softmax over no slot: torch's CPU SDPA answers zeros (torch 2.13), and so does the kernel."""
    q, k, v = torch.randn(2, 2, 1, 64), torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64)
    allowed = torch.tensor([[True, True, False, False, False], [False] * 5]).view(2, 1, 1, 5)
    got, ref = gemv.attend(q, k, v, allowed), F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, equal_nan=True)


@needs_gemv
def test_attention_is_sdpa_outside_a_compiled_step(monkeypatch):
    """Eager, even inside `own_attention` (as `--compile max` runs a step that was not compiled), and wherever the
    kernel is not built: SDPA, with the kvbench operator never called."""
    calls = []
    monkeypatch.setattr(gemv, "attend", lambda *a: calls.append(1))
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    allowed = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    with attention.own_attention():
        y = attention.attention(q, k, v, allowed, False)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
    monkeypatch.setattr(gemv, "library", lambda: None)
    with attention.own_attention():
        assert attention._own is False
    assert not calls


@needs_gemv
def test_the_operator_runs_the_kernel_and_states_its_shape():
    """`kvbench::decode_attention` as Inductor calls it: the C kernel on real tensors, SDPA's output shape on fake
    ones (what tracing sees)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = torch.randn(2, 3, 1, 64), torch.randn(2, 3, 7, 64), torch.randn(2, 3, 7, 64)
    allowed = _masks(7)[:2].contiguous()
    got = torch.ops.kvbench.decode_attention(q, k, v, allowed)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), rtol=1e-5, atol=1e-6)
    with FakeTensorMode() as mode:
        fake = torch.ops.kvbench.decode_attention(*(mode.from_tensor(t) for t in (q, k, v, allowed)))
    assert fake.shape == (2, 3, 1, 64) and fake.is_contiguous()
