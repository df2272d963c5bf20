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

import pytest
import torch

from hybrid_runtime.config import config_from_dict
from hybrid_runtime.executors.asynctls import AsyncTlsExecutor
from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
from hybrid_runtime.gpu_lane import GpuLane
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.scheduler import Scheduler, StepJob, StepTimeoutError
from hybrid_runtime.step_job import RuntimeBrokenError
from tests.helpers import RefClaims
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


# ---------------------------------------------------------------------------- the runtime's side (host)
GEOM = {"layers": 3, "q_heads": 8, "kv_heads": 2, "head_dim": 32}


class GatedRefExecutor(RefClaims):
    """The torch reference executor behind the claim interface, its claims retired later: the
    results are written at launch, but each claim reports itself unfinished until its gate opens
    (what a CUDA claim looks like to the host while it runs): `release` opens every gate so far,
    and with `open` set new claims end at once."""

    device = "gpu"
    retire_later = True
    RING = 8

    def __init__(self, store):
        super().__init__(store)
        self.gates: list[threading.Event] = []
        self.open = False
        self.retired = 0
        self.fail_wait = False
        self.wait_s = 0.0

    def release(self) -> None:
        for gate in self.gates:
            gate.set()

    def launch(self, plan, start, stop, step):
        _, t0, t1, nbytes = self.run_claim(plan, start, stop, step)
        gate = threading.Event()
        if self.open:
            gate.set()
        self.gates.append(gate)
        return _GatedHandle(t0, t1, nbytes, gate, self)


def gpu_only_runtime(executor=GatedRefExecutor, trails: bool = True, timeout: float = 30.0) -> HybridRuntime:
    cfg = config_from_dict({
        "geometry": GEOM,
        # The window on the host on every machine: the double runs on the host, and with a CUDA
        # window the step's claims would be sized by a CUDA lane's model (more than one a step).
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 2048, "max_sequences": 2,
                     "device": "cpu"},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.25},
        "scheduler": {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False,
                      "step_timeout_s": timeout},
    })
    rt = HybridRuntime(cfg, gpu_executor=executor)
    rt.gpu_only_trails = trails  # on only with CUDA; forced here (the double's results exist at launch)
    gen = torch.Generator().manual_seed(0)
    for s in (0, 1):
        for layer in range(GEOM["layers"]):
            rt.prefill(s, layer, torch.randn(300, 2, 32, generator=gen), torch.randn(300, 2, 32, generator=gen))
    return rt


def step_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, 32, generator=gen), torch.randn(2, 2, 32, generator=gen), torch.randn(2, 2, 32, generator=gen)


def test_runtime_gpu_only_steps_trail_below_the_last_layer_and_equal_the_waiting_path():
    last = GEOM["layers"] - 1
    outs = {}
    for trails in (True, False):
        rt = gpu_only_runtime(trails=trails)
        ex = rt.gpu_executor
        try:
            res = []
            for step in range(3):
                for layer in range(GEOM["layers"]):
                    ex.open = not trails or layer == last  # the last layer waits for its claim
                    res.append(rt.decode(layer, [0, 1], *step_inputs(10 * step + layer)))
                    trailing = rt.scheduler.lane.trailing
                    if trails and layer < last:
                        assert trailing is not None and trailing[0].layer == layer  # returned, its claim running
                        assert ex.retired == len(ex.gates) - 1  # every earlier claim retired, this one not
                        ex.release()  # it ends "on the device"; the next step retires it
                    else:
                        assert trailing is None and ex.retired == len(ex.gates)
            outs[trails] = torch.stack(res)
            st = rt.stats()
            assert st["gpu_trailed_steps"] == (6 if trails else 0)
            # Every claim retired once: its bytes counted, its timeline columns written. A trailing
            # step is one claim; a waiting one (the last layer, or trails off) may split its queue
            # as the lane's launch model sizes it (on a CUDA machine: 11 claims for 9 steps seen).
            assert ex.retired == len(ex.gates) >= 9
            assert st["gpu_bytes_read"] == ex.ref.bytes_read > 0
            recs = rt.timeline.records
            assert len(recs) == 9 and all((r.worker == rt.scheduler.gpu_worker_id).all() and (r.bytes_read > 0).all() for r in recs)
        finally:
            ex.release()
            rt.close()
    assert torch.equal(outs[True], outs[False])


def test_runtime_a_trailing_claim_that_fails_is_raised_by_the_next_decode():
    rt = gpu_only_runtime()
    ex = rt.gpu_executor
    try:
        rt.decode(0, [0, 1], *step_inputs(0))
        assert rt.scheduler.lane.trailing is not None
        ex.fail_wait = True
        ex.release()
        with pytest.raises(RuntimeError, match="claim failed on the device") as info:
            rt.decode(1, [0, 1], *step_inputs(1))
        assert any("its step (layer 0) had returned" in n for n in info.value.__notes__)
        ex.fail_wait, ex.open = False, True
        assert torch.isfinite(rt.decode(1, [0, 1], *step_inputs(2))).all()  # the runtime stays usable
    finally:
        ex.release()
        rt.close()


def test_runtime_close_waits_for_a_trailing_claim():
    rt = gpu_only_runtime()
    ex = rt.gpu_executor
    try:
        rt.decode(0, [0, 1], *step_inputs(0))
        assert rt.scheduler.lane.trailing is not None
        threading.Timer(0.2, ex.release).start()
        t0 = time.monotonic()
        rt.close()  # the store's arenas are freed only after the claim that reads them was retired
        assert time.monotonic() - t0 >= 0.19 and ex.retired == len(ex.gates) and rt.store.closed
    finally:
        ex.release()
        rt.close()


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lagged", [True, False])
def test_on_cuda_asynctls_steps_trail_and_equal_the_waiting_path(lagged):
    from tests.test_asynctls import asynctls_config, prefill_random
    from tests.test_asynctls import runtime as asynctls_runtime

    outs, counters = [], []
    for trails in (True, False):
        cfg = asynctls_config(blocks=5, tokens=40, lagged=lagged, kv={"device": "cuda"})
        with asynctls_runtime(cfg, device="cuda") as rt:
            rt.gpu_only_trails = trails
            prefill_random(rt, 0, 900, seed=13)
            gen = torch.Generator().manual_seed(14)
            res = []
            for _ in range(12):
                for layer in range(rt.geometry.layers):
                    q = torch.randn(1, rt.geometry.q_heads, rt.geometry.head_dim, generator=gen)
                    k, v = torch.randn(2, 1, rt.geometry.kv_heads, rt.geometry.head_dim, generator=gen)
                    res.append(rt.decode(layer, [0], q.cuda(), k.cuda(), v.cuda()))
            outs.append(torch.stack(res).cpu())
            st = rt.stats()  # settles: every claim counted
            ex = rt.gpu_executor
            counters.append((ex.bytes_read, ex.blocks_selected, ex.blocks_missed, ex.launches))
            assert (st["gpu_trailed_steps"] == 12) == trails and st["deferred_input_checks"] == 24
            assert rt._input_check.device_checks == 24  # counted by the kernel, not on the host
    assert torch.allclose(outs[0], outs[1], atol=1e-5) and counters[0] == counters[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_uva_gpu_only_steps_trail_and_equal_the_waiting_path():
    from tests.test_deferred_input_check import inputs, make_runtime

    outs, read = [], []
    for trails in (True, False):
        with make_runtime("auto", "gpu_only", device="cuda") as rt:
            rt.gpu_only_trails = trails
            res = [rt.decode(layer, [0, 1], *inputs(10 * step + layer, "cuda"))
                   for step in range(6) for layer in range(rt.geometry.layers)]
            outs.append(torch.stack(res).cpu())
            st = rt.stats()
            read.append(st["gpu_bytes_read"])
            assert (st["gpu_trailed_steps"] == 6) == trails
    # A trailing step is one claim, a waiting one several: a task's split count follows its claim's
    # longest task, so the split-K sums may round differently.
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert read[0] == read[1] > 0
