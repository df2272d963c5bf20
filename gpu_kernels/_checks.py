"""Argument checks shared by the kernel wrappers: every bad shape or dtype fails with a message
naming the argument, what it got and what it needs, before anything is launched."""

from __future__ import annotations

import os
from typing import Sequence

import torch

# Storage dtypes the kernels read (K, V, metadata); queries and results are always fp32.
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_tensor(
    name: str,
    t: object,
    *,
    dims: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument; `shape` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device and not same_device(t.device, device):
        raise ValueError(f"{name} is on {t.device}; expected {device} (like the other inputs)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    """Devices equal up to the default CUDA index ('cuda' == 'cuda:0' when 0 is current)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    cur = torch.cuda.current_device()
    return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)


def check_head_dim(d: int) -> None:
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim {d} is not supported; the kernels need a power of two >= 16")


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host. Plain Python: `triton.cdiv` and `triton.next_power_of_2` are
    constexpr functions costing ~6 us a call, several per launch on the GPU lane's hot path."""
    return -(-a // b)


def interpreted() -> bool:
    """Kernels run under Triton's interpreter (decided when the kernel modules were imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_in_fp32(kv_dtype: torch.dtype) -> bool:
    """Whether the attention dots take fp32 operands (tf32 on the GPU) instead of the storage dtype.

    fp32 storage does; so does everything under the interpreter, whose bf16 `tl.dot` is wrong
    (Triton 3.9: it multiplies the raw bits), so CPU tests check the fp32-operand variant and the
    device tests check the bf16 one.
    """
    return kv_dtype == torch.float32 or interpreted()


def dot_precision(kv_dtype: torch.dtype) -> str:
    """`input_precision` of the kernels' fp32-operand dots.

    fp32 storage is the exactness path (budget 1.0 must reproduce dense attention), so its dots
    are full fp32 ("ieee"); bf16 and fp16 values are exact in tf32, so theirs run on tensor
    cores ("tf32") and only q and the softmax weights round to tf32's 10-bit mantissa.
    """
    return "ieee" if kv_dtype == torch.float32 else "tf32"
