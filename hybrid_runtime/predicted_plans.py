"""The `predicted` head-plan policy: per decode step and layer, features -> predictor -> selector -> plan.

Per call (`PredictedHeadPlanner.__call__`, once per step and layer, before the step's tasks are
built):

1. on the device that holds the GPU window: the 41 features of every (sequence, query head)
   from this step's queries, the window (its rows include this step's token: the runtime appends
   before it plans) and the statistics cached at prefill (`prefill_statistics`); then the
   head-property predictor (`predictor.model`) -> `bgt0`, `k`, `p_streaming` per head;
2. still on the device, the granularity selector (Eq. 1 and Eq. 3 of `selector.GranularitySelector`)
   turns the budget laws into the plan: a block size per KV group, a budget per query head, 0
   for streaming heads (a group whose heads are all streaming gets no task);
3. the plan (and the predictions, for reports) in host memory and the host's wait for it: the
   **one synchronisation** of the policy. The host needs the plan to build the step's tasks
   (which blocks of which chunks each CPU worker and the GPU lane read), and the plan depends on
   values computed on the device, so the wait cannot be avoided -- only made short, which is
   what the fused kernels (or the CUDA graphs) are for -- or moved off the step: with
   `selection.plan_lag` 1 a step builds its tasks from the plan its layer computed one step
   earlier for the same sequences (already in host memory) and launches its own plan's
   computation for the next step without waiting for it. On the fused CUDA path that takes the
   device part and the wait off the host's path; elsewhere the plan is computed at once as before
   and only handed out a step later (the same plans, for quality runs on the CPU).

How the device part runs (`path`):

* `fused` (the default on CUDA): two Triton launches (`gpu_kernels.head_predictor`), one over
  (sequence, KV head) for the features and one over (sequence, KV groups) for the rest of the
  features, the network and the selector. The host writes the rows' window slots, statistics
  rows, window lengths and CPU lengths into a pinned buffer the kernels read through its CUDA
  view, and the plan lands in a pinned buffer the kernels write the same way. On CUDA the two
  launches are captured once per (layer, batch bucket, queries' dtype) into a CUDA graph (at
  `warm_up`, with `capture`; the runtime runs it on its background warm-up thread) and a step
  replays one, since two Triton launches cost the host about as much as the kernels take; a batch
  of `b` sequences runs the smallest bucket holding it.
  The step's queries reach the kernels by `fused_queries`:
  `reference` (default): the host writes their address, strides and row count into a pinned
  reference the kernels read (no copy; a graph per dtype of the store's and fp32, any other
  dtype copied into the bucket's fp32 static buffer first), and the bucket's rows past the
  batch do nothing; `static` (the previous way, kept to measure against): the step copies its
  queries into the bucket's static fp32 buffer and the extra rows point at the scratch row.
  Without graphs (`capture=False`, and under the interpreter) the host launches the two kernels,
  on the reference (`reference`) or on the caller's queries (`static`). Either way: no per-step
  allocation, and the host's one wait.
* `graph` / `graph_compiled`: the torch ops (plain, or through `torch.compile`) in one CUDA graph
  per (layer, batch bucket), captured at the planner's warm-up (`warm_up`) and replayed per step,
  followed by the copy of step 3: a batch of `b` sequences runs the graph of the smallest bucket
  (powers of two up to `kv_cache.max_sequences`) holding it, its extra rows pointing at a scratch
  row. Static input buffers per bucket take this step's queries (one copy) and the rows' slots
  and lengths (one small pinned host-to-device copy).
* `eager` (the default on the CPU): the same torch functions, op by op.

Statistics of a sequence come from `prefill(seq_id, layer, k, v, q_last)`, which the runtime calls
from its own `prefill` with the query of the prompt's last token; a sequence decoded without them
is refused with an error saying so.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from hybrid_runtime.config import GeometryConfig, SelectionConfig, resolve_checkpoint
from hybrid_runtime.head_plans import HeadPlan
from hybrid_runtime.prefill_statistics import PrefillStatisticsCache
from hybrid_runtime.selector import GranularitySelector, Selection
from predictor.features import FEATURE_NAMES, decode_features
from predictor.model import Checkpoint, HeadPropertyNet, load_checkpoint

PATHS = ("fused", "graph", "graph_compiled", "eager")
# How the fused path's kernels get the step's queries (`fused_queries`, module docstring).
FUSED_QUERIES = ("reference", "static")


def batch_buckets(max_sequences: int) -> tuple[int, ...]:
    """Batch sizes with a graph of their own: powers of two below `max_sequences`, and it."""
    return tuple(sorted({1 << i for i in range(max_sequences.bit_length()) if 1 << i < max_sequences} | {max_sequences}))


def network_linears(model: HeadPropertyNet) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The network as `(weight, bias)` Linear layers in order, SiLU between them, the three heads
    stacked into the last one (rows bgt0, k, streaming logit): what the fused kernels run."""
    layers = []
    for i, module in enumerate(model.backbone):
        if isinstance(module, torch.nn.Linear):
            layers.append((module.weight, module.bias))
        elif not isinstance(module, torch.nn.SiLU):
            raise ValueError(f"backbone[{i}] is {type(module).__name__}; the fused kernels run Linear + SiLU layers only")
    heads = (model.bgt0_head, model.k_head, model.streaming_head)
    layers.append((torch.cat([h.weight for h in heads]), torch.cat([h.bias for h in heads])))
    return layers


class PredictedHeadPlanner:
    """Head plans from the head-property predictor and the granularity selector (module docstring).

    `store` is the runtime's `KVStore`; the planner keeps its statistics and graphs on the store's
    window device. `checkpoint` overrides `selection.checkpoint` (tests, benchmarks). `path`: one
    of `PATHS` (module docstring); default `fused` on CUDA, `eager` on the CPU, where `fused` runs
    only under Triton's interpreter (tests) and the graph paths not at all. `capture` false leaves
    the graph paths' capture to `capture_all` (a bucket without a graph runs eagerly) and keeps the
    fused path on plain launches (`capture_fused` graphs it later). The constructor compiles the
    step's kernels and captures its graphs (`warm_up`) unless `defer_warm_up`: then the first step
    does, or whoever calls `warm_up` first (the runtime compiles them on its background warm-up
    thread while the caller prefills -- that took 4.7-13 s of the constructor at 8B geometry -- and
    captures the graphs on the caller's thread when its first decode step has waited for that:
    `warm_up(capture=False)`). `fused_options`:
    launch choices passed to `FusedHeadPredictor` (`parts`, `block_w`, `features_warps`,
    `features_pack`, `dot_precision`, ...; benchmarks compare them), defaults otherwise. `fused_queries`: `reference` or
    `static`, how the fused kernels get the step's queries (module docstring). `on_selection`, when
    set, is called with `(layer, seq_ids, selection)` after every step's selection (reports), when
    its plan is read. `plan_lag` overrides `selection.plan_lag` (0 or 1; module docstring).
    """

    uses_queries = True  # the runtime passes the step's queries `[B, Hq, D]`
    reads_window = True  # the runtime appends the step's k, v to the window before planning

    def __init__(self, policy: SelectionConfig, geometry: GeometryConfig, store: Any, *,
                 checkpoint: Checkpoint | None = None, path: str | None = None, capture: bool = True,
                 fused_options: Mapping[str, Any] | None = None, fused_queries: str = "reference",
                 defer_warm_up: bool = False, plan_lag: int | None = None):
        kv = store.cfg
        cuda = store.device.type == "cuda"
        path = ("fused" if cuda else "eager") if path is None else path
        if path not in PATHS:
            raise ValueError(f"path {path!r} is not one of {list(PATHS)}")
        if fused_queries not in FUSED_QUERIES:
            raise ValueError(f"fused_queries {fused_queries!r} is not one of {list(FUSED_QUERIES)}")
        plan_lag = policy.plan_lag if plan_lag is None else plan_lag
        if plan_lag not in (0, 1) or isinstance(plan_lag, bool):
            raise ValueError(f"plan_lag {plan_lag!r}: allowed 0 (a step's own plan) or 1 (the plan of the step before)")
        if path.startswith("graph") and not cuda:
            raise ValueError(f"path {path!r} captures CUDA graphs; the store's window is on {store.device}")
        if path == "fused" and not cuda:
            from gpu_kernels._checks import interpreted

            if not interpreted():
                raise ValueError("path 'fused' runs Triton kernels: on CUDA, or on the CPU under TRITON_INTERPRET=1")
        missing = [b for b in policy.block_sizes if b not in kv.block_sizes]
        if missing:
            raise ValueError(f"selection.block_sizes {missing} are not in kv_cache.block_sizes={list(kv.block_sizes)}: "
                             "the store keeps no metadata at those granularities")
        if checkpoint is None:
            checkpoint_file = resolve_checkpoint(policy.checkpoint)
            if checkpoint_file is None:
                raise FileNotFoundError(f"selection.checkpoint {policy.checkpoint!r}: no such file (looked up from the "
                                        "working directory and the repository root)")
            checkpoint = load_checkpoint(checkpoint_file)
        checkpoint.check_feature_names(FEATURE_NAMES)
        self.store = store
        self.geometry = geometry
        self.device = store.device  # CUDA with its index, as the checks on q below compare it
        self.cuda = cuda
        self.path = path
        self.tau = checkpoint.tau
        self._model = checkpoint.model.to(self.device).eval()
        self.statistics = PrefillStatisticsCache(geometry, kv, store.layers, self.device, checkpoint.tau)
        element_size = torch.tensor([], dtype=store.dtype).element_size()
        self.selector = GranularitySelector(geometry.group_size, geometry.head_dim, element_size,
                                            policy.block_sizes, policy.streaming_threshold)
        self.skip_streaming = policy.skip_streaming
        self.device_selector = self.selector.on_device(self.device)
        self.on_selection: Callable[[int, list, Selection], None] | None = None
        self.buckets = batch_buckets(kv.max_sequences)
        hq, d = geometry.q_heads, geometry.head_dim
        pin = self.cuda
        # Per bucket: static inputs (queries; window slot, statistics row, window length and CPU
        # length per row) and the output (bgt0, k, p_streaming and the budget per head, then the
        # block size per KV group), on the device and, for the output, pinned on the host.
        hkv = geometry.kv_heads
        self._q = {n: torch.zeros(n, hq, d, device=self.device) for n in self.buckets}
        self._idx = {n: torch.zeros(4, n, dtype=torch.int64, device=self.device) for n in self.buckets}
        self._idx_host = {n: torch.zeros(4, n, dtype=torch.int64, pin_memory=pin) for n in self.buckets}
        self._out = {n: torch.zeros(4 * n * hq + n * hkv, device=self.device) for n in self.buckets}
        self._out_host = {n: torch.zeros(4 * n * hq + n * hkv, pin_memory=pin) for n in self.buckets} if self.cuda else self._out
        for n in self.buckets:
            self._park(n)
        self._no_streaming = {n: np.zeros((n, hq), dtype=bool) for n in self.buckets}
        # `graph_compiled`: the device step through torch.compile (compiled during the warm-up run
        # before each capture, at most twice per bucket: layers share the code).
        self._step = torch.compile(self._device_step) if path == "graph_compiled" else self._device_step
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        # The smallest bucket holding a batch of b rows, by b.
        self._bucket_of = [0] + [next(n for n in self.buckets if n >= b) for b in range(1, self.buckets[-1] + 1)]
        # (layer, statistics rows) found ready: a step checks its rows once, until a prefill or release.
        self._ready_rows: set[tuple[int, ...]] = set()
        self._fused = None
        self.fused_queries = fused_queries
        self.plan_lag = plan_lag
        # plan_lag 1, per layer: the sequences of the plan the next step of that layer may run on, and
        # that plan -- a HeadPlan, or (bucket, CPU lengths) while the fused path computes it on the
        # device into the layer's own output rows. Forgotten on every prefill and release.
        self._lagged: dict[int, tuple[tuple[int, ...], Any]] = {}
        # The fused path's replays the host did not wait for, per layer: their index and output rows
        # are rewritten only after them.
        self._in_flight: dict[int, torch.cuda.Event] = {}
        self._free_events: list = []
        self._last_layer = 0  # whose output `predictions` reads (the fused path's rows are per layer)
        self.lagged_steps = 0  # steps that ran on the plan of the step before
        self._capture = capture
        self.warmed_up = False  # `warm_up` ran (its captures included)
        self._fused_compiled = False  # `_warm_fused` ran
        self._warm_lock = threading.Lock()  # the runtime's warm-up thread and a caller's first step may race
        if path == "fused":
            self._setup_fused(policy, dict(fused_options or {}))
        if self.cuda:
            self._done = torch.cuda.Event()
        if not defer_warm_up:
            self.warm_up()

    def warm_up(self, capture: bool = True) -> None:
        """Compile the kernels a step launches and, with the planner's `capture` on CUDA, capture the
        step's graphs (fused path: per layer, batch bucket and queries' dtype; graph paths: per layer
        and bucket); idempotent. Reads only the planner's own buffers, the statistics' scratch row
        and window slot 0 of layer 0 (results discarded), so a prefill may run meanwhile on another
        thread. A second caller waits for the first one's warm-up.

        `capture=False` compiles only and leaves `warmed_up` false where graphs are still to be
        captured (the next `warm_up()`, or the first step, captures them). The runtime's background
        thread warms up that way: a CUDA graph capture holds torch's default CUDA generator, and a
        draw from it on any other thread meanwhile raises ("Offset increment outside graph capture
        encountered unexpectedly") -- a caller's `torch.randn(..., device="cuda")` between two
        prefills, or `generate(do_sample=True)` sampling its first token, seen on the H200."""
        with self._warm_lock:
            if self.warmed_up:
                return
            captures = self.cuda and self._capture and (self._fused is not None or self.path.startswith("graph"))
            if self._fused is not None and not self._fused_compiled:
                self._warm_fused()
                self._fused_compiled = True
            if captures and not capture:
                return
            if captures:
                if self._fused is not None:
                    self.capture_fused()
                else:
                    self.capture_all()
            self.warmed_up = True

    def _setup_fused(self, policy: SelectionConfig, options: dict) -> None:
        """The fused kernels, planned once; their index and output buffers pinned on the host and
        read / written by the kernels through CUDA views (compiled by `_warm_fused`)."""
        from gpu_kernels.head_predictor import INDEX_ROWS, FusedHeadPredictor
        from gpu_kernels.uva import uva_view

        g, m = self.geometry, self.store.cfg.max_sequences
        model = self.model
        self._fused = FusedHeadPredictor(
            q_heads=g.q_heads, kv_heads=g.kv_heads, head_dim=g.head_dim, max_sequences=m,
            window_capacity=self.store.window_capacity, statistics_offsets=self.statistics.field_offsets(),
            statistics_width=self.statistics.width, feature_names=FEATURE_NAMES, linears=network_linears(model),
            feature_mean=model.feature_mean, feature_std=model.feature_std, target_mean=model.target_mean.tolist(),
            target_std=model.target_std.tolist(), tau=self.tau, block_sizes=policy.block_sizes,
            streaming_threshold=policy.streaming_threshold, skip_streaming=policy.skip_streaming, device=self.device,
            **options)
        # Index rows, query reference and output per layer: a layer's graph reads and writes its own,
        # so a replay the host does not wait for (plan_lag 1) is not overwritten by the next layer's.
        layers = self.store.layers
        self._fused_idx = torch.zeros(layers, INDEX_ROWS, m, dtype=torch.int64, pin_memory=self.cuda)
        self._fused_out = torch.zeros(layers, self._fused.out_size, pin_memory=self.cuda)
        if self.cuda:
            self._fused_idx_dev = uva_view(self._fused_idx, self.device.index)
            self._fused_out_dev = uva_view(self._fused_out, self.device.index)
        else:
            self._fused_idx_dev, self._fused_out_dev = self._fused_idx, self._fused_out
        self._fused_idx_np = self._fused_idx.numpy()
        self._fused_out_np = self._fused_out.numpy()
        self._fused_q: torch.Tensor | None = None  # the staged step's queries, until its launch
        self._fused_q_dtypes = (torch.float32, torch.bfloat16, torch.float16)
        self._fused_by_ref = self.fused_queries == "reference"
        # `reference`: the queries' address, row and head strides and row count, written per step into
        # pinned memory the kernels read through its CUDA view; the launch's q is a template that
        # carries only the dtype and the bucket's grid (d elements of storage, expanded).
        self._fused_ref = torch.zeros(layers, 4, dtype=torch.int64, pin_memory=self.cuda)
        self._fused_ref_dev = uva_view(self._fused_ref, self.device.index) if self.cuda else self._fused_ref
        self._fused_ref_np = self._fused_ref.numpy()
        templates = {dtype: torch.zeros(1, 1, g.head_dim, dtype=dtype, device=self.device).expand(m, g.q_heads, g.head_dim)
                     for dtype in self._fused_q_dtypes}
        self._q_template = {(dtype, n): t[:n] for dtype, t in templates.items() for n in self.buckets}
        self._q_static_rows = {b: self._q[self._bucket_of[b]][:b] for b in range(1, m + 1)}
        # Graphs: per (layer, bucket, queries' dtype). `reference`: the store's dtype and fp32 (another
        # dtype is copied into the bucket's fp32 static buffer and passed by reference to it);
        # `static`: fp32 only, the static buffer every step copies its queries into.
        self._graph_q_dtypes = tuple(dict.fromkeys((self.store.dtype, torch.float32))) if self._fused_by_ref \
            else (torch.float32,)
        # The plan's rows in a layer's output (bucket max_sequences on the fused path), by (layer, batch size).
        hq, hkv, n = g.q_heads, g.kv_heads, m * g.q_heads
        self._fused_plan_views = {(layer, b): (self._fused_out_np[layer, 3 * n : 3 * n + b * hq].reshape(b, hq),
                                               self._fused_out_np[layer, 4 * n : 4 * n + b * hkv].reshape(b, hkv))
                                  for layer in range(layers) for b in range(1, m + 1)}
        self._fused_graphs: dict[tuple[int, int, torch.dtype], torch.cuda.CUDAGraph] = {}
        self._fused_bucket = self.buckets[-1]  # the staged step's graph bucket
        self._fused_dtype = torch.float32  # and its queries' dtype
        # A padding row: window slot 0, the statistics' scratch row, one window token, no CPU segment.
        self._fused_pad = np.array([0, self.statistics.scratch, 1, 0], dtype=np.int64)

    def _warm_fused(self) -> None:
        """One run per usual queries' dtype on the scratch row (what padding rows use): the kernels
        compile here, so no decode step stops to compile."""
        import time

        t0 = time.perf_counter()
        g = self.geometry
        scratch = self.statistics.scratch
        self._fused_idx_np[0, :, 0] = (0, scratch, 1, 0)
        win_k, win_v = self.store.window(0)
        for dtype in dict.fromkeys((self.store.dtype, torch.float32)):
            zeros = torch.zeros(1, g.q_heads, g.head_dim, dtype=dtype, device=self.device)
            q, q_ref = zeros, None
            if self._fused_by_ref:  # the reference names the one query row
                self._fused_ref_np[0] = (zeros.data_ptr(), zeros.stride(0), zeros.stride(1), 1)
                q, q_ref = self._q_template[(dtype, 1)], self._fused_ref_dev[0]
            self._fused.run(q, self._fused_idx_dev[0], self.statistics.layer_rows(0), self.statistics.previous_queries(0),
                            win_k, win_v, 0.0, self._fused_out_dev[0], q_ref=q_ref)
            if self.cuda:
                torch.cuda.synchronize(self.device)  # q is freed next
        self.capture_seconds += time.perf_counter() - t0

    @property
    def model(self) -> HeadPropertyNet:
        """The head-property network the planner runs."""
        return self._model

    @model.setter
    def model(self, net: HeadPropertyNet) -> None:
        # Only the eager path reads the network at each step: the fused kernels took its weights
        # when the planner was built, and the graph paths captured it.
        if self.path != "eager":
            raise ValueError(f"the {self.path!r} path took its network when the planner was built; a network set "
                             "later would not run. Build the planner with checkpoint=... (or path='eager')")
        self._model = net

    def capture_fused(self) -> None:
        """Capture the fused kernels of every (layer, batch bucket, queries' dtype) into CUDA graphs
        that read the pinned index rows and, by `fused_queries`, the queries where the pinned
        reference says (`reference`) or the bucket's static fp32 queries (`static`); idempotent.
        Each is run once eagerly first (no rows, or padding rows), so capture never meets an
        uncompiled variant."""
        import time

        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        self.settle()  # replays still in flight read the rows rewritten here
        self._fused_idx_np[:] = self._fused_pad[None, :, None]
        self._fused_ref_np[:] = (self._q[self.buckets[-1]].data_ptr(), 0, 0, 0)  # no rows: the kernels do nothing
        for layer in range(self.store.layers):
            for bucket in self.buckets:
                for dtype in self._graph_q_dtypes:
                    key = (layer, bucket, dtype)
                    if key in self._fused_graphs:
                        continue
                    q = self._q_template[(dtype, bucket)] if self._fused_by_ref else self._q[bucket]
                    with torch.cuda.stream(side):
                        self._run_fused(layer, q)
                    side.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: the store's committer thread may register host memory meanwhile.
                    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                        self._run_fused(layer, q)
                    self._fused_graphs[key] = graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0

    def _run_fused(self, layer: int, q: torch.Tensor) -> None:
        """Launch the fused kernels of one layer for the rows of `q` (the index rows staged; with
        `fused_queries` `reference`, q is a template and the kernels read the staged reference)."""
        self._fused.run(q, self._fused_idx_dev[layer], self.statistics.layer_rows(layer),
                        self.statistics.previous_queries(layer), *self.store.window(layer),
                        layer / max(self.store.layers - 1, 1), self._fused_out_dev[layer], validate=False,
                        q_ref=self._fused_ref_dev[layer] if self._fused_by_ref else None)

    # ------------------------------------------------------------------ prefill and release
    def prefill(self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor, q_last: torch.Tensor,
                extend: bool = False) -> None:
        """Statistics of the sequence's prompt at `layer`, after the store took `k, v`; `q_last [Hq, D]` is
        the query of the prompt's last token so far. With `extend` the prompt is everything the store
        holds of the sequence at the layer (read once, on k's device)."""
        if extend:
            k, v = self.store.full_kv(seq_id, layer, device=k.device)
        self.settle()  # a replay not waited for may still read the rows this rewrites
        self.statistics.store_prompt(layer, self.store.slot(seq_id), k, v, q_last)
        self._ready_rows.clear()
        self._lagged.clear()

    def release(self, seq_id: int) -> None:
        """Before the store frees the sequence's slot: its statistics are stale from now on."""
        self.settle()
        self.statistics.forget(self.store.slot(seq_id))
        self._ready_rows.clear()
        self._lagged.clear()

    def absorb_spill(self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The store's spill listener: window tokens `[Hkv, n, D]` of a slot move into its CPU segment."""
        self.statistics.absorb_spill(layer, slot, k, v)

    # ------------------------------------------------------------------ the device part
    def _park(self, bucket: int) -> None:
        """Point every row of a bucket at the scratch row (what capture and warm-up run on)."""
        idx = self._idx[bucket]
        idx[0].zero_()
        idx[1].fill_(self.statistics.scratch)
        idx[2].fill_(1)
        idx[3].zero_()

    def _features(self, stats_rows: torch.Tensor, previous: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                  idx: torch.Tensor, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Features `[bucket * Hq, 41]` of a staged bucket from the layer's buffers (all arguments, so
        that a compiled version serves every layer)."""
        rows = idx[1]
        stats = self.statistics.unpack(stats_rows.index_select(0, rows))
        return decode_features(stats, q, previous.index_select(0, rows), win_k.index_select(0, idx[0]),
                               win_v.index_select(0, idx[0]), idx[2], layer, self.store.layers)

    def _device_step(self, stats_rows: torch.Tensor, previous: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                     idx: torch.Tensor, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Features, predictor and selector of a staged bucket: `[4 * bucket * Hq + bucket * Hkv]` (bgt0, k,
        p_streaming and budget per head, block size per group). Updates the rows' previous queries."""
        features = self._features(stats_rows, previous, win_k, win_v, idx, q, layer)
        previous.index_copy_(0, idx[1], q)  # padding rows all write the scratch row
        bgt0, k, p = self.model.predict(features)
        shape = (q.shape[0], self.geometry.q_heads)
        block_size, budgets, _ = self.device_selector(bgt0.view(shape), k.view(shape), p.view(shape), idx[3],
                                                      self.skip_streaming)
        return torch.cat([bgt0, k, p, budgets.view(-1), block_size.view(-1).float()])

    def _layer_inputs(self, layer: int, bucket: int) -> tuple:
        win_k, win_v = self.store.window(layer)
        return (self.statistics.layer_rows(layer), self.statistics.previous_queries(layer), win_k, win_v,
                self._idx[bucket], self._q[bucket], layer)

    def _compute(self, layer: int, bucket: int) -> None:
        """The device step of one bucket at one layer into its static output (what a graph holds)."""
        self._out[bucket].copy_(self._step(*self._layer_inputs(layer, bucket)))

    def capture_all(self, buckets: Sequence[int] | None = None) -> None:
        """Capture the graph of every (layer, bucket) (the planner's warm-up; `buckets`: only these); idempotent."""
        import time

        buckets = self.buckets if buckets is None else buckets
        bad = [n for n in buckets if n not in self.buckets]
        if bad:
            raise ValueError(f"buckets {bad} are not among the planner's {list(self.buckets)}")
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        for layer in range(self.store.layers):
            for bucket in buckets:
                if (layer, bucket) in self._graphs:
                    continue
                with torch.cuda.stream(side):  # eager run first: library handles and workspaces exist before capture
                    self._park(bucket)
                    self._compute(layer, bucket)
                side.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: the store's committer thread may register host memory meanwhile.
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    self._compute(layer, bucket)
                self._graphs[(layer, bucket)] = graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ the step
    def _check_step(self, layer: int, seq_ids: Sequence[int], store: Any,
                    q: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
        """The rows' store slots, window lengths and CPU lengths, after checking the step's arguments
        (nothing changed yet)."""
        b = len(seq_ids)
        hq = self.geometry.q_heads
        if q.shape != (b, hq, self.geometry.head_dim):
            raise ValueError(f"q has shape {tuple(q.shape)}; expected [{b}, {hq}, {self.geometry.head_dim}]")
        if b == 0 or b > self.buckets[-1]:
            raise ValueError(f"{b} sequences in one step; allowed 1..kv_cache.max_sequences={self.buckets[-1]}")
        slots, window_len, cpu_len = store.step_rows(layer, seq_ids)
        # Readiness changes only through this planner's prefill and release, which forget what was found.
        key = (layer, *slots)
        if key not in self._ready_rows:
            ready = self.statistics.ready(layer, slots)
            if not ready.all():
                missing = [s for s, r in zip(seq_ids, ready) if not r]
                raise ValueError(
                    f"sequences {missing} have no prefill statistics at layer {layer}: the predicted policy needs the query "
                    "of the prompt's last token at prefill (HybridRuntime.prefill(..., q_last=q) for every layer)")
            if len(self._ready_rows) >= 4096:  # batches keep changing: start over rather than grow
                self._ready_rows.clear()
            self._ready_rows.add(key)
        return slots, window_len, cpu_len

    def _stage(self, layer: int, seq_ids: Sequence[int], store: Any, q: torch.Tensor,
               torch_path: bool = False) -> tuple[int, np.ndarray]:
        """The step's inputs where the device part reads them; returns the output's row count
        (the bucket; `max_sequences` on the fused path) and the rows' CPU lengths.

        Fused path: the slots and lengths into the pinned index buffer (the kernels read it
        through its CUDA view; the previous call has been waited for). The queries: with
        `fused_queries` `reference` their address and strides into the pinned reference (copied
        into the bucket's fp32 static buffer first only for a dtype without graphs); with `static`
        copied into that buffer when the graphs run (padding rows staged too), else launched as
        they are. Torch paths (or `torch_path`): into the bucket's static buffers, padding rows pointing at
        the scratch row, one pinned host-to-device copy and one copy of the queries.
        """
        slots, window_len, cpu_len = self._check_step(layer, seq_ids, store, q)
        b = len(seq_ids)
        if self._fused is not None and not torch_path:
            if q.device != self.device or q.stride(-1) != 1 or q.dtype not in self._fused_q_dtypes:
                raise ValueError(f"q must be a float32/bf16/fp16 tensor on {self.device} with a unit last stride, got "
                                 f"{q.dtype} on {q.device} with strides {q.stride()}")
            self._await_in_flight(layer)  # its replay of a step ago read the rows rewritten here
            host = self._fused_idx_np[layer]
            host[:, :b] = (slots, slots, window_len, cpu_len)
            bucket = self._fused_bucket = self._bucket_of[b]
            if self._fused_by_ref:
                dtype = q.dtype
                if self._fused_graphs and dtype not in self._graph_q_dtypes:  # not the store's dtype, not fp32
                    static = self._q_static_rows[b]
                    static.copy_(q)
                    q, dtype = static, torch.float32
                strides = q.stride()
                ref = self._fused_ref_np[layer]
                ref[0] = q.data_ptr()
                ref[1] = strides[0]
                ref[2] = strides[1]
                ref[3] = b
                self._fused_dtype = dtype
                self._fused_q = q  # held until the launch (the kernels read it there)
            elif self._fused_graphs:
                host[:, b:bucket] = self._fused_pad[:, None]
                self._q_static_rows[b].copy_(q)  # the graph's static queries (fp32)
            else:
                self._fused_q = q
            return self.buckets[-1], host[3, :b]  # the output's layout is max_sequences rows
        bucket = next(n for n in self.buckets if n >= b)
        host = self._idx_host[bucket].numpy()
        host[0, :b] = slots
        host[0, b:] = 0
        host[1, :b] = slots
        host[1, b:] = self.statistics.scratch
        host[2, :b] = window_len
        host[2, b:] = 1
        host[3, :b] = cpu_len
        host[3, b:] = 0
        self._idx[bucket].copy_(self._idx_host[bucket], non_blocking=True)
        self._q[bucket][:b].copy_(q)
        return bucket, host[3, :b].copy()

    def _launch(self, layer: int, bucket: int) -> None:
        """The device part of a staged step, up to the plan in host memory once the stream gets there."""
        if self._fused is not None:
            if self._fused_graphs:
                self._fused_graphs[(layer, self._fused_bucket, self._fused_dtype)].replay()
            elif self._fused_by_ref:
                self._run_fused(layer, self._q_template[(self._fused_dtype, self._fused_bucket)])
            else:
                self._run_fused(layer, self._fused_q)
            # The caller's tensor: not kept past the call (a later use of its memory is ordered after
            # the kernels on the stream, as the allocator's reuse is).
            self._fused_q = None
            return
        graph = self._graphs.get((layer, bucket))
        if graph is not None:
            graph.replay()
        else:
            self._compute(layer, bucket)
        if self.cuda:
            # Outside the graph: a copy into pinned memory records an event for the host allocator.
            self._out_host[bucket].copy_(self._out[bucket], non_blocking=True)

    def _output(self, bucket: int, layer: int) -> np.ndarray:
        return self._fused_out_np[layer] if self._fused is not None else self._out_host[bucket].numpy()

    def step_features(self, layer: int, seq_ids: Sequence[int], q: torch.Tensor) -> torch.Tensor:
        """The features `[B * Hq, 41]` a step with queries `q` would see now, computed eagerly by the
        torch reference and changing no state (tests and reports; a step runs `__call__`)."""
        if not self.warmed_up:
            self.warm_up()
        bucket, _ = self._stage(layer, seq_ids, self.store, q, torch_path=True)
        features = self._features(*self._layer_inputs(layer, bucket))[: len(seq_ids) * self.geometry.q_heads].clone()
        if self.cuda:  # the staging buffers are reused by the next call
            torch.cuda.current_stream(self.device).synchronize()
        return features

    def __call__(self, layer: int, seq_ids: Sequence[int], store: Any, q: torch.Tensor) -> HeadPlan:
        """The plan of one step at one layer for `seq_ids`, whose queries are `q [B, Hq, D]` (unscaled):
        computed from `q` (plan_lag 0, or no plan of the step before for these sequences), or the
        plan of the layer's step before for the same sequences (plan_lag 1)."""
        if not self.warmed_up:
            self.warm_up()
        lagged = None
        if self.plan_lag:
            lagged = self.lagged_plan(layer, seq_ids)  # the fused CUDA path's split, in one call
            if lagged is not None:
                self.launch_next(layer, seq_ids, store, q)
                return lagged
            before = self._lagged.get(layer)  # elsewhere a plan is computed at once, handed out a step later
            if before is not None and before[0] == tuple(seq_ids):
                lagged = before[1]
        bucket, cpu_len = self._stage(layer, seq_ids, store, q)
        self._launch(layer, bucket)
        self._last_layer = layer
        if self.cuda:
            # The one wait: the host builds the step's tasks from this plan (module docstring).
            self._done.record()
            self._done.synchronize()
        plan = self._plan(layer, seq_ids, bucket, cpu_len)
        if not self.plan_lag:
            return plan
        self._lagged[layer] = (tuple(seq_ids), plan)
        if lagged is None:
            return plan
        self.lagged_steps += 1
        return lagged

    def lagged_plan(self, layer: int, seq_ids: Sequence[int]) -> HeadPlan | None:
        """plan_lag 1 on the fused CUDA path: the plan the layer's step before made for the same
        sequences, or None (there is none: `__call__` plans the step from its own queries). A caller
        that runs its step on this plan calls `launch_next` once the step's token is in the window
        (the runtime: after the window part), so nothing of the planner comes before the step's
        tasks but reading this plan."""
        if not (self.plan_lag and self._fused is not None and self.cuda):
            return None
        if not self.warmed_up:
            self.warm_up()
        before = self._lagged.get(layer)
        if before is None or before[0] != tuple(seq_ids):
            return None
        plan = before[1]
        if not isinstance(plan, HeadPlan):
            plan = self._finish(layer, seq_ids, *plan)
            self._lagged[layer] = (before[0], plan)  # read once
        self.lagged_steps += 1
        return plan

    def launch_next(self, layer: int, seq_ids: Sequence[int], store: Any, q: torch.Tensor) -> None:
        """plan_lag 1 on the fused CUDA path: launch the plan of this step's queries `q [B, Hq, D]` and
        window (its token appended) for the layer's next step, and return without waiting for it:
        that step reads it (`lagged_plan`, `_finish`) after its event."""
        bucket, cpu_len = self._stage(layer, seq_ids, store, q)
        self._launch(layer, bucket)
        self._last_layer = layer
        event = self._free_events.pop() if self._free_events else torch.cuda.Event()
        event.record()
        self._in_flight[layer] = event
        self._lagged[layer] = (tuple(seq_ids), (bucket, cpu_len.copy()))

    def _finish(self, layer: int, seq_ids: Sequence[int], bucket: int, cpu_len: np.ndarray) -> HeadPlan:
        """The plan a replay the host did not wait for wrote into the layer's output rows."""
        self._await_in_flight(layer)
        return self._plan(layer, seq_ids, bucket, cpu_len)

    def _await_in_flight(self, layer: int) -> None:
        """Wait for the layer's replay the host did not wait for (plan_lag 1), if any: a step of
        this layer ago, long done in practice."""
        event = self._in_flight.pop(layer, None)
        if event is not None:
            event.synchronize()
            self._free_events.append(event)

    def settle(self) -> None:
        """Wait for the replays the host did not wait for (plan_lag 1); their plans stay for the next step."""
        for layer in list(self._in_flight):
            self._await_in_flight(layer)

    def _plan(self, layer: int, seq_ids: Sequence[int], bucket: int, cpu_len: np.ndarray) -> HeadPlan:
        """The plan of a step whose device part has finished, from the output in host memory."""
        b, hq = len(seq_ids), self.geometry.q_heads
        out = self._output(bucket, layer)
        n = bucket * hq
        if self._fused is not None:  # the plan's rows of the layer's pinned output, as views made once
            budgets, block_size = self._fused_plan_views[(layer, b)]
        else:
            budgets = out[3 * n : 3 * n + b * hq].reshape(b, hq)
            block_size = out[4 * n : 4 * n + b * self.geometry.kv_heads].reshape(b, -1)
        budgets = budgets.copy()  # the buffers are the next call's
        block_size = block_size.astype(np.int64)
        if self.on_selection is not None:  # the host selector on the same predictions, for reports
            pred = out[: 3 * n].reshape(3, bucket, hq)[:, :b]
            streaming = pred[2] if self.skip_streaming else self._no_streaming[self.buckets[-1]][:b]
            self.on_selection(layer, list(seq_ids), self.selector(pred[0], pred[1], streaming, cpu_len))
        return HeadPlan(block_size, budgets)

    def predictions(self, bucket: int, b: int) -> np.ndarray:
        """`[3, b, Hq]` (bgt0, k, p_streaming) of the last step run for `b` rows of `bucket` (host copy;
        on the fused path the bucket is `max_sequences`; with plan_lag 1 call `settle` first)."""
        n = bucket * self.geometry.q_heads
        return self._output(bucket, self._last_layer)[: 3 * n].reshape(3, bucket, -1)[:, :b]


__all__ = ["PATHS", "PredictedHeadPlanner", "batch_buckets", "network_linears"]
