"""The AsyncTLS resident cache's table update and a claim's counts, one program per row.

`hybrid_runtime.resident_cache.plan_update_aged` states the update as ~35 torch ops (comparisons,
a stable sort, cumulative sums, scatters, concatenations), and the claim adds the rows' gather
and write-back of the tables and ages and the counts' reductions: about 45 kernels of a few
microseconds each on a `[64, 133]` table, replayed one after another inside every lagged claim's
graph. Here each program updates one row in registers and writes what the claim needs:

* the row's table and ages, in place (`table[seq_slot[r], kv_head[r]]`, `age[...]`);
* `dest [R, k]`: the slot each missing chosen block goes to, -1 elsewhere (the copy's input);
* `counts [3, R]`: bytes the row's misses move, blocks chosen, blocks missed.

The update is `plan_update_aged`'s exactly. A slot's block stays when it was chosen again or is
younger than `keep_steps` updates; the i-th missing block (in chosen order) takes the i-th slot of
the row's stable sort by "kept" -- the free slots first in slot order, then the kept ones (never
reached when the caller sizes the rows, `ResidentCache`). A chosen block's hit and a slot's
"chosen again" come from `[TJ, S]` comparisons over tiles of the chosen blocks; the i-th slot of
the sort is the one whose sort position equals i, another such comparison, so nothing is sorted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import check_tensor, next_pow2


# Rows, lengths and counts vary with the batch and the config, not the code path: none of them picks
# a compiled variant, so the executor's warm-up (one row) compiles the one decode runs.
@triton.jit(do_not_specialize=["n_rows", "k", "s", "keep_steps", "token_bytes"])
def _update_kernel(table_ptr, age_ptr, seq_slot_ptr, kv_head_ptr, chosen_ptr, cpu_len_ptr, dest_ptr, counts_ptr,
                   n_rows, k, s, s_seq, s_head, keep_steps, token_bytes,
                   BLK: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr, TJ: tl.constexpr):
    r = tl.program_id(0)
    base = tl.load(seq_slot_ptr + r).to(tl.int64) * s_seq + tl.load(kv_head_ptr + r).to(tl.int64) * s_head
    chosen_row = chosen_ptr + r.to(tl.int64) * k
    si = tl.arange(0, S_PAD)
    in_row = si < s
    # Block ids fit in int32 (a CPU segment of 2^31 blocks is far past any store): narrow comparisons.
    cached = tl.load(table_ptr + base + si, mask=in_row, other=-1).to(tl.int32)
    older = tl.load(age_ptr + base + si, mask=in_row, other=0) + 1
    # The chosen blocks in tiles of TJ: a [TJ, S] comparison stays in registers (the whole [k, S] at
    # k 128, S 256 spilled: 80 us a call on the H200 against a few for the tiles).
    was = tl.zeros((S_PAD,), dtype=tl.int32)  # the slot's block was chosen again
    for j0 in tl.static_range(0, K_PAD, TJ):
        ji = j0 + tl.arange(0, TJ)
        chosen = tl.load(chosen_row + ji, mask=ji < k, other=-1).to(tl.int32)
        eq = (chosen[:, None] == cached[None, :]) & (chosen[:, None] >= 0)  # chosen >= 0: the slot is present
        was = tl.maximum(was, tl.max(eq.to(tl.int32), axis=0))
    keep = in_row & ((was > 0) | ((cached >= 0) & (older < keep_steps)))
    free = in_row & ~keep
    n_free = tl.sum(free.to(tl.int32), axis=0)
    # Each slot's position in the stable sort of the row by `keep` (free slots first).
    position = tl.where(free, tl.cumsum(free.to(tl.int32), axis=0) - 1,
                        n_free + tl.cumsum(keep.to(tl.int32), axis=0) - 1)
    position = tl.where(in_row, position, -1)
    filled = tl.zeros((S_PAD,), dtype=tl.int32)
    incoming = tl.zeros((S_PAD,), dtype=tl.int32)
    misses_before = 0
    n_cpu = tl.load(cpu_len_ptr + r).to(tl.int64)
    moved = tl.zeros((TJ,), dtype=tl.int64)
    n_chosen = tl.zeros((TJ,), dtype=tl.int32)
    for j0 in tl.static_range(0, K_PAD, TJ):
        ji = j0 + tl.arange(0, TJ)
        chosen = tl.load(chosen_row + ji, mask=ji < k, other=-1).to(tl.int32)
        valid = chosen >= 0
        eq = (chosen[:, None] == cached[None, :]) & valid[:, None]
        miss = valid & (tl.max(eq.to(tl.int32), axis=1) == 0)
        rank = misses_before + tl.cumsum(miss.to(tl.int32), axis=0) - 1  # the i-th miss takes sort position i
        takes = (position[None, :] == rank[:, None]) & miss[:, None]  # [TJ, S]: miss j goes to slot s
        dest = tl.where(miss, tl.sum(tl.where(takes, si[None, :], 0), axis=1), -1)
        tl.store(dest_ptr + r.to(tl.int64) * k + ji, dest.to(tl.int64), mask=ji < k)
        filled = tl.maximum(filled, tl.max(takes.to(tl.int32), axis=0))
        incoming += tl.sum(tl.where(takes, chosen[:, None], 0), axis=0)
        misses_before += tl.sum(miss.to(tl.int32), axis=0)
        tokens = tl.minimum(tl.maximum(n_cpu - chosen.to(tl.int64) * BLK, 0), BLK)
        moved += tl.where(miss, tokens, 0)
        n_chosen += valid.to(tl.int32)
    table = tl.where(filled > 0, incoming, tl.where(keep, cached, -1))
    age = tl.where((filled > 0) | (was > 0), 0, older)
    tl.store(table_ptr + base + si, table.to(tl.int64), mask=in_row)
    tl.store(age_ptr + base + si, age, mask=in_row)
    tl.store(counts_ptr + r, tl.sum(moved, axis=0) * token_bytes)
    tl.store(counts_ptr + n_rows + r, tl.sum(n_chosen, axis=0).to(tl.int64))
    tl.store(counts_ptr + 2 * n_rows + r, misses_before.to(tl.int64))


def update_cache_rows(table: torch.Tensor, age: torch.Tensor, seq_slot: torch.Tensor, kv_head: torch.Tensor,
                      chosen: torch.Tensor, cpu_len: torch.Tensor, keep_steps: int, block_size: int,
                      token_bytes: int, dest: torch.Tensor | None = None,
                      counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Update rows `(seq_slot[r], kv_head[r])` of one layer's `table`, `age [max_sequences, Hkv, S]`
    (int64, in place) with the blocks `chosen [R, k]` (distinct, -1 padded, int64) as
    `plan_update_aged(table[seq_slot, kv_head], age[...], chosen, keep_steps)` does; rows are
    distinct. Returns (`dest [R, k]` int64: each missing block's slot, -1 elsewhere; `counts [3, R]`
    int64: bytes moved -- missing blocks' tokens below `cpu_len [R]` times `token_bytes` --, blocks
    chosen, blocks missed). On CUDA, or the host under TRITON_INTERPRET=1."""
    r, k = chosen.shape
    dev = table.device
    check_tensor("table", table, dims=3, dtypes=(torch.int64,), contiguous=True)
    s = table.shape[2]
    check_tensor("age", age, shape=tuple(table.shape), dtypes=(torch.int64,), device=dev, contiguous=True)
    for name, x in (("seq_slot", seq_slot), ("kv_head", kv_head), ("cpu_len", cpu_len)):
        check_tensor(name, x, shape=(r,), dtypes=(torch.int32, torch.int64), device=dev, contiguous=True)
    check_tensor("chosen", chosen, dims=2, dtypes=(torch.int64,), device=dev, contiguous=True)
    if k > s:
        raise ValueError(f"{k} chosen blocks per row and {s} cache slots: a row holds at most its slots")
    if keep_steps < 1:
        raise ValueError(f"keep_steps {keep_steps}: at least 1")
    if dest is None:
        dest = torch.empty((r, k), dtype=torch.int64, device=dev)
    elif dest.shape != (r, k) or dest.dtype != torch.int64 or not dest.is_contiguous():
        raise ValueError(f"dest has shape {tuple(dest.shape)}, dtype {dest.dtype}; expected contiguous int64 [{r}, {k}]")
    if counts is None:
        counts = torch.empty((3, r), dtype=torch.int64, device=dev)
    elif counts.shape != (3, r) or counts.dtype != torch.int64 or not counts.is_contiguous():
        raise ValueError(f"counts has shape {tuple(counts.shape)}, dtype {counts.dtype}; expected contiguous int64 [3, {r}]")
    if r == 0:
        return dest, counts
    k_pad = max(next_pow2(k), 2)
    _update_kernel[(r,)](table, age, seq_slot, kv_head, chosen, cpu_len, dest, counts, r, k, s, table.stride(0),
                         table.stride(1), keep_steps, token_bytes, BLK=block_size, K_PAD=k_pad,
                         S_PAD=max(next_pow2(s), 2), TJ=min(k_pad, 32), num_warps=4)
    return dest, counts


__all__ = ["update_cache_rows"]
