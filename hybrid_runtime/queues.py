"""The step's priority queue as native CPU workers see it, and a status line for any queue.

With native CPU workers the queue lives in shared memory (`native_pool`): workers pop positions
with an atomic compare-and-swap inside their numba loop, without the GIL, while the GPU lane
claims ranges of positions from the same control word -- so the fluxion placement's two devices still
pull from one queue. Python workers use `tasks.TaskQueue` instead; both serve the GPU lane
through the same interface.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hybrid_runtime import native_pool as native


class NativeQueue:
    """The step's priority queue in shared memory, popped by native CPU workers without the GIL.

    Same interface as `TaskQueue` for the GPU lane (`claim`, `finish`, `remaining_bytes`,
    `close`, `done`), which claims ranges of positions from the same control word.
    """

    def __init__(self, pool: "Any", ordered: list, table: tuple, order: np.ndarray | None = None):
        self.pool = pool
        self.tasks = ordered
        self.order = order  # position in the queue -> index in the tasks it was made from
        self.rows: np.ndarray | None = None  # position -> row of the step's task list (StepJob.queue_rows)
        self.tab, self.nsel, self.chunks, self._cum = table
        self.total = len(ordered)
        self.job = -1
        self.reserved = 0  # head positions taken by the GPU lane before publishing
        # Published with PICKS: workers attend each position from the GPU lane's selection
        # (`hybrid_runtime.gpu_picks`), which the GPU lane must then launch or refuse for every
        # position from `reserved` on.
        self.picks = False
        self.pick_at_ns = 0  # when the selection is expected to land (monotonic ns)
        self.pick_ns_per_block = 0  # a worker's modeled time to score one block itself
        # Published before q is on the host: workers wait for the device's word (native_pool, "Starting
        # on the device's word"), which the caller's stream writes after q's copy.
        self.q_gate = False
        self.gpu_done = 0
        self.released = 0  # never-started positions added to DONE to end a device-side wait
        self.closed_at: int | None = None
        self._close_lock = threading.Lock()

    def publish(self, layer: int, batch: int) -> None:
        buf = self.pool
        t, c = self.total, len(self.chunks)
        buf.tab[:t] = self.tab
        buf.nsel[:t] = self.nsel
        buf.chunks[:c] = self.chunks
        buf.rec[:t] = 0
        buf.rec[:t, native.R_WORKER] = -1
        self.job = native.publish(buf.ctrl, layer, batch, t, self.reserved, int(self.picks), int(self.pick_at_ns),
                                  int(self.pick_ns_per_block), int(self.q_gate))

    def meta_blocks(self) -> int:
        """Blocks whose metadata the queue's tasks score (at each task's block size)."""
        tab = self.tab
        blk = tab[:, native.T_BLOCK]
        return int(((tab[:, native.T_CPULEN] + blk - 1) // np.maximum(blk, 1)).sum())

    def next_job(self) -> int:
        """The job id `publish` will give this queue (the host publishes one job at a time)."""
        return (int(self.pool.ctrl[native.C_SEQ]) + 2) >> 1

    def __len__(self) -> int:
        return self.total - native.head(self.pool.ctrl, self.job, self.total)

    @property
    def remaining_bytes(self) -> float:
        if self.job < 0:  # not published yet
            return float(self._cum[self.total] - self._cum[self.reserved])
        h = native.head(self.pool.ctrl, self.job, self.total)
        return float(self._cum[self.total] - self._cum[h])

    @property
    def cum_bytes(self) -> np.ndarray:
        """Modeled bytes of the first i positions, i = 0..total (read only)."""
        return self._cum

    @property
    def total_bytes(self) -> float:
        """Modeled bytes of every task of the step's queue."""
        return float(self._cum[self.total])

    def reserve_head(self, positions: int) -> tuple[int, int]:
        """Before `publish`: take head positions `[0, positions)` (at least one) for the GPU lane,
        so its first claim is made before any CPU worker pops."""
        if self.job >= 0:
            raise RuntimeError("reserve_head after publish: the CPU workers may already hold the head")
        self.reserved = min(max(1, positions), self.total)
        return 0, self.reserved

    def claim_range(self, max_bytes: float) -> tuple[int, int]:
        """Queue positions `[i, j)` whose modeled bytes fit `max_bytes` (at least one; empty when
        nothing is left), taken from the same atomic word the CPU workers pop."""
        h = native.head(self.pool.ctrl, self.job, self.total)
        if h >= self.total:
            return h, h
        j = int(np.searchsorted(self._cum, self._cum[h] + max_bytes, side="right")) - 1
        k = max(1, j - h)
        start = native.claim(self.pool.ctrl, self.job, k, self.total)
        if start < 0:
            return self.total, self.total
        return start, start + min(k, self.total - start)

    def claim(self, max_bytes: float) -> list:
        i, j = self.claim_range(max_bytes)
        return self.tasks[i:j]

    def range_bytes(self, i: int, j: int) -> float:
        """Modeled bytes of queue positions `[i, j)`."""
        return float(self._cum[j] - self._cum[i])

    def finish(self, n: int = 1) -> None:
        self.gpu_done += n

    def finished(self) -> int:
        if self.job < 0:  # never published: only the GPU lane's reserved head ran
            return self.gpu_done
        return int(native.done(self.pool.ctrl)) + self.gpu_done - self.released

    def release_unstarted(self) -> None:
        """After `close`: count the positions no lane will run into the done word, so that a
        device-side wait for the CPU lane's count (`gpu_kernels.host_count_wait`) ends once the
        tasks still running end; `finished` leaves them out."""
        if self.closed_at is None or self.job < 0 or self.released:
            return
        self.released = self.total - self.closed_at
        native.add_done(self.pool.ctrl, self.released)

    def close(self) -> int:
        with self._close_lock:
            if self.closed_at is None and self.job < 0:
                self.closed_at = self.reserved  # the step failed before the CPU workers saw it
            elif self.closed_at is None:
                self.closed_at = int(native.close(self.pool.ctrl, self.job, self.total))
            return self.total - self.closed_at

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def done(self) -> bool:
        target = self.total if self.closed_at is None else self.closed_at
        return self.finished() >= target

    @property
    def in_flight(self) -> int:
        handed = native.head(self.pool.ctrl, self.job, self.total) if self.closed_at is None else self.closed_at
        return handed - self.finished()

    def describe(self) -> str:
        return f"{self.finished()}/{self.total} finished, {self.in_flight} running, {len(self)} waiting"


def describe_queue(q: Any) -> str:
    """Progress of a `NativeQueue` or `TaskQueue`, for timeout messages."""
    if isinstance(q, NativeQueue):
        return q.describe()
    return f"{q.finished}/{q.total} finished, {q.in_flight} running, {len(q)} waiting"


__all__ = ["NativeQueue", "describe_queue"]
