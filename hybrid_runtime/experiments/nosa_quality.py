"""What the NOSA selection costs and saves on a real model: SmolLM2-135M-Instruct through the NOSA executor.

    python -m hybrid_runtime.experiments.nosa_quality --config configs/nosa_quality_smollm2.yaml \\
        --out runs/nosa_quality [--results-dir benchmarks/results]

Per context length and policy, teacher-forced decoding of the quality experiment's text
(`quality_text`, `quality_measure.teacher_forced`) through `HybridRuntime` with the NOSA executor,
against the dense model: next-token top-1 agreement, KL(dense || policy), perplexity; the bytes
moved over the link per decode step (all layers: the cache misses' K and V; the metric excludes the
first step's cache fill, `link_bytes_per_step` in the points includes it); cache misses, hits
and selection locality per step, from the executor's log. Policies, all with the same `k` and so
the same block-cache capacity:

* `nosa_kq<f>`: NOSA with `k_q / k = f`, importance from the distilled eviction head (the score
  for which Theorem 2's bound holds);
* `nosa_decayed_kq<f>`: the same with the training-free decayed accumulated attention;
* `query_aware`: every cache block by the pooled query-aware score (InfLLMv2-style).

This is an adaptation (no NOSA-trained model exists for SmolLM2: the eviction head is distilled
with the model frozen and its Eq. 8 bias is off); every policy's result names its score source.
Misses per step exclude each sequence's first decode step, which fills the empty cache.

Outputs `nosa_quality.json` and its tables `nosa_quality.md` in `--out`; with `--results-dir`, the
results-contract file `nosa_quality-<device>.json` (`cpu` on a host without CUDA) and the same
tables beside it (`.md`). `--render FILE.json` rewrites the tables of an existing results-contract
file and exits (no model is loaded). Exit codes: 0 success, 2 bad settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from hybrid_runtime.config import Config, config_from_dict, resolve_checkpoint
from hybrid_runtime.executors.nosa import LOG_COLUMNS
from hybrid_runtime.experiments.quality_measure import compare_logits, reference_pass, step_bytes, teacher_forced
from hybrid_runtime.experiments.quality_settings import (
    length_tag,
    load_section_settings,
    run_and_write,
    timestamped_progress,
)
from hybrid_runtime.experiments.quality_text import check_novel, corpus_ids, text_window
from hybrid_runtime.profiling.results import device_kind_slug, write_results

COL = {c: i for i, c in enumerate(LOG_COLUMNS)}


@dataclass(frozen=True)
class NosaQualitySettings:
    """What to measure. `k_tokens` etc. are the `nosa` section of every policy's runtime config."""

    lengths: tuple[int, ...] = (4096, 8192)
    positions: int = 256
    text_offset: int = 30000
    model_dtype: str = "float32"
    store_dtype: str = "bf16"
    threads: int = 0
    k_tokens: int = 1024
    block_tokens: int = 64
    pool_kernel_tokens: int = 32
    pool_stride_tokens: int = 16
    kq_fractions: tuple[float, ...] = (0.125, 0.25, 0.5)  # eviction-head NOSA at each k_q / k
    decayed_kq_fractions: tuple[float, ...] = (0.25,)  # decayed-attention NOSA at each
    decay: float = 0.9
    checkpoint: str = "predictor/checkpoints/smollm2_eviction.pt"
    # Runtime sections laid over every policy's config (kv_cache, scheduler, profiling).
    runtime: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in (*self.kq_fractions, *self.decayed_kq_fractions):
            if not 0.0 <= f <= 1.0 or round(f * self.k_tokens) % self.block_tokens:
                raise ValueError(f"nosa_quality: k_q / k = {f} is not a whole number of {self.block_tokens}-token blocks "
                                 f"of k_tokens={self.k_tokens}; allowed: fractions f with f * k_tokens a multiple of it")
        if self.positions < 2:
            raise ValueError("nosa_quality.positions must be >= 2 (the first step fills the caches)")
        for n in self.lengths:
            if n <= self.positions + 1:
                raise ValueError(f"nosa_quality.lengths: {n} must exceed positions + 1 = {self.positions + 1}")

    def policies(self) -> dict[str, dict]:
        """Policy slug -> its `nosa` config section."""
        base = {"k_tokens": self.k_tokens, "block_tokens": self.block_tokens,
                "pool_kernel_tokens": self.pool_kernel_tokens, "pool_stride_tokens": self.pool_stride_tokens}
        out = {}
        for f in self.kq_fractions:
            out[f"nosa_kq{fraction_tag(f)}"] = {**base, "k_q_tokens": round(f * self.k_tokens), "score": "eviction_head",
                                                "checkpoint": self.checkpoint}
        for f in self.decayed_kq_fractions:
            out[f"nosa_decayed_kq{fraction_tag(f)}"] = {**base, "k_q_tokens": round(f * self.k_tokens),
                                                        "score": "decayed_attention", "decay": self.decay}
        out["query_aware"] = {**base, "selector": "query_aware"}
        return out


def fraction_tag(f: float) -> str:
    """0.125 -> '0125', 0.25 -> '025', 0.5 -> '05' (metric names)."""
    return f"{f:g}".replace(".", "")


def runtime_config(settings: NosaQualitySettings, nosa: dict) -> Config:
    longest = max(settings.lengths)
    data: dict = {
        # generated_cap 64: NOSA's window at SmolLM2 scale is the recent 256-320 tokens (5 blocks of 64).
        "kv_cache": {"dtype": settings.store_dtype, "max_sequences": 2, "cpu_capacity_tokens": longest + 512,
                     "sink": 64, "local": 256, "generated_cap": 64},
        "scheduler": {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False},
        # Every layer-step of the teacher-forced run stays in the timeline (bytes per step).
        "profiling": {"enabled": True, "chrome_trace": False, "max_steps": 65536},
    }
    for section, values in (settings.runtime or {}).items():
        data.setdefault(section, {}).update(values)
    data["selection"] = {"name": "nosa"}
    data["nosa"] = dict(nosa)
    return config_from_dict(data)


def score_source(nosa: dict) -> str:
    """What ranks the query-agnostic blocks, for the record."""
    if nosa.get("selector") == "query_aware":
        return "none: every cache block by the pooled query-aware score (InfLLMv2-style)"
    if nosa["score"] == "decayed_attention":
        return f"decayed_attention (training-free; decay {nosa['decay']} per step)"
    path = resolve_checkpoint(nosa["checkpoint"])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path else "missing"
    reads = "missing"
    if path:  # what the heads read; a checkpoint without `source` reads values
        reads = torch.load(path, map_location="cpu", weights_only=True)["geometry"].get("source", "value")
    return (f"eviction_head reading each token's {reads}, distilled with SmolLM2 frozen ({nosa['checkpoint']}, "
            f"sha256 {digest}; Eq. 8 bias off)")


def cache_statistics(log: np.ndarray, steps: int, layers: int) -> dict:
    """Misses, hits and selected blocks per decode step (all layers and KV heads), first step excluded."""
    warm = log[log[:, COL["cold"]] == 0]
    cold = log[log[:, COL["cold"]] == 1]
    per = max(1, steps - 1)
    return {
        "misses_per_step": float(warm[:, COL["misses"]].sum()) / per,
        "hits_per_step": float(warm[:, COL["hits"]].sum()) / per,
        "selected_per_step": float(warm[:, COL["selected"]].sum()) / per,
        "miss_fraction": float(warm[:, COL["misses"]].sum()) / max(1.0, float(warm[:, COL["selected"]].sum())),
        "cold_fill_misses": float(cold[:, COL["misses"]].sum()),
        "misses_per_step_per_layer": [float(warm[warm[:, COL["layer"]] == la, COL["misses"]].sum()) / per
                                      for la in range(layers)],
    }


def run(model, tok, settings: NosaQualitySettings, progress=timestamped_progress) -> dict:
    from hybrid_runtime.integrations.transformers import cores_for_runtime, disable_hybrid_attention, enable_hybrid_attention

    t_start = time.perf_counter()
    corpus = corpus_ids(tok)
    repeated = check_novel(corpus, settings.lengths, settings.positions, settings.text_offset)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    n = settings.positions
    policies = settings.policies()
    results: dict = {"settings": asdict(settings), "lengths": {},
                     "policies": {p: {"nosa": nosa, "score_source": score_source(nosa)} for p, nosa in policies.items()}}
    for length in settings.lengths:
        prompt_len = length - n
        ids = text_window(corpus, length, settings.text_offset)
        targets = ids[0, prompt_len + 1 : length + 1]
        t0 = time.perf_counter()
        ref = reference_pass(model, ids[:, :length].to(model.device), n)
        dense = compare_logits(ref["logits"], ref["logits"], targets)
        entry: dict = {"prompt_tokens": prompt_len, "positions": n, "repeated_8gram": repeated[length],
                       "dense": {"ppl": dense["ppl"], "seconds": time.perf_counter() - t0}, "policies": {}}
        progress(f"{length_tag(length)}: dense reference in {entry['dense']['seconds']:.1f} s, ppl {dense['ppl']:.3f}")
        for policy, nosa in policies.items():
            t0 = time.perf_counter()
            cfg = runtime_config(settings, nosa)
            rt = enable_hybrid_attention(model, cfg)
            try:
                ex = rt.gpu_executor
                ex.selection_log = []
                with cores_for_runtime(rt):
                    logits, cpu_tokens = teacher_forced(model, ref, ids, prompt_len, n)
                nbytes = step_bytes(rt, n)
                log = np.concatenate(ex.selection_log)
                locality = ex.locality()
                geometry = {"cache_blocks": ex.capacity, "query_aware_blocks": ex.k_q, "fixed_blocks": ex.fixed_blocks,
                            "block_bytes": ex.block_bytes}
            finally:
                disable_hybrid_attention(model)
            m = compare_logits(logits, ref["logits"], targets)
            cache = cache_statistics(log, n, len(ref["k"]))
            entry["policies"][policy] = {
                **m, **geometry,
                "score_source": results["policies"][policy]["score_source"],
                "link_bytes_per_step": nbytes["counted"],  # every step, the first one's cache fill included
                "link_bytes_per_step_after_fill": cache["misses_per_step"] * geometry["block_bytes"],
                "attended_cpu_bytes_per_step": cache["selected_per_step"] * geometry["block_bytes"],
                "cpu_tokens_per_layer": cpu_tokens,
                "cache": cache,
                "locality": locality,
                "seconds": time.perf_counter() - t0,
            }
            progress(f"{length_tag(length)} {policy}: agreement {m['agreement']:.3f}, KL {m['kl']:.4f}, "
                     f"{cache['misses_per_step']:.1f} misses/step ({cache['miss_fraction']:.3f} of selected), "
                     f"{cache['misses_per_step'] * geometry['block_bytes'] / 1e6:.3f} MB/step over the link, locality min {locality['min']:.3f} "
                     f"(bound {locality['bound']:.3f}), {time.perf_counter() - t0:.0f} s")
        results["lengths"][str(length)] = entry
        del ref
    results["seconds"] = time.perf_counter() - t_start
    return results


def metrics_of(results: dict) -> dict:
    """Flat metrics: per policy and length, and the issue's headline figures."""
    m: dict = {}
    eviction_gaps = []
    for length, entry in results["lengths"].items():
        tag = length_tag(int(length))
        qa = entry["policies"].get("query_aware")
        for policy, r in entry["policies"].items():
            m[f"agreement_{policy}_{tag}"] = r["agreement"]
            m[f"kl_{policy}_{tag}"] = r["kl"]
            m[f"ppl_{policy}_{tag}"] = r["ppl"]
            m[f"link_bytes_per_step_{policy}_{tag}"] = r["link_bytes_per_step_after_fill"]
            m[f"misses_per_step_{policy}_{tag}"] = r["cache"]["misses_per_step"]
            if policy != "query_aware":
                m[f"min_locality_minus_bound_{policy}_{tag}"] = r["locality"]["min_minus_bound"]
                if qa is not None and qa["cache"]["misses_per_step"] > 0:
                    m[f"miss_ratio_{policy}_vs_query_aware_{tag}"] = r["cache"]["misses_per_step"] / qa["cache"]["misses_per_step"]
                if r["score_source"].startswith("eviction_head"):
                    eviction_gaps.append(r["locality"]["min_minus_bound"])
        m[f"ppl_dense_{tag}"] = entry["dense"]["ppl"]
    if eviction_gaps:
        # Over every eviction-head policy and length: the "never below k_e / k".
        m["min_locality_minus_bound"] = min(eviction_gaps)
    return m


# The target for the miss ratio at k_q / k = 0.25 (NOSA reports about 2x fewer misses).
MISS_RATIO_BAR = 0.5


def markdown(record: dict) -> str:
    """The tables of a results-contract record of this experiment (`nosa_quality-<device>.json`):
    every figure is read from the record's points and metrics."""
    s, points, m = record["settings"], record["points"], record["metrics"]
    first = points[0]
    k_blocks = first["cache_blocks"] + first["fixed_blocks"]
    lines = ["# SmolLM2-135M-Instruct through the NOSA executor (an adaptation)", ""]
    if "commit" in record:
        versions = "".join(f"; {k} {v}" for k, v in record.get("versions", {}).items())
        lines += [f"Device: {record['device']}; commit {record['commit']}; command `{record['command']}`; "
                  f"created {record['created']}{versions}.", ""]
    lines += [
        f"Per step each KV head selects k = {s['k_tokens']} tokens = {k_blocks} blocks of {s['block_tokens']}: "
        f"{first['fixed_blocks']} sink and window blocks (the runtime's GPU window) and {first['cache_blocks']} "
        "CPU-resident blocks held in a GPU block cache per (sequence, layer, KV head), the same capacity for every "
        f"policy. Query-aware score: pooled q.K (sub-blocks of {s['pool_kernel_tokens']} every "
        f"{s['pool_stride_tokens']} tokens, max per block). {s['positions']} teacher-forced positions per length "
        f"through the runtime ({s['store_dtype']} store) against the dense model. No NOSA-trained model runs here: "
        "the eviction head is distilled with SmolLM2 frozen and its Eq. 8 softmax bias is off. Link MB / step: "
        "the cache misses' K and V over all layers per decode step, the first step's cache fill excluded. "
        "Locality: the share of a step's k blocks selected the step before (blocks a spill created or "
        "extended excused), its minimum over task-steps, against the bound k_e / k.",
        "",
        "| L | policy | query-aware blocks of k | agreement | KL | ppl | link MB / step | misses / step | misses vs query-aware | locality min (bound) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lengths = sorted({int(p["length"]) for p in points})
    for length in lengths:
        tag = length_tag(length)
        lines.append(f"| {tag} | dense | - | - | - | {m[f'ppl_dense_{tag}']:.3f} | - | - | - | - |")
        for p in (p for p in points if int(p["length"]) == length):
            ratio = m.get(f"miss_ratio_{p['policy']}_vs_query_aware_{tag}")
            loc = p["locality"]
            lines.append(
                f"| {tag} | {p['policy']} | {p['query_aware_blocks']} of {k_blocks} | {p['agreement']:.3f} | "
                f"{p['kl']:.4f} | {p['ppl']:.3f} | {p['link_bytes_per_step_after_fill'] / 1e6:.3f} | "
                f"{p['cache']['misses_per_step']:.1f} | {'-' if ratio is None else f'{ratio:.2f}'} | "
                f"{loc['min']:.3f} ({loc['bound']:.3f}) |")
    lines += ["", f"Targets: misses per step at k_q / k = 0.25 at most {MISS_RATIO_BAR} of the query-aware-only "
              "selector's, and the eviction head's locality never below k_e / k.", ""]
    for length in lengths:
        tag = length_tag(length)
        ratio = m.get(f"miss_ratio_nosa_kq025_vs_query_aware_{tag}")
        if ratio is not None:
            verdict = "met" if ratio <= MISS_RATIO_BAR else "not met"
            lines.append(f"* {tag}: miss ratio nosa_kq025 / query_aware {ratio:.3f} ({verdict}); agreement "
                         f"{m[f'agreement_nosa_kq025_{tag}']:.3f} vs {m[f'agreement_query_aware_{tag}']:.3f}, KL "
                         f"{m[f'kl_nosa_kq025_{tag}']:.4f} vs {m[f'kl_query_aware_{tag}']:.4f}.")
    if "min_locality_minus_bound" in m:
        gap = m["min_locality_minus_bound"]
        lines.append(f"* Eviction-head policies, every length: min locality minus bound {gap:+.3f} "
                     f"({'never below' if gap >= 0 else 'below'} the bound).")
    lines += ["", "Score sources:", ""]
    lines += [f"* {name}: {p['score_source']}" for name, p in record["policies"].items()]
    return "\n".join(lines) + "\n"


def library_versions() -> dict:
    """torch's and transformers' versions: the same commit on another pair gave agreement one
    position in 256 apart (benchmarks/notes/nosa.md)."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def write_outputs(results: dict, out: Path, results_dir: Path | None, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    points = [{"length": int(length), "policy": p, **r} for length, e in results["lengths"].items()
              for p, r in e["policies"].items()]
    record = {"metrics": metrics_of(results), "points": points, "settings": results["settings"],
              "policies": results["policies"]}
    if results_dir is not None:
        # A host without CUDA writes `nosa_quality-cpu.json` (not `-cpu<N>`), as the quality experiment does.
        final = write_results("nosa_quality", record["metrics"], points,
                              out_path=results_dir / f"nosa_quality-{device_kind_slug()}.json",
                              extra={"command": command, "settings": results["settings"],
                                     "policies": results["policies"], "versions": library_versions()})
        record = json.loads(final.read_text())
        md = final.with_suffix(".md")
        md.write_text(markdown(record))
        written += [final, md]
    (out / "nosa_quality.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "nosa_quality.md").write_text(markdown(record))
    return written + [out / "nosa_quality.json", out / "nosa_quality.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.nosa_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for nosa_quality.json and .md (required unless --render)")
    parser.add_argument("--config", help="YAML with `nosa_quality:` and `runtime:` sections")
    parser.add_argument("--results-dir", help="also write the results-contract file here (benchmarks/results)")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--positions", type=int)
    parser.add_argument("--render", metavar="JSON", help="write the .md tables of an existing results-contract file "
                        "(benchmarks/results/nosa_quality-cpu.json) beside it, and exit")
    args = parser.parse_args(argv)
    if args.render:
        path = Path(args.render)
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        timestamped_progress(f"wrote {path.with_suffix('.md')}")
        return 0
    if not args.out:
        parser.error("--out is required (unless --render)")
    try:
        settings = load_section_settings(args.config, {"lengths": args.lengths, "positions": args.positions},
                                         "nosa_quality", NosaQualitySettings,
                                         ("lengths", "kq_fractions", "decayed_kq_fractions"))
        for nosa in settings.policies().values():
            runtime_config(settings, nosa)  # every policy's config is valid before the model loads
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_and_write("hybrid_runtime.experiments.nosa_quality", argv, settings,
                         lambda model, tok: run(model, tok, settings),
                         write_outputs, args.out, args.results_dir, errors=())


if __name__ == "__main__":
    sys.exit(main())
