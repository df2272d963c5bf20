"""NOSA's block selection (Eq. 5-7), batched over a step's tasks: pure torch, on any device.

Tokens are grouped in blocks of `n_b`; inside a block, sub-blocks of `kernel` tokens start every
`stride` tokens (`sub_blocks_per_block` of them, none crossing the block's end, so a block's
sub-blocks change only when the block itself does).

* **Query-aware score** (Eq. 5-6): each sub-block's key is the mean of its keys (mean pooling of
  `q . K` over the sub-block is `q` times that mean); per query head, a softmax of `q . K_sub`
  over the task's sub-blocks; summed over the KV group's heads; a block's score is the max over
  its sub-blocks.
* **Query-agnostic score**: a per-sub-block importance (the pooled eviction-head score, or the
  decayed accumulated attention), max-pooled per block the same way.
* **Selection** (Eq. 7): the top `k_q` blocks by the query-aware score get importance +inf, then
  the top `k` blocks by that importance are the selection. Ties go to the lower block index
  (stable sorts), so a fixed importance gives the same picks every step.

With an importance that does not change once a block exists, the `k - k_q` most important
blocks are selected at every step, so at least `k - k_q` of a step's blocks were selected at the
step before (Theorem 2), except for blocks created or changed in between.
"""

from __future__ import annotations

import torch


def sub_blocks_per_block(block_tokens: int, kernel: int, stride: int) -> int:
    """Sub-blocks of `kernel` tokens every `stride` tokens that fit in one block."""
    return (block_tokens - kernel) // stride + 1


def sub_block_means(x: torch.Tensor, count: torch.Tensor, block_tokens: int, kernel: int, stride: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean pooling (Eq. 5) of per-token rows over each block's sub-blocks.

    `x [..., T, F]` with `T` a whole number of blocks; `count [T]` 1 for a token that exists, 0 for
    padding. Returns the mean of the existing tokens of each sub-block `[..., NS, F]` (0 for a
    sub-block with none) and how many exist `[NS]`, `NS = T / block_tokens * sub_blocks_per_block`.
    """
    t, f = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    nb = t // block_tokens
    xb = (x * count[:, None].to(x.dtype)).reshape(*lead, nb, block_tokens, f)
    sums = xb.unfold(-2, kernel, stride).sum(-1)  # [..., nb, spb, F]
    n = count.to(x.dtype).reshape(nb, block_tokens).unfold(-1, kernel, stride).sum(-1)  # [nb, spb]
    means = sums / n.clamp(min=1)[..., None]
    return means.reshape(*lead, -1, f), n.reshape(-1)


def block_max(sub_scores: torch.Tensor, spb: int, block_valid: torch.Tensor) -> torch.Tensor:
    """Max pooling (Eq. 6) of `[T, NB * spb]` sub-block scores per block; -inf where `block_valid [T, NB]` is false.

    A sub-block that holds no token (past the CPU length in the last block) must already be -inf.
    """
    t = sub_scores.shape[0]
    pooled = sub_scores.view(t, -1, spb).amax(-1)
    return pooled.masked_fill(~block_valid, float("-inf"))


def query_aware_scores(q: torch.Tensor, sub_keys: torch.Tensor, sub_valid: torch.Tensor) -> torch.Tensor:
    """Per sub-block, the group's softmax attention over the sub-blocks' pooled keys, summed over heads.

    `q [T, G, D]` (fp32, pre-scaled), `sub_keys [T, NS, D]`, `sub_valid [T, NS]` -> `[T, NS]`
    (0 at invalid sub-blocks; a task without a valid sub-block gets all zeros).
    """
    logits = torch.bmm(q, sub_keys.float().transpose(1, 2)).masked_fill_(~sub_valid[:, None, :], float("-inf"))
    top = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    return p.sum(1)


def select_blocks(s_q: torch.Tensor, s_e: torch.Tensor, block_valid: torch.Tensor, k_q: int, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 7: `k_q` blocks by `s_q`, then the rest of `k` by `s_e`; per task, over `[T, NB]` scores.

    Returns `selected [T, k]` block indices (-1 past the task's valid blocks, valid ones first) and
    `query_aware [T, k]`, true for the blocks the query-aware part chose. `k_q <= k`.
    """
    t, nb = s_q.shape
    k_eff = min(k, nb)
    neg = float("-inf")
    s_q = s_q.masked_fill(~block_valid, neg)
    by_q = torch.sort(s_q, dim=1, descending=True, stable=True).indices[:, : min(k_q, nb)]
    picked = torch.zeros_like(block_valid)
    if by_q.shape[1]:
        picked.scatter_(1, by_q, torch.ones_like(by_q, dtype=torch.bool))
    picked &= block_valid
    rank = torch.where(picked, torch.full_like(s_e, float("inf")), s_e).masked_fill(~block_valid, neg)
    order = torch.sort(rank, dim=1, descending=True, stable=True).indices[:, :k_eff]
    valid = block_valid.gather(1, order)
    selected = torch.where(valid, order, torch.full_like(order, -1))
    qa = picked.gather(1, order) & valid
    if k_eff < k:
        pad = torch.full((t, k - k_eff), -1, dtype=selected.dtype, device=selected.device)
        selected = torch.cat([selected, pad], 1)
        qa = torch.cat([qa, torch.zeros_like(pad, dtype=torch.bool)], 1)
    return selected, qa


__all__ = ["block_max", "query_aware_scores", "select_blocks", "sub_block_means", "sub_blocks_per_block"]
