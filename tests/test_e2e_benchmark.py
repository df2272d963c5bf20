"""CPU checks of benchmarks/e2e_decode.py: one (model, point, variant) measured end to end on a tiny
random Llama (dense and the hybrid cpu_only), the floor, the out-of-memory and skip records, the
metric assembly (synthetic points) and the results files. The real measurements run on the device."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the e2e benchmark needs the `models` extra")

import transformers  # noqa: E402

from benchmarks import e2e_decode as e2e  # noqa: E402
from hybrid_runtime.experiments import generate_timing as gt  # noqa: E402
from hybrid_runtime.kvcache import arena_bytes  # noqa: E402
from hybrid_runtime.profiling import step_stats  # noqa: E402

CONTEXT, NEW, BATCH = 300, 4, 2
CPU_RUNTIME = {"kv_cache": {"sink": 16, "local": 32, "generated_cap": 16},
               "scheduler": {"cpu_workers": 1, "gpu_worker": False, "pin_cores": False}}


def tiny_config():
    return transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=4096)


@pytest.fixture(scope="module")
def model():
    return e2e.build_model(tiny_config(), "cpu", torch.float32, seed=0)


@pytest.fixture(scope="module")
def measured(model):
    """Rows of the dense and the hybrid cpu_only variants, and what the runtime's timeline held."""
    seen = {}
    orig = e2e._timeline_fields

    def spy(rt, layers):  # an independent count of the same records (per-lane sums of step_stats)
        recs = rt.timeline.records
        seen["records"] = len(recs)
        seen["bytes"] = sum(step_stats(r)["bytes_cpu"] + step_stats(r)["bytes_gpu"] for r in recs)
        seen["geometry"] = rt.geometry
        seen["kv_cfg"] = rt.store.cfg
        return orig(rt, layers)

    rows = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(e2e, "_timeline_fields", spy)
        for name in ("dense", "cpu_only"):
            rows[name] = e2e.run_unit(model, "tiny", e2e.VARIANTS[name], BATCH, CONTEXT, new_tokens=NEW,
                                      warmup_tokens=64, cpu_workers=1, hybrid_overrides=CPU_RUNTIME)
    return rows, seen


# ---------------------------------------------------------------------------- one unit on the CPU
@pytest.mark.parametrize("name", ["dense", "cpu_only"])
def test_timing_fields_are_positive_and_consistent(measured, name):
    row = measured[0][name]
    assert row["status"] == "ok", row.get("traceback") or row.get("reason")
    assert (row["model"], row["batch"], row["context"], row["variant"]) == ("tiny", BATCH, CONTEXT, name)
    assert row["new_tokens"] == NEW and not row["stopped_by_time_cap"]
    assert row["tpot_samples"] == NEW - 1 == len(row["tpot_ms"])
    tpot = np.array(row["tpot_ms"])
    assert row["ttft_s"] > 0 and (tpot > 0).all()
    assert row["tpot_ms_median"] == pytest.approx(np.median(tpot))
    assert row["tpot_ms_mean"] == pytest.approx(tpot.mean())
    assert tpot.min() <= row["tpot_ms_p99"] <= row["tpot_ms_max"] == pytest.approx(tpot.max())
    assert row["decode_s"] == pytest.approx(tpot.sum() / 1e3)
    assert row["ttft_s"] + row["decode_s"] <= row["generate_s"] + 1e-9
    assert row["warmup_s"] > 0 and row["unit_s"] >= row["generate_s"]
    # The estimate the contract asks for, from the geometry (KV + weights), on every row.
    same = e2e.build_model(tiny_config(), "cpu", torch.float32)
    weights = sum(p.numel() * p.element_size() for p in same.parameters())
    assert row["kv_bytes_est"] == 2 * 2 * 2 * 32 * 2 * BATCH * CONTEXT
    assert row["needed_bytes_est"] == row["kv_bytes_est"] + weights
    json.dumps(e2e._plain(row))  # JSON-ready


def test_hybrid_bytes_per_step_equal_the_timeline_totals(measured):
    row, seen = measured[0]["cpu_only"], measured[1]
    layers = seen["geometry"].layers
    # The timeline holds the measured call's decode steps only (the warm-up's were cleared).
    assert row["decode_steps"] == NEW - 1 == row["tpot_samples"]
    assert row["timeline_records"] == seen["records"] == (NEW - 1) * layers
    assert row["bytes_per_step"] > 0
    assert row["timeline_bytes_total"] == seen["bytes"] > 0
    assert row["bytes_per_step"] * row["decode_steps"] == pytest.approx(row["timeline_bytes_total"])
    # The lanes' own counts over the same call agree (what a row without a timeline takes instead).
    assert row["lane_bytes_per_step"] == pytest.approx(row["bytes_per_step"]) and "bytes_per_step_from" not in row
    assert row["gpu_byte_share"] == 0.0  # cpu_only: every byte read by the CPU workers
    assert row["runtime_construction_s"] > 0
    # The workers' start-up is not in the construction: the warm-up's first decode step waited for
    # what was left of it (the measured call's steps never wait), and the workers had started.
    assert 0.0 <= row["worker_start_wait_s"] <= row["warmup_s"]
    assert row["worker_start_s"] is not None and row["worker_start_s"] > 0
    # Likewise the kernel warm-up: the warm-up call's first step waited for what was left of it.
    assert 0.0 <= row["kernel_warmup_wait_s"] <= row["warmup_s"]
    assert row["kernel_warmup_s"] is not None and row["kernel_warmup_s"] > 0
    # The arenas reserve the whole capacity and commit (pin, with CUDA) what the prompts use.
    assert row["reserved_host_bytes"] == arena_bytes(seen["kv_cfg"], seen["geometry"])[1] > 0
    assert row["pinned_host_bytes"] == (0 if not row["host_arena_pinned"] else row["pinned_host_bytes"])
    assert 0 <= row["pinned_host_bytes"] <= row["reserved_host_bytes"]
    assert seen["kv_cfg"].cpu_capacity_tokens == BATCH * (CONTEXT + NEW)
    assert row["runtime_stats"]["placement"] == "cpu_only"
    assert row["runtime_stats"]["jit_launches_after_warmup"] == 0  # no Triton launch without CUDA
    # The calling thread over the decode: its switches and its core at every token (Linux /proc).
    assert row["decode_caller_switches_involuntary"] >= 0 and row["decode_caller_switches_voluntary"] >= 0
    assert len(row["decode_caller_cpus"]) == row["new_tokens"]
    assert all(c in os.sched_getaffinity(0) for c in row["decode_caller_cpus"])
    # ... and per token interval, what the host lost over it (no steal on a bare machine is 0, not None).
    assert len(row["tpot_steal_core_ms"]) == len(row["tpot_caller_switches_involuntary"]) == len(row["tpot_ms"])
    assert all(x >= 0 for x in row["tpot_steal_core_ms"] + row["tpot_caller_switches_involuntary"])
    assert sum(row["tpot_caller_switches_involuntary"]) <= row["decode_caller_switches_involuntary"]
    on_worker = row["decode_caller_on_worker_core_tokens"]
    assert on_worker is None or 0 <= on_worker <= row["new_tokens"]
    assert row["torch_threads_decode"] >= 1
    # Where a step's time went around the layers: every part measured, the host parts of one step
    # within its token interval (they are disjoint host spans of the same step).
    split = {k: row[f"step_{k}_median"] for k in ("decode_host_ms", "between_layers_host_ms", "q_wait_ms",
                                                   "attention_ms", "merge_after_return_ms")}
    assert all(v >= 0 for v in split.values()) and split["decode_host_ms"] > 0 and split["attention_ms"] > 0
    assert split["between_layers_host_ms"] > 0  # the model's own layers ran between the runtime's
    assert split["decode_host_ms"] + split["between_layers_host_ms"] <= max(row["tpot_ms"]) + 1e-6
    # Without a GPU, attention ends when decode returns: nothing lags the return.
    assert split["merge_after_return_ms"] == 0.0
    # Step by step too: one entry per recorded step, each labelled with its decode token.
    series = row["step_series"]
    assert len(series["token"]) == row["decode_steps"] and series["token"] == sorted(series["token"])
    assert len(series["lead_ms"]) == len(series["gpu_byte_share"]) == row["decode_steps"]
    assert float(np.median(series["decode_host_ms"])) == pytest.approx(split["decode_host_ms"], abs=1e-3)
    # ... and the thread's legs through decode, which add up to no more than its time there (each
    # value is rounded to 1 us: six roundings).
    legs = np.sum([series[k] for k in ("host_to_scheduler_ms", "scheduler_to_release_ms", "release_to_scheduler_return_ms",
                                       "scheduler_return_to_merge_ms", "merge_to_return_ms")], axis=0)
    assert (legs > 0).all() and (legs <= np.asarray(series["decode_host_ms"]) + 3e-3).all()
    # The timeline's own host time on the decode path: some was spent, a part of the tokens' time.
    assert row["timeline_record_s"] > 0 and row["timeline_resolve_s"] >= 0
    assert 0 < row["timeline_host_ms_per_token"] < float(np.mean(row["tpot_ms"]))
    phases = {k: row[f"step_{k}_median"] for k in ("lead_ms", "tasks_ms", "tail_ms", "cpu_task_busy_ms")}
    assert phases["tasks_ms"] > 0 and phases["cpu_task_busy_ms"] > 0 and phases["lead_ms"] >= 0


def test_attention_splits_into_lead_tasks_and_tail():
    from hybrid_runtime.profiling.timeline import StepRecord

    def rec(t_start, t_end, starts=(), ends=(), lanes=(), t_entry=0.0, t_return=0.0):
        n = len(starts)
        return StepRecord(index=0, layer=0, batch=1, placement="fluxion", t_start=t_start, t_end=t_end,
                          worker=np.zeros(n, np.int16), lane=np.array(lanes, np.int8), seq_id=np.zeros(n, np.int64),
                          kv_head=np.zeros(n, np.int16), start=np.array(starts, float), end=np.array(ends, float),
                          bytes_read=np.zeros(n, np.int64), modeled_bytes=np.zeros(n, np.int64),
                          overhead=np.zeros(n), gpu_intervals=np.zeros((0, 2)), t_entry=t_entry, t_return=t_return)

    # One step of two layers: a CPU and a GPU task, then a layer-step without tasks (all tail).
    recs = [rec(1.000, 1.010, starts=(1.002, 1.001), ends=(1.008, 1.007), lanes=(0, 1), t_entry=0.999, t_return=1.004),
            rec(1.020, 1.023, t_entry=1.019, t_return=1.021)]
    split = gt.layer_time_split(recs, layers=2)
    assert split["step_lead_ms_median"] == pytest.approx(1.0)  # q at 1.000, first task at 1.001
    assert split["step_tasks_ms_median"] == pytest.approx(7.0)  # 1.001 .. 1.008
    assert split["step_tail_ms_median"] == pytest.approx(2.0 + 3.0)  # 1.008 .. 1.010, and 1.020 .. 1.023
    assert split["step_cpu_task_busy_ms_median"] == pytest.approx(6.0)  # the CPU task only
    assert split["step_attention_ms_median"] == pytest.approx(1.0 + 7.0 + 5.0)

    # The same parts step by step, with each lane's lead and the GPU's share of the bytes; a second step
    # whose only task is a CPU one, and the tokens they were, sampled one in 8 from the second.
    recs[0].bytes_read[:] = (300, 100)
    recs += [rec(2.000, 2.006, starts=(2.003,), ends=(2.005,), lanes=(0,), t_entry=1.999, t_return=2.002),
             rec(2.010, 2.011, t_entry=2.009, t_return=2.010)]
    recs[2].bytes_read[:] = 50
    series = gt.layer_time_series(recs, layers=2, sample_every=8, sample_offset=1)
    assert series["token"] == [1, 9]
    assert series["lead_ms"] == pytest.approx([1.0, 3.0])
    assert series["cpu_lead_ms"] == pytest.approx([2.0, 3.0]) and series["gpu_lead_ms"] == pytest.approx([1.0, 0.0])
    assert series["gpu_byte_share"] == pytest.approx([0.25, 0.0])
    assert series["attention_ms"][0] == pytest.approx(split["step_attention_ms_median"])
    assert gt.layer_time_split(recs, layers=2)["step_lead_ms_median"] == pytest.approx(2.0)  # median of 1 and 3
    assert gt.layer_time_series(recs[:3], layers=2) == {}  # not whole steps

    # The thread's path through decode between its milestones: the first layer-step has every one,
    # the second (no tasks) only the merge's, which is then its only leg.
    recs[0].t_scheduled, recs[0].t_release, recs[0].t_scheduler_return, recs[0].t_merge_issued = 0.9992, 0.9995, 1.0030, 1.0035
    recs[1].t_merge_issued = 1.0205
    legs = gt.layer_time_series(recs, layers=2)
    assert legs["host_to_scheduler_ms"][0] == pytest.approx(0.2)
    assert legs["scheduler_to_release_ms"][0] == pytest.approx(0.3)
    assert legs["release_to_scheduler_return_ms"][0] == pytest.approx(3.5)
    assert legs["scheduler_return_to_merge_ms"][0] == pytest.approx(0.5)
    assert legs["merge_to_return_ms"][0] == pytest.approx(0.5 + 0.5)  # 1.0035 .. 1.004, and 1.0205 .. 1.021
    assert legs["release_to_scheduler_return_ms"][1] == 0.0  # a step without marks adds nothing


def test_a_row_without_a_timeline_takes_its_bytes_per_step_from_the_lanes_counts(model):
    row = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion_unprofiled"], BATCH, CONTEXT, new_tokens=NEW,
                       warmup_tokens=64, cpu_workers=1, hybrid_overrides=CPU_RUNTIME)
    assert row["status"] == "ok" and row["timeline_records"] == 0
    assert row["timeline_host_ms_per_token"] == 0.0  # nothing recorded, nothing converted
    assert row["bytes_per_step_from"] == "lane counts" and row["bytes_per_step"] == row["lane_bytes_per_step"] > 0
    e2e.annotate_points([row], {}, ceiling_GBps=100.0)
    assert "floor_ms" not in row  # no no-attention step measured here; with one, the floor follows from the counts
    row["floor_noattn_paired_ms"] = 1.0
    e2e.annotate_points([row], {}, ceiling_GBps=100.0)
    assert row["floor_ms"] == pytest.approx(1.0 + row["bytes_per_step"] / 1e8)


def test_a_full_warmup_variant_warms_up_over_the_whole_prompt(model):
    # The warm-up generate of `fluxion_every_step_full_warmup` runs over the point's whole context (its
    # lanes' estimates learned at full size); the other hybrid variants over --warmup-tokens of it.
    full = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion_every_step_full_warmup"], BATCH, CONTEXT, new_tokens=NEW,
                        warmup_tokens=64, cpu_workers=1, hybrid_overrides=CPU_RUNTIME)
    short = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion_every_step"], BATCH, CONTEXT, new_tokens=NEW,
                         warmup_tokens=64, cpu_workers=1, hybrid_overrides=CPU_RUNTIME)
    assert full["status"] == short["status"] == "ok"
    assert full["warmup_tokens"] == CONTEXT and short["warmup_tokens"] == 64
    assert full["step_series"]["token"][0] == 0  # every step recorded, the first after the prompt included
    costs = e2e.CostModel()
    cfg = e2e.model_config("llama-3.1-8b")
    assert costs.predict(cfg, e2e.VARIANTS["fluxion_every_step_full_warmup"], 4, 32768, 24, None, 0) > \
        costs.predict(cfg, e2e.VARIANTS["fluxion_every_step"], 4, 32768, 24, None, 0)


def test_a_sampled_row_takes_its_bytes_per_step_from_the_lanes_counts_too(model):
    """The table's rows record one token in `--timeline-every` (8); fluxion_every_step records every token."""
    assert e2e.parse_args([]).timeline_every == e2e.TIMELINE_EVERY == 8
    row = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion"], BATCH, CONTEXT, new_tokens=NEW,
                       warmup_tokens=64, cpu_workers=1, hybrid_overrides=CPU_RUNTIME, timeline_every=8)
    assert row["status"] == "ok" and row["timeline_sample_every"] == 8 and row["timeline_sample_offset"] == 1
    # The second decode token, both layers (the first, slower than the rest, is left out of the sample).
    assert row["tpot_samples"] == NEW - 1 and row["timeline_records"] == 2
    assert row["bytes_per_step_from"] == "lane counts" and row["bytes_per_step"] == row["lane_bytes_per_step"] > 0
    every = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion_every_step"], BATCH, CONTEXT, new_tokens=NEW,
                         warmup_tokens=64, cpu_workers=1, hybrid_overrides=CPU_RUNTIME, timeline_every=8)
    assert every["status"] == "ok" and every["timeline_sample_every"] == 1 and every["timeline_sample_offset"] == 0
    assert every["timeline_records"] == (NEW - 1) * 2 and "bytes_per_step_from" not in every
    with pytest.raises(SystemExit):
        e2e.parse_args(["--timeline-every", "0"])


def test_the_model_is_left_as_it_was(model, measured):
    from hybrid_runtime.integrations.transformers import hybrid_runtime_of

    assert hybrid_runtime_of(model) is None
    assert model.config._attn_implementation == "sdpa"


def test_floor_replaces_attention_with_a_no_op(model, monkeypatch):
    calls = []

    def counting(module, query, *args, **kwargs):
        calls.append(query.shape)
        return e2e._noop_attention(module, query, *args, **kwargs)

    with e2e.attention_replaced(model, "e2e_test_noop", counting):
        out = model(torch.randint(3, 256, (2, 5)))
    assert model.config._attn_implementation == "sdpa"
    assert len(calls) == 2 and out.logits.shape == (2, 5, 256)
    f = e2e.measure_floor(model, BATCH, NEW)
    assert f["batch"] == BATCH and f["noattn_step_ms"] > 0 and f["dense_ctx16_step_ms"] > 0
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs thread affinity and two cores")
def test_pinned_caller_is_confined_from_its_first_decode_step_and_restored(model, monkeypatch):
    # Confined before the runtime existed, every thread the runtime started inherited the one core
    # (ec01fbe: 3-38x the TPOT). Now: after prefill, once per generate, and undone after each.
    calls, affinity_before = [], os.sched_getaffinity(0)

    def spy(cores):
        calls.append((list(cores), len(threading.enumerate())))
        return e2e_confine(cores)

    e2e_confine = e2e.confine_current_thread
    monkeypatch.setattr(e2e, "confine_current_thread", spy)
    pinned = {"scheduler": {**CPU_RUNTIME["scheduler"], "pin_cores": True}}
    row = e2e.run_unit(model, "tiny", e2e.VARIANTS["cpu_only_pinned_caller"], BATCH, CONTEXT, new_tokens=NEW,
                       warmup_tokens=64, cpu_workers=1, hybrid_overrides={**CPU_RUNTIME, **pinned})
    assert row["status"] == "ok", row.get("traceback") or row.get("reason")
    assert os.sched_getaffinity(0) == affinity_before
    assert isinstance(row["caller_core"], int)
    # Once in the warm-up's generate and once in the measured one, each on the runtime's free core.
    assert [c for c, _ in calls] == [[row["caller_core"]]] * 2
    assert all(n_threads > 1 for _, n_threads in calls), "the runtime's threads exist before the caller is confined"


def test_a_variant_selection_replaces_the_fixed_one_with_its_keys():
    cfg = e2e.hybrid_config(e2e.VARIANTS["fluxion"], 4, 32768, 24, 15)
    assert e2e.with_variant_selection(cfg, e2e.VARIANTS["fluxion"]) is cfg
    pred = e2e.with_variant_selection(cfg, e2e.VARIANTS["fluxion_predictor"]).selection
    lagged = e2e.with_variant_selection(cfg, e2e.VARIANTS["fluxion_predictor_lagged"]).selection
    assert (pred.name, pred.plan_lag) == ("predicted", 0)
    assert (lagged.name, lagged.plan_lag) == ("predicted", 1)
    assert lagged.block_size == cfg.selection.block_size  # a key both selections read is kept


# ---------------------------------------------------------------------------- records that are not measurements
def test_skips_and_out_of_memory_are_recorded_never_dropped(model, monkeypatch):
    kw = dict(new_tokens=NEW, warmup_tokens=0, cpu_workers=1, hybrid_overrides=CPU_RUNTIME)
    monkeypatch.setattr(e2e.SelectionConfig, "checkpoint", "predictor/checkpoints/missing.pt")
    pred = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion_predictor"], BATCH, CONTEXT, **kw)
    assert pred["status"] == "skipped" and "missing.pt is not in this tree" in pred["reason"]
    monkeypatch.undo()
    off = e2e.run_unit(model, "tiny", e2e.VARIANTS["offloaded"], BATCH, CONTEXT, **kw)
    assert off["status"] == "skipped" and "CUDA" in off["reason"]
    # Estimated: the lower bound (weights + KV + one MLP's prefill activations) exceeds the device.
    est = e2e.run_unit(model, "tiny", e2e.VARIANTS["dense"], BATCH, CONTEXT, gpu_bytes=10**5, **kw)
    assert est["status"] == "oom" and est["oom_source"] == "estimate" and "GPU" in est["reason"]
    assert est["needed_bytes_est"] == est["kv_bytes_est"] + est["weight_bytes"]
    assert "ttft_s" not in est
    host = e2e.run_unit(model, "tiny", e2e.VARIANTS["cpu_only"], BATCH, CONTEXT, host_bytes=10**5, **kw)
    assert host["status"] == "oom" and "host" in host["reason"] and host["needed_host_bytes_est"] > 10**5

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(e2e, "measure_variant", oom)
    caught = e2e.run_unit(model, "tiny", e2e.VARIANTS["dense"], BATCH, CONTEXT, **kw)
    assert caught["status"] == "oom" and caught["oom_source"] == "caught" and "64.00 GiB" in caught["reason"]

    def broken(*a, **k):
        raise ValueError("something else")

    monkeypatch.setattr(e2e, "measure_variant", broken)
    err = e2e.run_unit(model, "tiny", e2e.VARIANTS["dense"], BATCH, CONTEXT, **kw)
    assert err["status"] == "error" and "something else" in err["reason"] and "traceback" in err


def test_memory_estimates_of_the_reference_geometries():
    llama = e2e.model_config("llama-3.1-8b")
    assert e2e.param_count(llama) == pytest.approx(8.03e9, rel=0.002)
    assert e2e.param_count(e2e.model_config("qwen2.5-7b")) == pytest.approx(7.62e9, rel=0.002)
    assert e2e.kv_bytes(llama, 4, 131072) == 2 * 32 * 8 * 128 * 2 * 4 * 131072  # 64 GiB
    w = e2e.param_count(llama) * 2
    dense = e2e.memory_estimate(llama, e2e.VARIANTS["dense"], 4, 131072, w, None)
    assert e2e.fit_problems(dense, e2e.H100_BYTES, e2e.H100_HOST_BYTES)  # 4 x 128K dense cannot fit an H100
    hcfg = e2e.hybrid_config(e2e.VARIANTS["fluxion"], 4, 131072, 24, 15)
    hyb = e2e.memory_estimate(llama, e2e.VARIANTS["fluxion"], 4, 131072, w, hcfg)
    assert hyb["needed_host_bytes_est"] > hyb["kv_bytes_est"]  # the arenas hold the KV and block metadata
    assert not e2e.fit_problems(hyb, e2e.H100_BYTES, e2e.H100_HOST_BYTES)
    # HF's offloaded cache: the prompt's pinned blocks stay cached beside the first decode step's,
    # rounded up to powers of two (context + 1 tokens: twice the prompt's at 128K).
    off = e2e.memory_estimate(llama, e2e.VARIANTS["offloaded"], 4, 131072, w, None)
    assert off["needed_host_bytes_est"] == 3 * off["kv_bytes_est"]  # 192 GiB: killed on a 125 GiB host
    assert any(p.startswith("host:") for p in e2e.fit_problems(off, e2e.H100_BYTES, 125 * 2**30))
    off32 = e2e.memory_estimate(llama, e2e.VARIANTS["offloaded"], 8, 32768, w, None)
    assert not e2e.fit_problems(off32, e2e.H100_BYTES, 125 * 2**30)  # 96 GiB: it ran there


def test_parts_of_one_commit_merge_into_one_table(tmp_path, monkeypatch):
    from benchmarks import e2e_merge

    limits = {"concurrent_ceiling_GBps": 100.0, "cpu_concurrent_GBps": 60.0, "gpu_concurrent_GBps": 40.0}
    paths = []
    for i, (b, c) in enumerate(((4, 32768), (4, 131072))):
        monkeypatch.setenv("HYBRID_COMMIT", "abc1234")
        pts = [_pt("m", b, c, "dense", med=50.0), _pt("m", b, c, "fluxion", med=60.0 + i, bytes_per_step=1e9),
               _pt("m", b, c, "offloaded", med=900.0)]
        floors = {("m", b): {"noattn_step_ms": 20.0 + i, "dense_ctx16_step_ms": 21.0}}
        e2e.annotate_points(pts, floors, limits["concurrent_ceiling_GBps"] + 10 * i)
        extra = {"limits": {**limits, "concurrent_ceiling_GBps": 100.0 + 10 * i}, "complete": i == 0,
                 "floors": [{"model": "m", "batch": b, **floors[("m", b)]}]}
        paths.append(str(e2e.write(pts, extra, str(tmp_path / f"part{i}.json"))))
    out = e2e_merge.main(paths + ["--out", str(tmp_path / "merged.json")])
    r = json.loads(out.read_text())
    assert r["commit"] == "abc1234" and not r["complete"] and [d["part"] for d in r["parts"]] == [0, 1]
    assert [d["points"] for d in r["parts"]] == [["4x32K"], ["4x128K"]]
    # Rows keep their own call's floor: 20 ms + 1 GB over 100 GB/s, and 21 ms + 1 GB over 110 GB/s.
    flux = {p["context"]: p for p in r["points"] if p["variant"] == "fluxion"}
    assert flux[32768]["floor_ms"] == pytest.approx(30.0) and flux[131072]["floor_ms"] == pytest.approx(21 + 1e3 / 110)
    assert flux[131072]["part"] == 1 and len(r["points"]) == 6
    assert r["metrics"]["fluxion_tpot_over_floor_max"] == pytest.approx(61 / (21 + 1e3 / 110))
    assert r["metrics"]["offloaded_over_fluxion_tpot_min"] == pytest.approx(900 / 61)
    md = out.with_suffix(".md").read_text()
    assert "2 calls at this commit" in md and "part 1 (4x128K;" in md and "INCOMPLETE" in md
    # Parts of two commits (or machines) do not make one table; nor does a merged file.
    other = json.loads(Path(paths[1]).read_text())
    other["commit"] = "def5678"
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(e2e_merge.MergeError, match="commit 'def5678' differs"):
        e2e_merge.load_parts([paths[0], str(tmp_path / "other.json")])
    with pytest.raises(e2e_merge.MergeError, match="already a merged file"):
        e2e_merge.load_parts([str(out)])


def test_prompts_whose_prefill_does_not_fit_are_chunked():
    llama = e2e.model_config("llama-3.1-8b")
    w = e2e.param_count(llama) * 2
    hcfg = e2e.hybrid_config(e2e.VARIANTS["fluxion"], 4, 131072, 24, 15)
    # 4 x 128K: one forward needs ~64 GiB of activations beside 15 GiB of weights (it failed on an H100).
    est = e2e.memory_estimate(llama, e2e.VARIANTS["fluxion"], 4, 131072, w, hcfg, e2e.H100_BYTES)
    chunk = est["prefill_chunk_tokens"]
    assert chunk is not None and chunk < 131072 and 131072 % chunk == 0
    need = e2e.PREFILL_MARGIN * e2e.prefill_activation_bytes(llama, 4, chunk, 131072 - chunk, 2)
    assert need + w <= e2e.H100_BYTES  # the chunk fits beside the weights
    assert e2e.PREFILL_MARGIN * e2e.prefill_activation_bytes(llama, 4, 2 * chunk, 131072 - 2 * chunk, 2) + w > e2e.H100_BYTES
    assert est["prefill_activation_bytes_est"] == 3 * 4 * chunk * 14336 * 2
    # 4 x 32K fits in one forward; no GPU limit given: no chunking either.
    small = e2e.memory_estimate(llama, e2e.VARIANTS["fluxion"], 4, 32768, w,
                                e2e.hybrid_config(e2e.VARIANTS["fluxion"], 4, 32768, 24, 15), e2e.H100_BYTES)
    assert small["prefill_chunk_tokens"] is None
    assert e2e.memory_estimate(llama, e2e.VARIANTS["fluxion"], 4, 131072, w, hcfg)["prefill_chunk_tokens"] is None


# ---------------------------------------------------------------------------- metrics from points
def _pt(model, b, c, variant, status="ok", ttft=1.0, med=10.0, mean=None, bytes_per_step=None, construct=None):
    p = {"model": model, "batch": b, "context": c, "variant": variant, "status": status,
         "kind": "hybrid" if variant in ("cpu_only", "fluxion") else "hf"}
    if status == "ok":
        p.update(ttft_s=ttft, tpot_ms_median=med, tpot_ms_mean=med if mean is None else mean)
        if bytes_per_step is not None:
            p["bytes_per_step"] = bytes_per_step
        if construct is not None:
            p["runtime_construction_s"] = construct
    else:
        p.update(reason="does not fit", oom_source="estimate", needed_bytes_est=80 * 2**30)
    return p


def synthetic_points():
    return [
        _pt("m", 4, 32768, "dense", ttft=2.0, med=20.0),
        _pt("m", 4, 32768, "offloaded", ttft=2.5, med=400.0),
        _pt("m", 4, 32768, "cpu_only", ttft=5.0, med=90.0, bytes_per_step=2e9, construct=4.0),
        _pt("m", 4, 32768, "fluxion", ttft=6.0, med=60.0, mean=66.0, bytes_per_step=2e9, construct=5.0),
        _pt("m", 4, 131072, "dense", status="oom"),  # out of memory: no TTFT ratio at this point
        _pt("m", 4, 131072, "offloaded", ttft=9.0, med=3000.0),
        _pt("m", 4, 131072, "fluxion", ttft=30.0, med=200.0, mean=260.0, bytes_per_step=8e9, construct=9.0),
        _pt("m", 8, 32768, "fluxion", ttft=8.0, med=100.0, bytes_per_step=4e9, construct=6.0),  # no floor for b=8
        {"model": "m", "batch": 2, "context": 98304, "variant": "fluxion_predictor", "kind": "hybrid",
         "status": "skipped", "reason": "predictor not implemented"},
    ]


def test_a_rows_own_no_attention_step_makes_its_floor():
    pts = synthetic_points()
    pts[3]["floor_noattn_paired_ms"] = 30.0  # measured around the unit: the host was slower then
    pts[7]["floor_noattn_paired_ms"] = 25.0  # batch 8 has no (model, batch) floor, but a row of its own
    e2e.annotate_points(pts, {("m", 4): {"noattn_step_ms": 20.0, "dense_ctx16_step_ms": 21.0}}, ceiling_GBps=100.0)
    assert pts[3]["floor_ms"] == pytest.approx(50.0) and pts[3]["tpot_over_floor"] == pytest.approx(1.2)
    assert pts[6]["floor_ms"] == pytest.approx(100.0)  # no sample of its own: the (model, batch) floor
    assert pts[7]["floor_ms"] == pytest.approx(65.0)  # 25 ms + 4 GB at 100 GB/s
    assert e2e.paired_noattn(20.0, 30.0) == 25.0 and e2e.paired_noattn(None, 30.0) == 30.0
    assert e2e.paired_noattn(None, None) is None


def test_metrics_are_computed_from_the_points():
    pts = synthetic_points()
    floors = {("m", 4): {"noattn_step_ms": 20.0, "dense_ctx16_step_ms": 21.0}}
    e2e.annotate_points(pts, floors, ceiling_GBps=100.0)
    f32 = pts[3]
    assert f32["selected_bytes_ms"] == pytest.approx(20.0)  # 2 GB at 100 GB/s
    assert f32["floor_ms"] == pytest.approx(40.0) and f32["tpot_over_floor"] == pytest.approx(1.5)
    assert pts[6]["floor_ms"] == pytest.approx(100.0) and pts[6]["tpot_over_floor"] == pytest.approx(2.0)
    assert "floor_ms" not in pts[7]  # batch 8 has no floor
    assert f32["ttft_over_dense"] == pytest.approx(3.0) and "ttft_over_dense" not in pts[6]
    m = e2e.assemble_metrics(pts)
    assert m == pytest.approx({
        "fluxion_tpot_over_floor_max": 2.0,
        "offloaded_over_fluxion_tpot_min": min(400 / 60, 3000 / 200),  # the 8x32K point has no offloaded row
        "fluxion_tpot_mean_over_median_max": 1.3,
        "fluxion_ttft_over_dense_max": 3.0,  # only 4x32K has both rows ok
        "runtime_construction_s_max": 9.0,
        "offloaded_over_floor_min": min(400 / 40, 3000 / 100),  # offloaded over the fluxion rows' floors
    })


def test_a_table_of_several_models_also_holds_each_models_metrics():
    pts = synthetic_points()
    other = [dict(p, model="Qwen2.5-7B") for p in pts]
    for p in other:
        if p["variant"] == "fluxion" and p.get("tpot_ms_median"):
            p["tpot_ms_median"] *= 2
    floors = {("m", 4): {"noattn_step_ms": 20.0, "dense_ctx16_step_ms": 21.0},
              ("Qwen2.5-7B", 4): {"noattn_step_ms": 20.0, "dense_ctx16_step_ms": 21.0}}
    both = pts + other
    e2e.annotate_points(both, floors, ceiling_GBps=100.0)
    m = e2e.assemble_metrics(both)
    alone = e2e.assemble_metrics(pts)
    assert {k: m[f"m_{k}"] for k in alone} == pytest.approx(alone)
    assert m["qwen2_5_7b_fluxion_tpot_over_floor_max"] == pytest.approx(4.0)  # twice the 2.0 of "m"
    assert m["fluxion_tpot_over_floor_max"] == pytest.approx(4.0), "the table's own metric is over every model"


def test_repeated_variants_all_count_and_their_spread_is_reported():
    """A variant listed twice runs twice: each run is annotated, the metrics hold every run to the
    target (the worse one decides a max), and the markdown reports the runs' spread."""
    pts = synthetic_points()
    again = dict(pts[3], tpot_ms_median=80.0, tpot_ms_mean=84.0)  # fluxion at 4x32K once more, slower
    pts.insert(4, again)
    floors = {("m", 4): {"noattn_step_ms": 20.0, "dense_ctx16_step_ms": 21.0}}
    e2e.annotate_points(pts, floors, ceiling_GBps=100.0)
    assert pts[3]["tpot_over_floor"] == pytest.approx(1.5) and again["tpot_over_floor"] == pytest.approx(2.0)
    m = e2e.assemble_metrics(pts)
    assert m["fluxion_tpot_over_floor_max"] == pytest.approx(2.0)
    assert m["offloaded_over_fluxion_tpot_min"] == pytest.approx(min(400 / 80, 3000 / 200))
    (r,) = e2e.repeat_spread(pts)
    assert (r["variant"], r["batch"], r["tpot_ms_medians"]) == ("fluxion", 4, [60.0, 80.0])
    assert r["median_ms"] == pytest.approx(70.0) and r["spread"] == pytest.approx(80 / 60)
    md = e2e.markdown({"device": "d", "host_cpu": "h", "commit": "c", "created": "t", "complete": True,
                       "points": pts, "metrics": m})
    assert "| m | 4 | 32K | fluxion | 2 | 60.0, 80.0 | 70.0 | 1.33 |" in md


def test_interleaved_variants_are_read_as_paired_rounds():
    rows = [_pt("m", 4, 32768, v, med=t) for v, t in
            (("fluxion", 50.0), ("fluxion_graphs", 40.0), ("fluxion", 60.0), ("fluxion_graphs", 66.0),
             ("fluxion", 40.0), ("fluxion_graphs", 30.0), ("cpu_only", 70.0))]
    (r,) = e2e.paired_rounds(rows)  # cpu_only ran once: no pairs
    assert (r["reference"], r["variant"], r["rounds"], r["faster_rounds"]) == ("fluxion", "fluxion_graphs", 3, 2)
    assert r["ratios"] == pytest.approx([0.8, 1.1, 0.75]) and r["median_ratio"] == pytest.approx(0.8)
    md = e2e.markdown({"device": "d", "host_cpu": "h", "commit": "c", "created": "t", "complete": True,
                       "points": rows, "metrics": {}})
    assert "| m | 4 | 32K | fluxion_graphs / fluxion | 3 | 0.80, 1.10, 0.75 | 0.80 | 2 of 3 |" in md
    # Unequal run counts are not paired; nor is a point with one variant.
    assert e2e.paired_rounds(rows[:4] + [_pt("m", 4, 32768, "fluxion", med=45.0)]) == []


def test_the_first_step_is_read_against_the_later_ones():
    def claims(asked_mb, step_mb):
        return {"first_claims": {"steps": 0, "asked_bytes": asked_mb * 1e6, "reserved_bytes": 0.0,
                                 "step_bytes": step_mb * 1e6}}

    row = {"status": "ok", "kind": "hybrid", "model": "m", "batch": 4, "context": 32768, "variant": "fluxion",
           "tpot_ms": [90.0, 50.0, 40.0, 40.0, 44.0, 40.0],  # decode steps 0..5
           "step_series": {"token": [0, 1, 2, 3, 4, 5], "gpu_byte_share": [0.02, 0.2, 0.3, 0.32, 0.3, 0.34],
                           "lead_ms": [30.0, 9.0, 3.0, 2.0, 4.0, 3.0]},
           "lane_estimates_before": claims(500, 1000),  # what the warm-up's steps had asked already
           "lane_estimates_after_decode_step": {"0": claims(510, 5000), "1": claims(800, 9000)},
           "lane_estimates_after": claims(800 + 4 * 1200, 9000 + 4 * 4000)}
    f = e2e.first_step(row)
    assert f["first_over_median"] == pytest.approx(90.0 / 42.0)
    assert (f["step0_gpu_byte_share"], f["later_gpu_byte_share"]) == (0.02, pytest.approx(0.31))
    assert (f["step0_lead_ms"], f["later_lead_ms"]) == (30.0, pytest.approx(3.0))
    assert (f["step0_asked_MB"], f["step0_step_MB"]) == (pytest.approx(10.0), pytest.approx(4000.0))
    assert (f["later_asked_MB"], f["later_step_MB"]) == (pytest.approx(1200.0), pytest.approx(4000.0))
    md = e2e.markdown({"device": "d", "host_cpu": "h", "commit": "c", "created": "t", "complete": True,
                       "points": [row], "metrics": {}})
    assert "| m | 4 | 32K | fluxion | 2.14 | 0.02 / 0.31 | 30.0 / 3.0 | 10 / 1200 (of 4000) |" in md
    # A timeline sampled from decode token 1 on, and no snapshots: the ratio alone.
    sampled = dict(row, step_series={"token": [1, 9], "gpu_byte_share": [0.2, 0.3], "lead_ms": [9.0, 3.0]})
    for key in ("lane_estimates_before", "lane_estimates_after_decode_step", "lane_estimates_after"):
        sampled.pop(key)
    assert set(e2e.first_step(sampled)) == {"first_over_median"}
    assert e2e.first_step(dict(row, status="oom")) is None


def test_metrics_with_missing_inputs_are_left_out():
    pts = [p for p in synthetic_points() if p["variant"] not in ("dense", "offloaded")]
    e2e.annotate_points(pts, {}, ceiling_GBps=None)  # no floors, no ceiling
    m = e2e.assemble_metrics(pts)
    assert set(m) == {"fluxion_tpot_mean_over_median_max", "runtime_construction_s_max"}
    # Fluxion out of memory everywhere: nothing about fluxion, not even a default.
    oom = [_pt("m", 4, 32768, "dense"), _pt("m", 4, 32768, "fluxion", status="oom")]
    e2e.annotate_points(oom, {("m", 4): {"noattn_step_ms": 20.0}}, ceiling_GBps=100.0)
    assert e2e.assemble_metrics(oom) == {}
    assert e2e.assemble_metrics([]) == {}


# ---------------------------------------------------------------------------- results files
def test_results_json_and_markdown_follow_the_contract(tmp_path, monkeypatch, measured):
    monkeypatch.setenv("HYBRID_COMMIT", "abc1234")
    pts = synthetic_points() + [measured[0]["dense"], measured[0]["cpu_only"]]
    floors = {("m", 4): {"noattn_step_ms": 20.0, "dense_ctx16_step_ms": 21.0}}
    limits = {"concurrent_ceiling_GBps": 100.0, "cpu_concurrent_GBps": 60.0, "gpu_concurrent_GBps": 40.0}
    e2e.annotate_points(pts, floors, limits["concurrent_ceiling_GBps"])
    extra = {"config": {"new_tokens": NEW}, "limits": limits, "complete": True,
             "floors": [{"model": "m", "batch": 4, **floors[("m", 4)]}]}
    path = e2e.write(pts, extra, str(tmp_path / "sub" / "e2e.json"))
    assert path == tmp_path / "sub" / "e2e.json"
    assert sorted(p.name for p in path.parent.iterdir()) == ["e2e.json", "e2e.md"]  # the scratch directory is gone
    r = json.loads(path.read_text())
    for key in ("benchmark", "device", "host_cpu", "commit", "command", "created", "metrics", "points", "config"):
        assert key in r
    assert r["benchmark"] == "e2e_decode" and r["commit"] == "abc1234"
    table_metrics = {"fluxion_tpot_over_floor_max", "offloaded_over_fluxion_tpot_min",
                     "fluxion_tpot_mean_over_median_max", "fluxion_ttft_over_dense_max",
                     "runtime_construction_s_max", "offloaded_over_floor_min"}
    # Two models here ("m" and the measured rows' tiny one): each model's own metrics are given too.
    assert table_metrics <= set(r["metrics"])
    assert set(r["metrics"]) - table_metrics == {f"m_{k}" for k in table_metrics} | {"tiny_runtime_construction_s_max"}
    assert all(isinstance(v, float) for v in r["metrics"].values())
    assert len(r["points"]) == len(pts)
    assert {(p["model"], p["batch"], p["context"], p["variant"]) for p in r["points"]} == \
        {(p["model"], p["batch"], p["context"], p["variant"]) for p in pts}
    md = path.with_suffix(".md").read_text()
    assert "| model | batch | context | variant | status |" in md and "## metrics" in md
    assert "| construct s | kernel wait s | worker wait s | MB/step |" in md
    assert "`fluxion_tpot_over_floor_max`: 2" in md
    assert "| m | 4 | 128K | dense | oom |" in md and "needs 80.0 GiB" in md
    assert "predictor not implemented" in md and "| tiny | 2 | 300 | cpu_only | ok |" in md
    assert "concurrent ceiling (same run): 100.0 GB/s" in md
    assert "where a hybrid token's time went" in md and "| tiny | 2 | 300 | cpu_only | " in md.split("time went")[1]


def test_default_results_path_uses_the_device_slug(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e, "RESULTS_DIR", tmp_path / "benchmarks" / "results")
    path = e2e.write(synthetic_points(), {"complete": False}, None)
    from benchmarks.common import device_slug

    assert path == tmp_path / "benchmarks" / "results" / f"e2e_decode-{device_slug()}.json"
    assert "INCOMPLETE" in path.with_suffix(".md").read_text()


# ---------------------------------------------------------------------------- options, schedule, pure pieces
def test_options_and_points():
    assert e2e.parse_points("4x32768, 2x96K,4x128k") == [(4, 32768), (2, 98304), (4, 131072)]
    a = e2e.parse_args([])
    assert a.points == e2e.POINTS and a.models == ["llama-3.1-8b", "qwen2.5-7b"] and a.new_tokens == 24
    assert a.variants == ["dense", "fluxion", "offloaded", "cpu_only", "static", "fluxion_predictor",
                          "fluxion_eager_model", "fluxion_predictor_lagged", "fluxion_waits",
                          "cpu_only_waits", "fluxion_eager_window", "cpu_only_eager_window",
                          "fluxion_host_start", "cpu_only_host_start", "fluxion_ungated", "fluxion_native", "fluxion_graphs", "fluxion_direct", "fluxion_plans",
                          "fluxion_alt_plans_direct", "fluxion_alt_direct_plans", "fluxion_alt_plans_plans",
                          "fluxion_alt_auto_gpu_selection", "fluxion_alt_gpu_auto_selection",
                          "fluxion_host_selection",
                          "fluxion_gpu_selection", "fluxion_gpu_selection_ungated", "fluxion_no_spin", "fluxion_short_spin",
                          "fluxion_unplanned",
                          "cpu_only_unplanned", "fluxion_host_selection_unplanned",
                          "fluxion_pinned_caller", "cpu_only_pinned_caller", "fluxion_unprofiled", "fluxion_every_step",
                          "fluxion_every_step_full_warmup", "fluxion_w11", "fluxion_check_launch",
                          "fluxion_unprepared"]
    q = e2e.parse_args(["--quick"])
    assert q.models == ["llama-3.1-8b"] and q.points == [(4, 32768)] and "static" not in q.variants
    with pytest.raises(SystemExit):
        e2e.parse_args(["--variants", "dense,nope"])


def test_schedule_keeps_to_the_budget_and_records_why_units_do_not_run():
    plan = e2e.schedule(["llama-3.1-8b"], e2e.POINTS, list(e2e.VARIANTS), 24, 20.0, budget_s=540.0)
    state = {(u["batch"], u["context"], u["variant"]): u["state"] for u in plan}
    assert state[(4, 131072, "dense")] == state[(4, 131072, "static")] == "out of memory (estimate)"
    assert state[(4, 32768, "fluxion_predictor")] in ("run", "time budget")
    assert state[(4, 32768, "dense")] == "run" and "time budget" in state.values()
    ran = [u for u in plan if u["state"] == "run"]
    assert ran[-1]["end_s"] <= 540.0 and ran[-1]["end_s"] == pytest.approx(sum(u["predicted_s"] for u in ran))
    everything = e2e.schedule(["llama-3.1-8b"], e2e.POINTS, list(e2e.VARIANTS), 24, 20.0, budget_s=1e9)
    assert all(u["state"] != "time budget" for u in everything)


def test_caller_tokens_on_counts_the_tokens_on_pinned_cores():
    row = {"decode_caller_cpus": [0, 3, 3, None, 5]}
    assert gt.caller_tokens_on(row, [3, 4, 5]) == 3
    assert gt.caller_tokens_on(row, [None, None]) is None  # no worker pinned
    assert gt.caller_tokens_on({"decode_caller_cpus": []}, [3]) is None


def test_timing_fields_and_stop_rule():
    f = gt.timing_fields(10.0, [10.5, 10.6, 10.8, 11.1], 11.2)
    assert f["ttft_s"] == pytest.approx(0.5) and f["tpot_samples"] == 3 and f["new_tokens"] == 4
    assert f["tpot_ms"] == pytest.approx([100.0, 200.0, 300.0]) and f["tpot_ms_median"] == pytest.approx(200.0)
    assert f["decode_s"] == pytest.approx(0.6) and f["generate_s"] == pytest.approx(1.2)
    one = gt.timing_fields(0.0, [1.0], 1.0)
    assert one["tpot_samples"] == 0 and "tpot_ms_median" not in one
    clock = gt.StepClock(cuda=False)
    rule = gt.StopRule(clock, cap_s=1.0, min_tokens=2)
    ids = torch.zeros(3, 1, dtype=torch.long)
    clock.stamps[:] = [0.0, 5.0]
    assert rule(ids, None).all() and rule.capped
    clock.stamps[:] = [0.0]
    assert not gt.StopRule(clock, cap_s=0.0, min_tokens=2)(ids, None).any()
    assert gt.StopRule(clock, max_tokens=1)(ids, None).all()


def test_cost_model_learns_from_measured_rows():
    cfg, c = e2e.model_config("llama-3.1-8b"), e2e.CostModel()
    flops = e2e.prefill_flops(cfg, 4, 32768)
    c.observe(cfg, {"status": "ok", "batch": 4, "context": 32768, "variant": "dense", "kind": "hf", "ttft_s": 10.0})
    assert c.prefill_flops == pytest.approx(flops / 10.0)
    kv = e2e.kv_bytes(cfg, 4, 32768)
    c.observe(cfg, {"status": "ok", "batch": 4, "context": 32768, "variant": "fluxion", "kind": "hybrid",
                    "ttft_s": 30.0})
    assert c.store_Bps == pytest.approx(kv / 20.0)
    before = c.compile_s
    c.observe(cfg, {"status": "oom", "batch": 4, "context": 32768, "variant": "static", "kind": "hf"})
    assert c.compile_s == before
    # No dense row: a hybrid row's TTFT is the prefill's (the handoff hides behind it); its runtime's
    # construction and the process's one kernel warm-up are learned too.
    h = e2e.CostModel()
    assert h.kernel_warmup_s > 0
    h.observe(cfg, {"status": "ok", "batch": 4, "context": 32768, "variant": "fluxion", "kind": "hybrid", "ttft_s": 6.0,
                    "runtime_construction_s": 0.5, "kernel_warmup_wait_s": 40.0})
    assert h.prefill_flops == pytest.approx(flops / 6.0) and h.store_Bps >= kv / 0.2
    assert h.construct_s == 0.5 and h.kernel_warmup_s == 0.0
    first = e2e.unit_cost(e2e.CostModel(), cfg, e2e.VARIANTS["fluxion"], 4, 32768, 32, None, 16 * 10**9, True, True,
                          first_hybrid=True)
    later = e2e.unit_cost(e2e.CostModel(), cfg, e2e.VARIANTS["fluxion"], 4, 32768, 32, None, 16 * 10**9, True, True)
    assert first - later == pytest.approx(e2e.CostModel.kernel_warmup_s)


# ---------------------------------------------------------------------------- the whole loop, on the host
TINY = ("LlamaConfig", dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096))
CPU_SET = ["--set", "kv_cache.sink=16", "--set", "kv_cache.local=32", "--set", "kv_cache.generated_cap=16",
           "--set", "scheduler.gpu_worker=false", "--set", "scheduler.pin_cores=false"]


def test_run_writes_every_unit_and_the_floor(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(e2e.MODELS, "tiny", TINY)
    out = tmp_path / "e2e.json"
    args = e2e.parse_args(["--models", "tiny", "--points", f"{BATCH}x{CONTEXT}", "--variants",
                           "dense,cpu_only,offloaded,fluxion_predictor", "--new-tokens", str(NEW), "--warmup-tokens",
                           "64", "--cpu-workers", "1", "--out", str(out)] + CPU_SET)
    assert args.runtime_set["kv_cache"] == {"sink": 16, "local": 32, "generated_cap": 16}
    assert e2e.run(args, device="cpu") == out
    r = json.loads(out.read_text())
    assert r["complete"]
    assert [p["variant"] for p in r["points"]] == ["dense", "cpu_only", "offloaded", "fluxion_predictor"]
    assert [p["status"] for p in r["points"]] == ["ok", "ok", "skipped", "ok"]
    pred = r["points"][3]
    assert pred["runtime_stats"]["placement"] == "fluxion" and pred["tpot_ms_median"] > 0
    floor = r["floors"][0]
    assert floor["model"] == "tiny" and floor["batch"] == BATCH and floor["noattn_step_ms"] > 0
    # The no-attention step just before and after each hybrid unit; its mean is the row's own.
    assert len(floor["noattn_samples_ms"]) == 4 and floor["noattn_samples_ms"][0] == floor["noattn_step_ms"]
    for hyb in (r["points"][1], pred):
        b_, a_ = hyb["floor_noattn_before_ms"], hyb["floor_noattn_after_ms"]
        assert b_ > 0 and a_ > 0 and hyb["floor_noattn_paired_ms"] == pytest.approx((b_ + a_) / 2)
    assert "floor_noattn_paired_ms" not in r["points"][0]  # dense rows have no floor
    assert r["config"]["runtime_overrides"]["scheduler"] == {"gpu_worker": False, "pin_cores": False}
    assert r["limits"] is None and "fluxion_tpot_over_floor_max" not in r["metrics"]  # no ceiling measured: no floor
    assert r["metrics"]["runtime_construction_s_max"] == max(r["points"][i]["runtime_construction_s"] for i in (1, 3))
    assert r["points"][1]["ttft_over_dense"] > 0 and len(r["plan"]) == 4
    assert "wrote" in capsys.readouterr().out
    # No time left: every unit that could run is recorded as skipped for the budget, none dropped.
    args = e2e.parse_args(["--models", "tiny", "--points", f"{BATCH}x{CONTEXT}", "--variants",
                           "dense,fluxion_predictor", "--budget-s", "0", "--out", str(out)])
    e2e.run(args, device="cpu")
    r = json.loads(out.read_text())
    assert [(p["status"], p["reason"].split(":")[0]) for p in r["points"]] == [
        ("skipped", "time budget"), ("skipped", "time budget")]
    assert r["metrics"] == {}


def test_plan_needs_no_gpu(capsys):
    assert e2e.run(e2e.parse_args(["--plan"])) is None
    text = capsys.readouterr().out
    assert "out of memory (estimate)" in text and "fluxion_predictor" in text and "budget 540 s" in text


# ---------------------------------------------------------------------------- --tp
def test_tp_refuses_without_enough_gpus(capsys):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tp = max(2, n + 1)
    with pytest.raises(SystemExit) as exc:
        e2e.main(["--tp", str(tp), "--models", "llama-3.1-8b", "--points", "8x32K"])
    assert f"--tp {tp} needs {tp} CUDA devices (one per rank); this machine has {n}" in str(exc.value)
    with pytest.raises(SystemExit):
        e2e.parse_args(["--tp", "0"])
    assert "--tp 0: allowed an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--tp", "2", "--variants", "fluxion,static"])
    assert "variants ['static'] do not run split over GPUs; allowed: fluxion, cpu_only, dense" in capsys.readouterr().err


def test_tp_default_points_and_variants_leave_the_one_gpu_run_alone():
    one = e2e.parse_args([])
    assert one.tp == 1 and one.points == e2e.POINTS and one.variants == list(e2e.VARIANTS)
    split = e2e.parse_args(["--tp", "2"])
    assert split.points[0] == (8, 32768) and split.variants == ["fluxion"]


@pytest.mark.slow
def test_tp_run_on_cpu_ranks(tmp_path, monkeypatch):
    """`--tp 2` end to end on the host (gloo): a one-process run and a two-rank run of a tiny Llama,
    rows of every rank, each rank's runtime on its own cores, and the tp-over-tp1 metrics."""
    from benchmarks import e2e_tp

    monkeypatch.setitem(gt.MODELS, "tiny", ("LlamaConfig", tiny_config().to_dict()))
    out = tmp_path / "tp.json"
    args = e2e.parse_args(["--tp", "2", "--models", "tiny", "--points", f"{BATCH}x{CONTEXT}", "--new-tokens", str(NEW),
                           "--warmup-tokens", "64", "--cpu-workers", "1", "--budget-s", "600", "--out", str(out),
                           "--set", "kv_cache.sink=16", "--set", "kv_cache.local=32", "--set", "kv_cache.generated_cap=16",
                           "--set", "scheduler.gpu_worker=false", "--timeline-every", "1"])  # every step's records
    path = e2e_tp.run_tp(args, device="cpu")
    result = json.loads(path.read_text())
    rows = result["points"]
    assert [(r["tp"], r["rank"], r["status"]) for r in rows] == [(1, 0, "ok"), (2, 0, "ok"), (2, 1, "ok")], rows
    for r in rows:
        assert r["ttft_s"] > 0 and r["tpot_ms_median"] > 0 and r["decode_steps"] == NEW - 1
    assert "tensor parallel" not in rows[0]["runtime_stats"]["pinning"] and "rank" not in rows[0]["runtime_stats"]["pinning"]
    for r in rows[1:]:
        assert f"rank {r['rank']} of 2" in r["runtime_stats"]["pinning"]
    # Each rank stored its half of the KV heads: half the one-process arena.
    assert rows[1]["reserved_host_bytes"] * 2 == rows[0]["reserved_host_bytes"]
    ratio = max(r["tpot_ms_median"] for r in rows[1:]) / rows[0]["tpot_ms_median"]
    assert result["metrics"][f"tp2_over_tp1_tpot_{BATCH}x{CONTEXT}"] == pytest.approx(ratio)
    assert f"tp2_over_tp1_ttft_{BATCH}x{CONTEXT}" in result["metrics"]
    assert "| tiny | 2 | 300 | fluxion | 2 |" in path.with_suffix(".md").read_text()


def test_tp_metrics_name_variants_and_sum_the_ranks_limits():
    """fluxion's ratios unnamed, other variants named; the limits of ranks measured together summed;
    each point's attention read rate summed over its ranks."""
    from benchmarks import e2e_tp

    def unit(tp, rank, variant, tpot, ttft, bytes_per_step, attention_ms):
        return {"model": "m", "batch": 8, "context": 32768, "variant": variant, "tp": tp, "rank": rank, "status": "ok",
                "tpot_ms_median": tpot, "ttft_s": ttft, "bytes_per_step": bytes_per_step,
                "attention_ms_per_step": attention_ms}

    def limits(tp, rank, read, ceiling):
        return {"kind": "limits", "status": "limits", "tp": tp, "rank": rank, "host_read_GBps": read, "h2d_GBps": 50.0,
                "cpu_alone_GBps": read, "gpu_alone_GBps": 45.0, "cpu_concurrent_GBps": ceiling - 40.0,
                "gpu_concurrent_GBps": 40.0, "concurrent_GBps": ceiling}

    rows = [limits(1, 0, 70.0, 100.0), unit(1, 0, "fluxion", 170.0, 14.0, 8e9, 100.0), unit(1, 0, "dense", 100.0, 8.0, 0, 0),
            limits(2, 0, 40.0, 60.0), limits(2, 1, 35.0, 55.0),
            unit(2, 0, "fluxion", 210.0, 7.0, 4e9, 100.0), unit(2, 1, "fluxion", 220.0, 7.5, 4e9, 125.0),
            unit(2, 0, "dense", 90.0, 4.0, 0, 0), unit(2, 1, "dense", 80.0, 4.0, 0, 0)]
    e2e_tp.host_read_rates(rows)
    m = e2e_tp.tp_metrics(rows, 2)
    assert m["tp2_over_tp1_tpot_8x32k"] == pytest.approx(220.0 / 170.0)
    assert m["tp2_over_tp1_ttft_8x32k"] == pytest.approx(7.5 / 14.0)
    assert m["tp2_over_tp1_dense_tpot_8x32k"] == pytest.approx(0.9)
    assert m["tp1_concurrent_ceiling_GBps"] == 100.0 and m["tp2_concurrent_ceiling_GBps"] == 115.0
    assert m["tp2_host_read_GBps"] == 75.0
    assert rows[1]["attention_host_GBps_all_ranks"] == pytest.approx(80.0)
    assert rows[5]["attention_host_GBps_all_ranks"] == pytest.approx(40.0 + 32.0)
    assert "attention_host_GBps_all_ranks" not in rows[2]  # no attention time: dense
    md = e2e_tp.markdown(rows, 2)
    assert "tp2 limits, 2 rank(s) measured together: host read 75.0 GB/s, concurrent ceiling 115.0 GB/s" in md
    assert "| m | 8 | 32768 | fluxion | 2 | 7.50 | 220.0 | 72.0 | ok |" in md


def test_graph_floor_runs_the_decode_pieces_without_attention():
    """`measure_floor(graphs=True)`: generate's one-token steps go through `DecodeGraphs` (its pieces,
    eagerly on the CPU) with the attention left out; the prompt through the no-op attention; the
    model's forward is its own again afterwards."""
    from tests.test_transformers_integration import tiny_model

    model = tiny_model("llama")
    steps = []
    from hybrid_runtime.integrations import decode_graphs

    original = decode_graphs.DecodeGraphs.step

    def counted(self, *args):
        steps.append(args[0].shape)
        return original(self, *args)

    decode_graphs.DecodeGraphs.step = counted
    try:
        row = e2e.measure_floor(model, 2, 5, dense=False, graphs=True)
    finally:
        decode_graphs.DecodeGraphs.step = original
    assert row["noattn_graphs_step_ms"] > 0 and "noattn_step_ms" not in row
    assert len(steps) == (3 - 1) + (5 - 1) and all(s == (2, 1) for s in steps)  # warm-up, then the measured call
    assert "forward" not in model.model.__dict__


def test_token_interval_stats_read_each_interval_from_raw_snapshots():
    """Steal summed over cores and the caller's involuntary switches, per interval between two
    token snapshots, from the raw /proc texts (parsed after the call)."""
    import os as _os
    tick_ms = 1e3 / _os.sysconf("SC_CLK_TCK")

    def stat(steal0: int, steal1: int) -> str:
        return (f"cpu  1 0 1 10 0 0 0 {steal0 + steal1}\n"
                f"cpu0 1 0 1 5 0 0 0 {steal0}\ncpu1 0 0 0 5 0 0 0 {steal1}\nintr 1\n")

    def status(invol: int) -> str:
        return f"Name:\tpython\nvoluntary_ctxt_switches:\t7\nnonvoluntary_ctxt_switches:\t{invol}\n"

    snaps = [(stat(0, 0), status(1)), (stat(2, 1), status(1)), (stat(2, 1), status(4)), ("", "")]
    out = gt.token_interval_stats(snaps)
    assert out["tpot_steal_core_ms"] == [pytest.approx(3 * tick_ms), 0.0, None]
    assert out["tpot_caller_switches_involuntary"] == [0, 3, None]
    assert gt.token_interval_stats([]) == {"tpot_steal_core_ms": [], "tpot_caller_switches_involuntary": []}


def test_slow_tokens_lists_steps_over_the_bar_after_the_first_with_what_the_host_lost():
    row = {"status": "ok", "tpot_ms": [90.0, 50.0, 52.0, 150.0, 49.0, 51.0, 100.0],
           "tpot_steal_core_ms": [0.0, 0.0, 0.0, 40.0, 0.0, 0.0, 0.0],
           "tpot_caller_switches_involuntary": [0, 1, 0, 2, 0, 0, 0],
           "step_series": {"token": [1, 3]}}
    slow = e2e.slow_tokens(row)
    assert [t["step"] for t in slow] == [3, 6]  # step 0 (90 ms) is the first step's, left to first_step
    assert slow[0] == {"step": 3, "ms": 150.0, "over_median": pytest.approx(150.0 / 52.0), "steal_core_ms": 40.0,
                       "caller_switches_involuntary": 2, "recorded": True}
    assert slow[1]["recorded"] is False
    # Rows measured before the per-token stats, without a series, or not measured.
    old = {"status": "ok", "tpot_ms": row["tpot_ms"]}
    assert [(t["steal_core_ms"], t["recorded"]) for t in e2e.slow_tokens(old)] == [(None, None), (None, None)]
    assert e2e.slow_tokens({"status": "oom"}) == [] and e2e.slow_tokens({"status": "ok", "tpot_ms": [1.0, 9.0]}) == []
    md = e2e.markdown({"benchmark": "e2e_decode", "device": "cpu", "host_cpu": "x", "commit": "c", "created": "t",
                       "command": "python benchmarks/e2e_decode.py", "metrics": {}, "complete": True,
                       "points": [dict(row, model="m", batch=1, context=4096, variant="fluxion", kind="hybrid")]})
    assert "slow tokens" in md and "| m | 1 | 4K | fluxion | 3 | 150.0 | 2.88 | 40 | 2 | yes |" in md
