"""Reference attention in torch: dense decode attention and the log-sum-exp merge.

Every executor and kernel is tested against these. `lse` is the natural-log sum of exp of the
scaled scores; an empty part has out = 0 and lse = -inf and merges as no contribution.
"""

from __future__ import annotations

import math

import torch


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one sequence: q `[Hq, D]`, k/v `[L, Hkv, D]` -> out `[Hq, D]`, lse `[Hq]` (fp32)."""
    hq, d = q.shape
    length, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hkv} KV heads")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if length == 0:
        return torch.zeros(hq, d), torch.full((hq,), float("-inf"))
    g = hq // hkv
    qf = q.float().view(hkv, g, d)
    scores = torch.einsum("hgd,lhd->hgl", qf, k.float()) * scale  # [Hkv, G, L]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("hgl,lhd->hgd", probs, v.float())
    return out.reshape(hq, d), lse.reshape(hq)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax over the union of two disjoint key sets from their partial `(out, lse)`."""
    lse = torch.logaddexp(lse_a, lse_b)
    # Both -inf: no keys at all; keep zeros instead of NaN.
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a.float() * w_a + out_b.float() * w_b, lse


def sparse_reference(
    q: torch.Tensor,
    k_cpu: torch.Tensor,
    v_cpu: torch.Tensor,
    selected: list[torch.Tensor],
    block_size: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query head over its own selected blocks of a CPU segment.

    q `[G, D]`, k/v `[L_cpu, D]` of one KV head, `selected[g]` block indices of head g.
    """
    g_heads, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    outs, lses = [], []
    length = k_cpu.shape[0]
    for g in range(g_heads):
        blocks = selected[g].long()
        if blocks.numel() == 0:
            outs.append(torch.zeros(d))
            lses.append(torch.tensor(float("-inf")))
            continue
        tok = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
        tok = tok[tok < length]
        s = (k_cpu[tok].float() @ q[g].float()) * scale
        lse = torch.logsumexp(s, 0)
        outs.append(torch.softmax(s, 0) @ v_cpu[tok].float())
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
