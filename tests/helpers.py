"""Small builders shared by the tests."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import numpy as np
import torch

from hybrid_runtime.config import Config, config_from_dict
from hybrid_runtime.kvcache import KVStore

# Where tests run the Triton kernels: compiled on CUDA where there is one, else on CPU tensors under
# Triton's interpreter (conftest.py and gpu_kernels/__init__.py set TRITON_INTERPRET before any kernel
# module is imported). Tests build their inputs on the host, move them to DEV for the kernels and
# the executors' device state, and compare on the host.
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


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


@contextlib.contextmanager
def reversed_interpreter_grid() -> Iterator[list[int]]:
    """Triton's interpreter runs a launch's programs one after another, x outermost, each seeing
    what earlier ones stored; a GPU runs them in any order, concurrently. Inside this context the
    interpreter runs them last first (program (x, y, z) in slot (nx-1-x, ny-1-y, nz-1-z)), so a
    kernel whose result depends on program order differs from its in-order run. Yields a list
    whose one entry counts the programs run reversed (a test checks it ran any). Interpreter only."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    real = type(builder).set_grid_idx
    ran = [0]

    def set_grid_idx(x: int, y: int, z: int) -> None:
        nx, ny, nz = builder.grid_dim
        ran[0] += 1
        real(builder, nx - 1 - x, ny - 1 - y, nz - 1 - z)

    builder.set_grid_idx = set_grid_idx
    try:
        yield ran
    finally:
        del builder.set_grid_idx


class RefClaims:
    """The torch reference executor behind the GPU lane's claim interface (`GpuLaunchExecutor`):
    the base of the test doubles whose claims finish when a test says. `run_claim` runs a claim's
    tasks at once on the host; a subclass's `launch` wraps the result in its own handle."""

    stream = None
    link_bytes_per_s = None

    def __init__(self, store):
        from hybrid_runtime.executors.torch_ref import TorchRefExecutor

        self.ref = TorchRefExecutor(store, device="cpu")

    @property
    def bytes_read(self) -> int:
        return self.ref.bytes_read

    def pack(self, tab, nsel, chunks):
        return None

    def upload(self, packed, ordered, resident=False):
        return ordered

    def run_claim(self, plan, start: int, stop: int, step) -> tuple[list, float, float, np.ndarray]:
        """(the claim's tasks, host start, host end, bytes each task read)."""
        tasks = plan[start:stop]
        t0 = time.perf_counter()
        self.ref.run(tasks, step)
        t1 = time.perf_counter()
        return tasks, t0, t1, np.fromiter((t.bytes_read for t in tasks), dtype=np.int64, count=len(tasks))



def chained_decode(rt: Any, lengths: list[int], inputs: list, steps: int = 120, heads: tuple = (8, 2), d: int = 64,
                   layers: int = 3, after_step: Any = None) -> torch.Tensor:
    """`steps` layer-steps of `rt` (on CUDA) chained as in a model: each layer's q comes from the
    previous layer's output on the GPU, with no host sync between them, over sequences of `lengths`
    prefilled at every layer. An empty `inputs` is filled with the (q, k, v) of each layer-step; a
    filled one is fed back instead (a second runtime given the first one's inputs). `after_step(i)`
    runs after layer-step i's `decode`. Returns the outputs stacked."""
    hq, hkv = heads
    n = len(lengths)
    for s, length in enumerate(lengths):
        for layer in range(layers):
            rt.prefill(s, layer, *(x.cuda() for x in random_kv(length, hkv, d, seed=10 * s + layer)))
    record = not inputs
    gen = torch.Generator(device="cuda").manual_seed(0)
    mix = torch.randn(d, d, generator=gen, device="cuda") / 8
    q = torch.randn(n, hq, d, generator=gen, device="cuda")
    got = []
    for i in range(steps):
        if record:
            k = torch.randn(n, hkv, d, generator=gen, device="cuda")
            v = torch.randn(n, hkv, d, generator=gen, device="cuda")
            inputs.append((q, k, v))
        else:
            q, k, v = inputs[i]
        out = rt.decode(i % layers, list(range(n)), q, k, v)
        if after_step is not None:
            after_step(i)
        got.append(out)
        if record:
            q = torch.tanh(out @ mix) * 4  # the next layer's query depends on this output
    return torch.stack(got)


def store_after(arr: Any, index: int, value: int, after_s: float = 0.0) -> threading.Thread:
    """A thread that stores `value` into `arr[index]` `after_s` seconds from now (an aligned 8-byte
    store, which the native workers' acquire loads see): what another agent -- a test's gate, the
    device's stream write -- does to a word the workers wait on. Started; join it."""
    def go() -> None:
        time.sleep(after_s)
        arr[index] = value

    th = threading.Thread(target=go)
    th.start()
    return th
