"""The GPU window's append kernel against `index_put_` (under Triton's interpreter without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from gpu_kernels.window_append import append_window  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def reference(win_k, win_v, k, v, index):
    rk, rv = win_k.clone(), win_v.clone()
    rk[index[0], :, index[1]] = k.to(rk.dtype)
    rv[index[0], :, index[1]] = v.to(rv.dtype)
    return rk, rv


@pytest.mark.parametrize("win_dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.float16)])
def test_append_writes_each_sequences_row(win_dtype, kv_dtype):
    g = torch.Generator().manual_seed(0)
    slots, hkv, w, d, b = 5, 3, 40, 16, 3
    win_k = torch.randn((slots, hkv, w, d), generator=g).to(win_dtype).to(DEV)
    win_v = torch.randn((slots, hkv, w, d), generator=g).to(win_dtype).to(DEV)
    # k and v as strided slices of a fused projection (batch and head strides are not packed).
    fused = torch.randn((b, 2, hkv, d), generator=g).to(kv_dtype).to(DEV)
    k, v = fused[:, 0], fused[:, 1]
    index = torch.tensor([[4, 0, 2], [39, 7, 0]], dtype=torch.long, device=DEV)
    rk, rv = reference(win_k, win_v, k, v, index)
    append_window(win_k, win_v, k, v, index)
    if win_dtype == kv_dtype:
        assert torch.equal(win_k, rk) and torch.equal(win_v, rv)
    else:  # a conversion in the kernel: one rounding step of the window's dtype at most
        eps = torch.finfo(win_dtype).eps
        for got, want in ((win_k, rk), (win_v, rv)):
            assert torch.allclose(got.float(), want.float(), rtol=eps, atol=0)


def test_append_of_an_empty_batch_changes_nothing():
    win = torch.zeros((2, 1, 8, 16), device=DEV)
    e = torch.zeros((0, 1, 16), device=DEV)
    append_window(win, win.clone(), e, e, torch.zeros((2, 0), dtype=torch.long, device=DEV))
    assert not win.any()


def test_append_rejects_bad_arguments():
    win = torch.zeros((2, 2, 8, 16), device=DEV)
    k = torch.zeros((1, 2, 16), device=DEV)
    idx = torch.zeros((2, 1), dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="k has shape"):
        append_window(win, win.clone(), torch.zeros((1, 3, 16), device=DEV), k, idx)
    with pytest.raises(ValueError, match="index has dtype"):
        append_window(win, win.clone(), k, k, idx.float())
    with pytest.raises(ValueError, match="win_v has dtype"):
        append_window(win, win.to(torch.bfloat16), k, k, idx)
    with pytest.raises(ValueError, match="unit stride"):
        append_window(win, win.clone(), k, torch.zeros((1, 2, 32), device=DEV)[..., ::2], idx)
