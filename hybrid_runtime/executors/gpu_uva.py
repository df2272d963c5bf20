"""GPU executor: tasks read the pinned CPU store through a UVA view, two kernel launches a claim.

Plan once per step, run many claims (FlashInfer's plan/run split): `upload` copies the step's
task table (rows in queue order, packed once per task set by the caller) to the device in one
copy; a claim of rows `[start, stop)` is then two launches on the executor's stream --
`score_select` (Quest scores, exact per-head top-k, group union; two launches itself when the
claim's rows are longer than one selection tile of all heads, `score_select.split_select`) and
`sparse_attention_claim` (attention over the union with the split combine fused) -- and one small copy of the union
sizes back to a pinned landing slot for byte accounting. No host synchronisation, no per-task
Python, no allocation: scratch buffers grow only at `upload`, when a step needs more than any
step before it. Every kernel variant is compiled by `warm_up` (or `compile_kernels`), before the first
decode step.

How a claim launches is `claim_launch` (`scheduler.claim_launch`). "plans" (the default): two
planned Triton launches (`LaunchPlan`). "native": the two launches read the claim -- its rows,
grids, table, step buffers and landing slot -- from a pinned descriptor row
(`gpu_kernels/claim_descriptor.py`), so every kernel argument is fixed per landing slot, and one
nogil numba call writes the row and issues the row's copy, both launches and the two timing events
through the CUDA driver (`gpu_kernels/native_claim.py`): 25-27 us of host time a claim on the
H200 against 99 as planned, yet slower layer-steps and TPOT in most same-run comparisons there
(benchmarks/notes/gpu_lane.md section 22). Where its launcher cannot be built (`native_error` says
why) claims launch as planned. "graphs": the descriptor kernels captured once per landing slot into
a CUDA graph, a claim one row write and one replay (section 15). Without CUDA the descriptor
kernels of "native" and "graphs" run directly under the interpreter (tests), as on CUDA if a
capture fails. "direct": the planned kernels -- direct arguments, grids sized to the claim -- issued
as "native" issues the descriptor ones, by one nogil numba call through the driver
(`gpu_kernels/direct_claim.py`), with the parameters a claim changes written over the step's; a
launcher per step argument set (table, q, arena, outputs), built at its first claim. Without CUDA
"direct" claims are planned launches.

Block metadata is scored from the store's GPU copy of it when the store keeps one
(`kv_cache.gpu_metadata`, `KVStore.enable_gpu_metadata`): a task then reads only the K and V of
its union over the link, about half of what it reads from the arena at blk 16 and budget 0.05.
Its `bytes_read` counts host bytes; the metadata read from device memory is `device_bytes_read`.

`run(tasks, step)` is the synchronous form of the same path for callers holding `Task` objects.
Without CUDA the kernels run under Triton's interpreter on the host arena (tests only; slow).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from cpu_kernels import layout
from gpu_kernels._checks import cdiv
from gpu_kernels.claim_descriptor import (
    DESC_COUNTS_HOST, DESC_PARTS, DESC_PPS, DESC_ROW0, DESC_ROW_STRIDE, DESC_SPLITS, DESC_TASKS, DESC_WORDS,
    claim_descriptor_launches,
    claim_programs,
)
from gpu_kernels.cuda_driver import DriverEvent, check, driver_api, driver_error, free_event_count, reserve_events
from gpu_kernels.direct_claim import MISSING, DirectClaim, DirectSelect
from gpu_kernels.launch import direct_launches_allowed
from gpu_kernels.native_claim import NativeClaim
from gpu_kernels.score_select import BLOCK_B, ScoreSelectPlan
from gpu_kernels.sparse_attention import MAX_SPLITS, SparseAttentionClaimPlan, SparseConfig, claim_splits
from gpu_kernels.streams import capture_graph, use_stream
from gpu_kernels.uva import uva_view
from gpu_kernels.task_table import StepTable, StepTableBuffer, pack_step_table, step_table_views
from hybrid_runtime import native_pool
from hybrid_runtime.task_building import native_table
from hybrid_runtime.tasks import Step, Task

log = logging.getLogger(__name__)


@dataclass
class GpuLaunch:
    """One queued claim: CUDA events around its launches and its byte accounting.

    `start`/`end` are CUDA events on CUDA (host floats under the interpreter). `wait` blocks until
    the claim finished and returns the bytes each of its tasks read from host memory, in claim
    order: K and V of its union, plus the metadata unless it was scored from the GPU copy. The
    byte arrays are made there, not at launch: the launch is on the lane's critical path.
    """

    executor: "GpuUvaExecutor"
    table: StepTable  # the step's table; the claim is its rows [row0, row0 + n_tasks)
    row0: int
    n_tasks: int
    ring: np.ndarray  # the executor's pinned landing slots when it launched (`_grow` may replace them)
    slot: int  # the claim's union sizes arrive in this row of `ring`
    start: object
    end: object
    # The metadata came from the store's GPU copy: not host bytes (counted in `device_bytes_read`).
    meta_on_device: bool = False
    bytes_read: np.ndarray | None = None

    def query(self) -> bool:
        return self.bytes_read is not None or isinstance(self.end, float) or self.end.query()

    def wait(self) -> np.ndarray:
        if self.bytes_read is None:
            if not isinstance(self.end, float):
                self.end.synchronize()
            ex, rows = self.executor, slice(self.row0, self.row0 + self.n_tasks)
            row_bytes = 2 * ex.head_dim * ex.esize  # K+V (or min+max) of one token-row of a head
            counts = self.ring[self.slot, :self.n_tasks].astype(np.int64)
            self.bytes_read = counts * (self.table.block_size[rows] * row_bytes)
            meta_bytes = self.table.n_blocks[rows] * row_bytes
            if self.meta_on_device:
                ex.device_bytes_read += int(meta_bytes.sum())
            else:
                self.bytes_read += meta_bytes
            ex.bytes_read += int(self.bytes_read.sum())
        return self.bytes_read


class MetadataSource(NamedTuple):
    """Where a claim scores blocks from: the arena's view, or the store's GPU copy of the metadata."""

    tensor: torch.Tensor
    layout: tuple[int, int]  # (rows per chunk, first metadata row), `score_select`'s `meta_layout`
    on_device: bool  # the GPU copy: its reads are not host bytes


class DirectLaunchers:
    """Direct launchers (`gpu_kernels/direct_claim.py`) by step argument set -- None where one
    cannot be built -- at most `limit` of them (all dropped when there are more), and the rebuilds
    each set needed after a launch found one of its kernels uncompiled."""

    def __init__(self, limit: int, rebuilds: int):
        self.limit, self.rebuilds_allowed = limit, rebuilds
        self.launchers: dict = {}
        self.rebuilds: dict = {}

    def get(self, key: tuple, build) -> object | None:
        """`key`'s launcher, made by `build()` at its first use."""
        launcher = self.launchers.get(key, self)  # self: not built yet
        if launcher is self:
            launcher = build()
            if len(self.launchers) >= self.limit:
                self.launchers.clear()
            self.launchers[key] = launcher
        return launcher

    def missing(self, key: tuple) -> bool:
        """A launch of `key`'s launcher found a kernel uncompiled (and issued nothing; the caller
        launches it as planned, which compiles it): the launcher is rebuilt at its next use, or,
        once it has been rebuilt `rebuilds_allowed` times, never again (None is kept: launches of
        this set go planned). True in that last case."""
        self.launchers.pop(key, None)
        self.rebuilds[key] = self.rebuilds.get(key, 0) + 1
        if self.rebuilds[key] > self.rebuilds_allowed:
            self.launchers[key] = None
            return True
        return False

    def clear(self) -> None:
        self.launchers.clear()
        self.rebuilds.clear()


class GpuUvaExecutor:
    """Executor protocol (`device = "gpu"`) over a `KVStore`'s arenas, with claim launches."""

    device = "gpu"
    # A claim reads only the step's buffers and the pinned arena and its `wait` only counts bytes:
    # the GPU lane may return from a step before the claim ended and retire it later (`GpuLane.trails`).
    retire_later = True

    # How a claim's kernels are launched (`scheduler.claim_launch`): "plans" -- two planned Triton
    # launches (`LaunchPlan`); "native" -- the descriptor kernels issued by one numba call through
    # the CUDA driver (`gpu_kernels/native_claim.py`); "graphs" -- the descriptor kernels replayed
    # from a CUDA graph per landing slot; "direct" -- the planned kernels issued by one numba call
    # through the CUDA driver (`gpu_kernels/direct_claim.py`).
    CLAIM_LAUNCHES = ("plans", "native", "graphs", "direct")
    # Step argument sets whose direct launchers are kept (all dropped when there are more): a few
    # per layer (the step's table, q, arena and outputs are the runtime's persistent buffers).
    DIRECT_STEPS = 1024
    # A step argument set whose launcher still lacks a kernel after this many claims launched as
    # planned (which compile it) launches as planned from then on (`direct_error` says why).
    DIRECT_REBUILDS = 3
    # Driver events kept ready for native claims, topped up whenever `claim_launch` is set to native.
    # A claim's two events stay alive until the runtime's timeline resolves its step (some 64
    # steps later, `Timeline.RESOLVE_LAG`; all of them when a report reads the timeline after a long
    # run), so with a few claims a step hundreds are in use before the first handles come back to the
    # free list; a dry list creates `cuda_driver.EVENT_BATCH` at
    # once (32 driver calls) on the launcher's path. The measured native runs (benchmarks/notes/
    # gpu_lane.md section 22) had 32 ready, and so paid such a batch every 16 claims until then.
    NATIVE_EVENTS = 4096

    def __init__(self, store, stream: "torch.cuda.Stream | None" = None, config: SparseConfig | None = None,
                 claim_launch: str = "plans"):
        self.store = store
        self.cuda = torch.cuda.is_available()
        self.dev = torch.device("cuda") if self.cuda else torch.device("cpu")
        self.stream = stream if stream is not None or not self.cuda else torch.cuda.Stream()
        self._stream_handle = self.stream.cuda_stream if self.cuda else None
        self._config = config or SparseConfig()
        self.bytes_read = 0  # from host memory (the pinned arena), over the link
        self.device_bytes_read = 0  # metadata scored from the store's GPU copy (`kv_cache.gpu_metadata`)
        self._use_gpu_metadata = True
        self.launches = 0
        self.picks = 0  # selection launches for the CPU lane (`pick`)
        # The rows `pick` writes (`GpuPicks.views`), set by the runtime that uses it: its variant is
        # then compiled with the others (`compile_kernels`).
        self.pick_rows: tuple | None = None
        self.link_bytes_per_s: float | None = None  # measured by warm_up (CUDA only)
        self.group_size = store.geometry.group_size
        self.head_dim = store.head_dim
        self.esize = torch.tensor([], dtype=store.dtype).element_size()
        self._tables = StepTableBuffer(self.dev)
        self._resident: dict[int, tuple] = {}
        # Packed tables passed as `resident` once so far (id -> table): a second use makes them resident.
        self._seen_once: dict[int, np.ndarray] = {}
        self._claim_launch = "plans"
        self.claim_launch = claim_launch
        self._graphs: list = [None] * self.RING  # per landing slot, captured by `_capture`
        self.graph_replays = 0
        self.graph_captures = 0
        self.capture_error: str | None = None  # after a failed capture the descriptor kernels launch directly
        # Native launchers per metadata layout (None: not possible, `native_error` says why), and
        # the step words of the step being claimed (`_native_step`).
        self._native: dict = {}
        self._step_words: tuple | None = None
        self.native_launches = 0
        self.native_error: str | None = None
        # Direct launchers of the claims and of the CPU lane's selection (`pick`) per step argument
        # set (`direct_error` says why one could not be built), and the claimed step's (`_direct_step`).
        self._direct = DirectLaunchers(self.DIRECT_STEPS, self.DIRECT_REBUILDS)
        self._direct_picks = DirectLaunchers(self.DIRECT_STEPS, self.DIRECT_REBUILDS)
        self._direct_words: tuple | None = None
        self.direct_launches = 0
        self.direct_picks = 0
        self.direct_error: str | None = None
        # One descriptor row per landing slot (made whatever `claim_launch`, which may be switched):
        # a claim's row is rewritten only after the claim that last used the slot was retired
        # (the ring's rule), so never while a kernel reads it.
        self._desc = torch.zeros((self.RING, DESC_ROW_STRIDE), dtype=torch.int64, pin_memory=self.cuda)[:, :DESC_WORDS]
        self._desc_np = self._desc.numpy()
        # Each claim's row is copied to the device first (one 128-byte copy, in the graph too): read
        # through UVA by every program of both launches it cost ~0.13 ms of GPU time a claim
        # (measured on the H100 at b09f43e: fixed cost 255 us against the direct launches' 126).
        self._desc_dev = torch.zeros((self.RING, DESC_ROW_STRIDE), dtype=torch.int64, device=self.dev)[:, :DESC_WORDS] \
            if self.cuda else self._desc
        # Only their dtypes matter (the kernels take the addresses from the descriptor).
        self._carriers = (torch.empty(1, dtype=torch.float32, device=self.dev),
                          torch.empty(1, dtype=store.dtype, device=self.dev),
                          torch.empty(1, dtype=torch.int32, device=self.dev))
        self._programs = claim_programs(self.dev, self._config)
        self._work = torch.zeros(4, dtype=torch.int32, device=self.dev)  # the descriptor launches' item counters
        # A descriptor row no claim uses: compiling a variant for the native launcher runs a claim
        # of no tasks from it (all zeros), beside claims in flight.
        self._desc_idle = torch.zeros(DESC_WORDS, dtype=torch.int64, device=self.dev)
        self._capture_stream = torch.cuda.Stream() if self.cuda else None
        # `pick` launches here, not on the lane's stream: there it would queue behind the previous
        # layer's trailing claims while the CPU workers wait for it (0.3 ms of the workers' start
        # at 8 x 32K on the H200, benchmarks/notes/gpu_lane.md section 17). High priority: the
        # claims' programs are then scheduled after its.
        self._pick_stream = torch.cuda.Stream(priority=-1) if self.cuda else None
        self._upload_done = None
        self._tasks_cap = 0
        self._blocks_cap = 0
        self._grow(max(1, store.cfg.max_sequences * store.kv_heads), 256)

    @property
    def config(self) -> SparseConfig:
        """The claim kernels' launch shape; a new one drops the claim graphs (captured with the old)."""
        return self._config

    @config.setter
    def config(self, config: SparseConfig) -> None:
        if config == self._config:
            return
        self._drop_graphs()
        self._config = config
        self._programs = claim_programs(self.dev, config)

    @property
    def claim_launch(self) -> str:
        return self._claim_launch

    @claim_launch.setter
    def claim_launch(self, mode: str) -> None:
        """Switching to native claims on CUDA tops the driver events up to `NATIVE_EVENTS` now (on
        the caller's thread, whose CUDA context they join), not inside claims."""
        if mode not in self.CLAIM_LAUNCHES:
            raise ValueError(f"claim_launch {mode!r}; allowed: {', '.join(self.CLAIM_LAUNCHES)}")
        self._claim_launch = mode
        if mode in ("native", "direct") and self.cuda and driver_api() is not None:
            reserve_events(max(0, self.NATIVE_EVENTS - free_event_count()))

    @property
    def use_gpu_metadata(self) -> bool:
        """Score blocks from the store's GPU copy of the metadata when it keeps one
        (`KVStore.enable_gpu_metadata`); false reads it from the arena over the link (benchmarks
        compare the two). A change drops the claim graphs (captured with the other source)."""
        return self._use_gpu_metadata

    @use_gpu_metadata.setter
    def use_gpu_metadata(self, on: bool) -> None:
        if bool(on) != self._use_gpu_metadata:
            self._drop_graphs()
            self._use_gpu_metadata = bool(on)

    def _metadata_source(self, layer: int, arena: torch.Tensor) -> MetadataSource:
        meta = self.store.metadata_gpu(layer) if self._use_gpu_metadata else None
        if meta is None:
            return MetadataSource(arena, (layout.CHUNK_ROWS, layout.META_ROW), False)
        return MetadataSource(meta, (layout.META_ROWS, 0), True)

    def _drop_graphs(self) -> None:
        """Forget the claim graphs (recaptured on their next use), once none is being replayed, and
        the native launchers (their parameters point at the buffers being replaced; rebuilt at
        their next use)."""
        if self.cuda and any(gr is not None for gr in self._graphs):
            self.stream.synchronize()
        self._graphs = [None] * self.RING
        self._native = {}
        self._step_words = None
        self._direct.clear()
        self._direct_picks.clear()
        self._direct_words = None

    # ------------------------------------------------------------------ buffers
    # Landing slots for the union sizes of launches in flight (one per launch, reused in turn).
    RING = 8

    def prepare(self, packed: tuple) -> None:
        """Ready a packed table (`pack`) that steps will reuse before the first of them: grow the
        claims' scratch for it and make its resident device copy now, rather than in `upload` at
        its first and second steps. A growth allocates device and pinned memory and drops the
        claim graphs, and the copy allocates device memory: work for a caller with no claim in
        flight (a prefill: `HybridRuntime.prepare_decode`), not for a decode step's critical path."""
        data, n_blocks = packed[0], packed[1]
        if n_blocks.shape[0]:
            self._grow(int(n_blocks.shape[0]), int(n_blocks.max()))
        key = id(data)
        hit = self._resident.get(key)
        if hit is not None and hit[0] is data:
            return
        self._seen_once.pop(key, None)
        while len(self._resident) >= self.RESIDENT:
            self._resident.pop(next(iter(self._resident)))
        self._resident[key] = (data, self._resident_table(packed))
        if self.cuda:
            # A step that finds the copy resident gives `pick` (its own stream) no event to wait for.
            self._pick_stream.wait_event(self._upload_done)
        self._upload_done = None

    def _grow(self, tasks: int, blocks: int) -> None:
        """Scratch for claims of up to `tasks` tasks of up to `blocks` blocks (at plan time only)."""
        # Powers of two: few regrowths, and the block capacity (a kernel argument) stays a
        # multiple of 16, so Triton's specialisation -- and the compiled kernel -- never changes.
        tasks = max(tasks, self._tasks_cap)
        blocks = max(1 << max(0, int(blocks) - 1).bit_length(), 16, self._blocks_cap)
        if (tasks, blocks) == (self._tasks_cap, self._blocks_cap):
            return
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)  # old scratch may still be read
            torch.cuda.current_stream().wait_stream(self._pick_stream)
        self._drop_graphs()  # they read the old scratch
        g, d, dev = self.group_size, self.head_dim, self.dev
        self._scores = torch.empty((tasks, g, blocks), dtype=torch.float32, device=dev)
        # `pick`'s own scores and tickets (it runs on its own stream, beside the claims): made at its
        # first use after a growth (`_pick_select`), so a runtime that never picks holds none.
        self._ublocks = torch.empty((tasks, blocks), dtype=torch.int32, device=dev)
        self._uheads = torch.empty((tasks, blocks), dtype=torch.int32, device=dev)
        self._counts = torch.zeros(tasks, dtype=torch.int32, device=dev)
        self._tickets = torch.zeros((2, tasks), dtype=torch.int32, device=dev)
        self._part_out = torch.empty((tasks, MAX_SPLITS, g, d), dtype=torch.float32, device=dev)
        self._part_lse = torch.empty((tasks, MAX_SPLITS, g), dtype=torch.float32, device=dev)
        self._ring = torch.zeros((self.RING, tasks), dtype=torch.int32, pin_memory=self.cuda)
        # The select kernel writes union sizes straight into these pinned slots through a UVA view.
        self._ring_dev = uva_view(self._ring) if self.cuda else self._ring
        self._ring_np = self._ring.numpy()
        self._ring_users: list[GpuLaunch | None] = [None] * self.RING
        # The claim's two launches planned over this scratch (`LaunchPlan`): a few microseconds of
        # host time each instead of tens, on the launcher's path during a step.
        self._select_plan = ScoreSelectPlan(self._scores, self._tickets[0])
        self._attend_plan = SparseAttentionClaimPlan(self._ublocks, self._uheads, self._counts, self._part_out,
                                                     self._part_lse, self._tickets[1])
        self._pick_plan = None
        self._tasks_cap, self._blocks_cap = tasks, blocks
        if self.cuda:
            # Made (and the tickets and counts zeroed) on the caller's stream: the claims that use
            # them run on the lane's, after these.
            self.stream.wait_stream(torch.cuda.current_stream())

    def _pick_select(self) -> ScoreSelectPlan:
        """`pick`'s selection launch, planned over scores and tickets of its own at the claims'
        current capacity."""
        if self._pick_plan is None:
            # Made on the selection's stream: its zeroed tickets are ordered before the kernel there.
            with use_stream(self._pick_stream) if self.cuda else contextlib.nullcontext():
                scores = torch.empty(self._scores.shape, dtype=torch.float32, device=self.dev)
                tickets = torch.zeros(self._tasks_cap, dtype=torch.int32, device=self.dev)
            self._pick_plan = ScoreSelectPlan(scores, tickets)
        return self._pick_plan

    def _arena(self, layer: int) -> torch.Tensor:
        return self.store.arena_cuda(layer) if self.cuda else self.store.arena(layer)

    # ------------------------------------------------------------------ plan
    def pack(self, tab: np.ndarray, nsel: np.ndarray, chunks: np.ndarray) -> tuple:
        """A queue's tasks in queue order (`native_table` columns), validated and packed; the
        caller caches it with the task set."""
        return pack_step_table(tab[:, native_pool.T_BATCH], tab[:, native_pool.T_KVHEAD], tab[:, native_pool.T_BLOCK],
                               tab[:, native_pool.T_CPULEN], tab[:, native_pool.T_CHUNK_OFF],
                               tab[:, native_pool.T_N_CHUNKS], nsel, self.store.n_chunks, chunks)

    # Resident tables kept (least recently used dropped first): a few task sets per layer.
    RESIDENT = 256

    def upload(self, packed: tuple, ordered: Sequence[Task] = (), resident: bool = False) -> StepTable:
        """The packed table as the step's plan on the device, ordered on the executor's stream.

        `resident`: `packed` may be reused across steps (cached with its task set). Its first use
        goes through the pinned staging buffer like any other (asynchronous); from its second use
        on it has a device copy of its own, made then and kept, so a step that reuses the task set
        copies nothing. A task set used once -- a new head plan every step -- never pays for a
        device copy of its own. Otherwise one copy through the pinned staging buffer.
        """
        data, n_blocks, union_pages, block_size = packed
        if n_blocks.shape[0]:
            self._grow(int(n_blocks.shape[0]), int(n_blocks.max()))
        self._upload_done = None  # this step's table copy, if it makes one (`pick` waits for it)
        if resident:
            key = id(data)
            hit = self._resident.pop(key, None)
            if hit is not None and hit[0] is data:
                self._resident[key] = hit  # most recently used last
                return hit[1]
            if self._seen_once.pop(key, None) is data:  # its second use: worth a copy of its own
                while len(self._resident) >= self.RESIDENT:
                    self._resident.pop(next(iter(self._resident)))
                hit = self._resident[key] = (data, self._resident_table(packed))
                return hit[1]
            while len(self._seen_once) >= self.RESIDENT:
                self._seen_once.pop(next(iter(self._seen_once)))
            self._seen_once[key] = data  # held (bounded) so that its id is not reused meanwhile
        if self.cuda:
            with torch.cuda.stream(self.stream):
                table = self._tables.upload(data, n_blocks, union_pages, block_size, self.group_size)
                self._upload_done = torch.cuda.Event()
                self._upload_done.record(self.stream)
            return table
        return self._tables.upload(data, n_blocks, union_pages, block_size, self.group_size)

    def _resident_table(self, packed: tuple) -> StepTable:
        """A device copy of `packed` of its own (made once per task set, on the executor's stream).

        Staged through the pinned buffer, then copied on the device, both queued on the executor's
        stream: a copy straight from the packed (pageable) array would make the host wait for it,
        and that stream already waits for this step's q -- the host would lose its lead over the
        device at every layer of the step that makes the copy (each task set's second step)."""
        data, n_blocks, union_pages, block_size = packed
        if self.cuda:
            with torch.cuda.stream(self.stream):
                staged = self._tables.stage(data)
                dev = torch.empty(staged.shape, dtype=staged.dtype, device=self.dev)
                dev.copy_(staged, non_blocking=True)
                self._upload_done = torch.cuda.Event()  # `pick` reads the copy from its own stream
                self._upload_done.record(self.stream)
        else:
            dev = torch.from_numpy(data).clone()
        return step_table_views(dev, n_blocks, union_pages, block_size, self.group_size)

    # ------------------------------------------------------------------ run
    def launch(self, table: StepTable, start: int, stop: int, step: Step) -> GpuLaunch:
        """Queue rows `[start, stop)` of `table` on the executor's stream; returns at once.

        The stream must already wait for `step.q` (the caller records that dependency once per
        step). Results land in `step.out/lse` rows of the claimed tasks' heads.
        """
        n = stop - start
        if not 0 <= start < stop <= table.n_tasks:
            raise ValueError(f"claim [{start}, {stop}) of a table of {table.n_tasks} tasks")
        if n > self._tasks_cap:
            raise ValueError(f"claim of {n} tasks; the executor was planned for {self._tasks_cap}")
        slot = self.launches % self.RING
        prev = self._ring_users[slot]
        if prev is not None and prev.bytes_read is None:
            raise RuntimeError(f"more than {self.RING} launches in flight; wait for earlier launches first")
        if self._claim_launch == "native" and self.cuda:
            handle = self._launch_native(table, start, stop, step, slot)
            if handle is not None:
                return handle
        elif self._claim_launch == "direct" and self.cuda:
            handle = self._launch_direct(table, start, stop, step, slot)
            if handle is not None:
                return handle
        nb_max, pages_max = table.claim_shape(start, stop)
        arena = self._arena(step.layer)
        meta = self._metadata_source(step.layer, arena)
        if self.cuda:
            # Fresh events: the timeline resolves them after later launches have run. Everything is
            # issued on the lane's stream by handle: no stream switch, no copy to queue.
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record(self.stream)
            self._kernels(table, start, n, nb_max, pages_max, step, arena, meta, slot)
            ev1.record(self.stream)
        else:
            import time

            ev0 = time.perf_counter()
            self._kernels(table, start, n, nb_max, pages_max, step, arena, meta, slot)
            ev1 = time.perf_counter()
        handle = GpuLaunch(self, table, start, n, self._ring_np, slot, ev0, ev1, meta_on_device=meta.on_device)
        self._ring_users[slot] = handle
        self.launches += 1
        return handle

    def _launch_native(self, table: StepTable, start: int, stop: int, step: Step, slot: int) -> GpuLaunch | None:
        """The claim issued by one native call (`gpu_kernels/native_claim.py`); None where this
        step's kernel variant has no native launcher (the caller launches it another way)."""
        words = self._step_words
        if words is None or words[0] is not table or words[1] is not step:
            words = self._step_words = self._native_step(table, step)
        native, template, on_device = words[2], words[3], words[4]
        if native is None:
            return None
        ev0, ev1 = DriverEvent(), DriverEvent()
        code = native(table.n_blocks, table.union_pages, start, stop, slot, self._desc_np, template, ev0.cuda_event,
                      ev1.cuda_event)
        if code:
            check(code, f"the GPU lane's native launch of claim [{start}, {stop})")
        handle = GpuLaunch(self, table, start, stop - start, self._ring_np, slot, ev0, ev1, meta_on_device=on_device)
        self._ring_users[slot] = handle
        self.launches += 1
        self.native_launches += 1
        return handle

    def _launch_direct(self, table: StepTable, start: int, stop: int, step: Step, slot: int) -> GpuLaunch | None:
        """The claim's planned kernels issued by one native call (`gpu_kernels/direct_claim.py`);
        None where that cannot be done for it (the caller launches it as planned)."""
        if not direct_launches_allowed():
            return None
        words = self._direct_words
        if words is None or words[0] is not table or words[1] is not step:
            words = self._direct_words = self._direct_step(table, step)
        direct = words[2]
        if direct is None:
            return None
        ev0, ev1 = DriverEvent(), DriverEvent()
        code = direct(table.n_blocks, table.union_pages, start, stop, slot, ev0.cuda_event, ev1.cuda_event)
        if code == MISSING:
            self._direct_words = None
            self._direct_missing(self._direct, words[3], "the claims")
            return None
        if code:
            check(code, f"the GPU lane's direct launch of claim [{start}, {stop})")
        handle = GpuLaunch(self, table, start, stop - start, self._ring_np, slot, ev0, ev1, meta_on_device=words[4])
        self._ring_users[slot] = handle
        self.launches += 1
        self.direct_launches += 1
        return handle

    def _direct_step(self, table: StepTable, step: Step) -> tuple:
        """(table, step, direct launcher, its key, metadata on the device) for the claims of a step:
        the launcher of the step's argument set, built at the first claim that uses the set."""
        arena = self._arena(step.layer)
        meta = self._metadata_source(step.layer, arena)
        q = step.q
        key = (table.table.data_ptr(), table.n_select.data_ptr(), table.chunks.data_ptr(), q.data_ptr(), q.stride(0),
               q.stride(1), q.shape[1], q.shape[2], arena.data_ptr(), arena.dtype, meta.tensor.data_ptr(), meta.layout,
               step.out.data_ptr(), step.lse.data_ptr())
        direct = self._direct.get(key, lambda: self._build_direct(
            "claims", lambda api: self._direct_claim(api, table, step, arena, meta)))
        return table, step, direct, key, meta.on_device

    def _direct_claim(self, api, table: StepTable, step: Step, arena: torch.Tensor,
                      meta: MetadataSource) -> DirectClaim | str:
        fused, score, heads, split_above = self._select_plan.claim_calls(
            table.table, table.n_select, table.chunks, step.q, meta.tensor, self._ublocks, self._uheads, self._counts,
            self._ring_dev[0], meta_layout=meta.layout)
        attend = self._attend_plan.claim_call(table.table, table.chunks, step.q, arena, step.out, step.lse,
                                              self.config)
        return DirectClaim.build(api, (fused, score, heads, attend), self._stream_handle, self._ring_dev, self.config,
                                 split_above)

    def _build_direct(self, what: str, build) -> DirectClaim | DirectSelect | None:
        """`build(api)`: a direct launcher of `what` (claims or the CPU lane's selection) over the
        current scratch, or None -- with the reason in `direct_error` -- where the driver or the
        kernels do not allow it."""
        api = driver_api()
        result = (driver_error() or "no CUDA driver") if api is None else build(api)
        if isinstance(result, str):
            if self.direct_error is None:
                log.warning("GPU lane: %s cannot be launched directly (%s); they launch as planned Triton launches",
                            what, result)
            self.direct_error = result
            return None
        return result

    def _direct_missing(self, launchers: DirectLaunchers, key: tuple, what: str) -> None:
        """A direct launch of `what` found a kernel uncompiled for the step's arguments (nothing was
        issued; the caller launches it as planned, which compiles it)."""
        if launchers.missing(key):
            self.direct_error = f"a kernel of {what} stayed uncompiled after {self.DIRECT_REBUILDS} planned launches"
            log.warning("GPU lane: %s; those launch as planned", self.direct_error)

    def _native_step(self, table: StepTable, step: Step) -> tuple:
        """(table, step, launcher, descriptor words of the step, metadata on the device): what every
        native claim of this step shares, made at its first claim."""
        arena = self._arena(step.layer)
        meta = self._metadata_source(step.layer, arena)
        native = self._native.get(meta.layout)
        if native is None and meta.layout not in self._native:
            native = self._build_native(meta.layout)
        return table, step, native, self._step_template(table, step, arena, meta.tensor), meta.on_device

    @staticmethod
    def _step_template(table: StepTable, step: Step, arena: torch.Tensor, meta: torch.Tensor) -> np.ndarray:
        """The descriptor words every claim of a step shares (`_write_descriptor` writes the same
        words, and the claim's own, per claim); the claim's words are left zero."""
        q = step.q
        return np.array((table.table.data_ptr(), table.n_select.data_ptr(), table.chunks.data_ptr(), 0, 0, 0, 0, 0,
                         arena.data_ptr(), 0, q.data_ptr(), q.stride(0), q.stride(1), step.out.data_ptr(),
                         step.lse.data_ptr(), q.shape[1], meta.data_ptr()), dtype=np.int64)

    def _build_native(self, meta_layout: tuple[int, int]) -> "NativeClaim | None":
        """The native launcher of `meta_layout`'s kernel variant over the current buffers (compiling
        the variant first if no claim did yet), or None -- with the reason in `native_error` --
        where the driver or the kernels do not allow it. Off the hot path: at warm-up, and after
        `_grow` replaced the buffers (a step larger than any before)."""
        api = driver_api()
        result = driver_error() or "no CUDA driver" if api is None else None
        if result is None:
            slot_launches = [self._descriptor_launches(self._desc_dev[slot], meta_layout) for slot in range(self.RING)]
            if slot_launches[0][0].compiled() is None or slot_launches[0][1].compiled() is None:
                # Compile the variant with a claim of no tasks, from a row no claim uses.
                with use_stream(self.stream):
                    for launch in self._descriptor_launches(self._desc_idle, meta_layout):
                        launch()
            result = NativeClaim.build(api, slot_launches, self._stream_handle, self._desc, self._desc_dev,
                                       self._ring_dev, self._config)
        if isinstance(result, str):
            if self.native_error is None:
                log.warning("GPU lane: claims cannot be launched natively (%s); they launch as planned Triton launches",
                            result)
            self.native_error = result
            result = None
        self._native[meta_layout] = result
        return result

    def pick(self, table: StepTable, start: int, stop: int, step: Step, ublocks: torch.Tensor, uheads: torch.Tensor,
             counts: torch.Tensor, ready: torch.Tensor, stamp: int, after: object = None,
             split: bool | None = None) -> object:
        """Queue the block selection of rows `[start, stop)` for the CPU lane (`hybrid_runtime.gpu_picks`):
        row `start + t`'s union lands in row t of `ublocks`/`uheads` (device views of pinned host
        rows, at least the rows' block count wide), its size in `counts[t]`, then `stamp` in
        `ready[t]`. One `score_select` launch with scratch of its own, on a stream of its own that
        waits for `after` (the CUDA event after which `step.q` and the store's metadata are ready)
        and for this step's table copy, if `upload` made one -- not for the claims on the lane's
        stream. Its metadata bytes count as a claim's do (`device_bytes_read` from the GPU copy).
        `split`: the selection's form (`score_select.split_select` when None). Returns a CUDA event
        recorded after it (None without CUDA)."""
        n = stop - start
        if not 0 <= start < stop <= table.n_tasks:
            raise ValueError(f"selection of rows [{start}, {stop}) of a table of {table.n_tasks} tasks")
        nb_max, _ = table.claim_shape(start, stop)
        if n > self._tasks_cap or nb_max > min(self._blocks_cap, ublocks.shape[1]):
            raise ValueError(f"selection of {n} tasks of up to {nb_max} blocks; the executor was planned for "
                             f"{self._tasks_cap} of {self._blocks_cap} and the union rows hold {ublocks.shape[1]}")
        arena = self._arena(step.layer)
        meta = self._metadata_source(step.layer, arena)
        end = None
        if self._claim_launch == "direct" and self.cuda and split is None:
            end = self._pick_direct(table, start, stop, step, meta, ublocks, uheads, counts, ready, stamp, after)
        if end is None:
            stream = None
            if self.cuda:
                if after is not None:
                    self._pick_stream.wait_event(after)
                if self._upload_done is not None:
                    self._pick_stream.wait_event(self._upload_done)
                stream = self._pick_stream.cuda_stream
            self._pick_select()(table.table, table.n_select, table.chunks, start, n, nb_max, step.q, meta.tensor,
                                ublocks, uheads, counts, counts, stream, meta_layout=meta.layout, ready=ready,
                                stamp=stamp, split=split)
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)  # timed: `GpuPicks.learn` maps it to host time
                end.record(self._pick_stream)
        meta_bytes = int(table.n_blocks[start:stop].sum()) * 2 * self.head_dim * self.esize
        if meta.on_device:
            self.device_bytes_read += meta_bytes
        else:
            self.bytes_read += meta_bytes
        self.picks += 1
        return end

    def _pick_direct(self, table: StepTable, start: int, stop: int, step: Step, meta: MetadataSource, ublocks, uheads,
                     counts, ready, stamp: int, after: object) -> DriverEvent | None:
        """`pick`'s selection issued by one native call (`DirectSelect`); its end event, or None
        where that cannot be done for it (nothing issued: the caller launches it as planned)."""
        if not direct_launches_allowed():
            return None
        q = step.q
        key = (table.table.data_ptr(), table.n_select.data_ptr(), table.chunks.data_ptr(), q.data_ptr(), q.stride(0),
               q.stride(1), q.shape[1], q.shape[2], meta.tensor.data_ptr(), meta.tensor.dtype, meta.layout,
               ublocks.stride(0))
        direct = self._direct_picks.get(key, lambda: self._build_direct(
            "the CPU lane's selections", lambda api: self._direct_select(api, table, step, meta, ublocks, uheads, counts,
                                                                          ready)))
        if direct is None:
            return None
        rows = np.array((ublocks.data_ptr(), uheads.data_ptr(), counts.data_ptr(), ready.data_ptr()), dtype=np.int64)
        upload = self._upload_done
        end = DriverEvent()
        code = direct(table.n_blocks, start, stop, int(stamp), rows, 0 if after is None else after.cuda_event,
                      0 if upload is None else upload.cuda_event, end.cuda_event)
        if code == MISSING:
            self._direct_missing(self._direct_picks, key, "the CPU lane's selections")
            return None
        if code:
            check(code, f"the GPU lane's direct selection of rows [{start}, {stop}) for the CPU lane")
        self.direct_picks += 1
        return end

    def _direct_select(self, api, table: StepTable, step: Step, meta: MetadataSource, ublocks, uheads, counts,
                       ready) -> DirectSelect | str:
        fused, score, heads, split_above = self._pick_select().claim_calls(
            table.table, table.n_select, table.chunks, step.q, meta.tensor, ublocks, uheads, counts, counts,
            meta_layout=meta.layout, ready=ready)
        return DirectSelect.build(api, (fused, score, heads), self._pick_stream.cuda_stream, split_above)

    def _kernels(self, table: StepTable, start: int, n: int, nb_max: int, pages_max: int, step: Step, arena,
                 meta: MetadataSource, slot: int) -> None:
        meta_layout = meta.layout
        # Without CUDA, native claims run the descriptor kernels they would launch (under the
        # interpreter); on CUDA, a claim the native launcher cannot issue is launched as planned.
        if self._claim_launch == "graphs" or (self._claim_launch == "native" and not self.cuda):
            self._write_descriptor(table, start, n, nb_max, pages_max, step, arena, meta.tensor, slot)
            graph = self._graphs[slot] if self._claim_launch == "graphs" else None
            if graph is not None:
                with use_stream(self.stream):
                    graph.replay()
                self.graph_replays += 1
                return
            if self.cuda:
                with use_stream(self.stream):
                    self._descriptor_kernels(slot, meta_layout)  # compiles a missing variant
                if self.capture_error is None and self._claim_launch == "graphs":
                    self._capture(slot, meta_layout)
            else:
                self._descriptor_kernels(slot, meta_layout)
            return
        stream = self._stream_handle
        self._select_plan(table.table, table.n_select, table.chunks, start, n, nb_max, step.q, meta.tensor,
                          self._ublocks, self._uheads, self._counts, self._ring_dev[slot], stream,
                          meta_layout=meta_layout)
        self._attend_plan(table.table, table.chunks, start, n, pages_max, step.q, arena, step.out, step.lse,
                          self.config, stream)

    def _write_descriptor(self, table: StepTable, start: int, n: int, nb_max: int, pages_max: int, step: Step,
                          arena, meta, slot: int) -> None:
        n_splits, pps = claim_splits(pages_max, self.config)
        row = self._step_template(table, step, arena, meta)
        row[[DESC_ROW0, DESC_TASKS, DESC_PARTS, DESC_SPLITS, DESC_PPS, DESC_COUNTS_HOST]] = (
            start, n, cdiv(max(1, nb_max), BLOCK_B), n_splits, pps, self._ring_dev[slot].data_ptr())
        self._desc_np[slot] = row

    def _descriptor_kernels(self, slot: int, meta_layout: tuple[int, int]) -> None:
        """The claim of descriptor row `slot`, on the current stream."""
        if self.cuda:
            self._desc_dev[slot].copy_(self._desc[slot], non_blocking=True)
        for launch in self._descriptor_launches(self._desc_dev[slot], meta_layout):
            launch()

    def _descriptor_launches(self, desc: torch.Tensor, meta_layout: tuple[int, int]) -> tuple:
        """The two descriptor launches of a claim whose row is `desc` (on the device)."""
        return claim_descriptor_launches(desc, *self._carriers, self._scores, self._tickets, self._ublocks,
                                         self._uheads, self._counts, self._part_out, self._part_lse, self._work,
                                         self._programs, self.config, meta_layout=meta_layout)

    def _capture(self, slot: int, meta_layout: tuple[int, int]) -> None:
        """Capture slot `slot`'s two launches (their kernels compiled already) into a CUDA graph."""
        try:
            graph = capture_graph(lambda: self._descriptor_kernels(slot, meta_layout), self._capture_stream)
        except RuntimeError as exc:  # the same kernels, launched directly, stay correct
            self.capture_error = f"{type(exc).__name__}: {exc}"
            log.warning("GPU lane: claim graph capture failed (%s); claims launch their kernels directly", exc)
            return
        self._graphs[slot] = graph
        self.graph_captures += 1

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        """Run `tasks` (any mix of sequences, KV heads and block sizes of `step.layer`) and wait."""
        if not tasks:
            return
        g = step.group_size
        if any(t.layer != step.layer for t in tasks):
            raise ValueError(f"a task of another layer was given to a step of layer {step.layer}")
        n_select = np.stack([np.asarray(t.n_select, dtype=np.int32).reshape(-1) for t in tasks])
        if n_select.shape[1] != g:
            raise ValueError(f"tasks carry n_select of {n_select.shape[1]} heads; the step's group size is {g}")
        for name, x in (("q", step.q), ("out", step.out), ("lse", step.lse)):
            if x.device.type != self.dev.type or x.dtype != torch.float32 or not x.is_contiguous():
                raise ValueError(f"step.{name} must be a contiguous float32 tensor on {self.dev}, got {x.dtype} on {x.device}")
        tab, nsel, chunks, _ = native_table(tasks, g)
        packed = self.pack(tab, nsel, chunks)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # step.q is ready
        table = self.upload(packed)
        per_task = self.launch(table, 0, len(tasks), step).wait()
        for task, nbytes in zip(tasks, per_task.tolist()):
            task.bytes_read = int(nbytes)
            task.device = self.device

    def warm_up(self) -> None:
        """Compile every kernel variant now (`compile_kernels`) and measure the host-to-GPU link
        (`measure_link`)."""
        self.compile_kernels()
        self.measure_link()

    def compile_kernels(self) -> None:
        """Compile every kernel variant: one tiny claim on chunk 0 of layer 0's arena, ordered
        after the calling thread's current stream; waits for the claim only (not the device).
        The runtime calls it on its background warm-up thread (`warmup.py`)."""
        g, hq, d = self.group_size, self.store.geometry.q_heads, self.head_dim
        tab = np.zeros((1, native_pool.T_COLS), dtype=np.int64)
        tab[0, native_pool.T_BLOCK] = 16
        tab[0, native_pool.T_CPULEN] = layout.CHUNK_TOKENS
        tab[0, native_pool.T_N_CHUNKS] = 1
        packed = self.pack(tab, np.ones((1, g), np.int32), np.zeros(1, np.int32))
        step = Step.empty(0, torch.zeros((1, hq, d), dtype=torch.float32, device=self.dev), g)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())
        # One variant per arena dtype, geometry and metadata source (the arena, or the store's GPU
        # copy of the metadata); every layer shares it.
        table = self.upload(packed)
        self.launch(table, 0, 1, step).wait()
        # The split selection's two kernels too (`split_select`: claims of rows longer than one
        # tile of all heads take them), which a claim this small does not.
        arena = self._arena(0)
        meta = self._metadata_source(0, arena)
        nb_max, _ = table.claim_shape(0, 1)
        self._select_plan(table.table, table.n_select, table.chunks, 0, 1, nb_max, step.q, meta.tensor, self._ublocks,
                          self._uheads, self._counts, self._counts, self._stream_handle, meta_layout=meta.layout,
                          split=True)
        if self.cuda:
            self.stream.synchronize()
        if self.pick_rows is not None:
            # The CPU lane's selection variants (`pick`, fused and split), into row 0 with job id 0
            # (no job has it).
            ready, blocks, heads, counts = self.pick_rows
            # Under "direct" a selection whose form is the runtime's to choose (split None) goes
            # through the direct launcher: its numba function is compiled here, not at a step's.
            forms = (False, True, None) if self._claim_launch == "direct" and self.cuda else (False, True)
            for split in forms:
                after = None
                if self.cuda:
                    after = torch.cuda.Event()
                    after.record(torch.cuda.current_stream())  # step.q was made there
                self.pick(table, 0, 1, step, blocks[:1], heads[:1], counts[:1], ready[:1], 0, after, split=split)
                if self.cuda:
                    self._pick_stream.synchronize()
            self.picks = 0
        if self._claim_launch == "graphs" and self.cuda:
            meta_layout = self._metadata_source(0, self._arena(0)).layout
            for slot in range(self.RING):  # now, not on a step's critical path
                if self._graphs[slot] is None and self.capture_error is None:
                    self._capture(slot, meta_layout)
        if self._claim_launch == "native" and self.cuda:
            # Now, not at the first claim: the launcher (a numba compile). Its events were made when
            # `claim_launch` was set.
            self._build_native(self._metadata_source(0, self._arena(0)).layout)
        if self._claim_launch == "direct" and self.cuda:
            # The warm-up claim above compiled the numba launcher; its launchers found the kernels
            # uncompiled (the claim launched as planned): rebuilt at the first claims.
            self._direct.clear()
            self._direct_picks.clear()
            self._direct_words = None
        self.bytes_read = 0
        self.device_bytes_read = 0
        self.launches = 0
        self.native_launches = 0
        self.direct_launches = 0
        self.direct_picks = 0

    def measure_link(self) -> None:
        """Measure the host-to-GPU link (CUDA only), which bounds the scheduler's model of this
        lane: tens of milliseconds, before the scheduler is built (it reads `link_bytes_per_s`)."""
        if self.cuda:
            self.link_bytes_per_s = link_bandwidth(self.dev)


def link_bandwidth(device: torch.device, nbytes: int = 64 << 20, reps: int = 3) -> float:
    """Pinned host -> device copy rate (bytes/s), best of `reps`."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(reps + 1):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        best = max(best, nbytes / (e0.elapsed_time(e1) * 1e-3))
    return best


# The runtime's GPU lane executor (kept under its earlier name for callers that import it).
PipelinedGpuExecutor = GpuUvaExecutor
