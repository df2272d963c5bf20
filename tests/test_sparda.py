"""The SparDA executor through the runtime: selection one layer ahead, block cache, prefetch, config."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from cpu_kernels import layout
from forecast.grid import cell_counts, cell_means, group_block_scores, top_blocks
from hybrid_runtime.config import ConfigError, config_from_dict
from hybrid_runtime.reference import dense_attention, merge_attention
from hybrid_runtime.runtime import HybridRuntime
from tests.helpers import random_kv, reversed_interpreter_grid
from tests.test_deferred_input_check import with_finite_check

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GEOM = {"layers": 3, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
TOL = dict(atol=2e-3, rtol=2e-3) if torch.cuda.is_available() else dict(atol=3e-5, rtol=1e-4)
LENGTHS = [300, 700]
# Programs of a launch in the interpreter's order, or last first (`reversed_interpreter_grid`): a
# kernel whose result depends on the order its programs run in differs between the two.
GRID_ORDERS = ["in_order", pytest.param("reversed", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="reorders the Triton interpreter's programs; compiled kernels run in any order"))]


def sparda_config(lookahead="proxy", top_k=8, block_size=32, dtype="fp32", **sp):
    return config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 3,
                     "dtype": dtype},
        "selection": {"name": "sparda"},
        "sparda": {"lookahead": lookahead, "top_k": top_k, "block_size": block_size, **sp},
        # No scheduler section: the SparDA executor reads the CPU segment alone and no lane starts.
    })


def prefill(rt, lengths=LENGTHS):
    for s, n in enumerate(lengths):
        for layer in range(GEOM["layers"]):
            rt.prefill(s, layer, *random_kv(n, GEOM["kv_heads"], GEOM["head_dim"], seed=10 * s + layer))


def dense_reference(rt, layer, seq_ids, q):
    return torch.stack([dense_attention(q[b].float(), *rt.store.full_kv(s, layer))[0] for b, s in enumerate(seq_ids)])


def selected_reference(rt, layer, seq_ids, q, blocks):
    """Window dense + each KV group's blocks `blocks[b][h]` of the CPU segment (all its heads)."""
    store, blk = rt.store, rt.cfg.sparda.block_size
    g, sink = store.geometry.group_size, store.cfg.sink
    outs = []
    for b, s in enumerate(seq_ids):
        k, v = store.full_kv(s, layer)
        n = store.cpu_len(s, layer)
        keep = torch.cat([torch.arange(min(sink, k.shape[0])), torch.arange(sink + n, k.shape[0])])
        o_w, l_w = dense_attention(q[b].float(), k[keep], v[keep])
        o_c, l_c = torch.zeros_like(o_w), torch.full_like(l_w, float("-inf"))
        for h in range(store.kv_heads):
            tok = torch.cat([torch.arange(x * blk, min((x + 1) * blk, n)) for x in blocks[b][h]]) + sink
            if tok.numel():
                oc, lc = dense_attention(q[b, h * g : (h + 1) * g].float(), k[tok, h : h + 1], v[tok, h : h + 1])
                o_c[h * g : (h + 1) * g], l_c[h * g : (h + 1) * g] = oc, lc
        outs.append(merge_attention(o_w, l_w, o_c, l_c)[0])
    return torch.stack(outs)


def expected_blocks(rt, layer, seq_ids, queries):
    """Each group's top-k blocks by the module's own definition, from the store's keys."""
    store, sp = rt.store, rt.cfg.sparda
    out = []
    for b, s in enumerate(seq_ids):
        n = store.cpu_len(s, layer)
        keys = store.full_kv(s, layer)[0][store.cfg.sink : store.cfg.sink + n].transpose(0, 1)  # [Hkv, n, D]
        cells = cell_means(keys)
        sc = group_block_scores(queries[b], cells, cell_counts(n, cells.shape[-2]), sp.block_size, n)
        out.append([sorted(top_blocks(sc[h], sp.top_k)[0].tolist()) for h in range(store.kv_heads)])
    return out


# ---------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("lookahead", ["same_layer", "proxy", "forecast_shaped"])
def test_top_k_covering_every_block_gives_dense_attention(lookahead):
    mode = "proxy" if lookahead == "forecast_shaped" else lookahead
    heads = GEOM["kv_heads"] if lookahead == "forecast_shaped" else GEOM["q_heads"]
    with HybridRuntime(sparda_config(mode, top_k=64)) as rt:
        prefill(rt)
        gen = torch.Generator().manual_seed(1)
        seq_ids = [1, 0]
        for step in range(20):  # generated_cap 16: the window spills every 16 steps
            for layer in range(GEOM["layers"]):
                q = torch.randn(2, 8, 32, generator=gen)
                k, v = torch.randn(2, 2, 32, generator=gen), torch.randn(2, 2, 32, generator=gen)
                look = None
                if mode != "same_layer" and layer + 1 < GEOM["layers"]:
                    look = torch.randn(2, heads, 32, generator=gen)
                out = rt.decode(layer, seq_ids, q, k, v, lookahead=look)
                torch.testing.assert_close(out, dense_reference(rt, layer, seq_ids, q), **TOL)
        st = rt.stats()
        if mode == "same_layer":
            assert st["sparda_prefetched_steps"] == 0 and st["sparda_synchronous_steps"] == 20 * 3
        else:
            assert st["sparda_prefetched_steps"] == 20 * 2 and st["sparda_synchronous_steps"] == 20
            assert st["sparda_spill_reselections"] >= 1  # a spill between a prefetch and its attention


def test_small_top_k_attends_the_window_and_exactly_the_forecast_blocks():
    with HybridRuntime(sparda_config("proxy", top_k=3)) as rt:
        prefill(rt)
        gen = torch.Generator().manual_seed(2)
        seq_ids = [0, 1]
        look = torch.randn(2, 2, 32, generator=gen)
        q0 = torch.randn(2, 8, 32, generator=gen)
        rt.decode(0, seq_ids, q0, torch.randn(2, 2, 32), torch.randn(2, 2, 32), lookahead=look)
        want = expected_blocks(rt, 1, seq_ids, look)
        q1 = torch.randn(2, 8, 32, generator=gen)
        out = rt.decode(1, seq_ids, q1, torch.randn(2, 2, 32), torch.randn(2, 2, 32))
        torch.testing.assert_close(out, selected_reference(rt, 1, seq_ids, q1, want), **TOL)


def test_prefetched_buffers_equal_a_synchronous_gather_and_hits_fetch_nothing():
    with HybridRuntime(sparda_config("proxy", top_k=4, dtype="bf16")) as rt:
        prefill(rt)
        ex = rt.sparda
        seq_ids = (0, 1)
        look = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
        ex.prefetch(1, seq_ids, look)
        st = ex.staged[1]
        blk = rt.cfg.sparda.block_size
        for b, s in enumerate(seq_ids):
            k, v = rt.store.full_kv(s, 1)
            n, sink = rt.store.cpu_len(s, 1), rt.store.cfg.sink
            for h in range(2):
                for e in range(st.slots.shape[2]):
                    cnt = int(st.ntok[b, h, e])
                    slot = int(st.slots[b, h, e])
                    if not cnt:
                        continue
                    # The store's full KV is on the host; the block cache is on the executor's device.
                    ck, cv = ex.cache.k[1][slot].to(k.device), ex.cache.v[1][slot].to(v.device)
                    first = int(torch.nonzero(torch.all(k[sink : sink + n, h] == ck[0], -1))[0])
                    assert first % blk == 0
                    torch.testing.assert_close(ck[:cnt], k[sink + first : sink + first + cnt, h], rtol=0, atol=0)
                    torch.testing.assert_close(cv[:cnt], v[sink + first : sink + first + cnt, h], rtol=0, atol=0)
        fetched = rt.stats()["sparda_blocks_fetched"]
        assert fetched == rt.stats()["sparda_blocks_selected"] == 2 * 2 * 4
        # The same selection made synchronously (the layer's own queries) hits every block.
        staged = ex._stage(1, seq_ids, look.to(device=rt.store.device, dtype=torch.float32))  # as prefetch hands it
        torch.testing.assert_close(staged.slots, st.slots)
        assert rt.stats()["sparda_blocks_fetched"] == fetched
        assert rt.stats()["sparda_bytes_moved"] == fetched * 2 * blk * 32 * 2


def test_cache_evicts_least_recently_used_blocks():
    from hybrid_runtime.forecast_block_cache import BlockCache

    c = BlockCache(1, 4, 16, 8, torch.float32, torch.device("cpu"), 2, 1, 10)
    dst, fetch = c.assign(0, torch.tensor([1, 2, -1]))
    assert fetch.tolist() == [True, True, False] and dst[2] == c.spare
    dst2, fetch2 = c.assign(0, torch.tensor([3, 4, 1]))
    assert fetch2.tolist() == [True, True, False] and dst2[2] == dst[0]
    dst3, fetch3 = c.assign(0, torch.tensor([5, 1, -1]))  # 2 was used least recently: its slot goes
    assert fetch3.tolist() == [True, False, False] and dst3[0] == dst[1]
    assert int(c.slot_of[0][2]) == -1 and int(c.slot_of[0][5]) == int(dst3[0])
    c.invalidate(0, 0, first_block=3)  # keys 3, 4, 5 of sequence slot 0
    assert [int(c.slot_of[0][x]) for x in (1, 3, 4, 5)][1:] == [-1, -1, -1] and int(c.slot_of[0][1]) >= 0
    assert c.counts() == (7, 5)


# ---------------------------------------------------------------------------- kernels (interpreted without CUDA)
# Compiled Triton needs its tensors on the GPU: with CUDA these tests run there.
KERNEL_DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_block_gather_triton_equals_torch():
    from gpu_kernels.forecast_gather import gather_blocks

    torch.manual_seed(4)
    dev = KERNEL_DEV
    arena = torch.randn(6, layout.CHUNK_ROWS, 16).to(dev)
    chunk = torch.tensor([3, 0, 5, 2], dtype=torch.int32, device=dev)
    row0 = torch.tensor([0, 32, 96, 64], dtype=torch.int32, device=dev)
    dst = torch.tensor([1, 0, 3, 2], device=dev)
    fetch = torch.tensor([True, False, True, True], device=dev)
    out = [torch.zeros(4, 32, 16, device=dev) for _ in range(4)]
    gather_blocks(arena, out[0], out[1], chunk, row0, dst, fetch, use_triton=False)
    gather_blocks(arena, out[2], out[3], chunk, row0, dst, fetch, use_triton=True)
    torch.testing.assert_close(out[2], out[0], rtol=0, atol=0)
    torch.testing.assert_close(out[3], out[1], rtol=0, atol=0)
    torch.testing.assert_close(out[0][3], arena[5, 96:128], rtol=0, atol=0)
    torch.testing.assert_close(out[1][3], arena[5, 128 + 96 : 256], rtol=0, atol=0)
    assert not out[0][0].any()


@pytest.mark.parametrize("splits", [1, 3])
def test_slot_attention_triton_equals_torch(splits):
    from gpu_kernels.slot_attention import slot_attention, slot_attention_torch

    torch.manual_seed(5)
    dev = KERNEL_DEV
    ck, cv = torch.randn(9, 16, 16).to(dev), torch.randn(9, 16, 16).to(dev)
    q = (torch.randn(2, 6, 16) / 4).to(dev)
    slots = torch.randint(0, 9, (2, 2, 4)).to(dev)
    ntok = torch.randint(0, 17, (2, 2, 4)).to(torch.int32)
    ntok[1, 1] = 0  # a group without any block: out 0, lse -inf
    ntok = ntok.to(dev)
    o_ref, l_ref = slot_attention_torch(q, ck, cv, slots, ntok)
    o, lse = slot_attention(q, ck, cv, slots, ntok, n_splits=splits)
    torch.testing.assert_close(o, o_ref, **TOL)  # compiled dots round like TF32 on CUDA
    torch.testing.assert_close(lse, l_ref, **TOL)
    assert torch.all(lse[1, 3:] == float("-inf")) and not o[1, 3:].any()


def _key_scores(keys):
    """The fp32 scores behind block sort keys (gpu_kernels.forecast_scores)."""
    hi = (keys >> 32).to(torch.int32)
    return (hi ^ ((hi >> 31) & 0x7FFFFFFF)).view(torch.float32)


def _prefilled(lengths=(300, 1000, 700), dtype="bf16", **sp):
    rt = HybridRuntime(sparda_config(dtype=dtype, **sp))
    for s, n in enumerate(lengths):
        for layer in range(GEOM["layers"]):
            rt.prefill(s, layer, *random_kv(n, GEOM["kv_heads"], GEOM["head_dim"], seed=10 * s + layer))
    return rt


def _grid_order(order):
    """The context a test's launches run in: as they are, or with the interpreter's grid reversed."""
    return reversed_interpreter_grid() if order == "reversed" else contextlib.nullcontext([1])


@pytest.mark.parametrize("grid_order", GRID_ORDERS)
@pytest.mark.parametrize("heads", [GEOM["kv_heads"], GEOM["q_heads"]])
@pytest.mark.parametrize("limited", [False, True])
def test_block_sort_keys_kernel_equals_the_torch_scores(heads, limited, grid_order):
    """Scores read through the chunk tables (Triton) against group_block_scores on gathered cells;
    a batch of three (the grid's z): a launch must score every sequence, in any program order."""
    from gpu_kernels.forecast_scores import block_sort_keys, is_valid_key

    with _prefilled(top_k=6) as rt:
        ex, dev = rt.sparda, rt.device
        seq_slots = torch.tensor([rt.store.slot(s) for s in (2, 0, 1)], device=dev)
        n = ex.index.host_lengths[1, seq_slots.cpu().numpy()]
        n_chunks = -(-int(n.max()) // layout.CHUNK_TOKENS)
        width = n_chunks * layout.CHUNK_TOKENS // 32 + 3  # wider than the grid: padding columns
        limit = torch.tensor([3, 20, 1], dtype=torch.int32, device=dev) if limited else None
        q = torch.randn(3, heads, 32, generator=torch.Generator().manual_seed(7)).to(dev)
        want = ex._sort_keys_torch(1, seq_slots, q, n_chunks, width, limit)
        valid = is_valid_key(want)
        assert valid.sum() > 10 and not valid[..., -3:].any()  # blocks past the segment or the limit: none
        # Twice: on CUDA the first launch of a variant goes through the JIT, the second through the
        # cached launcher (the executor's warm-up may already have made it the first).
        for _ in range(2):
            # Pre-filled with the key of a valid block of score 2.0 (what an unwritten column would keep).
            got = torch.full_like(want, 1 << 62)
            with _grid_order(grid_order) as ran:
                block_sort_keys(q, ex.index.cells[1], ex.index.tables[1], ex.index.lengths[1], seq_slots, n_chunks * 8,
                                32, got, limit)
            assert ran[0] > 0
            assert torch.equal(is_valid_key(got), valid)
            torch.testing.assert_close(_key_scores(got)[valid], _key_scores(want)[valid], atol=1e-5, rtol=1e-5)
            assert torch.equal(torch.topk(got, 6).indices, torch.topk(want, 6).indices)


@pytest.mark.parametrize("width,k", [(40, 8), (300, 64), (5, 5)])
def test_row_top_k_kernel_equals_torch_topk(width, k):
    """The Triton top-k of sort keys (tiles merged into the best k so far) gives torch.topk's
    values and indices exactly: ties in score broken to the lower block, nonexistent blocks last."""
    from gpu_kernels.forecast_scores import sort_keys
    from gpu_kernels.forecast_topk import row_top_k

    scores = torch.randn(3, 2, width, generator=torch.Generator().manual_seed(width)).round(decimals=1)
    scores[..., width // 2 :] = float("-inf")  # half the row past the segment
    keys = sort_keys(scores, width).to(KERNEL_DEV)
    top_keys = torch.empty(3, 2, k, dtype=torch.int64, device=KERNEL_DEV)
    top_blocks = torch.empty_like(top_keys)
    for _ in range(2):  # on CUDA: through the JIT, then the cached launcher
        row_top_k(keys, k, top_keys, top_blocks)
        want = torch.topk(keys, k)
        assert torch.equal(top_keys, want.values) and torch.equal(top_blocks, want.indices)


def test_sort_keys_order_like_a_stable_descending_sort():
    from gpu_kernels.forecast_scores import is_valid_key, sort_keys

    scores = torch.tensor([[0.5, -0.0, 2.0, 2.0, float("-inf"), 0.0, -3.0, 0.5]])
    keys = sort_keys(scores, width=10)
    order = torch.sort(scores, descending=True, stable=True).indices
    assert torch.topk(keys, 8).indices.tolist() == order.tolist()
    assert is_valid_key(keys).tolist() == [[True, True, True, True, False, True, True, True, False, False]]


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("grid_order", GRID_ORDERS)
def test_cache_placement_kernels_equal_the_torch_path(grid_order, tiles, monkeypatch):
    """BlockCache.place: lookup, eviction order and assignment in Triton against the torch ops,
    over steps with hits, evictions, entries without a block, spill extras and an invalidation;
    the kept eviction order equals the stamps' sort after every step. `small` tiles make the
    plan's running counts carry across many tiles (entries 4, slots 8 per step)."""
    import gpu_kernels.forecast_plan as plan
    from gpu_kernels.forecast_scores import sort_keys
    from hybrid_runtime.forecast_block_cache import BlockCache, Placement

    if tiles == "small":
        monkeypatch.setattr(plan, "ENTRY_TILE", 4)
        monkeypatch.setattr(plan, "SLOT_TILE", 8)

    s, hkv, max_blocks, blk, dev = 3, 2, 40, 32, DEV
    caches = [BlockCache(1, 80, blk, 8, torch.float32, dev, s, hkv, max_blocks) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 100, (s, hkv, max_blocks * blk // 128 + 1), generator=gen, dtype=torch.int32).to(dev)
    lengths = torch.tensor([900, 300, 1200], dtype=torch.int32, device=dev)
    fetched = []
    for step in range(10):
        seq = torch.tensor([2, 0, 1] if step % 3 else [0, 2], device=dev)
        b = len(seq)
        nb = (lengths[seq].long() + blk - 1) // blk
        scores = torch.randn(b, hkv, max_blocks, generator=gen).round(decimals=1).to(dev)  # ties included
        extra, n_extra = None, 0
        if step % 4 == 3:  # a spill: top-k below the old end, then the blocks from it on
            extra, n_extra = (nb - 3).clamp_min(0).to(torch.int32), 5
            nb = extra.long()
        scores = scores.masked_fill(torch.arange(max_blocks, device=dev) >= nb[:, None, None], float("-inf"))
        top = torch.topk(sort_keys(scores), 8)
        if step == 6:
            for c in caches:
                c.invalidate(0, 2, first_block=10)
        m = b * hkv * (8 + n_extra)
        outs = []
        for cache, triton in zip(caches, (False, True)):
            out = Placement(torch.zeros(m, dtype=torch.int64, device=dev), *(torch.zeros(m, dtype=torch.int32, device=dev)
                            for _ in range(3)), torch.zeros(m, dtype=torch.bool, device=dev))
            with _grid_order(grid_order if triton else "in_order") as ran:
                cache.place(0, top.values, top.indices, extra, n_extra, seq, lengths, table, 128, out, triton)
            assert ran[0] > 0
            outs.append(out)
        for field in ("slots", "ntok", "chunk", "row0", "fetch"):
            assert torch.equal(getattr(outs[0], field), getattr(outs[1], field)), (step, field)
        for field in ("slot_of", "owner", "stamp"):
            assert torch.equal(getattr(caches[0], field)[0], getattr(caches[1], field)[0]), (step, field)
        c = caches[1]
        assert not c.lru_stale[0]
        lru = c.lru[0][c.lru_current[0]].long()
        assert torch.equal(lru, torch.sort(c.stamp[0][: c.n_slots]).indices), step  # the kept order is the stamps'
        assert caches[0].counts() == caches[1].counts()
        fetched.append(int(outs[0].fetch.sum()))
    assert caches[0].counts()[1] > 80 and min(fetched) < max(fetched)  # evictions happened, and hits


def _decode_steps(rt, steps, seed, forecast_layer=1):
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for step in range(steps):
        for layer in range(GEOM["layers"]):
            q = torch.randn(2, 8, 32, generator=gen)
            k, v = torch.randn(2, 2, 32, generator=gen), torch.randn(2, 2, 32, generator=gen)
            heads = GEOM["kv_heads"] if layer == forecast_layer else GEOM["q_heads"]
            look = torch.randn(2, heads, 32, generator=gen) if layer + 1 < GEOM["layers"] else None
            outs.append(rt.decode(layer, [1, 0], q.to(rt.device), k.to(rt.device), v.to(rt.device),
                                  lookahead=None if look is None else look.to(rt.device)))
    return outs


def comparable_stats(rt) -> dict:
    """`rt.stats()` without its host timings (the warm-up's and the workers' start: seconds that differ run to run)
    and the process-wide count of JIT launches (the Triton path's, interpreted, count there)."""
    timings = ("warmup_s", "warmup_wait_s", "worker_start_s", "worker_start_wait_s", "jit_launches_after_warmup")
    return {k: v for k, v in rt.stats().items() if k not in timings}


def test_triton_selection_through_the_runtime_equals_the_torch_path():
    """The executor with the Triton selection (interpreted without CUDA) against its torch path:
    the same outputs, blocks, cache state, counts; and a spill's re-selection alike."""
    runtimes = [_prefilled(top_k=5), _prefilled(top_k=5)]
    try:
        runtimes[0].sparda.use_triton, runtimes[1].sparda.use_triton = False, True
        runtimes[1].sparda.warm_up()
        results = [_decode_steps(rt, 3, seed=9) for rt in runtimes]
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, **TOL)
        ex_a, ex_b = (rt.sparda for rt in runtimes)
        for layer in range(GEOM["layers"]):
            for field in ("slot_of", "owner", "stamp"):
                assert torch.equal(getattr(ex_a.cache, field)[layer], getattr(ex_b.cache, field)[layer]), (layer, field)
        assert comparable_stats(runtimes[0]) == comparable_stats(runtimes[1])
        # A re-selection after a spill: top-k below each old end, then every block from it on.
        old = np.array([200, 640])
        q = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(11)).to(runtimes[0].device)
        st_a, st_b = (ex._stage(1, (1, 0), q, spilled_from=old) for ex in (ex_a, ex_b))
        assert st_a.slots.shape == (2, 2, 5 + ex_a.spill_blocks)
        assert torch.equal(st_a.slots, st_b.slots) and torch.equal(st_a.ntok, st_b.ntok)
        assert int(st_a.ntok.sum()) > 0
        assert comparable_stats(runtimes[0]) == comparable_stats(runtimes[1])
    finally:
        for rt in runtimes:
            rt.close()


def test_sparda_runtime_starts_no_lanes():
    from hybrid_runtime.memory_plan import estimate_runtime

    with HybridRuntime(sparda_config()) as rt:
        assert rt.scheduler.n_cpu == 0 and rt.scheduler.threads == [] and rt.cpu_executor is None
        assert rt.gpu_executor is None and rt.scheduler.lane.executor is None
        st = rt.stats()
        assert st["cpu_workers"] == 0 and st["gpu_worker"] is False
        with pytest.raises(RuntimeError, match="no lanes"):
            rt.scheduler.run(None)
    for cuda in (False, True):  # nor does the memory plan count lanes
        names = {p.name for p in estimate_runtime(sparda_config(), cuda=cuda).parts}
        assert "sparda_selection" in names and not names & {"cpu_workspaces", "gpu_lane_scratch", "torch_lane_task"}


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("data,match", [
    ({"sparda": {"top_k": 4}}, "sparda.top_k: read only under selection.name 'sparda'"),
    ({"selection": {"name": "sparda"}, "sparda": {"block_size": 48}}, "sparda.block_size"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "next"}}, "sparda.lookahead"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy", "top_k": 0}}, "sparda.top_k"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy", "cache_blocks": 5}}, "sparda.cache_blocks"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "same_layer", "checkpoint": "x.pt"}},
     "sparda.checkpoint: read only with sparda.lookahead 'forecast'"),
    ({"selection": {"name": "sparda"}, "sparda": {"checkpoint": "nowhere/f.pt"}}, "sparda.checkpoint: 'nowhere/f.pt' is not a file"),
    ({"selection": {"name": "sparda", "streaming_heads": {0: [1]}}, "sparda": {"lookahead": "proxy"}},
     "selection.streaming_heads"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"},
      "experiment": {"variants": [{"name": "a", "selection": {"name": "fixed"}}]}}, "variants cannot switch"),
    # The scheduler's lane settings do nothing under sparda (no task, no lane).
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"}, "scheduler": {"placement": "gpu_only"}},
     r"scheduler.placement: 'gpu_only' does nothing under selection.name 'sparda'.*allowed: remove it \(or 'fluxion'\)"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"}, "scheduler": {"cpu_workers": 4}},
     r"scheduler.cpu_workers: 4 does nothing.*allowed: remove it \(or 'auto' / 0\)"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"}, "scheduler": {"gpu_worker": True}},
     r"scheduler.gpu_worker: True does nothing.*\(or 'auto' / False\)"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"}, "scheduler": {"spin_us": 5.0}},
     "scheduler.spin_us: 5.0 does nothing"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"}, "scheduler": {"gpu_share": 0.5}},
     "scheduler.gpu_share: 0.5 does nothing"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"}, "scheduler": {"step_timeout_s": 5}},
     "scheduler.step_timeout_s: 5 does nothing"),
    ({"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"},
      "experiment": {"variants": [{"name": "a", "placement": "cpu_only"}]}},
     r"experiment.variants\[0\].placement: 'cpu_only' does nothing under selection.name 'sparda'"),
])
def test_bad_sparda_config_is_refused_naming_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


def test_sparda_scheduler_keys_that_say_no_lanes_and_a_resolved_config_read_back():
    from hybrid_runtime.config import resolved

    base = {"selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy"}}
    ok = config_from_dict({**base, "scheduler": {"cpu_workers": 0, "gpu_worker": False, "placement": "fluxion",
                                                 "pin_cores": False, "gc_freeze": False, "spin_us": 20000.0}})
    assert ok.scheduler.cpu_workers == 0 and ok.scheduler.pin_cores is False
    for cuda in (False, True):
        ran = resolved(config_from_dict(base), cuda=cuda)
        assert (ran.scheduler.cpu_workers, ran.scheduler.gpu_worker) == (0, False)
        assert config_from_dict(ran.to_dict()) == ran  # a run's config.yaml reads back
    # Elsewhere the same keys keep their meaning.
    assert config_from_dict({"scheduler": {"cpu_workers": 4, "gpu_worker": True}}).scheduler.cpu_workers == 4


def test_bad_lookahead_is_refused_before_anything_changes():
    with HybridRuntime(sparda_config("proxy", top_k=4)) as rt:
        prefill(rt)
        q, k, v = torch.randn(2, 8, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
        lens = [rt.store.seq_len(s, 0) for s in (0, 1)]
        with pytest.raises(ValueError, match=r"lookahead has shape \(2, 3, 32\); expected \[2, 2, 32\]"):
            rt.decode(0, [0, 1], q, k, v, lookahead=torch.randn(2, 3, 32))
        with pytest.raises(ValueError, match="the last layer"):
            rt.decode(2, [0, 1], q, k, v, lookahead=torch.randn(2, 2, 32))
        assert [rt.store.seq_len(s, 0) for s in (0, 1)] == lens
    # `finite_check: auto` defers the NaN/inf check of a SparDA step on CUDA (no CPU lane: a sync
    # check would wait for the device every layer; test_deferred_input_check covers that path), so
    # "refused before anything changes" is the promise of `sync`, on every machine.
    with HybridRuntime(with_finite_check(sparda_config("proxy", top_k=4), "sync")) as rt:
        prefill(rt)
        lens = [rt.store.seq_len(s, 0) for s in (0, 1)]
        bad = torch.randn(2, 2, 32)
        bad[0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="lookahead has 1 NaN/inf"):
            rt.decode(0, [0, 1], q, k, v, lookahead=bad)
        assert [rt.store.seq_len(s, 0) for s in (0, 1)] == lens
    with HybridRuntime(sparda_config("same_layer", top_k=4)) as rt:
        prefill(rt)
        with pytest.raises(ValueError, match="sparda.lookahead is 'same_layer'"):
            rt.decode(0, [0, 1], q, k, v, lookahead=torch.randn(2, 2, 32))
    cfg = config_from_dict({"geometry": GEOM, "kv_cache": {"sink": 4, "local": 32, "cpu_capacity_tokens": 4096},
                            "scheduler": {"cpu_workers": 0, "gpu_worker": True, "pin_cores": False}})
    with HybridRuntime(cfg) as rt:
        prefill(rt)
        with pytest.raises(ValueError, match="read only under selection.name 'sparda'"):
            rt.decode(0, [0, 1], q, k, v, lookahead=torch.randn(2, 2, 32))


# ---------------------------------------------------------------------------- the transformers backend
def _tiny_llama(layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      initializer_range=0.1)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def _hf_config(lookahead, top_k, checkpoint=None):
    sp = {"lookahead": lookahead, "top_k": top_k, "block_size": 16}
    if checkpoint is not None:
        sp["checkpoint"] = str(checkpoint)
    return config_from_dict({
        "kv_cache": {"dtype": "fp32", "sink": 8, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 2048,
                     "max_sequences": 2},
        "selection": {"name": "sparda"}, "sparda": sp,
    })


@torch.no_grad()
def _forced_logits(model, ids, cont, cache):
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    rows = [out.logits[:, -1]]
    for i in range(cont.shape[1]):
        pos = torch.tensor([[ids.shape[1] + i]])
        rows.append(model(input_ids=cont[:, i : i + 1], position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(rows, 1).float()


@pytest.mark.parametrize("lookahead", ["proxy", "forecast"])
def test_generate_prefetches_from_the_transformers_backend(lookahead, tmp_path):
    from transformers import DynamicCache

    from forecast.model import Forecast, ProxyQueries
    from hybrid_runtime.integrations.transformers import HybridCache, disable_hybrid_attention, enable_hybrid_attention

    model = _tiny_llama()
    ckpt = None
    if lookahead == "forecast":  # an untrained Forecast of this model: W_F at its starting point
        mods = [layer.self_attn for layer in model.model.layers]
        ckpt = tmp_path / "tiny.pt"
        Forecast(ProxyQueries.from_attention_modules(mods).group_mean_weights(2), 2, 16).save(ckpt, {})
    g = torch.Generator().manual_seed(1)
    ids, cont = torch.randint(0, 128, (1, 400), generator=g), torch.randint(0, 128, (1, 20), generator=g)
    ref = _forced_logits(model, ids, cont, DynamicCache(config=model.config))
    for top_k, exact in ((64, True), (2, False)):
        rt = enable_hybrid_attention(model, _hf_config(lookahead, top_k, ckpt))
        try:
            got = _forced_logits(model, ids, cont, HybridCache(model))
            st = rt.stats()
        finally:
            disable_hybrid_attention(model)
        # Layer 0 selects with its own query; layers 1 and 2 were prefetched during the layer before.
        assert st["sparda_prefetched_steps"] == 20 * 2 and st["sparda_synchronous_steps"] == 20
        if exact:  # every block of the segment selected: the model's own attention
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        else:
            assert st["sparda_hit_rate"] > 0.3  # the next step reuses most of the cached blocks
    assert all(not m._forward_pre_hooks for m in (layer.self_attn for layer in model.model.layers))


def test_forecast_checkpoint_of_another_model_is_refused(tmp_path):
    from forecast.model import Forecast
    from hybrid_runtime.integrations.transformers import UnsupportedModelError, enable_hybrid_attention

    model = _tiny_llama()
    ckpt = tmp_path / "other.pt"
    Forecast(torch.zeros(1, 64, 32), 2, 16).save(ckpt, {})  # 2 layers, not 3
    with pytest.raises(UnsupportedModelError, match=r"serves \(layers, d_model, kv_heads, head_dim\) = \(2, 64, 2, 16\)"):
        enable_hybrid_attention(model, _hf_config("forecast", 4, ckpt))
    assert model.config._attn_implementation == "sdpa"


def test_device_benchmark_smoke_runs_on_any_machine(tmp_path):
    from benchmarks.sparda import main

    out = tmp_path / "sparda-smoke.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    rec = __import__("json").loads(out.read_text())
    assert {"speedup_vs_sync_2x2k", "hit_rate_2x2k"} <= set(rec["metrics"])
    assert [r["mode"] for r in rec["points"]] == ["prefetch", "sync", "hits"]
    assert rec["points"][2]["hit_rate"] == 1.0 and rec["points"][0]["bytes_moved_per_layer_step"] > 0


# ---------------------------------------------------------------------------- the quality experiment's plumbing
def test_sparda_quality_settings_configs_and_text_check(tmp_path):
    from hybrid_runtime.experiments import sparda_quality as sq

    s = sq.load_settings("configs/sparda_smollm2.yaml")
    cfgs = {p: sq.runtime_config(s, p) for p in s.policies}
    assert {p: c.sparda.lookahead for p, c in cfgs.items()} == {"forecast": "forecast", "proxy": "proxy",
                                                                  "same_layer": "same_layer"}
    assert all(c.selection.name == "sparda" and c.sparda.top_k == 8 and c.sparda.block_size == 64 for c in cfgs.values())
    with pytest.raises(ValueError, match="recall_positions"):
        sq.SpardaQualitySettings(positions=16, recall_positions=32)
    with pytest.raises(ValueError, match="policies"):
        sq.SpardaQualitySettings(policies=("forecast", "oracle"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("sparda_quality: {lengths: [4096]}\nruntime: {selection: {name: fixed}}\n")
    with pytest.raises(ValueError, match=r"runtime: sections \['selection'\] are not read"):
        sq.load_settings(str(bad))
    corpus = torch.arange(1000)[None]
    assert sq.check_disjoint(corpus, (500, 700), [{"offset": 0}], 400) == 0
    assert sq.check_disjoint(corpus, (300, 700), [{"offset": 0}], 400) == 400 - 300 - 16 + 1


def test_sparda_quality_metrics_and_table():
    from hybrid_runtime.experiments import sparda_quality as sq

    pol = {"agreement": 0.9, "kl": 0.05, "ppl": 12.0, "bytes_per_step": 1e6, "hit_rate": 0.8}
    entry = {"dense": {"ppl": 11.0}, "recall": {p: {"mean": 0.7, "per_layer": [0.6, 0.8]} for p in sq.POLICIES},
             "policies": {p: dict(pol) for p in sq.POLICIES}}
    results = {"settings": {"policies": list(sq.POLICIES), "recall_positions": 4, "positions": 8, "store_dtype": "bf16"},
               "sparda": {"top_k": 8, "block_size": 64}, "checkpoint": "smollm2.pt",
               "lengths": {"4096": entry, "8192": entry}}
    m = sq.metrics_of(results)
    for p in ("forecast", "proxy", "same_layer"):
        assert m[f"{p}_recall_at_k"] == 0.7 and m[f"agreement_{p}_4k"] == 0.9 and m[f"agreement_{p}_8k"] == 0.9
    md = sq.markdown(results)
    assert "| 8k | forecast | 0.700 | 0.900 |" in md and "| 2 | 0.800 | 0.800 | 0.800 |" in md


@pytest.mark.gpu
def test_cuda_prefetch_on_the_side_stream_gives_dense_attention_at_full_top_k():
    """On CUDA: side-stream selection, UVA gather and the slot-attention kernel, bf16 store."""
    cfg = config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 3},
        "selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy", "top_k": 64, "block_size": 32},
    })
    dev = torch.device("cuda")
    with HybridRuntime(cfg) as rt:
        prefill(rt)
        gen = torch.Generator().manual_seed(6)
        for step in range(20):
            for layer in range(GEOM["layers"]):
                q = torch.randn(2, 8, 32, generator=gen).to(dev)
                k, v = torch.randn(2, 2, 32, generator=gen).to(dev), torch.randn(2, 2, 32, generator=gen).to(dev)
                look = torch.randn(2, 2, 32, generator=gen).to(dev) if layer + 1 < GEOM["layers"] else None
                out = rt.decode(layer, [0, 1], q, k, v, lookahead=look)
                ref = dense_reference(rt, layer, [0, 1], q.cpu())
                torch.testing.assert_close(out.cpu(), ref, atol=3e-2, rtol=3e-2)
        st = rt.stats()
        assert st["sparda_prefetched_steps"] == 40 and st["sparda_spill_reselections"] >= 1
        assert rt.sparda.staged[1] is None and st["sparda_hit_rate"] > 0.5
