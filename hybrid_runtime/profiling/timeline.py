"""Timeline recorder: what every task, worker and GPU stream did in every decode step.

Hot-path cost is kept to a reference append per step: the decode call hands over the step's
task objects (which the executors and workers already stamped with worker, lane, start, end and
bytes) and its CUDA events. Turning those into arrays -- and CUDA events into host times --
happens later, off the critical path of the step that produced them: when a report asks for
records, and on the decode path `RESOLVE_PER_STEP` of the oldest steps per recorded step once more
than `RESOLVE_LAG` are held, an even cost per step (converting them in batches of hundreds cost one
token in eight a stall of milliseconds). The time spent is itself measured: `recording_s` on the
decode path (`record`), `resolve_s` for the deferred conversion, so reports can show both against
the step time.

Retention is bounded: a timeline keeps the last `max_steps` resolved steps and counts the older
ones it dropped (`dropped_steps`, also in `summary()`), so a runtime that decodes for hours with
profiling on holds a fixed amount of memory, and a report says when it covers only the tail.

Recording can be sampled (`sample_every`): the timeline then records every layer of one decode
token in every `sample_every`, the `sample_offset`-th of each (`wants`, asked by the decode path
before a step), and the other steps run as with profiling off -- no timing events, no per-task
columns, no record. Whole tokens, not every n-th layer-step, so that per-token figures (the host
time between layers, a token's attention summed over its layers) stay whole.

One clock: `time.perf_counter()` seconds. CUDA events are mapped onto it by `CudaClock`, which
pairs one reference event with the host time at which the idle GPU executed it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from gpu_kernels.cuda_driver import elapsed_ms

LANE_CPU = 0
LANE_GPU = 1


class CudaClock:
    """Maps CUDA events to `perf_counter` seconds.

    Calibration records an event on an idle device and brackets it with host timestamps; the
    shortest of a few brackets bounds the error (a few microseconds). The GPU's event timer and
    the host clock run at rates that differ by tens of parts per million (about 25 ppm on the H100
    host: 1.7 ms after a 67 s prefill, longer than a decode step's parts), so each calibration at
    least `RATE_SPAN_S` after the previous one also measures the ratio of the two rates, and
    `to_host` scales elapsed event time by it. The runtime calibrates again at the first decode
    step after a prefill and a timeline when it is cleared.
    """

    RATE_SPAN_S = 1.0

    def __init__(self, device: Any = None):
        import torch

        self._torch = torch
        self.device = device
        self.ref = None
        self.t_ref = 0.0
        self.error_s = float("inf")
        self.rate = 1.0  # host seconds per event-timer second
        self.calibrate()

    def calibrate(self, tries: int = 5) -> None:
        """Take a new reference (synchronises the device); re-measure the rate when the last one is old enough."""
        torch = self._torch
        best = None
        for _ in range(tries):
            torch.cuda.synchronize(self.device)
            ev = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            ev.record()
            ev.synchronize()
            t1 = time.perf_counter()
            if best is None or t1 - t0 < best[2]:
                best = (ev, 0.5 * (t0 + t1), t1 - t0)
        if self.ref is not None and best[1] - self.t_ref >= self.RATE_SPAN_S:
            gpu_s = self.ref.elapsed_time(best[0]) * 1e-3
            if gpu_s > 0:
                self.rate = (best[1] - self.t_ref) / gpu_s
        self.ref, self.t_ref, self.error_s = best[0], best[1], 0.5 * best[2]

    def to_host(self, ev: Any) -> float:
        """Host time of a completed event (floats pass through: host-timed intervals)."""
        if isinstance(ev, float):
            return ev
        # Either kind of event: the GPU lane's native claims record driver events (`DriverEvent`).
        return self.t_ref + elapsed_ms(self.ref, ev) * 1e-3 * self.rate


@dataclass
class StepRecord:
    """One decode step at one layer, resolved to arrays on the host clock."""

    index: int
    layer: int
    batch: int
    placement: str
    t_start: float  # first q available (decode entry, or the q-ready event on the GPU)
    t_end: float  # merged output available
    worker: np.ndarray  # [T] int16, index into Timeline.worker_names
    lane: np.ndarray  # [T] int8, LANE_CPU or LANE_GPU
    seq_id: np.ndarray  # [T] int64
    kv_head: np.ndarray  # [T] int16
    start: np.ndarray  # [T] float64 seconds
    end: np.ndarray  # [T] float64 seconds
    bytes_read: np.ndarray  # [T] int64
    modeled_bytes: np.ndarray  # [T] int64
    overhead: np.ndarray  # [T] float64 seconds of scheduling overhead per task
    gpu_intervals: np.ndarray  # [n, 2] float64, busy intervals of the GPU (any stream)
    gpu_labels: tuple = ()
    has_gpu: bool = False
    t_entry: float = float("nan")  # host time `decode` was called
    t_return: float = float("nan")  # host time `decode` was about to return (the merge may still run)
    # Host milestones inside `decode` (NaN where the step had none): the scheduler took the step
    # (moved later by any wait for an earlier step's trailing CPU tasks, so `t_release - t_scheduled`
    # is its own path), released the CPU workers, returned; the merge was issued.
    t_scheduled: float = float("nan")
    t_release: float = float("nan")
    t_scheduler_return: float = float("nan")
    t_merge_issued: float = float("nan")

    @property
    def attention_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def n_tasks(self) -> int:
        return int(self.worker.shape[0])

    def gpu_busy_s(self) -> float:
        return union_length(self.gpu_intervals, self.t_start, self.t_end)

    def gpu_idle_s(self) -> float | None:
        """GPU idle time inside the attention window (None without a GPU)."""
        if not self.has_gpu:
            return None
        return max(0.0, self.attention_s - self.gpu_busy_s())

    def gpu_idle_ratio(self) -> float | None:
        idle = self.gpu_idle_s()
        if idle is None or self.attention_s <= 0:
            return None
        return idle / self.attention_s


def union_length(intervals: np.ndarray, lo: float, hi: float) -> float:
    """Total length of the union of `[start, end]` intervals clipped to `[lo, hi]`."""
    if len(intervals) == 0 or hi <= lo:
        return 0.0
    iv = np.clip(np.asarray(intervals, dtype=np.float64), lo, hi)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    total = 0.0
    cur_s, cur_e = iv[0]
    for s, e in iv[1:]:
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    return total + (cur_e - cur_s)


@dataclass
class _Pending:
    """A step as recorded on the hot path: references only, nothing converted yet."""

    index: int
    layer: int
    batch: int
    placement: str
    t_entry: float
    ev_entry: Any
    tasks: list
    columns: dict | None  # worker, start, end, bytes, overhead: arrays indexed by task.index
    gpu_events: list  # [(label, start_event_or_time, end_event_or_time)]
    gpu_batches: list  # [(start_event, end_event, [task indices])], one per GPU launch
    t_end_host: float
    ev_end: Any
    has_gpu: bool
    host_marks: tuple  # (t_scheduled, t_release, t_scheduler_return, t_merge_issued), or ()


class TimingEvents:
    """CUDA timing events for a timeline's steps, reused once their steps are resolved.

    The decode path records five timing events per layer-step (entry, window start and end, merge
    start, end); made new each time, each is a Python object plus a driver event created at its
    first record and destroyed when collected, ~5 us of host time a layer on the GPU machine's
    host beyond the record itself. Events handed out by `record` go back to the free list once
    the timeline has read them (`give_back`: only after the step's end event completed, so every
    earlier event of the step has too), and a later step records them again.
    """

    def __init__(self) -> None:
        self._free: list = []
        self._cls = None
        self.made = 0  # events created: bounded by the steps a timeline holds unresolved

    def record(self, stream: Any) -> Any:
        """A timing event recorded on `stream` now."""
        free = self._free
        if free:
            ev = free.pop()
        else:
            if self._cls is None:
                import torch

                class _PooledEvent(torch.cuda.Event):  # marks events this pool may take back
                    pass

                self._cls = _PooledEvent
            ev = self._cls(enable_timing=True)
            self.made += 1
        ev.record(stream)
        return ev

    def give_back(self, events: Sequence[Any]) -> None:
        """Events the caller has finished reading; those this pool made are reused. An event listed
        more than once goes back once (a step's intervals may share one: the merge ends at the end
        event), so that no two later steps are handed the same event."""
        cls = self._cls
        if cls is not None:
            self._free.extend({id(ev): ev for ev in events if type(ev) is cls}.values())


class Timeline:
    """All recorded steps of a runtime. `records` resolves and returns them."""

    # Steps held unconverted before the decode path converts the oldest, `RESOLVE_PER_STEP` per
    # recorded step (bounds the references held; two per step catch up after a blocking read).
    # Far enough behind that their CUDA events have completed and trailing claims retired.
    RESOLVE_LAG = 64
    RESOLVE_PER_STEP = 2
    # Default retention. One step is one layer of one decode call (the quality experiment's 256
    # positions x 30 layers fit); a step of 2-4 tasks measured 2-3 KB resident, so tens of MB.
    MAX_STEPS = 16384

    def __init__(self, worker_names: Sequence[str], worker_lanes: Sequence[int], clock: CudaClock | None = None,
                 enabled: bool = True, max_steps: int = MAX_STEPS, sample_every: int = 1, sample_offset: int = 0):
        for name, value, what in (("max_steps", max_steps, "steps a timeline retains"),
                                  ("sample_every", sample_every, "1 records every decode token, n one in n")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}; expected an integer >= 1 ({what})")
        if isinstance(sample_offset, bool) or not isinstance(sample_offset, int) or not 0 <= sample_offset < sample_every:
            raise ValueError(f"sample_offset is {sample_offset!r}; expected an integer in [0, sample_every = "
                             f"{sample_every}) (which token of each sample_every is recorded)")
        self.worker_names = list(worker_names)
        self.worker_lanes = np.asarray(worker_lanes, dtype=np.int8)
        self.clock = clock
        self.enabled = enabled
        self.max_steps = max_steps
        self.sample_every = sample_every
        self.sample_offset = sample_offset
        # Decode calls per layer since `clear` (`wants`): layer-steps of one token share a count.
        self._layer_calls: dict[int, int] = {}
        self.skipped_steps = 0  # layer-steps left unrecorded by sampling (since `clear`)
        self.dropped_steps = 0  # resolved steps forgotten to stay within max_steps (since `clear`)
        self._pending: deque[_Pending] = deque()
        self._records: deque[StepRecord] = deque(maxlen=max_steps)
        self._next_index = 0
        self.recording_s = 0.0  # host time `record` spent on the decode path
        # Called before pending steps are converted, with `block`: settles work that fills their
        # columns after the step returned (the GPU lane's trailing claims); returns True while
        # the last recorded step still has such work outstanding.
        self.before_resolve: Callable[[bool], bool] | None = None
        # Timing events for the recording side's steps; taken back once their step is converted.
        self.events = TimingEvents()
        self.resolve_s = 0.0  # host time spent converting pending steps into records

    # ------------------------------------------------------------------ hot path
    def wants(self, layer: int) -> bool:
        """Whether the decode step about to run at `layer` is to be recorded; counts the call.
        Each layer is called once per token, so counting per layer samples whole tokens, in
        step with each other: tokens `sample_offset`, `sample_offset + sample_every`, ... after
        `clear`."""
        if not self.enabled:
            return False
        if self.sample_every == 1:
            return True
        calls = self._layer_calls.get(layer, 0)
        self._layer_calls[layer] = calls + 1
        if calls % self.sample_every != self.sample_offset:
            self.skipped_steps += 1
            return False
        return True

    def record(
        self,
        *,
        layer: int,
        batch: int,
        placement: str,
        t_entry: float,
        ev_entry: Any,
        tasks: list,
        columns: dict | None = None,
        gpu_events: list = (),
        gpu_batches: list = (),
        t_end_host: float = 0.0,
        ev_end: Any = None,
        host_marks: tuple = (),
    ) -> None:
        """Keep references to one step; conversion happens later.

        `columns` are the per-task arrays the lanes filled (see `StepJob.columns`); without them
        the fields are read from the task objects at resolution (slower, same result).
        `host_marks`: `(t_scheduled, t_release, t_scheduler_return, t_merge_issued)` host times
        (`StepRecord`; 0 or NaN where the step had none), or empty.
        """
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self._pending.append(
            _Pending(self._next_index, layer, batch, placement, t_entry, ev_entry, tasks, columns, list(gpu_events),
                     list(gpu_batches), t_end_host, ev_end, self.clock is not None, host_marks)
        )
        self._next_index += 1
        t1 = time.perf_counter()
        self.recording_s += t1 - t0
        if len(self._pending) > self.RESOLVE_LAG:
            self._resolve_oldest(self.RESOLVE_PER_STEP)
            self.resolve_s += time.perf_counter() - t1

    # ------------------------------------------------------------------ resolution
    def _resolve(self, block: bool) -> None:
        """Convert every pending step (`block`: waiting for their events), but the last one while
        `before_resolve` says its trailing work is outstanding."""
        pending = self._pending
        outstanding = self.before_resolve is not None and self.before_resolve(block) and bool(pending)
        while len(pending) > outstanding:
            p = pending[0]
            if p.ev_end is not None and not block and not p.ev_end.query():
                break  # events complete in order on a stream: later steps are not ready either
            if p.ev_end is not None and block:
                p.ev_end.synchronize()
            self._convert_oldest()

    def _resolve_oldest(self, limit: int) -> None:
        """Convert up to `limit` of the oldest pending steps whose events have completed; never the
        last one (only that one may still have trailing work, `before_resolve`)."""
        pending = self._pending
        for _ in range(limit):
            if len(pending) < 2 or pending[0].ev_end is not None and not pending[0].ev_end.query():
                return
            self._convert_oldest()

    def _convert_oldest(self) -> None:
        p = self._pending.popleft()
        if len(self._records) == self.max_steps:
            self.dropped_steps += 1  # the deque forgets its oldest record
        self._records.append(self._convert(p))
        self.events.give_back([p.ev_entry, p.ev_end, *(e for _, a, b in p.gpu_events for e in (a, b))])

    def _convert(self, p: _Pending) -> StepRecord:
        clock = self.clock
        to_host = clock.to_host if clock is not None else (lambda x: x)
        tasks = p.tasks
        n = len(tasks)

        def attr(name: str, dtype: Any) -> np.ndarray:
            return np.fromiter((getattr(t, name) for t in tasks), dtype=dtype, count=n)

        if p.columns is not None:
            c = p.columns
            worker = np.asarray(c["worker"], dtype=np.int16)
            start = np.array(c["start"], dtype=np.float64)
            end = np.array(c["end"], dtype=np.float64)
            nbytes = np.asarray(c["bytes"], dtype=np.int64)
            overhead = np.asarray(c["overhead"], dtype=np.float64)
        else:
            worker, start, end = attr("worker", np.int16), attr("start_s", np.float64), attr("end_s", np.float64)
            nbytes, overhead = attr("bytes_read", np.int64), attr("overhead_s", np.float64)
        static = getattr(tasks, "seq_id", None) is not None
        seq_id = np.asarray(tasks.seq_id, dtype=np.int64) if static else attr("seq_id", np.int64)
        kv_head = np.asarray(tasks.kv_head, dtype=np.int16) if static else attr("kv_head", np.int16)
        modeled = np.asarray(tasks.modeled_bytes, dtype=np.int64) if static else attr("modeled_bytes", np.int64)
        gpu_iv = [(to_host(a), to_host(b)) for _, a, b in p.gpu_events]
        labels = [lbl for lbl, _, _ in p.gpu_events]
        for e0, e1, idx in p.gpu_batches:
            if isinstance(e0, float):
                continue  # a synchronous executor timed its tasks itself
            # Tasks of one launch run together on the device: each gets the launch's interval.
            t0, t1 = to_host(e0), to_host(e1)
            start[idx], end[idx] = t0, t1
            if p.has_gpu:
                gpu_iv.append((t0, t1))
                labels.append("sparse")
        lane = self.worker_lanes[worker] if n else np.zeros(0, np.int8)
        t_start = p.t_entry
        if p.ev_entry is not None:
            # The step starts when both the host called decode and the GPU produced q.
            t_start = max(t_start, to_host(p.ev_entry))
        t_end = to_host(p.ev_end) if p.ev_end is not None else p.t_end_host
        nan = float("nan")
        marks = [m if m > 0.0 else nan for m in p.host_marks] if len(p.host_marks) == 4 else [nan] * 4
        return StepRecord(
            index=p.index,
            layer=p.layer,
            batch=p.batch,
            placement=p.placement,
            t_start=t_start,
            t_end=t_end,
            worker=worker,
            lane=lane,
            seq_id=seq_id,
            kv_head=kv_head,
            start=start,
            end=end,
            bytes_read=nbytes,
            modeled_bytes=modeled,
            overhead=overhead,
            gpu_intervals=np.asarray(gpu_iv, dtype=np.float64).reshape(-1, 2),
            gpu_labels=tuple(labels),
            has_gpu=p.has_gpu,
            t_entry=p.t_entry,
            t_return=p.t_end_host,
            t_scheduled=marks[0],
            t_release=marks[1],
            t_scheduler_return=marks[2],
            t_merge_issued=marks[3],
        )

    @property
    def records(self) -> list[StepRecord]:
        """The last `max_steps` recorded steps, oldest first, resolved (waits for outstanding GPU events)."""
        t0 = time.perf_counter()
        self._resolve(block=True)
        self.resolve_s += time.perf_counter() - t0
        return list(self._records)  # a copy: later steps do not change a list handed out

    def clear(self) -> None:
        """Forget every record (and re-sync the CUDA clock)."""
        self._resolve(block=True)
        self._records.clear()
        self.dropped_steps = 0
        self.skipped_steps = 0
        self._layer_calls = {}
        self.recording_s = 0.0
        self.resolve_s = 0.0
        if self.clock is not None:
            self.clock.calibrate()

    def __len__(self) -> int:
        """Steps `records` returns now (at most `max_steps`)."""
        return min(len(self._records) + len(self._pending), self.max_steps)

    @property
    def recorded_steps(self) -> int:
        """Steps recorded since the last `clear`, retained or dropped."""
        return len(self._records) + len(self._pending) + self.dropped_steps

    # ------------------------------------------------------------------ reports
    @property
    def has_gpu_lane(self) -> bool:
        """Whether one of the timeline's workers is a GPU lane."""
        return bool((self.worker_lanes == LANE_GPU).any())

    def summary(self) -> dict:
        from hybrid_runtime.profiling.analysis import summarize

        summary = summarize(self)  # over the retained steps; resolves first, so the count below is final
        summary["dropped_steps"] = self.dropped_steps
        summary["sample_every"] = self.sample_every
        summary["sample_offset"] = self.sample_offset
        summary["skipped_steps"] = self.skipped_steps
        return summary

    def chrome_trace(self) -> dict:
        from hybrid_runtime.profiling.chrome_trace import chrome_trace

        return chrome_trace(self)

    def write_summary(self, path: str) -> None:
        import json

        with open(path, "w") as f:
            json.dump(self.summary(), f, indent=1)

    def write_chrome_trace(self, path: str) -> None:
        import json

        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
