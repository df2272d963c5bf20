"""The quality experiment's measurements: the dense reference, per-head output error, teacher-forced
decoding, bytes read, budget-1 greedy match and passkey retrieval, on a loaded model.

Per context length `L` (settings in `quality_settings.py`, text in `quality_text.py`) and
policy, all through `HybridRuntime`:

* **reference**: one dense forward over the `L` tokens (the model's own attention). It gives the
  dense next-token distributions of the last `N` positions, and -- captured from the attention
  function -- every layer's post-RoPE keys/values and the last `N` queries and attention outputs.
* **per-head output error** (Fluxion Eq. 2), `||o_sparse - o_full||_h / max_h ||o_full||_h`: the
  runtime is prefilled with the reference KV of the first `P = L - N` tokens and decodes the
  reference q/k/v of the last `N` positions layer by layer, so every layer sees exactly the
  inputs of the dense model; distribution per layer over positions and heads.
* **teacher-forced decoding** over the same `N` positions, end to end: the model decodes the
  text's tokens one per step through `HybridCache` (sparse attention at every layer, errors
  compounding), giving next-token top-1 agreement with the dense reference, mean
  KL(dense || sparse) and perplexity. Sparse attention needs one step per token; the dense
  reference is one forward pass.
* **bytes of CPU-resident KV read per decode step** (all layers): modeled (the tasks' Eq. 3
  volume) and counted (what the executors report), from the runtime's timeline.
* **passkey retrieval** (chat template): a number hidden at several depths of filler text. The
  dense model answers first (its result is kept under `dense`); each policy, `runtime_full`
  included, then answers the trials dense answers, from dense's prompt KV (under `policies`).
* **budget 1.0 greedy match**: `model.generate` through the runtime at budget 1.0 with an fp32
  KV store against dense `generate` (and the same with the bf16 store).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from hybrid_runtime.experiments.quality_settings import BUDGET1_POLICY, QualitySettings, length_tag, runtime_config
from hybrid_runtime.experiments.quality_text import (
    budget1_prompt,
    check_novel,
    corpus_ids,
    passkey_prompt,
    text_window,
)

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------- capture of the dense pass
_CAPTURE_NAME = "hybrid_runtime_capture"
_capture_local = threading.local()


def _capture_forward(module, query, key, value, attention_mask, **kwargs):
    """sdpa, plus a copy of the layer's post-RoPE K/V and its last queries and outputs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rec = getattr(_capture_local, "rec", None)
    if rec is not None:
        n, layer = rec["n"], module.layer_idx
        rec["k"][layer] = key[0].transpose(0, 1).contiguous()  # [L, Hkv, D]
        rec["v"][layer] = value[0].transpose(0, 1).contiguous()
        rec["q"][layer] = query[0, :, -n:].transpose(0, 1).contiguous()  # [n, Hq, D]
        rec["o"][layer] = out[0, -n:].float().contiguous()  # out is [B, T, Hq, D]
    return out, weights


@contextlib.contextmanager
def capture_attention(model: Any, n_last: int) -> Iterator[dict]:
    """Within the block, a forward of batch 1 records per layer k/v `[L,Hkv,D]`, q/o `[n_last,Hq,D]`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(_CAPTURE_NAME, _capture_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_CAPTURE_NAME, sdpa_mask)
    layers = model.config.num_hidden_layers
    rec = {"n": n_last, "k": [None] * layers, "v": [None] * layers, "q": [None] * layers, "o": [None] * layers}
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = _CAPTURE_NAME
    _capture_local.rec = rec
    try:
        yield rec
    finally:
        _capture_local.rec = None
        model.config._attn_implementation_internal = saved


@torch.no_grad()
def reference_pass(model: Any, ids: torch.Tensor, n_last: int) -> dict:
    """Dense forward over `ids [1, L]`: logits of the last `n_last` positions and the captured tensors."""
    with capture_attention(model, n_last) as rec:
        out = model(input_ids=ids, use_cache=False, logits_to_keep=n_last)
    rec["logits"] = out.logits[0].float()  # [n_last, V]
    return rec


# ---------------------------------------------------------------------------- measurements
def _distribution(x: np.ndarray) -> dict:
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    q = np.percentile(x, [50, 90, 99]) if x.size else [float("nan")] * 3
    return {"mean": float(x.mean()) if x.size else float("nan"), "p50": float(q[0]), "p90": float(q[1]),
            "p99": float(q[2]), "max": float(x.max()) if x.size else float("nan")}


@torch.no_grad()
def output_errors(rt: Any, ref: dict, prompt_len: int, n: int, seq_id: int = 1_000_000) -> np.ndarray:
    """Fluxion Eq. 2 per (position, layer, q head) `[n, layers, Hq]` on the reference inputs."""
    layers = len(ref["k"])
    errs = np.zeros((n, layers, ref["q"][0].shape[1]), dtype=np.float64)
    dev = rt.device
    for layer in range(layers):
        k, v = ref["k"][layer], ref["v"][layer]
        rt.prefill(seq_id, layer, k[:prompt_len].to(dev), v[:prompt_len].to(dev))
    try:
        for layer in range(layers):
            k, v, q, o_full = ref["k"][layer], ref["v"][layer], ref["q"][layer], ref["o"][layer]
            for t in range(n):
                pos = prompt_len + t
                o = rt.decode(layer, [seq_id], q[t : t + 1], k[pos : pos + 1], v[pos : pos + 1])[0].float()
                ref_o = o_full[t].to(o.device)
                num = (o - ref_o).norm(dim=-1)  # [Hq]
                errs[t, layer] = (num / ref_o.norm(dim=-1).max().clamp_min(1e-30)).cpu().numpy()
    finally:
        rt.release(seq_id)
    return errs


@torch.no_grad()
def teacher_forced(model: Any, ref: dict, ids: torch.Tensor, prompt_len: int, n: int,
                   last_queries: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """Logits `[n, V]` of decoding `ids[P .. P+n-1]` one token per step through a `HybridCache`,
    and the CPU-resident tokens per layer and KV head after the prompt. `last_queries[l]`
    `[Hq, D]`: the query of the prompt's last token at layer `l` (the `predicted` policy needs it)."""
    from hybrid_runtime.integrations.transformers import HybridCache, cache_kwarg

    cache = HybridCache(model)
    try:
        cache.load_prompt([k[:prompt_len].transpose(0, 1)[None] for k in ref["k"]],
                          [v[:prompt_len].transpose(0, 1)[None] for v in ref["v"]],
                          last_queries=None if last_queries is None else [q[None] for q in last_queries])
        cpu_tokens = cache.runtime.store.cpu_len(cache.seq_ids[0], 0)
        dev = model.device
        rows = []
        for t in range(n):
            pos = prompt_len + t
            out = model(input_ids=ids[:, pos : pos + 1].to(dev), position_ids=torch.tensor([[pos]], device=dev),
                        use_cache=True, **{cache_kwarg(model): cache})
            rows.append(out.logits[0, -1].float().cpu())
        return torch.stack(rows), cpu_tokens
    finally:
        cache.release()


def compare_logits(logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Top-1 agreement with the reference, mean KL(ref || logits) in nats, perplexity of `targets`."""
    lp, lp_ref = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    nll = -lp.gather(-1, targets.view(-1, 1)).squeeze(-1)
    return {
        "agreement": float((lp.argmax(-1) == lp_ref.argmax(-1)).float().mean()),
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "ppl": float(torch.exp(nll.mean())),
    }


def step_bytes(rt: Any, steps: int) -> dict:
    """CPU-resident KV bytes per decode step (all layers), modeled (Eq. 3) and counted, from the timeline.

    Refuses when the timeline dropped steps (it keeps the last `profiling.max_steps`): the totals
    would then cover only the tail while `steps` counts them all.
    """
    recs = rt.timeline.records
    dropped = rt.timeline.dropped_steps
    if dropped:
        raise ValueError(
            f"the runtime's timeline dropped {dropped} of {dropped + len(recs)} layer-steps, so bytes per step "
            "would be too low; raise profiling.max_steps above the measured layer-steps"
        )
    modeled = sum(int(r.modeled_bytes.sum()) for r in recs)
    counted = sum(int(r.bytes_read.sum()) for r in recs)
    tasks = sum(r.n_tasks for r in recs)
    return {"modeled": modeled / steps, "counted": counted / steps, "tasks": tasks / steps, "layer_steps": len(recs)}


# ---------------------------------------------------------------------------- generation
@torch.no_grad()
def greedy_steps(model: Any, first: torch.Tensor, start_pos: int, cache: Any, n: int) -> list[int]:
    """Greedy tokens: `first` (already chosen) then `n - 1` more, one forward each through `cache`."""
    from hybrid_runtime.integrations.transformers import cache_kwarg

    dev = model.device
    tokens = [int(first)]
    nxt = first.view(1, 1).to(dev)
    for i in range(n - 1):
        out = model(input_ids=nxt, position_ids=torch.tensor([[start_pos + i]], device=dev),
                    use_cache=True, **{cache_kwarg(model): cache})
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
    return tokens


@torch.no_grad()
def budget1_match(model: Any, ids: torch.Tensor, settings: QualitySettings, progress: Progress) -> dict:
    """Greedy `generate` of the prompt `ids [1, T]` through the runtime at budget 1.0 vs dense, fp32 and
    bf16 KV store."""
    from hybrid_runtime.integrations.transformers import (
        cores_for_runtime,
        disable_hybrid_attention,
        enable_hybrid_attention,
    )

    ids = ids.to(model.device)
    n = settings.budget1_new_tokens
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    t0 = time.perf_counter()
    dense = model.generate(ids, **kw)[0, ids.shape[1]:].cpu()
    result: dict = {"prompt_tokens": int(ids.shape[1]), "new_tokens": n, "policy": BUDGET1_POLICY,
                    "dense_s": time.perf_counter() - t0}
    for dtype in ("fp32", "bf16"):
        rt = enable_hybrid_attention(model, runtime_config(settings, BUDGET1_POLICY, store_dtype=dtype))
        try:
            t0 = time.perf_counter()
            with cores_for_runtime(rt):
                hyb = model.generate(ids, **kw)[0, ids.shape[1]:].cpu()
        finally:
            disable_hybrid_attention(model)
        m = min(len(hyb), len(dense))
        result[dtype] = {"match": float((hyb[:m] == dense[:m]).float().mean()), "seconds": time.perf_counter() - t0,
                         "first_mismatch": int(next((i for i in range(m) if hyb[i] != dense[i]), m))}
        progress(f"budget 1.0, {dtype} store: {result[dtype]['match']:.3f} of {n} greedy tokens match dense")
    return result


# ---------------------------------------------------------------------------- passkey
def passkey_answer(answer: str, key: int) -> dict:
    """One model's answer to a passkey trial: the text and whether it contains the key."""
    return {"answer": answer, "success": str(key) in answer}


@torch.no_grad()
def passkey_run(model: Any, tokenizer: Any, settings: QualitySettings, progress: Progress) -> list[dict]:
    """Trials per (length, depth): the dense model's answer under `dense`; each policy's, on the trials
    dense answers, under `policies`."""
    from hybrid_runtime.integrations.transformers import (
        HybridCache,
        cache_kwarg,
        cores_for_runtime,
        disable_hybrid_attention,
        enable_hybrid_attention,
    )

    rng = np.random.default_rng(settings.passkey_seed)
    trials = []
    for length in settings.passkey_lengths:
        for depth in settings.passkey_depths:
            key = int(rng.integers(10000, 100000))
            # Prompt plus answer stay within `length` positions (the model's window is 8192).
            ids = passkey_prompt(tokenizer, length - settings.passkey_new_tokens, depth, key).to(model.device)
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = getattr(out, cache_kwarg(model))
            # Keep references to the prompt's KV: the dense continuation grows the cache by concatenation.
            keys = [lay.keys for lay in cache.layers]
            values = [lay.values for lay in cache.layers]
            first = out.logits[0, -1].argmax()
            n_prompt = ids.shape[1]
            toks = greedy_steps(model, first, n_prompt, cache, settings.passkey_new_tokens)
            del cache, out
            trial = {"length": length, "tokens": int(n_prompt), "depth": depth, "key": key,
                     "dense": passkey_answer(tokenizer.decode(toks), key), "policies": {}}
            if trial["dense"]["success"]:
                for policy in settings.policies:
                    rt = enable_hybrid_attention(model, runtime_config(settings, policy))
                    try:
                        hc = HybridCache(model)
                        hc.load_prompt(keys, values)
                        with cores_for_runtime(rt):
                            toks = greedy_steps(model, first, n_prompt, hc, settings.passkey_new_tokens)
                        hc.release()
                    finally:
                        disable_hybrid_attention(model)
                    trial["policies"][policy] = passkey_answer(tokenizer.decode(toks), key)
            trial["seconds"] = time.perf_counter() - t0
            progress(f"passkey {length_tag(length)} depth {depth}: dense {'found' if trial['dense']['success'] else 'missed'} "
                     f"the key ({trial['dense']['answer']!r})"
                     + "".join(f"; {p} {'ok' if r['success'] else 'miss'}" for p, r in trial["policies"].items()))
            trials.append(trial)
    return trials


# ---------------------------------------------------------------------------- the run
def run_quality(model: Any, tokenizer: Any, settings: QualitySettings, progress: Progress = print,
                passkey: bool = True, budget1: bool = True) -> dict:
    """All measurements of `settings` on a loaded model; returns the results dict (see module doc).

    Refuses (`UnusableTextError`) before running the model when the text lies beyond the corpus or
    a length's scored part repeats its context (`quality_text.check_novel`).
    """
    from hybrid_runtime.integrations.transformers import (
        cores_for_runtime,
        disable_hybrid_attention,
        enable_hybrid_attention,
    )

    t_start = time.perf_counter()
    corpus = corpus_ids(tokenizer)
    repeated = check_novel(corpus, settings.lengths, settings.positions, settings.text_offset)
    b1_ids = budget1_prompt(tokenizer, corpus, settings.budget1_prompt_tokens, settings.text_offset) if budget1 else None
    if settings.threads:
        torch.set_num_threads(settings.threads)
    n_tf, n_err = settings.positions, settings.n_error
    results: dict = {"settings": dataclasses.asdict(settings), "lengths": {}}
    for length in settings.lengths:
        prompt_len = length - n_tf
        ids = text_window(corpus, length, settings.text_offset)
        targets = ids[0, prompt_len + 1 : length + 1]
        t0 = time.perf_counter()
        ref = reference_pass(model, ids[:, :length].to(model.device), n_tf)
        # Eq. 2 uses the first n_err of the teacher-forced positions (same prompt).
        ref_err = {**ref, "q": [q[:n_err] for q in ref["q"]], "o": [o[:n_err] for o in ref["o"]]}
        ref_logits = ref["logits"]
        dense = compare_logits(ref_logits, ref_logits, targets)
        entry: dict = {"prompt_tokens": prompt_len, "positions": n_tf, "error_positions": n_err,
                       "text": {"first_token": settings.text_offset, "repeated_8gram": repeated[length]},
                       "dense": {"ppl": dense["ppl"], "seconds": time.perf_counter() - t0}, "policies": {}}
        progress(f"{length_tag(length)}: dense reference over {length} tokens in {entry['dense']['seconds']:.1f} s, "
                 f"ppl {dense['ppl']:.3f}, {repeated[length]:.3f} of the scored tokens repeat an 8-gram of the context")
        for policy in settings.policies:
            t0 = time.perf_counter()
            rt = enable_hybrid_attention(model, runtime_config(settings, policy))
            try:
                with cores_for_runtime(rt):  # torch threads off the workers' cores (see the function)
                    errs = output_errors(rt, ref_err, prompt_len, n_err)
                    t_err = time.perf_counter() - t0
                    rt.timeline.clear()
                    logits, cpu_tokens = teacher_forced(model, ref, ids, prompt_len, n_tf)
                nbytes = step_bytes(rt, n_tf)
            finally:
                disable_hybrid_attention(model)
            m = compare_logits(logits, ref_logits, targets)
            entry["policies"][policy] = {
                **m,
                "bytes_per_step_modeled": nbytes["modeled"],
                "bytes_per_step_counted": nbytes["counted"],
                "tasks_per_step": nbytes["tasks"],
                "cpu_tokens_per_layer": cpu_tokens,
                "output_error": _distribution(errs),
                "output_error_per_layer": [_distribution(errs[:, layer]) for layer in range(errs.shape[1])],
                "seconds_error": t_err,
                "seconds_teacher_forced": time.perf_counter() - t0 - t_err,
            }
            progress(f"{length_tag(length)} {policy}: agreement {m['agreement']:.3f}, KL {m['kl']:.4f}, ppl {m['ppl']:.3f}, "
                     f"Eq.2 err mean {entry['policies'][policy]['output_error']['mean']:.4f}, "
                     f"{nbytes['counted'] / 1e6:.3f} MB/step counted ({nbytes['modeled'] / 1e6:.3f} modeled), "
                     f"{time.perf_counter() - t0:.1f} s")
        results["lengths"][str(length)] = entry
        del ref, ref_err
    if budget1:
        results["budget1"] = budget1_match(model, b1_ids, settings, progress)
    if passkey and settings.passkey_lengths:
        results["passkey"] = passkey_run(model, tokenizer, settings, progress)
    results["seconds"] = time.perf_counter() - t_start
    return results
