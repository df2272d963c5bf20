"""AsyncTLS: INT4 token index, block and token levels, resident cache and lag, config, runtime wiring."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from cpu_kernels import layout
from hybrid_runtime.config import ConfigError, config_from_dict
from hybrid_runtime.executors.asynctls import (
    AsyncTlsExecutor,
    block_scores,
    cache_slots,
    exact_attention,
    memory_bytes,
    token_scores,
)
from hybrid_runtime.memory_plan import estimate_runtime, estimate_synthetic_run
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.resident_cache import ResidentCache, fresh_age, plan_insert, plan_update, plan_update_aged
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.token_index import ChannelSets, channel_scores, dequantize_int4, quantize_int4
from tests.helpers import DEV

GEOMETRY = {"layers": 2, "q_heads": 6, "kv_heads": 2, "head_dim": 32}
D_C = 8


def asynctls_config(geometry: dict | None = None, kv: dict | None = None, profiling: dict | None = None,
                    **selection) -> "Config":  # noqa: F821
    kv_cache = {"sink": 16, "local": 64, "generated_cap": 64, "cpu_capacity_tokens": 2048, "max_sequences": 2,
                "dtype": "fp32"}
    kv_cache.update(kv or {})
    return config_from_dict({
        "geometry": geometry or GEOMETRY, "kv_cache": kv_cache, "profiling": profiling or {},
        "scheduler": {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False},
        "selection": {"name": "asynctls", "block_size": 16, "blocks": 4, "tokens": 32, "index_channels": D_C,
                      **selection}})


def channels_for(geometry: dict, d_c: int = D_C, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranked = torch.stack([torch.stack([torch.randperm(geometry["head_dim"], generator=gen)
                                       for _ in range(geometry["kv_heads"])]) for _ in range(geometry["layers"])])
    return ranked[..., :d_c].sort(-1).values


def runtime(cfg, channels: torch.Tensor | None = None, device: str | None = None) -> HybridRuntime:
    g = dataclasses.asdict(cfg.geometry)
    ch = channels_for(g) if channels is None else channels
    return HybridRuntime(cfg, gpu_executor=lambda store: AsyncTlsExecutor(store, cfg.selection, ch, device=device))


def prefill_random(rt: HybridRuntime, seq: int, length: int, seed: int = 0, q_last=None):
    g = rt.geometry
    gen = torch.Generator().manual_seed(seed)
    ks, vs = [], []
    for layer in range(g.layers):
        k = torch.randn(length, g.kv_heads, g.head_dim, generator=gen)
        v = torch.randn(length, g.kv_heads, g.head_dim, generator=gen)
        q = torch.randn(g.q_heads, g.head_dim, generator=gen) if q_last is None else q_last
        rt.prefill(seq, layer, k, v, q_last=q)
        ks.append(k)
        vs.append(v)
    return ks, vs


# ---------------------------------------------------------------------------- INT4 index
def test_int4_round_trip_error_is_at_most_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=gen) * torch.logspace(-3, 2, 4096)[:, None]
    x[0] = 1.5  # a constant row comes back exactly
    codes, params = quantize_int4(x)
    assert codes.dtype == torch.uint8 and codes.shape == (4096, 8) and params.shape == (4096, 2)
    back = dequantize_int4(codes, params)
    scale = (x.amax(1) - x.amin(1)) / 15
    err = (back - x).abs().amax(1)
    assert bool((err <= scale / 2 * (1 + 1e-4) + 1e-6 * x.abs().amax(1)).all())
    assert torch.equal(back[0], x[0])
    assert bool((err[1:] > 0).any())  # it is a quantization, not a copy
    # Both nibbles carry a code: the extremes of a row map to 0 and 15.
    q = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
    assert int(q.min()) == 0 and int(q.max()) == 15
    with pytest.raises(ValueError, match="even number"):
        quantize_int4(torch.zeros(3, 5))


def test_shipped_channel_file_and_calibration_score():
    sets = ChannelSets.load("hybrid_runtime/calibration/smollm2_channels.json")
    assert (sets.layers, sets.kv_heads, sets.head_dim) == (30, 3, 64) and sets.model == "smollm2-135m"
    ch = sets.channels(16)
    assert ch.shape == (30, 3, 16) and bool((ch.diff(dim=-1) > 0).all())
    # The ranking follows the recorded scores.
    top = sets.scores.gather(-1, sets.ranked)
    assert bool((top.diff(dim=-1) <= 0).all())
    assert sets.calibration["first_token"] + sets.calibration["tokens"] <= 30000  # before the evaluation text
    # score_i = mean_h max|q_h[i]| * max|k[i]| over the group's heads.
    q_absmax = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 1.0], [1.0, 1.0]])  # 4 q heads, 2 KV heads
    k_absmax = torch.tensor([[2.0, 1.0], [1.0, 4.0]])
    assert torch.allclose(channel_scores(q_absmax, k_absmax), torch.tensor([[4.0, 1.0], [3.0, 4.0]]))


def test_channel_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "x", "layers": 1, "kv_heads": 1, "head_dim": 4, "ranked": [[[0, 0, 1, 2]]],
                               "scores": [[[1, 1, 1, 1]]]}))
    with pytest.raises(ValueError, match="permutation"):
        ChannelSets.load(bad)
    with pytest.raises(ValueError, match="not a channel file"):
        ChannelSets.load(tmp_path / "missing.json")
    cfg = asynctls_config(geometry={"name": "llama-3.1-8b", "layers": 1}, block_size=64, blocks=4, tokens=64)
    with pytest.raises(ConfigError, match="channel_file.*calibrated for 'smollm2-135m'"):
        HybridRuntime(cfg)


def test_index_matches_the_store_and_counts_its_memory():
    cfg = asynctls_config()
    with runtime(cfg) as rt:
        prefill_random(rt, 0, 700)
        ex = rt.gpu_executor
        store = rt.store
        for layer in range(2):
            table = store.chunk_table(0, layer)
            block_meta = ex.index.block_meta[layer].cpu()  # the index lives on the executor's device
            for h in range(2):
                meta = block_meta[torch.from_numpy(table[h]).long()].reshape(-1, 2, 32)
                ref = store.block_metadata(0, layer, h, 16)
                assert torch.equal(meta[: ref.shape[0]], ref)
            k_cpu = store.full_kv(0, layer)[0][16 : 16 + store.cpu_len(0, layer)]  # [L_cpu, Hkv, D]
            n = k_cpu.shape[0]
            pos = torch.arange(n)
            cid = torch.from_numpy(table).long()[:, pos // 128]  # [Hkv, n]
            approx = ex.index.keys(layer, cid.to(ex.dev), (pos % 128).expand_as(cid).to(ex.dev)).cpu()  # [Hkv, n, d_c]
            exact = k_cpu.transpose(0, 1).gather(2, ex.index.channels[layer].cpu()[:, None, :].expand(-1, n, -1))
            step = (exact.amax(-1) - exact.amin(-1)) / 15
            assert bool(((approx - exact).abs() <= step[..., None] / 2 + 1e-5).all())
        sizes = memory_bytes(cfg.selection, cfg.kv_cache, cfg.geometry, store.n_chunks)
        assert ex.index.nbytes == sizes["index"] and ex.cache.nbytes == sizes["cache"]
        assert ex.nbytes == sizes["index"] + sizes["cache"]
        plan = {p.name: p.nbytes for p in estimate_runtime(cfg, cuda=False).parts}
        assert plan["asynctls_index"] == sizes["index"] and plan["asynctls_cache"] == sizes["cache"]
        assert "torch_lane_task" not in plan and plan["asynctls_step"] == sizes["step"]
        synthetic = {p.name for p in estimate_synthetic_run(cfg, cuda=False).parts}  # hybrid-runtime run's plan
        assert "asynctls_cache" in synthetic and "torch_lane_task" not in synthetic


# ---------------------------------------------------------------------------- block and token levels
def test_gemm_block_scores_equal_summed_quest_bounds():
    gen = torch.Generator().manual_seed(1)
    r, n, g, d = 3, 20, 4, 32
    lo = torch.randn(r, n, d, generator=gen)
    meta = torch.stack([lo, lo + torch.rand(r, n, d, generator=gen)], 2)  # [R, N, (min, max), D]
    q = torch.randn(r, g, d, generator=gen)
    quest = torch.maximum(q[:, :, None] * meta[:, None, :, 0], q[:, :, None] * meta[:, None, :, 1]).sum(-1)  # [R, G, N]
    assert torch.allclose(block_scores(meta, q), quest.sum(1), atol=1e-4)


def test_token_selection_equals_a_reference_on_the_same_index():
    cfg = asynctls_config(blocks=6, tokens=24)
    with runtime(cfg) as rt:
        prefill_random(rt, 0, 800, seed=3)
        ex = rt.gpu_executor
        store = rt.store
        layer, hkv, g = 1, 2, 3
        gen = torch.Generator().manual_seed(4)
        q = torch.randn(hkv, g, 32, generator=gen) / math.sqrt(32)
        active = torch.tensor([[True, True, False], [True, True, True]])
        table = torch.from_numpy(np.ascontiguousarray(store.chunk_table(0, layer))).long()
        cached = ex.cache.table[layer][store.slot(0)]  # [Hkv, S]: warmed at prefill, on the executor's device
        h = torch.arange(hkv)
        cpu_len = torch.full((hkv,), store.cpu_len(0, layer))
        sel, sel_valid = ex._select_tokens(layer, *(x.to(ex.dev) for x in (q, active, cached, h, table, cpu_len)))
        assert bool(sel_valid.all())
        # The reference on the host, from the index's dequantized keys.
        sel, cached, channels = sel.cpu(), cached.cpu(), ex.index.channels[layer].cpu()
        for row in range(hkv):
            blocks = cached[row][cached[row] >= 0]
            pos = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)
            pos = pos[pos < int(cpu_len[row])]
            keys = ex.index.keys(layer, table[row, pos // 128].to(ex.dev), (pos % 128).to(ex.dev)).cpu()  # [n, d_c]
            qc = q[row][:, channels[row]]
            probs = torch.stack([torch.softmax(keys @ qc[i], 0) for i in range(g) if active[row, i]]).mean(0)
            want = set(pos[torch.topk(probs, 24).indices].tolist())
            slots = sel[row] // 16
            got = set((cached[row][slots] * 16 + sel[row] % 16).tolist())
            assert got == want


def test_token_scores_and_exact_attention_masks():
    keys = torch.randn(1, 5, 4)
    q = torch.randn(1, 2, 4)
    valid = torch.tensor([[True, False, True, True, False]])
    s = token_scores(keys, q, valid, torch.tensor([[True, False]]))
    assert bool((s[0, ~valid[0]] == -1).all()) and math.isclose(float(s[0, valid[0]].sum()), 1.0, rel_tol=1e-5)
    out, lse = exact_attention(q, keys, keys, valid, torch.tensor([[True, False]]))
    ref_out, ref_lse = dense_attention(q[0, :1], keys[0, valid[0]][:, None], keys[0, valid[0]][:, None], scale=1.0)
    assert torch.allclose(out[0, 0], ref_out[0], atol=1e-5) and math.isclose(float(lse[0, 0]), float(ref_lse[0]), rel_tol=1e-5)
    assert lse[0, 1] == float("-inf") and bool((out[0, 1] == 0).all())


@pytest.mark.parametrize("lagged", [True, False])
def test_budgets_covering_everything_give_dense_attention(lagged):
    cfg = asynctls_config(blocks="all", tokens="all", lagged=lagged, kv={"generated_cap": 16})
    g = cfg.geometry
    with runtime(cfg) as rt:
        ks, vs = prefill_random(rt, 0, 500, seed=5)
        gen = torch.Generator().manual_seed(6)
        worst = 0.0
        for _ in range(40):  # past a spill of the GPU window into the CPU segment
            for layer in range(g.layers):
                q = torch.randn(1, g.q_heads, g.head_dim, generator=gen)
                k, v = torch.randn(2, 1, g.kv_heads, g.head_dim, generator=gen)
                ks[layer], vs[layer] = torch.cat([ks[layer], k]), torch.cat([vs[layer], v])
                out = rt.decode(layer, [0], q, k, v)
                ref, _ = dense_attention(q[0], ks[layer], vs[layer])
                worst = max(worst, float((out[0] - ref).abs().max()))
        assert rt.store.cpu_len(0, 0) > 500 - 16 - 64  # a spill happened
        assert worst < 1e-5
        ex = rt.gpu_executor
        assert ex.blocks_missed == 0 and ex.blocks_selected > 0  # everything stays resident
        assert ex.bytes_read > 0  # the spilled blocks were copied into the cache


# ---------------------------------------------------------------------------- resident cache
def test_plan_update_keeps_exactly_the_chosen_blocks():
    gen = torch.Generator().manual_seed(7)
    for _ in range(50):
        r, s, k = 5, 8, 6
        cached = torch.stack([torch.randperm(20, generator=gen)[:s] for _ in range(r)])
        cached[torch.rand(r, s, generator=gen) < 0.3] = -1
        chosen = torch.stack([torch.randperm(20, generator=gen)[:k] for _ in range(r)])
        chosen[torch.rand(r, k, generator=gen) < 0.2] = -1
        new, miss, dest = plan_update(cached, chosen)
        for i in range(r):
            c = set(cached[i][cached[i] >= 0].tolist())
            m = set(chosen[i][chosen[i] >= 0].tolist())
            assert set(new[i][new[i] >= 0].tolist()) == m and int((new[i] >= 0).sum()) == len(m)
            assert set(chosen[i][miss[i]].tolist()) == m - c
            # Kept blocks stay in their slots; missing ones land where the table now names them.
            for slot in range(s):
                if cached[i, slot] in m:
                    assert new[i, slot] == cached[i, slot]
            for j in torch.nonzero(miss[i]).flatten().tolist():
                assert new[i, dest[i, j]] == chosen[i, j]
            assert bool((dest[i][~miss[i]] == -1).all())


@pytest.mark.parametrize("keep_steps", [1, 2, 3])
def test_plan_update_aged_keeps_the_union_of_the_last_chosen_sets(keep_steps):
    gen = torch.Generator().manual_seed(70 + keep_steps)
    r, k = 4, 5
    s = keep_steps * k + 1
    cached, age = torch.full((r, s), -1), torch.zeros((r, s), dtype=torch.int64)
    history: list[list[set]] = [[] for _ in range(r)]
    for _ in range(30):
        chosen = torch.stack([torch.randperm(12, generator=gen)[:k] for _ in range(r)])  # small ids: many repeats
        chosen[torch.rand(r, k, generator=gen) < 0.2] = -1
        new, new_age, miss, dest = plan_update_aged(cached, age, chosen, keep_steps)
        for i in range(r):
            m = set(chosen[i][chosen[i] >= 0].tolist())
            c = set(cached[i][cached[i] >= 0].tolist())
            history[i].append(m)
            union = set().union(*history[i][-keep_steps:])
            assert set(new[i][new[i] >= 0].tolist()) == union and int((new[i] >= 0).sum()) == len(union)
            assert set(chosen[i][miss[i]].tolist()) == m - c
            for slot in range(s):  # blocks that stay keep their slots
                if int(cached[i, slot]) in union:
                    assert new[i, slot] == cached[i, slot]
            for j in torch.nonzero(miss[i]).flatten().tolist():
                assert new[i, dest[i, j]] == chosen[i, j]
            assert bool((dest[i][~miss[i]] == -1).all())
            for slot in range(s):  # a block's age: the updates since it was last chosen
                blk = int(new[i, slot])
                if blk >= 0:
                    last = max(j for j, ms in enumerate(history[i]) if blk in ms)
                    assert int(new_age[i, slot]) == len(history[i]) - 1 - last
        cached, age = new, new_age
    if keep_steps == 1:
        table, miss1, dest1 = plan_update(cached, chosen)
        want = plan_update_aged(cached, age, chosen, 1)
        assert torch.equal(table, want[0]) and torch.equal(miss1, want[2]) and torch.equal(dest1, want[3])


def test_fresh_age_zeroes_the_named_slots_only():
    age = torch.tensor([[3, 1, 2, 0], [5, 5, 5, 5]])
    assert fresh_age(age, torch.tensor([[2, -1], [-1, -1]])).tolist() == [[3, 1, 0, 0], [5, 5, 5, 5]]


def test_plan_insert_adds_without_evicting():
    cached = torch.tensor([[3, -1, 7, -1, -1]])
    wanted = torch.tensor([[7, 8, 9, -1]])
    new, dest = plan_insert(cached, wanted)
    assert new.tolist() == [[3, 8, 7, 9, -1]] and dest.tolist() == [[2, 1, 3, -1]]


@pytest.mark.parametrize("resident_steps", [1, 2])
def test_cache_after_a_step_holds_m_t_and_fetches_m_t_minus_c_t(resident_steps):
    # resident_steps 1: C_{t+1} = M_t (the paper's); 2: C_{t+1} = M_t and M_{t-1}.
    cfg = asynctls_config(blocks=5, tokens=40, resident_steps=resident_steps)
    g = cfg.geometry
    with runtime(cfg) as rt:
        prefill_random(rt, 0, 1000, seed=8)
        ex, store = rt.gpu_executor, rt.store
        assert ex.cache.slots == 5 * resident_steps + 64 // 16 + 2  # and one spill's room
        slot = store.slot(0)
        warm = ex.cache.table[0][slot].cpu()
        history = [[set(warm[h][warm[h] >= 0].tolist())] for h in range(2)]  # the prefill's choice
        gen = torch.Generator().manual_seed(9)
        table = torch.from_numpy(np.ascontiguousarray(store.chunk_table(0, 0))).long()
        cpu_len = torch.full((2,), store.cpu_len(0, 0))
        arena = store.arena(0)
        for step in range(6):
            c_t = ex.cache.table[0][slot].clone().cpu()  # a copy on the host (.cpu() of a host tensor is no copy)
            missed_before = ex.blocks_missed
            q = torch.randn(1, g.q_heads, g.head_dim, generator=gen)
            rt.decode(0, [0], q, *torch.randn(2, 1, g.kv_heads, g.head_dim, generator=gen))
            rt.scheduler.settle()  # on CUDA the claim of a step at layer 0 (of 2) trails it: retired (counted) here
            qs = (q[0] / math.sqrt(g.head_dim)).view(2, 3, -1)
            # M_t on the executor's device, as decode computed it; the cache read back on the host.
            m_t = ex._select_blocks(0, *(x.to(ex.dev) for x in (qs, torch.ones(2, 3, dtype=torch.bool), table, cpu_len)))
            m_t = m_t.cpu()
            if ex.cuda:
                torch.cuda.synchronize()  # lagged, the step's copies into the cache run on a side stream after decode
            after, cache_k, cache_v = ex.cache.table[0][slot].cpu(), ex.cache.k[0].cpu(), ex.cache.v[0].cpu()
            fetched = 0
            for h in range(2):
                m = set(m_t[h][m_t[h] >= 0].tolist())
                c = set(c_t[h][c_t[h] >= 0].tolist())
                history[h].append(m)
                assert set(after[h][after[h] >= 0].tolist()) == set().union(*history[h][-resident_steps:])
                assert len(m) == 5
                fetched += len(m - c)
                for s_i, blk in enumerate(after[h].tolist()):  # every slot holds its block's K and V
                    if blk < 0:
                        continue
                    pos = blk * 16 + torch.arange(16)
                    cid = table[h, pos // 128]
                    assert torch.equal(cache_k[slot, h, s_i], arena[cid, layout.K_ROW + pos % 128])
                    assert torch.equal(cache_v[slot, h, s_i], arena[cid, layout.V_ROW + pos % 128])
            assert ex.blocks_missed - missed_before == fetched
            assert ex.epsilon_per_step()[-1] == fetched / 10
            assert rt.timeline.records[-1].bytes_read.sum() == fetched * 16 * 2 * 32 * 4
        assert len(ex.epsilon_per_step()) == 6 and ex.launches == 6  # one claim per step: the whole queue
        del arena


def needle_prompt(length: int, blocks: list[int], hkv: int = 2, d: int = 32):
    """Small random keys, and a strong key direction per needle block: block b's keys point at e_b."""
    gen = torch.Generator().manual_seed(10)
    k = 0.01 * torch.randn(length, hkv, d, generator=gen)
    v = torch.randn(length, hkv, d, generator=gen)
    for i, b in enumerate(blocks):
        k[16 + b * 16 : 16 + (b + 1) * 16, :, i] = 4.0  # CPU segment starts after the 16 sink tokens
    return k, v


def needle_steps(rt: HybridRuntime, a: int, b: int):
    """Both layers prefilled with needle blocks `a` and `b`; queries pointing at each, zero new K/V."""
    g = rt.geometry
    k, v = needle_prompt(600, [a, b])
    for layer in range(2):
        rt.prefill(0, layer, k, v, q_last=torch.zeros(g.q_heads, g.head_dim))
    q_a, q_b = torch.zeros(1, g.q_heads, g.head_dim), torch.zeros(1, g.q_heads, g.head_dim)
    q_a[..., 0], q_b[..., 1] = 10.0, 10.0
    return k, v, q_a, q_b, torch.zeros(2, 1, g.kv_heads, g.head_dim)


def needle_reference(rt: HybridRuntime, k, v, q, kv_new, blocks: list[int], steps: int) -> torch.Tensor:
    """Dense attention of `q` over the GPU window, `steps` appended `kv_new` tokens and the CPU blocks."""
    cpu = 16  # sink
    n_cpu = rt.store.cpu_len(0, 0)
    parts = [slice(cpu + x * 16, cpu + (x + 1) * 16) for x in blocks]
    kk = torch.cat([k[:cpu], k[cpu + n_cpu:], *[kv_new[0]] * steps, *(k[sl] for sl in parts)])
    vv = torch.cat([v[:cpu], v[cpu + n_cpu:], *[kv_new[1]] * steps, *(v[sl] for sl in parts)])
    return dense_attention(q[0], kk, vv)[0]


@pytest.mark.parametrize("lagged", [True, False])
def test_lag_token_level_reads_the_blocks_chosen_at_the_previous_step(lagged):
    # k_b = 1: query t-1 points at needle block A, query t at needle block B. Lagged, step t attends A
    # (chosen at t-1, resident); unlagged it attends B.
    cfg = asynctls_config(blocks=1, tokens="all", lagged=lagged, kv={"generated_cap": 256})
    a, b = 3, 11
    with runtime(cfg) as rt:
        k, v, q_a, q_b, kv_new = needle_steps(rt, a, b)
        ex, store = rt.gpu_executor, rt.store
        rt.decode(0, [0], q_a, *kv_new)  # step t-1: chooses A
        assert set(ex.cache.table[0][store.slot(0)][:, 0].tolist()) == {a}
        out = rt.decode(0, [0], q_b, *kv_new)[0]  # step t: chooses B
        for blk, expect in ((a, lagged), (b, not lagged)):
            ref = needle_reference(rt, k, v, q_b, kv_new, [blk], steps=2)
            assert torch.allclose(out, ref, atol=1e-5) == expect
        assert set(ex.cache.table[0][store.slot(0)][:, 0].tolist()) == {b}  # C_{t+1} = M_t either way


def test_lagged_token_level_reads_the_last_two_steps_blocks_with_resident_steps_2():
    # k_b = 1, every token of the cached blocks: steps choose A, then B; the next lagged step reads
    # C = M_{t-1} and M_{t-2} = A and B, where resident_steps 1 would read B alone.
    cfg = asynctls_config(blocks=1, tokens="all", resident_steps=2, kv={"generated_cap": 256})
    a, b = 3, 11
    with runtime(cfg) as rt:
        k, v, q_a, q_b, kv_new = needle_steps(rt, a, b)
        store = rt.store
        rt.decode(0, [0], q_a, *kv_new)
        rt.decode(0, [0], q_b, *kv_new)
        table = rt.gpu_executor.cache.table[0][store.slot(0)].cpu()
        assert all(set(row[row >= 0].tolist()) == {a, b} for row in table)
        out = rt.decode(0, [0], q_b, *kv_new)[0]
        assert torch.allclose(out, needle_reference(rt, k, v, q_b, kv_new, [a, b], steps=3), atol=1e-5)
        assert not torch.allclose(out, needle_reference(rt, k, v, q_b, kv_new, [b], steps=3), atol=1e-5)


def test_prefill_warms_the_cache_from_the_last_query_and_needs_it():
    cfg = asynctls_config(blocks=1, tokens="all")
    g = cfg.geometry
    with runtime(cfg) as rt:
        k, v = needle_prompt(600, [7, 2])
        q = torch.zeros(g.q_heads, g.head_dim)
        q[:, 1] = 10.0  # points at the second needle, block 2
        rt.prefill(0, 0, k, v, q_last=q)
        assert rt.gpu_executor.cache.table[0][rt.store.slot(0)][:, 0].tolist() == [2, 2]
        assert rt.gpu_executor.prefill_bytes == 2 * 16 * 2 * 32 * 4
        with pytest.raises(ValueError, match="'asynctls' selection needs q_last"):
            rt.prefill(0, 1, k, v)


@pytest.mark.parametrize("lagged", [True, False])
def test_streaming_heads_read_nothing_and_batches_match_single_sequences(lagged):
    cfg = asynctls_config(blocks=4, tokens=32, lagged=lagged, streaming_heads={0: [1, 4]})
    g = cfg.geometry
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(3, 2, g.q_heads, g.head_dim, generator=gen)
    kv = torch.randn(3, 2, 2, g.kv_heads, g.head_dim, generator=gen)
    outs = {}
    for seqs in ([0, 1], [0], [1]):
        with runtime(cfg) as rt:
            for s in seqs:
                prefill_random(rt, s, 400 + 200 * s, seed=20 + s)
            res = []
            for t in range(3):
                idx = torch.tensor(seqs)
                res.append(rt.decode(0, seqs, q[t][idx], kv[t, 0][idx], kv[t, 1][idx]))
            for i, s in enumerate(seqs):
                outs[(tuple(seqs), s)] = torch.stack([r[i] for r in res])
            rec = rt.timeline.records[-1]
            assert rec.n_tasks == 2 * len(seqs)
    for s in (0, 1):
        assert torch.allclose(outs[((0, 1), s)], outs[((s,), s)], atol=1e-5)


# ---------------------------------------------------------------------------- config
def test_config_selects_the_executor_and_refuses_what_it_cannot_run(tmp_path):
    with HybridRuntime(asynctls_config(geometry={"name": "smollm2-135m", "layers": 2}, block_size=64, blocks=8,
                                       tokens=128, index_channels=16)) as rt:
        ex = rt.gpu_executor
        assert isinstance(ex, AsyncTlsExecutor) and ex.index.d_c == 16 and ex.cache.slots == 8 + 2 + 1
        assert rt.stats()["gpu_executor"] == "AsyncTlsExecutor"
    base = {"geometry": GEOMETRY, "scheduler": {"placement": "gpu_only", "gpu_worker": True},
            "selection": {"name": "asynctls"}}

    def bad(match: str, **sections):
        data = json.loads(json.dumps(base))
        for key, value in sections.items():
            data.setdefault(key, {}).update(value)
        with pytest.raises(ConfigError, match=match):
            config_from_dict(data)

    bad(r"scheduler.placement: 'fluxion'.*allowed: gpu_only", scheduler={"placement": "fluxion"})
    bad(r"scheduler.gpu_worker: false", scheduler={"gpu_worker": False})
    bad(r"selection.budget: not read by 'asynctls'", selection={"budget": 0.1})
    bad(r"selection.tokens: 600 exceeds the 4 x 128", selection={"blocks": 4, "block_size": 128, "tokens": 600})
    bad(r"selection.blocks: 0 is not allowed; allowed: a whole number >= 1, or 'all'", selection={"blocks": 0})
    bad(r"selection.tokens: 'some' is not allowed", selection={"tokens": "some"})
    bad(r"selection.index_channels: 7 is not allowed; allowed: an even number", selection={"index_channels": 7})
    bad(r"selection.index_channels: 64 exceeds the head dim 32", selection={"index_channels": 64})
    bad(r"selection.channel_file: 'nowhere.json' is not a file", selection={"channel_file": "nowhere.json"})
    bad(r"selection.lagged: read only by selection.name 'asynctls'", selection={"name": "fixed", "lagged": False})
    bad(r"selection.resident_steps: read only by selection.name 'asynctls'",
        selection={"name": "fixed", "resident_steps": 2})
    bad(r"selection.resident_steps: 2; with selection.blocks 'all'", selection={"blocks": "all", "resident_steps": 2})
    bad(r"selection.resident_steps: 0 is out of range; allowed: 1 <= value <= 16", selection={"resident_steps": 0})
    bad(r"selection.resident_steps: 2 exceeds the 1 steps between two spills of kv_cache.generated_cap=16",
        selection={"resident_steps": 2}, kv_cache={"generated_cap": 16})
    bad(r"selection.name: 'asynctls2' is not allowed", selection={"name": "asynctls2"})
    bad(r"experiment.variants\[0\].selection: 'asynctls' runs in its own GPU-lane executor",
        experiment={"variants": [{"name": "a", "selection": {"tokens": 64}}]})
    bad(r"experiment.variants\[0\].placement: 'cpu_only'", experiment={"variants": [{"name": "a", "placement": "cpu_only"}]})
    assert cache_slots(config_from_dict(base).selection, config_from_dict(base).kv_cache) == 128 + 33 + 1
    base["selection"]["resident_steps"] = 2
    assert cache_slots(config_from_dict(base).selection, config_from_dict(base).kv_cache) == 2 * 128 + 33 + 1


@pytest.mark.parametrize("programs", [64, 2])
def test_cache_fetch_kernel_matches_torch(programs, monkeypatch):
    from gpu_kernels import block_fetch
    from gpu_kernels.block_fetch import fetch_blocks

    # Two programs stride over the six entries (each copies some and skips others).
    monkeypatch.setattr(block_fetch, "PROGRAMS", programs)

    gen = torch.Generator().manual_seed(12)
    arena = torch.randn(6, layout.CHUNK_ROWS, 16, generator=gen)
    chunks = torch.tensor([[4, 1, 0], [2, 5, 3]])
    blocks = torch.tensor([[0, 3, 5], [1, 4, 2]])
    dest = torch.tensor([[2, -1, 0], [-1, 1, 3]])
    seq_slot, kv_head = torch.tensor([1, 0]), torch.tensor([0, 1])
    want = ResidentCache(1, 2, 2, 4, 64, 16, torch.float32, torch.device("cpu"))
    want.fetch(0, arena, chunks, seq_slot, kv_head, blocks, dest)  # the torch path, on the host
    got_k, got_v = torch.zeros_like(want.k[0], device=DEV), torch.zeros_like(want.v[0], device=DEV)
    fetch_blocks(*(x.to(DEV) for x in (arena, chunks, seq_slot, kv_head, blocks, dest)), got_k, got_v)
    assert torch.equal(got_k.cpu(), want.k[0]) and torch.equal(got_v.cpu(), want.v[0])
    assert bool(want.k[0][1, 0, 2].ne(0).all()) and bool(want.k[0][1, 0, 1].eq(0).all())
    # Block 5 of row 0 is the second half of its third chunk, id 0 (64-token blocks, two per chunk).
    assert torch.equal(want.v[0][1, 0, 0], arena[0, layout.V_ROW + 64 : layout.V_ROW + 128])


@pytest.mark.parametrize("programs", [3, 16])
def test_cache_fetch_kernel_scans_runs_of_entries(programs, monkeypatch):
    """More entries than one scan run (block_fetch.SCAN), a partial last run, runs with no miss, runs
    with every entry a miss, and fewer programs than runs: the kernel copies exactly the misses."""
    from gpu_kernels import block_fetch
    from gpu_kernels.block_fetch import fetch_blocks

    monkeypatch.setattr(block_fetch, "PROGRAMS", programs)
    monkeypatch.setattr(block_fetch, "SCAN", 16)
    gen = torch.Generator().manual_seed(5)
    rows, k, n_chunks, slots = 6, 13, 8, 20  # 78 entries: 4 full runs of 16 and one of 14
    arena = torch.randn(n_chunks, layout.CHUNK_ROWS, 16, generator=gen)
    chunks = torch.stack([torch.randperm(n_chunks, generator=gen)[:4] for _ in range(rows)])
    blocks = torch.randint(0, 8, (rows, k), generator=gen)
    dest = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):  # distinct slots per row; row 1 all misses, row 3 none
        n_miss = {1: k, 3: 0}.get(r, int(torch.randint(1, k, (1,), generator=gen)))
        at = torch.randperm(k, generator=gen)[:n_miss]
        dest[r, at] = torch.randperm(slots, generator=gen)[:n_miss]
    seq_slot, kv_head = torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 0, 0, 1, 1, 1])
    want = ResidentCache(1, 3, 2, slots, 64, 16, torch.float32, torch.device("cpu"))
    want.fetch(0, arena, chunks, seq_slot, kv_head, blocks, dest)
    got_k, got_v = torch.zeros_like(want.k[0], device=DEV), torch.zeros_like(want.v[0], device=DEV)
    fetch_blocks(*(x.to(DEV) for x in (arena, chunks, seq_slot, kv_head, blocks, dest)), got_k, got_v)
    assert torch.equal(got_k.cpu(), want.k[0]) and torch.equal(got_v.cpu(), want.v[0])
    assert int(want.k[0].ne(0).flatten(3).any(-1).sum()) == int((dest >= 0).sum())  # every miss landed, nothing else


@pytest.mark.gpu
@pytest.mark.parametrize("lagged", [True, False])
@pytest.mark.parametrize("graphs", [True, False])
def test_prefetch_on_cuda_matches_the_host(lagged, graphs):
    g = asynctls_config().geometry
    outs = []
    for dev in ("cpu", "cuda"):  # the host path, then the CUDA one (UVA copies; graphs from the second step)
        cfg = asynctls_config(blocks=5, tokens=40, lagged=lagged, kv={"device": dev})
        with runtime(cfg, device=dev) as rt:
            rt.gpu_executor.graphs = graphs and dev == "cuda"
            prefill_random(rt, 0, 900, seed=13)
            gen = torch.Generator().manual_seed(14)
            res = []
            for _ in range(30):
                for layer in range(g.layers):
                    q = torch.randn(1, g.q_heads, g.head_dim, generator=gen)
                    k, v = torch.randn(2, 1, g.kv_heads, g.head_dim, generator=gen)
                    res.append(rt.decode(layer, [0], q.to(dev), k.to(dev), v.to(dev)).cpu())
            outs.append(torch.stack(res))
            ex = rt.gpu_executor
            assert ex.blocks_selected > 0 and ex.blocks_missed > 0
            if dev == "cuda":
                assert ex.graphs == graphs  # no capture failed
                assert ex.transfer_seconds() > 0 or (graphs and not lagged)  # graphed synchronous copies have no events
                # A graphed lagged claim's copy replays its own graph on the copy stream.
                assert (ex.fetch_replays > 0) == (graphs and lagged)
    assert torch.allclose(outs[0], outs[1], atol=1e-4)


@pytest.mark.gpu
def test_express_steps_launch_no_kernel_the_warm_up_left_uncompiled():
    """A GPU-only step counts its NaN/inf checks in the step-inputs kernel without a CPU lane, here with
    q in fp32 beside k, v in the store's bf16: the warm-up compiles those variants too (they went through
    the JIT at the first decode step before)."""
    cfg = asynctls_config(blocks=5, tokens=40, kv={"device": "cuda", "dtype": "bf16"}, profiling={"enabled": False})
    g = cfg.geometry
    with runtime(cfg, device="cuda") as rt:
        prefill_random(rt, 0, 900, seed=3)
        prefill_random(rt, 1, 700, seed=4)
        gen = torch.Generator().manual_seed(5)
        for _ in range(4):
            for layer in range(g.layers):
                q = torch.randn(2, g.q_heads, g.head_dim, generator=gen).cuda()
                k, v = torch.randn(2, 2, g.kv_heads, g.head_dim, generator=gen).to("cuda", torch.bfloat16)
                rt.decode(layer, [0, 1], q, k, v)
        torch.cuda.synchronize()
        assert rt.scheduler.express_steps > 0
        assert rt.stats()["jit_kernels_after_warmup"] == {}


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_deferred_lagged_copy_gives_the_same_outputs_and_cache(graphs):
    """A lagged copy launched at the executor's next use (`defer_copy`; the last layer's at the next
    step's first) against one launched behind its claim: the same outputs and resident cache after every
    step, across spills; a copy is pending after every layer of a step but one that took a path without
    lagged copies, none once the runtime settled."""
    g = asynctls_config().geometry
    assert g.layers >= 2
    results = {}
    for defer in (True, False):
        cfg = asynctls_config(blocks=5, tokens=40, lagged=True, kv={"device": "cuda"})
        with runtime(cfg, device="cuda") as rt:
            ex = rt.gpu_executor
            ex.graphs, ex.defer_copy = graphs, defer
            prefill_random(rt, 0, 900, seed=13)
            prefill_random(rt, 1, 700, seed=15)
            gen = torch.Generator().manual_seed(14)
            outs, caches, pending = [], [], []
            for _ in range(70):  # generated_cap 64: spills
                for layer in range(g.layers):
                    q = torch.randn(2, g.q_heads, g.head_dim, generator=gen)
                    k, v = torch.randn(2, 2, g.kv_heads, g.head_dim, generator=gen)
                    outs.append(rt.decode(layer, [0, 1], q.cuda(), k.cuda(), v.cuda()).cpu())
                    pending.append(ex._pending_copy is not None)
                rt.scheduler.settle()  # launches the last layer's copy: the cache is read below
                assert ex._pending_copy is None
                torch.cuda.synchronize()
                caches.append(tuple(torch.stack(t).cpu() for t in (ex.cache.k, ex.cache.v, ex.cache.table)))
            assert ex.blocks_missed > 0 and ex.graphs == graphs
            results[defer] = (torch.stack(outs), caches, pending, ex.bytes_read)
    (out_d, caches_d, pending_d, bytes_d), (out_n, caches_n, pending_n, bytes_n) = results[True], results[False]
    assert torch.equal(out_d, out_n) and bytes_d == bytes_n
    for (kd, vd, td), (kn, vn, tn) in zip(caches_d, caches_n):
        assert torch.equal(td, tn) and torch.equal(kd, kn) and torch.equal(vd, vn)
    per_step = len(pending_d) // 70
    assert not any(pending_n)
    assert sum(pending_d[per_step - 1 :: per_step]) >= 60  # after a step's last layer, until the next step
    assert sum(pending_d) >= 60 * per_step  # after every layer (a spill's step takes another path)


@pytest.mark.gpu
def test_express_steps_give_the_general_paths_outputs():
    """GPU-only steps past the lanes' loop (`HybridRuntime._decode_express`) against the same steps
    through it: same outputs, bytes and cache, across spills (which take the general path) and a
    switch between the two paths midway; every claim retired by settle and close. Profiled steps
    take the general path (it records the timeline). With `step_graphs_enabled` the express steps
    replay whole-step CUDA graphs (step_graphs.py), k and v staged or read in place: the same again."""
    g = asynctls_config().geometry
    results = {}
    kv_in = torch.empty(2, 2, g.kv_heads, g.head_dim, device="cuda")  # "graphs_direct": the same k, v tensors
    for express in (True, False, "switch", "profiled", "graphs", "graphs_direct"):
        cfg = asynctls_config(blocks=5, tokens=40, kv={"device": "cuda"},
                              profiling={"enabled": express == "profiled"})
        with runtime(cfg, device="cuda") as rt:
            rt.express_path = express is not False
            rt.step_graphs_enabled = express in ("graphs", "graphs_direct")
            prefill_random(rt, 0, 900, seed=13)
            prefill_random(rt, 1, 700, seed=15)
            gen = torch.Generator().manual_seed(14)
            res = []
            for step in range(80):
                if express == "switch":
                    rt.express_path = step % 20 >= 10
                for layer in range(g.layers):
                    q = torch.randn(2, g.q_heads, g.head_dim, generator=gen)
                    k, v = torch.randn(2, 2, g.kv_heads, g.head_dim, generator=gen)
                    if express == "graphs_direct":
                        kv_in.copy_(torch.stack([k, v]))
                        k, v = kv_in[0], kv_in[1]
                    res.append(rt.decode(layer, [0, 1], q.cuda(), k.cuda(), v.cuda()))
            stats = rt.stats()  # settles: every claim retired
            graphs = rt._step_graphs
            if express in ("graphs", "graphs_direct"):
                # Captured at each task set's second step, replayed after (a spill makes a new task set).
                assert graphs.capture_error is None and graphs.captures >= g.layers
                assert graphs.replays >= 60 * g.layers and rt.gpu_executor.graph_step_replays == graphs.replays
                assert rt.gpu_executor.fetch_replays >= graphs.replays  # each lagged copy from its own graph
            else:
                assert graphs.replays == 0
            ex = rt.gpu_executor
            assert len(rt.scheduler.lane.express) == 0
            results[express] = (torch.stack(res).cpu(), ex.bytes_read, ex.blocks_selected, ex.blocks_missed,
                                ex.cache.table[0].cpu())
            steps = 80 * g.layers
            if express in (True, "graphs", "graphs_direct"):
                # Spill steps (one in generated_cap 64 per sequence and layer) take the general path.
                assert steps - 8 * g.layers <= stats["express_steps"] < steps
            elif express in (False, "profiled"):
                assert stats["express_steps"] == 0
            elif express == "switch":
                assert 0 < stats["express_steps"] < steps // 2 + 1
    for other in (False, "switch", "profiled", "graphs", "graphs_direct"):
        want, got = results[other], results[True]
        assert torch.allclose(got[0], want[0], atol=1e-5), (other, (got[0] - want[0]).abs().max())
        assert got[1:4] == want[1:4] and torch.equal(got[4], want[4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selected_attention_kernel_matches_the_torch_form(dtype):
    from gpu_kernels.asynctls_attention import selected_attention

    gen = torch.Generator().manual_seed(31)
    s, hkv, c, blk, d, g, bsz = 3, 2, 5, 16, 32, 3, 2
    cache_k = torch.randn(s, hkv, c, blk, d, generator=gen).to(dtype)
    cache_v = torch.randn(s, hkv, c, blk, d, generator=gen).to(dtype)
    q = torch.randn(bsz, hkv * g, d, generator=gen) / math.sqrt(d)
    # Four tasks: (batch row, slot, KV head); 70 chosen positions each (two tiles of 64, the second partial).
    batch, slot, head = torch.tensor([0, 0, 1, 1]), torch.tensor([2, 2, 0, 0]), torch.tensor([0, 1, 0, 1])
    sel = torch.stack([torch.randperm(c * blk, generator=gen)[:70] for _ in range(4)])
    valid = torch.rand(4, 70, generator=gen) < 0.8
    valid[3] = False  # a task with no valid token: out 0, lse -inf
    active = torch.tensor([[True, True, True], [True, False, True], [False, False, False], [True, True, True]])
    out, lse = torch.full((bsz, hkv * g, d), 7.0, device=DEV), torch.full((bsz, hkv * g), 7.0, device=DEV)
    selected_attention(*(x.to(DEV) for x in (q, cache_k, cache_v, slot, head, batch, sel, valid, active)), out, lse)
    kk = cache_k.view(s, hkv, c * blk, d)[slot[:, None], head[:, None], sel].float()
    vv = cache_v.view(s, hkv, c * blk, d)[slot[:, None], head[:, None], sel].float()
    want_out, want_lse = exact_attention(q.view(bsz, hkv, g, d)[batch, head], kk, vv, valid, active)
    got_out, got_lse = out.view(bsz, hkv, g, d)[batch, head].cpu(), lse.view(bsz, hkv, g)[batch, head].cpu()
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse)) and int(torch.isinf(want_lse).sum()) == 3 + 1 + 3
    fin = torch.isfinite(want_lse)
    # On CUDA a bf16 cache's dots run in tf32 (q and the softmax weights round to its 10-bit mantissa).
    atol = 2e-3 if dtype == torch.bfloat16 and DEV.type == "cuda" else 1e-4
    assert torch.allclose(got_lse[fin], want_lse[fin], atol=atol), float((got_lse[fin] - want_lse[fin]).abs().max())
    assert torch.allclose(got_out, want_out, atol=atol), float((got_out - want_out).abs().max())
    assert bool((got_out[~fin] == 0).all())
    with pytest.raises(ValueError, match="sel_valid has shape"):
        selected_attention(*(x.to(DEV) for x in (q, cache_k, cache_v, slot, head, batch, sel, valid[:, :5], active)),
                           out, lse)


def test_fused_int4_token_scores_match_the_dequantized_index():
    from gpu_kernels.asynctls_token_scores import int4_token_scores

    gen = torch.Generator().manual_seed(21)
    n_chunks, d_c, g, blk = 5, 8, 3, 16
    keys = torch.randn(n_chunks, layout.CHUNK_TOKENS, d_c, generator=gen)
    codes, params = quantize_int4(keys)
    q_c = torch.randn(2, g, d_c, generator=gen)
    chunks = torch.tensor([[3, 0, 4], [1, 2, 0]])
    blocks = torch.tensor([[0, 9, -1, 17, 5], [23, -1, 2, 11, 16]])  # -1: empty slots
    cpu_len = torch.tensor([300, 270])  # row 1: block 16 is cut at 270, block 23 lies past it
    got = int4_token_scores(*(x.to(DEV) for x in (q_c, codes, params, blocks, chunks, cpu_len)), blk).cpu()
    pos = blocks[:, :, None] * blk + torch.arange(blk)
    valid = ((blocks[:, :, None] >= 0) & (pos < cpu_len[:, None, None])).view(2, -1)
    pos = pos.clamp(min=0).view(2, -1)
    cid = chunks.gather(1, (pos // layout.CHUNK_TOKENS).clamp(max=2))
    x = dequantize_int4(codes[cid, pos % layout.CHUNK_TOKENS], params[cid, pos % layout.CHUNK_TOKENS])
    want = torch.bmm(q_c, x.transpose(1, 2)).masked_fill(~valid[:, None, :], float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and int(valid.sum()) == 4 * 16 + 2 * 16 + 14
    assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-4)
    with pytest.raises(ValueError, match="d_c / 2 a power of two"):
        int4_token_scores(torch.zeros(2, g, 12), torch.zeros(5, 128, 6, dtype=torch.uint8), params, blocks, chunks,
                          cpu_len, blk)


@pytest.mark.parametrize("fused", ["fused_token_scores", "fused_attention", "fused_cache_update", "fused_block_scores"])
@pytest.mark.parametrize("lagged", [True, False])
def test_fused_kernels_give_what_the_torch_forms_give(lagged, fused):
    # The block and token levels' scores, the exact attention and the cache update, each in its Triton
    # form and its torch form; streaming heads (inactive in their groups) and a spill along the way
    # (generated_cap 16).
    cfg = asynctls_config(blocks=6, tokens=24, lagged=lagged, streaming_heads={1: [0, 4]}, kv={"generated_cap": 16})
    g = cfg.geometry
    outs = []
    for on in (False, True):
        with runtime(cfg) as rt:
            setattr(rt.gpu_executor, fused, on)
            prefill_random(rt, 0, 700, seed=24)
            prefill_random(rt, 1, 500, seed=25)
            gen = torch.Generator().manual_seed(26)
            res = []
            for _ in range(20):
                for layer in range(g.layers):
                    q = torch.randn(2, g.q_heads, g.head_dim, generator=gen)
                    k, v = torch.randn(2, 2, g.kv_heads, g.head_dim, generator=gen)
                    res.append(rt.decode(layer, [0, 1], q, k, v))
            assert rt.store.cpu_len(0, 0) > 700 - 16 - 64  # a spill happened
            outs.append(torch.stack(res))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_token_gather_kernel_reads_the_chosen_rows():
    from gpu_kernels.asynctls_token_gather import gather_tokens

    gen = torch.Generator().manual_seed(27)
    arena = torch.randn(6, layout.CHUNK_ROWS, 16, generator=gen)
    chunks = torch.tensor([[4, 1, 0], [2, 5, 3]])
    pos = torch.tensor([[0, 130, 300, 5, 129], [383, 7, 256, 128, 1]])
    valid = torch.tensor([[True, True, True, False, True], [True, True, True, True, False]])
    k, v = gather_tokens(*(x.to(DEV) for x in (arena, chunks, pos, valid)))
    cid = chunks.gather(1, pos // 128)
    want_k = arena[cid, layout.K_ROW + pos % 128] * valid[..., None]
    want_v = arena[cid, layout.V_ROW + pos % 128] * valid[..., None]
    assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)


@pytest.mark.parametrize("triton_gather", [False, True])
def test_offload_selection_attends_the_unlagged_selection_read_from_the_store(triton_gather):
    # The benchmark's synchronous baseline: the same two-level selection as unlagged AsyncTLS, the
    # chosen tokens' K and V read from the CPU store; the resident cache stays as the prefill left it.
    cfg = asynctls_config(blocks=5, tokens=40, lagged=False)
    g = cfg.geometry
    outs, counters = [], []
    for offload in (False, True):
        with runtime(cfg) as rt:
            ex = rt.gpu_executor
            ex.offload_selection = offload
            ex.triton_gather = triton_gather
            prefill_random(rt, 0, 900, seed=24)
            tables = [t.clone() for t in ex.cache.table]
            gen = torch.Generator().manual_seed(25)
            res = []
            for _ in range(8):
                for layer in range(g.layers):
                    q = torch.randn(1, g.q_heads, g.head_dim, generator=gen)
                    k, v = torch.randn(2, 1, g.kv_heads, g.head_dim, generator=gen)
                    res.append(rt.decode(layer, [0], q, k, v))
            outs.append(torch.stack(res))
            counters.append((ex.bytes_read, ex.blocks_selected, ex.blocks_missed))
            if offload:
                assert all(torch.equal(a, b) for a, b in zip(tables, ex.cache.table))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    steps = 8 * g.layers * g.kv_heads  # task-steps; every one reads its 40 chosen tokens' K and V
    assert counters[1] == (steps * 40 * 2 * g.head_dim * 4, 0, 0)
    assert counters[0][1] > 0 and counters[0][0] != counters[1][0]


def test_stage_marks_of_an_eager_claim():
    cfg = asynctls_config(blocks=5, tokens=40)
    g = cfg.geometry
    with runtime(cfg) as rt:
        prefill_random(rt, 0, 900, seed=26)
        ex = rt.gpu_executor
        q = torch.randn(1, g.q_heads, g.head_dim)
        k = v = torch.zeros(1, g.kv_heads, g.head_dim)
        stages = {}
        for mode in ("lagged", "unlagged", "offload"):
            ex.lagged, ex.offload_selection = mode == "lagged", mode == "offload"
            ex.marks = []
            rt.decode(0, [0], q, k, v)
            stages[mode] = [name for name, _ in ex.marks]
            if torch.cuda.is_available():  # CUDA events on the executor's stream: times from the first
                torch.cuda.synchronize()
                times = [ex.marks[0][1].elapsed_time(ev) for _, ev in ex.marks]
            else:  # host seconds
                times = [t for _, t in ex.marks]
            assert all(b >= a for a, b in zip(times, times[1:]))
        ex.marks = None
    assert stages["lagged"] == ["start", "block level", "token scores", "token top-k", "attention", "cache update",
                                "outputs"]
    assert stages["unlagged"] == ["start", "block level", "cache update", "fetch", "token scores", "token top-k",
                                  "attention", "outputs"]
    assert stages["offload"] == ["start", "block level", "token scores", "token top-k", "attention", "outputs"]


# ---------------------------------------------------------------------------- the quality experiment's pieces
def test_quality_experiment_settings_selections_and_metrics(tmp_path):
    from hybrid_runtime.experiments import asynctls_quality as aq

    s = aq.AsyncTlsQualitySettings()
    # k_b * 64 = max(0.25 * L_cpu, 2 * budget), at most every block.
    assert aq.level1_blocks(s, 7616, 256) == 30 and aq.level1_blocks(s, 3520, 1024) == 32
    assert aq.level1_blocks(s, 1472, 1024) == 23
    assert aq.selection_of(s, "quest", 512, 3520)["blocks"] == 8 and aq.selection_of(s, "quest", 512, 3520)["tokens"] == "all"
    ds = aq.selection_of(s, "doublesparsity", 512, 3520)
    assert (ds["blocks"], ds["tokens"], ds["lagged"]) == ("all", 512, False)
    lag, unlag = aq.selection_of(s, "asynctls", 256, 7616), aq.selection_of(s, "asynctls_unlagged", 256, 7616)
    assert lag["lagged"] and not unlag["lagged"] and (lag["blocks"], lag["tokens"]) == (30, 256)
    for method in aq.METHODS:  # every selection is a valid runtime config
        cfg = aq.runtime_config(s, aq.selection_of(s, method, 1024, 1472))
        assert cfg.selection.name == "asynctls" and cfg.scheduler.placement == "gpu_only"
    assert aq.runtime_config(s, aq.BASELINES["fixed16_005"]).selection.budget == 0.05
    with pytest.raises(ValueError, match="methods"):
        aq.AsyncTlsQualitySettings(methods=("asynctls", "magic"))
    with pytest.raises(ValueError, match="scheduler and selection are set per method"):
        aq.AsyncTlsQualitySettings(runtime={"scheduler": {"cpu_workers": 2}})
    with pytest.raises(ValueError, match="level1_over_budget"):
        aq.AsyncTlsQualitySettings(level1_over_budget=0.5)
    assert aq.load_settings("configs/asynctls_smollm2.yaml").lengths == (2048, 4096, 8192)
    # A second text: the command line's offset over the file's; a negative one is refused before any model loads.
    assert aq.load_settings("configs/asynctls_smollm2.yaml", {"text_offset": 61000}).text_offset == 61000
    with pytest.raises(ValueError, match="text_offset: -1; allowed: >= 0"):
        aq.AsyncTlsQualitySettings(text_offset=-1)
    assert aq.main(["--out", str(tmp_path / "x"), "--text-offset", "-1"]) == 2
    # The resident cache's history reaches AsyncTLS's runs only; the levels alone keep the paper's cache.
    s2 = aq.AsyncTlsQualitySettings(resident_steps=2)
    assert aq.selection_of(s2, "asynctls", 256, 7616)["resident_steps"] == 2
    assert aq.runtime_config(s2, aq.selection_of(s2, "asynctls", 256, 7616)).selection.resident_steps == 2
    assert all("resident_steps" not in aq.selection_of(s2, m, 256, 7616) for m in ("quest", "doublesparsity"))
    with pytest.raises(ValueError, match="resident_steps: 0; allowed: 1 to 16"):
        aq.AsyncTlsQualitySettings(resident_steps=0)
    assert aq.main(["--out", str(tmp_path / "x"), "--resident-steps", "0"]) == 2

    def run(method, budget, agreement, eps=None):
        r = {"method": method, "budget": budget, "selection": {"name": "fixed"} if budget is None else
             aq.selection_of(s, method, budget, 3520), "agreement": agreement, "kl": 0.01, "ppl": 20.0,
             "bytes_per_step": 1e6}
        return {**r, "epsilon_median": eps, "epsilon_p90": eps} if eps is not None else r

    results = {"settings": dataclasses.asdict(dataclasses.replace(s, budgets=(256,))), "epsilon":
               {"epsilon_median": 0.1, "epsilon_p90": 0.3, "epsilon_steps": 10}, "lengths": {}}
    for length, bump in (("4096", 0.0), ("8192", 0.02)):
        results["lengths"][length] = {"prompt_tokens": int(length) - 256, "repeated_8gram": 0.0, "dense": {"ppl": 19.0},
                                      "runs": [run("fixed16_005", None, 0.85), run("asynctls", 256, 0.9 + bump, 0.1),
                                               run("asynctls_unlagged", 256, 0.91 + bump, 0.1), run("quest", 256, 0.86),
                                               run("doublesparsity", 256, 0.905 + bump)]}
    m = aq.metrics_of(results)
    assert math.isclose(m["agreement_asynctls_256"], 0.91) and math.isclose(m["agreement_quest_256"], 0.86)
    assert math.isclose(m["agreement_doublesparsity_256"], 0.915) and m["epsilon_median"] == 0.1
    assert math.isclose(m["lag_agreement_cost_256"], 0.01) and m["agreement_fixed16_005_8k"] == 0.85
    assert all(isinstance(v, float) for v in m.values())
    md = aq.markdown(results)
    assert "| asynctls | 256 | 14 | 256 |" in md and "256: AsyncTLS 0.910 vs Quest 0.860 (+0.050: met)" in md
    written = aq.write_outputs(results, tmp_path / "out", tmp_path / "res", "python -m x")
    record = json.loads(written[0].read_text())
    assert written[0].name == "asynctls_quality-cpu.json" or torch.cuda.is_available()
    assert record["metrics"]["agreement_asynctls_256"] == m["agreement_asynctls_256"]


def test_device_benchmark_smoke_run_writes_the_results_contract(tmp_path, monkeypatch):
    from benchmarks import asynctls as bench

    monkeypatch.setenv("HYBRID_COMMIT", "abc1234")
    path = bench.main(["--smoke", "--out", str(tmp_path / "asynctls-smoke.json")])
    r = json.loads(path.read_text())
    assert r["benchmark"] == "asynctls" and r["commit"] == "abc1234" and r["config"]["smoke"]
    (row,) = r["points"]
    assert (row["batch"], row["context"], row["layers"]) == (2, 4096, 2)
    m = r["metrics"]
    # The baseline is the selection read from the store every step; the old `sync` row is sync_misses.
    assert m["lagged_over_sync_time_2x4k"] == pytest.approx(row["lagged"]["attention_ms_per_layer"]
                                                             / row["sync_selection"]["attention_ms_per_layer"])
    assert m["lagged_over_sync_misses_time_2x4k"] == pytest.approx(row["lagged"]["attention_ms_per_layer"]
                                                                    / row["sync_misses"]["attention_ms_per_layer"])
    assert 0.0 <= m["epsilon_median_2x4k"] <= 1.0
    # Per layer step 2 sequences x 8 KV heads read their 128 chosen tokens' K and V (D 128, bf16) from the store.
    assert m["bytes_per_layer_step_sync_selection_2x4k"] == 2 * 8 * 128 * 2 * 128 * 2
    for mode in ("lagged", "sync_misses", "sync_selection"):
        assert len(row[mode]["samples_step_s"]) == 3 and row[mode]["claim_ms_per_layer"] > 0
        assert row["breakdown"][mode]["claim"] > 0 and "token top-k" in row["breakdown"][mode]
    # The same-run comparisons of the runtime's options, and which path each mode's steps took (on the
    # host there is no express path nor step graph; on CUDA the two modes that leave the express path never
    # take it, and only lagged_step_graphs replays graphs of whole steps).
    for name, mode in (("lagged_step_graphs_over_lagged_time_2x4k", "lagged_step_graphs"),
                       ("lagged_over_lagged_copy_now_time_2x4k", "lagged_copy_now")):
        ours = row[mode]["attention_ms_per_layer"]
        assert m[name] == pytest.approx(ours / row["lagged"]["attention_ms_per_layer"] if "step_graphs" in name
                                        else row["lagged"]["attention_ms_per_layer"] / ours)
    cuda = torch.cuda.is_available()
    for mode in bench.MODES:
        if not cuda or mode in ("lagged_general", "lagged_waits"):
            assert row[mode]["express_fraction"] == 0, mode
        if not cuda or mode != "lagged_step_graphs":
            assert row[mode]["graph_replay_fraction"] == 0, mode
    assert r["config"]["copy_programs"] >= 1
    assert "express / graphed layer-steps" in path.with_suffix(".md").read_text()
