"""Every Triton kernel variant the project launches, compiled for the GPU machine (sm_90) on a host
without a GPU; `tests/test_kernel_compile.py` runs it.

Why: without a GPU the kernels are tested under TRITON_INTERPRET=1, and the interpreter accepts
code the compiler refuses (a kernel reading a plain Python global ran in every interpreter test
and failed to compile on the GPU machine). The triton wheel ships ptxas, so a full compile for an
NVIDIA target needs no GPU.

How the variants are found: not from retyped signature lists, which drift from the code. The
project's own warm-ups and wrappers are called with small CPU tensors of the reference geometries
(`hybrid_runtime.config.GEOMETRIES`) and both store dtypes, while Triton's JIT is pointed at a
stand-in driver that reports an sm_90 target and its `jit_cache_hook` records what the JIT would
compile -- the signature, constexprs, specialisation attributes and options it derived from the
real arguments -- instead of compiling and launching it. Each distinct variant is then compiled
with `triton.compile`, exactly as the JIT's `_do_compile` would on the GPU machine.

Must run with TRITON_INTERPRET=0 in the environment before anything imports `gpu_kernels` (Triton
reads it when a kernel is decorated). Usage:

    TRITON_INTERPRET=0 TRITON_CACHE_DIR=$(mktemp -d) python -m tests.kernel_variants --json out.json

writes one record per variant (name, where it was captured, error or shared memory, registers,
spilled bytes and compile seconds) and exits 0 whether or not a variant failed; the test judges.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import linecache
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator

if os.environ.get("TRITON_INTERPRET", "") not in ("0",):
    raise SystemExit("tests/kernel_variants.py needs TRITON_INTERPRET=0 in the environment (Triton reads it when "
                     "the kernel modules are imported; gpu_kernels turns the interpreter on without CUDA otherwise)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

if TYPE_CHECKING:
    from hybrid_runtime.config import Config, GeometryConfig
    from hybrid_runtime.kvcache import KVStore

# The GPU machine: H100 / H200, compute capability 9.0, 32 threads a warp.
TARGET = GPUTarget("cuda", 90, 32)
# Shared memory one block may use on the H100 (227 KiB, the opt-in maximum of sm_90).
MAX_SHARED_BYTES = 227 * 1024


@dataclasses.dataclass
class Variant:
    """One compile the JIT would do: a kernel and everything its cache key holds."""

    kernel: Any  # the JITFunction
    key: str  # the JIT's cache key (specialisation and options): equal keys are one compile
    signature: dict
    constants: dict
    attrs: dict
    options: dict
    origins: list[str]

    @property
    def name(self) -> str:
        fn = self.kernel.fn
        module = fn.__module__.removeprefix("gpu_kernels.")
        consts = {self.kernel.arg_names[path[0]]: v for path, v in self.constants.items() if len(path) == 1}
        shown = [f"{k}={_short(v)}" for k, v in consts.items() if v is not None]
        ptrs = [t[1:] for t in self.signature.values() if isinstance(t, str) and t.startswith("*")]
        opts = f"warps={self.options.get('num_warps')},stages={self.options.get('num_stages')}"
        return f"{module}.{fn.__name__}[{','.join(shown)}; ptr {','.join(ptrs)}; {opts}]"


def _short(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:g}"
    return str(getattr(v, "value", v))


# ---------------------------------------------------------------------------- capture
class _TargetOnlyDriver:
    """What `JITFunction.run` asks the active driver before it compiles: a device, a stream, a target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET


def _guards_only(real: Callable[[], bool]) -> Callable[[], bool]:
    """`interpreted()` for the capture: True only where a constructor refuses to run off CUDA
    (`if ... not interpreted(): raise`), so the project's objects can be built on CPU tensors;
    `real()` (False: TRITON_INTERPRET=0) wherever it selects a variant (`dot_in_fp32`, the
    predictor's dot precision), so the GPU's variant is captured, not the interpreter's. A guard
    written another way makes its constructor raise: the capture fails loudly, never silently
    captures the interpreter's variant."""

    def interpreted() -> bool:
        caller = sys._getframe(1)
        line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
        return bool(re.search(r"\bif\b.*\bnot interpreted\(\)\s*:", line)) or real()

    return interpreted


@contextlib.contextmanager
def capturing() -> Iterator[list[tuple[Any, dict]]]:
    """Within: every kernel launch records `(kernel, what the JIT would compile)` instead of
    compiling and launching it; host-device synchronisations are no-ops (warm-ups end with one)."""
    from triton import knobs
    from triton.runtime.driver import driver

    import gpu_kernels._checks as checks
    import gpu_kernels.head_predictor as head_predictor

    records: list[tuple[Any, dict]] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        records.append((fn.jit_function, compile))
        return True  # handled: the JIT neither compiles nor launches

    saved = (knobs.runtime.jit_cache_hook, torch.cuda.synchronize, checks.interpreted, head_predictor.interpreted)
    saved_driver = driver._active  # None on a host without a GPU: no driver is active there
    driver.set_active(_TargetOnlyDriver())
    knobs.runtime.jit_cache_hook = hook
    torch.cuda.synchronize = lambda *a, **k: None
    # Both bindings: head_predictor imported the function by name.
    checks.interpreted = head_predictor.interpreted = _guards_only(saved[2])
    try:
        yield records
    finally:
        knobs.runtime.jit_cache_hook, torch.cuda.synchronize, checks.interpreted, head_predictor.interpreted = saved
        driver._active = saved_driver


# ---------------------------------------------------------------------------- what the project launches
def _store(geometry: GeometryConfig, dtype: str) -> tuple[Config, KVStore]:
    """A one-layer CPU `KVStore` of a reference geometry (what the executors are built on); small
    capacities: no kernel argument the capture records depends on them."""
    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.kvcache import KVStore

    kv_cache = {"sink": 4, "local": 32, "generated_cap": 32, "cpu_capacity_tokens": 4096, "max_sequences": 2,
                "dtype": dtype}
    cfg = config_from_dict({"geometry": {"name": geometry.name, "layers": 1}, "kv_cache": kv_cache})
    return cfg, KVStore(cfg.kv_cache, cfg.geometry)


def decode_step(geometry: GeometryConfig, dtype: str) -> None:
    """The runtime's window attention, merges and window append: its own warm-up
    (`hybrid_runtime.warmup.step_kernel_jobs`, which compiles every variant a decode step uses)."""
    from gpu_kernels.lse_merge import merge_attention
    from gpu_kernels.window_attention import window_attention
    from hybrid_runtime.warmup import step_kernel_jobs

    cfg, store = _store(geometry, dtype)
    for _, job in step_kernel_jobs(store, cfg.geometry, torch.device("cpu"), window_attention, merge_attention):
        job()
    store.close()


def gpu_lane(geometry: GeometryConfig, dtype: str) -> None:
    """The GPU lane's claim launches (score+select, attention+combine): the executor's warm-up,
    with the claims as planned launches and from descriptors (`scheduler.claim_launch`), scoring
    from the arena and from the store's GPU copy of the metadata (`kv_cache.gpu_metadata`)."""
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor

    _, store = _store(geometry, dtype)
    GpuUvaExecutor(store, claim_launch="plans").warm_up()
    GpuUvaExecutor(store, claim_launch="native").warm_up()
    store.enable_gpu_metadata()  # the variants that score from the store's copy of the metadata
    GpuUvaExecutor(store, claim_launch="plans").warm_up()
    GpuUvaExecutor(store, claim_launch="native").warm_up()
    store.close()


def predicted_planner(geometry: GeometryConfig, dtype: str) -> None:
    """The `predicted` policy's fused features and predictor kernels: the planner's warm-up (one
    run per query dtype it expects), built as the runtime builds it."""
    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.predicted_plans import PredictedHeadPlanner

    cfg, store = _store(geometry, dtype)
    policy = config_from_dict({"geometry": {"name": geometry.name, "layers": 1}, "selection": {"name": "predicted"}}).selection
    PredictedHeadPlanner(policy, cfg.geometry, store, path="fused")
    store.close()


def nosa(geometry: GeometryConfig, dtype: str) -> None:
    """NOSA's block gather and cache attention: the executor's warm-up with its Triton kernels."""
    from hybrid_runtime.config import NosaConfig
    from hybrid_runtime.executors.nosa import NosaExecutor
    from predictor.eviction_head import EvictionHeads

    cfg, store = _store(geometry, dtype)
    g = cfg.geometry
    # Untrained heads, as `benchmarks/nosa.py` gives a geometry without a trained checkpoint.
    heads = EvictionHeads(g.layers, g.kv_heads, g.head_dim)
    NosaExecutor(store, NosaConfig(), eviction_heads=heads, kernels="triton").warm_up()
    store.close()


def sparda(geometry: GeometryConfig, dtype: str) -> None:
    """SparDA's selection -- block scores as sort keys, cache lookup and assignment, the prefetch
    gather -- through the executor's own warm-up (`SpardaExecutor.warm_up`, CUDA only: called here
    on the CPU store) at every block size, with the Forecast's lookahead (it warms up both query
    head counts and a spill's variants); then slot attention, with the index dtypes the selection
    (`SpardaExecutor._stage`) produces."""
    from gpu_kernels.forecast_gather import gather_blocks
    from gpu_kernels.slot_attention import slot_attention
    from hybrid_runtime.config import BLOCK_SIZES, SpardaConfig
    from hybrid_runtime.executors.sparda import SpardaExecutor

    cfg, store = _store(geometry, dtype)
    for block_size in BLOCK_SIZES:
        SpardaExecutor(store, SpardaConfig(block_size=block_size, lookahead="forecast"), cfg.kv_cache,
                       use_triton=True).warm_up()
    ex = SpardaExecutor(store, SpardaConfig(), cfg.kv_cache)
    b, hkv, e = 1, store.kv_heads, ex.top_k
    slots = torch.zeros((b, hkv, e), dtype=torch.int64)  # `cache.assign`'s dst, viewed as the blocks
    chunk = ex.index.tables[0][0].reshape(-1)[: b * hkv * e].contiguous()
    row0 = torch.zeros(b * hkv * e, dtype=torch.int32)
    gather_blocks(store.arena(0), ex.cache.k[0], ex.cache.v[0], chunk, row0, slots.view(-1),
                  torch.zeros(b * hkv * e, dtype=torch.bool), use_triton=True)
    q = torch.zeros((b, cfg.geometry.q_heads, store.head_dim), dtype=torch.float32)
    # One split per entry: what `attend` asks for at small batches on the GPU machine's SM count.
    slot_attention(q, ex.cache.k[0], ex.cache.v[0], slots, torch.zeros((b, hkv, e), dtype=torch.int32), n_splits=e)
    store.close()


def asynctls(geometry: GeometryConfig, dtype: str) -> None:
    """AsyncTLS's block fetch into the resident cache, its block-level scores, cache-table update and
    attention over the chosen tokens there, with the arguments of the executor's warm-up
    (`AsyncTlsExecutor.warm_up`, CUDA only) on a cache sized as the executor sizes it."""
    from gpu_kernels.block_fetch import fetch_blocks
    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.executors.asynctls import cache_slots
    from hybrid_runtime.resident_cache import ResidentCache

    cfg, store = _store(geometry, dtype)
    selection = config_from_dict({"geometry": {"name": geometry.name, "layers": 1}, "selection": {"name": "asynctls"},
                                 "scheduler": {"placement": "gpu_only"}}).selection
    cache = ResidentCache(1, cfg.kv_cache.max_sequences, store.kv_heads, cache_slots(selection, cfg.kv_cache),
                          selection.block_size, store.head_dim, store.dtype, torch.device("cpu"))
    none = torch.full((1, 1), -1, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    fetch_blocks(store.arena(0), torch.zeros((1, 1), dtype=torch.int64), zero, zero, torch.zeros_like(none), none,
                 cache.k[0], cache.v[0], validate=False)
    # The token level's fused scores (the warm-up's launch; d_c 16 is SmolLM2's, 32 the benchmark's at
    # head dim 128) and the benchmark baseline's token gather.
    from gpu_kernels.asynctls_token_gather import gather_tokens
    from gpu_kernels.asynctls_token_scores import int4_token_scores
    from hybrid_runtime.token_index import TokenIndex

    # Block sizes: the config's default and AsyncTLS's 64 (the benchmark's and the quality experiment's).
    for d_c in sorted({selection.index_channels, 2 * selection.index_channels}):
        if d_c > store.head_dim:
            continue
        channels = torch.arange(d_c).expand(1, store.kv_heads, d_c)
        for blk in sorted({selection.block_size, 64}):
            index = TokenIndex(1, 1, store.head_dim, channels, blk, store.dtype, torch.device("cpu"))
            q_c = torch.zeros((1, geometry.group_size, d_c), dtype=torch.float32)
            int4_token_scores(q_c, index.codes[0], index.qparams[0], none, torch.zeros_like(none), zero, blk)
    gather_tokens(store.arena(0), torch.zeros((1, 1), dtype=torch.int64), torch.zeros((1, 1), dtype=torch.int64),
                  torch.zeros((1, 1), dtype=torch.bool))
    # The block level's scores on the index's metadata and the cache table's update, with the warm-up's
    # arguments (the update on a scratch table of the cache's shape, `selection.blocks` chosen per row).
    from gpu_kernels.block_level_scores import level_scores
    from gpu_kernels.cache_update import update_cache_rows

    for blk in sorted({selection.block_size, 64}):
        index = TokenIndex(1, 1, store.head_dim, torch.arange(selection.index_channels).expand(1, store.kv_heads, -1),
                           blk, store.dtype, torch.device("cpu"))
        level_scores(torch.zeros((1, geometry.group_size, store.head_dim), dtype=torch.float32),
                     torch.zeros((1, geometry.group_size), dtype=torch.bool), index.block_meta[0],
                     torch.zeros_like(none), zero, blk)
    table = torch.full((1, *cache.table[0].shape[1:]), -1, dtype=torch.int64)
    token_bytes = 2 * store.head_dim * torch.tensor([], dtype=store.dtype).element_size()
    update_cache_rows(table, torch.zeros_like(table), zero, zero,
                      none.expand(1, min(int(selection.blocks), cache.slots)).contiguous(), zero,
                      selection.resident_steps, selection.block_size, token_bytes)
    # The exact attention over the chosen tokens in the cache, with the warm-up's arguments.
    from gpu_kernels.asynctls_attention import selected_attention

    g, hq = geometry.group_size, store.kv_heads * geometry.group_size
    q = torch.zeros((1, hq, store.head_dim), dtype=torch.float32)
    selected_attention(q, cache.k[0], cache.v[0], zero, zero, zero, torch.zeros_like(none),
                       torch.zeros((1, 1), dtype=torch.bool), torch.zeros((1, g), dtype=torch.bool), q.clone(),
                       torch.zeros((1, hq), dtype=torch.float32))
    store.close()


def input_check(geometry: GeometryConfig, dtype: str) -> None:
    """The deferred NaN/inf check's count (`scheduler.finite_check`), for the input dtypes the runtime's
    warm-up compiles (`input_check.checked_dtypes`, with and without SparDA's lookahead)."""
    from gpu_kernels.nonfinite_counts import MAX_TENSORS, SPLITS, count_nonfinite
    from hybrid_runtime.input_check import checked_dtypes
    from hybrid_runtime.kvcache import _TORCH_DTYPES

    out = torch.zeros((MAX_TENSORS, SPLITS), dtype=torch.int32)
    heads = (geometry.q_heads, geometry.kv_heads, geometry.kv_heads, geometry.kv_heads)
    for dtypes in checked_dtypes(_TORCH_DTYPES[dtype], lookahead=True):
        count_nonfinite(tuple(torch.zeros((1, h, geometry.head_dim), dtype=t) for h, t in zip(heads, dtypes)), out)


def benchmark_pipeline(geometry: GeometryConfig, dtype: str) -> None:
    """The multi-launch selection and attention of `benchmarks/gpu_attention.py` (Quest scores, union,
    sparse attention, split combine) at its default launch shape (its `--sweep` variants are
    experiments it reports as failures, not errors)."""
    from cpu_kernels import layout
    from gpu_kernels.sparse_attention import SparseConfig, sparse_attention
    from gpu_kernels.task_table import SparseTaskTable

    _, store = _store(geometry, dtype)
    g, hkv, d = geometry.group_size, store.kv_heads, store.head_dim
    # One task selecting every block of 4 chunks: its union spans several splits, as a benchmark's does.
    n_chunks, blk = 4, min(layout.BLOCK_SIZES)
    n_blocks = n_chunks * layout.CHUNK_TOKENS // blk
    plan = SparseTaskTable.build(batch_index=[0], kv_head=[0], block_size=[blk], cpu_len=[n_chunks * layout.CHUNK_TOKENS],
                                 chunks=[np.arange(n_chunks)], n_select=np.full((1, g), n_blocks),
                                 n_arena_chunks=store.n_chunks, device="cpu")
    q = torch.zeros((1, hkv * g, d), dtype=torch.float32)
    sparse_attention(plan, q, store.arena(0), torch.zeros_like(q), torch.zeros((1, hkv * g)), SparseConfig())
    store.close()


def machine_probe(geometry: GeometryConfig | None, dtype: str | None) -> None:
    """The machine probe's UVA page gather (`_PageGather.launch` in
    `hybrid_runtime.profiling.machine_limits`, whose set-up needs CUDA), at the probe's sizes."""
    from gpu_kernels.page_gather import gather_pages_kernel
    from hybrid_runtime.profiling import machine_limits as ml

    programs = 4
    src = torch.zeros(programs * ml.PAGES_PER_PROG * ml.PAGE_ELEMS, dtype=torch.bfloat16)
    pages = torch.zeros(programs * ml.PAGES_PER_PROG, dtype=torch.int32)
    dst = torch.empty((programs, ml.PAGE_ELEMS), dtype=torch.float32)
    gather_pages_kernel[(programs,)](src, pages, dst, PAGE_ELEMS=ml.PAGE_ELEMS, PAGES_PER_PROG=ml.PAGES_PER_PROG,
                                     num_warps=4)


# Who launches what, per reference geometry and store dtype (`None`: once, independent of both).
FAMILIES: dict[str, tuple[Callable[[Any, str], None], bool]] = {
    "decode_step": (decode_step, True),
    "gpu_lane": (gpu_lane, True),
    "predicted": (predicted_planner, True),
    "nosa": (nosa, True),
    "sparda": (sparda, True),
    "asynctls": (asynctls, True),
    "input_check": (input_check, True),
    "benchmark_pipeline": (benchmark_pipeline, True),
    "machine_probe": (machine_probe, False),
}


def capture_variants() -> tuple[list[Variant], list[str]]:
    """Every family at every reference geometry and store dtype; returns the distinct variants and
    the families that failed before launching (each with its traceback)."""
    from hybrid_runtime.config import GEOMETRIES
    from hybrid_runtime.kvcache import _TORCH_DTYPES

    variants: dict[tuple[str, str], Variant] = {}
    errors: list[str] = []
    for family, (run, per_geometry) in FAMILIES.items():
        points = [(g, dt) for g in GEOMETRIES.values() for dt in _TORCH_DTYPES] if per_geometry else [(None, None)]
        for geometry, dtype in points:
            origin = family if geometry is None else f"{family}/{geometry.name}/{dtype}"
            with capturing() as records:
                try:
                    run(geometry, dtype)
                except Exception:
                    errors.append(f"{origin}: {traceback.format_exc()}")
            for kernel, data in records:
                spec = json.loads(data["specialization_data"])
                ident = (f"{kernel.fn.__module__}.{kernel.fn.__qualname__}", str(data["key"]))
                v = variants.get(ident)
                if v is None:
                    options = {k: tuple(x) if isinstance(x, list) else x for k, x in spec["options"].items()}
                    v = variants[ident] = Variant(kernel, ident[1], data["signature"], data["constants"],
                                                  data["configs"][0], options, [])
                if origin not in v.origins:
                    v.origins.append(origin)
    return list(variants.values()), errors


def launched_kernels() -> list[str]:
    """The `@triton.jit` functions of `gpu_kernels` that no other one calls or passes on: the
    kernels a host launches (the others are device functions, compiled inside them).
    Module-qualified names."""
    import importlib
    import pkgutil

    import gpu_kernels
    from triton.runtime.jit import JITFunction

    jit: dict[str, JITFunction] = {}
    for info in pkgutil.iter_modules(gpu_kernels.__path__):
        module = importlib.import_module(f"gpu_kernels.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
                jit[f"{module.__name__}.{obj.fn.__qualname__}"] = obj
    # Called, or passed to another (`tl.reduce(x, 1, combine_fn)`); a name in a docstring is neither.
    called = {name for name, f in jit.items()
              if any(g is not f and re.search(rf"\b{f.fn.__name__}\s*[(,)]", g.src) for g in jit.values())}
    return sorted(set(jit) - called)


# ---------------------------------------------------------------------------- compile
def _resource_usage(cubin: bytes) -> dict:
    """Registers per thread, stack frame (where register spills go) and local memory bytes per
    thread of a cubin, from the wheel's cuobjdump."""
    from triton import knobs

    try:
        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # a Triton without the knob: the tool sits beside ptxas
        tool = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = {key: re.search(rf"{field}:(\d+)", out) for key, field in
             (("num_regs", "REG"), ("stack_bytes", "STACK"), ("local_bytes", "LOCAL"))}
    return {key: int(m.group(1)) if m else None for key, m in found.items()}


def compile_variant(v: Variant) -> dict:
    """`triton.compile` of one variant for TARGET, as the JIT's `_do_compile` would on the GPU machine."""
    from triton.compiler import ASTSource

    rec = {"name": v.name, "origins": v.origins, "error": None}
    t0 = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(v.kernel, v.signature, v.constants, v.attrs), target=TARGET,
                                options=v.options)
        rec["shared_bytes"] = int(kernel.metadata.shared)
        rec.update(_resource_usage(kernel.asm["cubin"]))
    except Exception as exc:  # the compiler's message is the result
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


_VARIANTS: list[Variant] = []  # read by forked workers


def _compile_nth(i: int) -> dict:
    return compile_variant(_VARIANTS[i])


def compile_all(variants: list[Variant], jobs: int) -> list[dict]:
    """Compile every variant, `jobs` at a time in forked processes (they inherit the captured
    kernels, which do not pickle; each compile runs ptxas, and the compiler holds the GIL)."""
    global _VARIANTS
    _VARIANTS = variants
    if jobs <= 1:
        return [compile_variant(v) for v in variants]
    with multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=8) as pool:
        return pool.map(_compile_nth, range(len(variants)), chunksize=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the records")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at a time")
    parser.add_argument("--only", default="", help="compile only variants whose name contains this")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    variants, capture_errors = capture_variants()
    variants = [v for v in variants if args.only in v.name]
    t1 = time.perf_counter()
    records = compile_all(variants, args.jobs)
    t2 = time.perf_counter()
    report = {"target": dataclasses.asdict(TARGET), "max_shared_bytes": MAX_SHARED_BYTES,
              "triton": triton.__version__, "launched_kernels": launched_kernels(),
              "captured_kernels": sorted({f"{v.kernel.fn.__module__}.{v.kernel.fn.__qualname__}" for v in variants}),
              "capture_errors": capture_errors, "variants": records,
              "capture_seconds": round(t1 - t0, 1), "compile_seconds": round(t2 - t1, 1)}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
