"""Torch executor: really computes tasks with plain torch ops, on whatever device the step is on.

It stands in for the GPU lane where there is no CUDA device, so the scheduler's GPU worker, the
static split policies (gpu_only, uniform, length) and the fluxion shared queue run -- and are
tested -- on CPU-only machines with the same task interface and the same selection rule as the
numba and Triton kernels (Quest bound on stored metadata, per-head top-k, ties to the lower block
index). It is a reference, not a fast path: a few small torch ops per task and head.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from cpu_kernels import layout
from hybrid_runtime.kvcache import KVStore
from hybrid_runtime.tasks import Step, Task


class TorchRefExecutor:
    """Executor protocol over a `KVStore`; `device` names the lane it serves (default "gpu")."""

    def __init__(self, store: KVStore, device: str = "gpu"):
        self.store = store
        self.device = device
        self.bytes_read = 0
        self._lock = threading.Lock()

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        for task in tasks:
            self.run_one(task, step)

    def run_one(self, task: Task, step: Step) -> int:
        store = self.store
        g = step.group_size
        d = store.head_dim
        h0 = task.kv_head * g
        b = task.batch_index
        task.start_s = time.perf_counter()
        arena = store.arena(task.layer)
        esize = arena.element_size()
        blk = task.block_size
        n_blocks = -(-task.cpu_len // blk)
        chunks = torch.from_numpy(task.chunks).long()
        q = step.q[b, h0 : h0 + g].to(device="cpu", dtype=torch.float32)  # [G, D], pre-scaled
        out = torch.zeros((g, d), dtype=torch.float32)
        lse = torch.full((g,), float("-inf"), dtype=torch.float32)
        union = torch.zeros(n_blocks, dtype=torch.bool)
        if n_blocks:
            per_chunk = layout.blocks_per_chunk(blk)
            off = layout.meta_entry_offset(blk)
            meta = arena[chunks, layout.META_ROW :].view(-1, layout.META_ENTRIES, 2, d)
            meta = meta[:, off : off + per_chunk].reshape(-1, 2, d)[:n_blocks].float()  # [nb, 2, D]
            # Quest bound: sum_d max(q_d * min_d, q_d * max_d), per head and block.
            scores = torch.maximum(q[:, None] * meta[None, :, 0], q[:, None] * meta[None, :, 1]).sum(-1)
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # ties: lower index first
            tok_in_blk = torch.arange(blk)
            for gh in range(g):
                k_sel = int(min(max(int(task.n_select[gh]), 0), n_blocks))
                if k_sel == 0:
                    continue
                sel = order[gh, :k_sel]
                union[sel] = True
                tok = (sel[:, None] * blk + tok_in_blk).reshape(-1)
                tok = tok[tok < task.cpu_len]
                cid = chunks[tok // layout.CHUNK_TOKENS]
                row = tok % layout.CHUNK_TOKENS
                k = arena[cid, layout.K_ROW + row].float()
                v = arena[cid, layout.V_ROW + row].float()
                s = k @ q[gh]
                lse[gh] = torch.logsumexp(s, 0)
                out[gh] = torch.softmax(s, 0) @ v
        step.out[b, h0 : h0 + g] = out.to(step.out.device)
        step.lse[b, h0 : h0 + g] = lse.to(step.lse.device)
        # Same accounting as the numba kernel: all metadata of the granularity + union tokens.
        blocks = torch.nonzero(union).flatten()
        tokens = int(torch.clamp(task.cpu_len - blocks * blk, max=blk).sum()) if blocks.numel() else 0
        task.bytes_read = n_blocks * 2 * d * esize + tokens * 2 * d * esize
        task.device = self.device
        task.end_s = time.perf_counter()
        with self._lock:
            self.bytes_read += task.bytes_read
        return task.bytes_read
