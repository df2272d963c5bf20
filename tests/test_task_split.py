"""Idle native workers help with the last, large tasks of a step (the split described in
`hybrid_runtime/native_pool.py`): the split runs, and its output equals dense attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_runtime.config import config_from_dict
from hybrid_runtime.native_pool import MIN_PART_BYTES
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.runtime import HybridRuntime
from tests.helpers import random_kv

GEOM = {"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 64}


def split_config(placement: str, dtype: str) -> dict:
    return config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 16384, "max_sequences": 3,
                     "dtype": dtype},
        "selection": {"name": "full", "block_size": 16},
        "scheduler": {"placement": placement, "cpu_workers": 3, "gpu_worker": True, "step_timeout_s": 60.0,
                      "spin_us": 0},
    })


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("placement", ["cpu_only", "fluxion"])
def test_split_tasks_equal_dense_attention(placement, dtype):
    # 2 sequences x 2 KV groups = 4 tasks for 3 workers: every task is popped with fewer positions
    # left than workers, and at budget 1.0 each reads far more than two ranges' worth.
    lengths = [5000, 3100]
    d = GEOM["head_dim"]
    assert min(lengths) * 2 * d * 2 >= 2 * MIN_PART_BYTES
    with HybridRuntime(split_config(placement, dtype)) as rt:
        for s, n in enumerate(lengths):
            rt.prefill(s, 0, *random_kv(n, GEOM["kv_heads"], d, seed=s))
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            q = torch.randn(len(lengths), GEOM["q_heads"], d, generator=gen)
            k = torch.randn(len(lengths), GEOM["kv_heads"], d, generator=gen)
            v = torch.randn(len(lengths), GEOM["kv_heads"], d, generator=gen)
            out = rt.decode(0, [0, 1], q, k, v)
            for b in range(len(lengths)):
                kk, vv = rt.store.full_kv(b, 0)
                ref, _ = dense_attention(q[b], kk, vv)
                tol = dict(atol=3e-5, rtol=1e-4) if dtype == "fp32" else dict(atol=2e-3, rtol=2e-3)
                torch.testing.assert_close(out[b], ref.to(out.dtype), **tol)
        stats = rt.stats()
    assert stats["cpu_workers_native"]
    assert stats["cpu_split_tasks"] > 0, "no task was split: the test no longer covers the split path"


def test_split_is_off_for_an_injected_kernel():
    """A kernel given to the runtime always runs whole (the split runs the stock kernel's halves)."""
    from cpu_kernels.sparse_attention import run_task

    with HybridRuntime(split_config("cpu_only", "fp32"), cpu_kernel=run_task) as rt:
        rt.prefill(0, 0, *random_kv(5000, GEOM["kv_heads"], GEOM["head_dim"], seed=0))
        q = torch.randn(1, GEOM["q_heads"], GEOM["head_dim"])
        kv = torch.randn(1, GEOM["kv_heads"], GEOM["head_dim"])
        out = rt.decode(0, [0], q, kv, kv)
        kk, vv = rt.store.full_kv(0, 0)
        torch.testing.assert_close(out[0], dense_attention(q[0], kk, vv)[0], atol=3e-5, rtol=1e-4)
        assert rt.stats()["cpu_split_tasks"] == 0
