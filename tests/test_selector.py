"""The granularity-budget selector (Eq. 1 + Eq. 3) and modeled vs counted bytes."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_runtime.executors.torch_ref import TorchRefExecutor
from hybrid_runtime.selector import BLOCK_SIZES, budgets_at, compare_bytes, select_granularity
from hybrid_runtime.task_building import build_tasks
from hybrid_runtime.tasks import Step, modeled_volume
from tests.helpers import make_store, random_kv

D, ESIZE = 64, 2


def reference_selection(bgt0, k, streaming, cpu_len, g, block_sizes):
    """Eq. 1 and Eq. 3 written out per sequence, group, head and block size."""
    b, hq = bgt0.shape
    blk_out = np.zeros((b, hq // g), dtype=np.int64)
    budgets = np.zeros((b, hq), dtype=np.float32)
    volume = np.zeros((b, hq // g))
    for i in range(b):
        for grp in range(hq // g):
            heads = range(grp * g, grp * g + g)
            best = None
            for blk in block_sizes:
                bud = [0.0 if streaming[i, h] else min(1.0, max(0.0, float(np.float32(bgt0[i, h]) + np.float32(k[i, h])
                                                                     * np.float32(math.log2(blk))))) for h in heads]
                v = 2.0 * cpu_len[i] / blk + 2.0 * cpu_len[i] * sum(bud)
                if best is None or v < best[0] - 1e-9 * max(1.0, v):
                    best = (v, blk, bud)
            v, blk, bud = best
            blk_out[i, grp] = blk
            if cpu_len[i] > 0 and max(bud) > 0:
                budgets[i, list(heads)] = bud
                volume[i, grp] = v
    return blk_out, budgets, volume


@st.composite
def selector_inputs(draw):
    b = draw(st.integers(1, 4))
    hkv = draw(st.integers(1, 3))
    g = draw(st.integers(1, 4))
    hq = hkv * g
    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False, width=32)  # noqa: E731
    bgt0 = np.array(draw(st.lists(floats(-0.25, 1.25), min_size=b * hq, max_size=b * hq)), np.float32).reshape(b, hq)
    k = np.array(draw(st.lists(floats(-0.125, 0.125), min_size=b * hq, max_size=b * hq)), np.float32).reshape(b, hq)
    streaming = np.array(draw(st.lists(st.booleans(), min_size=b * hq, max_size=b * hq))).reshape(b, hq)
    cpu_len = np.array(draw(st.lists(st.integers(0, 200_000), min_size=b, max_size=b)), np.int64)
    blocks = draw(st.lists(st.sampled_from(BLOCK_SIZES), min_size=1, max_size=4, unique=True))
    return bgt0, k, streaming, cpu_len, g, tuple(sorted(blocks))


@settings(max_examples=150, deadline=None)
@given(selector_inputs())
def test_selector_matches_eq1_and_eq3_written_out(inputs):
    bgt0, k, streaming, cpu_len, g, blocks = inputs
    sel = select_granularity(bgt0, k, streaming, cpu_len, g, D, ESIZE, block_sizes=blocks)
    blk, budgets, volume = reference_selection(bgt0, k, streaming, cpu_len, g, blocks)
    np.testing.assert_allclose(sel.volume, volume, rtol=1e-5)
    has = volume > 0
    # Where two block sizes tie within rounding, either is right; otherwise the same one.
    np.testing.assert_array_equal(sel.has_task, has)
    chosen = np.take_along_axis(sel.volumes, np.searchsorted(blocks, sel.plan.block_size)[..., None], -1)[..., 0]
    np.testing.assert_allclose(chosen, sel.volumes.min(axis=-1), rtol=1e-6)
    same = sel.plan.block_size == blk
    budgets_g = sel.plan.budgets.reshape(budgets.shape[0], -1, g)
    np.testing.assert_allclose(budgets_g[same], budgets.reshape(budgets_g.shape)[same], atol=1e-6)
    # Streaming heads never read; budgets stay in [0, 1]; groups without a task have all-zero budgets.
    assert (sel.plan.budgets[streaming] == 0).all()
    assert ((sel.plan.budgets >= 0) & (sel.plan.budgets <= 1)).all()
    assert (budgets_g[~sel.has_task] == 0).all()
    for i, grp in zip(*np.nonzero(sel.has_task)):
        v = modeled_volume(int(cpu_len[i]), int(sel.plan.block_size[i, grp]), budgets_g[i, grp])
        assert sel.volume[i, grp] == pytest.approx(v, rel=1e-6)
    np.testing.assert_array_equal(sel.modeled_bytes, (sel.volume * D * ESIZE).astype(np.int64))


def test_block_size_follows_the_metadata_vs_budget_trade_off():
    """Doubling blk saves 2L/blk key-vectors of metadata and costs 2L*G*k of budget: with G = 4,
    k = 0 picks 128, k = 0.002 picks 64 (saving 2L/128 < 2L*0.008 only at 64 -> 128),
    k = 0.01 picks 16 (2L/32 < 2L*0.04)."""
    cpu_len = np.array([10_000])
    picks = []
    for slope in (0.0, 0.002, 0.01):
        sel = select_granularity(np.full((1, 4), 0.05, np.float32), np.full((1, 4), slope, np.float32),
                                 np.zeros((1, 4), bool), cpu_len, 4, D, ESIZE)
        picks.append(int(sel.plan.block_size[0, 0]))
        np.testing.assert_allclose(sel.plan.budgets[0], budgets_at(np.float32(0.05), np.float32(slope),
                                                                     [picks[-1]]).item(), rtol=1e-6)
    assert picks == [128, 64, 16]


def test_streaming_heads_and_groups():
    bgt0 = np.full((2, 4), 0.1, np.float32)
    k = np.full((2, 4), 0.01, np.float32)
    streaming = np.array([[True, True, False, True], [True, True, True, True]])
    sel = select_granularity(bgt0, k, streaming, np.array([4096, 4096]), 2, D, ESIZE)
    # Row 0: group 0 all streaming (no task), group 1 has one retrieval head; row 1: no task at all.
    np.testing.assert_array_equal(sel.has_task, [[False, True], [False, False]])
    assert sel.plan.budgets[0, 2] > 0 and (sel.plan.budgets[0, [0, 1, 3]] == 0).all()
    assert (sel.plan.budgets[1] == 0).all() and (sel.volume[1] == 0).all()
    blk = int(sel.plan.block_size[0, 1])
    assert sel.volume[0, 1] == pytest.approx(2 * 4096 / blk + 2 * 4096 * float(sel.plan.budgets[0, 2]))
    # A retrieval head whose Eq. 1 clips to 0 reads nothing either; nor does a sequence without CPU tokens.
    sel = select_granularity(np.array([[-1.0, 0.2]], np.float32), np.zeros((1, 2), np.float32),
                             np.zeros((1, 2), bool), np.array([0]), 1, D, ESIZE)
    assert not sel.has_task.any() and (sel.plan.budgets == 0).all()


def test_probabilities_and_torch_tensors():
    p = torch.tensor([[0.2, 0.7, 0.5, 0.49]])
    sel = select_granularity(torch.full((1, 4), 0.1), torch.zeros(1, 4), p, torch.tensor([2048]), 1, D, ESIZE)
    np.testing.assert_array_equal(sel.plan.budgets[0] > 0, [True, False, False, True])
    sel = select_granularity(torch.full((1, 4), 0.1), torch.zeros(1, 4), p, torch.tensor([2048]), 1, D, ESIZE,
                             streaming_threshold=0.8)
    assert (sel.plan.budgets[0] > 0).all()


@pytest.mark.parametrize("change, message", [
    (dict(bgt0=np.zeros((2, 3), np.float32)), "k must be"),
    (dict(k=np.full((2, 4), np.nan, np.float32)), "k must be finite"),
    (dict(streaming=np.zeros((2, 4), np.int32)), "bool flags or float"),
    (dict(cpu_len=np.array([10, -1])), "non-negative integers"),
    (dict(cpu_len=np.array([10.0, 1.0])), "non-negative integers"),
    (dict(group_size=3), "do not form groups"),
    (dict(group_size=0), "group_size must be a positive integer"),
    (dict(block_sizes=(16, 24)), "subset of"),
    (dict(streaming=np.full((2, 4), 0.3), streaming_threshold=1.0), "streaming_threshold"),
])
def test_bad_input_is_refused(change, message):
    args = dict(bgt0=np.zeros((2, 4), np.float32), k=np.zeros((2, 4), np.float32), streaming=np.zeros((2, 4), bool),
                cpu_len=np.array([10, 20]), group_size=2, head_dim=D, element_size=ESIZE)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        select_granularity(**args)


def test_plan_builds_tasks_with_the_selectors_priorities():
    store = make_store(geometry={"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32})
    for s, n in enumerate([30, 700, 2100]):
        store.prefill(s, 0, *random_kv(n, 2, 32, seed=s))
    seq_ids = [2, 0, 1]
    cpu_len = np.array([store.cpu_len(s, 0) for s in seq_ids])
    rng = np.random.default_rng(0)
    bgt0 = rng.uniform(-0.05, 0.3, (3, 8)).astype(np.float32)
    k = rng.uniform(0.0, 0.02, (3, 8)).astype(np.float32)
    streaming = np.zeros((3, 8), bool)
    streaming[:, :4] = True  # KV group 0 of every sequence is streaming
    esize = store.arena(0).element_size()
    sel = select_granularity(bgt0, k, streaming, cpu_len, 4, 32, esize)
    tasks = build_tasks(store, 0, seq_ids, sel.plan)
    assert [(t.batch_index, t.kv_head) for t in tasks] == [tuple(x) for x in np.argwhere(sel.has_task)]
    assert len(tasks) == 2  # sequence 0 has no CPU-resident tokens
    for t in tasks:
        assert t.priority == pytest.approx(sel.volume[t.batch_index, t.kv_head], rel=1e-6)
        assert t.modeled_bytes == sel.modeled_bytes[t.batch_index, t.kv_head]
        assert t.block_size == sel.plan.block_size[t.batch_index, t.kv_head]


def test_compare_bytes_from_selected_blocks():
    """40 CPU tokens at blk 16 are blocks of 16, 16 and 8 tokens; head 0 reads {0, 2}, head 1 {2}."""
    sel = np.zeros((1, 2, 3), bool)
    sel[0, 0, [0, 2]] = True
    sel[0, 1, 2] = True
    row = 2 * D * ESIZE
    args = (np.array([40]), np.array([16]), np.array([[0.5, 0.2]], np.float32), np.array([[2, 1]]), D, ESIZE)
    cpu = compare_bytes(*args, selected=sel)
    assert cpu.metadata[0] == 3 * row
    assert cpu.counted[0] == 3 * row + (16 + 8) * row  # the union, the partial block's 8 tokens once
    assert cpu.head_sum[0] == 3 * row + (16 + 8 + 8) * row
    assert cpu.modeled[0] == pytest.approx((2 * 40 / 16 + 2 * 40 * 0.7) * D * ESIZE, abs=1)  # float32 budgets
    gpu = compare_bytes(*args, selected=sel, whole_blocks=True)
    assert gpu.counted[0] == 3 * row + 2 * 16 * row and gpu.head_sum[0] == 3 * row + 3 * 16 * row
    s = cpu.summary()
    assert s["shared_kv_fraction"] == pytest.approx(1 - 24 / 32)
    assert s["counted_over_modeled"] == pytest.approx(cpu.counted[0] / cpu.modeled[0])
    with pytest.raises(ValueError, match="exactly one"):
        compare_bytes(*args)
    bad = np.zeros((1, 2, 4), bool)
    bad[0, 0, 3] = True
    with pytest.raises(ValueError, match="past a task's last block"):
        compare_bytes(*args, selected=bad)


@pytest.mark.parametrize("q_heads", [2, 8])
def test_counted_bytes_of_executed_tasks_against_the_model(q_heads):
    """Run the selector's tasks on the torch reference executor: what it counts is the union, so it
    lies between the largest head's blocks and the heads' blocks summed, and equals the sum for
    G = 1 (CPU lengths are whole blocks here, so the per-head count is exact)."""
    store = make_store(geometry={"layers": 1, "q_heads": q_heads, "kv_heads": 2, "head_dim": 32})
    lengths = [36 + 1024, 36 + 2048]  # sink 4 + local 32 stay in the window
    for s, n in enumerate(lengths):
        store.prefill(s, 0, *random_kv(n, 2, 32, seed=s))
    g = q_heads // 2
    rng = np.random.default_rng(1)
    sel = select_granularity(rng.uniform(0.02, 0.2, (2, q_heads)).astype(np.float32),
                             rng.uniform(0.0, 0.01, (2, q_heads)).astype(np.float32),
                             np.zeros((2, q_heads), bool), np.array([1024, 2048]), g, 32, store.arena(0).element_size())
    tasks = build_tasks(store, 0, [0, 1], sel.plan)
    q = torch.randn(2, q_heads, 32)
    TorchRefExecutor(store).run(tasks, Step.empty(0, q, g))
    cmp = compare_bytes([t.cpu_len for t in tasks], [t.block_size for t in tasks], np.stack([t.budgets for t in tasks]),
                        np.stack([t.n_select for t in tasks]), 32, store.arena(0).element_size(),
                        counted=[t.bytes_read for t in tasks])
    row = 2 * 32 * store.arena(0).element_size()
    largest = cmp.metadata + np.array([t.n_select.max() * t.block_size for t in tasks]) * row
    assert (cmp.counted >= largest).all() and (cmp.counted <= cmp.head_sum).all()
    if g == 1:
        np.testing.assert_array_equal(cmp.counted, cmp.head_sum)
    # Eq. 3 rounds nothing: the executors' whole blocks put counted above modeled only by rounding.
    assert (cmp.head_sum >= cmp.modeled).all()
