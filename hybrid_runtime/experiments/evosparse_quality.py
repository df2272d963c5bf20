"""EvoSparse on SmolLM2-135M-Instruct against Quest blocks at the same budget, with its two ablations.

    python -m hybrid_runtime.experiments.evosparse_quality --config configs/evosparse_smollm2.yaml \\
        --out runs/evosparse_quality --results-dir benchmarks/results

Per context length and token budget (`budgets`, CPU-resident tokens per KV group and step; sink and
local are the runtime's GPU window for every method), through `HybridRuntime` and `HybridCache`
exactly as the quality harness does (`quality_measure`: one dense reference forward, then
teacher-forced decoding of the last `positions` tokens with sparse attention at every layer,
errors compounding): next-token top-1 agreement with the dense model, KL(dense || sparse),
perplexity, and the CPU-resident KV bytes read per decode step (all layers, counted by the
executor; the retrieval heads' full-key read included). Methods (`METHODS`), all with the same
`dense_layers` (2) and block size, through the same executor:

* `evosparse`: retrieval-head scores propagated to the layers without retrieval heads (Eq. 3),
  Quest before the first retrieval layer, plus the decayed heat part;
* `quest`: Quest blocks alone (the group's summed bound), the whole budget;
* `noheat`: EvoSparse with the whole budget query-aware (`retrieval_share: 1`);
* `nopropagation`: EvoSparse whose layers without retrieval heads score with Quest.

The ablations run at `ablation_budgets`. Agreement differences come with a paired bootstrap 95%
interval over the scored positions (every length pooled; `bootstrap` resamples, seeded):
`agreement_diff_<budget>` is EvoSparse minus Quest, `agreement_diff_ci_low_<budget>` and
`_ci_high_` its interval; `agreement_diff_<ablation>_<budget>` EvoSparse minus the ablation.

Writes `evosparse_quality.json` and `.md` to `--out`; with `--results-dir`,
`evosparse_quality-<device>.json` (`cpu` on a host without CUDA) and its table.
Exit codes: 0 success, 2 bad settings or text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hybrid_runtime.config import GEOMETRIES, Config, config_from_dict, retrieval_head_mask
from hybrid_runtime.experiments.quality_settings import (
    length_tag,
    load_section_settings,
    run_and_write,
    timestamped_progress,
)
from hybrid_runtime.profiling.results import device_kind_slug, write_results

Progress = Callable[[str], None]

#: Method slug -> (what it is, its `evosparse` keys over the common ones).
METHODS: dict[str, tuple[str, dict]] = {
    "evosparse": ("retrieval scores propagated across layers + decayed heat", {}),
    "quest": ("Quest blocks alone, same budget and dense layers", {"selector": "quest"}),
    "noheat": ("EvoSparse without heat: the whole budget query-aware", {"retrieval_share": 1.0}),
    "nopropagation": ("EvoSparse with Quest in the layers without retrieval heads", {"propagate": False}),
}
ABLATIONS = ("noheat", "nopropagation")
SELECTOR_ONLY = ("retrieval_share", "decay", "propagate", "head_file", "retrieval_threshold")


@dataclass(frozen=True)
class EvoSparseQualitySettings:
    lengths: tuple[int, ...] = (4096, 8192)  # context at the last teacher-forced position
    positions: int = 256  # teacher-forced positions after the prompt
    budgets: tuple[int, ...] = (256, 512, 1024, 2048)  # CPU-resident tokens per KV group and step
    methods: tuple[str, ...] = tuple(METHODS)
    ablation_budgets: tuple[int, ...] = (512,)  # the budgets the ablations run at
    bootstrap: int = 2000  # paired bootstrap resamples of the scored positions
    seed: int = 0
    text_offset: int = 30000  # the quality harness's text
    model_dtype: str = "float32"
    store_dtype: str = "bf16"
    threads: int = 0
    runtime: dict = field(default_factory=dict)  # kv_cache, evosparse (block_size, dense_layers, decay, ...)

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or len(set(self.methods)) != len(self.methods) or "evosparse" not in self.methods:
            raise ValueError(f"evosparse_quality.methods: {list(self.methods)}; allowed: distinct names from "
                             f"{', '.join(METHODS)}, evosparse among them")
        if not self.lengths or self.positions < 1 or any(n <= self.positions + 1 for n in self.lengths):
            raise ValueError(f"evosparse_quality.lengths {list(self.lengths)} must each exceed positions + 1 = "
                             f"{self.positions + 1}")
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise ValueError(f"evosparse_quality.budgets {list(self.budgets)}: allowed: token counts >= 1")
        if any(b not in self.budgets for b in self.ablation_budgets):
            raise ValueError(f"evosparse_quality.ablation_budgets {list(self.ablation_budgets)}: allowed: a subset of "
                             f"budgets {list(self.budgets)}")
        if self.bootstrap < 100:
            raise ValueError(f"evosparse_quality.bootstrap: {self.bootstrap}; allowed: >= 100 resamples")
        bad_sections = set(self.runtime) - {"kv_cache", "evosparse", "profiling"}
        if bad_sections or "budget_tokens" in self.runtime.get("evosparse", {}):
            raise ValueError(f"evosparse_quality.runtime: {sorted(bad_sections) or 'evosparse.budget_tokens'} is set per "
                             "run; allowed sections: kv_cache, evosparse (without budget_tokens or selector), profiling")


def load_settings(path: str | None, overrides: dict | None = None) -> EvoSparseQualitySettings:
    return load_section_settings(path, overrides, "evosparse_quality", EvoSparseQualitySettings,
                                 ("lengths", "budgets", "methods", "ablation_budgets"))


def runtime_config(settings: EvoSparseQualitySettings, method: str, budget: int) -> Config:
    """One sequence at a time; the EvoSparse executor on the GPU lane (on the host without CUDA)."""
    longest = max(settings.lengths)
    # The timeline keeps every measured layer-step of a run (bytes per step are read from it).
    steps = settings.positions * GEOMETRIES["smollm2-135m"].layers
    data: dict = {"geometry": "smollm2-135m",  # the head file's model
                  "kv_cache": {"dtype": settings.store_dtype, "max_sequences": 2, "cpu_capacity_tokens": longest + 512},
                  "profiling": {"enabled": True, "chrome_trace": False, "max_steps": max(16384, steps)},
                  "scheduler": {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False}}
    for section, values in settings.runtime.items():
        data.setdefault(section, {}).update(values)
    evo = {**data.get("evosparse", {}), **METHODS[method][1], "budget_tokens": budget}
    if evo.get("selector") == "quest":
        evo = {k: v for k, v in evo.items() if k not in SELECTOR_ONLY}
    data["evosparse"] = evo
    data["selection"] = {"name": "evosparse"}
    return config_from_dict(data)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, n: int, seed: int) -> tuple[float, float, float]:
    """Mean of `a - b` (per-position 0/1 agreements) and its 95% percentile interval over `n`
    resamples of the positions (the same positions for both: paired)."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(n, len(diff)))].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(lo), float(hi)


def run_experiment(model: Any, tokenizer: Any, settings: EvoSparseQualitySettings, progress: Progress = print) -> dict:
    from hybrid_runtime.experiments.quality_measure import compare_logits, reference_pass, step_bytes, teacher_forced
    from hybrid_runtime.experiments.quality_text import check_novel, corpus_ids, text_window
    from hybrid_runtime.integrations.transformers import cores_for_runtime, disable_hybrid_attention, enable_hybrid_attention

    t_start = time.perf_counter()
    corpus = corpus_ids(tokenizer)
    repeated = check_novel(corpus, settings.lengths, settings.positions, settings.text_offset)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    n = settings.positions
    cfg0 = runtime_config(settings, "evosparse", settings.budgets[0])
    evo, geo = cfg0.evosparse, model.config
    mask = retrieval_head_mask(evo.head_file, geo.num_hidden_layers, geo.num_attention_heads, evo.retrieval_threshold)
    results: dict = {"settings": dataclasses.asdict(settings), "evosparse": dataclasses.asdict(evo),
                     "retrieval_heads": {"count": int(mask.sum()), "fraction": float(mask.mean()),
                                         "layers": sorted({int(l) for l in np.nonzero(mask)[0]}),
                                         "in_dense_layers": int(mask[: evo.dense_layers].sum())},
                     "lengths": {}}
    runs = [(m, b) for b in settings.budgets for m in settings.methods
            if m not in ABLATIONS or b in settings.ablation_budgets]
    for length in settings.lengths:
        prompt_len = length - n
        ids = text_window(corpus, length, settings.text_offset)
        targets = ids[0, prompt_len + 1 : length + 1]
        t0 = time.perf_counter()
        ref = reference_pass(model, ids[:, :length].to(model.device), n)
        ref_logits = ref["logits"]
        dense_ppl = compare_logits(ref_logits, ref_logits, targets)["ppl"]
        entry: dict = {"prompt_tokens": prompt_len, "positions": n, "repeated_8gram": repeated[length],
                       "dense": {"ppl": dense_ppl, "seconds": time.perf_counter() - t0}, "runs": []}
        progress(f"{length_tag(length)}: dense reference in {entry['dense']['seconds']:.0f} s, ppl {dense_ppl:.3f}")
        for method, budget in runs:
            t0 = time.perf_counter()
            rt = enable_hybrid_attention(model, runtime_config(settings, method, budget))
            try:
                with cores_for_runtime(rt):
                    logits, cpu_tokens = teacher_forced(model, ref, ids, prompt_len, n)
                nbytes = step_bytes(rt, n)
                st = rt.stats()
            finally:
                disable_hybrid_attention(model)
            m = compare_logits(logits, ref_logits, targets)
            match = (logits.argmax(-1) == ref_logits.argmax(-1)).to(torch.int8).tolist()
            r = {"method": method, "budget": budget, **m, "match": match, "bytes_per_step": nbytes["counted"],
                 "cpu_tokens_per_layer": cpu_tokens,
                 "tasks": {k.removeprefix("evosparse_"): v for k, v in st.items() if k.startswith("evosparse_tasks")},
                 "seconds": time.perf_counter() - t0}
            entry["runs"].append(r)
            progress(f"{length_tag(length)} {method} at {budget}: agreement {m['agreement']:.3f}, KL {m['kl']:.4f}, "
                     f"ppl {m['ppl']:.3f}, {nbytes['counted'] / 1e6:.3f} MB/step, {r['seconds']:.0f} s")
        results["lengths"][str(length)] = entry
        del ref
    results["seconds"] = time.perf_counter() - t_start
    return results


# ---------------------------------------------------------------------------- reports
def _pooled(results: dict) -> dict:
    """(method, budget) -> per-position matches, every length in order, and the runs."""
    by: dict = {}
    for entry in results["lengths"].values():
        for r in entry["runs"]:
            cur = by.setdefault((r["method"], r["budget"]), {"match": [], "runs": []})
            cur["match"] += r["match"]
            cur["runs"].append(r)
    return by


def metrics_of(results: dict) -> dict:
    """`agreement_<method>_<budget>` (every scored position of every length pooled), `kl_` and
    `bytes_per_step_` (mean over the lengths), per length with `_<tag>`; `agreement_diff_<budget>`
    (EvoSparse minus Quest) with `agreement_diff_ci_low_<budget>` / `_ci_high_`, and
    `agreement_diff_<ablation>_<budget>` (EvoSparse minus the ablation) with its interval."""
    s = results["settings"]
    out: dict = {}
    for length, entry in results["lengths"].items():
        tag = length_tag(int(length))
        for r in entry["runs"]:
            out[f"agreement_{r['method']}_{r['budget']}_{tag}"] = r["agreement"]
    by = _pooled(results)
    for (method, budget), cur in by.items():
        out[f"agreement_{method}_{budget}"] = float(np.mean(cur["match"]))
        out[f"kl_{method}_{budget}"] = float(np.mean([r["kl"] for r in cur["runs"]]))
        out[f"bytes_per_step_{method}_{budget}"] = float(np.mean([r["bytes_per_step"] for r in cur["runs"]]))
    for budget in s["budgets"]:
        evo = by.get(("evosparse", budget))
        if evo is None:
            continue
        for other, name in (("quest", "agreement_diff"), *((a, f"agreement_diff_{a}") for a in ABLATIONS)):
            if (other, budget) in by:
                d, lo, hi = paired_bootstrap(evo["match"], by[(other, budget)]["match"], s["bootstrap"], s["seed"] + budget)
                out[f"{name}_{budget}"], out[f"{name}_ci_low_{budget}"], out[f"{name}_ci_high_{budget}"] = d, lo, hi
    return out


def markdown(results: dict) -> str:
    s, evo, rh = results["settings"], results["evosparse"], results["retrieval_heads"]
    lines = ["# SmolLM2-135M-Instruct: EvoSparse against Quest blocks at the same budget, and its ablations", ""]
    if "meta" in results:
        m = results["meta"]
        lines += [f"{m['device']}; commit {m['commit']}; {m['created']}", "", f"`{m['command']}`", ""]
    n_pos = s["positions"] * len(s["lengths"])
    lines += [f"Text: corpus tokens from {s['text_offset']}; {s['positions']} teacher-forced positions per length "
              f"({n_pos} scored positions in all); KV store {s['store_dtype']}; blocks of {evo['block_size']}; the first "
              f"{evo['dense_layers']} layers dense for every method; sink and local (the GPU window) outside the budget. "
              f"EvoSparse: {rh['count']} retrieval heads ({rh['fraction']:.3f} of the query heads; score >= "
              f"{evo['retrieval_threshold']} in `{evo['head_file']}`; {rh['in_dense_layers']} of them in the dense layers) "
              f"in layers {rh['layers']}; k_r = {evo['retrieval_share']} of the budget's blocks, heat decay "
              f"lambda = {evo['decay']}. Bytes: CPU-resident K, V, metadata and retrieval keys read per decode step, "
              f"all layers, in whole blocks. Intervals: paired bootstrap over the scored positions, {s['bootstrap']} "
              "resamples, 95%.", ""]
    metrics = metrics_of(results)
    for length, entry in results["lengths"].items():
        lines += [f"## {length_tag(int(length))} ({entry['prompt_tokens']}-token prompt, dense ppl "
                  f"{entry['dense']['ppl']:.3f}, 8-gram repeat {entry['repeated_8gram']:.3f})", "",
                  "| method | budget | agreement | KL | ppl | MB/step | seconds |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in entry["runs"]:
            lines.append(f"| {r['method']} | {r['budget']} | {r['agreement']:.3f} | {r['kl']:.4f} | {r['ppl']:.3f} | "
                         f"{r['bytes_per_step'] / 1e6:.3f} | {r['seconds']:.0f} |")
        lines.append("")
    lines += ["## Agreement, every scored position pooled", "",
              "| budget | " + " | ".join(s["methods"]) + " | EvoSparse - Quest [95% CI] |",
              "| --- |" + " --- |" * (len(s["methods"]) + 1)]
    for budget in s["budgets"]:
        cells = [f"{metrics[f'agreement_{m}_{budget}']:.3f}" if f"agreement_{m}_{budget}" in metrics else "-"
                 for m in s["methods"]]
        d = metrics.get(f"agreement_diff_{budget}")
        ci = (f"{d:+.3f} [{metrics[f'agreement_diff_ci_low_{budget}']:+.3f}, "
              f"{metrics[f'agreement_diff_ci_high_{budget}']:+.3f}]") if d is not None else "-"
        lines.append(f"| {budget} | " + " | ".join(cells) + f" | {ci} |")
    abl = [(a, b) for b in s["budgets"] for a in ABLATIONS if f"agreement_diff_{a}_{b}" in metrics]
    if abl:
        lines += ["", "| ablation | budget | EvoSparse - ablation [95% CI] |", "| --- | --- | --- |"]
        for a, b in abl:
            lines.append(f"| {a} | {b} | {metrics[f'agreement_diff_{a}_{b}']:+.3f} "
                         f"[{metrics[f'agreement_diff_{a}_ci_low_{b}']:+.3f}, {metrics[f'agreement_diff_{a}_ci_high_{b}']:+.3f}] |")
    if "agreement_diff_ci_low_512" in metrics:
        lo = metrics["agreement_diff_ci_low_512"]
        lines += ["", f"Target at budget 512: EvoSparse beats Quest with the interval excluding zero: "
                  f"{'met' if lo > 0 else 'missed'} (lower bound {lo:+.3f})."]
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: Path, results_dir: Path | None, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if results_dir is not None:
        points = [{"length": int(n), **r} for n, e in results["lengths"].items() for r in e["runs"]]
        extra = {"command": command, "settings": results["settings"], "evosparse": results["evosparse"],
                 "retrieval_heads": results["retrieval_heads"],
                 "dense": {n: e["dense"] for n, e in results["lengths"].items()}, "seconds": results["seconds"]}
        final = write_results("evosparse_quality", metrics_of(results), points,
                              out_path=results_dir / f"evosparse_quality-{device_kind_slug()}.json", extra=extra)
        record = json.loads(final.read_text())
        results["meta"] = {k: record[k] for k in ("device", "commit", "command", "created")}
        final.with_suffix(".md").write_text(markdown(results))
        written += [final, final.with_suffix(".md")]
    (out / "evosparse_quality.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    (out / "evosparse_quality.md").write_text(markdown(results))
    return written + [out / "evosparse_quality.json", out / "evosparse_quality.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.evosparse_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for evosparse_quality.json and .md")
    parser.add_argument("--config", help="YAML with `evosparse_quality:` and `runtime:` sections")
    parser.add_argument("--results-dir", help="also write evosparse_quality-<device>.json here (benchmarks/results)")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--positions", type=int)
    parser.add_argument("--budgets", type=int, nargs="+")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS))
    parser.add_argument("--ablation-budgets", type=int, nargs="*")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, {"lengths": args.lengths, "positions": args.positions,
                                               "budgets": args.budgets, "methods": args.methods,
                                               "ablation_budgets": args.ablation_budgets})
        runtime_config(settings, "evosparse", settings.budgets[0])  # config errors before the model loads
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_and_write("hybrid_runtime.experiments.evosparse_quality", argv, settings,
                         lambda model, tok: run_experiment(model, tok, settings, timestamped_progress),
                         write_outputs, args.out, args.results_dir, errors=(ValueError,))


if __name__ == "__main__":
    sys.exit(main())
