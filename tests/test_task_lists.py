"""The vectorised task list (`task_building.TaskList`) gives what one `Task` object per task gave:
the same tasks, the same queue order and the same native and GPU tables, on random plans."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.task_build import baseline_build_tasks, baseline_native_table, baseline_queue_order, pack
from hybrid_runtime.head_plans import HeadPlan
from hybrid_runtime.task_building import OrderedTasks, TaskList, build_tasks, native_table, queue_arrays, queue_order
from hybrid_runtime.tasks import TaskQueue, make_task
from tests.helpers import make_store, random_kv

G, HKV = 4, 2
LENGTHS = (900, 30, 2100, 517)  # 30: all in the GPU window, no CPU-resident token


@pytest.fixture(scope="module")
def store():
    s = make_store(geometry={"layers": 2, "q_heads": HKV * G, "kv_heads": HKV, "head_dim": 32},
                   cpu_capacity_tokens=8192)
    for i, n in enumerate(LENGTHS):
        for layer in range(2):
            k, v = random_kv(n, HKV, 32, seed=10 * i + layer)
            s.prefill(i, layer, k, v)
    return s


def random_plan(rng, b: int, kind: str) -> HeadPlan:
    blk = rng.choice([16, 32, 64, 128], size=(b, HKV))
    budgets = rng.uniform(0.0, 0.3, size=(b, HKV * G)).astype(np.float32)
    if kind == "zeros":
        budgets[rng.random(budgets.shape) < 0.5] = 0.0
    elif kind == "empty_groups":
        budgets.reshape(b, HKV, G)[:, 0] = 0.0  # KV group 0 of every sequence has no task
    elif kind == "streaming":
        budgets[:] = 0.0
    elif kind == "extremes":
        budgets[rng.random(budgets.shape) < 0.3] = 1.0
        budgets[rng.random(budgets.shape) < 0.3] = 1e-6
    return HeadPlan(blk, budgets)


def same_task(a, b) -> bool:
    return (a.seq_id, a.layer, a.kv_head, a.batch_index, a.block_size, a.cpu_len, a.priority, a.modeled_bytes,
            a.index) == (b.seq_id, b.layer, b.kv_head, b.batch_index, b.block_size, b.cpu_len, b.priority,
                         b.modeled_bytes, b.index) and \
        np.array_equal(a.budgets, b.budgets) and a.budgets.dtype == b.budgets.dtype and \
        np.array_equal(a.n_select, b.n_select) and a.n_select.dtype == b.n_select.dtype and \
        np.array_equal(a.chunks, b.chunks)


@pytest.mark.parametrize("kind", ["mixed", "zeros", "empty_groups", "streaming", "extremes"])
def test_vectorised_tasks_and_tables_equal_the_per_task_ones(store, kind):
    rng = np.random.default_rng(hash(kind) % 1000)
    for trial in range(8):
        layer = trial % 2
        seq_ids = [int(x) for x in rng.permutation(len(LENGTHS))[: rng.integers(1, len(LENGTHS) + 1)]]
        plan = random_plan(rng, len(seq_ids), kind)
        new = build_tasks(store, layer, seq_ids, plan)
        old = baseline_build_tasks(store, layer, seq_ids, plan)
        assert isinstance(new, TaskList) and new._objects is None
        # The arrays the lanes and the timeline read, without making Task objects.
        assert len(new) == len(old)
        for name in ("seq_id", "kv_head", "modeled_bytes", "priority"):
            assert np.array_equal(getattr(new, name), getattr(old, name)), name
        ordered, order = queue_order(new)
        old_ordered, old_order = baseline_queue_order(old)
        assert isinstance(ordered, OrderedTasks) and np.array_equal(order, old_order)
        table = native_table(ordered, G) if len(new) else None
        assert new._objects is None  # none made so far
        if len(new):
            old_table = baseline_native_table(old_ordered, G)
            for x, y in zip(table, old_table):
                assert x.dtype == y.dtype and np.array_equal(x, y)
            n_arena = store.n_chunks
            for x, y in zip(pack(*table[:3], n_arena), pack(*old_table[:3], n_arena)):
                assert np.array_equal(x, y)
            # The per-task path over the materialised objects gives the same table too.
            for x, y in zip(native_table(list(ordered), G), table):
                assert np.array_equal(x, y)
        # The Task objects, made on demand, equal the old ones field by field and a make_task's.
        assert all(same_task(a, b) for a, b in zip(new, old))
        assert all(a is b for a, b in zip(new, new.objects()))  # the same objects every time
        assert [t.index for t in ordered] == order.tolist() and ordered[1:3] == [new[i] for i in order[1:3]]
        for t in new:
            ref = make_task(store, t.seq_id, layer, t.kv_head, t.batch_index, t.block_size, t.budgets)
            assert np.array_equal(ref.n_select, t.n_select) and np.array_equal(ref.chunks, t.chunks)
            assert ref.modeled_bytes == t.modeled_bytes and ref.priority == pytest.approx(t.priority, rel=1e-12)
        # Every (sequence, group) with a head that reads blocks has a task, and no other.
        want = {(s, h) for i, s in enumerate(seq_ids) for h in range(HKV)
                if make_task(store, s, layer, h, i, int(plan.block_size[i, h]),
                             plan.budgets[i, h * G:(h + 1) * G]).n_select.max() > 0}
        assert {(t.seq_id, t.kv_head) for t in new} == want


def test_a_queue_over_the_whole_list_takes_the_vectorised_table(store):
    """`queue_arrays` of a TaskQueue over the whole list (gpu_only) equals the per-task table."""
    rng = np.random.default_rng(5)
    plan = random_plan(rng, 4, "mixed")
    tasks = build_tasks(store, 0, [0, 1, 2, 3], plan)
    q = TaskQueue(tasks, tasks.priority, tasks.modeled_bytes)
    tab, nsel, chunks = queue_arrays(q, tasks)
    ref = baseline_native_table(q.tasks, G)
    assert np.array_equal(tab, ref[0]) and np.array_equal(nsel, ref[1]) and np.array_equal(chunks, ref[2])


def test_queues_over_a_reused_list_share_its_layout_and_nothing_else(store):
    """A reused task list keeps one queue layout (order, ordered tasks, byte sums); each queue over
    it still hands every task out once and counts its own progress; the layout is that of a queue
    given the priorities and bytes explicitly (which does not cache)."""
    rng = np.random.default_rng(9)
    tasks = build_tasks(store, 1, [3, 0, 2], random_plan(rng, 3, "mixed"))
    first, second = TaskQueue(tasks), TaskQueue(tasks)
    explicit = TaskQueue(tasks, tasks.priority, tasks.modeled_bytes)
    assert tasks._queue_layout is not None and first.tasks is second.tasks and first.order is second.order
    assert explicit.tasks is not first.tasks and np.array_equal(explicit.order, first.order)
    assert [t.index for t in explicit.tasks] == [t.index for t in first.tasks]
    assert np.array_equal(explicit.cum_bytes, first.cum_bytes)
    i, j = first.claim_range(float("inf"))
    first.finish(j - i)
    assert (i, j) == (0, len(tasks)) and first.done() and first.finished == len(tasks)
    assert len(second) == len(tasks) and second.finished == 0 and not second.done()
    handed = []
    while (task := second.pop()) is not None:
        handed.append(task.index)
        second.finish()
    assert sorted(handed) == list(range(len(tasks))) and second.done()


def test_bad_plans_are_refused(store):
    with pytest.raises(ValueError, match=r"block size 24 is not one of kv_cache.block_sizes"):
        build_tasks(store, 0, [0], HeadPlan(np.array([[16, 24]]), np.full((1, HKV * G), 0.1, np.float32)))
    for bad in (1.5, -0.1, np.nan, np.inf):
        budgets = np.full((1, HKV * G), 0.1, np.float32)
        budgets[0, 3] = bad
        with pytest.raises(ValueError, match=r"budgets must lie in \[0, 1\]"):
            build_tasks(store, 0, [0], HeadPlan(np.full((1, HKV), 16), budgets))
