"""Hierarchical KV store: a GPU window per sequence and a pinned, paged CPU store per layer.

Per sequence and layer the tokens live in position order as

    sink (GPU window) | CPU-resident segment (CPU store) | recent tokens (GPU window)

The recent part starts as the prompt's last `local` tokens; generated tokens append to it. When it
grows past `local + generated_cap`, its oldest whole pages move to the end of the CPU segment, so
GPU memory stays bounded and the CPU segment stays contiguous in position.

CPU memory is one arena per layer (layout in `cpu_kernels/layout.py`), allocated and pinned once;
chunks of 128 tokens of one KV head are handed out from a free list and returned by `release`,
so steady state never pins again. `kv_cache.cpu_capacity_tokens` bounds the CPU-resident tokens
of all sequences together at each layer; a prefill or a spill past it is refused before anything
changes. `close` gives the arenas back to the operating system.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import psutil
import torch

from cpu_kernels import layout
from hybrid_runtime.config import GeometryConfig, KVCacheConfig

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

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


def arena_bytes(kv_cfg: KVCacheConfig, geometry: GeometryConfig) -> tuple[int, int]:
    """(chunks per layer, bytes of all arenas) for a config, before anything is allocated."""
    hkv = geometry.kv_heads
    # The most chunks per KV head that sequences holding `cap` tokens in all can occupy: each of
    # the (at most min(max_sequences, cap)) non-empty ones wastes under one chunk at its tail, so
    # sum(ceil(len_i / 128)) <= (cap + 127 * n_seq) // 128, reached by n_seq - 1 one-token sequences.
    cap = kv_cfg.cpu_capacity_tokens
    tails = (layout.CHUNK_TOKENS - 1) * min(kv_cfg.max_sequences, cap)
    n_chunks = (cap + tails) // layout.CHUNK_TOKENS * hkv
    esize = torch.tensor([], dtype=_TORCH_DTYPES[kv_cfg.dtype]).element_size()
    per_layer = n_chunks * layout.CHUNK_ROWS * geometry.head_dim * esize
    return n_chunks, per_layer * geometry.layers


def _window_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("kv_cache.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
    return torch.device(name)


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

        n_chunks, _ = arena_bytes(kv_cfg, geometry)
        esize = torch.tensor([], dtype=self.dtype).element_size()
        total = n_chunks * layout.CHUNK_ROWS * self.head_dim * esize * self.layers
        available = psutil.virtual_memory().available
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
        self._arenas = [
            torch.zeros(
                (n_chunks, layout.CHUNK_ROWS, self.head_dim), dtype=self.dtype, pin_memory=self.pinned
            )
            for _ in range(self.layers)
        ]
        self._arenas_np = [_numpy_view(a) for a in self._arenas]
        self._arenas_cuda: list[torch.Tensor | None] = [None] * self.layers
        # Free chunks per layer as a stack: _free[l][:_n_free[l]] are free.
        self._free = [np.arange(n_chunks - 1, -1, -1, dtype=np.int32) for _ in range(self.layers)]
        self._n_free = [n_chunks] * self.layers
        self._cpu_tokens = [0] * self.layers  # CPU-resident tokens of all sequences, per layer

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
        """Host arena `[n_chunks, CHUNK_ROWS, D]` of a layer (pinned when CUDA exists)."""
        self._check_open()
        return self._arenas[layer]

    def arena_numpy(self, layer: int) -> np.ndarray:
        """The arena as numpy sharing memory: uint16 for bf16 stores, float32 for fp32 stores."""
        self._check_open()
        return self._arenas_np[layer]

    def arena_cuda(self, layer: int) -> torch.Tensor:
        """A CUDA view of the layer's pinned arena (no copy), made once and cached."""
        self._check_open()
        view = self._arenas_cuda[layer]
        if view is None:
            from gpu_kernels.uva import uva_view

            view = self._arenas_cuda[layer] = uva_view(self._arenas[layer])
        return view

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
        st = self._layer_state(seq_id, layer)
        return st.sink_len + st.cpu_len + st.recent_len

    def window_lengths(self, layer: int, seq_ids: Sequence[int]) -> torch.Tensor:
        lens = [self.window_len(s, layer) for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32).to(self.device, non_blocking=True)

    def slots(self, seq_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([self.slot(s) for s in seq_ids], dtype=torch.int32).to(
            self.device, non_blocking=True
        )

    def chunk_table(self, seq_id: int, layer: int) -> np.ndarray:
        """Arena chunk ids `[Hkv, n_chunks]` int32 of the sequence's CPU segment at a layer."""
        st = self._layer_state(seq_id, layer)
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
    def prefill(self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer of a prompt's KV `[L, Hkv, D]`: sink and recent to the window, the rest to CPU."""
        self._check_layer(layer)
        self._check_kv("k", k, "L")
        self._check_kv("v", v, "L")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        length = k.shape[0]
        if length == 0:
            raise ValueError("k and v hold no tokens; a prompt needs at least one")
        sink_len = min(self.cfg.sink, length)
        recent_len = min(self.cfg.local, length - sink_len)
        cpu_len = length - sink_len - recent_len
        n_chunks = -(-cpu_len // layout.CHUNK_TOKENS)
        need = n_chunks * self.kv_heads
        new_seq = seq_id not in self._slots
        if new_seq and not self._free_slots:
            raise CapacityError(
                f"all kv_cache.max_sequences={self.cfg.max_sequences} slots are in use; release a sequence first"
            )
        if not new_seq and self._state[seq_id][layer].sink_len + self._state[seq_id][layer].recent_len:
            raise ValueError(f"sequence {seq_id} already has layer {layer}; release it before prefilling again")
        self._check_room(layer, cpu_len, need, f"sequence {seq_id}")
        # All checks passed: from here on the store changes.
        if new_seq:
            self._slots[seq_id] = self._free_slots.pop()
            self._state[seq_id] = [_SeqLayer() for _ in range(self.layers)]
        st = self._state[seq_id][layer]
        slot = self._slots[seq_id]
        win_k, win_v = self._win_k[layer], self._win_v[layer]
        kd = k.to(device=self.device, dtype=self.dtype)
        vd = v.to(device=self.device, dtype=self.dtype)
        win_k[slot, :, :sink_len] = kd[:sink_len].transpose(0, 1)
        win_v[slot, :, :sink_len] = vd[:sink_len].transpose(0, 1)
        win_k[slot, :, sink_len : sink_len + recent_len] = kd[length - recent_len :].transpose(0, 1)
        win_v[slot, :, sink_len : sink_len + recent_len] = vd[length - recent_len :].transpose(0, 1)
        st.sink_len, st.recent_len = sink_len, recent_len
        st.chunk_table = np.zeros((self.kv_heads, max(n_chunks, 4)), dtype=np.int32)
        if cpu_len:
            self._cpu_write(
                seq_id, layer, k[sink_len : sink_len + cpu_len], v[sink_len : sink_len + cpu_len]
            )

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
        slots = torch.tensor([self._slots[s] for s in seq_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([st.sink_len + st.recent_len for st in states], dtype=torch.long, device=self.device)
        win_k, win_v = self._win_k[layer], self._win_v[layer]
        win_k[slots, :, pos] = k.to(device=self.device, dtype=self.dtype)
        win_v[slots, :, pos] = v.to(device=self.device, dtype=self.dtype)
        for seq_id, st, n_spill in zip(seq_ids, states, spills):
            st.recent_len += 1
            if n_spill:
                self._spill(seq_id, layer, st, n_spill)

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

    def _spill(self, seq_id: int, layer: int, st: _SeqLayer, n: int) -> None:
        """Move the oldest `n` recent tokens (whole pages) to the end of the CPU segment."""
        slot = self._slots[seq_id]
        win_k, win_v = self._win_k[layer], self._win_v[layer]
        s0 = st.sink_len
        k_old = win_k[slot, :, s0 : s0 + n].transpose(0, 1)  # [n, Hkv, D]
        v_old = win_v[slot, :, s0 : s0 + n].transpose(0, 1)
        self._cpu_write(seq_id, layer, k_old, v_old)
        remain = st.recent_len - n
        win_k[slot, :, s0 : s0 + remain] = win_k[slot, :, s0 + n : s0 + n + remain].clone()
        win_v[slot, :, s0 : s0 + remain] = win_v[slot, :, s0 + n : s0 + n + remain].clone()
        st.recent_len = remain

    def _cpu_write(self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append `[n, Hkv, D]` tokens to the CPU segment, allocating chunks and updating metadata."""
        st = self._state[seq_id][layer]
        n = k.shape[0]
        old_len, new_len = st.cpu_len, st.cpu_len + n
        n_new_chunks = -(-new_len // layout.CHUNK_TOKENS) - st.n_chunks
        arena = self._arenas[layer]
        if n_new_chunks:
            ids = self._alloc(layer, n_new_chunks * self.kv_heads).reshape(self.kv_heads, n_new_chunks)
            if st.n_chunks + n_new_chunks > st.chunk_table.shape[1]:
                grown = np.zeros((self.kv_heads, 2 * (st.n_chunks + n_new_chunks)), dtype=np.int32)
                grown[:, : st.n_chunks] = st.chunk_table[:, : st.n_chunks]
                st.chunk_table = grown
            st.chunk_table[:, st.n_chunks : st.n_chunks + n_new_chunks] = ids
            st.n_chunks += n_new_chunks
            # Reused chunks hold an earlier sequence's tokens; rows past cpu_len must be zero.
            arena[torch.from_numpy(ids.reshape(-1)).long()] = 0
        table = torch.from_numpy(st.chunk_table[:, : st.n_chunks]).long()  # [Hkv, n_chunks]
        positions = torch.arange(old_len, new_len)
        chunk_ids = table[:, positions // layout.CHUNK_TOKENS]  # [Hkv, n]
        rows = (positions % layout.CHUNK_TOKENS).expand(self.kv_heads, n)
        arena[chunk_ids, rows + layout.K_ROW] = k.to(device="cpu", dtype=self.dtype).transpose(0, 1)
        arena[chunk_ids, rows + layout.V_ROW] = v.to(device="cpu", dtype=self.dtype).transpose(0, 1)
        st.cpu_len = new_len
        self._cpu_tokens[layer] += n
        first_chunk = old_len // layout.CHUNK_TOKENS
        touched = table[:, first_chunk:]  # [Hkv, m]
        self._write_metadata(layer, touched.reshape(-1), new_len - first_chunk * layout.CHUNK_TOKENS)

    def _write_metadata(self, layer: int, chunk_ids: torch.Tensor, valid_tokens: int) -> None:
        """Recompute metadata of `chunk_ids` (Hkv-major runs of consecutive chunks of one sequence).

        `valid_tokens` counts the valid tokens from the first chunk of each run onwards; runs hold
        `len(chunk_ids) / Hkv` chunks each, and only the last chunk of a run may be partial.
        """
        arena = self._arenas[layer]
        m = chunk_ids.numel() // self.kv_heads
        keys = arena[chunk_ids, layout.K_ROW : layout.K_ROW + layout.CHUNK_TOKENS].float()
        keys = keys.view(self.kv_heads, m * layout.CHUNK_TOKENS, self.head_dim)
        valid = (torch.arange(m * layout.CHUNK_TOKENS) < valid_tokens).view(1, -1, 1)
        inf = torch.tensor(float("inf"))
        kmin = torch.where(valid, keys, inf).view(-1, layout.CHUNK_TOKENS, self.head_dim)
        kmax = torch.where(valid, keys, -inf).view(-1, layout.CHUNK_TOKENS, self.head_dim)
        mins, maxs = [], []
        for block_size in layout.BLOCK_SIZES:
            per_chunk = layout.CHUNK_TOKENS // block_size
            mins.append(kmin.view(-1, per_chunk, block_size, self.head_dim).amin(2))
            maxs.append(kmax.view(-1, per_chunk, block_size, self.head_dim).amax(2))
        meta = torch.stack([torch.cat(mins, 1), torch.cat(maxs, 1)], 2)  # [N, 15, 2, D]
        meta = torch.where(torch.isfinite(meta), meta, torch.zeros(()))
        arena[chunk_ids, layout.META_ROW :] = meta.view(-1, 2 * layout.META_ENTRIES, self.head_dim).to(self.dtype)

    def _alloc(self, layer: int, n: int) -> np.ndarray:
        top = self._n_free[layer]
        if n > top:  # `arena_bytes` makes this unreachable while the token count is within capacity
            raise RuntimeError(f"layer {layer}: {n} chunks asked for but {top} are free; the arena is undersized")
        ids = self._free[layer][top - n : top][::-1].copy()
        self._n_free[layer] = top - n
        return ids

    def release(self, seq_id: int) -> None:
        """Return a sequence's chunks and window slot; its memory stays pinned for reuse."""
        self._check_seq(seq_id)
        for layer, st in enumerate(self._state.pop(seq_id)):
            self._cpu_tokens[layer] -= st.cpu_len
            if st.n_chunks:
                ids = st.chunk_table[:, : st.n_chunks].reshape(-1)
                top = self._n_free[layer]
                self._free[layer][top : top + ids.size] = ids
                self._n_free[layer] = top + ids.size
        self._free_slots.append(self._slots.pop(seq_id))

    def close(self) -> int:
        """Give the arenas and windows back: the pinned memory returns to the operating system.

        Drops the store's arenas, their numpy and CUDA (UVA) views, the GPU windows and every
        sequence; the store raises on any later use. With CUDA, torch's caching host allocator
        keeps freed pinned blocks for reuse (so a new store of the same size would fail its host
        memory check), so its cache is emptied -- after a device synchronize, since kernels may
        still read an arena through its UVA view. Returns how many arenas outside references
        (executors, worker arguments) still keep alive: their memory returns when those go, or
        with a later cache emptying. Idempotent.
        """
        if self._closed:
            return 0
        if self.pinned:
            torch.cuda.synchronize()
        # Per layer: the arena and the views the store made of it (a view keeps the memory too).
        held = [
            [weakref.ref(x) for x in views if x is not None]
            for views in zip(self._arenas, self._arenas_np, self._arenas_cuda)
        ]
        self._closed = True
        self._arenas, self._arenas_np, self._arenas_cuda = [], [], []
        self._win_k, self._win_v = [], []
        self._free, self._n_free, self._cpu_tokens = [], [], []
        self._state.clear()
        self._slots.clear()
        self._free_slots = []
        alive = sum(any(r() is not None for r in refs) for refs in held)
        if self.pinned:
            _empty_host_cache()
        if alive:
            log.warning("KVStore.close: %d of %d arenas are still referenced outside the store; their memory "
                        "stays allocated until those references are dropped", alive, len(held))
        return alive

    # ------------------------------------------------------------------ for tests and references
    def full_kv(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's whole KV `[L, Hkv, D]` in position order, on the CPU (copies; not for hot paths)."""
        st = self._layer_state(seq_id, layer)
        slot = self._slots[seq_id]
        win_k, win_v = self._win_k[layer], self._win_v[layer]
        parts_k = [win_k[slot, :, : st.sink_len].transpose(0, 1).cpu()]
        parts_v = [win_v[slot, :, : st.sink_len].transpose(0, 1).cpu()]
        if st.cpu_len:
            table = torch.from_numpy(self.chunk_table(seq_id, layer)).long()
            arena = self._arenas[layer][table]  # [Hkv, n_chunks, ROWS, D]
            keys = arena[:, :, layout.K_ROW : layout.K_ROW + layout.CHUNK_TOKENS].reshape(self.kv_heads, -1, self.head_dim)
            vals = arena[:, :, layout.V_ROW : layout.V_ROW + layout.CHUNK_TOKENS].reshape(self.kv_heads, -1, self.head_dim)
            parts_k.append(keys[:, : st.cpu_len].transpose(0, 1))
            parts_v.append(vals[:, : st.cpu_len].transpose(0, 1))
        s0 = st.sink_len
        parts_k.append(win_k[slot, :, s0 : s0 + st.recent_len].transpose(0, 1).cpu())
        parts_v.append(win_v[slot, :, s0 : s0 + st.recent_len].transpose(0, 1).cpu())
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


def _empty_host_cache() -> None:
    """Return torch's cached (free) pinned host blocks to CUDA, whichever API this torch has."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        log.warning("this torch (%s) cannot empty its pinned host cache; closed stores' arenas stay cached",
                    torch.__version__)
        return
    empty()


def _numpy_view(arena: torch.Tensor) -> np.ndarray:
    if arena.dtype == torch.bfloat16:
        return arena.view(torch.int16).numpy().view(np.uint16)
    return arena.numpy()
