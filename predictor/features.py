"""The predictor's 41 per-head features, from GPU-resident data and statistics cached at prefill.

Two parts:

* `PrefillStatistics` -- computed once per (sequence, layer) by `compute_prefill_statistics` from
  the prompt's K/V and the query of its last token (the *anchor*), and cached beside the KV store:
  per KV head the first and second moments of the CPU segment's keys and values, key-norm
  moments, and per query head what the anchor needed (exact, since at prefill the whole prompt
  is on the GPU). `absorb` folds tokens that later spill into the segment into the moments.
* `decode_features(stats, q, q_prev, window_k, window_v, window_len, layer, n_layers)` ->
  `[B * Hq, 41]` (row `b * Hq + h`), per decode step and layer. It reads the GPU window (sinks +
  recent tokens) and the statistics, never the CPU-resident KV. Vectorised over sequences and
  heads, no host synchronisation, same code on CPU and CUDA.

Notation: scores `s = q . k / sqrt(D)`; the window `W` is the sink rows then the recent rows of
the window buffer; the CPU segment `C` has `n` tokens with key mean `mu_k`, key covariance
`S_k`, value mean `mu_v` and value-key covariance `S_vk` (population moments); `o_w` is the
window-only output.

The moment-based LSE approximation: if the segment's keys are Gaussian, `s` is Gaussian with mean
`q . mu_k / sqrt(D)` and variance `q^T S_k q / D`, so `log sum_C exp(s) ~ log n + mean + var / 2`;
tilting the joint Gaussian of (k, v) by `exp(s)` moves the value mean to
`o_c = mu_v + S_vk q / sqrt(D)`, the estimated attention output of the segment.

Fluxion's appendix A lists 41 features in these seven groups; the stored copy of the paper
available here has its front matter only, so each definition below is this module's own choice
within its group, stated in one line.

| # | name | meaning |
| --- | --- | --- |
|  0 | layer_frac | structural: layer / (layers - 1) |
|  1 | head_frac | structural: query head index / (Hq - 1) |
|  2 | log2_context | structural: log2 of the tokens attended (window + CPU segment) |
|  3 | log2_cpu_tokens | structural: log2(1 + n) |
|  4 | cpu_fraction | structural: n / tokens attended |
|  5 | key_norm_mean | KV distribution: mean of ||k|| / sqrt(D) over C |
|  6 | key_norm_cv | KV distribution: std / mean of ||k|| over C |
|  7 | key_concentration | KV distribution: ||mu_k|| / mean ||k|| over C (1: all keys aligned) |
|  8 | key_spread | KV distribution: sqrt(trace(S_k) / D), per-dimension key spread |
|  9 | key_top_eig_frac | KV distribution: largest eigenvalue of S_k / trace(S_k) (anisotropy) |
| 10 | value_spread | KV distribution: sqrt(trace(S_v) / D) |
| 11 | recent_key_drift_cos | KV distribution: cos(mean of the window's recent keys, mu_k) |
| 12 | q_norm | QK interaction: ||q|| / sqrt(D) |
| 13 | q_key_mean_cos | QK interaction: cos(q, mu_k) |
| 14 | window_score_max | QK interaction: max of s over W |
| 15 | sink_recent_gap | QK interaction: max s over sinks - max s over recent rows, in [-30, 30] |
| 16 | cpu_score_mean_est | QK interaction: q . mu_k / sqrt(D), mean score over C |
| 17 | cpu_score_std_est | QK interaction: sqrt(q^T S_k q / D), score spread over C |
| 18 | cpu_score_max_est | QK interaction: mean + std * sqrt(2 ln n), Gaussian extreme score over C |
| 19 | cpu_max_gap_est | QK interaction: cpu_score_max_est - window_score_max |
| 20 | lse_window | attention contribution: log-sum-exp of s over W |
| 21 | sink_share | attention contribution: share of the window's softmax mass on the sinks |
| 22 | lse_cpu_est | attention contribution: moment-based LSE of C, log n + mean + var / 2 |
| 23 | cpu_mass_logit_est | attention contribution: lse_cpu_est - lse_window, in [-30, 30] |
| 24 | cpu_mass_est | attention contribution: sigmoid(cpu_mass_logit_est), C's estimated softmax share |
| 25 | window_entropy | attention contribution: entropy of the window softmax / ln(window tokens) |
| 26 | cpu_shift_est | attention contribution: ||o_c - o_w|| / ||o_w|| |
| 27 | stream_err_est | attention contribution: Eq. 2 error of the window alone, m ||o_c - o_w|| / max_h' ||o_hat_h'|| |
| 28 | q_prev_cos | query dynamics: cos(q, query of the previous step) |
| 29 | q_anchor_cos | query dynamics: cos(q, anchor query) |
| 30 | q_anchor_norm_ratio | query dynamics: ||q|| / ||anchor query|| |
| 31 | log2_steps | query dynamics: log2(1 + tokens appended to the window since prefill) |
| 32 | anchor_cpu_mass | budget estimation: exact softmax share of C at the anchor |
| 33 | anchor_stream_err | budget estimation: exact Eq. 2 error of the window alone at the anchor |
| 34 | anchor_bgt_1 | budget estimation: smallest exact top-k token budget meeting tau at the anchor (grid) |
| 35 | anchor_bgt_16 | budget estimation: same with Quest-ranked 16-token blocks |
| 36 | anchor_bgt_128 | budget estimation: same with Quest-ranked 128-token blocks |
| 37 | bgt_gauss_est | budget estimation: token budget under the Gaussian score model, Phi(Phi^-1(1 - tau / stream_err_est) - std) |
| 38 | out_norm_share | cross-head: ||o_hat_h|| / max_h' ||o_hat_h'|| over the layer's heads (Eq. 2 denominator) |
| 39 | cpu_mass_group_rel | cross-head: cpu_mass_est / its max over the heads of the KV group |
| 40 | group_q_cos | cross-head: mean cos(q_h, q_h') over the other heads of the KV group (1 if none) |

Here `m` is cpu_mass_est and `o_hat = (1 - m) o_w + m o_c` the estimated dense output.
Statistics size per (sequence, layer): `4 * (Hkv * (2 D^2 + 2 D + 4) + Hq * (D + 5)) + 20`
bytes (`PrefillStatistics.nbytes`): 102 KB for SmolLM2-135M (Hkv 3, Hq 9, D 64), as much as the
bf16 K/V of 133 tokens; 1.07 MB for Llama-3.1-8B (Hkv 8, Hq 32, D 128), the K/V of 262 tokens.
The two D x D covariances are almost all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from predictor.budget_search import error_curves, relative_errors, smallest_budget

FEATURES: tuple[tuple[str, str], ...] = (
    ("layer_frac", "structural: layer / (layers - 1)"),
    ("head_frac", "structural: query head index / (Hq - 1)"),
    ("log2_context", "structural: log2 of the tokens attended (window + CPU segment)"),
    ("log2_cpu_tokens", "structural: log2(1 + CPU-segment tokens)"),
    ("cpu_fraction", "structural: CPU-segment tokens / tokens attended"),
    ("key_norm_mean", "KV distribution: mean ||k|| / sqrt(D) over the CPU segment"),
    ("key_norm_cv", "KV distribution: std / mean of ||k|| over the CPU segment"),
    ("key_concentration", "KV distribution: ||mean key|| / mean ||k|| over the CPU segment"),
    ("key_spread", "KV distribution: sqrt(trace(key covariance) / D)"),
    ("key_top_eig_frac", "KV distribution: top eigenvalue / trace of the key covariance"),
    ("value_spread", "KV distribution: sqrt(trace(value covariance) / D)"),
    ("recent_key_drift_cos", "KV distribution: cos(mean recent window key, CPU-segment mean key)"),
    ("q_norm", "QK interaction: ||q|| / sqrt(D)"),
    ("q_key_mean_cos", "QK interaction: cos(q, CPU-segment mean key)"),
    ("window_score_max", "QK interaction: max scaled score over the window"),
    ("sink_recent_gap", "QK interaction: max sink score - max recent score, clipped to [-30, 30]"),
    ("cpu_score_mean_est", "QK interaction: q . mean key / sqrt(D)"),
    ("cpu_score_std_est", "QK interaction: sqrt(q^T key_cov q / D)"),
    ("cpu_score_max_est", "QK interaction: mean + std * sqrt(2 ln n), Gaussian extreme CPU score"),
    ("cpu_max_gap_est", "QK interaction: cpu_score_max_est - window_score_max"),
    ("lse_window", "attention contribution: log-sum-exp of the window scores"),
    ("sink_share", "attention contribution: window softmax mass on the sinks"),
    ("lse_cpu_est", "attention contribution: moment-based CPU LSE, log n + mean + var / 2"),
    ("cpu_mass_logit_est", "attention contribution: lse_cpu_est - lse_window, clipped to [-30, 30]"),
    ("cpu_mass_est", "attention contribution: sigmoid(cpu_mass_logit_est)"),
    ("window_entropy", "attention contribution: window softmax entropy / ln(window tokens)"),
    ("cpu_shift_est", "attention contribution: ||o_cpu_est - o_window|| / ||o_window||"),
    ("stream_err_est", "attention contribution: estimated Eq. 2 error of the window alone"),
    ("q_prev_cos", "query dynamics: cos(q, previous step's q)"),
    ("q_anchor_cos", "query dynamics: cos(q, anchor q)"),
    ("q_anchor_norm_ratio", "query dynamics: ||q|| / ||anchor q||"),
    ("log2_steps", "query dynamics: log2(1 + tokens appended to the window since prefill)"),
    ("anchor_cpu_mass", "budget estimation: exact CPU softmax share at the anchor"),
    ("anchor_stream_err", "budget estimation: exact Eq. 2 error of the window alone at the anchor"),
    ("anchor_bgt_1", "budget estimation: smallest top-k token budget meeting tau at the anchor"),
    ("anchor_bgt_16", "budget estimation: smallest 16-token Quest block budget meeting tau at the anchor"),
    ("anchor_bgt_128", "budget estimation: smallest 128-token Quest block budget meeting tau at the anchor"),
    ("bgt_gauss_est", "budget estimation: Gaussian-score token budget for tau at the current q"),
    ("out_norm_share", "cross-head: ||o_est_h|| / max over the layer's heads"),
    ("cpu_mass_group_rel", "cross-head: cpu_mass_est / max over the KV group's heads"),
    ("group_q_cos", "cross-head: mean cos(q_h, q_h') over the KV group's other heads"),
)
FEATURE_NAMES: tuple[str, ...] = tuple(name for name, _ in FEATURES)
N_FEATURES = len(FEATURE_NAMES)
assert N_FEATURES == 41

#: Block sizes whose anchor budgets are features, and the budget grid they are searched on.
ANCHOR_BLOCK_SIZES: tuple[int, ...] = (1, 16, 128)
ANCHOR_BUDGET_GRID: tuple[float, ...] = (0.0, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                                         0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0)
_LOGIT_CLIP = 30.0
_EPS = 1e-12


@dataclass(frozen=True)
class PrefillStatistics:
    """What prefill caches per (sequence, layer) for the features; every tensor has a leading batch `B`.

    Moments are population moments of the CPU segment (zero when it is empty). Build with
    `compute_prefill_statistics`; batch with `cat`, gather rows (e.g. store slots) with `index`.
    """

    n_cpu: torch.Tensor  # [B] CPU-segment tokens (float32)
    sink_len: torch.Tensor  # [B] sink rows at the start of the window buffer (int64)
    window_len: torch.Tensor  # [B] window rows right after prefill (int64)
    key_mean: torch.Tensor  # [B, Hkv, D]
    key_cov: torch.Tensor  # [B, Hkv, D, D]
    value_mean: torch.Tensor  # [B, Hkv, D]
    value_key_cov: torch.Tensor  # [B, Hkv, D, D], Cov(v, k): rows value dims, columns key dims
    key_norm_mean: torch.Tensor  # [B, Hkv]
    key_norm_var: torch.Tensor  # [B, Hkv]
    value_var: torch.Tensor  # [B, Hkv], trace of the value covariance / D
    key_top_eig_frac: torch.Tensor  # [B, Hkv]
    anchor_q: torch.Tensor  # [B, Hq, D]
    anchor_cpu_mass: torch.Tensor  # [B, Hq]
    anchor_stream_err: torch.Tensor  # [B, Hq]
    anchor_budget: torch.Tensor  # [B, Hq, len(ANCHOR_BLOCK_SIZES)]
    tau: float  # the error bound the anchor budgets were searched for

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tau"}

    @property
    def batch(self) -> int:
        return self.n_cpu.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held, all rows."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def index(self, rows: torch.Tensor) -> "PrefillStatistics":
        """The statistics of `rows` (a long tensor on the statistics' device), in that order."""
        return replace(self, **{k: t.index_select(0, rows) for k, t in self._tensors().items()})

    def to(self, device: torch.device | str) -> "PrefillStatistics":
        return replace(self, **{k: t.to(device) for k, t in self._tensors().items()})

    @staticmethod
    def cat(parts: list["PrefillStatistics"]) -> "PrefillStatistics":
        """Rows of several statistics (same geometry and tau) as one batch."""
        if not parts:
            raise ValueError("cat needs at least one PrefillStatistics")
        if len({p.tau for p in parts}) != 1:
            raise ValueError(f"cannot batch statistics searched for different tau: {sorted({p.tau for p in parts})}")
        names = parts[0]._tensors()
        return replace(parts[0], **{k: torch.cat([getattr(p, k) for p in parts]) for k in names})

    def absorb(self, k: torch.Tensor, v: torch.Tensor) -> "PrefillStatistics":
        """The statistics after `k, v [B, T, Hkv, D]` (GPU window tokens spilled) joined every row's CPU segment.

        Moments merge exactly (Chan's parallel update); the anchor entries describe prefill and stay.
        """
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != self.batch or k.shape[2:] != self.key_mean.shape[1:]:
            raise ValueError(f"k and v must both be [{self.batch}, T, {self.key_mean.shape[1]}, {self.key_mean.shape[2]}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[1] == 0:
            return self
        new = _moments(k.float(), v.float())
        na = self.n_cpu.view(-1, 1)
        nb = float(k.shape[1])
        n = na + nb
        fa, fb = na / n, nb / n
        dk = new["key_mean"] - self.key_mean
        dv = new["value_mean"] - self.value_mean
        f2 = (fa * fb)[..., None, None]
        key_cov = fa[..., None, None] * self.key_cov + fb * new["key_cov"] + f2 * dk[..., :, None] * dk[..., None, :]
        vk_cov = fa[..., None, None] * self.value_key_cov + fb * new["value_key_cov"] + f2 * dv[..., :, None] * dk[..., None, :]
        dn = new["key_norm_mean"] - self.key_norm_mean
        d = self.key_mean.shape[-1]
        return replace(
            self,
            n_cpu=n.view(-1),
            key_mean=self.key_mean + fb[..., None] * dk,
            value_mean=self.value_mean + fb[..., None] * dv,
            key_cov=key_cov,
            value_key_cov=vk_cov,
            key_norm_mean=self.key_norm_mean + fb * dn,
            key_norm_var=fa * self.key_norm_var + fb * new["key_norm_var"] + fa * fb * dn ** 2,
            value_var=fa * self.value_var + fb * new["value_var"] + fa * fb * (dv ** 2).sum(-1) / d,
            key_top_eig_frac=_top_eig_frac(key_cov),
        )


def _moments(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Population moments over dim 1 of `k, v [B, T, Hkv, D]` (zeros for T = 0)."""
    b, t, hkv, d = k.shape
    if t == 0:
        z = k.new_zeros(b, hkv)
        zd = k.new_zeros(b, hkv, d)
        zdd = k.new_zeros(b, hkv, d, d)
        return {"key_mean": zd, "key_cov": zdd, "value_mean": zd.clone(), "value_key_cov": zdd.clone(),
                "key_norm_mean": z, "key_norm_var": z.clone(), "value_var": z.clone()}
    mk, mv = k.mean(1), v.mean(1)
    kc, vc = k - mk[:, None], v - mv[:, None]
    norms = k.norm(dim=-1) / math.sqrt(d)
    return {
        "key_mean": mk,
        "key_cov": torch.einsum("btkd,btke->bkde", kc, kc) / t,
        "value_mean": mv,
        "value_key_cov": torch.einsum("btkd,btke->bkde", vc, kc) / t,
        "key_norm_mean": norms.mean(1),
        "key_norm_var": norms.var(1, unbiased=False),
        "value_var": (vc ** 2).sum(-1).mean(1) / d,
    }


def _top_eig_frac(cov: torch.Tensor) -> torch.Tensor:
    eig = torch.linalg.eigvalsh(cov)  # ascending
    return eig[..., -1] / eig.sum(-1).clamp_min(_EPS)


def window_attention(q: torch.Tensor, window_k: torch.Tensor, window_v: torch.Tensor, window_len: torch.Tensor,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over the first `window_len[b]` rows of `window_k/v [B, Hkv, W, D]`: out `[B, Hq, D]`, lse `[B, Hq]` (fp32)."""
    b, hq, d = q.shape
    hkv = window_k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    s = torch.einsum("bkgd,bkwd->bkgw", q.float().view(b, hkv, hq // hkv, d), window_k.float()) * scale
    valid = torch.arange(window_k.shape[2], device=q.device) < window_len.view(b, 1)
    s = s.masked_fill(~valid[:, None, None, :], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    out = torch.einsum("bkgw,bkwd->bkgd", p, window_v.float())
    return out.reshape(b, hq, d), lse.reshape(b, hq)


def compute_prefill_statistics(k: torch.Tensor, v: torch.Tensor, q_anchor: torch.Tensor, *, sink: int = 64,
                               local: int = 256, tau: float = 0.10, scale: float | None = None) -> PrefillStatistics:
    """Statistics of one prompt at one layer: `k, v [L, Hkv, D]`, `q_anchor [Hq, D]` the last prompt token's query.

    The window split is the KV store's: the first `min(sink, L)` tokens and the last
    `min(local, L - sink)` stay on the GPU, the rest is the CPU segment. Anchor budgets are
    searched on `ANCHOR_BUDGET_GRID` for each of `ANCHOR_BLOCK_SIZES`.
    """
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [L, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    length, hkv, d = k.shape
    if length == 0:
        raise ValueError("the prompt holds no tokens")
    if q_anchor.dim() != 2 or q_anchor.shape[1] != d or q_anchor.shape[0] % hkv:
        raise ValueError(f"q_anchor must be [Hq, {d}] with Hq a multiple of {hkv}, got {tuple(q_anchor.shape)}")
    if sink < 0 or local < 0:
        raise ValueError(f"sink and local must be >= 0, got {sink} and {local}")
    if not 0.0 < tau:
        raise ValueError(f"tau must be > 0, got {tau}")
    dev = k.device
    hq = q_anchor.shape[0]
    sink_len = min(sink, length)
    recent_len = min(local, length - sink_len)
    cpu_end = length - recent_len
    n_cpu = cpu_end - sink_len
    kf, vf = k.float(), v.float()
    k_cpu, v_cpu = kf[sink_len:cpu_end], vf[sink_len:cpu_end]
    mom = _moments(k_cpu[None], v_cpu[None])
    win = torch.cat([torch.arange(sink_len, device=dev), torch.arange(cpu_end, length, device=dev)])
    wk, wv = kf[win].transpose(0, 1)[None], vf[win].transpose(0, 1)[None]
    q1 = q_anchor.float()[None]
    window_len = torch.tensor([win.numel()], device=dev)
    out_w, lse_w = window_attention(q1, wk, wv, window_len, scale)
    if n_cpu:
        scale_ = d ** -0.5 if scale is None else scale
        s_cpu = torch.einsum("kgd,lkd->kgl", q1[0].view(hkv, hq // hkv, d), k_cpu) * scale_
        cpu_mass = torch.sigmoid(torch.logsumexp(s_cpu, -1).reshape(1, hq) - lse_w)
        counts = {blk: torch.tensor(sorted({math.ceil(f * -(-n_cpu // blk)) for f in ANCHOR_BUDGET_GRID}))
                  for blk in ANCHOR_BLOCK_SIZES}
        errs, o_full = error_curves(q1, k_cpu, v_cpu, out_w, lse_w, counts, scale)
        rel = {blk: relative_errors(e, o_full) for blk, e in errs.items()}
        budgets = [smallest_budget(rel[blk], counts[blk], blk, n_cpu, tau) for blk in ANCHOR_BLOCK_SIZES]
        stream_err = rel[ANCHOR_BLOCK_SIZES[0]][..., 0]  # count 0: the window alone
    else:
        cpu_mass = torch.zeros(1, hq, device=dev)
        stream_err = torch.zeros(1, hq, device=dev)
        budgets = [torch.zeros(1, hq, device=dev) for _ in ANCHOR_BLOCK_SIZES]
    return PrefillStatistics(
        n_cpu=torch.tensor([float(n_cpu)], device=dev),
        sink_len=torch.tensor([sink_len], device=dev),
        window_len=window_len,
        key_top_eig_frac=_top_eig_frac(mom["key_cov"]) if n_cpu else torch.zeros(1, hkv, device=dev),
        anchor_q=q1,
        anchor_cpu_mass=cpu_mass,
        anchor_stream_err=stream_err,
        anchor_budget=torch.stack(budgets, -1),
        tau=float(tau),
        **mom,
    )


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(_EPS)


def decode_features(stats: PrefillStatistics, q: torch.Tensor, q_prev: torch.Tensor, window_k: torch.Tensor,
                    window_v: torch.Tensor, window_len: torch.Tensor, layer: int, n_layers: int,
                    scale: float | None = None) -> torch.Tensor:
    """The 41 features `[B * Hq, 41]` (float32, row `b * Hq + h`, columns `FEATURE_NAMES`) of one decode step at one layer.

    `q, q_prev [B, Hq, D]`: this step's queries and the previous step's (the anchor query at the
    first step); `window_k/v [B, Hkv, W, D]`: the GPU window buffers of the B sequences (sink rows
    first, then recent rows); `window_len [B]` (a tensor on q's device): valid rows, this step's
    token included; `stats`: the B sequences' `PrefillStatistics` in the same order.
    """
    if q.dim() != 3 or q_prev.shape != q.shape:
        raise ValueError(f"q and q_prev must both be [B, Hq, D], got {tuple(q.shape)} and {tuple(q_prev.shape)}")
    b, hq, d = q.shape
    if window_k.dim() != 4 or window_k.shape != window_v.shape or window_k.shape[0] != b or window_k.shape[3] != d:
        raise ValueError(f"window_k and window_v must both be [{b}, Hkv, W, {d}], got {tuple(window_k.shape)} and {tuple(window_v.shape)}")
    hkv = window_k.shape[1]
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the window's {hkv} KV heads")
    if stats.batch != b or stats.key_mean.shape[1:] != (hkv, d) or stats.anchor_q.shape[1] != hq:
        raise ValueError(f"stats hold {stats.batch} rows of geometry (Hkv {stats.key_mean.shape[1]}, Hq {stats.anchor_q.shape[1]}, "
                         f"D {stats.key_mean.shape[2]}); the step has {b} rows of (Hkv {hkv}, Hq {hq}, D {d})")
    if window_len.shape != (b,):
        raise ValueError(f"window_len must be [{b}], got {tuple(window_len.shape)}")
    # A tensor on another device would be copied here, a host synchronisation on every step.
    if window_len.device != q.device or window_k.device != q.device or stats.n_cpu.device != q.device:
        raise ValueError(f"q is on {q.device} but window_len is on {window_len.device}, window_k on {window_k.device} "
                         f"and stats on {stats.n_cpu.device}; all must be on q's device")
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} is not in [0, {n_layers})")
    g = hq // hkv
    dev = q.device
    scale = d ** -0.5 if scale is None else scale
    inf = math.inf

    qf = q.float().view(b, hkv, g, d)
    qs = qf * scale
    kw, vw = window_k.float(), window_v.float()
    pos = torch.arange(kw.shape[2], device=dev)
    wl = window_len.view(b, 1)
    valid = pos < wl
    sink = valid & (pos < stats.sink_len.view(b, 1))
    recent = valid & ~sink
    s = torch.einsum("bkgd,bkwd->bkgw", qs, kw)
    s_valid = s.masked_fill(~valid[:, None, None, :], -inf)
    lse_w = torch.logsumexp(s_valid, -1)
    p_w = torch.exp(s_valid - lse_w[..., None])
    o_w = torch.einsum("bkgw,bkwd->bkgd", p_w, vw)
    lse_sink = torch.logsumexp(s.masked_fill(~sink[:, None, None, :], -inf), -1)
    max_w = s_valid.amax(-1)
    max_sink = s.masked_fill(~sink[:, None, None, :], -inf).amax(-1)
    max_recent = s.masked_fill(~recent[:, None, None, :], -inf).amax(-1)
    entropy = -torch.special.xlogy(p_w, p_w).sum(-1) / torch.log(wl.clamp_min(2).float()).view(b, 1, 1)

    # The CPU segment, from its moments only.
    n = stats.n_cpu.view(b, 1, 1)
    has_cpu = n > 0
    mean_s = torch.einsum("bkgd,bkd->bkg", qs, stats.key_mean)
    var_s = (torch.matmul(qs, stats.key_cov) * qs).sum(-1).clamp_min(0)  # matmul: no copy of the covariances
    std_s = var_s.sqrt()
    lse_c = torch.where(has_cpu, torch.log(n.clamp_min(1)) + mean_s + var_s / 2, lse_w - _LOGIT_CLIP)
    logit = (lse_c - lse_w).clamp(-_LOGIT_CLIP, _LOGIT_CLIP)
    mass = torch.where(has_cpu, torch.sigmoid(logit), torch.zeros_like(logit))
    max_c = mean_s + std_s * torch.sqrt(2 * torch.log(n.clamp_min(1)))
    o_c = stats.value_mean[:, :, None] + torch.matmul(qs, stats.value_key_cov.transpose(-1, -2))
    o_hat = (1 - mass)[..., None] * o_w + mass[..., None] * o_c
    o_hat_norm = o_hat.norm(dim=-1)
    norm_max = o_hat_norm.amax((1, 2), keepdim=True).clamp_min(_EPS)
    shift = (o_c - o_w).norm(dim=-1)
    stream_err = torch.where(has_cpu, mass * shift / norm_max, torch.zeros_like(mass))
    eps = (stats.tau / stream_err.clamp_min(_EPS)).clamp(max=1.0)
    z = torch.special.ndtri((1 - eps).clamp(1e-7, 1 - 1e-7))
    bgt_gauss = torch.where(eps >= 1, torch.zeros_like(eps), torch.special.ndtr(z - std_s))

    # Query dynamics and cross-head.
    q_prev_f = q_prev.float().view(b, hkv, g, d)
    anchor = stats.anchor_q.float().view(b, hkv, g, d)
    q_norm = qf.norm(dim=-1)
    qn = qf / q_norm.clamp_min(_EPS)[..., None]
    gram = torch.einsum("bkgd,bkhd->bkgh", qn, qn)
    group_cos = (gram.sum(-1) - 1) / (g - 1) if g > 1 else torch.ones_like(q_norm)
    recent_n = recent.sum(-1).view(b, 1, 1)
    # matmul over (b, k) batches reads kw in place (einsum here would copy it into [b, w, k, d]).
    recent_sum = torch.matmul(recent.float()[:, None, None, :].expand(b, hkv, 1, -1), kw)[:, :, 0]
    recent_mean = recent_sum / recent_n.view(b, 1).clamp_min(1)[..., None]
    total = wl.view(b, 1, 1).float() + n
    steps = (wl.view(b, 1, 1) - stats.window_len.view(b, 1, 1)).clamp_min(0).float()

    def kv(x: torch.Tensor) -> torch.Tensor:  # per KV head [B, Hkv] -> [B, Hkv, G]
        return x[..., None].expand(b, hkv, g)

    knm = stats.key_norm_mean.clamp_min(_EPS)
    values = {
        "layer_frac": torch.full((b, hkv, g), layer / max(n_layers - 1, 1), device=dev),
        "head_frac": (torch.arange(hq, device=dev, dtype=torch.float32) / max(hq - 1, 1)).view(1, hkv, g).expand(b, hkv, g),
        "log2_context": torch.log2(total.clamp_min(1)).expand(b, hkv, g),
        "log2_cpu_tokens": torch.log2(1 + n).expand(b, hkv, g),
        "cpu_fraction": (n / total.clamp_min(1)).expand(b, hkv, g),
        "key_norm_mean": kv(stats.key_norm_mean),
        "key_norm_cv": kv(stats.key_norm_var.sqrt() / knm),
        "key_concentration": kv(stats.key_mean.norm(dim=-1) / math.sqrt(d) / knm),
        "key_spread": kv((stats.key_cov.diagonal(dim1=-2, dim2=-1).sum(-1) / d).clamp_min(0).sqrt()),
        "key_top_eig_frac": kv(stats.key_top_eig_frac),
        "value_spread": kv(stats.value_var.clamp_min(0).sqrt()),
        "recent_key_drift_cos": kv(_cos(recent_mean, stats.key_mean)),
        "q_norm": q_norm / math.sqrt(d),
        "q_key_mean_cos": _cos(qf, stats.key_mean[:, :, None]),
        "window_score_max": max_w,
        "sink_recent_gap": torch.where(sink.any(-1).view(b, 1, 1) & (recent_n > 0), max_sink - max_recent,
                                       torch.zeros_like(max_w)).clamp(-_LOGIT_CLIP, _LOGIT_CLIP),
        "cpu_score_mean_est": mean_s,
        "cpu_score_std_est": std_s,
        "cpu_score_max_est": max_c,
        "cpu_max_gap_est": torch.where(has_cpu, max_c - max_w, torch.full_like(max_w, -_LOGIT_CLIP)),
        "lse_window": lse_w,
        "sink_share": torch.exp(lse_sink - lse_w),
        "lse_cpu_est": lse_c,
        "cpu_mass_logit_est": logit,
        "cpu_mass_est": mass,
        "window_entropy": entropy,
        "cpu_shift_est": torch.where(has_cpu, shift / o_w.norm(dim=-1).clamp_min(_EPS), torch.zeros_like(shift)),
        "stream_err_est": stream_err,
        "q_prev_cos": _cos(qf, q_prev_f),
        "q_anchor_cos": _cos(qf, anchor),
        "q_anchor_norm_ratio": q_norm / anchor.norm(dim=-1).clamp_min(_EPS),
        "log2_steps": torch.log2(1 + steps).expand(b, hkv, g),
        "anchor_cpu_mass": stats.anchor_cpu_mass.view(b, hkv, g),
        "anchor_stream_err": stats.anchor_stream_err.view(b, hkv, g),
        "anchor_bgt_1": stats.anchor_budget[..., 0].view(b, hkv, g),
        "anchor_bgt_16": stats.anchor_budget[..., 1].view(b, hkv, g),
        "anchor_bgt_128": stats.anchor_budget[..., 2].view(b, hkv, g),
        "bgt_gauss_est": bgt_gauss,
        "out_norm_share": o_hat_norm / norm_max,
        "cpu_mass_group_rel": mass / mass.amax(-1, keepdim=True).clamp_min(_EPS),
        "group_q_cos": group_cos,
    }
    return torch.stack([values[name] for name in FEATURE_NAMES], -1).reshape(b * hq, N_FEATURES)


__all__ = [
    "ANCHOR_BLOCK_SIZES",
    "ANCHOR_BUDGET_GRID",
    "FEATURES",
    "FEATURE_NAMES",
    "N_FEATURES",
    "PrefillStatistics",
    "compute_prefill_statistics",
    "decode_features",
    "window_attention",
]
