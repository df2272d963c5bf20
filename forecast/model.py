"""Selection queries for the next layer: the trained Forecast and the training-free proxy.

Both turn layer `l`'s attention input `x` (its hidden state after the input norm, what its q/k/v
projections read) at the decode position into queries that score layer `l + 1`'s compressed
keys (`forecast.grid.group_block_scores`), so layer `l + 1`'s blocks can be chosen -- and
fetched -- while layer `l` computes:

* `Forecast` (SparDA): one head per KV group, `F_l = x W_F[l]` (`d_model -> Hkv * D`), rotated
  like a query at the decode position (the compressed keys are means of rotated keys); scored
  raw against the windows. `W_F` is the only trained weight; `W_F[l]` starts from the mean over
  each group's heads of layer `l + 1`'s query projection, so training starts at the proxy's
  single-head form.
* `ProxyQueries` (InfiniGen-style, training-free): `x` through layer `l + 1`'s own query
  projection and rotary embedding, one query per head, scored per head.

A checkpoint (`Forecast.save`) is one `torch.save` file: `W_F` in bf16 and a `meta` dict (the
geometry it serves, how it was trained, held-out metrics).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the Llama convention, halves rotated) of `x [..., H, D]` with `cos, sin
    [..., D]` of its position."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[..., None, :] + rot * sin[..., None, :]


class Forecast(nn.Module):
    """`W_F [L - 1, d_model, Hkv * D]`: row `l` forecasts layer `l + 1`'s blocks from layer `l`'s input.

    Trained as `W0 + A @ B` (`A [L-1, d_model, r]`, `B [L-1, r, Hkv*D]`, `W0` frozen) with `rank`
    r; `rank=0` trains the full matrix. Saved and used materialised (`weight`).
    """

    def __init__(self, init: torch.Tensor, kv_heads: int, head_dim: int, rank: int = 0):
        super().__init__()
        n, d_model, out = init.shape
        if out != kv_heads * head_dim:
            raise ValueError(f"W_F maps to {out} values; expected kv_heads * head_dim = {kv_heads * head_dim}")
        self.kv_heads, self.head_dim, self.rank = kv_heads, head_dim, rank
        self.register_buffer("w0", init.float().clone())
        if rank:
            # A starts at zero, so W_F starts at W0; B random so A gets gradients.
            self.a = nn.Parameter(torch.zeros(n, d_model, rank))
            self.b = nn.Parameter(torch.randn(n, rank, out) / out**0.5)
        else:
            self.delta = nn.Parameter(torch.zeros(n, d_model, out))

    @property
    def layers(self) -> int:
        """Layers of the model served (W_F has one row fewer: the last layer has no next layer)."""
        return self.w0.shape[0] + 1

    @property
    def weight(self) -> torch.Tensor:
        return self.w0 + (self.a @ self.b if self.rank else self.delta)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers: slice | None = None) -> torch.Tensor:
        """`x [L', ..., d_model]` (layers `layers` of `0..L-2`, default all), `cos, sin [..., D]` ->
        rotated forecasts `[L', ..., Hkv, D]`."""
        w = self.weight if layers is None else self.weight[layers]
        f = torch.einsum("l...i,lio->l...o", x.float(), w)
        return rotate(f.reshape(*f.shape[:-1], self.kv_heads, self.head_dim), cos.float(), sin.float())

    # ------------------------------------------------------------------ checkpoint
    def save(self, path: str | Path, meta: dict) -> None:
        torch.save({"weight": self.weight.detach().to(torch.bfloat16).contiguous(), "kv_heads": self.kv_heads,
                    "head_dim": self.head_dim, "meta": meta}, path)


class ForecastQueries:
    """A saved Forecast at inference: `queries(layer, x, cos, sin)` for layer `layer + 1`."""

    def __init__(self, weight: torch.Tensor, kv_heads: int, head_dim: int, meta: dict | None = None):
        self.weight = weight  # [L - 1, d_model, Hkv * D]
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.meta = meta or {}

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> "ForecastQueries":
        data = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"weight", "kv_heads", "head_dim"} - set(data)
        if missing:
            raise ValueError(f"{path}: not a Forecast checkpoint (missing {sorted(missing)}); write one with python -m forecast.train")
        return cls(data["weight"].to(device=device, dtype=dtype), int(data["kv_heads"]), int(data["head_dim"]),
                   data.get("meta"))

    @property
    def layers(self) -> int:
        return self.weight.shape[0] + 1

    @property
    def d_model(self) -> int:
        return self.weight.shape[1]

    def queries(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s input `x [B, d_model]` at positions with `cos, sin [B, D]` -> `[B, Hkv, D]`."""
        f = x.to(self.weight.dtype) @ self.weight[layer]
        return rotate(f.view(x.shape[0], self.kv_heads, self.head_dim), cos.to(f.dtype), sin.to(f.dtype))


class ProxyQueries:
    """InfiniGen-style proxy: layer `l`'s input through layer `l + 1`'s query projection, per head."""

    def __init__(self, q_weights: Sequence[torch.Tensor], q_biases: Sequence[torch.Tensor | None], q_heads: int,
                 head_dim: int):
        self.w = list(q_weights)  # per layer [Hq * D, d_model]; layer 0's is never used
        self.b = list(q_biases)
        self.q_heads, self.head_dim = q_heads, head_dim

    @classmethod
    def from_attention_modules(cls, modules: Sequence[Any]) -> "ProxyQueries":
        """From a Llama-style model's attention modules (their `q_proj`, shared, not copied)."""
        m0 = modules[0]
        hq = m0.q_proj.weight.shape[0] // m0.head_dim
        return cls([m.q_proj.weight for m in modules], [m.q_proj.bias for m in modules], hq, m0.head_dim)

    @property
    def layers(self) -> int:
        return len(self.w)

    def queries(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s input `x [B, d_model]` -> layer `layer + 1`'s proxy queries `[B, Hq, D]`."""
        w, b = self.w[layer + 1], self.b[layer + 1]
        q = torch.nn.functional.linear(x.to(w.dtype), w, b)
        return rotate(q.view(x.shape[0], self.q_heads, self.head_dim), cos.to(q.dtype), sin.to(q.dtype))

    def group_mean_weights(self, kv_heads: int) -> torch.Tensor:
        """`[L - 1, d_model, Hkv * D]`: per layer `l`, layer `l + 1`'s query projection averaged over
        each group's heads (the Forecast's starting point; biases are dropped)."""
        out = []
        for w in self.w[1:]:
            d_model = w.shape[1]
            g = self.q_heads // kv_heads
            wm = w.float().view(kv_heads, g, self.head_dim, d_model).mean(1)  # [Hkv, D, d_model]
            out.append(wm.reshape(kv_heads * self.head_dim, d_model).t())
        return torch.stack(out)


__all__ = ["Forecast", "ForecastQueries", "ProxyQueries", "rotate"]
