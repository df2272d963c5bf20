"""Hugging Face transformers backend: `model.generate` of a Llama-style model decodes through `HybridRuntime`.

    rt = enable_hybrid_attention(model, cfg)    # validates, starts the runtime, switches the model
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    disable_hybrid_attention(model)             # the model is exactly as before; the runtime is closed

How it plugs in (transformers >= 5; the model's attention modules call `past_key_values.update` and
then the function registered in `AttentionInterface` under `config._attn_implementation`):

* `HybridCache` (a `Cache`) replaces `DynamicCache` in `generate`. It keeps no KV itself: its
  `update` only counts tokens and marks the layer for the attention function, returning the new
  key/value states unchanged -- so no whole-sequence KV is concatenated or copied per step.
* `hybrid_attention_forward` (registered as ``"hybrid_runtime"``) serves that layer:
  - prefill (the first forward through a cache layer): the model's own dense attention (sdpa or
    eager) over the prompt, then each sequence's real tokens (left padding stripped) are handed to
    `rt.prefill` as post-RoPE keys and values. A prompt in chunks (`prefill_chunk_size`, or any
    multi-token forward before the first one-token step) attends densely over the earlier chunks,
    read back from the runtime (`KVStore.full_kv` on the model's device), and appends
    (`rt.prefill(..., extend=True)`);
  - decode: one `rt.decode(layer, seq_ids, q, k, v)` per layer and step for the whole batch (the
    runtime appends k, v and attends over everything before plus the new token). Under
    `selection.name: sparda` with `sparda.lookahead` `forecast` or `proxy`, a forward pre-hook on
    every attention module keeps the layer's input (and its rotary cos/sin), from which the
    layer's decode also hands the runtime the next layer's selection queries (`lookahead=`): the
    trained Forecast of `sparda.checkpoint`, or the next layer's own query projection (the proxy).
  Called without a `HybridCache` (a plain `model(...)` forward, a user `DynamicCache`) it runs the
  model's own dense attention, so the switched model still computes what the original computes.
* The mask function registered under the same name is transformers' `sdpa_mask`, so prefill gets
  the causal + padding mask the dense kernel expects, and the padding of each sequence is read
  from it; except for a later prompt chunk without padding (`_causal_mask`), whose mask would be
  `[B, 1, chunk, past + chunk]` (16 GiB of booleans at 8 x 32K over 64K, and twice that once sdpa
  turns it into a bias): it is left out, and the dense attention runs causal aligned to the
  bottom right (`torch.nn.attention.bias.causal_lower_right`, flash attention on CUDA).
* The runtime owns its cores: from the first decode step of a `generate` call until it returns,
  torch runs only the intra-op threads the runtime's CPU workers leave cores for
  (`enable_hybrid_attention(..., decode_threads="auto")`); the prefill keeps every thread. Torch's
  threads would otherwise take the workers' cores and every decode step would wait for a worker
  to be scheduled (`benchmarks/hf_overhead.py` compares with plain `generate`). A warning says so
  when decoding runs with more threads anyway (`decode_threads=None` or a number above the free
  cores, or a loop of your own over `HybridCache` without `cores_for_runtime`).

Tensor parallelism (a model loaded with `tp_plan="auto"` under `torchrun`, or sharded the same
way by hand): q, k and v projections column-parallel give each rank a slice of the heads, and the
attention module sees only those (`[B, Hq / W, T, D]`). `enable_hybrid_attention` reads the
per-rank head counts from the projections' local weights (a DTensor's local shard) and the rank
from their device mesh (else `torch.distributed`), and builds the rank's own runtime over its heads
(`tensor_parallel.py`: its own store, workers and cores); the output projection's all-reduce stays
the model's.

Left padding keeps positions right without any help: `generate` derives `position_ids` from the
attention mask, RoPE is applied by the model before the cache sees the keys, and padded tokens
never reach the runtime, so decode needs no mask at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import itertools
import logging
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from hybrid_runtime.config import GEOMETRIES, Config, GeometryConfig, resolve_checkpoint
from hybrid_runtime.integrations.decode_graphs import DecodeGraphs, DecodeGraphsUnsupported
from hybrid_runtime.kvcache import CapacityError
from hybrid_runtime.pinning import torch_threads
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.tensor_parallel import TensorParallelShard

try:  # transformers is an optional dependency (extra `models`)
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hybrid_runtime.integrations.transformers needs transformers >= 5: "
        'pip install "hybrid-runtime[models]"'
    ) from exc

log = logging.getLogger(__name__)

#: The name under which the attention and mask functions are registered with transformers.
ATTN_IMPLEMENTATION = "hybrid_runtime"

#: Model types whose attention modules are known to follow the Llama pattern this backend serves:
#: q/k/v projections, RoPE applied before `past_key_values.update`, GQA, full causal attention,
#: and a call into `ALL_ATTENTION_FUNCTIONS` with `(module, q, k, v, mask, scaling=..., ...)`.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_DENSE_IMPLEMENTATIONS = ("sdpa", "eager")
_HEAD_DIMS = (16, 32, 64, 128, 256)  # what GeometryConfig.head_dim allows


class UnsupportedModelError(ValueError):
    """The model cannot be served by the hybrid runtime (architecture, attention variant, settings)."""


# ---------------------------------------------------------------------------- per-model state
@dataclass(eq=False)
class _HybridState:
    """Everything `enable_hybrid_attention` set up for one model, and what it must restore."""

    runtime: HybridRuntime
    geometry: GeometryConfig  # the whole model's; under tensor parallelism the runtime serves the rank's share
    attn_modules: list  # weak references to the model's attention modules (no cycle through the registry)
    dense_impl: str  # the model's own implementation: "sdpa" or "eager"
    eager_fn: Callable | None
    saved_attn_implementation: Any
    saved_prepare_cache: Any  # instance attribute `_prepare_cache_for_generation` before, or _MISSING
    saved_generate: Any  # instance attribute `generate` before, or _MISSING
    decode_threads: int | str | None  # torch threads from a generate call's first decode step: "auto", a count, None
    generate_threads: int = 0  # torch's thread count when the current generate call began; 0: none under way
    model_ref: Any = None
    seq_counter: Any = field(default_factory=itertools.count)
    owns_runtime: bool = True
    enabled: bool = True  # False once disable_hybrid_attention ran: caches made under it refuse use
    # SparDA: where the next layer's selection queries come from (`queries(layer, x, cos, sin)`), and
    # the pre-hooks that keep each attention module's input for it.
    lookahead: Any = None
    hooks: list = field(default_factory=list)
    # `enable_hybrid_attention(decode_graphs=...)` when on: the decode step between attentions as
    # CUDA graphs (`decode_graphs.DecodeGraphs`), served from the base model's patched `forward`.
    decode_graphs: Any = None
    base_model: Any = None  # weak reference to the base model whose `forward` was patched
    saved_base_forward: Any = None  # its instance attribute `forward` before, or _MISSING


_MISSING = object()
# Model -> state, and attention module -> state (to find the model's dense attention in fallbacks).
_MODEL_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, _HybridState]" = weakref.WeakKeyDictionary()
_ATTN_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, _HybridState]" = weakref.WeakKeyDictionary()
# The layer a `HybridCache.update` just marked: `(cache, layer_idx)`. The model calls the attention
# function right after `update`, in the same thread, so a thread-local hand-off is enough.
_PENDING = threading.local()
# SparDA: the attention module last entered and its input `(module, hidden_states, cos, sin)`,
# set by the pre-hook and read by the same module's attention function, in the same thread.
_ATTN_INPUT = threading.local()


# ---------------------------------------------------------------------------- validation
def model_geometry(model: torch.nn.Module) -> GeometryConfig:
    """The attention geometry of a transformers model (layers, q heads, KV heads, head dim)."""
    cfg = model.config
    n_q = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_q)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    dims = (int(cfg.num_hidden_layers), n_q, n_kv, int(head_dim))
    # A reference geometry with the same shape lends its name (reports then say "smollm2-135m").
    name = next((g.name for g in GEOMETRIES.values() if (g.layers, g.q_heads, g.kv_heads, g.head_dim) == dims),
                str(getattr(cfg, "model_type", None) or "model"))
    return GeometryConfig(name, *dims)


def _attention_modules(model: torch.nn.Module) -> list:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None) or model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no decoder layers found at `{getattr(model, 'base_model_prefix', 'model')}.layers`; "
            f"the hybrid backend serves decoder-only models of types {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    mods = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        missing = [a for a in ("layer_idx", "head_dim", "num_key_value_groups", "scaling") if not hasattr(attn, a)]
        if attn is None or missing:
            raise UnsupportedModelError(
                f"{type(model).__name__}: layer {i} has no Llama-style `self_attn` (missing {missing or ['self_attn']}); "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if attn.layer_idx != i:
            raise UnsupportedModelError(f"{type(model).__name__}: layer {i} has attention layer_idx {attn.layer_idx}")
        if getattr(attn, "sliding_window", None) is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: layer {i} uses sliding-window attention (window {attn.sliding_window}); "
                "the hybrid runtime serves full causal attention only"
            )
        if not getattr(attn, "is_causal", True):
            raise UnsupportedModelError(f"{type(model).__name__}: layer {i} attention is not causal")
        mods.append(attn)
    return mods


def _check_model(model: torch.nn.Module) -> tuple[list, str, GeometryConfig]:
    """Every reason the backend cannot serve `model`, raised before anything changes."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "generate"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers generative model")
    if _MODEL_STATES.get(model) is not None:
        raise ValueError("hybrid attention is already enabled on this model; call disable_hybrid_attention first")
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {mtype!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(decoder-only, RoPE, GQA, full causal attention)"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{mtype}: encoder-decoder models are not supported")
    if getattr(cfg, "sliding_window", None) is not None:
        raise UnsupportedModelError(
            f"{mtype}: config.sliding_window={cfg.sliding_window}; the hybrid runtime serves full causal attention "
            "only (set sliding_window=None, or use_sliding_window=False where the model has it, if that is what you want)"
        )
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types) - {"full_attention"})
        raise UnsupportedModelError(f"{mtype}: layers of type {kinds}; only full_attention layers are supported")
    for attr in ("attention_chunk_size", "attn_logit_softcapping"):
        if getattr(cfg, attr, None) is not None:
            raise UnsupportedModelError(f"{mtype}: config.{attr}={getattr(cfg, attr)} is not supported")
    impl = cfg._attn_implementation
    if impl not in _DENSE_IMPLEMENTATIONS:
        raise UnsupportedModelError(
            f"the model's attention implementation is {impl!r}; the hybrid backend runs the prefill with the "
            f"model's own dense attention and supports {', '.join(map(repr, _DENSE_IMPLEMENTATIONS))}: load the "
            "model with attn_implementation='sdpa' (or 'eager')"
        )
    if hasattr(type(model), "_can_set_attn_implementation") and not type(model)._can_set_attn_implementation():
        raise UnsupportedModelError(f"{type(model).__name__} does not dispatch attention through AttentionInterface")
    geometry = model_geometry(model)
    if geometry.q_heads % geometry.kv_heads:
        raise UnsupportedModelError(f"{geometry.q_heads} query heads are not a multiple of {geometry.kv_heads} KV heads")
    if geometry.head_dim not in _HEAD_DIMS:
        raise UnsupportedModelError(f"head_dim {geometry.head_dim} is not supported; allowed: {list(_HEAD_DIMS)}")
    mods = _attention_modules(model)
    if len(mods) != geometry.layers:
        raise UnsupportedModelError(f"config says {geometry.layers} layers but the model has {len(mods)}")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UnsupportedModelError("the model has parameters on the meta device; load its weights first")
    return mods, impl, geometry


def _check_geometry(cfg: Config, geometry: GeometryConfig) -> None:
    """`cfg.geometry` left at its default is replaced by the model's; a named one must match it."""
    g = cfg.geometry
    if g == GeometryConfig():
        return
    ours = (g.layers, g.q_heads, g.kv_heads, g.head_dim)
    theirs = (geometry.layers, geometry.q_heads, geometry.kv_heads, geometry.head_dim)
    if ours != theirs:
        raise ValueError(
            f"geometry: cfg.geometry {g.name!r} has (layers, q_heads, kv_heads, head_dim) = {ours} but the model has "
            f"{theirs}; leave geometry unset to take the model's"
        )


def _local_rows(linear: Any) -> int | None:
    """Output rows of a projection's weight held by this process: a DTensor's local shard (a
    `tp_plan` model), else the weight itself (unsharded, or sharded by hand); None without one."""
    w = getattr(linear, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    to_local = getattr(w, "to_local", None)
    return int((to_local() if callable(to_local) else w).shape[0])


def tensor_parallel_of(model: torch.nn.Module, mods: list | None = None) -> TensorParallelShard | None:
    """The tensor-parallel shard `model`'s attention serves on this process, or None when every
    attention module holds all of the model's heads.

    The per-rank head counts are the q and k projections' local output rows over the head dim
    (identical on every layer); the rank and world size come from the projections' device mesh
    (a `tp_plan` model's DTensors), else from `torch.distributed`. Where the projections cannot
    tell, transformers' `_tp_size` splits the config's heads. Raises `UnsupportedModelError` for a
    split that does not give every rank whole KV heads and their query heads.
    """
    geometry = model_geometry(model)
    mods = _attention_modules(model) if mods is None else mods
    counts, mesh = set(), None
    for m in mods:
        rows = [_local_rows(getattr(m, name, None)) for name in ("q_proj", "k_proj", "v_proj")]
        if None in rows:
            counts = set()
            break
        q, k, v = (r // geometry.head_dim for r in rows)
        if any(r % geometry.head_dim for r in rows) or k != v:
            raise UnsupportedModelError(
                f"layer {m.layer_idx}: the q/k/v projections hold {rows} output rows here, not whole heads of "
                f"{geometry.head_dim} with as many keys as values; a tensor-parallel plan must split by heads")
        counts.add((q, k))
        mesh = mesh or getattr(getattr(m.q_proj, "weight", None), "device_mesh", None)
    if len(counts) > 1:
        raise UnsupportedModelError(f"the attention layers hold different head counts here (query, KV): {sorted(counts)}")
    tp_size = getattr(model, "_tp_size", None) or 1
    q, k = counts.pop() if counts else (geometry.q_heads // tp_size, geometry.kv_heads // tp_size)
    if (q, k) == (geometry.q_heads, geometry.kv_heads):
        return None
    world = geometry.kv_heads // k if k else 0
    if not k or k * world != geometry.kv_heads or q * world != geometry.q_heads:
        raise UnsupportedModelError(
            f"this rank's attention holds {q} of {geometry.q_heads} query heads and {k} of {geometry.kv_heads} KV heads: "
            "not an even split by KV groups; the hybrid runtime serves tensor parallelism whose world size divides "
            "the KV heads (each rank whole KV heads and their query heads)")
    if mesh is not None and mesh.ndim == 1:
        rank, size = mesh.get_local_rank(), mesh.size()
        import torch.distributed as dist

        if dist.get_world_size() == size:
            shard = TensorParallelShard.from_process_group()
            shard = TensorParallelShard(rank, size, shard.local_rank, shard.local_world_size)
        else:
            shard = TensorParallelShard(rank, size)
    else:
        try:
            shard = TensorParallelShard.from_process_group()
        except RuntimeError as exc:
            raise UnsupportedModelError(
                f"the attention holds {q} of {geometry.q_heads} query heads (a tensor-parallel shard) but {exc}") from None
    if shard.world_size != world:
        raise UnsupportedModelError(
            f"the attention holds 1/{world} of the heads but the process group has {shard.world_size} ranks; pass "
            "enable_hybrid_attention(..., tensor_parallel=TensorParallelShard(rank, world_size)) for a sub-group")
    return shard


# ---------------------------------------------------------------------------- enable / disable
def enable_hybrid_attention(
    model: torch.nn.Module,
    cfg: Config,
    runtime: HybridRuntime | None = None,
    *,
    decode_threads: int | str | None = "auto",
    tensor_parallel: TensorParallelShard | str | None = "auto",
    decode_graphs: bool | str = "auto",
) -> HybridRuntime:
    """Make `model.generate` decode through a `HybridRuntime`; returns the runtime.

    `cfg` configures the runtime (KV store dtype and window, selection, scheduler); its geometry is
    taken from the model. Pass `runtime` to use one you made (its geometry must match; it is then
    not closed by `disable_hybrid_attention`). `decode_threads`: torch's intra-op threads from a
    `generate` call's first decode step until it returns (the prefill keeps torch's setting):
    "auto" the cores the runtime's CPU workers leave (`CorePlan.torch_threads`; never more than
    torch had), a number exactly that many, None leaves torch's setting alone.
    `tensor_parallel`: "auto" detects a model sharded over ranks by heads (`tensor_parallel_of`)
    and serves this rank's heads; a `TensorParallelShard` says which rank this is (a sub-group);
    None serves the attention modules as the whole model. `decode_graphs`: a decode step's work
    between two attention calls (norms, projections, rotary embedding, MLP, residuals) runs as one
    CUDA graph replay per layer, captured per batch size at the first decode step of that size
    (`decode_graphs.py`; ~0.1 s at 8B geometry). "auto" (default): on a model on CUDA where they
    apply (not under tensor parallelism or SparDA's lookahead, a Llama-style layer structure, a
    rope computed at construction, no accelerate hooks), else the model's own forward; True:
    always (refused where they do not apply; on a model on the CPU the same pieces run eagerly);
    False: never. Parameters replaced after the first decode step (rather than updated in place)
    are not seen by graphs already captured. Raises `UnsupportedModelError` for a model it cannot
    serve, before anything changes.
    """
    count = isinstance(decode_threads, int) and not isinstance(decode_threads, bool)
    if not (decode_threads in ("auto", None) or (count and decode_threads >= 1)):
        raise ValueError(f"decode_threads is {decode_threads!r}; allowed: 'auto', None or an integer >= 1")
    if not (tensor_parallel in ("auto", None) or isinstance(tensor_parallel, TensorParallelShard)):
        raise ValueError(f"tensor_parallel is {tensor_parallel!r}; allowed: 'auto', None or a TensorParallelShard")
    if not (isinstance(decode_graphs, bool) or decode_graphs == "auto"):
        raise ValueError(f"decode_graphs is {decode_graphs!r}; allowed: 'auto', True or False")
    mods, impl, geometry = _check_model(model)
    shard = tensor_parallel_of(model, mods) if tensor_parallel == "auto" else tensor_parallel
    if shard is not None:
        shard.local_geometry(geometry)  # heads that do not divide: refused before anything is built
    graphs = None
    if decode_graphs is True:
        if shard is not None:
            raise UnsupportedModelError("decode_graphs under tensor parallelism: the output projection's all-reduce "
                                        "would run inside the graphs; allowed here: decode_graphs=False or 'auto'")
        try:
            graphs = DecodeGraphs(model)
        except DecodeGraphsUnsupported as exc:
            raise UnsupportedModelError(f"decode_graphs: {exc}") from None
    elif decode_graphs == "auto" and shard is None and next(model.parameters()).device.type == "cuda":
        try:
            graphs = DecodeGraphs(model)
        except DecodeGraphsUnsupported as exc:
            log.info("decode graphs off for this model: %s", exc)
    eager_fn = getattr(sys.modules.get(type(mods[0]).__module__), "eager_attention_forward", None)
    if impl == "eager" and eager_fn is None:  # pragma: no cover - every supported type has one
        raise UnsupportedModelError(f"{type(mods[0]).__module__} has no eager_attention_forward")
    if runtime is None:
        _check_geometry(cfg, geometry)
        # The runtime's config carries the model's geometry so every report names what was served.
        runtime = HybridRuntime(dataclasses.replace(cfg, geometry=geometry), geometry=geometry, tensor_parallel=shard)
        owns = True
    else:
        g, want = runtime.geometry, geometry if shard is None else shard.local_geometry(geometry)
        if (g.layers, g.q_heads, g.kv_heads, g.head_dim) != (want.layers, want.q_heads, want.kv_heads, want.head_dim):
            raise ValueError(f"runtime geometry {g} does not match the {'rank' if shard else 'model'}'s {want}")
        owns = False
    try:
        lookahead = _lookahead_source(runtime, mods, geometry, model)
        if graphs is not None and lookahead is not None and decode_graphs == "auto":
            graphs = None  # the lookahead needs each attention module's input: the model's own forward
        elif graphs is not None and lookahead is not None:
            raise UnsupportedModelError(
                f"decode_graphs with sparda.lookahead {runtime.cfg.sparda.lookahead!r}: the next layer's selection "
                "queries come from each attention module's input, which the graphs do not hand out; allowed: "
                "decode_graphs=False or 'auto', or sparda.lookahead same_layer")
    except BaseException:
        if owns:
            runtime.close()
        raise
    if graphs is not None:
        graphs.before_capture = runtime.await_warm_up  # its background captures finish before ours begin
    _register()
    state = _HybridState(
        runtime=runtime,
        geometry=geometry,
        attn_modules=[weakref.ref(m) for m in mods],
        dense_impl=impl,
        eager_fn=eager_fn,
        saved_attn_implementation=model.config._attn_implementation_internal,
        saved_prepare_cache=model.__dict__.get("_prepare_cache_for_generation", _MISSING),
        saved_generate=model.__dict__.get("generate", _MISSING),
        decode_threads=decode_threads,
        model_ref=weakref.ref(model),
        owns_runtime=owns,
        lookahead=lookahead,
        decode_graphs=graphs,
    )
    if lookahead is not None:
        state.hooks = [m.register_forward_pre_hook(_keep_attention_input, with_kwargs=True) for m in mods]
    # From here on the model changes; nothing below can fail on a validated model.
    _MODEL_STATES[model] = state
    for m in mods:
        _ATTN_STATES[m] = state
    # LlamaForCausalLM and its LlamaModel share one config object: one assignment switches both.
    model.config._attn_implementation_internal = ATTN_IMPLEMENTATION
    model._prepare_cache_for_generation = _make_prepare_cache(model)
    model.generate = _make_generate(model)
    if graphs is not None:
        state.base_model = weakref.ref(graphs.base)
        state.saved_base_forward = graphs.base.__dict__.get("forward", _MISSING)
        graphs.base.forward = _make_graphed_forward(graphs.base, state)
    return runtime


def disable_hybrid_attention(model: torch.nn.Module) -> None:
    """Undo `enable_hybrid_attention`: the model's attention, config and attributes are as before.

    Closes the runtime when `enable_hybrid_attention` made it. Caches made while enabled become
    unusable: any later use raises RuntimeError (their sequences are released with the runtime).
    """
    state = _MODEL_STATES.pop(model, None)
    if state is None:
        raise ValueError("hybrid attention is not enabled on this model")
    state.enabled = False  # its HybridCaches raise from now on (HybridCache._check_usable)
    for ref in state.attn_modules:
        m = ref()
        if m is not None:
            _ATTN_STATES.pop(m, None)
    model.config._attn_implementation_internal = state.saved_attn_implementation
    for handle in state.hooks:
        handle.remove()
    base = state.base_model() if state.base_model is not None else None
    if base is not None:
        if state.saved_base_forward is _MISSING:
            base.__dict__.pop("forward", None)
        else:
            base.__dict__["forward"] = state.saved_base_forward
    state.decode_graphs = None  # its graphs and static tensors go with it
    for name, saved in (("_prepare_cache_for_generation", state.saved_prepare_cache),
                        ("generate", state.saved_generate)):
        if saved is _MISSING:
            model.__dict__.pop(name, None)
        else:
            model.__dict__[name] = saved
    if state.owns_runtime:
        state.runtime.close()


def _lookahead_source(runtime: HybridRuntime, mods: list, geometry: GeometryConfig, model: torch.nn.Module) -> Any:
    """SparDA's next-layer selection queries for this model (None unless `sparda.lookahead` is
    forecast or proxy); a Forecast checkpoint must serve this model's geometry."""
    from forecast.model import ForecastQueries, ProxyQueries

    cfg = runtime.cfg
    if runtime.sparda is None or cfg.sparda.lookahead == "same_layer":
        return None
    if runtime.geometry.kv_heads != geometry.kv_heads:
        raise UnsupportedModelError(
            f"sparda.lookahead {cfg.sparda.lookahead!r} under tensor parallelism: its next-layer queries come from the "
            "whole model's heads; allowed here: sparda.lookahead same_layer")
    if cfg.sparda.lookahead == "proxy":
        return ProxyQueries.from_attention_modules(mods)
    path = resolve_checkpoint(cfg.sparda.checkpoint)
    if path is None:
        raise ValueError(f"sparda.checkpoint: {cfg.sparda.checkpoint!r} is not a file; allowed: a Forecast checkpoint "
                         "written by python -m forecast.train")
    device = next(model.parameters()).device
    fq = ForecastQueries.load(path, device=device)
    d_model = int(model.config.hidden_size)
    ours = (fq.layers, fq.d_model, fq.kv_heads, fq.head_dim)
    theirs = (geometry.layers, d_model, geometry.kv_heads, geometry.head_dim)
    if ours != theirs:
        raise UnsupportedModelError(
            f"sparda.checkpoint {cfg.sparda.checkpoint!r} serves (layers, d_model, kv_heads, head_dim) = {ours} but the "
            f"model has {theirs}; allowed: a Forecast trained for this model (python -m forecast.train), or "
            "sparda.lookahead: proxy")
    return fq


def _keep_attention_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an attention module: its input and rotary cos/sin, for SparDA's lookahead."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cos, sin = kwargs.get("position_embeddings") or args[1]
    _ATTN_INPUT.value = (module, hidden, cos, sin)


def hybrid_runtime_of(model: torch.nn.Module) -> HybridRuntime | None:
    """The runtime serving `model`, or None when hybrid attention is not enabled on it."""
    state = _MODEL_STATES.get(model)
    return state.runtime if state is not None else None


def decode_graphs_of(model: torch.nn.Module) -> DecodeGraphs | None:
    """The decode graphs serving `model` (`enable_hybrid_attention(decode_graphs=...)`), or None when
    its decode steps run the model's own forward or hybrid attention is not enabled on it."""
    state = _MODEL_STATES.get(model)
    return state.decode_graphs if state is not None else None


_warned_contention = False


def _warn_contention(runtime: HybridRuntime) -> None:
    """Once per process, when a decode step on the CPU starts with more torch threads than the
    cores the runtime's workers leave: the user's settings make them compete."""
    global _warned_contention
    free, workers = runtime.scheduler.cores.torch_threads, runtime.scheduler.n_cpu
    if _warned_contention or not workers or torch.get_num_threads() <= free:
        return
    _warned_contention = True
    log.warning(
        "decoding on the CPU with %d torch intra-op threads beside the runtime's %d CPU workers, which leave %d "
        "core(s): torch's threads take the workers' cores and every decode step waits for a worker to be "
        "scheduled; decode through generate with enable_hybrid_attention(..., decode_threads='auto') (the default), "
        "or wrap your own loop in `with cores_for_runtime(rt):`",
        torch.get_num_threads(), workers, free,
    )


@contextlib.contextmanager
def cores_for_runtime(runtime: HybridRuntime) -> Iterator[int]:
    """Within the block torch uses only the cores the runtime's CPU workers leave free; yields that count.

    For a decode loop of your own over a model computed on the CPU (`generate` does this itself
    from its first decode step): torch's intra-op threads otherwise compete with the workers for
    cores, and every decode step waits for a worker to be scheduled. Restored on exit.
    """
    with torch_threads(runtime.scheduler.cores.torch_threads) as n:
        yield n


def _make_generate(model: torch.nn.Module) -> Callable:
    """`generate` bound to the instance: torch's thread count is restored when it returns (its
    decode steps lower it to `decode_threads`, see `HybridCache._own_cores`)."""
    original = type(model).generate
    model_ref = weakref.ref(model)  # no reference cycle model -> closure -> model

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        m = model_ref()
        state = _MODEL_STATES.get(m)
        saved = torch.get_num_threads()
        outer = state is not None and not state.generate_threads
        if outer:
            state.generate_threads = saved
        try:
            return original(m, *args, **kwargs)
        finally:
            if outer:
                state.generate_threads = 0
            torch.set_num_threads(saved)

    return generate


def _make_graphed_forward(base: torch.nn.Module, state: _HybridState) -> Callable:
    """The base model's `forward` under `decode_graphs`: a one-token step through a prefilled
    `HybridCache` runs `DecodeGraphs.step`; every other call (prefill, a plain forward, another
    cache, hidden states or attentions asked for) the model's own forward."""
    # Its own forward: an instance attribute set before (a wrapper of the caller's), else the class's.
    original = base.__dict__.get("forward") or type(base).forward.__get__(base)
    fields = BaseModelOutputWithPast.__dataclass_fields__
    cache_field = "cache" if "cache" in fields else "past_key_values"

    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids")
        if (args or not isinstance(cache, HybridCache) or cache._state is not state or ids is None
                or kwargs.get("inputs_embeds") is not None or ids.dim() != 2 or ids.shape[1] != 1
                or not cache.seq_ids or ids.shape[0] != len(cache.seq_ids)
                or not all(layer.prefilled for layer in cache.layers)
                or kwargs.get("output_hidden_states") or kwargs.get("output_attentions")):
            return original(*args, **kwargs)
        cache._check_usable()
        positions = kwargs.get("position_ids")
        if positions is None:  # as the model's forward: the tokens seen so far (padding included)
            positions = torch.full_like(ids, cache.get_seq_length())
        hidden = state.decode_graphs.step(ids, positions, cache._graph_attend)
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{cache_field: cache})

    return forward


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which this transformers passes the KV cache to `forward` and keeps it in
    `generate`'s model kwargs: `cache` from transformers 5.24 on (where `past_key_values` is a
    deprecated alias that `generate`'s chunked prefill does not read), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _make_prepare_cache(model: torch.nn.Module) -> Callable:
    """`generate`'s cache set-up, bound to the instance: a `HybridCache` where it would make a `DynamicCache`."""
    original = type(model)._prepare_cache_for_generation
    model_ref = weakref.ref(model)  # no reference cycle model -> closure -> model

    def _prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs):
        m = model_ref()
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if user_cache is None and generation_config.use_cache is not False:
            if getattr(generation_config, "num_beams", 1) > 1:
                raise NotImplementedError(
                    "beam search reorders the KV cache every step; the hybrid runtime does not support it "
                    "(use greedy or sampling, or disable_hybrid_attention first)"
                )
            if generation_config.cache_implementation not in (None, "dynamic"):
                raise ValueError(
                    f"cache_implementation={generation_config.cache_implementation!r} conflicts with hybrid attention, "
                    "which brings its own cache; leave cache_implementation unset"
                )
            model_kwargs[cache_kwarg(m)] = HybridCache(m)
            return None
        return original(m, generation_config, model_kwargs, *args, **kwargs)

    return _prepare_cache_for_generation


_registered = False


def _register() -> None:
    """Register the attention and mask functions with transformers once per process."""
    global _registered
    if _registered:
        return
    ALL_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, hybrid_attention_forward)
    # sdpa's boolean mask (None when it is plain causal): the dense prefill and the padding of
    # each sequence are read from it; the eager path converts it.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _causal_mask)
    _registered = True


def _causal_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """`sdpa_mask`, but None for a padding-free causal chunk whose queries are the last keys'
    positions (a later prompt chunk): `_dense` attends it causally aligned to the bottom right, so
    no `[B, 1, chunk, past + chunk]` mask is made. Reads the query positions from `q_length` /
    `q_offset` or from `cache_position`, whichever this transformers passes; anything else (a
    sliding window, another mask pattern, padding, positional arguments) goes to `sdpa_mask`."""
    from transformers.masking_utils import causal_mask_function

    if not args and kwargs.get("local_size") is None and kwargs.get("mask_function", causal_mask_function) is causal_mask_function:
        kv_length, kv_offset = kwargs.get("kv_length"), kwargs.get("kv_offset", 0)
        if "q_length" in kwargs:
            q_length, q_offset = kwargs["q_length"], kwargs.get("q_offset", 0)
        elif isinstance(kwargs.get("cache_position"), torch.Tensor) and kwargs["cache_position"].dim() == 1:
            positions = kwargs["cache_position"]
            q_length = positions.shape[0]
            q_offset = int(positions[0]) if q_length else 0
            if q_length and int(positions[-1]) - q_offset != q_length - 1:
                q_length = None  # not one contiguous run of positions
        else:
            q_length = None
        padding = kwargs.get("attention_mask")
        if (isinstance(q_length, int) and isinstance(kv_length, int) and isinstance(q_offset, int)
                and 1 < q_length < kv_length and q_offset + q_length == kv_offset + kv_length
                and (padding is None or bool(padding.all()))):
            return None
    return sdpa_mask(*args, **kwargs)


def _causal_with_past(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention of a chunk's `query [B, Hq, T, D]` over `key, value [B, Hkv, past + T, D]`, the
    queries being the last T positions; the output as `sdpa_attention_forward` returns it."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(query.shape[2], key.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, dropout_p=dropout if module.training else 0.0, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------- the attention function
def _dense(
    state: _HybridState | None,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own dense attention, given the boolean mask (or None) of `sdpa_mask`."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if state is None or state.dense_impl == "sdpa":
        if attention_mask is None and 1 < q_len < kv_len:  # `_causal_mask` left a later chunk's mask out
            return _causal_with_past(module, query, key, value, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is None and q_len > 1:
        # sdpa_mask skips a plain causal mask (sdpa's is_causal covers it); eager needs it written out.
        rows = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        attention_mask = (torch.arange(kv_len, device=query.device)[None, :] <= rows)[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # What transformers' eager_mask makes from the same boolean mask.
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    return state.eager_fn(module, query, key, value, attention_mask, **kwargs)


def hybrid_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`AttentionInterface` entry: q `[B,Hq,T,D]`, k/v `[B,Hkv,T,D]` -> (out `[B,T,Hq,D]`, None)."""
    pending = getattr(_PENDING, "entry", None)
    _PENDING.entry = None
    state = _ATTN_STATES.get(module)
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedModelError(f"layer {getattr(module, 'layer_idx', '?')}: sliding-window attention is not supported")
    if pending is None or pending[0]._state is not state or pending[1] != module.layer_idx:
        # Not driven by a HybridCache (plain forward, DynamicCache): exactly the model's attention.
        return _dense(state, module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    cache, layer = pending
    return cache._attend(module, layer, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


# ---------------------------------------------------------------------------- the cache
class _HybridLayer(CacheLayerMixin):
    """Length bookkeeping of one layer; the KV itself lives in the runtime's store."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0  # tokens seen, padding included (what transformers sizes masks by)
        self.prefilled = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a HybridCache cannot be reset; make a new one (generate does)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported with hybrid attention")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("cropping (assisted decoding) is not supported with hybrid attention")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            raise NotImplementedError("a prefilled HybridCache cannot be expanded along the batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("batch selection is not supported with hybrid attention")

    def offload(self) -> None:  # the runtime decides where KV lives
        return None

    def prefetch(self) -> None:
        return None


def _release_sequences(runtime: HybridRuntime, seq_ids: list) -> None:
    """Free a cache's sequences in the runtime (finalizer: runs when the cache is collected)."""
    if not getattr(runtime, "_closed", False):
        for s in seq_ids:
            try:
                runtime.release(s)
            except (KeyError, RuntimeError):
                pass
    seq_ids.clear()


class HybridCache(Cache):
    """A transformers `Cache` whose KV lives in the model's `HybridRuntime`.

    `generate` makes one per call once `enable_hybrid_attention` was called; make one yourself
    to drive `model(...)` step by step (`past_key_values=cache`). Each batch row becomes one
    runtime sequence at the first forward; the sequences are released by `release()` or when
    the cache is garbage-collected. Batch rows must be left-padded.
    """

    def __init__(self, model: torch.nn.Module):
        state = _MODEL_STATES.get(model)
        if state is None:
            raise ValueError("call enable_hybrid_attention(model, cfg) before making a HybridCache")
        super().__init__(layers=[_HybridLayer() for _ in range(state.geometry.layers)])
        self._state = state
        self.runtime = state.runtime
        self.seq_ids: list[int] = []
        self._real_lengths: list[int] | None = None  # prompt tokens per row, padding excluded
        self._decoding = False  # set by the first one-token step: later multi-token steps decode token by token
        self._finalizer = weakref.finalize(self, _release_sequences, self.runtime, self.seq_ids)

    # -- transformers entry points
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Count the tokens and mark the layer for `hybrid_attention_forward`, which does the work.

        Returns the new states unchanged: during prefill the dense attention needs exactly these;
        during decode the runtime already holds everything before them.
        """
        self._check_usable()
        keys, values = self.layers[layer_idx].update(key_states, value_states)
        _PENDING.entry = (self, layer_idx)
        return keys, values

    def _check_usable(self) -> None:
        """Refuse a cache whose hybrid attention was disabled: it holds no KV of its own, so the
        model's dense attention would attend over the new tokens only (wrong logits, silently)."""
        if not self._state.enabled:
            raise RuntimeError(
                "this HybridCache was made while hybrid attention was enabled on the model, and "
                "disable_hybrid_attention has since been called: the cache holds no KV itself and its sequences "
                "are gone with the runtime, so it cannot be used any more; make a new cache (HybridCache(model) "
                "after enable_hybrid_attention, or a transformers DynamicCache for the dense model) and prefill again"
            )

    def release(self) -> None:
        """Free this cache's sequences in the runtime now (also done when the cache is collected)."""
        _release_sequences(self.runtime, self.seq_ids)

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids) if self.seq_ids else -1

    # -- prefill
    def _allocate(self, real_lengths: list[int], whole_prompt: bool = True) -> None:
        """Reserve one runtime sequence per batch row (checks capacity before any state changes).

        With `whole_prompt` false (a forward that may be the first chunk of a prompt) a row may
        have no real token yet; the first decode step checks that every row got one.
        """
        rt = self.runtime
        b = len(real_lengths)
        if whole_prompt and any(n < 1 for n in real_lengths):
            raise ValueError(f"every batch row needs at least one real (unpadded) token; got lengths {real_lengths}")
        limit = rt.store.cfg.max_sequences
        if len(rt.store.sequences()) + b > limit:
            gc.collect()  # finished generate() caches nobody holds free their sequences when collected
        if len(rt.store.sequences()) + b > limit:
            raise CapacityError(
                f"batch of {b} needs {b} runtime sequences but {len(rt.store.sequences())} of "
                f"kv_cache.max_sequences={limit} are in use; release caches (HybridCache.release) or raise max_sequences"
            )
        self.seq_ids.extend(next(self._state.seq_counter) for _ in range(b))
        self._real_lengths = list(real_lengths)

    def _prefill_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
                       last_query: torch.Tensor | None = None) -> None:
        """Hand one layer's prompt KV `[B,Hkv,T,D]` to the runtime, real tokens only (left padding);
        a row the layer already holds tokens of gets them appended (a later chunk of its prompt).
        `last_query [B, Hq, D]`: each row's query of its last token, in the runtime's scaling (the
        `predicted` policy caches prefill statistics from it)."""
        rt = self.runtime
        t = key.shape[2]
        for b, (s, n) in enumerate(zip(self.seq_ids, lengths)):
            if n:
                k_b = key[b, :, t - n :].transpose(0, 1)  # [n, Hkv, D]
                v_b = value[b, :, t - n :].transpose(0, 1)
                q_b = None if last_query is None else last_query[b]
                rt.prefill(s, layer, k_b, v_b, extend=self._holds(s, layer), q_last=q_b)
        self.layers[layer].prefilled = True
        # The batch is known here and the prompt is in: the first decode step's tables are built
        # now rather than at that step (a later chunk of the prompt forgets and rebuilds them).
        if rt.prepares_decode and all(self._holds(s, layer) for s in self.seq_ids):
            rt.prepare_decode(self.seq_ids, layer)

    def _holds(self, seq_id: int, layer: int) -> bool:
        store = self.runtime.store
        return seq_id in store.sequences() and store.seq_len(seq_id, layer) > 0

    def _with_stored(self, layer: int, key: torch.Tensor, value: torch.Tensor, past: int):
        """This chunk's `[B,Hkv,T,D]` KV after what the runtime holds of each row at the layer, laid
        out as the mask expects (`past` columns before the chunk, each row's tokens at their end)."""
        b, hkv, t, d = key.shape
        keys, values = key.new_zeros((b, hkv, past + t, d)), value.new_zeros((b, hkv, past + t, d))
        keys[:, :, past:], values[:, :, past:] = key, value
        for row, s in enumerate(self.seq_ids):
            if self._holds(s, layer):  # earlier chunks, as the store holds them (in its dtype)
                k_s, v_s = self.runtime.store.full_kv(s, layer, device=key.device)
                keys[row, :, past - k_s.shape[0] : past] = k_s.transpose(0, 1)
                values[row, :, past - v_s.shape[0] : past] = v_s.transpose(0, 1)
        return keys, values

    @staticmethod
    def _real_lengths_from_mask(mask: torch.Tensor | None, batch: int, t: int) -> list[int]:
        """Prompt tokens per row from sdpa's boolean mask; checks the padding is on the left."""
        if mask is None:
            return [t] * batch
        if mask.dtype != torch.bool or mask.dim() != 4:
            raise ValueError(f"expected sdpa's boolean 4D mask in the prefill, got {mask.dtype} {tuple(mask.shape)}")
        keys = mask[:, 0, -1, -t:].expand(batch, t)  # the last query sees every real key of its row
        # (A row may be all padding here: the first chunks of a long-padded row in a chunked prefill.)
        ok = bool((keys[:, 1:].int() >= keys[:, :-1].int()).all())
        if not ok:
            raise ValueError(
                "hybrid attention needs left padding (every row ends in a real token and has no holes); "
                "set tokenizer.padding_side = 'left'"
            )
        return keys.sum(dim=1).tolist()

    def load_prompt(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], attention_mask: torch.Tensor | None = None,
        last_queries: list[torch.Tensor] | None = None,
    ) -> None:
        """Prefill every layer from KV computed elsewhere: `keys[l]`, `values[l]` `[B,Hkv,T,D]`, post-RoPE.

        Equivalent to running the prompt through the model with this cache (the dense prefill),
        for callers that already have the prompt's KV (e.g. a quality harness comparing policies).
        `attention_mask` `[B, T]` marks real tokens (left padding); None means all real.
        `last_queries[l]` `[B, Hq, D]`: the query of each row's last prompt token at layer `l`
        (post-RoPE, scaled as the runtime's decode queries), which the `predicted` policy needs.
        """
        self._check_usable()
        if self.seq_ids or any(layer.length for layer in self.layers):
            raise ValueError("this HybridCache already holds a prompt")
        if len(keys) != len(self.layers) or len(values) != len(self.layers):
            raise ValueError(f"need KV for all {len(self.layers)} layers, got {len(keys)} keys and {len(values)} values")
        b, _, t, _ = keys[0].shape
        if attention_mask is None:
            lengths = [t] * b
        else:
            am = attention_mask.bool()
            lengths = self._real_lengths_from_mask(am[:, None, None, :], b, t)
        self._allocate(lengths)
        try:
            for layer, (k, v) in enumerate(zip(keys, values)):
                self._prefill_layer(layer, k, v, lengths, None if last_queries is None else last_queries[layer])
                self.layers[layer].update(k, v)
        except BaseException:
            self.release()
            raise

    def _own_cores(self) -> None:
        """At each decode step of a model on the CPU: inside `generate`, torch's threads leave the
        runtime's workers their cores until it returns; otherwise say so if they do not."""
        state = self._state
        want = state.decode_threads
        if state.generate_threads and want is not None:
            n = min(state.generate_threads, self.runtime.scheduler.cores.torch_threads) if want == "auto" else want
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
        _warn_contention(self.runtime)

    # -- the per-layer work, called from hybrid_attention_forward
    def _attend(
        self,
        module: torch.nn.Module,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        state = self._state
        lyr = self.layers[layer]
        if not lyr.prefilled or (key.shape[2] > 1 and not self._decoding):
            # Prefill (the prompt, or its next chunk before any decode step): the model's own dense
            # attention over the earlier chunks the runtime holds and this one, then the KV to the runtime.
            t = key.shape[2]
            lengths = self._real_lengths_from_mask(attention_mask, query.shape[0], t)
            if not self.seq_ids:
                self._allocate(lengths, whole_prompt=False)
            elif query.shape[0] != len(self.seq_ids):
                raise ValueError(f"batch of {query.shape[0]} rows but the cache holds {len(self.seq_ids)} sequences")
            if any(n < t and self._holds(s, layer) for s, n in zip(self.seq_ids, lengths)):
                raise ValueError("hybrid attention needs left padding: a prompt chunk has padding after real tokens")
            past = lyr.length - t
            keys, values = self._with_stored(layer, key, value, past) if past else (key, value)
            out = _dense(state, module, query, keys, values, attention_mask, scaling=scaling, **kwargs)
            last_query = query[:, :, -1]  # [B, Hq, D]: each row's last token (left padding)
            if scaling is not None and abs(scaling * query.shape[-1] ** 0.5 - 1.0) > 1e-6:
                last_query = last_query * (scaling * query.shape[-1] ** 0.5)
            try:
                self._prefill_layer(layer, key, value, lengths, last_query)
            except BaseException:
                self.release()
                raise
            return out
        b, _, t, d = query.shape
        if b != len(self.seq_ids):
            raise ValueError(f"batch of {b} rows but the cache holds {len(self.seq_ids)} sequences")
        if not self._decoding:
            empty = [row for row, s in enumerate(self.seq_ids) if not self._holds(s, layer)]
            if empty:
                raise ValueError(f"batch rows {empty} have no real (unpadded) prompt token; every row needs at least one")
            self._decoding = True
        if layer == 0 and query.device.type == "cpu":  # a model on the GPU leaves torch's host threads idle
            self._own_cores()
        # The runtime scales q by 1/sqrt(D); a model with another softmax scale gets q rescaled.
        if scaling is not None and abs(scaling * d**0.5 - 1.0) > 1e-6:
            query = query * (scaling * d**0.5)
        rt = self.runtime
        look = self._lookahead(module, layer)
        if t == 1:
            out = rt.decode(layer, self.seq_ids, query[:, :, 0], key[:, :, 0], value[:, :, 0], lookahead=look(0))  # [B, Hq, D]
            return out.unsqueeze(1), None
        # Several new tokens after the prompt (continuing from a cache): one runtime step each, which
        # is causal attention among them since every step appends before it attends.
        outs = [rt.decode(layer, self.seq_ids, query[:, :, i], key[:, :, i], value[:, :, i], lookahead=look(i))
                for i in range(t)]
        return torch.stack(outs, dim=1), None

    def _graph_attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """One layer's decode attention for `DecodeGraphs.step`: what the model's attention module
        does after its projections (the cache's count, then `_attend`) -> `[B, 1, Hq, D]`."""
        module = self._state.attn_modules[layer]()
        self.layers[layer].update(key, value)
        return self._attend(module, layer, query, key, value, None, scaling=module.scaling)[0]

    def _lookahead(self, module: torch.nn.Module, layer: int) -> Callable[[int], torch.Tensor | None]:
        """`i -> ` the next layer's SparDA selection queries for the step's i-th new token (None when
        there are none: no lookahead source, the last layer, or no input kept for this module)."""
        source = self._state.lookahead
        kept = getattr(_ATTN_INPUT, "value", None)
        if source is None or layer + 1 >= self._state.geometry.layers or kept is None or kept[0] is not module:
            return lambda i: None
        _, hidden, cos, sin = kept
        return lambda i: source.queries(layer, hidden[:, i], cos[:, i], sin[:, i])


__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
    "HybridCache",
    "UnsupportedModelError",
    "cores_for_runtime",
    "decode_graphs_of",
    "disable_hybrid_attention",
    "enable_hybrid_attention",
    "hybrid_attention_forward",
    "hybrid_runtime_of",
    "model_geometry",
    "tensor_parallel_of",
]
