"""Stand-ins for the CUDA driver and compiled Triton kernels, for the native launchers' tests
(`gpu_kernels/native_claim.py`, `gpu_kernels/direct_claim.py`) on machines without CUDA."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

from gpu_kernels.cuda_driver import DriverApi

_u64, _u32, _int = ctypes.c_uint64, ctypes.c_uint, ctypes.c_int


class FakeDriver:
    """ctypes callbacks standing in for cuLaunchKernel, cuEventRecord, cuMemcpyHtoDAsync and cuStreamWaitEvent."""

    def __init__(self, fail_launch: int | None = None):
        self.calls: list[tuple] = []
        self.fail_launch = fail_launch

        def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            self.calls.append(("launch", f, (gx, gy, gz), (bx, by, bz), shared, stream, params, extra))
            launches = sum(c[0] == "launch" for c in self.calls)
            return 700 if launches == self.fail_launch else 0

        def record(event, stream):
            self.calls.append(("record", event, stream))
            return 0

        def copy(dst, src, nbytes, stream):
            self.calls.append(("copy", dst, src, nbytes, stream))
            return 0

        def wait(stream, event, flags):
            self.calls.append(("wait", stream, event, flags))
            return 0

        self._keep = (ctypes.CFUNCTYPE(_int, _u64, _u32, _u32, _u32, _u32, _u32, _u32, _u32, _u64, _u64, _u64)(launch),
                      ctypes.CFUNCTYPE(_int, _u64, _u64)(record),
                      ctypes.CFUNCTYPE(_int, _u64, _u64, _u64, _u64)(copy),
                      ctypes.CFUNCTYPE(_int, _u64, _u64, _u32)(wait))
        launch_fn, record_fn, copy_fn, wait_fn = self._keep
        self.api = DriverApi(launch_fn, record_fn, copy_fn, None, None, None, None, wait_fn, None, None)


class FakeKernel:
    """What `NativeClaim.build` reads of a compiled Triton kernel."""

    def __init__(self, function: int, names: list[str], signature: dict, num_warps: int = 4, shared: int = 1024,
                 **metadata):
        self.function = function
        self.src = SimpleNamespace(signature=signature, fn=SimpleNamespace(arg_names=names))
        self.metadata = SimpleNamespace(**{"num_warps": num_warps, "shared": shared, "num_ctas": 1, **metadata})


def params_at(address: int, n: int) -> list[int]:
    """The values a cuLaunchKernel parameter array at `address` points at."""
    pointers = (ctypes.c_uint64 * n).from_address(address)
    return [ctypes.c_int64.from_address(p).value for p in pointers]
