"""The GPU lane's claim path: a step table uploaded once, claims of rows as two launches.

Checked against float64 references: exact per-head top-k of the Quest scores (ties broken by the
lowest block id), the group union, attention over each head's own blocks, and the fused split
combine. Claims that cover the table in pieces must give the same result as one claim.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cpu_kernels import layout  # noqa: E402
from gpu_kernels.score_select import score_select  # noqa: E402
from gpu_kernels.task_table import StepTableBuffer, pack_step_table  # noqa: E402
from tests.test_gpu_kernels import CUDA, DEV, _gpu, check_heads_attend, make_case, quest_reference, rel_err  # noqa: E402


def pack_case(c):
    """The case's tasks as the queue-order arrays the runtime packs."""
    lens = np.array([len(c.ar.chunks[(s, h)]) for s, h, _ in c.tasks])
    return pack_step_table(
        np.array([s for s, _, _ in c.tasks]), np.array([h for _, h, _ in c.tasks]),
        np.array([b for _, _, b in c.tasks]), np.array([c.ar.cpu_lens[s] for s, _, _ in c.tasks]),
        np.concatenate([[0], np.cumsum(lens)[:-1]]), lens, c.n_select, c.ar.arena.shape[0],
        np.concatenate([c.ar.chunks[(s, h)] for s, h, _ in c.tasks]),
    )


class Scratch:
    def __init__(self, t: int, g: int, nb: int, d: int):
        from gpu_kernels.sparse_attention import MAX_SPLITS

        self.scores = torch.empty((t, g, nb), dtype=torch.float32, device=DEV)
        self.ublocks = torch.empty((t, nb), dtype=torch.int32, device=DEV)
        self.uheads = torch.empty((t, nb), dtype=torch.int32, device=DEV)
        self.counts = torch.empty(t, dtype=torch.int32, device=DEV)
        self.tickets = torch.zeros((2, t), dtype=torch.int32, device=DEV)
        self.part_out = torch.empty((t, MAX_SPLITS, g, d), dtype=torch.float32, device=DEV)
        self.part_lse = torch.empty((t, MAX_SPLITS, g), dtype=torch.float32, device=DEV)


def upload(c):
    packed = pack_case(c)
    return StepTableBuffer(DEV).upload(*packed, group_size=c.g)


def select(c, table, start, stop, sc, split=None):
    nb_max, _ = table.claim_shape(start, stop)
    score_select(table.table, table.n_select, table.chunks, start, stop - start, nb_max, c.q, c.ar.arena,
                 sc.scores, sc.tickets[0], sc.ublocks, sc.uheads, sc.counts, split=split)


def select_with_tile(c, sc, sel_elems: int, split=None) -> None:
    """`select` of the case's first task with the selection tile `SEL_ELEMS` set to `sel_elems`
    (smaller than the row: the chunked path)."""
    import gpu_kernels.score_select as ss

    old = ss.SEL_ELEMS
    try:
        ss.SEL_ELEMS = sel_elems
        select(c, upload(c), 0, 1, sc, split)
    finally:
        ss.SEL_ELEMS = old


def check_selection(c, start, stop, sc):
    for j, i in enumerate(range(start, stop)):
        s, h, blk = c.tasks[i]
        ref = quest_reference(c.q[s, h * c.g : (h + 1) * c.g].cpu(), c.ar.keys[(s, h)], blk)
        nb = ref.shape[1]
        got = sc.scores[j, :, :nb].cpu().double()
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), f"task {i}: scores differ"
        cnt = int(sc.counts[j])
        blocks = sc.ublocks[j, :cnt].cpu()
        bits = sc.uheads[j, :cnt].cpu()
        assert (blocks[1:] > blocks[:-1]).all(), "union not in ascending block order"
        assert (bits != 0).all()
        for gg in range(c.g):
            mine = blocks[((bits >> gg) & 1) != 0]
            k = int(c.n_select[i, gg])
            assert mine.numel() == k, f"task {i} head {gg}: {mine.numel()} blocks, wants {k}"
            if 0 < k < nb:
                chosen = torch.zeros(nb, dtype=torch.bool)
                chosen[mine.long()] = True
                # Ranked by the kernel's own fp32 scores: exact top-k with lowest-index ties.
                s32 = sc.scores[j, gg, :nb].cpu()
                assert s32[chosen].min() >= s32[~chosen].max()
                kth = s32[chosen].min()
                ties = torch.nonzero(s32 == kth).flatten()
                n_above = int((s32 > kth).sum())
                assert chosen[ties[: k - n_above]].all(), "ties must go to the lowest block ids"
    assert (sc.tickets == 0).all(), "the last program of every task resets its ticket"


# split: the fused kernel (False) and a program per head (True, `_select_heads_kernel`), which the
# runtime takes for rows longer than one tile of all heads (`split_select`).
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_score_select_exact_topk_and_union(dtype, split):
    c = make_case(cpu_lens=[300, 129, 40], hkv=2, g=2, d=32, dtype=dtype, blks=(16, 32, 64, 128),
                  budget="random", streaming=True)
    table = upload(c)
    sc = Scratch(len(c.tasks), c.g, int(table.n_blocks.max()), 32)
    select(c, table, 0, len(c.tasks), sc, split)
    check_selection(c, 0, len(c.tasks), sc)


@pytest.mark.parametrize("planned", [False, True])
def test_split_scoring_launch_shape_is_its_own(monkeypatch, planned):
    # The split form's scoring launch takes `SCORE_BLOCK_B` (its grid and its blocks a program), not the
    # fused kernel's `BLOCK_B`: a smaller one scores the same rows in more programs, same selection. A
    # shape other than the default (32 x 4), so the knob is what is exercised.
    from gpu_kernels import score_select as ss
    from gpu_kernels.score_select import ScoreSelectPlan

    monkeypatch.setattr(ss, "SCORE_BLOCK_B", 64)
    monkeypatch.setattr(ss, "SCORE_NUM_WARPS", 8)
    c = make_case(cpu_lens=[1200, 129, 40], hkv=2, g=2, d=32, dtype=torch.float32, blks=(16, 32, 64, 128),
                  budget="random", streaming=True, seed=3)
    table = upload(c)
    n, nb = len(c.tasks), int(table.n_blocks.max())
    sc = Scratch(n, c.g, nb, 32)
    if planned:
        nb_max, _ = table.claim_shape(0, n)
        plan = ScoreSelectPlan(sc.scores, sc.tickets[0])
        plan(table.table, table.n_select, table.chunks, 0, n, nb_max, c.q, c.ar.arena, sc.ublocks, sc.uheads,
             sc.counts, split=True)
    else:
        select(c, table, 0, n, sc, True)
    assert ss._grid(n, nb, ss.SCORE_BLOCK_B)[1] == -(-nb // 64) > ss._grid(n, nb)[1] == 1  # 75 blocks a row
    check_selection(c, 0, n, sc)


def test_planned_selection_in_both_forms_twice():
    # `ScoreSelectPlan` (the executor's launches), fused and split, each called twice: the second
    # call of a form goes through its plan (on CUDA the planned launch; the interpreter runs the JIT).
    from gpu_kernels.score_select import ScoreSelectPlan

    c = make_case(cpu_lens=[300, 129, 40], hkv=2, g=3, d=32, dtype=torch.bfloat16, blks=(16, 32, 64, 128),
                  budget="random", streaming=True, seed=7)
    table = upload(c)
    n, nb = len(c.tasks), int(table.n_blocks.max())
    nb_max, _ = table.claim_shape(0, n)
    for split in (False, True):
        sc = Scratch(n, c.g, nb, 32)
        plan = ScoreSelectPlan(sc.scores, sc.tickets[0])
        for _ in range(2):
            sc.ublocks.fill_(-1)
            plan(table.table, table.n_select, table.chunks, 0, n, nb_max, c.q, c.ar.arena, sc.ublocks, sc.uheads,
                 sc.counts, split=split)
            check_selection(c, 0, n, sc)


def test_split_select_is_taken_where_rows_exceed_one_tile_of_all_heads():
    from gpu_kernels import score_select as ss

    assert not ss.split_select(ss.SEL_ELEMS // 4, 4) and ss.split_select(ss.SEL_ELEMS // 4 + 1, 4)
    assert ss.split_select(ss.SEL_ELEMS // 8 + 1, 7), "G = 7 pads to 8 heads a tile"
    assert not ss.split_select(ss.SEL_ELEMS // 2, 1), "G = 1 pads to 2"


# A head's row in registers (4096); the radix path of the fused kernel and, split, a head's row
# re-read a tile at a time (1024).
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("sel_elems", [4096, 1024])
def test_score_select_rows_longer_than_one_selection_tile_and_ties(sel_elems, split):
    # 2600 blocks of 16 tokens, more than one selection tile of both heads (SEL_ELEMS / BLOCK_G): a head's
    # row at a time when it fits SEL_ELEMS, else the radix path. Duplicated keys make equal scores, so the
    # tie rule decides which blocks complete each head's k.
    g = 2
    c = make_case(cpu_lens=[2600 * 16], hkv=1, g=g, d=16, dtype=torch.float32, blks=(16,), budget=0.1, seed=5)
    host = c.ar.host
    ids = c.ar.chunks[(0, 0)]
    # Every chunk's metadata equal to the first chunk's: scores repeat every 8 blocks.
    host[torch.from_numpy(ids[1:]).long(), layout.META_ROW :] = host[int(ids[0]), layout.META_ROW :]
    sc = Scratch(1, g, 2600, 16)
    c.n_select[:] = [[37, 260]]
    select_with_tile(c, sc, sel_elems, split)  # smaller tiles than the GPU's, so the interpreter runs these paths quickly
    cnt = int(sc.counts[0])
    blocks, bits = sc.ublocks[0, :cnt].cpu(), sc.uheads[0, :cnt].cpu()
    for gg, k in enumerate((37, 260)):
        mine = blocks[((bits >> gg) & 1) != 0]
        assert mine.numel() == k
        s32 = sc.scores[0, gg, :2600].cpu()
        kth = s32[mine.long()].min()
        assert (s32[mine.long()] >= kth).all() and int((s32 > kth).sum()) <= k
        ties = torch.nonzero(s32 == kth).flatten()
        assert torch.equal(mine[s32[mine.long()] == kth], ties[: mine.numel() - int((s32 > kth).sum())])


# All heads' rows in registers (700 blocks x BLOCK_G 4 <= 8192); a head's row at a time (700 <= 1024);
# the radix path (700 > 512).
# Split: a head's row in registers (8192, 1024) or re-read a tile at a time (512).
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("sel_elems", [8192, 1024, 512])
def test_score_select_scores_that_share_their_high_digits(sel_elems, split):
    # Every block's metadata is one vector plus a perturbation of 1e-5 relative: each head's scores
    # agree in their top 12-16 bits, so the k-th key is decided by the radix select's low digits.
    # G = 3 (a padded head lane), heads of both score signs, one head that selects nothing.
    g, d, n_blocks = 3, 16, 700
    c = make_case(cpu_lens=[n_blocks * 16], hkv=1, g=g, d=d, dtype=torch.float32, blks=(16,), budget=0.1, seed=9)
    host, ids = c.ar.host, torch.from_numpy(c.ar.chunks[(0, 0)]).long()
    rng = torch.Generator().manual_seed(4)
    meta = host[ids, layout.META_ROW :]
    base = torch.randn(d, generator=rng)
    host[ids, layout.META_ROW :] = base + 1e-5 * torch.randn(meta.shape, generator=rng) * base.abs().max()
    c.q[0, 0] = c.q[0, 0].abs() * torch.sign(base).to(c.q.device)  # positive scores
    c.q[0, 1] = -c.q[0, 1].abs() * torch.sign(base).to(c.q.device)  # negative scores
    c.n_select[:] = [[41, 300, 0]]
    sc = Scratch(1, g, n_blocks, d)
    select_with_tile(c, sc, sel_elems, split)
    cnt = int(sc.counts[0])
    blocks, bits = sc.ublocks[0, :cnt].cpu(), sc.uheads[0, :cnt].cpu()
    assert (bits >> g == 0).all(), "no block is marked for the padded head lane"
    for gg, k in enumerate((41, 300, 0)):
        s32 = sc.scores[0, gg, :n_blocks].cpu()
        assert s32.max() - s32.min() < 1e-3 * s32.abs().max(), "the case must make close scores"
        mine = blocks[((bits >> gg) & 1) != 0]
        assert mine.numel() == k
        if k:
            want = torch.sort(-s32.double(), stable=True).indices[:k].sort().values  # lowest ids win ties
            assert torch.equal(mine.long(), want)


def run_claims(c, bounds, pps=None, programs=0):
    from gpu_kernels.sparse_attention import SparseConfig, sparse_attention_claim

    config = SparseConfig(block_n=32, pages_per_split=pps or 3, claim_programs=programs)
    table = upload(c)
    b, d = len(c.ar.cpu_lens), c.q.shape[2]
    out = torch.full((b, c.hq, d), 7.0, device=DEV)
    lse = torch.full((b, c.hq), 3.0, device=DEV)
    sc = Scratch(len(c.tasks), c.g, int(table.n_blocks.max()), d)
    unions = {}
    for start, stop in bounds:
        select(c, table, start, stop, sc)
        _, pages_max = table.claim_shape(start, stop)
        sparse_attention_claim(table.table, table.chunks, start, stop - start, pages_max, c.q, c.ar.arena,
                               sc.ublocks, sc.uheads, sc.counts, sc.part_out, sc.part_lse, sc.tickets[1],
                               out, lse, config)
        for j, i in enumerate(range(start, stop)):
            cnt = int(sc.counts[j])
            unions[i] = (sc.ublocks[j, :cnt].cpu().clone(), sc.uheads[j, :cnt].cpu().clone())
    assert (sc.tickets == 0).all()
    return out.cpu(), lse.cpu(), unions


def check_attention(c, out, lse, unions, tol):
    def blocks_of(i):
        ub, uh = unions[i]
        return [ub[((uh >> gg) & 1) != 0] for gg in range(c.g)]

    check_heads_attend(c, out, lse, blocks_of, tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_claims_attend_each_heads_own_blocks(dtype):
    c = make_case(cpu_lens=[300, 129, 40], hkv=2, g=2, d=32, dtype=dtype, blks=(16, 32, 64, 128),
                  budget="random", streaming=True, seed=1)
    out, lse, unions = run_claims(c, [(0, len(c.tasks))])
    check_attention(c, out, lse, unions, tol=5e-3)


def test_claims_in_pieces_equal_one_claim():
    c = make_case(cpu_lens=[300, 129, 40], hkv=2, g=2, d=32, dtype=torch.float32, blks=(16, 32),
                  budget="random", seed=2)
    n = len(c.tasks)
    whole = run_claims(c, [(0, n)])
    parts = run_claims(c, [(0, 1), (1, 4), (4, n)])
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])


@pytest.mark.parametrize("programs", [1, 3])
def test_bounded_claim_equals_one_program_per_item(programs):
    # Fewer programs than (task, split) items: each loops over items p, p + programs, ...; a
    # task's splits land on different programs and in any order, and the last ticket combines.
    c = make_case(cpu_lens=[300, 129, 40], hkv=2, g=2, d=32, dtype=torch.float32, blks=(16, 32),
                  budget="random", seed=2)
    n = len(c.tasks)
    plain = run_claims(c, [(0, n)], pps=1)
    bounded = run_claims(c, [(0, 2), (2, n)], pps=1, programs=programs)
    assert torch.allclose(plain[0], bounded[0], rtol=0, atol=1e-6)
    assert torch.allclose(plain[1], bounded[1], rtol=0, atol=1e-6)


def test_claim_with_many_splits_combines_them():
    # budget 1.0 and one page per split: every task's union spans many splits (capped at
    # MAX_SPLITS, beyond which splits grow longer); the combine must reproduce dense attention.
    from hybrid_runtime import reference

    c = make_case(cpu_lens=[1200], hkv=1, g=2, d=16, dtype=torch.float32, blks=(16,), budget=1.0, seed=3)
    out, lse, _ = run_claims(c, [(0, 1)], pps=1)
    ro, rl = reference.dense_attention(c.q[0].cpu(), c.ar.keys[(0, 0)][:, None], c.ar.values[(0, 0)][:, None], scale=1.0)
    assert rel_err(out[0], ro) < 1e-5
    assert torch.allclose(lse[0], rl, atol=1e-5)


@_gpu
def test_claims_large_llama_geometry():
    c = make_case(cpu_lens=[8000, 5003, 3072, 700], hkv=8, g=4, d=128, dtype=torch.bfloat16,
                  blks=(16, 32, 64, 128), budget="random", streaming=True, seed=3)
    table = upload(c)
    sc = Scratch(len(c.tasks), c.g, int(table.n_blocks.max()), 128)
    select(c, table, 0, len(c.tasks), sc)
    check_selection(c, 0, len(c.tasks), sc)
    out, lse, unions = run_claims(c, [(0, 5), (5, len(c.tasks))], pps=8)
    check_attention(c, out, lse, unions, tol=5e-3)
    bounded = run_claims(c, [(0, 5), (5, len(c.tasks))], pps=8, programs=20)
    assert torch.allclose(out, bounded[0], rtol=0, atol=1e-5) and torch.allclose(lse, bounded[1], rtol=0, atol=1e-5)


def test_pack_step_table_rejects_bad_rows():
    ok = dict(batch_index=np.zeros(1), kv_head=np.zeros(1), block_size=np.array([16]), cpu_len=np.array([100]),
              chunk_off=np.zeros(1), n_chunks=np.ones(1), n_select=np.ones((1, 2)), n_arena_chunks=4,
              chunk_ids=np.zeros(1, np.int32))
    pack_step_table(**ok)
    with pytest.raises(ValueError, match="block_size 48"):
        pack_step_table(**{**ok, "block_size": np.array([48])})
    with pytest.raises(ValueError, match="chunk ids"):
        pack_step_table(**{**ok, "chunk_ids": np.array([9], np.int32)})
    with pytest.raises(ValueError, match="cpu_len"):
        pack_step_table(**{**ok, "cpu_len": np.array([200])})
    with pytest.raises(ValueError, match="n_select"):
        pack_step_table(**{**ok, "n_select": np.full((1, 2), 9)})



def _staging(ex) -> set[int]:
    """Addresses of the executor's step-table staging slots (on the device)."""
    return {d.data_ptr() for d in ex._tables._dev}


def test_step_tables_are_staged_in_turn_through_slots_that_grow_together():
    buf = StepTableBuffer(DEV, capacity=8)
    words = [np.arange(k, k + 5, dtype=np.int32) for k in range(3)]
    staged = [buf.stage(w) for w in words]
    # Two slots in turn: the next layer's upload does not wait for this one's copy (nor for its q).
    assert staged[0].data_ptr() != staged[1].data_ptr() == buf._dev[1].data_ptr()
    assert staged[2].data_ptr() == staged[0].data_ptr() and torch.equal(staged[2].cpu(), torch.from_numpy(words[2]))
    assert torch.equal(staged[1].cpu(), torch.from_numpy(words[1]))  # the other slot kept its words
    big = np.arange(20, dtype=np.int32)
    assert torch.equal(buf.stage(big).cpu(), torch.from_numpy(big)) and buf.capacity == 20
    assert all(d.numel() == 20 for d in buf._dev) and len(buf._dev) == StepTableBuffer.SLOTS


def test_executor_keeps_a_resident_table_per_task_set():
    from hybrid_runtime import native_pool
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
    from tests.helpers import make_store

    store = make_store()
    ex = GpuUvaExecutor(store)
    g = store.geometry.group_size

    def packed():
        tab = np.zeros((1, native_pool.T_COLS), dtype=np.int64)
        tab[0, native_pool.T_BLOCK], tab[0, native_pool.T_CPULEN], tab[0, native_pool.T_N_CHUNKS] = 16, 128, 1
        return ex.pack(tab, np.ones((1, g), np.int32), np.zeros(1, np.int32))

    p1 = packed()
    staged = ex.upload(p1, resident=True)  # first use: through the staging buffer, no copy of its own
    assert not ex._resident and staged.table.data_ptr() in _staging(ex)
    first = ex.upload(p1, resident=True)  # second use: its own device copy (staged, then copied), kept
    assert first.table.data_ptr() not in _staging(ex) and len(ex._resident) == 1
    assert torch.equal(first.table, staged.table) and torch.equal(first.chunks, staged.chunks)
    assert ex.upload(p1, resident=True) is first  # the same task set: nothing copied again
    p2 = packed()
    ex.upload(p2, resident=True)
    assert len(ex._resident) == 1  # another task set, used once: staged only
    assert ex.upload(p2, resident=True) is not first  # used again: its own copy
    ex.RESIDENT = 2
    p3, p4 = packed(), packed()
    for p in (p3, p3, p4, p4):
        ex.upload(p, resident=True)
    assert len(ex._resident) == 2
    again = ex.upload(p1, resident=True)  # least recent dropped: staged again, then resident again
    assert again is not first and ex.upload(p1, resident=True) is not first and len(ex._resident) == 2
    streamed = ex.upload(p1)  # not resident: through the staging buffer, every time
    assert torch.equal(streamed.table, first.table) and torch.equal(streamed.chunks, first.chunks)


def test_a_prepared_table_is_resident_with_its_scratch_grown_before_its_first_upload():
    """`prepare` (a prefill's `prepare_decode`): the claims' scratch grown for the table and its
    device copy made, so its first upload copies nothing and grows nothing."""
    from cpu_kernels import layout
    from hybrid_runtime import native_pool
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
    from tests.helpers import make_store

    store = make_store()
    ex = GpuUvaExecutor(store)
    g = store.geometry.group_size
    tab = np.zeros((1, native_pool.T_COLS), dtype=np.int64)
    blocks = 2 * ex._blocks_cap  # more blocks a task than the scratch holds
    n_chunks = -(-16 * blocks // layout.CHUNK_TOKENS)
    tab[0, native_pool.T_BLOCK], tab[0, native_pool.T_CPULEN], tab[0, native_pool.T_N_CHUNKS] = 16, 16 * blocks, n_chunks
    p1 = ex.pack(tab, np.ones((1, g), np.int32), (np.arange(n_chunks) % store.n_chunks).astype(np.int32))
    ex.prepare(p1)
    caps, resident = (ex._tasks_cap, ex._blocks_cap), ex._resident[id(p1[0])][1]
    assert caps[1] >= blocks and resident.table.data_ptr() not in _staging(ex)
    assert ex.upload(p1, resident=True) is resident and (ex._tasks_cap, ex._blocks_cap) == caps
    ex.prepare(p1)  # already ready: nothing made again
    assert ex._resident[id(p1[0])][1] is resident and len(ex._resident) == 1
    assert torch.equal(resident.table, ex.upload(p1).table)  # the same words as a staged upload


def test_fresh_task_sets_are_staged_not_made_resident():
    """A new head plan every step gives a new task set every step: each is uploaded through the
    pinned staging buffer (asynchronous), never copied into a resident table of its own."""
    from hybrid_runtime import native_pool
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
    from tests.helpers import make_store

    store = make_store()
    ex = GpuUvaExecutor(store)
    g = store.geometry.group_size
    made = []
    real = ex._resident_table
    ex._resident_table = lambda packed: made.append(packed) or real(packed)
    for n in range(1, 6):
        tab = np.zeros((n, native_pool.T_COLS), dtype=np.int64)
        tab[:, native_pool.T_BLOCK], tab[:, native_pool.T_CPULEN], tab[:, native_pool.T_N_CHUNKS] = 16, 128, 1
        tab[:, native_pool.T_CHUNK_OFF] = np.arange(n)
        packed = ex.pack(tab, np.ones((n, g), np.int32), np.zeros(n, np.int32))
        table = ex.upload(packed, resident=True)
        assert table.n_tasks == n and table.table.data_ptr() in _staging(ex)
        assert torch.equal(table.table.cpu(), torch.from_numpy(packed[0][: n * 9]).view(n, 9))
    assert made == [] and not ex._resident


def _executor_step(claim_launch: str, budget: float = 0.3, gpu_metadata: bool = False,
                   seqs: tuple[int, ...] = (700, 420), pick_rows: tuple | None = None):
    """One step's tasks (a sequence per prompt length in `seqs`, every KV head, block 16) on a
    warmed-up `GpuUvaExecutor`: (executor, its uploaded table, the step). `gpu_metadata`: the store
    keeps a copy of the metadata on its device (`KVStore.enable_gpu_metadata`), made after the
    first prompt and written with the second, which the claims score from. `pick_rows`: the CPU
    lane's selection rows (`GpuPicks.views`), compiled for at warm-up."""
    from hybrid_runtime.config import GeometryConfig, KVCacheConfig
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
    from hybrid_runtime.kvcache import KVStore
    from hybrid_runtime.task_building import native_table
    from hybrid_runtime.tasks import Step, Task, blocks_for_budget

    seqs = list(seqs)
    geom = GeometryConfig("t", 1, q_heads=4, kv_heads=2, head_dim=32)
    kv = KVCacheConfig(sink=16, local=32, generated_cap=32, dtype="bf16", cpu_capacity_tokens=sum(seqs) + 256,
                       max_sequences=len(seqs), device="auto")
    store = KVStore(kv, geom)
    gen = torch.Generator().manual_seed(3)
    for i, n in enumerate(seqs):
        if gpu_metadata and i == 1:
            store.enable_gpu_metadata()
        store.prefill(i, 0, torch.randn((n, 2, 32), generator=gen).to(DEV), torch.randn((n, 2, 32), generator=gen).to(DEV))
    q = (torch.randn((len(seqs), 4, 32), generator=gen) / 32 ** 0.5).to(DEV)
    g = geom.group_size
    tasks = []
    for i in range(len(seqs)):
        cl, table = store.cpu_len(i, 0), store.chunk_table(i, 0)
        for h in range(2):
            nsel = np.array([blocks_for_budget(budget * (1 + j), cl, 16) for j in range(g)], dtype=np.int32)
            tasks.append(Task(i, 0, h, i, 16, np.full(g, budget, np.float32), nsel, cl, table[h]))
    if claim_launch == "native":
        # As in a fresh process: the descriptor launches' cache holds nothing another test compiled
        # (the native launcher must find every landing slot's variant compiled by its own warm-up).
        from gpu_kernels import claim_descriptor

        claim_descriptor._select_launch._compiled.clear()
        claim_descriptor._attend_launch._compiled.clear()
    ex = GpuUvaExecutor(store, claim_launch=claim_launch)
    ex.pick_rows = pick_rows
    ex.compile_kernels()
    tab, nsel, chunks, _ = native_table(tasks, g)
    step = Step.empty(0, q, g)
    if CUDA:
        ex.stream.wait_stream(torch.cuda.current_stream())
    return ex, ex.upload(ex.pack(tab, nsel, chunks)), step


def _claims_through_executor(claim_launch: str, bounds, budget: float = 0.3, gpu_metadata: bool = False,
                             seqs: tuple[int, ...] = (700, 420)):
    """Claims of `bounds` over `_executor_step`'s step; returns (out, lse, bytes per task, executor)."""
    ex, table, step = _executor_step(claim_launch, budget, gpu_metadata, seqs)
    per_task = np.concatenate([ex.launch(table, i, j, step).wait() for i, j in bounds])
    if CUDA:
        torch.cuda.synchronize()
    return step.out.cpu(), step.lse.cpu(), per_task, ex


@pytest.mark.parametrize("launch", ["graphs", "native"])
@pytest.mark.parametrize("bounds", [[(0, 4)], [(0, 1), (1, 3), (3, 4)]])
def test_descriptor_claims_equal_planned_launches(bounds, launch):
    """Claims read from a descriptor row -- replayed from CUDA graphs, or issued by the native
    launcher through the CUDA driver (both launched as descriptor kernels here, without CUDA) --
    give what the two planned launches give, claim by claim, on every landing slot."""
    out_d, lse_d, bytes_d, _ = _claims_through_executor("plans", bounds)
    out_g, lse_g, bytes_g, ex = _claims_through_executor(launch, bounds)
    assert torch.equal(out_g, out_d) and torch.equal(lse_g, lse_d)
    assert np.array_equal(bytes_g, bytes_d)
    assert torch.isfinite(lse_d).all()  # every head attended something
    assert not ex._work.any()  # the launches' item counters are back at zero for the next claim
    if CUDA and launch == "graphs":
        assert ex.capture_error is None and ex.graph_captures >= ex.RING and ex.graph_replays == len(bounds)
    if CUDA and launch == "native":
        assert ex.native_error is None and ex.native_launches == len(bounds)


@_gpu
@pytest.mark.parametrize("seqs", [(700, 420), (70000, 420)])
@pytest.mark.parametrize("bounds", [[(0, 4)], [(0, 1), (1, 3), (3, 4)]])
def test_direct_claims_equal_planned_launches(bounds, seqs):
    """The planned kernels issued by the direct launcher through the CUDA driver give what their
    planned launches give, claim by claim, on every landing slot, in both selection forms: 70,000
    tokens at block 16 are more blocks than one selection tile of both heads holds, so claims of
    that sequence's tasks select split (`split_select`)."""
    from gpu_kernels.score_select import split_select

    assert split_select(-(-(70000 - 48) // 16), 2) and not split_select(-(-(700 - 48) // 16), 2)
    out_p, lse_p, bytes_p, _ = _claims_through_executor("plans", bounds, seqs=seqs)
    out_d, lse_d, bytes_d, ex = _claims_through_executor("direct", bounds, seqs=seqs)
    assert torch.equal(out_d, out_p) and torch.equal(lse_d, lse_p)
    assert np.array_equal(bytes_d, bytes_p)
    assert torch.isfinite(lse_p).all()
    assert ex.direct_error is None and ex.direct_launches == len(bounds)


def _picks_through_executor(claim_launch: str, seqs: tuple[int, ...], stamp: int = 41):
    """The CPU lane's selection (`GpuUvaExecutor.pick` through `GpuPicks.launch`) of rows [1, all)
    of `_executor_step`'s step, stamped `stamp`; returns (ready, blocks, heads, counts) copied from
    the pinned rows, and the executor."""
    from hybrid_runtime.gpu_picks import GpuPicks

    picks = GpuPicks(4, 8192, DEV)
    ex, table, step = _executor_step(claim_launch, seqs=seqs, pick_rows=picks.views)
    for row in picks.arrays:
        row[...] = -7
    after = None
    if CUDA:
        after = torch.cuda.Event()
        after.record(torch.cuda.current_stream())
    picks.launch(ex, table, 1, table.n_tasks, step, stamp, after)
    if CUDA:
        torch.cuda.synchronize()
    return tuple(a.copy() for a in picks.arrays), ex


@_gpu
@pytest.mark.parametrize("seqs", [(700, 420), (70000, 420)])
def test_direct_selections_for_the_cpu_lane_equal_planned_ones(seqs):
    """The CPU lane's selection issued by the direct launcher writes the planned launch's unions,
    counts and ready stamps into the pinned rows, fused and split, and nothing into the row before."""
    planned, _ = _picks_through_executor("plans", seqs)
    direct, ex = _picks_through_executor("direct", seqs)
    ready, blocks, heads, counts = direct
    assert ready[0] == -7 and (ready[1:4] == 41).all() and (counts[1:4] > 0).all()
    for a, b in zip(direct, planned):
        assert np.array_equal(a, b)
    assert ex.direct_error is None and ex.direct_picks == 1


@pytest.mark.parametrize("claim_launch", ["plans", "graphs", "native", "direct"])
def test_claims_score_from_the_gpu_copy_of_the_metadata(claim_launch):
    """Scored from the store's GPU copy of the metadata (`kv_cache.gpu_metadata`), claims attend
    exactly what they attend when scoring from the arena; only the metadata's bytes move from
    the host count (`bytes_read`) to the device count (`device_bytes_read`)."""
    bounds = [(0, 1), (1, 4)]
    out_a, lse_a, bytes_a, ex_a = _claims_through_executor(claim_launch, bounds)
    out_m, lse_m, bytes_m, ex_m = _claims_through_executor(claim_launch, bounds, gpu_metadata=True)
    assert torch.equal(out_m, out_a) and torch.equal(lse_m, lse_a)
    meta = np.array([-(-n // 16) * 2 * 32 * 2 for n in (700 - 48, 700 - 48, 420 - 48, 420 - 48)])  # blocks x (min, max) x D x bf16
    assert np.array_equal(bytes_a - bytes_m, meta) and (bytes_m > 0).all()
    assert ex_a.device_bytes_read == 0 and ex_m.device_bytes_read == meta.sum()
    assert ex_m.bytes_read == bytes_m.sum() and ex_a.bytes_read == bytes_a.sum()
    ex_m.use_gpu_metadata = False  # the arena again (benchmarks compare the two on one runtime)
    assert ex_m._metadata_source(0, ex_m._arena(0)).on_device is False


@_gpu
def test_runtime_decodes_the_same_with_and_without_the_gpu_metadata_copy():
    """Through the runtime on CUDA (gpu_only: every task on the GPU lane, so the lanes' rounding
    cannot differ): prompts, decode steps that spill window pages into the CPU segment, and a
    released sequence's chunks reused -- the copy of the metadata gives the arena's selections."""
    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.runtime import HybridRuntime

    def run(gpu_metadata: bool) -> tuple[list, dict]:
        cfg = config_from_dict({
            "geometry": {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 64},
            "kv_cache": {"sink": 16, "local": 64, "generated_cap": 32, "cpu_capacity_tokens": 16384,
                         "max_sequences": 3, "gpu_metadata": gpu_metadata},
            "selection": {"block_size": 16, "budget": 0.1},
            "scheduler": {"placement": "gpu_only", "cpu_workers": 0, "pin_cores": False},
        })
        gen = torch.Generator(device="cuda").manual_seed(5)
        outs = []
        with HybridRuntime(cfg) as rt:
            assert (rt.store.metadata_gpu(0) is not None) == gpu_metadata
            for s, n in ((0, 3000), (1, 1700), (2, 900)):
                for layer in range(2):
                    k, v = torch.randn((2, n, 2, 64), generator=gen, device="cuda", dtype=torch.bfloat16)
                    rt.prefill(s, layer, k, v)
            rt.release(2)
            for layer in range(2):
                k, v = torch.randn((2, 2500, 2, 64), generator=gen, device="cuda", dtype=torch.bfloat16)
                rt.prefill(2, layer, k, v)  # into the released chunks
            for _ in range(40):  # 40 tokens past local + generated_cap: spills
                for layer in range(2):
                    q = torch.randn((3, 8, 64), generator=gen, device="cuda", dtype=torch.bfloat16)
                    k, v = torch.randn((2, 3, 2, 64), generator=gen, device="cuda", dtype=torch.bfloat16)
                    outs.append(rt.decode(layer, [0, 1, 2], q, k, v).float().cpu())
            stats = {"host": rt.gpu_executor.bytes_read, "device": rt.gpu_executor.device_bytes_read}
        return outs, stats

    with_copy, bytes_copy = run(True)
    without, bytes_arena = run(False)
    assert all(torch.equal(a, b) for a, b in zip(with_copy, without))
    assert bytes_arena["device"] == 0 and bytes_copy["device"] > 0
    assert bytes_copy["host"] + bytes_copy["device"] == bytes_arena["host"]
