"""Diagnostic: host time of each segment of a fluxion decode step (8 x 32K, 1 layer)."""
import os, sys, time, collections
import numpy as np, torch
sys.path.insert(0, os.getcwd())
from benchmarks.layer_attention import MixPlanner
from hybrid_runtime.config import GEOMETRIES, config_from_dict
from hybrid_runtime.runtime import HybridRuntime
import hybrid_runtime.gpu_lane as gl, hybrid_runtime.workers as wk, hybrid_runtime.scheduler as sc

T = collections.defaultdict(list)
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); T[label].append(time.perf_counter() - t0); return r
    setattr(obj, name, g)

b, ctx = 8, 32768
geo = GEOMETRIES["llama-3.1-8b"]; geo = type(geo)(geo.name, 1, geo.q_heads, geo.kv_heads, geo.head_dim)
cfg = config_from_dict({"geometry": {"layers": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128},
    "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16", "cpu_capacity_tokens": b * ctx, "max_sequences": b},
    "scheduler": {"policy": "fluxion", "cpu_workers": 15, "gpu_worker": True, "pin_cores": True}})
mix = MixPlanner(geo, 0.5, (0.02, 0.08), (16, 32, 64), 0)
rt = HybridRuntime(cfg, geo, head_planner=mix)
gen = torch.Generator(device="cuda").manual_seed(0)
for s in range(b):
    rt.prefill(s, 0, torch.randn((ctx, 8, 128), generator=gen, device="cuda", dtype=torch.bfloat16),
               torch.randn((ctx, 8, 128), generator=gen, device="cuda", dtype=torch.bfloat16))
torch.set_num_threads(1)
lane, ex = rt.scheduler.lane, rt.scheduler.lane.executor
wrap(lane, "reserve_first", "reserve_first"); wrap(lane, "_plan", "plan(upload)"); wrap(ex, "launch", "launch")
wrap(rt.scheduler.workers, "wake", "wake"); wrap(rt.scheduler, "run", "scheduler.run"); wrap(rt, "decode", "decode")
wrap(rt, "_tasks", "_tasks"); wrap(rt.scheduler, "collect", "collect"); wrap(rt, "_window", "window")
wrap(rt.timeline, "record", "timeline.record")
import itertools
for pin, pol in itertools.product((False, True), ("fluxion", "cpu_only")):
    if pin:
        os.sched_setaffinity(0, {rt.scheduler.cores.gpu})
    rt.scheduler.set_policy(pol)
    for i in range(60):
        if i == 20: T.clear()
        q = torch.randn((b, 32, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((b, 8, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
        rt.decode(0, list(range(b)), q, k, k)
    torch.cuda.synchronize()
    print("pinned" if pin else "unpinned", pol, {k: f"{np.median(v)*1e6:.0f}us x{len(v)}" for k, v in T.items()})
import gpu_kernels.score_select as ss, gpu_kernels.sparse_attention as sa
print("fast launches", ss._launch.fast_launches, sa._claim_launch.fast_launches, "broken", ss._launch._broken, sa._claim_launch._broken)
import cProfile, pstats
rt.scheduler.set_policy("fluxion")
pr = cProfile.Profile()
pr.enable()
for i in range(40):
    q = torch.randn((b, 32, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((b, 8, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    rt.decode(0, list(range(b)), q, k, k)
pr.disable()
st = pstats.Stats(pr); st.sort_stats("cumtime").print_stats(30)
recs = rt.timeline.records[-40:]
print("first cpu start", np.median([r.start[r.lane==0].min()-r.t_start for r in recs])*1e3)
rt.close()
