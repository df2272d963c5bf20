"""The window part of a decode step replayed from CUDA graphs (`kv_cache.window_graphs`).

On the host: `KVStore.advance`, the bookkeeping half of an append that the graphs use. On CUDA
(`gpu` marker): a runtime replaying the graphs against one launching kernel by kernel, fed the
same inputs -- batch sizes changing, spills (which take the eager path), sequences prefilled
between steps -- and the caller's output never aliasing a graph's buffer.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_runtime.config import config_from_dict
from hybrid_runtime.kvcache import KVStore
from tests.helpers import random_kv


def _store(generated_cap: int = 16) -> KVStore:
    cfg = config_from_dict({
        "geometry": {"layers": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 16},
        "kv_cache": {"sink": 4, "local": 16, "generated_cap": generated_cap, "cpu_capacity_tokens": 4096,
                     "max_sequences": 3, "device": "cpu"},
    })
    return KVStore(cfg.kv_cache, cfg.geometry)


def test_advance_counts_a_token_into_the_windows_and_returns_slots_and_rows():
    store = _store()
    try:
        for s, n in enumerate([40, 100]):
            store.prefill(s, 1, *random_kv(n, 2, 16, seed=s))
        before = [store.window_len(s, 1) for s in (1, 0)]
        slots, rows = store.advance(1, [1, 0])
        assert slots == [store.slot(1), store.slot(0)] and rows == before
        assert [store.window_len(s, 1) for s in (1, 0)] == [n + 1 for n in before]
        assert store.cpu_len(0, 1) == 40 - 20 and store.cpu_len(1, 1) == 100 - 20  # nothing spilled
    finally:
        store.close()


def test_advance_refuses_repeats_and_a_due_spill_before_changing_anything():
    store = _store(generated_cap=16)
    try:
        store.prefill(0, 0, *random_kv(60, 2, 16, seed=0))
        with pytest.raises(ValueError, match="repeat"):
            store.advance(0, [0, 0])
        for _ in range(16):  # the generated cap fills up
            store.advance(0, [0])
        n = store.window_len(0, 0)
        assert store.will_spill(0, [0])
        with pytest.raises(ValueError, match="spills"):
            store.advance(0, [0])
        assert store.window_len(0, 0) == n
    finally:
        store.close()


# ---------------------------------------------------------------------------- the runtime on CUDA
def _runtime(graphs: bool, placement: str = "fluxion"):
    from hybrid_runtime.runtime import HybridRuntime

    return HybridRuntime(config_from_dict({
        "geometry": {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 64},
        "kv_cache": {"sink": 16, "local": 64, "generated_cap": 32, "cpu_capacity_tokens": 40000,
                     "max_sequences": 4, "window_graphs": graphs},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.25},
        "scheduler": {"placement": placement, "cpu_workers": 2, "gc_freeze": False},
        "profiling": {"enabled": False},
    }))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["fluxion", "cpu_only"])
def test_replayed_window_parts_give_the_eager_output(placement):
    """Steps of batch 3, then 2, then 3 again (a graph per (layer, batch size), reused), past the
    generated cap (spills: eager appends), a fourth sequence prefilled midway; every output equal
    to a runtime launching the window part kernel by kernel."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    steps = []
    for i in range(60):
        ids = [0, 1, 2] if i < 20 or i >= 40 else [1, 3]
        b = len(ids)
        steps.append((ids, torch.randn(b, 8, 64, generator=gen, device="cuda"),
                      torch.randn(b, 2, 64, generator=gen, device="cuda"),
                      torch.randn(b, 2, 64, generator=gen, device="cuda")))
    outs = {}
    for graphs in (True, False):
        rt = _runtime(graphs, placement)
        try:
            for s, n in enumerate([5000, 3000, 200]):
                for layer in range(2):
                    rt.prefill(s, layer, *(x.cuda() for x in random_kv(n, 2, 64, seed=10 * s + layer)))
            got = []
            for i, (ids, q, k, v) in enumerate(steps):
                if i == 20:
                    for layer in range(2):
                        rt.prefill(3, layer, *(x.cuda() for x in random_kv(4000, 2, 64, seed=70 + layer)))
                for layer in range(2):
                    got.append(rt.decode(layer, ids, q, k, v))
            st = rt.stats()
            if graphs:
                # Graphs of (layer, batch 3) and (layer, batch 2): replayed on every later step
                # without a spill (120 layer-steps, a few of them with one).
                assert st["window_graph_captures"] == 4 and st["window_graph_replays"] >= 100, st
            else:
                assert st["window_graph_captures"] == 0 and st["window_graph_replays"] == 0
            outs[graphs] = got
        finally:
            rt.close()
    # The same kernels; the split grid differs (sized for the full window), so rounding may.
    # fluxion: the lanes split each step anew, and which lane ran a task may change a tie in block
    # selection (see test_cpu_lane_trails).
    tol = 1e-4 if placement == "cpu_only" else 2e-2
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_an_output_without_cpu_parts_is_the_callers_own_tensor():
    """Sequences short enough to have no CPU-resident tokens make no tasks: the step's output is
    the window's alone, which a graph rewrites next step; the caller's tensor must not change."""
    rt = _runtime(True)
    try:
        for s in range(2):
            rt.prefill(s, 0, *(x.cuda() for x in random_kv(40, 2, 64, seed=s)))
        gen = torch.Generator(device="cuda").manual_seed(1)
        firsts = []
        for _ in range(3):
            q = torch.randn(2, 8, 64, generator=gen, device="cuda")
            k, v = (torch.randn(2, 2, 64, generator=gen, device="cuda") for _ in range(2))
            out = rt.decode(0, [0, 1], q, k, v)
            firsts.append((out, out.clone()))
        assert rt.stats()["window_graph_replays"] >= 1
        for out, kept in firsts:
            torch.testing.assert_close(out, kept, atol=0, rtol=0)
        assert len({out.data_ptr() for out, _ in firsts}) == 3
    finally:
        rt.close()


@pytest.mark.gpu
def test_a_caller_handing_the_same_k_v_gets_a_graph_reading_them_in_place():
    """A model's decode graph writes k, v into the same tensors every step: once handed twice in a
    row (contiguous, in the window's dtype), the window part replays a graph that reads them where
    they are (no staging copies). Outputs equal a runtime launching kernel by kernel, also when the
    caller switches to other tensors midway (copied again, then read in place again) and when the
    tensors are in another dtype (always copied)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    steps = []
    for i in range(30):
        steps.append((torch.randn(3, 8, 64, generator=gen, device="cuda"),
                      torch.randn(3, 2, 64, generator=gen, device="cuda"),
                      torch.randn(3, 2, 64, generator=gen, device="cuda")))
    outs, direct = {}, {}
    for graphs in (True, False):
        rt = _runtime(graphs, "cpu_only")
        dtype = rt.store.window(0)[0].dtype
        assert dtype == torch.bfloat16  # the config's default: the steps' fp32 k, v are another dtype
        static = [(torch.empty(3, 2, 64, dtype=dtype, device="cuda"), torch.empty(3, 2, 64, dtype=dtype, device="cuda"))
                  for _ in range(2)]
        try:
            for s, n in enumerate([5000, 3000, 200]):
                for layer in range(2):
                    rt.prefill(s, layer, *(x.cuda() for x in random_kv(n, 2, 64, seed=10 * s + layer)))
            got = []
            for i, (q, k, v) in enumerate(steps):
                for layer in range(2):
                    if i >= 25:  # fp32 beside a bf16 window: copied (and converted) every step
                        kk, vv = k, v
                    else:
                        kk, vv = static[0 if i < 12 else 1]  # the caller's buffers, switched at step 12
                        kk.copy_(k)
                        vv.copy_(v)
                    got.append(rt.decode(layer, [0, 1, 2], q, kk, vv))
            outs[graphs] = got
            direct[graphs] = rt.stats()["window_graph_direct_captures"]
        finally:
            rt.close()
    # Per layer: one graph for the first buffers (captured at their second step), one for the second (at step 13).
    assert direct == {True: 4, False: 0}
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
