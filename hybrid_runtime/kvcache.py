"""Hierarchical KV store: a GPU window per sequence and a pinned, paged CPU store per layer.

Per sequence and layer the tokens live in position order as

    sink (GPU window) | CPU-resident segment (CPU store) | recent tokens (GPU window)

A prompt arrives whole or in chunks (`prefill(..., extend=True)` appends the next chunk): the
first `sink` tokens fill the sink, and the recent part keeps the last `local` tokens, everything
older moving to the CPU segment, so a prompt given in chunks is stored exactly as the same prompt
given at once. Generated tokens append to the recent part; when it grows past
`local + generated_cap`, its oldest whole pages move to the end of the CPU segment (a spill), so
GPU memory stays bounded and the CPU segment stays contiguous in position.

CPU memory is one arena per layer (layout in `cpu_kernels/layout.py`): one tensor whose address
range is reserved when the store is built, so every kernel addresses it as before (a numpy view,
a UVA view), but whose memory is committed -- faulted in and, with CUDA, pinned
(`cudaHostRegister`) -- in slabs of `SLAB_BYTES` as chunks are first handed out. Building a store
therefore costs microseconds whatever its capacity; prefill commits the slabs it writes and asks
a background thread to commit the other layers' arenas as far (a prompt has the same length at
every layer) plus a reserve for decode spills, so decode steps find their memory committed. Chunks
of 128 tokens of one KV head come from a free list and go back to it on `release`; committed
memory stays committed (and pinned) until `close`. `kv_cache.cpu_capacity_tokens` bounds the
CPU-resident tokens of all sequences together at each layer; a prefill or a spill past it is
refused before anything changes.

Handing KV to the CPU store (`_write_cpu`): the chunks a write touches are built whole -- keys,
values with zeroed tails and the block metadata of every granularity -- on the device the KV is on
(torch ops, on the caller's stream), then land in the arena: from CUDA as one device-to-host copy
per contiguous run of chunk ids into the pinned arena on the store's copy stream, overlapping
whatever the caller does next (the chunks' source buffer is owned by the store, so the caller may
overwrite its k, v at once); from the CPU in place. Anything that reads a layer's arena on the
host or learns its chunk ids (`chunk_table`, `full_kv`, decode's task building) first waits for
that layer's copies.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import psutil
import torch

from cpu_kernels import layout
from gpu_kernels.streams import current_stream
from gpu_kernels.uva import uva_view
from gpu_kernels.window_append import append_window
from hybrid_runtime.config import GeometryConfig, KVCacheConfig

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Arena memory is committed (faulted in, pinned with CUDA) in slabs of this many bytes: large
# enough that registering them costs little per byte, small enough that a layer commits at most
# one slab it does not use yet.
SLAB_BYTES = 64 << 20
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every device, mapped into the
# unified address space (the arena's UVA view reads it at its host address).
_REGISTER_FLAGS = 0x01 | 0x02
# Arenas start on a 2 MiB boundary and are advised to use transparent huge pages: fewer page
# faults when a slab is committed, fewer TLB misses for the CPU workers that read it.
_HUGE_PAGE = 2 << 20

log = logging.getLogger(__name__)


class CapacityError(MemoryError):
    """A request needs more memory (host, pinned chunks or sequence slots) than is available."""


@dataclass
class _SeqLayer:
    """State of one sequence at one layer."""

    sink_len: int = 0
    recent_len: int = 0
    cpu_len: int = 0
    n_chunks: int = 0  # chunks per KV head
    chunk_table: np.ndarray | None = None  # [Hkv, capacity] int32, first n_chunks columns valid

    @property
    def tokens(self) -> int:
        return self.sink_len + self.cpu_len + self.recent_len


def arena_bytes(kv_cfg: KVCacheConfig, geometry: GeometryConfig, layers: int | None = None) -> tuple[int, int]:
    """(chunks per layer, bytes of all arenas once committed) for a config, before anything is
    allocated; `layers` defaults to the geometry's. The one formula for arena memory: the store's
    own check and the run's memory plan (`memory_plan.py`) both use it."""
    hkv = geometry.kv_heads
    # The most chunks per KV head that sequences holding `cap` tokens in all can occupy: each of
    # the (at most min(max_sequences, cap)) non-empty ones wastes under one chunk at its tail, so
    # sum(ceil(len_i / 128)) <= (cap + 127 * n_seq) // 128, reached by n_seq - 1 one-token sequences.
    cap = kv_cfg.cpu_capacity_tokens
    tails = (layout.CHUNK_TOKENS - 1) * min(kv_cfg.max_sequences, cap)
    n_chunks = (cap + tails) // layout.CHUNK_TOKENS * hkv
    esize = torch.tensor([], dtype=_TORCH_DTYPES[kv_cfg.dtype]).element_size()
    per_layer = n_chunks * layout.CHUNK_ROWS * geometry.head_dim * esize
    return n_chunks, per_layer * (geometry.layers if layers is None else layers)


def gpu_metadata_bytes(kv_cfg: KVCacheConfig, geometry: GeometryConfig, layers: int | None = None) -> int:
    """Device bytes of the GPU copy of every layer's block metadata (`kv_cache.gpu_metadata`):
    the metadata rows of every chunk `arena_bytes` counts."""
    n_chunks, _ = arena_bytes(kv_cfg, geometry, layers)
    esize = torch.tensor([], dtype=_TORCH_DTYPES[kv_cfg.dtype]).element_size()
    return n_chunks * layout.META_ROWS * geometry.head_dim * esize * (geometry.layers if layers is None else layers)


def host_available_bytes() -> int:
    """Host memory available for a new pinned allocation: psutil's figure after handing torch's cached
    pinned blocks back to the system. Freed pinned tensors (a closed runtime's arena) stay in torch's
    host caching allocator, invisible to psutil; a second runtime in the process would otherwise be
    refused for memory the first one left there."""
    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    return int(psutil.virtual_memory().available)


def _window_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("kv_cache.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        # With its index: a tensor's device always carries one, and "cuda:0" != "cuda", so checks of
        # inputs against the store's device (the runtime's step-inputs path, the predictor's) would
        # never pass (they did not, from 62d7b58 until the runtime indexed its own copy).
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ---------------------------------------------------------------------------- chunk images
def chunk_images(keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole chunks `[H * m, CHUNK_ROWS, D]` holding `H` runs of `T` tokens `[H, T, D]`.

    Run `h` fills chunks `h * m .. h * m + m - 1` (`m = ceil(T / 128)`) from the first row of the
    first one: key rows, value rows, rows past `T` zero, and the (min, max) key metadata of every
    block of every granularity; blocks without a valid token get zero metadata. Computed with torch
    ops on the tensors' device, in their dtype (min and max are exact in any order, so this equals
    a float32 computation bit for bit). `out` (same shape, dtype and device) receives the chunks in
    place, e.g. a contiguous slice of an arena.
    """
    h, t, d = keys.shape
    ct = layout.CHUNK_TOKENS
    m = -(-t // ct)
    if out is None:
        out = torch.empty((h * m, layout.CHUNK_ROWS, d), dtype=keys.dtype, device=keys.device)
    chunks = out.view(h, m, layout.CHUNK_ROWS, d)
    full, tail = divmod(t, ct)
    for row, src in ((layout.K_ROW, keys), (layout.V_ROW, values)):
        if full:
            chunks[:, :full, row : row + ct] = src[:, : full * ct].reshape(h, full, ct, d)
        if tail:
            chunks[:, full, row : row + tail] = src[:, full * ct :]
            chunks[:, full, row + tail : row + ct] = 0
    k_rows = chunks[:, :, layout.K_ROW : layout.K_ROW + ct]  # [h, m, 128, d], in the output dtype
    per16 = layout.CHUNK_TOKENS // layout.BLOCK_SIZES[0]
    blocks = k_rows.reshape(h, m, per16, layout.BLOCK_SIZES[0], d)
    lo, hi = blocks.amin(3), blocks.amax(3)  # [h, m, 8, d]
    if tail:  # the last chunk's rows past T must not count
        last = k_rows[:, full]
        valid = (torch.arange(ct, device=keys.device) < tail)[:, None]
        lo[:, full] = torch.where(valid, last, float("inf")).view(h, per16, -1, d).amin(2)
        hi[:, full] = torch.where(valid, last, float("-inf")).view(h, per16, -1, d).amax(2)
    mins, maxs = [lo], [hi]
    while mins[-1].shape[2] > 1:  # blk 32, 64, 128 from pairs of the next smaller size
        n = mins[-1].shape[2] // 2
        mins.append(mins[-1].view(h, m, n, 2, d).amin(3))
        maxs.append(maxs[-1].view(h, m, n, 2, d).amax(3))
    meta = torch.stack([torch.cat(mins, 2), torch.cat(maxs, 2)], 3)  # [h, m, 15, 2, d]: entry e, (min, max)
    meta.masked_fill_(meta.isinf(), 0)  # blocks past T
    chunks[:, :, layout.META_ROW :] = meta.view(h, m, 2 * layout.META_ENTRIES, d)
    return out


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """`(first id, end id, first position in ids)` of every run of consecutive ids."""
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [ids.size]])
    return [(int(ids[s]), int(ids[s]) + int(e - s), int(s)) for s, e in zip(starts, ends)]


# ---------------------------------------------------------------------------- host arenas
class _HostArena:
    """One layer's arena: address space for every chunk reserved at once, memory committed later.

    The reservation is an anonymous private mapping (no memory until touched). `commit(n)` makes
    the first `n` chunks usable: slab by slab it faults the pages in (torch's parallel fill) and,
    with `pin`, registers them with CUDA so copies into them are asynchronous and the UVA view of
    the arena reads them. Thread-safe: the caller and the store's committer thread may both commit.
    """

    def __init__(self, n_chunks: int, head_dim: int, dtype: torch.dtype, pin: bool):
        esize = torch.tensor([], dtype=dtype).element_size()
        self.chunk_bytes = layout.CHUNK_ROWS * head_dim * esize
        self.nbytes = n_chunks * self.chunk_bytes
        self.n_chunks = n_chunks
        self.pin = pin
        span = -(-self.nbytes // _HUGE_PAGE) * _HUGE_PAGE  # slabs end on page boundaries inside the mapping
        self._map = mmap.mmap(-1, span + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no transparent huge pages here: 4 KiB pages work too
            pass
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # the whole mapping
        self._start = (-self._bytes.data_ptr()) % _HUGE_PAGE  # the arena starts 2 MiB aligned
        self._end = self._start + span
        arena = self._bytes[self._start : self._start + self.nbytes]
        self.tensor = arena.view(dtype).view(n_chunks, layout.CHUNK_ROWS, head_dim)
        # Bytes [0, committed_bytes) of the mapping are committed. The first slab also covers the
        # bytes before the arena: torch asks CUDA about the mapping's first address when it checks
        # that the arena is pinned.
        self.committed_bytes = 0
        self.ready_chunks = 0  # chunks [0, ready_chunks) are committed
        self.registered: list[int] = []  # base addresses of the slabs registered with CUDA
        self.lock = threading.Lock()

    def commit(self, n_chunks: int, max_slabs: int | None = None) -> int:
        """Commit slabs until the first `n_chunks` chunks are usable (at most `max_slabs` slabs);
        returns the bytes committed by this call. Raises CapacityError if CUDA refuses to pin."""
        done = 0
        with self.lock:
            goal = self._start + min(n_chunks, self.n_chunks) * self.chunk_bytes
            while self.committed_bytes < goal and (max_slabs is None or max_slabs > 0):
                lo = self.committed_bytes
                hi = min(self._start + SLAB_BYTES * (1 + max(0, lo - self._start) // SLAB_BYTES), self._end)
                slab = self._bytes[lo:hi]
                slab.zero_()  # faults the pages in (they are zero already), in parallel, without the GIL
                if self.pin:
                    err = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), hi - lo, _REGISTER_FLAGS)
                    if int(err) != 0:
                        raise CapacityError(
                            f"pinning {(hi - lo) / 2**20:.0f} MiB of a KV arena failed (cudaHostRegister error "
                            f"{int(err)}) with {self.committed_bytes / 2**30:.2f} GiB of it pinned: the host has "
                            "no more memory it can pin; lower kv_cache.cpu_capacity_tokens or "
                            "kv_cache.max_host_memory_fraction"
                        )
                    self.registered.append(slab.data_ptr())
                self.committed_bytes = hi
                self.ready_chunks = min(self.n_chunks, (hi - self._start) // self.chunk_bytes)
                done += hi - lo
                if max_slabs is not None:
                    max_slabs -= 1
        return done


def _unregister(registered: list[list[int]]) -> None:
    """Unpin every registered slab (before the mappings go away). Finalizer: holds no arena."""
    for ptrs in registered:
        for ptr in ptrs:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        ptrs.clear()


class KVStore:
    """GPU windows and CPU arenas of every layer for up to `max_sequences` sequences."""

    def __init__(self, kv_cfg: KVCacheConfig, geometry: GeometryConfig, layers: int | None = None):
        self.cfg = kv_cfg
        self.geometry = geometry
        self.layers = geometry.layers if layers is None else layers
        self.kv_heads = geometry.kv_heads
        self.head_dim = geometry.head_dim
        self.dtype = _TORCH_DTYPES[kv_cfg.dtype]
        self.device = _window_device(kv_cfg.device)
        self.pinned = torch.cuda.is_available()
        self._closed = False

        n_chunks, total = arena_bytes(kv_cfg, geometry, self.layers)
        available = host_available_bytes()
        allowed = int(available * kv_cfg.max_host_memory_fraction)
        if total > allowed:
            raise CapacityError(
                f"kv_cache.cpu_capacity_tokens={kv_cfg.cpu_capacity_tokens} needs "
                f"{total / 2**30:.2f} GiB of {'pinned ' if self.pinned else ''}host memory for "
                f"{self.layers} layers, but only {allowed / 2**30:.2f} GiB is allowed "
                f"({kv_cfg.max_host_memory_fraction:.0%} of {available / 2**30:.2f} GiB available); "
                "lower cpu_capacity_tokens or max_sequences"
            )
        self.n_chunks = n_chunks
        # Address space only: memory is committed slab by slab as chunks are first used.
        self._host = [_HostArena(n_chunks, self.head_dim, self.dtype, self.pinned) for _ in range(self.layers)]
        self._arenas = [a.tensor for a in self._host]
        self._arenas_np = [numpy_view(a) for a in self._arenas]
        self._arenas_cuda: list[torch.Tensor | None] = [None] * self.layers
        self._unpin = weakref.finalize(self, _unregister, [a.registered for a in self._host])
        # Free chunks per layer as a stack: _free[l][:_n_free[l]] are free; `_alloc` pops from the
        # top so that chunk ids come out ascending, and `release` pushes a sequence's chunks so
        # that the next allocation of the same size gets them back in the same order (contiguous
        # runs stay contiguous: one copy per run when a prefill hands its KV over).
        self._free = [np.arange(n_chunks - 1, -1, -1, dtype=np.int32) for _ in range(self.layers)]
        self._n_free = [n_chunks] * self.layers
        self._frontier = [0] * self.layers  # 1 + the highest chunk id ever handed out, per layer
        self._cpu_tokens = [0] * self.layers  # CPU-resident tokens of all sequences, per layer
        # Committed chunks kept ahead of use for decode spills: one spill of every sequence.
        spill_chunks = (kv_cfg.generated_cap + layout.PAGE_SIZE) // layout.CHUNK_TOKENS + 2
        self.reserve_chunks = min(n_chunks, kv_cfg.max_sequences * self.kv_heads * spill_chunks)
        self._bg_lock = threading.Lock()
        self._bg_target = 0  # chunks every layer's committer should reach
        self._bg_next = 0  # the layer it serves first
        self._bg_running = False
        self._bg_stop = False  # set by close: the committer stops after its current slab
        self._committer: ThreadPoolExecutor | None = None
        self.decode_commit_bytes = 0  # bytes a spill had to commit itself (the committer was behind)
        # Device-to-host copies of chunks still in flight, per layer (the newest; one stream).
        self._copy_stream: torch.cuda.Stream | None = None
        self._pending: list[torch.cuda.Event | None] = [None] * self.layers
        # Per layer `[n_chunks, META_ROWS, D]` on the window's device: every chunk's metadata rows,
        # written with the chunk (`enable_gpu_metadata`); None while the store keeps none.
        self._meta_dev: list[torch.Tensor] | None = None

        w = kv_cfg.sink + kv_cfg.local + kv_cfg.generated_cap + layout.PAGE_SIZE
        self.window_capacity = w
        shape = (kv_cfg.max_sequences, self.kv_heads, w, self.head_dim)
        self._win_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self._win_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self._slots: dict[int, int] = {}
        self._free_slots = list(range(kv_cfg.max_sequences - 1, -1, -1))
        self._state: dict[int, list[_SeqLayer]] = {}

    # ------------------------------------------------------------------ accessors
    @property
    def max_sequence_cpu_tokens(self) -> int:
        """The most CPU-resident tokens one sequence can hold at a layer: the whole capacity."""
        return self.cfg.cpu_capacity_tokens

    @property
    def max_task_blocks(self) -> int:
        """The most blocks one task (a sequence's KV head at a layer) can have: its longest CPU
        segment in blocks of the smallest size. Sizes the CPU kernels' workspaces."""
        return -(-self.max_sequence_cpu_tokens // min(layout.BLOCK_SIZES))

    @property
    def closed(self) -> bool:
        return self._closed

    def arena(self, layer: int) -> torch.Tensor:
        """Host arena `[n_chunks, CHUNK_ROWS, D]` of a layer (pinned as committed, with CUDA)."""
        self._check_open()
        return self._arenas[layer]

    def arena_numpy(self, layer: int) -> np.ndarray:
        """The arena as numpy sharing memory: uint16 for bf16 stores, float32 for fp32 stores."""
        self._check_open()
        return self._arenas_np[layer]

    def arena_cuda(self, layer: int) -> torch.Tensor:
        """A CUDA view of the layer's pinned arena (no copy), made once and cached.

        Only committed chunks may be read through it -- every chunk a sequence holds is. Its
        first slab is committed here, since the view is made from the arena's first address.
        """
        self._check_open()
        view = self._arenas_cuda[layer]
        if view is None:
            from gpu_kernels.uva import uva_view

            self._host[layer].commit(1)
            view = self._arenas_cuda[layer] = uva_view(self._arenas[layer])
        return view

    def enable_gpu_metadata(self) -> None:
        """Keep a copy of every chunk's block metadata on the window's device from now on.

        The GPU lane then scores blocks from device memory instead of reading the metadata rows of
        the pinned arena over the link (`kv_cache.gpu_metadata`). Chunks written before this call
        are copied now; later writes (prefill, spill) update the copy as they build the chunks, on
        the caller's stream, so a kernel queued after them reads the new rows. Idempotent.
        """
        self._check_open()
        if self._meta_dev is not None:
            return
        shape = (self.n_chunks, layout.META_ROWS, self.head_dim)
        mirrors = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        for layer, frontier in enumerate(self._frontier):
            if frontier:
                self.wait_for_writes(layer)
                mirrors[layer][:frontier] = self._arenas[layer][:frontier, layout.META_ROW :].to(self.device)
        self._meta_dev = mirrors

    def metadata_gpu(self, layer: int) -> torch.Tensor | None:
        """The layer's metadata copy `[n_chunks, META_ROWS, D]` (`enable_gpu_metadata`), or None.

        Chunk `c`'s rows are `c`'s arena rows `[META_ROW, CHUNK_ROWS)`, valid for every chunk a
        sequence holds once the caller's stream reaches the point where that chunk was written.
        """
        self._check_open()
        return None if self._meta_dev is None else self._meta_dev[layer]

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """GPU window K and V `[max_sequences, Hkv, W, D]`; a slot's first window_len rows are valid."""
        self._check_open()
        return self._win_k[layer], self._win_v[layer]

    def slot(self, seq_id: int) -> int:
        return self._slots[self._check_seq(seq_id)]

    def sequences(self) -> list[int]:
        return list(self._slots)

    def _layer_state(self, seq_id: int, layer: int) -> _SeqLayer:
        self._check_seq(seq_id)
        self._check_layer(layer)
        return self._state[seq_id][layer]

    def cpu_len(self, seq_id: int, layer: int) -> int:
        return self._layer_state(seq_id, layer).cpu_len

    def window_len(self, seq_id: int, layer: int) -> int:
        st = self._layer_state(seq_id, layer)
        return st.sink_len + st.recent_len

    def seq_len(self, seq_id: int, layer: int) -> int:
        return self._layer_state(seq_id, layer).tokens

    def first_unready(self, layer: int, seq_ids: Sequence[int]) -> tuple[int, bool] | None:
        """The first of `seq_ids` (ints) a decode step at `layer` (in range) cannot read, with
        whether it is in the store at all (False) or has no KV at that layer (True); None when
        every one has KV there. One pass for the per-step input check."""
        self._check_open()
        slots, state = self._slots, self._state
        for s in seq_ids:
            if s not in slots:  # what `_check_seq` asks
                return s, False
            if not state[s][layer].tokens:
                return s, True
        return None

    def step_rows(self, layer: int, seq_ids: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Slots, window lengths and CPU lengths of `seq_ids` at a layer, in one pass (per-step callers)."""
        self._check_layer(layer)
        slots, states = self._slots, self._state
        missing = [s for s in seq_ids if s not in slots]
        if missing:
            raise KeyError(f"sequences {missing} are not in the store; prefill them first")
        rows = [states[s][layer] for s in seq_ids]
        return [slots[s] for s in seq_ids], [r.sink_len + r.recent_len for r in rows], [r.cpu_len for r in rows]

    def window_lengths(self, layer: int, seq_ids: Sequence[int]) -> torch.Tensor:
        lens = [self.window_len(s, layer) for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32).to(self.device, non_blocking=True)

    def slots(self, seq_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([self.slot(s) for s in seq_ids], dtype=torch.int32).to(
            self.device, non_blocking=True
        )

    def chunk_table(self, seq_id: int, layer: int) -> np.ndarray:
        """Arena chunk ids `[Hkv, n_chunks]` int32 of the sequence's CPU segment at a layer.

        Returned once the layer's copies into the arena have landed, so whoever reads the chunks
        it names (decode's tasks, tests) reads the data.
        """
        st = self._layer_state(seq_id, layer)
        self.wait_for_writes(layer)
        if st.chunk_table is None:
            return np.zeros((self.kv_heads, 0), dtype=np.int32)
        return st.chunk_table[:, : st.n_chunks]

    def free_chunks(self, layer: int) -> int:
        self._check_layer(layer)
        return self._n_free[layer]

    def cpu_tokens(self, layer: int) -> int:
        """CPU-resident tokens of all sequences at a layer (at most `kv_cache.cpu_capacity_tokens`)."""
        self._check_layer(layer)
        return self._cpu_tokens[layer]

    def memory_stats(self) -> dict:
        """Host memory of the arenas: reserved (address space), committed and pinned bytes, and
        the bytes decode spills had to commit themselves."""
        self._check_open()
        committed = sum(a.committed_bytes for a in self._host)
        return {
            "reserved_bytes": sum(a.nbytes for a in self._host),
            "committed_bytes": committed,
            "pinned_bytes": committed if self.pinned else 0,
            "decode_commit_bytes": self.decode_commit_bytes,
            "gpu_metadata_bytes": 0 if self._meta_dev is None else sum(m.nbytes for m in self._meta_dev),
        }

    def wait_for_writes(self, layer: int | None = None) -> None:
        """Block until the copies into a layer's arena (every layer's, for None) have landed."""
        for i in range(self.layers) if layer is None else (layer,):
            ev = self._pending[i]
            if ev is not None:
                ev.synchronize()
                self._pending[i] = None

    def commit_ahead(self, tokens: int | None = None) -> None:
        """Start committing (pinning) every layer's arena for `tokens` CPU-resident tokens of all
        sequences (default: the whole capacity) in the background, and return at once.

        For a server that will use its capacity: the memory is then pinned before the first
        prompts need it instead of while they are prefilled (prefill commits what it lacks itself).
        """
        self._check_open()
        cap = self.cfg.cpu_capacity_tokens if tokens is None else tokens
        if not 0 <= cap <= self.cfg.cpu_capacity_tokens:
            raise ValueError(
                f"tokens={tokens}: expected 0..kv_cache.cpu_capacity_tokens={self.cfg.cpu_capacity_tokens}"
            )
        chunks = -(-cap // layout.CHUNK_TOKENS) * self.kv_heads
        self._schedule_commits(chunks, after_layer=-1)

    def wait_for_commits(self) -> None:
        """Block until the background committer is idle (tests and benchmarks)."""
        while True:
            with self._bg_lock:
                committer, running = self._committer, self._bg_running
            if committer is None or not running:
                return
            committer.submit(lambda: None).result()  # queued behind the running commit loop

    # ------------------------------------------------------------------ checks
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the KV store is closed (its runtime was closed); build a new HybridRuntime or KVStore")

    def _check_seq(self, seq_id: int) -> int:
        self._check_open()
        if seq_id not in self._slots:
            raise KeyError(f"sequence {seq_id} is not in the store; prefill it first")
        return seq_id

    def _check_layer(self, layer: int) -> None:
        self._check_open()
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} out of range; the store has layers 0..{self.layers - 1}")

    def _check_kv(self, name: str, x: torch.Tensor, lead: str) -> None:
        if x.dim() != 3 or x.shape[1] != self.kv_heads or x.shape[2] != self.head_dim:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected [{lead}, {self.kv_heads}, {self.head_dim}] "
                f"([{lead}, kv_heads, head_dim])"
            )
        if not x.is_floating_point():
            raise ValueError(f"{name} has dtype {x.dtype}; expected a floating-point tensor")

    # ------------------------------------------------------------------ prefill / append / release
    def prefill(self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor, *, extend: bool = False) -> None:
        """Store one layer of a prompt's KV `[L, Hkv, D]`: sink and recent to the window, the rest to CPU.

        `extend=True` appends the next chunk of the same prompt to what the layer holds (a prompt
        whose activations do not fit at once is prefilled in chunks); the result is the same as
        prefilling the chunks concatenated. k, v may be on the CPU or CUDA, in any float dtype;
        from CUDA the CPU part lands asynchronously (see the module docstring).
        """
        self._check_layer(layer)
        self._check_kv("k", k, "L")
        self._check_kv("v", v, "L")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        n = k.shape[0]
        if n == 0:
            raise ValueError("k and v hold no tokens; a prompt (or a chunk of one) needs at least one")
        known = seq_id in self._slots
        has_layer = known and self._state[seq_id][layer].tokens > 0
        if extend and not has_layer:
            raise ValueError(
                f"sequence {seq_id} has no KV at layer {layer} to extend; prefill the prompt's first chunk "
                "without extend=True"
            )
        if not extend and has_layer:
            raise ValueError(
                f"sequence {seq_id} already has layer {layer}; release it before prefilling again "
                "(or pass extend=True to append the next chunk of the same prompt)"
            )
        if not known and not self._free_slots:
            raise CapacityError(
                f"all kv_cache.max_sequences={self.cfg.max_sequences} slots are in use; release a sequence first"
            )
        st = self._state[seq_id][layer] if known else _SeqLayer()
        # Tokens fill the sink first (while nothing follows it); of the recent part and the rest,
        # the last `local` stay in the window and the older ones (the recent part's first, then
        # the chunk's) go to the CPU.
        to_sink = min(self.cfg.sink - st.sink_len, n) if st.cpu_len + st.recent_len == 0 else 0
        recent_after = min(self.cfg.local, st.recent_len + n - to_sink)
        to_cpu = st.recent_len + n - to_sink - recent_after
        from_recent = min(to_cpu, st.recent_len)
        from_chunk = to_cpu - from_recent
        need = self._chunks_needed(st, to_cpu)
        self._check_room(layer, to_cpu, need, f"sequence {seq_id}")
        self._commit(layer, need, in_decode=False)  # may raise (pinning refused); changes no state
        # All checks passed: from here on the store changes.
        if not known:
            self._slots[seq_id] = self._free_slots.pop()
            self._state[seq_id] = [_SeqLayer() for _ in range(self.layers)]
            self._state[seq_id][layer] = st
        if st.chunk_table is None:
            st.chunk_table = np.zeros((self.kv_heads, max(-(-to_cpu // layout.CHUNK_TOKENS), 4)), dtype=np.int32)
        slot = self._slots[seq_id]
        win_k, win_v = self._win_k[layer], self._win_v[layer]
        kd = k.to(dtype=self.dtype).transpose(0, 1)  # [Hkv, n, D] on k's device (a view when no cast)
        vd = v.to(dtype=self.dtype).transpose(0, 1)
        if to_sink:
            span = slice(st.sink_len, st.sink_len + to_sink)
            win_k[slot, :, span] = kd[:, :to_sink].to(self.device)
            win_v[slot, :, span] = vd[:, :to_sink].to(self.device)
            st.sink_len += to_sink
        s0 = st.sink_len
        if to_cpu:
            # The recent rows that move are copied out (torch.cat) before the shift below overwrites them.
            cpu_k, cpu_v = kd[:, to_sink : to_sink + from_chunk], vd[:, to_sink : to_sink + from_chunk]
            if from_recent:
                cpu_k = torch.cat([win_k[slot, :, s0 : s0 + from_recent].to(k.device), cpu_k], 1)
                cpu_v = torch.cat([win_v[slot, :, s0 : s0 + from_recent].to(k.device), cpu_v], 1)
            self._write_cpu(st, layer, cpu_k, cpu_v, wait=False)
        kept = st.recent_len - from_recent
        if from_recent and kept:
            win_k[slot, :, s0 : s0 + kept] = win_k[slot, :, s0 + from_recent : s0 + st.recent_len].clone()
            win_v[slot, :, s0 : s0 + kept] = win_v[slot, :, s0 + from_recent : s0 + st.recent_len].clone()
        if recent_after > kept:
            win_k[slot, :, s0 + kept : s0 + recent_after] = kd[:, to_sink + from_chunk :].to(self.device)
            win_v[slot, :, s0 + kept : s0 + recent_after] = vd[:, to_sink + from_chunk :].to(self.device)
        st.recent_len = recent_after
        # The same prompt reaches every layer: commit the other arenas as far in the background.
        self._schedule_commits(self._frontier[layer], after_layer=layer)

    def will_spill(self, layer: int, seq_ids: Sequence[int]) -> bool:
        """Whether appending one token to each sequence spills window pages into the CPU segment."""
        limit = self.cfg.local + self.cfg.generated_cap
        return any(self._layer_state(s, layer).recent_len + 1 > limit for s in seq_ids)

    def append(self, layer: int, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one decode token per sequence (`[B, Hkv, D]`) to the windows; spill when full."""
        self._check_layer(layer)
        self._check_kv("k", k, "B")
        self._check_kv("v", v, "B")
        if k.shape[0] != len(seq_ids) or k.shape != v.shape:
            raise ValueError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [{len(seq_ids)}, Hkv, D] for {len(seq_ids)} sequences"
            )
        states = [self._layer_state(s, layer) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids {list(seq_ids)} repeat a sequence")
        limit = self.cfg.local + self.cfg.generated_cap
        # A spill happens before the write, so check its chunk needs first.
        spills = [
            ((st.recent_len + 1 - self.cfg.local) // layout.PAGE_SIZE) * layout.PAGE_SIZE
            if st.recent_len + 1 > limit
            else 0
            for st in states
        ]
        if any(spills):
            need = sum(self._chunks_needed(st, n) for st, n in zip(states, spills))
            self._check_room(layer, sum(spills), need, "spilling the GPU window")
            self._commit(layer, need, in_decode=True)
        index, done = self._append_index(seq_ids, states)
        win_k, win_v = self._win_k[layer], self._win_v[layer]
        if done is not None:
            # One launch for K and V, reading (slot, pos) from the pinned ring through UVA.
            # The window's dtype first (no-op for the model's usual bf16): torch's rounding, as before.
            k, v = (x.to(self.device, self.dtype) if x.stride(-1) == 1 else x.to(self.device, self.dtype).contiguous()
                    for x in (k, v))
            append_window(win_k, win_v, k, v, index, validate=False)
            done.record(current_stream())  # the ring row is rewritten only after the kernel read it
        else:
            slots, pos = index
            win_k[slots, :, pos] = k.to(device=self.device, dtype=self.dtype)
            win_v[slots, :, pos] = v.to(device=self.device, dtype=self.dtype)
        for seq_id, st, n_spill in zip(seq_ids, states, spills):
            st.recent_len += 1
            if n_spill:
                self._spill(seq_id, layer, st, n_spill)
        if any(spills):  # top the reserve up in the background for the next spills
            self._schedule_commits(self._frontier[layer], after_layer=layer - 1)

    def advance(self, layer: int, seq_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Count one decode token per sequence into the windows without writing it, for a caller
        that writes the token itself (the runtime's window graphs, `window_graphs.py`): returns
        each sequence's slot and its new token's window row. Only where no spill is due (the
        caller checked `will_spill`); refused otherwise, before anything changes."""
        self._check_layer(layer)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids {list(seq_ids)} repeat a sequence")
        if self.will_spill(layer, seq_ids):
            raise ValueError(f"layer {layer}: appending to {list(seq_ids)} spills window pages; use append()")
        states = [self._layer_state(s, layer) for s in seq_ids]
        rows = [st.sink_len + st.recent_len for st in states]
        for st in states:
            st.recent_len += 1
        return [self._slots[s] for s in seq_ids], rows

    # Pinned (slot, position) rows of recent appends: an async copy needs a pinned source (from
    # pageable memory, as `torch.tensor(..., device="cuda")` does, it waits for the stream), and
    # a row is rewritten only after its copy finished. Made on the first append on CUDA.
    APPEND_RING = 8
    _append_ring: tuple | None = None

    def _append_index(self, seq_ids: Sequence[int], states: list) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """`([2, B] int64, event)`: each sequence's slot, then its new token's row. On CUDA a UVA
        view of a pinned ring row, which the caller's kernel reads; the caller records the event
        after that kernel (the row is rewritten only once it completed). On the host: a tensor, None."""
        b = len(seq_ids)
        values = [self._slots[s] for s in seq_ids] + [st.sink_len + st.recent_len for st in states]
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.long).view(2, b), None
        if self._append_ring is None:
            n = 2 * self.cfg.max_sequences
            host = torch.zeros((self.APPEND_RING, n), dtype=torch.long, pin_memory=True)
            self._append_ring = (host, uva_view(host, self.device.index), [torch.cuda.Event() for _ in range(self.APPEND_RING)],
                                 [0])
        host, dev, used, turn = self._append_ring
        i = turn[0] = (turn[0] + 1) % self.APPEND_RING
        used[i].synchronize()  # long done in practice (returns at once if never recorded)
        host[i, : 2 * b].numpy()[:] = values
        return dev[i, : 2 * b].view(2, b), used[i]

    def _check_room(self, layer: int, tokens: int, chunks: int, what: str) -> None:
        """CapacityError unless `tokens` more CPU-resident tokens fit the layer's capacity.

        The token count, not the free chunks, is the limit: the arena has slack for chunk
        rounding (see `arena_bytes`), and letting that slack hold tokens would let one sequence
        outgrow every bound sized from the capacity (workspaces, task tables).
        """
        cap = self.cfg.cpu_capacity_tokens
        free = cap - self._cpu_tokens[layer]
        if tokens > free:
            raise CapacityError(
                f"layer {layer}: {what} needs {chunks} chunks ({tokens} CPU-resident tokens x {self.kv_heads} "
                f"KV heads) but only {free} of the kv_cache.cpu_capacity_tokens={cap} tokens per layer are "
                "free; raise kv_cache.cpu_capacity_tokens (the CPU-resident tokens of all sequences at one "
                "layer) or release sequences"
            )

    def _chunks_needed(self, st: _SeqLayer, n_tokens: int) -> int:
        have = -(-st.cpu_len // layout.CHUNK_TOKENS)
        return (-(-(st.cpu_len + n_tokens) // layout.CHUNK_TOKENS) - have) * self.kv_heads

    # ------------------------------------------------------------------ committing arena memory
    def _commit(self, layer: int, n_chunks: int, *, in_decode: bool) -> None:
        """Commit the layer's arena far enough for the next `n_chunks` chunks `_alloc` hands out."""
        if not n_chunks:
            return
        top = self._n_free[layer]
        if n_chunks > top:  # `arena_bytes` makes this unreachable while the token count is within capacity
            raise RuntimeError(
                f"layer {layer}: {n_chunks} chunks asked for but {top} are free; the arena is undersized"
            )
        end = int(self._free[layer][top - n_chunks : top].max()) + 1
        host = self._host[layer]
        if end > host.ready_chunks:
            nbytes = host.commit(end)
            if in_decode and nbytes:
                self.decode_commit_bytes += nbytes
                log.info("layer %d: a spill committed %.0f MiB of arena itself (the background committer was "
                         "behind)", layer, nbytes / 2**20)

    def _schedule_commits(self, frontier: int, after_layer: int) -> None:
        """Have the committer thread bring every layer's arena to `frontier` chunks plus the spill
        reserve, starting with the layers after `after_layer` (the next ones a prefill reaches)."""
        target = min(self.n_chunks, frontier + self.reserve_chunks)
        with self._bg_lock:
            self._bg_next = (after_layer + 1) % self.layers
            if target <= self._bg_target:
                return
            self._bg_target = target
            if self._bg_running:
                return
            self._bg_running = True
            if self._committer is None:
                self._committer = ThreadPoolExecutor(1, thread_name_prefix="hybrid-kv-commit")
            self._committer.submit(self._commit_in_background)

    def _commit_in_background(self) -> None:
        try:
            while True:
                with self._bg_lock:
                    target, first = self._bg_target, self._bg_next
                    order = [(first + i) % self.layers for i in range(self.layers)]
                    todo = [layer for layer in order if self._host[layer].ready_chunks < target]
                    if not todo or self._bg_stop:
                        self._bg_running = False
                        return
                    host = self._host[todo[0]]
                host.commit(target, max_slabs=1)  # one slab at a time: a prefill's next layer goes first
        except BaseException as exc:  # the caller commits (and raises) itself when it needs the memory
            with self._bg_lock:
                self._bg_running = False
            log.warning("background commit of KV arena memory failed: %s", exc)

    # ------------------------------------------------------------------ writing the CPU segment
    # Called as `spill_listener(slot, layer, k, v)` with the window rows `[Hkv, n, D]` a spill is about
    # to move into the CPU segment (the predicted policy folds them into its cached statistics).
    spill_listener: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None
    # Called as `chunk_listener(layer, chunk_ids, k, v, held)` whenever CPU chunks are written (prefill,
    # spill): `chunk_ids [Hkv, m]` in position order, `k, v [Hkv, T, D]` their tokens from the first
    # chunk's start, the first `held` of which were there before (the NOSA executor's block state).
    chunk_listener: Callable[[int, np.ndarray, torch.Tensor, torch.Tensor, int], None] | None = None

    def _spill(self, seq_id: int, layer: int, st: _SeqLayer, n: int) -> None:
        """Move the oldest `n` recent tokens (whole pages) to the end of the CPU segment."""
        slot = self._slots[seq_id]
        win_k, win_v = self._win_k[layer], self._win_v[layer]
        s0 = st.sink_len
        if self.spill_listener is not None:
            self.spill_listener(slot, layer, win_k[slot, :, s0 : s0 + n], win_v[slot, :, s0 : s0 + n])
        # The tasks of this very step read the spilled pages: the copy must land first.
        self._write_cpu(st, layer, win_k[slot, :, s0 : s0 + n], win_v[slot, :, s0 : s0 + n], wait=True)
        remain = st.recent_len - n
        win_k[slot, :, s0 : s0 + remain] = win_k[slot, :, s0 + n : s0 + n + remain].clone()
        win_v[slot, :, s0 : s0 + remain] = win_v[slot, :, s0 + n : s0 + n + remain].clone()
        st.recent_len = remain

    def _write_cpu(self, st: _SeqLayer, layer: int, k: torch.Tensor, v: torch.Tensor, *, wait: bool) -> None:
        """Append `[Hkv, n, D]` tokens (store dtype, any device) to the CPU segment: allocate chunks,
        build the touched chunks whole on k's device, copy them into the arena."""
        n = k.shape[1]
        old_len, new_len = st.cpu_len, st.cpu_len + n
        n_new = -(-new_len // layout.CHUNK_TOKENS) - st.n_chunks
        if n_new:
            ids = self._alloc(layer, n_new * self.kv_heads).reshape(self.kv_heads, n_new)
            if st.n_chunks + n_new > st.chunk_table.shape[1]:
                grown = np.zeros((self.kv_heads, 2 * (st.n_chunks + n_new)), dtype=np.int32)
                grown[:, : st.n_chunks] = st.chunk_table[:, : st.n_chunks]
                st.chunk_table = grown
            st.chunk_table[:, st.n_chunks : st.n_chunks + n_new] = ids
            st.n_chunks += n_new
        first = old_len // layout.CHUNK_TOKENS
        touched = st.chunk_table[:, first : st.n_chunks].reshape(-1)  # Hkv-major runs of m chunks
        held = old_len - first * layout.CHUNK_TOKENS  # tokens already in the first touched chunk
        if held:  # rebuild that chunk whole: its earlier tokens come back from the arena
            self.wait_for_writes(layer)
            prev = self._arenas[layer][torch.from_numpy(st.chunk_table[:, first]).long()].to(k.device)
            k = torch.cat([prev[:, layout.K_ROW : layout.K_ROW + held], k], 1)
            v = torch.cat([prev[:, layout.V_ROW : layout.V_ROW + held], v], 1)
        if self.chunk_listener is not None:
            self.chunk_listener(layer, st.chunk_table[:, first : st.n_chunks], k, v, held)
        self._store_chunks(layer, touched, k, v, wait=wait)
        st.cpu_len = new_len
        self._cpu_tokens[layer] += n

    def _store_chunks(self, layer: int, ids: np.ndarray, k: torch.Tensor, v: torch.Tensor, *, wait: bool) -> None:
        """Build the chunks `ids` from `[Hkv, T, D]` tokens and put them in the layer's arena."""
        arena = self._arenas[layer]
        runs = _runs(ids)
        meta = None if self._meta_dev is None else self._meta_dev[layer]
        if k.device.type == "cpu":
            self.wait_for_writes(layer)  # an earlier copy into these chunks must not land after this write
            if len(runs) == 1:
                lo, hi, _ = runs[0]
                chunk_images(k, v, out=arena[lo:hi])  # built in place
            else:
                arena.index_copy_(0, torch.from_numpy(ids).long(), chunk_images(k, v))
            if meta is not None:  # not a decode path: a CPU-side prompt, copied synchronously
                for lo, hi, _ in runs:
                    meta[lo:hi] = arena[lo:hi, layout.META_ROW :].to(meta.device)
            return
        images = chunk_images(k, v)  # on the caller's stream, ordered after whatever produced k, v
        if meta is not None:
            # On the caller's stream too: the GPU lane's claims of later steps are queued after it.
            for lo, hi, src in runs:
                meta[lo:hi].copy_(images[src : src + hi - lo, layout.META_ROW :])
        caller = torch.cuda.current_stream(k.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=k.device)
        stream = self._copy_stream
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            # One copy per slab a run touches: each slab is its own CUDA registration, and an
            # asynchronous copy must stay inside one ("invalid argument" otherwise).
            row = self._host[layer].chunk_bytes
            dst = arena.reshape(-1).view(torch.uint8)
            srcb = images.reshape(-1).view(torch.uint8)
            for lo, hi, src in runs:
                b0, b1, s0 = lo * row, hi * row, src * row
                while b0 < b1:
                    end = min(b1, (b0 // SLAB_BYTES + 1) * SLAB_BYTES)
                    dst[b0:end].copy_(srcb[s0 : s0 + end - b0], non_blocking=True)
                    s0 += end - b0
                    b0 = end
            done = torch.cuda.Event()
            done.record(stream)
        images.record_stream(stream)  # its memory is not reused before the copies finish
        self._pending[layer] = done
        if wait:
            self.wait_for_writes(layer)

    def _alloc(self, layer: int, n: int) -> np.ndarray:
        top = self._n_free[layer]
        if n > top:  # `arena_bytes` makes this unreachable while the token count is within capacity
            raise RuntimeError(f"layer {layer}: {n} chunks asked for but {top} are free; the arena is undersized")
        ids = self._free[layer][top - n : top][::-1].copy()
        self._n_free[layer] = top - n
        if n:
            self._frontier[layer] = max(self._frontier[layer], int(ids.max()) + 1)
        return ids

    def release(self, seq_id: int) -> None:
        """Return a sequence's chunks and window slot; its memory stays committed (pinned) for reuse."""
        self._check_seq(seq_id)
        for layer, st in enumerate(self._state.pop(seq_id)):
            self._cpu_tokens[layer] -= st.cpu_len
            if st.n_chunks:
                ids = st.chunk_table[:, : st.n_chunks].reshape(-1)
                top = self._n_free[layer]
                self._free[layer][top : top + ids.size] = ids[::-1]  # popped back in this order
                self._n_free[layer] = top + ids.size
        self._free_slots.append(self._slots.pop(seq_id))

    def close(self) -> int:
        """Give the arenas and windows back: the pinned memory returns to the operating system.

        Stops the committer thread, waits for the copies in flight, unpins every slab (after a
        device synchronize, since kernels may still read an arena through its UVA view), then
        drops the arenas, their numpy and CUDA (UVA) views, the GPU windows and every sequence;
        the store raises on any later use. Returns how many arenas outside references
        (executors, worker arguments) still keep alive: their address space is unmapped when those
        go (their memory is no longer pinned). Idempotent.
        """
        if self._closed:
            return 0
        with self._bg_lock:
            committer, self._committer = self._committer, None
            self._bg_stop = True
        if committer is not None:
            committer.shutdown(wait=True, cancel_futures=True)
        if self.pinned:
            torch.cuda.synchronize()
        self._pending = [None] * self.layers
        self._meta_dev = None
        self._unpin()
        # Per layer: the arena and the views the store made of it (a view keeps the memory too).
        held = [
            [weakref.ref(x) for x in views if x is not None]
            for views in zip(self._arenas, self._arenas_np, self._arenas_cuda)
        ]
        self._closed = True
        self._host, self._arenas, self._arenas_np, self._arenas_cuda = [], [], [], []
        self._win_k, self._win_v = [], []
        self._free, self._n_free, self._cpu_tokens = [], [], []
        self._state.clear()
        self._slots.clear()
        self._free_slots = []
        alive = sum(any(r() is not None for r in refs) for refs in held)
        if alive:
            log.warning("KVStore.close: %d of %d arenas are still referenced outside the store; their memory "
                        "stays allocated until those references are dropped", alive, len(held))
        return alive

    # ------------------------------------------------------------------ reading the store back
    def full_kv(
        self, seq_id: int, layer: int, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's whole KV `[L, Hkv, D]` in position order (copies; not for hot paths).

        On the CPU by default. On CUDA with a pinned store the CPU segment is gathered by the GPU
        through the arena's UVA view (the caller's stream waits for copies still in flight), so a
        chunked prefill can attend over what the store already holds without a host round trip.
        """
        st = self._layer_state(seq_id, layer)
        dev = torch.device("cpu") if device is None else torch.device(device)
        slot = self._slots[seq_id]
        win_k, win_v = self._win_k[layer], self._win_v[layer]
        parts_k = [win_k[slot, :, : st.sink_len].transpose(0, 1).to(dev)]
        parts_v = [win_v[slot, :, : st.sink_len].transpose(0, 1).to(dev)]
        if st.cpu_len:
            table = torch.from_numpy(st.chunk_table[:, : st.n_chunks].copy()).long()
            ev = self._pending[layer]
            if dev.type == "cuda" and self.pinned:
                if ev is not None:
                    torch.cuda.current_stream(dev).wait_event(ev)
                chunks = self.arena_cuda(layer)[table.to(dev)]  # [Hkv, n_chunks, ROWS, D], read over the link
            else:
                self.wait_for_writes(layer)
                chunks = self._arenas[layer][table].to(dev)
            ct = layout.CHUNK_TOKENS
            keys = chunks[:, :, layout.K_ROW : layout.K_ROW + ct].reshape(self.kv_heads, -1, self.head_dim)
            vals = chunks[:, :, layout.V_ROW : layout.V_ROW + ct].reshape(self.kv_heads, -1, self.head_dim)
            parts_k.append(keys[:, : st.cpu_len].transpose(0, 1))
            parts_v.append(vals[:, : st.cpu_len].transpose(0, 1))
        s0 = st.sink_len
        parts_k.append(win_k[slot, :, s0 : s0 + st.recent_len].transpose(0, 1).to(dev))
        parts_v.append(win_v[slot, :, s0 : s0 + st.recent_len].transpose(0, 1).to(dev))
        return torch.cat(parts_k), torch.cat(parts_v)

    def block_metadata(self, seq_id: int, layer: int, kv_head: int, block_size: int) -> torch.Tensor:
        """Stored `[n_blocks, 2, D]` (min, max) metadata of one sequence-head at a granularity."""
        st = self._layer_state(seq_id, layer)
        per_chunk = layout.blocks_per_chunk(block_size)
        off = layout.meta_entry_offset(block_size)
        n_blocks = -(-st.cpu_len // block_size)
        table = torch.from_numpy(self.chunk_table(seq_id, layer)[kv_head]).long()
        meta = self._arenas[layer][table, layout.META_ROW :].view(-1, layout.META_ENTRIES, 2, self.head_dim)
        return meta[:, off : off + per_chunk].reshape(-1, 2, self.head_dim)[:n_blocks]


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy sharing its memory, for the numba kernels: bf16 as its uint16 bits
    (numpy has no bfloat16), other dtypes as they are."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()
