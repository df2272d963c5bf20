"""The host window kernels (`cpu_kernels/window_attention.py`) against their torch references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_kernels.window_attention import merge_into, window_attention
from hybrid_runtime.kvcache import numpy_view
from hybrid_runtime.reference import merge_attention
from hybrid_runtime.runtime import window_attention_torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hkv,g,d", [(3, 3, 64), (2, 4, 32), (1, 1, 48)])
def test_window_attention_equals_the_torch_reference(dtype, hkv, g, d):
    gen = torch.Generator().manual_seed(hkv * 100 + g * 10 + d)
    slots_total, width = 4, 90
    win_k = torch.randn(slots_total, hkv, width, d, generator=gen).to(dtype)
    win_v = torch.randn(slots_total, hkv, width, d, generator=gen).to(dtype)
    q = torch.randn(3, hkv * g, d, generator=gen) * d**-0.5
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    lengths = torch.tensor([37, 0, width], dtype=torch.int32)  # partial, empty, full
    ref_out, ref_lse = window_attention_torch(q, win_k, win_v, slots, lengths, width)
    out = torch.full_like(ref_out, 7.0)  # stale values must be overwritten
    lse = torch.full_like(ref_lse, 7.0)
    scratch = np.empty((g, width), dtype=np.float32)
    window_attention(q.numpy(), numpy_view(win_k), numpy_view(win_v), slots.numpy(), lengths.numpy(), out.numpy(), lse.numpy(),
                     scratch)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.isinf(lse[1]).all() and (out[1] == 0).all()  # the empty window: no contribution
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)


def test_merge_into_equals_the_reference_merge_and_keeps_empty_parts_out():
    gen = torch.Generator().manual_seed(0)
    out_a, out_b = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen)
    lse_a, lse_b = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    lse_a[1] = float("-inf")  # only b
    lse_b[2] = float("-inf")  # only a
    lse_a[3] = lse_b[3] = float("-inf")  # neither
    ref_out, ref_lse = merge_attention(out_a, lse_a, out_b, lse_b)
    result, merged_lse = torch.empty_like(out_a), lse_a.clone()
    merge_into(out_a.numpy(), merged_lse.numpy(), out_b.numpy(), lse_b.numpy(), result.numpy())
    torch.testing.assert_close(result, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merged_lse, ref_lse, atol=1e-6, rtol=1e-6)
    assert (result[3] == 0).all() and torch.isinf(merged_lse[3])
    # In place (`result` is `out_a`), as the runtime merges.
    a = out_a.clone()
    merge_into(a.numpy(), lse_a.clone().numpy(), out_b.numpy(), lse_b.numpy(), a.numpy())
    torch.testing.assert_close(a, ref_out, atol=1e-6, rtol=1e-6)
