"""The express path's claims (hybrid_runtime/express_claims.py) and the GPU lane's hooks for them,
on fake launches: retirement in launch order, room for the next claim, a stalled claim's timeout
and the broken lane after it, failures raised with the step they belong to. The express path of
`decode` itself runs on CUDA only (tests/test_asynctls.py, `gpu` marker)."""

from __future__ import annotations

import threading
import time

import pytest

from hybrid_runtime.express_claims import ExpressClaims
from hybrid_runtime.gpu_lane import GpuLane
from hybrid_runtime.lane_rates import LaneRates
from hybrid_runtime.scheduler import Scheduler
from hybrid_runtime.step_job import RuntimeBrokenError, StepJob, StepTimeoutError
from tests.test_scheduler import TrailingGpu, _GatedHandle, fake_tasks, sched_cfg


class FakeLaunch:
    def __init__(self, n: int):
        self.n = n
        self.ended = False
        self.waited = 0
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self.ended

    def wait(self):
        self.waited += 1
        if self.error is not None:
            raise self.error
        return [self.n]


class FakeExecutor:
    claims_whole_queue = True
    retire_later = True
    RING = 4
    stream = None

    def __init__(self):
        self.launches: list[FakeLaunch] = []
        self.calls: list[tuple] = []

    def launch(self, plan, start, stop, step):
        self.calls.append((plan, start, stop, step))
        handle = FakeLaunch(stop - start)
        self.launches.append(handle)
        return handle


def lane(executor=None) -> GpuLane:
    return GpuLane(executor or FakeExecutor(), rates=LaneRates(), n_cpu=0, worker_id=0, poll_sleep=1e-4,
                   wait_on_cpu_queue=False)


def test_claims_retire_in_launch_order_as_they_end():
    ex = FakeExecutor()
    express = ExpressClaims(ex, depth=3, poll_sleep=0.0)
    a = express.launch("plan a", 5, "step a", layer=0)
    b = express.launch("plan b", 7, "step b", layer=1)
    assert ex.calls == [("plan a", 0, 5, "step a"), ("plan b", 0, 7, "step b")]
    b.ended = True
    express.retire()  # the oldest has not ended: nothing retires past it
    assert len(express) == 2 and b.waited == 0
    a.ended = True
    express.retire()
    assert len(express) == 0 and (a.waited, b.waited) == (1, 1) and express.retired == 2


def test_room_is_made_by_waiting_for_the_oldest_claim():
    ex = FakeExecutor()
    express = ExpressClaims(ex, depth=2, poll_sleep=1e-4)
    a = express.launch("p", 1, "s", layer=0)
    b = express.launch("p", 1, "s", layer=1)
    b.ended = True
    timer = threading.Timer(0.02, lambda: setattr(a, "ended", True))
    timer.start()
    t0 = time.monotonic()
    express.make_room(timeout=1.0, layer=2)  # full, its head still running: waits for it
    timer.join()
    assert time.monotonic() - t0 >= 0.015 and express.waits == 1
    assert len(express) == 0 and (a.waited, b.waited) == (1, 1)
    express.launch("p", 1, "s", layer=2)
    express.make_room(timeout=1.0, layer=3)  # room left: no wait
    assert express.waits == 1 and len(express) == 1


def test_a_stalled_claim_times_out_the_waiting_step_then_breaks_the_runtime():
    express = ExpressClaims(FakeExecutor(), depth=1, poll_sleep=1e-4)
    stuck = express.launch("p", 3, "s", layer=4)
    with pytest.raises(StepTimeoutError, match=r"step at layer 5 .*express step at layer 4 \(3 tasks\).*nothing of "
                                               r"this step was launched"):
        express.make_room(timeout=0.02, layer=5)
    assert len(express) == 1  # still there: the next step waits for it again
    time.sleep(0.03)
    with pytest.raises(RuntimeBrokenError, match="express step at layer 4"):
        express.make_room(timeout=0.02, layer=5)
    stuck.ended = True
    express.make_room(timeout=0.02, layer=5)  # it ended after all: retired, room again
    assert len(express) == 0


def test_a_failed_claim_is_raised_by_the_call_that_retires_it_naming_its_step():
    express = ExpressClaims(FakeExecutor(), depth=3, poll_sleep=0.0)
    bad = express.launch("p", 2, "s", layer=6)
    bad.error, bad.ended = RuntimeError("kernel fault"), True
    with pytest.raises(RuntimeError, match="kernel fault") as info:
        express.retire()
    assert any("express step at layer 6" in note for note in info.value.__notes__)
    assert len(express) == 0


def test_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one claim"):
        ExpressClaims(FakeExecutor(), depth=0, poll_sleep=0.0)


def test_the_lane_keeps_express_claims_for_whole_queue_executors_that_retire_later():
    gl = lane()
    assert gl.express is not None and gl.express.depth == FakeExecutor.RING - 1

    class Waits(FakeExecutor):
        retire_later = False

    assert lane(Waits()).express is None


def test_the_lane_settles_describes_and_counts_express_claims():
    gl = lane()
    a = gl.express.launch("p", 2, "s", layer=0)
    b = gl.express.launch("p", 2, "s", layer=1)
    assert "express GPU claims still running: layer 0 (2 tasks), layer 1 (2 tasks)" in gl.describe_unfinished()
    assert gl._ring_full(1) is False and gl._ring_full(2) is True  # two express claims hold landing slots
    assert gl.settle(block=False) is True and not gl.orphan_done()
    a.ended = b.ended = True
    assert gl.orphan_done() and len(gl.express) == 0
    assert gl.settle(block=False) is False and gl.describe_unfinished() == "nothing"


def test_a_general_step_first_retires_express_claims_and_a_stall_breaks_the_lane():
    gl = lane()
    gl.express.launch("p", 2, "s", layer=0)
    with pytest.raises(StepTimeoutError, match="step at layer 1"):
        gl.settle_express(0.01, layer=1)
    time.sleep(0.03)
    with pytest.raises(RuntimeBrokenError):
        gl.settle_express(0.01, layer=1)
    assert gl.broken is not None and "express step at layer 0" in gl.broken
    with pytest.raises(RuntimeBrokenError):
        gl.await_orphan(1.0)  # every later step of the general path refuses too


# ---------------------------------------------------------------------------- the scheduler's hook
class WholeQueueGpu(TrailingGpu):
    """A trailing GPU executor double that runs a whole queue as one claim (as AsyncTLS does)."""

    claims_whole_queue = True
    RING = 4


def whole_queue_scheduler():
    gpu = WholeQueueGpu()
    return Scheduler(sched_cfg("gpu_only", cpu_workers=2), None, gpu), gpu


def test_the_scheduler_hands_out_express_claims_only_where_nothing_else_applies():
    s, gpu = whole_queue_scheduler()
    try:
        assert s.lane.express is not None and s.lane.express.depth == WholeQueueGpu.RING - 1
        assert s.express_claims(0, fake_tasks(8)) is None  # a plain list keeps no table: the general path
        s.lane.broken = "broken for the test"
        with pytest.raises(RuntimeBrokenError, match="broken for the test"):
            s.express_claims(0, fake_tasks(8))
        s.lane.broken = None
    finally:
        gpu.gate.set()
        s.close()
    assert s.express_claims(0, fake_tasks(8)) is None  # closed
    plain = Scheduler(sched_cfg("gpu_only", cpu_workers=2), None, TrailingGpu())
    try:
        assert plain.lane.express is None and plain.express_claims(0, fake_tasks(8)) is None
    finally:
        plain.close()


def test_a_general_step_retires_express_claims_first_and_close_waits_for_them():
    s, gpu = whole_queue_scheduler()
    try:
        express = s.lane.express
        handle = express.launch(fake_tasks(1), 1, None, layer=3)  # as `_decode_express` launches
        assert isinstance(handle, _GatedHandle) and len(express) == 1
        threading.Timer(0.05, gpu.gate.set).start()
        job = StepJob(0, fake_tasks(20), cpu_arrays=(None, None, None))
        s.run(job, gpu_trails=True)  # waits for the express claim before anything of its own
        assert len(express) == 0 and express.retired == 1 and gpu.retired >= 1
    finally:
        gpu.gate.set()
        s.close()
    s2, gpu2 = whole_queue_scheduler()
    s2.lane.express.launch(fake_tasks(1), 1, None, layer=0)
    with pytest.raises(RuntimeError, match="express GPU claims still running: layer 0"):
        s2.close(timeout=0.05)
    gpu2.gate.set()
    s2.close()  # again, once it ended
    assert len(s2.lane.express) == 0
