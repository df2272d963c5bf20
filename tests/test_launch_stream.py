"""A launch handed the default stream's handle stays on the default stream, through the JIT too.

`CachedLaunch` sends a call it has no compiled kernel for through Triton's JIT with
`torch.cuda.stream(torch.cuda.ExternalStream(handle))` current, and torch makes
`ExternalStream(0)` -- the legacy default stream's handle -- a new stream from its pool
(torch/csrc/cuda/Stream.cpp: a zero `stream_ptr` means "from the pool"; pool streams are
non-blocking), not stream 0. `decode` on the default stream passes its handle, 0, to the
step-inputs launch, so the first launch of a new key ran off the caller's stream: at once, ahead of
the wait for the previous layer-step's trailing CPU lane, writing the next layer's q into the pinned
buffer that lane's last tasks still read (the first device-started runtime of each process was
wrong at layer-step 0 on the H200; benchmarks/notes/e2e_overlap.md section 22). `CachedLaunch`
now launches through the JIT on the current stream when it is the one asked for, and makes the
default stream itself current for a handle of 0 otherwise.

Without CUDA, torch's streams are emulated here as the JIT branch sees them, and the kernels run
under Triton's interpreter (every call goes through the JIT there), recording the stream that was
current at each launch.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from gpu_kernels import launch as launch_module
from gpu_kernels import nonfinite_counts, step_inputs, streams
from gpu_kernels.launch import CachedLaunch

POOL = 0x7F00  # the first handle the emulated pool gives
# The emulation runs the kernels under Triton's interpreter; on CUDA they compile (and the last test
# checks the order on the device itself).
emulated_only = pytest.mark.skipif(torch.cuda.is_available(), reason="emulates torch's streams without CUDA")


class _TorchStreams:
    """torch's current CUDA stream, as `torch.cuda.stream`, `ExternalStream` and the raw current
    handle show it: 0 (the default stream) until a stream context makes another current."""

    def __init__(self) -> None:
        self.current = 0
        self._next = POOL

    def external(self, stream_ptr: int, device=None, **kwargs) -> SimpleNamespace:
        if stream_ptr:  # at::cuda::getStreamFromExternal
            return SimpleNamespace(cuda_stream=stream_ptr)
        handle, self._next = self._next, self._next + 8  # stream_ptr 0: at::cuda::getStreamFromPool
        return SimpleNamespace(cuda_stream=handle)

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s.cuda_stream
        try:
            yield s
        finally:
            self.current = prev


class _Recording:
    """A Triton function whose launches record the stream current when they are made."""

    def __init__(self, fn, torch_streams: _TorchStreams, seen: list) -> None:
        self._fn, self._streams, self._seen = fn, torch_streams, seen

    def __getitem__(self, grid):
        run = self._fn[grid]

        def launch(*args, **kwargs):
            self._seen.append(self._streams.current)
            return run(*args, **kwargs)

        return launch

    def __getattr__(self, name):
        return getattr(self._fn, name)


@pytest.fixture
def emulated(monkeypatch):
    """(torch's emulated streams, the stream current at each launch of the two kernels)."""
    ts, seen = _TorchStreams(), []
    monkeypatch.setattr(torch.cuda, "ExternalStream", ts.external)
    monkeypatch.setattr(torch.cuda, "stream", ts.stream)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(streams, "current_stream_handle", lambda: ts.current)
    monkeypatch.setattr(launch_module, "current_stream_handle", lambda: ts.current)
    for module in (step_inputs, nonfinite_counts):
        monkeypatch.setattr(module._launch, "fn", _Recording(module._launch.fn, ts, seen))
    return ts, seen


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, 64, generator=g) for h in (8, 2, 2))
    return q, k, v


@emulated_only
def test_the_emulation_is_torchs_an_external_handle_of_0_is_a_pool_stream(emulated):
    ts, _ = emulated
    assert torch.cuda.ExternalStream(0).cuda_stream >= POOL
    assert torch.cuda.ExternalStream(0x55).cuda_stream == 0x55


@emulated_only
@pytest.mark.parametrize("current", [0, 0x55])
def test_the_step_inputs_launch_on_the_callers_stream_runs_there_through_the_jit(emulated, current):
    """What `decode` does each layer-step: `StepInputsPlan` with the caller's (current) stream's handle."""
    ts, seen = emulated
    ts.current = current
    q, k, v = _inputs()
    qs, q_host = torch.empty(3, 8, 64), torch.zeros(3 * 8 * 64)
    counts = torch.zeros((step_inputs.N_COUNTS, step_inputs.count_columns(24)), dtype=torch.int32)
    plan = step_inputs.StepInputsPlan()
    for _ in range(2):  # the plan's first call, then a planned one (every call takes the JIT here)
        plan(q, k, v, 0.125, qs, q_host=q_host, counts=counts, stream=current)
    step_inputs.prepare_step_inputs(q, k, v, 0.125, qs, q_host=q_host, counts=counts, stream=current)
    assert seen == [current] * 3, f"launched on {[hex(s) for s in seen]}, not the caller's stream {current:#x}"
    torch.testing.assert_close(q_host.view(3, 8, 64), q * 0.125)


@emulated_only
def test_the_deferred_checks_own_launch_on_the_callers_stream_runs_there_through_the_jit(emulated):
    ts, seen = emulated
    q, k, v = _inputs()
    out = torch.zeros((nonfinite_counts.MAX_TENSORS, nonfinite_counts.SPLITS), dtype=torch.int32)
    nonfinite_counts.count_nonfinite((q, k, v), out, 0, validate=False)
    assert seen == [0], f"launched on {[hex(s) for s in seen]}, not the default stream"


@emulated_only
def test_another_streams_handle_is_kept(emulated):
    ts, seen = emulated
    q, k, v = _inputs()
    qs = torch.empty(3, 8, 64)
    step_inputs.prepare_step_inputs(q, k, v, 0.125, qs, stream=0x99)  # a side stream, not the current one
    assert seen == [0x99]


@emulated_only
def test_the_default_streams_handle_is_the_default_stream_while_another_is_current(emulated):
    """A handle of 0 handed to a launch while a side stream is current: the JIT launch runs on stream 0."""
    ts, seen = emulated
    ts.current = 0x55
    q, k, v = _inputs()
    out = torch.zeros((nonfinite_counts.MAX_TENSORS, nonfinite_counts.SPLITS), dtype=torch.int32)
    jit_before = CachedLaunch.jit_launches
    nonfinite_counts.count_nonfinite((q, k, v), out, 0, validate=False)
    assert seen == [0] and ts.current == 0x55 and CachedLaunch.jit_launches > jit_before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_jit_launch_handed_the_default_stream_runs_behind_its_work():
    """The mechanism itself: torch's `ExternalStream(0)` is not stream 0, and a launch through the JIT
    handed 0 runs after what stream 0 holds (a fill behind a long sleep), not before it."""
    import triton
    import triton.language as tl

    assert torch.cuda.ExternalStream(0).cuda_stream != 0  # a stream from torch's pool

    @triton.jit
    def _plus_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)

    with torch.cuda.stream(torch.cuda.default_stream()):
        x, y = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")
        CachedLaunch(_plus_one)((1,), (x, y, 64), {"BLOCK": 64}, (), {}, 0)  # compiled: Triton's cache has it
        torch.cuda.synchronize()
        # A new CachedLaunch has no kernel of its own: its first call goes through the JIT, which finds
        # the compiled kernel (no compile, which would outlast the sleep) and launches it.
        launch = CachedLaunch(_plus_one)
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU cycles on stream 0
        x.fill_(5.0)
        jit_before = CachedLaunch.jit_launches
        launch((1,), (x, y, 64), {"BLOCK": 64}, (), {}, 0)  # first call: through the JIT
        assert CachedLaunch.jit_launches == jit_before + 1
        torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 6.0)), "the JIT launch ran ahead of stream 0's fill"
