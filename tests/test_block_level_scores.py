"""`gpu_kernels.block_level_scores`: the AsyncTLS block level's scores read from the bf16 metadata
in place equal the torch form's (gather, float32 copy, two GEMVs, mask)."""

from __future__ import annotations

import pytest
import torch

from gpu_kernels.block_level_scores import level_scores
from hybrid_runtime.executors.asynctls import block_scores
from tests.helpers import DEV


@pytest.mark.parametrize("block_size, chunk_dtype", [(64, torch.int64), (16, torch.int32), (128, torch.int64)])
def test_scores_equal_the_gemm_form_with_inactive_heads_and_masks(block_size, chunk_dtype):
    gen = torch.Generator().manual_seed(block_size)
    r, g, d, n_chunks, c = 5, 4, 32, 9, 3
    per = 128 // block_size
    low = torch.randn(n_chunks, per, d, generator=gen)
    meta = torch.stack([low, low + torch.rand(n_chunks, per, d, generator=gen)], 2).to(torch.bfloat16)
    q = torch.randn(r, g, d, generator=gen)
    active = torch.rand(r, g, generator=gen) > 0.3
    active[2] = False  # a row whose heads are all streaming: every real block scores 0
    chunks = torch.stack([torch.randperm(n_chunks, generator=gen)[:c] for _ in range(r)]).to(chunk_dtype)
    cpu_len = torch.tensor([384, 300, 129, 1, 250])  # full, partial last block, one token
    got = level_scores(*(x.to(DEV) for x in (q, active, meta, chunks, cpu_len)), block_size).cpu()
    full = meta[chunks.long()].view(r, -1, 2, d).float()
    want = block_scores(full, q * active[..., None])
    n_blocks = -(-cpu_len // block_size)
    past = torch.arange(c * per)[None, :] >= n_blocks[:, None]
    want.masked_fill_(past, float("-inf"))
    assert torch.equal(torch.isinf(got), past)
    assert torch.allclose(got[~past], want[~past], rtol=1e-5, atol=1e-4)
    assert bool((got[2][~past[2]] == 0).all())


def test_bad_inputs_are_refused():
    q = torch.zeros(2, 4, 32, device=DEV)
    active = torch.ones(2, 4, dtype=torch.bool, device=DEV)
    meta = torch.zeros(3, 2, 2, 32, dtype=torch.bfloat16, device=DEV)
    chunks = torch.zeros(2, 1, dtype=torch.int64, device=DEV)
    lens = torch.ones(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="2 blocks a chunk and the block size is 16"):
        level_scores(q, active, meta, chunks, lens, 16)
    with pytest.raises(ValueError, match="active"):
        level_scores(q, active.int(), meta, chunks, lens, 64)
    with pytest.raises(ValueError, match="q has dtype"):
        level_scores(q.half(), active, meta, chunks, lens, 64)
    assert level_scores(q, active, meta, chunks, lens, 64).shape == (2, 2)
