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
    for n in (100, 100, 37):
        x = torch.randn(n, device=DEV)
        y = torch.full((n,), float("nan"), device=DEV)
        launch((triton.cdiv(n, 64),), (x, y, n), {"BLOCK": 64}, (64,), {"num_warps": 1})
        assert torch.equal(y.cpu(), (x + 1.0).cpu())
    if CUDA:  # the repeated variant went straight to the compiled kernel
        assert launch.fast_launches == 1
    else:  # the interpreter always goes through the JIT
        assert launch.fast_launches == 0


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
