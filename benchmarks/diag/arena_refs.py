"""Diagnostic (device): does anything still hold an arena when the runtime closes? Writes no results file.

Builds a small runtime whose GPU lane takes every task (placement gpu_only, no CPU workers), runs a
few decode steps, closes it and prints how many arenas `KVStore.close` found still referenced
outside the store (0 expected).

    python benchmarks/diag/arena_refs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hybrid_runtime.config import config_from_dict  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("arena_refs needs a CUDA device")
    layers, hq, hkv, d, b, ctx = 4, 8, 2, 64, 2, 4096
    cfg = config_from_dict({
        "geometry": {"name": "small", "layers": layers, "q_heads": hq, "kv_heads": hkv, "head_dim": d},
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 64, "cpu_capacity_tokens": 2 * ctx, "max_sequences": b},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.05},
        "scheduler": {"placement": "gpu_only", "cpu_workers": 0, "gpu_worker": True, "pin_cores": False},
    })
    gen = torch.Generator(device="cuda").manual_seed(0)
    rt = HybridRuntime(cfg)
    for s in range(b):
        for layer in range(layers):
            k = torch.randn((ctx, hkv, d), generator=gen, device="cuda", dtype=torch.bfloat16)
            rt.prefill(s, layer, k, k)
    for _ in range(3):
        for layer in range(layers):
            q = torch.randn((b, hq, d), generator=gen, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn((b, hkv, d), generator=gen, device="cuda", dtype=torch.bfloat16)
            rt.decode(layer, list(range(b)), q, kv, kv)
    torch.cuda.synchronize()
    ex = rt.scheduler.lane.executor
    print("GPU claims launched:", getattr(ex, "launches", None), flush=True)
    rt.scheduler.close()
    rt._warm_up.join()
    print("arenas still referenced at close:", rt.store.close(), flush=True)
    rt.close()


if __name__ == "__main__":
    main()
