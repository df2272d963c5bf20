"""Cached Triton launches: the key covers what Triton specialises on; with CUDA the second call
of a variant bypasses the JIT and computes the same result."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpu_kernels.launch import CachedLaunch, _specialization  # noqa: E402

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


def test_cached_launch_hands_the_compiled_kernel_the_whole_grid(monkeypatch):
    """Runs without a GPU: the compiled path stood in for. It dropped the grid's z (launched
    `(x, y, 1)`), so SparDA's scores (grid `(tiles, Hkv, B)`) were computed for the first
    sequence only on CUDA while every interpreter test passed."""
    import gpu_kernels.launch as launch_module

    if launch_module._KNOBS is None:
        pytest.skip("this Triton has no knobs: CachedLaunch always goes through the JIT")
    compiled = _StandInCompiledKernel()

    class _StandInJit:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: compiled

    monkeypatch.setattr(launch_module, "interpreted", lambda: False)
    monkeypatch.setattr(launch_module, "current_stream_handle", lambda: 0)
    launch = CachedLaunch(_StandInJit())
    for grid in ((4, 3, 5), (4, 3, 5), (7,), (7,), (2, 6), (2, 6)):
        launch(grid, (torch.zeros(8),), {"BLOCK": 64}, (len(grid),), {"num_warps": 1})
    assert launch.fast_launches == 3  # the first call of each variant compiled through the JIT
    assert compiled.grids == [(4, 3, 5), (7, 1, 1), (2, 6, 1)]


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
