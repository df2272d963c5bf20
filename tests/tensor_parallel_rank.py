"""One rank of the tensor-parallel test (`tests/test_tensor_parallel.py` launches two with torchrun).

Loads the saved tiny Llama with transformers' `tp_plan="auto"` (gloo on the CPU), enables hybrid
attention (budget 1.0, fp32 store), generates greedily through the runtime, and writes what the
test checks: the tokens, the geometry the rank's runtime serves, every sequence's stored KV per
layer, and the rank's cores.

    torchrun --nproc_per_node 2 tests/tensor_parallel_rank.py MODEL_DIR INPUTS.pt OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def main(model_dir: str, inputs_path: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.integrations.transformers import HybridCache, disable_hybrid_attention, enable_hybrid_attention

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    inputs = torch.load(inputs_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    cfg = config_from_dict({
        "kv_cache": {"dtype": "fp32", "sink": 16, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096,
                     "max_sequences": 4},
        "selection": {"name": "full"},
        "scheduler": {"placement": "cpu_only", "gpu_worker": False},
    })
    rt = enable_hybrid_attention(model, cfg)
    try:
        cache = HybridCache(model)
        with torch.no_grad():
            out = model.generate(inputs["ids"], attention_mask=inputs["mask"], past_key_values=cache,
                                 max_new_tokens=inputs["new_tokens"], min_new_tokens=inputs["new_tokens"],
                                 do_sample=False, pad_token_id=0)
        g = rt.geometry
        result = {
            "tokens": out[:, inputs["ids"].shape[1]:],
            "geometry": (g.layers, g.q_heads, g.kv_heads, g.head_dim),
            "kv_heads": list(rt.tensor_parallel.kv_heads(rt.model_geometry)),
            "kv": [[rt.store.full_kv(s, layer) for layer in range(g.layers)] for s in cache.seq_ids],
            "share": rt.core_share.cores,
            "worker_cores": rt.scheduler.cores.cpu,
            "caller_core": rt.scheduler.cores.caller,
            "launcher_affinity": sorted(os.sched_getaffinity(0)),
            "decode_steps": len(rt.timeline),
            "tasks": sum(r.n_tasks for r in rt.timeline.records),
        }
        cache.release()
    finally:
        disable_hybrid_attention(model)
    result["affinity_after_close"] = sorted(os.sched_getaffinity(0))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
