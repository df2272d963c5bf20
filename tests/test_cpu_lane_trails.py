"""Steps that return before their CPU tasks end (`scheduler.cpu_lane_trails`).

On the host: the scheduler's side, and the done count the device-side wait reads (it must reach
the wait's target exactly when the CPU lane's positions are all done, and the host's release must
raise it past). On CUDA (`gpu` marker): the driver's stream wait itself, and the runtime's output
against a runtime that waits, fed the same inputs.
"""

from __future__ import annotations

import threading
import time

import numba
import numpy as np
import pytest
import torch

from hybrid_runtime import native_pool
from hybrid_runtime.scheduler import Scheduler, StepJob, StepTimeoutError
from tests.helpers import store_after
from tests.test_scheduler import CountingGpu, CountingNativeCpu, id_tasks, native_args, sched_cfg

N = 64


@numba.njit(nogil=True)
def gated_kernel(arena, chunks, cpu_len, block_size, q, n_select, out, lse, hits):
    """Counts its task (`cpu_len` is the task id) once the gate (`hits[-1]`) opens; task 7 raises
    while `hits[-2]` is set."""
    while native_pool.atomic_load(hits, hits.shape[0] - 1) == 0:
        native_pool.cpu_relax()
    if cpu_len == 7 and hits[hits.shape[0] - 2] != 0:
        raise FloatingPointError("kernel failed on task 7")
    native_pool.atomic_add(hits, cpu_len, 1)
    return 1


def scheduler(placement: str = "cpu_only", timeout: float = 120.0, gpu: object = None):
    hits = np.zeros(N + 2, dtype=np.int64)
    cfg = sched_cfg(placement, cpu_workers=2, gpu_worker=gpu is not None, timeout=timeout)
    s = Scheduler(cfg, CountingNativeCpu(hits), gpu, native=native_args(N, gated_kernel))
    return s, hits


def open_gate(hits: np.ndarray, after_s: float = 0.0) -> threading.Thread:
    return store_after(hits, hits.shape[0] - 1, 1, after_s)


def await_count(s: Scheduler, job: StepJob, timeout: float = 60.0) -> None:
    """What the device-side wait does, on the host: until the done word reaches the job's target."""
    target = s.cpu_lane_target(job)
    end = time.monotonic() + timeout
    while s.native.ctrl[native_pool.C_DONE] < target:
        assert time.monotonic() < end, f"done count {s.native.ctrl[native_pool.C_DONE]} never reached {target}"
        time.sleep(1e-4)


def test_a_step_returns_before_its_cpu_tasks_and_the_device_wait_ends_when_they_do():
    s, hits = scheduler()
    try:
        job = StepJob(0, id_tasks(N), batch=1)
        s.run(job, cpu_trails=True)
        # Returned with every task held at the gate: nothing ran, the job trails.
        assert job.cpu_trailing and s.cpu_inflight is job and not job.done()
        assert hits[:N].sum() == 0
        assert s.cpu_lane_target(job) == N
        th = open_gate(hits, after_s=0.2)
        t0 = time.perf_counter()
        await_count(s, job)
        assert time.perf_counter() - t0 >= 0.15
        assert s.native.ctrl[native_pool.C_DONE] == N and (hits[:N] == 1).all()  # counted after every result
        th.join()
        # The next step collects it first: every task recorded, each once.
        nxt = StepJob(0, id_tasks(N, seed=1), batch=1)
        s.run(nxt)
        assert s.cpu_inflight is None and job.columns["worker"].min() >= 0 and (hits[:N] == 2).all()
        assert not nxt.cpu_trailing and nxt.done()
    finally:
        hits[-1] = 1
        s.close()


def test_a_failed_trailing_task_is_raised_by_the_next_step_and_releases_the_device_wait():
    s, hits = scheduler()
    try:
        hits[N] = 1  # task 7 fails
        job = StepJob(0, id_tasks(N), batch=1)
        s.run(job, cpu_trails=True)
        assert job.cpu_trailing
        open_gate(hits).join()
        with pytest.raises(FloatingPointError, match="task 7") as info:
            s.settle()
        assert any("layer 0 had returned before its CPU tasks ended" in n for n in info.value.__notes__)
        # The failed position was counted done, the positions never started too (by the host):
        # the device-side wait ends at its target.
        assert s.native.ctrl[native_pool.C_DONE] == N
        await_count(s, job)
        hits[N] = 0
        s.run(StepJob(0, id_tasks(N), batch=1))  # the scheduler stays usable
        assert s.cpu_inflight is None
    finally:
        s.close()


def test_a_trailing_step_that_times_out_is_raised_and_its_tasks_are_waited_for():
    s, hits = scheduler(timeout=0.3)
    try:
        job = StepJob(0, id_tasks(N), batch=1)
        s.run(job, cpu_trails=True)
        with pytest.raises(StepTimeoutError, match="layer 0 did not finish"):
            s.settle_cpu()
        # The two tasks the workers hold are all the device still waits for.
        assert s.native.ctrl[native_pool.C_DONE] == N - 2
        open_gate(hits, after_s=0.1)
        await_count(s, job)
        s.run(StepJob(0, id_tasks(N, seed=2), batch=1))  # waits for the orphaned tasks first
        assert s.lane.orphan is None
    finally:
        hits[-1] = 1
        s.close()


@pytest.mark.gpu
def test_the_driver_wait_holds_the_stream_until_the_host_counts():
    from gpu_kernels.host_count_wait import device_address, wait_for_count

    word = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    addr = device_address(word[3:])
    for target in (5, 6):
        word[3] = 0
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        wait_for_count(addr, target, torch.cuda.current_stream().cuda_stream)
        e1.record()
        time.sleep(0.05)
        assert not e1.query()  # still held
        word[3] = target - 1
        time.sleep(0.02)
        assert not e1.query()
        word[3] = target + 1 if target == 6 else target  # at or past the target
        e1.synchronize()
        assert e0.elapsed_time(e1) >= 60.0
    with pytest.raises(ValueError, match="pinned host memory"):
        device_address(torch.zeros(2, dtype=torch.int64))


def test_fluxion_trailing_step_keeps_the_gpu_to_its_reserved_claim():
    gpu = CountingGpu()
    s, hits = scheduler("fluxion", gpu=gpu)
    # Lanes of equal modeled speed: the GPU lane reserves about half the queue.
    s.tp_cpu_worker = 1e9
    s.rates.cpu_lane.bytes_per_s = 2e9
    s.rates.cpu_start.seconds = 0.0
    s.gpu_model.lat, s.gpu_model.bw = 0.0, 2e9
    try:
        tasks = id_tasks(N)
        job = StepJob(0, tasks, batch=1)
        s.run(job, cpu_trails=True)
        assert job.cpu_trailing and job.gpu_first is None
        reserved = job.cpu_queue.reserved
        assert 0 < reserved < N and gpu.batches == [reserved]  # one launch: the reserved head, no more
        assert s.cpu_lane_target(job) == N - reserved
        open_gate(hits)
        await_count(s, job)
        s.settle()
        on_gpu = np.zeros(N, dtype=np.int64)
        on_gpu[[t.cpu_len for t in tasks if t.seq_id in set(gpu.runs)]] = 1
        assert ((hits[:N] + on_gpu) == 1).all()  # each task once, on one lane
    finally:
        hits[-1] = 1
        s.close()


@pytest.mark.parametrize("gate", [True, False])
def test_a_trailing_step_whose_cpu_lane_ends_within_the_launchers_time_claims_nothing(gate):
    """`gate_trailing_claims`: the launcher's measured time from a trailing step's release to the
    next step's entry (`launcher_slack`) bounds what its CPU lane may take; a CPU lane modeled to
    end within it leaves the GPU out (its claim would only add host work to the critical path), and
    so is the GPU's selection for the CPU lane (its launch would too): not even weighed."""
    import dataclasses

    class Picks:  # the selection's decision only: it never pays, so nothing is launched
        enabled, weighed = True, 0

        def pays(self, *args) -> bool:
            self.weighed += 1
            return False

    gpu = CountingGpu()
    s, hits = scheduler("fluxion", gpu=gpu)
    s.cfg = dataclasses.replace(s.cfg, gate_trailing_claims=gate)
    s.picks = picks = Picks()
    s.tp_cpu_worker = 1e9
    s.rates.cpu_lane.bytes_per_s = 2e9
    s.rates.cpu_start.seconds = 0.0
    s.gpu_model.lat, s.gpu_model.bw = 0.0, 2e9
    try:
        first = StepJob(0, id_tasks(N), batch=1)
        s.run(first, cpu_trails=True)
        assert s.launcher_slack is None and first.cpu_queue.reserved > 0  # nothing measured yet: claims as sized
        assert picks.weighed == 1 and not first.picks
        time.sleep(0.05)
        s.note_entry(time.perf_counter())  # the caller's next step: 50 ms after the release
        assert s.launcher_slack.seconds >= 0.05
        open_gate(hits)
        await_count(s, first)
        hits[-1] = 0  # hold the next step's tasks again
        s.settle()
        launches = len(gpu.batches)
        s.rates.balance = 0.0  # (the first step taught the lanes a correction: back to the plain split)
        job = StepJob(0, id_tasks(N, seed=1), batch=1)
        s.run(job, cpu_trails=True)  # its CPU lane (modeled: microseconds) ends well within 50 ms
        assert job.cpu_trailing and job.gpu_gated == gate
        if gate:
            assert job.cpu_queue.reserved == 0 and len(gpu.batches) == launches and s.trailing_claims_gated == 1
            assert s.cpu_lane_target(job) == N
            assert picks.weighed == 1  # the gated step did not consider the selection
        else:
            assert job.cpu_queue.reserved > 0 and len(gpu.batches) == launches + 1 and s.trailing_claims_gated == 0
            assert picks.weighed == 2
        open_gate(hits)
        await_count(s, job)
        s.settle()
    finally:
        hits[-1] = 1
        s.close()


@pytest.mark.parametrize("placement", ["uniform", "length"])
def test_static_placements_wait_for_their_cpu_tasks(placement):
    s, hits = scheduler(placement, gpu=CountingGpu())
    try:
        open_gate(hits, after_s=0.1)
        job = StepJob(0, id_tasks(N), batch=1)
        s.run(job, cpu_trails=True)  # ignored: a separate GPU queue is driven until the step ends
        assert not job.cpu_trailing and job.done() and s.cpu_inflight is None
    finally:
        hits[-1] = 1
        s.close()


# ---------------------------------------------------------------------------- the runtime on CUDA
def _runtime(placement: str, trails: bool, profiling: bool = True):
    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.runtime import HybridRuntime

    return HybridRuntime(config_from_dict({
        "geometry": {"layers": 3, "q_heads": 8, "kv_heads": 2, "head_dim": 64},
        "kv_cache": {"sink": 16, "local": 64, "generated_cap": 32, "cpu_capacity_tokens": 121000,
                     "max_sequences": 3},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.25},
        # One worker: the step's CPU tasks run one after another, well past the step's host work.
        "scheduler": {"placement": placement, "cpu_workers": 1, "cpu_lane_trails": trails, "gc_freeze": False},
        "profiling": {"enabled": profiling},
    }))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["fluxion", "cpu_only"])
def test_runtime_steps_that_trail_their_cpu_lane_give_the_waiting_steps_output(placement, monkeypatch):
    """Layers chained on the GPU without a host sync between them (each layer's q comes from the
    previous layer's output, as in a model), so the host issues layer l + 1 while layer l's CPU
    tasks run. A runtime that waits, fed the same inputs, gives the same output at every step,
    spills included."""
    from hybrid_runtime.gpu_lane import GpuLane
    from tests.helpers import chained_decode

    # fluxion: one CPU worker against the GPU lane makes the reserved claim round up to every
    # position of the step's six (it ends the step sooner), and a step without CPU tasks has
    # nothing to trail (0 of 120 did on an H200 at 0b506b6): the claim leaves the CPU lane one.
    first_positions = GpuLane.first_positions
    monkeypatch.setattr(GpuLane, "first_positions", lambda self, queue, want: max(
        0, min(first_positions(self, queue, want), len(queue.cum_bytes) - 2)))
    inputs, outs = [], {}
    for trails in (True, False):
        rt = _runtime(placement, trails)
        try:

            def last_layer_waits(i: int) -> None:
                if i % 3 == 2:
                    assert rt.scheduler.cpu_inflight is None  # the last layer waits for its CPU tasks

            # Tasks of ~1 ms (they outlast the step's host work); 40 steps of 3 layers: past the window's
            # generated cap, so spills change the tasks.
            outs[trails] = chained_decode(rt, [50000, 30000, 40000], inputs, after_step=last_layer_waits)
            st = rt.stats()  # settles the last step; its records are complete
            # Waiting steps never trail; trailing ones do, unless all their tasks ended before the
            # step's host work did.
            trailed = st["cpu_trailed_steps"]
            assert (trailed >= 30) if trails else (trailed == 0), f"{trailed} of 120 steps trailed their CPU tasks"
            recs = rt.timeline.records
            assert len(recs) == 120 and all(r.worker.min() >= 0 for r in recs if r.n_tasks)
        finally:
            rt.close()
    # cpu_only: the same kernels on the same data, so the same output to rounding. fluxion: the
    # lanes split each step anew, and a task the GPU lane ran in one runtime and a CPU worker in
    # the other may select a block or two differently where scores tie to rounding (up to ~1e-2
    # here); a merge that read CPU results before they were written was off by 0.3-0.7.
    tol = 1e-3 if placement == "cpu_only" else 2e-2
    torch.testing.assert_close(outs[True], outs[False], atol=tol, rtol=tol)


@pytest.mark.gpu
def test_by_default_steps_trail_but_the_last_layer_waits_and_raises_its_own_errors():
    """`cpu_lane_trails` left at "auto": on CUDA a layer's `decode` returns while a CPU task is
    still held; the last layer's `decode` waits for its tasks, so a failing one is raised by that
    same call (within the model step), and the runtime stays exact afterwards."""
    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.runtime import HybridRuntime
    from hybrid_runtime.reference import dense_attention
    from tests.helpers import random_kv
    from tests.test_faults import FAIL, FAULT, FAULTY_KERNEL, HOLD, NATIVE_STATUS, NONE, NativeFaultCpu

    lengths, target = [300, 1000, 2500], 1
    rt = HybridRuntime(config_from_dict({
        "geometry": {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32},
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 8192, "max_sequences": 4},
        "selection": {"name": "full"},
        "scheduler": {"placement": "cpu_only", "cpu_workers": 2, "step_timeout_s": 30.0, "gc_freeze": False},
        "profiling": {"enabled": False},
    }), cpu_executor=NativeFaultCpu, cpu_kernel=FAULTY_KERNEL)
    ids = list(range(len(lengths)))
    gen = torch.Generator().manual_seed(0)

    def step(layer):
        q, k, v = (torch.randn(len(ids), h, 32, generator=gen).cuda() for h in (8, 2, 2))
        return q, rt.decode(layer, ids, q, k, v)

    def exact(layer, q, out):
        ref = torch.stack([dense_attention(q[b].float().cpu(), *rt.store.full_kv(s, layer))[0] for b, s in enumerate(ids)])
        torch.testing.assert_close(out.cpu(), ref, atol=2e-3, rtol=2e-3)

    try:
        for s, n in enumerate(lengths):
            for layer in range(2):
                rt.prefill(s, layer, *(x.cuda() for x in random_kv(n, 2, 32, seed=10 * s + layer)))
        target_len = rt.store.cpu_len(target, 0)
        FAULT[1], FAULT[2] = target_len, 0
        FAULT[0] = HOLD  # the target's task does not end until released
        q0, out0 = step(0)
        assert rt.scheduler.cpu_inflight is not None  # returned with the held task still running
        FAULT[0] = NONE
        q1, out1 = step(1)  # settles layer 0 first, then waits for its own tasks: the last layer
        assert rt.scheduler.cpu_inflight is None
        exact(0, q0, out0)
        exact(1, q1, out1)
        step(0)
        rt.scheduler.settle_cpu()  # layer 0's tasks ended: the fault below is layer 1's only
        FAULT[2] = 0
        FAULT[0] = FAIL
        with pytest.raises(RuntimeError, match=f"failure status {NATIVE_STATUS}") as info:
            step(1)
        assert FAULT[2] >= 1
        assert not any("had returned before its CPU tasks ended" in n for n in getattr(info.value, "__notes__", []))
        FAULT[0] = NONE
        for layer in (0, 1):
            exact(layer, *step(layer))
        assert rt.stats()["cpu_trailed_steps"] >= 1
    finally:
        FAULT[:] = 0
        rt.close()


def test_a_prefill_or_release_between_steps_is_no_sample_of_the_launchers_time():
    """`launcher_slack` is the launcher's own time from a trailing step's release to its next step:
    a prefill between them (seconds of the caller's other work) is not, and one such sample taken
    as the launcher's (clipped to 3x the estimate) gated the claims of the first step after every
    prompt. `end_step_chain` (called by the runtime's prefill and release) drops the pending sample."""
    s, hits = scheduler("fluxion", gpu=CountingGpu())
    try:
        for expect_sample in (True, False):
            job = StepJob(0, id_tasks(N, seed=int(expect_sample)), batch=1)
            s.run(job, cpu_trails=True)
            before = s.launcher_slack.seconds if s.launcher_slack is not None else None
            if not expect_sample:
                s.end_step_chain()  # the caller prefilled a prompt here
            time.sleep(0.02)
            s.note_entry(time.perf_counter())
            if expect_sample:
                assert s.launcher_slack is not None and s.launcher_slack.seconds >= 0.02
            else:
                assert s.launcher_slack.seconds == before
            open_gate(hits)
            await_count(s, job)
            hits[-1] = 0
            s.settle()
    finally:
        hits[-1] = 1
        s.close()
