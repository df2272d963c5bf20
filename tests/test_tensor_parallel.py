"""Tensor parallelism over KV heads: one runtime per rank.

In one process: the per-rank geometry and its errors, the split of a host's cores between ranks
(by NUMA node, physical cores whole, never overlapping), a rank's runtime planning over its share.
Across two processes (torchrun, gloo on the CPU): a tiny Llama loaded with transformers'
`tp_plan="auto"` generates through the runtime exactly the single-process dense tokens, and each
rank's store holds only its own KV heads.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest
import torch

from hybrid_runtime.config import GeometryConfig, SelectionConfig, config_from_dict
from hybrid_runtime.pinning import numa_nodes, physical_cores, plan_cores, rank_cores
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.tensor_parallel import TensorParallelShard

ROOT = Path(__file__).resolve().parent.parent
LLAMA = GeometryConfig("llama-3.1-8b", 32, 32, 8, 128)


# ---------------------------------------------------------------------------- heads
def test_local_geometry_and_heads_per_rank():
    shard = TensorParallelShard(1, 4)
    g = shard.local_geometry(LLAMA)
    assert (g.layers, g.q_heads, g.kv_heads, g.head_dim) == (32, 8, 2, 128)
    assert list(shard.kv_heads(LLAMA)) == [2, 3] and list(shard.q_heads(LLAMA)) == list(range(8, 16))
    assert TensorParallelShard(0, 1).local_geometry(LLAMA) == LLAMA
    # Every rank's heads together are the model's, once each.
    heads = [h for r in range(8) for h in TensorParallelShard(r, 8).kv_heads(LLAMA)]
    assert heads == list(range(8))


def test_heads_that_do_not_divide_are_refused_with_the_sizes_that_do():
    with pytest.raises(ValueError, match=r"8 KV heads do not divide evenly.*allowed world sizes: \[1, 2, 4, 8\]"):
        TensorParallelShard(0, 3).local_geometry(LLAMA)
    with pytest.raises(ValueError, match=r"3 KV heads.*\[1, 3\]"):
        TensorParallelShard(0, 2).local_geometry(GeometryConfig("smollm2-135m", 30, 9, 3, 64))


@pytest.mark.parametrize("args, match", [
    ((2, 2), "rank is 2; allowed: an integer in 0..1"),
    ((0, 0), "world_size is 0"),
    ((0, 2, 1, 3), "local_world_size is 3; allowed: an integer in 1..2"),
    ((0, 2, 1, 1), "local_rank is 1; allowed: an integer in 0..0"),
    ((True, 2), "rank is True"),
])
def test_bad_shards_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        TensorParallelShard(*args)


def test_streaming_heads_are_cut_to_the_rank_and_renumbered():
    sel = SelectionConfig(name="fixed", streaming_heads={0: (0, 9, 10), 3: (1,)})
    assert TensorParallelShard(1, 4).local_selection(sel, LLAMA).streaming_heads == {0: (1, 2)}
    assert TensorParallelShard(0, 4).local_selection(sel, LLAMA).streaming_heads == {0: (0,), 3: (1,)}


# ---------------------------------------------------------------------------- cores
def _disjoint(shares):
    return all(not set(a.cores) & set(b.cores) for a, b in combinations(shares, 2))


@pytest.mark.parametrize("cores, nodes, world, expected", [
    (range(8), {0: range(8)}, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # one node: even slices
    (range(7), {0: range(7)}, 2, [[0, 1, 2, 3], [4, 5, 6]]),
    (range(8), {0: range(4), 1: range(4, 8)}, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # a node per rank
    (range(8), {0: range(4), 1: range(4, 8)}, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),  # ranks divide each node
    (range(16), {n: range(4 * n, 4 * n + 4) for n in range(4)}, 2, [list(range(8)), list(range(8, 16))]),
    (range(8), {0: range(4), 1: range(4, 8)}, 3, [[0, 1, 2], [3, 4, 5], [6, 7]]),  # does not divide: even slices
])
def test_rank_cores_split_without_overlap(cores, nodes, world, expected):
    nodes = {n: list(c) for n, c in nodes.items()}
    shares = [rank_cores(r, world, list(cores), nodes) for r in range(world)]
    assert [s.cores for s in shares] == expected
    assert _disjoint(shares) and all(s.exclusive for s in shares)


def test_rank_cores_follow_each_rank_gpus_node():
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    # GPU 0 on node 1, GPU 1 on node 0: each rank goes where its GPU is.
    assert [rank_cores(r, 2, range(8), nodes, gpu_nodes=[1, 0]).cores for r in range(2)] == [[4, 5, 6, 7], [0, 1, 2, 3]]
    # Both GPUs on node 0: the ranks split that node.
    assert [rank_cores(r, 2, range(8), nodes, gpu_nodes=[0, 0]).cores for r in range(2)] == [[0, 1], [2, 3]]


def test_rank_cores_keep_hyperthread_siblings_together(tmp_path):
    # 4 physical cores, siblings (0, 4) (1, 5) (2, 6) (3, 7), as Linux numbers them.
    for c in range(8):
        d = tmp_path / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(f"{c % 4},{c % 4 + 4}\n")
    assert physical_cores(range(8), tmp_path) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    shares = [rank_cores(r, 2, range(8), {0: list(range(8))}, cpu_dir=tmp_path) for r in range(2)]
    assert [s.cores for s in shares] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_fewer_cores_than_ranks_share_them_unpinned():
    share = rank_cores(1, 3, [0, 1], {0: [0, 1]})
    assert share.cores == [0, 1] and not share.exclusive and "nothing is pinned" in share.note


def test_numa_nodes_from_sysfs(tmp_path):
    for n, text in ((0, "0-3,8-11\n"), (1, "4-7,12-15\n"), (2, "\n")):
        (tmp_path / f"node{n}").mkdir()
        (tmp_path / f"node{n}" / "cpulist").write_text(text)
    assert numa_nodes(range(16), tmp_path) == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert numa_nodes([5, 6], tmp_path) == {1: [5, 6]}
    assert numa_nodes([0, 1], tmp_path / "absent") == {0: [0, 1]}


def test_plan_cores_over_a_rank_share():
    plan = plan_cores(3, True, [4, 5, 6, 7])
    assert plan.caller == 4 and plan.cpu == [5, 6, 7] and plan.torch_threads == 1


def _cfg(**scheduler):
    return config_from_dict({
        "geometry": {"name": "custom", "layers": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 32},
        "kv_cache": {"dtype": "fp32", "sink": 4, "local": 16, "generated_cap": 16, "cpu_capacity_tokens": 2048,
                     "max_sequences": 2},
        "selection": {"name": "full", "streaming_heads": {1: [3]}},
        "scheduler": {"placement": "cpu_only", "gpu_worker": False, **scheduler},
    })


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_rank_runtime_serves_its_heads_on_its_cores():
    before = os.sched_getaffinity(0)
    shard = TensorParallelShard(1, 2)
    with HybridRuntime(_cfg(), tensor_parallel=shard) as rt:
        g = rt.geometry
        assert (g.q_heads, g.kv_heads) == (2, 1) and rt.model_geometry.q_heads == 4
        assert rt.cfg.selection.streaming_heads == {1: (1,)}  # model head 3 is this rank's head 1
        assert rt.store.arena(0).shape[0] > 0 and rt.store.geometry.kv_heads == 1
        share = rt.core_share
        assert share.cores == rank_cores(1, 2).cores
        planned = [c for c in rt.scheduler.cores.cpu + [rt.scheduler.cores.caller] if c is not None]
        assert set(planned) <= set(share.cores)
        if share.exclusive:  # the launcher (this thread) stays on the rank's cores until close
            assert os.sched_getaffinity(0) == set(share.cores)
        assert "rank 1 of 2" in rt.stats()["pinning"]
        # decode takes the rank's heads
        k, v = torch.randn(2, 40, 1, 32)
        rt.prefill(0, 0, k, v)
        out = rt.decode(0, [0], torch.randn(1, 2, 32), torch.randn(1, 1, 32), torch.randn(1, 1, 32))
        assert out.shape == (1, 2, 32)
    assert os.sched_getaffinity(0) == before


def test_rank_runtime_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="2 KV heads do not divide evenly"):
        HybridRuntime(_cfg(), tensor_parallel=TensorParallelShard(0, 4))


# ---------------------------------------------------------------------------- transformers, two ranks
transformers = pytest.importorskip("transformers", reason="the transformers backend needs the `models` extra")


def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=4096, initializer_range=0.1)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).eval()


def _left_padded(lengths, vocab=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, t - n:] = 1
        ids[b, : t - n] = 0
    return ids, mask


def test_unsharded_model_is_not_tensor_parallel():
    from hybrid_runtime.integrations.transformers import tensor_parallel_of

    assert tensor_parallel_of(_tiny_llama()) is None


def test_hand_sharded_model_without_process_group_is_refused_or_takes_an_explicit_shard():
    from hybrid_runtime.integrations.transformers import (
        UnsupportedModelError,
        disable_hybrid_attention,
        enable_hybrid_attention,
        tensor_parallel_of,
    )

    model = _tiny_llama()
    for layer in model.model.layers:  # rank 1 of 2, colwise by hand: the second half of each projection's rows
        for name in ("q_proj", "k_proj", "v_proj"):
            lin = getattr(layer.self_attn, name)
            lin.weight = torch.nn.Parameter(lin.weight[lin.weight.shape[0] // 2 :].clone())
    with pytest.raises(UnsupportedModelError, match="holds 4 of 8 query heads.*not initialized"):
        tensor_parallel_of(model)
    cfg = config_from_dict({"kv_cache": {"dtype": "fp32", "cpu_capacity_tokens": 2048, "max_sequences": 2},
                            "scheduler": {"placement": "cpu_only", "gpu_worker": False, "pin_cores": False}})
    rt = enable_hybrid_attention(model, cfg, tensor_parallel=TensorParallelShard(1, 2))
    try:
        assert (rt.geometry.q_heads, rt.geometry.kv_heads) == (4, 2)
        assert list(rt.tensor_parallel.kv_heads(rt.model_geometry)) == [2, 3]
    finally:
        disable_hybrid_attention(model)
    odd = _tiny_llama()
    for layer in odd.model.layers:  # 3 of 4 KV heads: no even split
        lin = layer.self_attn.k_proj
        lin.weight = torch.nn.Parameter(lin.weight[:48].clone())
        layer.self_attn.v_proj.weight = torch.nn.Parameter(layer.self_attn.v_proj.weight[:48].clone())
    with pytest.raises(UnsupportedModelError, match="8 of 8 query heads and 3 of 4 KV heads: not an even split"):
        tensor_parallel_of(odd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tensor_parallel_generate_equals_dense_and_each_rank_stores_its_heads(tmp_path):
    """Two ranks (torchrun, gloo), `tp_plan="auto"`: greedy tokens through the runtime equal the
    single-process dense tokens; each rank's store holds exactly its KV heads of every token."""
    from transformers import DynamicCache

    model = _tiny_llama()
    model.save_pretrained(tmp_path / "model")
    ids, mask = _left_padded([90, 61])
    new_tokens = 24  # past generated_cap: decode spills window pages into the CPU store too
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        dense = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    torch.save({"ids": ids, "mask": mask, "new_tokens": new_tokens}, tmp_path / "inputs.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(ROOT / "tests" / "tensor_parallel_rank.py"),
           str(tmp_path / "model"), str(tmp_path / "inputs.pt"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, res in enumerate(ranks):
        assert torch.equal(res["tokens"], dense), f"rank {r}"
        assert res["geometry"] == (2, 4, 2, 16)
        assert res["kv_heads"] == [2 * r, 2 * r + 1]
        assert res["decode_steps"] == 2 * (new_tokens - 1) and res["tasks"] > 0
        for b in range(2):
            pad = int((mask[b] == 0).sum())
            for layer in range(2):
                k, v = res["kv"][b][layer]  # [L, 2, D]: the rank's heads only
                want_k = cache.layers[layer].keys[b, 2 * r : 2 * r + 2, pad:].transpose(0, 1)
                want_v = cache.layers[layer].values[b, 2 * r : 2 * r + 2, pad:].transpose(0, 1)
                assert k.shape == want_k.shape, (k.shape, want_k.shape)
                torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, want_v, atol=1e-5, rtol=1e-5)
    shares = [set(res["share"]) for res in ranks]
    if len(os.sched_getaffinity(0)) >= 2:
        assert not shares[0] & shares[1]
        for res in ranks:
            mine = set(res["share"])
            assert set(res["launcher_affinity"]) == mine  # the launcher stayed on the rank's cores
            assert {c for c in res["worker_cores"] + [res["caller_core"]] if c is not None} <= mine
            assert set(res["affinity_after_close"]) > mine  # and got the host back at close
