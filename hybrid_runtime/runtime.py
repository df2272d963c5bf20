"""The public API a generation loop calls: prefill a prompt's KV, decode one layer at a time.

    with HybridRuntime(cfg) as rt:
        rt.prefill(seq_id, layer, k, v)            # [L, Hkv, D] per layer of the prompt
        out = rt.decode(layer, seq_ids, q, k, v)   # q [B, Hq, D], k/v [B, Hkv, D] -> [B, Hq, D]
        rt.release(seq_id)

One `decode` call (docs/architecture.md, "one decode step"): append k, v to the GPU window; dense attention
over the window (Triton on CUDA, torch otherwise); build the step's tasks from the head plan;
the scheduler's workers run them (CPU lane writes pinned host buffers, GPU lane writes device
buffers); one small host-to-device copy brings the CPU results over; log-sum-exp merge; return
in q's dtype and device.

Without CUDA everything runs on the host: the window attention and the merge use the torch
reference, and there is no GPU lane unless `scheduler.gpu_worker` is set to true (the default
"auto" has one only where CUDA is); then the torch reference executor serves it on the CPU, so
every placement keeps its meaning and its tests.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from cpu_kernels.window_attention import merge_into as merge_host
from cpu_kernels.window_attention import window_attention as window_attention_host
from gpu_kernels.launch import CachedLaunch
from gpu_kernels.step_inputs import N_COUNTS, StepInputsPlan, count_columns
from gpu_kernels.streams import current_stream, use_stream
from hybrid_runtime import native_pool
from hybrid_runtime.config import (Config, ConfigError, GeometryConfig, selects_cpu_tasks_on_gpu, starts_lanes,
                                   uses_gpu_metadata)
from hybrid_runtime.executors.cpu import CpuExecutor
from hybrid_runtime.executors.torch_ref import TorchRefExecutor
from hybrid_runtime.gc_control import freeze_collector, thaw_collector
from hybrid_runtime.head_plans import ConfigHeadPlanner, HeadPlan
from hybrid_runtime.input_check import DeferredInputCheck, checked_dtypes, defers, finite_check_mode
from hybrid_runtime.input_check import check_finite as _check_finite
from hybrid_runtime.input_check import check_finite_host as _check_finite_host
from hybrid_runtime.input_check import nonfinite_error
from hybrid_runtime.kvcache import KVStore, numpy_view
from hybrid_runtime.memory_plan import MachineMemory, MemoryPlan, admit, estimate_runtime
from hybrid_runtime.pinning import confine_current_thread
from hybrid_runtime.profiling.timeline import CudaClock, Timeline
from hybrid_runtime.scheduler import Scheduler
from hybrid_runtime.step_job import RuntimeBrokenError, StepJob
from hybrid_runtime.task_building import TaskList, build_tasks, native_table, queue_order
from hybrid_runtime.tasks import Step
from hybrid_runtime.tensor_parallel import TensorParallelShard
from hybrid_runtime.warmup import BackgroundWarmUp, host_step_kernel_jobs, step_kernel_jobs

log = logging.getLogger(__name__)

# `planner(layer, seq_ids, store)`, or `planner(layer, seq_ids, store, q)` for a planner whose
# `uses_queries` is true. Optional hooks a planner may define: `reads_window` (true: the step's k, v
# are in the window before it is called), `prefill(seq_id, layer, k, v, q_last, extend)`,
# `release(seq_id)` and `absorb_spill(slot, layer, k, v)` (the store's spill listener).
HeadPlanner = Callable[..., HeadPlan]


def window_attention_torch(
    q: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of q `[B,Hq,D]` (fp32, pre-scaled) over rows `[:lengths[b]]` of window slot `slots[b]`.

    The reference path for hosts without CUDA; vectorised over the batch (no per-token loop).
    """
    b, hq, d = q.shape
    hkv = k_win.shape[1]
    g = hq // hkv
    w = max(1, min(int(max_len), k_win.shape[2]))
    k = k_win[slots.long(), :, :w].float()  # [B, Hkv, w, D]
    v = v_win[slots.long(), :, :w].float()
    s = torch.einsum("bhgd,bhwd->bhgw", q.view(b, hkv, g, d), k)
    invalid = torch.arange(w, device=q.device)[None, :] >= lengths.to(q.device).long()[:, None]  # [B, w]
    s = s.masked_fill(invalid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G]; -inf for an empty window
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])
    out = torch.einsum("bhgw,bhwd->bhgd", p, v)
    return out.reshape(b, hq, d), lse.reshape(b, hq)


def _stream_op_usable(missing: str | None, explicit: bool, refusal: str, fallback: str) -> bool:
    """Whether a driver stream memory operation a scheduler setting needs can run: `missing` (None,
    or why not; `gpu_kernels.host_count_wait`) raises ConfigError(`refusal`) where the setting asked
    for it by name, and is logged (`fallback`) where its "auto" does without. Each message has one
    `{}` for the reason."""
    if missing is None:
        return True
    if explicit:
        raise ConfigError(refusal.format(missing))
    log.info(fallback.format(missing))
    return False


def _as_int(value: Any, what: str) -> int:
    """`value` as a Python int: ints and integer scalars (numpy, 0-d tensors); no bools, floats, strings."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} is {value!r} ({type(value).__name__}); expected an integer")


def _input_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _check_tensor(name: str, x: Any, allowed: tuple[str, ...] | None = None) -> None:
    """A floating-point torch tensor on a device the runtime can read (`allowed`, default
    `_input_devices()`; the shape is checked by the caller)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} is a {type(x).__name__}; expected a torch.Tensor")
    if allowed is None:
        allowed = _input_devices()
    if x.device.type not in allowed:
        where = " or ".join(a.upper() for a in allowed)
        raise ValueError(f"{name} is on device {x.device}; expected a tensor on {where}")
    if not x.is_floating_point():
        raise ValueError(f"{name} has dtype {x.dtype}; expected a floating-point tensor (float32, bfloat16, float16, float64)")


@dataclasses.dataclass(frozen=True)
class _StepViews:
    """Views of the runtime's step buffers for one batch size: q for the CPU workers and their
    results (pinned host; `cpu_arrays` as numpy), the GPU lane's q / out / lse, and on CUDA the
    scaled queries, q's UVA view the step-inputs kernel writes, and the CPU lane's results as the
    merge reads them (through UVA, or after the trailing step's copy to the device)."""

    cpu_q: torch.Tensor
    cpu_out: torch.Tensor
    cpu_lse: torch.Tensor
    cpu_arrays: tuple
    gq: torch.Tensor
    gout: torch.Tensor
    glse: torch.Tensor
    qs: torch.Tensor | None
    q_host_uva: torch.Tensor | None
    res_uva_parts: tuple | None
    res_host_flat: torch.Tensor
    res_dev_flat: torch.Tensor | None
    res_dev_parts: tuple | None


class HybridRuntime:
    """Embeddable decode-time sparse attention over a CPU-resident KV cache.

    `geometry` overrides `cfg.geometry` (e.g. fewer layers for a benchmark). `cpu_executor` and
    `gpu_executor` (an executor, or a factory `store -> executor`) and `head_planner` replace the
    defaults (tests inject failing executors). `selection.name: predicted` makes the head planner a
    `PredictedHeadPlanner` (features, predictor and selector per step and layer).
    `cpu_kernel` replaces the numba task kernel the native CPU workers call (same signature as
    `cpu_kernels.sparse_attention.run_task`; tests inject a failing one). Workers start here and
    live until `close()`; the constructor does not wait for their start-up (pinning, workspaces,
    compiling or loading numba's worker loop), which overlaps the prefill: the first decode step
    with CPU tasks waits for it (`stats()["worker_start_wait_s"]`), and a worker's start error is
    raised there, after which the runtime is closed. Nor does it wait for the decode step's kernels
    to compile (`warmup.py`): the first `decode` waits for them (`stats()["warmup_wait_s"]`) and
    raises a failed compile there (`KernelWarmUpError`, naming the kernel).

    Before anything is allocated, the run's memory plan is admitted (`memory_plan.admit`): an
    `AdmissionError` with the figures when its peak does not fit this machine. `memory_plan`
    defaults to `estimate_runtime(cfg, geometry)`, whose largest prefill is one prompt filling
    the capacity; a caller that knows its workload passes its own (the synthetic experiment does).

    `tensor_parallel`: this process is one rank of a model whose heads are split over ranks
    (`tensor_parallel.py`). `geometry` (or `cfg.geometry`) is then the whole model's; the runtime
    serves the rank's heads (`self.geometry`, `decode`'s shapes), reads `selection.streaming_heads`
    in the model's head numbers, plans its workers over the rank's cores (`pinning.rank_cores`),
    confines the constructing thread -- the GPU lane's launcher -- to them until `close()`, and
    admits its memory plan against its share of the host's available memory.
    """

    def __init__(
        self,
        cfg: Config,
        geometry: GeometryConfig | None = None,
        *,
        cpu_executor: Any | None = None,
        gpu_executor: Any | None = None,
        head_planner: HeadPlanner | None = None,
        cpu_kernel: Any | None = None,
        memory_plan: MemoryPlan | None = None,
        tensor_parallel: TensorParallelShard | None = None,
    ):
        geometry = cfg.geometry if geometry is None else geometry
        for layer, heads in cfg.selection.streaming_heads.items():
            if not 0 <= layer < geometry.layers or any(not 0 <= h < geometry.q_heads for h in heads):
                raise ConfigError(
                    f"selection.streaming_heads.{layer}: layer or heads {list(heads)} out of range for geometry "
                    f"{geometry.name!r} ({geometry.layers} layers, {geometry.q_heads} q heads)"
                )
        # When a NaN/inf input is reported (input_check.py); checked before anything is built.
        self.finite_check = finite_check_mode(cfg.scheduler)
        self.model_geometry = geometry
        self.tensor_parallel = tensor_parallel
        share = machine = None
        if tensor_parallel is not None:
            local = tensor_parallel.local_geometry(geometry)  # raises when the heads do not divide
            cfg = dataclasses.replace(cfg, geometry=local,
                                      selection=tensor_parallel.local_selection(cfg.selection, geometry))
            geometry = local
            share = tensor_parallel.core_share()
            # The host's ranks start together and commit their arenas later: each holds its plan
            # to its share of what is available now.
            now = MachineMemory.now()
            machine = dataclasses.replace(now, host_available=now.host_available // tensor_parallel.local_world_size)
        admit(estimate_runtime(cfg, geometry) if memory_plan is None else memory_plan, cfg.kv_cache, machine)
        self.cfg = cfg
        self.geometry = geometry
        self.core_share = share
        self._closed = False
        self.store = KVStore(cfg.kv_cache, geometry)
        store = self.store
        self.device = store.device  # CUDA with its index (`kvcache._window_device`)
        self.cuda = self.device.type == "cuda"
        self.scale = 1.0 / math.sqrt(geometry.head_dim)
        # "auto" resolved for this machine: what the scheduler, stats and traces see.
        rank_cores = None
        if share is not None:
            # Too few cores for one each: the ranks share them all, one worker each, none pinned.
            per_rank = max(1, len(share.cores) // tensor_parallel.local_world_size)
            rank_cores = share.cores if share.exclusive else share.cores[:per_rank]
        sc = dataclasses.replace(cfg.scheduler, gpu_worker=cfg.scheduler.gpu_lane(torch.cuda.is_available()),
                                 cpu_workers=cfg.scheduler.cpu_worker_count(None if rank_cores is None else len(rank_cores)),
                                 pin_cores=cfg.scheduler.pin_cores and (share is None or share.exclusive))
        lanes = starts_lanes(cfg.selection)
        if not lanes:
            # The SparDA executor reads the CPU segment itself and makes no tasks: no lane to start.
            sc = dataclasses.replace(sc, cpu_workers=0, gpu_worker=False)
        # An executor argument may also be a factory `store -> executor` (executors need the store).
        if cpu_executor is not None and (isinstance(cpu_executor, type) or not hasattr(cpu_executor, "run")):
            cpu_executor = cpu_executor(store)
        if gpu_executor is not None and (isinstance(gpu_executor, type) or not hasattr(gpu_executor, "run")):
            gpu_executor = gpu_executor(store)
        if cfg.selection.name == "evosparse":
            from hybrid_runtime.executors.evosparse import EvoSparseExecutor

            # One lane runs it (config allows cpu_only or gpu_only): its heat lives where that lane computes.
            if cfg.scheduler.placement == "gpu_only" and gpu_executor is None and sc.gpu_worker:
                gpu_executor = EvoSparseExecutor(store, cfg.evosparse, geometry, lane="gpu")
            elif cfg.scheduler.placement == "cpu_only" and cpu_executor is None and sc.cpu_workers > 0:
                cpu_executor = EvoSparseExecutor(store, cfg.evosparse, geometry, lane="cpu")
        if cpu_executor is None and sc.cpu_workers > 0:
            cpu_executor = CpuExecutor(store)
        if cfg.selection.name == "nosa" and not sc.gpu_worker:
            raise ConfigError("selection.name 'nosa' needs a GPU lane (its executor keeps the block caches); allowed: "
                              "scheduler.gpu_worker true, or 'auto' on a machine with CUDA")
        if gpu_executor is None and sc.gpu_worker and cfg.selection.name == "asynctls":
            from hybrid_runtime.executors.asynctls import asynctls_executor

            gpu_executor = asynctls_executor(store, cfg.selection)
        warm_jobs: list = []  # kernels compiled after the constructor returns, before the first decode step
        if gpu_executor is None and sc.gpu_worker:
            if cfg.selection.name == "nosa":
                from hybrid_runtime.executors.nosa import NosaExecutor

                gpu_executor = NosaExecutor(store, cfg.nosa)
                gpu_executor.warm_up()  # its Triton kernels compile now, not in the first decode step
            elif torch.cuda.is_available():
                from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor

                if uses_gpu_metadata(cfg, True):
                    store.enable_gpu_metadata()  # before any prefill: the copy is written with the chunks
                gpu_executor = GpuUvaExecutor(store, stream=torch.cuda.Stream(), claim_launch=sc.claim_launch)
                # The link is measured now (the scheduler reads it); the claim kernels compile on
                # the background warm-up thread, before the first decode step (warmup.py).
                gpu_executor.measure_link()
                warm_jobs.append(("GPU lane claim kernels (score_select, sparse_attention_claim)",
                                  gpu_executor.compile_kernels))
                store.arena_cuda(0)  # its view made here: the warm-up thread changes nothing in the store
            else:
                log.info("no CUDA device: the GPU lane (scheduler.gpu_worker: true) runs the torch reference "
                         "executor on the CPU")
                gpu_executor = TorchRefExecutor(store, device="cpu")
        self.cpu_executor = cpu_executor if sc.cpu_workers > 0 else None
        self.gpu_executor = gpu_executor if sc.gpu_worker else None
        # The GPU lane's buffers live where its executor computes.
        lane_cuda = (
            self.gpu_executor is not None and torch.cuda.is_available() and getattr(self.gpu_executor, "device", "") == "gpu"
        )
        self.gpu_lane_device = torch.device("cuda") if lane_cuda else torch.device("cpu")
        if head_planner is None and cfg.selection.name == "predicted":
            from hybrid_runtime.predicted_plans import PredictedHeadPlanner

            # Its kernels compile on the background warm-up thread while the caller prefills
            # (warmup.py), not here: 4.7-13 s at 8B geometry. Its CUDA graphs are captured on the
            # caller's thread once the first decode step (or `await_warm_up`) has waited for the
            # warm-up: a capture holds torch's default CUDA generator, which the caller may draw
            # from meanwhile (`PredictedHeadPlanner.warm_up`).
            head_planner = PredictedHeadPlanner(cfg.selection, geometry, store, defer_warm_up=True)
            warm_jobs.append(("predicted head planner (features and predictor kernels)",
                              lambda: head_planner.warm_up(capture=False)))
        self.planner: HeadPlanner = head_planner or ConfigHeadPlanner(cfg.selection, geometry)
        # selection.name sparda: the CPU segment's blocks are chosen one layer ahead and prefetched
        # into a block cache on the window's device (executors/sparda.py); no tasks, no planner.
        self.sparda = None
        if cfg.selection.name == "sparda":
            from hybrid_runtime.executors.sparda import SpardaExecutor

            self.sparda = SpardaExecutor(store, cfg.sparda, cfg.kv_cache)
        if getattr(self.planner, "absorb_spill", None) is not None:
            store.spill_listener = self.planner.absorb_spill
        if getattr(self.gpu_executor, "absorb_chunks", None) is not None:
            store.chunk_listener = self.gpu_executor.absorb_chunks  # per-block state from the K/V the store writes
        self._task_cache: dict = {}

        # Step buffers, allocated once for the largest batch (the hot path allocates no pinned
        # memory). The CPU lane's results are one flat buffer -- out then lse, packed for the
        # step's batch -- so they reach the GPU in a single copy.
        s, hq, d = cfg.kv_cache.max_sequences, geometry.q_heads, geometry.head_dim
        pin = torch.cuda.is_available()
        self._q_host = torch.zeros(s * hq * d, dtype=torch.float32, pin_memory=pin)
        self._res_host = torch.zeros(s * hq * (d + 1), dtype=torch.float32, pin_memory=pin)
        # Raw host copies of a step's k and v (any float dtype, up to 8 bytes an element) for the
        # NaN/inf check that rides on q's copy.
        self._kv_host = torch.zeros(2 * s * geometry.kv_heads * d * 8 + 8, dtype=torch.uint8, pin_memory=pin)
        # ... and of a step's SparDA lookahead queries (up to one per query head).
        self._look_host = torch.zeros(s * hq * d * 8 if self.sparda is not None else 0, dtype=torch.uint8, pin_memory=pin)
        dev = self.gpu_lane_device
        self._gq = torch.zeros((s, hq, d), dtype=torch.float32, device=dev)
        self._gout = torch.zeros((s, hq, d), dtype=torch.float32, device=dev)
        self._glse = torch.full((s, hq), float("-inf"), dtype=torch.float32, device=dev)
        self._step_views: dict[int, _StepViews] = {}  # batch size -> views of the buffers above (`_make_step_views`)

        self._window_graphs = None
        if self.cuda:
            from gpu_kernels.lse_merge import OUT_DTYPES as merge_out_dtypes
            from gpu_kernels.lse_merge import merge_attention as merge_gpu
            from gpu_kernels.uva import uva_view
            from gpu_kernels.window_attention import window_attention as window_gpu

            self._merge_gpu, self._window_gpu, self._merge_out_dtypes = merge_gpu, window_gpu, merge_out_dtypes
            self._side_stream = torch.cuda.Stream(priority=-1)  # high priority (-1); default streams are 0
            self._win_host = torch.zeros((self.WINDOW_RING, 2 * s), dtype=torch.int32, pin_memory=True)
            # The window kernel reads a ring row through UVA: no copy op on the decode path.
            self._win_dev = uva_view(self._win_host, self.device.index)
            self._win_used = [torch.cuda.Event() for _ in range(self.WINDOW_RING)]
            # The CPU lane's results as the merge kernel reads them (through UVA, no copy op).
            self._res_uva = uva_view(self._res_host, self.device.index)
            # What the step-inputs kernel writes through: q for the CPU workers and the NaN/inf
            # counts of q, k, v, both pinned (gpu_kernels/step_inputs.py).
            self._q_host_uva = uva_view(self._q_host, self.device.index)
            counts = torch.zeros((N_COUNTS, count_columns(s * hq)), dtype=torch.int32, pin_memory=True)
            self._input_counts, self._input_counts_np = uva_view(counts, self.device.index), counts.numpy()
            self._win_turn = 0
            # The step's scaled queries: a buffer that stays put, which the window graphs read.
            self._qs_buf = torch.empty((s, hq, d), dtype=torch.float32, device=self.device)
            self._step_inputs = StepInputsPlan()  # on every step's path: its launch planned once per variant
            if cfg.kv_cache.window_graphs:
                from hybrid_runtime.window_graphs import WindowGraphs

                # A few batch sizes per layer; the least recently used graph goes first.
                self._window_graphs = WindowGraphs(store, hq, self.device, max_graphs=4 * store.layers)
            warm_jobs = step_kernel_jobs(store, geometry, self.device, window_gpu, merge_gpu,
                                         lane=self.gpu_executor is not None and self.gpu_lane_device.type == "cuda") + warm_jobs
        else:
            # The window part on the host (cpu_kernels.window_attention): its result buffers, the
            # kernel's score scratch and numpy views of the windows, made once.
            w = store.window(0)[0].shape[2]
            self._wout = torch.zeros((s, hq, d), dtype=torch.float32)
            self._wlse = torch.zeros((s, hq), dtype=torch.float32)
            self._wscores = np.zeros((geometry.group_size, max(1, w)), dtype=np.float32)
            self._win_numpy = [tuple(numpy_view(t) for t in store.window(layer)) for layer in range(store.layers)]
            # Both kernels compile on the background warm-up thread, before the first decode step.
            warm_jobs += host_step_kernel_jobs(self._q_host[: hq * d].view(1, hq, d).numpy(), *self._win_numpy[0],
                                               self._wout[:1].numpy(), self._wlse[:1].numpy(), self._wscores,
                                               window_attention_host, merge_host)
        # Deferred input checks (`scheduler.finite_check`): their counts land in a small pinned ring,
        # made whatever the mode (1 KiB), so that `finite_check` may be switched between calls.
        # On CUDA the step-inputs kernel counts into a ring of its own too: a deferred check of a step
        # that launches it costs no launch of its own (`_decode`'s `counted_in_inputs`).
        self._input_check = DeferredInputCheck(self.device, fused_columns=count_columns(s * hq) if self.cuda else 0)
        if self.cuda and self.finite_check != "sync":
            # Another dtype than these compiles its variant at its first step.
            variants = checked_dtypes(store.dtype, lookahead=cfg.selection.name == "sparda")
            warm_jobs.append(("count_nonfinite (the deferred input check)",
                              lambda: self._input_check.warm_up(variants, geometry.head_dim)))
        native = {
            "arenas": tuple(store.arena_numpy(layer) for layer in range(store.layers)),
            "q_flat": self._q_host.numpy(),
            "res_flat": self._res_host.numpy(),
            "hq": hq,
            "d": d,
            "g": geometry.group_size,
            "max_tasks": s * geometry.kv_heads,
            "max_chunks": store.n_chunks,
            "kernel": cpu_kernel,
        }
        # The GPU lane selects the CPU lane's blocks on fluxion steps (`scheduler.cpu_task_selection`,
        # gpu_picks.py): where the store keeps the metadata on the GPU, the lane is the UVA executor
        # and the CPU workers run the stock kernel.
        self._picks = None
        picks_possible = (cpu_kernel is None and self.cpu_executor is not None and hasattr(self.gpu_executor, "pick")
                          and selects_cpu_tasks_on_gpu(cfg, lane_cuda))
        if sc.cpu_task_selection == "gpu" and not picks_possible:
            raise ConfigError(
                "scheduler.cpu_task_selection: 'gpu' needs a GPU lane whose executor selects blocks (the UVA executor "
                "on CUDA, selection.name one of fixed, full, streaming, predicted), CPU workers and the stock CPU "
                "kernel; allowed here: 'auto' or 'host'")
        if picks_possible:
            from hybrid_runtime.gpu_picks import GpuPicks

            self._picks = GpuPicks(s * geometry.kv_heads, store.max_task_blocks, self.gpu_lane_device,
                                   meta_block_bytes=2 * d * store.arena(0).element_size())
            native["picks"] = self._picks.arrays
            self.gpu_executor.pick_rows = self._picks.views  # its kernel variant compiles at warm-up
        # The native workers' control words in pinned memory: with `scheduler.cpu_lane_trails` the
        # merge's stream waits on their done count (a driver stream wait on host memory).
        self._done_address = None
        if self.cuda:
            self._ctrl_host = torch.zeros(native_pool.CTRL_SIZE, dtype=torch.int64, pin_memory=True)
            native["ctrl"] = self._ctrl_host.numpy()
            if sc.trails(cuda=True):
                from gpu_kernels.host_count_wait import device_address, driver_wait_available, wait_for_count

                if _stream_op_usable(
                        driver_wait_available(), sc.cpu_lane_trails is True,
                        "scheduler.cpu_lane_trails: true needs a driver stream wait on host memory, but {}; allowed: "
                        "'auto' (waits for the CPU lane where it is missing) or false",
                        "CPU lanes wait for their steps (scheduler.cpu_lane_trails 'auto'): {}"):
                    self._done_address = device_address(self._ctrl_host[native_pool.C_DONE :])
                self._wait_for_count = wait_for_count
                # The trailing CPU part reaches the merge by one copy queued after the wait.
                self._res_dev = torch.empty(self._res_host.shape, dtype=self._res_host.dtype, device=self.device)
        # CPU lanes that start on the device's word (`scheduler.cpu_lane_start`) need the driver's
        # stream write to host memory: checked before anything starts.
        start_on_device = self.cuda and sc.starts_on_device(cuda=True)
        if start_on_device:
            from gpu_kernels.host_count_wait import driver_write_available

            start_on_device = _stream_op_usable(
                driver_write_available(), sc.cpu_lane_start == "device",
                "scheduler.cpu_lane_start: 'device' needs a driver stream write to host memory, but {}; allowed: "
                "'auto' (starts on the host where it is missing) or 'host'",
                "CPU lanes start on the host (scheduler.cpu_lane_start 'auto'): {}")
        # A rank's launcher (this thread) and the threads it starts later (the store's committer,
        # whose page faults place the arenas) stay on the rank's cores, and so on its NUMA node.
        self._confined = None
        if share is not None and share.exclusive and sc.pin_cores:
            self._confined = (threading.get_ident(), confine_current_thread(share.cores))
        try:
            self.scheduler = Scheduler(sc, self.cpu_executor, self.gpu_executor, gpu_is_cuda=lane_cuda, native=native,
                                       cores=rank_cores, lanes=lanes, picks=self._picks)
        except BaseException:
            self._release_thread()
            raise
        if share is not None:
            self.scheduler.cores.note = f"{tensor_parallel.describe()}: {share.note}; {self.scheduler.cores.note}"
        # Steps return before their CPU tasks end (the merge waits for them on the device): only
        # on CUDA, where the native workers' done count is in pinned memory. The last layer waits:
        # the model's head needs its output anyway, and a CPU task's error then surfaces within
        # the model step it happened in.
        self._cpu_trails = bool(self._done_address is not None and self.scheduler.native is not None)
        # Steps without CPU tasks return once their GPU claims are launched, where the executor
        # retires claims later (`GpuLane.trails`) and the merge can wait for the last one's end
        # event on the device (a CUDA lane); the last layer waits, as for trailing CPU lanes.
        # Benchmarks switch it off to compare (`benchmarks/asynctls.py` mode lagged_waits).
        self.gpu_only_trails = bool(self.cuda and lane_cuda)
        # GPU-only steps whose executor runs a whole queue as one claim and may retire it later (the
        # AsyncTLS executor) skip the lanes' loop: `_decode_express` launches the claim itself
        # (express_claims.py). Only where nothing of the general path applies -- no spill, no
        # planner that reads the step, no SparDA, no profiled step, a deferred input check counted by
        # the step-inputs kernel, the window from its graphs; `_express_static` holds the part fixed
        # at construction. Benchmarks switch it off to compare (`benchmarks/asynctls.py`).
        self.express_path = True
        self._express_static = bool(
            self.cuda and lane_cuda and self.scheduler.lane.express is not None and self.sparda is None
            and self._window_graphs is not None and getattr(self.gpu_executor, "merged", None) is None
            and getattr(self.planner, "lagged_plan", None) is None and not getattr(self.planner, "reads_window", False)
            and not getattr(self.planner, "uses_queries", False))
        self._express_ready = torch.cuda.Event() if self._express_static else None  # q and the lane's buffers ready
        # ... and the whole step (window, claim, merge, lagged copy) replayed from one CUDA graph where the
        # executor can capture its claim (`step_graphs.py`). Off by default until measured on a GPU machine;
        # `benchmarks/asynctls.py --step-graphs` turns it on.
        self.step_graphs_enabled = False
        self._step_graphs = None
        if self._express_static and getattr(self.gpu_executor, "capture_claim", None) is not None:
            from hybrid_runtime.step_graphs import StepGraphs

            self._step_graphs = StepGraphs(self._window_graphs, self._merge_gpu, self.device,
                                           max_graphs=4 * store.layers,
                                           max_tasks=store.cfg.max_sequences * geometry.kv_heads)
        # A deferred input check of a step that launches the step-inputs kernel is counted by it,
        # into the check's ring (no launch of its own). Benchmarks switch it off to compare
        # (`benchmarks/e2e_decode.py` variant fluxion_check_launch).
        self.count_checks_in_inputs = True
        # Native CPU workers start on a word the caller's stream writes after q's copy to the host
        # (`scheduler.cpu_lane_start`, native_pool "Starting on the device's word"); `_res_free`
        # marks the stream past the last read of the CPU lane's results, which the next step clears.
        self._qready_address = None
        if start_on_device and self.scheduler.native is not None:
            from gpu_kernels.host_count_wait import device_address, signal_value

            self._qready_address = device_address(self._ctrl_host[native_pool.C_QREADY :])
            self._signal_value = signal_value
            self._res_free = torch.cuda.Event()
        try:
            clock = self._clock = CudaClock() if self.cuda else None
            self._clock_stale = False  # set by prefill: the next decode step calibrates first
            # The scheduler's launch model reads GPU launch end times through the same clock.
            self.scheduler.clock = clock if lane_cuda else None
            self._timeline = Timeline(self.scheduler.worker_names, self.scheduler.worker_lanes,
                                      clock if cfg.profiling.enabled else None, enabled=cfg.profiling.enabled,
                                      max_steps=cfg.profiling.max_steps, sample_every=cfg.profiling.sample_every,
                                      sample_offset=cfg.profiling.sample_offset)
            # A step may return before its last GPU claims ended (`GpuLane.trails`): they fill its
            # timeline columns when retired.
            self._timeline.before_resolve = self.scheduler.settle
        except BaseException:
            try:
                self.scheduler.close()
            except RuntimeError as close_error:  # workers still starting past START_WAIT_S: named, not lost
                log.error("HybridRuntime: construction failed; closing its scheduler: %s", close_error)
            finally:
                self._release_thread()
            raise
        self._froze_gc = bool(sc.gc_freeze)
        if self._froze_gc:
            freeze_collector()
        # Last: the kernels the decode step launches compile on a thread of their own while the
        # caller prefills; the first decode step waits for them (`await_warm_up`).
        self._jit_launches_at_warmup: int | None = None  # CachedLaunch.jit_launches at the first decode step
        self._jit_keys_at_warmup: dict[str, int] = {}  # CachedLaunch.jit_launch_keys then
        self._jit_launches_seen = 0  # CachedLaunch.jit_launches when the last step looked (`_warn_jit_launches`)
        self._jit_keys_warned: set[str] = set()
        self._warm_up = BackgroundWarmUp(warm_jobs, device=self.device,
                                         stream=torch.cuda.Stream(self.device) if self.cuda else None).start()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "HybridRuntime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop and join every worker thread, then free the store's pinned arenas. Idempotent.

        A task of a timed-out step that still runs cannot be interrupted: close waits for it at
        most `scheduler.step_timeout_s`, then raises naming it and leaves the arenas allocated
        (it may still read them); calling close again waits once more and frees them.
        """
        if self._closed and self.store.closed:
            return
        first = not self._closed
        self._closed = True
        bad_input = None
        try:
            self.scheduler.close()
            bad_input = self._read_input_checks_at_close()
            self._warm_up.join()  # it reads the store's arena: joined (not its error) before it is freed
            # Only once no worker can read them: the pinned arenas go back to the system.
            self.store.close()
            self._window_graphs = None  # their buffers, and kernels that read the store's windows
            self._step_graphs = None  # (every claim they replayed was retired by the scheduler's close)
        finally:
            if first and self._froze_gc:
                thaw_collector()
            if first:
                self._release_thread()
        if bad_input is not None:
            bad_input.add_note("raised by close(), after the runtime was closed")
            raise bad_input

    def await_warm_up(self) -> float:
        """Wait for the background kernel warm-up (the first decode step does); returns the seconds
        waited. Raises `warmup.KernelWarmUpError` naming a kernel that failed to compile. A caller
        that captures CUDA graphs of its own before the first decode step calls it first: the
        warm-up thread's allocations and module loads are not allowed during such a capture."""
        self._check_open()
        return self._finish_warm_up()

    def _finish_warm_up(self) -> float:
        """Wait for the background warm-up (raising its error), then capture what must be captured
        on the caller's thread (the predicted planner's graphs; once). Returns the seconds waited."""
        waited = self._warm_up.wait()
        warm_up = getattr(self.planner, "warm_up", None)
        if warm_up is not None and not getattr(self.planner, "warmed_up", True):
            warm_up()
        return waited

    def _release_thread(self) -> None:
        """Give a rank's constructing thread back the cores it had (when close runs on that thread)."""
        confined, self._confined = self._confined, None
        if confined is not None and confined[1] is not None and confined[0] == threading.get_ident():
            os.sched_setaffinity(0, confined[1])

    def _read_input_checks_at_close(self) -> ValueError | None:
        """Every deferred input check not read yet (reported by close, never dropped): the first
        bad one's error, the others' in its notes."""
        bad_input = None
        try:
            while self._input_check.pending:
                try:
                    self._input_check.poll(block=True)
                except ValueError as exc:
                    if bad_input is None:
                        bad_input = exc
                    else:
                        bad_input.add_note(f"and: {exc}")
        except RuntimeError as exc:  # the device failed: nothing more can be read
            log.warning("HybridRuntime.close: the deferred input checks could not be read: %s", exc)
        return bad_input

    def _settle_input_checks(self) -> None:
        """Read every deferred input check (waiting for those still queued) and raise the first bad
        one: before the store changes for anything but a decode step."""
        self._input_check.poll(block=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HybridRuntime is closed")
        if self.scheduler.broken is not None:
            raise RuntimeBrokenError(self.scheduler.broken)

    @property
    def timeline(self) -> Timeline:
        return self._timeline

    # ------------------------------------------------------------------ prefill / release
    def prefill(self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor, *, extend: bool = False,
                q_last: torch.Tensor | None = None) -> None:
        """Store one layer of a prompt's KV `[L, Hkv, D]` (sink and recent window, CPU pages, metadata).

        `extend=True` appends the next chunk of the same prompt to what the layer already holds,
        for prompts prefilled in chunks; the store then holds exactly what one call with the whole
        prompt would leave. From CUDA tensors the CPU part is copied into the pinned store
        asynchronously, overlapping the caller's next work; the caller may overwrite k, v at once.
        Inputs are validated before anything changes: an integer `seq_id` and `layer`, floating-point
        k, v on the CPU (or CUDA) without NaN/inf; the store refuses wrong shapes, an empty prompt,
        a layer the sequence already has (without `extend`) or lacks (with it) and a prompt past the
        capacity.

        `q_last [Hq, D]` (unscaled) is the query of the prompt's last token at this layer: a head
        planner that caches prefill statistics (the `predicted` policy) needs it on every prefill
        call and computes the statistics of the prompt so far from it; other planners ignore it.
        """
        self._check_open()
        self._settle_input_checks()
        seq_id = _as_int(seq_id, "seq_id")
        layer = _as_int(layer, "layer")
        if not isinstance(extend, (bool, np.bool_)):
            raise TypeError(f"extend is {extend!r} ({type(extend).__name__}); expected True or False")
        if not 0 <= layer < self.store.layers:
            raise IndexError(f"layer {layer} out of range; the runtime has layers 0..{self.store.layers - 1}")
        _check_tensor("k", k)
        _check_tensor("v", v)
        planner_prefill = getattr(self.planner, "prefill", None)
        # An executor that keeps state per prompt (the AsyncTLS index and cache) is told of it too.
        executor_prefill = getattr(self.gpu_executor, "prefill", None)
        tensors = {"k": k, "v": v}
        if q_last is not None:
            _check_tensor("q_last", q_last)
            g = self.geometry
            if tuple(q_last.shape) != (g.q_heads, g.head_dim):
                raise ValueError(f"q_last has shape {tuple(q_last.shape)}; expected [{g.q_heads}, {g.head_dim}] "
                                 "([q_heads, head_dim]: the query of the prompt's last token)")
            tensors["q_last"] = q_last
        elif planner_prefill is not None or executor_prefill is not None:
            raise ValueError(f"the {self.cfg.selection.name!r} selection needs q_last, the query of the prompt's last "
                             "token at this layer ([q_heads, head_dim]), at every prefill; nothing was changed")
        _check_finite(tensors)
        self.scheduler.settle()  # no claim of an earlier step reads the store while it changes
        self.scheduler.end_step_chain()
        self.store.prefill(seq_id, layer, k, v, extend=bool(extend))
        self._clock_stale = self._clock is not None
        self._forget_tasks(seq_id, layer)
        if self.sparda is not None:
            self.sparda.prefill(seq_id, layer)
        if planner_prefill is not None:
            planner_prefill(seq_id, layer, k, v, q_last, extend=bool(extend))
        if executor_prefill is not None:
            executor_prefill(seq_id, layer, q_last, extend=bool(extend))

    def release(self, seq_id: int) -> None:
        """Free a sequence's pages and window slot (memory stays pinned for reuse)."""
        self._check_open()
        self._settle_input_checks()
        seq_id = _as_int(seq_id, "seq_id")
        if seq_id not in self.store.sequences():
            raise KeyError(
                f"release({seq_id}): sequence {seq_id} is not in the store (never prefilled, or already released); "
                f"sequences in the store: {sorted(self.store.sequences())}"
            )
        self.scheduler.settle()  # its pages may be reused at once: no earlier claim may still read them
        self.scheduler.end_step_chain()
        planner_release = getattr(self.planner, "release", None)
        if planner_release is not None:
            planner_release(seq_id)
        for executor in (self.cpu_executor, self.gpu_executor):
            executor_release = getattr(executor, "release", None)
            if executor_release is not None:
                executor_release(self.store.slot(seq_id))  # per-slot state (the NOSA block caches, EvoSparse heat)
        if self.sparda is not None:
            self.sparda.release(seq_id)
        self.store.release(seq_id)
        self._forget_tasks(seq_id)

    # Whether callers that know a batch's prompt is in (the transformers integration after each
    # layer's prefill) build its first decode step's tables then (`prepare_decode`); the e2e
    # benchmark's A/B turns it off.
    prepares_decode = True

    def prepare_decode(self, seq_ids: Sequence[int], layer: int) -> bool:
        """Build now, off the decode path, what the next decode step of the batch `seq_ids` needs
        at `layer` and would otherwise build at its start: the step's task list, its queue order,
        the CPU lane's native table and the GPU lane's packed table, kept with the task list the
        step then reuses (`_tasks`). Measured on the CPU, building them for a new batch was the
        first step's extra host work (`benchmarks/diag/first_step_host.py`). A GPU executor that
        readies a table ahead (`prepare`: the UVA executor grows its claims' scratch and makes the
        table's device copy) does it now too: device and pinned allocations the first two steps
        would otherwise make. A prefill or release of one of the sequences
        forgets the tables, as it forgets any task list.

        Returns False, building nothing, where the plan is not known before the step: a planner
        that plans from the step's queries or keeps state across steps, or SparDA's selection."""
        self._check_open()
        layer = _as_int(layer, "layer")
        if not 0 <= layer < self.store.layers:
            raise ValueError(f"layer {layer} is out of range: the store has {self.store.layers} layers")
        seq_ids = [_as_int(s, "seq_id") for s in seq_ids]
        held = self.store.sequences()
        missing = [s for s in seq_ids if s not in held]
        if missing or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"prepare_decode: seq_ids {seq_ids} must be distinct sequences in the store; not in it: "
                             f"{missing} (in the store: {sorted(held)})")
        planner = self.planner
        if not seq_ids or self.sparda is not None or not getattr(planner, "stateless", False) \
                or getattr(planner, "uses_queries", False):
            return False
        tasks = self._tasks(layer, seq_ids, planner(layer, seq_ids, self.store))
        if not isinstance(tasks, TaskList) or not len(tasks):
            return True
        if tasks._native is None:
            tasks._native = native_table(queue_order(tasks)[0], self.geometry.group_size)
        lane = self.scheduler.lane
        pack = getattr(lane.executor, "pack", None) if lane is not None else None
        if pack is not None and tasks._gpu_packed is None:
            tasks._gpu_packed = pack(*tasks._native[:3])
        prepare = getattr(lane.executor, "prepare", None) if lane is not None else None
        if prepare is not None and tasks._gpu_packed is not None:
            prepare(tasks._gpu_packed)  # scratch grown, device copy made (`GpuUvaExecutor.prepare`)
        return True

    # ------------------------------------------------------------------ decode
    def _warn_jit_launches(self) -> None:
        """Log, once per kernel and key, a Triton launch that went through the JIT in this process
        since the previous decode step (this runtime's steps mostly; a prefill's or another runtime's
        too): a variant its warm-up did not compile, launched at the JIT's host cost (a compile, or a
        lookup). Under Triton's interpreter every launch does, unnamed: nothing to say."""
        self._jit_launches_seen = CachedLaunch.jit_launches
        new = [name for name in self._jit_keys_since_warmup() if name not in self._jit_keys_warned]
        if new:
            self._jit_keys_warned.update(new)
            log.warning("%d Triton kernel variant(s) went through the JIT since the previous decode step, after the "
                        "warm-up (host time on the decode path; stats()['jit_kernels_after_warmup'] counts them): %s",
                        len(new), "; ".join(new))

    def _jit_keys_since_warmup(self) -> dict[str, int]:
        """`CachedLaunch.jit_launch_keys` counted since this runtime's first decode step: kernel and
        key -> launches through the JIT ({} before that step)."""
        if self._jit_launches_at_warmup is None:
            return {}
        at = self._jit_keys_at_warmup
        keys = dict(CachedLaunch.jit_launch_keys)  # a copy: another runtime's warm-up thread may add one
        return {name: n - at.get(name, 0) for name, n in keys.items() if n > at.get(name, 0)}

    def _check_decode(
        self, layer: int, seq_ids: Sequence[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        check_finite: bool = True,
    ) -> tuple[int, list[int]]:
        g = self.geometry
        layer = _as_int(layer, "layer")
        if not 0 <= layer < self.store.layers:
            raise IndexError(f"layer {layer!r} out of range; the runtime has layers 0..{self.store.layers - 1}")
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
            raise TypeError(f"seq_ids is {seq_ids!r}; expected a sequence of integer sequence ids")
        # Plain ints (the common case) skip `_as_int`'s call: its checks are for other types.
        seq_ids = [s if type(s) is int else _as_int(s, "a sequence id in seq_ids") for s in seq_ids]
        if not seq_ids:
            raise ValueError("seq_ids is empty; decode needs at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids {seq_ids} repeat a sequence; each sequence may appear once per step")
        b, devices = len(seq_ids), _input_devices()
        _check_tensor("q", q, devices)
        if q.dim() != 3 or tuple(q.shape) != (b, g.q_heads, g.head_dim):
            raise ValueError(
                f"q has shape {tuple(q.shape)}; expected [{b}, {g.q_heads}, {g.head_dim}] ([B, q_heads, head_dim])"
            )
        for name, x in (("k", k), ("v", v)):
            _check_tensor(name, x, devices)
            if tuple(x.shape) != (b, g.kv_heads, g.head_dim):
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}; expected [{b}, {g.kv_heads}, {g.head_dim}] ([B, kv_heads, head_dim])"
                )
        unready = self.store.first_unready(layer, seq_ids)
        if unready is not None:
            s, known = unready
            if not known:
                raise KeyError(f"sequence {s} is not in the store; prefill it first (sequences in the store: "
                               f"{sorted(self.store.sequences())})")
            raise ValueError(f"sequence {s} has no KV at layer {layer}; prefill every layer of it before decoding")
        if check_finite:
            _check_finite({"q": q, "k": k, "v": v})
        return layer, seq_ids

    def _raise_counted_nonfinite(self, q_rows: int, inputs: dict[str, torch.Tensor]) -> None:
        """Once the step-inputs launch has completed: its NaN/inf counts of q, k, v (in `inputs`'
        order), raised as the host check of their copies would."""
        counts = self._input_counts_np[:, : count_columns(q_rows)].sum(axis=1)
        if counts.any():
            raise nonfinite_error({name: (int(c), x.numel()) for (name, x), c in zip(inputs.items(), counts)})

    def _make_step_views(self, b: int) -> "_StepViews":
        """The views of the step buffers a batch of `b` sequences uses, made once per batch size
        (a dozen slicing and view ops that cost ~15-30 us of host time a layer when made per step)."""
        hq, d = self.geometry.q_heads, self.geometry.head_dim
        n, m = b * hq * d, b * hq * (d + 1)
        cpu_q = self._q_host[:n].view(b, hq, d)
        res = self._res_host[:m]
        cpu_out, cpu_lse = res[:n].view(b, hq, d), res[n:].view(b, hq)
        uva = getattr(self, "_res_uva", None)
        dev = getattr(self, "_res_dev", None)
        views = _StepViews(
            cpu_q=cpu_q, cpu_out=cpu_out, cpu_lse=cpu_lse,
            cpu_arrays=(cpu_q.numpy(), cpu_out.numpy(), cpu_lse.numpy()),
            gq=self._gq[:b], gout=self._gout[:b], glse=self._glse[:b],
            qs=self._qs_buf[:b] if self.cuda else None,
            q_host_uva=self._q_host_uva[:n] if self.cuda else None,
            res_uva_parts=(uva[:n].view(b, hq, d), uva[n:m].view(b, hq)) if uva is not None else None,
            res_host_flat=res,
            res_dev_flat=dev[:m] if dev is not None else None,
            res_dev_parts=(dev[:n].view(b, hq, d), dev[n:m].view(b, hq)) if dev is not None else None,
        )
        self._step_views[b] = views
        return views

    @staticmethod
    def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        """A timing event recorded on `stream` (callers pass the stream they looked up once)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    # Pinned slots for the window's (slots, lengths) of recent steps: an async copy needs a
    # pinned source (from pageable memory it waits for the stream), and a slot is rewritten only
    # after its copy finished.
    WINDOW_RING = 8

    def _window(self, layer: int, seq_ids: list[int], qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        store = self.store
        win_k, win_v = store.window(layer)
        lens = [store.window_len(s, layer) for s in seq_ids]
        slots = [store.slot(s) for s in seq_ids]
        b = len(seq_ids)
        if not self.cuda:
            out, lse = self._wout[:b], self._wlse[:b]
            win_k, win_v = self._win_numpy[layer]
            window_attention_host(qs.numpy(), win_k, win_v, np.array(slots, dtype=np.int32),
                                  np.array(lens, dtype=np.int32), out.numpy(), lse.numpy(), self._wscores)
            return out, lse
        i = self._win_turn = (self._win_turn + 1) % self.WINDOW_RING
        used = self._win_used[i]
        used.synchronize()  # long done in practice: steps apart (returns at once if never recorded)
        self._win_host[i, : 2 * b].numpy()[:] = slots + lens
        dev = self._win_dev[i, : 2 * b]  # a UVA view of that pinned row
        # The runtime's own buffers and the store's window, checked when they were made.
        res = self._window_gpu(qs, win_k, win_v, dev[:b], dev[b:], max_len=max(lens), validate=False)
        used.record(current_stream())  # the row is rewritten only after the kernel read it
        return res

    def _merge(self, out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
        if self.cuda:
            return self._merge_gpu(out, lse, out_b, lse_b, out=out, lse=lse, validate=False)
        d = out.shape[-1]
        flat_out, flat_lse = out.view(-1, d).numpy(), lse.view(-1).numpy()
        merge_host(flat_out, flat_lse, out_b.reshape(-1, d).numpy(), lse_b.reshape(-1).numpy(), flat_out)
        return out, lse  # merged in place

    # Plans remembered per (layer, batch): a few, so alternating plans (benchmarks) still hit.
    TASK_CACHE_PLANS = 4

    def _tasks(self, layer: int, seq_ids: list[int], plan: HeadPlan):
        """The step's tasks; reused while the batch, the plan and the CPU segments are unchanged.

        A fixed head plan over unchanged CPU segments (no spill since the last step) gives the same
        tasks every step, so building them -- O(tasks) Python on the step's critical path -- is
        done once. Entries are dropped when a sequence is prefilled or released (its chunks
        change); a spill changes `cpu_len`, which misses the cache.
        """
        store = self.store
        key = (layer, tuple(seq_ids))
        cpu_lens = [store.cpu_len(s, layer) for s in seq_ids]
        entries = self._task_cache.get(key)
        if entries is not None:
            for c_plan, c_lens, c_tasks in entries:
                if c_lens == cpu_lens and (c_plan is plan or np.array_equal(c_plan.block_size, plan.block_size) and
                                           np.array_equal(c_plan.budgets, plan.budgets)):
                    return c_tasks
        tasks = build_tasks(store, layer, seq_ids, plan, cpu_len=cpu_lens)
        if len(self._task_cache) >= 4 * store.layers:
            self._task_cache.clear()  # batches changed: start over rather than track usage
        entries = self._task_cache.setdefault(key, [])
        if len(entries) >= self.TASK_CACHE_PLANS:
            entries.pop(0)
        # The plan's arrays are copied unless it is frozen: a planner may reuse and overwrite its buffers.
        kept = plan if plan.frozen else HeadPlan(np.array(plan.block_size), np.array(plan.budgets))
        entries.append((kept, cpu_lens, tasks))
        return tasks

    def _forget_tasks(self, seq_id: int, layer: int | None = None) -> None:
        """Drop the task lists holding `seq_id`: at `layer` (a prefill changes that layer's chunks
        only), or at every layer (a release)."""
        for key in [k for k in self._task_cache if seq_id in k[1] and (layer is None or k[0] == layer)]:
            del self._task_cache[key]

    def _will_spill(self, layer: int, seq_ids: list[int]) -> bool:
        """Whether appending one token spills window pages into the CPU segment (changes tasks)."""
        will_spill = getattr(self.store, "will_spill", None)
        if will_spill is not None:
            return bool(will_spill(layer, seq_ids))
        limit = self.store.cfg.local + self.store.cfg.generated_cap
        return any(self.store._layer_state(s, layer).recent_len + 1 > limit for s in seq_ids)

    def _check_lookahead(self, layer: int, seq_ids: list[int], lookahead: Any) -> None:
        """`decode(..., lookahead=)`: SparDA's selection queries of the next layer, or an error."""
        g = self.geometry
        if self.sparda is None:
            raise ValueError(f"lookahead is given but selection.name is {self.cfg.selection.name!r}; it is read only under "
                             "selection.name 'sparda' (the next layer's selection queries)")
        if self.cfg.sparda.lookahead == "same_layer":
            raise ValueError("lookahead is given but sparda.lookahead is 'same_layer' (every layer selects with its own "
                             "query); allowed: no lookahead, or sparda.lookahead 'forecast' or 'proxy'")
        if layer == self.store.layers - 1:
            raise ValueError(f"lookahead is given at layer {layer}, the last layer: there is no next layer to select for")
        _check_tensor("lookahead", lookahead)
        if lookahead.dim() != 3 or lookahead.shape[0] != len(seq_ids) or lookahead.shape[2] != g.head_dim or \
                lookahead.shape[1] not in (g.kv_heads, g.q_heads):
            raise ValueError(f"lookahead has shape {tuple(lookahead.shape)}; expected [{len(seq_ids)}, {g.kv_heads}, "
                             f"{g.head_dim}] (one query per KV group, the Forecast's) or [{len(seq_ids)}, {g.q_heads}, "
                             f"{g.head_dim}] (one per query head, unscaled, the proxy's)")

    @torch.no_grad()
    def decode(self, layer: int, seq_ids: Sequence[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               lookahead: torch.Tensor | None = None) -> torch.Tensor:
        """One layer of one decode step for a batch: q `[B,Hq,D]`, k/v `[B,Hkv,D]` -> out `[B,Hq,D]`.

        `q` is not pre-scaled (the runtime applies 1/sqrt(D)). The output has q's dtype and device.
        `lookahead` (only under `selection.name: sparda`, not at the last layer): the next layer's
        selection queries, `[B, Hkv, D]` (one per KV group: the Forecast's) or `[B, Hq, D]` (one per
        query head, unscaled: the proxy's); its blocks are selected and prefetched now, during this
        layer (`executors/sparda.py`). Without it a sparda layer selects with its own query.
        Inputs are validated before anything changes (ids, layer, shapes, dtypes, devices; see
        `_check_decode`), and so is NaN/inf in q, k, v unless the check is deferred
        (`scheduler.finite_check`, input_check.py: by default on CUDA steps whose host does not wait
        for q -- without a CPU lane, or with one that starts on the device's word, `scheduler.cpu_lane_start`):
        then a later call raises it, naming the step, before that call changes anything. If a
        worker fails or the step times out, the error is raised here and the runtime stays usable;
        the step's k, v remain appended (a GPU-only step's claim that fails after the step returned
        is raised by the next call, naming its step).
        If a task of a timed-out step is still running another `scheduler.step_timeout_s` later,
        this and every later call raise `RuntimeBrokenError` (close the runtime and build a new one).
        """
        t_entry = time.perf_counter()
        self._check_open()
        if self._jit_launches_at_warmup is None:  # the first step (or one after a failed warm-up wait)
            self._finish_warm_up()  # every kernel the step launches has compiled (warmup.py), graphs captured
            self._jit_launches_at_warmup = self._jit_launches_seen = CachedLaunch.jit_launches
            self._jit_keys_at_warmup = dict(CachedLaunch.jit_launch_keys)
        elif CachedLaunch.jit_launches != self._jit_launches_seen:
            self._warn_jit_launches()
        cuda = self.cuda
        has_cpu, has_gpu = self.cpu_executor is not None, self.gpu_executor is not None
        # An earlier step's deferred input check that has run (one two calls old is waited for):
        # its bad input is raised here, before this call changes anything.
        self._input_check.next_call()
        self._input_check.poll()
        layer, seq_ids = self._check_decode(layer, seq_ids, q, k, v, check_finite=False)
        self.scheduler.note_entry(t_entry)
        if self._clock_stale:
            # After a prefill (seconds to minutes of GPU work) the event clock has drifted from the
            # host's by up to milliseconds, which the GPU lane's launch model and the timeline read.
            self._clock_stale = False
            self._clock.calibrate()
        sparda = self.sparda
        if lookahead is not None:
            self._check_lookahead(layer, seq_ids, lookahead)
        store, geo = self.store, self.geometry
        prof = self._timeline.wants(layer)  # profiling on and this step sampled
        if self._express_static and not prof and self.express_path and lookahead is None and self.gpu_only_trails:
            out = self._decode_express(layer, seq_ids, q, k, v)
            if out is not None:
                return out
        timing = self._timeline.events.record  # the timeline's events, reused once it has read them
        caller = current_stream() if cuda else None  # looked up once: each lookup costs host time
        ev_entry = timing(caller) if cuda and prof else None
        # A spill moves window pages into the CPU segment the tasks read: it must come first; so
        # must the append when the planner reads the window (its features include this token).
        # Otherwise the append only touches the GPU window and runs while the tasks do. Without a
        # spill, on CUDA, the planner's append comes with the window attention from the window
        # graph, replayed before the planner (`window_first`) instead of as the step's side work:
        # one replay, not the append and the window kernels launched one by one.
        spill_due = self._will_spill(layer, seq_ids)
        cpu_lane = has_cpu and self.scheduler.placement != "gpu_only"  # the step has CPU tasks
        # The CPU lane starts on the device's word (`scheduler.cpu_lane_start`): nothing on the host
        # waits for q, so the check cannot ride on its copy. Not on a step that spills (its pages
        # reach the CPU segment by host work the tasks must follow) or checks synchronously.
        device_start = cpu_lane and self._qready_address is not None and not spill_due and lookahead is None and \
            self.finite_check != "sync"
        # The previous step's CPU tasks (`cpu_lane_trails`) end before this one changes anything. A
        # step that starts on the device's word with a planner that changes nothing waits for them in
        # the scheduler, just before its launches (`Scheduler.run`): its host work up to there --
        # the plan, the tasks, the split, the claim sizes -- overlaps them, and its job can be
        # published before its q exists. Any other step waits here: its q reaching the host would
        # wait for them anyway (its model layer needed their output).
        late_settle = device_start and getattr(self.planner, "stateless", False)
        if not late_settle and self.scheduler.cpu_inflight is not None:
            self.scheduler.settle_cpu()
        # A planner whose plans lag a step (`selection.plan_lag`) may have this step's plan already: the
        # step then runs on it, and the planner computes the next one after the window part
        # (`launch_next`), so it reads nothing of this step before the tasks exist.
        lagged_plan = getattr(self.planner, "lagged_plan", None) if cuda and sparda is None else None
        plan_early = lagged_plan(layer, seq_ids) if lagged_plan is not None else None
        reads_window = sparda is None and plan_early is None and getattr(self.planner, "reads_window", False)
        append_first = spill_due or reads_window
        window_first = reads_window and not spill_due and cuda and self._window_graphs is not None
        # NaN/inf in q, k, v (and lookahead) is an error (input_check.py). Refused now, before
        # anything changes (`scheduler.finite_check` sync): on CUDA with a CPU lane the check rides
        # on the copy of q to the host that the CPU workers need anyway (k and v go along), read
        # after the one wait for it; otherwise (or before an append that must come first: a spill,
        # or a planner that reads the window) the inputs are checked here, at a device sync of its
        # own. Deferred (under "auto" a CUDA step without a CPU lane, whose host would otherwise
        # wait for the GPU here every layer): counted on the device now, raised by a later call.
        defer_check = defers(self.finite_check, cuda, cpu_lane and not device_start)
        # The check rides on q's copy to the host also before a window graph replayed ahead of the
        # planner (`window_first`): it is read before that replay appends anything.
        q_copy_check = not defer_check and cuda and cpu_lane and (not append_first or window_first)
        checked = {"q": q, "k": k, "v": v} if lookahead is None else {"q": q, "k": k, "v": v, "lookahead": lookahead}
        b, hq = len(seq_ids), geo.q_heads
        # On CUDA one launch makes the step's inputs ready (gpu_kernels/step_inputs.py): scaled q
        # on the device, on the host for the CPU workers and in the GPU lane's buffer, the lane's
        # results cleared, and q, k, v's NaN/inf counts -- for the check that rides on q's copy, or
        # into the deferred check's ring (`counted_in_inputs`: that check then launches nothing).
        # Not while claims of a timed-out step may still write the lane's results (they are waited
        # for first), nor for SparDA's lookahead, inputs on the host or a GPU lane computing there:
        # separate ops.
        fused = cuda and lookahead is None and not self.scheduler.has_orphan and (
            not has_gpu or self.gpu_lane_device.type == "cuda") and q.device == k.device == v.device == self.device
        counted_in_inputs = defer_check and fused and self.count_checks_in_inputs

        def issue_check() -> None:  # once the previous step's CPU tasks are settled (their errors come first)
            if counted_in_inputs:  # the step-inputs kernel, queued before on `caller`, counted them
                self._input_check.issue_counted({"q": q.numel(), "k": k.numel(), "v": v.numel()},
                                                count_columns(b * hq), layer, seq_ids, caller)
            else:
                self._input_check.issue(checked, layer, seq_ids, caller)

        if defer_check and not late_settle and not counted_in_inputs:
            issue_check()
        elif not defer_check and not q_copy_check:
            _check_finite(checked)
        if append_first and not window_first:
            old_lens = [store.cpu_len(s, layer) for s in seq_ids] if sparda is not None else None
            store.append(layer, seq_ids, k, v)
            if sparda is not None:
                sparda.spilled(layer, seq_ids, old_lens)

        views = self._step_views.get(b) or self._make_step_views(b)
        cpu_q, cpu_out, cpu_lse = views.cpu_q, views.cpu_out, views.cpu_lse
        if has_gpu:
            gq, gout, glse = views.gq, views.gout, views.glse
        if fused:
            qs = views.qs
            counts = self._input_counts if q_copy_check else self._input_check.fused_row() if counted_in_inputs else None
            self._step_inputs(q, k, v, self.scale, qs, q_host=views.q_host_uva if cpu_lane else None,
                              lane=(gq, gout, glse) if has_gpu else None, counts=counts, stream=caller.cuda_stream)
            if counted_in_inputs and not late_settle:
                issue_check()
        elif cuda:
            qs = views.qs
            qs.copy_(q)
            qs.mul_(self.scale)
        else:
            qs = (q.to(device=self.device, dtype=torch.float32) * self.scale).contiguous()
        # q in its own dtype where the planner's and SparDA's device parts read it (a caller may pass
        # host tensors): copied once, and only for a step that has one of them.
        reads_q = sparda is not None or plan_early is not None or getattr(self.planner, "uses_queries", False)
        q_dev = q.to(self.device) if reads_q and q.device != self.device else q
        if cpu_lane and not fused:
            cpu_q.copy_(qs, non_blocking=True)  # device -> pinned host, ordered on the main stream
        if q_copy_check and not fused:
            # Raw copies in the inputs' own dtypes: one memcpy each, no conversion kernel.
            k_nbytes = -(-k.numel() * k.element_size() // 8) * 8  # v starts 8-byte aligned
            k_host = self._kv_host[:k_nbytes].view(k.dtype)[: k.numel()].view(k.shape)
            v_host = self._kv_host[k_nbytes : k_nbytes + v.numel() * v.element_size()].view(v.dtype).view(v.shape)
            k_host.copy_(k, non_blocking=True)
            v_host.copy_(v, non_blocking=True)
            if lookahead is not None:
                look_host = self._look_host[: lookahead.numel() * lookahead.element_size()].view(lookahead.dtype)
                look_host = look_host.view(lookahead.shape)
                look_host.copy_(lookahead, non_blocking=True)
        ev_qhost = self._event(caller) if cuda and (cpu_lane or fused) else None

        def gpu_prep() -> None:
            # After the CPU workers were released (these ops are not on their critical path), but
            # before, when they wait for the GPU lane's selection (`scheduler.cpu_task_selection`).
            if fused:
                job.gpu_ready = ev_qhost  # the lane's buffers were made ready with q
                return
            gq.copy_(qs, non_blocking=True)
            gout.zero_()
            glse.fill_(float("-inf"))
            if self.gpu_lane_device.type == "cuda":
                job.gpu_ready = self._event(caller)  # the GPU lane's stream starts after this point

        window: dict = {}

        def window_part() -> None:
            if window:  # replayed before the planner (`window_first`)
                return
            if not cuda:
                if not append_first:
                    store.append(layer, seq_ids, k, v)
                window["ev0"] = window["ev1"] = None
                window["out"], window["lse"] = self._window(layer, seq_ids, qs)
                return
            # On a high-priority side stream, so that it runs ahead of anything else queued.
            side = self._side_stream
            side.wait_stream(caller)
            graphs = self._window_graphs if (window_first or not append_first) and sparda is None else None
            with use_stream(side, caller):
                if graphs is None and not append_first:
                    store.append(layer, seq_ids, k, v)
                window["ev0"] = timing(side) if prof else None
                # From a graph, append and window are replayed together into the graph's own out, lse.
                out, lse = graphs.run(layer, seq_ids, qs, k, v, side) if graphs is not None else \
                    self._window(layer, seq_ids, qs)
                window["ev1"] = timing(side) if prof else None
            caller.wait_stream(side)  # the merges below run on the caller's stream
            if graphs is None:
                out.record_stream(caller)  # allocated on the side stream, used and freed on the caller's
                lse.record_stream(caller)
            if plan_early is not None:  # the next step's plan, from this step's queries and window
                self.planner.launch_next(layer, seq_ids, store, q_dev)
            window["out"], window["lse"], window["graph"] = out, lse, graphs is not None

        def check_copied_inputs() -> None:
            ev_qhost.synchronize()  # the CPU lane's wait for q, moved before anything changes
            if fused:
                self._raise_counted_nonfinite(b * hq, {"q": q, "k": k, "v": v})
            else:
                host = {"q": cpu_q, "k": k_host, "v": v_host}
                if lookahead is not None:
                    host["lookahead"] = look_host
                _check_finite_host(host)

        if window_first:
            if q_copy_check:
                check_copied_inputs()  # before the replay below appends this step's token
            window_part()  # the append (and the window attention) the planner reads, from the graph
        if sparda is not None:
            tasks = []  # the CPU segment is read by the SparDA executor alone
        elif plan_early is not None:
            tasks = self._tasks(layer, seq_ids, plan_early)
        elif getattr(self.planner, "uses_queries", False):
            plan = self.planner(layer, seq_ids, store, q_dev)
            tasks = self._tasks(layer, seq_ids, plan)
        else:
            plan = self.planner(layer, seq_ids, store)
            tasks = self._tasks(layer, seq_ids, plan)
        if q_copy_check and not window_first:
            check_copied_inputs()
        if lookahead is not None:
            sparda.prefetch(layer + 1, seq_ids, lookahead)  # the next layer's blocks, while this one computes
        job = None
        if tasks:

            def before_cpu() -> None:
                if device_start:
                    # The workers start once q lands (`q_signal`); the results are cleared once the
                    # previous step's merge has read them.
                    self._res_free.synchronize()
                elif ev_qhost is not None:
                    # q is on the host now, and the previous step's copy out of `res` is done.
                    ev_qhost.synchronize()
                res_out, res_lse = views.cpu_arrays[1], views.cpu_arrays[2]
                res_out.fill(0.0)
                res_lse.fill(-np.inf)

            job = StepJob(
                layer,
                tasks,
                batch=b,
                cpu_arrays=views.cpu_arrays if has_cpu else None,
                gpu_step=Step(layer, gq, gout, glse, geo.group_size) if has_gpu else None,
                record=prof,
            )
            # The window attention is the step's side work: issued after the CPU workers were
            # released (issued before, it delayed their first task by 0.3-0.9 ms) and after the
            # GPU lane's first claim (benchmarks/notes/gpu_lane.md).
            try:
                last = layer == store.layers - 1
                # A caller on the host gets its output through a copy that waits for the device, and
                # a trailing CPU lane's merge makes the device wait for the workers: that copy would
                # wait for them with no step timeout (a stalled task would hang it), so such a step
                # does not trail.
                cpu_trails = self._cpu_trails and not last and q.device.type == "cuda"
                q_signal = (lambda job_id: self._signal_value(self._qready_address, job_id, caller.cuda_stream)) \
                    if device_start else None
                self.scheduler.run(job, before_cpu=before_cpu, before_gpu=gpu_prep, side_work=window_part, collect=False,
                                   cpu_trails=cpu_trails, gpu_trails=self.gpu_only_trails and not last, q_signal=q_signal,
                                   after_settle=issue_check if defer_check and late_settle else None)
                t_scheduler_return = time.perf_counter()
            except BaseException:
                if self.scheduler.start_failed:
                    # The CPU workers never started (what a failed construction was before start-up
                    # moved out of it): nothing is left running, and nothing more can run.
                    self.close()
                raise
        else:
            if late_settle:
                self.scheduler.settle_cpu()
                if defer_check:
                    issue_check()
            window_part()
        out_w, lse_w = window["out"], window["lse"]
        if sparda is not None:
            # q in its own dtype: `attend` converts it only for a selection made now (no prefetch).
            sp_out, sp_lse = sparda.attend(layer, seq_ids, q_dev, qs)
            res_s = self._merge(out_w, lse_w, sp_out.contiguous(), sp_lse.contiguous())
            if not cuda:
                out_w, lse_w = res_s
        cpu_used = job is not None and job.cpu_used
        gpu_used = job is not None and job.gpu_used

        ev_m0 = timing(caller) if cuda and prof else None
        out = None
        if cuda:
            # One kernel merges the window with the lanes' parts -- the CPU lane's read through UVA
            # from the pinned buffer its workers wrote (no copy op) -- and writes the caller's dtype.
            parts = []
            if cpu_used and job.cpu_trailing:
                # The CPU tasks are still running: the stream waits for the workers' done count, then
                # one copy brings their results over (a DMA read of host memory at that point: the
                # merge's UVA loads, issued before the workers wrote, read stale lines now and then).
                self._wait_for_count(self._done_address, self.scheduler.cpu_lane_target(job), caller.cuda_stream)
                views.res_dev_flat.copy_(views.res_host_flat, non_blocking=True)
                parts.append(views.res_dev_parts)
            elif cpu_used:
                parts.append(views.res_uva_parts)
            if gpu_used and job.gpu_batches:
                last_end = job.gpu_batches[-1][1]
                if not isinstance(last_end, float):
                    caller.wait_event(last_end)
                if gout.device.type != "cuda":
                    # A GPU lane on the host (its executor computes there) beside a CUDA window: its
                    # step has ended, so its part is complete; one copy each brings it over.
                    parts.append((gout.to(out_w.device), glse.to(out_w.device)))
                else:
                    parts.append((gout, glse))
            if parts:
                # Straight into the caller's tensor where the kernel can write it; else in place.
                if q.device == out_w.device and q.dtype in self._merge_out_dtypes:
                    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                (o_b, l_b), (o_c, l_c) = parts[0], parts[1] if len(parts) > 1 else (None, None)
                self._merge_gpu(out_w, lse_w, o_b, l_b, out=out_w if out is None else out, lse=lse_w, validate=False,
                                out_c=o_c, lse_c=l_c)
                if cpu_used and self._qready_address is not None:
                    self._res_free.record(caller)  # the CPU lane's results are read: the next step may clear them
        else:
            if cpu_used:
                out_w, lse_w = self._merge(out_w, lse_w, cpu_out, cpu_lse)
            if gpu_used and job.gpu_batches:
                if gout.device.type == "cuda":
                    # A window on the host with the GPU lane on CUDA (`kv_cache.device: cpu`): the
                    # merge runs on the host, so it waits for the lane's last claim and copies.
                    last_end = job.gpu_batches[-1][1]
                    if not isinstance(last_end, float):
                        last_end.synchronize()
                    out_w, lse_w = self._merge(out_w, lse_w, gout.cpu(), glse.cpu())
                else:
                    out_w, lse_w = self._merge(out_w, lse_w, gout, glse)
        t_merge_issued = time.perf_counter()
        for executor in (self.cpu_executor, self.gpu_executor):
            merged = getattr(executor, "merged", None) if job is not None else None
            if merged is not None:
                merged(layer, seq_ids, lse_w)  # each head's final lse (EvoSparse's heat, on the device)
        ev_end = timing(caller) if cuda and prof else None
        if out is None:
            # On the host, or from a window graph, the window's result lives in a buffer the next
            # step rewrites: the caller gets a copy.
            out = out_w.to(device=q.device, dtype=q.dtype, copy=not cuda or window.get("graph", False))
        if job is not None and not job.cpu_trailing:
            self.scheduler.collect(job)  # bookkeeping, after the merge is queued (a trailing job: at the next step)
        if prof:
            gpu_events = [("window", window["ev0"], window["ev1"]), ("merge", ev_m0, ev_end)] if cuda else []
            self._timeline.record(
                layer=layer,
                batch=b,
                placement=self.scheduler.placement,
                t_entry=t_entry,
                ev_entry=ev_entry,
                tasks=tasks,
                columns=job.columns if job is not None else None,
                gpu_events=gpu_events,
                gpu_batches=job.gpu_batches if job is not None else [],
                t_end_host=time.perf_counter(),
                ev_end=ev_end,
                host_marks=(job.t_run, job.t_release, t_scheduler_return, t_merge_issued) if job is not None
                else (0.0, 0.0, 0.0, t_merge_issued),
            )
        return out

    def _decode_express(self, layer: int, seq_ids: list[int], q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor | None:
        """`decode` of a GPU-only step past the lanes' loop, or None (decided before anything changed)
        when the step must take the general path.

        The same device work as the general path's GPU-only step, in the same order on the device:
        the step-inputs kernel on the caller's stream (scaled q, the lane's buffers, q, k, v's
        NaN/inf counts into the deferred check's ring), the claim on the executor's stream after it,
        the window graph on the caller's stream beside the claim (nothing else runs there: the
        general path's high-priority side stream and its two joins would only add host time), then
        the merge behind the claim's end event. What it leaves out is host work: the `StepJob`, the
        split into queues, the GPU lane's loop and its retirement into the lane models (a GPU-only
        step of a whole-queue executor has no claim to size). The claim is retired by a later call
        (`ExpressClaims`); the last layer waits for every claim, as the general path's does. With
        `step_graphs_enabled` a step whose graph is captured (or due) replays window, claim and merge
        from it instead (step_graphs.py), the lagged copy from a second graph on the copy stream.
        """
        if self.cpu_executor is not None and self.scheduler.placement != "gpu_only":
            return None
        if self.finite_check == "sync" or not self.count_checks_in_inputs:
            return None
        dev = self.device
        if q.device != dev or k.device != dev or v.device != dev or self._will_spill(layer, seq_ids):
            return None
        store = self.store
        tasks = self._tasks(layer, seq_ids, self.planner(layer, seq_ids, store))
        if not tasks:
            return None
        picked = self.scheduler.express_claims(layer, tasks)
        if picked is None:
            return None
        express, (packed, ordered) = picked
        caller = current_stream()
        b, hq = len(seq_ids), self.geometry.q_heads
        ex = express.executor
        # The whole step from one graph (step_graphs.py) where one is captured or due: decided here,
        # before the window's rows advance the store.
        graphs, window, key, kv = self._step_graphs, None, None, None
        if graphs is not None and self.step_graphs_enabled and ex.graphs and ex.marks is None and \
                q.dtype in self._merge_out_dtypes and not ex.stale(layer, packed):
            entry = self._window_graphs.entry(layer, b)
            if entry is not None:
                direct = k.dtype == entry.k.dtype and v.dtype == entry.v.dtype and k.is_contiguous() and \
                    v.is_contiguous() and k.shape == entry.k.shape and v.shape == entry.v.shape
                kv = (k, v) if direct else None
                key = graphs.key(layer, b, packed, (k.data_ptr(), v.data_ptr()) if direct else None, q.dtype,
                                 (ex.lagged, ex.offload_selection, ex.fused_token_scores, ex.fused_attention,
                                  ex.fused_cache_update, ex.fused_block_scores))
                if graphs.wants(key, layer, b):
                    window = self._window_graphs.prepared(layer, seq_ids)
        views = self._step_views.get(b) or self._make_step_views(b)
        qs, gq, gout, glse = views.qs, views.gq, views.gout, views.glse
        check = self._input_check
        self._step_inputs(q, k, v, self.scale, qs, q_host=None, lane=(gq, gout, glse), counts=check.fused_row(),
                          stream=caller.cuda_stream)
        check.issue_counted({"q": q.numel(), "k": k.numel(), "v": v.numel()}, count_columns(b * hq), layer, seq_ids,
                            caller)
        if window is not None and kv is None:
            window.k.copy_(k)  # staged: the graph reads the window entry's buffers
            window.v.copy_(v)
        ready = self._express_ready
        ready.record(caller)
        stream = ex.stream
        stream.wait_event(ready)
        plan = ex.upload(packed, ordered, resident=True)
        step = Step(layer, gq, gout, glse, self.geometry.group_size)
        self.scheduler.express_steps += 1
        replayed = None
        if window is not None:
            fetched = ex._fetched[layer]
            if fetched is not None:
                stream.wait_event(fetched)  # a copy launched at this layer outside the graph
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            replayed = graphs.run(key, ex, plan, step, window, qs, kv, stream, len(ordered), q.dtype)
        if replayed is not None:
            end.record(stream)
            window.done.record(stream)
            handle = replayed.last = ex.replayed(plan, replayed.counts, start, end, replayed.copy)
            express.push(handle, layer, len(ordered))
            caller.wait_event(replayed.merged)
            out = replayed.out.clone()  # the graph's buffer: its next replay rewrites it
        else:
            handle = express.launch(plan, len(ordered), step, layer)
            if window is not None:  # its capture failed: the window kernels launched one by one
                self._window_graphs.kernels(layer, window, qs, *(kv or ()))
                window.done.record(caller)
                out_w, lse_w = window.out, window.lse
            else:
                out_w, lse_w = self._window_graphs.run(layer, seq_ids, qs, k, v, caller)
            caller.wait_event(handle.end)
            out = torch.empty(q.shape, dtype=q.dtype, device=dev) if q.dtype in self._merge_out_dtypes else None
            self._merge_gpu(out_w, lse_w, gout, glse, out=out_w if out is None else out, lse=lse_w, validate=False)
            if out is None:
                out = out_w.to(dtype=q.dtype, copy=True)  # the window graph's buffer: the next step rewrites it
        if layer == store.layers - 1:
            self.scheduler.lane.settle_express(self.scheduler.cfg.step_timeout_s, layer)
        return out

    # ------------------------------------------------------------------ introspection
    def probe_gpu_lane(
        self, layer: int, seq_ids: Sequence[int], claim_sizes: Sequence[int] | None = None, repeats: int = 5
    ) -> list[dict]:
        """Time the GPU lane alone on this step's tasks (`hybrid_runtime.lane_probe.probe_gpu_lane`:
        per claim size, host and CUDA-event times and bytes). Call it between decode steps."""
        from hybrid_runtime.lane_probe import probe_gpu_lane

        return probe_gpu_lane(self, layer, seq_ids, claim_sizes, repeats)

    def _probe_step(self, layer: int, seq_ids: Sequence[int]) -> tuple | None:
        """What a probe claims from (`lane_probe`): (GPU executor, this step's tasks, the step on the
        lane's buffers), or None when the step has no task. Settles earlier steps first: the probe's
        launches use the lane's buffers and ring slots."""
        self._check_open()
        self._finish_warm_up()
        ex = self.scheduler.lane.executor
        if ex is None:
            raise RuntimeError("probe_gpu_lane: the runtime has no GPU lane (scheduler.gpu_worker false, or 'auto' without CUDA)")
        if getattr(self.planner, "uses_queries", False):
            raise RuntimeError("probe_gpu_lane: the head planner plans from the step's queries (and keeps state per "
                               "step); probe with a planner that does not, e.g. a fixed policy")
        seq_ids = [int(s) for s in seq_ids]
        self.scheduler.settle()
        tasks = self._tasks(layer, seq_ids, self.planner(layer, seq_ids, self.store))
        if not tasks:
            return None
        b = len(seq_ids)
        return ex, tasks, Step(layer, self._gq[:b], self._gout[:b], self._glse[:b], self.geometry.group_size)

    def stats(self) -> dict:
        """Scheduler estimates and placement, for reports; the GPU lane's only where there is one."""
        sch = self.scheduler
        if not self._closed:
            sch.settle()  # the previous step's trailing work: its bytes and what the lanes learned
        stats = {
            "placement": sch.placement,
            "cpu_workers": sch.n_cpu,
            "gpu_worker": self.gpu_executor is not None,
            "pinning": sch.cores.note,
            "tensor_parallel": self.tensor_parallel.describe() if self.tensor_parallel is not None else None,
            "tp_cpu_worker_GBps": sch.tp_cpu_worker / 1e9,
            # The CPU lane as the fluxion claims see it: its rate from first task to last, and
            # the delay from the workers' release to their first task.
            "cpu_lane_GBps": sch.rates.cpu_lane.bytes_per_s / 1e9,
            "cpu_lane_start_us": sch.rates.cpu_start.seconds * 1e6,
            "cpu_workers_native": sch.native is not None,
            # The CPU workers' start-up (pinning, workspaces, numba's loop compiled or loaded): how
            # long it took in the background from construction, None until done, and how long
            # decode waited for it (the first step with CPU tasks; 0 when it was done by then).
            "worker_start_s": sch.workers.start_s,
            "worker_start_wait_s": sch.worker_start_wait_s,
            # The kernel warm-up (warmup.py) likewise: how long it took on its thread from the end
            # of construction, None until done, and how long decode waited for it (the first step,
            # before it waits for the CPU workers' start: the two waits add up).
            "warmup_s": self._warm_up.seconds,
            "warmup_wait_s": self._warm_up.wait_s,
            # Triton launches that went through the JIT since the first decode step, after the warm-up
            # (process-wide: other runtimes' count too; None before that step). On CUDA each is a variant or
            # an argument alignment the warm-up did not see, launched at the JIT's host cost on the
            # hot path (under Triton's interpreter every launch goes through it).
            "jit_launches_after_warmup": None if self._jit_launches_at_warmup is None
            else CachedLaunch.jit_launches - self._jit_launches_at_warmup,
            # ... by kernel and key (`gpu_kernels.launch._describe_key`), on CUDA: what the warm-up missed.
            "jit_kernels_after_warmup": self._jit_keys_since_warmup(),
            # Tasks whose attention idle workers helped with at the end of a step (native workers).
            "cpu_split_tasks": int(sch.native.split_tasks[0]) if sch.native is not None else 0,
            # CPU tasks that attended the GPU lane's block selection (scheduler.cpu_task_selection),
            # the selection launches, and positions handed back to host selection (a launch failed).
            "cpu_tasks_gpu_selected": int(sch.native.picked_tasks[0]) if sch.native is not None else 0,
            "gpu_selection_launches": sch.picks.launches if sch.picks is not None else 0,
            "gpu_selection_refused": sch.picks.refused if sch.picks is not None else 0,
            # Its learned latency (launch call to its end on the GPU), the launch call's own host
            # time, and the steps that read their metadata on the host because it would not pay.
            "gpu_selection_latency_us": sch.picks.latency.seconds * 1e6 if sch.picks is not None else 0.0,
            "gpu_selection_host_us": sch.picks.host_s.seconds * 1e6 if sch.picks is not None else 0.0,
            "gpu_selection_skipped_steps": sch.picks.skipped_steps if sch.picks is not None else 0,
            # Of those, the steps that paid but selected on the host to re-measure the CPU lane's own
            # rate, and the current interval between two of them (`GpuPicks.pays`).
            "gpu_selection_host_explore_steps": sch.picks.host_explore_steps if sch.picks is not None else 0,
            "gpu_selection_host_explore_after": sch.picks.host_explore_after if sch.picks is not None else 0,
            # Steps that returned before their CPU tasks ended (scheduler.cpu_lane_trails).
            "cpu_trailed_steps": sch.cpu_trailed_steps,
            # Steps whose CPU lane started on the device's word, released before q was on the host
            # (scheduler.cpu_lane_start).
            "cpu_lane_device_starts": sch.device_started_steps,
            # Steps without CPU tasks that returned before their GPU claims ended (`gpu_only_trails`).
            "gpu_trailed_steps": sch.gpu_trailed_steps,
            # GPU-only steps launched past the lanes' loop (`_decode_express`; not in gpu_trailed_steps).
            "express_steps": sch.express_steps,
            # When a NaN/inf input is reported (scheduler.finite_check), and the steps whose check
            # was deferred (read by a later call).
            "finite_check": self.finite_check,
            "deferred_input_checks": self._input_check.deferred_checks,
            # ... of them counted by the step-inputs kernel on its way (no launch of their own).
            "fused_input_checks": self._input_check.fused_checks,
            # Trailing steps that reserved no GPU claim because their CPU lane ended within the
            # launcher's time (scheduler.gate_trailing_claims), and that time (None until measured).
            "trailing_claims_gated": sch.trailing_claims_gated,
            "launcher_slack_us": sch.launcher_slack.seconds * 1e6 if sch.launcher_slack is not None else None,
            # Window parts replayed from a CUDA graph, and the graphs captured (kv_cache.window_graphs).
            "window_graph_replays": self._window_graphs.replays if self._window_graphs is not None else 0,
            "window_graph_captures": self._window_graphs.captures if self._window_graphs is not None else 0,
            # Of them, graphs that read the caller's k, v in place (the same tensors handed twice in a row).
            "window_graph_direct_captures": self._window_graphs.direct_captures if self._window_graphs is not None else 0,
            # GPU-lane claims replayed from a CUDA graph, and the graphs captured (scheduler.claim_launch
            # graphs); claims issued by the native launcher (descriptor kernels) and by the direct one
            # (planned kernels), and why each could not be built (None: it could, or was not asked for).
            "claim_graph_replays": getattr(self.gpu_executor, "graph_replays", 0),
            "claim_graph_captures": getattr(self.gpu_executor, "graph_captures", 0),
            "claim_native_launches": getattr(self.gpu_executor, "native_launches", 0),
            "claim_native_error": getattr(self.gpu_executor, "native_error", None),
            "claim_direct_launches": getattr(self.gpu_executor, "direct_launches", 0),
            "claim_direct_error": getattr(self.gpu_executor, "direct_error", None),
            # ... and the GPU's selections for the CPU lane issued by it.
            "gpu_selection_direct_launches": getattr(self.gpu_executor, "direct_picks", 0),
            # Bytes the CPU lane's tasks read since the runtime started (with profiling off too).
            "cpu_bytes_read": int(self.cpu_executor.bytes_read) if self.cpu_executor is not None else 0,
        }
        if self.sparda is not None:
            stats.update(self.sparda.stats())
        for executor in (self.cpu_executor, self.gpu_executor):
            if executor is not None and self.cfg.selection.name == "evosparse" and hasattr(executor, "stats"):
                stats.update(executor.stats())
        if sch.picks is not None:
            # What the steps on the GPU's selection learned (their own estimates,
            # `Scheduler.selection_rates`): the CPU lane's rate and start, the GPU lane's rate, the
            # claim's delay, the first claim's correction. Under cpu_task_selection "gpu" every
            # shared step is such a step, and the placement's own estimates below keep their priors.
            sel = sch.selection_rates()
            stats.update({
                "gpu_selection_cpu_lane_GBps": sel.cpu_lane.bytes_per_s / 1e9,
                "gpu_selection_tp_gpu_GBps": sel.gpu.bytes_per_s / 1e9,
                "gpu_selection_cpu_lane_start_us": sel.cpu_start.seconds * 1e6,
                "gpu_selection_claim_delay_us": sel.delay.seconds * 1e6,
                "gpu_selection_share_balance": sel.balance,
                # How much later the first CPU task starts on the selection than with host selection
                # (what `GpuPicks.pays` weighs the metadata's reading time against).
                "gpu_selection_later_start_us": (sel.cpu_first.seconds - sch.rates.cpu_first.seconds) * 1e6,
            })
        if self.gpu_executor is not None:
            stats.update({
                "gpu_executor": type(self.gpu_executor).__name__,
                "gpu_bytes_read": int(self.gpu_executor.bytes_read),
                # Metadata the GPU lane scored from the store's GPU copy (kv_cache.gpu_metadata):
                # device memory, not in gpu_bytes_read (host bytes).
                "gpu_device_bytes_read": int(getattr(self.gpu_executor, "device_bytes_read", 0)),
                "gpu_metadata_bytes": 0 if self.store.closed else self.store.memory_stats()["gpu_metadata_bytes"],
                "tp_gpu_GBps": sch.tp_gpu / 1e9,
                "gpu_launch_latency_us": sch.gpu_model.lat * 1e6,
                "gpu_claim_delay_us": sch.rates.delay.seconds * 1e6,
                "gpu_launch_GBps": sch.gpu_model.bw / 1e9,
                "gpu_link_GBps": sch.link_bw / 1e9 if sch.link_bw else None,
                "gpu_share": sch.gpu_share(),
                # The learned correction to the GPU's first claim, as a fraction of a step's bytes.
                "gpu_share_balance": sch.rates.balance,
            })
        return stats


__all__ = ["HybridRuntime", "window_attention_torch"]
