"""Cold start of a runtime: construction, the prefill beside the background compiles, the first decode's waits.

Run it with fresh compile caches to see a new machine's cold start (warm caches: a second run):

    TRITON_CACHE_DIR=$(mktemp -d) NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD \\
        python -m benchmarks.cold_start --json /tmp/cold.json

One process: imports, `HybridRuntime(cfg)` at the geometry's attention shape (`construction_s`),
a prefill of `--batch` random prompts of `--context` tokens into every layer (on CUDA from device
tensors, as a model's prefill hands them over), then decode steps through every layer. Recorded:
`construction_s`; `prefill_s`; the first step's wall time over all layers (`first_step_s`) and
the second's (`second_step_s`); the runtime's `warmup_s`/`warmup_wait_s` (kernel warm-up:
`hybrid_runtime/warmup.py`) and `worker_start_s`/`worker_start_wait_s` (CPU workers' start:
`hybrid_runtime/workers.py`); `stats()` keeps them. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

T_PROCESS = time.perf_counter()

import torch  # noqa: E402

from hybrid_runtime.config import config_from_dict  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402

IMPORTS_S = time.perf_counter() - T_PROCESS


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--cpu-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    cfg = config_from_dict({
        "geometry": {"name": args.geometry, "layers": args.layers},
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 64, "dtype": "bf16",
                     "cpu_capacity_tokens": args.batch * (args.context + 128), "max_sequences": args.batch},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.05},
        "scheduler": {"placement": "fluxion", "cpu_workers": args.cpu_workers},
        "profiling": {"enabled": False},
    })
    row: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "imports_s": IMPORTS_S,
                 "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"), "numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR"),
                 **{k: getattr(args, k) for k in ("geometry", "layers", "batch", "context", "cpu_workers")}}
    t = time.perf_counter()
    rt = HybridRuntime(cfg)
    row["construction_s"] = time.perf_counter() - t
    try:
        g, dev = rt.geometry, torch.device("cuda" if cuda else "cpu")
        gen = torch.Generator(device=dev).manual_seed(0)
        t = time.perf_counter()
        for layer in range(g.layers):
            for s in range(args.batch):
                k, v = (torch.randn(args.context, g.kv_heads, g.head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
                        for _ in range(2))
                rt.prefill(s, layer, k, v)
        if cuda:
            torch.cuda.synchronize()
        row["prefill_s"] = time.perf_counter() - t
        ids = list(range(args.batch))
        for name in ("first_step_s", "second_step_s"):
            t = time.perf_counter()
            for layer in range(g.layers):
                q = torch.randn(args.batch, g.q_heads, g.head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
                kv = torch.randn(args.batch, g.kv_heads, g.head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
                rt.decode(layer, ids, q, kv, kv)
            if cuda:
                torch.cuda.synchronize()
            row[name] = time.perf_counter() - t
        st = rt.stats()
        row.update({k: st.get(k) for k in ("warmup_s", "warmup_wait_s", "worker_start_s", "worker_start_wait_s")})
    finally:
        rt.close()
    print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return row


if __name__ == "__main__":
    main()
