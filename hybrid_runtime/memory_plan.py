"""What a run will hold in memory, estimated from its config before anything is allocated.

`HybridRuntime(cfg)` and the synthetic experiment behind `hybrid-runtime run` build a
`MemoryPlan` first and `admit` it: when its peak does not fit what this machine has free they
raise `AdmissionError` with every figure, and nothing has been allocated.

A plan is one line per part: bytes, where they live (pinned host, pageable host, GPU), the config
keys that scale them, and when they are held. *Resident* parts live from construction to `close`
(arenas, windows, workspaces, buffers); every other part belongs to one *phase* (the temporaries
of a prefill, of a decode step, of the experiment's prompt generation or its final check). Phases
never overlap, so the peak is the resident sum plus the largest phase.

The figures mirror the code that allocates (sizes from the same formulas; temporaries counted
tensor by tensor from the operations that make them), so a change there must change them here:
`tests/test_admission.py` compares them with the real buffers and with the measured peak RSS.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Iterable

import psutil
import torch

from cpu_kernels import layout
from hybrid_runtime import native_pool
from hybrid_runtime.forecast_block_cache import BlockCache
from hybrid_runtime.config import (Config, GeometryConfig, KVCacheConfig, selects_cpu_tasks_on_gpu, sparda_cache_blocks,
                                   spill_blocks, starts_lanes, uses_gpu_metadata)
from hybrid_runtime.kvcache import CapacityError, arena_bytes, gpu_metadata_bytes, host_available_bytes
from hybrid_runtime.prefill_statistics import statistics_bytes
from hybrid_runtime.segment_index import CELLS_PER_CHUNK, SegmentIndex
from hybrid_runtime.tasks import blocks_for_budget

HOST_PINNED = "host pinned"
HOST = "host"
GPU = "gpu"
RESIDENT = "resident"

_ESIZE = {"bf16": 2, "fp32": 4}
_F32 = 4
_I64 = 8
_GiB = 2**30
_MiB = 2**20

# Threads, compiled code and Python objects of a runtime, beyond every sized buffer. Measured as
# the RSS growth of building a runtime with the smallest store in a fresh process (Linux, numba
# 0.61, torch 2.13): ~20 MB without CPU workers; with native CPU workers, the numba compilation of
# their loop adds ~150 MB (the first runtime of a process; later ones reuse the code).
RUNTIME_BASE_BYTES = 24 * _MiB
NATIVE_LOOP_CODE_BYTES = 160 * _MiB
# Without CUDA the runtime also compiles its host window kernels (cpu_kernels/window_attention.py)
# at construction. The quickstart-shaped admission run (tests/test_admission.py) with a fresh numba
# cache peaked at 858-872 MB on one 2-core host and at 909 MB on the CI host (another CPU, so other
# LLVM code generation), against 786-809 MB with a warm cache: the compiled code's share depends on
# the host, and this allowance takes the largest seen. Later (2026-11-29, with more kernels compiled
# at start) the same run on a 2-core host peaked at 859-878 MiB in nine runs from a script and at up
# to 939 MiB in runs under pytest, against an estimate of 900 MiB with 80 MiB here: 144 MiB covers
# the largest by 2.5%.
HOST_WINDOW_CODE_BYTES = 144 * _MiB
# Freed temporaries the C allocator keeps in its heaps (glibc serves requests up to 32 MiB from
# them once a chunk that size was freed, and returns little of it): the measured peak RSS of the
# synthetic run exceeded the counted parts by up to 82 MiB over eight configs (bf16 and fp32,
# 2 to 16 layers, 2K to 32K-token prompts); this allowance covers it.
ALLOCATOR_SLACK_BYTES = 128 * _MiB
# One decode step's record in the profiling timeline (arrays per task, events, Python objects):
# measured 2.6-3.8 KB with 4 tasks and 7.1 KB with 64 tasks per step (RSS growth over 400-2000
# recorded steps); a timeline keeps at most `profiling.max_steps` of them.
TIMELINE_STEP_BYTES = 4096
TIMELINE_TASK_BYTES = 80


class AdmissionError(CapacityError):
    """A run's estimated peak memory does not fit what this machine has free; nothing was allocated.

    `plan` is the itemised estimate, `limit_bytes` what it was allowed, `where` "host" or "gpu".
    """

    def __init__(self, message: str, plan: "MemoryPlan", where: str, limit_bytes: int):
        super().__init__(message)
        self.plan = plan
        self.where = where
        self.limit_bytes = limit_bytes


@dataclass(frozen=True)
class MemoryPart:
    """One thing a run allocates: `nbytes` in `where`, held in `phase` (RESIDENT or a phase name)."""

    name: str
    where: str
    phase: str
    nbytes: int
    keys: tuple[str, ...]  # config keys that scale it, the one it grows with most first
    detail: str  # how the figure is made, in the units of the code that allocates it


@dataclass(frozen=True)
class MemoryPlan:
    parts: tuple[MemoryPart, ...]

    def __add__(self, other: "MemoryPlan") -> "MemoryPlan":
        return MemoryPlan(self.parts + other.parts)

    def peak(self, wheres: Iterable[str]) -> tuple[int, str | None]:
        """(peak bytes over the parts in `wheres`, the phase that makes it, None when no phase adds)."""
        wheres = set(wheres)
        resident = sum(p.nbytes for p in self.parts if p.where in wheres and p.phase == RESIDENT)
        phases: dict[str, int] = {}
        for p in self.parts:
            if p.where in wheres and p.phase != RESIDENT:
                phases[p.phase] = phases.get(p.phase, 0) + p.nbytes
        if not phases:
            return resident, None
        phase = max(phases, key=phases.__getitem__)
        return resident + phases[phase], phase

    @property
    def host_peak_bytes(self) -> int:
        return self.peak((HOST, HOST_PINNED))[0]

    @property
    def gpu_peak_bytes(self) -> int:
        return self.peak((GPU,))[0]

    @property
    def pinned_bytes(self) -> int:
        return self.peak((HOST_PINNED,))[0]

    def table(self, wheres: Iterable[str] = (HOST, HOST_PINNED, GPU)) -> str:
        """The parts as aligned lines: resident first, then the phase that makes the peak."""
        wheres = tuple(wheres)
        _, phase = self.peak(wheres)
        shown = [p for p in self.parts if p.where in wheres and p.phase in (RESIDENT, phase) and p.nbytes]
        width = max((len(p.name) for p in shown), default=0)
        lines = []
        for p in shown:
            held = "resident" if p.phase == RESIDENT else f"during {p.phase}"
            keys = f"  [{', '.join(p.keys)}]" if p.keys else ""
            lines.append(f"  {p.name:<{width}}  {_gib(p.nbytes):>10}  {p.where:<11}  {held:<24}  {p.detail}{keys}")
        return "\n".join(lines)


@dataclass(frozen=True)
class MachineMemory:
    """What this machine has free now: host from psutil (available, not total), GPU from CUDA."""

    host_available: int
    host_total: int
    gpu_free: int | None = None
    gpu_total: int | None = None

    @classmethod
    def now(cls) -> "MachineMemory":
        gpu_free = gpu_total = None
        if torch.cuda.is_available():
            # Creates the CUDA context first, so the host figure below already excludes its memory.
            gpu_free, gpu_total = torch.cuda.mem_get_info()
        available = host_available_bytes()
        return cls(available, int(psutil.virtual_memory().total), gpu_free, gpu_total)


# ---------------------------------------------------------------------------- sizes
def _gib(nbytes: float) -> str:
    return f"{nbytes / _GiB:.2f} GiB" if nbytes >= _GiB else f"{nbytes / _MiB:.1f} MiB"


def pinned_footprint(nbytes: int) -> int:
    """Bytes one pinned allocation of `nbytes` takes: torch's caching host allocator rounds every
    request up to a power of two before it pins."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def _gpu_footprint(nbytes: int) -> int:
    """Bytes one CUDA tensor takes in torch's caching allocator: 512-byte blocks; requests over
    1 MiB come from segments rounded to 2 MiB."""
    if nbytes <= 0:
        return 0
    if nbytes <= _MiB:
        return -(-nbytes // 512) * 512
    return -(-nbytes // (2 * _MiB)) * (2 * _MiB)


def _on(where: str, nbytes: int) -> int:
    if where == HOST_PINNED:
        return pinned_footprint(nbytes)
    if where == GPU:
        return _gpu_footprint(nbytes)
    return int(nbytes)


def max_task_blocks(kv: KVCacheConfig) -> int:
    """Blocks of the largest task (one sequence holding the whole capacity, smallest block size):
    the CPU workspaces' size (`KVStore.max_task_blocks`)."""
    return -(-kv.cpu_capacity_tokens // min(layout.BLOCK_SIZES))


def workspace_bytes(group_size: int, head_dim: int, max_blocks: int) -> int:
    """Bytes of one CPU worker's `cpu_kernels.sparse_attention.Workspace`."""
    g, mb = group_size, max_blocks
    scores_selected = 2 * g * mb * 4
    block_heads_topk = mb * 4 + (mb + 256) * 4
    state = (2 * g + 2) * (2 + head_dim + layout.PAGE_SIZE) * 4
    return scores_selected + g * 4 + block_heads_topk + state


def native_job_bytes(max_tasks: int, group_size: int, max_chunks: int, n_workers: int, head_dim: int,
                     max_blocks: int) -> int:
    """Bytes of `native_pool.NativeJobBuffers` (the native workers' shared task table and split buffers)."""
    t = max(1, max_tasks)
    fixed = native_pool.CTRL_SIZE * _I64 + t * (native_pool.T_COLS + native_pool.R_COLS) * _I64
    fixed += t * group_size * 4 + max(1, max_chunks) * 4 + max(1, n_workers) * 2 * _I64
    split = n_workers > 1 and head_dim > 0 and max_blocks > 0 and max_tasks < (1 << 16)
    w = max(1, n_workers) if split else 1
    parts = native_pool.MAX_PARTS if split else 1
    team = 3 * w * native_pool.LINE * _I64 + w * (parts + 1) * _I64 + native_pool.LINE * _I64
    team += w * parts * group_size * (max(1, head_dim) + 1) * _F32 + w * (max(1, max_blocks) if split else 1) * 4
    doorbells = max(1, n_workers) * (native_pool.SEM_BYTES + _I64) + 4
    picked = native_pool.LINE * _I64  # the picked-task count (the GPU selection's rows are a part of their own)
    collected = native_pool.COLLECTED * 8  # `collect_records`' totals (float64)
    return fixed + team + doorbells + picked + collected


def gpu_lane_sizes(kv: KVCacheConfig, geometry: GeometryConfig) -> dict[str, int]:
    """Bytes of each buffer kind of the CUDA GPU lane (`executors.gpu_uva`) at its largest: claim
    scratch and split partials for every task of a full batch at the most blocks a task can have,
    the resident step tables it keeps, the step-table staging buffers (pinned and on the device),
    the union-size ring (pinned) and the link probe (one buffer of each kind)."""
    from gpu_kernels.sparse_attention import MAX_SPLITS
    from gpu_kernels.task_table import N_COLS, StepTableBuffer
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor, link_bandwidth

    g, d = geometry.group_size, geometry.head_dim
    n_chunks, _ = arena_bytes(kv, geometry)
    tasks = max(1, kv.max_sequences * geometry.kv_heads)
    blocks = max(1 << max(0, max_task_blocks(kv) - 1).bit_length(), 16)  # `_grow` rounds to a power of two
    table_words = tasks * (N_COLS + g) + n_chunks + 1
    # The sizes the lane allocates with: its functions' own defaults.
    initial_words = inspect.signature(StepTableBuffer).parameters["capacity"].default
    return {
        "tasks": tasks,
        "blocks": blocks,
        # scores, union blocks and heads; counts and two rows of tickets
        "claim_scratch": tasks * (g + 2) * blocks * 4 + tasks * 3 * 4,
        # scores and tickets of the CPU lane's selection (`GpuUvaExecutor.pick`), at the claims' capacity
        "pick_scratch": tasks * g * blocks * 4 + tasks * 4,
        "split_partials": tasks * MAX_SPLITS * g * (d + 1) * _F32,
        "step_table": table_words * 4,  # one table; the lane keeps up to `resident_tables` on the device
        "resident_tables": GpuUvaExecutor.RESIDENT,
        "table_staging": StepTableBuffer.SLOTS * max(initial_words, 2 * table_words) * 4,
        "ring": GpuUvaExecutor.RING * tasks * 4,
        "link_probe": inspect.signature(link_bandwidth).parameters["nbytes"].default,
    }


def gpu_lane_bytes(kv: KVCacheConfig, geometry: GeometryConfig, picks: bool = False) -> tuple[int, int, str]:
    """(device bytes, pinned host bytes, how) of the CUDA GPU lane, as the caching allocators hold
    them: the claim scratch grows by doubling and the smaller earlier buffers stay cached (counted
    twice); the link probe's buffers stay cached too. `picks`: the lane also selects the CPU lane's
    blocks (`scheduler.cpu_task_selection`), whose scratch grows with the claims'."""
    z = gpu_lane_sizes(kv, geometry)
    device = (2 * _on(GPU, z["claim_scratch"]) + (2 * _on(GPU, z["pick_scratch"]) if picks else 0)
              + _on(GPU, z["split_partials"])
              + z["resident_tables"] * _on(GPU, z["step_table"])
              + _on(GPU, z["table_staging"]) + _on(GPU, z["link_probe"]))
    pinned = _on(HOST_PINNED, z["ring"]) + _on(HOST_PINNED, z["table_staging"]) + _on(HOST_PINNED, z["link_probe"])
    how = f"claims of {z['tasks']} tasks x {z['blocks']} blocks, cached step tables, link probe"
    return device, pinned, how


def nosa_bytes(cfg: Config, geometry: GeometryConfig) -> tuple[int, int, str]:
    """(resident, one decode step's temporaries, how) of the NOSA executor (`executors.nosa`):
    per layer, the side arenas indexed by chunk id (pooled sub-block keys in the store dtype, the
    importance in fp32) and the block caches of every (slot, KV head); per step, the gathered
    sub-block keys and their scores for every chunk of the step's tasks and, on the torch path,
    the gathered cache contents and their scores (the larger of the two bounds the Triton path)."""
    kv, nosa = cfg.kv_cache, cfg.nosa
    n_b, d, g, hkv = nosa.block_tokens, geometry.head_dim, geometry.group_size, geometry.kv_heads
    es = _ESIZE[kv.dtype]
    spc = layout.CHUNK_TOKENS // n_b * ((n_b - nosa.pool_kernel_tokens) // nosa.pool_stride_tokens + 1)
    n_chunks, _ = arena_bytes(kv, geometry)
    rows = n_chunks + 1
    score = spc * _F32 if nosa.score == "decayed_attention" else layout.CHUNK_TOKENS // n_b * _F32
    cap = nosa.cache_blocks(kv)
    entries = kv.max_sequences * hkv
    cache = entries * cap * (2 * n_b * d * es + 8) + entries * 8
    resident = geometry.layers * (rows * (spc * d * es + score) + cache)
    step = rows * spc * (d * (es + _F32) + 3 * g * _F32) + entries * cap * n_b * (2 * d * (es + _F32) + 2 * g * _F32)
    how = (f"{geometry.layers} layers x ({rows} chunks x {spc} pooled keys, a {cap}-block cache per slot and KV head); "
           "per step the pooled keys and cache contents of every task")
    return resident, step, how


def window_workspace_bytes(kv: KVCacheConfig, geometry: GeometryConfig) -> int:
    """Device bytes of the window kernel's split-K workspace (`gpu_kernels.window_attention`) for a full batch."""
    from gpu_kernels.window_attention import MAX_SPLITS

    rows = kv.max_sequences * geometry.q_heads
    return _on(GPU, max(rows * MAX_SPLITS * (geometry.head_dim + 1), 1 << 16) * _F32) + _on(GPU, 4 * max(rows, 1024))


def _prompt_split(kv: KVCacheConfig, length: int) -> tuple[int, int]:
    """(window tokens, CPU-resident tokens) of a prompt of `length` tokens (`KVStore.prefill`)."""
    sink = min(kv.sink, length)
    recent = min(kv.local, length - sink)
    return sink + recent, length - sink - recent


def _prefill_temporaries(kv: KVCacheConfig, geometry: GeometryConfig, length: int, *, converts: bool,
                         extends: bool) -> int:
    """Bytes of the temporaries of one `KVStore.prefill` of `length` tokens at its peak, on the
    device the prompt is on.

    `converts`: the prompt is not in the store's dtype, so all of k and v are cast first. The CPU
    segment's chunks are built by `kvcache.chunk_images`: a separate image of the chunks when their
    ids do not form one run (counted always), one of k's or v's rows reshaped at a time, then the
    block min/max pyramid (amin, cat, stack, isinf: about 3 bytes per stored metadata element for
    each of their bytes). `extends`: a chunk already partly filled is rebuilt, so k and v are
    concatenated behind its tokens first.
    """
    hkv, d, es = geometry.kv_heads, geometry.head_dim, _ESIZE[kv.dtype]
    _, cpu = _prompt_split(kv, length)
    chunks = -(-cpu // layout.CHUNK_TOKENS)
    key_elems = hkv * chunks * layout.CHUNK_TOKENS * d
    meta_elems = hkv * chunks * 2 * layout.META_ENTRIES * d
    cast = 2 * length * hkv * d * es if converts else 0
    joined = 2 * key_elems * es if extends else 0
    images = hkv * chunks * layout.CHUNK_ROWS * d * es
    build = max(cpu * hkv * d * es, meta_elems * (3 * es + 1))
    return cast + joined + images + build


def _torch_lane_task_bytes(cpu_len: int, block_size: int, budget: float, geometry: GeometryConfig, es: int) -> int:
    """Host temporaries of one task on the torch reference GPU lane (`executors.torch_ref`), at its peak:
    the block scores stage ([G, blocks, D] products) or the gather of the selected tokens."""
    g, d = geometry.group_size, geometry.head_dim
    n_blocks = -(-cpu_len // block_size)
    chunks = -(-cpu_len // layout.CHUNK_TOKENS)
    meta_gather = chunks * 2 * layout.META_ENTRIES * d * es + n_blocks * 2 * d * (es + _F32)
    scores = 3 * g * n_blocks * d * _F32
    tokens = min(cpu_len, blocks_for_budget(budget, cpu_len, block_size) * block_size)
    gather = n_blocks * 2 * d * _F32 + g * n_blocks * (_F32 + 2 * _I64) + tokens * (4 * _I64 + 2 * d * _F32 + d * es)
    return chunks * _I64 + max(meta_gather + scores, gather)


# ---------------------------------------------------------------------------- plans
def estimate_runtime(cfg: Config, geometry: GeometryConfig | None = None, *, cuda: bool | None = None,
                     recorded_steps: int | None = None) -> MemoryPlan:
    """Everything `HybridRuntime(cfg, geometry)` allocates, and the temporaries of its largest prefill
    (one prompt filling `kv_cache.cpu_capacity_tokens`) and decode task (budget 1.0 at the smallest
    block size: any head plan). `cuda`: plan for a machine with (True) or without CUDA (default:
    this one). `recorded_steps`: decode steps the timeline will record (default: as many as it keeps)."""
    geometry = cfg.geometry if geometry is None else geometry
    cuda = torch.cuda.is_available() if cuda is None else cuda
    kv, sc = cfg.kv_cache, cfg.scheduler
    layers, hkv, hq, d, g = geometry.layers, geometry.kv_heads, geometry.q_heads, geometry.head_dim, geometry.group_size
    es = _ESIZE[kv.dtype]
    s = kv.max_sequences
    window_on_gpu = kv.device == "cuda" or (kv.device == "auto" and cuda)
    host_kind = HOST_PINNED if cuda else HOST
    lanes = starts_lanes(cfg.selection)
    lane_on_gpu = lanes and sc.gpu_lane(cuda) and cuda
    cap_keys = ("kv_cache.cpu_capacity_tokens", "kv_cache.max_sequences", "kv_cache.dtype", "geometry.layers")
    parts = []

    n_chunks, arenas = arena_bytes(kv, geometry)
    parts.append(MemoryPart(
        "kv_arenas", host_kind, RESIDENT, arenas, cap_keys,
        f"{layers} layers x {n_chunks} chunks x {layout.CHUNK_ROWS} rows x {d} x {es} B, committed as used"))

    w = kv.sink + kv.local + kv.generated_cap + layout.PAGE_SIZE
    win_where = GPU if window_on_gpu else HOST
    one_window = s * hkv * w * d * es
    parts.append(MemoryPart(
        "kv_windows", win_where, RESIDENT, 2 * layers * _on(win_where, one_window),
        ("kv_cache.max_sequences", "kv_cache.generated_cap", "kv_cache.local", "kv_cache.sink", "geometry.layers"),
        f"k and v x {layers} layers x {s} slots x {hkv} heads x {w} tokens x {d} x {es} B"))

    if cfg.selection.name == "predicted":
        parts.append(MemoryPart(
            "prefill_statistics", win_where, RESIDENT, _on(win_where, statistics_bytes(geometry, kv, layers)),
            ("kv_cache.max_sequences", "geometry.layers"),
            f"predictor statistics and previous queries of {s} + 1 slots x {layers} layers, fp32"))
        # The anchor's budget search at prefill (predictor.features.compute_prefill_statistics): the
        # weighted values of every CPU-resident prompt token per query head and their block sums, fp32.
        _, longest_cpu = _prompt_split(kv, kv.sink + kv.local + kv.cpu_capacity_tokens)
        parts.append(MemoryPart(
            "prefill_statistics_search", win_where, "prefill", _on(win_where, 2 * hq * longest_cpu * d * _F32),
            ("kv_cache.cpu_capacity_tokens",), f"anchor budget search over {longest_cpu} tokens x {hq} heads x {d}, fp32"))

    if cfg.selection.name == "sparda":
        sp = cfg.sparda
        per_group = sparda_cache_blocks(sp, kv)
        max_blocks = -(-kv.cpu_capacity_tokens // sp.block_size) + 1
        max_chunks = -(-kv.cpu_capacity_tokens // layout.CHUNK_TOKENS) + 1
        # A staged selection's entries per layer (slot, valid tokens, chunk, first row, fetch flag).
        entries = s * hkv * (sp.top_k + spill_blocks(kv, sp.block_size))
        per_layer = BlockCache.nbytes(s * hkv * per_group, sp.block_size, d, es, s, hkv, max_blocks) + \
            SegmentIndex.nbytes(n_chunks, s, hkv, d, max_chunks, es) + entries * (8 + 4 + 4 + 4 + 1)
        parts.append(MemoryPart(
            "sparda_cache_index", win_where, RESIDENT, _on(win_where, layers * per_layer),
            ("sparda.cache_blocks", "sparda.top_k", "kv_cache.max_sequences", "kv_cache.cpu_capacity_tokens",
             "geometry.layers"),
            f"{layers} layers x ({s * hkv * per_group} cached blocks of {sp.block_size} tokens, K and V; cell means of "
            f"{n_chunks} chunks; chunk tables)"))
        cells = s * hkv * max_chunks * CELLS_PER_CHUNK
        if window_on_gpu:
            # One selection from the index tables (gpu_kernels/forecast_scores.py): window scores
            # per query head in fp32 (a proxy's; a Forecast's are per KV group), the blocks' sort
            # keys and their topk, the cache plan's scratch.
            step = s * hq * max_chunks * CELLS_PER_CHUNK * _F32 + s * hkv * max_blocks * 8 + \
                s * hkv * sp.top_k * 16 + entries * (3 * 8 + 2 * 4)
            how = f"window scores of {cells} cells per query head, sort keys of {s * hkv * max_blocks} blocks"
        else:
            # On the host: the batch's cells gathered and scored in fp32 (per head for a proxy), and
            # the attention's gathered K and V of every selected block in fp32.
            step = cells * d * (es + _F32) + 4 * s * hq * max_chunks * CELLS_PER_CHUNK * _F32 + \
                2 * entries * sp.block_size * d * _F32
            how = f"scores of {cells} cells for {s} sequences; attention over the selected blocks on the host"
        parts.append(MemoryPart(
            "sparda_selection", win_where, "decode", _on(win_where, step),
            ("kv_cache.max_sequences", "kv_cache.cpu_capacity_tokens", "sparda.top_k"), how))

    # Step buffers (runtime.__init__): q and packed results on the host, their device copies.
    step_keys = ("kv_cache.max_sequences",)
    host_step = _on(host_kind, s * hq * d * _F32) + _on(host_kind, s * hq * (d + 1) * _F32)
    if window_on_gpu:
        from gpu_kernels.step_inputs import N_COUNTS, count_columns

        from hybrid_runtime.input_check import DeferredInputCheck

        # The step-inputs kernel's NaN/inf counts: one row for the sync check, a ring for the deferred one.
        columns = count_columns(s * hq)
        host_step += _on(host_kind, N_COUNTS * (columns + DeferredInputCheck.SLOTS
                                                * DeferredInputCheck.fused_row_columns(columns)) * 4)
    lane_where = GPU if lane_on_gpu else HOST
    lane_step = 2 * _on(lane_where, s * hq * d * _F32) + _on(lane_where, s * hq * _F32)
    parts.append(MemoryPart("step_buffers", host_kind, RESIDENT, host_step + (0 if lane_on_gpu else lane_step),
                            step_keys, f"q and results of {s} sequences x {hq} heads, fp32"))
    gpu_step = (_on(GPU, s * hq * (d + 1) * _F32) if window_on_gpu else 0) + (lane_step if lane_on_gpu else 0)
    if gpu_step:
        parts.append(MemoryPart("step_buffers_gpu", GPU, RESIDENT, gpu_step, step_keys,
                                f"device copies of q and results of {s} sequences x {hq} heads, fp32"))

    mb = max_task_blocks(kv)
    n = sc.cpu_worker_count() if lanes else 0
    if n:
        parts.append(MemoryPart(
            "cpu_workspaces", HOST, RESIDENT, n * workspace_bytes(g, d, mb),
            ("scheduler.cpu_workers", "kv_cache.cpu_capacity_tokens"),
            f"{n} workers x (scores, selections of {g} heads x {mb} blocks)"))
        parts.append(MemoryPart(
            "cpu_job_buffers", HOST, RESIDENT, native_job_bytes(s * hkv, g, n_chunks, n, d, mb),
            ("kv_cache.max_sequences", "kv_cache.cpu_capacity_tokens", "scheduler.cpu_workers"),
            f"task table of {s * hkv} tasks, {n_chunks} chunk ids, split buffers of {n} workers"))

    base = RUNTIME_BASE_BYTES + (NATIVE_LOOP_CODE_BYTES if n else 0) + (0 if window_on_gpu else HOST_WINDOW_CODE_BYTES)
    parts.append(MemoryPart("runtime_code_threads", HOST, RESIDENT, base, ("scheduler.cpu_workers",),
                            "threads, compiled kernels and objects (measured)"))
    parts.append(MemoryPart("allocator_slack", HOST, RESIDENT, ALLOCATOR_SLACK_BYTES, (),
                            "freed temporaries the C allocator keeps (measured)"))
    if cfg.profiling.enabled:
        steps = cfg.profiling.max_steps if recorded_steps is None else min(recorded_steps, cfg.profiling.max_steps)
        tasks = s * hkv
        parts.append(MemoryPart(
            "timeline", HOST, RESIDENT, steps * (TIMELINE_STEP_BYTES + tasks * TIMELINE_TASK_BYTES),
            ("profiling.max_steps", "kv_cache.max_sequences"),
            f"{steps} recorded steps of up to {tasks} tasks (measured per step and task)"))

    nosa = cfg.selection.name == "nosa" and sc.gpu_lane(cuda)
    if nosa:
        where = GPU if cuda else HOST
        state, step, how = nosa_bytes(cfg, geometry)
        nosa_keys = ("kv_cache.cpu_capacity_tokens", "kv_cache.max_sequences", "nosa.k_tokens", "geometry.layers")
        parts.append(MemoryPart("nosa_state", where, RESIDENT, _on(where, state), nosa_keys, how))
        parts.append(MemoryPart("nosa_step", where, "decode", _on(where, step), nosa_keys,
                                "one decode step's pooled keys, scores and cache contents"))
    asynctls = cfg.selection.name == "asynctls" and sc.gpu_lane(cuda)
    if asynctls:
        from hybrid_runtime.executors.asynctls import memory_bytes

        sizes = memory_bytes(cfg.selection, kv, geometry, n_chunks)
        where = GPU if cuda else HOST
        sel_keys = ("selection.blocks", "kv_cache.max_sequences", "selection.block_size", "geometry.layers")
        parts.append(MemoryPart("asynctls_index", where, RESIDENT, _on(where, sizes["index"]),
                                ("kv_cache.cpu_capacity_tokens", "selection.index_channels", "geometry.layers"),
                                f"block metadata and INT4 codes of {n_chunks} chunks x {layers} layers"))
        parts.append(MemoryPart("asynctls_cache", where, RESIDENT, _on(where, sizes["cache"]), sel_keys,
                                f"resident K and V blocks of {s} sequences x {hkv} heads x {layers} layers"))
        parts.append(MemoryPart("asynctls_step", where, "decode", _on(where, sizes["step"]),
                                ("kv_cache.cpu_capacity_tokens", "selection.blocks", "kv_cache.max_sequences"),
                                f"block scores, token scores and gathers of {s * hkv} tasks"))
    evosparse = cfg.selection.name == "evosparse"
    if evosparse:
        from hybrid_runtime.executors.evosparse import memory_bytes as evosparse_bytes

        state, step, how = evosparse_bytes(cfg, geometry)
        where = GPU if cuda and sc.placement == "gpu_only" else HOST
        evo_keys = ("kv_cache.cpu_capacity_tokens", "kv_cache.max_sequences", "evosparse.block_size", "geometry.layers")
        parts.append(MemoryPart("evosparse_state", where, RESIDENT, _on(where, state), evo_keys, how))
        parts.append(MemoryPart("evosparse_step", where, "decode", _on(where, step), evo_keys,
                                "one layer step's gathered keys, values, metadata, scores and probabilities"))
    # NOSA, AsyncTLS and EvoSparse under gpu_only run the GPU lane with their own executor (counted above).
    own_lane = nosa or asynctls or (evosparse and sc.placement == "gpu_only")
    if lane_on_gpu and not own_lane:
        device, pinned, how = gpu_lane_bytes(kv, geometry, selects_cpu_tasks_on_gpu(cfg, cuda))
        lane_keys = ("kv_cache.cpu_capacity_tokens", "kv_cache.max_sequences")
        parts.append(MemoryPart("gpu_lane_scratch", GPU, RESIDENT, device, lane_keys, how))
        parts.append(MemoryPart("gpu_lane_pinned", HOST_PINNED, RESIDENT, pinned, ("kv_cache.max_sequences",),
                                "union-size ring, step-table staging, link probe"))
        if uses_gpu_metadata(cfg, cuda):
            parts.append(MemoryPart(
                "gpu_metadata", GPU, RESIDENT, layers * _on(GPU, gpu_metadata_bytes(kv, geometry, 1)),
                ("kv_cache.cpu_capacity_tokens", "kv_cache.gpu_metadata", "kv_cache.max_sequences", "geometry.layers"),
                f"{layers} layers x {n_chunks} chunks x {layout.META_ROWS} metadata rows x {d} x {es} B"))
        if selects_cpu_tasks_on_gpu(cfg, cuda):
            from hybrid_runtime.gpu_picks import picks_tensor_bytes

            tasks = max(1, kv.max_sequences * geometry.kv_heads)
            rows = sum(_on(HOST_PINNED, n) for n in picks_tensor_bytes(tasks, max_task_blocks(kv)))
            parts.append(MemoryPart(
                "gpu_selection_rows", HOST_PINNED, RESIDENT, rows,
                ("kv_cache.cpu_capacity_tokens", "kv_cache.max_sequences", "scheduler.cpu_task_selection"),
                f"the GPU lane's block selection for {tasks} CPU tasks of up to {max_task_blocks(kv)} blocks"))
    if window_on_gpu:
        parts.append(MemoryPart("window_workspace", GPU, RESIDENT, window_workspace_bytes(kv, geometry),
                                ("kv_cache.max_sequences",), f"split-K partials of {s} sequences x {hq} heads"))

    # The largest prefill the store admits: one prompt whose CPU segment fills the capacity, on
    # the runtime's device, in another dtype, appended to a partly filled chunk.
    longest = kv.sink + kv.local + kv.cpu_capacity_tokens
    staging = _prefill_temporaries(kv, geometry, longest, converts=True, extends=True)
    staging_where = GPU if window_on_gpu else HOST
    parts.append(MemoryPart(
        "prefill_staging", staging_where, "prefill", _on(staging_where, staging),
        ("kv_cache.cpu_capacity_tokens", "kv_cache.dtype"),
        f"cast, chunk images and block metadata of one {longest}-token prompt"))
    if lanes and sc.gpu_lane(cuda) and not cuda and not own_lane:
        blk = min(kv.block_sizes)
        parts.append(MemoryPart(
            "torch_lane_task", HOST, "decode", _torch_lane_task_bytes(kv.cpu_capacity_tokens, blk, 1.0, geometry, es),
            ("kv_cache.cpu_capacity_tokens", "scheduler.gpu_worker"),
            f"one task of {kv.cpu_capacity_tokens} tokens at block {blk}, budget 1.0 (torch GPU lane without CUDA)"))
    return MemoryPlan(tuple(parts))


def _cpu_tokens_after(kv: KVCacheConfig, context: int, steps: int) -> int:
    """CPU-resident tokens of one sequence after a prompt of `context` and `steps` decode tokens:
    the window's recent part spills `generated_cap` tokens each time it holds `local + generated_cap`."""
    window, cpu = _prompt_split(kv, context)
    recent = window - min(kv.sink, context)
    first = kv.local + kv.generated_cap - recent  # the step whose append spills first
    spills = 0 if steps <= first else 1 + (steps - 1 - first) // kv.generated_cap
    return cpu + spills * kv.generated_cap


def estimate_synthetic_run(cfg: Config, *, cuda: bool | None = None) -> MemoryPlan:
    """The runtime of `hybrid-runtime run` plus its workload (`experiments.synthetic.run_synthetic`):
    random prompts built and prefilled one (layer, sequence) at a time, decode, and the final check
    against dense attention over each sequence's whole KV."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    wl, kv = cfg.workload, cfg.kv_cache
    geometry = cfg.geometry
    plan = estimate_runtime(cfg, geometry, cuda=cuda, recorded_steps=wl.decode_steps * geometry.layers)
    layers, hkv, d, g = geometry.layers, geometry.kv_heads, geometry.head_dim, geometry.group_size
    es = _ESIZE[kv.dtype]
    window_on_gpu = kv.device == "cuda" or (kv.device == "auto" and cuda)
    ctx = wl.context
    prompt = ctx * hkv * d * _F32  # one of k or v of one (layer, sequence), fp32
    keys = ("workload.context",)
    parts = [p for p in plan.parts if p.phase == RESIDENT]

    # The prompt builder: centres, their repeat, noise, scaled noise, sum; the previous (layer,
    # sequence)'s k and v are still bound while the next are built.
    segs = -(-ctx // 64)
    previous = 2 * prompt if layers * wl.batch > 1 else 0
    build = segs * hkv * d * _F32 + segs * 64 * hkv * d * _F32 + 3 * prompt + previous
    parts.append(MemoryPart("workload_prompt_build", HOST, "prompt generation", build, keys,
                            f"random k, v of {ctx} tokens x {hkv} heads x {d}, fp32, and their temporaries"))

    # Prefill: the prompt (and its device copy on CUDA) plus the store's temporaries there.
    staging = _prefill_temporaries(kv, geometry, ctx, converts=kv.dtype != "fp32", extends=False)
    parts.append(MemoryPart("workload_prompt", HOST, "prefill", 2 * prompt, keys, f"k, v of {ctx} tokens, fp32"))
    staging_where = GPU if window_on_gpu else HOST
    if window_on_gpu:
        parts.append(MemoryPart("workload_prompt_gpu", GPU, "prefill", 2 * _on(GPU, prompt), keys,
                                f"device copies of k, v of {ctx} tokens, fp32"))
    parts.append(MemoryPart("prefill_staging", staging_where, "prefill", _on(staging_where, staging),
                            ("workload.context", "kv_cache.dtype"),
                            f"cast, chunk images and block metadata of one {ctx}-token prompt"))

    cpu_len = min(_cpu_tokens_after(kv, ctx, wl.decode_steps), kv.cpu_capacity_tokens)
    # NOSA's, AsyncTLS's and EvoSparse's steps are parts of the runtime's plan; SparDA starts no lane.
    if starts_lanes(cfg.selection) and cfg.scheduler.gpu_lane(cuda) and not cuda and \
            cfg.selection.name not in ("nosa", "asynctls", "evosparse"):
        sel = cfg.selection
        # A predicted plan may give any head budget 1.0 at its smallest block size.
        budget = {"fixed": sel.budget, "full": 1.0, "streaming": 0.0, "predicted": 1.0}[sel.name]
        blk = min(sel.block_sizes) if sel.name == "predicted" else sel.block_size
        parts.append(MemoryPart(
            "torch_lane_task", HOST, "decode",
            _torch_lane_task_bytes(cpu_len, blk, budget, geometry, es),
            ("workload.context", "selection.budget", "selection.block_size"),
            f"one task of {cpu_len} tokens at block {blk}, budget {budget:g}"))

    # The final check, per (layer, sequence): `KVStore.full_kv` gathers whole chunks (all their
    # rows), slices keys and values and concatenates; dense attention then makes fp32 copies
    # (einsum permutes them once more) while the previous sequence's KV is still bound.
    length = ctx + wl.decode_steps
    chunks = -(-cpu_len // layout.CHUNK_TOKENS)
    seq_kv = length * hkv * d * es
    gather = hkv * chunks * (layout.CHUNK_ROWS + 2 * layout.CHUNK_TOKENS) * d * es + 2 * seq_kv
    f32_copy = length * hkv * d * _F32 * (2 if es != _F32 else 1)
    dense = f32_copy + 3 * hkv * g * length * _F32
    prior = 2 * seq_kv if layers * wl.batch > 1 else 0
    parts.append(MemoryPart("dense_check", HOST, "check", prior + max(gather, dense),
                            ("workload.context", "workload.decode_steps"),
                            f"whole KV of one {length}-token sequence, gathered and as fp32"))
    return MemoryPlan(tuple(parts))


def admit(plan: MemoryPlan, kv: KVCacheConfig, machine: MachineMemory | None = None) -> MachineMemory:
    """Raise `AdmissionError` unless the plan's host peak fits `kv_cache.max_host_memory_fraction`
    of the host memory available now, and its GPU peak the free GPU memory. Returns what was read."""
    machine = MachineMemory.now() if machine is None else machine
    host_peak, phase = plan.peak((HOST, HOST_PINNED))
    allowed = int(machine.host_available * kv.max_host_memory_fraction)
    if host_peak > allowed:
        raise AdmissionError(
            f"this run needs an estimated {_gib(host_peak)} of host memory at its peak"
            f"{f' (during {phase})' if phase else ''}"
            f"{f', {_gib(plan.pinned_bytes)} of it pinned' if plan.pinned_bytes else ''}, but {_gib(allowed)} is "
            f"allowed: kv_cache.max_host_memory_fraction={kv.max_host_memory_fraction:g} of the "
            f"{_gib(machine.host_available)} available (of {_gib(machine.host_total)} total); nothing was allocated.\n"
            f"{plan.table((HOST, HOST_PINNED))}\n{_advice(plan, (HOST, HOST_PINNED))}",
            plan, "host", allowed)
    gpu_peak, phase = plan.peak((GPU,))
    if gpu_peak and machine.gpu_free is not None and gpu_peak > machine.gpu_free:
        raise AdmissionError(
            f"this run needs an estimated {_gib(gpu_peak)} of GPU memory at its peak"
            f"{f' (during {phase})' if phase else ''}, but {_gib(machine.gpu_free)} is free "
            f"(of {_gib(machine.gpu_total or 0)} total); nothing was allocated.\n"
            f"{plan.table((GPU,))}\n{_advice(plan, (GPU,))}",
            plan, "gpu", machine.gpu_free)
    return machine


def _advice(plan: MemoryPlan, wheres: tuple[str, ...]) -> str:
    """The keys to lower, each with the bytes of the parts in the peak that grow with it most."""
    _, phase = plan.peak(wheres)
    weight: dict[str, int] = {}
    for p in plan.parts:
        if p.where in wheres and p.phase in (RESIDENT, phase) and p.keys:
            weight[p.keys[0]] = weight.get(p.keys[0], 0) + p.nbytes
    ranked = sorted(weight, key=weight.__getitem__, reverse=True)
    return ("To fit, lower " + ", ".join(f"{key} ({_gib(weight[key])})" for key in ranked[:4])
            + "; or free memory on this machine.")


__all__ = [
    "AdmissionError",
    "GPU",
    "HOST",
    "HOST_PINNED",
    "MachineMemory",
    "MemoryPart",
    "MemoryPlan",
    "RESIDENT",
    "admit",
    "estimate_runtime",
    "estimate_synthetic_run",
    "gpu_lane_bytes",
    "gpu_lane_sizes",
    "max_task_blocks",
    "native_job_bytes",
    "pinned_footprint",
    "window_workspace_bytes",
    "workspace_bytes",
]
