"""Diagnostic (device): the GPU chain of lagged AsyncTLS layer-steps, interval by interval, from CUDA
events -- where a layer's time goes between its claim and its neighbours' (benchmarks/notes/asynctls.md
section 14).

The census's runtime (`asynctls_census.prefilled`: Llama-3.1-8B heads, random KV) decodes `--steps`
steps of `--layers` layers back to back, no model work between layers. Per call, events on the
caller's stream just before `decode` (`in`) and just after it (`out`: after the merge), the claim's
own start and end events (`claim0`, `claim1`) and its lagged copy's (`fetch0`, `fetch1`, on the copy
stream). Medians over the calls, in us:

    in -> claim0        step inputs and the hand-over to the executor's stream
    claim0 -> claim1    the claim
    claim1 -> out       the window's tail and the merge behind the claim
    out -> next in      the device waiting for the host's next call (0 when the GPU is the bound)
    fetch0 - claim1     when the copy starts after its claim; fetch0 -> fetch1 its length
    layer               in -> next in

`--variants` runs several forms in turn on one runtime (new task lists for each, so claims and copies
are captured again): `copy` as configured, `skip` the copy left out (the cache never changes: timing
only), `programs=N` the copy kernel on N programs (`gpu_kernels/block_fetch.py`), `general` every step
through the lanes' loop (the runtime's express path off).

`--step-graphs` replays each step from the runtime's whole-step graphs (`claim` is then the graph:
window, claim and merge); `--model-work` runs the rest of a decoder layer (the GEMMs of
benchmarks/asynctls.py) before each layer's `in` mark, so `layer` holds it too.

    python benchmarks/diag/asynctls_layer_chain.py --batch 8 --context 32768 --steps 40 --variants copy,skip,programs=132
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.diag import asynctls_census  # noqa: E402
from gpu_kernels import block_fetch  # noqa: E402
from hybrid_runtime.executors.asynctls import AsyncTlsExecutor  # noqa: E402


def chain(rt, cfg, q, seq_ids, zeros, steps: int, work=None) -> tuple[list[dict], int]:
    """`steps` measured steps (after 5 unmeasured), one row of intervals per layer-step; `work(layer)`
    (the model's GEMMs) runs on the caller's stream before each layer's `in` mark."""
    ex = rt.gpu_executor
    layers = cfg.geometry.layers
    launches: list = []
    launch, replayed = AsyncTlsExecutor.launch, AsyncTlsExecutor.replayed

    def keep(*a, **kw):
        handle = launch(ex, *a, **kw)
        launches.append(handle)
        return handle

    def keep_replayed(*a, **kw):  # a claim inside a graph of the whole step: its events bracket that graph
        handle = replayed(ex, *a, **kw)
        launches.append(handle)
        return handle

    ex.launch, ex.replayed = keep, keep_replayed
    noise = torch.empty_like(q[:, 0])
    rows = []
    express0 = rt.scheduler.express_steps
    try:
        for i in range(steps + 5):
            torch.cuda.synchronize()
            launches.clear()
            ex.fetch_events.clear()
            marks = []
            for layer in range(layers):
                q[:, layer].add_(noise.normal_().mul_(0.1))
                if work is not None:
                    work(layer)
                e_in, e_out = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e_in.record()
                rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)
                e_out.record()
                marks.append((e_in, e_out))
            torch.cuda.synchronize()
            if i < 5 or len(launches) != layers:
                continue
            fetches = {layer: (f0, f1) for layer, f0, f1 in ex.fetch_events}
            for layer, ((e_in, e_out), h) in enumerate(zip(marks, launches)):
                row = {"in->claim0": e_in.elapsed_time(h.start) * 1e3, "claim": h.start.elapsed_time(h.end) * 1e3,
                       "claim1->out": h.end.elapsed_time(e_out) * 1e3}
                if layer + 1 < layers:
                    nxt = marks[layer + 1][0]
                    row["out->next in"] = e_out.elapsed_time(nxt) * 1e3
                    row["layer"] = e_in.elapsed_time(nxt) * 1e3
                if layer in fetches:
                    f0, f1 = fetches[layer]
                    row["fetch0-claim1"] = h.end.elapsed_time(f0) * 1e3
                    row["fetch"] = f0.elapsed_time(f1) * 1e3
                rows.append(row)
    finally:
        del ex.launch, ex.replayed
    return rows, rt.scheduler.express_steps - express0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    asynctls_census.add_point_args(ap)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--variants", default="copy",
                    help="comma list, each run in turn on one runtime: copy (as configured), skip (the lagged copy "
                         "left out: timing only), programs=N (the copy kernel on N programs), general (the express "
                         "path off)")
    ap.add_argument("--step-graphs", action="store_true",
                    help="the runtime's graphs of whole GPU-only steps on (hybrid_runtime/step_graphs.py); `claim` is "
                         "then the step's graph (window, claim, merge)")
    ap.add_argument("--model-work", action="store_true",
                    help="the rest of a decoder layer (benchmarks/asynctls.py's GEMMs) before each layer; `layer` "
                         "then includes it")
    args = ap.parse_args()
    rt, cfg, q, seq_ids, zeros = asynctls_census.prefilled(args)
    rt.step_graphs_enabled = args.step_graphs
    work = None
    if args.model_work:
        from benchmarks.asynctls import ModelWork

        work = ModelWork(cfg.geometry.layers, args.batch, rt.device)
    fetch, capture_copy = AsyncTlsExecutor._fetch, AsyncTlsExecutor.capture_copy
    programs = block_fetch.PROGRAMS

    def no_fetch(self, layer, *a, **kw):
        self._fetched[layer] = None

    def no_copy(self, *a, **kw):  # a step graph's copy left out: its claim is the layer's last mark
        return None

    try:
        for variant in args.variants.split(","):
            name, _, value = variant.partition("=")
            if name not in ("copy", "skip", "programs", "general"):
                raise SystemExit(f"variant {variant!r}: allowed copy, skip, programs=N, general")
            AsyncTlsExecutor._fetch = no_fetch if name == "skip" else fetch
            AsyncTlsExecutor.capture_copy = no_copy if name == "skip" else capture_copy
            block_fetch.PROGRAMS = int(value) if name == "programs" else programs
            rt.express_path = name != "general"
            rt.scheduler.settle()
            rt._task_cache.clear()  # new task lists: claims and copies captured again with this variant
            graphs = rt._step_graphs
            if graphs is not None:
                graphs.clear()  # and the step graphs, keyed by those lists
            replays0 = graphs.replays if graphs is not None else 0
            rows, express = chain(rt, cfg, q, seq_ids, zeros, args.steps, work)
            replays = (graphs.replays if graphs is not None else 0) - replays0
            print(f"{args.batch} x {args.context}, {cfg.geometry.layers} layers, {args.steps} steps; variant {variant}; "
                  f"copy kernel programs {block_fetch.PROGRAMS}; express steps {express}; step graph replays {replays}; "
                  f"model work {'on' if work is not None else 'off'}")
            for key in ("in->claim0", "claim", "claim1->out", "out->next in", "layer", "fetch0-claim1", "fetch"):
                vals = np.array([r[key] for r in rows if key in r])
                if vals.size:
                    print(f"  {key:<14} median {np.median(vals):7.1f} us   mean {vals.mean():7.1f}   p90 "
                          f"{np.percentile(vals, 90):7.1f}   n {vals.size}", flush=True)
    finally:
        AsyncTlsExecutor._fetch, AsyncTlsExecutor.capture_copy = fetch, capture_copy
        block_fetch.PROGRAMS = programs
        rt.close()


if __name__ == "__main__":
    main()
