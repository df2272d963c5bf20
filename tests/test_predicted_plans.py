"""The `predicted` head-plan policy: statistics cached at prefill, features at decode, predictor,
selector and the plan the runtime builds its tasks from (CPU; the CUDA-graph path is gpu-marked)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hybrid_runtime.config import ConfigError, config_from_dict, resolve_checkpoint
from hybrid_runtime.kvcache import KVStore
from hybrid_runtime.predicted_plans import PredictedHeadPlanner, batch_buckets
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.task_building import build_tasks
from predictor.features import FEATURE_NAMES, compute_prefill_statistics, decode_features
from predictor.model import Checkpoint, HeadPropertyNet, load_checkpoint
from tests.helpers import random_kv
from tests.test_runtime import sparse_step_reference

GEOM = {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
HQ, HKV, D = 8, 2, 32
KV = {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 4, "dtype": "fp32"}
TOL = dict(atol=2e-3, rtol=2e-3) if torch.cuda.is_available() else dict(atol=3e-5, rtol=1e-4)


def config(policy: dict | None = None, scheduler: dict | None = None, **kv):
    return config_from_dict({
        "geometry": GEOM, "kv_cache": {**KV, **kv}, "selection": {"name": "predicted", **(policy or {})},
        "scheduler": {"placement": "cpu_only", "cpu_workers": 1, "gpu_worker": False, "pin_cores": False,
                      **(scheduler or {})},
    })


def constant_checkpoint(bgt0: float, k: float, streaming_logit: float, head_split: bool = False) -> Checkpoint:
    """A predictor with known outputs: `bgt0`, `k` for every head; `p_streaming = sigmoid(streaming_logit)`,
    or with `head_split` streaming for query heads 2.. of 8 (the logit rises with `head_frac`)."""
    net = HeadPropertyNet(len(FEATURE_NAMES), hidden=(1,))
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        net.bgt0_head.bias.fill_(bgt0)
        net.k_head.bias.fill_(k)
        net.streaming_head.bias.fill_(streaming_logit)
        if head_split:  # h = SiLU(10 * head_frac); logit = 10 h - 20: heads 0, 1 retrieval, 2..7 streaming
            net.backbone[0].weight[0, FEATURE_NAMES.index("head_frac")] = 10.0
            net.streaming_head.weight.fill_(10.0)
            net.streaming_head.bias.fill_(-20.0)
    return Checkpoint(net.eval(), list(FEATURE_NAMES), tau=0.1)


def prefill(rt_or_planner, store, seq_id, length, seed, layers=(0, 1)):
    """Prompt KV and last query per layer, into the runtime (or a store and a planner)."""
    prompts = {}
    for layer in layers:
        k, v = random_kv(length, HKV, D, seed=seed + layer)
        q_last = torch.randn(HQ, D, generator=torch.Generator().manual_seed(seed + 50 + layer))
        if isinstance(rt_or_planner, HybridRuntime):
            rt_or_planner.prefill(seq_id, layer, k, v, q_last=q_last)
        else:
            store.prefill(seq_id, layer, k, v)
            rt_or_planner.prefill(seq_id, layer, k, v, q_last)
        prompts[layer] = (k, v, q_last)
    return prompts


def step_inputs(b, gen):
    return torch.randn(b, HQ, D, generator=gen), torch.randn(b, HKV, D, generator=gen), torch.randn(b, HKV, D, generator=gen)


# ---------------------------------------------------------------------------- plans
def test_plans_are_the_selector_of_the_predictions_and_streaming_heads_get_no_task():
    # On the host: the test swaps the planner's network (`planner.model`), which the torch paths
    # read; the fused CUDA kernels carry the checkpoint's weights from construction.
    cfg = config(device="cpu")
    with HybridRuntime(cfg, head_planner=None) as rt:
        planner = rt.planner
        planner_ckpt = constant_checkpoint(0.05, 0.01, 0.0, head_split=True)
        planner.model = planner_ckpt.model
        prefill(rt, rt.store, 0, 700, seed=1)
        prefill(rt, rt.store, 1, 300, seed=2)
        gen = torch.Generator().manual_seed(3)
        seen = []
        planner.on_selection = lambda layer, ids, sel: seen.append(sel)
        for step in range(3):
            for layer in (0, 1):
                q, k, v = step_inputs(2, gen)
                q = q.to(rt.store.device)  # the planner reads queries where the store's window is
                rt.store.append(layer, [0, 1], k, v)  # what decode does first for this planner
                features = planner.step_features(layer, [0, 1], q)
                plan = planner(layer, [0, 1], rt.store, q)
                bgt0, kk, p = (x.cpu().numpy().reshape(2, HQ) for x in planner.model.predict(features))
                expected = planner.selector(bgt0, kk, p, np.array([rt.store.cpu_len(s, layer) for s in (0, 1)]))
                np.testing.assert_array_equal(plan.block_size, expected.plan.block_size)
                np.testing.assert_allclose(plan.budgets, expected.plan.budgets)
                assert set(np.unique(plan.block_size)) <= set(cfg.selection.block_sizes)
                assert (plan.budgets[:, 2:] == 0).all() and (plan.budgets[:, :2] > 0).all()
                tasks = build_tasks(rt.store, layer, [0, 1], plan)
                # Query heads 4..7 (KV group 1) are all streaming: only group 0 of each sequence reads blocks.
                assert sorted((t.batch_index, t.kv_head) for t in tasks) == [(0, 0), (1, 0)]
                assert all(list(t.n_select[2:]) == [0, 0] for t in tasks)
                np.testing.assert_array_equal(seen[-1].has_task, [[True, False], [True, False]])


def test_runtime_output_matches_the_sparse_reference_of_its_plan():
    with HybridRuntime(config(device="cpu")) as rt:  # a swapped network: the eager path
        rt.planner.model = constant_checkpoint(0.04, 0.02, 0.0, head_split=True).model
        prefill(rt, rt.store, 0, 900, seed=4)
        prefill(rt, rt.store, 1, 500, seed=5)
        plans = []
        rt.planner.on_selection = lambda layer, ids, sel: plans.append(sel.plan)
        gen = torch.Generator().manual_seed(6)
        for layer in (0, 1):
            q, k, v = step_inputs(2, gen)
            out = rt.decode(layer, [1, 0], q, k, v)
            torch.testing.assert_close(out, sparse_step_reference(rt, layer, [1, 0], q, plans[-1]), **TOL)


@pytest.mark.parametrize("streaming_logit", [-30.0, 30.0])
def test_full_budget_checkpoint_equals_dense_and_all_streaming_the_window(streaming_logit):
    with HybridRuntime(config(device="cpu")) as rt:  # a swapped network: the torch path (above)
        rt.planner.model = constant_checkpoint(1.0, 0.0, streaming_logit).model
        prefill(rt, rt.store, 0, 800, seed=7)
        prefill(rt, rt.store, 1, 1200, seed=8)
        gen = torch.Generator().manual_seed(9)
        for step in range(20):  # generated_cap 16: the windows spill on the way
            for layer in (0, 1):
                q, k, v = step_inputs(2, gen)
                out = rt.decode(layer, [0, 1], q, k, v)
                ref = []
                for b, s in enumerate((0, 1)):
                    kf, vf = rt.store.full_kv(s, layer)
                    if streaming_logit > 0:  # no task: the sink and the recent tokens only
                        sink, cpu = rt.store.cfg.sink, rt.store.cpu_len(s, layer)
                        keep = torch.cat([torch.arange(sink), torch.arange(sink + cpu, kf.shape[0])])
                        kf, vf = kf[keep], vf[keep]
                    ref.append(dense_attention(q[b], kf, vf)[0])
                torch.testing.assert_close(out, torch.stack(ref), **TOL)
        assert rt.store.cpu_len(0, 0) > 800 - 36  # spilled
        n_tasks = sum(r.n_tasks for r in rt.timeline.records)
        assert (n_tasks == 0) == (streaming_logit > 0)


# ---------------------------------------------------------------------------- features from cached statistics
def test_decode_features_match_a_reference_from_the_full_kv_after_spills():
    with HybridRuntime(config()) as rt:
        store, planner = rt.store, rt.planner
        prompts = prefill(rt, store, 0, 600, seed=11)
        prefill(rt, store, 3, 250, seed=12)
        gen = torch.Generator().manual_seed(13)
        last_q = {layer: prompts[layer][2][None] for layer in (0, 1)}
        for step in range(40):
            for layer in (0, 1):
                q, k, v = step_inputs(2, gen)
                if step in (0, 17, 39):  # before this step's token: the reference appends it itself
                    store.append(layer, [0, 3], k, v)
                    got = planner.step_features(layer, [0, 3], q)
                    kf, vf = store.full_kv(0, layer)
                    sink_len, cpu = store.cfg.sink, store.cpu_len(0, layer)
                    recent = kf.shape[0] - sink_len - cpu
                    # Moments of today's CPU segment, straight from the full KV; anchor entries of the prompt.
                    now = compute_prefill_statistics(kf, vf, q[0], sink=sink_len, local=recent, tau=planner.tau)
                    pk, pv, pq = prompts[layer]
                    at_prefill = compute_prefill_statistics(pk, pv, pq, sink=sink_len, local=store.cfg.local,
                                                            tau=planner.tau)
                    spilled = cpu - int(at_prefill.n_cpu)
                    ref_stats = dataclasses.replace(
                        now, anchor_q=at_prefill.anchor_q, anchor_cpu_mass=at_prefill.anchor_cpu_mass,
                        anchor_stream_err=at_prefill.anchor_stream_err, anchor_budget=at_prefill.anchor_budget,
                        window_len=at_prefill.window_len - spilled)
                    keep = torch.cat([torch.arange(sink_len), torch.arange(sink_len + cpu, kf.shape[0])])
                    win_k, win_v = kf[keep].transpose(0, 1)[None], vf[keep].transpose(0, 1)[None]
                    ref = decode_features(ref_stats, q[:1], last_q[layer][:1], win_k, win_v,
                                          torch.tensor([keep.numel()]), layer, 2)
                    torch.testing.assert_close(got[:HQ].cpu(), ref, atol=2e-4, rtol=2e-4)
                    planner(layer, [0, 3], store, q.to(store.device))  # the plan (and the previous query) of this step
                else:
                    rt.decode(layer, [0, 3], q, k, v)
                last_q[layer] = q
        assert store.cpu_len(0, 0) > 600 - 36  # at least one spill was absorbed


def test_chunked_prefill_statistics_equal_the_whole_prompt():
    cfg = config()
    store = KVStore(cfg.kv_cache, cfg.geometry)
    planner = PredictedHeadPlanner(cfg.selection, cfg.geometry, store)
    k, v = random_kv(500, HKV, D, seed=21)
    q_last = torch.randn(HQ, D)
    store.prefill(0, 0, k[:200], v[:200])
    planner.prefill(0, 0, k[:200], v[:200], torch.randn(HQ, D))
    store.prefill(0, 0, k[200:], v[200:], extend=True)
    planner.prefill(0, 0, k[200:], v[200:], q_last, extend=True)
    whole = compute_prefill_statistics(k, v, q_last, sink=KV["sink"], local=KV["local"], tau=planner.tau)
    got = planner.statistics.gather(0, torch.tensor([store.slot(0)], device=store.device))
    for f in dataclasses.fields(whole):
        if f.name != "tau":
            torch.testing.assert_close(getattr(got, f.name).cpu(), getattr(whole, f.name).float(), atol=1e-5, rtol=1e-5)


def test_a_network_swapped_after_construction_is_refused_where_it_would_not_run():
    store = KVStore(config(device="cpu").kv_cache, config().geometry)
    try:
        eager = PredictedHeadPlanner(config().selection, config().geometry, store, path="eager")
        eager.model = constant_checkpoint(0.05, 0.01, 0.0).model  # read at every step: allowed
        if torch.cuda.is_available():
            cuda_store = KVStore(config(device="cuda").kv_cache, config().geometry)
            try:
                fused = PredictedHeadPlanner(config().selection, config().geometry, cuda_store, capture=False)
                with pytest.raises(ValueError, match="took its network when the planner was built"):
                    fused.model = constant_checkpoint(0.05, 0.01, 0.0).model
            finally:
                cuda_store.close()
    finally:
        store.close()


def test_the_runtime_warms_the_planner_up_on_its_background_thread():
    """The planner's kernels compile on the runtime's warm-up thread, not in the constructor; the first
    decode step waits for it like for every other kernel, and on CUDA then captures the planner's
    graphs on the caller's thread (a capture holds torch's default CUDA generator)."""
    with HybridRuntime(config()) as rt:
        assert any(name.startswith("predicted head planner") for name in rt._warm_up.kernels)
        prefill(rt, rt.store, 0, 600, seed=21)
        rt._warm_up._done.wait()
        if rt.planner.cuda and rt.planner._fused is not None:  # compiled in the background, nothing captured there
            assert rt.planner._fused_compiled and not rt.planner._fused_graphs and not rt.planner.warmed_up
        q, k, v = step_inputs(1, torch.Generator().manual_seed(22))
        assert torch.isfinite(rt.decode(0, [0], q, k, v)).all()
        assert rt._warm_up.ready and rt.planner.warmed_up
        if rt.planner.cuda and rt.planner._fused is not None:  # every (layer, bucket, dtype) graph captured
            assert len(rt.planner._fused_graphs) == 2 * len(rt.planner.buckets) * len(rt.planner._graph_q_dtypes)


def test_a_deferred_planner_warms_up_at_its_first_step():
    store = KVStore(config(device="cpu").kv_cache, config().geometry)
    try:
        planner = PredictedHeadPlanner(config().selection, config().geometry, store, path="eager", defer_warm_up=True)
        assert not planner.warmed_up
        prefill(planner, store, 0, 500, seed=23)
        q, k, v = step_inputs(1, torch.Generator().manual_seed(24))
        store.append(0, [0], k, v)
        plan = planner(0, [0], store, q)
        assert planner.warmed_up and plan.budgets.shape == (1, HQ)
        planner.warm_up()  # idempotent
    finally:
        store.close()


def test_buckets_and_released_slots():
    assert batch_buckets(1) == (1,) and batch_buckets(8) == (1, 2, 4, 8) and batch_buckets(6) == (1, 2, 4, 6)
    with HybridRuntime(config()) as rt:
        prefill(rt, rt.store, 0, 300, seed=31)
        slot = rt.store.slot(0)
        assert rt.planner.statistics.ready(0, [slot]).all()
        rt.release(0)
        assert not rt.planner.statistics.ready(0, [slot]).any()
        prefill(rt, rt.store, 5, 300, seed=32)  # the slot comes back with fresh statistics
        q, k, v = step_inputs(1, torch.Generator().manual_seed(33))
        assert torch.isfinite(rt.decode(0, [5], q, k, v)).all()


# ---------------------------------------------------------------------------- bad input
def test_config_refuses_unknown_block_sizes_and_missing_checkpoints():
    assert config().selection.name == "predicted"
    with pytest.raises(ConfigError, match=r"selection.block_sizes: \[64\] are not in kv_cache.block_sizes"):
        config({"block_sizes": [16, 64]}, block_sizes=[16, 32])
    with pytest.raises(ConfigError, match="selection.checkpoint: 'nowhere.pt' is not a file"):
        config({"checkpoint": "nowhere.pt"})
    with pytest.raises(ConfigError, match="selection.streaming_threshold"):
        config({"streaming_threshold": 1.0})


def test_bad_input_is_refused_before_anything_changes():
    with HybridRuntime(config()) as rt:
        k, v = random_kv(300, HKV, D)
        with pytest.raises(ValueError, match="needs q_last"):
            rt.prefill(0, 0, k, v)
        with pytest.raises(ValueError, match=r"q_last has shape \(8, 16\)"):
            rt.prefill(0, 0, k, v, q_last=torch.randn(8, 16))
        bad = torch.randn(HQ, D)
        bad[3, 5] = float("nan")
        with pytest.raises(ValueError, match="q_last has 1 NaN/inf value"):
            rt.prefill(0, 0, k, v, q_last=bad)
        assert rt.store.sequences() == []
    with HybridRuntime(config(scheduler={"placement": "fluxion", "gpu_worker": True})) as rt:
        prefill(rt, rt.store, 0, 300, seed=1)
        with pytest.raises(RuntimeError, match="plans from the step's queries"):
            rt.probe_gpu_lane(0, [0])
    cfg = config()
    store = KVStore(cfg.kv_cache, cfg.geometry)
    wrong = constant_checkpoint(0.1, 0.0, 0.0)
    wrong.feature_names = list(reversed(wrong.feature_names))
    with pytest.raises(ValueError, match="same names in another order"):
        PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=wrong)
    planner = PredictedHeadPlanner(cfg.selection, cfg.geometry, store)
    store.prefill(0, 0, k, v)  # into the store only: no statistics
    with pytest.raises(ValueError, match=r"sequences \[0\] have no prefill statistics at layer 0"):
        planner(0, [0], store, torch.randn(1, HQ, D))
    with pytest.raises(ValueError, match=r"q has shape \(2, 8, 32\); expected \[1, 8, 32\]"):
        planner(0, [0], store, torch.randn(2, HQ, D))


def query_checkpoint() -> Checkpoint:
    """A predictor whose budgets follow the query: bgt0 = 0.01 * SiLU(q_norm) (about 0.05 at D 32,
    different at every step), k 0.01, no streaming heads."""
    net = HeadPropertyNet(len(FEATURE_NAMES), hidden=(1,))
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        net.backbone[0].weight[0, FEATURE_NAMES.index("q_norm")] = 1.0
        net.bgt0_head.weight.fill_(0.01)
        net.k_head.bias.fill_(0.01)
        net.streaming_head.bias.fill_(-30.0)
    return Checkpoint(net.eval(), list(FEATURE_NAMES), tau=0.1)


def lag_steps(store, lagged, own, batches, gen, device="cpu"):
    """Decode steps over `batches` (one list of sequence ids per step) at both layers, each appending a
    token and planning with both planners: yields `(step, layer, ids, lagged plan, own plan)`."""
    for step, ids in enumerate(batches):
        for layer in (0, 1):
            q = torch.randn(len(ids), HQ, D, generator=gen).to(device)
            store.append(layer, ids, *(torch.randn(len(ids), HKV, D, generator=gen).to(device) for _ in range(2)))
            yield step, layer, ids, lagged(layer, ids, store, q), own(layer, ids, store, q)


def check_lagged_plans(store, lagged, own, batches, gen, device="cpu", atol=0.0):
    """A plan_lag 1 planner hands each step the plan its plan_lag 0 twin made at the layer's step
    before when that step had the same sequences, else the step's own plan; returns the lagged steps."""
    before: dict = {}
    lagged_steps = 0
    for step, layer, ids, a, b in lag_steps(store, lagged, own, batches, gen, device):
        prev = before.get(layer)
        expected = prev[1] if prev is not None and prev[0] == ids else b
        lagged_steps += expected is not b
        if expected is not b:  # the two plans differ: the check below tells them apart
            assert np.abs(expected.budgets - b.budgets).max() > 1e-4
        np.testing.assert_array_equal(a.block_size, expected.block_size)
        np.testing.assert_allclose(a.budgets, expected.budgets, atol=atol)
        before[layer] = (ids, b)
    assert lagged.lagged_steps == lagged_steps
    return lagged_steps


def test_a_lagged_planner_runs_each_step_on_the_plan_of_the_step_before():
    """plan_lag 1 (eager, on the host): the plan of the layer's step before for the same sequences; the
    first step, a step whose sequences changed and the first after a prefill plan for themselves. The
    budgets follow each step's query norms (`query_checkpoint`), so a wrong lag shows."""
    cfg = config(device="cpu")
    store = KVStore(cfg.kv_cache, cfg.geometry)
    lagged, own = (PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=query_checkpoint(), plan_lag=lag)
                   for lag in (1, 0))
    assert (lagged.plan_lag, own.plan_lag) == (1, 0)
    for s, n in ((0, 900), (1, 1300), (2, 600)):
        for layer in (0, 1):
            k, v = random_kv(n, HKV, D, seed=60 + s + layer)
            q_last = torch.randn(HQ, D, generator=torch.Generator().manual_seed(160 + s + layer))
            store.prefill(s, layer, k, v)
            lagged.prefill(s, layer, k, v, q_last)
            own.prefill(s, layer, k, v, q_last)
    gen = torch.Generator().manual_seed(61)
    # Per layer: steps 1, 2, 4 and 6 have the sequences of the step before.
    batches = [[0, 1], [0, 1], [0, 1], [1], [1], [2, 0, 1], [2, 0, 1]]
    assert check_lagged_plans(store, lagged, own, batches, gen) == 8
    # A prefill forgets the plans of the step before: the next step plans for itself.
    k, v = random_kv(300, HKV, D, seed=70)
    store.prefill(3, 0, k, v)
    lagged.prefill(3, 0, k, v, torch.randn(HQ, D))
    own.prefill(3, 0, k, v, torch.randn(HQ, D))
    q = torch.randn(3, HQ, D, generator=gen)
    store.append(0, [2, 0, 1], *(torch.randn(3, HKV, D, generator=gen) for _ in range(2)))
    steps = lagged.lagged_steps
    a, b = lagged(0, [2, 0, 1], store, q), own(0, [2, 0, 1], store, q)
    assert lagged.lagged_steps == steps
    np.testing.assert_allclose(a.budgets, b.budgets)
    store.close()


def test_a_runtime_with_lagged_plans_attends_the_plan_of_the_step_before():
    with HybridRuntime(config({"plan_lag": 1}, device="cpu")) as rt:
        assert rt.planner.plan_lag == 1
        rt.planner.model = query_checkpoint().model  # budgets that change with each step's queries
        prefill(rt, rt.store, 0, 900, seed=8)
        prefill(rt, rt.store, 1, 500, seed=9)
        made: dict = {0: [], 1: []}
        rt.planner.on_selection = lambda layer, ids, sel: made[layer].append(sel.plan)
        gen = torch.Generator().manual_seed(10)
        for step in range(3):
            for layer in (0, 1):
                q, k, v = step_inputs(2, gen)
                out = rt.decode(layer, [0, 1], q, k, v)
                used = made[layer][-1] if step == 0 else made[layer][-2]
                if step:
                    assert np.abs(made[layer][-1].budgets - used.budgets).max() > 1e-4
                torch.testing.assert_close(out, sparse_step_reference(rt, layer, [0, 1], q, used), **TOL)
        assert rt.planner.lagged_steps == 4


# ---------------------------------------------------------------------------- CUDA graphs
def cuda_planner_pair(first: dict, second: dict,
                      checkpoint: Checkpoint | None = None) -> tuple[KVStore, PredictedHeadPlanner, PredictedHeadPlanner]:
    """Two planners (keyword arguments `first`, `second`) with the shipped checkpoint (or `checkpoint`)
    over one bf16 store of 4 sequences on CUDA, three prompts prefilled into the store and both planners."""
    cfg = config()
    cfg = dataclasses.replace(cfg, kv_cache=dataclasses.replace(cfg.kv_cache, dtype="bf16", max_sequences=4))
    store = KVStore(cfg.kv_cache, cfg.geometry)
    shipped = checkpoint or load_checkpoint(resolve_checkpoint(cfg.selection.checkpoint))
    a, b = (PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=shipped, **kw) for kw in (first, second))
    for s, n in ((0, 700), (1, 1500), (2, 400)):
        for layer in (0, 1):
            k, v = (x.cuda() for x in random_kv(n, HKV, D, seed=40 + s + layer))
            q_last = torch.randn(HQ, D, device="cuda")
            store.prefill(s, layer, k, v)
            a.prefill(s, layer, k, v, q_last)
            b.prefill(s, layer, k, v, q_last)
    return store, a, b


def cuda_planner_steps(store: KVStore, a: PredictedHeadPlanner, b: PredictedHeadPlanner, seed: int,
                       q_dtype: torch.dtype = torch.float32):
    """Four decode steps of batches [0, 1, 2], [2], [1, 0] (buckets 4 with a padding row, 1, 2) at both
    layers, each appending a token and planning with both planners: yields `(ids, plan_a, plan_b)`."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(4):
        for ids in ([0, 1, 2], [2], [1, 0]):
            for layer in (0, 1):
                q = torch.randn(len(ids), HQ, D, generator=gen).cuda().to(q_dtype)
                store.append(layer, ids, *(torch.randn(len(ids), HKV, D, generator=gen).cuda() for _ in range(2)))
                yield ids, a(layer, ids, store, q), b(layer, ids, store, q)


@pytest.mark.gpu
def test_graph_replay_equals_eager():
    store, graphed, eager = cuda_planner_pair({"path": "graph"}, {"path": "eager"})
    assert len(graphed._graphs) == 2 * len(graphed.buckets) and not eager._graphs
    for ids, a, b in cuda_planner_steps(store, graphed, eager, seed=41):
        np.testing.assert_array_equal(a.block_size, b.block_size)
        np.testing.assert_allclose(a.budgets, b.budgets, atol=1e-4)
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("capture", [True, False])
def test_fused_lagged_plans_are_the_fused_plans_of_the_step_before(capture):
    """plan_lag 1 on the fused CUDA path (replays, or launches, the host does not wait for; each
    layer's own index, reference and output rows) hands each step the plan its plan_lag 0 twin made
    at the layer's step before for the same sequences, and the step's own plan after a change."""
    store, lagged, own = cuda_planner_pair({"path": "fused", "plan_lag": 1, "capture": capture},
                                           {"path": "fused", "capture": capture}, checkpoint=query_checkpoint())
    gen = torch.Generator().manual_seed(47)
    batches = [[0, 1, 2]] * 3 + [[1, 0]] * 3 + [[2]] * 2
    assert check_lagged_plans(store, lagged, own, batches, gen, device="cuda", atol=1e-6) == 2 * (2 + 2 + 1)
    lagged.settle()
    assert not lagged._in_flight
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("plan_lag", [0, 1])
def test_predicted_steps_replay_the_window_graph_before_planning(plan_lag):
    """On CUDA, a step without a spill appends the token the predicted planner reads from the window
    graph, replayed before the planner (one replay for append and window attention): the outputs equal
    a runtime's that appends and attends kernel by kernel (`kv_cache.window_graphs: false`)."""
    outs, replays = {}, {}
    for graphs in (True, False):
        cfg = config({"plan_lag": plan_lag}, {"placement": "fluxion", "gpu_worker": True}, window_graphs=graphs)
        with HybridRuntime(cfg) as rt:
            assert rt.device.type == "cuda" and rt.planner.path == "fused"
            for s, n in ((0, 700), (1, 1500)):
                for layer in (0, 1):
                    k, v = (x.cuda() for x in random_kv(n, HKV, D, seed=80 + s + layer))
                    rt.prefill(s, layer, k, v, q_last=torch.randn(HQ, D, generator=torch.Generator().manual_seed(90 + s + layer)).cuda())
            gen = torch.Generator().manual_seed(81)
            outs[graphs] = []
            for step in range(5):
                for layer in (0, 1):
                    q, k, v = (x.cuda() for x in step_inputs(2, gen))
                    outs[graphs].append(rt.decode(layer, [1, 0], q, k, v).cpu())
            replays[graphs] = rt.stats()["window_graph_replays"]
    assert replays[True] > 0 and replays[False] == 0
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.gpu
def test_a_cuda_runtime_runs_each_step_on_the_plan_made_a_step_before(tmp_path):
    """plan_lag 1 on CUDA: a step reads the plan its layer's step before made (`lagged_plan`, before
    any of its own work) and launches the next one after the window part (`launch_next`). Each
    output is the sparse attention of the plan a plan_lag 0 twin made a step earlier (the first
    step's own), whose budgets follow the queries, so a wrong lag shows."""
    path = tmp_path / "query.pt"
    query_checkpoint().save(path)
    own: dict = {0: [], 1: []}  # plan_lag 0: the plan of every step, in order
    for lag in (0, 1):
        cfg = config({"plan_lag": lag, "checkpoint": str(path)}, {"placement": "fluxion", "gpu_worker": True})
        with HybridRuntime(cfg) as rt:
            for s, n in ((0, 700), (1, 1500)):
                for layer in (0, 1):
                    k, v = (x.cuda() for x in random_kv(n, HKV, D, seed=70 + s + layer))
                    q_last = torch.randn(HQ, D, generator=torch.Generator().manual_seed(75 + s + layer)).cuda()
                    rt.prefill(s, layer, k, v, q_last=q_last)
            if not lag:
                rt.planner.on_selection = lambda layer, ids, sel: own[layer].append(sel.plan)
            gen = torch.Generator().manual_seed(71)
            for step in range(4):
                for layer in (0, 1):
                    q, k, v = (x.cuda() for x in step_inputs(2, gen))
                    out = rt.decode(layer, [0, 1], q, k, v)
                    if lag:
                        plan = own[layer][max(step - 1, 0)]
                        expected = sparse_step_reference(rt, layer, [0, 1], q.cpu(), plan)
                        torch.testing.assert_close(out.cpu(), expected.to(out.dtype), **TOL)
            if lag:
                assert rt.planner.lagged_steps == 6
                rt.planner.settle()
    for layer in (0, 1):  # the plans differ from step to step
        assert all(np.abs(a.budgets - b.budgets).max() > 1e-4 for a, b in zip(own[layer], own[layer][1:]))


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["q", "k", "v"])
def test_nonfinite_input_is_refused_before_the_window_graph_appends(bad):
    """The predicted planner's window graph replays before the planner: the NaN/inf check riding on
    q's copy is read before that replay, so a refused step appends nothing."""
    # "sync": under "auto" the CPU lane starts on the device's word and the check is deferred.
    # q_last is drawn on the host: the runtime's warm-up thread captures the planner's CUDA graphs
    # meanwhile, and a capture holds torch's default CUDA generator (a draw from it on another thread
    # raises "Offset increment outside graph capture"; seen once on the H200 at 7c635d2).
    with HybridRuntime(config(scheduler={"placement": "fluxion", "gpu_worker": True, "finite_check": "sync"})) as rt:
        for s, n in ((0, 700), (1, 1500)):
            for layer in (0, 1):
                k, v = (x.cuda() for x in random_kv(n, HKV, D, seed=85 + s + layer))
                q_last = torch.randn(HQ, D, generator=torch.Generator().manual_seed(87 + s + layer)).cuda()
                rt.prefill(s, layer, k, v, q_last=q_last)
        gen = torch.Generator().manual_seed(86)
        rt.decode(0, [0, 1], *(x.cuda() for x in step_inputs(2, gen)))  # the graph of (layer 0, batch 2) exists
        assert not rt._will_spill(0, [0, 1])
        before = [list(x) for x in rt.store.step_rows(0, [0, 1])]
        replays = rt.stats()["window_graph_replays"]
        q, k, v = (x.cuda() for x in step_inputs(2, gen))
        {"q": q, "k": k, "v": v}[bad][1, 0, 2] = float("nan")
        with pytest.raises(ValueError, match=f"{bad} has 1 NaN/inf"):
            rt.decode(0, [0, 1], q, k, v)
        assert [list(x) for x in rt.store.step_rows(0, [0, 1])] == before
        assert rt.stats()["window_graph_replays"] == replays
        out = rt.decode(0, [0, 1], *(x.cuda() for x in step_inputs(2, gen)))  # usable after the refusal
        assert torch.isfinite(out).all() and rt.stats()["window_graph_replays"] == replays + 1


@pytest.mark.gpu
def test_fused_graphs_equal_fused_launches():
    """The fused path replayed from its CUDA graphs (queries by reference, a graph per layer, bucket
    and the store's bf16 and fp32; rows past a batch below its bucket idle) gives the plans of the
    same kernels launched by the host with the static queries' way (on the caller's tensor), step
    after step (the previous-query state included)."""
    store, graphed, launched = cuda_planner_pair({"path": "fused"},
                                                 {"path": "fused", "capture": False, "fused_queries": "static"})
    assert len(graphed._fused_graphs) == 2 * len(graphed.buckets) * 2 and not launched._fused_graphs
    for ids, a, b in cuda_planner_steps(store, graphed, launched, seed=43, q_dtype=torch.bfloat16):
        np.testing.assert_array_equal(a.block_size, b.block_size)
        np.testing.assert_allclose(a.budgets, b.budgets, atol=1e-6)
        np.testing.assert_allclose(graphed.predictions(graphed.buckets[-1], len(ids)),
                                   launched.predictions(launched.buckets[-1], len(ids)), atol=1e-5, rtol=1e-5)
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fused_graphs_by_reference_equal_static_graphs(q_dtype):
    """The graphs reading the queries by reference plan as the graphs reading the static buffer the
    step copies them into (`fused_queries` `static`, the previous way): bf16 and fp32 queries by
    reference, fp16 (no graph of its own) through the fp32 static buffer; the queries a strided view."""
    store, by_ref, static = cuda_planner_pair({"path": "fused"}, {"path": "fused", "fused_queries": "static"})
    assert len(static._fused_graphs) == 2 * len(static.buckets)
    gen = torch.Generator().manual_seed(47)
    m = by_ref.buckets[-1]
    for step in range(3):
        for ids in ([0, 1, 2], [2], [1, 0]):
            for layer in (0, 1):
                wide = torch.randn(len(ids), HQ, 2 * D, generator=gen).cuda().to(q_dtype)
                q = wide[:, :, D:]  # rows and heads 2 D apart
                store.append(layer, ids, *(torch.randn(len(ids), HKV, D, generator=gen).cuda() for _ in range(2)))
                a, b = by_ref(layer, ids, store, q), static(layer, ids, store, q)
                np.testing.assert_array_equal(a.block_size, b.block_size)
                np.testing.assert_allclose(a.budgets, b.budgets, rtol=1e-5, atol=1e-6)
                # The same arithmetic on queries loaded two ways: compiled, a last-bit difference is possible.
                np.testing.assert_allclose(by_ref.predictions(m, len(ids)), static.predictions(m, len(ids)),
                                           rtol=1e-5, atol=1e-6)
    store.close()


# ---------------------------------------------------------------------------- through transformers
def test_generate_through_the_predicted_policy_equals_dense_at_full_budget(tmp_path):
    """A left-padded batch through `HybridCache`: prefill hands each row's last query to the runtime,
    and a predictor forcing budget 1.0 reproduces the model's own attention."""
    pytest.importorskip("transformers", reason="the transformers backend needs the `models` extra")
    from transformers import DynamicCache

    from hybrid_runtime.integrations.transformers import HybridCache, disable_hybrid_attention, enable_hybrid_attention
    from tests.test_transformers_integration import forced_logits, hybrid_cfg, left_padded, tiny_model

    path = tmp_path / "full.pt"
    constant_checkpoint(1.0, 0.0, -30.0).save(path)
    model = tiny_model("llama")
    ids, mask = left_padded([300, 180])
    cont = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    ref = forced_logits(model, ids, mask, cont, DynamicCache(config=model.config))
    rt = enable_hybrid_attention(model, hybrid_cfg(selection={"name": "predicted", "checkpoint": str(path)}))
    try:
        cache = HybridCache(model)
        got = forced_logits(model, ids, mask, cont, cache)
        assert sum(r.n_tasks for r in rt.timeline.records) > 0
        slots = [rt.store.slot(s) for s in cache.seq_ids]
        assert rt.planner.statistics.ready(1, slots).all()
    finally:
        disable_hybrid_attention(model)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------------- the selector on the device
@pytest.mark.parametrize("skip_streaming", [True, False])
def test_device_selector_equals_the_host_selector(skip_streaming):
    from hybrid_runtime.selector import GranularitySelector

    rng = np.random.default_rng(5)
    b, hq = 6, 8
    bgt0 = rng.uniform(-0.1, 0.3, (b, hq)).astype(np.float32)
    k = rng.uniform(-0.02, 0.05, (b, hq)).astype(np.float32)
    bgt0[0], k[0] = 0.05, 0.0  # equal budgets at every block size: ties of Eq. 3 go to the smallest block
    p = rng.uniform(0, 1, (b, hq)).astype(np.float32)
    p[1] = 0.9  # a sequence whose heads are all streaming
    cpu_len = np.array([4096, 3000, 0, 17, 100000, 640])
    for blocks in ((16, 32, 64, 128), (32,), (16, 64)):
        sel = GranularitySelector(4, 64, 2, blocks)
        host = sel(bgt0, k, p if skip_streaming else np.zeros((b, hq), bool), cpu_len)
        blk, budgets, volume = sel.on_device("cpu")(torch.from_numpy(bgt0), torch.from_numpy(k), torch.from_numpy(p),
                                                    torch.from_numpy(cpu_len), skip_streaming)
        np.testing.assert_array_equal(blk.numpy(), host.plan.block_size)
        np.testing.assert_array_equal(budgets.numpy(), host.plan.budgets)
        np.testing.assert_allclose(volume.numpy(), host.volume)


# ---------------------------------------------------------------------------- labels -> training -> plans, tiny
@pytest.mark.parametrize("criterion", ["output", "score95"])
def test_tiny_labels_train_a_predictor_that_plans(tmp_path, criterion):
    transformers = pytest.importorskip("transformers")
    from predictor.labels import LabelSettings, build
    from predictor.train import TrainSettings, run

    torch.manual_seed(0)
    mcfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                    max_position_embeddings=2048, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(mcfg).eval()
    settings = LabelSettings(lengths=(400, 640), span=32, sink=4, local=32, positions=4, texts=3, criterion=criterion)
    build(model, torch.randint(0, 256, (2100,)), settings, tmp_path / "labels.npz", progress=lambda _: None)
    ckpt = str(tmp_path / "tiny.pt")
    run(str(tmp_path / "labels.npz"), ckpt, TrainSettings(hidden=(32, 32), batch_size=64, max_epochs=20, patience=5,
                                                        threads=1), log=None)
    with HybridRuntime(config({"checkpoint": ckpt}, local=32, sink=4)) as rt:
        prefill(rt, rt.store, 0, 600, seed=61)
        gen = torch.Generator().manual_seed(62)
        for layer in (0, 1):
            q, k, v = step_inputs(1, gen)
            assert torch.isfinite(rt.decode(layer, [0], q, k, v)).all()
        assert rt.planner.tau == pytest.approx(0.1)


# ---------------------------------------------------------------------------- the overhead benchmark, tiny
def test_overhead_benchmark_variants_are_fused_planners():
    """`--fused-variant NAME:KEY=VALUE,...`: planner keys and launch choices, refused when unknown."""
    from benchmarks import predictor_overhead as po

    assert po.parse_variant("static:queries=static") == ("static", {"queries": "static"})
    assert po.parse_variant("lag1:lag=1") == ("lag1", {"lag": 1})
    assert po.parse_variant("g4:predict_groups=4,predict_block_n=16") == ("g4", {"predict_groups": 4,
                                                                               "predict_block_n": 16})
    for bad, message in (("x", "expected NAME:KEY=VALUE"), ("x:parts", "is not KEY=VALUE"),
                         ("x:warps=4", "unknown key 'warps'"), ("p4:parts=2", "would be the row")):
        with pytest.raises(ValueError, match=message):
            po.parse_variant(bad)
    cfg = config()
    with HybridRuntime(cfg) as rt:
        from gpu_kernels._checks import interpreted

        if rt.store.device.type == "cuda" or interpreted():
            planner = po.variant_planner(cfg, rt, {"queries": "static", "parts": 2, "predict_block_n": 16})
            assert planner.fused_queries == "static" and planner._fused.parts == 2
            assert po.variant_planner(cfg, rt, {"lag": 1}).plan_lag == 1


def test_overhead_metric_takes_its_path_from_the_runtimes_own_paths_only():
    from benchmarks import predictor_overhead as po

    modes = ["fused", "graph", "fused_launch", "fused_p4", "fused_g8", "fused_lag1", "eager"]
    assert po.metric_paths(modes, ["fused_lag1"], {"fused_p4", "fused_g8"}) == ["fused", "graph", "fused_launch"]
    assert po.metric_paths(["eager", "fused_p4"], [], {"fused_p4"}) == ["eager"]


def test_overhead_benchmark_runs_quick_on_the_cpu(tmp_path):
    import json

    from benchmarks import predictor_overhead

    assert predictor_overhead.main(["--quick", "--steps", "2", "--warmup", "1", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("predictor_overhead-*.json")
    record = json.loads(path.read_text())
    m = record["metrics"]
    assert m["predictor_overhead_fraction_2x2k"] > 0 and m["decode_fixed_layer_us_median_2x2k"] > 0
    assert record["points"][0]["eager"]["wall"]["samples"] == 2 * 2  # steps x layers
    # The planner's own host time in place: one call per layer-step measured.
    assert record["points"][0]["decode_in_situ"]["planner_call"]["samples"] == 2 * 2
    assert m["predictor_in_situ_call_us_median_2x2k"] > 0 and m["decode_reads_window_layer_us_median_2x2k"] > 0
    assert path.with_suffix(".md").is_file()


def test_overhead_benchmark_plan_agreement_compares_plans_on_the_same_queries():
    """`plan_agreement` (what a `--fused-variant` that changes numerics does to the plans): a planner
    against its twin agrees everywhere; against one that makes every head streaming, no streaming call
    agrees and it reads nothing."""
    from benchmarks import predictor_overhead as po

    cfg = config(device="cpu")
    with HybridRuntime(cfg, head_planner=None) as rt:
        g = rt.geometry
        base = PredictedHeadPlanner(cfg.selection, g, rt.store, checkpoint=constant_checkpoint(0.05, 0.01, -9.0))
        twin = PredictedHeadPlanner(cfg.selection, g, rt.store, checkpoint=constant_checkpoint(0.05, 0.01, -9.0))
        streaming = PredictedHeadPlanner(cfg.selection, g, rt.store, checkpoint=constant_checkpoint(0.05, 0.01, 9.0))
        for s, length in ((0, 700), (1, 300)):
            for layer in (0, 1):
                k, v = random_kv(length, HKV, D, seed=10 * s + layer)
                q_last = torch.randn(HQ, D, generator=torch.Generator().manual_seed(20 * s + layer))
                rt.store.prefill(s, layer, k, v)
                for planner in (base, twin, streaming):
                    planner.prefill(s, layer, k, v, q_last)
        gen = torch.Generator().manual_seed(7)
        same = po.plan_agreement(rt, base, twin, 2, 2, gen)
        assert same["streaming_agreement"] == same["block_size_agreement"] == 1.0
        assert same["budget_abs_diff_max"] == 0.0 and same["read_ratio"] == pytest.approx(1.0)
        assert same["heads"] == 2 * 2 * 2 * HQ and same["groups"] == 2 * 2 * 2 * HKV  # steps x layers x batch
        apart = po.plan_agreement(rt, base, streaming, 2, 2, gen)
        assert apart["streaming_agreement"] == 0.0 and apart["read_ratio"] == 0.0
