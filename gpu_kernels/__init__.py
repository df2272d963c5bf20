"""Triton kernels of the GPU path and CUDA views of pinned host memory.

Modules, one concept each:
    uva                 `uva_view`: a CUDA tensor aliasing a pinned host tensor (no copy)
    task_table          `SparseTaskTable` (one launch's tasks) and `StepTable` (a step's tasks in
                        queue order, uploaded once; claims are row ranges)
    score_select        the GPU lane's first claim launch: Quest scores, exact top-k, group union
    sparse_attention    attention over the selected blocks read straight from the (UVA) arena;
                        the claim launch fuses the split combine
    block_scores        the multi-launch selection (scores, torch.topk, union), for benchmarks and tests
    window_attention    dense split-K decode attention over the GPU window
    split_combine       log-sum-exp reduction of split-K partials into `[B, Hq]` rows
    lse_merge           merge of two partial `(out, lse)` results
    launch              `CachedLaunch`: a compiled kernel launched without the JIT's per-call work
    claim_descriptor    the claim kernels reading their claim from a descriptor row (fixed arguments)
    native_claim        a claim issued by one numba call through the CUDA driver (those kernels)
    cuda_driver         the driver calls made directly (ctypes) and `DriverEvent`
    _checks             argument checks shared by the wrappers

On a machine without CUDA, Triton kernels can only run under Triton's interpreter. Triton reads
TRITON_INTERPRET when a kernel is *decorated* (module import), not when it is launched, so the
switch has to be made before the first kernel module is imported; doing it here, in the package
that owns the kernels, makes it independent of which test or module imports them first. An
explicit TRITON_INTERPRET in the environment always wins.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
