"""A decode step's inputs made ready in one launch: scaled q where each lane reads it, the GPU
lane's results cleared, and the NaN/inf counts of q, k, v.

Before the lanes can start, a step on CUDA needs q scaled to fp32 on the device (the window),
in pinned host memory (the CPU workers) and in the GPU lane's buffer; the GPU lane's results
cleared (out 0, lse -inf); and, under `scheduler.finite_check: sync`, q, k and v checked for
NaN/inf before anything changes. As separate torch ops that was a copy, a multiply, three
device-to-host copies, two clears and a host check of the copies: ~0.3-0.4 ms of the launcher's
host time per layer on the H200 host, most of the time before the first CPU task at 4 x 32K
(benchmarks/notes/gpu_lane.md section 18). The CPU lane's results are cleared on the host, as
before: the GPU reads them through UVA after the workers wrote them, and a line this kernel
wrote there could be what a later kernel reads instead. Here it is one launch: program p takes `ROWS` rows
`(b, h)` of q and writes each destination, and counts the NaN/inf values of its q rows and of
the same row numbers of k and v into column p of `counts` (a UVA view of pinned host memory, so
the host reads them once an event after the launch has completed: `counts.sum(axis=1)`). Every
cell of the counts is written by exactly one program, so they need no clearing.

The q count is taken on the scaled fp32 values (what the CPU workers and the window read: a
float64 q beyond float32's range counts), k and v in their own dtypes (a float64 beyond
float32's range is finite), as the host check of the copies did (`input_check.check_finite_host`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import KV_DTYPES, cdiv, next_pow2
from gpu_kernels.launch import CachedLaunch, LaunchPlan
from gpu_kernels.nonfinite_counts import nonfinite

ROWS = 4  # (b, h) rows of q per program
N_COUNTS = 3  # q, k, v
IN_DTYPES = KV_DTYPES + (torch.float64,)


@triton.jit
def _bad(x, xf, mask):
    """NaN/inf values of `x` (its fp32 value `xf`) under `mask`, as the deferred check counts them."""
    return tl.sum(tl.sum((nonfinite(x, xf) & mask).to(tl.int32), axis=1), axis=0)


@triton.jit(do_not_specialize=["q_s0", "q_s1", "q_s2", "k_s0", "k_s1", "k_s2", "v_s0", "v_s1", "v_s2",
                               "n_q_rows", "HQ", "n_kv_rows", "HKV", "D", "count_stride"],
            do_not_specialize_on_alignment=["q_ptr", "k_ptr", "v_ptr", "qs_ptr", "qhost_ptr", "gq_ptr", "gout_ptr",
                                            "glse_ptr", "counts_ptr"])
def _step_inputs_kernel(
    q_ptr, q_s0, q_s1, q_s2, k_ptr, k_s0, k_s1, k_s2, v_ptr, v_s0, v_s1, v_s2,
    n_q_rows, HQ, n_kv_rows, HKV, D, scale,
    qs_ptr, qhost_ptr, gq_ptr, gout_ptr, glse_ptr, counts_ptr, count_stride,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HOST: tl.constexpr, LANE: tl.constexpr, COUNT: tl.constexpr,
):
    p = tl.program_id(0)
    r = p * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    rmask = r < n_q_rows
    mask = rmask[:, None] & dmask[None, :]
    b = r // HQ
    h = r - b * HQ
    x = tl.load(q_ptr + b.to(tl.int64)[:, None] * q_s0 + h.to(tl.int64)[:, None] * q_s1
                + d.to(tl.int64)[None, :] * q_s2, mask=mask, other=0.0)
    xs = x.to(tl.float32) * scale
    off = r.to(tl.int64)[:, None] * D + d[None, :]
    tl.store(qs_ptr + off, xs, mask=mask)
    if HOST:
        tl.store(qhost_ptr + off, xs, mask=mask)
    if LANE:
        tl.store(gq_ptr + off, xs, mask=mask)
        tl.store(gout_ptr + off, tl.zeros([ROWS, BLOCK_D], dtype=tl.float32), mask=mask)
        tl.store(glse_ptr + r, tl.full([ROWS], float("-inf"), tl.float32), mask=rmask)
    if COUNT:
        cq = _bad(xs, xs, mask)
        # The same row numbers of k and v (they have fewer rows than q: every row is some program's).
        kmask = (r < n_kv_rows)[:, None] & dmask[None, :]
        bk = r // HKV
        hk = r - bk * HKV
        kx = tl.load(k_ptr + bk.to(tl.int64)[:, None] * k_s0 + hk.to(tl.int64)[:, None] * k_s1
                     + d.to(tl.int64)[None, :] * k_s2, mask=kmask, other=0.0)
        ck = _bad(kx, kx.to(tl.float32), kmask)
        vx = tl.load(v_ptr + bk.to(tl.int64)[:, None] * v_s0 + hk.to(tl.int64)[:, None] * v_s1
                     + d.to(tl.int64)[None, :] * v_s2, mask=kmask, other=0.0)
        cv = _bad(vx, vx.to(tl.float32), kmask)
        tl.store(counts_ptr + p, cq)
        tl.store(counts_ptr + count_stride + p, ck)
        tl.store(counts_ptr + 2 * count_stride + p, cv)


def count_columns(max_q_rows: int) -> int:
    """Columns of the `counts` buffer for steps of up to `max_q_rows` rows `(b, h)` of q: one per program."""
    return max(1, cdiv(max_q_rows, ROWS))


def prepare_step_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, qs: torch.Tensor, *,
    q_host: torch.Tensor | None = None, lane: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    counts: torch.Tensor | None = None,
    stream: int | None = None, validate: bool = True,
) -> None:
    """Queue one launch that writes `qs = float32(q) * scale` (q `[B, Hq, D]`, k, v `[B, Hkv, D]`, any
    float dtype and strides) and, where given: the same into `q_host` (a UVA view of pinned host
    memory); into `lane = (gq, gout, glse)`'s gq, clearing gout to 0 and glse to -inf; the NaN/inf counts of q
    (scaled), k and v into `counts` (int32 `[3, C]`, `C >= count_columns(B * Hq)`, contiguous):
    tensor i has `counts[i, :count_columns(B * Hq)].sum()`. Every destination is contiguous fp32,
    `[B, Hq, D]` (lse `[B, Hq]`, or flat of those sizes). Nothing waits: read `counts` once an
    event recorded after the launch has completed. `stream`: a raw CUDA stream handle (default: the
    current stream). `validate=False` skips the checks (the runtime's own buffers, inputs checked)."""
    b, hq, d = q.shape
    n = b * hq
    if validate:
        for name, x in (("q", q), ("k", k), ("v", v)):  # any strides: read in place
            if x.dtype not in IN_DTYPES or x.dim() != 3 or x.device != q.device:
                raise ValueError(f"{name} has shape {tuple(x.shape)}, dtype {x.dtype} on {x.device}; expected "
                                 f"[B, H, D] of one of {[str(t) for t in IN_DTYPES]} on {q.device}")
            if name != "q" and (x.shape[0] != b or x.shape[2] != d or hq % max(1, x.shape[1])):
                raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [{b}, Hkv, {d}] with Hkv dividing {hq}")
        outs = [("qs", qs, n * d), ("q_host", q_host, n * d)]
        if lane is not None:
            outs += [("gq", lane[0], n * d), ("gout", lane[1], n * d), ("glse", lane[2], n)]
        for name, t, numel in outs:
            if t is not None and (t.dtype != torch.float32 or t.numel() != numel or not t.is_contiguous()):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, dtype {t.dtype}; expected {numel} contiguous "
                                 "float32 values")
        if counts is not None and (counts.dim() != 2 or counts.shape[0] != N_COUNTS or counts.dtype != torch.int32
                                   or counts.shape[1] < count_columns(n) or not counts.is_contiguous()):
            raise ValueError(f"counts has shape {tuple(counts.shape)}, dtype {counts.dtype}; expected contiguous "
                             f"int32 [{N_COUNTS}, >= {count_columns(n)}]")
    grid, args, constexprs, variant = _call(q, k, v, scale, qs, q_host, lane, counts)
    _launch(grid, args, constexprs, variant, _OPTIONS, stream)


def _args(q, k, v, scale, qs, q_host, lane, counts) -> tuple:
    b, hq, d = q.shape
    hkv = k.shape[1]
    gq, gout, glse = lane if lane is not None else (qs, qs, qs)
    return (q, q.stride(0), q.stride(1), q.stride(2), k, k.stride(0), k.stride(1), k.stride(2),
            v, v.stride(0), v.stride(1), v.stride(2), b * hq, hq, b * hkv, hkv, d, float(scale),
            qs, qs if q_host is None else q_host, gq, gout, glse,
            qs if counts is None else counts, 0 if counts is None else counts.shape[1])


def _call(q, k, v, scale, qs, q_host, lane, counts) -> tuple[tuple, tuple, dict, tuple]:
    args = _args(q, k, v, scale, qs, q_host, lane, counts)
    constexprs = dict(ROWS=ROWS, BLOCK_D=next_pow2(q.shape[2]), HOST=q_host is not None, LANE=lane is not None,
                      COUNT=counts is not None)
    variant = (q.dtype, k.dtype, v.dtype, tuple(constexprs.values()))
    return _grid(q), args, constexprs, variant


def _grid(q) -> tuple[int]:
    return (count_columns(q.shape[0] * q.shape[1]),)


class StepInputsPlan:
    """`prepare_step_inputs(..., validate=False)` planned once per variant (`LaunchPlan`: a few
    microseconds of host time a call where the plain call costs tens): the runtime's one launch
    before its lanes start, on every decode step."""

    def __init__(self) -> None:
        self._plans: dict[tuple, LaunchPlan] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, qs: torch.Tensor, *,
                 q_host: torch.Tensor | None = None,
                 lane: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 counts: torch.Tensor | None = None, stream: int | None = None) -> None:
        """As `prepare_step_inputs` with `validate=False`: the caller's buffers, inputs checked."""
        key = (q.dtype, k.dtype, v.dtype, q_host is not None, lane is not None, counts is not None, q.shape[2])
        plan = self._plans.get(key)
        if plan is None:
            # Every argument may change: q, k and v come from the model each step.
            grid, args, constexprs, variant = _call(q, k, v, scale, qs, q_host, lane, counts)
            plan = self._plans[key] = LaunchPlan(_launch, args, constexprs, variant, _OPTIONS,
                                                 tuple(range(len(args))))
        else:
            grid, args = _grid(q), _args(q, k, v, scale, qs, q_host, lane, counts)
        plan(grid, args, stream)


_OPTIONS = {"num_warps": 1}
_launch = CachedLaunch(_step_inputs_kernel)

__all__ = ["N_COUNTS", "ROWS", "StepInputsPlan", "count_columns", "prepare_step_inputs"]
