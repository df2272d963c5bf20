"""Budget criteria: when does a head's sparse attention at budget `bgt` count as good enough?

A label is the smallest budget that meets a criterion (`budget_search.smallest_budget` over a
curve of the criterion at every block count). Fluxion's criterion and the two its ablation
compares it with (Fig. 10a):

* `output` -- Eq. 2: `||o(n) - o||_h / max_h' ||o_h'|| <= tau`, `h'` over the layer's query
  heads. The error is measured against the largest output among the heads, so a head that
  contributes little to the layer's output gets a proportionally looser bound (the
  head-contribution term).
* `output_no_head_contribution` -- the same bound relative to the head's own output,
  `||o(n) - o||_h / ||o_h|| <= tau`: every head is held to the same relative error.
* `score95` -- the kept keys (GPU window plus the top `n` blocks) hold at least 95% of the
  head's attention probability (attention-score coverage); `tau` plays no part.

All three need the exact attention over the CPU-resident keys, which only the offline labels
pipeline computes; at decode time the selector sees nothing but the predictor's budget laws.
So a label set made with one criterion trains a predictor for that criterion, and the
comparison of Fig. 10a is between predictors (or oracle budgets) of the three.
"""

from __future__ import annotations

import torch

from predictor.budget_search import block_bounds, block_scores

CRITERIA = ("output", "output_no_head_contribution", "score95")
SCORE_COVERAGE = 0.95


def own_relative_errors(err: torch.Tensor, o_full: torch.Tensor) -> torch.Tensor:
    """`err [B, Hq, C]` divided by each head's own `||o_h||` (no head-contribution term)."""
    return err / o_full.float().norm(dim=-1).clamp_min(1e-30)[..., None]


@torch.no_grad()
def prefix_mass(q: torch.Tensor, k_cpu: torch.Tensor, lse_w: torch.Tensor, blk: int,
                scale: float | None = None) -> torch.Tensor:
    """Attention probability on the window plus the top `n` blocks, for every `n = 0 .. nb`: `[B, Hq, nb + 1]`.

    Blocks are ranked as `budget_search.prefix_errors` ranks them (Quest bounds on the blocks'
    key min/max), so `n` means the same blocks for every criterion. `q [B, Hq, D]` unscaled,
    `k_cpu [Lc, Hkv, D]`, `lse_w [B, Hq]` the window's log-sum-exp of scaled scores (`-inf` for
    an empty window).
    """
    b, hq, d = q.shape
    lc, hkv, _ = k_cpu.shape
    if hq % hkv or lse_w.shape != (b, hq) or blk < 1:
        raise ValueError(f"q [B, Hq, D], k_cpu [Lc, Hkv, D] with Hkv dividing Hq, lse_w [B, Hq] and blk >= 1 "
                         f"expected; got {list(q.shape)}, {list(k_cpu.shape)}, {list(lse_w.shape)}, blk {blk}")
    scale = d ** -0.5 if scale is None else scale
    if lc == 0:
        return torch.ones(b, hq, 1, device=q.device)
    qg = q.float().view(b, hkv, hq // hkv, d)
    s = torch.einsum("bkgd,lkd->bkgl", qg, k_cpu.float()) * scale  # [B, Hkv, G, Lc]
    nb = -(-lc // blk)
    s = torch.nn.functional.pad(s, (0, nb * blk - lc), value=float("-inf")).view(b, hkv, hq // hkv, nb, blk)
    lse_b = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, nb]
    lse_win = lse_w.float().view(b, hkv, hq // hkv)
    total = torch.logaddexp(lse_win, torch.logsumexp(lse_b, dim=-1))
    order = block_scores(qg, *block_bounds(k_cpu, blk)).argsort(-1, descending=True)
    kept_blocks = torch.exp(lse_b.gather(-1, order) - total[..., None]).cumsum(-1)
    window = torch.exp(lse_win - total)[..., None]
    return torch.cat([window, window + kept_blocks], -1).clamp(max=1.0).reshape(b, hq, nb + 1)


def criterion_curve(criterion: str, tau: float, err: torch.Tensor | None = None, o_full: torch.Tensor | None = None,
                    mass: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """`(curve, bound)`: the criterion is met at block count `n` when `curve[..., n] <= bound`.

    The output criteria take `err [B, Hq, C]` (`||o(n) - o||`) and `o_full [B, Hq, D]` and use
    `tau`; `score95` takes `mass [B, Hq, C]` (`prefix_mass`) and gives `1 - mass <= 0.05`.
    """
    if criterion not in CRITERIA:
        raise ValueError(f"unknown budget criterion {criterion!r}; allowed {list(CRITERIA)}")
    if criterion == "score95":
        if mass is None:
            raise ValueError("criterion 'score95' needs mass (predictor.budget_criteria.prefix_mass)")
        return 1.0 - mass, 1.0 - SCORE_COVERAGE
    if err is None or o_full is None:
        raise ValueError(f"criterion {criterion!r} needs err and o_full (predictor.budget_search.prefix_errors)")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if criterion == "output":
        return err / o_full.float().norm(dim=-1).amax(-1).clamp_min(1e-30)[:, None, None], tau
    return own_relative_errors(err, o_full), tau


__all__ = ["CRITERIA", "SCORE_COVERAGE", "criterion_curve", "own_relative_errors", "prefix_mass"]
