"""CUDA views of pinned host memory (unified virtual addressing, zero copy).

A kernel that reads through such a view pulls exactly the bytes it touches over PCIe, straight
from host memory: no staging buffer, no whole-sequence copy. The view is an ordinary CUDA tensor
(Triton and torch ops accept it), made once per arena and cached by the KV store.

How: ask the CUDA runtime for the device address of the pinned host pointer
(`cudaPointerGetAttributes`, through cupy when it is installed; on 64-bit UVA platforms it equals
the host address, which is the fallback), then hand torch a small owner object exposing
`__cuda_array_interface__`. torch keeps a reference to that owner for as long as any tensor
aliases the memory, and the owner keeps the host tensor, so the pinned buffer cannot be freed
under a live view.
"""

from __future__ import annotations

import torch

# numpy-style type strings understood by `__cuda_array_interface__`; bf16 has none, so it travels
# as int16 and is reinterpreted (same bits) afterwards.
_TYPESTR = {
    torch.float32: ("<f4", None),
    torch.float16: ("<f2", None),
    torch.bfloat16: ("<i2", torch.int16),
    torch.int32: ("<i4", None),
    torch.int16: ("<i2", None),
    torch.uint8: ("|u1", None),
    torch.int8: ("|i1", None),
    torch.int64: ("<i8", None),
}

_CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: page-locked host memory known to CUDA


class _PinnedOwner:
    """Keeps the host tensor alive and describes its memory to torch as device memory."""

    def __init__(self, host: torch.Tensor, device_ptr: int, typestr: str):
        self.host = host  # the reference that keeps the pinned allocation alive
        esize = host.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "strides": tuple(s * esize for s in host.stride()),
            "typestr": typestr,
            "data": (device_ptr, False),
            "version": 3,
        }


def _device_pointer(host_ptr: int) -> int:
    """Device address of a pinned host address; raises ValueError when CUDA does not know it."""
    try:
        import cupy.cuda.runtime as rt
    except ImportError:
        # Every 64-bit platform CUDA supports has unified addressing: pinned host memory is
        # mapped into the device's address space at the same address.
        return host_ptr
    attrs = rt.pointerGetAttributes(host_ptr)
    if attrs.type != _CUDA_MEMORY_TYPE_HOST:
        raise ValueError(
            f"uva_view: CUDA reports memory type {attrs.type} for address {host_ptr:#x}; "
            "expected page-locked (pinned) host memory"
        )
    return int(attrs.devicePointer)


def uva_view(host: torch.Tensor, device: int | None = None) -> torch.Tensor:
    """A CUDA tensor aliasing the pinned host tensor `host` (same shape, strides and dtype).

    `device` is the CUDA device index to map into (default: the current one). Writes on either
    side are visible on the other (after the usual stream ordering). Raises
    RuntimeError without CUDA and ValueError for tensors that are not pinned CPU tensors.
    """
    if not isinstance(host, torch.Tensor):
        raise TypeError(f"uva_view expects a torch.Tensor, got {type(host).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "uva_view needs a CUDA device: there is no GPU to map pinned host memory into "
            "(torch.cuda.is_available() is False)"
        )
    if host.device.type != "cpu":
        raise ValueError(f"uva_view expects a host (cpu) tensor, got one on {host.device}")
    if host.dtype not in _TYPESTR:
        raise ValueError(f"uva_view: unsupported dtype {host.dtype}; supported: {sorted(map(str, _TYPESTR))}")
    if not host.is_pinned():
        raise ValueError(
            "uva_view: the host tensor is not pinned (page-locked); allocate it with "
            "pin_memory=True or call .pin_memory() once, outside the hot path"
        )
    if host.numel() == 0:
        raise ValueError("uva_view: the host tensor is empty")
    typestr, carrier = _TYPESTR[host.dtype]
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else int(device))
    with torch.cuda.device(dev):
        owner = _PinnedOwner(host, _device_pointer(host.data_ptr()), typestr)
        view = torch.as_tensor(owner, device=dev)
    if view.data_ptr() != owner.__cuda_array_interface__["data"][0]:
        raise RuntimeError("uva_view: torch copied the memory instead of aliasing it")
    if carrier is not None:
        view = view.view(host.dtype)
    return view
