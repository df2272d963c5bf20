import math

import numpy as np
import pytest
import torch

from cpu_kernels import layout
from cpu_kernels.sparse_attention import Workspace, block_scores, run_task, topk_blocks
from hybrid_runtime.executors.cpu import CpuExecutor
from hybrid_runtime.reference import dense_attention, merge_attention, sparse_reference
from hybrid_runtime.tasks import Step, blocks_for_budget, make_task
from tests.helpers import make_store, random_kv


def window_part(store, seq_id, layer, q):
    """Dense attention over the GPU-window tokens of one sequence (torch reference)."""
    k, v = store.full_kv(seq_id, layer)
    sink = store.cfg.sink
    cpu_len = store.cpu_len(seq_id, layer)
    keep = torch.cat([torch.arange(min(sink, k.shape[0])), torch.arange(sink + cpu_len, k.shape[0])])
    return dense_attention(q, k[keep], v[keep])


def hybrid_decode(store, layer, seq_ids, q, budgets_per_head, block_size):
    """Window attention + CPU tasks + merge, for a batch `q [B, Hq, D]`."""
    g = store.geometry.group_size
    d = store.head_dim
    step = Step.empty(layer, q / math.sqrt(d), g)
    tasks = [
        make_task(store, s, layer, h, b, block_size, budgets_per_head[h * g : (h + 1) * g])
        for b, s in enumerate(seq_ids)
        for h in range(store.kv_heads)
    ]
    CpuExecutor(store).run(tasks, step)
    outs = []
    for b, s in enumerate(seq_ids):
        out_w, lse_w = window_part(store, s, layer, q[b])
        outs.append(merge_attention(out_w, lse_w, step.out[b], step.lse[b])[0])
    return torch.stack(outs), tasks, step


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("geometry", [(4, 4), (8, 2), (6, 2)], ids=["mha", "gqa4", "gqa3"])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_budget_one_equals_dense(dtype, geometry, block_size):
    hq, hkv = geometry
    store = make_store(dtype=dtype, geometry={"layers": 1, "q_heads": hq, "kv_heads": hkv, "head_dim": 32})
    lengths = [37, 301, 1111]  # odd lengths, one shorter than sink + local
    for s, n in enumerate(lengths):
        store.prefill(s, 0, *random_kv(n, hkv, 32, seed=n))
    q = torch.randn(len(lengths), hq, 32)
    out, tasks, _ = hybrid_decode(store, 0, [0, 1, 2], q, np.ones(hq), block_size)
    for b, s in enumerate([0, 1, 2]):
        k, v = store.full_kv(s, 0)
        ref, _ = dense_attention(q[b], k, v)
        torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=1e-4)
    assert sum(t.bytes_read for t in tasks) > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_budget_one_equals_dense_at_every_head_dim_path(dtype, head_dim):
    """D = 128 has its own constant-offset page kernels, other multiples of 32 the generic ones,
    and D = 16 the scalar loops; all must equal dense attention."""
    store = make_store(dtype=dtype, geometry={"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": head_dim})
    lengths = [37, 1111]
    for s, n in enumerate(lengths):
        store.prefill(s, 0, *random_kv(n, 2, head_dim, seed=n))
    q = torch.randn(len(lengths), 8, head_dim)
    for block_size in (16, 64):
        out, _, _ = hybrid_decode(store, 0, [0, 1], q, np.ones(8), block_size)
        for b in range(len(lengths)):
            k, v = store.full_kv(b, 0)
            ref, _ = dense_attention(q[b], k, v)
            torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=1e-4)


def test_random_budgets_match_reference_on_selected_blocks():
    store = make_store(geometry={"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32})
    store.prefill(0, 0, *random_kv(2000, 2, 32))
    rng = np.random.default_rng(0)
    budgets = np.array([0.0, 0.03, 0.2, 1.0, 0.5, 0.0, 0.07, 0.01], dtype=np.float32)
    q = torch.randn(1, 8, 32)
    for block_size in (16, 64):
        _, tasks, step = hybrid_decode(store, 0, [0], q, budgets, block_size)
        k, v = store.full_kv(0, 0)
        cpu_len = store.cpu_len(0, 0)
        k_cpu, v_cpu = k[4 : 4 + cpu_len], v[4 : 4 + cpu_len]
        for task in tasks:
            h0 = task.kv_head * 4
            qg = q[0, h0 : h0 + 4]
            meta = torch.stack(
                [store.block_metadata(0, 0, task.kv_head, block_size)[:, i].float() for i in (0, 1)], 1
            )
            scores = torch.maximum(qg[:, None] * meta[None, :, 1], qg[:, None] * meta[None, :, 0]).sum(-1)
            selected = []
            for gh in range(4):
                order = np.lexsort((np.arange(scores.shape[1]), -scores[gh].numpy()))
                selected.append(torch.from_numpy(np.sort(order[: task.n_select[gh]])))
            ref_out, ref_lse = sparse_reference(qg, k_cpu[:, task.kv_head], v_cpu[:, task.kv_head], selected, block_size)
            torch.testing.assert_close(step.out[0, h0 : h0 + 4], ref_out, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(step.lse[0, h0 : h0 + 4], ref_lse, atol=2e-5, rtol=1e-4)
            streaming = budgets[h0 : h0 + 4] == 0
            assert torch.all(torch.isneginf(step.lse[0, h0 : h0 + 4][torch.from_numpy(streaming)]))
    del rng


def test_topk_matches_bruteforce_with_ties():
    rng = np.random.default_rng(1)
    n_blocks = 300
    scores = rng.integers(0, 20, size=(5, n_blocks)).astype(np.float32)  # many ties
    n_select = np.array([0, 1, 17, 299, 300], dtype=np.int32)
    selected = np.empty((5, n_blocks), dtype=np.int32)
    n_selected = np.empty(5, dtype=np.int32)
    topk_blocks(scores, n_blocks, n_select, selected, n_selected, np.empty(n_blocks + 256, np.int32), np.zeros(n_blocks, np.uint32))
    for g in range(5):
        order = np.lexsort((np.arange(n_blocks), -scores[g]))  # score desc, then lower index
        expected = np.sort(order[: n_select[g]])
        assert n_selected[g] == n_select[g]
        assert np.array_equal(selected[g, : n_selected[g]], expected)


@pytest.mark.parametrize("head_dim", [16, 32, 128])
def test_block_scores_are_quest_bound(head_dim):
    store = make_store(geometry={"layers": 1, "q_heads": 4, "kv_heads": 1, "head_dim": head_dim})
    store.prefill(0, 0, *random_kv(700, 1, head_dim))
    q = np.random.default_rng(2).standard_normal((4, head_dim)).astype(np.float32)
    ws = Workspace(4, head_dim, 64)
    cpu_len = store.cpu_len(0, 0)
    for block_size in layout.BLOCK_SIZES:
        n = block_scores(store.arena_numpy(0), store.chunk_table(0, 0)[0], cpu_len, block_size, q, ws.scores, ws.state)
        meta = store.block_metadata(0, 0, 0, block_size).float().numpy()
        expected = np.maximum(q[:, None] * meta[None, :, 1], q[:, None] * meta[None, :, 0]).sum(-1)
        assert n == meta.shape[0]
        np.testing.assert_allclose(ws.scores[:, :n], expected, rtol=1e-5, atol=1e-5)
        # An upper bound: no key in a block scores above its bound.
        k, _ = store.full_kv(0, 0)
        k_cpu = k[4 : 4 + cpu_len, 0].float().numpy()
        exact = (q @ k_cpu.T)
        for b in range(n):
            assert np.all(exact[:, b * block_size : (b + 1) * block_size].max(1) <= ws.scores[:, b] + 1e-4)


def test_two_part_merge_equals_dense():
    k, v = random_kv(500, 2, 16)
    q = torch.randn(4, 16)
    out, lse = dense_attention(q, k, v)
    a = dense_attention(q, k[:123], v[:123])
    b = dense_attention(q, k[123:], v[123:])
    merged, merged_lse = merge_attention(*a, *b)
    torch.testing.assert_close(merged, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)
    empty = (torch.zeros(4, 16), torch.full((4,), float("-inf")))
    same, same_lse = merge_attention(out, lse, *empty)
    torch.testing.assert_close(same, out)
    both_empty, _ = merge_attention(*empty, *empty)
    assert torch.all(both_empty == 0)


def test_blocks_for_budget_rounds_up_to_whole_blocks():
    assert blocks_for_budget(0.0, 1000, 16) == 0
    assert blocks_for_budget(0.05, 1000, 16) == 4  # 50 tokens -> 4 blocks of 16
    assert blocks_for_budget(1.0, 1000, 16) == 63
    assert blocks_for_budget(0.5, 0, 16) == 0


def test_workspace_rejects_too_large_groups_and_tasks():
    with pytest.raises(ValueError, match="at most 32 heads"):
        Workspace(33, 32, 8)
    with pytest.raises(ValueError, match="sized for 8"):
        Workspace(4, 32, 8).check(9)


def test_run_task_counts_metadata_and_kv_bytes():
    store = make_store(geometry={"layers": 1, "q_heads": 2, "kv_heads": 1, "head_dim": 32})
    store.prefill(0, 0, *random_kv(36 + 160, 1, 32))  # 160 CPU tokens = 10 blocks of 16
    ws = Workspace(2, 32, 16)
    q = np.ones((2, 32), np.float32)
    out = np.empty((2, 32), np.float32)
    lse = np.empty(2, np.float32)
    nbytes = run_task(store.arena_numpy(0), store.chunk_table(0, 0)[0], 160, 16, q, np.array([3, 0], np.int32),
                      out, lse, ws.scores, ws.selected, ws.n_selected, ws.block_heads, ws.state, ws.topk_scratch)
    # 10 blocks x (min + max) rows + 3 blocks x 16 tokens x (K + V), 32 dims x 2 bytes
    assert nbytes == (10 * 2 + 3 * 16 * 2) * 32 * 2


@pytest.mark.parametrize("seed", range(6))
def test_topk_histogram_matches_bruteforce_on_continuous_and_clustered_scores(seed):
    rng = np.random.default_rng(seed)
    n_blocks = int(rng.integers(50, 3000))
    scores = np.stack([
        rng.standard_normal(n_blocks),
        np.round(rng.standard_normal(n_blocks), 1),  # clustered: big boundary buckets
        np.exp(rng.standard_normal(n_blocks) * 4),  # heavy tail: most blocks in the lowest bucket
        np.full(n_blocks, 3.0),  # all equal
    ]).astype(np.float32)
    n_select = rng.integers(1, n_blocks, size=4).astype(np.int32)
    selected = np.empty((4, n_blocks), dtype=np.int32)
    n_selected = np.empty(4, dtype=np.int32)
    marks = np.zeros(n_blocks, np.uint32)
    topk_blocks(scores, n_blocks, n_select, selected, n_selected, np.empty(n_blocks + 256, np.int32), marks)
    for g in range(4):
        order = np.lexsort((np.arange(n_blocks), -scores[g]))
        assert np.array_equal(selected[g, : n_selected[g]], np.sort(order[: n_select[g]])), g
    assert not marks.any()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [16, 32, 128])
@pytest.mark.parametrize("block_size", [16, 64])
def test_attention_split_into_block_ranges_equals_the_whole_task(dtype, head_dim, block_size):
    """select_task + attend_blocks over `split_bounds` ranges + merge_parts (how idle workers
    help with a large task) gives run_task's output, lse and bytes, for any number of parts."""
    from cpu_kernels.sparse_attention import attend_blocks, merge_parts, select_task, split_bounds

    g, cpu_len = 4, 3000
    store = make_store(dtype=dtype, geometry={"layers": 1, "q_heads": g, "kv_heads": 1, "head_dim": head_dim})
    store.prefill(0, 0, *random_kv(cpu_len + store.cfg.sink + store.cfg.local, 1, head_dim, seed=head_dim))
    arena, chunks = store.arena_numpy(0), store.chunk_table(0, 0)[0]
    cpu_len = store.cpu_len(0, 0)
    n_blocks = -(-cpu_len // block_size)
    rng = np.random.default_rng(block_size)
    q = rng.standard_normal((g, head_dim)).astype(np.float32) * 0.3
    n_select = np.array([n_blocks // 10, 0, n_blocks // 3, 1], np.int32)  # one streaming head
    ws = Workspace(g, head_dim, n_blocks + 8)
    out_ref, lse_ref = np.empty((g, head_dim), np.float32), np.empty(g, np.float32)
    whole = run_task(arena, chunks, cpu_len, block_size, q, n_select, out_ref, lse_ref, ws.scores, ws.selected,
                     ws.n_selected, ws.block_heads, ws.state, ws.topk_scratch)
    for n_parts in (1, 2, 3, 7, 64):
        ws = Workspace(g, head_dim, n_blocks + 8)
        out, lse = np.empty((g, head_dim), np.float32), np.empty(g, np.float32)
        meta_bytes, union_tokens = select_task(arena, chunks, cpu_len, block_size, q, n_select, out, lse, ws.scores,
                                               ws.selected, ws.n_selected, ws.block_heads, ws.state, ws.topk_scratch)
        bounds = np.empty(n_parts + 1, np.int64)
        parts = split_bounds(ws.block_heads, cpu_len, block_size, union_tokens, n_parts, bounds)
        assert 1 <= parts <= n_parts and bounds[0] == 0 and bounds[parts] == n_blocks
        assert np.all(np.diff(bounds[: parts + 1]) > 0)
        part_out = np.empty((parts, g, head_dim), np.float32)
        part_lse = np.empty((parts, g), np.float32)
        kv_bytes = sum(
            attend_blocks(arena, chunks, cpu_len, block_size, q, ws.block_heads, bounds[p], bounds[p + 1],
                          part_out[p], part_lse[p], ws.state)
            for p in range(parts)
        )
        merge_parts(part_out, part_lse, parts, out, lse)
        assert meta_bytes + kv_bytes == whole
        assert kv_bytes == union_tokens * 2 * head_dim * arena.itemsize
        np.testing.assert_allclose(out, out_ref, atol=2e-6, rtol=1e-5)
        np.testing.assert_allclose(lse, lse_ref, atol=1e-5, rtol=1e-6)
        assert lse[1] == -np.inf and not out[1].any()  # the streaming head stays empty
