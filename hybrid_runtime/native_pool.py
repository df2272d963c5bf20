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
    QGATE, QREADY the job waits for the device's word; that word, written by the caller's stream
                  ("Starting on the device's word" below)
The host writes the task table, then publishes (SEQ odd, parameters, WORD, DONE, SEQ even). The
GPU lane claims ranges of positions from the same WORD (`claim`), so the fluxion placement's two
devices pull from one priority queue. `close` stops further pops and returns how many positions
were handed out, so the host can wait for exactly the tasks in flight.

Sleeping between jobs: a worker that saw no job for `spin_ns` blocks on its own POSIX semaphore
(its *doorbell*, `sem_wait` called from numba with the GIL released) and the host rings the
doorbells after publishing a job or STOP (`ring`). Before doorbells, an idle worker returned to
Python and blocked on a condition variable: every wake-up then took the GIL twice (leaving the
loop, re-entering it through numba's dispatcher), while the caller ran the step's Python. With
one worker on a 2-core host that cost ~100-140 us from the release to the first task and ~90 us
between the last task and the merge, per layer (benchmarks/notes/cpu_window.md). Where unnamed
semaphores are missing (`sem_init` fails), workers fall back to returning LOOP_IDLE and blocking
in Python.

Helping at the end of a step: a step's tasks are few and coarse (one per sequence and KV group,
hundreds of microseconds each), so when the queue runs dry most workers would idle while a few
finish their last tasks. A worker that pops a task when fewer positions are left than there are
workers splits it after selection: it cuts the union of selected blocks into ranges of about
equal size (`split_bounds`) and offers them in its help word, `(job << 32) | (position << 16) |
(n_parts << 8) | next_part`; a worker that finds the queue empty takes ranges by CAS on that word
(a stale job id or a retracted word makes the CAS fail), attends them into the owner's partial
slots and counts them done. The owner takes ranges too, waits until all are counted, retracts
the word and merges the partials by log-sum-exp. Ranges never wait on anything, so helping
cannot deadlock; the owner's task keeps one record (its bytes, its start and end).

GPU picks: under the fluxion placement the GPU lane may select the blocks of the CPU lane's tasks
too (scheduler.cpu_task_selection, `hybrid_runtime.gpu_picks`): one launch scores every queue
position from the store's GPU copy of the metadata and writes each task's union (block ids and
head bits, as `cpu_kernels.sparse_attention.picked_union` reads them) into pinned host memory,
then the job id into the position's `ready` word (a system-scope release after the union). A job
published with PICKS set makes a worker wait for its position's `ready` word after the pop: the
job id means the union is there and the worker reads only K and V (`attend_picked`); minus the
job id means the GPU's selection will not come (its launch failed or never happened) and the
worker selects on the host as usual. The host writes the latter on every path on which it does
not launch the selection, so a worker never waits for a launch that will not happen. A worker
waits only while waiting is modeled to be cheaper than selecting itself: the job carries when the
selection is expected to land (PICK_AT, from its measured latency) and a worker's time to score
one block's metadata (PICK_NS_PER_BLOCK); a worker whose task's scoring would end before the
expected landing selects on the host at once, and one that waited gives up once that scoring time
has passed beyond the expected landing (`_await_pick`).

Starting on the device's word: on CUDA the step's q reaches the host by a copy on the caller's
stream, and the host used to wait for that copy and only then publish the job, so every layer's CPU
lane started after the device's event had fired, the launcher's thread had woken and published
(0.17-0.27 ms after q was on the device, end to end at 4 x 32K). A job published with QGATE set is
published before q is there: its workers take the job, then wait until the word QREADY holds at
least its id. The caller's stream writes the id there after q's copy (a driver stream write, fenced
behind the copy: `gpu_kernels.host_count_wait.signal_value`), so the workers start when q lands,
with no host thread between. A worker stops waiting on STOP, and when nothing of the job is left
to pop (the host closed the queue: a failed or timed-out step), so a write that never comes cannot
hold it.

Failures are statuses, not exceptions. An exception that unwinds through nopython frames skips
their reference decrements (numba 0.68: every array view those frames made -- of the arenas, q,
the results -- stays referenced for good, so a store's pinned arenas could never be freed). So a
task fails by a negative return instead: for the stock kernel (`run_task`, which raises on a row it
cannot run) the loop checks each row first (`task_status`: block size, CPU length within its
chunks, blocks within the workspace capacity the host wrote to `ctrl[MAX_BLOCKS]`; an injected
kernel gets 0 there and checks its rows itself), and a kernel returns a negative status instead
of its byte count for anything else. Then the loop stores the status in the task's
`rec[i, BYTES]` and returns `LOOP_FAILED` with `cur[wid, 0]` still holding the position; the
worker's Python fails the step with `failed_task_error`, counts the position done and calls the
loop again (`workers.CpuWorkers._native_failed`). Per task this costs a few integer compares. A
kernel that raises anyway still fails the step with its exception (same route), at the price of
that leak, which `KVStore.close` then reports. A kernel that never returns cannot be
interrupted; `cur` shows which worker is in which position (`running`), which the step's timeout
error names.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from cpu_kernels.layout import CHUNK_TOKENS
from cpu_kernels.sparse_attention import (Workspace, attend_blocks, attend_picked, merge_parts, picked_union, run_task,
                                         select_task, split_bounds)


def _libc_sem_init() -> Any:
    """libc's `sem_init` typed for ctypes (address as size_t), or None where the C library lacks
    the unnamed-semaphore calls; the loop calls `sem_wait`, `sem_post` and `sem_getvalue` by
    symbol (`_libc_call`)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sem_init
        for name in ("sem_wait", "sem_post", "sem_getvalue"):
            getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t, ctypes.c_int, ctypes.c_uint], ctypes.c_int
    return fn


_sem_init = _libc_sem_init()
SEM_BYTES = 64  # one doorbell per cache line (a glibc sem_t is 32 bytes)

C_SEQ, C_STOP, C_WORD, C_DONE = 0, 8, 16, 24
C_LAYER, C_B, C_N = 32, 33, 34
C_MAX_BLOCKS = 35  # blocks the stock kernel's workspaces hold (0: rows not checked), written at start
C_PICKS = 36  # the job's CPU tasks attend the GPU lane's selection (`picks`, see "GPU picks" above)
C_PICK_AT = 37  # when that selection is expected to land (monotonic ns)
C_PICK_NS_PER_BLOCK = 38  # a worker's modeled time to score one block's metadata itself (ns)
C_QGATE = 39  # the job's workers pop nothing before C_QREADY reaches its id ("Starting on the device's word")
C_QREADY = 40  # the last job whose q is on the host: written by the GPU's stream, on its own cache line
CTRL_SIZE = 48
MASK = (1 << 32) - 1

# Task table columns (queue order).
T_BATCH, T_KVHEAD, T_BLOCK, T_CPULEN, T_CHUNK_OFF, T_N_CHUNKS = range(6)
T_COLS = 6
# Record columns (queue order): worker, kernel start ns, kernel end ns, bytes, overhead ns.
R_WORKER, R_START, R_END, R_BYTES, R_OVERHEAD = range(5)
R_COLS = 5
# `collect_records`' totals: busy seconds, modeled bytes, first start, last end, bytes read.
COLLECTED = 5

LOOP_STOPPED, LOOP_IDLE, LOOP_WARM, LOOP_FAILED = 0, 1, 2, 3
# Negative task statuses of the loop's own row check (`task_status`); a kernel may return others.
S_BLOCK_SIZE, S_CPU_LEN, S_WORKSPACE, S_PICKS = -1, -2, -3, -4
# A picks row's wait: the GPU's selection is there (PICK_READY), will not come (PICK_HOST: select
# on the host), or the loop must stop (PICK_STOP).
PICK_READY, PICK_HOST, PICK_STOP = 1, 0, -1

# Splitting a task among idle workers: at most this many ranges, each of at least this many bytes
# of selected K+V (a range costs ~1-2 us of set-up and merge; 192 KiB is ~30 us of one core).
MAX_PARTS = 16
MIN_PART_BYTES = 192 << 10
# Help words and counters sit this many int64 apart (one cache line per worker).
LINE = 8


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
@numba.njit(nogil=True, inline="always")
def task_status(cpu_len, block_size, n_chunks, max_blocks):
    """0 when a task row is one the stock kernel accepts, else its negative status (checked before
    the kernel, which would have to raise: see "Failures" above); `max_blocks` 0: not checked."""
    if max_blocks <= 0:
        return 0
    if block_size != 16 and block_size != 32 and block_size != 64 and block_size != 128:
        return S_BLOCK_SIZE
    if cpu_len < 0 or cpu_len > n_chunks * CHUNK_TOKENS:
        return S_CPU_LEN
    if (cpu_len + block_size - 1) // block_size > max_blocks:
        return S_WORKSPACE
    return 0


def failed_task_error(status: int, row: np.ndarray, max_blocks: int) -> Exception:
    """The exception for a task that failed with `status` (its task table row `row`)."""
    cpu_len, block_size, n_chunks = int(row[T_CPULEN]), int(row[T_BLOCK]), int(row[T_N_CHUNKS])
    if status == S_BLOCK_SIZE:
        return ValueError(f"task block_size {block_size} is not one of 16, 32, 64, 128")
    if status == S_CPU_LEN:
        return ValueError(f"task cpu_len {cpu_len} is more than its {n_chunks} chunks of {CHUNK_TOKENS} tokens hold")
    if status == S_WORKSPACE:
        n_blocks = -(-cpu_len // block_size)
        return ValueError(f"task has {n_blocks} blocks (cpu_len {cpu_len}, block_size {block_size}) but the workspace "
                          f"holds {max_blocks}; size it from KVStore.max_task_blocks")
    if status == S_PICKS:
        return RuntimeError("the GPU lane's block selection for this CPU task holds a block outside the task's "
                            f"{-(-cpu_len // block_size)} blocks (cpu_len {cpu_len}, block_size {block_size}) or "
                            "more entries than it has blocks")
    return RuntimeError(f"the CPU task kernel returned failure status {status}")


def _libc_call(name: str, arg_types: list) -> Any:
    """An intrinsic calling libc's `name(pointers...) -> int` (one or two pointer arguments, passed as
    uintp addresses) by symbol, resolved when the code loads like `clock_gettime` above: functions
    calling it can be cached on disk, which a ctypes function (an address baked in) would forbid."""

    def codegen(context, builder, signature, llargs):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), arg_types), name)
        return builder.call(fn, [builder.inttoptr(a, t) for a, t in zip(llargs, arg_types)])

    if len(arg_types) == 1:
        def call(typingctx, a):
            return types.int32(a), codegen
    elif len(arg_types) == 2:
        def call(typingctx, a, b):
            return types.int32(a, b), codegen
    else:
        raise ValueError(f"libc calls of {len(arg_types)} arguments: 1 or 2 supported")
    call.__name__ = f"libc_{name}"
    return intrinsic(call)


if _sem_init is not None:
    _P8 = ir.IntType(8).as_pointer()
    _libc_sem_wait = _libc_call("sem_wait", [_P8])
    _libc_sem_post = _libc_call("sem_post", [_P8])
    _libc_sem_getvalue = _libc_call("sem_getvalue", [_P8, ir.IntType(32).as_pointer()])

    @numba.njit(nogil=True, cache=True)
    def _doorbell_wait(bell):
        # A signal interrupts sem_wait (-1, EINTR) like any spurious wake-up: the caller looks again.
        _libc_sem_wait(numba.uintp(bell))

    @numba.njit(nogil=True, cache=True)
    def _ring(bells, value):
        """Post every doorbell in `bells` (addresses) that is not already posted: a worker
        consumes at most one stale post, and a spinning worker does not pile posts up."""
        for i in range(bells.shape[0]):
            _libc_sem_getvalue(numba.uintp(bells[i]), numba.uintp(value.ctypes.data))
            if value[0] <= 0:
                _libc_sem_post(numba.uintp(bells[i]))

else:  # no semaphores: every bell address is 0 and the loop never sleeps on one

    @numba.njit(nogil=True, cache=True)
    def _doorbell_wait(bell):
        pass

    @numba.njit(nogil=True, cache=True)
    def _ring(bells, value):
        pass


def _call_kernel(kernel, arena, chunks, cpu_len, block_size, q, n_select, out, lse, scratch):
    """`kernel(...)`, or the stock `run_task` by name when `kernel` is None (chosen by type when the
    loop compiles, so the stock loop holds no dispatcher object and can be cached)."""


@overload(_call_kernel, jit_options={"nogil": True})
def _call_kernel_impl(kernel, arena, chunks, cpu_len, block_size, q, n_select, out, lse, scratch):
    if isinstance(kernel, types.NoneType):
        def stock(kernel, arena, chunks, cpu_len, block_size, q, n_select, out, lse, scratch):
            return run_task(arena, chunks, cpu_len, block_size, q, n_select, out, lse, *scratch)
        return stock

    def injected(kernel, arena, chunks, cpu_len, block_size, q, n_select, out, lse, scratch):
        return kernel(arena, chunks, cpu_len, block_size, q, n_select, out, lse, *scratch)
    return injected


# Not cached on disk: its signature holds the kernel (a dispatcher), which numba cannot pickle; the
# stock kernel's loop is `stock_worker_loop`, which is.
@numba.njit(nogil=True)
def worker_loop(ctrl, wid, spin_ns, bell, mode, arenas, q_flat, res_flat, hq, d, g, tab, nsel, chunks, rec, cur, kernel,
                scratch, team, picks):
    """Serve jobs until STOP (returns LOOP_STOPPED); after `spin_ns` without a new job, sleep on
    the doorbell at address `bell` until rung (`bell` 0: return LOOP_IDLE instead).

    `kernel(arena, chunks, cpu_len, block_size, q, n_select, out, lse, *scratch) -> bytes` is the
    task kernel, None for the stock one (`cpu_kernels.sparse_attention.run_task`, called by name so
    that no dispatcher object is baked into the code: see `stock_worker_loop`); `scratch` is this worker's workspace
    arrays in the kernel's parameter order. `cur[wid]` = (queue position being run or -1, last
    job id seen): lets the host account for a task that failed (returns LOOP_FAILED, see
    "Failures" above) or whose kernel raised, and keeps a worker from
    re-joining a job it already left. `team` = (split on, help words, done counts, busy ns,
    bounds, partial out, partial lse, every worker's union mask, this worker's `select_task`
    scratch, split count) of `NativeJobBuffers.team`: the helping described in the module docstring (split on
    = 0: every task runs whole in `kernel`). `picks` = (ready, union blocks, union head bits, union
    sizes, this worker's union mask and attention state, picked-task count) of
    `NativeJobBuffers.picks_args`, read for jobs published with PICKS ("GPU picks" above).
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
        use_picks = 0
        pick_at = 0
        pick_ns = 0
        q_gate = 0
        while True:
            if atomic_load(ctrl, C_STOP) != 0:
                return LOOP_STOPPED
            s1 = atomic_load(ctrl, C_SEQ)
            if s1 & 1 == 0 and (s1 >> 1) != last:
                layer = atomic_load(ctrl, C_LAYER)
                b = atomic_load(ctrl, C_B)
                n = atomic_load(ctrl, C_N)
                use_picks = atomic_load(ctrl, C_PICKS)
                pick_at = atomic_load(ctrl, C_PICK_AT)
                pick_ns = atomic_load(ctrl, C_PICK_NS_PER_BLOCK)
                q_gate = atomic_load(ctrl, C_QGATE)
                if atomic_load(ctrl, C_SEQ) == s1:  # consistent snapshot of the job
                    job = s1 >> 1
                    break
                continue
            if monotonic_ns() - t_idle > spin_ns:
                if bell == 0:
                    return LOOP_IDLE
                _doorbell_wait(bell)
                t_idle = monotonic_ns()
                continue
            cpu_relax()
        last = job
        cur[wid, 1] = job
        if q_gate != 0 and not _await_q(ctrl, job, n):
            return LOOP_STOPPED
        max_blocks = ctrl[C_MAX_BLOCKS]
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
            nbytes = task_status(tab[i, T_CPULEN], tab[i, T_BLOCK], tab[i, T_N_CHUNKS], max_blocks)
            t_popped = t1
            picked = PICK_HOST
            if nbytes == 0 and use_picks != 0:
                host_ns = (tab[i, T_CPULEN] + tab[i, T_BLOCK] - 1) // tab[i, T_BLOCK] * pick_ns
                picked = _await_pick(ctrl, picks[0], i, job, pick_at, host_ns)
                if picked == PICK_STOP:
                    return LOOP_STOPPED
                # The task starts with its selection in hand; the wait for it is neither the task's
                # time nor scheduling overhead (the GPU's selection latency, idle in the timeline).
                t1 = monotonic_ns()
            if nbytes != 0:
                pass  # a row the kernel would refuse by raising: failed below, as a status
            elif team[0] != 0 and n - i - 1 < cur.shape[0]:  # the queue is about to run dry
                nbytes = _split_task(ctrl, wid, job, i, arena, chunks[off : off + tab[i, T_N_CHUNKS]], tab[i, T_CPULEN],
                                     tab[i, T_BLOCK], q[bi, h0 : h0 + g], nsel[i], out[bi, h0 : h0 + g],
                                     lse[bi, h0 : h0 + g], team[8], team, tab, chunks, q, picked, picks)
            elif picked == PICK_READY:
                nbytes = attend_picked(arena, chunks[off : off + tab[i, T_N_CHUNKS]], tab[i, T_CPULEN], tab[i, T_BLOCK],
                                       q[bi, h0 : h0 + g], picks[1][i], picks[2][i], picks[3][i], out[bi, h0 : h0 + g],
                                       lse[bi, h0 : h0 + g], picks[4], picks[5])
                if nbytes < 0:
                    nbytes = S_PICKS
            else:
                nbytes = _call_kernel(
                    kernel, arena, chunks[off : off + tab[i, T_N_CHUNKS]], tab[i, T_CPULEN], tab[i, T_BLOCK],
                    q[bi, h0 : h0 + g], nsel[i], out[bi, h0 : h0 + g], lse[bi, h0 : h0 + g], scratch
                )
            if picked == PICK_READY and nbytes >= 0:
                atomic_add(picks[6], 0, 1)
            t2 = monotonic_ns()
            if nbytes < 0:  # failed: the host fails the step and counts the position done
                rec[i, R_BYTES] = nbytes
                return LOOP_FAILED
            rec[i, R_WORKER] = wid
            rec[i, R_START] = t1
            rec[i, R_END] = t2
            rec[i, R_BYTES] = nbytes
            cur[wid, 0] = -1
            t3 = monotonic_ns()
            rec[i, R_OVERHEAD] = (t_popped - t0) + (t3 - t2)  # pop + dispatch before, recording after
            atomic_add(ctrl, C_DONE, 1)
            t0 = t3
        if team[0] != 0:
            _help_until_done(ctrl, wid, job, arena, q, g, tab, chunks, cur, team, team[8][4])


@numba.njit(nogil=True)
def _await_q(ctrl, job, n):
    """Until job `job`'s q is on the host (QREADY >= job), or nothing of the job is left to pop;
    False on STOP ("Starting on the device's word" above)."""
    while atomic_load(ctrl, C_QREADY) < job:
        if atomic_load(ctrl, C_STOP) != 0:
            return False
        w = atomic_load(ctrl, C_WORD)
        if (w >> 32) != job or (w & MASK) >= n:
            return True
        cpu_relax()
    return True


@numba.njit(nogil=True)
def _await_pick(ctrl, ready, i, job, pick_at, host_ns):
    """Position `i`'s GPU selection of job `job` ("GPU picks" above): PICK_READY once its union is
    in place; PICK_HOST when it will not come, when it is expected (at `pick_at`, monotonic ns)
    later than this task's own scoring would end (`host_ns` from now), or when it is still missing
    `host_ns` past its expected landing; PICK_STOP on STOP."""
    r = atomic_load(ready, i)  # acquire: the union's words are read after it
    if r == job:
        return PICK_READY
    if r == -job:
        return PICK_HOST
    now = monotonic_ns()
    if pick_at - now > host_ns:
        return PICK_HOST
    deadline = max(pick_at, now) + host_ns
    while True:
        r = atomic_load(ready, i)
        if r == job:
            return PICK_READY
        if r == -job:
            return PICK_HOST
        if atomic_load(ctrl, C_STOP) != 0:
            return PICK_STOP
        if monotonic_ns() > deadline:
            return PICK_HOST
        cpu_relax()


@numba.njit(nogil=True)
def _take_part(me, w, job, arena, q, g, tab, chunks, team, state):
    """Worker `me` takes and attends one range offered by worker `w` for `job`; False when `w`
    offers none (True after a lost race too: the caller looks again)."""
    words, dones, busy, bounds, part_out, part_lse, masks = team[1], team[2], team[3], team[4], team[5], team[6], team[7]
    word = atomic_load(words, w * LINE)
    if (word >> 32) != job or (word & 255) >= ((word >> 8) & 255):
        return False
    if not atomic_cas(words, w * LINE, word, word + 1):
        return True  # lost a race for it: look again
    p = word & 255
    i = (word >> 16) & 0xFFFF
    t0 = monotonic_ns()
    bi = tab[i, T_BATCH]
    h0 = tab[i, T_KVHEAD] * g
    off = tab[i, T_CHUNK_OFF]
    attend_blocks(arena, chunks[off : off + tab[i, T_N_CHUNKS]], tab[i, T_CPULEN], tab[i, T_BLOCK], q[bi, h0 : h0 + g],
                  masks[w], bounds[w, p], bounds[w, p + 1], part_out[w, p], part_lse[w, p], state)
    if me != w:  # the owner's own ranges are inside its task's record
        atomic_add(busy, me * LINE, monotonic_ns() - t0)
    atomic_add(dones, w * LINE, 1)  # last: the owner may merge and move on at once
    return True


@numba.njit(nogil=True)
def _split_task(ctrl, wid, job, i, arena, task_chunks, cpu_len, block_size, qg, n_select, out, lse, scratch, team,
                tab, chunks, q, picked, picks):
    """Run task `i` as the owner of a split: select (or take the GPU's selection when `picked` is
    PICK_READY), offer ranges, attend, wait, merge; returns bytes."""
    words, dones, bounds, part_out, part_lse, masks = team[1], team[2], team[4], team[5], team[6], team[7]
    state = scratch[4]
    if picked == PICK_READY:
        meta_bytes = 0
        union_tokens = picked_union(cpu_len, block_size, picks[1][i], picks[2][i], picks[3][i], masks[wid])
        if union_tokens < 0:
            return S_PICKS
    else:
        meta_bytes, union_tokens = select_task(arena, task_chunks, cpu_len, block_size, qg, n_select, out, lse, *scratch)
    kv_bytes = union_tokens * 2 * qg.shape[1] * arena.itemsize
    n_parts = min(MAX_PARTS, kv_bytes // MIN_PART_BYTES)
    if n_parts < 2:
        attend_blocks(arena, task_chunks, cpu_len, block_size, qg, masks[wid], 0, (cpu_len + block_size - 1) // block_size,
                      out, lse, state)
        return meta_bytes + kv_bytes
    parts = split_bounds(masks[wid], cpu_len, block_size, union_tokens, n_parts, bounds[wid])
    atomic_add(team[9], 0, 1)
    atomic_store(dones, wid * LINE, 0)
    atomic_store(words, wid * LINE, (job << 32) | (i << 16) | (parts << 8))  # release: bounds and mask first
    g = qg.shape[0]
    while atomic_load(dones, wid * LINE) < parts:
        if _take_part(wid, wid, job, arena, q, g, tab, chunks, team, state):
            continue
        # Ours are all taken: help the others while ours finish (never wait idle).
        took = False
        for w in range(words.shape[0] // LINE):
            if w != wid and _take_part(wid, w, job, arena, q, g, tab, chunks, team, state):
                took = True
                break
        if not took:
            cpu_relax()
    atomic_store(words, wid * LINE, 0)
    merge_parts(part_out[wid], part_lse[wid], parts, out, lse)
    return meta_bytes + kv_bytes


@numba.njit(nogil=True)
def _help_until_done(ctrl, wid, job, arena, q, g, tab, chunks, cur, team, state):
    """The queue of `job` is empty: take ranges of split tasks until no worker still runs one of
    its tasks (a task in flight may still offer ranges), a new job starts, or STOP."""
    words = team[1]
    n_workers = words.shape[0] // LINE
    cur_flat = cur.reshape(-1)
    while True:
        took = False
        for w in range(n_workers):
            if w != wid and _take_part(wid, w, job, arena, q, g, tab, chunks, team, state):
                took = True
        if took:
            continue
        if atomic_load(ctrl, C_STOP) != 0 or (atomic_load(ctrl, C_SEQ) >> 1) != job:
            return
        busy = False
        for w in range(n_workers):
            if w != wid and atomic_load(cur_flat, 2 * w) >= 0 and atomic_load(cur_flat, 2 * w + 1) == job:
                busy = True
                break
        if not busy:
            return
        cpu_relax()


@numba.njit(nogil=True, cache=True)
def stock_worker_loop(ctrl, wid, spin_ns, bell, mode, arenas, q_flat, res_flat, hq, d, g, tab, nsel, chunks, rec, cur,
                      scratch, team, picks):
    """`worker_loop` with the stock kernel (`run_task`) built in, so that it is cached on disk: a new
    process loads it instead of compiling the loop and the kernels it inlines (seconds per start)."""
    return worker_loop(ctrl, wid, spin_ns, bell, mode, arenas, q_flat, res_flat, hq, d, g, tab, nsel, chunks, rec, cur,
                       None, scratch, team, picks)


# Numba invalidates a cached function when its own file changes, not when a function it compiles in
# does: the stock loop holds its own copy of the kernels below, so their files are stamped beside
# its cache and a changed stamp drops the loop's cached builds (they recompile on first use).
_LOOP_DEPENDENCIES = ("cpu_kernels/sparse_attention.py", "cpu_kernels/layout.py")


def _drop_stale_loop_cache() -> None:
    import os

    import cpu_kernels

    root = os.path.dirname(os.path.dirname(os.path.abspath(cpu_kernels.__file__)))
    try:
        stats = [os.stat(os.path.join(root, f)) for f in _LOOP_DEPENDENCIES]
    except OSError:
        return
    stamp = repr([(st.st_mtime_ns, st.st_size) for st in stats])
    cache = getattr(stock_worker_loop, "_cache", None)
    path = getattr(cache, "cache_path", None)
    if not path:
        return
    stamp_file = os.path.join(path, "native_pool.stock_worker_loop.dependencies")
    try:
        with open(stamp_file) as f:
            if f.read() == stamp:
                return
    except OSError:
        pass
    cache.flush()
    try:
        os.makedirs(path, exist_ok=True)
        with open(stamp_file, "w") as f:
            f.write(stamp)
    except OSError:
        pass  # a read-only cache: numba will not write the loop either


_drop_stale_loop_cache()


def serve(ctrl, wid: int, spin_ns: int, bell: int, mode: int, arenas, q_flat, res_flat, hq: int, d: int, g: int, tab,
          nsel, chunks, rec, cur, kernel, scratch, team, picks) -> int:
    """Run a worker's loop (`worker_loop`'s arguments): the cached `stock_worker_loop` for the stock
    kernel, the generic loop for any other."""
    if kernel is run_task:
        return stock_worker_loop(ctrl, wid, spin_ns, bell, mode, arenas, q_flat, res_flat, hq, d, g, tab, nsel, chunks,
                                 rec, cur, scratch, team, picks)
    return worker_loop(ctrl, wid, spin_ns, bell, mode, arenas, q_flat, res_flat, hq, d, g, tab, nsel, chunks, rec, cur,
                       kernel, scratch, team, picks)


@numba.njit(nogil=True, cache=True)
def publish(ctrl, layer, b, n, start=0, picks=0, pick_at=0, pick_ns_per_block=0, q_gate=0):
    """Make the job (tables already written) visible; returns its id.

    Positions `[0, start)` are already taken (the GPU lane's first claim, made before the CPU
    workers can pop anything): the first pop gets position `start`. `picks` non-zero: the workers
    look for each position's GPU selection, expected at `pick_at` (monotonic ns), and wait for it
    while that is cheaper than `pick_ns_per_block` per block of their own scoring ("GPU picks" above).
    `q_gate` non-zero: they pop nothing before QREADY reaches the job's id ("Starting on the
    device's word" above).
    """
    s = atomic_load(ctrl, C_SEQ)
    atomic_store(ctrl, C_SEQ, s + 1)
    atomic_store(ctrl, C_LAYER, layer)
    atomic_store(ctrl, C_B, b)
    atomic_store(ctrl, C_N, n)
    atomic_store(ctrl, C_PICKS, picks)
    atomic_store(ctrl, C_PICK_AT, pick_at)
    atomic_store(ctrl, C_PICK_NS_PER_BLOCK, pick_ns_per_block)
    atomic_store(ctrl, C_QGATE, q_gate)
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


@numba.njit(nogil=True, cache=True)
def collect_records(rec, total, cum, rows, worker, start, end, nbytes, overhead, help_busy_ns, out):
    """A finished job's records in one pass (the host's per-step `CpuWorkers.collect`): for each
    of the first `total` queue positions a CPU worker ran (`rec[i, R_WORKER] >= 0`; the GPU
    lane's stay -1), its record into the timeline columns at row `rows[i]` (`rows` empty: no
    columns), and the totals into `out`: busy seconds (plus the workers' help on others' ranges,
    which is taken and zeroed), modeled bytes (`cum` differences), first start and last end in
    seconds (0 when no position is a worker's), bytes read. A dozen numpy calls over ~30 rows
    cost ~120 us of host time a layer on the GPU machine's host; this costs a few."""
    busy = 0.0
    modeled = 0.0
    first = np.inf
    last = -np.inf
    read = 0
    cols = rows.shape[0] > 0
    for i in range(total):
        w = rec[i, R_WORKER]
        if w < 0:
            continue
        s = rec[i, R_START] * 1e-9
        e = rec[i, R_END] * 1e-9
        busy += e - s
        modeled += cum[i + 1] - cum[i]
        first = min(first, s)
        last = max(last, e)
        read += rec[i, R_BYTES]
        if cols:
            r = rows[i]
            worker[r] = w
            start[r] = s
            end[r] = e
            nbytes[r] = rec[i, R_BYTES]
            overhead[r] = rec[i, R_OVERHEAD] * 1e-9
    helped = 0
    for j in range(help_busy_ns.shape[0]):
        helped += help_busy_ns[j]
        help_busy_ns[j] = 0
    out[0] = busy + helped * 1e-9
    out[1] = modeled
    out[2] = first if last >= first else 0.0
    out[3] = last if last >= first else 0.0
    out[4] = read


def running(cur: np.ndarray, job: int) -> list[tuple[int, int]]:
    """`(worker, queue position)` of every native worker inside a task of job `job` (from
    `cur`; a snapshot for error messages, read while the workers run)."""
    return [(w, int(cur[w, 0])) for w in range(cur.shape[0]) if cur[w, 1] == job and cur[w, 0] >= 0]


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
    """Compile the host-side helpers for the argument types the host and the GPU lane pass
    (`queues.NativeQueue`: `publish` with its `start`). Each CPU worker calls it at its start,
    before it compiles (or loads) its loop, so the first step's wait for the workers covers it."""
    c = np.zeros(CTRL_SIZE, dtype=np.int64)
    job = publish(c, 0, 0, 0, 0, 0, 0, 0, 0)
    claim(c, job, 1, 0)
    close(c, job, 0)
    head(c, job, 0)
    done(c)
    add_done(c, 0)
    set_stop(c, 0)
    i64, f64 = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float64)
    collect_records(np.zeros((1, R_COLS), dtype=np.int64), 0, np.zeros(2), i64[:0], i64, f64, f64, i64, f64,
                    np.zeros(1, dtype=np.int64), np.zeros(COLLECTED))
    _ring(np.zeros(0, dtype=np.uint64), np.zeros(1, dtype=np.int32))


def _check_picks(picks: tuple, max_tasks: int) -> None:
    """ValueError unless `picks` is the (ready, blocks, heads, counts) arrays the loop reads."""
    want = (("ready", np.int64, 1), ("blocks", np.int32, 2), ("heads", np.int32, 2), ("counts", np.int32, 1))
    if len(picks) != len(want):
        raise ValueError(f"picks has {len(picks)} arrays; expected {len(want)}: ready, blocks, heads, counts")
    for x, (name, dtype, ndim) in zip(picks, want):
        if not isinstance(x, np.ndarray) or x.dtype != dtype or x.ndim != ndim or not x.flags.c_contiguous:
            raise ValueError(f"picks {name} is {getattr(x, 'dtype', type(x).__name__)} with "
                             f"{getattr(x, 'ndim', '?')} dims; expected contiguous {np.dtype(dtype).name} with {ndim}")
        if x.shape[0] < max_tasks:
            raise ValueError(f"picks {name} has {x.shape[0]} rows; the job buffers hold {max_tasks} tasks")
    if picks[1].shape != picks[2].shape:
        raise ValueError(f"picks blocks {picks[1].shape} and heads {picks[2].shape} differ in shape")


class NativeJobBuffers:
    """Shared task table, records and control word for one runtime, sized for the largest step.

    With `head_dim` and `max_blocks` (the workspaces' block capacity) and more than one worker,
    the workers also get the buffers to split tasks at the end of a step (`team`); `masks[w]` must
    then be worker w's workspace `block_heads`, so that helpers read the owner's union.
    """

    def __init__(self, max_tasks: int, group_size: int, max_chunks: int, n_workers: int, head_dim: int = 0,
                 max_blocks: int = 0, ctrl: np.ndarray | None = None, picks: tuple | None = None):
        # `ctrl`: the control words in memory the caller provides (pinned, so that a CUDA stream can
        # wait on DONE: `gpu_kernels.host_count_wait`); zeroed here.
        if ctrl is not None and (ctrl.dtype != np.int64 or ctrl.shape != (CTRL_SIZE,) or not ctrl.flags.c_contiguous):
            raise ValueError(f"ctrl is {ctrl.dtype} {ctrl.shape}; expected contiguous int64 ({CTRL_SIZE},)")
        # `picks`: (ready int64 [T], union blocks int32 [T, U], union head bits int32 [T, U], union
        # sizes int32 [T]) the GPU lane writes ("GPU picks" above; `hybrid_runtime.gpu_picks`), T
        # at least `max_tasks`; without them jobs cannot be published with PICKS.
        if picks is not None:
            _check_picks(picks, max(1, max_tasks))
        self.picks = picks if picks is not None else (
            np.zeros(1, np.int64), np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
        self.has_picks = picks is not None
        self.picked_tasks = np.zeros(LINE, dtype=np.int64)  # [0]: CPU tasks run on the GPU's selection
        self.ctrl = np.zeros(CTRL_SIZE, dtype=np.int64) if ctrl is None else ctrl
        self.ctrl[:] = 0
        self.tab = np.zeros((max(1, max_tasks), T_COLS), dtype=np.int64)
        self.nsel = np.zeros((max(1, max_tasks), group_size), dtype=np.int32)
        self.chunks = np.zeros(max(1, max_chunks), dtype=np.int32)
        self.rec = np.zeros((max(1, max_tasks), R_COLS), dtype=np.int64)
        self.cur = np.full((max(1, n_workers), 2), -1, dtype=np.int64)
        self.lock = threading.Lock()  # serialises hosts writing the table (one job at a time)
        # A help word holds a queue position in 16 bits.
        self.split = n_workers > 1 and head_dim > 0 and max_blocks > 0 and max_tasks < (1 << 16)
        w = max(1, n_workers) if self.split else 1
        parts = MAX_PARTS if self.split else 1
        self.help_words = np.zeros(w * LINE, dtype=np.int64)
        self.help_done = np.zeros(w * LINE, dtype=np.int64)
        self.help_busy_ns = np.zeros(w * LINE, dtype=np.int64)  # time spent on others' ranges
        self.collected = np.zeros(COLLECTED)  # `collect_records`' totals of the last collected job
        self.bounds = np.zeros((w, parts + 1), dtype=np.int64)
        self.part_out = np.zeros((w, parts, group_size, max(1, head_dim)), dtype=np.float32)
        self.part_lse = np.zeros((w, parts, group_size), dtype=np.float32)
        self.masks = np.zeros((w, max(1, max_blocks) if self.split else 1), dtype=np.uint32)
        self.split_tasks = np.zeros(LINE, dtype=np.int64)  # [0]: tasks run as a split so far
        # Doorbells (see "Sleeping between jobs"): worker w sleeps on the semaphore at bells[w].
        self._bell_mem = np.zeros((max(1, n_workers), SEM_BYTES), dtype=np.uint8)
        self.bells = np.zeros(max(1, n_workers), dtype=np.uint64)
        self._bell_value = np.zeros(1, dtype=np.int32)
        if _sem_init is not None:
            addrs = [self._bell_mem[w].ctypes.data for w in range(self.bells.size)]
            if all(_sem_init(a, 0, 0) == 0 for a in addrs):
                self.bells[:] = addrs

    @property
    def has_doorbells(self) -> bool:
        """Workers sleep on doorbells (else they return LOOP_IDLE and block in Python)."""
        return bool(self.bells[0])

    def bell(self, wid: int) -> int:
        """The `bell` argument of `worker_loop` for worker `wid` (0: none)."""
        return int(self.bells[wid])

    def ring(self) -> None:
        """Wake every sleeping worker: after publishing a job, or after STOP."""
        if self.has_doorbells:
            _ring(self.bells, self._bell_value)

    def team(self, workspace, enabled: bool = True) -> tuple:
        """The `team` argument of `worker_loop` for a worker with this `workspace` (split off
        unless `enabled` and sized for it); it ends with the workspace arrays `select_task` takes,
        whatever kernel the worker runs whole tasks with."""
        on = enabled and self.split
        if not on:  # never run, but typed like the real thing (a test double's workspace may lack it)
            workspace = Workspace(self.part_lse.shape[2], self.part_out.shape[3], 1)
        return (int(on), self.help_words, self.help_done, self.help_busy_ns, self.bounds,
                self.part_out, self.part_lse, self.masks, scratch_of(select_task, workspace), self.split_tasks)

    def picks_args(self, workspace) -> tuple:
        """The `picks` argument of `worker_loop` for a worker with this `workspace`: the shared
        picks arrays, its union mask and attention state (stand-ins when it has none: an injected
        kernel's workspace, whose jobs are never published with PICKS), the picked-task count."""
        if not isinstance(getattr(workspace, "block_heads", None), np.ndarray) or \
                not isinstance(getattr(workspace, "state", None), np.ndarray):
            workspace = Workspace(self.part_lse.shape[2], max(1, self.part_out.shape[3]), 1)
        return (*self.picks, workspace.block_heads, workspace.state, self.picked_tasks)


__all__ = [
    "COLLECTED", "C_DONE", "C_MAX_BLOCKS", "C_PICK_AT", "C_PICK_NS_PER_BLOCK", "C_PICKS", "C_QGATE", "C_QREADY", "C_SEQ",
    "C_STOP", "C_WORD", "LOOP_FAILED", "LOOP_IDLE", "LOOP_STOPPED",
    "LOOP_WARM", "MAX_PARTS", "MIN_PART_BYTES", "NativeJobBuffers", "PICK_HOST", "PICK_READY", "PICK_STOP", "R_BYTES",
    "R_COLS", "R_END", "R_OVERHEAD", "R_START", "R_WORKER", "S_BLOCK_SIZE", "S_CPU_LEN", "S_PICKS", "S_WORKSPACE",
    "T_BATCH", "T_BLOCK", "T_CHUNK_OFF", "T_COLS", "T_CPULEN", "T_KVHEAD", "T_N_CHUNKS", "add_done", "claim", "close", "collect_records",
    "done", "failed_task_error", "head", "monotonic_ns", "publish", "running", "scratch_of", "serve", "set_stop",
    "stock_worker_loop", "task_status", "warm_up", "worker_loop",
]
