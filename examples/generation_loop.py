"""Drive HybridRuntime from a generation loop: prefill each layer's prompt KV, then decode.

Random KV stands in for a model's (a real loop passes each layer's post-RoPE keys, values and
queries). The runtime is built for the layers of the config's geometry: Llama-3.1-8B's first 4
in configs/quickstart.yaml. Run from the repository root: python examples/generation_loop.py
"""

import torch

from hybrid_runtime.config import load_config
from hybrid_runtime.runtime import HybridRuntime

cfg = load_config("configs/quickstart.yaml")
g = cfg.geometry
seq_ids, prompt_tokens, new_tokens = [0, 1], 4096, 4
torch.manual_seed(0)
with HybridRuntime(cfg) as rt:
    for seq_id in seq_ids:
        for layer in range(g.layers):
            k, v = torch.randn(2, prompt_tokens, g.kv_heads, g.head_dim)  # prompt KV [L, Hkv, D]
            rt.prefill(seq_id, layer, k[:3072], v[:3072])
            rt.prefill(seq_id, layer, k[3072:], v[3072:], extend=True)  # optional: the prompt's next chunk
    for step in range(new_tokens):
        for layer in range(g.layers):
            q = torch.randn(len(seq_ids), g.q_heads, g.head_dim)  # [B, Hq, D]
            k, v = torch.randn(2, len(seq_ids), g.kv_heads, g.head_dim)  # this token's KV [B, Hkv, D]
            out = rt.decode(layer, seq_ids, q, k, v)  # attention output [B, Hq, D]
    for seq_id in seq_ids:
        rt.release(seq_id)
    stats = rt.stats()
    print(f"{new_tokens} tokens x {g.layers} layers decoded for sequences {seq_ids}; output {tuple(out.shape)}")
    print(f"{stats['placement']} placement, {stats['cpu_workers']} CPU workers, {rt.timeline.summary()['tasks']} tasks")
