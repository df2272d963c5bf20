"""NOSA's eviction head and its distillation: the input source, the training windows, the objective
on a synthetic case, and the replayed selection against a step-by-step one."""

from __future__ import annotations

import pytest
import torch

from hybrid_runtime.executors.nosa import NosaExecutor
from hybrid_runtime.nosa_selection import query_aware_scores, select_blocks
from hybrid_runtime.pinning import torch_threads
from hybrid_runtime.runtime import HybridRuntime
from predictor.eviction_head import EvictionHeads, load_eviction_heads, save_eviction_heads
from predictor.train_eviction_head import (
    QUALITY_TEXT,
    EvictionSettings,
    attention_targets,
    evaluate,
    overlaps,
    pooled_blocks,
    replay_selection,
    spearman,
    train,
    training_windows,
)
from tests.test_nosa import GEOM, nosa_config


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


def test_source_picks_the_input_and_survives_a_checkpoint(tmp_path):
    k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    key_heads = EvictionHeads(1, 2, 8, hidden=4, source="key")
    assert key_heads.pick(k, v) is k and EvictionHeads(1, 2, 8, hidden=4).pick(k, v) is v  # NOSA's default: the value
    save_eviction_heads(key_heads, tmp_path / "h.pt")
    back = load_eviction_heads(tmp_path / "h.pt")
    assert back.source == "key"
    torch.testing.assert_close(back(0, back.pick(k, v)), key_heads(0, k))
    # A checkpoint written before heads had a source reads values.
    data = torch.load(tmp_path / "h.pt", weights_only=True)
    del data["geometry"]["source"]
    torch.save(data, tmp_path / "old.pt")
    assert load_eviction_heads(tmp_path / "old.pt").source == "value"
    with pytest.raises(ValueError, match="source 'query'; allowed: value, key"):
        EvictionHeads(1, 2, 8, source="query")


@pytest.mark.parametrize("source", ["key", "value"])
def test_the_executor_scores_blocks_from_the_heads_source_only(tmp_path, source):
    """Prefill the same keys with other values (and the reverse): the importance follows the source."""
    torch.manual_seed(3)
    heads = EvictionHeads(GEOM["layers"], GEOM["kv_heads"], GEOM["head_dim"], hidden=8, source=source)
    cfg = nosa_config(tmp_path)
    gen = torch.Generator().manual_seed(0)
    k, v, other = (torch.randn(600, 2, 32, generator=gen) for _ in range(3))

    def importance(kk, vv):
        # Closed on the way out: an open runtime keeps its workers and the collector frozen.
        with HybridRuntime(cfg, gpu_executor=lambda store: NosaExecutor(store, cfg.nosa, eviction_heads=heads)) as rt:
            rt.prefill(0, 0, kk, vv)
            ex = rt.gpu_executor
            return ex.importance[0][: ex.store.n_chunks].clone()

    base = importance(k, v)
    same, changed = (importance(k, other), importance(other, v)) if source == "key" else (importance(other, v), importance(k, other))
    assert torch.isfinite(base).any()
    torch.testing.assert_close(same, base)
    assert not torch.equal(changed, base)


def test_training_windows_avoid_the_quality_text_and_the_held_out_windows():
    st = EvictionSettings()
    windows = training_windows(112966, st)
    assert len(windows) == st.texts + st.long_texts
    assert sum(n == st.long_length for _, n in windows) == st.long_texts
    for s, n in windows:
        assert s + n <= 112966 and not overlaps((s, s + n), QUALITY_TEXT)
        assert not any(overlaps((s, s + n), (h, h + m)) for h, m in st.heldout)
    with pytest.raises(ValueError, match="30 windows of 4096 tokens asked for"):
        training_windows(112966, EvictionSettings(texts=30))
    with pytest.raises(ValueError, match="overlaps the quality experiments' text"):
        EvictionSettings(heldout=((28000, 4096),))
    with pytest.raises(ValueError, match="source 'q'"):
        EvictionSettings(source="q")


def synthetic_window(seed: int, tokens: int = 512, queries: int = 24, d: int = 16) -> dict:
    """One layer, one KV head of two query heads: queries share a direction `u`, so the attention a
    key receives grows with `k . u`, which has a part shared by the tokens of a 16-token block (as
    text has topics); values are independent of the keys."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.zeros(d)
    u[0] = 1.0
    k = torch.randn(1, 1, tokens, d, generator=gen)
    k[..., 0] += torch.randn(tokens // 16, generator=gen).repeat_interleave(16)
    q = (6.0 * u + 0.5 * torch.randn(1, queries, 2, d, generator=gen))  # [L, n, Hq, D], unscaled
    v = torch.randn(1, 1, tokens, d, generator=gen)
    return {"k": k, "v": v, "q": q}


def test_the_objective_learns_a_key_driven_attention_a_value_head_cannot():
    """Distillation on a synthetic case where attention is set by the key: a key head ranks held-out
    tokens and blocks well, a value head (values independent of the keys) at chance."""
    st = EvictionSettings(steps=150, batch_tokens=512, hidden=8, block_tokens=16, pool_kernel_tokens=8,
                          pool_stride_tokens=4, replay_cache_blocks=8, replay_query_aware_blocks=2)
    train_w = [synthetic_window(s) for s in range(3)]
    held = synthetic_window(10)
    a_held = attention_targets(held)
    assert a_held.shape == (1, 1, 512) and torch.allclose(a_held.mean(-1), torch.ones(1, 1))  # uniform attention is 1
    results = {}
    for source in ("key", "value"):
        s2 = EvictionSettings(**{**st.__dict__, "source": source})
        x = torch.cat([w["k" if source == "key" else "v"] for w in train_w], 2)
        heads = train(x, torch.cat([attention_targets(w) for w in train_w], 2), s2, log=lambda _: None)
        assert heads.source == source
        results[source] = evaluate(heads, held, a_held, s2)
    assert results["key"]["spearman_mean"] > 0.8 and results["key"]["top_quarter_block_recall_mean"] > 0.6
    assert abs(results["value"]["spearman_mean"]) < 0.3
    assert results["key"]["loss"] < results["value"]["loss"]
    # The reference of `--evaluate`: the window's own target ranks its tokens exactly.
    own = evaluate(None, held, a_held, st, scores=torch.log(a_held + st.eps))
    assert own["spearman_mean"] > 0.999 and own["top_quarter_block_recall_mean"] >= results["key"]["top_quarter_block_recall_mean"]
    # Blocks ranked by the key head hold the blocks queries pick: fewer misses than the value head's.
    assert results["key"]["replay_misses_per_task_step_nosa"] < results["value"]["replay_misses_per_task_step_nosa"]
    assert results["key"]["replay_attention_share_nosa"] > results["value"]["replay_attention_share_nosa"]


def test_replayed_selection_equals_a_step_by_step_selection():
    st = EvictionSettings(block_tokens=16, pool_kernel_tokens=8, pool_stride_tokens=4, replay_cache_blocks=5,
                          replay_query_aware_blocks=2)
    gen = torch.Generator().manual_seed(1)
    hkv, g, d, n, s = 2, 3, 16, 12, 160
    q = torch.randn(n, hkv * g, d, generator=gen) * 2
    k = torch.randn(hkv, s, d, generator=gen)
    s_e = pooled_blocks(torch.randn(hkv, s, generator=gen), st)
    got = replay_selection(q, k, s_e, st)
    # The same selection, one step and one KV head at a time, with the cache as an explicit set.
    nb = s // 16
    sub = k.view(hkv, nb, 16, d).unfold(2, 8, 4).mean(-1)  # [Hkv, NB, spb, D]
    for h in range(hkv):
        for kq, score, name in ((2, s_e[h], "nosa"), (5, torch.zeros(nb), "query_aware")):
            cache, misses = set(), []
            for i in range(n):
                qi = q[i, h * g : (h + 1) * g][None] / d**0.5
                s_q = query_aware_scores(qi, sub[h].reshape(1, -1, d), torch.ones(1, nb * 3, dtype=torch.bool))
                sel, _ = select_blocks(s_q.view(1, nb, 3).amax(-1), score[None], torch.ones(1, nb, dtype=torch.bool), kq, 5)
                picked = set(sel[0].tolist())
                if i:
                    misses.append(len(picked - cache))
                cache = picked
            assert got[f"misses_{name}"][h].item() == pytest.approx(sum(misses) / len(misses))
    assert ((got["mass_query_aware"] > 0) & (got["mass_query_aware"] <= 1 + 1e-6)).all()


def test_spearman_of_a_monotone_map_is_one():
    x = torch.randn(3, 50)
    assert torch.allclose(spearman(x, x.exp()), torch.ones(3))
