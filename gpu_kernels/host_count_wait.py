"""Hold a CUDA stream, on the device, until a counter in pinned host memory reaches a target.

Why: a decode step's merge needs the CPU workers' results, and the host used to wait for the
workers before it queued the merge, so the model's next layer could not be issued while they ran
(its Python and launches, ~1.2-1.5 ms a layer through `generate`, then came on top of the
attention). With this wait the host queues the merge at once; the stream reaches the merge only
once the workers have counted every task done.

One program of one warp polls the counter through a UVA view of the pinned control words with
volatile loads (each one a read across the link, about a microsecond). The program also ends when
a release word reaches the wait's ticket (the host gave the tasks up: a timed-out step), when the
stop word is set (the workers were stopped), or after `max_polls` polls: whatever the CPU side
does, the stream never waits forever. The loads are ordered after the workers' writes because the
workers count a task done with a sequentially consistent atomic add after writing its results; the
merge is a later kernel on the same stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import check_tensor, interpreted
from gpu_kernels.launch import CachedLaunch


@triton.jit
def _load_fresh(ptr):
    # `ld.global.cv`: a load of system memory that discards a matching L2 line and fetches it
    # again. Volatile loads (`ld.volatile`) were served from a line the previous step's wait had
    # cached, so a wait saw that step's final count and let the merge read results the workers
    # had not written yet (measured: one step in twenty, deterministic for a given run).
    return tl.inline_asm_elementwise("ld.global.cv.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _poll(ptr, COMPILED: tl.constexpr):
    if COMPILED:
        return _load_fresh(ptr)
    else:  # the interpreter runs no PTX; its loads read host memory as it is
        return tl.load(ptr, volatile=True)


@triton.jit(do_not_specialize=["target", "ticket", "max_polls"])
def _wait_kernel(ctrl_ptr, target, ticket, max_polls, COUNT: tl.constexpr, RELEASE: tl.constexpr,
                 STOP: tl.constexpr, COMPILED: tl.constexpr):
    count = _poll(ctrl_ptr + COUNT, COMPILED)
    release = _poll(ctrl_ptr + RELEASE, COMPILED)
    stop = _poll(ctrl_ptr + STOP, COMPILED)
    polls = 0
    while (count < target) & (release < ticket) & (stop == 0) & (polls < max_polls):
        count = _poll(ctrl_ptr + COUNT, COMPILED)
        release = _poll(ctrl_ptr + RELEASE, COMPILED)
        stop = _poll(ctrl_ptr + STOP, COMPILED)
        polls += 1
    if COMPILED:
        # An acquire at system scope: the stream's later kernels see what the workers wrote
        # before they counted (their results; the merge also gets them by a copy).
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.b32 $0, $1;", "=r,r", [polls], dtype=tl.int32,
                                  is_pure=False, pack=1)


def wait_for_count(ctrl: torch.Tensor, count_index: int, target: int, *, release_index: int, ticket: int,
                   stop_index: int, max_polls: int, stream: int | None = None, validate: bool = True) -> None:
    """Queue a wait on `stream` (raw handle; None: the current stream) that ends once
    `ctrl[count_index] >= target`, `ctrl[release_index] >= ticket`, `ctrl[stop_index] != 0`, or
    after `max_polls` polls. `ctrl`: int64 words, on CUDA a UVA view of pinned host memory (the
    host and the CPU workers write them while the wait runs)."""
    if validate:
        check_tensor("ctrl", ctrl, dims=1, dtypes=(torch.int64,), contiguous=True)
        n = ctrl.shape[0]
        for name, i in (("count_index", count_index), ("release_index", release_index), ("stop_index", stop_index)):
            if not 0 <= i < n:
                raise IndexError(f"{name} {i} is outside ctrl's {n} words")
        if max_polls < 1:
            raise ValueError(f"max_polls is {max_polls}; expected at least 1")
    compiled = not interpreted()
    _launch((1,), (ctrl, int(target), int(ticket), int(max_polls)),
            {"COUNT": count_index, "RELEASE": release_index, "STOP": stop_index, "COMPILED": compiled},
            (count_index, release_index, stop_index, compiled), {"num_warps": 1}, stream)


_launch = CachedLaunch(_wait_kernel)

__all__ = ["wait_for_count"]
