"""What the Forecast is trained to match, the loss, and recall.

**Target** of a decode position and KV group at layer `l + 1` (SparDA Eq. 12-14): the group's
query heads' attention over the CPU segment on the fine grid (kernel 2, stride 1) --
`softmax(q . k~ / (sqrt(D) tau))` per head, over the segment's windows only (causal: the
segment ends before the decode position; the init and local tokens live in the GPU window and
are attended anyway, so they are not candidates) -- summed over the group's heads, max-pooled
onto the selection blocks and normalised into a distribution `P` over blocks.

**Restricted KL**: both `P` and the Forecast's `Q = softmax(block scores)` are reduced to the
target's top-k blocks plus one bucket holding the rest of the mass, and the loss is
`KL(P' || Q')`: it asks the Forecast to rank the blocks that matter and to keep the others
below them, not to reproduce the long tail.

**Recall@k** of a selection: the fraction of the target's top-k blocks it selects.
"""

from __future__ import annotations

import math

import torch

from forecast.grid import fine_scores, pool_to_blocks, top_blocks


def attention_target(q: torch.Tensor, keys: torch.Tensor, block_size: int, tau: float = 1.0) -> torch.Tensor:
    """`P [..., Hkv, NB]`: the block distribution of `q [..., Hq, D]` (post-RoPE queries of the
    layer) over the CPU-segment keys `keys [Hkv, n, D]`, per KV group (see the module doc)."""
    hkv, n, d = keys.shape
    hq = q.shape[-2]
    g = hq // hkv
    qg = q.float().reshape(*q.shape[:-2], hkv, g, d)
    s = torch.einsum("...hgd,hnd->...hgn", qg, keys.float()) / (math.sqrt(d) * tau)
    p = torch.softmax(fine_scores(s, n), -1).sum(-2)  # [..., Hkv, n]
    t = pool_to_blocks(p, 1, 2, block_size, n)
    return t / t.sum(-1, keepdim=True)


def restricted_kl(target: torch.Tensor, block_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Mean over rows of `KL(P' || Q')`: `target [..., NB]` (a distribution), `block_logits`
    (same shape; -inf for blocks that do not exist) reduced to the target's top-k blocks plus a
    rest bucket. With k >= NB the rest bucket is empty and this is the plain KL."""
    nb = target.shape[-1]
    k = min(k, nb)
    top = target.topk(k, -1).indices
    in_top = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, top, True)
    log_q = torch.log_softmax(block_logits.float(), -1)
    p_top = target.gather(-1, top)
    kl_top = (p_top * (p_top.clamp_min(1e-30).log() - log_q.gather(-1, top))).sum(-1)
    p_rest = (target * ~in_top).sum(-1)
    log_q_rest = torch.logsumexp(log_q.masked_fill(in_top, float("-inf")), -1)
    kl_rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - log_q_rest), torch.zeros_like(p_rest))
    return (kl_top + kl_rest).mean()


def recall_at_k(target: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the fraction of the target's top-k blocks among the top-k of `scores` (ties to the
    lower block index, as the runtime selects); `[...]` float."""
    ref = top_blocks(target, k)[0]
    sel = top_blocks(scores, k)[0]
    return (ref[..., :, None] == sel[..., None, :]).any(-1).float().mean(-1)


__all__ = ["attention_target", "recall_at_k", "restricted_kl"]
