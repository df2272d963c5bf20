"""A GPU-lane claim issued by one numba call: descriptor row, copy, both launches, both events.

The descriptor launches (`claim_descriptor`) take only fixed arguments -- every address and size
that varies from claim to claim is in the claim's descriptor row -- so their kernel parameters can
be packed once per landing slot. What is left per claim is what this module does in one nogil
numba call (`claim_launch`), with no Python object made or touched in between:

1. the claim's shape from the step table's host columns (largest block count and union pages of
   its rows), its attention splits and pages per split (`sparse_attention.claim_splits`);
2. the descriptor row: the step's words (the caller's `template`, the same for every claim of a
   step) plus the claim's own, written into the slot's pinned row;
3. on the lane's stream, through the CUDA driver: the start event, the row's copy to the device,
   `cuLaunchKernel` of the selection and of the attention, the end event.

Why: with the kernels' own fixed cost at 43-96 us, a claim's wall fixed cost on the GPU machine
was its launch call's host time, 107-265 us, about fifteen Python-level operations each costing
3-5x its tight-loop time between other work (benchmarks/notes/gpu_lane.md section 21). The
launches are exactly those the Triton launcher would make: the same compiled functions, grids,
block sizes and shared memory, and a parameter list built from the kernel's signature and checked
against the driver's own count and sizes where the driver reports them (CUDA 12.4 and later).
A kernel this module cannot launch as Triton would (thread-block clusters, programmatic
dependent launch, cooperative grids, global or profiling scratch) makes `NativeClaim.build`
return the reason instead of a launcher; the caller then launches the claim another way.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from cpu_kernels import layout
from gpu_kernels.claim_descriptor import (
    DESC_COUNTS_HOST, DESC_PARTS, DESC_PPS, DESC_ROW0, DESC_SPLITS, DESC_TASKS, DESC_WORDS, DescriptorLaunch,
)
from gpu_kernels.cuda_driver import DriverApi, kernel_param_sizes
from gpu_kernels.score_select import BLOCK_B
from gpu_kernels.sparse_attention import MAX_SPLITS, SparseConfig

# Words of a launcher's state (int64).
S_STREAM = 0  # the lane's stream
S_DESC_HOST = 1  # address of descriptor row 0 in pinned memory
S_DESC_DEV = 2  # address of descriptor row 0 on the device
S_DESC_STRIDE = 3  # bytes between descriptor rows (the same on the host and the device)
S_RING_DEV = 4  # device address of landing slot 0's union sizes (a UVA view of pinned memory)
S_RING_STRIDE = 5  # bytes between landing slots
S_PPS_MIN = 6  # fewest pages per attention split (`claim_splits`)
S_KERNELS = 7  # then per launch: function, grid, threads per program, dynamic shared memory bytes
KERNEL_WORDS = 4
N_LAUNCHES = 2
STATE_WORDS = S_KERNELS + KERNEL_WORDS * N_LAUNCHES

# Triton's launcher appends its global and profiling scratch pointers to a kernel's parameters
# (Triton 3.3 the first, 3.5 the second); a kernel ignores parameters it does not declare.
SCRATCH_PARAMS = 2

_launchers: list = []  # (DriverApi, compiled claim_launch)


def launcher_for(api: DriverApi, held: list, make):
    """`make(api)` -- numba functions calling `api`'s driver functions -- made once per `api` and
    kept in `held` (numba takes the ctypes functions as constants, so they cannot be cached on disk)."""
    # Matched by identity with the api held (ctypes functions are unhashable): a dict keyed by id()
    # could hand a later api whose id was reused a launcher calling freed callbacks.
    for api_held, made in held:
        if api_held is api:
            return made
    made = make(api)
    held.append((api, made))
    return made


def claim_launcher(api: DriverApi):
    """The compiled `claim_launch` calling `api`'s functions."""
    return launcher_for(api, _launchers, lambda a: _make_claim_launch(a.launch_kernel, a.event_record,
                                                                      a.memcpy_htod_async))


def _make_claim_launch(launch_kernel, event_record, memcpy_htod_async):
    desc_bytes = DESC_WORDS * 8

    @numba.njit(nogil=True, cache=False)
    def claim_launch(state, params, n_blocks, union_pages, start, stop, slot, desc, template, ev0, ev1):
        """Issue the claim of step-table rows `[start, stop)` in landing slot `slot`; returns the
        first non-zero CUDA error code, or 0."""
        nb_max = 0
        pages_max = 0
        for i in range(start, stop):
            nb_max = max(nb_max, n_blocks[i])
            pages_max = max(pages_max, union_pages[i])
        pps = max(state[S_PPS_MIN], (max(1, pages_max) + MAX_SPLITS - 1) // MAX_SPLITS)
        row = desc[slot]
        for w in range(DESC_WORDS):
            row[w] = template[w]
        row[DESC_ROW0] = start
        row[DESC_TASKS] = stop - start
        row[DESC_PARTS] = (max(1, nb_max) + BLOCK_B - 1) // BLOCK_B
        row[DESC_SPLITS] = max(1, (pages_max + pps - 1) // pps)
        row[DESC_PPS] = pps
        row[DESC_COUNTS_HOST] = state[S_RING_DEV] + slot * state[S_RING_STRIDE]
        stream = np.uint64(state[S_STREAM])
        rc = event_record(np.uint64(ev0), stream)
        if rc != 0:
            return rc
        offset = slot * state[S_DESC_STRIDE]
        rc = memcpy_htod_async(np.uint64(state[S_DESC_DEV] + offset), np.uint64(state[S_DESC_HOST] + offset),
                               np.uint64(desc_bytes), stream)
        if rc != 0:
            return rc
        for k in range(N_LAUNCHES):
            w = S_KERNELS + KERNEL_WORDS * k
            one = np.uint32(1)
            rc = launch_kernel(np.uint64(state[w]), np.uint32(state[w + 1]), one, one, np.uint32(state[w + 2]), one,
                               one, np.uint32(state[w + 3]), stream, np.uint64(params[k, slot]), np.uint64(0))
            if rc != 0:
                return rc
        return event_record(np.uint64(ev1), stream)

    return claim_launch


def kernel_parameters(kernel, args: tuple) -> list[int] | str:
    """The values of `kernel`'s parameters for a launch with runtime arguments `args`, as Triton's
    launcher passes them (tensors as addresses, integers as they are, arguments Triton made
    constants left out), or why they cannot be known."""
    src = getattr(kernel, "src", None)
    signature = getattr(src, "signature", None)
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    if not isinstance(signature, dict) or names is None:
        return "the compiled kernel does not say its signature"
    values, kinds = [], []
    for name, value in zip(names, args):
        kind = signature.get(name)
        if kind is None:
            return f"argument {name} is not in the kernel's signature"
        if kind == "constexpr":
            continue
        if isinstance(value, torch.Tensor):
            if not kind.startswith("*"):
                return f"tensor argument {name} has signature type {kind}"
            values.append(value.data_ptr())
        elif isinstance(value, int) and not isinstance(value, bool) and kind in ("i32", "i64", "u32", "u64"):
            values.append(int(value))
        else:
            return f"argument {name} of type {kind} ({type(value).__name__}) is not a pointer or an integer"
        kinds.append(kind)
    sizes = kernel_param_sizes(kernel_function(kernel))
    if sizes is not None:
        want = [8 if k.startswith("*") or k.endswith("64") else 4 for k in kinds]
        if sizes[:len(want)] != want or not len(want) <= len(sizes) <= len(want) + SCRATCH_PARAMS \
                or any(s != 8 for s in sizes[len(want):]):
            return f"the driver reports parameter sizes {sizes}; the signature gives {want} (+ scratch pointers)"
    return values


def kernel_function(kernel) -> int:
    """The driver handle (CUfunction) of a compiled Triton kernel, loading it first if no launch did."""
    if getattr(kernel, "function", None) is None:
        kernel._init_handles()
    return int(kernel.function)


def launch_shape(kernel) -> tuple[int, int] | str:
    """(threads per program, dynamic shared memory bytes) of `kernel`, or why this module cannot
    launch it as Triton's launcher would."""
    md = kernel.metadata
    for attr, allowed in (("num_ctas", 1), ("launch_pdl", False), ("launch_cooperative_grid", False),
                          ("global_scratch_size", 0), ("profile_scratch_size", 0)):
        value = getattr(md, attr, allowed)
        if value != allowed:
            return f"{attr} = {value}"
    if md.shared > 228 * 1024:  # Triton launches these with an oversized-shared-memory attribute
        return f"{md.shared} bytes of shared memory"
    return 32 * md.num_warps, md.shared


def kernel_launch(kernel, args: tuple) -> tuple[tuple[int, int], list[int]] | str:
    """`(launch_shape(kernel), kernel_parameters(kernel, args))`, or why this module cannot launch
    `kernel` with `args` as Triton's launcher would."""
    shape = launch_shape(kernel)
    if isinstance(shape, str):
        return shape
    values = kernel_parameters(kernel, args)
    return values if isinstance(values, str) else (shape, values)


class NativeClaim:
    """The state of `claim_launch` for one kernel variant over one executor's buffers.

    Holds the packed kernel parameters (and, through them, nothing else: the tensors they point at
    are the executor's, which drops this object whenever it replaces them)."""

    def __init__(self, api: DriverApi, state: np.ndarray, values: np.ndarray):
        self.launch = claim_launcher(api)
        self.state = state
        self.values = values  # [N_LAUNCHES, slots, max params] int64: each slot's parameter values
        n, slots, width = values.shape
        # The parameter arrays cuLaunchKernel takes: one pointer per parameter, to its value.
        self._pointers = (values.ctypes.data + 8 * np.arange(values.size, dtype=np.uint64)).reshape(values.shape)
        # [N_LAUNCHES, slots]: the address of each slot's parameter array.
        self.params = (self._pointers.ctypes.data + 8 * width * np.arange(n * slots, dtype=np.uint64)).reshape(n, slots)

    @classmethod
    def build(cls, api: DriverApi, slot_launches: list[tuple[DescriptorLaunch, DescriptorLaunch]], stream: int,
              desc_host: torch.Tensor, desc_dev: torch.Tensor, ring_dev: torch.Tensor,
              config: SparseConfig) -> "NativeClaim | str":
        """`slot_launches[s]`: the descriptor launches of landing slot `s` (compiled already);
        `desc_host`/`desc_dev`: the `[slots, DESC_WORDS]` int64 descriptor rows (pinned, device; rows
        `DESC_ROW_STRIDE` words apart in the executor's, any equal spacing here);
        `ring_dev`: the `[slots, tasks]` int32 landing slots' device view. Returns the launcher, or
        why it cannot be built."""
        slots = len(slot_launches)
        if desc_host.shape != (slots, DESC_WORDS) or desc_dev.shape != (slots, DESC_WORDS) or ring_dev.shape[0] != slots \
                or desc_host.stride() != desc_dev.stride() or desc_host.stride(1) != 1:
            raise ValueError(f"descriptor rows {tuple(desc_host.shape)} / {tuple(desc_dev.shape)} (strides "
                             f"{desc_host.stride()} / {desc_dev.stride()}) and landing slots {tuple(ring_dev.shape)} for "
                             f"{slots} slots of {DESC_WORDS} contiguous words, rows equally spaced on both sides")
        state = np.zeros(STATE_WORDS, dtype=np.int64)
        state[S_STREAM] = stream
        state[S_DESC_HOST] = desc_host.data_ptr()
        state[S_DESC_DEV] = desc_dev.data_ptr()
        state[S_DESC_STRIDE] = desc_host.stride(0) * 8
        state[S_RING_DEV] = ring_dev.data_ptr()
        state[S_RING_STRIDE] = ring_dev.stride(0) * ring_dev.element_size()
        state[S_PPS_MIN] = max(config.pages_per_split, config.block_n // layout.PAGE_SIZE)
        per_slot = []
        for s, launches in enumerate(slot_launches):
            row = []
            for k, launch in enumerate(launches):
                kernel = launch.compiled()
                if kernel is None:
                    return f"launch {k} of slot {s} is not compiled"
                launchable = kernel_launch(kernel, launch.args)
                if isinstance(launchable, str):
                    return launchable
                shape, values = launchable
                if s == 0:
                    w = S_KERNELS + KERNEL_WORDS * k
                    state[w:w + KERNEL_WORDS] = (kernel_function(kernel), launch.grid[0], *shape)
                elif int(state[S_KERNELS + KERNEL_WORDS * k]) != kernel_function(kernel):
                    return f"slot {s} runs another compiled kernel than slot 0"
                row.append(values + [0] * SCRATCH_PARAMS)
            per_slot.append(row)
        width = max(len(v) for row in per_slot for v in row)
        values = np.zeros((N_LAUNCHES, slots, width), dtype=np.int64)
        for s, row in enumerate(per_slot):
            for k, v in enumerate(row):
                values[k, s, :len(v)] = v
        return cls(api, state, values)

    def __call__(self, n_blocks: np.ndarray, union_pages: np.ndarray, start: int, stop: int, slot: int,
                 desc: np.ndarray, template: np.ndarray, ev0: int, ev1: int) -> int:
        """Issue a claim (`claim_launch`); returns the CUDA error code (0: queued)."""
        return self.launch(self.state, self.params, n_blocks, union_pages, start, stop, slot, desc, template, ev0, ev1)


__all__ = ["NativeClaim", "claim_launcher", "kernel_function", "kernel_launch", "kernel_parameters", "launch_shape",
           "launcher_for"]
