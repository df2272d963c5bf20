"""Timeline recording, GPU-idle analysis, Chrome trace and summary export."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hybrid_runtime.profiling import (
    LANE_CPU,
    LANE_GPU,
    StepRecord,
    Timeline,
    layer_table,
    step_stats,
    union_length,
)
from hybrid_runtime.runtime import HybridRuntime
from tests.test_runtime import prefill_all, rt_config

CUDA = torch.cuda.is_available()


def test_union_length_merges_overlaps_and_clips():
    iv = np.array([[0.0, 1.0], [0.5, 2.0], [3.0, 4.0], [3.5, 3.7], [-1.0, -0.5], [4.5, 9.0]])
    assert union_length(iv, 0.0, 5.0) == pytest.approx(2.0 + 1.0 + 0.5)
    assert union_length(np.zeros((0, 2)), 0.0, 1.0) == 0.0
    assert union_length(iv, 2.0, 2.0) == 0.0


def synthetic_record(layer: int, t0: float, gpu_iv, has_gpu=True) -> StepRecord:
    n = 3
    return StepRecord(
        index=0, layer=layer, batch=2, placement="fluxion", t_start=t0, t_end=t0 + 5.0,
        worker=np.array([0, 1, 2], np.int16), lane=np.array([LANE_CPU, LANE_CPU, LANE_GPU], np.int8),
        seq_id=np.arange(n), kv_head=np.zeros(n, np.int16),
        start=t0 + np.array([0.1, 0.2, 1.0]), end=t0 + np.array([2.0, 4.0, 2.0]),
        bytes_read=np.array([100, 200, 300]), modeled_bytes=np.array([100, 200, 300]),
        overhead=np.array([1e-6, 2e-6, 0.0]),
        gpu_intervals=t0 + np.asarray(gpu_iv, dtype=np.float64).reshape(-1, 2), has_gpu=has_gpu,
    )


def test_gpu_idle_per_layer_as_in_table_5():
    r0 = synthetic_record(0, 10.0, [[0.0, 1.0], [0.5, 2.0], [3.0, 4.0]])  # busy 3 of 5
    r1 = synthetic_record(0, 20.0, [[0.0, 5.0]])  # never idle
    r2 = synthetic_record(1, 30.0, [])  # idle throughout
    assert r0.gpu_busy_s() == pytest.approx(3.0)
    assert r0.gpu_idle_s() == pytest.approx(2.0) and r0.gpu_idle_ratio() == pytest.approx(0.4)
    assert r0.gpu_idle_s() + r0.gpu_busy_s() == pytest.approx(r0.attention_s)
    rows = layer_table([r0, r1, r2])
    assert [r["layer"] for r in rows] == [0, 1]
    assert rows[0]["steps"] == 2 and rows[0]["attention_ms_mean"] == pytest.approx(5000.0)
    assert rows[0]["gpu_idle_ms_mean"] == pytest.approx(1000.0)
    assert rows[0]["gpu_idle_ratio"] == pytest.approx(2.0 / 10.0)
    assert rows[1]["gpu_idle_ratio"] == pytest.approx(1.0)
    no_gpu = synthetic_record(2, 0.0, [], has_gpu=False)
    assert no_gpu.gpu_idle_s() is None and layer_table([no_gpu])[0]["gpu_idle_ratio"] is None
    st = step_stats(r0)
    assert st["bytes_cpu"] == 300 and st["bytes_gpu"] == 300 and st["tasks_gpu"] == 1
    assert st["cpu_busy_s"] == pytest.approx(1.9 + 3.8)


def run_steps(placement="fluxion", steps=3, plan="fixed", budget=0.2):
    rt = HybridRuntime(rt_config(placement, plan=plan, budget=budget))
    prefill_all(rt)
    gen = torch.Generator().manual_seed(0)
    bytes_before = sum(ex.bytes_read for ex in (rt.cpu_executor, rt.gpu_executor) if ex is not None)
    for _ in range(steps):
        for layer in (0, 1):
            q = torch.randn(3, 8, 32, generator=gen)
            rt.decode(layer, [0, 1, 2], q, torch.randn(3, 2, 32, generator=gen), torch.randn(3, 2, 32, generator=gen))
    bytes_after = sum(ex.bytes_read for ex in (rt.cpu_executor, rt.gpu_executor) if ex is not None)
    return rt, bytes_after - bytes_before


@pytest.mark.parametrize("placement", ["fluxion", "uniform"])
def test_timeline_totals_add_up(placement):
    rt, nbytes = run_steps(placement)
    try:
        recs = rt.timeline.records
        assert len(recs) == 6 and [r.layer for r in recs] == [0, 1] * 3
        # Every task is recorded once, with its worker, lane, interval and bytes.
        assert sum(r.bytes_read.sum() for r in recs) == nbytes
        for r in recs:
            assert r.n_tasks == 6  # 3 sequences x 2 KV groups, budget 0.2 everywhere
            assert (r.worker >= 0).all()
            assert ((r.lane == LANE_GPU) == (r.worker == rt.scheduler.gpu_worker_id)).all()
            # GPU launches are CUDA events mapped to the host clock (a few us of calibration error).
            eps = 2e-4 if CUDA else 1e-6
            # (Timing checks say by how much and on which lane: one failed once on an H200 and passed
            # on the re-run, without its message.)
            early, late = (r.t_start - r.start) * 1e6, (r.end - r.t_end) * 1e6
            assert (early <= eps * 1e6).all(), f"layer {r.layer}: tasks start {early.max():.0f} us before the step (lanes {r.lane})"
            assert (late <= eps * 1e6).all(), f"layer {r.layer}: tasks end {late.max():.0f} us after the step (lanes {r.lane})"
            assert (r.end >= r.start).all() and (r.bytes_read > 0).all()
            # A CPU worker runs one task at a time: its busy time fits in the step. (Tasks of one
            # GPU launch share the launch's interval, so the GPU lane's busy time is their union.)
            for w in np.unique(r.worker[r.lane == LANE_CPU]):
                busy = (r.end - r.start)[r.worker == w].sum()
                assert busy <= r.attention_s + eps, \
                    f"layer {r.layer}: worker {w} busy {busy * 1e6:.0f} us in a {r.attention_s * 1e6:.0f} us step"
            gpu = r.lane == LANE_GPU
            if gpu.any():
                iv = np.stack([r.start[gpu], r.end[gpu]], 1)
                assert union_length(iv, r.t_start - eps, r.t_end + eps) <= r.attention_s + 2 * eps
        s = rt.timeline.summary()
        assert s["steps"] == 6 and s["tasks"] == 36
        assert s["bytes_cpu"] + s["bytes_gpu"] == nbytes
        assert sum(w["tasks"] for w in s["workers"]) == 36
        assert sum(w["bytes"] for w in s["workers"]) == nbytes
        assert s["attention_s_total"] == pytest.approx(sum(r.attention_s for r in recs))
        assert [row["steps"] for row in s["layers"]] == [3, 3]
        assert s["gpu_idle_ratio"] is None if not CUDA else 0 <= s["gpu_idle_ratio"] <= 1
    finally:
        rt.close()


def test_chrome_trace_and_summary_export(tmp_path):
    rt, _ = run_steps("fluxion", steps=2)
    try:
        trace_path, summary_path = tmp_path / "trace.json", tmp_path / "summary.json"
        rt.timeline.write_chrome_trace(str(trace_path))
        rt.timeline.write_summary(str(summary_path))
        trace = json.loads(trace_path.read_text())
        events = trace["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        steps = [e for e in spans if e["pid"] == 1]
        tasks = [e for e in spans if e["pid"] in (2, 3) and e["name"].startswith("s")]
        assert len(steps) == 4 and len(tasks) == 24
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
        names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        assert {"cpu0", "cpu1", "gpu"} <= names
        summary = json.loads(summary_path.read_text())
        assert summary["steps"] == 4 and len(summary["layers"]) == 2
    finally:
        rt.close()


def test_recording_cost_is_measured_and_clear_resets():
    # The < 2% target is checked on the device by benchmarks/layer_attention.py
    # (`timeline_recording_fraction_max`); a timed unit test would be noise on a loaded runner.
    rt, _ = run_steps("fluxion", steps=4)
    try:
        tl = rt.timeline
        total = sum(r.attention_s for r in tl.records)
        frac = tl.recording_s / total
        print(f"\ntimeline recording on the decode path: {tl.recording_s * 1e6:.0f} us over {len(tl)} steps = "
              f"{frac:.2%} of attention time; deferred resolution {tl.resolve_s * 1e6:.0f} us = {tl.resolve_s / total:.2%}")
        assert total > 0 and tl.recording_s > 0 and math.isfinite(frac)
        tl.clear()
        assert len(tl) == 0 and tl.summary()["steps"] == 0
    finally:
        rt.close()


def test_disabled_profiling_records_nothing():
    from hybrid_runtime.config import config_from_dict

    cfg = rt_config()
    cfg = config_from_dict({**cfg.to_dict(), "profiling": {"enabled": False}})
    with HybridRuntime(cfg) as rt:
        prefill_all(rt, layers=(0,))
        rt.decode(0, [0, 1, 2], torch.randn(3, 8, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32))
        assert len(rt.timeline) == 0


def _record_host_step(tl, i, layer=0):
    tl.record(layer=layer, batch=1, placement="cpu_only", t_entry=float(i), ev_entry=None, tasks=[], gpu_events=[],
              gpu_batches=[], t_end_host=i + 0.5, ev_end=None)


def test_timeline_converts_a_few_of_the_oldest_steps_per_recorded_step():
    """Once more than RESOLVE_LAG steps are held, each record converts RESOLVE_PER_STEP of the
    oldest: an even cost per step, not a batch of hundreds in one token's time."""
    tl = Timeline(["cpu0"], [LANE_CPU], clock=None)
    tl.RESOLVE_LAG, tl.RESOLVE_PER_STEP = 4, 2
    converted = []
    for i in range(12):
        _record_host_step(tl, i)
        converted.append(len(tl._records))
        assert len(tl._pending) <= 5
    assert converted == [0, 0, 0, 0, 2, 2, 4, 4, 6, 6, 8, 8]
    assert [r.attention_s for r in tl.records] == [0.5] * 12 and not tl._pending  # a read converts the rest


def test_timeline_converts_steps_whose_events_have_completed_only():
    class Pending:  # an end event the device has not reached yet
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    tl = Timeline(["cpu0"], [LANE_CPU], clock=None)
    tl.RESOLVE_LAG = 2
    ev = Pending()
    tl.record(layer=0, batch=1, placement="cpu_only", t_entry=0.0, ev_entry=None, tasks=[], gpu_events=[],
              gpu_batches=[], t_end_host=0.5, ev_end=ev)
    for i in range(1, 6):
        _record_host_step(tl, i)
    assert len(tl._records) == 0 and len(tl._pending) == 6  # in order: nothing passes the step still running
    ev.done = True
    _record_host_step(tl, 6)
    assert len(tl._records) == 2


def test_timeline_settles_trailing_work_before_it_converts_a_step():
    """A read runs `before_resolve` (the GPU lane's `settle`) first; while it reports work
    outstanding, the last step stays pending (its columns are filled when that work retires).
    The conversions on the decode path never take the last step."""
    tl = Timeline(["cpu0"], [LANE_CPU], clock=None)
    tl.RESOLVE_LAG, tl.RESOLVE_PER_STEP = 0, 8
    calls = []
    tl.before_resolve = lambda block: calls.append(block) or not block  # outstanding until a blocking settle
    for i in range(4):
        _record_host_step(tl, i)
        assert [p.index for p in tl._pending] == [i]  # the older ones converted, never the last
    assert calls == []
    tl._resolve(block=False)
    assert calls == [False] and [p.index for p in tl._pending] == [3]
    assert len(tl.records) == 4 and calls == [False, True]


def test_timeline_keeps_the_last_max_steps_and_counts_the_dropped():
    tl = Timeline(["cpu0"], [LANE_CPU], clock=None, max_steps=6)
    tl.RESOLVE_LAG = 4
    for i in range(23):
        _record_host_step(tl, i, layer=i % 2)
        assert len(tl._records) + len(tl._pending) <= 6 + tl.RESOLVE_LAG + 1  # bounded on the way, not only at the end
        assert len(tl) == min(i + 1, 6) and tl.recorded_steps == i + 1
    assert [r.index for r in tl.records] == list(range(17, 23)) and tl.dropped_steps == 17
    summary = tl.summary()
    assert summary["steps"] == 6 and summary["dropped_steps"] == 17 and len(summary["layers"]) == 2
    tl.clear()
    assert len(tl) == 0 and tl.dropped_steps == 0 and tl.recorded_steps == 0
    with pytest.raises(ValueError, match="max_steps is 0; expected an integer >= 1"):
        Timeline(["cpu0"], [LANE_CPU], max_steps=0)


def test_profiling_max_steps_bounds_the_runtime_timeline():
    from hybrid_runtime.config import ConfigError, config_from_dict

    base = rt_config().to_dict()
    with pytest.raises(ConfigError, match="profiling.max_steps"):
        config_from_dict({**base, "profiling": {"max_steps": 0}})
    with HybridRuntime(config_from_dict({**base, "profiling": {"max_steps": 3}})) as rt:
        prefill_all(rt, layers=(0,))
        for _ in range(5):
            rt.decode(0, [0, 1, 2], torch.randn(3, 8, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32))
        assert [r.index for r in rt.timeline.records] == [2, 3, 4] and rt.timeline.summary()["dropped_steps"] == 2


def test_a_sampled_timeline_records_whole_tokens_one_in_n():
    tl = Timeline(["cpu0"], [LANE_CPU], clock=None, sample_every=3)
    wanted = [(token, layer) for token in range(7) for layer in range(4) if tl.wants(layer)]
    # Every layer of tokens 0, 3 and 6: per-token figures (a token summed over its layers) stay whole.
    assert wanted == [(t, layer) for t in (0, 3, 6) for layer in range(4)]
    assert tl.skipped_steps == 7 * 4 - 12
    tl.clear()  # counts restart: the next token is recorded
    assert tl.skipped_steps == 0 and tl.wants(2) and not tl.wants(2)
    assert all(Timeline(["cpu0"], [LANE_CPU]).wants(0) for _ in range(3))  # sample_every 1: every step
    assert not Timeline(["cpu0"], [LANE_CPU], enabled=False).wants(0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"sample_every is {bad!r}; expected an integer >= 1"):
            Timeline(["cpu0"], [LANE_CPU], sample_every=bad)


def test_a_sampled_timeline_records_the_offset_token_of_each_n():
    tl = Timeline(["cpu0"], [LANE_CPU], clock=None, sample_every=3, sample_offset=1)
    wanted = [(token, layer) for token in range(7) for layer in range(2) if tl.wants(layer)]
    assert wanted == [(t, layer) for t in (1, 4) for layer in range(2)]  # not the first token after clear
    assert tl.summary()["sample_offset"] == 1
    for bad in (3, -1, 1.0, True):
        with pytest.raises(ValueError, match=f"sample_offset is {bad!r}; expected an integer in \\[0, sample_every = 3\\)"):
            Timeline(["cpu0"], [LANE_CPU], sample_every=3, sample_offset=bad)


def test_profiling_sample_every_records_one_token_in_n_and_leaves_the_rest_unprofiled():
    from hybrid_runtime.config import ConfigError, config_from_dict

    base = rt_config().to_dict()
    with pytest.raises(ConfigError, match="profiling.sample_every"):
        config_from_dict({**base, "profiling": {"sample_every": 0}})
    with pytest.raises(ConfigError, match=r"profiling.sample_offset: 2 is not allowed with profiling.sample_every 2; "
                                          r"allowed: 0 <= value < sample_every"):
        config_from_dict({**base, "profiling": {"sample_every": 2, "sample_offset": 2}})
    with HybridRuntime(config_from_dict({**base, "profiling": {"sample_every": 2, "sample_offset": 1}})) as rt:
        assert rt.timeline.sample_offset == 1 and not rt.timeline.wants(0) and rt.timeline.wants(0)
    with HybridRuntime(config_from_dict({**base, "profiling": {"sample_every": 2}})) as rt:
        prefill_all(rt)
        gen = torch.Generator().manual_seed(0)
        out = {}
        for token in range(5):
            for layer in (0, 1):
                out[token, layer] = rt.decode(layer, [0, 1, 2], torch.randn(3, 8, 32, generator=gen),
                                              torch.randn(3, 2, 32, generator=gen), torch.randn(3, 2, 32, generator=gen))
        recs = rt.timeline.records
        assert [r.layer for r in recs] == [0, 1] * 3 and [r.index for r in recs] == list(range(6))
        assert all(r.n_tasks == 6 and (r.worker >= 0).all() and r.bytes_read.sum() > 0 for r in recs)
        summary = rt.timeline.summary()
        assert summary["steps"] == 6 and summary["sample_every"] == 2 and summary["skipped_steps"] == 4
        # The lanes count every step's bytes, sampled or not.
        lanes = sum(ex.bytes_read for ex in (rt.cpu_executor, rt.gpu_executor) if ex is not None)
        assert lanes > summary["bytes_cpu"] + summary.get("bytes_gpu", 0)
    # The unrecorded steps computed the same attention as recorded ones would: every step was recorded
    # in a second runtime fed the same inputs.
    with HybridRuntime(config_from_dict(base)) as rt:
        prefill_all(rt)
        gen = torch.Generator().manual_seed(0)
        for token in range(5):
            for layer in (0, 1):
                again = rt.decode(layer, [0, 1, 2], torch.randn(3, 8, 32, generator=gen),
                                  torch.randn(3, 2, 32, generator=gen), torch.randn(3, 2, 32, generator=gen))
                # On CUDA the lanes' split (and so which kernels summed a head) depends on timing.
                torch.testing.assert_close(again, out[token, layer], **(dict(atol=2e-3, rtol=2e-3) if CUDA else {}))
        assert len(rt.timeline) == 10


class _DriftingEvents:
    """A stand-in for torch's CUDA events whose timer runs `ppm` parts per million slow against the host."""

    def __init__(self, ppm: float):
        import time
        import types

        slow = 1.0 - ppm * 1e-6
        origin = time.perf_counter()

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self, stream=None):
                self.t = (time.perf_counter() - origin) * slow  # the event timer's reading

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3

        self.cuda = types.SimpleNamespace(Event=Event, synchronize=lambda device=None: None)


def test_cuda_clock_measures_the_timers_rate_and_maps_later_events_with_it(monkeypatch):
    """The event timer drifts from the host clock (tens of ppm): a calibration at least RATE_SPAN_S
    after the previous one measures the rate, and events mapped after it land on the host clock."""
    import time

    from hybrid_runtime.profiling import CudaClock

    fake = _DriftingEvents(ppm=2000.0)  # exaggerated so that 0.2 s shows it
    monkeypatch.setattr(CudaClock, "RATE_SPAN_S", 0.1)
    clock = CudaClock.__new__(CudaClock)
    clock._torch, clock.device, clock.ref, clock.t_ref, clock.error_s, clock.rate = fake, None, None, 0.0, 1.0, 1.0
    clock.calibrate()
    assert clock.rate == 1.0  # one reference: no rate yet
    time.sleep(0.2)
    clock.calibrate()
    assert clock.rate == pytest.approx(1 / (1 - 2000e-6), rel=2e-4)
    time.sleep(0.2)
    ev = fake.cuda.Event()
    t0 = time.perf_counter()
    ev.record()
    t1 = time.perf_counter()
    # Unscaled, the event would map 0.4 ms early (2000 ppm of 0.2 s); scaled it lands in its bracket.
    assert t0 - 60e-6 <= clock.to_host(ev) <= t1 + 60e-6


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_clock_maps_events_onto_the_host_clock():
    import time

    from hybrid_runtime.profiling import CudaClock

    clock = CudaClock()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    ev.synchronize()
    t1 = time.perf_counter()
    assert t0 - 50e-6 <= clock.to_host(ev) <= t1 + 50e-6
    time.sleep(clock.RATE_SPAN_S + 0.5)
    clock.calibrate()
    assert abs(clock.rate - 1.0) < 500e-6  # tens of ppm on the reference host


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_idle_is_measured_on_cuda():
    rt, _ = run_steps("fluxion", steps=3)
    try:
        for r in rt.timeline.records:
            assert r.has_gpu and len(r.gpu_intervals) >= 2
            assert 0.0 <= r.gpu_idle_ratio() <= 1.0
    finally:
        rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_timing_events_are_reused_after_their_steps_resolve(monkeypatch):
    from hybrid_runtime.profiling.timeline import Timeline

    monkeypatch.setattr(Timeline, "RESOLVE_LAG", 4)
    rt, _ = run_steps("fluxion", steps=20)  # 40 layer-steps, five timing events each
    try:
        recs = rt.timeline.records
        assert len(recs) == 40
        # Made at most for the steps held unconverted at once (RESOLVE_LAG, the one recorded, and one
        # more while the oldest's end event has not completed), not 200.
        assert rt.timeline.events.made <= 5 * 7
        ends = [r.t_end for r in recs]
        assert all(r.t_start <= r.t_end for r in recs) and ends == sorted(ends)  # re-recorded events time their own step
        for r in recs:
            for a, b in r.gpu_intervals:
                assert recs[0].t_start - 1e-3 <= a <= b <= recs[-1].t_end + 1e-3
    finally:
        rt.close()


def test_cpu_shares_from_proc_stat_counters():
    from hybrid_runtime.profiling.machine import cpu_jiffies, cpu_shares

    #                      user nice sys idle iowait irq softirq steal
    before = {0: np.array([100, 0, 10, 500, 0, 0, 0, 5]), 1: np.array([0, 0, 0, 1000, 0, 0, 0, 0])}
    after = {0: np.array([160, 0, 20, 520, 0, 0, 0, 15]), 1: np.array([0, 0, 0, 1100, 0, 0, 0, 0])}
    # core 0: 100 ticks, 20 idle, 10 stolen; core 1: 100 ticks, all idle
    assert cpu_shares(before, after, [0]) == {"busy": 0.8, "steal": 0.1}
    assert cpu_shares(before, after) == {"busy": 0.4, "steal": 0.05}
    nan = cpu_shares(before, before)  # no tick passed
    assert math.isnan(nan["busy"]) and math.isnan(nan["steal"])
    snap = cpu_jiffies()  # this machine's counters, where it has /proc/stat
    assert all(v.shape == (8,) and (v >= 0).all() for v in snap.values())
