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

`LaunchPlan` is the plan/run split for the launches on a step's critical path: the argument list
is packed once (tensors as their addresses), and a call only writes the arguments that change,
checks that they specialise as the planned ones did, and calls the compiled kernel's launcher. On
the GPU machine a `CachedLaunch` call cost ~30 us of host time with the workers idle and 60-80 us
while they read host memory beside it (`benchmarks/diag/launch_cost.py`); about half of the idle
figure was our Python (the key over every argument), and passing addresses as ints spares the
launcher a `data_ptr()` call and a driver query per tensor.
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
        spec, packed = _pack(args)
        key = (variant, tuple(options.items()), spec)
        kernel = None if self._broken or interpreted() else self._compiled.get(key)
        if kernel is None:
            CachedLaunch.jit_launches += 1
            if not interpreted():  # under the interpreter every call goes through the JIT: nothing to name
                name = f"{getattr(self.fn, '__name__', self.fn)} {_describe_key(key)}"
                CachedLaunch.jit_launch_keys[name] = CachedLaunch.jit_launch_keys.get(name, 0) + 1
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
            enter, leave = _launch_hooks()
            argv = (*packed, *constexprs.values())
            # Launch hooks (profilers) get the metadata the JIT would give them.
            meta = kernel.launch_metadata(grid, stream, *args, *constexprs.values()) if enter is not None else None
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *argv)
            self.fast_launches += 1
        except (TypeError, AttributeError) as exc:  # a Triton whose launcher differs: use the JIT
            log.warning("cached Triton launch unavailable (%s); launching through the JIT", exc)
            self._broken = True
            self(grid, args, constexprs, variant, options, stream)

    fast_launches = 0
    # Calls of every CachedLaunch in the process that went through the JIT (a first call of a
    # variant or specialisation, every call under the interpreter or with a Triton whose launcher
    # differs): after warm-up, each is one on the hot path that costs the JIT's host time
    # (`HybridRuntime.stats()["jit_launches_after_warmup"]`).
    jit_launches = 0
    # The same calls by kernel and key (outside the interpreter): which variant or specialisation a
    # warm-up missed (`HybridRuntime.stats()["jit_kernels_after_warmup"]`).
    jit_launch_keys: dict[str, int] = {}

    def compiled(self, args: tuple, variant: tuple, options: dict) -> object | None:
        """The compiled kernel a call with these arguments runs, once a call compiled it; None
        before that, under the interpreter, or where the JIT launches every call."""
        if self._broken or interpreted():
            return None
        return self._compiled.get((variant, tuple(options.items()), _specialization(args)))


def _launch_hooks() -> tuple:
    """Triton's launch hooks (enter, exit), or (None, None) when none is set. Newer Tritons keep an
    empty hook chain there rather than None; handing it on would make every launch build the
    hooks' metadata and call the chain."""
    rt = _KNOBS.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    if _hook_set(enter) or _hook_set(leave):
        return enter, leave
    return None, None


def _hook_set(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def _pack(args: tuple) -> tuple[tuple, tuple]:
    """What Triton may specialise a kernel on, per argument, and the arguments as its launcher
    takes them fastest (`_pack_into`)."""
    argv = list(args)
    return _pack_into(args, range(len(args)), argv), tuple(argv)


def _pack_into(args: tuple, positions, argv: list) -> tuple:
    """For each of `positions` (in order): what Triton may specialise the kernel on in `args[i]`,
    returned as a tuple, and the argument as its launcher takes it fastest, written to `argv[i]`.
    Specialisation: a tensor's dtype and 16-byte alignment, an integer being 1 or a multiple of 16;
    a key that includes it can never hand a call to a kernel compiled for other arguments (an
    argument Triton does not specialise only costs one more lookup through the JIT, never a
    compile). Arguments: CUDA tensors as their addresses -- the launcher takes an int as the device
    pointer it is (a CUDA tensor's `data_ptr()` is one, UVA views of pinned memory included) and
    skips its `data_ptr()` call and driver query."""
    spec = []
    for i in positions:
        a = args[i]
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            spec.append((a.dtype, p % 16 == 0))
            argv[i] = p if a.is_cuda else a
        else:
            spec.append((a == 1, a % 16 == 0) if isinstance(a, int) and not isinstance(a, bool) else type(a))
            argv[i] = a
    return tuple(spec)


def _describe_key(key: tuple) -> str:
    """A `CachedLaunch` key in a line: the variant, the options, then per argument what Triton
    specialises (a tensor's dtype and 16-byte alignment, `a16`/`u`; an integer being 1, a multiple
    of 16 or neither, `1`/`d16`/`i`)."""
    variant, options, spec = key
    args = []
    for s in spec:
        if isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], torch.dtype):
            args.append(f"{str(s[0]).removeprefix('torch.')}:{'a16' if s[1] else 'u'}")
        elif isinstance(s, tuple):
            args.append("1" if s[0] else "d16" if s[1] else "i")
        else:
            args.append(getattr(s, "__name__", str(s)))
    return f"variant={variant} options={dict(options)} args=[{' '.join(args)}]"


def _specialization(args: tuple) -> tuple:
    """What Triton may specialise a kernel on, per argument (see `_pack`)."""
    return _pack(args)[0]


class LaunchPlan:
    """One kernel's launch planned once, run many times (FlashInfer's plan/run split).

    `args`, `constexprs`, `variant`, `options`: a complete call as `CachedLaunch` takes it.
    `per_call`: the positions in `args` of the arguments a call may change; every other argument
    is packed once (the plan keeps its tensors alive, and only those) and must be the same in every
    call. A call passes the complete argument tuple; the planned path reads only the `per_call`
    positions (a call through `CachedLaunch` reads them all). A call whose
    values there specialise as an earlier call's did goes straight to that call's compiled kernel;
    any other goes through `CachedLaunch` (which may compile) and is remembered. Under the
    interpreter, or with Triton's launch hooks set (a profiler), every call goes through
    `CachedLaunch`; so does every call while the class attribute `enabled` is false (diagnostics
    compare the two paths on one machine).
    """

    enabled = True

    def __init__(self, launch: CachedLaunch, args: tuple, constexprs: dict, variant: tuple, options: dict,
                 per_call: tuple[int, ...]) -> None:
        if len(set(per_call)) != len(per_call) or not all(0 <= i < len(args) for i in per_call):
            raise ValueError(f"per_call {per_call} must be distinct positions of the {len(args)} arguments")
        self._launch = launch
        self._per_call = tuple(per_call)
        # The fixed arguments only: the packed list holds their addresses, so the plan keeps those
        # tensors alive. Not the per-call ones, which each call passes again: a plan holding the
        # first call's (a layer's arena view, say) kept that arena referenced after the store was
        # closed ("KVStore.close: 1 of N arenas are still referenced").
        self._args = tuple(None if i in self._per_call else a for i, a in enumerate(args))
        self._constexprs = constexprs
        self._variant = variant
        self._options = options
        self._argv = [*_pack(args)[1], *constexprs.values()]
        for i in self._per_call:
            self._argv[i] = None  # written by every call before its launch
        self._kernels: dict = {}  # specialisation of the per-call values -> compiled kernel
        self.fast_launches = 0

    def __call__(self, grid: tuple, args: tuple, stream: int | None = None) -> None:
        """Launch on `grid` with the complete arguments `args` (only the `per_call` positions are
        read), on the raw CUDA stream handle `stream` (None: the current stream)."""
        if len(args) != len(self._args):
            raise ValueError(f"{len(args)} arguments for a plan of {len(self._args)}")
        key = _pack_into(args, self._per_call, self._argv)
        kernel = self._kernels.get(key)
        if kernel is None or not LaunchPlan.enabled or _launch_hooks()[0] is not None:
            self._slow(grid, args, stream, key)
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        try:
            kernel.run(grid[0], g1, g2, current_stream_handle() if stream is None else stream, kernel.function,
                       kernel.packed_metadata, None, None, None, *self._argv)
        except (TypeError, AttributeError) as exc:  # a Triton whose launcher differs: use the JIT
            log.warning("planned Triton launch unavailable (%s); launching through the JIT", exc)
            self._launch._broken = True
            self._kernels.clear()
            self._slow(grid, args, stream, key)
            return
        self.fast_launches += 1

    def _slow(self, grid: tuple, args: tuple, stream: int | None, key: tuple) -> None:
        launch = self._launch
        launch(grid, args, self._constexprs, self._variant, self._options, stream)
        if launch._broken or interpreted():
            return
        kernel = launch._compiled.get((self._variant, tuple(self._options.items()), _specialization(args)))
        if kernel is not None:
            self._kernels[key] = kernel


try:  # the JIT reads its launch hooks here too (Triton >= 3.3)
    from triton import knobs as _KNOBS
except ImportError:  # older Triton: always launch through the JIT
    _KNOBS = None
