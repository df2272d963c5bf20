"""`kv_cache.cpu_capacity_tokens` is a hard bound, workspaces are sized from it, and closing frees.

The CPU kernels run without bounds checks, so every size here is an exact edge: a sequence that
fills the whole capacity, one token past it, a workspace one block short. CI runs this file once
more with NUMBA_BOUNDSCHECK=1, where any access past an array's end raises instead.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest
import torch

from cpu_kernels import layout
from cpu_kernels.sparse_attention import Workspace, run_task
from hybrid_runtime.executors.cpu import CpuExecutor
from hybrid_runtime.kvcache import CapacityError, KVStore, arena_bytes
from hybrid_runtime.reference import dense_attention, merge_attention
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.tasks import Step, make_task
from tests.helpers import make_store, random_kv, small_config

GEOM = {"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
SINK, LOCAL, GENERATED_CAP = 4, 32, 32  # tests.helpers.small_config's window
CAP = 1024


def capacity_store(cap: int = CAP, max_sequences: int = 8, dtype: str = "fp32") -> KVStore:
    return make_store(dtype=dtype, cpu_capacity_tokens=cap, max_sequences=max_sequences, geometry=GEOM)


def prompt(cpu_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt that leaves exactly `cpu_tokens` in the CPU store (the rest fills the window)."""
    return random_kv(SINK + LOCAL + cpu_tokens, GEOM["kv_heads"], GEOM["head_dim"], seed=seed)


def decode_full_budget(store: KVStore, seq_id: int, q: torch.Tensor, block_size: int) -> torch.Tensor:
    """Window attention merged with the CPU tasks at budget 1.0, for one sequence `q [Hq, D]`."""
    g = store.geometry.group_size
    step = Step.empty(0, q[None] / math.sqrt(store.head_dim), g)
    tasks = [make_task(store, seq_id, 0, h, 0, block_size, np.ones(g)) for h in range(store.kv_heads)]
    CpuExecutor(store).run(tasks, step)
    k, v = store.full_kv(seq_id, 0)
    cpu_len = store.cpu_len(seq_id, 0)
    keep = torch.cat([torch.arange(SINK), torch.arange(SINK + cpu_len, k.shape[0])])
    out_w, lse_w = dense_attention(q, k[keep], v[keep])
    return merge_attention(out_w, lse_w, step.out[0], step.lse[0])[0]


def snapshot(store: KVStore) -> dict:
    """Everything a refused call must leave as it was."""
    return {
        "seqs": store.sequences(),
        "free": store.free_chunks(0),
        "lens": [(store.cpu_len(s, 0), store.window_len(s, 0)) for s in store.sequences()],
        "kv": [store.full_kv(s, 0) for s in store.sequences()],
    }


def assert_unchanged(store: KVStore, before: dict) -> None:
    after = snapshot(store)
    assert {k: after[k] for k in ("seqs", "free", "lens")} == {k: before[k] for k in ("seqs", "free", "lens")}
    for (k0, v0), (k1, v1) in zip(before["kv"], after["kv"]):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


# ---------------------------------------------------------------------------- the capacity bound
@pytest.mark.parametrize("cap", [CAP, 1000])  # 1000: not a whole number of blocks or chunks
def test_the_longest_prompt_the_store_takes_fills_the_capacity_and_equals_dense_at_budget_one(cap):
    """Offered the most its arenas could hold for one sequence, then one token over the capacity,
    then exactly the capacity, the store takes only the last; decoding it equals dense attention.
    (Before the capacity was enforced it took the first, 2x the capacity, which overflowed the
    kernels' workspaces: wrong output, then a corrupted heap.)"""
    store = capacity_store(cap)
    arena_tokens = store.n_chunks // store.kv_heads * layout.CHUNK_TOKENS
    for n in (arena_tokens, cap + 1, cap):
        k, v = prompt(n, seed=n)
        try:
            store.prefill(0, 0, k, v)
            break
        except CapacityError:
            assert store.sequences() == []
    q = torch.randn(GEOM["q_heads"], GEOM["head_dim"], generator=torch.Generator().manual_seed(1))
    ref, _ = dense_attention(q, k, v)
    for block_size in layout.BLOCK_SIZES:
        out = decode_full_budget(store, 0, q, block_size)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert store.cpu_len(0, 0) == cap
    # The workspace is exactly as large as this sequence's task at blk 16: no slack hides an overflow.
    assert CpuExecutor(store).max_blocks == store.max_task_blocks == -(-cap // 16)
    assert store.cpu_tokens(0) == cap


def test_prefill_one_token_over_the_capacity_is_refused_and_changes_nothing():
    store = capacity_store()
    before = snapshot(store)
    with pytest.raises(CapacityError, match=r"1025 CPU-resident tokens .* only 1024 of the kv_cache.cpu_capacity_tokens=1024"):
        store.prefill(0, 0, *prompt(CAP + 1))
    assert_unchanged(store, before)
    # With another sequence holding part of the capacity, the rest is what is free.
    store.prefill(0, 0, *prompt(1000, seed=1))
    before = snapshot(store)
    with pytest.raises(CapacityError, match=r"only 24 of the kv_cache.cpu_capacity_tokens=1024 tokens per layer are free"):
        store.prefill(1, 0, *prompt(25, seed=2))
    assert_unchanged(store, before)
    store.prefill(1, 0, *prompt(24, seed=2))  # exactly the rest fits, and the failed call took no slot
    assert store.cpu_tokens(0) == CAP
    with pytest.raises(CapacityError, match="only 0 of"):
        store.prefill(3, 0, *prompt(1, seed=4))
    store.prefill(3, 0, *prompt(0, seed=4))  # a prompt that fits the window needs no capacity
    store.release(0)
    assert store.cpu_tokens(0) == 24
    store.prefill(2, 0, *prompt(1000, seed=3))  # released tokens are free again


def test_a_spill_past_the_capacity_is_refused_before_the_window_changes():
    store = capacity_store()
    store.prefill(0, 0, *prompt(CAP - 24))
    # The recent part starts at LOCAL tokens and holds GENERATED_CAP more; the next append spills
    # its oldest whole pages: 32 tokens here.
    for i in range(GENERATED_CAP):
        store.append(0, [0], *random_kv(1, 2, 32, seed=10 + i))
    before = snapshot(store)
    refused = r"spilling the GPU window needs .* \(32 CPU-resident tokens .* only 24 of the kv_cache.cpu_capacity_tokens=1024"
    with pytest.raises(CapacityError, match=refused):
        store.append(0, [0], *random_kv(1, 2, 32, seed=99))
    assert_unchanged(store, before)
    store.release(0)
    store.prefill(0, 0, *prompt(CAP - 32))
    for i in range(GENERATED_CAP + 1):  # now the spill fits exactly
        store.append(0, [0], *random_kv(1, 2, 32, seed=10 + i))
    assert store.cpu_len(0, 0) == store.cpu_tokens(0) == CAP


def test_arena_holds_the_worst_chunk_rounding_of_a_full_store():
    """Seven one-token CPU segments and one of the rest: the most chunks a full store can need."""
    store = capacity_store()
    n_chunks, _ = arena_bytes(store.cfg, store.geometry)
    assert n_chunks == store.n_chunks == 15 * 2  # 7 + ceil(1017 / 128) per KV head
    for s in range(7):
        store.prefill(s, 0, *prompt(1, seed=s))
    store.prefill(7, 0, *prompt(CAP - 7, seed=7))
    assert store.cpu_tokens(0) == CAP and store.free_chunks(0) == 0
    for s in range(8):
        k, v = store.full_kv(s, 0)
        assert torch.equal(k, prompt(1 if s < 7 else CAP - 7, seed=s)[0])


# ---------------------------------------------------------------------------- the kernel's own check
def test_a_task_larger_than_its_workspace_raises_before_the_kernel_writes():
    store = capacity_store()
    store.prefill(0, 0, *prompt(160))  # 10 blocks of 16
    q = np.ones((4, 32), np.float32)
    out = np.full((4, 32), 7.0, np.float32)
    lse = np.full(4, 7.0, np.float32)

    def run(ws: Workspace, cpu_len: int = 160, block_size: int = 16) -> int:
        return run_task(store.arena_numpy(0), store.chunk_table(0, 0)[0], cpu_len, block_size, q,
                        np.full(4, 10, np.int32), out, lse, ws.scores, ws.selected, ws.n_selected,
                        ws.block_heads, ws.state, ws.topk_scratch)

    with pytest.raises(ValueError, match=r"task has 10 blocks .* the workspace holds 9; size it from KVStore.max_task_blocks"):
        run(Workspace(4, 32, 9))
    with pytest.raises(ValueError, match="cpu_len 257 is more than its 2 chunks of 128 tokens hold"):
        run(Workspace(4, 32, 64), cpu_len=257)
    with pytest.raises(ValueError, match="block_size 48 is not one of 16, 32, 64, 128"):
        run(Workspace(4, 32, 64), block_size=48)
    with pytest.raises(ValueError, match="4 query heads of dim 32 .* fit 2 heads"):
        run(Workspace(2, 32, 64))
    assert (out == 7.0).all() and (lse == 7.0).all()
    assert run(Workspace(4, 32, 10)) > 0  # exactly large enough


class ShortWorkspaces(CpuExecutor):
    """The stock executor (native workers run its kernel) with workspaces one block too small."""

    def __init__(self, store: KVStore) -> None:
        super().__init__(store)
        self.max_blocks = -(-store.cfg.cpu_capacity_tokens // 16) - 1


def test_native_workers_fail_the_step_on_a_task_larger_than_their_workspace():
    cfg = small_config(dtype="fp32", cpu_capacity_tokens=CAP, max_sequences=2, geometry=dict(GEOM, layers=1))
    with HybridRuntime(cfg, cpu_executor=ShortWorkspaces) as rt:
        assert rt.scheduler.native is not None
        rt.prefill(0, 0, *prompt(CAP))
        q = torch.randn(1, 8, 32)
        with pytest.raises(ValueError, match="the workspace holds"):
            rt.decode(0, [0], q, *random_kv(1, 2, 32))


# ---------------------------------------------------------------------------- close
def arena_refs(store: KVStore) -> list:
    return [weakref.ref(store.arena(layer)) for layer in range(store.layers)] + [
        weakref.ref(store.arena_numpy(layer)) for layer in range(store.layers)
    ]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_closed_store_drops_its_arenas_and_refuses_use(dtype):
    store = make_store(dtype=dtype)
    store.prefill(0, 0, *random_kv(500, 2, 32))
    refs = arena_refs(store)
    assert store.close() == 0
    assert store.closed and not any(r() is not None for r in refs)
    assert store.close() == 0  # idempotent
    for use in (
        lambda: store.prefill(1, 0, *random_kv(10, 2, 32)),
        lambda: store.append(0, [0], *random_kv(1, 2, 32)),
        lambda: store.arena(0),
        lambda: store.arena_numpy(0),
        lambda: store.window(0),
        lambda: store.cpu_len(0, 0),
        lambda: store.chunk_table(0, 0),
        lambda: store.release(0),
        lambda: store.free_chunks(0),
    ):
        with pytest.raises(RuntimeError, match="KV store is closed"):
            use()
    assert store.sequences() == []


def test_close_reports_arenas_still_referenced_elsewhere():
    store = make_store()
    held = store.arena_numpy(1)
    assert store.close() == 1
    del held


def pinned_bytes() -> int:
    """Bytes of pinned blocks torch's caching host allocator holds, in use or cached (0 without CUDA)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not torch.cuda.is_available() or stats is None:
        return 0
    return int(stats()["allocated_bytes.current"])


CLOSE_CFG = small_config(cpu_capacity_tokens=64 * 1024, max_sequences=4)
ARENA_BYTES = arena_bytes(CLOSE_CFG.kv_cache, CLOSE_CFG.geometry)[1]


def test_build_close_rebuild_a_store_ten_times():
    closed = []  # kept alive on purpose: only close() may free their memory
    start = pinned_bytes()
    for i in range(10):
        store = KVStore(CLOSE_CFG.kv_cache, CLOSE_CFG.geometry)
        store.prefill(0, 0, *random_kv(2000, 2, 32, seed=i))
        refs = arena_refs(store)
        assert store.close() == 0
        assert not any(r() is not None for r in refs)
        closed.append(store)
        assert pinned_bytes() < start + ARENA_BYTES  # with CUDA: the pinned arenas went back


def test_build_close_rebuild_a_runtime_ten_times():
    closed = []
    start = pinned_bytes()
    for i in range(10):
        rt = HybridRuntime(CLOSE_CFG)
        rt.prefill(0, 0, *random_kv(2000, 2, 32, seed=i))
        rt.decode(0, [0], torch.randn(1, 8, 32), *random_kv(1, 2, 32))
        refs = arena_refs(rt.store)
        rt.close()
        assert rt.store.closed, "HybridRuntime.close() must close its KVStore"
        assert not any(r() is not None for r in refs), "something outside the store still holds an arena"
        closed.append(rt)
        # The runtime's own small pinned step buffers may stay with the kept runtimes; the arenas may not.
        assert pinned_bytes() < start + ARENA_BYTES + i * ARENA_BYTES // 8
