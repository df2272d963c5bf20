"""Launch a Triton kernel through its compiled handle once it has been compiled.

`kernel[grid](*args)` binds every argument, recomputes the specialization key and looks the kernel
up on every call: tens of microseconds of host time per launch, which on the GPU lane's critical
path is the larger part of a small claim's fixed cost. `CachedLaunch` goes through the JIT once per
variant (that call compiles it, at warm-up) and afterwards hands the arguments straight to the
compiled kernel's launcher, as the JIT itself does after its lookup.

Safe only for kernels whose specialization cannot drift between calls with the same `variant`
key: every integer argument that varies is in `do_not_specialize`, every pointer whose alignment
varies is in `do_not_specialize_on_alignment`, and the variant key names everything else that
selects a compiled kernel (constexprs, pointer dtypes). Under the interpreter, or with a launch
hook installed (a profiler), every call goes through the JIT.
"""

from __future__ import annotations

import logging

import torch

from gpu_kernels._checks import interpreted

log = logging.getLogger(__name__)


class CachedLaunch:
    """One Triton kernel; `__call__(grid, args, constexprs, variant)` launches it on the current stream."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}
        self._broken = False

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, variant: tuple, num_warps: int,
                 stream: int | None = None) -> None:
        """`stream`: the raw CUDA stream handle to launch on; None: the current stream (the JIT
        path always launches on the current stream, so a caller passing a handle makes it current
        for the first, compiling call)."""
        key = (variant, num_warps)
        kernel = None if self._broken or interpreted() else self._compiled.get(key)
        if kernel is None:
            if stream is not None:
                with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                    kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps)
            else:
                kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps)
            if not interpreted() and kernel is not None and _KNOBS is not None:
                self._compiled[key] = kernel
            return
        try:
            if stream is None:
                stream = torch.cuda.current_stream().cuda_stream
            g1 = grid[1] if len(grid) > 1 else 1
            rt = _KNOBS.runtime
            enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
            argv = (*args, *constexprs.values())
            # Launch hooks (profilers) get the metadata the JIT would give them.
            meta = kernel.launch_metadata(grid, stream, *argv) if enter is not None else None
            kernel.run(grid[0], g1, 1, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *argv)
            self.fast_launches += 1
        except (TypeError, AttributeError) as exc:  # a Triton whose launcher differs: use the JIT
            log.warning("cached Triton launch unavailable (%s); launching through the JIT", exc)
            self._broken = True
            self(grid, args, constexprs, variant, num_warps, stream)

    fast_launches = 0


try:  # the JIT reads its launch hooks here too (Triton >= 3.3)
    from triton import knobs as _KNOBS
except ImportError:  # older Triton: always launch through the JIT
    _KNOBS = None
