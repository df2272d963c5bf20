"""Host-work census of one AsyncTLS `HybridRuntime.decode` call (one layer-step).

Builds an AsyncTLS runtime the way tests/test_asynctls.py and benchmarks/asynctls.py do
(`selection.name: asynctls`, `placement: gpu_only`, `gpu_worker: true`, `cpu_workers: 0`, an
`AsyncTlsExecutor` on the default device: the host here), prefills a few sequences, warms up,
then for the measured decode calls collects

  (a) torch.profiler (CPU activity, with_stack=True) op counts per decode call, attributed to
      the innermost project frame (hybrid_runtime/, gpu_kernels/, cpu_kernels/) above each op;
      "top-level" ops are those called from Python (parent is not an aten op), "kernel-like"
      ops are aten ops with no aten children that are not views/allocations (a stand-in for
      device kernels);
  (b) cProfile of the same kind of decode calls (separate calls, to keep the profilers apart):
      calls and cumulative time of project functions per decode call.

    python benchmarks/diag/asynctls_census.py --out DIR                  # CPU path as built
    python benchmarks/diag/asynctls_census.py --out DIR --variant fused  # the executor's CUDA form of the token level
        (fused_token_scores on: `int4_token_scores`, one Triton launch on CUDA; here a stand-in computes
        the same scores with torch ops under record_function("triton_stub::..."), and the census counts
        it as one launch and leaves its ops out: the interpreted kernel under the profiler's Python
        tracer ran this 2-core, 23 GB host out of memory)
Writes census-<variant>-<geometry>.json and .md into --out (default: the working directory); no results file.
Only the CPU path has been run (no GPU on the machine this was written on); the script does not
add CUDA activities or synchronise, so its times mean nothing for a device.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import sys
import time
from pathlib import Path

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # no CUDA: Triton kernels (the fused variant) interpreted
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
_IN_ROOT = re.compile(re.escape(str(ROOT)) + r"/(.*)$")
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from hybrid_runtime.config import GEOMETRIES, config_from_dict  # noqa: E402
from hybrid_runtime.executors.asynctls import AsyncTlsExecutor  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402

PROJECT = re.compile(r"^((?:hybrid_runtime|gpu_kernels|cpu_kernels)/\S+\.py)\((\d+)\): (\S+)$")
# aten ops that launch no kernel on a device (views, metadata, allocations).
NO_KERNEL = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::_unsafe_view", "aten::reshape",
    "aten::_reshape_alias", "aten::slice", "aten::select", "aten::as_strided", "aten::expand", "aten::expand_as",
    "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::t", "aten::permute", "aten::alias",
    "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::resize_", "aten::result_type", "aten::unbind",
    "aten::split", "aten::chunk", "aten::narrow", "aten::view_as", "aten::contiguous", "aten::to",
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::set_", "aten::size", "aten::stride",
    "aten::numpy_T", "aten::flatten", "aten::unflatten", "aten::squeeze_", "aten::unsqueeze_", "aten::diagonal",
    "aten::from_blob", "aten::record_stream", "aten::resolve_conj", "aten::resolve_neg", "aten::real",
    "aten::as_strided_", "aten::scalar_tensor", "aten::nonzero_numpy",
}
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::masked_select"}
COPY_OPS = {"aten::copy_", "aten::_to_copy"}
# Where an op runs, by the first of these frames among its ancestors (what the CUDA path does there
# instead is in report.md): the claim's ops are one CUDA-graph replay from the second step on.
REGIONS = [
    ("claim ops (_claim_ops: CUDA graph replay)", "hybrid_runtime/executors/asynctls.py:_claim_ops"),
    ("copy of misses (_fetch: 1 Triton launch)", "hybrid_runtime/executors/asynctls.py:_fetch"),
    ("claim wrapper (_claim/launch)", "hybrid_runtime/executors/asynctls.py:_claim"),
    ("claim wrapper (_claim/launch)", "hybrid_runtime/executors/asynctls.py:launch"),
    ("retire (AsyncTlsLaunch.wait)", "hybrid_runtime/executors/asynctls.py:wait"),
    ("plan upload", "hybrid_runtime/executors/asynctls.py:upload"),
    ("window part (append + window attention)", "hybrid_runtime/runtime.py:window_part"),
    ("merge", "hybrid_runtime/runtime.py:_merge"),
    ("input check", "hybrid_runtime/input_check.py:check_finite"),
    ("lane buffers (gpu_prep)", "hybrid_runtime/runtime.py:gpu_prep"),
]


def install_token_score_stub():
    """`int4_token_scores` replaced by the same scores from the dequantized index (torch ops under a
    `triton_stub::` record, which the census counts as one launch)."""
    import gpu_kernels.asynctls_token_scores as mod
    from cpu_kernels import layout
    from hybrid_runtime.token_index import dequantize_int4

    def int4_token_scores(q_c, codes, qparams, cached, chunks, cpu_len, blk):
        with record_function("triton_stub::int4_token_scores"):
            r, s = cached.shape
            n = s * blk
            pos = cached[:, :, None] * blk + torch.arange(blk)
            valid = ((cached[:, :, None] >= 0) & (pos < cpu_len[:, None, None])).view(r, n)
            pos = pos.clamp(min=0).view(r, n)
            cid = chunks.gather(1, (pos // layout.CHUNK_TOKENS).clamp(max=chunks.shape[1] - 1)).long()
            row = pos % layout.CHUNK_TOKENS
            keys = dequantize_int4(codes[cid, row], qparams[cid, row])
            raw = torch.bmm(q_c, keys.transpose(1, 2))
            return raw.masked_fill_(~valid[:, None, :], float("-inf"))

    mod.int4_token_scores = int4_token_scores


def build(args):
    if args.geometry == "llama":
        base = GEOMETRIES["llama-3.1-8b"]
        geo = {"layers": args.layers, "q_heads": base.q_heads, "kv_heads": base.kv_heads, "head_dim": base.head_dim}
        kv = {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16"}
    else:  # tests/test_asynctls.py's GEOMETRY
        geo = {"layers": args.layers, "q_heads": 6, "kv_heads": 2, "head_dim": 32}
        kv = {"sink": 16, "local": 64, "generated_cap": 256, "dtype": "fp32"}
    kv.update({"cpu_capacity_tokens": args.batch * args.context, "max_sequences": args.batch})
    cfg = config_from_dict({
        "geometry": geo, "kv_cache": kv,
        "scheduler": {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False},
        "selection": {"name": "asynctls", "block_size": args.block_size, "blocks": args.blocks, "tokens": args.tokens,
                      "index_channels": args.channels, "resident_steps": args.resident_steps},
        "profiling": {"enabled": False},
    })
    g = cfg.geometry
    channels = torch.stack([torch.stack([torch.randperm(g.head_dim, generator=torch.Generator().manual_seed(l * 97 + h))
                                         [: args.channels].sort().values for h in range(g.kv_heads)])
                            for l in range(g.layers)])
    rt = HybridRuntime(cfg, gpu_executor=lambda store: AsyncTlsExecutor(store, cfg.selection, channels))
    return rt, cfg


def add_point_args(ap: argparse.ArgumentParser) -> None:
    """The point of the diagnostics that build this census's runtime at Llama-3.1-8B's heads
    (`asynctls_replay_cost.py`, `decode_host_timers.py`, `decode_host_sampler.py`, `asynctls_host_ab.py`)."""
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--resident-steps", type=int, default=1,
                    help="the resident cache keeps the blocks of the last this many steps (selection.resident_steps)")


def prefilled(args: argparse.Namespace) -> tuple:
    """The census's runtime (`build`, Llama-3.1-8B heads, blocks of 64, 32 index channels) at
    `add_point_args`'s point, every sequence prefilled with random bf16 KV on the runtime's device.
    Returns (runtime, config, queries `[B, layers, Hq, D]`, seq_ids, zero k/v `[B, Hkv, D]`)."""
    build_args = argparse.Namespace(geometry="llama", layers=args.layers, batch=args.batch, context=args.context,
                                    block_size=64, blocks=args.blocks, tokens=args.tokens, channels=32)
    rt, cfg = build(build_args)
    g = cfg.geometry
    dev = rt.device
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((args.batch, g.layers, g.q_heads, g.head_dim), generator=gen).to(dev)
    for s in range(args.batch):
        for layer in range(g.layers):
            k = torch.randn((args.context, g.kv_heads, g.head_dim), generator=gen, dtype=torch.bfloat16)
            v = torch.randn((args.context, g.kv_heads, g.head_dim), generator=gen, dtype=torch.bfloat16)
            rt.prefill(s, layer, k.to(dev), v.to(dev), q_last=q[s, layer])
    zeros = torch.zeros((args.batch, g.kv_heads, g.head_dim), dtype=torch.bfloat16, device=dev)
    return rt, cfg, q, list(range(args.batch)), zeros


def frame_of(e):
    m = PROJECT.match(e.name)
    return f"{m.group(1)}:{m.group(3)}" if m else None


def census_events(events, anchor_name="census::decode"):
    """Counts of one profiled decode call from its FunctionEvents."""
    anchors = [e for e in events if e.name == anchor_name]
    assert len(anchors) == 1, f"{len(anchors)} anchors"
    anchor = anchors[0]

    def ancestors(e):
        p = e.cpu_parent
        while p is not None:
            yield p
            p = p.cpu_parent

    kernel_memo: dict = {}

    def is_kernel(e):
        """Kernel-like: an aten op that does work itself (not a view or allocation) and whose aten
        descendants do none (an `index` allocating its output counts; a `to` whose copy_ counts does not)."""
        k = id(e)
        if k not in kernel_memo:
            kernel_memo[k] = e.name not in NO_KERNEL and not any(has_kernel(c) for c in e.cpu_children)
        return kernel_memo[k]

    def has_kernel(e):
        return (e.name.startswith("aten::") and is_kernel(e)) or any(has_kernel(c) for c in e.cpu_children)

    per_fn = collections.defaultdict(collections.Counter)
    fn_ops = collections.defaultdict(collections.Counter)  # top-level op names per function
    regions = collections.defaultdict(collections.Counter)
    op_names = collections.Counter()  # top-level ops by name
    leaf_names = collections.Counter()
    totals = collections.Counter()
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        anc = list(ancestors(e))
        if anchor not in anc:
            continue
        parent = e.cpu_parent
        top = parent is None or not parent.name.startswith("aten::")
        leaf = is_kernel(e)
        fn = "(no project frame)"
        via_triton = any("triton/" in a.name or a.name.startswith("triton_stub::") for a in anc)
        for a in anc:
            f = frame_of(a)
            if f is not None:
                fn = f
                break
        c = per_fn[fn]
        kind = "interp" if via_triton else "own"
        frames = {frame_of(a) for a in anc}
        region = next((name for name, f in REGIONS if f in frames), "decode, other")
        r = regions[region]
        if top and not via_triton:
            fn_ops[fn][e.name] += 1
            r["own_top"] += 1
        if leaf and not via_triton:
            r["own_kernel"] += 1
        if top:
            c[f"{kind}_top"] += 1
            totals[f"{kind}_top"] += 1
            if not via_triton:
                op_names[e.name] += 1
        if leaf:
            c[f"{kind}_kernel"] += 1
            totals[f"{kind}_kernel"] += 1
            if not via_triton:
                leaf_names[e.name] += 1
        if not via_triton:
            if e.name in COPY_OPS and top:
                c["copy_top"] += 1
                totals["copy_top"] += 1
            if e.name in SYNC_OPS:
                c["sync"] += 1
                totals["sync"] += 1
        c[f"{kind}_all"] += 1
        totals[f"{kind}_all"] += 1
    totals["triton_stub_launches"] = sum(1 for e in events if e.name.startswith("triton_stub::")
                                         and anchor in list(ancestors(e)))
    pyframes = sum(1 for e in events if frame_of(e) is not None and anchor in list(ancestors(e)))
    totals["project_python_frames"] = pyframes
    return per_fn, op_names, leaf_names, totals, fn_ops, regions


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=("llama", "tests"), default="llama")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--resident-steps", type=int, default=1,
                    help="the resident cache keeps the blocks of the last this many steps (selection.resident_steps)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured decode steps (all layers)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per collector (all layers)")
    ap.add_argument("--variant", choices=("cpu", "fused"), default="cpu",
                    help="cpu: the executor as built on the host; fused: fused_token_scores on (Triton, interpreted)")
    ap.add_argument("--lagged", choices=("yes", "no"), default="yes")
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    rt, cfg = build(args)
    ex = rt.gpu_executor
    ex.lagged = args.lagged == "yes"
    if args.variant == "fused" and not ex.cuda:
        install_token_score_stub()
        ex.fused_token_scores = True
    g = cfg.geometry
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if args.geometry == "llama" else torch.float32
    dev = rt.device  # the runtime's device: decode's fused CUDA path needs q, k, v there (untested on CUDA)
    q = torch.randn((args.batch, g.layers, g.q_heads, g.head_dim), generator=gen).to(dev)
    for s in range(args.batch):
        for layer in range(g.layers):
            k = torch.randn((args.context, g.kv_heads, g.head_dim), generator=gen, dtype=dt)
            v = torch.randn((args.context, g.kv_heads, g.head_dim), generator=gen, dtype=dt)
            rt.prefill(s, layer, k.to(dev), v.to(dev), q_last=q[s, layer])
    seq_ids = list(range(args.batch))
    zeros = torch.zeros((args.batch, g.kv_heads, g.head_dim), dtype=dt, device=dev)
    print(f"built and prefilled in {time.perf_counter() - t0:.1f} s; cuda={rt.cuda} executor device={ex.device} "
          f"fused_token_scores={ex.fused_token_scores} graphs={ex.graphs} lagged={ex.lagged} "
          f"gpu_only_trails={rt.gpu_only_trails} finite_check={rt.finite_check}", flush=True)

    def one(layer, hook=None):
        q[:, layer].add_(0.1 * torch.randn(q[:, layer].shape, generator=gen).to(dev))
        spill = rt._will_spill(layer, seq_ids)
        if hook is None:
            t = time.perf_counter()
            rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)
            return time.perf_counter() - t, spill
        return hook(lambda: rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)), spill

    for _ in range(args.warmup):
        for layer in range(g.layers):
            one(layer)
    # Plain wall time per call.
    wall = [one(layer)[0] for _ in range(args.steps) for layer in range(g.layers)]

    # (a) torch.profiler, one profile per decode call.
    calls = []
    for step in range(args.steps):
        for layer in range(g.layers):
            def prof_hook(fn):
                with profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=True) as prof:
                    with record_function("census::decode"):
                        fn()
                return prof.events()
            events, spill = one(layer, prof_hook)
            per_fn, op_names, leaf_names, totals, fn_ops, regions = census_events(events)
            calls.append({"step": step, "layer": layer, "spill": spill, "per_fn": {k: dict(v) for k, v in per_fn.items()},
                          "fn_ops": {k: dict(v) for k, v in fn_ops.items()}, "regions": {k: dict(v) for k, v in regions.items()},
                          "op_names": dict(op_names), "leaf_names": dict(leaf_names), "totals": dict(totals)})

    def cprofiled_calls() -> tuple[pstats.Stats, int]:
        """cProfile of `args.steps` more decode steps (every layer), and how many calls that was."""
        pr = cProfile.Profile()

        def hook(fn):
            pr.enable()
            try:
                fn()
            finally:
                pr.disable()

        for _ in range(args.steps):
            for layer in range(g.layers):
                one(layer, hook)
        return pstats.Stats(pr), args.steps * g.layers

    # (b) cProfile of more decode calls.
    st, n_cprof = cprofiled_calls()
    cp_rows, total_calls, builtin_rows = [], 0, []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        total_calls += nc
        m = _IN_ROOT.search(file)
        if m:
            cp_rows.append({"fn": f"{m.group(1)}:{fn}", "line": line, "calls": nc / n_cprof,
                            "tottime_us": tt / n_cprof * 1e6, "cumtime_us": ct / n_cprof * 1e6})
        elif file == "~":
            builtin_rows.append({"fn": fn, "calls": nc / n_cprof, "tottime_us": tt / n_cprof * 1e6})
    cp_rows.sort(key=lambda r: -r["cumtime_us"])
    builtin_rows.sort(key=lambda r: -r["calls"])
    # (c) The host skeleton: the claim's ops and the copy of misses replaced by their last results
    # (what a CUDA step keeps on the host when the claim replays as a graph and the copy is one
    # launch), to time decode's remaining Python and host ops without the CPU's compute.
    saved = {}
    claim_ops, fetch = ex._claim_ops, ex._fetch

    def cached_claim_ops(layer, d, step, arena, fetch_events):
        if layer not in saved:
            saved[layer] = claim_ops(layer, d, step, arena, fetch_events)
        return saved[layer]

    ex._claim_ops = cached_claim_ops
    ex._fetch = lambda *a, **kw: None
    for layer in range(g.layers):
        one(layer)
    skel = [one(layer)[0] for _ in range(max(10, args.steps * 4)) for layer in range(g.layers)]
    st2, n_skel = cprofiled_calls()
    skel_rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st2.stats.items():
        m = _IN_ROOT.search(file)
        name = f"{m.group(1)}:{fn}" if m else f"{file}:{fn}" if file != "~" else fn
        skel_rows.append({"fn": name, "calls": nc / n_skel, "tottime_us": tt / n_skel * 1e6, "cumtime_us": ct / n_skel * 1e6})
    skel_rows.sort(key=lambda r: -r["tottime_us"])
    ex._claim_ops, ex._fetch = claim_ops, fetch
    rt.close()

    # Aggregate the torch.profiler census over the non-spill calls.
    keep = [c for c in calls if not c["spill"]]
    n = len(keep)
    agg_fn = collections.defaultdict(collections.Counter)
    agg_tot, agg_ops, agg_leaf = collections.Counter(), collections.Counter(), collections.Counter()
    agg_fn_ops, agg_reg = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for c in keep:
        for fn, cnt in c["per_fn"].items():
            agg_fn[fn].update(cnt)
        for fn, cnt in c["fn_ops"].items():
            agg_fn_ops[fn].update(cnt)
        for reg, cnt in c["regions"].items():
            agg_reg[reg].update(cnt)
        agg_tot.update(c["totals"])
        agg_ops.update(c["op_names"])
        agg_leaf.update(c["leaf_names"])
    result = {
        "config": vars(args), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
        "wall_ms_per_call_median": sorted(wall)[len(wall) // 2] * 1e3,
        "profiled_calls": len(calls), "non_spill_calls": n,
        "per_call_totals": {k: v / n for k, v in agg_tot.items()},
        "per_call_totals_each": [dict(c["totals"], layer=c["layer"], spill=c["spill"]) for c in calls],
        "per_fn": {fn: {k: v / n for k, v in cnt.items()} for fn, cnt in agg_fn.items()},
        "top_ops": {k: v / n for k, v in agg_ops.most_common()},
        "fn_ops": {fn: {k: v / n for k, v in cnt.most_common()} for fn, cnt in agg_fn_ops.items()},
        "regions": {reg: {k: v / n for k, v in cnt.items()} for reg, cnt in agg_reg.items()},
        "leaf_ops": {k: v / n for k, v in agg_leaf.most_common()},
        "skeleton_wall_us_per_call_median": sorted(skel)[len(skel) // 2] * 1e6,
        "skeleton_cprofile_by_tottime": skel_rows,
        "cprofile_calls": n_cprof, "cprofile_total_function_calls_per_call": total_calls / n_cprof,
        "cprofile_project": cp_rows, "cprofile_builtins": builtin_rows[:60],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"census-{args.variant}-{args.geometry}{args.tag}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# census ({args.variant}) {vars(args)}", "",
             f"wall ms/call median {result['wall_ms_per_call_median']:.2f}; profiled calls {len(calls)} "
             f"(non-spill {n}); per call totals: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(result['per_call_totals'].items())),
             "", "| function | top ops | kernel-like | copies (top) | syncs | interp top |", "| --- | --- | --- | --- | --- | --- |"]
    for fn, cnt in sorted(result["per_fn"].items(), key=lambda kv: -kv[1].get("own_top", 0)):
        lines.append(f"| {fn} | {cnt.get('own_top', 0):.1f} | {cnt.get('own_kernel', 0):.1f} | {cnt.get('copy_top', 0):.1f} "
                     f"| {cnt.get('sync', 0):.1f} | {cnt.get('interp_top', 0):.1f} |")
    lines += ["", "| region | top ops | kernel-like |", "| --- | --- | --- |"]
    for reg, cnt in sorted(result["regions"].items(), key=lambda kv: -kv[1].get("own_top", 0)):
        lines.append(f"| {reg} | {cnt.get('own_top', 0):.1f} | {cnt.get('own_kernel', 0):.1f} |")
    lines += ["", "top-level op names per function:", ""]
    for fn, cnt in sorted(result["fn_ops"].items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"* {fn}: " + ", ".join(f"{k.removeprefix('aten::')} {v:g}" for k, v in cnt.items()))
    lines += ["", "top-level ops: " + ", ".join(f"{k} {v:g}" for k, v in result["top_ops"].items()), "",
              "kernel-like ops: " + ", ".join(f"{k} {v:g}" for k, v in result["leaf_ops"].items()), "",
              f"cProfile: {result['cprofile_total_function_calls_per_call']:.0f} function calls per decode call "
              f"(all, incl. builtins); project functions by cumtime:", "",
              "| function | calls/decode | tottime us | cumtime us |", "| --- | --- | --- | --- |"]
    for r in cp_rows[:70]:
        lines.append(f"| {r['fn']} ({r['line']}) | {r['calls']:.1f} | {r['tottime_us']:.0f} | {r['cumtime_us']:.0f} |")
    lines += ["", f"host skeleton (claim ops and copy replaced by cached results): median "
              f"{result['skeleton_wall_us_per_call_median']:.0f} us per decode call; by tottime (cProfile):", "",
              "| function | calls/decode | tottime us | cumtime us |", "| --- | --- | --- | --- |"]
    for r in skel_rows[:25]:
        lines.append(f"| {r['fn']} | {r['calls']:.1f} | {r['tottime_us']:.0f} | {r['cumtime_us']:.0f} |")
    lines += ["", "builtins by calls/decode: " + ", ".join(f"{r['fn']} {r['calls']:.1f}" for r in builtin_rows[:40])]
    (out / f"census-{args.variant}-{args.geometry}{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:110]))
    return result


if __name__ == "__main__":
    main()
