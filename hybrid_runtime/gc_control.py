"""Keep Python's cyclic garbage collector off the decode path's critical section.

Measured on the reference machine: a generation-2 collection during decoding walks every tracked
object of the process (torch, transformers, the model's modules: hundreds of thousands) and took
98-233 ms, about one per 80 layer-steps; with the collector off, those stalls were gone. A
runtime is made after the model and the libraries are loaded, so what is alive then lives for
the whole process: `freeze_collector` moves it into the collector's permanent generation
(`gc.freeze`, CPython's tool for exactly this), and later collections walk only what was made
since. Collection itself stays on: cycles made after the freeze are still reclaimed.

The last runtime to close unfreezes (`thaw_collector`), and so does interpreter exit: frozen
objects are never finalised, which extension modules report as leaks at shutdown.

Config `scheduler.gc_freeze` (default true) turns this off for processes that rely on collecting
cycles that already exist when the runtime starts.
"""

from __future__ import annotations

import atexit
import gc
import threading

_lock = threading.Lock()
_holders = 0
_atexit_registered = False


def freeze_collector() -> int:
    """Collect once, then freeze every object alive now; returns how many are frozen.

    Each call must be paired with one `thaw_collector` (the runtime's `close`).
    """
    global _holders, _atexit_registered
    with _lock:
        gc.collect()
        gc.freeze()
        _holders += 1
        if not _atexit_registered:
            atexit.register(gc.unfreeze)
            _atexit_registered = True
        return gc.get_freeze_count()


def thaw_collector() -> None:
    """Undo one `freeze_collector`; the last one returns every frozen object to the collector."""
    global _holders
    with _lock:
        if _holders > 0:
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()


__all__ = ["freeze_collector", "thaw_collector"]
