"""What sparse attention does to a real model: SmolLM2-135M-Instruct on real text.

    python -m hybrid_runtime.experiments.quality --out runs/quality [--config configs/quality_smollm2.yaml]
                                                 [--results-dir benchmarks/results]

Per context length `L` (2K, 4K, 8K tokens of `pydoc_data.topics`) and policy (FULL = budget 1.0,
fixed (blk, bgt), streaming-only), all through `HybridRuntime`:

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
* **passkey retrieval** (chat template): a number hidden at several depths of filler text; FULL
  (dense) first, and each policy only on the trials FULL answers (FULL's own success per length
  is reported).
* **budget 1.0 greedy match**: `model.generate` through the runtime at budget 1.0 with an fp32
  KV store against dense `generate` (and the same with the bf16 store).

Outputs `quality.json` and `quality.md` in `--out`; with `--results-dir`, the results-contract
file `quality_smollm2-<device>.json` (device `cpu` on a host without CUDA) and its table `.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import yaml

from hybrid_runtime.config import Config, config_from_dict

Progress = Callable[[str], None]

#: Policy slug -> `policy` section of the runtime config.
POLICIES: dict[str, dict] = {
    "full": {"name": "full"},
    "fixed16_005": {"name": "fixed", "block_size": 16, "budget": 0.05},
    "fixed16_002": {"name": "fixed", "block_size": 16, "budget": 0.02},
    "fixed32_005": {"name": "fixed", "block_size": 32, "budget": 0.05},
    "fixed32_002": {"name": "fixed", "block_size": 32, "budget": 0.02},
    "streaming": {"name": "streaming"},
}

# The classic passkey filler (Mohtashami & Jaggi, 2023) and question.
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
# Asking for the number only: with an answer prefix ("The pass key is") or without this request the
# 135M model often answers with a definition of "pass key" even at 1K tokens (tried at 1K and 2K).
PASSKEY_QUESTION = "\n\nWhat is the pass key? Answer with the number only."


@dataclass(frozen=True)
class QualitySettings:
    """What to measure. Lengths are total context at the last teacher-forced position."""

    lengths: tuple[int, ...] = (2048, 4096, 8192)
    positions: int = 256  # teacher-forced positions after the prompt
    error_positions: int = 0  # the first this many positions also measure Eq. 2; 0: all `positions`
    policies: tuple[str, ...] = tuple(POLICIES)
    model_dtype: str = "float32"
    store_dtype: str = "bf16"  # the KV store of the policies (bf16 is the runtime default)
    text_offset: int = 0  # first token of the corpus used
    passkey_lengths: tuple[int, ...] = (2048, 4096, 8192)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_new_tokens: int = 12  # "The pass key is 71532" is 9 tokens (digits are single tokens)
    passkey_seed: int = 0
    budget1_prompt_tokens: int = 2048
    budget1_new_tokens: int = 64
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    # Extra runtime config (kv_cache, scheduler, profiling sections); the policy is set per run.
    runtime: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ValueError(f"quality.policies: unknown {bad}; allowed: {', '.join(POLICIES)}")
        if self.positions < 1:
            raise ValueError("quality.positions must be >= 1")
        for n in self.lengths:
            if n <= self.positions + 1:
                raise ValueError(f"quality.lengths: {n} must exceed positions + 1 = {self.positions + 1}")
        if self.error_positions > self.positions:
            raise ValueError("quality.error_positions must not exceed positions")
        if self.store_dtype not in ("bf16", "fp32"):
            raise ValueError(f"quality.store_dtype: {self.store_dtype!r}; allowed: bf16, fp32")
        if not all(0.0 <= d <= 1.0 for d in self.passkey_depths):
            raise ValueError("quality.passkey_depths must lie in [0, 1]")

    @property
    def n_error(self) -> int:
        return self.error_positions or self.positions


def length_tag(n: int) -> str:
    """Metric suffix of a length: 2048 -> '2k', 8192 -> '8k', others as the number."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def runtime_config(settings: QualitySettings, policy: str, store_dtype: str | None = None) -> Config:
    """The runtime config of one policy: defaults suited to a small host, then `settings.runtime`."""
    # One sequence is live at a time (each measurement releases its sequence before the next), so
    # the store is sized for the longest one, plus room for the chat template and chunk rounding:
    # zeroing a larger store costs seconds per policy on a small host.
    longest = max(max(settings.lengths), max(settings.passkey_lengths or (0,)),
                  settings.budget1_prompt_tokens + settings.budget1_new_tokens)
    data: dict = {
        "kv_cache": {"dtype": store_dtype or settings.store_dtype, "max_sequences": 2,
                     "cpu_capacity_tokens": longest + 512},
        # One CPU worker beside the model's own threads; no GPU lane on a host without CUDA.
        "scheduler": {"policy": "cpu_only" if not torch.cuda.is_available() else "fluxion",
                      "cpu_workers": 1, "gpu_worker": torch.cuda.is_available(), "pin_cores": False},
        "profiling": {"enabled": True, "chrome_trace": False},
    }
    for section, values in (settings.runtime or {}).items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    data["policy"] = dict(POLICIES[policy])
    return config_from_dict(data)


# ---------------------------------------------------------------------------- text
def corpus_text() -> str:
    """~465k characters of English: every topic of `pydoc_data.topics`, in key order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def corpus_tokens(tokenizer: Any, n: int, offset: int = 0) -> torch.Tensor:
    """`n` token ids `[1, n]` of the corpus starting at token `offset` (no special tokens)."""
    ids = tokenizer(corpus_text(), add_special_tokens=False, return_tensors="pt").input_ids
    if offset + n > ids.shape[1]:
        raise ValueError(f"the corpus has {ids.shape[1]} tokens; {offset} + {n} requested")
    return ids[:, offset : offset + n]


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
def teacher_forced(model: Any, ref: dict, ids: torch.Tensor, prompt_len: int, n: int) -> tuple[torch.Tensor, int]:
    """Logits `[n, V]` of decoding `ids[P .. P+n-1]` one token per step through a `HybridCache`,
    and the CPU-resident tokens per layer and KV head after the prompt."""
    from hybrid_runtime.integrations.transformers import HybridCache

    cache = HybridCache(model)
    try:
        cache.load_prompt([k[:prompt_len].transpose(0, 1)[None] for k in ref["k"]],
                          [v[:prompt_len].transpose(0, 1)[None] for v in ref["v"]])
        cpu_tokens = cache.runtime.store.cpu_len(cache.seq_ids[0], 0)
        dev = model.device
        rows = []
        for t in range(n):
            pos = prompt_len + t
            out = model(input_ids=ids[:, pos : pos + 1].to(dev), position_ids=torch.tensor([[pos]], device=dev),
                        past_key_values=cache, use_cache=True)
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


def repeated_fraction(ids: torch.Tensor, first_target: int, n: int = 8) -> float:
    """Fraction of the targets `ids[first_target:]` that complete an `n`-gram already seen earlier in `ids`.

    A measure of how much of the scored text repeats the context (copying needs retrieval, so
    it is where sparse attention loses most, and it lowers the dense perplexity).
    """
    toks = ids.reshape(-1).tolist()
    first_end: dict = {}
    hits = total = 0
    for j in range(n - 1, len(toks)):
        gram = tuple(toks[j - n + 1 : j + 1])
        seen = gram in first_end
        if j >= first_target:
            total += 1
            hits += seen
        if not seen:
            first_end[gram] = j
    return hits / total if total else float("nan")


def step_bytes(rt: Any, steps: int) -> dict:
    """CPU-resident KV bytes per decode step (all layers), modeled (Eq. 3) and counted, from the timeline."""
    recs = rt.timeline.records
    modeled = sum(int(r.modeled_bytes.sum()) for r in recs)
    counted = sum(int(r.bytes_read.sum()) for r in recs)
    tasks = sum(r.n_tasks for r in recs)
    return {"modeled": modeled / steps, "counted": counted / steps, "tasks": tasks / steps, "layer_steps": len(recs)}


# ---------------------------------------------------------------------------- passkey
def passkey_prompt(tokenizer: Any, target_tokens: int, depth: float, key: int) -> torch.Tensor:
    """Chat-template prompt `[1, T]` of about `target_tokens` tokens with the key at `depth` of the filler."""
    def n_tokens(n_fill: int) -> int:
        return _passkey_ids(tokenizer, n_fill, depth, key).shape[1]

    per = len(tokenizer(PASSKEY_FILLER, add_special_tokens=False).input_ids)
    n_fill = max(1, (target_tokens - n_tokens(0)) // per)
    # The filler tokenizes almost additively; settle on the largest count that fits the target.
    while n_fill > 1 and n_tokens(n_fill) > target_tokens:
        n_fill -= 1
    return _passkey_ids(tokenizer, n_fill, depth, key)


def _passkey_ids(tokenizer: Any, n_fill: int, depth: float, key: int) -> torch.Tensor:
    at = int(round(depth * n_fill))
    body = PASSKEY_FILLER * at + PASSKEY_NEEDLE.format(key=key) + PASSKEY_FILLER * (n_fill - at)
    msgs = [{"role": "user", "content": PASSKEY_INTRO + body + PASSKEY_QUESTION}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


@torch.no_grad()
def greedy_steps(model: Any, first: torch.Tensor, start_pos: int, cache: Any, n: int) -> list[int]:
    """Greedy tokens: `first` (already chosen) then `n - 1` more, one forward each through `cache`."""
    dev = model.device
    tokens = [int(first)]
    nxt = first.view(1, 1).to(dev)
    for i in range(n - 1):
        out = model(input_ids=nxt, position_ids=torch.tensor([[start_pos + i]], device=dev),
                    past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
    return tokens


# ---------------------------------------------------------------------------- the run
def _budget1_prompt(tokenizer: Any, n_tokens: int, offset: int) -> torch.Tensor:
    """A chat prompt of about `n_tokens`: a corpus excerpt and a request to continue it."""
    ids = corpus_tokens(tokenizer, n_tokens, offset)
    doc = tokenizer.decode(ids[0])
    msgs = [{"role": "user", "content": doc + "\n\nSummarize the text above."}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


@torch.no_grad()
def budget1_match(model: Any, tokenizer: Any, settings: QualitySettings, progress: Progress) -> dict:
    """Greedy `generate` through the runtime at budget 1.0 vs dense, fp32 and bf16 KV store."""
    from hybrid_runtime.integrations.transformers import (
        cores_for_runtime,
        disable_hybrid_attention,
        enable_hybrid_attention,
    )

    ids = _budget1_prompt(tokenizer, settings.budget1_prompt_tokens, settings.text_offset).to(model.device)
    n = settings.budget1_new_tokens
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    t0 = time.perf_counter()
    dense = model.generate(ids, **kw)[0, ids.shape[1]:].cpu()
    result: dict = {"prompt_tokens": int(ids.shape[1]), "new_tokens": n, "dense_s": time.perf_counter() - t0}
    for dtype in ("fp32", "bf16"):
        rt = enable_hybrid_attention(model, runtime_config(settings, "full", store_dtype=dtype))
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


@torch.no_grad()
def passkey_run(model: Any, tokenizer: Any, settings: QualitySettings, progress: Progress) -> list[dict]:
    """Trials per (length, depth): FULL (dense) first; each policy on the trials FULL answers."""
    from hybrid_runtime.integrations.transformers import (
        HybridCache,
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
            cache = out.past_key_values
            # Keep references to the prompt's KV: the dense continuation grows the cache by concatenation.
            keys = [lay.keys for lay in cache.layers]
            values = [lay.values for lay in cache.layers]
            first = out.logits[0, -1].argmax()
            n_prompt = ids.shape[1]
            toks = greedy_steps(model, first, n_prompt, cache, settings.passkey_new_tokens)
            del cache, out
            answer = tokenizer.decode(toks)
            trial = {"length": length, "tokens": int(n_prompt), "depth": depth, "key": key,
                     "full": {"answer": answer, "success": str(key) in answer}, "seconds": time.perf_counter() - t0}
            if trial["full"]["success"]:
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
                    ans = tokenizer.decode(toks)
                    trial[policy] = {"answer": ans, "success": str(key) in ans}
            progress(f"passkey {length_tag(length)} depth {depth}: FULL {'found' if trial['full']['success'] else 'missed'} "
                     f"the key ({trial['full']['answer']!r})"
                     + ("" if not trial["full"]["success"] else
                        "; " + ", ".join(f"{p} {'ok' if trial[p]['success'] else 'miss'}" for p in settings.policies)))
            trials.append(trial)
    return trials


def run_quality(model: Any, tokenizer: Any, settings: QualitySettings, progress: Progress = print,
                passkey: bool = True, budget1: bool = True) -> dict:
    """All measurements of `settings` on a loaded model; returns the results dict (see module doc)."""
    from hybrid_runtime.integrations.transformers import (
        cores_for_runtime,
        disable_hybrid_attention,
        enable_hybrid_attention,
    )

    if settings.threads:
        torch.set_num_threads(settings.threads)
    t_start = time.perf_counter()
    n_tf, n_err = settings.positions, settings.n_error
    results: dict = {"settings": dataclasses.asdict(settings), "lengths": {}}
    corpus = corpus_tokens(tokenizer, max(settings.lengths) + 1, settings.text_offset)
    for length in settings.lengths:
        prompt_len = length - n_tf
        ids = corpus[:, : length + 1]
        targets = ids[0, prompt_len + 1 : length + 1]
        t0 = time.perf_counter()
        ref = reference_pass(model, ids[:, :length].to(model.device), n_tf)
        # Eq. 2 uses the first n_err of the teacher-forced positions (same prompt).
        ref_err = {**ref, "q": [q[:n_err] for q in ref["q"]], "o": [o[:n_err] for o in ref["o"]]}
        ref_logits = ref["logits"]
        dense = compare_logits(ref_logits, ref_logits, targets)
        entry: dict = {"prompt_tokens": prompt_len, "positions": n_tf, "error_positions": n_err,
                       "dense": {"ppl": dense["ppl"], "repeated_8gram": repeated_fraction(ids, prompt_len + 1),
                                 "seconds": time.perf_counter() - t0}, "policies": {}}
        progress(f"{length_tag(length)}: dense reference over {length} tokens in {entry['dense']['seconds']:.1f} s, "
                 f"ppl {dense['ppl']:.3f}, {entry['dense']['repeated_8gram']:.2f} of the scored tokens repeat an 8-gram of the context")
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
        results["budget1"] = budget1_match(model, tokenizer, settings, progress)
    if passkey and settings.passkey_lengths:
        results["passkey"] = passkey_run(model, tokenizer, settings, progress)
    results["seconds"] = time.perf_counter() - t_start
    return results


# ---------------------------------------------------------------------------- reports
def metrics_of(results: dict) -> dict:
    """The flat metrics of the results contract's `metrics`, and no others:

    `budget1_token_match` (fp32 store) and per policy and length `agreement_`, `kl_`, `ppl_` and
    `bytes_per_step_` (counted by the executors, all layers). Everything else is in `other_metrics`.
    """
    out: dict = {}
    if "budget1" in results:
        out["budget1_token_match"] = results["budget1"]["fp32"]["match"]
    for length, entry in results["lengths"].items():
        tag = length_tag(int(length))
        for policy, r in entry["policies"].items():
            out[f"agreement_{policy}_{tag}"] = r["agreement"]
            out[f"kl_{policy}_{tag}"] = r["kl"]
            out[f"ppl_{policy}_{tag}"] = r["ppl"]
            out[f"bytes_per_step_{policy}_{tag}"] = r["bytes_per_step_counted"]
    return out


def other_metrics(results: dict) -> dict:
    """Flat name -> number of the figures beside the contract's metrics (bf16 budget-1 match, dense
    perplexity, modeled bytes, Eq. 2 output error, passkey success)."""
    out: dict = {}
    if "budget1" in results:
        out["budget1_token_match_bf16"] = results["budget1"]["bf16"]["match"]
    for length, entry in results["lengths"].items():
        tag = length_tag(int(length))
        out[f"ppl_dense_{tag}"] = entry["dense"]["ppl"]
        if "repeated_8gram" in entry["dense"]:
            out[f"repeated_8gram_{tag}"] = entry["dense"]["repeated_8gram"]
        for policy, r in entry["policies"].items():
            out[f"bytes_per_step_modeled_{policy}_{tag}"] = r["bytes_per_step_modeled"]
            out[f"output_error_mean_{policy}_{tag}"] = r["output_error"]["mean"]
            out[f"output_error_p90_{policy}_{tag}"] = r["output_error"]["p90"]
    for length, trials in _passkey_by_length(results).items():
        tag = length_tag(length)
        out[f"passkey_full_{tag}"] = sum(t["full"]["success"] for t in trials) / len(trials)
        won = [t for t in trials if t["full"]["success"]]
        for policy in results["settings"]["policies"]:
            if won:
                out[f"passkey_{policy}_{tag}"] = sum(t[policy]["success"] for t in won) / len(won)
    return out


def _passkey_by_length(results: dict) -> dict:
    by: dict = {}
    for t in results.get("passkey", []):
        by.setdefault(t["length"], []).append(t)
    return by


def markdown(results: dict, title: str = "SmolLM2-135M-Instruct: sparse attention quality") -> str:
    """The results as markdown tables."""
    s = results["settings"]
    lines = [f"# {title}", ""]
    if "meta" in results:
        meta = results["meta"]
        lines += [f"Device: {meta.get('device', '?')}; commit {meta.get('commit', '?')}; "
                  f"command `{meta.get('command', '?')}`; {results.get('seconds', 0) / 60:.1f} min.", ""]
    lines += [
        f"Model weights {s['model_dtype']} (dequantized Q4_1 GGUF); KV store {s['store_dtype']}; text `pydoc_data.topics`; "
        f"{s['positions']} teacher-forced positions after a prompt of `L - {s['positions']}` tokens. "
        "Agreement and KL against the dense model (its own attention); KL(dense || policy) in nats, mean over positions; "
        f"bytes: CPU-resident KV read per decode step, all {_n_layers(results)} layers (counted by the executors; Eq. 3 model in brackets); "
        "output error: Fluxion Eq. 2 per head on the dense model's own inputs (mean / p90 / max over positions, layers, heads).",
        "",
        "| L | policy | CPU tokens/layer | top-1 agreement | KL | ppl | bytes/step (modeled) | output error mean / p90 / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length, entry in results["lengths"].items():
        tag = length_tag(int(length))
        lines.append(f"| {tag} | dense (reference) | - | - | - | {entry['dense']['ppl']:.3f} | - | - |")
        for policy, r in entry["policies"].items():
            e = r["output_error"]
            lines.append(
                f"| {tag} | {policy} | {r['cpu_tokens_per_layer']} | {r['agreement']:.3f} | {r['kl']:.4f} | {r['ppl']:.3f} | "
                f"{_mb(r['bytes_per_step_counted'])} ({_mb(r['bytes_per_step_modeled'])}) | "
                f"{e['mean']:.4f} / {e['p90']:.4f} / {e['max']:.4f} |"
            )
    rep = {length_tag(int(n)): e["dense"]["repeated_8gram"] for n, e in results["lengths"].items()
           if "repeated_8gram" in e["dense"]}
    if rep:
        lines += ["", "Scored tokens that complete an 8-gram already in the context (text the model can copy, which "
                  "needs retrieval): " + ", ".join(f"{t} {x:.2f}" for t, x in rep.items()) + "."]
    if "budget1" in results:
        b = results["budget1"]
        lines += ["", f"Budget 1.0 through `model.generate` ({b['prompt_tokens']}-token chat prompt, {b['new_tokens']} greedy "
                  f"tokens): fp32 store matches dense on {b['fp32']['match']:.3f} of the tokens, bf16 store on "
                  f"{b['bf16']['match']:.3f} (first mismatch at token {b['bf16']['first_mismatch']})."]
    by = _passkey_by_length(results)
    if by:
        pols = s["policies"]
        lines += ["", "Passkey retrieval (chat template; depths " + ", ".join(str(d) for d in s["passkey_depths"])
                  + "). Policies run only on the trials the dense model answers.", "",
                  "| L | dense (FULL) | " + " | ".join(pols) + " |", "| --- | --- |" + " --- |" * len(pols)]
        for length, trials in by.items():
            won = [t for t in trials if t["full"]["success"]]
            cells = [f"{sum(t[p]['success'] for t in won)}/{len(won)}" if won else "-" for p in pols]
            lines.append(f"| {length_tag(length)} | {len(won)}/{len(trials)} | " + " | ".join(cells) + " |")
    if results["lengths"]:
        length, entry = list(results["lengths"].items())[-1]
        pols = list(entry["policies"])
        lines += ["", f"Output error (Eq. 2) per layer at {length_tag(int(length))}: p90 over positions and heads.", "",
                  "| layer | " + " | ".join(pols) + " |", "| --- |" + " --- |" * len(pols)]
        n_layers = len(entry["policies"][pols[0]]["output_error_per_layer"]) if pols else 0
        for layer in range(n_layers):
            lines.append(f"| {layer} | " + " | ".join(
                f"{entry['policies'][p]['output_error_per_layer'][layer]['p90']:.4f}" for p in pols) + " |")
    return "\n".join(lines) + "\n"


def _n_layers(results: dict) -> int:
    for entry in results["lengths"].values():
        for r in entry["policies"].values():
            return len(r["output_error_per_layer"])
    return 0


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f} MB"


def _points(results: dict) -> list:
    points = []
    for length, entry in results["lengths"].items():
        points.append({"length": int(length), "policy": "dense", "ppl": entry["dense"]["ppl"]})
        for policy, r in entry["policies"].items():
            points.append({"length": int(length), "policy": policy, **r})
    if "budget1" in results:
        points.append({"budget1": results["budget1"]})
    for t in results.get("passkey", []):
        points.append({"passkey": t})
    return points


def write_outputs(results: dict, out: Path, results_dir: Path | None = None, command: str | None = None) -> list[Path]:
    """`quality.json` + `quality.md` in `out`; with `results_dir`, the results-contract file and its table.

    `command` replaces the record's command (default: `python` + sys.argv).
    """
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if results_dir is not None:
        # benchmarks/ is a folder of the repository, not part of the installed package.
        root = Path(__file__).resolve().parents[2]
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        from benchmarks.common import device_slug, write_results

        extra = {"other_metrics": other_metrics(results), "settings": results["settings"]}
        if command:
            extra["command"] = command
        path = write_results("quality_smollm2", metrics_of(results), _points(results), out_dir=results_dir,
                             extra=extra)
        record = json.loads(path.read_text())
        # A host without CUDA writes `quality_smollm2-cpu.json` (not `-cpu<N>`): one file per kind of device.
        slug = device_slug() if torch.cuda.is_available() else "cpu"
        final = path.with_name(f"quality_smollm2-{slug}.json")
        if final != path:
            path.replace(final)
        results["meta"] = {k: record[k] for k in ("device", "host_cpu", "commit", "command", "created")}
        md = final.with_suffix(".md")
        md.write_text(markdown(results))
        written += [final, md]
    (out / "quality.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "quality.md").write_text(markdown(results))
    return written + [out / "quality.json", out / "quality.md"]


def load_settings(path: str | os.PathLike | None, overrides: dict | None = None) -> QualitySettings:
    """Settings from a YAML file's `quality:` section (and `runtime:` for the runtime config)."""
    data: dict = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(raw) - {"quality", "runtime"}
        if unknown:
            raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: quality, runtime")
        data = dict(raw.get("quality") or {})
        if raw.get("runtime"):
            data["runtime"] = raw["runtime"]
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    names = {f.name for f in dataclasses.fields(QualitySettings)}
    bad = set(data) - names
    if bad:
        raise ValueError(f"quality: unknown keys {sorted(bad)}; allowed: {', '.join(sorted(names))}")
    for k in ("lengths", "policies", "passkey_lengths", "passkey_depths"):
        if k in data:
            data[k] = tuple(data[k])
    return QualitySettings(**data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for quality.json and quality.md")
    parser.add_argument("--config", help="YAML with `quality:` and `runtime:` sections (configs/quality_smollm2.yaml)")
    parser.add_argument("--results-dir", help="also write the results-contract file here (benchmarks/results)")
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths, e.g. 2048 4096 8192")
    parser.add_argument("--positions", type=int, help="teacher-forced positions per length")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES))
    parser.add_argument("--passkey-lengths", type=int, nargs="*")
    parser.add_argument("--no-passkey", action="store_true")
    parser.add_argument("--no-budget1", action="store_true")
    args = parser.parse_args(argv)
    settings = load_settings(args.config, {"lengths": args.lengths, "positions": args.positions,
                                           "policies": args.policies, "passkey_lengths": args.passkey_lengths})

    from hybrid_runtime.models import load_smollm2

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if settings.threads:
        torch.set_num_threads(settings.threads)
    model, tok = load_smollm2(dtype=settings.model_dtype, device="cuda" if torch.cuda.is_available() else "cpu")
    results = run_quality(model, tok, settings, progress, passkey=not args.no_passkey, budget1=not args.no_budget1)
    command = " ".join(["python -m hybrid_runtime.experiments.quality", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    for p in write_outputs(results, Path(args.out), Path(args.results_dir) if args.results_dir else None, command):
        progress(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
