"""What the host and its GPU can read at best (host read, pinned H2D, UVA gather, concurrent
ceiling): the measurements live in `hybrid_runtime.profiling.machine_limits`, which
`hybrid-runtime probe` also runs; the benchmarks import them from here."""

from hybrid_runtime.profiling.machine_limits import (  # noqa: F401
    concurrent_ceiling,
    h2d_bandwidth,
    host_read_bandwidth,
    overlap_rates,
    uva_gather_bandwidth,
)

__all__ = ["concurrent_ceiling", "h2d_bandwidth", "host_read_bandwidth", "overlap_rates", "uva_gather_bandwidth"]
