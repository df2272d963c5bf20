"""The naive baselines of the attention benchmarks do the kernels' work, no more and no less.

benchmarks/cpu_attention.py divides the bytes of the same selection by the wall time of the
numba kernels and of a plain torch path; both must compute the same attention and read the same
rows. benchmarks/gpu_attention.py's naive path is checked against the numba kernel on the same
arena (without CUDA on CPU tensors, its Triton select step in the interpreter). All small.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks import cpu_attention as ca
from cpu_kernels import layout
from hybrid_runtime.executors.cpu import CpuExecutor
from hybrid_runtime.tasks import Step, make_task
from tests.helpers import make_store, random_kv

GEOMETRY = {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 128}


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """naive_torch_round sets torch's thread count; leave it as it was for other tests."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _naive_buffers(steps):
    return [(torch.zeros_like(s.out), torch.full_like(s.lse, float("-inf"))) for s in steps]


def _kernel_rows(store, task, ws) -> np.ndarray:
    """Arena rows the kernels read for a task that just ran in `ws`: the (min, max) metadata rows of
    every block, then K and V rows of the tokens of the union of the heads' selected blocks."""
    blk, per_chunk = task.block_size, layout.blocks_per_chunk(task.block_size)
    n_blocks = -(-task.cpu_len // blk)
    chunks = task.chunks.astype(np.int64)
    b = np.arange(n_blocks)
    entry = layout.META_ROW + 2 * (layout.meta_entry_offset(blk) + b % per_chunk)
    meta = chunks[b // per_chunk] * layout.CHUNK_ROWS + entry
    union = sorted({int(x) for g in range(len(ws.n_selected)) for x in ws.selected[g, : ws.n_selected[g]]})
    pos = np.array([p for u in union for p in range(u * blk, min((u + 1) * blk, task.cpu_len))], dtype=np.int64)
    k = chunks[pos // layout.CHUNK_TOKENS] * layout.CHUNK_ROWS + pos % layout.CHUNK_TOKENS
    return np.concatenate([meta, meta + 1, k, k + layout.V_ROW])


@pytest.mark.parametrize("block_size", [16, 64])
def test_naive_and_kernels_compute_the_same_attention_over_the_same_bytes(block_size):
    store, steps = ca.build_case(GEOMETRY, context=1200, batch=2, budget=0.1, block_size=block_size, layers=2)
    _, kernel_bytes = ca.kernel_round(CpuExecutor(store), steps, 1)
    outputs = _naive_buffers(steps)
    _, naive_bytes = ca.naive_torch_round(store, steps, 1, outputs)
    assert naive_bytes == kernel_bytes == sum(t.bytes_read for s in steps for t in s.tasks)
    for step, (out, lse) in zip(steps, outputs):
        torch.testing.assert_close(out, step.out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse, step.lse, atol=2e-5, rtol=1e-4)
        assert torch.isfinite(lse).all()  # every head of the case has blocks


def test_naive_reads_exactly_the_rows_the_kernels_read():
    """Ragged tasks (lengths, block sizes, per-head budgets with empty heads and whole segments) in
    one step: the naive path gathers each metadata row and each selected K/V row once, nothing else."""
    store = make_store(geometry={"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32})
    lengths = [30, 301, 1111]  # the first has no CPU-resident token (sink 4 + local 32)
    for s, n in enumerate(lengths):
        store.prefill(s, 0, *random_kv(n, 2, 32, seed=n))
    gen = torch.Generator().manual_seed(5)
    step = Step.empty(0, torch.randn(len(lengths), 8, 32, generator=gen) / math.sqrt(32), 4)
    budgets = [np.array([0.0, 0.05, 0.2, 1.0], np.float32), np.array([0.1, 0.0, 0.0, 0.03], np.float32)]
    sizes = iter([16, 32, 16, 64, 128, 16])
    step.tasks = [make_task(store, s, 0, h, s, next(sizes), budgets[h]) for s in range(len(lengths)) for h in range(2)]

    executor = CpuExecutor(store)
    ws = executor.workspace()
    q, out, lse = step.q.numpy(), step.out.numpy(), step.lse.numpy()
    expected = []
    for task in step.tasks:
        executor.run_one(task, q, out, lse, ws)
        expected.append(_kernel_rows(store, task, ws))
    expected = np.sort(np.concatenate(expected))

    naive_out, naive_lse = _naive_buffers([step])[0]
    reads = ca.naive_torch_step(store, step, naive_out, naive_lse)
    assert np.array_equal(np.sort(torch.cat(reads).numpy()), expected)
    assert ca.bytes_read(store.arena(0), reads) == sum(t.bytes_read for t in step.tasks)
    torch.testing.assert_close(naive_out, step.out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(naive_lse, step.lse, atol=2e-5, rtol=1e-4)
    assert torch.isneginf(naive_lse[1:, 5:7]).all() and (naive_out[1:, 5:7] == 0).all()  # heads without blocks
    assert torch.isneginf(naive_lse[0]).all()  # no CPU-resident token


def test_naive_bytes_follow_the_budget_not_the_chunks():
    d, esize = GEOMETRY["head_dim"], 2
    seen = []
    for budget in (0.02, 0.1, 0.4):
        store, steps = ca.build_case(GEOMETRY, context=2400, batch=2, budget=budget, block_size=16, layers=1)
        tasks = steps[0].tasks
        _, kernel_bytes = ca.kernel_round(CpuExecutor(store), steps, 1)
        _, naive_bytes = ca.naive_torch_round(store, steps, 1)
        assert naive_bytes == kernel_bytes
        meta = sum(-(-t.cpu_len // 16) * 2 * d * esize for t in tasks)
        block = 16 * 2 * d * esize  # K and V of one full block
        kv = naive_bytes - meta
        # The union of a group's selections: at least one head's blocks, at most all heads'.
        one_head = sum(int(t.n_select.max()) for t in tasks) * block
        all_heads = sum(int(t.n_select.sum()) for t in tasks) * block
        assert one_head <= kv <= all_heads
        whole_chunks = sum(len(t.chunks) for t in tasks) * layout.CHUNK_ROWS * d * esize
        seen.append((naive_bytes, whole_chunks))
    assert seen[0][0] < seen[1][0] < seen[2][0]
    assert seen[0][0] < 0.25 * seen[0][1]  # 2%: a small part of what copying whole chunks reads


def test_gpu_benchmark_naive_path_matches_the_cpu_kernel():
    """gpu_attention.py's arena builder and naive path (on CPU tensors without CUDA, on the GPU
    with it): the same union of blocks and the same attention (up to its bf16 SDPA) as the numba
    kernel on that arena."""
    pytest.importorskip("triton")
    from benchmarks import gpu_attention as ga
    from cpu_kernels.sparse_attention import Workspace, run_task
    from gpu_kernels.task_table import SparseTaskTable

    b, hkv, g, d, cpu_len, blk, n_sel = 2, 2, 4, 32, 700, 16, 5
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    host, chunk_ids = ga.build_arena(b, hkv, d, cpu_len, seed=0, dev=dev)
    tasks = [(s, h) for s in range(b) for h in range(hkv)]
    plan = SparseTaskTable.build(
        batch_index=[s for s, _ in tasks], kv_head=[h for _, h in tasks], block_size=[blk] * len(tasks),
        cpu_len=[cpu_len] * len(tasks), chunks=[chunk_ids[s, h] for s, h in tasks],
        n_select=np.full((len(tasks), g), n_sel, dtype=np.int32), n_arena_chunks=host.shape[0], device=dev,
    )
    q = torch.randn((b, hkv * g, d), generator=torch.Generator().manual_seed(1)) / math.sqrt(d)
    chunk_tab, meta_rows = ga.naive_tables(chunk_ids, tasks, plan.n_blocks_max, blk)
    assert meta_rows.numel() * d * 2 == int(plan.metadata_bytes(d, 2).sum())
    out, counts = ga.naive_pipeline(host, q.to(dev), plan, chunk_tab, cpu_len, g, hkv * g, blk, meta_rows, dev=dev)
    out = out.cpu()

    arena = host.view(torch.int16).numpy().view(np.uint16)
    n_blocks = -(-cpu_len // blk)
    ws = Workspace(g, d, n_blocks + 8)
    for i, (s, h) in enumerate(tasks):
        o, lse = np.empty((g, d), np.float32), np.empty(g, np.float32)
        run_task(arena, chunk_ids[s, h], cpu_len, blk, q[s, h * g : (h + 1) * g].numpy().copy(),
                 np.full(g, n_sel, np.int32), o, lse, ws.scores, ws.selected, ws.n_selected,
                 ws.block_heads, ws.state, ws.topk_scratch)
        union = {int(x) for gh in range(g) for x in ws.selected[gh, : ws.n_selected[gh]]}
        assert int(counts[i]) == len(union)
        torch.testing.assert_close(out[i, :, 0].float(), torch.from_numpy(o), atol=1e-2, rtol=1e-2)
