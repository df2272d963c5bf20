"""What a dense forward of a Llama-style transformers model gives the Forecast's training and evaluation.

Per layer, from a forward pre-hook on its attention module (so nothing of the model changes):
the attention input `x` (hidden state after the input norm) and the post-RoPE query at the
chosen decode positions, the post-RoPE keys of every token, and the rotary `cos, sin` at those
positions -- recomputed from the module's own projections and the rotary embedding it is given.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from forecast.model import rotate


def attention_modules(model: Any) -> list:
    """The `self_attn` modules of a Llama-style model's decoder layers, in order."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None) or model
    return [layer.self_attn for layer in base.layers]


@contextlib.contextmanager
def capturing(model: Any, positions: Sequence[int]) -> Iterator[dict]:
    """Within the block, a forward of batch 1 fills the yielded dict as `capture` returns it (for a
    caller that runs the forward itself, e.g. beside other hooks)."""
    dev = next(model.parameters()).device
    positions = torch.as_tensor(list(positions), dtype=torch.long, device=dev)
    layers = len(attention_modules(model))
    raw: dict = {"x": [None] * layers, "q": [None] * layers, "k": [None] * layers}
    rec: dict = {}
    handles = []

    def hook(module, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        d = module.head_dim
        x = h[0].float()  # [T, d_model]
        k = module.k_proj(h[0]).float().view(x.shape[0], -1, d)
        q = module.q_proj(h[0, positions]).float().view(len(positions), -1, d)
        layer = module.layer_idx
        raw["x"][layer] = x[positions]
        raw["k"][layer] = rotate(k, cos[0].float(), sin[0].float())
        raw["q"][layer] = rotate(q, cos[0, positions].float(), sin[0, positions].float())
        if layer == layers - 1:
            rec.update({name: torch.stack(raw[name]) for name in ("x", "q", "k")})
            rec["cos"], rec["sin"] = cos[0, positions].float(), sin[0, positions].float()

    for m in attention_modules(model):
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture(model: Any, ids: torch.Tensor, positions: Sequence[int]) -> dict:
    """Dense forward over `ids [T]`. Returns float32 tensors on the model's device: `x [L, n,
    d_model]`, `q [L, n, Hq, D]` at `positions` (n of them, in the order given), `k [L, T, Hkv,
    D]`, `cos, sin [n, D]`."""
    dev = next(model.parameters()).device
    with capturing(model, positions) as rec:
        model(input_ids=ids.view(1, -1).to(dev), use_cache=False, logits_to_keep=1)
    return rec


__all__ = ["attention_modules", "capture", "capturing"]
