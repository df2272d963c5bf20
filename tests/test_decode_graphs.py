"""`enable_hybrid_attention(decode_graphs=True)`: the decode step between attention calls as CUDA
graphs (`hybrid_runtime/integrations/decode_graphs.py`). On the CPU the same pieces run eagerly,
which checks the restructured forward against the model's own on every supported model type; the
graphs themselves are checked on CUDA (`gpu` marker)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")

from hybrid_runtime.integrations.decode_graphs import DecodeGraphs, DecodeGraphsUnsupported  # noqa: E402
from hybrid_runtime.integrations.transformers import (  # noqa: E402
    HybridCache,
    decode_graphs_of,
    UnsupportedModelError,
    disable_hybrid_attention,
    enable_hybrid_attention,
    hybrid_runtime_of,
)
from tests.test_transformers_integration import (  # noqa: E402
    _assert_same,
    _snapshot,
    forced_logits,
    greedy,
    hybrid_cfg,
    left_padded,
    tiny_model,
)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_pieces_equal_the_models_forward_on_cpu(model_type):
    """Teacher-forced decode of a left-padded batch: the pieces (run eagerly on the CPU) give the
    logits of the model's own forward through the same runtime, bit for bit, and every decode step
    went through the runtime."""
    bias = {"attention_bias": True} if model_type == "llama" else {}
    model = tiny_model(model_type, **bias)
    ids, mask = left_padded([300, 180, 90])
    cont = torch.randint(3, 256, (3, 12), generator=torch.Generator().manual_seed(2))
    logits = {}
    for graphs in (False, True):
        rt = enable_hybrid_attention(model, hybrid_cfg(), decode_graphs=graphs)
        try:
            cache = HybridCache(model)
            logits[graphs] = forced_logits(model, ids, mask, cont, cache)
            assert len(rt.timeline) == 12 * 2
            assert [rt.store.seq_len(s, 0) for s in cache.seq_ids] == [300 + 12, 180 + 12, 90 + 12]
            assert [layer.length for layer in cache.layers] == [300 + 12] * 2
            if graphs:
                dg = decode_graphs_of(model)
                assert isinstance(dg, DecodeGraphs) and not dg.capture and dg.captures == 0
        finally:
            disable_hybrid_attention(model)
    assert torch.equal(logits[True], logits[False])


def test_generate_with_pieces_matches_and_disable_restores_the_model():
    model = tiny_model("llama")
    ids, mask = left_padded([120, 64])
    before = _snapshot(model)
    base_dict = set(model.model.__dict__)
    rt = enable_hybrid_attention(model, hybrid_cfg(selection={"name": "fixed", "block_size": 16, "budget": 0.1}))
    try:
        plain = greedy(model, ids, mask, 10)
    finally:
        disable_hybrid_attention(model)
    rt = enable_hybrid_attention(model, hybrid_cfg(selection={"name": "fixed", "block_size": 16, "budget": 0.1}),
                                 decode_graphs=True)
    assert "forward" in model.model.__dict__
    calls = []
    step = decode_graphs_of(model).step
    decode_graphs_of(model).step = lambda *a: calls.append(1) or step(*a)
    try:
        pieces = greedy(model, ids, mask, 10)
        # a plain forward (no HybridCache) is the model's own
        with torch.no_grad():
            assert model(ids, attention_mask=mask).logits.shape == (2, ids.shape[1], 256)
    finally:
        disable_hybrid_attention(model)
    assert len(calls) == 9  # every decode step but the prefill's token
    assert torch.equal(pieces, plain)
    assert set(model.model.__dict__) == base_dict and hybrid_runtime_of(model) is None and rt._closed
    _assert_same(model, before)


def test_refusals_come_before_any_change():
    model = tiny_model("llama")
    before = _snapshot(model)
    with pytest.raises(ValueError, match="decode_graphs is 'yes'; allowed: 'auto', True or False"):
        enable_hybrid_attention(model, hybrid_cfg(), decode_graphs="yes")
    _assert_same(model, before)
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    before_dynamic = _snapshot(dynamic)
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic'"):
        enable_hybrid_attention(dynamic, hybrid_cfg(), decode_graphs=True)
    _assert_same(dynamic, before_dynamic)
    assert hybrid_runtime_of(dynamic) is None
    from hybrid_runtime.config import config_from_dict

    sparda = config_from_dict({
        "kv_cache": {"dtype": "fp32", "sink": 8, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 2048,
                     "max_sequences": 2},
        "selection": {"name": "sparda"}, "sparda": {"lookahead": "proxy", "top_k": 4, "block_size": 16},
    })
    with pytest.raises(UnsupportedModelError, match="decode_graphs with sparda.lookahead 'proxy'"):
        enable_hybrid_attention(model, sparda, decode_graphs=True)
    _assert_same(model, before)
    assert hybrid_runtime_of(model) is None
    model.model.layers[1].mlp = None  # not a Llama-style layer any more
    with pytest.raises(DecodeGraphsUnsupported, match="decoder layer 1 has no"):
        DecodeGraphs(model)


def test_an_instance_forward_set_before_is_called_and_restored():
    """A wrapper the caller put on the base model's `forward` still serves every call the graphs do
    not (the prefill), and is the model's `forward` again after disabling."""
    model = tiny_model("llama")
    calls = []
    inner = model.model.forward

    def wrapper(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    model.model.forward = wrapper
    ids, mask = left_padded([100, 60])
    enable_hybrid_attention(model, hybrid_cfg(), decode_graphs=True)
    try:
        greedy(model, ids, mask, 4)
    finally:
        disable_hybrid_attention(model)
    assert len(calls) == 1  # the prefill; the 3 decode steps ran the pieces
    assert model.model.__dict__["forward"] is wrapper


def test_accelerate_hooks_are_refused():
    model = tiny_model("llama")
    model.model.layers[1].mlp._hf_hook = object()  # what accelerate's device_map dispatch leaves on a module
    with pytest.raises(DecodeGraphsUnsupported, match=r"modules \['layers.1.mlp'\] carry accelerate hooks"):
        DecodeGraphs(model)
    with pytest.raises(UnsupportedModelError, match="accelerate hooks"):
        enable_hybrid_attention(model, hybrid_cfg(), decode_graphs=True)
    assert hybrid_runtime_of(model) is None


def test_auto_is_off_on_the_cpu():
    model = tiny_model("llama")
    enable_hybrid_attention(model, hybrid_cfg())
    try:
        assert decode_graphs_of(model) is None and "forward" not in model.model.__dict__
    finally:
        disable_hybrid_attention(model)


def test_step_refuses_more_than_one_token_per_row():
    model = tiny_model("llama")
    dg = DecodeGraphs(model)
    with pytest.raises(ValueError, match=r"one token per row: input_ids \[B, 1\], got \(2, 3\)"):
        dg.step(torch.zeros((2, 3), dtype=torch.long), torch.zeros((2, 3), dtype=torch.long), None)
    with pytest.raises(ValueError, match="must match input_ids"):
        dg.step(torch.zeros((2, 1), dtype=torch.long), torch.zeros((3, 1), dtype=torch.long), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_cuda_graphs_match_eager_and_are_reused(model_type):
    """On CUDA: teacher-forced logits through the graphs equal the model's own forward through the
    runtime (bf16 model, same kernels: a tight tolerance); graphs are captured once per batch size
    and reused by the next generate call; a new batch size captures its own."""
    model = tiny_model(model_type, device="cuda").to(torch.bfloat16)
    ids, mask = left_padded([300, 180, 90], device="cuda")
    cont = torch.randint(3, 256, (3, 12), generator=torch.Generator().manual_seed(2)).cuda()
    cfg = hybrid_cfg("bf16", selection={"name": "fixed", "block_size": 16, "budget": 0.2})
    logits, tokens = {}, {}
    for graphs in (False, True):
        # the default ("auto") on a model on CUDA: the graphs
        enable_hybrid_attention(model, cfg, **({} if graphs else {"decode_graphs": False}))
        try:
            assert (decode_graphs_of(model) is not None) == graphs
            logits[graphs] = forced_logits(model, ids, mask, cont, HybridCache(model))
            tokens[graphs] = greedy(model, ids, mask, 8)
            if graphs:
                dg = decode_graphs_of(model)
                assert dg.capture and dg.captures == 1  # forced_logits captured batch 3; generate reused it
                greedy(model, ids[:2], mask[:2], 4)
                assert dg.captures == 2
                times = dg.time_without_attention(3, steps=3)
                assert len(times) == 3 and all(t > 0 for t in times)
        finally:
            disable_hybrid_attention(model)
    torch.testing.assert_close(logits[True], logits[False], atol=2e-2, rtol=2e-2)
    assert (tokens[True] == tokens[False]).float().mean() >= 0.9


def test_batch_sizes_past_the_cap_run_eagerly(monkeypatch, caplog):
    """At most `max_batch_sizes` sizes are captured; a later new size runs the pieces eagerly (one
    warning), and an already captured size is reused."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="max_batch_sizes is -1; expected an integer >= 0"):
        DecodeGraphs(model, max_batch_sizes=-1)
    dg = DecodeGraphs(model, max_batch_sizes=2)
    dg.capture = True  # as on CUDA; the capture itself stands in below

    def fake_capture(b):
        b.graphs = ["graph"] * (len(dg.layers) + 1)
        dg.captures += 1

    monkeypatch.setattr(dg, "_capture", fake_capture)
    with caplog.at_level("WARNING", logger="hybrid_runtime.integrations.decode_graphs"):
        sizes = [dg._bucket(n, torch.float32) for n in (4, 2, 4, 3, 5)]
    assert dg.captures == 2 and [bool(b.graphs) for b in sizes] == [True, True, True, False, False]
    assert dg.eager_batch_sizes == [3, 5] and sizes[0] is sizes[2]
    assert len([r for r in caplog.records if "max_batch_sizes" in r.getMessage()]) == 1
    with pytest.raises(RuntimeError, match="batch size 3 is past max_batch_sizes"):
        dg.time_without_attention(3)
