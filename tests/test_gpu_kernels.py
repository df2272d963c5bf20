"""Triton kernels of the GPU path against torch references.

Without CUDA the kernels run under Triton's interpreter on CPU tensors (small shapes: the
interpreter executes every program in numpy). Triton reads TRITON_INTERPRET when a kernel is
decorated, i.e. when a `gpu_kernels` module is first imported in the process, so it is set here
before those imports -- and also in `gpu_kernels/__init__.py`, so the order in which pytest
imports test modules (another module may import the executor first) cannot defeat it.

With CUDA, the same tests run compiled with the arena pinned and read through a UVA view, and the
`gpu`-marked tests add real shapes (Llama-3.1-8B heads, thousands of CPU tokens).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cpu_kernels import layout  # noqa: E402
from gpu_kernels.block_scores import quest_scores, select_blocks  # noqa: E402
from gpu_kernels.lse_merge import merge_attention  # noqa: E402
from gpu_kernels.sparse_attention import SparseConfig, sparse_attention, sparse_attention_selected  # noqa: E402
from gpu_kernels.task_table import SparseTaskTable  # noqa: E402
from gpu_kernels.window_attention import window_attention  # noqa: E402
from hybrid_runtime import reference  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


def _gpu(fn):
    for m in gpu:
        fn = m(fn)
    return fn


# ---------------------------------------------------------------------------- arena builders
@dataclass
class Arena:
    arena: torch.Tensor  # [n_chunks, CHUNK_ROWS, D] on DEV (a UVA view of pinned memory with CUDA)
    host: torch.Tensor  # the host arena
    chunks: dict  # (seq, kv_head) -> np.int32 chunk ids
    keys: dict  # (seq, kv_head) -> [cpu_len, D] fp32 as stored
    values: dict
    cpu_lens: list


def chunk_metadata(keys: torch.Tensor, valid: int) -> torch.Tensor:
    """[N, 128, D] keys of consecutive chunks -> [N, 30, D] metadata rows (min, max per entry)."""
    n, _, d = keys.shape
    mask = (torch.arange(n * layout.CHUNK_TOKENS) < valid).view(n, layout.CHUNK_TOKENS, 1)
    kmin = torch.where(mask, keys, float("inf"))
    kmax = torch.where(mask, keys, float("-inf"))
    mins, maxs = [], []
    for blk in layout.BLOCK_SIZES:
        per = layout.CHUNK_TOKENS // blk
        mins.append(kmin.view(n, per, blk, d).amin(2))
        maxs.append(kmax.view(n, per, blk, d).amax(2))
    meta = torch.stack([torch.cat(mins, 1), torch.cat(maxs, 1)], 2)
    meta = torch.where(torch.isfinite(meta), meta, torch.zeros(()))
    return meta.view(n, 2 * layout.META_ENTRIES, d)


def build_arena(cpu_lens: list, hkv: int, d: int, dtype: torch.dtype, seed: int = 0) -> Arena:
    """Random K/V per (sequence, KV head) in shuffled chunks (unused chunks in between, so an
    indexing bug cannot hide behind an identity layout); rows past a length are zero."""
    gen = torch.Generator().manual_seed(seed)
    per_head = [-(-n // layout.CHUNK_TOKENS) for n in cpu_lens]
    total = sum(per_head) * hkv + 3
    perm = torch.randperm(total, generator=gen).numpy().astype(np.int32)
    host = torch.zeros((total, layout.CHUNK_ROWS, d), dtype=dtype, pin_memory=CUDA)
    host.view(torch.int16 if dtype != torch.float32 else torch.int32).fill_(0x7FC0 if dtype == torch.bfloat16 else -1)  # poison unused
    chunks, keys, values = {}, {}, {}
    nxt = 0
    for s, n in enumerate(cpu_lens):
        nc = per_head[s]
        for h in range(hkv):
            ids = perm[nxt : nxt + nc]
            nxt += nc
            scale = 1.0 + float(torch.rand(1, generator=gen))
            shift = torch.randn((nc * layout.CHUNK_TOKENS // 16, 1, d), generator=gen) * 0.5
            k = (torch.randn((nc * layout.CHUNK_TOKENS // 16, 16, d), generator=gen) * scale + shift).view(-1, d)
            v = torch.randn((nc * layout.CHUNK_TOKENS, d), generator=gen)
            k[n:] = 0
            v[n:] = 0
            kq, vq = k.to(dtype), v.to(dtype)
            idx = torch.from_numpy(ids).long()
            host[idx, layout.K_ROW : layout.K_ROW + layout.CHUNK_TOKENS] = kq.view(nc, -1, d)
            host[idx, layout.V_ROW : layout.V_ROW + layout.CHUNK_TOKENS] = vq.view(nc, -1, d)
            host[idx, layout.META_ROW :] = chunk_metadata(kq.float().view(nc, -1, d), n).to(dtype)
            chunks[(s, h)] = ids
            keys[(s, h)] = kq[:n].float()
            values[(s, h)] = vq[:n].float()
    if CUDA:
        from gpu_kernels.uva import uva_view

        arena = uva_view(host)
    else:
        arena = host
    return Arena(arena, host, chunks, keys, values, list(cpu_lens))


def quest_reference(q: torch.Tensor, keys: torch.Tensor, blk: int) -> torch.Tensor:
    """Quest scores `[G, n_blocks]` (float64 sums) of q `[G, D]` over stored keys `[L, D]`."""
    n, d = keys.shape
    nb = -(-n // blk)
    pad = torch.zeros((nb * blk, d))
    pad[:n] = keys
    valid = (torch.arange(nb * blk) < n).view(nb, blk, 1)
    kmin = torch.where(valid, pad.view(nb, blk, d), float("inf")).amin(1)
    kmax = torch.where(valid, pad.view(nb, blk, d), float("-inf")).amax(1)
    qd = q.double()[:, None, :]
    return torch.maximum(qd * kmax.double(), qd * kmin.double()).sum(-1)


def attend_blocks(q, keys, values, blocks, blk):
    """Per-head attention (float64) over its own blocks; q `[G, D]` pre-scaled."""
    g, d = q.shape
    n = keys.shape[0]
    outs, lses = [], []
    for h in range(g):
        b = blocks[h].long().cpu()
        tok = (b[:, None] * blk + torch.arange(blk)).reshape(-1)
        tok = tok[tok < n]
        if tok.numel() == 0:
            outs.append(torch.zeros(d, dtype=torch.float64))
            lses.append(torch.tensor(float("-inf"), dtype=torch.float64))
            continue
        s = keys[tok].double() @ q[h].double()
        lse = torch.logsumexp(s, 0)
        outs.append(torch.exp(s - lse) @ values[tok].double())
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------- task sets
@dataclass
class Case:
    ar: Arena
    plan: SparseTaskTable
    q: torch.Tensor  # [B, Hq, D] fp32 on DEV, pre-scaled
    tasks: list  # (seq, kv_head, blk)
    n_select: np.ndarray
    hq: int
    g: int


def make_case(cpu_lens, hkv, g, d, dtype, blks, budget, seed=0, streaming=False) -> Case:
    """Tasks for every (sequence, KV head), block sizes cycling through `blks`.

    budget: a float (fraction for every head) or "random" (per-head random fractions, with
    streaming heads -- n_select 0 -- and one all-streaming task when `streaming`).
    """
    ar = build_arena(cpu_lens, hkv, d, dtype, seed)
    rng = np.random.default_rng(seed)
    b = len(cpu_lens)
    hq = hkv * g
    q = (torch.randn((b, hq, d), generator=torch.Generator().manual_seed(seed + 1)) / math.sqrt(d)).to(DEV)
    tasks, nsel = [], []
    for s in range(b):
        for h in range(hkv):
            blk = blks[(s * hkv + h) % len(blks)]
            nb = -(-cpu_lens[s] // blk)
            if budget == "random":
                frac = rng.uniform(0.0, 0.6, size=g)
                n = np.minimum(nb, np.ceil(frac * nb)).astype(np.int32)
                if streaming:
                    n[rng.integers(g)] = 0
                    if (s, h) == (0, 0):
                        n[:] = 0
            else:
                n = np.full(g, min(nb, math.ceil(budget * nb)), dtype=np.int32)
            tasks.append((s, h, blk))
            nsel.append(n)
    n_select = np.stack(nsel)
    plan = SparseTaskTable.build(
        batch_index=[t[0] for t in tasks],
        kv_head=[t[1] for t in tasks],
        block_size=[t[2] for t in tasks],
        cpu_len=[cpu_lens[t[0]] for t in tasks],
        chunks=[ar.chunks[(t[0], t[1])] for t in tasks],
        n_select=n_select,
        n_arena_chunks=ar.arena.shape[0],
        device=DEV,
    )
    return Case(ar, plan, q, tasks, n_select, hq, g)


SMALL = dict(cpu_lens=[300, 129, 40], hkv=2, g=2, d=32)
LARGE = dict(cpu_lens=[8000, 5003, 3072, 700], hkv=8, g=4, d=128)


# ---------------------------------------------------------------------------- scoring + selection
def check_scores_and_selection(c: Case, paired: bool = False) -> None:
    scores = quest_scores(c.plan, c.q, c.ar.arena, paired=paired)
    sel = select_blocks(c.plan, scores)
    for i, (s, h, blk) in enumerate(c.tasks):
        ref = quest_reference(c.q[s, h * c.g : (h + 1) * c.g].cpu(), c.ar.keys[(s, h)], blk)
        nb = ref.shape[1]
        got = scores[i, :, :nb].cpu().double()
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), f"task {i}: scores differ"
        assert torch.isinf(scores[i, :, nb:]).all()
        chosen = sel.selected[i, :, :nb].cpu()
        for gg in range(c.g):
            k = int(c.n_select[i, gg])
            assert int(chosen[gg].sum()) == k
            if 0 < k < nb:
                # Every chosen block scores at least as high as every unchosen one (up to rounding).
                assert ref[gg][chosen[gg]].min() >= ref[gg][~chosen[gg]].max() - 1e-4
        union = chosen.any(0)
        cnt = int(sel.counts[i])
        assert cnt == int(union.sum())
        assert sel.blocks[i, :cnt].cpu().tolist() == torch.nonzero(union).flatten().tolist()
        bits = sum(chosen[gg].long() << gg for gg in range(c.g))
        assert sel.heads[i, :cnt].cpu().tolist() == bits[union].tolist()


@pytest.mark.parametrize("dtype,paired", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_quest_scores_and_topk(dtype, paired):
    c = make_case(**SMALL, dtype=dtype, blks=(16, 32, 64, 128), budget="random", streaming=True)
    check_scores_and_selection(c, paired)


def test_topk_one_budget_for_all_heads():
    # Every head of every task keeps the same number of blocks: the unsorted top-k path.
    c = make_case(cpu_lens=[300, 290], hkv=2, g=2, d=32, dtype=torch.bfloat16, blks=(16,), budget=0.3)
    assert (c.n_select == c.n_select.max()).all()
    check_scores_and_selection(c)


@_gpu
@pytest.mark.parametrize("paired", [False, True])
def test_quest_scores_and_topk_large(paired):
    c = make_case(**LARGE, dtype=torch.bfloat16, blks=(16, 32, 64, 128), budget="random", streaming=True, seed=3)
    check_scores_and_selection(c, paired)


# ---------------------------------------------------------------------------- sparse attention
def run_sparse(c: Case, config: SparseConfig = SparseConfig()):
    b = len(c.ar.cpu_lens)
    d = c.q.shape[2]
    out = torch.full((b, c.hq, d), 7.0, device=DEV)  # poison: rows without a task must keep it
    lse = torch.full((b, c.hq), 3.0, device=DEV)
    res = sparse_attention(c.plan, c.q, c.ar.arena, out, lse, config)
    return out.cpu(), lse.cpu(), res


def check_sparse_against_selection(c: Case, out, lse, res, tol: float) -> None:
    sel = res.selection.selected.cpu()
    check_heads_attend(c, out, lse, lambda i: [torch.nonzero(sel[i, gg]).flatten() for gg in range(c.g)], tol)


def check_heads_attend(c: Case, out, lse, blocks_of, tol: float) -> None:
    """Every task's heads against float64 attention over their own blocks (`blocks_of(task)`: one
    tensor of block ids per head); a head without blocks must hold out 0, lse -inf."""
    for i, (s, h, blk) in enumerate(c.tasks):
        blocks = blocks_of(i)
        ro, rl = attend_blocks(c.q[s, h * c.g : (h + 1) * c.g].cpu(), c.ar.keys[(s, h)], c.ar.values[(s, h)], blocks, blk)
        go, gl = out[s, h * c.g : (h + 1) * c.g], lse[s, h * c.g : (h + 1) * c.g]
        for gg in range(c.g):
            if blocks[gg].numel() == 0:
                assert gl[gg] == float("-inf") and (go[gg] == 0).all(), f"task {i} head {gg}: empty head"
            else:
                assert rel_err(go[gg], ro[gg]) < tol, f"task {i} head {gg}: out err {rel_err(go[gg], ro[gg])}"
                assert abs(float(gl[gg]) - float(rl[gg])) < tol * max(1.0, abs(float(rl[gg])))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_random_budgets_match_reference(dtype):
    c = make_case(**SMALL, dtype=dtype, blks=(16, 32, 64, 128), budget="random", streaming=True, seed=1)
    out, lse, res = run_sparse(c, SparseConfig(block_n=32, pages_per_split=3))
    check_sparse_against_selection(c, out, lse, res, tol=5e-3)


def test_sparse_budget_one_equals_dense():
    c = make_case(**SMALL, dtype=torch.bfloat16, blks=(16, 64), budget=1.0, seed=2)
    out, lse, _ = run_sparse(c, SparseConfig(block_n=32, pages_per_split=4))
    for s, n in enumerate(c.ar.cpu_lens):
        k = torch.stack([c.ar.keys[(s, h)] for h in range(2)], 1)  # [L, Hkv, D]
        v = torch.stack([c.ar.values[(s, h)] for h in range(2)], 1)
        ro, rl = reference.dense_attention(c.q[s].cpu(), k, v, scale=1.0)
        assert rel_err(out[s], ro) < 5e-3
        assert torch.allclose(lse[s], rl, atol=5e-3)


def test_sparse_heads_without_task_untouched():
    c = make_case(cpu_lens=[200], hkv=2, g=2, d=32, dtype=torch.bfloat16, blks=(16,), budget=0.5, seed=4)
    plan = SparseTaskTable.build(
        batch_index=[0], kv_head=[1], block_size=[32], cpu_len=[200], chunks=[c.ar.chunks[(0, 1)]],
        n_select=np.array([[2, 0]], dtype=np.int32), n_arena_chunks=c.ar.arena.shape[0], device=DEV,
    )
    out = torch.full((1, 4, 32), 7.0, device=DEV)
    lse = torch.full((1, 4), 3.0, device=DEV)
    sparse_attention(plan, c.q, c.ar.arena, out, lse)
    assert (out[0, :2] == 7.0).all() and (lse[0, :2] == 3.0).all()
    assert lse[0, 3] == float("-inf") and (out[0, 3] == 0).all()
    assert torch.isfinite(lse[0, 2])


@_gpu
@pytest.mark.parametrize("budget,config", [
    (1.0, SparseConfig()), ("random", SparseConfig()),
    ("random", SparseConfig(num_warps=8, block_n=32, pages_per_split=4, score_block_b=32)),
    (0.05, SparseConfig(block_n=128, pages_per_split=16)),
])
def test_sparse_large(budget, config):
    c = make_case(**LARGE, dtype=torch.bfloat16, blks=(16, 32, 64, 128), budget=budget, streaming=True, seed=5)
    out, lse, res = run_sparse(c, config)
    check_sparse_against_selection(c, out, lse, res, tol=5e-3)


# ---------------------------------------------------------------------------- window attention
def check_window(b, hkv, g, d, w, dtype, lengths, n_splits, block_n=64, seed=0):
    # On the GPU a bf16 window is attended with bf16 dot operands (q and p rounded to 8 bits,
    # like SDPA in bf16); the interpreter uses fp32 operands.
    tol = 1e-2 if (CUDA and dtype != torch.float32) else 5e-3
    gen = torch.Generator().manual_seed(seed)
    n_slots = b + 2
    k = torch.randn((n_slots, hkv, w, d), generator=gen).to(dtype)
    v = torch.randn((n_slots, hkv, w, d), generator=gen).to(dtype)
    q = torch.randn((b, hkv * g, d), generator=gen) / math.sqrt(d)
    slots = torch.randperm(n_slots, generator=gen)[:b].to(torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    args = (q.to(DEV), k.to(DEV), v.to(DEV), slots.to(DEV), lens.to(DEV))
    out, lse = window_attention(*args, n_splits=n_splits, block_n=block_n)
    out, lse = out.cpu(), lse.cpu()
    # Again: the split path's arrival counters must have been reset by the first call.
    out2, lse2 = window_attention(*args, n_splits=n_splits, block_n=block_n)
    assert torch.equal(out2.cpu(), out) and torch.equal(lse2.cpu(), lse)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            assert (lse[i] == float("-inf")).all() and (out[i] == 0).all()
            continue
        kk = k[slots[i], :, :n].transpose(0, 1)  # [L, Hkv, D]
        vv = v[slots[i], :, :n].transpose(0, 1)
        ro, rl = reference.dense_attention(q[i].double(), kk.double(), vv.double(), scale=1.0)
        assert rel_err(out[i], ro) < tol, f"row {i}"
        assert torch.allclose(lse[i].double(), rl.double(), atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_window_attention_variable_lengths_gqa(dtype, n_splits):
    check_window(b=3, hkv=2, g=2, d=32, w=80, dtype=dtype, lengths=[80, 17, 0], n_splits=n_splits, block_n=16)


@_gpu
def test_window_attention_large():
    check_window(b=8, hkv=8, g=4, d=128, w=848, dtype=torch.bfloat16,
                 lengths=[848, 320, 321, 1, 600, 0, 847, 64], n_splits=None)


# ---------------------------------------------------------------------------- merge
def check_merge(rows, d):
    gen = torch.Generator().manual_seed(rows)
    oa, ob = torch.randn((rows, d), generator=gen), torch.randn((rows, d), generator=gen)
    la, lb = torch.randn(rows, generator=gen) * 3, torch.randn(rows, generator=gen) * 3
    la[::5] = float("-inf")
    lb[::7] = float("-inf")
    oa[::5] = float("nan")  # an empty part's out must not leak
    ro, rl = reference.merge_attention(torch.where(torch.isnan(oa), 0, oa), la, ob, lb)
    go, gl = merge_attention(oa.to(DEV), la.to(DEV), ob.to(DEV), lb.to(DEV))
    assert torch.allclose(go.cpu(), ro, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(gl.cpu()), torch.isinf(rl))
    assert torch.allclose(gl.cpu()[torch.isfinite(rl)], rl[torch.isfinite(rl)], atol=1e-5)
    # In place into the first part.
    a, al = oa.clone().to(DEV), la.clone().to(DEV)
    merge_attention(a, al, ob.to(DEV), lb.to(DEV), out=a, lse=al)
    assert torch.allclose(a.cpu(), ro, atol=1e-5, rtol=1e-5)


def test_merge():
    check_merge(rows=70, d=32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_merge_of_three_parts_into_the_callers_dtype(out_dtype):
    # The decode step's final merge: window, CPU lane and GPU lane parts; empty parts (lse -inf,
    # out NaN) add nothing; the output is written in the caller's dtype, lse in place.
    gen = torch.Generator().manual_seed(3)
    rows, d = 45, 32
    outs = [torch.randn((rows, d), generator=gen) for _ in range(3)]
    lses = [torch.randn(rows, generator=gen) * 3 for _ in range(3)]
    lses[1][::4] = float("-inf")
    lses[2][::3] = float("-inf")
    lses[0][::6] = float("-inf")
    for o, lz in zip(outs, lses):
        o[torch.isinf(lz)] = float("nan")
    clean = [torch.where(torch.isnan(o), 0, o) for o in outs]
    ro, rl = reference.merge_attention(clean[0], lses[0], clean[1], lses[1])
    ro, rl = reference.merge_attention(ro, rl, clean[2], lses[2])
    final = torch.empty((rows, d), dtype=out_dtype, device=DEV)
    la = lses[0].clone().to(DEV)
    merge_attention(outs[0].to(DEV), la, outs[1].to(DEV), lses[1].to(DEV), out=final, lse=la,
                    out_c=outs[2].to(DEV), lse_c=lses[2].to(DEV))
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    assert final.dtype == out_dtype and torch.allclose(final.float().cpu(), ro, atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(la.cpu()), torch.isinf(rl))
    assert torch.allclose(la.cpu()[torch.isfinite(rl)], rl[torch.isfinite(rl)], atol=1e-5)
    with pytest.raises(ValueError, match="out_c and lse_c"):
        merge_attention(outs[0].to(DEV), la, outs[1].to(DEV), la, out_c=outs[2].to(DEV))


@_gpu
def test_merge_large():
    check_merge(rows=8 * 32, d=128)


# ---------------------------------------------------------------------------- errors
def test_bad_arguments_raise_clear_errors():
    c = make_case(cpu_lens=[64], hkv=1, g=2, d=32, dtype=torch.bfloat16, blks=(16,), budget=0.5)
    with pytest.raises(ValueError, match="q has dtype"):
        quest_scores(c.plan, c.q.to(torch.float16), c.ar.arena)
    with pytest.raises(ValueError, match="arena has shape"):
        quest_scores(c.plan, c.q, c.ar.arena[:, :100])
    with pytest.raises(ValueError, match="n_select"):
        SparseTaskTable.build(batch_index=[0], kv_head=[0], block_size=[16], cpu_len=[64],
                              chunks=[c.ar.chunks[(0, 0)]], n_select=np.array([[5, 1]]),
                              n_arena_chunks=c.ar.arena.shape[0], device=DEV)
    with pytest.raises(ValueError, match="block_size"):
        SparseTaskTable.build(batch_index=[0], kv_head=[0], block_size=[24], cpu_len=[64],
                              chunks=[c.ar.chunks[(0, 0)]], n_select=np.array([[1, 1]]),
                              n_arena_chunks=c.ar.arena.shape[0], device=DEV)
    with pytest.raises(ValueError, match="chunk ids"):
        SparseTaskTable.build(batch_index=[0], kv_head=[0], block_size=[16], cpu_len=[64],
                              chunks=[np.array([10**6], np.int32)], n_select=np.array([[1, 1]]),
                              n_arena_chunks=c.ar.arena.shape[0], device=DEV)
    with pytest.raises(ValueError, match="fewer than its cpu_len"):
        SparseTaskTable.build(batch_index=[0], kv_head=[0], block_size=[16], cpu_len=[200],
                              chunks=[c.ar.chunks[(0, 0)]], n_select=np.array([[1, 1]]),
                              n_arena_chunks=c.ar.arena.shape[0], device=DEV)
    q = torch.zeros((2, 4, 32), device=DEV)
    k = torch.zeros((2, 3, 8, 32), device=DEV)
    lens = torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="not a multiple"):
        window_attention(q, k, k, lens, lens)
    with pytest.raises(ValueError, match="lse_b has shape"):
        merge_attention(q, q[..., 0].contiguous(), q, q[..., :2, 0].contiguous())


@pytest.mark.skipif(CUDA, reason="checks the message on a machine without CUDA")
def test_uva_view_without_cuda_raises():
    from gpu_kernels.uva import uva_view

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        uva_view(torch.zeros(4))


# ---------------------------------------------------------------------------- UVA (device only)
@_gpu
def test_uva_view_aliases_pinned_memory():
    from gpu_kernels.uva import uva_view

    host = torch.zeros((1024, 128), dtype=torch.bfloat16, pin_memory=True)
    view = uva_view(host)
    assert view.is_cuda and view.shape == host.shape and view.dtype == host.dtype
    host[3, 5] = 2.5  # host write -> visible on the device without any copy
    assert float(view[3, 5].item()) == 2.5
    view[7].fill_(-1.0)  # device write -> visible on the host
    torch.cuda.synchronize()
    assert (host[7] == -1.0).all()
    del host
    import gc

    gc.collect()
    assert float(view[3, 5].item()) == 2.5  # the view keeps the pinned buffer alive
    with pytest.raises(ValueError, match="not pinned"):
        uva_view(torch.zeros(16))
    with pytest.raises(ValueError, match="host"):
        uva_view(torch.zeros(16, device="cuda"))


# ---------------------------------------------------------------------------- executor on a KVStore
def run_executor_case(geom_kw: dict, seqs: list, block_size: int, budget: float, seed: int = 0):
    from hybrid_runtime.config import GeometryConfig, KVCacheConfig
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
    from hybrid_runtime.kvcache import KVStore
    from hybrid_runtime.tasks import Step, Task, blocks_for_budget

    geom = GeometryConfig("t", 1, **geom_kw)
    kv = KVCacheConfig(sink=16, local=32, generated_cap=32, dtype="bf16",
                       cpu_capacity_tokens=sum(seqs) + 256, max_sequences=len(seqs), device="auto")
    store = KVStore(kv, geom)
    gen = torch.Generator().manual_seed(seed)
    hkv, d, g = geom.kv_heads, geom.head_dim, geom.group_size
    for i, n in enumerate(seqs):
        store.prefill(i, 0, torch.randn((n, hkv, d), generator=gen), torch.randn((n, hkv, d), generator=gen))
    q = (torch.randn((len(seqs), geom.q_heads, d), generator=gen) / math.sqrt(d)).to(DEV)
    step = Step.empty(0, q, g)
    tasks = []
    for i in range(len(seqs)):
        cl = store.cpu_len(i, 0)
        table = store.chunk_table(i, 0)
        for h in range(hkv):
            nsel = np.full(g, blocks_for_budget(budget, cl, block_size), dtype=np.int32)
            tasks.append(Task(i, 0, h, i, block_size, np.full(g, budget, np.float32), nsel, cl, table[h]))
    ex = GpuUvaExecutor(store)
    ex.run(tasks, step)
    return store, step, tasks, ex


def check_executor_budget_one(geom_kw, seqs, block_size):
    store, step, tasks, ex = run_executor_case(geom_kw, seqs, block_size, budget=1.0)
    d = geom_kw["head_dim"]
    for i in range(len(seqs)):
        k, v = store.full_kv(i, 0)
        s0 = store.cfg.sink
        cl = store.cpu_len(i, 0)
        ro, rl = reference.dense_attention(step.q[i].cpu(), k[s0 : s0 + cl], v[s0 : s0 + cl], scale=1.0)
        assert rel_err(step.out[i].cpu(), ro) < 5e-3
        assert torch.allclose(step.lse[i].cpu(), rl, atol=5e-3)
    esize = 2
    for t in tasks:
        nb = -(-t.cpu_len // block_size)
        assert t.device == "gpu"
        assert t.bytes_read == nb * 2 * d * esize + nb * block_size * 2 * d * esize
    assert ex.bytes_read == sum(t.bytes_read for t in tasks)


def test_executor_budget_one_equals_dense_on_kvstore():
    check_executor_budget_one(dict(q_heads=4, kv_heads=2, head_dim=32), seqs=[260, 100], block_size=32)


@_gpu
def test_executor_budget_one_equals_dense_on_kvstore_large():
    check_executor_budget_one(dict(q_heads=32, kv_heads=8, head_dim=128), seqs=[4000, 2500], block_size=16)
