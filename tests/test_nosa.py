"""The NOSA executor: Eq. 5-7 selection, the locality bound, the block cache, dense equivalence, config errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_runtime.config import ConfigError, config_from_dict
from hybrid_runtime.executors.nosa import LOG_COLUMNS, NosaExecutor
from hybrid_runtime.nosa_selection import block_max, select_blocks, sub_block_means
from hybrid_runtime.pinning import torch_threads
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.runtime import HybridRuntime
from predictor.eviction_head import EvictionHeads, load_eviction_heads, save_eviction_heads
from tests.helpers import CUDA, DEV

GEOM = {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The executor's host path is many small torch ops: on a loaded 2-core host two intra-op
    threads made a decode step 60x slower than one."""
    with torch_threads(1):
        yield
COL = {c: i for i, c in enumerate(LOG_COLUMNS)}


def nosa_config(tmp_path=None, k_tokens=256, k_q_tokens=64, score="eviction_head", selector="nosa", dtype="fp32", **extra):
    """Blocks of 16, sink 16 (1 block), window 32 + 16 (3 blocks): k 256 leaves a 12-block cache."""
    nosa = {"k_tokens": k_tokens, "block_tokens": 16, "pool_kernel_tokens": 8, "pool_stride_tokens": 4, "selector": selector}
    if selector == "nosa":
        nosa.update(k_q_tokens=k_q_tokens, score=score)
        if score == "eviction_head":
            path = tmp_path / "heads.pt"
            torch.manual_seed(5)
            save_eviction_heads(EvictionHeads(GEOM["layers"], GEOM["kv_heads"], GEOM["head_dim"], hidden=8), path)
            nosa["checkpoint"] = str(path)
    nosa.update(extra)
    return config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 16, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 8192, "max_sequences": 4,
                     "dtype": dtype},
        "selection": {"name": "nosa"},
        "scheduler": {"placement": "gpu_only", "cpu_workers": 0, "gpu_worker": True},
        "nosa": nosa,
    })


def decode_steps(rt, steps, lengths=(300, 1000), seed=0, check_dense=False, after_step=None, outs=None):
    """Prefill random prompts, then `steps` decode steps of every layer; optionally check against
    dense, and append every step's output to `outs`."""
    gen = torch.Generator().manual_seed(seed)
    seq_ids = list(range(len(lengths)))
    for s, n in zip(seq_ids, lengths):
        for layer in range(GEOM["layers"]):
            rt.prefill(s, layer, torch.randn(n, 2, 32, generator=gen), torch.randn(n, 2, 32, generator=gen))
    for step in range(steps):
        for layer in range(GEOM["layers"]):
            q = torch.randn(len(seq_ids), 8, 32, generator=gen) * 3
            k, v = torch.randn(len(seq_ids), 2, 32, generator=gen), torch.randn(len(seq_ids), 2, 32, generator=gen)
            out = rt.decode(layer, seq_ids, q, k, v)
            if outs is not None:
                outs.append(out.float().cpu())
            if check_dense:
                ref = torch.stack([dense_attention(q[b], *rt.store.full_kv(s, layer))[0] for b, s in enumerate(seq_ids)])
                torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)
            if after_step is not None:
                after_step(step, layer, seq_ids)


# ---------------------------------------------------------------------------- selection (Eq. 5-7)
def test_sub_block_means_pool_the_existing_tokens_of_each_sub_block():
    x = torch.randn(3, 64, 5)
    count = torch.arange(64) < 40  # the second block holds 8 tokens
    means, n = sub_block_means(x, count, 32, 8, 4)
    assert means.shape == (3, 2 * 7, 5) and n.tolist() == [8.0] * 7 + [8.0, 4.0] + [0.0] * 5
    for blk in range(2):
        for i in range(7):
            lo = blk * 32 + i * 4
            tok = [t for t in range(lo, lo + 8) if t < 40]
            want = x[:, tok].mean(1) if tok else torch.zeros(3, 5)
            torch.testing.assert_close(means[:, blk * 7 + i], want)
            assert n[blk * 7 + i] == len(tok)


def test_select_blocks_takes_kq_by_query_then_fills_k_by_importance():
    s_q = torch.tensor([[0.1, 0.9, 0.2, 0.8, 0.0, 0.3]])
    s_e = torch.tensor([[5.0, 0.0, 4.0, 9.0, 1.0, 3.0]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    selected, qa = select_blocks(s_q, s_e, valid, k_q=2, k=4)
    # Query-aware: blocks 1 and 3; then importance over the rest: 0 (5.0), 2 (4.0); 5 is not valid.
    assert sorted(selected[0].tolist()) == [0, 1, 2, 3]
    assert {b for b, a in zip(selected[0].tolist(), qa[0].tolist()) if a} == {1, 3}
    # k larger than the valid blocks: every valid block once, then -1.
    selected, qa = select_blocks(s_q, s_e, valid, k_q=2, k=8)
    assert sorted(b for b in selected[0].tolist() if b >= 0) == [0, 1, 2, 3, 4] and (selected[0] == -1).sum() == 3
    # Query-aware only (k_q = k): the top 4 by s_q.
    selected, _ = select_blocks(s_q, s_e, valid, k_q=4, k=4)
    assert sorted(selected[0].tolist()) == [0, 1, 2, 3]


def test_block_max_pools_sub_blocks_and_masks_invalid_blocks():
    sub = torch.tensor([[1.0, 3.0, 2.0, 0.5, float("-inf"), float("-inf")]])
    out = block_max(sub, 2, torch.tensor([[True, True, False]]))
    assert out.tolist() == [[3.0, 2.0, float("-inf")]]


# ---------------------------------------------------------------------------- through the runtime
@pytest.mark.parametrize("source", ["eviction_head", "decayed_attention", "query_aware"])
@pytest.mark.parametrize("k_blocks", [68, 65])
def test_k_covering_every_block_equals_dense_attention(tmp_path, source, k_blocks):
    """No bias, and a cache as large as the CPU segment: the output is dense attention, through spills."""
    # 1000-token prompt: 60 CPU blocks, 61 after the spill. k = 68 blocks leaves a 64-block cache
    # (room to spare); k = 65 a 61-block cache, exactly every block once the spill has come (no free slot).
    cfg = nosa_config(tmp_path, k_tokens=k_blocks * 16,
                      **({"selector": "query_aware"} if source == "query_aware" else {"score": source}))
    with HybridRuntime(cfg) as rt:
        ex = rt.gpu_executor
        ex.selection_log = []
        decode_steps(rt, 20, check_dense=True)  # a spill of 16 tokens at step 16
        assert ex.misses > 0 and ex.capacity == k_blocks - 4
        log = np.concatenate(ex.selection_log)
        # Every CPU block selected at every step: the longer sequence's last steps fill the cache.
        blocks = -(-log[:, COL["cpu_len"]] // 16)
        assert (log[:, COL["selected"]] == np.minimum(blocks, ex.capacity)).all()
        assert (log[:, COL["selected"]] == ex.capacity).any() == (k_blocks == 65)


def test_eviction_head_locality_never_falls_below_ke_over_k(tmp_path):
    """Theorem 2 with a fixed score: of each step's C cache blocks at least C - C_q were selected the
    step before, outside blocks that were new or changed (the spilled tokens' blocks)."""
    cfg = nosa_config(tmp_path, k_tokens=256, k_q_tokens=96)
    with HybridRuntime(cfg) as rt:
        ex = rt.gpu_executor
        ex.selection_log = []
        decode_steps(rt, 40)  # spills at steps 16 and 32
        log = np.concatenate(ex.selection_log)
    k_e_cache = ex.capacity - ex.k_q
    warm = (log[:, COL["cold"]] == 0) & (log[:, COL["selected"]] == ex.capacity)
    rows = log[warm]
    assert rows.shape[0] > 100 and ex.capacity == 12 and ex.k_q == 6
    hits, changed = rows[:, COL["hits"]], rows[:, COL["changed"]]
    assert (hits >= k_e_cache - changed).all()
    assert (hits[changed == 0] >= k_e_cache).all() and (changed > 0).any()
    loc = ex.locality()
    assert loc["min_minus_bound"] >= 0 and loc["bound"] == pytest.approx(1 - 6 / 16)
    # The query-aware part moves: the bound is not met trivially.
    assert (hits[changed == 0] < ex.capacity).any()


def test_cache_holds_exactly_the_selected_blocks_after_each_step(tmp_path):
    cfg = nosa_config(tmp_path, k_tokens=256, k_q_tokens=64, score="decayed_attention", dtype="bf16")
    with HybridRuntime(cfg) as rt:
        ex = rt.gpu_executor
        ex.selection_log, ex.selection_blocks = [], []
        checked = []
        seen = [0]

        def check(step, layer, seq_ids):
            # The step's tasks may have run as several claims: every log entry since the last check.
            rows = np.concatenate(ex.selection_log[seen[0]:])
            blocks = np.concatenate(ex.selection_blocks[seen[0]:])
            seen[0] = len(ex.selection_log)
            # The cache on the host (it lives on the executor's device); the store's full_kv is on the host too.
            cache_block, cache_k, cache_v = (t[layer].cpu() for t in (ex.cache.block, ex.cache.k, ex.cache.v))
            for row, sel in zip(rows, blocks):
                slot, head, cpu_len = int(row[COL["slot"]]), int(row[COL["kv_head"]]), int(row[COL["cpu_len"]])
                held = cache_block[slot, head]
                assert sorted(held[held >= 0].tolist()) == sorted(int(b) for b in sel if b >= 0)
                seq = next(s for s in seq_ids if rt.store.slot(s) == slot)
                k, v = rt.store.full_kv(seq, layer)
                sink = rt.store._layer_state(seq, layer).sink_len
                for c, b in enumerate(held.tolist()):
                    if b >= 0:
                        n = min(16, cpu_len - b * 16)
                        lo = sink + b * 16
                        assert torch.equal(cache_k[slot, head, c, :n], k[lo : lo + n, head])
                        assert torch.equal(cache_v[slot, head, c, :n], v[lo : lo + n, head])
            checked.append(len(rows))

        decode_steps(rt, 18, after_step=check)  # a spill at step 16
    assert sum(checked) == 18 * 2 * 4  # every step, layer, sequence and KV head


def test_bytes_read_are_the_misses_k_and_v(tmp_path):
    cfg = nosa_config(tmp_path, k_tokens=256, score="decayed_attention")
    with HybridRuntime(cfg) as rt:
        ex = rt.gpu_executor
        ex.selection_log = []
        decode_steps(rt, 6)
        log = np.concatenate(ex.selection_log)
        assert ex.misses == int(log[:, COL["misses"]].sum()) > 0
        assert ex.bytes_read == ex.misses * 2 * 16 * 32 * 4  # K and V, 16 tokens x 32 dims, fp32
        assert sum(int(r.bytes_read.sum()) for r in rt.timeline.records) == ex.bytes_read
        # The first step of each (sequence, layer, head) fills the cache; later ones miss less.
        cold = log[:, COL["cold"]] == 1
        assert log[cold, COL["misses"]].min() == ex.capacity and log[~cold, COL["misses"]].mean() < ex.capacity


def test_release_empties_a_slots_cache(tmp_path):
    cfg = nosa_config(tmp_path, k_tokens=68 * 16, score="decayed_attention")
    with HybridRuntime(cfg) as rt:
        decode_steps(rt, 2, lengths=(400,))
        rt.release(0)
        assert all((b[rt.store._free_slots[-1]] == -1).all() for b in rt.gpu_executor.cache.block)
        # A new prompt in the same slot reuses block indices: nothing of the old one may be a hit.
        decode_steps(rt, 3, lengths=(500,), seed=9, check_dense=True)


def test_triton_kernels_match_the_torch_path(tmp_path):
    """The Triton gather of misses and attention over the cache slots (interpreted on the host)."""
    outs, caches = {}, {}
    for kernels in ("torch", "triton"):
        cfg = nosa_config(tmp_path, k_tokens=128, score="decayed_attention", dtype="bf16")
        with HybridRuntime(cfg, gpu_executor=lambda store: NosaExecutor(store, cfg.nosa, kernels=kernels)) as rt:
            ex = rt.gpu_executor
            got, step_outs = [], []
            decode_steps(rt, 3, lengths=(200, 330), outs=step_outs,
                         after_step=lambda step, layer, seq_ids: got.append(rt.timeline.records[-1].bytes_read.copy()))
            caches[kernels] = [c.clone() for c in ex.cache.k + ex.cache.v + ex.cache.block]
            outs[kernels] = (got, ex.misses, torch.stack(step_outs))
    for a, b in zip(caches["torch"], caches["triton"]):
        assert torch.equal(a, b)
    assert outs["torch"][1] == outs["triton"][1] > 0
    # The same bytes per task and step, and the same merged output. The interpreter multiplies the
    # bf16 cache in fp32; compiled on CUDA the kernel's dots take bf16 operands (as the GPU test allows).
    assert len(outs["torch"][0]) == len(outs["triton"][0]) == 3 * GEOM["layers"]
    assert all(np.array_equal(a, b) for a, b in zip(outs["torch"][0], outs["triton"][0]))
    tol = 2e-2 if CUDA else 1e-4
    torch.testing.assert_close(outs["triton"][2], outs["torch"][2], atol=tol, rtol=tol)


def test_cache_attention_kernel_matches_attend_blocks():
    from gpu_kernels.cache_attention import cache_attention
    from hybrid_runtime.executors.nosa import attend_blocks

    gen = torch.Generator().manual_seed(0)
    s, hkv, c, nb, d, g, b = 3, 2, 4, 16, 32, 4, 2
    k = torch.randn(s, hkv, c, nb, d, generator=gen)
    v = torch.randn(s, hkv, c, nb, d, generator=gen)
    blocks = torch.tensor([[[0, 3, -1, 1], [2, -1, -1, -1]], [[5, 4, 0, 1], [-1, -1, -1, -1]],
                           [[1, 0, 2, 3], [0, 1, 2, 3]]])
    slots, heads, batch = torch.tensor([0, 0, 2, 1]), torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 1])
    cpu_len = torch.tensor([60, 40, 50, 70])
    q = torch.randn(b, hkv * g, d, generator=gen)
    out, lse = torch.zeros(b, hkv * g, d, device=DEV), torch.full((b, hkv * g), float("-inf"), device=DEV)
    cache_attention(*(x.to(DEV) for x in (q, k, v, blocks, slots, heads, batch, cpu_len)), out, lse)
    out, lse = out.cpu(), lse.cpu()
    want_o, want_l = attend_blocks(q.view(b, hkv, g, d)[batch, heads], k[slots, heads], v[slots, heads],
                                   blocks[slots, heads], cpu_len, nb)
    torch.testing.assert_close(out.view(b, hkv, g, d)[batch, heads], want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.view(b, hkv, g)[batch, heads], want_l, atol=1e-4, rtol=1e-4)
    assert torch.isinf(lse.view(b, hkv, g)[1, 1]).all() and (out.view(b, hkv, g, d)[1, 1] == 0).all()  # no block


def test_eviction_head_checkpoint_round_trip_and_geometry_check(tmp_path):
    heads = EvictionHeads(3, 2, 32, hidden=4)
    save_eviction_heads(heads, tmp_path / "h.pt", {"note": "x"})
    back = load_eviction_heads(tmp_path / "h.pt")
    v = torch.randn(2, 7, 32)
    torch.testing.assert_close(back(1, v), heads(1, v))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt"):
        load_eviction_heads(tmp_path / "bad.pt")
    cfg = nosa_config(tmp_path)
    with pytest.raises(ConfigError, match="nosa.checkpoint: eviction heads of 3 layers x 4 KV heads"):
        HybridRuntime(cfg, gpu_executor=lambda store: NosaExecutor(store, cfg.nosa, eviction_heads=EvictionHeads(3, 4, 32)))


def with_nosa(**sections):
    """A config dict with the NOSA selection on its lane, plus `sections` laid over it."""
    data = {"selection": {"name": "nosa"}, "scheduler": {"placement": "gpu_only"}, "nosa": {}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return data


BAD = [
    ({"nosa": {"k_tokens": 1024}}, "nosa: read only with selection.name 'nosa'"),
    ({"selection": {"name": "nosa"}}, "scheduler.placement: 'fluxion' with selection.name 'nosa'"),
    (with_nosa(scheduler={"gpu_worker": False}), "scheduler.gpu_worker: false with selection.name 'nosa'"),
    (with_nosa(nosa={"k_tokens": 1000}), "nosa.k_tokens: 1000 is not a whole number of blocks"),
    (with_nosa(nosa={"k_tokens": 128}), "nosa.k_tokens: 128 tokens = 2 blocks of 64"),
    (with_nosa(nosa={"k_tokens": 2048, "k_q_tokens": 2048}), "nosa.k_q_tokens: 2048 tokens = 32 blocks"),
    (with_nosa(nosa={"selector": "query_aware", "k_q_tokens": 512}), "nosa.k_q_tokens: only read with nosa.selector"),
    (with_nosa(nosa={"score": "decayed_attention", "checkpoint": "x.pt"}), "nosa.checkpoint: only read with nosa.score"),
    (with_nosa(nosa={"decay": 0.5}), "nosa.decay: only read with nosa.score 'decayed_attention'"),
    # The default score reads nothing under selector query_aware, so neither does its checkpoint.
    (with_nosa(nosa={"selector": "query_aware", "checkpoint": "x.pt"}),
     r"nosa.checkpoint: only read with nosa.score 'eviction_head' and nosa.selector 'nosa' \(nosa.selector is "
     r"'query_aware'\); allowed: remove it, or set nosa.score: eviction_head, nosa.selector: nosa"),
    (with_nosa(nosa={"checkpoint": "missing.pt"}), "nosa.checkpoint: 'missing.pt' is not a file"),
    (with_nosa(nosa={"pool_kernel_tokens": 24}), "sub-blocks must tile a block"),
    (with_nosa(nosa={"score": "decayed_attention", "decay": 1.0}), "nosa.decay: 1.0 is not allowed"),
    (with_nosa(nosa={"score": "decayed_attention"}, selection={"streaming_heads": {0: [1]}}),
     "selection.streaming_heads: not read by the NOSA selection"),
    (with_nosa(nosa={"score": "decayed_attention"}, experiment={"variants": [{"name": "a", "placement": "fluxion"}]}),
     r"experiment.variants\[0\]: the NOSA executor serves the whole runtime"),
]


@pytest.mark.parametrize("data, message", BAD)
def test_bad_nosa_config_names_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_nosa_variant_without_top_level_nosa_is_refused():
    with pytest.raises(ConfigError, match="experiment.variants\\[0\\].selection.name: 'nosa'"):
        config_from_dict({"experiment": {"variants": [{"name": "a", "selection": {"name": "nosa"}}]}})


def test_nosa_without_a_gpu_lane_is_refused_by_the_runtime(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("'auto' has a GPU lane on this machine")
    cfg = config_from_dict({"geometry": GEOM, "selection": {"name": "nosa"}, "scheduler": {"placement": "gpu_only"},
                            "nosa": {"score": "decayed_attention"},
                            "kv_cache": {"sink": 16, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096}})
    with pytest.raises(ConfigError, match="needs a GPU lane"):
        HybridRuntime(cfg)


# ---------------------------------------------------------------------------- experiment and benchmark
def test_nosa_quality_policies_share_k_and_refuse_a_fraction_off_the_block_grid():
    from hybrid_runtime.experiments.nosa_quality import NosaQualitySettings, runtime_config

    st = NosaQualitySettings()
    policies = st.policies()
    assert list(policies) == ["nosa_kq0125", "nosa_kq025", "nosa_kq05", "nosa_decayed_kq025", "query_aware"]
    caps = {p: runtime_config(st, n).nosa.cache_blocks(runtime_config(st, n).kv_cache) for p, n in policies.items()}
    assert set(caps.values()) == {10}  # the same cache capacity for every selector
    assert [runtime_config(st, policies[p]).nosa.query_aware_blocks(runtime_config(st, policies[p]).kv_cache)
            for p in ("nosa_kq0125", "nosa_kq025", "nosa_kq05", "query_aware")] == [2, 4, 8, 10]
    with pytest.raises(ValueError, match="k_q / k = 0.3 is not a whole number"):
        NosaQualitySettings(kq_fractions=(0.3,))


def test_device_benchmark_smoke_runs_on_the_host(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "nosa.json"
    env = {**__import__("os").environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(root / "benchmarks" / "nosa.py"), "--smoke", "--out", str(out)], check=True,
                   env=env, capture_output=True, timeout=300)
    record = json.loads(out.read_text())
    m = record["metrics"]
    assert {"miss_ratio_vs_query_aware_kq025", "misses_per_step_query_aware_2x2k"} <= set(m)
    assert 0 < m["miss_ratio_vs_query_aware_kq025"] < 1
    assert all(p["locality_min"] >= p["locality_bound"] for p in record["points"])
    # Every point names its score source and its place in the run order; the table sits beside the JSON.
    assert [p["run_index"] for p in record["points"]] == [0, 1, 2]
    assert [p["score_source"].split(" ")[0] for p in record["points"]] == ["eviction_head", "eviction_head", "none:"]
    from benchmarks.nosa import markdown

    assert out.with_suffix(".md").read_text() == markdown(record)


def quality_results(lengths=(4096, 8192)):
    """A `nosa_quality.run` result with made-up figures (the shape `metrics_of` reads)."""
    def policy(agreement, misses, gap, source):
        return {"agreement": agreement, "kl": 0.01, "ppl": 10.0, "link_bytes_per_step_after_fill": misses * 16384.0,
                "cache": {"misses_per_step": misses}, "locality": {"min_minus_bound": gap}, "score_source": source}

    entry = {"dense": {"ppl": 9.0}, "policies": {
        "nosa_kq025": policy(0.9, 40.0, 0.0, "eviction_head distilled"),
        "nosa_decayed_kq025": policy(0.92, 30.0, -0.125, "decayed_attention"),
        "query_aware": policy(0.95, 100.0, 0.1, "none: query-aware"),
    }}
    return {"lengths": {str(n): entry for n in lengths}}


def test_quality_metrics_carry_the_issues_names():
    from hybrid_runtime.experiments.nosa_quality import metrics_of

    m = metrics_of(quality_results())
    for tag in ("4k", "8k"):
        assert m[f"agreement_nosa_kq025_{tag}"] == 0.9 and m[f"agreement_query_aware_{tag}"] == 0.95
        assert m[f"miss_ratio_nosa_kq025_vs_query_aware_{tag}"] == pytest.approx(0.4)
        assert m[f"link_bytes_per_step_nosa_kq025_{tag}"] == 40.0 * 16384
    # Over the eviction-head policies only: the decayed score's -0.125 does not count.
    assert m["min_locality_minus_bound"] == 0.0
    assert "min_locality_minus_bound_query_aware_4k" not in m


def test_device_benchmark_metrics_name_the_issues_figures():
    from benchmarks.nosa import assemble_metrics

    def row(selector, batch, misses, ms):
        return {"selector": selector, "batch": batch, "context": 32768, "misses_per_step": misses,
                "attention_ms_median": ms}

    rows = [row("nosa_kq025", 8, 40.0, 1.5), row("query_aware", 8, 100.0, 2.0),
            row("nosa_kq025", 16, 90.0, 2.5), row("query_aware", 16, 200.0, 3.0)]
    m = assemble_metrics(rows)
    assert m["miss_ratio_vs_query_aware_kq025"] == pytest.approx(0.45)  # the worse of the two points
    assert m["attention_ms_8x32k"] == 1.5 and m["attention_ms_query_aware_16x32k"] == 3.0


@pytest.mark.parametrize("name", ["nosa_quality-cpu", "nosa-h100", "nosa-h200"])
def test_committed_nosa_tables_are_rendered_from_their_json(name):
    """benchmarks/results/<name>.md is what the script renders from <name>.json (no typed-in figure)."""
    import json
    from pathlib import Path

    from benchmarks.nosa import markdown as device_markdown
    from hybrid_runtime.experiments.nosa_quality import markdown as quality_markdown

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    record = json.loads((results / f"{name}.json").read_text())
    render = quality_markdown if name.startswith("nosa_quality") else device_markdown
    assert (results / f"{name}.md").read_text() == render(record)


def test_warm_up_runs_both_triton_kernels_and_changes_nothing(tmp_path):
    cfg = nosa_config(tmp_path, k_tokens=128, score="decayed_attention", dtype="bf16")
    with HybridRuntime(cfg, gpu_executor=lambda store: NosaExecutor(store, cfg.nosa, kernels="triton")) as rt:
        ex = rt.gpu_executor
        ex.warm_up()
        assert all((b == -1).all() for b in ex.cache.block) and all((k == 0).all() for k in ex.cache.k)
        decode_steps(rt, 2, lengths=(200,))
        assert ex.misses > 0


@pytest.mark.parametrize("score", ["eviction_head", "decayed_attention"])
def test_memory_plan_counts_the_nosa_state(tmp_path, score):
    from hybrid_runtime.memory_plan import estimate_runtime

    cfg = nosa_config(tmp_path, k_tokens=256, score=score, dtype="bf16")
    plan = {p.name: p for p in estimate_runtime(cfg, cuda=False).parts}
    assert "nosa_state" in plan and "nosa_step" in plan and "torch_lane_task" not in plan
    with HybridRuntime(cfg) as rt:
        ex = rt.gpu_executor
        side = ex.importance if ex.importance is not None else ex.attention
        held = sum(t.numel() * t.element_size() for t in ex.sub_keys + side) + ex.cache.nbytes
    assert held <= plan["nosa_state"].nbytes <= 1.1 * held


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["nosa", "query_aware"])
def test_cuda_path_matches_the_torch_path_and_dense(tmp_path, selector):
    """On CUDA (UVA gather and in-place attention in Triton): the same selections, cache and bytes as
    the torch kernels, and dense attention when the cache covers every block."""
    extra = {"selector": "query_aware"} if selector == "query_aware" else {"score": "eviction_head"}
    results = {}
    for kernels in ("torch", "triton"):
        cfg = nosa_config(tmp_path, k_tokens=68 * 16, dtype="bf16", **extra)
        with HybridRuntime(cfg, gpu_executor=lambda store: NosaExecutor(store, cfg.nosa, kernels=kernels)) as rt:
            ex = rt.gpu_executor
            ex.warm_up()
            outs = []
            gen = torch.Generator().manual_seed(0)
            for s, n in enumerate((300, 1000)):
                for layer in range(GEOM["layers"]):
                    rt.prefill(s, layer, torch.randn(n, 2, 32, generator=gen).cuda(), torch.randn(n, 2, 32, generator=gen).cuda())
            for _ in range(18):  # a spill at step 16
                for layer in range(GEOM["layers"]):
                    q = torch.randn(2, 8, 32, generator=gen).cuda()
                    out = rt.decode(layer, [0, 1], q, torch.randn(2, 2, 32, generator=gen).cuda(),
                                    torch.randn(2, 2, 32, generator=gen).cuda())
                    ref = torch.stack([dense_attention(q[b].cpu(), *rt.store.full_kv(s, layer))[0] for b, s in enumerate([0, 1])])
                    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
                    outs.append(out.float().cpu())
            results[kernels] = (torch.stack(outs), ex.misses, [b.cpu() for b in ex.cache.block])
    assert results["torch"][1] == results["triton"][1] > 0
    assert all(torch.equal(a, b) for a, b in zip(results["torch"][2], results["triton"][2]))
    torch.testing.assert_close(results["torch"][0], results["triton"][0], atol=2e-2, rtol=2e-2)
