"""CPU lanes that start on the device's word (`scheduler.cpu_lane_start`).

On the host: a job published gated pops nothing until the word (written here by a thread, as the
caller's stream writes it on CUDA) reaches its id, and a word that never comes cannot hold a
worker (the step's timeout closes the queue; STOP ends the wait); a step settles the previous one
after its own planning and before its launches. The key resolves and refuses as
documented. On CUDA (`gpu` marker): the driver's write lands after the copy it follows; chained
layers started on the device's word give the output of layers started on the host; a bad input
there is raised by a later call (the check is deferred: no step waits for q).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from hybrid_runtime import native_pool
from hybrid_runtime.config import ConfigError, config_from_dict, resolved
from hybrid_runtime.scheduler import Scheduler, StepJob, StepTimeoutError
from tests.helpers import store_after
from tests.test_scheduler import CountingNativeCpu, counting_kernel, id_tasks, native_args, sched_cfg

N = 48


def scheduler(timeout: float = 120.0) -> tuple[Scheduler, np.ndarray]:
    hits = np.zeros(N, dtype=np.int64)
    s = Scheduler(sched_cfg("cpu_only", cpu_workers=2, gpu_worker=False, timeout=timeout), CountingNativeCpu(hits),
                  None, native=native_args(N, counting_kernel))
    return s, hits


def signal_after(ctrl: np.ndarray, value: int, after_s: float) -> threading.Thread:
    """The device's write of `value` to QREADY, `after_s` from now, from another thread."""
    return store_after(ctrl, native_pool.C_QREADY, value, after_s)


def test_a_gated_job_pops_nothing_until_the_word_reaches_its_id():
    s, hits = scheduler()
    try:
        s.run(StepJob(0, id_tasks(N), batch=1))  # the workers' start, and a job published ungated
        assert (hits == 1).all()
        signalled = []
        job = StepJob(0, id_tasks(N, seed=1), batch=1)
        s.run(job, cpu_trails=True, q_signal=signalled.append)
        assert signalled == [job.cpu_queue.job] and job.cpu_queue.q_gate and s.device_started_steps == 1
        time.sleep(0.2)
        assert (hits == 1).all() and s.native.ctrl[native_pool.C_DONE] == 0, "a gated job ran before its word"
        # An older job's id is not this job's: still nothing.
        s.native.ctrl[native_pool.C_QREADY] = job.cpu_queue.job - 1
        time.sleep(0.1)
        assert (hits == 1).all()
        th = signal_after(s.native.ctrl, job.cpu_queue.job, 0.1)
        s.settle_cpu()  # collects the trailing job once its tasks ran
        th.join()
        assert (hits == 2).all() and job.columns["worker"].min() >= 0
        # A word already past the next job's id (the device ran ahead of the host) lets it run at once.
        s.native.ctrl[native_pool.C_QREADY] = 1 << 40
        nxt = StepJob(0, id_tasks(N, seed=2), batch=1)
        s.run(nxt, q_signal=lambda job_id: None)
        assert nxt.done() and (hits == 3).all()
    finally:
        s.close()


def test_a_word_that_never_comes_times_the_step_out_and_frees_the_workers():
    s, hits = scheduler(timeout=0.3)
    try:
        s.run(StepJob(0, id_tasks(N), batch=1))
        job = StepJob(0, id_tasks(N, seed=1), batch=1)
        s.run(job, cpu_trails=True, q_signal=lambda job_id: None)
        with pytest.raises(StepTimeoutError, match="layer 0 did not finish"):
            s.settle_cpu()
        # The queue was closed: the waiting workers left the job without popping, and the device-side
        # wait of that step ends (the positions never started are counted done by the host).
        assert (hits == 1).all() and s.native.ctrl[native_pool.C_DONE] >= s.cpu_lane_target(job)
        nxt = StepJob(0, id_tasks(N, seed=2), batch=1)
        s.run(nxt)  # usable: an ungated job runs
        assert nxt.done() and (hits == 2).all()
    finally:
        s.close()


def test_a_step_settles_the_previous_one_just_before_its_own_launches():
    """`run` sizes and splits the step while the previous step's CPU tasks still run, then waits for
    them (their errors first) and calls `after_settle` before it publishes anything."""
    s, hits = scheduler()
    try:
        s.run(StepJob(0, id_tasks(N), batch=1))
        job = StepJob(0, id_tasks(N, seed=1), batch=1)
        s.run(job, cpu_trails=True, q_signal=lambda job_id: None)  # held at its word
        th = signal_after(s.native.ctrl, job.cpu_queue.job, 0.2)
        seen = []
        nxt = StepJob(0, id_tasks(N, seed=2), batch=1)
        s.run(nxt, after_settle=lambda: seen.append((s.cpu_inflight is None, int(hits.sum()), nxt.cpu_queue.job)))
        th.join()
        assert seen == [(True, 2 * N, -1)], "after_settle ran before the previous step ended, or after publishing"
        assert nxt.done() and (hits == 3).all() and job.columns["worker"].min() >= 0
    finally:
        s.close()


def test_close_ends_a_wait_for_the_word():
    s, hits = scheduler()
    s.run(StepJob(0, id_tasks(N), batch=1))
    job = StepJob(0, id_tasks(N, seed=1), batch=1)
    s.run(job, cpu_trails=True, q_signal=lambda job_id: None)
    t0 = time.monotonic()
    s.close()  # STOP reaches the workers waiting for the word
    assert time.monotonic() - t0 < 30 and not any(t.is_alive() for t in s.threads)
    assert (hits == 1).all()


def test_the_key_resolves_to_where_it_can_run_and_refuses_a_sync_check():
    assert config_from_dict({}).scheduler.cpu_lane_start == "auto"
    assert resolved(config_from_dict({}), cuda=True).scheduler.cpu_lane_start == "device"
    assert resolved(config_from_dict({}), cuda=False).scheduler.cpu_lane_start == "host"
    sync = config_from_dict({"scheduler": {"finite_check": "sync"}})
    assert resolved(sync, cuda=True).scheduler.cpu_lane_start == "host"  # "auto" keeps a sync check's wait
    host = config_from_dict({"scheduler": {"cpu_lane_start": "host"}})
    assert resolved(host, cuda=True).scheduler.cpu_lane_start == "host"
    with pytest.raises(ConfigError, match=r"scheduler.cpu_lane_start: 'device'.*finite_check.*'sync'"):
        config_from_dict({"scheduler": {"cpu_lane_start": "device", "finite_check": "sync"}})
    with pytest.raises(ConfigError, match=r"scheduler.cpu_lane_start: 'gpu' is not allowed; allowed: 'auto', 'host', 'device'"):
        config_from_dict({"scheduler": {"cpu_lane_start": "gpu"}})
    ran = resolved(config_from_dict({}), cuda=True)
    assert config_from_dict(ran.to_dict()) == ran


def test_without_cuda_every_step_starts_on_the_host():
    from hybrid_runtime.runtime import HybridRuntime
    from tests.helpers import random_kv

    cfg = config_from_dict({
        "geometry": {"layers": 1, "q_heads": 4, "kv_heads": 2, "head_dim": 32},
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 2,
                     "device": "cpu"},
        "selection": {"name": "full"},
        "scheduler": {"placement": "cpu_only", "cpu_workers": 1, "gc_freeze": False, "cpu_lane_start": "device",
                      "finite_check": "deferred"},
        "profiling": {"enabled": False},
    })
    with HybridRuntime(cfg) as rt:
        rt.prefill(0, 0, *random_kv(600, 2, 32, seed=1))
        g = torch.Generator().manual_seed(0)
        rt.decode(0, [0], torch.randn(1, 4, 32, generator=g), *torch.randn(2, 1, 2, 32, generator=g))
        assert rt.stats()["cpu_lane_device_starts"] == 0


# ---------------------------------------------------------------------------- on CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_drivers_write_lands_after_the_copy_it_follows():
    from gpu_kernels.host_count_wait import device_address, signal_value

    word = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    dst = torch.zeros(1 << 22, dtype=torch.float32, pin_memory=True)
    src = torch.full((1 << 22,), 3.0, device="cuda")
    stream = torch.cuda.Stream()
    address = device_address(word[3:])
    signal_value(address, 5, stream.cuda_stream)  # the driver's entry point loaded, the stream used once
    stream.synchronize()
    assert int(word[3]) == 5
    with torch.cuda.stream(stream):
        torch.cuda._sleep(400_000_000)  # ~0.2 s: holds the stream, the write must wait for it and the copy
        dst.copy_(src, non_blocking=True)
        signal_value(address, 17, stream.cuda_stream)
    assert int(word[3]) == 5, "the write came before the work queued ahead of it"
    end = time.monotonic() + 30
    while int(word[3]) != 17:
        assert time.monotonic() < end, "the stream never wrote the word"
    assert bool((dst == 3.0).all()), "the word was there before the copy it follows"
    stream.synchronize()


def _runtime(start: str, placement: str):
    from hybrid_runtime.runtime import HybridRuntime

    return HybridRuntime(config_from_dict({
        "geometry": {"layers": 3, "q_heads": 8, "kv_heads": 2, "head_dim": 64},
        "kv_cache": {"sink": 16, "local": 64, "generated_cap": 32, "cpu_capacity_tokens": 121000, "max_sequences": 3},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.25},
        "scheduler": {"placement": placement, "cpu_workers": 2, "cpu_lane_start": start, "gc_freeze": False},
        "profiling": {"enabled": True},
    }))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("placement,counted_in_inputs", [("cpu_only", True), ("fluxion", True), ("cpu_only", False)])
def test_layers_started_on_the_devices_word_give_the_host_started_output(placement, counted_in_inputs):
    """Layers chained on the GPU (each layer's q from the previous layer's output, as in a model):
    the host publishes layer l + 1 before its q exists. Runtimes starting on the host and on the
    device's word, fed the same inputs, give the same output at every step, spills included."""
    from tests.helpers import chained_decode

    inputs, outs, stats = [], {}, {}
    for start in ("host", "device"):  # 40 steps of 3 layers: past the window's cap, so spills start some on the host
        rt = _runtime(start, placement)
        rt.count_checks_in_inputs = counted_in_inputs  # the deferred check in the step-inputs kernel, or its own launch
        try:
            outs[start] = chained_decode(rt, [50000, 30000, 40000], inputs)
            stats[start] = rt.stats()
            assert all(r.worker.min() >= 0 for r in rt.timeline.records if r.n_tasks)
        finally:
            rt.close()
    assert stats["host"]["cpu_lane_device_starts"] == 0
    # A Triton launch through the JIT after warm-up (a new specialisation: the check's ring rows were
    # once 72 bytes apart, so a misaligned row compiled on the hot path) made the first runtime of a
    # process wrong at layer-step 0 on the device's word (benchmarks/notes/e2e_overlap.md section 22).
    assert stats["host"]["jit_launches_after_warmup"] == 0 and stats["device"]["jit_launches_after_warmup"] == 0, \
        (stats["host"]["jit_kernels_after_warmup"], stats["device"]["jit_kernels_after_warmup"])
    assert stats["device"]["cpu_lane_device_starts"] >= 90, stats["device"]["cpu_lane_device_starts"]
    tol = 1e-3 if placement == "cpu_only" else 2e-2  # fluxion: the lanes split each step anew (ties to rounding)
    torch.testing.assert_close(outs["device"], outs["host"], atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("placement,bad", [("cpu_only", "q"), ("fluxion", "q"), ("fluxion", "v")])
def test_a_bad_input_of_a_device_started_step_is_raised_by_the_next_call(placement, bad):
    """The deferred check of a step started on the device's word is counted by its step-inputs
    kernel (no launch of its own) and raised by a later call, naming the tensor."""
    from tests.helpers import random_kv

    rt = _runtime("auto", placement)
    try:
        for s in range(3):
            for layer in range(3):
                rt.prefill(s, layer, *(x.cuda() for x in random_kv(3000, 2, 64, seed=s + layer)))
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(3, h, 64, generator=gen, device="cuda") for h in (8, 2, 2))
        rt.decode(0, [0, 1, 2], q, k, v)
        q, v = q.clone(), v.clone()
        {"q": q, "v": v}[bad][1, 1, 5] = float("nan")
        rt.decode(1, [0, 1, 2], q, k, v)  # started on the device's word: nothing waited for q
        st = rt.stats()
        assert st["cpu_lane_device_starts"] == 2 and st["fused_input_checks"] == 2
        with pytest.raises(ValueError, match=f"{bad} has 1 NaN/inf value of .* at layer 1"):
            rt.decode(2, [0, 1, 2], *(torch.randn(3, h, 64, generator=gen, device="cuda") for h in (8, 2, 2)))
    finally:
        rt.close()


def test_a_missing_stream_memory_operation_refuses_an_explicit_setting_and_falls_back_under_auto(caplog):
    """The runtime's check of the driver's stream wait (`cpu_lane_trails`) and write (`cpu_lane_start`)."""
    from hybrid_runtime.runtime import _stream_op_usable

    assert _stream_op_usable(None, True, "refused: {}", "fell back: {}")
    with caplog.at_level("INFO", logger="hybrid_runtime.runtime"):
        assert not _stream_op_usable("no cuStreamWriteValue64", False, "refused: {}", "fell back: {}")
    assert "fell back: no cuStreamWriteValue64" in caplog.text
    with pytest.raises(ConfigError, match="^refused: no cuStreamWriteValue64$"):
        _stream_op_usable("no cuStreamWriteValue64", True, "refused: {}", "fell back: {}")
