"""CPU workers whose whole task loop runs in numba with the GIL released.

Why: a Python worker needs the GIL between tasks (queue pop, dispatch, bookkeeping). Measured on
the reference VM, every GIL hand-off between threads costs a thread wake-up of ~50 us: 15 workers
started one after another 50 us apart, the per-task overhead was ~15 us median, and the first task
began ~1.8 ms after q was ready. Here each worker thread calls `worker_loop` once; inside it the
worker waits for a job (spinning briefly on a shared control word, then returning to Python to
block), pops queue positions with an atomic compare-and-swap, runs the numba kernel, stamps the
task's times and bytes into shared arrays and counts it done -- no Python and no GIL per task.

Shared state (`ctrl`, int64, hot words on their own cache lines):
    SEQ    seqlock of the job description: odd while the host writes it, even when published;
           the job id is SEQ // 2
    STOP   non-zero: every worker returns
    WORD   (job id << 32) | next queue position; a pop is a CAS that advances the position
           for the current job only, so a worker holding a stale job id can never take a
           position of a newer job
    DONE   positions finished (CPU side) in the current job
    LAYER, B, N   the job: layer, batch size, number of queue positions
The host writes the task table, then publishes (SEQ odd, parameters, WORD, DONE, SEQ even). The
GPU lane claims ranges of positions from the same WORD (`claim`), so the fluxion policy's two
devices pull from one priority queue. `close` stops further pops and returns how many positions
were handed out, so the host can wait for exactly the tasks in flight.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

C_SEQ, C_STOP, C_WORD, C_DONE = 0, 8, 16, 24
C_LAYER, C_B, C_N = 32, 33, 34
CTRL_SIZE = 40
MASK = (1 << 32) - 1

# Task table columns (queue order).
T_BATCH, T_KVHEAD, T_BLOCK, T_CPULEN, T_CHUNK_OFF, T_N_CHUNKS = range(6)
T_COLS = 6
# Record columns (queue order): worker, kernel start ns, kernel end ns, bytes, overhead ns.
R_WORKER, R_START, R_END, R_BYTES, R_OVERHEAD = range(5)
R_COLS = 5

LOOP_STOPPED, LOOP_IDLE, LOOP_WARM = 0, 1, 2


# ---------------------------------------------------------------------------- intrinsics
def _ptr(context, builder, sig, args):
    aty = sig.args[0]
    ary = context.make_array(aty)(context, builder, args[0])
    idx = context.cast(builder, args[1], sig.args[1], types.intp)
    return cgutils.get_item_pointer(context, builder, aty, ary, [idx])


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """`arr[idx] += val` atomically (int64 array); returns the old value."""
    sig = types.int64(arr, idx, val)

    def codegen(context, builder, signature, args):
        ptr = _ptr(context, builder, signature, args)
        v = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, v, "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """Acquire load of `arr[idx]` (never hoisted out of a spin loop)."""
    sig = types.int64(arr, idx)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_ptr(context, builder, signature, args), "acquire", 8)

    return sig, codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """Release store `arr[idx] = val`."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(v, _ptr(context, builder, signature, args), "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def atomic_cas(typingctx, arr, idx, expected, new):
    """Compare-and-swap `arr[idx]`: True when it held `expected` and now holds `new`."""
    sig = types.boolean(arr, idx, expected, new)

    def codegen(context, builder, signature, args):
        ptr = _ptr(context, builder, signature, args)
        e = context.cast(builder, args[2], signature.args[2], types.int64)
        n = context.cast(builder, args[3], signature.args[3], types.int64)
        return builder.extract_value(builder.cmpxchg(ptr, e, n, "seq_cst", "seq_cst"), 1)

    return sig, codegen


@intrinsic
def monotonic_ns(typingctx):
    """clock_gettime(CLOCK_MONOTONIC) in ns: the clock of Python's time.perf_counter on Linux."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ts_t = ir.LiteralStructType([i64, i64])
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32, ts_t.as_pointer()]), "clock_gettime")
        ts = cgutils.alloca_once(builder, ts_t)
        builder.call(fn, [i32(1), ts])
        sec = builder.load(builder.gep(ts, [i32(0), i32(0)]))
        nsec = builder.load(builder.gep(ts, [i32(0), i32(1)]))
        return builder.add(builder.mul(sec, i64(1_000_000_000)), nsec)

    return sig, codegen


@intrinsic
def cpu_relax(typingctx):
    """The x86 PAUSE hint inside spin loops (less power, no memory-order mis-speculation)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------------------- numba side
# Not cached on disk: its signature holds the kernel (a dispatcher), which numba cannot pickle.
@numba.njit(nogil=True)
def worker_loop(ctrl, wid, spin_ns, mode, arenas, q_flat, res_flat, hq, d, g, tab, nsel, chunks, rec, cur, kernel,
                scratch):
    """Serve jobs until STOP (returns LOOP_STOPPED) or `spin_ns` without a new job (LOOP_IDLE).

    `kernel(arena, chunks, cpu_len, block_size, q, n_select, out, lse, *scratch) -> bytes` is the
    task kernel (`cpu_kernels.sparse_attention.run_task`); `scratch` is this worker's workspace
    arrays in the kernel's parameter order. `cur[wid]` = (queue position being run or -1, last
    job id seen): lets the host account for a task whose kernel raised, and keeps a worker from
    re-joining a job it already left.
    """
    if mode == LOOP_WARM:
        return LOOP_WARM
    last = cur[wid, 1]
    while True:
        t_idle = monotonic_ns()
        job = -1
        layer = 0
        b = 0
        n = 0
        while True:
            if atomic_load(ctrl, C_STOP) != 0:
                return LOOP_STOPPED
            s1 = atomic_load(ctrl, C_SEQ)
            if s1 & 1 == 0 and (s1 >> 1) != last:
                layer = atomic_load(ctrl, C_LAYER)
                b = atomic_load(ctrl, C_B)
                n = atomic_load(ctrl, C_N)
                if atomic_load(ctrl, C_SEQ) == s1:  # consistent snapshot of the job
                    job = s1 >> 1
                    break
                continue
            if monotonic_ns() - t_idle > spin_ns:
                return LOOP_IDLE
            cpu_relax()
        last = job
        cur[wid, 1] = job
        arena = arenas[layer]
        nq = b * hq * d
        q = q_flat[:nq].reshape((b, hq, d))
        out = res_flat[:nq].reshape((b, hq, d))
        lse = res_flat[nq : nq + b * hq].reshape((b, hq))
        t0 = monotonic_ns()
        while True:
            w = atomic_load(ctrl, C_WORD)
            i = w & MASK
            if (w >> 32) != job or i >= n:
                break
            if not atomic_cas(ctrl, C_WORD, w, w + 1):
                continue
            cur[wid, 0] = i
            bi = tab[i, T_BATCH]
            h0 = tab[i, T_KVHEAD] * g
            off = tab[i, T_CHUNK_OFF]
            t1 = monotonic_ns()
            nbytes = kernel(
                arena, chunks[off : off + tab[i, T_N_CHUNKS]], tab[i, T_CPULEN], tab[i, T_BLOCK],
                q[bi, h0 : h0 + g], nsel[i], out[bi, h0 : h0 + g], lse[bi, h0 : h0 + g], *scratch
            )
            t2 = monotonic_ns()
            rec[i, R_WORKER] = wid
            rec[i, R_START] = t1
            rec[i, R_END] = t2
            rec[i, R_BYTES] = nbytes
            cur[wid, 0] = -1
            t3 = monotonic_ns()
            rec[i, R_OVERHEAD] = (t1 - t0) + (t3 - t2)  # pop + dispatch before, recording after
            atomic_add(ctrl, C_DONE, 1)
            t0 = t3


@numba.njit(nogil=True, cache=True)
def publish(ctrl, layer, b, n, start=0):
    """Make the job (tables already written) visible; returns its id.

    Positions `[0, start)` are already taken (the GPU lane's first claim, made before the CPU
    workers can pop anything): the first pop gets position `start`.
    """
    s = atomic_load(ctrl, C_SEQ)
    atomic_store(ctrl, C_SEQ, s + 1)
    atomic_store(ctrl, C_LAYER, layer)
    atomic_store(ctrl, C_B, b)
    atomic_store(ctrl, C_N, n)
    job = (s + 2) >> 1
    atomic_store(ctrl, C_DONE, 0)
    atomic_store(ctrl, C_WORD, (job << 32) | start)
    atomic_store(ctrl, C_SEQ, s + 2)
    return job


@numba.njit(nogil=True, cache=True)
def claim(ctrl, job, k, n):
    """Take up to `k` positions of job `job` (the GPU lane); returns the first, or -1 when none is left."""
    while True:
        w = atomic_load(ctrl, C_WORD)
        i = w & MASK
        if (w >> 32) != job or i >= n:
            return -1
        take = min(k, n - i)
        if atomic_cas(ctrl, C_WORD, w, w + take):
            return i


@numba.njit(nogil=True, cache=True)
def close(ctrl, job, n):
    """Hand out nothing more of job `job`; returns how many positions were handed out."""
    while True:
        w = atomic_load(ctrl, C_WORD)
        i = w & MASK
        if (w >> 32) != job or i >= n:
            return min(i, n)
        if atomic_cas(ctrl, C_WORD, w, (job << 32) | n):
            return i


@numba.njit(nogil=True, cache=True)
def head(ctrl, job, n):
    """Positions handed out so far."""
    w = atomic_load(ctrl, C_WORD)
    if (w >> 32) != job:
        return n
    return min(w & MASK, n)


@numba.njit(nogil=True, cache=True)
def done(ctrl):
    return atomic_load(ctrl, C_DONE)


@numba.njit(nogil=True, cache=True)
def add_done(ctrl, k):
    atomic_add(ctrl, C_DONE, k)


@numba.njit(nogil=True, cache=True)
def set_stop(ctrl, value):
    atomic_store(ctrl, C_STOP, value)


def scratch_of(kernel, workspace) -> tuple:
    """The workspace arrays a kernel takes after its `lse` parameter, by name, in its order."""
    import inspect

    fn = getattr(kernel, "py_func", kernel)
    names = list(inspect.signature(fn).parameters)
    if "lse" not in names:
        raise TypeError(f"CPU task kernel {fn.__name__} has no `lse` parameter; expected run_task's signature")
    missing = [n for n in names[names.index("lse") + 1 :] if not hasattr(workspace, n)]
    if missing:
        raise TypeError(f"CPU task kernel {fn.__name__} needs workspace arrays {missing} that Workspace does not have")
    return tuple(getattr(workspace, n) for n in names[names.index("lse") + 1 :])


def warm_up() -> None:
    """Compile the host-side helpers (the worker loop compiles in its threads)."""
    c = np.zeros(CTRL_SIZE, dtype=np.int64)
    job = publish(c, 0, 0, 0)
    claim(c, job, 1, 0)
    close(c, job, 0)
    head(c, job, 0)
    done(c)
    add_done(c, 0)
    set_stop(c, 0)


class NativeJobBuffers:
    """Shared task table, records and control word for one runtime, sized for the largest step."""

    def __init__(self, max_tasks: int, group_size: int, max_chunks: int, n_workers: int):
        self.ctrl = np.zeros(CTRL_SIZE, dtype=np.int64)
        self.tab = np.zeros((max(1, max_tasks), T_COLS), dtype=np.int64)
        self.nsel = np.zeros((max(1, max_tasks), group_size), dtype=np.int32)
        self.chunks = np.zeros(max(1, max_chunks), dtype=np.int32)
        self.rec = np.zeros((max(1, max_tasks), R_COLS), dtype=np.int64)
        self.cur = np.full((max(1, n_workers), 2), -1, dtype=np.int64)
        self.lock = threading.Lock()  # serialises hosts writing the table (one job at a time)


__all__ = [
    "C_DONE", "C_SEQ", "C_STOP", "C_WORD", "LOOP_IDLE", "LOOP_STOPPED", "LOOP_WARM", "NativeJobBuffers",
    "R_BYTES", "R_COLS", "R_END", "R_OVERHEAD", "R_START", "R_WORKER", "T_BATCH", "T_BLOCK", "T_CHUNK_OFF",
    "T_COLS", "T_CPULEN", "T_KVHEAD", "T_N_CHUNKS", "add_done", "claim", "close", "done", "head", "monotonic_ns",
    "publish", "scratch_of", "set_stop", "warm_up", "worker_loop",
]
