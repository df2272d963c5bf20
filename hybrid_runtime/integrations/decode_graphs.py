"""A Llama-style model's decode step as CUDA graphs between the hybrid attention calls.

Run eagerly, a transformers decoder layer launches ~25 small kernels per token from Python
(norms, projections, rotary embedding, residuals, MLP) plus the model's mask and position work.
On the H200 host the 8B model's decode step without attention took 20-35 ms at batch 2-8
(`benchmarks/results/runs/e2e_decode-h200-ce92b90.md`, "no-attention step") against ~4 ms of weight reads:
that host time sits in every hybrid token's TPOT, beside the attention the runtime serves.

Here the work between two attention calls is one graph replay (vLLM's piecewise graphs, split at
attention): graph 0 embeds the step's tokens, makes the rotary cos/sin and layer 0's q, k, v;
graph l (1 <= l < L) is layer l-1's output projection, residual, post-attention norm, MLP and
residual, then layer l's input norm, projections and rotary embedding; graph L finishes the last
layer and applies the final norm. The attention itself stays eager (`attend(layer, q, k, v)`: the
hybrid runtime's `decode`, with its host work, CPU workers and waits). Its output is copied into
the next graph's input, in stream order, so a runtime that finishes a layer's output on the
device later (its merge behind a stream wait) is read when it is done.

Graphs are captured per batch size at the first decode step of that size (a generate call's
first decode step; the same model keeps them for later calls), after the runtime's background
warm-up has finished (its captures and module loads must not overlap ours), and share one memory
pool. With `capture=False` the same pieces run eagerly (the CPU path, and the tests' reference
for the restructured forward).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

# rope types whose cos/sin the model computes at construction: `dynamic` and `longrope` change
# their frequencies on the host as the sequence grows, which a replayed graph would not see.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", None)

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeGraphsUnsupported(ValueError):
    """The model's decoder layers do not have the structure the decode graphs replay."""


def _rope_type(config: Any) -> str | None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type")) if isinstance(params, dict) else None


@dataclass(eq=False)
class _Bucket:
    """One batch size's graphs and their static tensors (inputs written before a replay, outputs
    read after it; every one stays alive as long as the graphs that read or write it)."""

    batch: int
    input_ids: torch.Tensor  # [B, 1] int64
    position_ids: torch.Tensor  # [B, 1] int64
    attn_out: list[torch.Tensor] = field(default_factory=list)  # per layer [B, 1, Hq * D]: the attention's output
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer [B, H, 1, D]
    hidden: torch.Tensor | None = None  # [B, 1, hidden]: the final norm's output
    graphs: list[Any] = field(default_factory=list)  # L + 1 CUDA graphs (empty when not captured)


class DecodeGraphs:
    """The decode step of `model` (a transformers `*ForCausalLM` of Llama structure) in L + 1
    pieces around its attention; on CUDA each piece is a CUDA graph per batch size.

    `step(input_ids [B, 1], position_ids [B, 1], attend)` runs one token for the batch and returns
    the final norm's output `[B, 1, hidden]` (a static tensor: valid until the next step of that
    batch size). Raises `DecodeGraphsUnsupported` at construction for a model whose layers differ
    from the structure replayed here, before anything is captured.

    At most `max_batch_sizes` batch sizes are captured (each keeps L + 1 graphs and its static
    tensors for as long as this object lives); a later new size runs the same pieces eagerly
    (`eager_batch_sizes` lists them; a warning names the first), so a caller whose batch size
    keeps changing neither captures without end nor fails.
    """

    MAX_BATCH_SIZES = 32

    def __init__(self, model: torch.nn.Module, *, capture: bool = True,
                 before_capture: Callable[[], Any] | None = None, max_batch_sizes: int = MAX_BATCH_SIZES) -> None:
        """`before_capture`: called before each capture (the integration waits there for the
        runtime's background warm-up, whose captures and module loads must not overlap ours)."""
        if isinstance(max_batch_sizes, bool) or not isinstance(max_batch_sizes, int) or max_batch_sizes < 0:
            raise ValueError(f"max_batch_sizes is {max_batch_sizes!r}; expected an integer >= 0 (batch sizes "
                             "captured as graphs; later sizes run eagerly)")
        base = getattr(model, getattr(model, "base_model_prefix", "model"), None) or model
        missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if getattr(base, a, None) is None]
        if missing:
            raise DecodeGraphsUnsupported(f"{type(base).__name__} has no {missing}: decode graphs need a Llama-style "
                                          "base model (embed_tokens, layers, norm, rotary_emb)")
        for i, layer in enumerate(base.layers):
            attn = getattr(layer, "self_attn", None)
            need = [a for a in ("input_layernorm", "post_attention_layernorm", "mlp") if getattr(layer, a, None) is None]
            need += [f"self_attn.{a}" for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")
                     if getattr(attn, a, None) is None]
            if need:
                raise DecodeGraphsUnsupported(f"decoder layer {i} has no {need}; decode graphs replay Llama-style layers")
        if float(getattr(base.config, "embedding_multiplier", 1.0) or 1.0) != 1.0:
            raise DecodeGraphsUnsupported("the model scales its embeddings; decode graphs replay Llama-style models")
        hooked = [name for name, m in base.named_modules() if getattr(m, "_hf_hook", None) is not None]
        if hooked:
            raise DecodeGraphsUnsupported(
                f"modules {hooked[:3]}{' ...' if len(hooked) > 3 else ''} carry accelerate hooks (a device_map "
                "that offloads or splits the model): they move weights and activations at every call, which "
                "a replayed graph would skip")
        rope = _rope_type(base.config)
        if rope not in _STATIC_ROPE_TYPES:
            raise DecodeGraphsUnsupported(
                f"rope type {rope!r} recomputes its frequencies on the host as the sequence grows; decode graphs "
                f"need one of {[t for t in _STATIC_ROPE_TYPES if t]}")
        module = sys.modules.get(type(base.layers[0].self_attn).__module__)
        self._apply_rope = getattr(module, "apply_rotary_pos_emb", None)
        if self._apply_rope is None:
            raise DecodeGraphsUnsupported(f"{type(base.layers[0].self_attn).__module__} has no apply_rotary_pos_emb")
        self.base = base
        self.layers = list(base.layers)
        self.device = next(base.parameters()).device
        self.capture = bool(capture) and self.device.type == "cuda"
        self.before_capture = before_capture
        self.max_batch_sizes = max_batch_sizes
        self.eager_batch_sizes: list[int] = []  # sizes past the cap, run eagerly
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self.captures = 0  # batch sizes captured so far
        self.capture_s = 0.0  # seconds spent capturing

    # -- the pieces (the same modules and order as the transformers forward they replace)
    def _head(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer `layer`'s input norm, q/k/v projections and rotary embedding -> q, k, v `[B, H, 1, D]`."""
        attn = self.layers[layer].self_attn
        x = self.layers[layer].input_layernorm(h)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head norms before the transpose
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self._apply_rope(q, k, cos, sin)
        return q, k, v

    def _tail(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s output projection, residual, post-attention norm, MLP and residual."""
        lyr = self.layers[layer]
        h = h + lyr.self_attn.o_proj(attn_out)
        return h + lyr.mlp(lyr.post_attention_layernorm(h))

    def _first(self, b: _Bucket):
        h = self.base.embed_tokens(b.input_ids)
        cos, sin = self.base.rotary_emb(h, b.position_ids)
        return (h, cos, sin), self._head(0, h, cos, sin)

    def _middle(self, layer: int, b: _Bucket, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        h = self._tail(layer - 1, h, b.attn_out[layer - 1])
        return h, self._head(layer, h, cos, sin)

    def _last(self, b: _Bucket, h: torch.Tensor) -> torch.Tensor:
        return self.base.norm(self._tail(len(self.layers) - 1, h, b.attn_out[-1]))

    # -- buckets
    def _bucket(self, batch: int, dtype: torch.dtype) -> _Bucket:
        b = self._buckets.get(batch)
        if b is not None:
            return b
        attn = self.layers[0].self_attn
        width = int(attn.o_proj.in_features)
        dev = self.device
        b = _Bucket(batch, torch.zeros((batch, 1), dtype=torch.long, device=dev),
                    torch.zeros((batch, 1), dtype=torch.long, device=dev))
        b.attn_out = [torch.zeros((batch, 1, width), dtype=dtype, device=dev) for _ in self.layers]
        if self.capture and self.captures < self.max_batch_sizes:
            self._capture(b)
        elif self.capture:
            if not self.eager_batch_sizes:
                log.warning("decode graphs: %d batch sizes captured (max_batch_sizes); batch size %d and later new "
                            "sizes run the model's pieces eagerly", self.captures, batch)
            self.eager_batch_sizes.append(batch)
        self._buckets[batch] = b
        return b

    def _run_eager(self, b: _Bucket, attend: Attend | None) -> torch.Tensor:
        """Every piece in step order, launched one by one; with `attend`, each layer's attention
        output goes into the next piece's input (without it, that input stays as it is: warm-up)."""
        (h, cos, sin), qkv = self._first(b)
        n = len(self.layers)
        for layer in range(n):
            if attend is not None:
                b.attn_out[layer].copy_(attend(layer, *qkv).reshape(b.batch, 1, -1))
            if layer + 1 < n:
                h, qkv = self._middle(layer + 1, b, h, cos, sin)
        return self._last(b, h)

    def _capture(self, b: _Bucket) -> None:
        if self.before_capture is not None:
            self.before_capture()
        t0 = time.perf_counter()
        n = len(self.layers)
        # Warm-up on a side stream first (cuBLAS handles and workspaces, lazy module state), as
        # torch.cuda.graphs' documentation asks; then one capture per piece, in step order.
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run_eager(b, None)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graphs: list[Any] = []

        def captured(fn: Callable[[], Any]) -> Any:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                out = fn()
            graphs.append(g)
            return out

        (h, cos, sin), qkv = captured(lambda: self._first(b))
        b.qkv = [qkv]
        for layer in range(1, n):
            h, qkv = captured(lambda layer=layer, h=h: self._middle(layer, b, h, cos, sin))
            b.qkv.append(qkv)
        b.hidden = captured(lambda h=h: self._last(b, h))
        torch.cuda.current_stream(self.device).synchronize()
        b.graphs = graphs
        self.captures += 1
        self.capture_s += time.perf_counter() - t0

    # -- one token
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
        """One decode step of the batch: `input_ids`, `position_ids` `[B, 1]`; `attend(layer, q, k, v)`
        (q `[B, Hq, 1, D]`, k, v `[B, Hkv, 1, D]`, post-RoPE) returns the attention's output `[B, 1, Hq, D]`."""
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"decode graphs take one token per row: input_ids [B, 1], got {tuple(input_ids.shape)}")
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        batch = int(input_ids.shape[0])
        b = self._bucket(batch, self.base.embed_tokens.weight.dtype)
        b.input_ids.copy_(input_ids, non_blocking=True)
        b.position_ids.copy_(position_ids, non_blocking=True)
        if not b.graphs:  # eager: the same pieces, fresh tensors
            return self._run_eager(b, attend)
        n = len(self.layers)
        for layer in range(n):
            b.graphs[layer].replay()
            b.attn_out[layer].copy_(attend(layer, *b.qkv[layer]).reshape(batch, 1, -1))
        b.graphs[n].replay()
        return b.hidden

    def time_without_attention(self, batch: int, steps: int = 20) -> list[float]:
        """Milliseconds of `steps` decode steps of `batch` rows with every attention left out (the
        graphs replayed back to back, each layer's attention input as it is): the model's own step
        in this mode, for a floor. Needs CUDA and captures that batch size if it has not."""
        if not self.capture:
            raise RuntimeError("time_without_attention needs the CUDA graphs (a model on CUDA, capture=True)")
        b = self._bucket(batch, self.base.embed_tokens.weight.dtype)
        if not b.graphs:
            raise RuntimeError(f"batch size {batch} is past max_batch_sizes ({self.max_batch_sizes}) and runs "
                               "eagerly: no graphs to time")
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for g in b.graphs:
                g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times


__all__ = ["DecodeGraphs", "DecodeGraphsUnsupported"]
