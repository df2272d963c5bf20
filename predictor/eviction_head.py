"""NOSA's eviction head: a per-token importance score from one of the token's own vectors.

    s_e = softplus(x W1) W2            (one W1 [D, H], W2 [H] per layer and KV head)

where `x` is the token's value (`source` "value", NOSA's head) or its post-RoPE key ("key"). It
depends on nothing but the token's own vector, so a token's score never changes once the token
exists: the property NOSA's locality bound (Theorem 2) needs. NOSA trains it with the model; here
it is distilled for a frozen model (`predictor.train_eviction_head`), and the NOSA executor uses it
to rank blocks only (its score does not enter the softmax: the frozen model never saw that bias).

Why a key source: in NOSA the model is trained with the head (its score enters the softmax as a
bias), so the values learn to carry it. In a frozen model the attention a token receives is set by
its key (`q . k`), and its value carries little of it: on SmolLM2 a value head ranks blocks barely
better than chance, a key head well (benchmarks/notes/nosa.md, section 6).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


#: What an eviction head reads: the token's value (NOSA's head) or its post-RoPE key.
SOURCES = ("value", "key")


class EvictionHeads(nn.Module):
    """The eviction heads of every (layer, KV head) of a model, evaluated in one batched product."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, hidden: int = 32, source: str = "value"):
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"eviction head source {source!r}; allowed: {', '.join(SOURCES)}")
        self.layers, self.kv_heads, self.head_dim, self.hidden = layers, kv_heads, head_dim, hidden
        self.source = source
        self.w1 = nn.Parameter(torch.randn(layers, kv_heads, head_dim, hidden) / head_dim**0.5)
        self.w2 = nn.Parameter(torch.randn(layers, kv_heads, hidden) / hidden**0.5)

    def pick(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The input the heads read, of a token's key `k` and value `v` (any matching shapes)."""
        return k if self.source == "key" else v

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Scores `[Hkv, T]` of one layer's inputs `x [Hkv, T, D]` (`pick`; computed in fp32)."""
        h = F.softplus(torch.einsum("htd,hdk->htk", x.float(), self.w1[layer]))
        return torch.einsum("htk,hk->ht", h, self.w2[layer])

    def all_layers(self, x: torch.Tensor) -> torch.Tensor:
        """Scores `[L, Hkv, T]` of inputs `[L, Hkv, T, D]` of every layer (training)."""
        h = F.softplus(torch.einsum("lhtd,lhdk->lhtk", x.float(), self.w1))
        return torch.einsum("lhtk,lhk->lht", h, self.w2)

    def geometry(self) -> dict:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "hidden": self.hidden,
                "source": self.source}


def save_eviction_heads(heads: EvictionHeads, path: str | Path, info: dict | None = None) -> None:
    """Write the weights, their geometry and `info` (training settings, metrics) to `path`."""
    torch.save({"geometry": heads.geometry(), "state": heads.state_dict(), "info": info or {}}, path)


def load_eviction_heads(path: str | Path, device: str | torch.device = "cpu") -> EvictionHeads:
    """The heads saved by `save_eviction_heads`; ValueError naming the file when it is not one."""
    try:
        data = torch.load(path, map_location=device, weights_only=True)
        heads = EvictionHeads(**data["geometry"])  # a checkpoint without `source` reads values
        heads.load_state_dict(data["state"])
    except (KeyError, TypeError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path}: not an eviction-head checkpoint written by predictor.train_eviction_head ({e})") from None
    return heads.to(device).eval().requires_grad_(False)


__all__ = ["SOURCES", "EvictionHeads", "load_eviction_heads", "save_eviction_heads"]
