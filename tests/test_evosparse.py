"""EvoSparse: retrieval-score propagation (Eq. 3), the heat update against numpy, dense at full budget,
both lanes, bytes counted, config errors that name the key."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from hybrid_runtime.config import ConfigError, config_from_dict
from hybrid_runtime.evosparse_selection import decay_and_add, heat_increment, select_blocks
from hybrid_runtime.executors.evosparse import DENSE, SCORE_INHERITED, SCORE_QUEST, SCORE_RETRIEVAL
from hybrid_runtime.pinning import torch_threads
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.runtime import HybridRuntime

GEOM = {"layers": 5, "q_heads": 4, "kv_heads": 2, "head_dim": 32}
# Layer 2 has a retrieval head in KV group 0 (query head 1), layer 4 one in group 1 (query head 3).
RETRIEVAL = {(2, 1): 0.6, (4, 3): 0.3, (3, 0): 0.05}


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


def head_file(tmp_path, scores=RETRIEVAL, layers=GEOM["layers"], q_heads=GEOM["q_heads"]):
    heads = [{"layer": l, "head": h, "score": scores.get((l, h), 0.0)} for l in range(layers) for h in range(q_heads)]
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"geometry": {"layers": layers, "q_heads": q_heads, "kv_heads": 2, "head_dim": 32},
                                "heads": heads}))
    return str(path)


def evo_config(tmp_path, placement="gpu_only", **evo):
    section = {"budget_tokens": 64, "block_size": 16, "dense_layers": 1, **evo}
    if section.get("selector", "evosparse") == "evosparse":
        section.setdefault("head_file", head_file(tmp_path))
    sched = ({"placement": "gpu_only", "cpu_workers": 0, "gpu_worker": True} if placement == "gpu_only"
             else {"placement": "cpu_only", "cpu_workers": 1, "gpu_worker": False, "pin_cores": False})
    return config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 16, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 2,
                     "dtype": "fp32"},
        "selection": {"name": "evosparse"},
        "scheduler": sched,
        "profiling": {"enabled": False},
        "evosparse": section,
    })


def run_steps(rt, steps, lengths=(400, 700), seed=0, check_dense=False, after_layer=None):
    gen = torch.Generator().manual_seed(seed)
    seq_ids = list(range(len(lengths)))
    for s, n in zip(seq_ids, lengths):
        for layer in range(GEOM["layers"]):
            rt.prefill(s, layer, torch.randn(n, 2, 32, generator=gen), torch.randn(n, 2, 32, generator=gen))
    for step in range(steps):
        for layer in range(GEOM["layers"]):
            q = torch.randn(len(seq_ids), 4, 32, generator=gen) * 2
            k, v = torch.randn(len(seq_ids), 2, 32, generator=gen), torch.randn(len(seq_ids), 2, 32, generator=gen)
            out = rt.decode(layer, seq_ids, q, k, v)
            if check_dense:
                ref = torch.stack([dense_attention(q[b], *rt.store.full_kv(s, layer))[0] for b, s in enumerate(seq_ids)])
                torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)
            if after_layer is not None:
                after_layer(step, layer, seq_ids, q)


# ---------------------------------------------------------------------------- selection
def test_select_blocks_takes_top_scores_then_hottest_of_the_rest_ties_to_score():
    score = torch.tensor([[5.0, 1.0, 4.0, 3.0, 2.0, float("-inf")]])
    heat = torch.tensor([[9.0, 0.0, 0.0, 0.0, 0.5, 7.0]])
    idx, valid = select_blocks(score, heat, torch.tensor([2]), torch.tensor([2]), 2, 2)
    chosen = sorted(idx[valid].tolist())
    # top-2 by score: 0, 2; hottest of the rest: 4 (0.5), then a tie at 0 between 1 and 3 -> 3 (higher score).
    # Block 5 is not a block (-inf score) although it is hot.
    assert chosen == [0, 2, 3, 4]


def test_heat_update_matches_numpy_over_several_steps():
    rng = np.random.default_rng(0)
    t, g, s, nb, decay = 3, 2, 4, 10, 0.8
    heat = torch.zeros((t, nb))
    ref = np.zeros((t, nb))
    rows = (torch.arange(t),)
    for _ in range(5):
        idx = np.stack([rng.choice(nb, s, replace=False) for _ in range(t)])
        valid = rng.random((t, s)) < 0.8
        mass = rng.random((t, g, s)).astype(np.float32)
        lse_task = rng.normal(size=(t, g)).astype(np.float32)
        lse_final = lse_task + rng.random((t, g)).astype(np.float32)  # the window adds mass
        inc = heat_increment(torch.from_numpy(mass), torch.from_numpy(lse_task), torch.from_numpy(lse_final),
                             torch.from_numpy(valid))
        decay_and_add(heat, rows, torch.from_numpy(idx), inc, decay)
        # numpy: h <- lambda h + s, s = sum over the group of p_head(block) * exp(lse_task - lse_final).
        s_tok = (mass * np.exp(lse_task - lse_final)[..., None]).sum(1) * valid
        ref *= decay
        for i in range(t):
            np.add.at(ref[i], idx[i], s_tok[i])
    np.testing.assert_allclose(heat.numpy(), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- the executor in the runtime
def test_score_sources_follow_eq3_propagation(tmp_path):
    """Layer 0 dense; layer 1 before any retrieval layer: Quest; layer 2: group 0 scores its retrieval
    head, group 1 has none and no earlier retrieval layer: Quest; layer 3 (its head scores under the
    threshold) inherits from layer 2; layer 4: group 1 retrieval, group 0 inherits from layer 2."""
    with HybridRuntime(evo_config(tmp_path, retrieval_threshold=0.1)) as rt:
        ex = rt.gpu_executor
        assert ex.retrieval_layers == [2, 4]
        kinds = {l: ex._kinds(l, np.array([0, 1])).tolist() for l in range(5)}
    assert kinds == {0: [DENSE, DENSE], 1: [SCORE_QUEST, SCORE_QUEST], 2: [SCORE_RETRIEVAL, SCORE_QUEST],
                     3: [SCORE_INHERITED, SCORE_INHERITED], 4: [SCORE_INHERITED, SCORE_RETRIEVAL]}
    with HybridRuntime(evo_config(tmp_path, propagate=False)) as rt:
        assert rt.gpu_executor._kinds(3, np.array([0, 1])).tolist() == [SCORE_QUEST, SCORE_QUEST]


def test_inherited_blocks_are_the_retrieval_layers_top_blocks(tmp_path):
    """At layer 3 (no retrieval heads) each group's query-aware blocks are the top-k_r of layer 2's
    retrieval mass summed over KV heads (Eq. 3), computed from layer 2's queries in the same step."""
    cfg = evo_config(tmp_path, retrieval_share=1.0)  # no heat: the whole budget is the inherited part
    seen = {}

    def check(step, layer, seq_ids, q):
        ex = rt.gpu_executor
        if layer == 2:
            # Layer 2's retrieval head is query head 1 (group 0): its exact softmax over the CPU keys, pooled.
            masses = []
            for s in seq_ids:
                k, _ = rt.store.full_kv(s, layer)  # window + CPU segment, positions in order
                n_cpu = rt.store.cpu_len(s, layer)
                kc = k[16 : 16 + n_cpu, 0]  # the CPU segment of KV head 0
                p = torch.softmax(kc @ (q[seq_ids.index(s), 1] / 32**0.5), 0)
                pad = -(-n_cpu // 16) * 16 - n_cpu
                masses.append(torch.nn.functional.pad(p, (0, pad)).view(-1, 16).sum(1))
            seen["mass"] = masses
        if layer == 3:
            for b, s in enumerate(seq_ids):
                slot = rt.store.slot(s)
                want = seen["mass"][b]
                got = ex.rmass[ex._r_index[2], slot, :, : len(want)].sum(0)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            seen["checked"] = True

    with HybridRuntime(cfg) as rt:
        run_steps(rt, 2, after_layer=check)
        assert rt.gpu_executor.tasks_by_score[SCORE_INHERITED] > 0
    assert seen.get("checked")


@pytest.mark.parametrize("placement", ["gpu_only", "cpu_only"])
def test_full_budget_is_dense_attention_on_both_lanes(tmp_path, placement):
    """A budget covering every block (any split of it between retrieval and heat) is dense attention."""
    with HybridRuntime(evo_config(tmp_path, placement, budget_tokens=4096, retrieval_share=0.5)) as rt:
        run_steps(rt, 2, check_dense=True)
        ex = rt.gpu_executor if placement == "gpu_only" else rt.cpu_executor
        assert type(ex).__name__ == "EvoSparseExecutor" and ex.device == placement[:3]
        assert ex.tasks_by_score[SCORE_RETRIEVAL] > 0 and ex.tasks_by_score[SCORE_INHERITED] > 0


def test_sparse_budget_reads_less_and_heat_accumulates(tmp_path):
    with HybridRuntime(evo_config(tmp_path, budget_tokens=64, retrieval_share=0.5, decay=0.5)) as rt:
        run_steps(rt, 3)
        ex = rt.gpu_executor
        assert float(ex.heat[1:].sum()) > 0.0 and float(ex.heat[0].sum()) == 0.0  # dense layer 0 keeps none
        # Per decode step, every group of a sparse layer reads at most its budget of K and V, plus the
        # metadata (Quest) or the keys (retrieval) of its segment.
        assert 0 < ex.bytes_read
        st = rt.stats()
        assert st["evosparse_tasks_retrieval"] > 0 and st["evosparse_tasks_dense"] > 0
        # Releasing a sequence clears its slot's heat.
        slot = rt.store.slot(0)
        rt.release(0)
        assert float(ex.heat[:, slot].abs().sum()) == 0.0


def test_bytes_count_the_retrieval_full_key_read(tmp_path):
    """Layer 2 group 0 reads every key of its segment (retrieval); group 1 the metadata (Quest)."""
    cfg = evo_config(tmp_path, retrieval_share=1.0)
    with HybridRuntime(cfg) as rt:
        run_steps(rt, 1, lengths=(400,))
        tasks = rt._tasks(2, [0], rt.planner(2, [0], rt.store))
        rt.gpu_executor.run(tasks, _step_for(rt, 2, 1))
        by_head = {t.kv_head: t.bytes_read for t in tasks}
        n_cpu = rt.store.cpu_len(0, 2)
        nb = -(-n_cpu // 16)
        row = 32 * 4
        assert by_head[0] == nb * 16 * row + 4 * 16 * row  # all keys + V of the 4 selected blocks
        assert by_head[1] == nb * 2 * row + 4 * 16 * 2 * row  # min/max metadata + K and V of 4 blocks


def _step_for(rt, layer, batch):
    from hybrid_runtime.tasks import Step

    return Step.empty(layer, torch.randn(batch, 4, 32), 2)


def test_quest_selector_needs_no_head_file_and_runs(tmp_path):
    with HybridRuntime(evo_config(tmp_path, selector="quest")) as rt:
        run_steps(rt, 1)
        assert rt.gpu_executor.retrieval_layers == [] and rt.gpu_executor.heat.numel() == 0


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize("change, key", [
    ({"scheduler": {"placement": "fluxion"}}, "scheduler.placement"),
    ({"evosparse": {"block_size": 24}}, "evosparse.block_size"),
    ({"evosparse": {"decay": 1.0}}, "evosparse.decay"),
    ({"evosparse": {"retrieval_share": 1.5}}, "evosparse.retrieval_share"),
    ({"evosparse": {"dense_layers": 9}}, "evosparse.dense_layers"),
    ({"evosparse": {"head_file": "no/such/file.json"}}, "evosparse.head_file"),
    ({"evosparse": {"selector": "quest", "decay": 0.5}}, "evosparse.decay"),
    ({"evosparse": {"budget_tokens": 0}}, "evosparse.budget_tokens"),
    ({"selection": {"name": "fixed"}}, "evosparse"),
])
def test_config_errors_name_the_key(tmp_path, change, key):
    data = {"geometry": GEOM, "selection": {"name": "evosparse"},
            "scheduler": {"placement": "gpu_only", "cpu_workers": 0, "gpu_worker": True},
            "evosparse": {"head_file": head_file(tmp_path)}}
    for section, values in change.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError, match=f"^{key.replace('.', '[.]')}"):
        config_from_dict(data)


def test_head_file_of_another_model_is_refused(tmp_path):
    path = head_file(tmp_path, q_heads=8)
    with pytest.raises(ConfigError, match=r"^evosparse\.head_file: .*8 query heads"):
        config_from_dict({"geometry": GEOM, "selection": {"name": "evosparse"},
                          "scheduler": {"placement": "gpu_only", "cpu_workers": 0, "gpu_worker": True},
                          "evosparse": {"head_file": path}})


# ---------------------------------------------------------------------------- the quality experiment's statistics
def test_paired_bootstrap_interval_and_metric_names():
    from hybrid_runtime.experiments import evosparse_quality as eq

    a = np.array([1] * 90 + [0] * 10)
    assert eq.paired_bootstrap(a, a, 500, 0) == (0.0, 0.0, 0.0)
    b = np.array([1] * 70 + [0] * 30)  # a wins on 20 positions, never loses
    d, lo, hi = eq.paired_bootstrap(a, b, 2000, 0)
    assert d == pytest.approx(0.2) and 0.1 < lo < 0.2 < hi < 0.3
    s = dataclasses.asdict(eq.EvoSparseQualitySettings(lengths=(1024,), positions=100, budgets=(256, 512)))

    def run(method, budget, match):
        return {"method": method, "budget": budget, "agreement": float(np.mean(match)), "kl": 0.1, "match": list(match),
                "bytes_per_step": 1.0}

    results = {"settings": s, "lengths": {"1024": {"runs": [
        run("evosparse", 512, a), run("quest", 512, b), run("noheat", 512, b), run("evosparse", 256, b),
        run("quest", 256, b)]}}}
    m = eq.metrics_of(results)
    assert m["agreement_evosparse_512"] == pytest.approx(0.9) and m["agreement_quest_512"] == pytest.approx(0.7)
    assert m["agreement_diff_ci_low_512"] > 0 and m["agreement_diff_256"] == 0.0
    assert "agreement_diff_noheat_ci_low_512" in m and "agreement_diff_nopropagation_512" not in m


def test_quality_settings_refuse_what_they_cannot_run():
    from hybrid_runtime.experiments import evosparse_quality as eq

    with pytest.raises(ValueError, match="ablation_budgets"):
        eq.EvoSparseQualitySettings(budgets=(256,), ablation_budgets=(512,))
    with pytest.raises(ValueError, match="methods"):
        eq.EvoSparseQualitySettings(methods=("quest",))
    with pytest.raises(ValueError, match="runtime"):
        eq.EvoSparseQualitySettings(runtime={"evosparse": {"budget_tokens": 64}})


@pytest.mark.gpu
def test_cuda_lane_matches_the_cpu_lane_through_a_spill(tmp_path):
    """On CUDA (state on the device, the arena read through its UVA view): the same outputs, heat and
    bytes as the CPU lane on the same inputs, over 18 steps (a spill at step 16)."""
    results = {}
    for placement in ("gpu_only", "cpu_only"):
        cfg = evo_config(tmp_path, placement, budget_tokens=64, retrieval_share=0.5, decay=0.8)
        with HybridRuntime(cfg) as rt:
            ex = rt.gpu_executor if placement == "gpu_only" else rt.cpu_executor
            assert ex.cuda == (placement == "gpu_only")
            outs = []
            gen = torch.Generator().manual_seed(0)
            for s, n in enumerate((300, 1000)):
                for layer in range(GEOM["layers"]):
                    rt.prefill(s, layer, torch.randn(n, 2, 32, generator=gen).cuda(),
                               torch.randn(n, 2, 32, generator=gen).cuda())
            for _ in range(18):
                for layer in range(GEOM["layers"]):
                    q = torch.randn(2, 4, 32, generator=gen).cuda() * 2
                    outs.append(rt.decode(layer, [0, 1], q, torch.randn(2, 2, 32, generator=gen).cuda(),
                                          torch.randn(2, 2, 32, generator=gen).cuda()).float().cpu())
            results[placement] = (torch.stack(outs), ex.heat.cpu(), ex.bytes_read)
    torch.testing.assert_close(results["gpu_only"][0], results["cpu_only"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(results["gpu_only"][1], results["cpu_only"][1], atol=1e-5, rtol=1e-4)
    assert results["gpu_only"][2] == results["cpu_only"][2] > 0
