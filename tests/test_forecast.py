"""The Forecast's grids, targets, loss and training (forecast/)."""

from __future__ import annotations

import math

import pytest
import torch

from forecast.grid import (
    CELL,
    cell_counts,
    cell_means,
    fine_scores,
    group_block_scores,
    pool_to_blocks,
    window_scores,
)
from forecast.model import Forecast, ForecastQueries, ProxyQueries, rotate
from forecast.targets import attention_target, recall_at_k, restricted_kl


def _windows_brute(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Compressed windows (kernel 32, stride 16) of the first n keys `[n, D]`, by definition."""
    return torch.stack([keys[j * CELL : min(j * CELL + 2 * CELL, n)].mean(0) for j in range(-(-n // CELL))])


@pytest.mark.parametrize("n", [16, 37, 64, 200])
def test_window_scores_equal_scores_against_mean_pooled_windows(n):
    torch.manual_seed(0)
    keys, q = torch.randn(n, 8), torch.randn(8)
    cells = cell_means(keys)
    got = window_scores(cells @ q, cell_counts(n, cells.shape[0]))
    torch.testing.assert_close(got, _windows_brute(keys, n) @ q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride,kernel,blk,n", [(16, 32, 64, 200), (16, 32, 16, 50), (1, 2, 32, 70), (16, 32, 128, 129)])
def test_pool_to_blocks_is_the_max_over_overlapping_windows(stride, kernel, blk, n):
    torch.manual_seed(1)
    w = -(-n // stride)
    s = torch.randn(3, w)
    got = pool_to_blocks(s, stride, kernel, blk, n)
    nb = -(-n // blk)
    assert got.shape == (3, nb)
    for b in range(nb):
        idx = [i for i in range(w) if i * stride < (b + 1) * blk and i * stride + kernel > b * blk]
        torch.testing.assert_close(got[:, b], s[:, idx].amax(-1))


def test_group_block_scores_raw_and_per_head():
    torch.manual_seed(2)
    hkv, g, d, n, blk = 2, 3, 16, 150, 32
    keys = torch.randn(hkv, n, d)
    cells = cell_means(keys)
    counts = cell_counts(n, cells.shape[-2])
    wins = torch.stack([_windows_brute(keys[h], n) for h in range(hkv)])  # [Hkv, W, D]
    f = torch.randn(hkv, d)
    raw = group_block_scores(f, cells, counts, blk, n)
    torch.testing.assert_close(raw, pool_to_blocks(torch.einsum("hd,hwd->hw", f, wins), 16, 32, blk, n), rtol=1e-4, atol=1e-4)
    q = torch.randn(hkv * g, d)
    per_head = group_block_scores(q, cells, counts, blk, n)
    p = torch.softmax(torch.einsum("hgd,hwd->hgw", q.view(hkv, g, d), wins) / math.sqrt(d), -1).sum(1)
    torch.testing.assert_close(per_head, pool_to_blocks(p, 16, 32, blk, n), rtol=1e-4, atol=1e-5)


def test_attention_target_is_a_block_distribution_of_the_fine_grid():
    torch.manual_seed(3)
    hkv, g, d, n, blk = 2, 2, 8, 100, 16
    keys, q = torch.randn(hkv, n, d), torch.randn(5, hkv * g, d)
    t = attention_target(q, keys, blk)
    assert t.shape == (5, hkv, -(-n // blk))
    torch.testing.assert_close(t.sum(-1), torch.ones(5, hkv))
    s = torch.einsum("phgd,hnd->phgn", q.view(5, hkv, g, d), keys) / math.sqrt(d)
    p = torch.softmax(fine_scores(s, n), -1).sum(-2)
    ref = pool_to_blocks(p, 1, 2, blk, n)
    torch.testing.assert_close(t, ref / ref.sum(-1, keepdim=True))


def test_restricted_kl_is_plain_kl_when_k_covers_every_block_and_zero_at_the_target():
    torch.manual_seed(4)
    p = torch.softmax(torch.randn(4, 10), -1)
    z = torch.randn(4, 10)
    plain = (p * (p.log() - torch.log_softmax(z, -1))).sum(-1).mean()
    torch.testing.assert_close(restricted_kl(p, z, 10), plain)
    assert float(restricted_kl(p, p.log(), 3)) == pytest.approx(0.0, abs=1e-6)
    assert float(restricted_kl(p, z, 3)) >= 0
    assert float(recall_at_k(p, p, 3).mean()) == 1.0


def test_rotate_matches_transformers_rotary_embedding():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(5)
    x, ang = torch.randn(2, 3, 8), torch.randn(2, 8)
    cos, sin = ang.cos(), ang.sin()
    ref, _ = apply_rotary_pos_emb(x[:, :, None], x[:, :, None], cos[:, None], sin[:, None], unsqueeze_dim=1)
    torch.testing.assert_close(rotate(x, cos, sin), ref[:, :, 0])


# ---------------------------------------------------------------------------- training on a tiny model
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def test_training_lowers_the_restricted_kl_on_a_tiny_model(tmp_path):
    from forecast.train import TrainSettings, block_logits, evaluate, text_rows, train

    model = _tiny_llama()
    s = TrainSettings(length=320, span=32, positions=16, sink=4, local=32, block_size=16, top_k=4, rank=8, steps=25,
                      lr=2e-2)
    gen = torch.Generator().manual_seed(0)
    texts = [text_rows(model, torch.randint(0, 96, (s.length,), generator=gen), s, seed) for seed in range(2)]
    mods = [layer.self_attn for layer in model.model.layers]
    proxy = ProxyQueries.from_attention_modules(mods)
    forecast = Forecast(proxy.group_mean_weights(2), 2, 16, rank=s.rank)
    before = evaluate(forecast, proxy, texts, s, with_baselines=True)
    losses = train(forecast, texts, s, log=lambda m: None)
    after = evaluate(forecast, proxy, texts, s, with_baselines=False)
    assert losses[-1] < 0.7 * losses[0]
    assert after["restricted_kl"] < before["restricted_kl"]
    assert 0.0 <= before["proxy_recall_at_k"] <= 1.0 and 0.0 <= before["same_layer_recall_at_k"] <= 1.0
    # The saved checkpoint serves the same queries as the trained module.
    path = tmp_path / "f.pt"
    forecast.save(path, {"note": "test"})
    fq = ForecastQueries.load(path)
    r = texts[0]
    want = forecast(r["x"], r["cos"], r["sin"])[1]
    got = fq.queries(1, r["x"][1], r["cos"], r["sin"])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 weights
    assert block_logits(want[None], {**r, "cells": r["cells"][1:2]}, s.block_size).shape[-1] == -(-r["n_cpu"] // 16)


def test_training_texts_avoid_the_excluded_text_and_its_repeats():
    import numpy as np

    from forecast.train import TrainSettings, choose_texts

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50000, 20 * 512)
    ids[3 * 512 + 100 : 3 * 512 + 140] = ids[10 * 512 + 5 : 10 * 512 + 45]  # chunk 3 repeats a passage of chunk 10
    s = TrainSettings(length=512, span=64, positions=8, sink=4, local=32, block_size=16, train_texts=4,
                      heldout_texts=2, exclude=((10 * 512, 11 * 512),))
    texts = choose_texts(ids, s)
    offsets = [t["offset"] for t in texts]
    assert 3 * 512 not in offsets and 10 * 512 not in offsets and len(offsets) == 6
    assert [t["split"] for t in texts].count("heldout") == 2
