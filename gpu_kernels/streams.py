"""Current-stream lookups and stream switches for the decode path, without torch's device lookup.

`torch.cuda.current_stream()` with no device, `Event.record()` with no stream and
`with torch.cuda.stream(s)` each resolve the current device through Python
(`_get_device_index` -> `_get_device_attr` -> `is_available`). A profiled decode layer at 4 x 32K
on the H200 made 15 such lookups and 19 `is_available` calls (`benchmarks/diag/host_path.py`), on
the thread that launches the GPU lane, whose host time is the step's critical path when the lanes
are balanced. These helpers ask the CUDA runtime for the current device directly.
"""

from __future__ import annotations

import torch

_get_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream() -> torch.cuda.Stream:
    """The current CUDA stream of the current device (`torch.cuda.current_stream()`, faster)."""
    return torch.cuda.current_stream(_get_device())


def current_stream_handle() -> int:
    """The raw `cudaStream_t` of the current stream of the current device."""
    if _raw_stream is None:  # a torch build without the raw accessor
        return torch.cuda.current_stream().cuda_stream
    return _raw_stream(_get_device())


class use_stream:
    """`with use_stream(s, prev):` makes `s` current and restores `prev` (default: the current
    stream) on exit: `torch.cuda.stream(s)` for a stream of the current device, without its device
    lookups. A stream of another device goes through `torch.cuda.stream`, which switches devices."""

    __slots__ = ("stream", "prev", "_fallback")

    def __init__(self, stream: torch.cuda.Stream, prev: torch.cuda.Stream | None = None):
        self.stream, self.prev, self._fallback = stream, prev, None

    def __enter__(self) -> torch.cuda.Stream:
        if self.stream.device_index != _get_device():
            self._fallback = torch.cuda.stream(self.stream)
            self._fallback.__enter__()
            return self.stream
        if self.prev is None:
            self.prev = current_stream()
        torch.cuda.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(*exc)
        else:
            torch.cuda.set_stream(self.prev)


def capture_graph(launches, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """`launches()` captured into a new CUDA graph on `stream` (their kernels compiled already).

    Thread-local capture: other threads (the store's committer, the warm-up) may call CUDA
    meanwhile. A capture that fails raises its RuntimeError; the caller falls back to launching
    the same kernels directly."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            launches()
        finally:
            graph.capture_end()
    return graph


__all__ = ["capture_graph", "current_stream", "current_stream_handle", "use_stream"]
