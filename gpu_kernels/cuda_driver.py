"""The few CUDA driver calls the GPU lane makes itself, through ctypes, and events built on them.

Why call the driver directly: on the GPU machine a claim's host time -- two Triton launches, two
torch events and the Python between them -- was 107-265 us, each call costing 3-5x its tight-loop
time once other work ran in between (benchmarks/notes/gpu_lane.md section 21). `native_claim`
issues a whole claim from one numba call; it needs the raw driver entry points (`cuLaunchKernel`,
`cuEventRecord`, `cuMemcpyHtoDAsync`), and events it can record by handle without creating one
per claim (and the AsyncTLS claim's counts come back by `cuMemcpyDtoHAsync`: torch's `copy_` cost
~18 us of host time a claim). Driver and runtime handles are the same objects (a `cudaEvent_t` is
a `CUevent`), so these events mix with torch's: a torch stream can wait on one, and `elapsed_ms` times any pair.

`DriverEvent`s come from a free list: the handle of one that is garbage goes back to the list
(nothing can record or read it any more), so steady-state claims create no CUDA events.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NamedTuple

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600

_u64, _u32, _int = ctypes.c_uint64, ctypes.c_uint, ctypes.c_int


class DriverApi(NamedTuple):
    """ctypes functions of libcuda, every handle and pointer typed as an unsigned 64-bit integer
    (what numba can pass; the x86-64 and aarch64 ABIs pass both in the same registers)."""

    launch_kernel: Any  # cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
    event_record: Any  # cuEventRecord(event, stream)
    memcpy_htod_async: Any  # cuMemcpyHtoDAsync_v2(dst, src, bytes, stream)
    event_create: Any  # cuEventCreate(&event, flags)
    event_query: Any  # cuEventQuery(event)
    event_synchronize: Any  # cuEventSynchronize(event)
    event_elapsed: Any  # cuEventElapsedTime(&ms, start, end)
    stream_wait_event: Any  # cuStreamWaitEvent(stream, event, flags)
    func_param_info: Any  # cuFuncGetParamInfo(f, index, &offset, &size); None before CUDA 12.4
    error_name: Any  # cuGetErrorName(code, &str)
    graph_launch: Any = None  # cuGraphLaunch(exec, stream)
    memcpy_dtoh_async: Any = None  # cuMemcpyDtoHAsync_v2(dst, src, bytes, stream)


def _bind(lib: ctypes.CDLL, name: str, argtypes: list, required: bool = True) -> Any:
    fn = getattr(lib, name, None)
    if fn is None:
        if required:
            raise OSError(f"libcuda has no {name}")
        return None
    fn.argtypes, fn.restype = argtypes, _int
    return fn


_api: DriverApi | None = None
_api_error: str | None = None
_api_lock = threading.Lock()


def driver_api() -> DriverApi | None:
    """The driver's entry points, or None where libcuda cannot be loaded (`driver_error` says why)."""
    global _api, _api_error
    if _api is not None:  # set once, never unset: no lock on the events' calls
        return _api
    with _api_lock:
        if _api is None and _api_error is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                ptr = ctypes.POINTER
                _api = DriverApi(
                    launch_kernel=_bind(lib, "cuLaunchKernel", [_u64, _u32, _u32, _u32, _u32, _u32, _u32, _u32, _u64,
                                                                _u64, _u64]),
                    event_record=_bind(lib, "cuEventRecord", [_u64, _u64]),
                    memcpy_htod_async=_bind(lib, "cuMemcpyHtoDAsync_v2", [_u64, _u64, _u64, _u64]),
                    event_create=_bind(lib, "cuEventCreate", [ptr(_u64), _u32]),
                    event_query=_bind(lib, "cuEventQuery", [_u64]),
                    event_synchronize=_bind(lib, "cuEventSynchronize", [_u64]),
                    event_elapsed=_bind(lib, "cuEventElapsedTime", [ptr(ctypes.c_float), _u64, _u64]),
                    stream_wait_event=_bind(lib, "cuStreamWaitEvent", [_u64, _u64, _u32]),
                    func_param_info=_bind(lib, "cuFuncGetParamInfo", [_u64, ctypes.c_size_t, ptr(ctypes.c_size_t),
                                                                      ptr(ctypes.c_size_t)], required=False),
                    error_name=_bind(lib, "cuGetErrorName", [_int, ptr(ctypes.c_char_p)]),
                    graph_launch=_bind(lib, "cuGraphLaunch", [_u64, _u64]),
                    memcpy_dtoh_async=_bind(lib, "cuMemcpyDtoHAsync_v2", [_u64, _u64, _u64, _u64]),
                )
            except OSError as exc:
                _api_error = f"{type(exc).__name__}: {exc}"
        return _api


def driver_error() -> str | None:
    """Why `driver_api()` is None (None when it is not, or was not asked for yet)."""
    return _api_error


def check(code: int, what: str) -> None:
    """Raise a RuntimeError naming `what` and the driver's error for a non-zero `code`."""
    if code != CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {error_name(code)} ({code})")


def error_name(code: int) -> str:
    api = driver_api()
    name = ctypes.c_char_p()
    if api is None or api.error_name(int(code), ctypes.byref(name)) != CUDA_SUCCESS or name.value is None:
        return "CUDA error"
    return name.value.decode()


# Parameter sizes per kernel handle: a direct launcher is built per layer and step argument set from
# the same few compiled kernels, each asking the driver once per parameter (Triton keeps its loaded
# kernels, and so their handles, for the life of the process).
_param_sizes: dict[int, list[int]] = {}


def kernel_param_sizes(function: int) -> list[int] | None:
    """Sizes in bytes of a compiled kernel's parameters, in order, as the driver knows them; None
    where the driver cannot say (before CUDA 12.4)."""
    api = driver_api()
    if api is None or api.func_param_info is None:
        return None
    known = _param_sizes.get(int(function))
    if known is not None:
        return list(known)
    sizes = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    while api.func_param_info(int(function), len(sizes), ctypes.byref(offset), ctypes.byref(size)) == CUDA_SUCCESS:
        sizes.append(int(size.value))
        if len(sizes) > 4096:
            break
    _param_sizes[int(function)] = sizes
    return list(sizes)


# ---------------------------------------------------------------------------- events
_free_events: list[int] = []
EVENT_BATCH = 32


def _take_handle() -> int:
    try:
        return _free_events.pop()
    except IndexError:
        reserve_events(EVENT_BATCH)
        return _free_events.pop()


def reserve_events(n: int) -> None:
    """Create `n` more timing events for `DriverEvent` (off the hot path: warm-up, or when the free
    list runs dry). They belong to the calling thread's current context."""
    api = driver_api()
    if api is None:
        raise RuntimeError(f"CUDA driver unavailable: {_api_error}")
    for _ in range(n):
        h = _u64()
        check(api.event_create(ctypes.byref(h), 0), "cuEventCreate")  # default flags: timed
        _free_events.append(int(h.value))


def free_event_count() -> int:
    return len(_free_events)


class DriverEvent:
    """A CUDA timing event recorded by handle (`cuda_event`), with the part of `torch.cuda.Event`'s
    interface the runtime uses: `query`, `synchronize`, `elapsed_time`, `wait` (so
    `torch.cuda.Stream.wait_event` takes it) and `record`. Its handle returns to the free list
    when it is garbage."""

    __slots__ = ("cuda_event",)

    def __init__(self) -> None:
        self.cuda_event = _take_handle()

    def __del__(self) -> None:
        h = getattr(self, "cuda_event", 0)
        try:
            if h:
                _free_events.append(h)
        except Exception:  # interpreter shutdown: the module's globals may be gone
            pass

    @property
    def _as_parameter_(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.cuda_event)

    def record(self, stream: Any) -> None:
        check(driver_api().event_record(self.cuda_event, _stream_handle(stream)), "cuEventRecord")

    def query(self) -> bool:
        code = driver_api().event_query(self.cuda_event)
        if code == CUDA_ERROR_NOT_READY:
            return False
        check(code, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        check(driver_api().event_synchronize(self.cuda_event), "cuEventSynchronize")  # ctypes drops the GIL

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to `end` (either kind of event), like torch's."""
        return elapsed_ms(self, end)

    def wait(self, stream: Any) -> None:
        check(driver_api().stream_wait_event(_stream_handle(stream), self.cuda_event, 0), "cuStreamWaitEvent")


def _stream_handle(stream: Any) -> int:
    return stream if isinstance(stream, int) else int(stream.cuda_stream)


def elapsed_ms(start: Any, end: Any) -> float:
    """Milliseconds between two recorded events, each a `torch.cuda.Event` or a `DriverEvent`."""
    if not isinstance(start, DriverEvent) and not isinstance(end, DriverEvent):
        return start.elapsed_time(end)
    ms = ctypes.c_float()
    check(driver_api().event_elapsed(ctypes.byref(ms), int(start.cuda_event), int(end.cuda_event)),
          "cuEventElapsedTime")
    return float(ms.value)


__all__ = ["DriverApi", "DriverEvent", "check", "driver_api", "driver_error", "elapsed_ms", "error_name",
           "free_event_count", "kernel_param_sizes", "reserve_events"]
