"""Offline labels: the budget search, the Eq. 1 fit, the streaming label, and the saved dataset's contract."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from predictor.budget_search import (
    BLOCK_SIZES,
    all_counts,
    block_bounds,
    error_curves,
    fit_budget_law,
    geometric_counts,
    prefix_errors,
    relative_errors,
    smallest_budget,
)
from predictor.features import FEATURE_NAMES, window_attention
from predictor.labels import (LabelSettings, build, build_taus, label_layer, main, output_paths, repeated_fraction,
                             save_npz, select_texts, text_ranges)
from tests.helpers import random_kv

CONTRACT = {"features", "feature_names", "bgt0", "k", "streaming", "split", "text_id", "layer", "head", "position", "tau",
            "budgets", "budget_block_sizes"}


def brute_force_error(q, k_cpu, v_cpu, wk, wv, blk, n_blocks):
    """||o(n) - o|| by selecting the top-n Quest blocks per head and attending them with a plain softmax."""
    hq, d = q.shape
    hkv = k_cpu.shape[1]
    kmin, kmax = block_bounds(k_cpu, blk)
    errs = []
    for h in range(hq):
        kv = h // (hq // hkv)
        score = (torch.maximum(q[h] * kmin[:, kv], q[h] * kmax[:, kv])).sum(-1)
        top = score.argsort(descending=True)[:n_blocks]
        tok = (top[:, None] * blk + torch.arange(blk)).reshape(-1)
        tok = tok[tok < k_cpu.shape[0]]

        def attend(keys, values):
            return torch.softmax(keys @ q[h] / math.sqrt(d), 0) @ values

        o_n = attend(torch.cat([wk[kv], k_cpu[tok, kv]]), torch.cat([wv[kv], v_cpu[tok, kv]]))
        o = attend(torch.cat([wk[kv], k_cpu[:, kv]]), torch.cat([wv[kv], v_cpu[:, kv]]))
        errs.append((o_n - o).norm())
    return torch.stack(errs)


@pytest.mark.parametrize("blk", [1, 16, 32])
def test_error_curves_match_brute_force(blk):
    gen = torch.Generator().manual_seed(blk)
    hkv, g, d, lc, w = 2, 3, 16, 200, 24
    q = torch.randn(2, hkv * g, d, generator=gen)
    k_cpu, v_cpu = random_kv(lc, hkv, d, seed=blk)
    wk, wv = torch.randn(2, hkv, w, d, generator=gen), torch.randn(2, hkv, w, d, generator=gen)
    out_w, lse_w = window_attention(q, wk, wv, torch.tensor([w, w]))
    err, o_full = prefix_errors(q, k_cpu, v_cpu, out_w, lse_w, blk)
    nb = -(-lc // blk)
    assert err.shape == (2, hkv * g, nb + 1)
    assert torch.all(err[..., -1] < 1e-5)  # every block read: the dense output
    for n in (0, 1, 3, nb // 2, nb):
        torch.testing.assert_close(err[0, :, n], brute_force_error(q[0], k_cpu, v_cpu, wk[0], wv[0], blk, n),
                                   atol=1e-5, rtol=1e-4)
    # Several block sizes and a sparse grid of counts in one call agree with the per-size curves.
    counts = {blk: torch.tensor(sorted({0, 1, 3, nb // 2, nb})), 64: all_counts(lc, 64)}
    errs, o_grid = error_curves(q, k_cpu, v_cpu, out_w, lse_w, counts)
    torch.testing.assert_close(errs[blk], err[..., counts[blk]], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(errs[64], prefix_errors(q, k_cpu, v_cpu, out_w, lse_w, 64)[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(o_grid, o_full, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="must ascend strictly"):
        error_curves(q, k_cpu, v_cpu, out_w, lse_w, {blk: torch.tensor([0, nb + 1])})


def test_geometric_counts_cover_every_budget_within_five_percent():
    counts = geometric_counts(7616, 1)
    assert counts[0] == 0 and counts[-1] == 7616 and torch.all(counts.diff() > 0)
    assert torch.equal(counts[:65], torch.arange(65))
    assert float((counts[65:].float() / counts[64:-1].float()).max()) <= 1.05 + 1e-9
    assert torch.equal(geometric_counts(500, 16), all_counts(500, 16))


def test_smallest_budget_is_the_first_count_after_the_last_miss():
    counts = torch.arange(6)
    curves = torch.tensor([
        [0.50, 0.20, 0.05, 0.12, 0.03, 0.00],  # dips under tau at 2, misses again at 3: first safe count is 4
        [0.50, 0.30, 0.09, 0.08, 0.01, 0.00],  # monotone: 2
        [0.05, 0.04, 0.03, 0.02, 0.01, 0.00],  # the window alone meets tau: 0
        [0.50, 0.40, 0.30, 0.20, 0.15, 0.11],  # even everything misses: 1.0
    ])
    got = smallest_budget(curves, counts, blk=16, n_cpu=100, tau=0.1)
    torch.testing.assert_close(got, torch.tensor([0.64, 0.32, 0.0, 1.0]))
    assert torch.all(smallest_budget(curves, counts, blk=16, n_cpu=0, tau=0.1) == 0)


def test_search_finds_the_needle_block_and_no_less():
    """A constructed head: all the attention outside the window sits in one 16-token block of the segment."""
    d, lc, w = 16, 512, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 8.0
    k_cpu = torch.randn(lc, 1, d, generator=gen) * 0.1
    k_cpu[:, 0, 0] = -2.0  # every segment key points away from q ...
    k_cpu[160:176, 0, 0] = 4.0  # ... except block 10, which dominates the softmax
    v_cpu = torch.randn(lc, 1, d, generator=gen)
    v_cpu[160:176] += 3.0
    wk, wv = torch.zeros(1, 1, w, d), torch.randn(1, 1, w, d, generator=gen)
    out_w, lse_w = window_attention(q, wk, wv, torch.tensor([w]))
    for blk, tokens_needed in ((16, 16), (32, 32), (128, 128)):
        err, o_full = prefix_errors(q, k_cpu, v_cpu, out_w, lse_w, blk)
        rel = relative_errors(err, o_full)
        budget = smallest_budget(rel, torch.arange(rel.shape[-1]), blk, lc, tau=0.1)
        assert budget.item() == pytest.approx(tokens_needed / lc)  # one block
        assert rel[0, 0, 0] > 0.1  # zero blocks miss
    # Exact top-k tokens: the 16 needle tokens and nothing else are needed.
    err, o_full = prefix_errors(q, k_cpu, v_cpu, out_w, lse_w, 1)
    rel = relative_errors(err, o_full)
    assert smallest_budget(rel, torch.arange(lc + 1), 1, lc, tau=0.1).item() <= 16 / lc


def test_fit_recovers_a_known_law():
    x = torch.tensor([math.log2(b) for b in BLOCK_SIZES])
    bgt0 = torch.tensor([0.01, 0.05, 0.2])
    k = torch.tensor([0.002, 0.01, -0.01])
    budgets = bgt0[:, None] + k[:, None] * x[None]
    got0, got_k = fit_budget_law(budgets)
    torch.testing.assert_close(got0, bgt0)
    torch.testing.assert_close(got_k, k)
    noisy = budgets + torch.tensor([0.001, -0.001, 0.0, 0.001, -0.001])
    got0, got_k = fit_budget_law(noisy)
    torch.testing.assert_close(got_k, k, atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="budgets must be"):
        fit_budget_law(budgets[:, :3])


def synthetic_sequence(needle: bool):
    """A 1000-token sequence of 1 KV head whose queries only match the window, or also a CPU-segment needle."""
    t, d = 1000, 16
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(t, 1, d, generator=gen) * 0.1
    v = torch.randn(t, 1, d, generator=gen)
    k[:, 0, 0] = -6.0
    k[:4, 0, 0] = 6.0  # the sinks match the query
    if needle:  # segment tokens 288-297: inside one 16-token block
        k[292:302, 0, 0] = 12.0
        v[292:302] += 5.0
    q = torch.zeros(t, 2, d)
    q[:, :, 0] = 4.0
    return k, v, q


@pytest.mark.parametrize("needle", [False, True])
def test_streaming_label_on_constructed_heads(needle):
    settings = LabelSettings(lengths=(700,), span=64, sink=4, local=128, positions=3, texts=1)
    k, v, q = synthetic_sequence(needle)
    positions = [650, 660, 699]
    res = label_layer(k, v, q[positions], q[[p - 1 for p in positions]], q[635], positions, 636, 0, 1, settings)
    assert res["features"].shape == (6, len(FEATURE_NAMES))
    assert bool(res["streaming"].all()) is (not needle)
    assert bool((res["budgets"] == 0).all()) is (not needle)
    if needle:  # the 10 needle tokens: under a 16-token block
        cpu = 636 - 128 - 4
        torch.testing.assert_close(res["budgets"][:, 1], torch.full((6,), 16 / cpu))


def test_repeat_fraction_and_text_selection():
    gen = torch.Generator().manual_seed(2)
    fresh = torch.randint(0, 1000, (600,), generator=gen)
    assert repeated_fraction(fresh, 500) == 0.0
    copied = torch.cat([fresh[:300], fresh[:300]])
    assert repeated_fraction(copied, 500) == 1.0
    # Chunk 0 repeats itself in its decode span, chunks 1 and 2 do not.
    corpus = torch.cat([copied, torch.randint(0, 1000, (1200,), generator=gen)])
    settings = LabelSettings(lengths=(600,), span=64, sink=4, local=32, positions=2, texts=5)
    texts = select_texts(corpus, settings)
    assert [t.text_id for t in texts] == [1, 2]
    assert [t.split for t in texts] == ["train", "heldout"]


def test_settings_and_cli_reject_bad_values():
    with pytest.raises(ValueError, match="CPU segment"):
        LabelSettings(lengths=(512,))
    with pytest.raises(ValueError, match="positions must be"):
        LabelSettings(positions=0)
    with pytest.raises(ValueError, match="ascending"):
        LabelSettings(lengths=(4096, 2048))
    with pytest.raises(SystemExit):
        main(["--out", "x.npz", "--lengths", "2k"])
    with pytest.raises(SystemExit):
        main(["--out", "x.csv"])


def tiny_llama():
    """A random 2-layer Llama (4 query heads, 2 KV heads, head dim 16), seeded (skips without transformers)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                   max_position_embeddings=2048, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).eval()


def test_dataset_contract_on_a_tiny_model(tmp_path):
    model = tiny_llama()
    corpus = torch.randint(0, 256, (2100,))
    settings = LabelSettings(lengths=(400, 640), span=32, sink=16, local=64, positions=3, texts=3)
    out = tmp_path / "labels.npz"
    arrays, summary = build(model, corpus, settings, out, progress=lambda _: None)
    data = np.load(out, allow_pickle=False)
    assert set(data.files) == CONTRACT
    n = 3 * 2 * 3 * 2 * 4  # texts x lengths x positions x layers x heads
    assert data["features"].shape == (n, 41) and data["features"].dtype == np.float32
    assert np.isfinite(data["features"]).all()
    assert list(data["feature_names"]) == list(FEATURE_NAMES)
    for name in ("bgt0", "k"):
        assert data[name].shape == (n,) and data[name].dtype == np.float32
    assert data["streaming"].dtype == np.bool_
    for name in ("text_id", "layer", "head", "position"):
        assert data[name].shape == (n,) and data[name].dtype == np.int32
    assert data["tau"].shape == () and float(data["tau"]) == pytest.approx(0.1)
    # The split is by text: each text in one split, both splits present.
    splits = {t: set(data["split"][data["text_id"] == t]) for t in set(data["text_id"].tolist())}
    assert all(len(s) == 1 for s in splits.values())
    assert {next(iter(s)) for s in splits.values()} == {"train", "heldout"}
    assert set(data["layer"].tolist()) == {0, 1} and set(data["head"].tolist()) == {0, 1, 2, 3}
    pos = data["position"]
    assert np.all(((pos >= 400 - 32) & (pos < 400)) | ((pos >= 640 - 32) & (pos < 640)))
    # The labels' dense outputs are the model's own attention outputs.
    assert summary["max_output_deviation_vs_model"] < 1e-4
    assert summary["labels"]["rows"] == n
    # The ranges a labels run reads are known without the model, whatever tau (the evaluation's
    # training-overlap check relies on it when a checkpoint's labels file is absent).
    chunk = max(settings.lengths)
    read = [(int(t) * chunk, int(t) * chunk + int(pos[data["text_id"] == t].max()) + 1)
            for t in np.unique(data["text_id"])]
    assert text_ranges(corpus, settings) == read
    assert text_ranges(corpus, dataclasses.replace(settings, tau=0.02, criterion="score95")) == read
    save_npz(out, arrays)  # rewriting in place leaves no temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.npz"]


def test_several_taus_in_one_pass_equal_one_pass_each(tmp_path):
    """`build_taus` shares the forward passes and error curves; each file is what `build` writes for its tau."""
    model = tiny_llama()
    corpus = torch.randint(0, 256, (1400,))
    settings = LabelSettings(lengths=(400, 640), span=32, sink=16, local=64, positions=3, texts=2)
    taus = (0.05, 0.2)
    outs = output_paths(str(tmp_path / "labels_tau{tau}.npz"), taus)
    assert [p.name for p in outs] == ["labels_tau0.05.npz", "labels_tau0.2.npz"]
    built = build_taus(model, corpus, [dataclasses.replace(settings, tau=t) for t in taus], outs,
                       progress=lambda _: None)
    for tau, out, (arrays, summary) in zip(taus, outs, built):
        alone, _ = build(model, corpus, dataclasses.replace(settings, tau=tau), None, progress=lambda _: None)
        saved = np.load(out, allow_pickle=False)
        for name in CONTRACT:
            np.testing.assert_array_equal(saved[name], alone[name], err_msg=f"{name} at tau {tau}")
        assert summary["settings"]["tau"] == tau
    # A looser bound never needs more: budgets at 0.2 are at most those at 0.05, streaming at least as often.
    tight, loose = (np.load(p) for p in outs)
    assert (loose["budgets"] <= tight["budgets"] + 1e-7).all()
    assert (loose["streaming"] >= tight["streaming"]).all()
    assert list(tight["budget_block_sizes"]) == [1, 16, 32, 64, 128]
    with pytest.raises(ValueError, match="tau only"):
        build_taus(model, corpus, [settings, dataclasses.replace(settings, tau=0.2, positions=2)])
    with pytest.raises(ValueError, match="twice"):
        build_taus(model, corpus, [settings, settings])
    with pytest.raises(ValueError, match=r"\{tau\}"):
        output_paths("labels.npz", (0.1, 0.2))
    assert output_paths("labels.npz", (0.1,)) == [Path("labels.npz")]


def test_upper_fit_is_the_least_law_above_every_budget():
    """Against a brute-force grid over (bgt0, k): never below a budget, and no feasible line of the
    grid has a smaller sum over the block sizes."""
    from predictor.budget_search import fit_budget_law_upper

    blocks = (16, 32, 64, 128)
    x = torch.tensor([math.log2(b) for b in blocks], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    budgets = torch.rand(64, 4, generator=gen) * 0.3
    budgets[0] = torch.tensor([0.05, 0.05, 0.05, 0.05])  # flat
    budgets[1] = torch.tensor([0.07, 0.10, 0.16, 0.23])  # convex, as the measured budgets are: the chord of the ends
    bgt0, k = fit_budget_law_upper(budgets, blocks)
    line = bgt0.double()[:, None] + k.double()[:, None] * x
    assert (line >= budgets.double() - 1e-6).all()
    torch.testing.assert_close(line[0].float(), budgets[0])
    torch.testing.assert_close(line[1, [0, 3]].float(), budgets[1, [0, 3]])
    ks = torch.linspace(-0.2, 0.2, 401, dtype=torch.float64)
    for row in range(budgets.shape[0]):
        y = budgets[row].double()
        b0_needed = (y[None, :] - ks[:, None] * x[None, :]).amax(-1)  # least bgt0 feasible for each k
        grid_best = (b0_needed[:, None] + ks[:, None] * x[None, :]).sum(-1).min()
        assert float(line[row].sum()) <= float(grid_best) + 1e-5
    with pytest.raises(ValueError, match="two distinct"):
        fit_budget_law_upper(budgets[:, :1], (16,))
