"""GPU-only steps that return before their claims end (`GpuLane.drive(gpu_trails=True)`).

On the host: the scheduler's side with executor doubles whose claims 'run on the device' until a
gate opens (`query` is False until then), and the runtime's side with a double that computes its
results at launch but reports its claims unfinished (the runtime's switch `gpu_only_trails` is on
only on CUDA, forced here). On CUDA (`gpu` marker): the runtime's output against a runtime that
waits, fed the same inputs, for the UVA executor and AsyncTLS.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from hybrid_runtime.config import config_from_dict
from hybrid_runtime.executors.asynctls import AsyncTlsExecutor
from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
from hybrid_runtime.executors.torch_ref import TorchRefExecutor
from hybrid_runtime.gpu_lane import GpuLane
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.scheduler import Scheduler, StepJob, StepTimeoutError
from hybrid_runtime.step_job import RuntimeBrokenError
from tests.test_scheduler import CountingGpu, TrailingGpu, _GatedHandle, fake_tasks, sched_cfg, trailing_scheduler


def run_gpu_only(s: Scheduler, tasks, layer: int = 0, timeout=None, gpu_trails: bool = True) -> StepJob:
    job = StepJob(layer, tasks, cpu_arrays=(None, None, None))
    s.run(job, timeout, gpu_trails=gpu_trails)
    return job


# ---------------------------------------------------------------------------- the scheduler's side
def test_a_gpu_only_step_returns_once_its_queue_is_launched_and_the_next_step_retires_it():
    s, gpu = trailing_scheduler("gpu_only")
    try:
        first = run_gpu_only(s, fake_tasks(50))  # returns although its claim has not ended on the "device"
        assert s.lane.trailing is not None and s.lane.trailing[0] is first and gpu.retired == 0
        assert gpu.batches == [50]  # one claim of the whole queue: every position launched
        assert first.done() and len(first.gpu_batches) == 1  # the merge's end event is known at launch
        assert (first.columns["worker"] == -1).all()  # recorded when retired
        assert sorted(gpu.runs) == list(range(50)) and s.gpu_trailed_steps == 1
        gpu.gate.set()
        second = run_gpu_only(s, fake_tasks(50, seed=1))
        assert gpu.retired >= 1 and (first.columns["worker"] == s.gpu_worker_id).all()
        assert first.gpu_bytes == 50  # its bytes were counted at retirement
        assert second.done() and sorted(gpu.runs) == sorted(list(range(50)) * 2)  # each task once
        s.lane.settle()
        assert s.lane.trailing is None and gpu.retired == len(gpu.batches) == 2
    finally:
        gpu.gate.set()
        s.close()


def test_one_gpu_only_step_trails_at_a_time():
    """A step returns only once the claims of the step before it are retired: the host runs at
    most one step ahead of the GPU lane."""
    s, gpu = trailing_scheduler("gpu_only")
    try:
        run_gpu_only(s, fake_tasks(40))
        threading.Timer(0.2, gpu.gate.set).start()
        t0 = time.monotonic()
        second = run_gpu_only(s, fake_tasks(40, seed=1))
        assert time.monotonic() - t0 >= 0.19  # it waited for the first step's claim
        # Its own claim had ended by the time it could trail (the gate is open): nothing trails.
        assert s.lane.trailing is None or s.lane.trailing[0] is second
        assert gpu.retired >= 1
    finally:
        gpu.gate.set()
        s.close()


def test_gpu_only_steps_wait_where_they_cannot_trail():
    # An executor that does not declare `retire_later` is waited for (its `wait` may do the work).
    s = Scheduler(sched_cfg("gpu_only", cpu_workers=2), None, CountingGpu())
    try:
        job = run_gpu_only(s, fake_tasks(30))
        assert s.lane.trailing is None and (job.columns["worker"] == s.gpu_worker_id).all()
    finally:
        s.close()
    # And a step the caller does not let trail (the runtime's last layer, a host without CUDA).
    s, gpu = trailing_scheduler("gpu_only")
    try:
        threading.Timer(0.2, gpu.gate.set).start()
        t0 = time.monotonic()
        run_gpu_only(s, fake_tasks(30), gpu_trails=False)
        assert time.monotonic() - t0 >= 0.19 and s.lane.trailing is None and gpu.retired == len(gpu.batches)
    finally:
        gpu.gate.set()
        s.close()


def test_a_trailing_gpu_only_claim_that_fails_fails_the_next_step_naming_it():
    s, gpu = trailing_scheduler("gpu_only")
    try:
        run_gpu_only(s, fake_tasks(40), layer=3)
        gpu.fail_wait = True
        gpu.gate.set()
        with pytest.raises(RuntimeError, match="claim failed on the device") as info:
            run_gpu_only(s, fake_tasks(40, seed=1), layer=4)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "claim of queue positions [0, 40)" in notes and "its step (layer 3) had returned" in notes
        gpu.fail_wait = False
        gpu.runs.clear()
        run_gpu_only(s, fake_tasks(40, seed=2))  # the scheduler stays usable
        s.lane.settle()
        assert sorted(gpu.runs) == list(range(40))
    finally:
        gpu.gate.set()
        s.close()


def test_a_trailing_gpu_only_claim_that_never_ends_times_out_the_next_step_then_breaks_the_lane():
    s, gpu = trailing_scheduler("gpu_only")
    try:
        run_gpu_only(s, fake_tasks(40))
        with pytest.raises(StepTimeoutError, match="trailing GPU claims of the step at layer 0"):
            run_gpu_only(s, fake_tasks(40, seed=1), timeout=0.3)
        with pytest.raises(RuntimeBrokenError, match="still running"):
            run_gpu_only(s, fake_tasks(40, seed=2), timeout=0.3)
        with pytest.raises(RuntimeError, match="still running after 0.2 s .*trailing GPU claims of the step at layer 0"):
            s.close(timeout=0.2)
        gpu.gate.set()
        s.close(timeout=5.0)  # once more: the claims ended, they are retired
        assert s.lane.trailing is None and s.lane.orphan is None and gpu.retired == len(gpu.batches)
    finally:
        gpu.gate.set()
        s.close()


def test_close_waits_for_a_trailing_gpu_only_claim():
    s, gpu = trailing_scheduler("gpu_only")
    try:
        run_gpu_only(s, fake_tasks(40))
        threading.Timer(0.2, gpu.gate.set).start()
        t0 = time.monotonic()
        s.close()  # nothing may read the store after close
        assert time.monotonic() - t0 >= 0.19 and s.lane.trailing is None and gpu.retired == 1
    finally:
        gpu.gate.set()
        s.close()


class _RetiredHandle(_GatedHandle):
    retired = False

    def wait(self):
        nbytes = super().wait()
        self.retired = True
        return nbytes


class RingGpu(TrailingGpu):
    """`TrailingGpu` with an executor's landing ring of `RING` slots: a launch into a slot whose
    previous claim was not retired is the error `GpuUvaExecutor.launch` raises."""

    RING = 1

    def __init__(self):
        super().__init__()
        self.users: list = [None] * self.RING
        self.launched = 0

    def launch(self, plan, start, stop, step):
        slot = self.launched % self.RING
        prev = self.users[slot]
        if prev is not None and not prev.retired:
            raise RuntimeError(f"more than {self.RING} launches in flight")
        h = CountingGpu.launch(self, plan, start, stop, step)
        h = self.users[slot] = _RetiredHandle(h.start, h.end, h.nbytes, self.gate, self)
        self.launched += 1
        return h


def test_a_landing_slot_is_never_reused_before_its_claim_was_retired():
    gpu = RingGpu()
    s = Scheduler(sched_cfg("gpu_only", cpu_workers=2), None, gpu)
    assert s.lane.ring == 1
    try:
        run_gpu_only(s, fake_tasks(20))  # trails, holding the one slot
        threading.Timer(0.2, gpu.gate.set).start()
        t0 = time.monotonic()
        run_gpu_only(s, fake_tasks(20, seed=1))  # may launch only once the first claim is retired
        assert time.monotonic() - t0 >= 0.19 and gpu.launched == 2
    finally:
        gpu.gate.set()
        s.close()


@pytest.mark.parametrize("executor", [GpuUvaExecutor, AsyncTlsExecutor])
def test_the_executors_that_trail_keep_enough_landing_slots(executor):
    """Unretired claims: this step's (at most PIPELINE_DEPTH; a trailing GPU-only step has one) and
    the previous step's trailing ones (as many) -- fewer than the executor's ring of landing slots."""
    assert executor.retire_later
    assert 2 * GpuLane.PIPELINE_DEPTH < executor.RING
