"""Small builders shared by the tests."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_runtime.config import Config, config_from_dict
from hybrid_runtime.kvcache import KVStore


def small_config(**kv: Any) -> Config:
    geometry = kv.pop("geometry", {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32})
    kv_cache = {"sink": 4, "local": 32, "generated_cap": 32, "cpu_capacity_tokens": 4096, "max_sequences": 4}
    kv_cache.update(kv)
    return config_from_dict({"geometry": geometry, "kv_cache": kv_cache})


def make_store(**kv: Any) -> KVStore:
    cfg = small_config(**kv)
    return KVStore(cfg.kv_cache, cfg.geometry)


def random_kv(length: int, kv_heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(length, kv_heads, head_dim, generator=gen)
    v = torch.randn(length, kv_heads, head_dim, generator=gen)
    return k, v
