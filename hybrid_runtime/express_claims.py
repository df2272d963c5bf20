"""The claims of GPU-only steps taken on the express path: launched, left on the device, retired in order.

A step without CPU tasks whose executor runs a whole queue as one claim and may retire it later
(`claims_whole_queue`, `retire_later`: the AsyncTLS executor) has nothing to schedule: no split, no
claim sizes, no shared queue, nothing for the lane models to learn. The general path still pays
for all of that machinery on the host -- a `StepJob`, a `TaskQueue`, the GPU lane's loop,
a retirement that feeds the models -- about 0.4 ms of a ~1.1 ms layer-step on the H200 machine's
slower leases (benchmarks/notes/asynctls.md section 13), while the GPU needs ~0.6 ms for the
step's work. The runtime's express path (`HybridRuntime.decode`) launches such a step's claim here
instead: one `launch` on the executor's prepared table, the handle kept in a FIFO.

Claims are retired (their counts read into the executor's accounting) in launch order, as they
end, at later steps' entries; up to `depth` of them stay unretired, so the host may run that many
layer-steps ahead of the GPU (the executor's landing ring bounds it: `RING` slots). A claim that
does not end within `scheduler.step_timeout_s` fails the step that waits for room with
`StepTimeoutError` (that step launched nothing); still running a whole timeout later, it breaks
the runtime (`RuntimeBrokenError`, as a stuck task of the general path does). A claim that failed
raises its error at the call that retires it, naming the step it belonged to.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from hybrid_runtime.step_job import RuntimeBrokenError, StepTimeoutError


class ExpressClaims:
    """The FIFO of express claims not yet retired, over one GPU launch executor."""

    def __init__(self, executor: Any, depth: int, poll_sleep: float):
        if depth < 1:
            raise ValueError(f"depth {depth}: at least one claim must be allowed in flight")
        self.executor = executor
        self.depth = depth
        self.poll_sleep = poll_sleep
        # (handle, layer, number of tasks) in launch order.
        self.pending: deque = deque()
        self.launched = 0
        self.retired = 0
        self.waits = 0  # times a step found no room and waited for the oldest claim
        # The claim a step timed out waiting for, and when the wait for it began (monotonic seconds).
        self._stalled: tuple | None = None

    def __len__(self) -> int:
        return len(self.pending)

    def launch(self, plan: Any, n_tasks: int, step: Any, layer: int) -> Any:
        """Queue the step's whole table as one claim; returns its handle (start and end events)."""
        handle = self.executor.launch(plan, 0, n_tasks, step)
        self.push(handle, layer, n_tasks)
        return handle

    def push(self, handle: Any, layer: int, n_tasks: int) -> None:
        """A claim the caller launched itself (replayed inside a graph of its step: step_graphs.py)."""
        self.pending.append((handle, layer, n_tasks))
        self.launched += 1

    def retire(self, block: bool = False, timeout: float | None = None, waiting_layer: int | None = None) -> None:
        """Retire claims from the oldest on: those that have ended, or every one with `block`
        (waiting at most `timeout` seconds for each; None: no limit). Raises a retired claim's
        failure, and `StepTimeoutError` for the step at `waiting_layer` when the oldest did not end
        in time (nothing is retired past it)."""
        pending = self.pending
        while pending:
            handle, layer, n = pending[0]
            if not handle.query():
                if not block:
                    return
                self._wait(handle, layer, n, timeout, waiting_layer)
            pending.popleft()
            self._stalled = None
            self.retired += 1
            try:
                handle.wait()
            except BaseException as exc:
                exc.add_note(f"raised by the GPU claim of the express step at layer {layer} ({n} tasks), after that "
                             "step had returned; its output may hold the failed claim's part")
                raise

    def make_room(self, timeout: float, layer: int) -> None:
        """Before a step launches: retire what has ended, then wait (at most `timeout`) until fewer
        than `depth` claims are in flight."""
        self.retire(block=False)
        while len(self.pending) >= self.depth:
            self.waits += 1
            handle, old_layer, n = self.pending[0]
            self._wait(handle, old_layer, n, timeout, layer)
            self.retire(block=False)

    def _wait(self, handle: Any, layer: int, n: int, timeout: float | None, waiting_layer: int | None) -> None:
        now = time.monotonic()
        if self._stalled is not None and self._stalled[0] is handle:
            if timeout is not None and now - self._stalled[1] > 2 * timeout:
                raise RuntimeBrokenError(self._broken_message(layer, n, now - self._stalled[1]))
        else:
            self._stalled = (handle, now)
        end = None if timeout is None else now + timeout
        while not handle.query():
            if end is not None and time.monotonic() > end:
                waited = time.monotonic() - self._stalled[1]
                if waited > 2 * timeout:
                    raise RuntimeBrokenError(self._broken_message(layer, n, waited))
                where = f"decode step at layer {waiting_layer}" if waiting_layer is not None else "a wait"
                raise StepTimeoutError(
                    f"{where} did not finish within scheduler.step_timeout_s={timeout:g} s: the GPU claim of the "
                    f"express step at layer {layer} ({n} tasks) is still running; nothing of this step was launched")
            if self.poll_sleep:
                time.sleep(self.poll_sleep)

    @staticmethod
    def _broken_message(layer: int, n: int, waited: float) -> str:
        return (f"the runtime is broken: the GPU claim of an express step at layer {layer} ({n} tasks) is still "
                f"running {waited:.1f} s after a step first waited for it (twice scheduler.step_timeout_s) and cannot "
                "be interrupted; close the runtime and build a new one")

    def describe(self) -> str:
        """The claims still running, for timeout and close messages (not for hot paths)."""
        running = [f"layer {layer} ({n} tasks)" for handle, layer, n in self.pending if not handle.query()]
        return f"express GPU claims still running: {', '.join(running)}" if running else ""


__all__ = ["ExpressClaims"]
