"""A GPU-only decode layer-step -- window, claim, merge, and the claim's lagged copy -- replayed from
one CUDA graph (the express path's second form, `HybridRuntime._decode_express`).

On the express path a GPU-only AsyncTLS step still launches five things from the host -- the
window graph, the claim graph and its counts' copy, the lagged copy's graph, the merge -- with
their events and stream switches: ~0.2 ms of a ~0.33 ms call on a fast H200 lease, twice that on a
slow one, where the step is then bound by its host (benchmarks/notes/asynctls.md section 14).
Here they are captured once per (layer, batch size, task set, caller's k/v addresses, mode) and
replayed as one graph on the executor's stream:

    window branch:  append, window attention (the window graph's kernels, its pinned index rows)
    main:           claim (selection, attention, cache update) -> counts into a pinned slot, the
                    blocks to copy into buffers of the graph's own -> [join window] -> merge into
                    the graph's output -> `merged` (an external event)

The caller's stream waits on `merged`, an event recorded inside the graph
(`torch.cuda.Event(external=True)`). The lagged copy of the missed blocks is a second, small graph
replayed on the executor's copy stream after this one (`executor.replayed`), as on the express path:
inside the step's graph, joined at its end, it held the next layer's graph -- which replays on the
same stream -- until it ended, and put itself back on the step's chain (0.79 against 0.64 ms a
layer at 8 x 32K on the H200, benchmarks/notes/asynctls.md section 14).

What stays on the host per call: the step-inputs kernel (its deferred input check takes a ring row
per call), the window's index rows (`WindowGraphs.prepared`), the two replays, their events, the
wait, a copy of the output. Each graph has its own pinned counts slot: a replay first retires the previous
replay's claim if it is still unretired (it read that slot). A task set is captured at its second
step (its first runs the express path's launches); a spill makes a new task set, so its graphs
are captured again. Graphs are dropped least recently used past `max_graphs`, and with the window
entry they captured when that one is dropped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from gpu_kernels.streams import use_stream

log = logging.getLogger(__name__)


@dataclass
class _StepGraph:
    graph: torch.cuda.CUDAGraph
    window: Any  # the window graphs' entry whose buffers and rows it reads
    packed: Any  # the task set's table (kept: the key holds its id)
    out: torch.Tensor  # [B, Hq, D] in the caller's dtype: the merge's output
    merged: torch.cuda.Event  # external: recorded inside the graph after the merge
    slot: int  # its row of the pinned counts slots
    counts: torch.Tensor  # [3, T] pinned view: the claim's counts, written by each replay
    last: Any = None  # the handle of the previous replay (its counts live in `counts`)
    # Lagged: the copy of the missed blocks, a graph of its own on the executor's copy stream replayed
    # after this one (`executor.replayed`), and the buffers it reads (this graph writes them).
    copy: Any = None
    blocks: tuple | None = None


class StepGraphs:
    """CUDA graphs of whole GPU-only layer-steps over one executor that can capture its claim
    (`capture_claim`); the least recently used dropped past `max_graphs`."""

    def __init__(self, window_graphs: Any, merge: Any, device: torch.device, max_graphs: int, max_tasks: int):
        self.window_graphs = window_graphs
        self.merge = merge
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _StepGraph] = OrderedDict()
        self._seen: set = set()  # keys stepped once (captured at the second step)
        # Pinned once here (decode allocates no pinned memory).
        cuda = device.type == "cuda"
        # Flat rows: a slot's `[3, T]` view is contiguous whatever T (a copy into a strided pinned view
        # would go through a host-side copy, which a capture cannot hold).
        self._counts = torch.zeros((max_graphs, 3 * max(1, max_tasks)), dtype=torch.int64, pin_memory=cuda)
        self._free = list(range(max_graphs))
        self._window_stream = torch.cuda.Stream(device) if cuda else None  # the window branch while capturing
        self.captures = 0
        self.replays = 0
        self.capture_error: str | None = None  # after a failed capture, no more graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def key(self, layer: int, b: int, packed: Any, kv_src: tuple | None, dtype: torch.dtype, mode: tuple) -> tuple:
        return (layer, b, id(packed), kv_src, dtype, mode)

    def wants(self, key: tuple, layer: int, b: int) -> bool:
        """Whether this step goes through a graph (replayed, or captured now): its key was stepped
        before and the window graphs hold a captured entry for (layer, b). The first step of a key
        only marks it (it runs the express path's launches, which warm every kernel up)."""
        if self.capture_error is not None:
            return False
        entry = self._graphs.get(key)
        window = self.window_graphs.entry(layer, b)
        if window is None or window.graph is None:
            return False
        if entry is not None:
            if entry.window is window:
                return True
            self._drop(key)  # its window entry was dropped, and its buffers went to another
        if key in self._seen:
            return True
        if len(self._seen) > 64 * self.max_graphs:
            self._seen.clear()
        self._seen.add(key)
        return False

    def run(self, key: tuple, executor: Any, plan: Any, step: Any, window: Any, qs: torch.Tensor,
            kv: tuple | None, stream: torch.cuda.Stream, n_tasks: int, out_dtype: torch.dtype) -> tuple | None:
        """Replay (capturing first if needed) the step's graph on `stream` (the executor's, current on
        return as before) after the caller's stream has been made to precede it; returns (output the
        caller must copy before the next replay of this key, the `merged` event to wait on, the
        entry), or None when the capture failed (nothing launched; the caller launches the same
        work itself)."""
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, executor, plan, step, window, qs, kv, stream, n_tasks, out_dtype)
            if entry is None:
                return None
        else:
            self._graphs.move_to_end(key)
        if entry.last is not None and entry.last.bytes_read is None:
            entry.last.wait()  # its counts are in the slot this replay rewrites
        with use_stream(stream):
            entry.graph.replay()
        self.replays += 1
        return entry

    def _capture(self, key: tuple, executor: Any, plan: Any, step: Any, window: Any, qs: torch.Tensor,
                 kv: tuple | None, stream: torch.cuda.Stream, n_tasks: int, out_dtype: torch.dtype) -> _StepGraph | None:
        if not self._free:
            old_key = next(iter(self._graphs))
            self._drop(old_key)
        slot = self._free.pop()
        counts = self._counts[slot, : 3 * n_tasks].view(3, n_tasks)
        dev = window.out.device
        out = torch.empty(tuple(window.out.shape), dtype=out_dtype, device=dev)
        # The lagged copy's inputs, made outside the capture's pool (the copy reads them after this
        # graph ended, while the next one -- another layer's, on the same pool -- may run).
        width = n_tasks * executor.block_capacity()
        flat = (torch.full((width,), -1, dtype=torch.int64, device=dev), torch.full((width,), -1, dtype=torch.int64, device=dev))
        side = self._window_stream
        blocks = copy = None
        try:
            merged = torch.cuda.Event(external=True)
            graph = torch.cuda.CUDAGraph()
            with use_stream(stream):
                graph.capture_begin(pool=executor._pool, capture_error_mode="thread_local")
                try:
                    side.wait_stream(stream)
                    with use_stream(side, stream):
                        k, v = kv if kv is not None else (None, None)
                        self.window_graphs.kernels(plan.layer, window, qs, k, v)
                    chosen = executor.capture_claim(plan, step, counts)
                    if chosen is not None:
                        r, width_k = chosen[0].shape
                        blocks = tuple(buf[: r * width_k].view(r, width_k) for buf in flat)
                        for buf, value in zip(blocks, chosen):
                            buf.copy_(value)
                    stream.wait_stream(side)
                    self.merge(window.out, window.lse, step.out, step.lse, out=out, lse=window.lse, validate=False)
                    merged.record(stream)
                finally:
                    graph.capture_end()
            if blocks is not None:
                copy = executor.capture_copy(plan, *blocks)
        except Exception as exc:  # noqa: BLE001 - any capture failure: the express path's launches from now on
            self.capture_error = f"{type(exc).__name__}: {exc}"
            self._free.append(slot)
            log.warning("step graphs: capturing a GPU-only step failed (%s); steps launch their parts separately", exc)
            return None
        entry = self._graphs[key] = _StepGraph(graph, window, plan.plan, out, merged, slot, counts, copy=copy,
                                               blocks=blocks)
        self._seen.discard(key)
        self.captures += 1
        return entry

    def _drop(self, key: tuple) -> None:
        entry = self._graphs.pop(key)
        if entry.last is not None and entry.last.bytes_read is None:
            entry.last.wait()  # its counts slot goes to another graph
        self._free.append(entry.slot)

    def clear(self) -> None:
        """Drop every graph (their claims retired first: each read its slot)."""
        for key in list(self._graphs):
            self._drop(key)
        self._seen.clear()


__all__ = ["StepGraphs"]
