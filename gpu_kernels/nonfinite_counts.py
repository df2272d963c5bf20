"""Count the NaN/inf values of up to four `[B, H, D]` tensors in one launch, without the host waiting.

The decode step's input check (q, k, v and SparDA's lookahead) used to be one `aminmax` per
tensor, a stack and one flag read back to the host: a device synchronisation per call, and ~15
launches (benchmarks/notes/gpu_lane.md section 7). A step without a CPU lane has nothing else to
wait for, so that read was the host's one wait for the device before the step. Here the counts
land in a row of `out` -- a UVA view of pinned host memory -- and the host reads them later, once
an event recorded after the launch has completed (`hybrid_runtime.input_check.DeferredInputCheck`).

Program (t, s) counts the values of tensor t in rows `s, s + SPLITS, ...` (a row is one (b, h)
pair, D values) and writes its count to `out[t, s]`: every cell of the `[4, SPLITS]` row is
written by exactly one program (unused tensors count 0 rows), so the row needs no clearing and
no atomic, and the counts are exact (`out[t].sum()`). Any float dtype: a float64 beyond float32's
range counts as finite. Strided inputs are read in place: no contiguous copy, no allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import next_pow2
from gpu_kernels.launch import CachedLaunch

# Programs per tensor: the inputs are small (q of a batch of 8 at 32 heads x 128: 32K values),
# so a few programs each keep the launch to one wave of a few microseconds.
SPLITS = 8
MAX_TENSORS = 4
ROWS = 4  # (b, h) rows a program reads per iteration


@triton.jit
def nonfinite(x, xf):
    """Where `x` (its value in float32: `xf`) is NaN or +-inf. Compared in float32 (exact for the
    16-bit floats; Triton's interpreter compares bf16 by its bits, so NaN == NaN there), but an
    infinity only counts if it is the value itself: a float64 beyond float32's range becomes inf in
    float32 and is finite."""
    return (xf != xf) | ((tl.abs(xf) == float("inf")) & (xf.to(x.dtype) == x))


@triton.jit
def _count_rows(x_ptr, n_rows, H, s0, s1, s2, split, D, SPLITS: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """NaN/inf values in this program's rows of one `[B, H, D]` tensor (`n_rows = B * H`)."""
    count = tl.zeros([ROWS, BLOCK_D], dtype=tl.int32)
    d = tl.arange(0, BLOCK_D)
    r0 = tl.arange(0, ROWS)
    for start in tl.range(split * ROWS, n_rows, SPLITS * ROWS):
        r = start + r0
        b = r // H
        h = r - b * H
        mask = (r < n_rows)[:, None] & (d < D)[None, :]
        off = b.to(tl.int64)[:, None] * s0 + h.to(tl.int64)[:, None] * s1 + d.to(tl.int64)[None, :] * s2
        x = tl.load(x_ptr + off, mask=mask, other=0.0)
        count += (nonfinite(x, x.to(tl.float32)) & mask).to(tl.int32)
    return tl.sum(tl.sum(count, axis=1), axis=0)


@triton.jit(do_not_specialize=["n0", "h0", "a0", "b0", "c0", "n1", "h1", "a1", "b1", "c1",
                               "n2", "h2", "a2", "b2", "c2", "n3", "h3", "a3", "b3", "c3", "D"],
            do_not_specialize_on_alignment=["x0", "x1", "x2", "x3", "out_ptr"])
def _nonfinite_kernel(x0, n0, h0, a0, b0, c0, x1, n1, h1, a1, b1, c1, x2, n2, h2, a2, b2, c2,
                      x3, n3, h3, a3, b3, c3, D, out_ptr,
                      SPLITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    s = tl.program_id(1)
    if t == 0:
        c = _count_rows(x0, n0, h0, a0, b0, c0, s, D, SPLITS, ROWS, BLOCK_D)
    elif t == 1:
        c = _count_rows(x1, n1, h1, a1, b1, c1, s, D, SPLITS, ROWS, BLOCK_D)
    elif t == 2:
        c = _count_rows(x2, n2, h2, a2, b2, c2, s, D, SPLITS, ROWS, BLOCK_D)
    else:
        c = _count_rows(x3, n3, h3, a3, b3, c3, s, D, SPLITS, ROWS, BLOCK_D)
    tl.store(out_ptr + t * SPLITS + s, c)


def count_nonfinite(tensors: tuple[torch.Tensor, ...], out: torch.Tensor, stream: int | None = None,
                    validate: bool = True) -> None:
    """Queue the count of NaN/inf values of each of `tensors` (1 to 4, each `[B, H, D]`, any float
    dtype and strides, one device, one D) into `out` (int32 `[MAX_TENSORS, SPLITS]`, contiguous,
    on the tensors' device or a UVA view of pinned host memory): tensor i has `out[i].sum()`.
    Nothing waits: read `out` once the launch has ended (an event after it). `stream`: a raw
    CUDA stream handle (default: the current stream). `validate=False` skips the checks, for the
    runtime passing inputs `decode` has checked and its own ring row."""
    n = len(tensors)
    d = tensors[0].shape[2]
    if validate:
        if not 1 <= n <= MAX_TENSORS:
            raise ValueError(f"count_nonfinite takes 1 to {MAX_TENSORS} tensors, got {n}")
        for i, x in enumerate(tensors):
            if x.dim() != 3 or x.shape[2] != d or x.device != tensors[0].device:
                raise ValueError(f"tensor {i} has shape {tuple(x.shape)} on {x.device}; expected [B, H, {d}] on "
                                 f"{tensors[0].device} like tensor 0")
        if tuple(out.shape) != (MAX_TENSORS, SPLITS) or out.dtype != torch.int32 or not out.is_contiguous():
            raise ValueError(f"out has shape {tuple(out.shape)}, dtype {out.dtype}; expected contiguous int32 "
                             f"[{MAX_TENSORS}, {SPLITS}]")
    args: list = []
    for i in range(MAX_TENSORS):
        x = tensors[i] if i < n else tensors[0]
        rows = x.shape[0] * x.shape[1] if i < n else 0  # a missing tensor counts no row
        args += [x, rows, max(1, x.shape[1]), x.stride(0), x.stride(1), x.stride(2)]
    args += [d, out]
    constexprs = dict(SPLITS=SPLITS, ROWS=ROWS, BLOCK_D=next_pow2(max(1, d)))
    variant = (tuple(x.dtype for x in tensors), n, tuple(constexprs.values()))
    _launch((MAX_TENSORS, SPLITS), tuple(args), constexprs, variant, {"num_warps": 1}, stream)


_launch = CachedLaunch(_nonfinite_kernel)

__all__ = ["MAX_TENSORS", "SPLITS", "count_nonfinite"]
