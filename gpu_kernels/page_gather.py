"""Random 4 KiB pages of pinned host memory read through a UVA view: what the GPU's loads over
the link reach at best (the machine probe's UVA gather and concurrent ceiling)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_pages_kernel(src_ptr, pages_ptr, dst_ptr, PAGE_ELEMS: tl.constexpr, PAGES_PER_PROG: tl.constexpr):
    """Each program sums `PAGES_PER_PROG` pages of `PAGE_ELEMS` bf16 elements (page ids from `pages_ptr`)
    of `src` into one row of `dst`."""
    pid = tl.program_id(0)
    offs = tl.arange(0, PAGE_ELEMS)
    acc = tl.zeros([PAGE_ELEMS], tl.float32)
    for i in tl.static_range(PAGES_PER_PROG):
        p = tl.load(pages_ptr + pid * PAGES_PER_PROG + i).to(tl.int64)
        acc += tl.load(src_ptr + p * PAGE_ELEMS + offs).to(tl.float32)
    tl.store(dst_ptr + pid * PAGE_ELEMS + offs, acc)


__all__ = ["gather_pages_kernel"]
