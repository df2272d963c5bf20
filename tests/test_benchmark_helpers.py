"""CPU-only checks of the pure pieces of benchmarks/layer_attention.py and benchmarks/machine_limits.py
(statistics, fits, window arithmetic, metric assembly, results files); the measurements run on the device."""

import gc
import json

import numpy as np
import pytest

from benchmarks import layer_attention as la
from benchmarks.machine_limits import host_read_bandwidth, overlap_rates


def test_overlap_rates_counts_only_launches_inside_the_cpu_interval():
    # CPU reads 10 GB over [1.0, 1.1]; launches of 1 GB every 10 ms from 0.995 to 1.115.
    spans = [(0.995 + 0.01 * i, 0.995 + 0.01 * (i + 1)) for i in range(12)]
    r = overlap_rates((1.0, 1.1), 10 * 10**9, spans, 10**9)
    assert r["cpu_GBps"] == pytest.approx(100.0)
    assert r["gpu_covers_cpu"]
    assert r["gpu_launches_in_window"] == 9  # [1.005, 1.015] .. [1.085, 1.095]
    assert r["gpu_GBps"] == pytest.approx(100.0)
    assert r["gpu_gap_fraction"] == pytest.approx(0.0, abs=1e-9)
    assert r["window_ms"] == pytest.approx(100.0)


def test_overlap_rates_flags_gaps_and_uncovered_rounds():
    # Two 1 GB launches of 10 ms with a 10 ms hole between them, all inside the CPU interval.
    r = overlap_rates((0.0, 1.0), 10**9, [(0.1, 0.11), (0.12, 0.13)], 10**9)
    assert not r["gpu_covers_cpu"]
    assert r["gpu_GBps"] == pytest.approx(2 / 0.03)
    assert r["gpu_gap_fraction"] == pytest.approx(1 / 3)
    none = overlap_rates((0.0, 1.0), 10**9, [(-1.0, 2.0)], 10**9)
    assert none["gpu_covers_cpu"] and none["gpu_GBps"] is None and none["gpu_launches_in_window"] == 0


def test_host_read_bandwidth_runs_on_the_cpu():
    assert host_read_bandwidth(1, [None], gib=0.01, reps=2) > 0


def test_fit_fixed_cost_recovers_the_line():
    claims = [{"tasks": k, "bytes": k * 10**6, "wall_s": 50e-6 + k * 10**6 / 40e9, "gpu_s": 5e-6 + k * 10**6 / 50e9}
              for k in (1, 2, 4, 8, 16)]
    w, g = la.fit_fixed_cost(claims, "wall_s"), la.fit_fixed_cost(claims, "gpu_s")
    assert w["intercept_us"] == pytest.approx(50.0) and w["GBps"] == pytest.approx(40.0) and w["claims"] == 5
    assert g["intercept_us"] == pytest.approx(5.0) and g["GBps"] == pytest.approx(50.0)
    # Raw intercepts may be negative; a flat or falling line has no bandwidth; one size, no fit.
    neg = [{"bytes": b, "wall_s": -1e-6 + b / 1e10} for b in (10**6, 2 * 10**6)]
    assert la.fit_fixed_cost(neg, "wall_s")["intercept_us"] == pytest.approx(-1.0)
    assert la.fit_fixed_cost([{"bytes": b, "wall_s": 1.0} for b in (1, 2)], "wall_s")["GBps"] is None
    assert la.fit_fixed_cost([{"bytes": 5, "wall_s": 1.0}] * 3, "wall_s") is None


def test_attention_stats():
    s = la.attention_stats(np.array([1e-3] * 99 + [101e-3]))
    assert s["attention_ms_median"] == pytest.approx(1.0)
    assert s["attention_ms_mean"] == pytest.approx(2.0)
    assert s["attention_ms_max"] == pytest.approx(101.0)
    assert s["attention_ms_p90"] == pytest.approx(1.0)
    assert 1.0 < s["attention_ms_p99"] < 101.0


def test_gc_watch_counts_generation_2_per_label():
    with la.GcWatch() as w:
        w.label = "a"
        gc.collect(2)
        gc.collect(0)
        w.label = "b"
        gc.collect(2)
        gc.collect(2)
    gc.collect(2)  # uninstalled: not counted
    assert w.count == {"a": 1, "b": 2}
    assert w.ms["b"] >= 0.0


def _row(b, c, policy, median, mean=None, p99=None, gbps=10.0):
    mean = median if mean is None else mean
    p99 = median if p99 is None else p99
    return {"batch": b, "context": c, "policy": policy, "attention_ms_median": median, "attention_ms_mean": mean,
            "attention_ms_p90": median, "attention_ms_p99": p99, "attention_ms_max": p99,
            "step_mean_over_median": mean / median, "step_p99_over_median": p99 / median,
            "achieved_GBps": gbps, "achieved_GBps_time_weighted": gbps / 2, "gpu_byte_share": 0.3,
            "gpu_idle_ratio": 0.2, "gpu_idle_ratio_time_weighted": 0.25, "tasks_per_step": 64.0,
            "task_overhead_us_median": 1.0 if policy == "fluxion" else None,
            "recording_fraction": 0.001, "resolve_fraction": 0.01, "gc_gen2_collections": 1, "gc_gen2_ms": 2.5}


LIMITS = {"host_read_GBps": 90.0, "h2d_GBps": 50.0, "cpu_alone_GBps": 90.0, "gpu_alone_GBps": 50.0,
          "cpu_concurrent_GBps": 70.0, "gpu_concurrent_GBps": 40.0, "concurrent_ceiling_GBps": 110.0}


def _result(points, probes):
    la.annotate_points(points, LIMITS["concurrent_ceiling_GBps"])
    return la.assemble_metrics(points, LIMITS, probes)


def test_metrics_at_all_points():
    points = []
    for b, c in ((4, 32768), (8, 32768)):
        points += [_row(b, c, "fluxion", 2.0, mean=3.0, gbps=55.0), _row(b, c, "cpu_only", 4.0, p99=12.0),
                   _row(b, c, "cpu_only_fixed", 8.0)]
    points[3]["attention_ms_median"] = 3.0  # fluxion at 8x32k: 3 / 4
    claims = [{"tasks": k, "bytes": k * 10**6, "wall_s": 30e-6 + k * 1e-5, "gpu_s": 10e-6 + k * 1e-5,
               "gpu_warm_s": 4e-6 + k * 1e-5, "launch_s": (9 + k) * 1e-6} for k in (1, 2, 4)]
    probes = [{"batch": 8, "context": 32768, "claims": claims, "fit_wall": la.fit_fixed_cost(claims, "wall_s"),
               "fit_gpu": la.fit_fixed_cost(claims, "gpu_s"), "fit_gpu_warm": la.fit_fixed_cost(claims, "gpu_warm_s"),
               "launch_host_us_median": 11.0}]
    m = _result(points, probes)
    assert m["gpu_lane_fixed_cost_gpu_warm_us"] == pytest.approx(4.0) and m["gpu_lane_launch_host_us"] == 11.0
    assert m["fluxion_vs_cpu_only_time_ratio_max"] == pytest.approx(0.75)
    assert m["fluxion_vs_cpu_only_fixed_time_ratio_max"] == pytest.approx(3 / 8)
    assert m["fluxion_concurrent_bw_fraction_8x32k"] == pytest.approx(55 / 110)
    assert m["concurrent_ceiling_GBps"] == 110.0
    assert m["gpu_lane_fixed_cost_us"] == pytest.approx(30.0)
    assert m["gpu_lane_fixed_cost_gpu_us"] == pytest.approx(10.0)
    assert m["gpu_lane_fit_GBps"] == pytest.approx(100.0)
    assert m["task_overhead_us_median"] == 1.0
    assert m["step_mean_over_median_max"] == pytest.approx(1.5)
    assert m["step_p99_over_median_max"] == pytest.approx(3.0)
    assert m["gc_gen2_collections"] == 6 and isinstance(m["gc_gen2_collections"], int)
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in m.values())
    assert points[0]["concurrent_bw_fraction"] == pytest.approx(0.5)
    assert points[0]["vs_cpu_only"] == pytest.approx(0.5)


def test_metrics_of_a_skipped_point_are_left_out():
    points = [_row(4, 32768, name, 2.0) for name in ("fluxion", "cpu_only", "cpu_only_fixed")]
    m = _result(points, [])
    for name in ("fluxion_concurrent_bw_fraction_8x32k", "fluxion_achieved_GBps_8x32k", "cpu_only_achieved_GBps_8x32k",
                 "fluxion_bw_fraction_8x32k", "gpu_lane_fixed_cost_us", "gpu_lane_fit_GBps"):
        assert name not in m
    assert m["fluxion_vs_cpu_only_time_ratio_max"] == pytest.approx(1.0)


def test_write_to_out_path_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_COMMIT", "abc123")
    other = tmp_path / "layer_attention-cpu2.json"  # what write_results would name it here
    other.write_text("keep")
    points = [_row(8, 32768, name, 2.0) for name in ("fluxion", "cpu_only", "cpu_only_fixed")]
    claims = [{"tasks": k, "bytes": k * 10**6, "wall_s": -5e-6 + k * 1e-5, "gpu_s": 1e-6 + k * 1e-5} for k in (1, 2)]
    probes = [{"batch": 8, "context": 32768, "claims": claims, "fit_wall": la.fit_fixed_cost(claims, "wall_s"),
               "fit_gpu": la.fit_fixed_cost(claims, "gpu_s")}]
    metrics = _result(points, probes)
    extra = {"config": {"cpu_workers": 15}, "machine_limits": [], "gpu_lane_probes": probes}
    out = tmp_path / "sub" / "mine.json"
    path = la.write(metrics, points, extra, str(out))
    assert path == out and other.read_text() == "keep"
    assert sorted(p.name for p in out.parent.iterdir()) == ["mine.json"]
    rec = json.loads(out.read_text())
    assert rec["commit"] == "abc123" and rec["benchmark"] == "layer_attention"
    assert {"device", "host_cpu", "command", "created", "metrics", "points"} <= set(rec)
    assert rec["metrics"]["gpu_lane_fixed_cost_us"] == pytest.approx(-5.0)  # raw in the JSON
    md = la.markdown(rec)
    assert "| 8 | 32K | fluxion | 2.000 |" in md and "concurrent ceiling 110.0 GB/s" in md
    assert "| 8 | 32K | 2 | 0 | " in md and md.count("| - | - |") == 1  # clipped at 0; no spin or launch figures
    warm = [{**c, "gpu_warm_s": 3e-6 + c["tasks"] * 1e-5, "launch_s": 12e-6} for c in claims]
    probes = [{**probes[0], "claims": warm, "fit_gpu_warm": la.fit_fixed_cost(warm, "gpu_warm_s"),
               "launch_host_us_median": 12.0}]
    md = la.markdown({**rec, "gpu_lane_probes": probes})
    assert "| 8 | 32K | 2 | 0 | 100.0 | 1 | 100.0 | 3 | 12 |" in md


def test_prefill_random_draws_k_then_v_for_every_sequence_and_layer_from_the_seed():
    from types import SimpleNamespace

    import torch

    from benchmarks.common import prefill_random

    def run(dtype=torch.bfloat16) -> list:
        calls: list = []
        rt = SimpleNamespace(geometry=SimpleNamespace(layers=2, kv_heads=2, head_dim=8),
                             prefill=lambda s, layer, k, v: calls.append((s, layer, k, v)))
        prefill_random(rt, 3, 5, torch.Generator().manual_seed(1), dtype)
        return calls

    calls = run()
    assert [(s, layer) for s, layer, _, _ in calls] == [(s, layer) for s in range(3) for layer in range(2)]
    assert all(k.shape == v.shape == (5, 2, 8) and k.dtype == v.dtype == torch.bfloat16 for _, _, k, v in calls)
    assert not torch.equal(calls[0][2], calls[0][3]) and not torch.equal(calls[0][2], calls[1][2])
    # One seed, the same prompts: what lets a benchmark's methods read the same KV.
    assert all(torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]) for a, b in zip(calls, run()))
    assert run(torch.float32)[0][2].dtype == torch.float32
