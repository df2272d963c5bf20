"""The AsyncTLS index of the CPU-resident keys, kept on the device: Quest block metadata for the
block level and an INT4 copy of a few calibrated channels of every key for the token level.

Both mirror the CPU store chunk by chunk (`cpu_kernels/layout.py`): row `c` of every index
tensor describes arena chunk `c` of the same layer, so a task's chunk ids address its index as
they address its KV, and the index costs memory in proportion to what the store holds:

* `block_meta[layer]` `[n_chunks, 128 / blk, 2, D]` (store dtype): key (min, max) of every block
  of the level-1 block size, copied from the chunk's own metadata rows;
* `codes[layer]` `[n_chunks, 128, d_c / 2]` uint8: the key's `d_c` calibrated channels of its KV
  head (Double Sparsity's label channels), quantized per token to 4 bits, two to a byte;
* `qparams[layer]` `[n_chunks, 128, 2]` float32: each token's (scale, minimum).

Per token, `x ~ min + scale * code` with `scale = (max - min) / 15` over its `d_c` values, so the
round trip is off by at most `scale / 2` in every channel (`dequantize_int4`).

`ChannelSets` is the calibration: per layer and KV head the channels ranked by
`mean_h max|q_h[i]| * max|k[i]|` over calibration text (`experiments/asynctls_calibration.py`
writes it; `hybrid_runtime/calibration/smollm2_channels.json` is SmolLM2-135M's), of which the
index keeps the first `d_c`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from cpu_kernels import layout
from hybrid_runtime.config import ConfigError, GeometryConfig

INT4_LEVELS = 15  # codes 0..15
QPARAM_BYTES = 8  # scale and minimum, float32


# ---------------------------------------------------------------------------- INT4
def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., C]` (C even) -> (codes `[..., C/2]` uint8, two per byte, low nibble first;
    params `[..., 2]` float32 (scale, min)) with per-row asymmetric 4-bit quantization."""
    if x.shape[-1] % 2:
        raise ValueError(f"quantize_int4: {x.shape[-1]} channels; needs an even number (two codes per byte)")
    x = x.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / INT4_LEVELS
    # A constant row has scale 0: every code is 0 and the row comes back exactly as its minimum.
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((x - lo) * inv).clamp_(0, INT4_LEVELS).to(torch.uint8)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return codes, torch.cat([scale, lo], -1)


def dequantize_int4(codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The float32 values `[..., C]` of `quantize_int4`'s output."""
    lo4 = (codes & 0x0F).float()
    hi4 = (codes >> 4).float()
    q = torch.stack([lo4, hi4], -1).flatten(-2)
    return params[..., 1:2] + params[..., 0:1] * q


# ---------------------------------------------------------------------------- calibration file
@dataclass(frozen=True)
class ChannelSets:
    """Calibrated channels: `ranked[layer][kv_head]` all `head_dim` channels, most important first."""

    model: str
    layers: int
    kv_heads: int
    head_dim: int
    ranked: torch.Tensor  # [layers, kv_heads, head_dim] int64
    scores: torch.Tensor  # [layers, kv_heads, head_dim] float32, in channel order
    calibration: dict  # what it was calibrated on (text, tokens, command)

    def channels(self, d_c: int) -> torch.Tensor:
        """`[layers, kv_heads, d_c]` int64: the first `d_c` ranked channels, ascending per head."""
        if not 2 <= d_c <= self.head_dim or d_c % 2:
            raise ValueError(f"d_c {d_c}: allowed an even number from 2 to head_dim {self.head_dim}")
        return self.ranked[..., :d_c].sort(-1).values

    def check_geometry(self, geometry: GeometryConfig, what: str) -> None:
        """ConfigError (naming `what`) unless this calibration covers the geometry's layers and heads."""
        if (self.kv_heads, self.head_dim) != (geometry.kv_heads, geometry.head_dim) or self.layers < geometry.layers:
            raise ConfigError(
                f"{what}: calibrated for {self.model!r} ({self.layers} layers, {self.kv_heads} KV heads, head dim "
                f"{self.head_dim}) but the runtime's geometry {geometry.name!r} has {geometry.layers} layers, "
                f"{geometry.kv_heads} KV heads, head dim {geometry.head_dim}; allowed: a channel file calibrated for "
                "this model (python -m hybrid_runtime.experiments.asynctls_calibration)")

    def to_json(self) -> dict:
        return {"model": self.model, "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "calibration": self.calibration, "ranked": self.ranked.tolist(),
                "scores": [[[float(f"{x:.4g}") for x in h] for h in layer] for layer in self.scores.tolist()]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ChannelSets":
        """Read a channel file; ValueError naming the file when it is not one."""
        try:
            data = json.loads(Path(path).read_text())
            ranked = torch.tensor(data["ranked"], dtype=torch.int64)
            scores = torch.tensor(data["scores"], dtype=torch.float32)
            sets = cls(str(data["model"]), int(data["layers"]), int(data["kv_heads"]), int(data["head_dim"]), ranked,
                       scores, dict(data.get("calibration", {})))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a channel file ({exc}); write one with "
                             "python -m hybrid_runtime.experiments.asynctls_calibration") from None
        shape = (sets.layers, sets.kv_heads, sets.head_dim)
        perm_ok = ranked.shape == shape and bool((ranked.sort(-1).values == torch.arange(sets.head_dim)).all())
        if not perm_ok or scores.shape != shape:
            raise ValueError(f"{path}: `ranked` must hold a permutation of 0..{sets.head_dim - 1} for each of "
                             f"{sets.layers} x {sets.kv_heads} heads and `scores` the same shape")
        return sets

    @classmethod
    def from_scores(cls, scores: torch.Tensor, model: str, calibration: dict) -> "ChannelSets":
        """Channels ranked by `scores [layers, kv_heads, head_dim]` (higher first, ties to the lower channel)."""
        scores = scores.float()
        ranked = torch.sort(-scores, dim=-1, stable=True).indices
        layers, hkv, d = scores.shape
        return cls(model, layers, hkv, d, ranked, scores, calibration)


def channel_scores(q_absmax: torch.Tensor, k_absmax: torch.Tensor) -> torch.Tensor:
    """Double Sparsity's channel importance `mean_h max|q_h[i]| * max|k[i]|` of one layer.

    `q_absmax [Hq, D]` (max over tokens of each query head), `k_absmax [Hkv, D]` -> `[Hkv, D]`;
    the query heads of a group are consecutive (`h // G` is their KV head).
    """
    hkv, d = k_absmax.shape
    return q_absmax.float().view(hkv, -1, d).mean(1) * k_absmax.float()


# ---------------------------------------------------------------------------- the index
def index_bytes(n_chunks: int, head_dim: int, d_c: int, block_size: int, meta_element_size: int) -> int:
    """Bytes of one layer's index over `n_chunks` arena chunks (what `TokenIndex` allocates)."""
    tokens = n_chunks * layout.CHUNK_TOKENS
    meta = n_chunks * (layout.CHUNK_TOKENS // block_size) * 2 * head_dim * meta_element_size
    return tokens * (d_c // 2 + QPARAM_BYTES) + meta


class TokenIndex:
    """Block metadata and INT4 token codes of every arena chunk of every layer, on `device`.

    `channels [layers, Hkv, d_c]`: the channels each KV head's codes keep. `refresh(layer, chunk_ids,
    kv_head_of_chunk, chunks)` rebuilds the index rows of those chunks from their arena images
    (`[m, CHUNK_ROWS, D]`, keys, values and metadata as the store wrote them): at prefill for every
    chunk of the prompt, after a spill for the chunks it touched.
    """

    def __init__(self, n_chunks: int, layers: int, head_dim: int, channels: torch.Tensor, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        if block_size not in layout.META_ENTRY_OFFSET:
            raise ValueError(f"block size {block_size}: allowed {layout.BLOCK_SIZES}")
        self.block_size = block_size
        self.d_c = int(channels.shape[-1])
        self.head_dim = head_dim
        self.device = device
        self.channels = channels.to(device)
        per = layout.CHUNK_TOKENS // block_size
        ct = layout.CHUNK_TOKENS
        self.block_meta = [torch.zeros((n_chunks, per, 2, head_dim), dtype=dtype, device=device) for _ in range(layers)]
        self.codes = [torch.zeros((n_chunks, ct, self.d_c // 2), dtype=torch.uint8, device=device) for _ in range(layers)]
        self.qparams = [torch.zeros((n_chunks, ct, 2), dtype=torch.float32, device=device) for _ in range(layers)]
        self._meta_rows = torch.tensor(
            [layout.META_ROW + 2 * (layout.meta_entry_offset(block_size) + i) + j for i in range(per) for j in (0, 1)],
            device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in (self.block_meta, self.codes, self.qparams) for t in ts)

    def refresh(self, layer: int, chunk_ids: torch.Tensor, kv_heads: torch.Tensor, images: torch.Tensor) -> None:
        """Rebuild the rows of `chunk_ids [m]` (on the index's device) from their arena `images [m, ROWS, D]`,
        whose keys belong to `kv_heads [m]`."""
        per = layout.CHUNK_TOKENS // self.block_size
        meta = images.index_select(1, self._meta_rows).view(-1, per, 2, self.head_dim)
        self.block_meta[layer][chunk_ids] = meta.to(self.block_meta[layer].dtype)
        keys = images[:, layout.K_ROW : layout.K_ROW + layout.CHUNK_TOKENS]  # [m, 128, D]
        ch = self.channels[layer, kv_heads]  # [m, d_c]
        picked = keys.gather(2, ch[:, None, :].expand(-1, layout.CHUNK_TOKENS, -1))
        codes, params = quantize_int4(picked)
        self.codes[layer][chunk_ids] = codes
        self.qparams[layer][chunk_ids] = params

    def keys(self, layer: int, chunk_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Dequantized index keys `[..., d_c]` float32 of the tokens at (`chunk_ids`, `rows`) (same shapes)."""
        return dequantize_int4(self.codes[layer][chunk_ids, rows], self.qparams[layer][chunk_ids, rows])


__all__ = ["ChannelSets", "TokenIndex", "channel_scores", "dequantize_int4", "index_bytes", "quantize_int4"]
