"""Launch a Triton kernel through its compiled handle once it has been compiled.

`kernel[grid](*args)` binds every argument, recomputes the specialization key and looks the kernel
up on every call: tens of microseconds of host time per launch, which on the GPU lane's critical
path is the larger part of a small claim's fixed cost. `CachedLaunch` goes through the JIT once per
variant (that call compiles it, at warm-up) and afterwards hands the arguments straight to the
compiled kernel's launcher, as the JIT itself does after its lookup.

The cache key is the caller's `variant` (the constexprs), the launch options and, per argument,
what Triton specialises on (dtype and 16-byte alignment of tensors, integers equal to 1 or
divisible by 16), so a call never reaches a kernel compiled for other arguments. Arguments that
vary from step to step belong in `do_not_specialize` / `do_not_specialize_on_alignment`: then a
new key costs one lookup through the JIT, never a compile. Under the interpreter every call goes
through the JIT.
"""

from __future__ import annotations

import logging

import torch

from gpu_kernels._checks import interpreted
from gpu_kernels.streams import current_stream_handle

log = logging.getLogger(__name__)


class CachedLaunch:
    """One Triton kernel; `__call__(grid, args, constexprs, variant)` launches it on the current stream."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}
        self._broken = False

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, variant: tuple, options: dict,
                 stream: int | None = None) -> None:
        """Launch on `grid`. `args`: the runtime arguments in order; `constexprs`: the constexpr
        arguments in their declared order (all after the runtime ones); `variant`: everything else
        that selects a compiled kernel (pointer dtypes, integer arguments Triton specialises);
        `options`: launch options (num_warps, num_stages). `stream`: the raw CUDA stream handle to
        launch on; None: the current stream (the first, compiling call makes the handle current)."""
        key = (variant, tuple(options.items()), _specialization(args))
        kernel = None if self._broken or interpreted() else self._compiled.get(key)
        if kernel is None:
            if stream is not None:
                with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                    kernel = self.fn[grid](*args, **constexprs, **options)
            else:
                kernel = self.fn[grid](*args, **constexprs, **options)
            if not interpreted() and kernel is not None and _KNOBS is not None:
                self._compiled[key] = kernel
            return
        try:
            if stream is None:
                stream = current_stream_handle()
            # Every dimension of the grid: the JIT passes (x, y, z) too. Dropping z ran only the
            # programs with program_id(2) == 0 from the second call of a variant on (the first goes
            # through the JIT and was right; the interpreter always does, so only CUDA showed it).
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            rt = _KNOBS.runtime
            enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
            argv = (*args, *constexprs.values())
            # Launch hooks (profilers) get the metadata the JIT would give them.
            meta = kernel.launch_metadata(grid, stream, *argv) if enter is not None else None
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *argv)
            self.fast_launches += 1
        except (TypeError, AttributeError) as exc:  # a Triton whose launcher differs: use the JIT
            log.warning("cached Triton launch unavailable (%s); launching through the JIT", exc)
            self._broken = True
            self(grid, args, constexprs, variant, options, stream)

    fast_launches = 0


def _specialization(args: tuple) -> tuple:
    """What Triton may specialise a kernel on, per argument: a tensor's dtype and 16-byte
    alignment, an integer being 1 or a multiple of 16. A key that includes it can never hand a
    call to a kernel compiled for other arguments (an argument Triton does not specialise only
    costs one more lookup through the JIT, never a compile)."""
    spec = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool):
            spec.append((a == 1, a % 16 == 0))
        else:
            spec.append(type(a))
    return tuple(spec)


try:  # the JIT reads its launch hooks here too (Triton >= 3.3)
    from triton import knobs as _KNOBS
except ImportError:  # older Triton: always launch through the JIT
    _KNOBS = None
