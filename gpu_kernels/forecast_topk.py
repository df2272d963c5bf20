"""Each row's `k` largest block sort keys, in descending order: SparDA's top-k in one Triton launch.

What `torch.topk(keys, k)` returns for the int64 sort keys of `gpu_kernels.forecast_scores`
(distinct per row, so the result is unique), without it: on CUDA that op is a radix select with
one thread block per row, 32 passes of two bits over a 64-bit key, then a sort of its results,
and a torch op on the selection's stream besides the Triton launches around it.

One program per row keeps the best `KP = next_pow2(k)` keys seen so far, sorted descending, and
walks the row in tiles of `KP` keys: the tile sorted ascending, the elementwise maximum of the two
(the `KP` largest of their union, as a bitonic sequence), sorted descending again. Padding is the
smallest int64, below every sort key (the smallest key, of a block whose score orders lowest, is
`-2**63 + 2**32 - 1 - block`). The block of a key is `2**32 - 1` minus its low word.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels.launch import CachedLaunch

PAD_KEY = -(2**63)


@triton.jit(do_not_specialize=["width", "k"])
def _row_top_k_kernel(keys_ptr, top_keys_ptr, top_blocks_ptr, width, k, KP: tl.constexpr, PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = keys_ptr + row * width
    j = tl.arange(0, KP)
    best = tl.full([KP], PAD, tl.int64)
    for start in range(0, width, KP):
        tile = tl.load(src + start + j, mask=start + j < width, other=PAD)
        best = tl.sort(tl.maximum(best, tl.sort(tile)), descending=True)
    keep = j < k
    tl.store(top_keys_ptr + row * k + j, best, mask=keep)
    tl.store(top_blocks_ptr + row * k + j, 4294967295 - (best & 4294967295), mask=keep)


_top_k = CachedLaunch(_row_top_k_kernel)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_top_k(keys: torch.Tensor, k: int, top_keys: torch.Tensor, top_blocks: torch.Tensor,
              stream: int | None = None) -> None:
    """`keys [..., W]` int64 sort keys (contiguous, `W >= k`) -> `top_keys, top_blocks [..., k]`
    int64: the `k` largest keys of each row in descending order and their blocks (what
    `torch.topk(keys, k)` gives as values and indices). Shapes are the caller's contract."""
    width = keys.shape[-1]
    rows = keys.numel() // width
    _top_k((rows,), (keys, top_keys, top_blocks, width, k), {"KP": next_pow2(k), "PAD": PAD_KEY}, (next_pow2(k),),
           {"num_warps": 1 if k <= 64 else 4}, stream=stream)


__all__ = ["PAD_KEY", "row_top_k"]
