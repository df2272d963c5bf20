"""Dense decode attention over each sequence's GPU window (sinks + recent + generated tokens).

Batched over sequences, GQA-aware (one program serves the G query heads of a KV head, so the
window's K and V are read once per group), variable lengths (each batch row has its own valid
prefix), and split-K over the window when batch x KV heads alone would leave SMs idle.

One launch does everything: with several splits, each program writes its partial `(out, lse)`,
then bumps a per-row arrival counter; the program that arrives last reduces the row's partials
and resets the counter to zero for the next call. A decode step is latency-bound (tens of
microseconds), so saving the second launch of a separate combine matters as much as the kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import KV_DTYPES, cdiv, check_head_dim, check_tensor, dot_in_fp32, dot_precision, next_pow2
from gpu_kernels.launch import CachedLaunch
from gpu_kernels.online_softmax import masked_scores, softmax_result, softmax_tile


# The split count, span and split length change from step to step (the window grows), and the
# scratch and index views move with the batch: none of them may pick a compiled variant, or a
# decode step would stop to compile one (hundreds of ms). `MULTI` (one split or several) is the
# only shape choice; both variants are compiled at the runtime's warm-up.
@triton.jit(do_not_specialize=["SPLIT_LEN", "SPAN", "N_SPLITS"],
            do_not_specialize_on_alignment=["slots_ptr", "lens_ptr", "part_out_ptr", "part_lse_ptr", "counter_ptr"])
def _window_attn_kernel(
    q_ptr, stride_qb, stride_qh,
    k_ptr, v_ptr, stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    slots_ptr, lens_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    HKV, SPLIT_LEN, SPAN, N_SPLITS,
    MULTI: tl.constexpr, BLOCK_S: tl.constexpr,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    r = tl.program_id(0)  # batch row * HKV + kv head
    s = tl.program_id(1)
    b = r // HKV
    kvh = r % HKV
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # Clamped to the span the grid covers, so a bad length can never read past the window.
    length = tl.minimum(tl.load(lens_ptr + b), SPAN)
    start = s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + (kvh * G + g)[:, None].to(tl.int64) * stride_qh + d[None, :],
        mask=gmask[:, None], other=0.0,
    )
    if DOT_FP32:
        q_mm = q
    else:
        q_mm = q.to(k_ptr.dtype.element_ty)  # bf16 operands like flash attention; fp32 accumulate
    k_base = k_ptr + slot * stride_ks + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        idx = n0 + n
        valid = idx < end
        k = tl.load(k_base + idx[:, None] * stride_kn + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_base + idx[:, None] * stride_vn + d[None, :], mask=valid[:, None], other=0.0)
        sc = masked_scores(q_mm, k, valid, DOT_FP32, DOT_PRECISION)
        m_i, l_i, acc = softmax_tile(sc, v, m_i, l_i, acc, DOT_FP32, DOT_PRECISION)

    o, lse = softmax_result(m_i, l_i, acc)
    final = r.to(tl.int64) * G + g  # == b * Hq + kvh * G + g
    if not MULTI:
        tl.store(out_ptr + final[:, None] * D + d[None, :], o, mask=gmask[:, None])
        tl.store(lse_ptr + final, lse, mask=gmask)
    else:
        part = (r.to(tl.int64) * N_SPLITS + s) * G + g
        tl.store(part_out_ptr + part[:, None] * D + d[None, :], o, mask=gmask[:, None])
        tl.store(part_lse_ptr + part, lse, mask=gmask)
        # Every thread's partial stores complete before the (release) arrival below.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + r, 1, sem="acq_rel")
        if arrived == N_SPLITS - 1:
            # Last program of the row: reduce all splits. `.cg` reads from L2, where the other
            # programs' partials are (never stale L1 lines).
            sidx = tl.arange(0, BLOCK_S)
            rows = (r.to(tl.int64) * N_SPLITS + sidx)[:, None] * G + g[None, :]  # [BLOCK_S, BLOCK_G]
            lmask = (sidx < N_SPLITS)[:, None] & gmask[None, :]
            lse_all = tl.load(part_lse_ptr + rows, mask=lmask, other=float("-inf"), cache_modifier=".cg")
            m_all = tl.max(lse_all, axis=0)
            m_all_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
            tot = tl.sum(tl.exp(lse_all - m_all_safe[None, :]), axis=0)
            has_all = tot > 0.0
            lse_fin = tl.where(has_all, m_all_safe + tl.log(tl.where(has_all, tot, 1.0)), float("-inf"))
            lse_fin_safe = tl.where(has_all, lse_fin, 0.0)
            o_fin = tl.zeros([BLOCK_G, D], tl.float32)
            for si in range(0, N_SPLITS):
                prow = (r.to(tl.int64) * N_SPLITS + si) * G + g
                ls = tl.load(part_lse_ptr + prow, mask=gmask, other=float("-inf"), cache_modifier=".cg")
                w = tl.where(has_all, tl.exp(ls - lse_fin_safe), 0.0)
                po = tl.load(part_out_ptr + prow[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0, cache_modifier=".cg")
                o_fin += w[:, None] * po
            tl.store(out_ptr + final[:, None] * D + d[None, :], o_fin, mask=gmask[:, None])
            tl.store(lse_ptr + final, lse_fin, mask=gmask)
            tl.atomic_xchg(counter_ptr + r, 0)  # ready for the next call


_launch = CachedLaunch(_window_attn_kernel)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class WindowWorkspace:
    """Scratch of the split-K path: per-row arrival counters and partial results, grown on demand.

    Counters are zero between calls (the last program of a row resets its own), so nothing is
    cleared on the hot path. Calls on one stream may share a workspace (they run in order); calls
    that can run concurrently on different streams need one workspace each.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.partials = torch.empty(0, dtype=torch.float32, device=self.device)

    def get(self, rows: int, part_rows: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(counters >= rows, partial out `[part_rows, d]`, partial lse `[part_rows]`)."""
        if self.counters.numel() < rows:
            self.counters = torch.zeros(max(rows, 1024), dtype=torch.int32, device=self.device)
        need = part_rows * (d + 1)
        if self.partials.numel() < need:
            self.partials = torch.empty(max(need, 1 << 16), dtype=torch.float32, device=self.device)
        return self.counters, self.partials[: part_rows * d].view(part_rows, d), self.partials[part_rows * d : need]


_WORKSPACES: dict[str, WindowWorkspace] = {}


def default_workspace(dev: torch.device) -> WindowWorkspace:
    key = str(dev if dev.index is not None or dev.type != "cuda" else torch.device("cuda", torch.cuda.current_device()))
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = WindowWorkspace(key)
    return ws


def split_count(dev: torch.device, rows: int, span: int, block_n: int, min_tiles: int = 4) -> int:
    """Splits per row: about one wave of programs (rows x splits ~ SMs), each split at least
    `min_tiles` tiles. Measured on the H100 (benchmarks/gpu_attention.py sweep): fewer, longer
    programs beat many short ones here, since each split adds partial writes and a reduction."""
    n_tiles = cdiv(span, block_n)
    sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 2
    return max(1, min(sms // max(rows, 1), n_tiles // min_tiles, MAX_SPLITS))


# Most splits of a row (a power of two: the combine reads every split's lse in one load).
MAX_SPLITS = 64


def window_attention(
    q: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    *,
    max_len: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    n_splits: int | None = None,
    workspace: WindowWorkspace | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q `[B,Hq,D]` (fp32, pre-scaled) over window rows `[:lengths[b]]` of slot `slots[b]`.

    k_win, v_win `[S, Hkv, W, D]` (bf16/fp16/fp32, last dim contiguous); slots, lengths `[B]` int32
    on the same device. `max_len` (host int, default W) must bound the lengths (rows past it are
    not attended); it sizes the split grid. Returns (out `[B,Hq,D]` fp32, lse `[B,Hq]` fp32, natural
    log); a row of length 0 gets out 0, lse -inf. `workspace`: see `WindowWorkspace` (default:
    one per device, for calls from one stream at a time). `validate=False` skips the argument
    checks (several microseconds each): for a caller whose arguments are its own buffers, made
    and checked once (the runtime's decode step).
    """
    dev = q.device
    if validate:
        check_tensor("q", q, dims=3, dtypes=(torch.float32,))
    bsz, hq, d = q.shape
    n_slots, hkv, w, _ = k_win.shape
    if validate:
        check_head_dim(d)
        check_tensor("k_win", k_win, dims=4, dtypes=KV_DTYPES, device=dev)
        check_tensor("k_win", k_win, shape=(n_slots, hkv, w, d))
        check_tensor("v_win", v_win, shape=(n_slots, hkv, w, d), dtypes=(k_win.dtype,), device=dev)
        check_tensor("slots", slots, shape=(bsz,), dtypes=(torch.int32, torch.int64), device=dev)
        check_tensor("lengths", lengths, shape=(bsz,), dtypes=(torch.int32, torch.int64), device=dev)
        if hq % hkv:
            raise ValueError(f"q has {hq} heads, not a multiple of the window's {hkv} KV heads")
    g = hq // hkv
    if out is None:
        out = torch.empty((bsz, hq, d), dtype=torch.float32, device=dev)
    if lse is None:
        lse = torch.empty((bsz, hq), dtype=torch.float32, device=dev)
    if validate:
        check_tensor("out", out, shape=(bsz, hq, d), dtypes=(torch.float32,), device=dev, contiguous=True)
        check_tensor("lse", lse, shape=(bsz, hq), dtypes=(torch.float32,), device=dev, contiguous=True)
    if bsz == 0:
        return out, lse
    rows = bsz * hkv
    span = w if max_len is None else max(1, min(int(max_len), w))
    if n_splits is None:
        n_splits = split_count(dev, rows, span, block_n)
    n_splits = max(1, min(n_splits, MAX_SPLITS))
    split_len = cdiv(cdiv(span, block_n), max(1, n_splits)) * block_n
    n_splits = cdiv(span, split_len)
    if n_splits == 1:
        part_out, part_lse, counters = out, lse, lse  # unused by the kernel
    else:
        ws = workspace if workspace is not None else default_workspace(dev)
        counters, part_out, part_lse = ws.get(rows, rows * n_splits * g, d)
    args = (
        q, q.stride(0), q.stride(1),
        k_win, v_win, k_win.stride(0), k_win.stride(1), k_win.stride(2),
        v_win.stride(0), v_win.stride(1), v_win.stride(2),
        slots, lengths,
        out, lse, part_out, part_lse, counters,
        hkv, split_len, span, n_splits,
    )
    constexprs = dict(
        MULTI=n_splits > 1, BLOCK_S=MAX_SPLITS,
        G=g, BLOCK_G=max(16, next_pow2(g)), D=d, BLOCK_N=block_n, DOT_FP32=dot_in_fp32(k_win.dtype),
        DOT_PRECISION=dot_precision(k_win.dtype),
    )
    _launch((rows, n_splits), args, constexprs, tuple(constexprs.values()),
            {"num_warps": num_warps, "num_stages": num_stages})
    return out, lse
