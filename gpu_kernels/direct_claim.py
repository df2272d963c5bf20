"""A GPU-lane claim's planned launches issued by one numba call through the CUDA driver.

The two ways a claim launched before each paid for what the other saved (benchmarks/notes/
gpu_lane.md section 38, H200): planned Triton launches (`LaunchPlan`: the kernels take the claim's
rows, grids and buffers as arguments, grids sized to the claim) cost 131-174 us of host time a
claim; the native call (`native_claim`) cost 39-49 us, but its descriptor kernels -- fixed grids,
items pulled from a counter, every address read from a row copied to the device first -- cost
68-74 us of GPU time a claim against the planned kernels' 45. Here the planned kernels are issued
as the native call issues the descriptor ones: one nogil numba call per claim, no Python object
made or touched in between, computes the claim's shape from the step table's host columns, picks
the selection's form (`score_select.split_select`), writes the few parameters a claim changes --
its first row, the landing slot its union sizes go to, the attention's task, split and program
counts -- over the step's parameter values, and records the start event, launches the selection
(one kernel, or the split form's two), the attention, and records the end event.

What the numba call launches is exactly what the planned path would: the compiled kernel the
planned launch of the same arguments runs (`CachedLaunch.compiled`, keyed on what Triton
specialises; a claim's own values are all declared `do_not_specialize`), its grid, block size and
shared memory, and a parameter list built from its signature (`native_claim.kernel_parameters`).
`cuLaunchKernel` copies parameter values at the call, so one value array per kernel serves every
claim. A form whose kernel is not compiled yet for the step's arguments makes the call return
`MISSING` before it issues anything; the caller then launches that claim as planned, which
compiles it.

The GPU's selection for the CPU lane (`GpuUvaExecutor.pick`, "picks") is the same selection with
signalling: `direct_select` issues it the same way on its own stream -- the waits for the step's
events, the launches with the selection's union rows, ready words and stamp written per call, the
end event -- since its host time is spent before the CPU workers are woken on the steps that use it
(115-160 us as planned launches on the H200, benchmarks/notes/gpu_lane.md section 39).
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np

from cpu_kernels import layout
from gpu_kernels.cuda_driver import DriverApi
from gpu_kernels.launch import KernelCall
from gpu_kernels.native_claim import SCRATCH_PARAMS, kernel_function, kernel_launch, launcher_for
from gpu_kernels.sparse_attention import MAX_SPLITS, SparseConfig

# A claim's kernels, in the order of `DirectClaim.build`'s `calls`.
FUSED, SCORE, HEADS, ATTEND = 0, 1, 2, 3
N_KERNELS = 4
# Words of a kernel's row in `DirectClaim.kernels` (int64): the compiled function (0: not compiled
# for the step's arguments), threads per program, dynamic shared memory bytes, then the parameter
# index of each word a claim sets (-1: the kernel has no such parameter).
K_FUNCTION, K_THREADS, K_SHARED = 0, 1, 2
K_ROW0, K_COUNTS_HOST, K_TASKS, K_SPLITS, K_PPS, K_PROGRAMS = 3, 4, 5, 6, 7, 8
# ... and those a selection for the CPU lane sets (`DirectSelect`): its union rows, ready words, stamp.
K_UBLOCKS, K_UHEADS, K_COUNTS, K_READY, K_STAMP = 9, 10, 11, 12, 13
K_WORDS = 14
CLAIM_WORDS = {"row0": K_ROW0, "counts_host": K_COUNTS_HOST, "tasks": K_TASKS, "splits": K_SPLITS, "pps": K_PPS,
               "programs": K_PROGRAMS, "ublocks": K_UBLOCKS, "uheads": K_UHEADS, "counts": K_COUNTS,
               "ready": K_READY, "stamp": K_STAMP}
# Words of a launcher's state (int64).
S_STREAM = 0  # the lane's stream
S_RING_DEV = 1  # device address of landing slot 0's union sizes (a UVA view of pinned memory)
S_RING_STRIDE = 2  # bytes between landing slots
S_PPS_MIN = 3  # fewest pages per attention split (`sparse_attention.claim_splits`)
S_CLAIM_PROGRAMS = 4  # `SparseConfig.claim_programs` (0: a program per item)
S_SPLIT_ABOVE = 5  # claims whose rows have more blocks select split (`score_select.split_select`)
S_GROUP = 6  # query heads per KV head: the split selection's heads launch has a program per head
S_BLOCK_B = 7  # blocks a fused selection program scores
S_SCORE_BLOCK_B = 8  # blocks a split scoring program scores
STATE_WORDS = 9
MISSING = -1  # `direct_launch`'s return when a kernel the claim needs is not compiled

_launchers: list = []  # (DriverApi, (compiled direct_launch, direct_select))


def direct_launchers(api: DriverApi) -> tuple:
    """The compiled `(direct_launch, direct_select)` calling `api`'s functions."""
    return launcher_for(api, _launchers, lambda a: _make_direct_launch(a.launch_kernel, a.event_record,
                                                                       a.stream_wait_event))


def _make_direct_launch(launch_kernel, event_record, stream_wait_event):
    @numba.njit(nogil=True, cache=False)
    def put(values, kernels, k, word, value):
        index = kernels[k, word]
        if index >= 0:
            values[k, index] = value

    @numba.njit(nogil=True, cache=False)
    def issue(kernels, params, k, gx, gy, stream):
        one = np.uint32(1)
        return launch_kernel(np.uint64(kernels[k, K_FUNCTION]), np.uint32(gx), np.uint32(gy), one,
                             np.uint32(kernels[k, K_THREADS]), one, one, np.uint32(kernels[k, K_SHARED]), stream,
                             np.uint64(params[k]), np.uint64(0))

    @numba.njit(nogil=True, cache=False)
    def selection_missing(kernels, split):
        """Whether a kernel of the selection's form (fused, or scored then selected) is not compiled."""
        return kernels[SCORE if split else FUSED, K_FUNCTION] == 0 or (split and kernels[HEADS, K_FUNCTION] == 0)

    @numba.njit(nogil=True, cache=False)
    def issue_selection(state, kernels, values, params, split, n, nb_max, start, counts_host, stream):
        """The selection of `n` rows from `start`: fused, or scored then selected a head a program."""
        if split:
            put(values, kernels, SCORE, K_ROW0, start)
            rc = issue(kernels, params, SCORE, n, max(1, (nb_max + state[S_SCORE_BLOCK_B] - 1) // state[S_SCORE_BLOCK_B]),
                       stream)
            if rc != 0:
                return rc
            put(values, kernels, HEADS, K_ROW0, start)
            put(values, kernels, HEADS, K_COUNTS_HOST, counts_host)
            return issue(kernels, params, HEADS, n, state[S_GROUP], stream)
        put(values, kernels, FUSED, K_ROW0, start)
        put(values, kernels, FUSED, K_COUNTS_HOST, counts_host)
        return issue(kernels, params, FUSED, n, max(1, (nb_max + state[S_BLOCK_B] - 1) // state[S_BLOCK_B]), stream)

    @numba.njit(nogil=True, cache=False)
    def direct_launch(state, kernels, values, params, n_blocks, union_pages, start, stop, slot, ev0, ev1):
        """Issue the claim of step-table rows `[start, stop)` whose union sizes land in slot `slot`;
        returns `MISSING`, the first non-zero CUDA error code, or 0."""
        nb_max = 0
        pages_max = 0
        for i in range(start, stop):
            nb_max = max(nb_max, n_blocks[i])
            pages_max = max(pages_max, union_pages[i])
        split = nb_max > state[S_SPLIT_ABOVE]
        if selection_missing(kernels, split) or kernels[ATTEND, K_FUNCTION] == 0:
            return MISSING
        n = stop - start
        counts_host = state[S_RING_DEV] + slot * state[S_RING_STRIDE]
        pps = max(state[S_PPS_MIN], (max(1, pages_max) + MAX_SPLITS - 1) // MAX_SPLITS)
        n_splits = max(1, (pages_max + pps - 1) // pps)
        items = n * n_splits
        programs = min(items, state[S_CLAIM_PROGRAMS]) if state[S_CLAIM_PROGRAMS] > 0 else items
        stream = np.uint64(state[S_STREAM])
        rc = event_record(np.uint64(ev0), stream)
        if rc != 0:
            return rc
        rc = issue_selection(state, kernels, values, params, split, n, nb_max, start, counts_host, stream)
        if rc != 0:
            return rc
        put(values, kernels, ATTEND, K_ROW0, start)
        put(values, kernels, ATTEND, K_TASKS, n)
        put(values, kernels, ATTEND, K_SPLITS, n_splits)
        put(values, kernels, ATTEND, K_PPS, pps)
        put(values, kernels, ATTEND, K_PROGRAMS, programs)
        rc = issue(kernels, params, ATTEND, programs, 1, stream)
        if rc != 0:
            return rc
        return event_record(np.uint64(ev1), stream)

    @numba.njit(nogil=True, cache=False)
    def direct_select(state, kernels, values, params, n_blocks, start, stop, stamp, rows, wait0, wait1, ev):
        """Issue the selection of step-table rows `[start, stop)` for the CPU lane, after the events
        `wait0` and `wait1` (0: none): row t's union into the union rows at `rows` (addresses of
        the launch's first union row, union heads row, count, ready word), then `stamp` into its
        ready word; then record `ev`. Returns `MISSING`, the first non-zero CUDA error code, or 0."""
        nb_max = 0
        for i in range(start, stop):
            nb_max = max(nb_max, n_blocks[i])
        split = nb_max > state[S_SPLIT_ABOVE]
        if selection_missing(kernels, split):
            return MISSING
        n = stop - start
        stream = np.uint64(state[S_STREAM])
        for event in (wait0, wait1):
            if event != 0:
                rc = stream_wait_event(stream, np.uint64(event), np.uint32(0))
                if rc != 0:
                    return rc
        last = HEADS if split else FUSED  # the kernel that writes the unions and signals
        put(values, kernels, last, K_UBLOCKS, rows[0])
        put(values, kernels, last, K_UHEADS, rows[1])
        put(values, kernels, last, K_COUNTS, rows[2])
        put(values, kernels, last, K_READY, rows[3])
        put(values, kernels, last, K_STAMP, stamp)
        rc = issue_selection(state, kernels, values, params, split, n, nb_max, start, rows[2], stream)
        if rc != 0:
            return rc
        return event_record(np.uint64(ev), stream)

    return direct_launch, direct_select


def parameter_indices(kernel, args: tuple) -> list[int | None]:
    """Per argument of a launch of `kernel` with `args`, the index of its kernel parameter (None
    for an argument Triton made a constant): the order `kernel_parameters` lists them in."""
    signature = kernel.src.signature
    indices, n = [], 0
    for name in kernel.src.fn.arg_names[:len(args)]:
        if signature.get(name) == "constexpr":
            indices.append(None)
        else:
            indices.append(n)
            n += 1
    return indices


def _kernel_table(calls: Sequence[KernelCall | None]) -> tuple[np.ndarray, np.ndarray] | str:
    """`(kernels [N_KERNELS, K_WORDS], values [N_KERNELS, params])` of `calls` (in `FUSED, SCORE,
    HEADS, ATTEND` order; None: a kernel the launcher never issues), or why they cannot be launched
    as Triton would. A kernel not compiled yet gets function 0 (launches needing it return `MISSING`)."""
    kernels = np.full((N_KERNELS, K_WORDS), -1, dtype=np.int64)
    rows: list[list[int]] = []
    for k, call in enumerate(calls):
        kernels[k, :K_ROW0] = 0
        kernel = call.compiled() if call is not None else None
        if kernel is None:
            rows.append([])
            continue
        launchable = kernel_launch(kernel, call.args)
        if isinstance(launchable, str):
            return launchable
        shape, values = launchable
        indices = parameter_indices(kernel, call.args)
        for word, position in call.claim_args.items():
            if indices[position] is None:
                return f"argument {position} ({word}) of kernel {k} was made a constant"
            kernels[k, CLAIM_WORDS[word]] = indices[position]
        kernels[k, :K_ROW0] = (kernel_function(kernel), *shape)
        rows.append(values + [0] * SCRATCH_PARAMS)
    width = max(1, max(len(r) for r in rows))
    values = np.zeros((N_KERNELS, width), dtype=np.int64)
    for k, r in enumerate(rows):
        values[k, :len(r)] = r
    return kernels, values


def _state(stream: int, calls: Sequence[KernelCall | None], split_above: int) -> np.ndarray:
    """A launcher's state words but the claims' (landing slots, attention splits)."""
    state = np.zeros(STATE_WORDS, dtype=np.int64)
    state[S_STREAM] = stream
    state[S_SPLIT_ABOVE] = split_above
    state[S_GROUP] = calls[FUSED].constexprs["G"]
    state[S_BLOCK_B] = calls[FUSED].constexprs["BLOCK_B"]
    state[S_SCORE_BLOCK_B] = calls[SCORE].constexprs["BLOCK_B"]
    return state


class _DirectLaunches:
    """A direct launcher's tables for launches with one set of step arguments: the kernels, their
    parameter values, the pointer arrays `cuLaunchKernel` takes. Holds addresses only; the caller
    keeps the tensors alive and drops this object whenever it replaces them."""

    def __init__(self, api: DriverApi, state: np.ndarray, kernels: np.ndarray, values: np.ndarray):
        self.launch, self.select = direct_launchers(api)
        self.state = state
        self.kernels = kernels  # [N_KERNELS, K_WORDS]
        self.values = values  # [N_KERNELS, params]: the parameter values, a launch's words written per launch
        self._pointers = (values.ctypes.data + 8 * np.arange(values.size, dtype=np.uint64)).reshape(values.shape)
        self.params = self._pointers.ctypes.data + 8 * values.shape[1] * np.arange(values.shape[0], dtype=np.uint64)

    @property
    def complete(self) -> bool:
        """Every kernel a launch may need is compiled for these arguments."""
        return bool((self.kernels[:, K_FUNCTION] != 0).all())


class DirectClaim(_DirectLaunches):
    """`direct_launch`'s tables for the claims of steps with one set of step arguments (table,
    q, arena, out, lse, scratch)."""

    @classmethod
    def build(cls, api: DriverApi, calls: Sequence[KernelCall], stream: int, ring_dev, config: SparseConfig,
              split_above: int) -> "DirectClaim | str":
        """`calls`: the claim's `(fused, score, heads, attend)` launches as the planned path makes
        them for the step (`ScoreSelectPlan.claim_calls`, `SparseAttentionClaimPlan.claim_call`);
        `ring_dev`: the `[slots, tasks]` int32 landing slots' device view; `split_above`: the
        most blocks of a claim selecting fused. Returns the launcher, or why it cannot be built.
        A kernel not compiled yet is left out (claims needing it return `MISSING`)."""
        if len(calls) != N_KERNELS:
            raise ValueError(f"{len(calls)} kernel calls; a claim has {N_KERNELS}: fused, score, heads, attend")
        table = _kernel_table(calls)
        if isinstance(table, str):
            return table
        state = _state(stream, calls, split_above)
        state[S_RING_DEV] = ring_dev.data_ptr()
        state[S_RING_STRIDE] = ring_dev.stride(0) * ring_dev.element_size()
        state[S_PPS_MIN] = max(config.pages_per_split, config.block_n // layout.PAGE_SIZE)
        state[S_CLAIM_PROGRAMS] = config.claim_programs
        return cls(api, state, *table)

    def __call__(self, n_blocks: np.ndarray, union_pages: np.ndarray, start: int, stop: int, slot: int, ev0: int,
                 ev1: int) -> int:
        """Issue a claim (`direct_launch`); returns `MISSING`, the CUDA error code, or 0 (queued)."""
        return self.launch(self.state, self.kernels, self.values, self.params, n_blocks, union_pages, start, stop,
                           slot, ev0, ev1)


class DirectSelect(_DirectLaunches):
    """`direct_select`'s tables for the CPU lane's selections ("picks", `GpuUvaExecutor.pick`) of
    steps with one set of step arguments (table, q, metadata, the selection's own scratch)."""

    @classmethod
    def build(cls, api: DriverApi, calls: Sequence[KernelCall], stream: int, split_above: int) -> "DirectSelect | str":
        """`calls`: the selection's signalling `(fused, score, heads)` launches as the planned path
        makes them (`ScoreSelectPlan.claim_calls(..., ready=...)`); `stream`: the selection's own."""
        if len(calls) != N_KERNELS - 1:
            raise ValueError(f"{len(calls)} kernel calls; a selection has {N_KERNELS - 1}: fused, score, heads")
        table = _kernel_table((*calls, None))
        if isinstance(table, str):
            return table
        return cls(api, _state(stream, calls, split_above), *table)

    @property
    def complete(self) -> bool:
        """Every kernel a selection may need is compiled for these arguments."""
        return bool((self.kernels[:ATTEND, K_FUNCTION] != 0).all())

    def __call__(self, n_blocks: np.ndarray, start: int, stop: int, stamp: int, rows: np.ndarray, wait0: int,
                 wait1: int, ev: int) -> int:
        """Issue a selection (`direct_select`); `rows`: int64 addresses of the launch's first union
        row, union heads row, count and ready word. Returns `MISSING`, the CUDA error code, or 0."""
        return self.select(self.state, self.kernels, self.values, self.params, n_blocks, start, stop, stamp, rows,
                           wait0, wait1, ev)


__all__ = ["DirectClaim", "DirectSelect", "MISSING", "direct_launchers", "parameter_indices"]
