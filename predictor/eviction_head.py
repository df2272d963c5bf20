"""NOSA's eviction head: a per-token importance score from the token's value vector alone.

    s_e = softplus(v W1) W2            (one W1 [D, H], W2 [H] per layer and KV head)

It depends on nothing but the token's own value, so a token's score never changes once the token
exists: the property NOSA's locality bound (Theorem 2) needs. NOSA trains it with the model; here
it is distilled for a frozen model (`predictor.train_eviction_head`), and the NOSA executor uses it
to rank blocks only (its score does not enter the softmax: the frozen model never saw that bias).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


class EvictionHeads(nn.Module):
    """The eviction heads of every (layer, KV head) of a model, evaluated in one batched product."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, hidden: int = 32):
        super().__init__()
        self.layers, self.kv_heads, self.head_dim, self.hidden = layers, kv_heads, head_dim, hidden
        self.w1 = nn.Parameter(torch.randn(layers, kv_heads, head_dim, hidden) / head_dim**0.5)
        self.w2 = nn.Parameter(torch.randn(layers, kv_heads, hidden) / hidden**0.5)

    def forward(self, layer: int, v: torch.Tensor) -> torch.Tensor:
        """Scores `[Hkv, T]` of the values `v [Hkv, T, D]` of one layer (computed in fp32)."""
        h = F.softplus(torch.einsum("htd,hdk->htk", v.float(), self.w1[layer]))
        return torch.einsum("htk,hk->ht", h, self.w2[layer])

    def all_layers(self, v: torch.Tensor) -> torch.Tensor:
        """Scores `[L, Hkv, T]` of values `[L, Hkv, T, D]` of every layer (training)."""
        h = F.softplus(torch.einsum("lhtd,lhdk->lhtk", v.float(), self.w1))
        return torch.einsum("lhtk,lhk->lht", h, self.w2)

    def geometry(self) -> dict:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "hidden": self.hidden}


def save_eviction_heads(heads: EvictionHeads, path: str | Path, info: dict | None = None) -> None:
    """Write the weights, their geometry and `info` (training settings, metrics) to `path`."""
    torch.save({"geometry": heads.geometry(), "state": heads.state_dict(), "info": info or {}}, path)


def load_eviction_heads(path: str | Path, device: str | torch.device = "cpu") -> EvictionHeads:
    """The heads saved by `save_eviction_heads`; ValueError naming the file when it is not one."""
    try:
        data = torch.load(path, map_location=device, weights_only=True)
        heads = EvictionHeads(**data["geometry"])
        heads.load_state_dict(data["state"])
    except (KeyError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path}: not an eviction-head checkpoint written by predictor.train_eviction_head ({e})") from None
    return heads.to(device).eval().requires_grad_(False)


__all__ = ["EvictionHeads", "load_eviction_heads", "save_eviction_heads"]
