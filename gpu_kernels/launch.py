"""Launch a Triton kernel through its compiled handle once it has been compiled.

`kernel[grid](*args)` binds every argument, recomputes the specialization key and looks the kernel
up on every call: tens of microseconds of host time per launch, which on the GPU lane's critical
path is the larger part of a small claim's fixed cost. `CachedLaunch` goes through the JIT once per
variant (that call compiles it, at warm-up) and afterwards hands the arguments straight to the
compiled kernel's launcher, as the JIT itself does after its lookup.

The cache key is the caller's `variant` (the constexprs), the launch options and, per argument,
what Triton specialises on (dtype and 16-byte alignment of tensors, an integer's width and whether
it is 1 or divisible by 16), so a call never reaches a kernel compiled for other arguments; and
nothing more: what the kernel declares `do_not_specialize` / `do_not_specialize_on_alignment`
(arguments that vary from step to step) is left out, so their changes never send a call through
the JIT. Under the interpreter every call goes through the JIT.

`LaunchPlan` is the plan/run split for the launches on a step's critical path: the argument list
is packed once (tensors as their addresses), and a call only writes the arguments that change,
checks that they specialise as the planned ones did, and calls the compiled kernel's launcher. On
the GPU machine a `CachedLaunch` call cost ~30 us of host time with the workers idle and 60-80 us
while they read host memory beside it (`benchmarks/diag/launch_cost.py`); about half of the idle
figure was our Python (the key over every argument), and passing addresses as ints spares the
launcher a `data_ptr()` call and a driver query per tensor.
"""

from __future__ import annotations

import inspect
import logging
from typing import NamedTuple

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
        # Per runtime argument (the kernel's parameters before its constexprs): what Triton may
        # specialise on it, from the kernel's own `do_not_specialize` / `do_not_specialize_on_alignment`.
        # A key that specialised what Triton does not sent every new alignment or integer class of such
        # an argument (a task offset, a length, a ring row) through the JIT after warm-up: 19-22 launches
        # on the hot path of each process's first runtime at 4 x 32K on the H200 -- and a slower launch
        # there made the first device-started step wrong (benchmarks/notes/e2e_overlap.md section 22).
        self._rules = _specialization_rules(fn)

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, variant: tuple, options: dict,
                 stream: int | None = None) -> None:
        """Launch on `grid`. `args`: the runtime arguments in order; `constexprs`: the constexpr
        arguments in their declared order (all after the runtime ones); `variant`: everything else
        that selects a compiled kernel (pointer dtypes, integer arguments Triton specialises);
        `options`: launch options (num_warps, num_stages). `stream`: the raw CUDA stream handle to
        launch on; None: the current stream (the first, compiling call makes the handle current)."""
        spec, packed = _pack(args, self._rules)
        key = (variant, tuple(options.items()), spec)
        kernel = None if self._broken or interpreted() else self._compiled.get(key)
        if kernel is None:
            CachedLaunch.jit_launches += 1
            if not (interpreted() or self._broken or _KNOBS is None):  # else every call goes through the JIT
                name = f"{getattr(self.fn, '__name__', self.fn)} {_describe_key(key)}"
                CachedLaunch.jit_launch_keys[name] = CachedLaunch.jit_launch_keys.get(name, 0) + 1
            # The JIT launches on torch's current stream, so `stream` is made current unless it is.
            # Not with `ExternalStream(0)` for the default stream's handle: torch makes that a new
            # stream from its pool (non-blocking, ordered after nothing on stream 0). A decode step on
            # the default stream hands its launches 0; the first device-started runtime of a process
            # ran one such JIT launch (step inputs) ahead of the stream's wait for the previous step's
            # trailing CPU lane, overwriting the q its last tasks still read (notes/e2e_overlap.md 22).
            if stream is None or stream == current_stream_handle():
                kernel = self.fn[grid](*args, **constexprs, **options)
            else:
                with torch.cuda.stream(torch.cuda.default_stream() if stream == 0 else torch.cuda.ExternalStream(stream)):
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
        return self._compiled.get((variant, tuple(options.items()), _specialization(args, self._rules)))


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


# What Triton specialises an argument on, by the kernel's declaration of that parameter.
SPECIALISED, NOT_ON_ALIGNMENT, NOT_SPECIALISED = 0, 1, 2


def _specialization_rules(fn) -> tuple[int, ...]:
    """Per runtime parameter of the Triton kernel `fn` (those before its constexprs), in order:
    `SPECIALISED`, `NOT_ON_ALIGNMENT` (`do_not_specialize_on_alignment`) or `NOT_SPECIALISED`
    (`do_not_specialize`). Empty for an object without Triton's parameter list (a stand-in):
    then every argument is keyed as specialised, which is never wrong, only more keys."""
    rules = []
    params = getattr(fn, "params", None)
    if params is not None:  # a JITFunction: Triton's own reading of the declarations
        for param in params:
            if param.is_constexpr:
                break
            rules.append(NOT_SPECIALISED if param.do_not_specialize
                         else NOT_ON_ALIGNMENT if param.do_not_specialize_on_alignment else SPECIALISED)
        return tuple(rules)
    kwargs, py_fn = getattr(fn, "kwargs", None), getattr(fn, "fn", None)
    if not isinstance(kwargs, dict) or py_fn is None:
        return ()
    # The interpreter's function (no CUDA): the same declarations, read from its arguments.
    dns = set(kwargs.get("do_not_specialize") or ())
    dns_oa = set(kwargs.get("do_not_specialize_on_alignment") or ())
    for i, (name, param) in enumerate(inspect.signature(py_fn).parameters.items()):
        if "constexpr" in str(param.annotation):
            break
        rules.append(NOT_SPECIALISED if name in dns or i in dns
                     else NOT_ON_ALIGNMENT if name in dns_oa or i in dns_oa else SPECIALISED)
    return tuple(rules)


def _pack(args: tuple, rules: tuple[int, ...] = ()) -> tuple[tuple, tuple]:
    """What Triton may specialise a kernel on, per argument, and the arguments as its launcher
    takes them fastest (`_pack_into`)."""
    argv = list(args)
    return _pack_into(args, range(len(args)), argv, rules), tuple(argv)


def _pack_into(args: tuple, positions, argv: list, rules: tuple[int, ...] = ()) -> tuple:
    """For each of `positions` (in order): what Triton may specialise the kernel on in `args[i]`,
    returned as a tuple, and the argument as its launcher takes it fastest, written to `argv[i]`.
    Specialisation (`rules[i]`, `_specialization_rules`; `SPECIALISED` past its end): a tensor's
    dtype and, unless `NOT_ON_ALIGNMENT` or `NOT_SPECIALISED`, its 16-byte alignment; an integer's
    width and, unless `NOT_SPECIALISED`, whether it is 1 and, unless either, a multiple of 16 -- what
    Triton's JIT keys its compiled kernels on, so a key never hands a call to a kernel compiled for
    other arguments, and an argument Triton does not specialise never sends a call through the JIT.
    Arguments: CUDA tensors as their addresses -- the launcher takes an int as the device
    pointer it is (a CUDA tensor's `data_ptr()` is one, UVA views of pinned memory included) and
    skips its `data_ptr()` call and driver query."""
    spec = []
    n_rules = len(rules)
    for i in positions:
        a = args[i]
        rule = rules[i] if i < n_rules else SPECIALISED
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            spec.append((a.dtype, p % 16 == 0) if rule == SPECIALISED else a.dtype)
            argv[i] = p if a.is_cuda else a
        else:
            if isinstance(a, int) and not isinstance(a, bool):
                # The type Triton gives it (its launcher refuses a value outside it); inline: this
                # runs for every per-call integer of every planned launch.
                width = "i32" if -2147483648 <= a <= 2147483647 else "u64" if a >= 9223372036854775808 else "i64"
                spec.append(width if rule == NOT_SPECIALISED else (width, a == 1) if rule == NOT_ON_ALIGNMENT
                            else (width, a == 1, a % 16 == 0))
            else:
                spec.append(type(a))
            argv[i] = a
    return tuple(spec)


def _describe_key(key: tuple) -> str:
    """A `CachedLaunch` key in a line: the variant, the options, then per argument what Triton
    specialises (a tensor's dtype and 16-byte alignment, `a16`/`u`, or its dtype alone; an integer
    being 1, a multiple of 16 or neither, `1`/`d16`/its width `i32`)."""
    variant, options, spec = key
    args = []
    for s in spec:
        if isinstance(s, torch.dtype):  # a tensor Triton does not specialise on alignment
            args.append(str(s).removeprefix("torch."))
        elif isinstance(s, tuple) and isinstance(s[0], torch.dtype):
            args.append(f"{str(s[0]).removeprefix('torch.')}:{'a16' if s[1] else 'u'}")
        elif isinstance(s, tuple):  # an integer: (width, is 1[, multiple of 16])
            args.append("1" if s[1] else "d16" if len(s) > 2 and s[2] else s[0])
        else:  # an unspecialised integer's width, or another argument's type
            args.append(s if isinstance(s, str) else getattr(s, "__name__", str(s)))
    return f"variant={variant} options={dict(options)} args=[{' '.join(args)}]"


def _specialization(args: tuple, rules: tuple[int, ...] = ()) -> tuple:
    """What Triton may specialise a kernel on, per argument (see `_pack`)."""
    return _pack(args, rules)[0]


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
        key = _pack_into(args, self._per_call, self._argv, self._launch._rules)
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
        kernel = launch._compiled.get((self._variant, tuple(self._options.items()), _specialization(args, launch._rules)))
        if kernel is not None:
            self._kernels[key] = kernel


def direct_launches_allowed() -> bool:
    """Whether a launcher may issue compiled kernels itself, past Triton's launcher
    (`gpu_kernels/direct_claim.py`): not while planned launches are switched off
    (`LaunchPlan.enabled`, diagnostics) or Triton's launch hooks are set (a profiler must see
    every launch), nor with a Triton whose launch cache this module does not use."""
    return _KNOBS is not None and LaunchPlan.enabled and _launch_hooks()[0] is None


class KernelCall(NamedTuple):
    """One launch of a claim as its planned path makes it, for a launcher that issues it itself
    (`gpu_kernels/direct_claim.py`): the kernel, a complete argument list with placeholder values at
    the positions a claim sets (`claim_args`: a claim word's name -> its position in `args`; Triton
    never specialises on those, so the placeholders select the compiled kernel every claim of the
    step runs), the constexprs and the launch options."""

    launch: CachedLaunch
    args: tuple
    constexprs: dict
    options: dict
    claim_args: dict

    def compiled(self) -> object | None:
        """The compiled kernel a planned launch with these arguments runs, once one compiled it."""
        return self.launch.compiled(self.args, tuple(self.constexprs.values()), self.options)


try:  # the JIT reads its launch hooks here too (Triton >= 3.3)
    from triton import knobs as _KNOBS
except ImportError:  # older Triton: always launch through the JIT
    _KNOBS = None
