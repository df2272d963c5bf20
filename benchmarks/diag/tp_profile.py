"""Diagnostic (GPU, N GPUs): where a dense decode step's time goes under transformers' tensor-parallel plan.

`e2e_decode --tp 2` measured the HF dense model's TPOT at 8 x 32K going from 73 ms on one GPU to
140 ms on two ranks (benchmarks/results/e2e_decode_tp2-h200.json). This builds the same
random-weight model (Llama-3.1-8B geometry, bf16) on one GPU and sharded over `--tp` ranks exactly
as `benchmarks/e2e_tp.py` does, prefills `--batch` x `--context` random tokens into a DynamicCache,
then times `--steps` one-token forward passes (CUDA-synchronised wall time per step) and profiles
a few of them with torch.profiler: the ops with the most host (self CPU) time, how many of them
went through DTensor, and the all-reduces. Rank 0 prints; nothing is written but stdout.

    python benchmarks/diag/tp_profile.py --tp 2 [--batch 8 --context 4096 --steps 12]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _decode_times(model, batch: int, context: int, steps: int, device: str, label: str, rank: int) -> None:
    from transformers import DynamicCache

    from hybrid_runtime.integrations.transformers import cache_kwarg

    key = cache_kwarg(model)  # `cache` from transformers 5.24 on, `past_key_values` before
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(ids, use_cache=True, **{key: cache})
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(tok, use_cache=True, **{key: cache})
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                out = model(tok, use_cache=True, **{key: cache})
                tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
    if rank != 0:
        return
    times.sort()
    print(f"\n=== {label}: one-token step, median {times[len(times) // 2]:.1f} ms, min {times[0]:.1f} ms "
          f"(batch {batch}, context {context})", flush=True)
    ka = prof.key_averages()
    host_total = sum(e.self_cpu_time_total for e in ka) / 3 / 1e3
    dev_total = sum(getattr(e, "self_device_time_total", 0) for e in ka) / 3 / 1e3
    dtensor = sum(e.count for e in ka if "dtensor" in e.key.lower() or "redistribute" in e.key.lower()) / 3
    allreduce = [e for e in ka if "all_reduce" in e.key.lower() or "allreduce" in e.key.lower()]
    print(f"per step: host self time {host_total:.1f} ms, device time {dev_total:.1f} ms, "
          f"DTensor-named events {dtensor:.0f}, all-reduce events "
          f"{sum(e.count for e in allreduce) / 3:.0f}", flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=18), flush=True)


def _rank(rank: int, world: int, args, port: int) -> None:
    import torch.distributed as dist
    import transformers

    from benchmarks.e2e_tp import _shard
    from hybrid_runtime.experiments.generate_timing import build_model, model_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    transformers.logging.set_verbosity_error()
    model = _shard(build_model(model_config(args.model), f"cuda:{rank}", torch.bfloat16, 0), world)
    if rank == 0:
        p = model.model.layers[0].self_attn.q_proj.weight
        print(f"tp{world}: q_proj weight is {type(p).__name__} ({type(p.data).__name__}), local shape "
              f"{tuple(getattr(p, 'to_local', lambda: p)().shape)}; transformers {transformers.__version__}", flush=True)
    _decode_times(model, args.batch, args.context, args.steps, f"cuda:{rank}", f"tp{world}", rank)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    import torch.multiprocessing as mp
    import transformers

    from benchmarks.e2e_tp import _free_port
    from hybrid_runtime.experiments.generate_timing import build_model, model_config

    transformers.logging.set_verbosity_error()
    model = build_model(model_config(args.model), "cuda:0", torch.bfloat16, 0)
    _decode_times(model, args.batch, args.context, args.steps, "cuda:0", "one GPU", 0)
    del model
    torch.cuda.empty_cache()
    mp.start_processes(_rank, args=(args.tp, args, _free_port()), nprocs=args.tp, start_method="spawn")


if __name__ == "__main__":
    main()
