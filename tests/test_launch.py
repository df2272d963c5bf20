"""Cached Triton launches: the key covers what Triton specialises on; with CUDA the second call
of a variant bypasses the JIT and computes the same result."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpu_kernels.launch import CachedLaunch, LaunchPlan, _specialization  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@triton.jit
def _add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) + 1.0, mask=m)


def test_key_tells_apart_what_triton_specialises_on():
    x = torch.zeros(64)
    assert _specialization((x, 32)) == _specialization((torch.ones(64), 48))
    assert _specialization((x, 32)) != _specialization((x[1:], 32))  # alignment
    assert _specialization((x, 32)) != _specialization((x, 33))  # divisible by 16 or not
    assert _specialization((x, 2)) != _specialization((x, 1))  # 1 is a constant to Triton
    assert _specialization((x,)) != _specialization((x.double(),))  # dtype


def test_cached_launch_computes_what_the_jit_does():
    launch = CachedLaunch(_add_kernel)
    # 37 specialises as 100 does (neither 1 nor a multiple of 16): the compiled kernel serves it;
    # 48 (a multiple of 16) is a new variant and goes through the JIT.
    for n in (100, 100, 37, 48):
        x = torch.randn(n, device=DEV)
        y = torch.full((n,), float("nan"), device=DEV)
        launch((triton.cdiv(n, 64),), (x, y, n), {"BLOCK": 64}, (64,), {"num_warps": 1})
        assert torch.equal(y.cpu(), (x + 1.0).cpu())
    if CUDA:  # the second and third calls went straight to the compiled kernel
        assert launch.fast_launches == 2
    else:  # the interpreter always goes through the JIT
        assert launch.fast_launches == 0


@triton.jit
def _grid_ids_kernel(out_ptr):
    x, y, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = (z * tl.num_programs(1) + y) * tl.num_programs(0) + x
    tl.store(out_ptr + i, i)


def test_cached_launch_runs_every_program_of_a_three_dimensional_grid():
    """With CUDA the second call is the cached one: every (x, y, z) program must run, not z = 0 only."""
    launch = CachedLaunch(_grid_ids_kernel)
    for _ in range(2):
        out = torch.full((4 * 3 * 5,), -1, dtype=torch.int32, device=DEV)
        launch((4, 3, 5), (out,), {}, (), {"num_warps": 1})
        assert torch.equal(out.cpu(), torch.arange(60, dtype=torch.int32))


@triton.jit
def _after_the_previous_program_kernel(out_ptr):
    i = tl.program_id(0)
    prev = tl.load(out_ptr + i - 1, mask=i > 0, other=0)
    tl.store(out_ptr + i, prev + 1)


@pytest.mark.skipif(CUDA, reason="reorders the Triton interpreter's programs")
def test_reversed_interpreter_grid_exposes_a_dependence_between_programs():
    """The helper the order-sensitivity tests use: a kernel reading what the program before it
    wrote counts up in the interpreter's order and not when its programs run last first."""
    from tests.helpers import reversed_interpreter_grid

    out = torch.zeros(6, dtype=torch.int32)
    _after_the_previous_program_kernel[(6,)](out)
    assert out.tolist() == [1, 2, 3, 4, 5, 6]
    out.zero_()
    with reversed_interpreter_grid() as ran:
        _after_the_previous_program_kernel[(6,)](out)
    assert ran[0] == 6 and out.tolist() == [1, 1, 1, 1, 1, 1]


class _StandInCompiledKernel:
    """What the JIT hands back after a compile, as far as `CachedLaunch` uses it: records `run`."""

    function = packed_metadata = None

    def __init__(self):
        self.grids = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, *args):
        self.grids.append((gx, gy, gz))


def _take_the_compiled_path(monkeypatch) -> None:
    """Launches take the compiled path (no interpreter, stream 0); skips where this Triton has no
    knobs (launches always go through the JIT)."""
    import gpu_kernels.launch as launch_module

    if launch_module._KNOBS is None:
        pytest.skip("this Triton has no knobs: launches always go through the JIT")
    monkeypatch.setattr(launch_module, "interpreted", lambda: False)
    monkeypatch.setattr(launch_module, "current_stream_handle", lambda: 0)
    # The stand-ins' names stay out of the process-wide record other tests read.
    monkeypatch.setattr(CachedLaunch, "jit_launch_keys", dict(CachedLaunch.jit_launch_keys))


def _stand_in_jit(monkeypatch, compiled):
    """A JIT function whose every launch hands back `compiled`, on the compiled path."""
    _take_the_compiled_path(monkeypatch)

    class _StandInJit:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: compiled

    return _StandInJit()


def test_cached_launch_hands_the_compiled_kernel_the_whole_grid(monkeypatch):
    """Runs without a GPU: the compiled path stood in for. It dropped the grid's z (launched
    `(x, y, 1)`), so SparDA's scores (grid `(tiles, Hkv, B)`) were computed for the first
    sequence only on CUDA while every interpreter test passed."""
    compiled = _StandInCompiledKernel()
    launch = CachedLaunch(_stand_in_jit(monkeypatch, compiled))
    jit_before = CachedLaunch.jit_launches
    for grid in ((4, 3, 5), (4, 3, 5), (7,), (7,), (2, 6), (2, 6)):
        launch(grid, (torch.zeros(8),), {"BLOCK": 64}, (len(grid),), {"num_warps": 1})
    assert launch.fast_launches == 3  # the first call of each variant compiled through the JIT
    assert CachedLaunch.jit_launches - jit_before == 3  # ... and counted there, process-wide
    launch((7,), (torch.zeros(8)[1:],), {"BLOCK": 64}, (1,), {"num_warps": 1})  # 4-byte aligned: a new key
    assert CachedLaunch.jit_launches - jit_before == 4 and launch.fast_launches == 3
    # ... named by kernel and key, so a run's stats say which specialisation the warm-up missed.
    assert any(name.endswith("variant=(1,) options={'num_warps': 1} args=[float32:u]")
               for name in CachedLaunch.jit_launch_keys), CachedLaunch.jit_launch_keys
    assert compiled.grids == [(4, 3, 5), (7, 1, 1), (2, 6, 1)]


def _declared_stand_in_jit(monkeypatch, compiled, rules: dict):
    """`_stand_in_jit` declaring Triton's parameter list: `rules` maps a parameter name to
    "dns" (`do_not_specialize`), "dnsoa" (`do_not_specialize_on_alignment`) or "" (specialised);
    then one constexpr, BLOCK."""
    from types import SimpleNamespace

    jit = _stand_in_jit(monkeypatch, compiled)
    jit.params = [SimpleNamespace(is_constexpr=False, do_not_specialize=r == "dns", do_not_specialize_on_alignment=r == "dnsoa")
                  for r in rules.values()] + [SimpleNamespace(is_constexpr=True, do_not_specialize=False,
                                                               do_not_specialize_on_alignment=False)]
    return jit


def test_what_the_kernel_does_not_specialise_never_sends_a_launch_through_the_jit(monkeypatch):
    """An argument the kernel declares `do_not_specialize` (a length, a task offset) or
    `do_not_specialize_on_alignment` (a ring row) may change class or alignment from step to step:
    Triton compiled one kernel for all of them, so the key must not tell them apart. Before, each
    new class went through the JIT after warm-up: 19-22 launches in a process's first runtime at
    4 x 32K on the H200, and one such launch made a device-started step wrong."""
    compiled = _StandInCompiledKernel()
    launch = CachedLaunch(_declared_stand_in_jit(monkeypatch, compiled,
                                                 {"ring": "dnsoa", "data": "", "row0": "dns", "offset": "dnsoa", "stride": ""}))
    ring, data = torch.zeros(64, dtype=torch.int32), torch.zeros(64)
    jit_before = CachedLaunch.jit_launches
    launch((4,), (ring, data, 16, 32, 48), {"BLOCK": 64}, (), {})  # the warm-up's call
    assert CachedLaunch.jit_launches - jit_before == 1
    # A misaligned ring row, row0 of every class, an offset that stops being a multiple of 16: fast.
    for row, row0, offset in ((1, 1, 33), (3, 7, 17), (2, 0, 5)):
        launch((4,), (ring[row:], data, row0, offset, 48), {"BLOCK": 64}, (), {})
    assert CachedLaunch.jit_launches - jit_before == 1 and launch.fast_launches == 3
    # What Triton does specialise still makes a new key: the data's alignment, the stride's class,
    # an offset equal to 1 (a constant to Triton), an integer past int32 (another type).
    launch((4,), (ring, data[1:], 16, 32, 48), {"BLOCK": 64}, (), {})
    launch((4,), (ring, data, 16, 32, 5), {"BLOCK": 64}, (), {})
    launch((4,), (ring, data, 16, 1, 48), {"BLOCK": 64}, (), {})
    launch((4,), (ring, data, 2 ** 31, 32, 48), {"BLOCK": 64}, (), {})
    assert CachedLaunch.jit_launches - jit_before == 5 and launch.fast_launches == 3
    # LaunchPlan keys its per-call arguments the same way: its first call finds the kernel through
    # `CachedLaunch` (no JIT), the second goes straight to it although its row and integers differ.
    plan = LaunchPlan(launch, (ring, data, 16, 32, 48), {"BLOCK": 64}, (), {}, per_call=(0, 2, 3))
    plan((4,), (ring[1:], data, 7, 17, 48))
    plan((4,), (ring[2:], data, 0, 5, 48))
    assert plan.fast_launches == 1 and CachedLaunch.jit_launches - jit_before == 5


def test_the_rules_are_the_kernels_own_declarations():
    """Read from Triton's parameter list on CUDA and from the interpreter's arguments here: the
    same positions, constexprs excluded."""
    from gpu_kernels.launch import NOT_ON_ALIGNMENT, NOT_SPECIALISED, SPECIALISED
    from gpu_kernels.step_inputs import _launch as step_inputs

    names = ["q_ptr", "q_s0", "q_s1", "q_s2", "k_ptr", "k_s0", "k_s1", "k_s2", "v_ptr", "v_s0", "v_s1", "v_s2",
             "n_q_rows", "HQ", "n_kv_rows", "HKV", "D", "scale", "qs_ptr", "qhost_ptr", "gq_ptr", "gout_ptr",
             "glse_ptr", "counts_ptr", "count_stride"]
    rules = dict(zip(names, step_inputs._rules, strict=True))
    assert rules["counts_ptr"] == NOT_ON_ALIGNMENT and rules["count_stride"] == NOT_SPECIALISED
    assert rules["scale"] == SPECIALISED
    assert CachedLaunch(_add_kernel)._rules == (SPECIALISED,) * 3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cached_launch_on_a_given_stream():
    launch = CachedLaunch(_add_kernel)
    s = torch.cuda.Stream()
    x = torch.randn(256, device=DEV)
    y = torch.empty_like(x)
    s.wait_stream(torch.cuda.current_stream())
    for _ in range(2):
        launch((4,), (x, y, 256), {"BLOCK": 64}, (64,), {"num_warps": 1}, s.cuda_stream)
    s.synchronize()
    assert torch.equal(y, x + 1.0) and launch.fast_launches == 1


# ---------------------------------------------------------------------------- LaunchPlan
def test_plan_refuses_per_call_positions_it_does_not_have():
    launch = CachedLaunch(_add_kernel)
    x = torch.zeros(8, device=DEV)
    for per_call in ((3,), (0, 0), (-1,)):
        with pytest.raises(ValueError, match="per_call"):
            LaunchPlan(launch, (x, x, 8), {"BLOCK": 64}, (64,), {"num_warps": 1}, per_call)


def test_plan_computes_what_the_jit_does_and_takes_a_new_variant_through_it():
    """Calls with the planned specialisation go straight to the compiled kernel (CUDA); a value that
    specialises otherwise (48: a multiple of 16) or a tensor at another alignment goes through
    `CachedLaunch`, and so does everything under the interpreter."""
    launch = CachedLaunch(_add_kernel)
    x0 = torch.randn(100, device=DEV)
    plan = LaunchPlan(launch, (x0, torch.empty_like(x0), 100), {"BLOCK": 64}, (64,), {"num_warps": 1}, (0, 1, 2))
    calls = [(100, 0), (100, 0), (37, 0), (48, 0), (48, 0), (100, 1)]  # (n, offset of x in its storage)
    for n, offset in calls:
        x = torch.randn(n + offset, device=DEV)[offset:]
        y = torch.full((n,), float("nan"), device=DEV)
        plan((triton.cdiv(n, 64),), (x, y, n))
        assert torch.equal(y.cpu(), (x + 1.0).cpu())
    # Fast: the second 100, 37 (specialises as 100), the second 48. Not: the first of each
    # specialisation (100 looked up after the JIT compiled it, 48, the unaligned x).
    assert plan.fast_launches == (3 if CUDA else 0)


def test_plan_runs_with_only_its_per_call_arguments_changed():
    launch = CachedLaunch(_add_kernel)
    x = torch.randn(64, device=DEV)
    y = torch.zeros(64, device=DEV)
    plan = LaunchPlan(launch, (x, y, 64), {"BLOCK": 64}, (64,), {"num_warps": 1}, (2,))
    for n in (64, 32, 32):  # only n changes: the first n elements of the planned y
        y.zero_()
        plan((1,), (x, y, n))
        assert torch.equal(y[:n].cpu(), (x[:n] + 1.0).cpu()) and not y[n:].any()


def test_plan_keeps_its_fixed_arguments_alive_and_not_the_per_call_ones():
    """The plan holds the tensors it packed once; the per-call ones are passed again by every call,
    and holding the first call's (a layer's arena view) kept a closed store's arena referenced."""
    import gc
    import weakref

    launch = CachedLaunch(_add_kernel)
    fixed = torch.zeros(64, device=DEV)
    per_call = torch.randn(64, device=DEV)
    plan = LaunchPlan(launch, (per_call, fixed, 64), {"BLOCK": 64}, (64,), {"num_warps": 1}, (0, 2))
    fixed_ref, per_call_ref = weakref.ref(fixed), weakref.ref(per_call)
    del fixed, per_call
    gc.collect()
    assert fixed_ref() is not None and per_call_ref() is None
    x = torch.randn(64, device=DEV)
    plan((1,), (x, fixed_ref(), 64))
    assert torch.equal(fixed_ref().cpu(), (x + 1.0).cpu())


def test_disabled_plans_launch_through_cached_launch():
    from gpu_kernels.launch import LaunchPlan as Plan

    launch = CachedLaunch(_add_kernel)
    x = torch.randn(64, device=DEV)
    y = torch.zeros(64, device=DEV)
    plan = Plan(launch, (x, y, 64), {"BLOCK": 64}, (64,), {"num_warps": 1}, ())
    Plan.enabled = False
    try:
        for _ in range(3):
            plan((1,), (x, y, 64))
    finally:
        Plan.enabled = True
    assert torch.equal(y.cpu(), (x + 1.0).cpu())
    assert plan.fast_launches == 0 and launch.fast_launches == (2 if CUDA else 0)


def test_plan_hands_the_compiled_kernel_the_whole_grid_and_addresses(monkeypatch):
    """Runs without a GPU, the compiled path stood in for: every grid dimension reaches the
    launcher, CUDA tensors as their addresses, other values as they are."""
    runs = []

    class _Compiled(_StandInCompiledKernel):
        def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, *args):
            runs.append(((gx, gy, gz), args))

    t = torch.zeros(8)
    plan = LaunchPlan(CachedLaunch(_stand_in_jit(monkeypatch, _Compiled())), (t, 5), {"BLOCK": 64}, (1,),
                      {"num_warps": 1}, (1,))
    for grid, n in (((4, 3, 5), 5), ((4, 3, 5), 7), ((2,), 9)):
        plan(grid, (t, n))
    assert plan.fast_launches == 2  # the first call looked the kernel up through CachedLaunch
    assert [r[0] for r in runs] == [(4, 3, 5), (2, 1, 1)]
    assert [r[1][1:] for r in runs] == [(7, 64), (9, 64)]


def test_launch_hooks_count_as_set_only_when_a_hook_is_there(monkeypatch):
    """Newer Tritons keep an empty hook chain where older ones kept None: neither is a hook."""
    import gpu_kernels.launch as launch_module

    if launch_module._KNOBS is None:
        pytest.skip("this Triton has no knobs")

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    def hook(*args):
        return None

    rt = launch_module._KNOBS.runtime
    for enter, leave, expected in ((None, None, (None, None)), (Chain([]), Chain([]), (None, None)),
                                   (hook, None, "set"), (Chain([hook]), Chain([]), "set")):
        monkeypatch.setattr(rt, "launch_enter_hook", enter)
        monkeypatch.setattr(rt, "launch_exit_hook", leave)
        got = launch_module._launch_hooks()
        assert got == (expected if expected != "set" else (enter, leave))


def test_plan_refuses_a_call_with_the_wrong_number_of_arguments():
    launch = CachedLaunch(_add_kernel)
    x = torch.zeros(8, device=DEV)
    plan = LaunchPlan(launch, (x, x, 8), {"BLOCK": 64}, (64,), {"num_warps": 1}, (0, 2))
    with pytest.raises(ValueError, match="2 arguments for a plan of 3"):
        plan((1,), (x, 8))


def test_plan_falls_back_to_the_jit_when_the_launcher_refuses_its_arguments(monkeypatch):
    """A Triton whose launcher takes other arguments: the planned call goes through the JIT from then on."""
    jit_calls = []

    class _Refusing(_StandInCompiledKernel):
        def run(self, *args):
            raise TypeError("launcher signature differs")

    compiled = _Refusing()

    class _CountingJit:
        def __getitem__(self, grid):
            def call(*args, **kwargs):
                jit_calls.append(grid)
                return compiled
            return call

    _take_the_compiled_path(monkeypatch)
    launch = CachedLaunch(_CountingJit())
    t = torch.zeros(8)
    plan = LaunchPlan(launch, (t, 5), {"BLOCK": 64}, (1,), {"num_warps": 1}, (1,))
    plan._kernels[_specialization((5,))] = compiled  # as a first call would have left it (the key of 5)
    plan((2,), (t, 5))
    assert launch._broken and plan.fast_launches == 0 and not plan._kernels
    assert jit_calls == [(2,)]
