"""`model.generate` timed token by token, on random-weight transformers models of the reference geometries.

Timing does not depend on the weights, so the Llama-3.1-8B and Qwen2.5-7B geometries are built
from their published configs with random weights (nothing is downloaded; RoPE scaling is left
out, it changes no timing). `StepClock` is a logits processor: `generate` calls it once per token
right after the forward that produced the token's logits; it synchronizes the device and stamps
`perf_counter`, so TTFT is the stamp of the first token and TPOT the gaps between successive
stamps -- a `generate` call measured exactly as a user's runs. `benchmarks/e2e_decode.py` and the
`tpot` experiment of `hybrid-runtime run` both time through here.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Sequence

import numpy as np
import torch

try:  # transformers is an optional dependency (extra `models`)
    import transformers
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('timing generate needs transformers >= 5: pip install "hybrid-runtime[models]"') from exc

from hybrid_runtime.config import GeometryConfig
from hybrid_runtime.profiling import LANE_CPU, LANE_GPU
from hybrid_runtime.profiling.machine import (cpu_jiffies, cpu_shares, parse_cpu_jiffies, parse_thread_switches,
                                              read_cpu_stat, read_thread_status, steal_core_ms, thread_cpu,
                                              thread_switches)

# The published configs of the random-weight models: (transformers config class, its arguments).
MODELS: dict[str, tuple[str, dict]] = {
    "llama-3.1-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=262144,
        tie_word_embeddings=False)),
    "qwen2.5-7b": ("Qwen2Config", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=262144,
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=None)),
}
# A geometry of no published model: a Llama of that attention shape, MLP 4x the hidden size.
CUSTOM_VOCAB = 32000


def model_config(name: str, **over: Any):
    """The transformers config of a reference model in `MODELS`, with `over` replacing its arguments."""
    cls, kw = MODELS[name]
    return getattr(transformers, cls)(**{**kw, **over})


def config_for_geometry(geometry: GeometryConfig):
    """A random-weight model's config with `geometry`'s attention shape and layer count: the
    reference model's own config (its first `geometry.layers` layers), else a Llama of that shape."""
    if geometry.name in MODELS:
        return model_config(geometry.name, num_hidden_layers=geometry.layers)
    hidden = geometry.q_heads * geometry.head_dim
    return transformers.LlamaConfig(
        vocab_size=CUSTOM_VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=geometry.layers,
        num_attention_heads=geometry.q_heads, num_key_value_heads=geometry.kv_heads, head_dim=geometry.head_dim,
        max_position_embeddings=262144, tie_word_embeddings=False)


def model_dims(cfg) -> tuple[int, int, int, int, int, int, int]:
    """(layers, hidden, intermediate, vocab, q heads, KV heads, head dim) of a transformers config."""
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, hq, hkv, d


def param_count(cfg) -> int:
    """Parameters of a Llama/Qwen2-style causal LM from its config (Qwen2 adds q/k/v biases)."""
    layers, h, inter, vocab, hq, hkv, d = model_dims(cfg)
    attn = h * hq * d + 2 * h * hkv * d + hq * d * h
    if getattr(cfg, "model_type", "") == "qwen2":
        attn += hq * d + 2 * hkv * d
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return embed + layers * per_layer + h


def kv_bytes(cfg, batch: int, context: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x 2 bytes (bf16) x batch x context."""
    layers, _, _, _, _, hkv, d = model_dims(cfg)
    return 2 * layers * hkv * d * 2 * batch * context


def build_model(cfg, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A causal LM with random weights, created directly on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def random_prompt(vocab: int, batch: int, context: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids `[batch, context]` (no special tokens) and an all-ones attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, context), generator=g)
    return ids.to(device), torch.ones_like(ids, device=device)


def random_prompts(vocab: int, lengths: Sequence[int], seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded (pad id 0, mask 0) to the longest."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.zeros((len(lengths), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, longest - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, longest - n:] = 1
    return ids.to(device), mask.to(device)


def latency_stats(seconds: Sequence[float] | np.ndarray, prefix: str) -> dict:
    """Median, mean, p90, p99 and max of latencies (seconds in, `<prefix>_ms_*` keys in ms out)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return {
        f"{prefix}_ms_median": float(np.median(ms)),
        f"{prefix}_ms_mean": float(ms.mean()),
        f"{prefix}_ms_p90": float(np.percentile(ms, 90)),
        f"{prefix}_ms_p99": float(np.percentile(ms, 99)),
        f"{prefix}_ms_max": float(ms.max()),
    }


class StepClock(LogitsProcessor):
    """Host time of every generated token: `generate` calls a logits processor once per token,
    right after the forward that produced it; the device is synchronized first, so a stamp is
    when that token's logits exist. `on_first` callables run at the first token (after the
    prefill); `on_token(i)` callables at every token i (0-based), after its stamp, before the
    forward of token i + 1."""

    def __init__(self, cuda: bool, on_first: list | tuple = (), on_token: list | tuple = ()):
        self.cuda = cuda
        self.on_first = list(on_first)
        self.on_token = list(on_token)
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        if self.cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 1:
            for fn in self.on_first:
                fn()
        for fn in self.on_token:
            fn(len(self.stamps) - 1)
        return scores


class StopRule(StoppingCriteria):
    """Stops after `max_tokens` tokens, or once the decode (from the first token) has run
    `cap_s` seconds with at least `min_tokens` tokens out; either may be None."""

    def __init__(self, clock: StepClock, max_tokens: int | None = None, cap_s: float | None = None,
                 min_tokens: int = 4):
        self.clock, self.max_tokens, self.cap_s, self.min_tokens = clock, max_tokens, cap_s, min_tokens
        self.capped = False

    def __call__(self, input_ids, scores, **kwargs):
        st = self.clock.stamps
        stop = self.max_tokens is not None and len(st) >= self.max_tokens
        if not stop and self.cap_s is not None and len(st) >= self.min_tokens and st[-1] - st[0] >= self.cap_s:
            stop = self.capped = True
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def timing_fields(t0: float, stamps: list, t_end: float) -> dict:
    """TTFT and TPOT statistics from the stamps of one generate call (seconds in; TPOT in ms)."""
    gaps = np.diff(np.asarray(stamps, dtype=np.float64))
    out = {"ttft_s": stamps[0] - t0, "new_tokens": len(stamps), "tpot_samples": int(gaps.size),
           "decode_s": stamps[-1] - stamps[0], "generate_s": t_end - t0, "tpot_ms": [float(g * 1e3) for g in gaps]}
    if gaps.size:
        out.update(latency_stats(gaps, "tpot"))
    return out


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed_generate(model, ids, mask, new_tokens: int, gen_kwargs: dict, *, cap_s: float | None = None,
                   on_first: list | tuple = (), on_token: list | tuple = (), max_tokens: int | None = None,
                   measure_memory: bool = True) -> dict:
    """One greedy `generate` of exactly `new_tokens` tokens (fewer when `cap_s` or `max_tokens`
    stops it), timed by `StepClock`; with CUDA, the peak memory before and after the first token."""
    cuda = ids.device.type == "cuda"
    mem: dict = {}

    def prefill_peak() -> None:
        mem["prefill"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    jiffies: dict = {}
    caller_cpus: list = []  # the core the calling thread was on at each token
    # At each token, /proc/stat and the calling thread's status, unparsed (two reads, ~40 us a
    # token in all; parsed after the call): what each token's interval lost to the hypervisor and
    # to other threads taking the caller's core, so a slow token can be told from a slow host.
    token_stats: list = []

    def decode_start() -> None:
        jiffies["first"] = cpu_jiffies()
        jiffies["switches"] = thread_switches()

    def caller_cpu(_: int) -> None:
        caller_cpus.append(thread_cpu())
        token_stats.append((read_cpu_stat(), read_thread_status()))

    clock = StepClock(cuda, ([prefill_peak] if cuda and measure_memory else []) + [decode_start] + list(on_first),
                      [caller_cpu] + list(on_token))
    rule = StopRule(clock, max_tokens=max_tokens, cap_s=cap_s)
    _sync(cuda)
    if cuda and measure_memory:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=min(new_tokens, max_tokens or new_tokens), do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([clock]), stopping_criteria=StoppingCriteriaList([rule]),
                         **gen_kwargs)
    _sync(cuda)
    t_end = time.perf_counter()
    generated = out.shape[1] - ids.shape[1]
    if generated != len(clock.stamps):
        raise RuntimeError(f"generate made {generated} tokens but the clock saw {len(clock.stamps)}")
    row = timing_fields(t0, clock.stamps, t_end)
    row["stopped_by_time_cap"] = rule.capped
    if "first" in jiffies:
        # The host's cores from the first token on: how busy, and how much time the hypervisor took.
        shares = cpu_shares(jiffies["first"], cpu_jiffies())
        row["decode_host_busy_share"], row["decode_host_steal_share"] = (
            None if v != v else v for v in (shares["busy"], shares["steal"]))  # NaN (no /proc/stat): None
        # The calling thread -- the one that launches every layer's work -- over the decode: its
        # context switches (involuntary: another runnable thread took its core) and its core at
        # each token (the first token's included), None where /proc has no such file.
        before, after = jiffies.get("switches"), thread_switches()
        row["decode_caller_switches_voluntary"], row["decode_caller_switches_involuntary"] = (
            (after[0] - before[0], after[1] - before[1]) if before is not None and after is not None else (None, None))
        row["decode_caller_cpus"] = caller_cpus[:]
        row.update(token_interval_stats(token_stats))
    if cuda and measure_memory:
        decode = torch.cuda.max_memory_allocated()
        row.update(prefill_peak_gpu_bytes=mem.get("prefill"), decode_peak_gpu_bytes=decode,
                   peak_gpu_bytes=max(mem.get("prefill", 0), decode))
    return row


def token_interval_stats(snapshots: list[tuple[str, str]]) -> dict:
    """Per token interval (`tpot_ms[i]`: token i to token i + 1), from the raw snapshots taken at
    each token (`/proc/stat` text, the calling thread's status text): `tpot_steal_core_ms`, the
    time the hypervisor took from this machine's cores over the interval, summed over cores
    (`steal_core_ms`), and `tpot_caller_switches_involuntary`, the times another thread took the
    calling thread's core; None entries where /proc lacks what they need."""
    jiffies = [parse_cpu_jiffies(stat) for stat, _ in snapshots]
    switches = [parse_thread_switches(status) for _, status in snapshots]
    return {
        "tpot_steal_core_ms": [steal_core_ms(a, b) for a, b in zip(jiffies, jiffies[1:])],
        "tpot_caller_switches_involuntary": [b[1] - a[1] if a is not None and b is not None else None
                                             for a, b in zip(switches, switches[1:])],
    }


def caller_tokens_on(row: dict, cores) -> int | None:
    """Of the tokens at which `timed_generate` read the calling thread's core (`decode_caller_cpus`),
    how many found it on one of `cores` (the CPU workers' pinned cores; None entries are unpinned
    workers); None when no core is pinned or no token's core was read."""
    pinned = {c for c in cores if c is not None}
    cpus = [c for c in row.get("decode_caller_cpus") or [] if c is not None]
    return sum(c in pinned for c in cpus) if pinned and cpus else None


def release_memory() -> None:
    """Collect garbage and return the CUDA caching allocator's free blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timeline_fields(rt, layers: int) -> dict:
    """What a runtime's timeline recorded since its last clear: records, decode steps (records /
    layers), bytes read per step, the GPU lane's byte share and attention ms per step."""
    recs = rt.timeline.records
    total = sum(int(r.bytes_read.sum()) for r in recs)
    gpu = sum(int(r.bytes_read[r.lane == LANE_GPU].sum()) for r in recs)
    steps = len(recs) // layers if len(recs) % layers == 0 else len(recs) / layers
    attn = sum(r.attention_s for r in recs)
    return {
        "timeline_records": len(recs),
        "decode_steps": steps,
        "timeline_bytes_total": total,
        "bytes_per_step": total / steps if steps else None,
        "gpu_byte_share": gpu / total if total else None,
        "attention_ms_per_step": attn / steps * 1e3 if steps else None,
        **layer_time_split(recs, layers),
        "step_series": layer_time_series(recs, layers, rt.timeline.sample_every, rt.timeline.sample_offset,
                                         rt.timeline.dropped_steps // layers),
    }


def layer_time_split(recs: list, layers: int) -> dict:
    """Where a decode step's time goes around the runtime's layers, medians over whole steps (ms).

    Per step (the sum over its `layers` consecutive records): `decode_host_ms` -- host time inside
    `decode`; `between_layers_host_ms` -- host time between one layer's `decode` returning and the
    next layer's call (the model's own Python and launches); `q_wait_ms` -- how long after the call
    the GPU produced q (the host ran ahead of the device by that much); `attention_ms` -- q produced
    to merged output (the timeline's attention time); `merge_after_return_ms` -- how long the merged
    output lagged the call's return. The attention time in three parts: `lead_ms` -- q produced to
    the first task's start (either lane), `tasks_ms` -- first task's start to the last task's end,
    `tail_ms` -- last task's end to the merged output (a layer-step without tasks: all tail); and
    `cpu_task_busy_ms` -- the CPU lane's task durations summed (over workers too). Empty when the
    records do not split into whole steps.
    """
    parts = _step_parts(recs, layers)
    return {f"step_{k}_median": float(np.median(v) * 1e3) for k, v in parts.items() if k in _SPLIT_PARTS}


# The parts `layer_time_split` reports as medians; `layer_time_series` has these and more, per step.
_SPLIT_PARTS = ("lead_ms", "tasks_ms", "tail_ms", "cpu_task_busy_ms", "decode_host_ms", "between_layers_host_ms",
                "q_wait_ms", "attention_ms", "merge_after_return_ms")


def layer_time_series(recs: list, layers: int, sample_every: int = 1, sample_offset: int = 0,
                      first_recorded: int = 0) -> dict:
    """`layer_time_split`'s parts for every recorded step, not their medians: a row's tokens read
    side by side (which steps were slow, and whether the thread, the lead or the lanes made them so).

    Besides the split's parts: `cpu_lead_ms` / `gpu_lead_ms` -- q produced to that lane's first task,
    summed over the step's layers that ran a task on it (a layer without one adds nothing),
    `gpu_byte_share` -- the GPU lane's share of the step's bytes, and the thread's path through
    `decode` in five legs between its milestones: `host_to_scheduler_ms` (the call to the scheduler
    taking the step), `scheduler_to_release_ms` (to the CPU workers' release, less any wait for an
    earlier step's CPU tasks), `release_to_scheduler_return_ms` (the GPU lane's drive until the
    scheduler returns), `scheduler_return_to_merge_ms` (to the merge issued) and `merge_to_return_ms`.
    `token`: each entry's decode step, counted from the timeline's clear, given how it sampled (`sample_every`, `sample_offset`) and how
    many recorded steps it had already dropped (`first_recorded`). Values in ms rounded to 1 us; `{}`
    when the records do not split into whole steps.
    """
    parts = _step_parts(recs, layers)
    if not parts:
        return {}
    series = {k: [round(float(x) * 1e3, 3) for x in v] for k, v in parts.items() if k != "gpu_byte_share"}
    series["gpu_byte_share"] = [round(float(x), 4) for x in parts["gpu_byte_share"]]
    series["token"] = [sample_offset + (first_recorded + i) * sample_every for i in range(len(parts["lead_ms"]))]
    return series


def _step_parts(recs: list, layers: int) -> dict:
    """Per whole step (`layers` consecutive records), each part in seconds (the byte share a fraction)."""
    n = len(recs) // layers if layers else 0
    if not n or len(recs) != n * layers:
        return {}
    t_entry = np.array([r.t_entry for r in recs]).reshape(n, layers)
    t_return = np.array([r.t_return for r in recs]).reshape(n, layers)
    t_start = np.array([r.t_start for r in recs]).reshape(n, layers)
    t_end = np.array([r.t_end for r in recs]).reshape(n, layers)
    if np.isnan(t_entry).any() or np.isnan(t_return).any():
        return {}
    first = np.array([r.start.min() if r.n_tasks else r.t_start for r in recs]).reshape(n, layers)
    last = np.array([r.end.max() if r.n_tasks else r.t_start for r in recs]).reshape(n, layers)
    cpu_busy = np.array([float((r.end - r.start)[r.lane == LANE_CPU].sum()) for r in recs]).reshape(n, layers)
    # A lane's first task in a layer-step, as its lead from q (0 where the lane ran nothing there).
    lane_lead = {lane: np.array([float(r.start[r.lane == lane].min() - r.t_start) if (r.lane == lane).any() else 0.0
                                 for r in recs]).reshape(n, layers) for lane in (LANE_CPU, LANE_GPU)}
    # The host's path through `decode` between its milestones (`StepRecord.t_scheduled` ...), summed
    # over the step's layers that have them (a layer-step without tasks has only the merge's).
    marks = np.array([(r.t_entry, r.t_scheduled, r.t_release, r.t_scheduler_return, r.t_merge_issued, r.t_return)
                      for r in recs], dtype=np.float64).reshape(n, layers, 6)
    host_legs = {name: np.nansum(marks[:, :, i + 1] - marks[:, :, i], axis=1)
                 for i, name in enumerate(("host_to_scheduler_ms", "scheduler_to_release_ms", "release_to_scheduler_return_ms",
                                           "scheduler_return_to_merge_ms", "merge_to_return_ms"))}
    step_bytes = np.array([float(r.bytes_read.sum()) for r in recs]).reshape(n, layers).sum(axis=1)
    gpu_bytes = np.array([float(r.bytes_read[r.lane == LANE_GPU].sum()) for r in recs]).reshape(n, layers).sum(axis=1)
    return {
        "lead_ms": (first - t_start).sum(axis=1),
        "tasks_ms": (last - first).sum(axis=1),
        "tail_ms": (t_end - last).sum(axis=1),
        "cpu_task_busy_ms": cpu_busy.sum(axis=1),
        "decode_host_ms": (t_return - t_entry).sum(axis=1),
        "between_layers_host_ms": (t_entry[:, 1:] - t_return[:, :-1]).sum(axis=1),
        "q_wait_ms": np.maximum(t_start - t_entry, 0.0).sum(axis=1),
        "attention_ms": (t_end - t_start).sum(axis=1),
        "merge_after_return_ms": np.maximum(t_end - t_return, 0.0).sum(axis=1),
        "cpu_lead_ms": lane_lead[LANE_CPU].sum(axis=1),
        "gpu_lead_ms": lane_lead[LANE_GPU].sum(axis=1),
        "gpu_byte_share": np.divide(gpu_bytes, step_bytes, out=np.zeros_like(gpu_bytes), where=step_bytes > 0),
        **host_legs,
    }


__all__ = [
    "MODELS",
    "StepClock",
    "StopRule",
    "build_model",
    "config_for_geometry",
    "kv_bytes",
    "latency_stats",
    "layer_time_series",
    "layer_time_split",
    "model_config",
    "model_dims",
    "param_count",
    "random_prompt",
    "random_prompts",
    "release_memory",
    "timed_generate",
    "timeline_fields",
    "timing_fields",
    "token_interval_stats",
]
