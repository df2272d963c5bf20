"""The quality experiment's results as the results contract's metrics, markdown tables and files.

Every table and metric keeps the dense model (`dense`, the reference: its own attention, no
runtime) apart from the policies run through the runtime (`runtime_full`, `fixed...`,
`streaming`); columns and metric names follow the policies in the results, so a new policy
needs nothing here.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_runtime.experiments.quality_settings import length_tag
from hybrid_runtime.experiments.quality_text import MAX_REPEATED_8GRAM, NGRAM
from hybrid_runtime.profiling.results import device_kind_slug, write_results


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
    """Flat name -> number of the figures beside the contract's metrics: bf16 budget-1 match, dense
    perplexity, the scored text's 8-gram repeat fraction, modeled bytes, Eq. 2 output error, and
    passkey success (`passkey_dense_` over all trials, `passkey_<policy>_` over those dense answers)."""
    out: dict = {}
    if "budget1" in results:
        out["budget1_token_match_bf16"] = results["budget1"]["bf16"]["match"]
    for length, entry in results["lengths"].items():
        tag = length_tag(int(length))
        out[f"ppl_dense_{tag}"] = entry["dense"]["ppl"]
        out[f"repeated_8gram_{tag}"] = entry["text"]["repeated_8gram"]
        for policy, r in entry["policies"].items():
            out[f"bytes_per_step_modeled_{policy}_{tag}"] = r["bytes_per_step_modeled"]
            out[f"output_error_mean_{policy}_{tag}"] = r["output_error"]["mean"]
            out[f"output_error_p90_{policy}_{tag}"] = r["output_error"]["p90"]
    for length, trials in _passkey_by_length(results).items():
        tag = length_tag(length)
        out[f"passkey_dense_{tag}"] = sum(t["dense"]["success"] for t in trials) / len(trials)
        won = [t for t in trials if t["dense"]["success"]]
        for policy in results["settings"]["policies"]:
            if won:
                out[f"passkey_{policy}_{tag}"] = sum(t["policies"][policy]["success"] for t in won) / len(won)
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
        f"Model weights {s['model_dtype']} (dequantized Q4_1 GGUF); KV store {s['store_dtype']}; text `pydoc_data.topics` "
        f"(distinct topics, key order) from token {s['text_offset']}; "
        f"{s['positions']} teacher-forced positions after a prompt of `L - {s['positions']}` tokens. "
        "`dense` is the model with its own attention, the reference of every column; every other row runs through the "
        "runtime (`runtime_full`: budget 1.0). "
        "Agreement and KL against dense; KL(dense || policy) in nats, mean over positions; "
        f"bytes: CPU-resident KV read per decode step, all {_n_layers(results)} layers (counted by the executors; Eq. 3 model in brackets); "
        "output error: Fluxion Eq. 2 per head on the dense model's own inputs (mean / p90 / max over positions, layers, heads).",
        "",
        "| L | policy | CPU tokens/layer | top-1 agreement | KL | ppl | bytes/step (modeled) | output error mean / p90 / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length, entry in results["lengths"].items():
        tag = length_tag(int(length))
        lines.append(f"| {tag} | dense | - | - | - | {entry['dense']['ppl']:.3f} | - | - |")
        for policy, r in entry["policies"].items():
            e = r["output_error"]
            lines.append(
                f"| {tag} | {policy} | {r['cpu_tokens_per_layer']} | {r['agreement']:.3f} | {r['kl']:.4f} | {r['ppl']:.3f} | "
                f"{_mb(r['bytes_per_step_counted'])} ({_mb(r['bytes_per_step_modeled'])}) | "
                f"{e['mean']:.4f} / {e['p90']:.4f} / {e['max']:.4f} |"
            )
    if results["lengths"]:
        rep = ", ".join(f"{length_tag(int(n))} {e['text']['repeated_8gram']:.3f}" for n, e in results["lengths"].items())
        lines += ["", f"Scored tokens that complete an {NGRAM}-gram already in their context (text the model could copy): "
                  f"{rep}; a text at {MAX_REPEATED_8GRAM} or more is refused."]
    if "budget1" in results:
        b = results["budget1"]
        stores = [f"{dtype} store matches dense on {b[dtype]['match']:.3f} of the tokens ("
                  + (f"first mismatch at token {b[dtype]['first_mismatch']})" if b[dtype]["first_mismatch"] < b["new_tokens"]
                     else "no mismatch)") for dtype in ("fp32", "bf16")]
        lines += ["", f"Budget 1.0 (`{b['policy']}`) through `model.generate` ({b['prompt_tokens']}-token "
                  f"chat prompt, {b['new_tokens']} greedy tokens): " + ", ".join(stores) + "."]
    by = _passkey_by_length(results)
    if by:
        pols = s["policies"]
        lines += ["", "Passkey retrieval (chat template; depths " + ", ".join(str(d) for d in s["passkey_depths"])
                  + "). `dense`: the dense model's own answers, over all trials; each policy runs on the trials dense "
                  "answers, from dense's prompt KV.", "",
                  "| L | dense | " + " | ".join(pols) + " |", "| --- | --- |" + " --- |" * len(pols)]
        for length, trials in by.items():
            won = [t for t in trials if t["dense"]["success"]]
            cells = [f"{sum(t['policies'][p]['success'] for t in won)}/{len(won)}" if won else "-" for p in pols]
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
        points.append({"length": int(length), "policy": "dense", "ppl": entry["dense"]["ppl"], "text": entry["text"]})
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
        extra = {"other_metrics": other_metrics(results), "settings": results["settings"]}
        if command:
            extra["command"] = command
        # A host without CUDA writes `quality_smollm2-cpu.json` (not `-cpu<N>`): one file per kind of device.
        final = write_results("quality_smollm2", metrics_of(results), _points(results),
                              out_path=results_dir / f"quality_smollm2-{device_kind_slug()}.json", extra=extra)
        record = json.loads(final.read_text())
        results["meta"] = {k: record[k] for k in ("device", "host_cpu", "commit", "command", "created")}
        md = final.with_suffix(".md")
        md.write_text(markdown(results))
        written += [final, md]
    (out / "quality.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "quality.md").write_text(markdown(results))
    return written + [out / "quality.json", out / "quality.md"]
