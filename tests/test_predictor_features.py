"""The predictor's features: names, shapes, the moment-based LSE, and no read of CPU-resident KV."""

from __future__ import annotations

import math

import pytest
import torch

from predictor.budget_search import prefix_errors, relative_errors
from predictor.features import (
    ANCHOR_BLOCK_SIZES,
    FEATURE_NAMES,
    FEATURES,
    N_FEATURES,
    PrefillStatistics,
    compute_prefill_statistics,
    decode_features,
    window_attention,
)
from tests.helpers import make_store, random_kv

HKV, G, D = 2, 4, 32
HQ = HKV * G


def random_step(b: int, w: int, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HQ, D, generator=gen)
    q_prev = torch.randn(b, HQ, D, generator=gen)
    wk = torch.randn(b, HKV, w, D, generator=gen)
    wv = torch.randn(b, HKV, w, D, generator=gen)
    return q.to(device), q_prev.to(device), wk.to(device), wv.to(device)


def prompt_stats(length: int, seed: int = 0, **kw) -> PrefillStatistics:
    k, v = random_kv(length, HKV, D, seed=seed)
    q_anchor = torch.randn(HQ, D, generator=torch.Generator().manual_seed(seed + 1))
    return compute_prefill_statistics(k, v, q_anchor, **kw)


def test_41_documented_names():
    assert N_FEATURES == 41 == len(FEATURE_NAMES) == len(set(FEATURE_NAMES))
    assert all(desc.split(":")[0] in {"structural", "KV distribution", "QK interaction", "attention contribution",
                                      "query dynamics", "budget estimation", "cross-head"} for _, desc in FEATURES)
    doc = __import__("predictor.features", fromlist=["x"]).__doc__
    assert all(f"| {name} |" in doc for name in FEATURE_NAMES)  # one table row each


def test_shapes_batch_and_edge_cases_are_finite():
    # Rows of different prompts (no CPU segment at all, short sink, long) batched together.
    stats = PrefillStatistics.cat([prompt_stats(10, sink=4, local=32), prompt_stats(600, seed=1, sink=4, local=32),
                                   prompt_stats(300, seed=2, sink=0, local=32)])
    assert stats.batch == 3 and stats.n_cpu.tolist() == [0.0, 564.0, 268.0]
    q, q_prev, wk, wv = random_step(3, 48)
    wl = torch.tensor([11, 40, 33])
    f = decode_features(stats, q, q_prev, wk, wv, wl, layer=3, n_layers=4)
    assert f.shape == (3 * HQ, 41) and f.dtype == torch.float32
    assert torch.isfinite(f).all()
    col = {n: f[:, i] for i, n in enumerate(FEATURE_NAMES)}
    assert torch.all(col["layer_frac"] == 1.0)
    assert col["head_frac"][:HQ].tolist() == pytest.approx([h / (HQ - 1) for h in range(HQ)])
    assert torch.all(col["cpu_mass_est"][:HQ] == 0) and torch.all(col["stream_err_est"][:HQ] == 0)
    assert torch.all(col["sink_share"][2 * HQ :] == 0)  # no sink rows
    assert torch.all((col["cpu_mass_est"] >= 0) & (col["cpu_mass_est"] <= 1))
    assert torch.all((col["bgt_gauss_est"] >= 0) & (col["bgt_gauss_est"] <= 1))
    torch.testing.assert_close(col["out_norm_share"].view(3, HQ).amax(-1), torch.ones(3))
    # Each row depends on its own sequence only.
    one = decode_features(stats.index(torch.tensor([1])), q[1:2], q_prev[1:2], wk[1:2], wv[1:2], wl[1:2], 3, 4)
    torch.testing.assert_close(one, f[HQ : 2 * HQ])


def test_features_read_no_cpu_resident_kv():
    """Garbage in the CPU store changes nothing once the prefill statistics are cached."""
    store = make_store(dtype="fp32", device="cpu")
    k, v = random_kv(700, HKV, D, seed=3)
    prompt = 690
    q_anchor = torch.randn(HQ, D)
    store.prefill(7, 0, k[:prompt], v[:prompt])
    for t in range(prompt, 700):  # decode steps append to the window
        store.append(0, [7], k[t : t + 1], v[t : t + 1])
    stats = compute_prefill_statistics(k[:prompt], v[:prompt], q_anchor, sink=store.cfg.sink, local=store.cfg.local)
    slot = torch.tensor([store.slot(7)])

    def features(st: PrefillStatistics) -> torch.Tensor:
        win_k, win_v = store.window(0)
        wl = torch.tensor([store.window_len(7, 0)])
        q = k[699:700, :1].expand(1, HQ, D).clone()
        return decode_features(st, q, q_anchor[None], win_k[slot], win_v[slot], wl, layer=0, n_layers=2)

    before = features(stats)
    assert store.cpu_len(7, 0) > 0
    torch.manual_seed(0)
    store.arena(0).normal_(mean=5.0, std=10.0)  # every CPU-resident key, value and metadata row
    torch.testing.assert_close(features(stats), before, rtol=0, atol=0)
    # The statistics do carry the segment: rebuilt from the garbage, the features change.
    k_bad, v_bad = store.full_kv(7, 0)
    garbage = compute_prefill_statistics(k_bad[:prompt].float(), v_bad[:prompt].float(), q_anchor,
                                         sink=store.cfg.sink, local=store.cfg.local)
    assert not torch.allclose(features(garbage), before)


def test_moment_lse_matches_true_lse_on_gaussian_keys():
    gen = torch.Generator().manual_seed(4)
    n, d = 50_000, 64
    a = torch.randn(d, d, generator=gen) / math.sqrt(d)
    mu = torch.randn(d, generator=gen) * 0.3
    keys = torch.randn(n, d, generator=gen) @ a.T + mu  # N(mu, A A^T)
    values = keys @ (torch.randn(d, d, generator=gen) / math.sqrt(d)).T + 0.3 * torch.randn(n, d, generator=gen)
    k = torch.cat([torch.zeros(1, d), keys]).view(n + 1, 1, d)  # one sink token, the rest is the CPU segment
    v = torch.cat([torch.zeros(1, d), values]).view(n + 1, 1, d)
    q = torch.randn(6, d, generator=gen) * 1.5
    stats = compute_prefill_statistics(k, v, q, sink=1, local=0).index(torch.zeros(1, dtype=torch.long))
    wk, wv = torch.zeros(1, 1, 4, d), torch.zeros(1, 1, 4, d)
    f = decode_features(stats, q[None], q[None], wk, wv, torch.tensor([1]), layer=0, n_layers=1)
    col = {name: f[:, i] for i, name in enumerate(FEATURE_NAMES)}
    true_lse = torch.logsumexp(keys @ q.T / math.sqrt(d), 0)
    assert col["cpu_score_std_est"].min() > 0.5  # a spread wide enough to matter
    torch.testing.assert_close(col["lse_cpu_est"], true_lse, atol=0.05, rtol=0)
    # The tilted-Gaussian output of the segment gives the window-only error within 10%.
    out_w, lse_w = window_attention(q[None], wk, wv, torch.tensor([1]))
    err, o_full = prefix_errors(q[None], keys.view(n, 1, d), values.view(n, 1, d), out_w, lse_w, 16)
    exact = relative_errors(err, o_full)[0, :, 0]
    torch.testing.assert_close(col["stream_err_est"], exact, rtol=0.1, atol=0)


def test_absorb_equals_statistics_of_the_longer_segment():
    k, v = random_kv(900, HKV, D, seed=5)
    q_anchor = torch.randn(HQ, D)
    stats = compute_prefill_statistics(k[:600], v[:600], q_anchor, sink=16, local=64)
    # 80 window tokens spill: the segment becomes [16, 616) of a 680-token prompt.
    merged = stats.absorb(k[None, 536:616], v[None, 536:616])
    direct = compute_prefill_statistics(k[:680], v[:680], q_anchor, sink=16, local=64)
    for name in ("n_cpu", "key_mean", "key_cov", "value_mean", "value_key_cov", "key_norm_mean", "key_norm_var",
                 "value_var", "key_top_eig_frac"):
        torch.testing.assert_close(getattr(merged, name), getattr(direct, name), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(merged.anchor_budget, stats.anchor_budget)  # prefill facts stay


def test_statistics_size_and_anchor_entries():
    stats = prompt_stats(1000, sink=16, local=64)
    hq_part = HQ * (D + 5)
    assert stats.nbytes == 4 * (HKV * (2 * D * D + 2 * D + 4) + hq_part) + 20
    assert stats.anchor_budget.shape == (1, HQ, len(ANCHOR_BLOCK_SIZES))
    assert torch.all((stats.anchor_budget >= 0) & (stats.anchor_budget <= 1))
    assert torch.all((stats.anchor_cpu_mass > 0) & (stats.anchor_cpu_mass < 1))


def test_bad_inputs_are_named():
    stats = prompt_stats(300, sink=4, local=32)
    q, q_prev, wk, wv = random_step(1, 40)
    wl = torch.tensor([40])
    with pytest.raises(ValueError, match="q and q_prev"):
        decode_features(stats, q, q_prev[:, :4], wk, wv, wl, 0, 2)
    with pytest.raises(ValueError, match="stats hold 1 rows"):
        decode_features(stats, q.expand(2, -1, -1), q_prev.expand(2, -1, -1), wk.expand(2, -1, -1, -1),
                        wv.expand(2, -1, -1, -1), torch.tensor([40, 40]), 0, 2)
    with pytest.raises(ValueError, match="layer 2 is not in"):
        decode_features(stats, q, q_prev, wk, wv, wl, 2, 2)
    with pytest.raises(ValueError, match="window_len must be"):
        decode_features(stats, q, q_prev, wk, wv, torch.tensor([40, 1]), 0, 2)
    with pytest.raises(ValueError, match="q_anchor must be"):
        compute_prefill_statistics(*random_kv(100, HKV, D), torch.randn(HQ + 1, D))
    with pytest.raises(ValueError, match="different tau"):
        PrefillStatistics.cat([stats, prompt_stats(300, sink=4, local=32, tau=0.2)])


@pytest.mark.gpu
def test_cuda_matches_cpu_without_host_sync():
    stats = PrefillStatistics.cat([prompt_stats(900, sink=16, local=64), prompt_stats(40, seed=1, sink=16, local=64)])
    q, q_prev, wk, wv = random_step(2, 96)
    wl = torch.tensor([90, 41])
    cpu = decode_features(stats, q, q_prev, wk, wv, wl, 1, 3)
    dev = torch.device("cuda")
    args = (stats.to(dev), q.to(dev), q_prev.to(dev), wk.to(dev), wv.to(dev), wl.to(dev), 1, 3)
    decode_features(*args)  # first call: lazy CUDA initialisation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = decode_features(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="all must be on q's device"):
        decode_features(stats.to(dev), q.to(dev), q_prev.to(dev), wk.to(dev), wv.to(dev), wl, 1, 3)
