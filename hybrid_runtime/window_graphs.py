"""The GPU window part of a decode layer-step -- append the step's k, v, attend q over the window --
replayed from one CUDA graph per (layer, batch size).

Eagerly that part is two Triton launches with their Python around them (the index rows, the
split grid, events): ~0.1-0.2 ms of host time a layer-step on the launcher thread, which under
the CPU workers' memory traffic is on the step's critical path (benchmarks/notes/gpu_lane.md,
sections 12-13). A replay is one driver call. What a graph needs fixed, it gets:

* the step's k and v are copied into the graph's own buffers (one copy each, which also converts
  them to the window's dtype), q is read from the runtime's fp32 buffer of scaled queries. A caller
  that hands the same k and v tensors every step (a model's own decode graph writes its outputs in
  place), contiguous and in the window's dtype, gets a second graph once it did so twice in a row:
  that one reads them where they are, and the two copies (~20 us of host time each on the H200
  machine, `benchmarks/diag/decode_host_timers.py`) go. Other tensors take the copies again;
* the append's (slot, row) and the window's (slot, length) live in pinned rows of each graph's
  own that the kernels read through UVA; the host rewrites it only after the graph's previous replay ended
  (an event; in a model it ended a whole model step earlier);
* the window's split grid is sized for the window's full width (the kernel clamps each row to its
  length, so shorter windows only leave programs idle), and its partials live in a workspace of
  the graph's own, grown before the capture.

The first step of a (layer, batch size) runs the two kernels eagerly on the graph's buffers --
compiling any variant that is still missing -- and then captures them (capture records, runs
nothing); later steps replay. Only steps without a spill take this path (a spill moves window
pages into the CPU segment the tasks read, so it comes first and eagerly, `KVStore.append`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from gpu_kernels.streams import capture_graph
from gpu_kernels.uva import uva_view
from gpu_kernels.window_append import append_window
from gpu_kernels.window_attention import WindowWorkspace, window_attention

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    row: int  # its rows in the pinned pools
    # Pinned, read by the kernels through UVA views (the dtypes the warm-up compiled for):
    append_rows: torch.Tensor  # [2, B] int64: slots, the new tokens' window rows
    window_rows: torch.Tensor  # [2, B] int32: slots, window lengths
    append_rows_dev: torch.Tensor
    window_rows_dev: torch.Tensor
    # The host's numpy views of `append_rows` and `window_rows`, made once: each step writes them.
    append_np: np.ndarray  # [2, B]
    window_np: np.ndarray  # [2, B]
    k: torch.Tensor  # [B, Hkv, D] in the window's dtype
    v: torch.Tensor
    out: torch.Tensor  # [B, Hq, D] fp32
    lse: torch.Tensor  # [B, Hq] fp32
    workspace: WindowWorkspace
    done: torch.cuda.Event  # recorded after each replay: the rows are rewritten only after it
    # The graph that reads the caller's k, v in place, and their (address, address); captured once the
    # caller handed the same ones twice in a row (`last_src`).
    direct: torch.cuda.CUDAGraph | None = None
    direct_src: tuple[int, int] | None = None
    last_src: tuple[int, int] | None = None


class WindowGraphs:
    """CUDA graphs of the window part, per (layer, batch size); the least recently used dropped
    past `max_graphs`."""

    def __init__(self, store, q_heads: int, device: torch.device, max_graphs: int):
        self.store = store
        self.q_heads = q_heads
        self.device = device
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        # The graphs' index rows, pinned once here (decode allocates no pinned memory), in the
        # dtypes the warm-up compiled the kernels for.
        s = store.cfg.max_sequences
        self._append_rows = torch.zeros((max_graphs, 2 * s), dtype=torch.int64, pin_memory=True)
        self._window_rows = torch.zeros((max_graphs, 2 * s), dtype=torch.int32, pin_memory=True)
        self._append_rows_dev = uva_view(self._append_rows, device.index)
        self._window_rows_dev = uva_view(self._window_rows, device.index)
        self._free_rows = list(range(max_graphs))
        self._capture_stream = torch.cuda.Stream(device)
        self.captures = 0
        self.direct_captures = 0  # of the captures, graphs that read the caller's k, v in place
        self.replays = 0
        self.capture_error: str | None = None  # after a failed capture, every graph launches eagerly
        self.direct_error: str | None = None  # after a failed capture of a direct graph, k and v are copied

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, layer: int, seq_ids: list[int], qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `k, v` (`[B, Hkv, D]`) to the windows of `seq_ids` at `layer` and attend `qs`
        (`[B, Hq, D]` fp32, pre-scaled, a buffer that stays put between steps) over them, on
        `stream` (the current stream). Returns the graph's own `(out, lse)`, valid until its next
        replay (one step of the same layer and batch size later). No spill may be due."""
        b = len(seq_ids)
        key = (layer, b)
        gr = self._graphs.get(key)
        if gr is not None:
            self._graphs.move_to_end(key)
            gr.done.synchronize()  # long done in practice (a step of this layer ago)
        slots, rows = self.store.advance(layer, seq_ids)
        fresh = gr is None
        if fresh:
            if not self._free_rows:
                _, old = self._graphs.popitem(last=False)  # the least recently used
                old.done.synchronize()  # its last replay read its rows
                self._free_rows.append(old.row)
            gr = self._make(b, self._free_rows.pop())
        self._write_rows(gr, slots, rows)
        # The caller's k, v where a graph may read them in place: the staging buffers' dtype and layout.
        src = (k.data_ptr(), v.data_ptr()) if k.dtype == gr.k.dtype and v.dtype == gr.v.dtype and \
            k.shape == gr.k.shape and v.shape == gr.v.shape and k.is_contiguous() and v.is_contiguous() and \
            k.device == gr.k.device and v.device == gr.v.device else None
        if gr.graph is not None and src is not None and src != gr.direct_src and src == gr.last_src:
            self._capture_direct(layer, gr, qs, k, v, src)
        gr.last_src = src
        if gr.direct is not None and src == gr.direct_src:
            gr.direct.replay()  # k, v read in place: no staging copies
            self.replays += 1
        else:
            gr.k.copy_(k)
            gr.v.copy_(v)
            if fresh:
                self.kernels(layer, gr, qs)  # this step, eagerly: compiles what is missing, sizes the workspace
                if self.capture_error is None:
                    self._capture(layer, gr, qs)
                self._graphs[key] = gr
            elif gr.graph is None:
                self.kernels(layer, gr, qs)  # capture failed once: launched kernel by kernel
            else:
                gr.graph.replay()
                self.replays += 1
        gr.done.record(stream)
        return gr.out, gr.lse

    def prepared(self, layer: int, seq_ids: list[int]) -> _Graph | None:
        """For a caller that captures the window kernels into a graph of its own (step_graphs.py):
        the (layer, batch size) entry with this step's append and window rows written and the store
        advanced, as `run` leaves them before its replay; None, with nothing changed, while the
        entry has no captured graph of its own (its first step sizes the workspace and captures).
        The caller launches the kernels (`kernels`) and records `done` after them."""
        key = (layer, len(seq_ids))
        gr = self._graphs.get(key)
        if gr is None or gr.graph is None:
            return None
        self._graphs.move_to_end(key)
        gr.done.synchronize()  # its rows were read (a step of this layer ago)
        self._write_rows(gr, *self.store.advance(layer, seq_ids))
        return gr

    @staticmethod
    def _write_rows(gr: _Graph, slots, rows) -> None:
        """This step's rows into `gr`'s pinned ones: the append's (slot, the new token's window row)
        and the window's (slot, length)."""
        gr.append_np[0], gr.append_np[1] = slots, rows
        gr.window_np[0], gr.window_np[1] = slots, rows
        gr.window_np[1] += 1  # the window's length: the new token's row + 1

    def entry(self, layer: int, b: int) -> _Graph | None:
        """The (layer, batch size) entry as it is now (a dropped one's buffers go to another)."""
        return self._graphs.get((layer, b))

    def _make(self, b: int, row: int) -> _Graph:
        win_k, _ = self.store.window(0)
        _, hkv, _, d = win_k.shape
        dev = self.device
        return _Graph(
            graph=None,
            row=row,
            # [2, B] contiguous: the append kernel reads a sequence's row at `b` past its slot.
            append_rows=self._append_rows[row, : 2 * b].view(2, b),
            window_rows=self._window_rows[row, : 2 * b].view(2, b),
            append_rows_dev=self._append_rows_dev[row, : 2 * b].view(2, b),
            window_rows_dev=self._window_rows_dev[row, : 2 * b].view(2, b),
            append_np=self._append_rows[row, : 2 * b].view(2, b).numpy(),
            window_np=self._window_rows[row, : 2 * b].view(2, b).numpy(),
            k=torch.empty((b, hkv, d), dtype=win_k.dtype, device=dev),
            v=torch.empty((b, hkv, d), dtype=win_k.dtype, device=dev),
            out=torch.empty((b, self.q_heads, d), dtype=torch.float32, device=dev),
            lse=torch.empty((b, self.q_heads), dtype=torch.float32, device=dev),
            workspace=WindowWorkspace(str(dev)),
            done=torch.cuda.Event(),
        )

    def kernels(self, layer: int, gr: _Graph, qs: torch.Tensor, k: torch.Tensor | None = None,
                v: torch.Tensor | None = None) -> None:
        """`gr`'s append (of `k, v`, by default its staging buffers) and window attention, launched on
        the current stream: eagerly, inside this object's captures, or inside a caller's."""
        win_k, win_v = self.store.window(layer)
        append_window(win_k, win_v, gr.k if k is None else k, gr.v if v is None else v, gr.append_rows_dev,
                      validate=False)
        # The full width sizes the split grid: the same grid whatever the lengths at a replay.
        rows = gr.window_rows_dev
        window_attention(qs, win_k, win_v, rows[0], rows[1], gr.out, gr.lse, max_len=win_k.shape[2],
                         workspace=gr.workspace, validate=False)

    def _capture(self, layer: int, gr: _Graph, qs: torch.Tensor) -> None:
        try:
            graph = capture_graph(lambda: self.kernels(layer, gr, qs), self._capture_stream)
        except RuntimeError as exc:  # the same kernels, launched eagerly, stay correct
            self.capture_error = f"{type(exc).__name__}: {exc}"
            log.warning("window graphs: capture failed (%s); the window part launches kernel by kernel", exc)
            return
        gr.graph = graph
        self.captures += 1

    def _capture_direct(self, layer: int, gr: _Graph, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        src: tuple[int, int]) -> None:
        """Capture `gr`'s kernels reading `k, v` in place (replacing a graph of other addresses); a
        failed capture leaves the staging graph to serve, and tries no more direct graphs."""
        if self.direct_error is not None:
            return
        try:
            graph = capture_graph(lambda: self.kernels(layer, gr, qs, k, v), self._capture_stream)
        except RuntimeError as exc:
            self.direct_error = f"{type(exc).__name__}: {exc}"
            log.warning("window graphs: capture of a graph reading k, v in place failed (%s); they are copied", exc)
            return
        gr.direct, gr.direct_src = graph, src
        self.captures += 1
        self.direct_captures += 1
