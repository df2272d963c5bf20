"""SparDA's selection on SmolLM2-135M-Instruct: the Forecast against the proxy and same-layer selection.

    python -m hybrid_runtime.experiments.sparda_quality --config configs/sparda_smollm2.yaml \\
        --out runs/sparda_quality --results-dir benchmarks/results

Per context length (4K and 8K tokens of the quality harness's text, `quality_text`) and lookahead
(`POLICIES`: the trained Forecast of `sparda.checkpoint`, the InfiniGen-style proxy, and
same-layer selection -- every layer choosing with its own query at its own step, what a
selection without lookahead reads), at the same `top_k` and block size (`runtime.sparda`):

* **recall@k** of each source's top-k blocks of layer `l + 1` against the top-k of that layer's
  exact attention target (its query heads' softmax on the fine grid, max-pooled onto the blocks:
  `forecast.targets`), over every layer pair, KV group and `recall_positions` of the scored
  positions, from the dense forward's own inputs (`forecast.evaluation`);
* **end to end**, through `HybridRuntime` and `HybridCache` exactly as the quality harness runs
  its policies (`quality_measure.teacher_forced`: prompt KV from the dense forward, then one decode
  step per scored token, sparse attention at every layer, errors compounding): top-1 agreement
  with the dense model, KL(dense || sparda), perplexity, and what the prefetch moved -- bytes of
  K and V copied from the CPU store per decode step (all layers) and the block cache's hit rate.

The text must not share a 16-token sequence with any text the Forecast was trained or
held out on (the checkpoint's `texts`, chunks of the same corpus); the run refuses it otherwise.
Writes `sparda_quality.json` and `.md` to `--out`; with `--results-dir`,
`sparda_quality-<device>.json` (`cpu` on a host without CUDA) and its table.
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

import numpy as np
import torch

from hybrid_runtime.config import Config, config_from_dict, resolve_checkpoint
from hybrid_runtime.experiments.quality_settings import (
    length_tag,
    load_section_settings,
    run_and_write,
    timestamped_progress,
)
from hybrid_runtime.profiling.results import device_kind_slug, write_results

#: Policy slug -> `sparda.lookahead`. The slug names the metrics (`agreement_<slug>_4k`, `<slug>_recall_at_k`).
POLICIES = {"forecast": "forecast", "proxy": "proxy", "same_layer": "same_layer"}
OVERLAP_NGRAM = 16


@dataclass(frozen=True)
class SpardaQualitySettings:
    lengths: tuple[int, ...] = (4096, 8192)
    positions: int = 256  # teacher-forced positions after the prompt
    recall_positions: int = 32  # of those, evenly spaced, the ones recall is measured at
    policies: tuple[str, ...] = tuple(POLICIES)
    text_offset: int = 30000
    model_dtype: str = "float32"
    store_dtype: str = "bf16"
    tau: float = 1.0  # temperature of the recall target (the Forecast's training target)
    threads: int = 0
    runtime: dict = field(default_factory=dict)  # kv_cache, sparda (block_size, top_k, checkpoint), scheduler

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"sparda_quality.policies: {list(self.policies)}; allowed: distinct names from {list(POLICIES)}")
        if self.positions < 1 or not 1 <= self.recall_positions <= self.positions:
            raise ValueError("sparda_quality.positions must be >= 1 and recall_positions in [1, positions]")
        for n in self.lengths:
            if n <= self.positions + 1:
                raise ValueError(f"sparda_quality.lengths: {n} must exceed positions + 1 = {self.positions + 1}")
        if self.store_dtype not in ("bf16", "fp32"):
            raise ValueError(f"sparda_quality.store_dtype: {self.store_dtype!r}; allowed: bf16, fp32")
        bad_sections = set(self.runtime) - {"kv_cache", "sparda", "scheduler", "profiling"}
        if bad_sections:
            raise ValueError(f"runtime: sections {sorted(bad_sections)} are not read; allowed: kv_cache, sparda, scheduler, "
                             "profiling (the selection is sparda, its lookahead set per policy)")


def runtime_config(settings: SpardaQualitySettings, policy: str) -> Config:
    """The runtime config of one policy: `selection.name: sparda` with the policy's lookahead."""
    longest = max(settings.lengths)
    data: dict = {
        "kv_cache": {"dtype": settings.store_dtype, "max_sequences": 2, "cpu_capacity_tokens": longest + 512},
        # No scheduler section: under sparda no task runs and no lane starts, so the host's cores
        # stay the model's.
        "profiling": {"enabled": False},
    }
    for section, values in (settings.runtime or {}).items():
        data.setdefault(section, {}).update(values)
    sp = dict(data.get("sparda") or {})
    sp["lookahead"] = POLICIES[policy]
    if sp["lookahead"] != "forecast":
        sp.pop("checkpoint", None)  # read only by the forecast
    data["sparda"] = sp
    data["selection"] = {"name": "sparda"}
    return config_from_dict(data)


def load_settings(path: str | None, overrides: dict | None = None) -> SpardaQualitySettings:
    return load_section_settings(path, overrides, "sparda_quality", SpardaQualitySettings, ("lengths", "policies"))


# ---------------------------------------------------------------------------- text
def check_disjoint(corpus: torch.Tensor, window: tuple[int, int], texts: list[dict], length: int) -> int:
    """Tokens of `corpus [1, T]` in `window` that continue a 16-gram of a Forecast text (0 required)."""
    ids = corpus[0].tolist()
    seen = set()
    for t in texts:
        chunk = ids[t["offset"] : t["offset"] + length]
        seen.update(tuple(chunk[i : i + OVERLAP_NGRAM]) for i in range(len(chunk) - OVERLAP_NGRAM + 1))
    lo, hi = window
    return sum(tuple(ids[i : i + OVERLAP_NGRAM]) in seen for i in range(lo, hi - OVERLAP_NGRAM + 1))


# ---------------------------------------------------------------------------- measurements
@torch.no_grad()
def reference_and_rows(model, ids: torch.Tensor, n_tf: int, recall_at: list[int], sink: int, n_cpu: int,
                       block_size: int, tau: float) -> tuple[dict, dict]:
    """One dense forward: the quality harness's reference (logits, prompt KV) and the recall rows."""
    from forecast.capture import capturing
    from forecast.evaluation import rows_from_capture
    from hybrid_runtime.experiments.quality_measure import capture_attention

    with capture_attention(model, n_tf) as ref, capturing(model, recall_at) as cap:
        out = model(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=n_tf)
    ref["logits"] = out.logits[0].float()
    return ref, rows_from_capture(cap, sink, n_cpu, block_size, tau)


def run(model, tok, settings: SpardaQualitySettings, progress=print) -> dict:
    from forecast.evaluation import source_recall
    from forecast.model import ForecastQueries, ProxyQueries
    from hybrid_runtime.experiments.quality_measure import compare_logits, teacher_forced
    from hybrid_runtime.experiments.quality_text import UnusableTextError, check_novel, corpus_ids, text_window
    from hybrid_runtime.integrations.transformers import cores_for_runtime, disable_hybrid_attention, enable_hybrid_attention

    t_start = time.perf_counter()
    cfg0 = runtime_config(settings, settings.policies[0])
    sp, kv = cfg0.sparda, cfg0.kv_cache
    ckpt_path = resolve_checkpoint(runtime_config(settings, "forecast").sparda.checkpoint)
    if ckpt_path is None:
        raise UnusableTextError("runtime.sparda.checkpoint: not a file; allowed: a checkpoint of python -m forecast.train")
    fq = ForecastQueries.load(ckpt_path)
    corpus = corpus_ids(tok)
    repeated = check_novel(corpus, settings.lengths, settings.positions, settings.text_offset)
    window = (settings.text_offset, settings.text_offset + max(settings.lengths) + 1)
    shared = check_disjoint(corpus, window, fq.meta.get("texts", []), fq.meta.get("settings", {}).get("length", 0))
    if shared:
        raise UnusableTextError(f"sparda_quality.text_offset {settings.text_offset}: {shared} tokens of the text continue a "
                                f"{OVERLAP_NGRAM}-gram of a text the Forecast was trained or held out on; allowed: text "
                                "outside the checkpoint's texts (its `texts` offsets)")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    mods = [layer.self_attn for layer in model.model.layers]
    proxy = ProxyQueries.from_attention_modules(mods)
    sources = {"forecast": fq.queries, "proxy": proxy.queries, "same_layer": None}
    n_tf = settings.positions
    recall_idx = np.linspace(0, n_tf - 1, settings.recall_positions).round().astype(int).tolist()
    results: dict = {"settings": dataclasses.asdict(settings), "checkpoint": str(ckpt_path.name),
                     "sparda": dataclasses.asdict(sp), "lengths": {}}
    for length in settings.lengths:
        prompt_len = length - n_tf
        ids = text_window(corpus, length, settings.text_offset)
        targets = ids[0, prompt_len + 1 : length + 1]
        n_cpu = prompt_len - kv.local - kv.sink  # the store's CPU segment while the scored part decodes
        t0 = time.perf_counter()
        ref, rows = reference_and_rows(model, ids[:, :length], n_tf, [prompt_len + i for i in recall_idx], kv.sink,
                                       n_cpu, sp.block_size, settings.tau)
        dense = compare_logits(ref["logits"], ref["logits"], targets)
        entry: dict = {"prompt_tokens": prompt_len, "cpu_tokens": n_cpu, "positions": n_tf,
                       "text": {"first_token": settings.text_offset, "repeated_8gram": repeated[length]},
                       "dense": {"ppl": dense["ppl"], "seconds": time.perf_counter() - t0}, "recall": {}, "policies": {}}
        for policy in settings.policies:
            r = source_recall(rows, sources[policy], sp.block_size, sp.top_k)  # [L-1, n, Hkv]
            entry["recall"][policy] = {"mean": float(r.mean()), "per_layer": [float(x) for x in r.mean((1, 2))]}
        progress(f"{length_tag(length)}: dense forward {entry['dense']['seconds']:.1f} s, ppl {dense['ppl']:.3f}; recall@"
                 f"{sp.top_k} " + ", ".join(f"{p} {v['mean']:.3f}" for p, v in entry["recall"].items()))
        for policy in settings.policies:
            t0 = time.perf_counter()
            rt = enable_hybrid_attention(model, runtime_config(settings, policy))
            try:
                with cores_for_runtime(rt):
                    logits, cpu_tokens = teacher_forced(model, ref, ids, prompt_len, n_tf)
                st = rt.stats()
            finally:
                disable_hybrid_attention(model)
            m = compare_logits(logits, ref["logits"], targets)
            entry["policies"][policy] = {
                **m, "cpu_tokens_per_layer": cpu_tokens,
                "bytes_per_step": st["sparda_bytes_moved"] / n_tf,
                "blocks_selected_per_step": st["sparda_blocks_selected"] / n_tf,
                "hit_rate": st["sparda_hit_rate"],
                "prefetched_layer_steps": st["sparda_prefetched_steps"],
                "synchronous_layer_steps": st["sparda_synchronous_steps"],
                "seconds": time.perf_counter() - t0,
            }
            progress(f"{length_tag(length)} {policy}: agreement {m['agreement']:.3f}, KL {m['kl']:.4f}, ppl {m['ppl']:.3f}, "
                     f"{entry['policies'][policy]['bytes_per_step'] / 1e6:.3f} MB/step moved, hit rate "
                     f"{st['sparda_hit_rate']:.3f}, {time.perf_counter() - t0:.1f} s")
        results["lengths"][str(length)] = entry
        del ref, rows
    results["seconds"] = time.perf_counter() - t_start
    return results


# ---------------------------------------------------------------------------- outputs
def metrics_of(results: dict) -> dict:
    """`<policy>_recall_at_k` (over every length), and per length `<policy>_recall_at_k_<len>`,
    `agreement_<policy>_<len>`, `kl_`, `ppl_`, `bytes_per_step_`, `hit_rate_`."""
    out: dict = {}
    lengths = results["lengths"]
    for policy in results["settings"]["policies"]:
        out[f"{policy}_recall_at_k"] = float(np.mean([e["recall"][policy]["mean"] for e in lengths.values()]))
    for length, e in lengths.items():
        tag = length_tag(int(length))
        for policy, r in e["policies"].items():
            out[f"{policy}_recall_at_k_{tag}"] = e["recall"][policy]["mean"]
            for name in ("agreement", "kl", "ppl"):
                out[f"{name}_{policy}_{tag}"] = r[name]
            out[f"bytes_per_step_{policy}_{tag}"] = r["bytes_per_step"]
            out[f"hit_rate_{policy}_{tag}"] = r["hit_rate"]
    return out


def markdown(results: dict) -> str:
    s, sp = results["settings"], results["sparda"]
    first = next(iter(results["lengths"].values()))
    n_layers = len(next(iter(first["recall"].values()))["per_layer"])
    lines = ["# SmolLM2-135M-Instruct: SparDA selection one layer ahead", ""]
    if "meta" in results:
        m = results["meta"]
        lines += [f"Device: {m['device']}; commit {m['commit']}; command `{m['command']}`; "
                  f"{results.get('seconds', 0) / 60:.1f} min.", ""]
    lines += [
        f"Every KV group attends its window (sink and recent tokens) and its top {sp['top_k']} blocks of "
        f"{sp['block_size']} tokens of the CPU segment, chosen over compressed keys (kernel 32, stride 16) by the "
        f"Forecast (`{results['checkpoint']}`, one query per KV group from the previous layer's input), the proxy "
        "(the previous layer's input through this layer's query projection, per head) or this layer's own queries "
        "(`same_layer`, no lookahead). Layer 0 always selects with its own queries. Recall@k: the fraction of the "
        "top-k blocks of the layer's exact attention (its heads' softmax on the fine grid, max-pooled) that the "
        f"source selects, over layers 1-{n_layers}, KV groups and {s['recall_positions']} of the scored positions. End to end: {s['positions']} teacher-forced "
        f"positions through the runtime ({s['store_dtype']} store) against the dense model; bytes: K and V copied "
        "from the CPU store per decode step, all layers.",
        "",
        "| L | policy | recall@k | top-1 agreement | KL | ppl | MB moved / step | cache hit rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length, e in results["lengths"].items():
        tag = length_tag(int(length))
        lines.append(f"| {tag} | dense | - | - | - | {e['dense']['ppl']:.3f} | - | - |")
        for policy, r in e["policies"].items():
            lines.append(f"| {tag} | {policy} | {e['recall'][policy]['mean']:.3f} | {r['agreement']:.3f} | {r['kl']:.4f} | "
                         f"{r['ppl']:.3f} | {r['bytes_per_step'] / 1e6:.3f} | {r['hit_rate']:.3f} |")
    last = list(results["lengths"].items())[-1]
    pols = list(last[1]["recall"])
    lines += ["", f"Recall@k per predicted layer at {length_tag(int(last[0]))}.", "",
              "| layer | " + " | ".join(pols) + " |", "| --- |" + " --- |" * len(pols)]
    for i in range(len(last[1]["recall"][pols[0]]["per_layer"])):
        lines.append(f"| {i + 1} | " + " | ".join(f"{last[1]['recall'][p]['per_layer'][i]:.3f}" for p in pols) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: Path, results_dir: Path | None, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if results_dir is not None:
        points = [{"length": int(n), **e} for n, e in results["lengths"].items()]
        extra = {"command": command, "settings": results["settings"], "sparda": results["sparda"],
                 "checkpoint": results["checkpoint"]}
        final = write_results("sparda_quality", metrics_of(results), points,
                              out_path=results_dir / f"sparda_quality-{device_kind_slug()}.json", extra=extra)
        record = json.loads(final.read_text())
        results["meta"] = {k: record[k] for k in ("device", "host_cpu", "commit", "command", "created")}
        md = final.with_suffix(".md")
        md.write_text(markdown(results))
        written += [final, md]
    (out / "sparda_quality.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "sparda_quality.md").write_text(markdown(results))
    return written + [out / "sparda_quality.json", out / "sparda_quality.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.sparda_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for sparda_quality.json and .md")
    parser.add_argument("--config", help="YAML with `sparda_quality:` and `runtime:` sections (configs/sparda_smollm2.yaml)")
    parser.add_argument("--results-dir", help="also write the results-contract file here (benchmarks/results)")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--positions", type=int)
    parser.add_argument("--recall-positions", type=int)
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES))
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, {"lengths": args.lengths, "positions": args.positions,
                                               "recall_positions": args.recall_positions, "policies": args.policies})
        for policy in settings.policies:
            runtime_config(settings, policy)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_and_write("hybrid_runtime.experiments.sparda_quality", argv, settings,
                         lambda model, tok: run(model, tok, settings, timestamped_progress),
                         write_outputs, args.out, args.results_dir, errors=())


if __name__ == "__main__":
    sys.exit(main())
