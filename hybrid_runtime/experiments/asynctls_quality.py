"""AsyncTLS on SmolLM2-135M-Instruct: two-level selection against each level alone, the lag, and fixed.

    python -m hybrid_runtime.experiments.asynctls_quality --config configs/asynctls_smollm2.yaml \\
        --out runs/asynctls_quality --results-dir benchmarks/results

Per context length and token budget (`budgets`, tokens per KV group), through `HybridRuntime` and
`HybridCache` exactly as the quality harness does (`quality_measure`: one dense reference forward,
then teacher-forced decoding of the last `positions` tokens with sparse attention at every layer,
errors compounding; the prompt's last query of every layer goes to the prefill): next-token top-1
agreement with the dense model, KL(dense || sparse), perplexity, and the CPU-resident KV bytes
moved per decode step (all layers, counted by the executor: for AsyncTLS the K and V of the
blocks missing from the resident cache). Methods (`METHODS`), each at every budget `B`:

* `asynctls`: block level keeps `k_b` blocks of `block_size`, token level keeps `k_t = B` tokens of
  the cached blocks, lagged prefetch (the token level reads the blocks chosen one step earlier);
* `asynctls_unlagged`: the same selection with the missing blocks copied before the token level
  (what the lag costs in quality);
* `quest`: Quest blocks alone, `B / block_size` blocks and every token of them (no lag);
* `doublesparsity`: Double Sparsity alone, the token level over every CPU-resident token, `k_t = B`.

`k_b` scales with the context as the paper's does (128 blocks of 64 at 32K is a quarter of it):
`k_b * block_size = max(block_fraction * L_cpu, level1_over_budget * B)`, at most every block, so
the block level filters at every length and still leaves the token level a choice. The
runtime's fixed `(16, 0.05)` policy runs at each length for comparison (`baselines`).

The executor records `epsilon_t = |M_t \\ C_t| / |M_t|` (blocks missing from the resident cache
over blocks chosen) per layer step of the real model's decode; `epsilon_median` pools every
lagged AsyncTLS run.

Writes `asynctls_quality.json` and `.md` to `--out`; with `--results-dir`,
`asynctls_quality-<device>.json` (`cpu` on a host without CUDA) and its table.
Exit codes: 0 success, 2 bad settings or text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hybrid_runtime.config import MAX_RESIDENT_STEPS, Config, config_from_dict
from hybrid_runtime.experiments.quality_settings import (
    length_tag,
    load_section_settings,
    run_and_write,
    timestamped_progress,
)
from hybrid_runtime.profiling.results import device_kind_slug, write_results

Progress = Callable[[str], None]

#: Method slug -> what it is.
METHODS: dict[str, str] = {
    "asynctls": "AsyncTLS: k_b blocks, then k_t = budget tokens of the cached blocks, lagged prefetch",
    "asynctls_unlagged": "AsyncTLS selection, missing blocks copied before the token level (no lag)",
    "quest": "Quest blocks alone: budget / block_size blocks, every token of them",
    "doublesparsity": "Double Sparsity alone: token level over every CPU-resident token, k_t = budget",
}
#: Runtime policies run once per length beside the methods: slug -> `selection` section.
BASELINES: dict[str, dict] = {"fixed16_005": {"name": "fixed", "block_size": 16, "budget": 0.05}}


@dataclass(frozen=True)
class AsyncTlsQualitySettings:
    lengths: tuple[int, ...] = (2048, 4096, 8192)  # context at the last teacher-forced position
    positions: int = 256  # teacher-forced positions after the prompt
    budgets: tuple[int, ...] = (256, 512, 1024)  # tokens per KV group and step
    methods: tuple[str, ...] = tuple(METHODS)
    baselines: tuple[str, ...] = tuple(BASELINES)
    block_size: int = 64  # the block level's block (AsyncTLS: 64)
    block_fraction: float = 0.25  # k_b * block_size >= this fraction of the CPU-resident tokens ...
    level1_over_budget: float = 2.0  # ... and >= this many times the token budget
    index_channels: int = 16  # d_c of the INT4 token index (AsyncTLS: 32 at head dim 128)
    resident_steps: int = 1  # AsyncTLS's resident cache: the blocks of the last this many steps (1: the paper's)
    channel_file: str = "hybrid_runtime/calibration/smollm2_channels.json"
    text_offset: int = 30000  # the quality harness's text: novel at 2K, 4K and 8K
    model_dtype: str = "float32"
    store_dtype: str = "bf16"
    threads: int = 0
    runtime: dict = field(default_factory=dict)  # extra runtime sections (kv_cache, profiling)

    def __post_init__(self) -> None:
        for name, chosen, allowed in (("methods", self.methods, METHODS), ("baselines", self.baselines, BASELINES)):
            bad = [m for m in chosen if m not in allowed]
            if bad or len(set(chosen)) != len(chosen):
                raise ValueError(f"asynctls_quality.{name}: {list(chosen)}; allowed: distinct names from {', '.join(allowed)}")
        if not self.lengths or self.positions < 1 or any(n <= self.positions + 1 for n in self.lengths):
            raise ValueError(f"asynctls_quality.lengths {list(self.lengths)} must each exceed positions + 1 = {self.positions + 1}")
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise ValueError(f"asynctls_quality.budgets {list(self.budgets)}: allowed: token counts >= 1")
        if not 0.0 < self.block_fraction <= 1.0 or self.level1_over_budget < 1.0:
            raise ValueError("asynctls_quality: block_fraction must lie in (0, 1] and level1_over_budget be >= 1 (the "
                             "block level must keep at least the token budget)")
        if not 1 <= self.resident_steps <= MAX_RESIDENT_STEPS:
            raise ValueError(f"asynctls_quality.resident_steps: {self.resident_steps}; allowed: 1 to {MAX_RESIDENT_STEPS}")
        if self.text_offset < 0:
            raise ValueError(f"asynctls_quality.text_offset: {self.text_offset}; allowed: >= 0 (a token index of the corpus)")
        if "scheduler" in self.runtime or "selection" in self.runtime:
            raise ValueError("asynctls_quality.runtime: scheduler and selection are set per method; allowed sections: "
                             "kv_cache, profiling")


def load_settings(path: str | None, overrides: dict | None = None) -> AsyncTlsQualitySettings:
    return load_section_settings(path, overrides, "asynctls_quality", AsyncTlsQualitySettings,
                                 ("lengths", "budgets", "methods", "baselines"))


def level1_blocks(settings: AsyncTlsQualitySettings, cpu_len: int, budget: int) -> int:
    """`k_b` of AsyncTLS at a CPU segment of `cpu_len` tokens and a token budget (see the module doc)."""
    blk = settings.block_size
    want = max(math.ceil(settings.block_fraction * cpu_len / blk), math.ceil(settings.level1_over_budget * budget / blk))
    return max(1, min(want, -(-cpu_len // blk)))


def selection_of(settings: AsyncTlsQualitySettings, method: str, budget: int, cpu_len: int) -> dict:
    """The `selection` section of a method at a budget, for a CPU segment of `cpu_len` tokens."""
    common = {"name": "asynctls", "block_size": settings.block_size, "index_channels": settings.index_channels,
              "channel_file": settings.channel_file}
    tokens = min(budget, cpu_len)
    if method == "quest":
        return {**common, "blocks": max(1, math.ceil(budget / settings.block_size)), "tokens": "all", "lagged": False}
    if method == "doublesparsity":
        return {**common, "blocks": "all", "tokens": tokens, "lagged": False}
    kb = level1_blocks(settings, cpu_len, budget)
    return {**common, "blocks": kb, "tokens": min(tokens, kb * settings.block_size), "lagged": method == "asynctls",
            "resident_steps": settings.resident_steps}


def runtime_config(settings: AsyncTlsQualitySettings, selection: dict) -> Config:
    """One sequence at a time; AsyncTLS on the GPU lane (the host without CUDA), fixed on one CPU worker."""
    longest = max(settings.lengths)
    data: dict = {"kv_cache": {"dtype": settings.store_dtype, "max_sequences": 2, "cpu_capacity_tokens": longest + 512},
                  "profiling": {"enabled": True, "chrome_trace": False}}
    for section, values in settings.runtime.items():
        data.setdefault(section, {}).update(values)
    if selection["name"] == "asynctls":
        data["scheduler"] = {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False}
    else:
        data["scheduler"] = {"placement": "fluxion" if torch.cuda.is_available() else "cpu_only", "cpu_workers": 1,
                             "pin_cores": False}
    data["selection"] = selection
    return config_from_dict(data)


def _epsilon(eps: np.ndarray) -> dict:
    if not eps.size:
        return {}
    return {"epsilon_median": float(np.median(eps)), "epsilon_mean": float(eps.mean()),
            "epsilon_p90": float(np.percentile(eps, 90)), "epsilon_steps": int(eps.size)}


def run_experiment(model: Any, tokenizer: Any, settings: AsyncTlsQualitySettings, progress: Progress = print) -> dict:
    from hybrid_runtime.experiments.quality_measure import compare_logits, reference_pass, step_bytes, teacher_forced
    from hybrid_runtime.experiments.quality_text import check_novel, corpus_ids, text_window
    from hybrid_runtime.integrations.transformers import cores_for_runtime, disable_hybrid_attention, enable_hybrid_attention

    t_start = time.perf_counter()
    corpus = corpus_ids(tokenizer)
    repeated = check_novel(corpus, settings.lengths, settings.positions, settings.text_offset)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    n = settings.positions
    results: dict = {"settings": dataclasses.asdict(settings), "lengths": {}}
    pooled_eps: list[np.ndarray] = []
    for length in settings.lengths:
        prompt_len = length - n
        ids = text_window(corpus, length, settings.text_offset)
        targets = ids[0, prompt_len + 1 : length + 1]
        t0 = time.perf_counter()
        # One more position than scored: the prompt's last query, which AsyncTLS warms its cache with.
        ref = reference_pass(model, ids[:, :length].to(model.device), n + 1)
        last_queries = [q[0] for q in ref["q"]]
        ref_logits = ref["logits"][1:]
        dense_ppl = compare_logits(ref_logits, ref_logits, targets)["ppl"]
        entry: dict = {"prompt_tokens": prompt_len, "positions": n, "repeated_8gram": repeated[length],
                       "dense": {"ppl": dense_ppl, "seconds": time.perf_counter() - t0}, "runs": []}
        progress(f"{length_tag(length)}: dense reference in {entry['dense']['seconds']:.0f} s, ppl {dense_ppl:.3f}")
        runs = [(b, None, BASELINES[b]) for b in settings.baselines]
        kv = runtime_config(settings, BASELINES["fixed16_005"]).kv_cache
        cpu_len = max(0, prompt_len - kv.sink - kv.local)
        runs += [(m, budget, selection_of(settings, m, budget, cpu_len)) for budget in settings.budgets
                 for m in settings.methods]
        for method, budget, selection in runs:
            t0 = time.perf_counter()
            rt = enable_hybrid_attention(model, runtime_config(settings, selection))
            try:
                with cores_for_runtime(rt):
                    logits, cpu_tokens = teacher_forced(model, ref, ids, prompt_len, n, last_queries=last_queries)
                nbytes = step_bytes(rt, n)
                ex = rt.gpu_executor if selection["name"] == "asynctls" else None
                eps = ex.epsilon_per_step() if ex is not None else np.zeros(0)
                prefill_bytes = ex.prefill_bytes if ex is not None else 0
            finally:
                disable_hybrid_attention(model)
            m = compare_logits(logits, ref_logits, targets)
            r = {"method": method, "budget": budget, "selection": selection, **m,
                 "bytes_per_step": nbytes["counted"], "tasks_per_step": nbytes["tasks"], "cpu_tokens_per_layer": cpu_tokens,
                 "prefill_cache_bytes": prefill_bytes, **_epsilon(eps), "seconds": time.perf_counter() - t0}
            if method == "asynctls":
                pooled_eps.append(eps)
            entry["runs"].append(r)
            what = f"{method} at {budget}" if budget else method
            sel = (f" (k_b {selection['blocks']}, k_t {selection['tokens']})" if selection["name"] == "asynctls" else "")
            progress(f"{length_tag(length)} {what}{sel}: agreement {m['agreement']:.3f}, KL {m['kl']:.4f}, "
                     f"ppl {m['ppl']:.3f}, {nbytes['counted'] / 1e6:.3f} MB/step"
                     + (f", epsilon median {r['epsilon_median']:.3f}" if "epsilon_median" in r else "")
                     + f", {r['seconds']:.0f} s")
        results["lengths"][str(length)] = entry
        del ref
    eps = np.concatenate(pooled_eps) if pooled_eps else np.zeros(0)
    results["epsilon"] = _epsilon(eps)
    results["seconds"] = time.perf_counter() - t_start
    return results


# ---------------------------------------------------------------------------- reports
def metrics_of(results: dict) -> dict:
    """`agreement_<method>_<budget>` (mean over the lengths), the same per length with `_<2k|4k|8k>`,
    `kl_` and `bytes_per_step_` likewise, the baselines per length, `epsilon_median` (lagged
    AsyncTLS, every length and budget pooled) and `epsilon_median_<budget>`, and
    `lag_agreement_cost_<budget>` (unlagged minus lagged agreement, mean over the lengths)."""
    out: dict = {}
    by: dict = {}
    for length, entry in results["lengths"].items():
        tag = length_tag(int(length))
        for r in entry["runs"]:
            key = r["method"] if r["budget"] is None else f"{r['method']}_{r['budget']}"
            out[f"agreement_{key}_{tag}"] = r["agreement"]
            out[f"kl_{key}_{tag}"] = r["kl"]
            out[f"bytes_per_step_{key}_{tag}"] = r["bytes_per_step"]
            if r["budget"] is not None:
                by.setdefault(key, []).append(r)
    for key, rs in by.items():
        out[f"agreement_{key}"] = float(np.mean([r["agreement"] for r in rs]))
        out[f"kl_{key}"] = float(np.mean([r["kl"] for r in rs]))
        out[f"bytes_per_step_{key}"] = float(np.mean([r["bytes_per_step"] for r in rs]))
    for budget in results["settings"]["budgets"]:
        if f"asynctls_unlagged_{budget}" in by and f"asynctls_{budget}" in by:
            out[f"lag_agreement_cost_{budget}"] = out[f"agreement_asynctls_unlagged_{budget}"] - out[f"agreement_asynctls_{budget}"]
        eps = [r["epsilon_median"] for r in by.get(f"asynctls_{budget}", []) if "epsilon_median" in r]
        if eps:
            out[f"epsilon_median_{budget}"] = float(np.median(eps))
    if "epsilon_median" in results.get("epsilon", {}):
        out["epsilon_median"] = results["epsilon"]["epsilon_median"]
        out["epsilon_p90"] = results["epsilon"]["epsilon_p90"]
    return out


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = ["# SmolLM2-135M-Instruct: AsyncTLS against its levels alone, the lag, and fixed (16, 0.05)", ""]
    if "meta" in results:
        m = results["meta"]
        lines += [f"{m['device']}; commit {m['commit']}; {m['created']}", "", f"`{m['command']}`", ""]
    lines += [f"Text: corpus tokens from {s['text_offset']}; {s['positions']} teacher-forced positions per length; "
              f"KV store {s['store_dtype']}; block level: blocks of {s['block_size']}, `k_b * {s['block_size']} = "
              f"max({s['block_fraction']} * L_cpu, {s['level1_over_budget']} * budget)`; token index: "
              f"{s['index_channels']} channels in INT4 (`{s['channel_file']}`); resident cache: the blocks of the last "
              f"{s.get('resident_steps', 1)} step(s). Bytes: K and V moved into the resident "
              "cache per decode step, all layers (the fixed policy: what its tasks read). Epsilon: blocks missing "
              "from the cache over blocks chosen, per layer step (median / p90).", ""]
    metrics = metrics_of(results)
    for length, entry in results["lengths"].items():
        lines += [f"## {length_tag(int(length))} ({entry['prompt_tokens']}-token prompt, dense ppl "
                  f"{entry['dense']['ppl']:.3f}, 8-gram repeat {entry['repeated_8gram']:.3f})", "",
                  "| method | budget | k_b | k_t | agreement | KL | ppl | MB/step | epsilon median / p90 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in entry["runs"]:
            sel = r["selection"]
            kb, kt = (sel.get("blocks", "-"), sel.get("tokens", "-")) if sel["name"] == "asynctls" else ("-", "-")
            eps = f"{r['epsilon_median']:.3f} / {r['epsilon_p90']:.3f}" if "epsilon_median" in r else "-"
            lines.append(f"| {r['method']} | {r['budget'] or '-'} | {kb} | {kt} | {r['agreement']:.3f} | {r['kl']:.4f} | "
                         f"{r['ppl']:.3f} | {r['bytes_per_step'] / 1e6:.3f} | {eps} |")
        lines.append("")
    lines += ["## Mean over the lengths", "", "| budget | " + " | ".join(s["methods"]) + " | lag cost |",
              "| --- |" + " --- |" * (len(s["methods"]) + 1)]
    for budget in s["budgets"]:
        cells = [f"{metrics.get(f'agreement_{m}_{budget}', float('nan')):.3f}" for m in s["methods"]]
        cost = metrics.get(f"lag_agreement_cost_{budget}")
        lines.append(f"| {budget} | " + " | ".join(cells) + f" | {'-' if cost is None else f'{cost:+.3f}'} |")
    lines += ["", "Targets at budgets 256 and 512: AsyncTLS at least 0.02 above Quest alone, within 0.01 of Double "
              "Sparsity alone.", ""]
    for budget in (b for b in (256, 512) if b in s["budgets"]):
        a, q, ds = (metrics.get(f"agreement_{m}_{budget}") for m in ("asynctls", "quest", "doublesparsity"))
        if None not in (a, q, ds):
            lines.append(f"- {budget}: AsyncTLS {a:.3f} vs Quest {q:.3f} ({a - q:+.3f}: "
                         f"{'met' if a - q >= 0.02 else 'missed'}), vs Double Sparsity {ds:.3f} ({a - ds:+.3f}: "
                         f"{'met' if abs(a - ds) <= 0.01 or a > ds else 'missed'})")
    if "epsilon_median" in metrics:
        lines += ["", f"Epsilon over every lagged AsyncTLS layer step: median {metrics['epsilon_median']:.3f}, "
                  f"p90 {metrics['epsilon_p90']:.3f} ({results['epsilon']['epsilon_steps']} layer steps)."]
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: Path, results_dir: Path | None, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if results_dir is not None:
        points = [{"length": int(n), **r} for n, e in results["lengths"].items() for r in e["runs"]]
        extra = {"command": command, "settings": results["settings"], "epsilon": results["epsilon"],
                 "dense": {n: e["dense"] for n, e in results["lengths"].items()}}
        final = write_results("asynctls_quality", metrics_of(results), points,
                              out_path=results_dir / f"asynctls_quality-{device_kind_slug()}.json", extra=extra)
        record = json.loads(final.read_text())
        results["meta"] = {k: record[k] for k in ("device", "commit", "command", "created")}
        final.with_suffix(".md").write_text(markdown(results))
        written += [final, final.with_suffix(".md")]
    (out / "asynctls_quality.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    (out / "asynctls_quality.md").write_text(markdown(results))
    return written + [out / "asynctls_quality.json", out / "asynctls_quality.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.asynctls_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for asynctls_quality.json and .md")
    parser.add_argument("--config", help="YAML with `asynctls_quality:` and `runtime:` sections")
    parser.add_argument("--results-dir", help="also write asynctls_quality-<device>.json here (benchmarks/results)")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--positions", type=int)
    parser.add_argument("--budgets", type=int, nargs="+")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS))
    parser.add_argument("--baselines", nargs="*", choices=list(BASELINES))
    parser.add_argument("--block-size", type=int, help="the block level's block size")
    parser.add_argument("--block-fraction", type=float, help="k_b * block_size >= this fraction of the CPU segment")
    parser.add_argument("--resident-steps", type=int, help="AsyncTLS's resident cache keeps the blocks of the last this "
                                                           "many steps (1: the paper's)")
    parser.add_argument("--text-offset", type=int, help="the corpus token the text starts at (a second text: the "
                                                        "same experiment on other positions)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, {"lengths": args.lengths, "positions": args.positions,
                                               "budgets": args.budgets, "methods": args.methods,
                                               "baselines": args.baselines, "block_size": args.block_size,
                                               "block_fraction": args.block_fraction,
                                               "resident_steps": args.resident_steps,
                                               "text_offset": args.text_offset})
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_and_write("hybrid_runtime.experiments.asynctls_quality", argv, settings,
                         lambda model, tok: run_experiment(model, tok, settings, timestamped_progress),
                         write_outputs, args.out, args.results_dir, errors=(ValueError,))


if __name__ == "__main__":
    sys.exit(main())
