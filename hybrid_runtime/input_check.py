"""The NaN/inf check of `decode`'s inputs, and when a bad input is reported (`scheduler.finite_check`).

A non-finite key written to the store poisons its blocks' min/max metadata, and so the selection
of every later step; a non-finite query makes the step's output NaN. The check is therefore an
error, never a warning, and a bad input is never dropped: it is raised by the call that made it
(`sync`) or, where checking at once would make the host wait for the GPU, by a later call
(`deferred`). The modes (`finite_check_mode`):

    sync      the call whose q, k, v (or lookahead) hold NaN/inf raises a ValueError naming them
              before anything changes. On CUDA with a CPU lane the check rides on q's host copy the
              CPU workers need anyway; otherwise (a GPU-only step, a spill that must come first) it
              reads a flag back from the device: a device synchronisation every call.
    deferred  the check is queued on the device (`gpu_kernels/nonfinite_counts.py`: one launch
              counting into pinned memory; none on a step whose step-inputs kernel counts q, k, v
              on its way, `gpu_kernels/step_inputs.py`) and read once it has run, without waiting: by the next
              `decode` (before it changes anything), or `prefill`, `release`, `close`; a check two
              calls old is waited for. The ValueError names the tensors, their counts and the step
              (layer, sequences, decode call) they came from; that step ran: its k, v are in the
              store (release and prefill those sequences again) and its output was NaN where q was.
              Without CUDA the check is computed at once on the host and reported the same way
              (one behaviour on every machine).
    auto      `deferred` for steps without a CPU lane on CUDA (placement gpu_only, AsyncTLS,
              SparDA: a sync check is a device synchronisation every layer, the host's only wait
              for the GPU there; benchmarks/notes/gpu_lane.md, Next -7), `sync` everywhere else,
              where it is cheap.

The key is read with `getattr` and a default (`finite_check_mode`) until `SchedulerConfig` carries
it (hybrid_runtime/config.py is owned elsewhere; docs/architecture.md gives the field to add).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Sequence

import numpy as np
import torch

from hybrid_runtime.config import ConfigError

FINITE_CHECK_MODES = ("auto", "sync", "deferred")


def finite_check_mode(scheduler_cfg: Any) -> str:
    """`scheduler.finite_check`, validated (a config built without `config_from_dict` skips its checks)."""
    mode = scheduler_cfg.finite_check
    if mode not in FINITE_CHECK_MODES:
        raise ConfigError(f"scheduler.finite_check: {mode!r} is not allowed; allowed: {', '.join(FINITE_CHECK_MODES)}")
    return mode


def defers(mode: str, cuda: bool, cpu_lane: bool) -> bool:
    """Whether a step's input check is deferred under `mode`, on CUDA or not, with or without a CPU
    lane whose start waits for q on the host (one that starts on the device's word,
    `scheduler.cpu_lane_start`, counts as none: nothing waits for q then)."""
    return mode == "deferred" or (mode == "auto" and cuda and not cpu_lane)


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming the tensor(s) holding NaN or +-inf, before anything changes.

    One `aminmax` per tensor (a single read, no temporary of the input's size; NaN propagates
    into both, +-inf shows in one). CPU results are read directly; CUDA results are combined
    into one flag read once: one device sync per call. Counting what is wrong runs only on failure.
    """
    ok = True
    on_device = []
    for x in tensors.values():
        if not x.numel():
            continue
        lo, hi = torch.aminmax(x)
        if x.device.type == "cpu":
            ok = ok and math.isfinite(lo.item()) and math.isfinite(hi.item())
        else:
            on_device += [lo.float(), hi.float()]
    if on_device:
        ok = ok and bool(torch.isfinite(torch.stack(on_device)).all())
    if ok:
        return
    raise nonfinite_error(count_nonfinite_now(tensors))


def nonfinite_count(x: torch.Tensor) -> int:
    """NaN/inf values of one tensor, counted at once (a device sync for a CUDA tensor)."""
    return int((~torch.isfinite(x)).sum()) if x.numel() else 0


def count_nonfinite_now(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """name -> (NaN/inf values, values), counted at once."""
    return {name: (nonfinite_count(x), x.numel()) for name, x in tensors.items()}


def check_finite_host(tensors: dict[str, torch.Tensor]) -> None:
    """`check_finite` on host copies (q scaled to fp32, k and v in their own dtypes)."""
    if not any(nonfinite_mask(x).any() for x in tensors.values()):
        return
    raise nonfinite_error(count_nonfinite_now(tensors))


# Exponent bits of the 16-bit floats: all set means +-inf or NaN.
_EXPONENT_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def nonfinite_mask(x: torch.Tensor) -> np.ndarray:
    """Where a host tensor holds NaN or +-inf (numpy has no bfloat16: its bits are read)."""
    mask = _EXPONENT_MASK.get(x.dtype)
    if mask is None:
        return ~np.isfinite(x.numpy())
    return (x.view(torch.int16).numpy() & mask) == mask


def nonfinite_error(counts: dict[str, tuple[int, int]], after: str | None = None) -> ValueError:
    """The error for inputs holding NaN/inf: `counts` maps a name to (bad values, values). `after`:
    the step they came from, for a check read after that step ran (`DeferredInputCheck`)."""
    bad = [f"{name} has {n} NaN/inf value{'s' if n > 1 else ''} of {total}" for name, (n, total) in counts.items() if n]
    if after is None:
        return ValueError(
            "; ".join(bad) + "; expected finite values (NaN/inf in k or v would poison the stored KV and its block "
            "metadata for every later step, in q they make the output NaN); nothing was changed"
        )
    return ValueError(
        "; ".join(bad) + f" in the inputs of {after}; expected finite values. Found by the deferred input check "
        "(scheduler.finite_check), read after that step had run: its k and v are in the store at that layer, and "
        "NaN/inf there poisons the stored KV and its block metadata for every later step (release those sequences "
        "and prefill them again); NaN/inf in q made that step's output NaN"
    )


def checked_dtypes(store_dtype: torch.dtype, lookahead: bool) -> list[tuple[torch.dtype, ...]]:
    """The input dtypes the count kernel is compiled for before the first step (`DeferredInputCheck.warm_up`):
    q, k, v in the store's dtype or fp32, and with `lookahead` (SparDA) a fourth tensor in either."""
    three = [(t, t, t) for t in dict.fromkeys((store_dtype, torch.float32))]
    four = [(*t, la) for t in three for la in dict.fromkeys((t[0], torch.float32))] if lookahead else []
    return three + four


class DeferredInputCheck:
    """Input checks queued on the device and read when they have run, for `finite_check: deferred`.

    `issue` counts each tensor's NaN/inf values on the caller's stream into a row of a pinned ring
    (one launch, `gpu_kernels.nonfinite_counts`) and records an event after it; `poll` reads the
    rows whose event has completed (waiting for those `WAIT_AFTER_CALLS` calls old) and raises the
    first bad step's ValueError. A ring row is reused only after it was read. Tensors not all on
    the CUDA `device` (and every tensor without CUDA) are counted at once on the host and
    reported the same way, one call later.
    """

    # Rows in the ring: pending checks never exceed WAIT_AFTER_CALLS + 1 (every call polls first).
    SLOTS = 8
    # The fused ring's rows are padded to a multiple of this many int32 columns (16 bytes).
    ROW_ALIGN_INTS = 4
    # A check is waited for once this many later calls have started (it has run long before in
    # practice: a GPU-only step that trails returns after the previous step's claims ended, and
    # those claims were queued after the previous step's check).
    WAIT_AFTER_CALLS = 2

    def __init__(self, device: torch.device, fused_columns: int = 0):
        """`fused_columns`: on CUDA, also a ring of `[N_COUNTS, fused_columns]` rows that the
        step-inputs kernel counts q, k and v into (`fused_row`, `issue_counted`): the check of a
        step that launches that kernel anyway costs no launch of its own."""
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # "cuda": the inputs' devices carry an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.calls = 0  # decode calls seen (`issue` numbers the checks with it)
        self.deferred_checks = 0  # checks issued
        self.device_checks = 0  # ... of them counted on the device (the others at once on the host)
        self.fused_checks = 0  # ... of them counted by a kernel the step launched anyway (`issue_counted`)
        # (slot, counts, names, numel, layer, seq_ids, call, event), oldest first; counts: the slot's
        # rows as numpy, one per tensor, whose sums are the tensors' NaN/inf counts.
        self._pending: deque = deque()
        self._busy = [False] * self.SLOTS
        self._turn = 0
        if self.cuda:
            from gpu_kernels.nonfinite_counts import MAX_TENSORS, SPLITS, count_nonfinite
            from gpu_kernels.streams import current_stream
            from gpu_kernels.uva import uva_view

            self._count, self._stream = count_nonfinite, current_stream
            self._ring = torch.zeros((self.SLOTS, MAX_TENSORS, SPLITS), dtype=torch.int32, pin_memory=True)
            ring_dev = uva_view(self._ring, device.index)  # the kernel writes the pinned rows directly
            self._rows_dev = [ring_dev[i] for i in range(self.SLOTS)]  # views made once: each costs host time
            self._events = [torch.cuda.Event() for _ in range(self.SLOTS)]
        else:
            self._ring = torch.zeros((self.SLOTS, 4, 1), dtype=torch.int32)
            self._events = [None] * self.SLOTS
        self.fused_columns = fused_columns
        if fused_columns:
            from gpu_kernels.step_inputs import N_COUNTS

            # Rows padded to 16 bytes, so that every slot's row starts 16-byte aligned. The unpadded
            # ring (72-byte rows at C = 6) gave wrong first steps on CUDA: a misaligned row was a new
            # `CachedLaunch` key then, so its first launch went through Triton's JIT, which launched
            # on a pool stream instead of the caller's (benchmarks/notes/e2e_overlap.md section 22).
            # Both are fixed in gpu_kernels/launch.py; the rows stay aligned all the same.
            fused = torch.zeros((self.SLOTS, N_COUNTS, self.fused_row_columns(fused_columns)), dtype=torch.int32, pin_memory=self.cuda)
            fused_dev = uva_view(fused, device.index) if self.cuda else fused  # the kernel writes the pinned rows
            self._fused_dev = [fused_dev[i] for i in range(self.SLOTS)]
            self._fused_np = fused.numpy()
        self._ring_np = self._ring.numpy()

    @classmethod
    def fused_row_columns(cls, columns: int) -> int:
        """The columns a fused ring row of `columns` counts takes: padded to `ROW_ALIGN_INTS`."""
        return -(-columns // cls.ROW_ALIGN_INTS) * cls.ROW_ALIGN_INTS

    def next_call(self) -> None:
        """A decode call starts (the age of pending checks is counted in calls)."""
        self.calls += 1

    def issue(self, tensors: dict[str, torch.Tensor], layer: int, seq_ids: Sequence[int],
              stream: "torch.cuda.Stream | None" = None) -> None:
        """Queue the check of `tensors` (name -> `[B, H, D]`, at most 4), the inputs of the decode
        step at `layer` for `seq_ids`, on `stream` (the caller's, where they are ready; CUDA);
        returns at once on CUDA."""
        slot = self._turn
        if self._busy[slot]:
            self.poll(block=True)  # not reached: every call polls first (`SLOTS` > pending)
        self._turn = (slot + 1) % self.SLOTS
        names = tuple(tensors)
        xs = tuple(tensors.values())
        numel = tuple(x.numel() for x in xs)
        row = self._ring_np[slot]
        event = None
        if self.cuda and all(x.device == self.device for x in xs):
            stream = self._stream() if stream is None else stream
            self._count(xs, self._rows_dev[slot], stream.cuda_stream, validate=False)
            event = self._events[slot]
            event.record(stream)
            self.device_checks += 1
        else:  # host tensors (or another device): counted now, reported as if deferred
            row[:] = 0
            for i, x in enumerate(xs):
                row[i, 0] = nonfinite_count(x)
        self._busy[slot] = True
        self._pending.append((slot, row, names, numel, layer, seq_ids, self.calls, event))
        self.deferred_checks += 1

    def fused_row(self) -> torch.Tensor:
        """The UVA view (int32 `[N_COUNTS, C]`, `C >= fused_columns`, contiguous, 16-byte aligned) of the pinned row that the
        next check counted by another kernel takes: pass it as the step-inputs kernel's `counts`,
        then register the check with `issue_counted` on the same stream. Until then the row is
        nobody's: a step that fails in between leaves it to the next check."""
        if not self.fused_columns:
            raise RuntimeError("this DeferredInputCheck has no fused rows (built with fused_columns=0)")
        slot = self._turn
        if self._busy[slot]:
            self.poll(block=True)  # not reached: every call polls first (`SLOTS` > pending)
        return self._fused_dev[slot]

    def issue_counted(self, numel: dict[str, int], columns: int, layer: int, seq_ids: Sequence[int],
                      stream: "torch.cuda.Stream | None") -> None:
        """Register the check whose counts a kernel queued on `stream` wrote into `fused_row()`'s
        row: `numel` names q, k and v (in the kernel's count order) with their sizes, `columns` the
        columns that kernel wrote (`step_inputs.count_columns(B * Hq)`; the others hold an older
        step's counts). Returns at once; read and raised as `issue`'s checks are. Without CUDA
        (`stream` None) the row must hold its counts already."""
        slot = self._turn
        self._turn = (slot + 1) % self.SLOTS
        event = self._events[slot]
        if event is not None:
            event.record(stream)
        self._busy[slot] = True
        self._pending.append((slot, self._fused_np[slot, :, :columns], tuple(numel), tuple(numel.values()), layer,
                              seq_ids, self.calls, event))
        self.device_checks += event is not None
        self.fused_checks += 1
        self.deferred_checks += 1

    @property
    def pending(self) -> int:
        return len(self._pending)

    def poll(self, block: bool = False) -> None:
        """Read the checks that have run, oldest first (`block`: all of them, waiting; else those
        `WAIT_AFTER_CALLS` calls old are waited for); raise the first bad one's ValueError (the
        checks after it stay pending and are read by the next poll)."""
        pending = self._pending
        while pending:
            slot, row, names, numel, layer, seq_ids, call, event = pending[0]
            if event is not None and not event.query():
                if not block and self.calls - call < self.WAIT_AFTER_CALLS:
                    return
                event.synchronize()
            pending.popleft()
            self._busy[slot] = False
            if row.any():  # unused rows of a check count 0: any count is a bad input
                counts = row.sum(axis=1)
                where = f"the decode step at layer {layer} for sequences {list(seq_ids)} (decode call {call})"
                raise nonfinite_error({name: (int(counts[i]), numel[i]) for i, name in enumerate(names)}, after=where)

    def warm_up(self, variants: Sequence[tuple[torch.dtype, ...]], d: int) -> None:
        """Compile the kernel for inputs of these dtypes (one tuple per variant: q, k, v and maybe
        lookahead) and head dim `d`, on the current stream, into scratch of its own (CUDA only)."""
        if not self.cuda:
            return
        from gpu_kernels.nonfinite_counts import MAX_TENSORS, SPLITS

        out = torch.zeros((MAX_TENSORS, SPLITS), dtype=torch.int32, device=self.device)
        for dtypes in dict.fromkeys(variants):
            self._count(tuple(torch.zeros((1, 1, d), dtype=t, device=self.device) for t in dtypes), out,
                        self._stream().cuda_stream)


__all__ = ["DeferredInputCheck", "FINITE_CHECK_MODES", "check_finite", "check_finite_host", "checked_dtypes",
           "count_nonfinite_now",
           "defers", "finite_check_mode", "nonfinite_count", "nonfinite_error", "nonfinite_mask"]
