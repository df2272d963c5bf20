"""AsyncTLS executor: block-then-token selection over the CPU-resident KV, with a lagged
asynchronous prefetch into a resident cache on the device (the GPU lane's executor).

Per task -- one (sequence, KV group) of a step, the runtime's unit -- and step t:

1. **Block level** (Quest as a GEMM over the group's heads): with the index's block metadata
   (`token_index.TokenIndex.block_meta`, block size `selection.block_size`),
   `s_b = (sum_h max(q_h, 0)) . K_max,b + (sum_h min(q_h, 0)) . K_min,b`, which equals the sum of
   the heads' Quest bounds; the top `selection.blocks` (`k_b`) blocks are `M_t`.
2. **Token level** (Double Sparsity) over the blocks the cache holds: the index keeps `d_c`
   calibrated channels of every key in INT4; each head's approximate scores over those channels
   go through a softmax, the softmaxes are averaged over the group's heads, and the top
   `selection.tokens` (`k_t`) tokens are chosen.
3. **Exact attention** of the group's heads over the full K, V of the chosen tokens, read from
   the cache; `out`/`lse` go to the step's rows and the runtime merges them with the window's.
4. **Cache update** (`resident_cache.plan_update_aged`): the cache of the row held `C_t`; the blocks
   `T_t = M_t \\ C_t` are copied in, into the slots of evicted blocks, and it holds `C_{t+1} = M_t`
   (the paper's; with `selection.resident_steps` n, the union of `M_t` .. `M_{t-n+1}`).
   Only `T_t` crosses the link; those bytes are what a task reports as read.

With `selection.lagged` (AsyncTLS) step 2 runs on `C_t = M_{t-1}`, already resident, and the copy
of `T_t` is queued on a side stream after step 3 has read the cache; the next step at the layer
waits for it (a CUDA event) before its token level, so the transfer overlaps everything in
between and nothing on the host waits for it. Unlagged, the copy runs on the executor's stream
between steps 1 and 2, which then sees `M_t`. Without CUDA the same order runs synchronously on
the host (tests and the quality experiment).

`selection.blocks: all` keeps every block (Double Sparsity alone); `selection.tokens: all` keeps
every token of the cached blocks (Quest blocks alone); both give dense attention over the CPU
segment. Prefill builds the index of the prompt's CPU segment and warms the cache with the blocks
the prompt's last query chooses (`prefill`); a spill that grows the CPU segment updates the index
and refreshes resident blocks that gained tokens before the step's claims (`upload`).

On CUDA the token level's approximate scores come from one Triton launch over the INT4 codes
(`gpu_kernels/asynctls_token_scores.py`), and the exact attention from one more that reads the chosen
tokens in the cache in place (`gpu_kernels/asynctls_attention.py`). `offload_selection` (not AsyncTLS: the benchmark's
synchronous baseline) reads the chosen tokens' K and V from the CPU store every step instead of the
cache, and `marks` times an eager claim's stages (`benchmarks/asynctls.py --breakdown`).

Counters: `bytes_read` (K and V of the missing blocks' tokens, decode and refreshes),
`blocks_selected` and `blocks_missed` (epsilon = missed / selected), `prefill_bytes`, and
`fetch_log`, per claim `(step, layer, selected, missed)`: `epsilon_per_step`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from cpu_kernels import layout
from gpu_kernels.cuda_driver import check, driver_api
from gpu_kernels.streams import capture_graph, use_stream
from hybrid_runtime import native_pool
from hybrid_runtime.config import ConfigError, GeometryConfig, KVCacheConfig, SelectionConfig, resolve_checkpoint
from hybrid_runtime.kvcache import KVStore
from hybrid_runtime.resident_cache import ResidentCache, block_tokens, cache_bytes, fresh_age, plan_insert, plan_update_aged
from hybrid_runtime.task_building import native_table
from hybrid_runtime.tasks import Step, Task
from hybrid_runtime.token_index import ChannelSets, TokenIndex, index_bytes

log = logging.getLogger(__name__)


def cache_slots(selection: SelectionConfig, kv: KVCacheConfig) -> int:
    """Blocks the resident cache holds per sequence and KV head: `blocks` times `resident_steps` plus
    room for the blocks one spill adds (they join the cache at once: their tokens just left the GPU
    window), or every block of the longest CPU segment a sequence can have for `blocks: all`."""
    blk = selection.block_size
    if selection.blocks == "all":
        return max(1, -(-kv.cpu_capacity_tokens // blk))
    spill = kv.generated_cap + layout.PAGE_SIZE
    return int(selection.blocks) * selection.resident_steps + -(-spill // blk) + 1


@dataclass
class AsyncTlsPlan:
    """A task set in queue order: host columns from `pack`, device tensors made at `upload`."""

    batch: np.ndarray  # [T] row of the step's q/out/lse
    kv_head: np.ndarray  # [T]
    cpu_len: np.ndarray  # [T]
    chunks: np.ndarray  # [T, C] chunk ids in position order (0-padded)
    active: np.ndarray  # [T, G] heads with a budget (the others get lse -inf)
    seq_slot: np.ndarray | None = None  # [T] store slots, from the tasks at the first upload
    dev: dict = field(default_factory=dict)  # device copies, kept while the task set is reused
    graphs: dict = field(default_factory=dict)  # the claims' CUDA graphs (`AsyncTlsExecutor._graph`)


@dataclass
class AsyncTlsStepPlan:
    """One step's plan: the task set's device tensors, the layer, and the event the step's token
    level waits for (the copies of the previous step at this layer)."""

    plan: AsyncTlsPlan
    layer: int
    step: int  # the executor's count of steps, for the per-step log
    fetched: Any  # CUDA event or None
    refreshed: torch.Tensor | None = None  # [T] tokens a spill's blocks brought into the cache


@dataclass
class AsyncTlsLaunch:
    """One claim. `start`/`end` bracket its selection and attention (CUDA events, or host seconds);
    `wait` returns the bytes each task moved over the link. `fetch_start`/`fetch_end` bracket its
    copies (CUDA events, None on the host)."""

    executor: "AsyncTlsExecutor"
    step: int
    layer: int
    counts_host: torch.Tensor  # [3, n] int64: bytes moved, blocks selected, blocks missed
    start: Any
    end: Any
    fetch_start: Any = None
    fetch_end: Any = None
    bytes_read: np.ndarray | None = None

    def query(self) -> bool:
        return self.bytes_read is not None or isinstance(self.end, float) or self.end.query()

    def wait(self) -> np.ndarray:
        if self.bytes_read is None:
            if not isinstance(self.end, float):
                self.end.synchronize()
            counts = self.counts_host.numpy().copy()
            self.bytes_read = counts[0]
            self.executor._account(self.step, self.layer, counts)
        return self.bytes_read


class AsyncTlsExecutor:
    """`GpuLaunchExecutor` over a `KVStore`: AsyncTLS selection and attention, index and cache on the device.

    `channels [layers, Hkv, d_c]` (int): the token index's channels per KV head (a `ChannelSets`'
    `channels(d_c)`). The selection's `streaming_heads` are left out of the prefill's cache warming
    as decode leaves them out. `device`: "cuda" or "cpu" (the host path); None: CUDA where there is one.
    """

    # One claim is one set of batched torch ops whatever its size: the GPU lane gives it the whole
    # queue of a step it has alone (a split only repeats the ops' host cost).
    claims_whole_queue = True
    # A claim's device work reads the step's q and the executor's own index and cache and writes
    # the step's out/lse rows, the cache table and its counts' landing slot, all ordered on the
    # executor's stream (the next claim, a spill's refresh at `upload`) or behind the caller's
    # merge (which waits for the claim's end event; the next step's buffers are written after
    # it); `wait` only reads the counts into the accounting (`_account`). So the GPU lane may
    # return from a step before the claim ended and retire it later (`GpuLane.trails`): the
    # runtime settles the lane before a prefill or release changes what a claim reads.
    retire_later = True
    # Landing slots for the counts of claims not yet retired: a slot is reused every RING
    # launches, and the GPU lane launches only while fewer than RING claims are unretired
    # (`GpuLane._ring_full`; a step's claims and the previous step's trailing ones: a GPU-only
    # step is one claim).
    RING = 8
    # Claims remembered in `fetch_log`, and copies (CUDA event pairs) in `fetch_events`.
    LOG = 1 << 16
    EVENTS = 4096

    def __init__(self, store: KVStore, selection: SelectionConfig, channels: torch.Tensor,
                 stream: "torch.cuda.Stream | None" = None, device: str | None = None):
        if selection.name != "asynctls":
            raise ValueError(f"AsyncTlsExecutor needs selection.name 'asynctls', got {selection.name!r}")
        if device not in (None, "cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
            raise ValueError(f"device {device!r}: allowed 'cuda' (with CUDA), 'cpu', or None (cuda where there is one)")
        self.store = store
        self.selection = selection
        self.cuda = torch.cuda.is_available() if device is None else device == "cuda"
        self.device = "gpu" if self.cuda else "cpu"
        self.dev = torch.device("cuda") if self.cuda else torch.device("cpu")
        self.stream = (stream or torch.cuda.Stream()) if self.cuda else None
        self.copy_stream = torch.cuda.Stream() if self.cuda else None
        self.link_bytes_per_s: float | None = None
        self.block_size = selection.block_size
        self.blocks = selection.blocks
        self.tokens = selection.tokens
        self.lagged = selection.lagged
        self.resident_steps = selection.resident_steps
        g = store.geometry
        self.group_size, self.kv_heads, self.head_dim = g.group_size, g.kv_heads, g.head_dim
        self.scale = 1.0 / math.sqrt(g.head_dim)
        self.esize = torch.tensor([], dtype=store.dtype).element_size()
        # Bytes of one token's K and V: what a moved or attended token counts.
        self.token_bytes = 2 * self.head_dim * self.esize
        channels = torch.as_tensor(channels, dtype=torch.int64)
        if channels.dim() != 3 or channels.shape[:2] != (store.layers, g.kv_heads) or channels.shape[2] % 2:
            raise ValueError(f"channels has shape {tuple(channels.shape)}; expected [{store.layers}, {g.kv_heads}, d_c] "
                             "with an even d_c")
        if channels.shape[2] != selection.index_channels:
            raise ValueError(f"channels keep {channels.shape[2]} channels per KV head; selection.index_channels is "
                             f"{selection.index_channels}")
        if int(channels.min()) < 0 or int(channels.max()) >= g.head_dim:
            raise ValueError(f"channels must lie in 0..{g.head_dim - 1}")
        self.index = TokenIndex(store.n_chunks, store.layers, g.head_dim, channels, self.block_size, store.dtype, self.dev)
        slots = cache_slots(selection, store.cfg)
        self.cache = ResidentCache(store.layers, store.cfg.max_sequences, g.kv_heads, slots, self.block_size,
                                   g.head_dim, store.dtype, self.dev)
        self._streaming = {layer: list(heads) for layer, heads in selection.streaming_heads.items()}
        # CPU-resident tokens the index covers, per (layer, store slot).
        self._indexed = np.zeros((store.layers, store.cfg.max_sequences), dtype=np.int64)
        self._fetched: list[Any] = [None] * store.layers  # the newest copy event per layer (CUDA)
        # A lagged copy is launched at the executor's next use rather than behind its own claim (on
        # CUDA): it then starts when the next layer's claim may start -- after the model's work between
        # the layers, which it slowed by holding SMs its GEMMs wanted (benchmarks/notes/asynctls.md
        # section 15) -- and still ends before anything reads the layer's cache again (that claim waits
        # for it). The last layer's copy waits for the next step's first claim: a step ends without a
        # copy behind it. `flush_copy` launches it; the GPU lane's `settle` (before the store changes,
        # a release, a probe) calls it, so nothing outside a decode step finds a copy still pending.
        self.defer_copy = self.cuda
        self._pending_copy: Any = None
        max_tasks = store.cfg.max_sequences * g.kv_heads
        self._ring = torch.zeros((self.RING, 3, max_tasks), dtype=torch.int64, pin_memory=self.cuda)
        self._ring_users: list[AsyncTlsLaunch | None] = [None] * self.RING
        self.launches = 0
        self.fetch_replays = 0  # lagged copies replayed from a graph (`_graph`) rather than launched
        self.graph_step_replays = 0  # claims replayed inside a caller's graph of the whole step (`capture_claim`)
        self.steps = 0
        self.bytes_read = 0
        self.blocks_selected = 0
        self.blocks_missed = 0
        self.prefill_bytes = 0
        self.fetch_log: deque = deque(maxlen=self.LOG)
        self.fetch_events: deque = deque(maxlen=self.EVENTS)
        # Claims replay as CUDA graphs from their second step on (`_graph`); one memory pool for all.
        self.graphs = self.cuda
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None
        # Recorded on the executor's stream just before a lagged copy is queued on the copy stream.
        self._claims_queued = torch.cuda.Event() if self.cuda else None
        api = driver_api() if self.cuda else None
        self._driver = api if api is not None and api.memcpy_dtoh_async is not None else None
        self._graph_bufs: dict[int, tuple] = {}
        # The token level's scores straight from the INT4 codes in one Triton launch
        # (`gpu_kernels/asynctls_token_scores.py`); the torch form expands every candidate's codes
        # to d_c float32 values first (~40x the bytes). Off on the host unless a test turns it on
        # (it runs there under TRITON_INTERPRET=1); the kernel needs d_c / 2 a power of two.
        half = self.index.d_c // 2
        self.fused_token_scores = self.cuda and half & (half - 1) == 0
        # The exact attention over the chosen tokens in one Triton launch reading the cache in place,
        # writing the step's rows (`gpu_kernels/asynctls_attention.py`); the torch form gathers the
        # tokens' K and V, copies them to float32 and scatters the result (~15 kernels). Host: torch
        # unless a test turns it on; the kernel needs a power-of-two head dim.
        self.fused_attention = self.cuda and self.head_dim & (self.head_dim - 1) == 0
        # The cache table's update and the claim's counts in one Triton launch, a program per row
        # (`gpu_kernels/cache_update.py`); the torch form (`plan_update_aged`, the rows' gather and
        # write-back, the counts) is ~45 kernels of a few microseconds each, replayed one after
        # another in every claim's graph. Host: torch unless a test turns it on.
        self.fused_cache_update = self.cuda
        # The block level's scores read from the bf16 metadata in place, in one Triton launch
        # (`gpu_kernels/block_level_scores.py`); the torch form gathers the rows' metadata, copies it to
        # float32 and runs two batched GEMVs and a mask (~10 kernels, ~80 MB a claim at 8 x 32K). Host:
        # torch unless a test turns it on; the kernel needs a power-of-two head dim.
        self.fused_block_scores = self.cuda and self.head_dim & (self.head_dim - 1) == 0
        # The benchmark's synchronous sparse-offload baseline (`benchmarks/asynctls.py`,
        # `sync_selection`), not AsyncTLS: the same two-level selection, its token level over this
        # step's blocks `M_t` on the index, and the K and V of the chosen tokens read from the CPU
        # store over the link (UVA) before the attention, every step; the resident cache is neither
        # read nor changed, and a claim reports the bytes of the tokens it read.
        self.offload_selection = False
        # ... its tokens read by a Triton gather of whole K/V rows (`gpu_kernels/asynctls_token_gather.py`);
        # torch indexing of the UVA view reads element-sized pieces. Host: torch unless a test turns it on.
        self.triton_gather = self.cuda
        # Stage marks of eager claims (`benchmarks/asynctls.py --breakdown`): (stage, CUDA event or
        # host seconds) appended as each stage is queued; None: off. Claims are not graphed while on.
        self.marks: list | None = None

    @property
    def nbytes(self) -> int:
        """Device memory of the token index and the resident cache."""
        return self.index.nbytes + self.cache.nbytes

    def _arena(self, layer: int) -> torch.Tensor:
        return self.store.arena_cuda(layer) if self.cuda else self.store.arena(layer)

    # ------------------------------------------------------------------ selection and attention
    def _select_blocks(self, layer: int, q: torch.Tensor, active: torch.Tensor, chunks: torch.Tensor,
                       cpu_len: torch.Tensor) -> torch.Tensor:
        """`M`: the top `k_b` blocks `[R, k]` (-1 padded) of each row by the group's summed Quest bound."""
        r = q.shape[0]
        if self.fused_block_scores:
            from gpu_kernels.block_level_scores import level_scores

            scores = level_scores(q, active, self.index.block_meta[layer], chunks, cpu_len, self.block_size)
        else:
            meta = self.index.block_meta[layer][chunks.long()]  # [R, C, per, 2, D]
            meta = meta.view(r, -1, 2, self.head_dim).float()
            qa = q * active[..., None]
            scores = block_scores(meta, qa)
            n_blocks = -(-cpu_len // self.block_size)
            past = torch.arange(scores.shape[1], device=q.device)[None, :] >= n_blocks[:, None]
            scores.masked_fill_(past, float("-inf"))
        nb = scores.shape[1]
        k = nb if self.blocks == "all" else min(int(self.blocks), nb)
        top = torch.topk(scores, k, dim=1, sorted=False)
        return torch.where(torch.isfinite(top.values), top.indices, torch.full_like(top.indices, -1))

    def _select_tokens(self, layer: int, q: torch.Tensor, active: torch.Tensor, cached: torch.Tensor,
                       kv_head: torch.Tensor, chunks: torch.Tensor, cpu_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(candidate positions `[R, k_t]` into the rows' `S * blk` candidates -- token `p % blk` of block
        `cached[r, p // blk]` --, whether each is a real token). `cached [R, S]`: the candidate blocks (-1: none)."""
        r, s = cached.shape
        blk = self.block_size
        n = s * blk
        if self.tokens == "all" or int(self.tokens) >= n:
            pos = cached[:, :, None] * blk + torch.arange(blk, device=q.device)  # [R, S, blk] token positions
            valid = ((cached[:, :, None] >= 0) & (pos < cpu_len[:, None, None])).view(r, n)
            return torch.arange(n, device=q.device).expand(r, n), valid
        q_c = q.gather(2, self.index.channels[layer, kv_head][:, None, :].expand(-1, q.shape[1], -1))  # [R, G, d_c]
        if self.fused_token_scores:
            from gpu_kernels.asynctls_token_scores import int4_token_scores

            raw = int4_token_scores(q_c.contiguous(), self.index.codes[layer], self.index.qparams[layer],
                                    cached.contiguous(), chunks, cpu_len, blk)
            valid = raw[:, 0] > float("-inf")
        else:
            pos = cached[:, :, None] * blk + torch.arange(blk, device=q.device)
            valid = (cached[:, :, None] >= 0) & (pos < cpu_len[:, None, None])
            pos, valid = pos.clamp(min=0).view(r, n), valid.view(r, n)
            cid = chunks.gather(1, (pos // layout.CHUNK_TOKENS).clamp(max=chunks.shape[1] - 1)).long()
            keys = self.index.keys(layer, cid, pos % layout.CHUNK_TOKENS)
            raw = torch.bmm(q_c, keys.transpose(1, 2))  # [R, G, N]
        self._mark("token scores")
        approx = group_token_scores(raw, valid, active)
        sel = torch.topk(approx, int(self.tokens), dim=1, sorted=False).indices
        self._mark("token top-k")
        return sel, valid.gather(1, sel)

    def _mark(self, stage: str) -> None:
        """Record the end of a claim's stage (`marks`)."""
        if self.marks is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self.marks.append((stage, ev))
        else:
            self.marks.append((stage, time.perf_counter()))

    def _attend_from_store(self, arena: torch.Tensor, q: torch.Tensor, active: torch.Tensor, chosen: torch.Tensor,
                           chunks: torch.Tensor, sel: torch.Tensor, sel_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`offload_selection`: exact attention over the selected tokens of `chosen [R, k]`, their K and V
        read from the CPU store (the arena's UVA view on CUDA)."""
        blk, ct = self.block_size, layout.CHUNK_TOKENS
        pos = chosen.gather(1, sel // blk).clamp(min=0) * blk + sel % blk  # [R, k_t] CPU-segment positions
        if self.triton_gather:
            from gpu_kernels.asynctls_token_gather import gather_tokens

            kk, vv = gather_tokens(arena, chunks, pos, sel_valid.contiguous())
            return exact_attention(q, kk.float(), vv.float(), sel_valid, active)
        cid = chunks.gather(1, (pos // ct).clamp(max=chunks.shape[1] - 1)).long()
        row = pos % ct
        kk = arena[cid, layout.K_ROW + row].float()
        vv = arena[cid, layout.V_ROW + row].float()
        return exact_attention(q, kk, vv, sel_valid, active)

    def _attend_into(self, layer: int, step: Step, q: torch.Tensor, active: torch.Tensor, b: torch.Tensor,
                     seq_slot: torch.Tensor, kv_head: torch.Tensor, sel: torch.Tensor, sel_valid: torch.Tensor) -> None:
        """Exact attention over the selected cached tokens, written into the step's `out`/`lse` rows."""
        if self.fused_attention:
            from gpu_kernels.asynctls_attention import selected_attention

            selected_attention(step.q, self.cache.k[layer], self.cache.v[layer], seq_slot, kv_head, b, sel, sel_valid,
                               active, step.out, step.lse)
            return
        out, lse = self._attend(layer, q, active, seq_slot, kv_head, sel, sel_valid)
        bsz, _, dim = step.q.shape
        step.out.view(bsz, self.kv_heads, self.group_size, dim)[b, kv_head] = out
        step.lse.view(bsz, self.kv_heads, self.group_size)[b, kv_head] = lse

    def _attend(self, layer: int, q: torch.Tensor, active: torch.Tensor, seq_slot: torch.Tensor,
                kv_head: torch.Tensor, sel: torch.Tensor, sel_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention `(out [R, G, D], lse [R, G])` over the selected cached tokens."""
        ck, cv = self.cache.k[layer], self.cache.v[layer]
        flat = ck.shape[2] * ck.shape[3]
        kk = ck.view(ck.shape[0], ck.shape[1], flat, -1)[seq_slot[:, None], kv_head[:, None], sel].float()
        vv = cv.view(cv.shape[0], cv.shape[1], flat, -1)[seq_slot[:, None], kv_head[:, None], sel].float()
        return exact_attention(q, kk, vv, sel_valid, active)

    # ------------------------------------------------------------------ plan
    def pack(self, tab: np.ndarray, nsel: np.ndarray, chunks: np.ndarray) -> AsyncTlsPlan:
        """A queue's tasks in queue order (`native_table` columns); cached by the lane with the task set."""
        blk = tab[:, native_pool.T_BLOCK]
        if tab.shape[0] and not (blk == self.block_size).all():
            raise ValueError(f"tasks of block size {sorted(set(blk.tolist()))}: the AsyncTLS executor selects blocks "
                             f"of selection.block_size={self.block_size}")
        n = tab[:, native_pool.T_N_CHUNKS]
        c = max(1, int(n.max()) if n.size else 1)
        off = tab[:, native_pool.T_CHUNK_OFF]
        col = np.arange(c)[None, :]
        at = np.minimum(off[:, None] + col, max(0, chunks.size - 1))
        padded = np.where(col < n[:, None], chunks[at] if chunks.size else 0, 0).astype(np.int64)
        return AsyncTlsPlan(tab[:, native_pool.T_BATCH].copy(), tab[:, native_pool.T_KVHEAD].copy(),
                            tab[:, native_pool.T_CPULEN].copy(), padded, nsel > 0)

    def upload(self, packed: AsyncTlsPlan, ordered: Sequence[Task], resident: bool = False) -> AsyncTlsStepPlan:
        """The step's plan: device copies of the task set (kept while it is reused), and the index
        and cache brought up to date with spills since the last step."""
        if not len(ordered):
            raise ValueError("upload of an empty task set")
        self.flush_copy()  # before `_fetched` is read: the plan's claim waits for the copy's end
        layer = ordered[0].layer
        if packed.seq_slot is None:  # once per task set
            packed.seq_slot = np.fromiter((self.store.slot(t.seq_id) for t in ordered), dtype=np.int64, count=len(ordered))
        if not packed.dev or not resident:  # on the executor's stream, which its claims run on
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                packed.dev = {name: torch.from_numpy(np.ascontiguousarray(getattr(packed, name))).to(self.dev)
                              for name in ("batch", "kv_head", "cpu_len", "chunks", "active", "seq_slot")}
                if self.cuda:
                    # Read on the copy stream by every lagged copy of the plan: marked once here (the allocator
                    # waits for every stream a block was ever marked with), not at each copy's launch.
                    for t in packed.dev.values():
                        t.record_stream(self.copy_stream)
        stale = self._indexed[layer, packed.seq_slot] != packed.cpu_len
        refreshed = None
        if stale.any():  # a spill grew these CPU segments (rare: once per generated_cap tokens)
            refreshed = self._grow_segments(layer, packed, np.flatnonzero(stale))
        self.steps += 1
        return AsyncTlsStepPlan(packed, layer, self.steps, self._fetched[layer], refreshed)

    def _grow_segments(self, layer: int, packed: AsyncTlsPlan, rows: np.ndarray) -> torch.Tensor:
        """Index the tokens a spill appended to these rows' CPU segments and put the blocks holding them
        into the cache (refreshing a resident one that gained tokens): they were in the GPU window until
        this step, so its token level must see them. On the executor's stream after the layer's last
        copies. Returns the tokens copied per task `[T]` (counted as moved by the step's claims)."""
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            if self.cuda and self._fetched[layer] is not None:
                self.stream.wait_event(self._fetched[layer])
            old, new = self._indexed[layer, packed.seq_slot[rows]], packed.cpu_len[rows]
            self._index_rows(layer, packed.chunks[rows], packed.kv_head[rows], old, new)
            blk = self.block_size
            first, last = old // blk, (new - 1) // blk
            width = int((last - first).max()) + 1
            wanted = first[:, None] + np.arange(width)[None, :]
            wanted = torch.from_numpy(np.where(wanted <= last[:, None], wanted, -1)).to(self.dev)
            sub = torch.from_numpy(rows).to(self.dev)
            d = {k: v[sub] for k, v in packed.dev.items()}
            table, age = self.cache.table[layer], self.cache.age[layer]
            cached = table[d["seq_slot"], d["kv_head"]]  # [n, S]
            updated, dest = plan_insert(cached, wanted)
            table[d["seq_slot"], d["kv_head"]] = updated
            age[d["seq_slot"], d["kv_head"]] = fresh_age(age[d["seq_slot"], d["kv_head"]], dest)
            self.cache.fetch(layer, self._arena(layer), d["chunks"], d["seq_slot"], d["kv_head"], wanted, dest,
                             stream=self.stream.cuda_stream if self.cuda else None)
            tokens = torch.zeros(len(packed.batch), dtype=torch.int64, device=self.dev)
            tokens[sub] = block_tokens(wanted, d["cpu_len"], blk).sum(1)
        self._indexed[layer, packed.seq_slot[rows]] = packed.cpu_len[rows]
        return tokens

    def _index_rows(self, layer: int, chunks: np.ndarray, kv_head: np.ndarray, old_len: np.ndarray,
                    new_len: np.ndarray) -> None:
        """Rebuild the index rows of the chunks holding tokens `[old_len, new_len)` of each row."""
        ct = layout.CHUNK_TOKENS
        ids, heads = [], []
        for c, h, lo, hi in zip(chunks, kv_head.tolist(), old_len.tolist(), new_len.tolist()):
            if hi > lo:
                part = c[lo // ct : -(-hi // ct)]
                ids.append(part)
                heads.append(np.full(part.shape, h, dtype=np.int64))
        if not ids:
            return
        ids_t = torch.from_numpy(np.concatenate(ids).astype(np.int64)).to(self.dev)
        images = self._arena(layer)[ids_t]
        self.index.refresh(layer, ids_t, torch.from_numpy(np.concatenate(heads)).to(self.dev), images)

    # ------------------------------------------------------------------ run
    def launch(self, plan: AsyncTlsStepPlan, start: int, stop: int, step: Step) -> AsyncTlsLaunch:
        """Queue rows `[start, stop)` of the step's plan (on the executor's stream; returns at once on CUDA)."""
        n = stop - start
        if not 0 <= start < stop <= len(plan.plan.batch):
            raise ValueError(f"claim [{start}, {stop}) of a plan of {len(plan.plan.batch)} tasks")
        self.flush_copy()
        slot = self.launches % self.RING
        prev = self._ring_users[slot]
        if prev is not None and prev.bytes_read is None:
            raise RuntimeError(f"more than {self.RING} launches in flight; wait for earlier launches first")
        # A contiguous prefix of the slot: the counts come back as one flat copy (`_counts_home`).
        counts_host = self._ring[slot].view(-1)[: 3 * n].view(3, n)
        if self.cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            f0, f1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with use_stream(self.stream):  # torch.cuda.stream's device lookups cost host time here
                ev0.record(self.stream)
                self._claim(plan, start, stop, step, counts_host, (f0, f1), ev1)
        else:
            ev0 = time.perf_counter()
            self._claim(plan, start, stop, step, counts_host, None, None)
            ev1 = time.perf_counter()
            f0 = f1 = None
        handle = AsyncTlsLaunch(self, plan.step, plan.layer, counts_host, ev0, ev1, f0, f1)
        self._ring_users[slot] = handle
        self.launches += 1
        return handle

    def _claim(self, plan: AsyncTlsStepPlan, start: int, stop: int, step: Step, counts_host: torch.Tensor,
               fetch_events: tuple | None, end: Any) -> None:
        dev = plan.plan.dev
        # A claim of the whole table (every GPU-only step's) reads the tensors as they are: six slices
        # cost ~10 us of host time a call.
        whole = start == 0 and stop == len(plan.plan.batch)
        layer, d = plan.layer, dev if whole else {k: v[start:stop] for k, v in dev.items()}
        if self.cuda and plan.fetched is not None:
            self.stream.wait_event(plan.fetched)  # the previous step's copies at this layer
        arena = self._arena(layer)
        graph = self._graph(plan, start, stop, step, d, arena) if self.cuda and self.graphs and self.marks is None else None
        if graph is not None:
            graph[0].replay()
            chosen, dest, counts = graph[1]
        else:
            chosen, dest, counts = self._claim_ops(layer, d, step, arena, fetch_events)
        if plan.refreshed is not None:
            counts = counts.clone()
            counts[0] += plan.refreshed[start:stop] * self.token_bytes
        self._counts_home(counts, counts_host)
        if end is not None:
            end.record(self.stream)
        if self.lagged and not self.offload_selection:
            copy = functools.partial(self._fetch, layer, arena, d["chunks"], d["seq_slot"], d["kv_head"], chosen, dest,
                                     fetch_events, side=True, graph=graph[2] if graph is not None else None)
            if self.defer_copy and self.cuda and fetch_events is not None:
                self._pending_copy = copy
            else:
                copy()

    def _counts_home(self, counts: torch.Tensor, counts_host: torch.Tensor) -> None:
        """Queue the copy of a claim's counts into its pinned ring slot on the executor's stream. On CUDA
        one driver call (torch's `copy_` into pinned memory also records an event for its host allocator:
        ~18 us of host time a claim on the H200, against a few here); the ring outlives every copy into it."""
        api = self._driver
        if api is not None and counts.is_contiguous() and counts_host.is_contiguous() and \
                counts.dtype == counts_host.dtype and counts.shape == counts_host.shape:
            check(api.memcpy_dtoh_async(counts_host.data_ptr(), counts.data_ptr(), counts.numel() * counts.element_size(),
                                        self.stream.cuda_stream), "cuMemcpyDtoHAsync")
            return
        counts_host.copy_(counts, non_blocking=self.cuda)

    def flush_copy(self) -> None:
        """Launch the lagged copy a claim left for later (`defer_copy`), on the copy stream after
        everything queued on the executor's stream so far (its claim, and whatever the caller made
        the stream wait for since). Runs first in every entry point that reads or writes the cache:
        `upload`, `launch`, `prefill`, `capture_claim`; the GPU lane's `settle` calls it between steps."""
        copy, self._pending_copy = self._pending_copy, None
        if copy is not None:
            copy()

    def _claim_ops(self, layer: int, d: dict, step: Step, arena: torch.Tensor,
                   fetch_events: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The claim's device work: selection, attention into the step's rows, the cache table update
        (and, unlagged, the copies). Returns (chosen blocks, their copy slots, counts `[3, R]`)."""
        b, h, slot, cpu_len, chunks, active = (d["batch"], d["kv_head"], d["seq_slot"], d["cpu_len"], d["chunks"],
                                               d["active"])
        bsz, hq, dim = step.q.shape
        g = self.group_size
        q = step.q.view(bsz, self.kv_heads, g, dim)[b, h]  # [R, G, D], pre-scaled fp32
        self._mark("start")
        chosen = self._select_blocks(layer, q, active, chunks, cpu_len)
        self._mark("block level")
        token_bytes = self.token_bytes
        if self.offload_selection:  # the synchronous baseline: no cache, the chosen tokens read from the store
            sel, sel_valid = self._select_tokens(layer, q, active, chosen, h, chunks, cpu_len)
            out, lse = self._attend_from_store(arena, q, active, chosen, chunks, sel, sel_valid)
            self._mark("attention")
            step.out.view(bsz, self.kv_heads, g, dim)[b, h] = out
            step.lse.view(bsz, self.kv_heads, g)[b, h] = lse
            none = torch.zeros_like(cpu_len)
            counts = torch.stack([sel_valid.sum(1) * token_bytes, none, none])  # no cache: no epsilon
            self._mark("outputs")
            return chosen, torch.full_like(chosen, -1), counts
        table = self.cache.table[layer]
        if self.lagged:
            sel, sel_valid = self._select_tokens(layer, q, active, table[slot, h], h, chunks, cpu_len)
            self._attend_into(layer, step, q, active, b, slot, h, sel, sel_valid)
            self._mark("attention")
            dest, counts = self._update_cache(layer, slot, h, chosen, cpu_len)
            self._mark("cache update")
        else:
            dest, counts = self._update_cache(layer, slot, h, chosen, cpu_len)
            self._mark("cache update")
            self._fetch(layer, arena, chunks, slot, h, chosen, dest, fetch_events, side=False)
            self._mark("fetch")
            sel, sel_valid = self._select_tokens(layer, q, active, table[slot, h], h, chunks, cpu_len)
            self._attend_into(layer, step, q, active, b, slot, h, sel, sel_valid)
            self._mark("attention")
        self._mark("outputs")
        return chosen, dest, counts

    def _update_cache(self, layer: int, slot: torch.Tensor, kv_head: torch.Tensor, chosen: torch.Tensor,
                      cpu_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `(slot, kv_head)` of the layer's cache table take the blocks `chosen` (`plan_update_aged`);
        returns (each missing block's slot `[R, k]`, -1 elsewhere; counts `[3, R]`: bytes moved, blocks
        chosen, blocks missed)."""
        table, age = self.cache.table[layer], self.cache.age[layer]
        if self.fused_cache_update:
            from gpu_kernels.cache_update import update_cache_rows

            return update_cache_rows(table, age, slot, kv_head, chosen, cpu_len, self.resident_steps, self.block_size,
                                     self.token_bytes)
        new, ages, miss, dest = plan_update_aged(table[slot, kv_head], age[slot, kv_head], chosen, self.resident_steps)
        table[slot, kv_head], age[slot, kv_head] = new, ages
        moved = torch.where(miss, block_tokens(chosen, cpu_len, self.block_size), 0).sum(1)
        return dest, torch.stack([moved * self.token_bytes, (chosen >= 0).sum(1), miss.sum(1)])

    def _graph(self, plan: AsyncTlsStepPlan, start: int, stop: int, step: Step, d: dict, arena: torch.Tensor):
        """The claim as a CUDA graph (graph, (chosen, dest, counts)), or None to run it eagerly.

        A claim's torch ops cost more host time than the GPU spends on them at small batches, and
        a step of a reused task set repeats the same ops on the same buffers: its second claim of a
        (layer, rows, mode) is captured and every later one replays it. The first runs eagerly (it
        warms up the libraries and the allocator for these shapes). The outputs the copy stream and
        the host read live in per-layer buffers, so that every graph can share one memory pool
        (they replay one after another on the executor's stream). A capture that fails turns
        graphs off for the executor, with a warning.
        """
        key = (plan.layer, start, stop, self.lagged, self.offload_selection, self.fused_token_scores, self.fused_attention,
               self.fused_cache_update, self.fused_block_scores,
               step.q.data_ptr(), step.out.data_ptr(), step.lse.data_ptr())
        graphs = plan.plan.graphs
        entry = graphs.get(key)
        if entry is None:
            graphs[key] = "eager once"
            return None
        if entry != "eager once":
            return entry
        r = stop - start
        bufs = self._graph_outputs(plan.layer, r)
        fetch_graph = None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"):
                chosen, dest, counts = self._claim_ops(plan.layer, d, step, arena, None)
                k = chosen.shape[1]
                # Contiguous views: the block-fetch kernel indexes `blocks` and `dest` as dense [R, k].
                outs = (bufs[0][: r * k].view(r, k), bufs[1][: r * k].view(r, k), bufs[2][: 3 * r].view(3, r))
                for buf, value in zip(outs, (chosen, dest, counts)):
                    buf.copy_(value)
            if self.lagged and not self.offload_selection:
                # The lagged copy of the misses, on the copy stream after the claim: a graph of its own
                # (a replay costs the host less than the kernel's launch), reading the claim's outputs.
                fetch_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(fetch_graph, stream=self.copy_stream, capture_error_mode="thread_local"):
                    self.cache.fetch(plan.layer, arena, d["chunks"], d["seq_slot"], d["kv_head"], outs[0], outs[1],
                                     stream=self.copy_stream.cuda_stream)
        except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly from now on
            log.warning("AsyncTLS: capturing a claim as a CUDA graph failed (%r); claims run eagerly from now on", exc)
            self.graphs = False
            graphs[key] = None
            return None
        entry = graphs[key] = (graph, outs, fetch_graph)
        return entry

    def capture_claim(self, plan: AsyncTlsStepPlan, step: Step, counts_out: torch.Tensor) -> tuple | None:
        """Inside a caller's capture on this executor's stream (`stream` current: hybrid_runtime/step_graphs.py):
        the whole table's claim -- selection, attention into the step's rows, the cache update -- with its
        counts `[3, T]` copied into `counts_out` (pinned). Lagged, returns the blocks to copy and their cache
        slots `[T, k]` (the capture's own tensors: the caller copies them into buffers that stay put and
        captures their copy with `capture_copy`); None for an unlagged claim, which copies inside it."""
        self.flush_copy()
        layer, d = plan.layer, plan.plan.dev
        arena = self._arena(layer)
        chosen, dest, counts = self._claim_ops(layer, d, step, arena, None)
        counts_out.copy_(counts, non_blocking=True)
        if not self.lagged or self.offload_selection:
            return None
        return chosen, dest

    def capture_copy(self, plan: AsyncTlsStepPlan, chosen: torch.Tensor, dest: torch.Tensor) -> torch.cuda.CUDAGraph:
        """The lagged copy of `chosen` blocks into `dest` slots (buffers that stay put) as a graph of its own,
        captured on the copy stream."""
        layer, d = plan.layer, plan.plan.dev
        arena = self._arena(layer)
        return capture_graph(lambda: self.cache.fetch(layer, arena, d["chunks"], d["seq_slot"], d["kv_head"], chosen, dest,
                                                      stream=self.copy_stream.cuda_stream), self.copy_stream)

    def replayed(self, plan: AsyncTlsStepPlan, counts_host: torch.Tensor, start: Any, end: Any,
                 copy: "torch.cuda.CUDAGraph | None" = None) -> AsyncTlsLaunch:
        """The handle of a claim a caller replayed inside its own graph (`capture_claim`), bracketed by
        `start`/`end` on this executor's stream; `copy` (lagged: `capture_copy`'s graph) is replayed on the
        copy stream after `end`, off the caller's chain, and the layer's next claim waits for it."""
        if copy is None:
            self._fetched[plan.layer] = end
        else:
            stream = self.copy_stream
            stream.wait_event(end)
            f0, f1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            f0.record(stream)
            with use_stream(stream):
                copy.replay()
            f1.record(stream)
            self._fetched[plan.layer] = f1
            self.fetch_events.append((plan.layer, f0, f1))
            self.fetch_replays += 1
        self.graph_step_replays += 1
        return AsyncTlsLaunch(self, plan.step, plan.layer, counts_host, start, end)

    def block_capacity(self) -> int:
        """The most blocks a claim chooses per task (its `chosen` rows' width at most)."""
        return self.cache.slots

    def stale(self, layer: int, packed: AsyncTlsPlan) -> bool:
        """Whether this task set's next upload at `layer` has work beyond the copies: its first upload,
        or a spill that grew a CPU segment since the index saw it (`_grow_segments`)."""
        return packed.seq_slot is None or not packed.dev or \
            bool((self._indexed[layer, packed.seq_slot] != packed.cpu_len).any())

    def _graph_outputs(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-layer flat (chosen, dest, counts) buffers for graphed claims of up to `rows` tasks
        (each claim views a contiguous prefix of them)."""
        bufs = self._graph_bufs.get(layer)
        n, s = max(rows, self.store.cfg.max_sequences * self.kv_heads), self.cache.slots
        if bufs is None or bufs[0].numel() < rows * s:
            bufs = self._graph_bufs[layer] = (torch.full((n * s,), -1, dtype=torch.int64, device=self.dev),
                                              torch.full((n * s,), -1, dtype=torch.int64, device=self.dev),
                                              torch.zeros((3 * n,), dtype=torch.int64, device=self.dev))
        return bufs

    def _fetch(self, layer: int, arena: torch.Tensor, chunks: torch.Tensor, slot: torch.Tensor, kv_head: torch.Tensor,
               chosen: torch.Tensor, dest: torch.Tensor, events: tuple | None, side: bool,
               graph: torch.cuda.CUDAGraph | None = None) -> None:
        """Copy the missing blocks; on CUDA on the copy stream (`side`, after the claim's reads of
        the cache) or the executor's stream, bracketed by `events`; the layer's event marks its end.
        `graph`: the same copy captured (`_graph`: it reads the graphed claim's outputs), replayed."""
        if not self.cuda:
            self.cache.fetch(layer, arena, chunks, slot, kv_head, chosen, dest)
            return
        stream = self.copy_stream if side else self.stream
        if side:
            queued = self._claims_queued  # `wait_stream` without a new event each call
            queued.record(self.stream)
            stream.wait_event(queued)
            # Made on the executor's stream, read on the copy stream: the plan's chunks, slots and heads
            # were marked at upload; a graphed claim's outputs are the executor's own buffers, kept for its life.
            if graph is None:
                chosen.record_stream(stream)
                dest.record_stream(stream)
        if events is None:  # inside a graph capture: the copy is part of the graph
            self.cache.fetch(layer, arena, chunks, slot, kv_head, chosen, dest, stream=stream.cuda_stream)
            return
        f0, f1 = events
        f0.record(stream)
        if graph is not None:
            with use_stream(stream, self.stream):  # a replay goes to the current stream
                graph.replay()
            self.fetch_replays += 1
        else:
            self.cache.fetch(layer, arena, chunks, slot, kv_head, chosen, dest, stream=stream.cuda_stream)
        f1.record(stream)
        self._fetched[layer] = f1
        self.fetch_events.append((layer, f0, f1))

    def _account(self, step: int, layer: int, counts: np.ndarray) -> None:
        """A retired claim's counts: `[3, n]` bytes moved, blocks selected, blocks missed per task."""
        moved, sel, miss = counts.sum(axis=1).tolist()
        self.bytes_read += moved
        self.blocks_selected += sel
        self.blocks_missed += miss
        self.fetch_log.append((step, layer, sel, miss))

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        """Run `tasks` of `step.layer` and wait; sets each task's `bytes_read`."""
        if not tasks:
            return
        tab, nsel, chunks, _ = native_table(tasks, step.group_size)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # step.q is ready
        plan = self.upload(self.pack(tab, nsel, chunks), tasks)
        per_task = self.launch(plan, 0, len(tasks), step).wait()
        for task, nbytes in zip(tasks, per_task.tolist()):
            task.bytes_read = int(nbytes)
            task.device = self.device

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, seq_id: int, layer: int, q_last: torch.Tensor, extend: bool = False) -> None:
        """After the store took a prompt (or its next chunk) at `layer`: index its CPU segment and warm
        the cache with the blocks the prompt's last query `q_last [Hq, D]` (unscaled) chooses."""
        self.flush_copy()
        store = self.store
        seq_slot = store.slot(seq_id)
        cpu_len = store.cpu_len(seq_id, layer)
        table = store.chunk_table(seq_id, layer)  # [Hkv, n], once the store's copies landed
        if self.cuda:
            stream = torch.cuda.current_stream()
            if self._fetched[layer] is not None:  # a released sequence's copies into this slot
                stream.wait_event(self._fetched[layer])
            stream.wait_stream(self.stream)
        old = self._indexed[layer, seq_slot] if extend else 0
        hkv = self.kv_heads
        chunks = np.ascontiguousarray(table, dtype=np.int64)
        heads = np.arange(hkv)
        self._index_rows(layer, chunks, heads, np.full(hkv, old), np.full(hkv, cpu_len))
        self._indexed[layer, seq_slot] = cpu_len
        self.cache.reset(layer, seq_slot)
        if not cpu_len:
            return
        dev = self.dev
        active = torch.ones((hkv, self.group_size), dtype=torch.bool)
        active.view(-1)[self._streaming.get(layer, [])] = False
        q = (q_last.to(device=dev, dtype=torch.float32) * self.scale).view(hkv, self.group_size, self.head_dim)
        h = torch.arange(hkv, device=dev)
        slot = torch.full((hkv,), seq_slot, dtype=torch.int64, device=dev)
        lens = torch.full((hkv,), cpu_len, dtype=torch.int64, device=dev)
        chunks_t = torch.from_numpy(chunks).to(dev)
        chosen = self._select_blocks(layer, q, active.to(dev), chunks_t, lens)
        new, ages, miss, dest = plan_update_aged(self.cache.table[layer][seq_slot], self.cache.age[layer][seq_slot],
                                                 chosen, self.resident_steps)
        self.cache.table[layer][seq_slot], self.cache.age[layer][seq_slot] = new, ages
        self.cache.fetch(layer, self._arena(layer), chunks_t, slot, h, chosen, dest,
                         stream=torch.cuda.current_stream().cuda_stream if self.cuda else None)
        moved = int(torch.where(miss, block_tokens(chosen, lens, self.block_size), 0).sum())
        self.prefill_bytes += moved * self.token_bytes
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())

    # ------------------------------------------------------------------ lifecycle and reports
    def warm_up(self) -> None:
        """Compile the copy kernel, the block and token scores', the cache update's and the attention's
        now (launches that read no token), not in the first decode step."""
        if not self.cuda:
            return
        none = torch.full((1, 1), -1, dtype=torch.int64, device=self.dev)
        zero = torch.zeros(1, dtype=torch.int64, device=self.dev)
        self.cache.fetch(0, self._arena(0), torch.zeros((1, 1), dtype=torch.int64, device=self.dev), zero, zero,
                         torch.zeros_like(none), none, stream=torch.cuda.current_stream().cuda_stream)
        if self.fused_token_scores:
            from gpu_kernels.asynctls_token_scores import int4_token_scores

            q_c = torch.zeros((1, self.group_size, self.index.d_c), dtype=torch.float32, device=self.dev)
            int4_token_scores(q_c, self.index.codes[0], self.index.qparams[0], none, torch.zeros_like(none), zero,
                              self.block_size)
        if self.fused_block_scores:
            from gpu_kernels.block_level_scores import level_scores

            level_scores(torch.zeros((1, self.group_size, self.head_dim), dtype=torch.float32, device=self.dev),
                         torch.zeros((1, self.group_size), dtype=torch.bool, device=self.dev), self.index.block_meta[0],
                         torch.zeros_like(none), zero, self.block_size)
        if self.fused_cache_update and self.blocks != "all":
            from gpu_kernels.cache_update import update_cache_rows

            # A scratch table of the layers' shape: the update writes its rows (the strides pick the variant).
            table = torch.full((1, *self.cache.table[0].shape[1:]), -1, dtype=torch.int64, device=self.dev)
            k = min(int(self.blocks), self.cache.slots)
            update_cache_rows(table, torch.zeros_like(table), zero, zero, none.expand(1, k).contiguous(), zero,
                              self.resident_steps, self.block_size, self.token_bytes)
        if self.fused_attention:
            from gpu_kernels.asynctls_attention import selected_attention

            hq = self.kv_heads * self.group_size
            q = torch.zeros((1, hq, self.head_dim), dtype=torch.float32, device=self.dev)
            selected_attention(q, self.cache.k[0], self.cache.v[0], zero, zero, zero, torch.zeros_like(none),
                               torch.zeros((1, 1), dtype=torch.bool, device=self.dev),
                               torch.zeros((1, self.group_size), dtype=torch.bool, device=self.dev), q.clone(),
                               torch.zeros((1, hq), dtype=torch.float32, device=self.dev))
        torch.cuda.synchronize()

    def epsilon_per_step(self) -> np.ndarray:
        """`|M_t \\ C_t| / |M_t|` of every recorded step (one layer of one decode call; its claims
        summed over the batch and KV heads), in step order."""
        log = np.array(self.fetch_log, dtype=np.int64).reshape(-1, 4)
        steps, at = np.unique(log[:, 0], return_inverse=True)
        sel = np.bincount(at, weights=log[:, 2], minlength=len(steps))
        miss = np.bincount(at, weights=log[:, 3], minlength=len(steps))
        keep = sel > 0
        return miss[keep] / sel[keep]

    def transfer_seconds(self) -> float:
        """GPU time of the copies launched so far (synchronizes; CUDA only), and forgets them. A copy
        still pending (`defer_copy`) is not launched here: the first call after its launch counts it."""
        if not self.cuda:
            return 0.0
        torch.cuda.synchronize()
        total = sum(f0.elapsed_time(f1) for _, f0, f1 in self.fetch_events) * 1e-3
        self.fetch_events.clear()
        return total


def memory_bytes(selection: SelectionConfig, kv: KVCacheConfig, geometry: GeometryConfig, n_chunks: int) -> dict[str, int]:
    """What the executor allocates: `index` and `cache` (resident, on its device) and `step`, the
    temporaries of a claim of every task at its largest (a sequence filling the capacity)."""
    es = 4 if kv.dtype == "fp32" else 2
    d, g, hkv = geometry.head_dim, geometry.group_size, geometry.kv_heads
    blk, d_c = selection.block_size, selection.index_channels
    slots = cache_slots(selection, kv)
    index = geometry.layers * index_bytes(n_chunks, d, d_c, blk, es)
    cache = cache_bytes(geometry.layers, kv.max_sequences, hkv, slots, blk, d, es)
    rows = kv.max_sequences * hkv
    nb = -(-kv.cpu_capacity_tokens // layout.CHUNK_TOKENS) * (layout.CHUNK_TOKENS // blk)
    n = slots * blk
    k_t = n if selection.tokens == "all" else min(n, int(selection.tokens))
    level1 = nb * 2 * d * (es + 4) + 2 * nb * 4
    level2 = n * (5 * 8 + (d_c // 2) + 8 + 4 * d_c) + 3 * g * n * 4
    attend = k_t * (2 * d * (es + 4) + 8) + 2 * g * k_t * 4
    return {"index": index, "cache": cache, "step": rows * (level1 + max(level2, attend))}


def asynctls_executor(store: KVStore, selection: SelectionConfig) -> AsyncTlsExecutor:
    """The runtime's AsyncTLS executor: channels from `selection.channel_file` (checked against the
    store's geometry), kernels compiled."""
    path = resolve_checkpoint(selection.channel_file)
    if path is None:
        raise ConfigError(f"selection.channel_file: {selection.channel_file!r} is not a file; allowed: a channel file "
                          "written by python -m hybrid_runtime.experiments.asynctls_calibration")
    try:
        sets = ChannelSets.load(path)
    except ValueError as exc:
        raise ConfigError(f"selection.channel_file: {exc}") from None
    sets.check_geometry(store.geometry, f"selection.channel_file {selection.channel_file!r}")
    executor = AsyncTlsExecutor(store, selection, sets.channels(selection.index_channels)[: store.layers])
    executor.warm_up()
    return executor


# ---------------------------------------------------------------------------- the math, shared with tests
def block_scores(meta: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Quest bounds summed over a group's heads, as two GEMMs: `meta [R, N, 2, D]` (min, max) and
    `q [R, G, D]` -> `[R, N]` = `(sum_h max(q_h, 0)) . max + (sum_h min(q_h, 0)) . min`."""
    pos, neg = q.clamp(min=0).sum(1), q.clamp(max=0).sum(1)  # [R, D]
    return torch.bmm(meta[:, :, 1], pos[:, :, None]).squeeze(2) + torch.bmm(meta[:, :, 0], neg[:, :, None]).squeeze(2)


def token_scores(keys: torch.Tensor, q: torch.Tensor, valid: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Double Sparsity's group score of each candidate: the heads' softmaxes over their
    approximate scores `q_c . k_c` (`keys [R, N, d_c]`, `q [R, G, d_c]`), averaged over the active
    heads; -1 for candidates that are not tokens (never chosen before a real one)."""
    return group_token_scores(torch.bmm(q, keys.transpose(1, 2)), valid, active)


def group_token_scores(s: torch.Tensor, valid: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """`token_scores` from the heads' approximate scores `s [R, G, N]` (overwritten): softmax per head
    over the `valid [R, N]` candidates, averaged over the `active [R, G]` heads; -1 where not valid."""
    s.masked_fill_(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a row without candidates has no distribution
    w = active.to(p.dtype)
    avg = (p * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp(min=1)
    return avg.masked_fill_(~valid, -1.0)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                    active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `q [R, G, D]` over `k, v [R, N, D]` where `valid [R, N]`; heads not
    `active [R, G]` (and rows with no valid key) get out 0, lse -inf."""
    s = torch.bmm(q, k.transpose(1, 2))  # [R, G, N]
    s.masked_fill_(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(active, lse, torch.full_like(lse, float("-inf")))
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])
    p = torch.where(torch.isfinite(lse)[..., None], p, torch.zeros_like(p))
    return torch.bmm(p, v), lse


__all__ = ["AsyncTlsExecutor", "AsyncTlsLaunch", "AsyncTlsPlan", "asynctls_executor", "block_scores", "cache_slots",
           "exact_attention", "group_token_scores", "memory_bytes", "token_scores"]
