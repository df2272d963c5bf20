"""Hold a CUDA stream until a counter in pinned host memory reaches a target; write such a word from a stream.

Why: a decode step's merge needs the CPU workers' results, and the host used to wait for the
workers before it queued the merge, so the model's next layer could not be issued while they ran.
With this wait the host queues the merge at once; the stream reaches it only once the workers have
counted every task done.

How: the driver's stream memory operation `cuStreamWaitValue64` (`_v2`, on by default since CUDA
11.7): the GPU's front end re-reads the 64-bit word in host memory until it is >= the target,
with no kernel and no SM held. A first version polled from a one-warp Triton kernel with volatile
loads; on the H200 those loads were served from a line of the L2 that the previous step's poll had
cached, so a wait now and then saw the previous step's final count and the merge read results the
workers had not written (benchmarks/notes/e2e_overlap.md).

The other direction, `signal_value`: the driver's `cuStreamWriteValue64` writes a 64-bit word in
pinned host memory once the stream reaches it, after a system-wide fence behind the stream's earlier
work (the default flags). The runtime writes a step's job id there after q's copy to the host; the
CPU workers, spinning on that word, start the moment q lands (`hybrid_runtime.native_pool`,
"Starting on the device's word").

A step that fails or times out closes its queue; the host then counts the positions never started
into the word (`NativeQueue.release_unstarted`), so the wait ends when the tasks still running do.
Device-side memory ordering: the workers count a task done with a
sequentially consistent atomic add after writing its results, and the caller reads the results by
a copy queued after the wait (a DMA read of host memory when the copy runs).
"""

from __future__ import annotations

import ctypes
import functools

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced (not CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER)


@functools.lru_cache(maxsize=None)
def _stream_memory_op(name: str):
    """The CUDA driver's stream memory operation `name` (`cuStreamWaitValue64`, `cuStreamWriteValue64`;
    its `_v2` where there is one), typed; raises RuntimeError where it is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError(f"the CUDA driver library could not be loaded ({exc})") from exc
    fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name, None)
    if fn is None:
        raise RuntimeError(f"this CUDA driver has no {name} (stream memory operations)")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_WAIT_OP, _WRITE_OP = "cuStreamWaitValue64", "cuStreamWriteValue64"


def _missing(name: str) -> str | None:
    """None where the driver has stream memory operation `name`, else why not."""
    try:
        _stream_memory_op(name)
    except RuntimeError as exc:
        return str(exc)
    return None


def driver_wait_available() -> str | None:
    """None where `wait_for_count` can run, else why not."""
    return _missing(_WAIT_OP)


def driver_write_available() -> str | None:
    """None where `signal_value` can run, else why not."""
    return _missing(_WRITE_OP)


def device_address(word: torch.Tensor) -> int:
    """The device address of a pinned host tensor's first element (for `wait_for_count`)."""
    from gpu_kernels.uva import _device_pointer

    if word.device.type != "cpu" or not word.is_pinned():
        raise ValueError(f"the counter must be in pinned host memory; got a {word.device} tensor "
                         f"(pinned: {word.is_pinned() if word.device.type == 'cpu' else False})")
    return _device_pointer(word.data_ptr())


def wait_for_count(address: int, target: int, stream: int) -> None:
    """Queue on `stream` (raw handle) a wait until the int64 at device `address` (pinned host
    memory, `device_address`) is >= `target`."""
    status = _stream_memory_op(_WAIT_OP)(ctypes.c_void_p(stream), address, int(target), _WAIT_GEQ)
    if status != 0:
        raise RuntimeError(f"cuStreamWaitValue64 failed with CUDA driver error {status}")


def signal_value(address: int, value: int, stream: int) -> None:
    """Queue on `stream` (raw handle) a write of `value` to the int64 at device `address` (pinned
    host memory, `device_address`), fenced behind the stream's earlier work."""
    status = _stream_memory_op(_WRITE_OP)(ctypes.c_void_p(stream), address, int(value), _WRITE_DEFAULT)
    if status != 0:
        raise RuntimeError(f"cuStreamWriteValue64 failed with CUDA driver error {status}")


__all__ = ["device_address", "driver_wait_available", "driver_write_available", "signal_value", "wait_for_count"]
