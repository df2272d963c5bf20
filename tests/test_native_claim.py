"""The native claim launcher (`gpu_kernels/native_claim.py`) against stand-in driver functions.

Without CUDA the real driver is absent, so the launcher is compiled against ctypes callbacks that
record their calls: what the numba function writes into the descriptor row, which driver calls it
makes in which order with which arguments, and the parameter arrays it hands `cuLaunchKernel`,
checked against the executor's own Python path (`_write_descriptor`). The launch on the GPU is
tested on the device (`test_gpu_claims.py`, marked runs there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_kernels import native_claim as nc
from gpu_kernels.claim_descriptor import DESC_COUNTS_HOST, DESC_WORDS
from gpu_kernels.cuda_driver import DriverEvent, elapsed_ms
from gpu_kernels.sparse_attention import SparseConfig
from tests.fake_driver import FakeDriver, FakeKernel, params_at


@pytest.fixture(autouse=True)
def _no_driver_queries(monkeypatch):
    """The stand-in kernels' handles are not the driver's: never ask it about them (on a machine
    with CUDA it would be handed a bogus CUfunction)."""
    monkeypatch.setattr(nc, "kernel_param_sizes", lambda function: None)


class FakeLaunch:
    def __init__(self, kernel, grid, args):
        self.kernel, self.grid, self.args = kernel, grid, args

    def compiled(self):
        return self.kernel


def _build(driver: FakeDriver, slots: int = 3, kernels=None, ring_tasks: int = 5):
    desc_host = torch.zeros((slots, DESC_WORDS), dtype=torch.int64)
    desc_dev = torch.zeros((slots, DESC_WORDS), dtype=torch.int64)
    ring = torch.zeros((slots, ring_tasks), dtype=torch.int32)
    scratch = torch.zeros(4)
    sel = FakeKernel(0x51, ["desc", "scores", "NB_CAP", "N_PROGRAMS", "G"],
                     {"desc": "*i64", "scores": "*fp32", "NB_CAP": "i32", "N_PROGRAMS": "i32", "G": "constexpr"})
    att = FakeKernel(0xA7, ["desc", "out", "N"], {"desc": "*i64", "out": "*fp32", "N": "i64"}, num_warps=8, shared=4096)
    sel, att = kernels or (sel, att)
    launches = [(FakeLaunch(sel, (528,), (desc_dev[s], scratch, 256, 528)),
                 FakeLaunch(att, (264,), (desc_dev[s], scratch[1:], 7))) for s in range(slots)]
    claim = nc.NativeClaim.build(driver.api, launches, 0x5EA, desc_host, desc_dev, ring, SparseConfig())
    return claim, desc_host, desc_dev, ring, scratch


def test_a_claim_is_one_call_making_the_driver_calls_in_order():
    drv = FakeDriver()
    claim, desc_host, desc_dev, ring, scratch = _build(drv)
    assert isinstance(claim, nc.NativeClaim)
    n_blocks = np.array([3, 200, 17, 5], np.int64)
    union_pages = np.array([4, 90, 30, 2], np.int64)
    template = np.arange(DESC_WORDS, dtype=np.int64) + 1000
    code = claim(n_blocks, union_pages, 1, 3, 2, desc_host.numpy(), template, 0xE0, 0xE1)
    assert code == 0
    row_bytes = DESC_WORDS * 8
    assert [c[0] for c in drv.calls] == ["record", "copy", "launch", "launch", "record"]
    assert drv.calls[0] == ("record", 0xE0, 0x5EA) and drv.calls[-1] == ("record", 0xE1, 0x5EA)
    assert drv.calls[1] == ("copy", desc_dev.data_ptr() + 2 * row_bytes, desc_host.data_ptr() + 2 * row_bytes,
                            row_bytes, 0x5EA)
    sel, att = drv.calls[2], drv.calls[3]
    assert sel[1:6] == (0x51, (528, 1, 1), (128, 1, 1), 1024, 0x5EA) and sel[7] == 0
    assert att[1:6] == (0xA7, (264, 1, 1), (256, 1, 1), 4096, 0x5EA)
    # Slot 2's parameters, as Triton's launcher passes them: the constexpr G left out, then the
    # global and profiling scratch pointers (null).
    assert params_at(sel[6], 6) == [desc_dev[2].data_ptr(), scratch.data_ptr(), 256, 528, 0, 0]
    assert params_at(att[6], 5) == [desc_dev[2].data_ptr(), scratch[1:].data_ptr(), 7, 0, 0]
    # The row: the template with the claim's words over it.
    row = desc_host.numpy()[2]
    assert row[nc.DESC_ROW0] == 1 and row[nc.DESC_TASKS] == 2
    assert row[DESC_COUNTS_HOST] == ring.data_ptr() + 2 * ring.stride(0) * 4
    claim_words = {nc.DESC_ROW0, nc.DESC_TASKS, nc.DESC_PARTS, nc.DESC_SPLITS, nc.DESC_PPS, DESC_COUNTS_HOST}
    assert all(row[w] == template[w] for w in range(DESC_WORDS) if w not in claim_words)
    assert not desc_host.numpy()[[0, 1]].any()  # other slots untouched


def test_a_failing_driver_call_stops_the_claim_and_returns_its_code():
    drv = FakeDriver(fail_launch=1)
    claim = _build(drv)[0]
    code = claim(np.array([1], np.int64), np.array([1], np.int64), 0, 1, 0, np.zeros((3, DESC_WORDS), np.int64),
                 np.zeros(DESC_WORDS, np.int64), 1, 2)
    assert code == 700
    assert [c[0] for c in drv.calls] == ["record", "copy", "launch"]  # no second launch, no end event


def test_the_native_row_is_the_executors_descriptor_row():
    """The claim words the numba function computes are those `GpuUvaExecutor._write_descriptor`
    writes for the same claim (shape from the table's host columns, `claim_splits`)."""
    from cpu_kernels import layout
    from hybrid_runtime import native_pool
    from hybrid_runtime.config import GeometryConfig, KVCacheConfig
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
    from hybrid_runtime.kvcache import KVStore
    from hybrid_runtime.tasks import Step

    geom = GeometryConfig("t", 1, q_heads=4, kv_heads=2, head_dim=32)
    kv = KVCacheConfig(sink=16, local=32, generated_cap=32, dtype="bf16", cpu_capacity_tokens=4096, max_sequences=2,
                       device="cpu")
    store = KVStore(kv, geom)
    try:
        ex = GpuUvaExecutor(store, claim_launch="native")
        # Every landing slot's row starts 16-byte aligned: the launches specialise alike.
        assert all(ex._desc[s].data_ptr() % 16 == 0 == ex._desc_dev[s].data_ptr() % 16 for s in range(ex.RING))
        rng = np.random.default_rng(0)
        n = 6
        tab = np.zeros((n, native_pool.T_COLS), dtype=np.int64)
        tab[:, native_pool.T_BLOCK] = rng.choice([16, 32, 64, 128], n)
        tab[:, native_pool.T_CPULEN] = rng.integers(100, 3000, n)
        tab[:, native_pool.T_N_CHUNKS] = -(-tab[:, native_pool.T_CPULEN] // layout.CHUNK_TOKENS)
        tab[1:, native_pool.T_CHUNK_OFF] = np.cumsum(tab[:-1, native_pool.T_N_CHUNKS])
        n_blocks = -(-tab[:, native_pool.T_CPULEN] // tab[:, native_pool.T_BLOCK])
        nsel = np.minimum(rng.integers(1, 40, (n, 2)), n_blocks[:, None]).astype(np.int32)
        chunks = np.zeros(int(tab[:, native_pool.T_N_CHUNKS].sum()), np.int32)
        table = ex.upload(ex.pack(tab, nsel, chunks))
        step = Step.empty(0, torch.zeros((2, 4, 32)), 2)
        arena = ex._arena(0)
        meta = ex._metadata_source(0, arena)
        drv = FakeDriver()
        claim = nc.NativeClaim.build(
            drv.api, [(FakeLaunch(FakeKernel(1, ["d"], {"d": "*i64"}), (4,), (ex._desc_dev[s],)),
                       FakeLaunch(FakeKernel(2, ["d"], {"d": "*i64"}), (4,), (ex._desc_dev[s],))) for s in range(ex.RING)],
            0, ex._desc, ex._desc_dev, ex._ring_dev, ex.config)
        template = ex._step_template(table, step, arena, meta.tensor)
        native_rows = np.zeros_like(ex._desc_np)
        for slot, (i, j) in enumerate([(0, 6), (2, 3), (1, 5)]):
            assert claim(table.n_blocks, table.union_pages, i, j, slot, native_rows, template, 0, 0) == 0
            nb_max, pages_max = table.claim_shape(i, j)
            ex._write_descriptor(table, i, j - i, nb_max, pages_max, step, arena, meta.tensor, slot)
            assert np.array_equal(native_rows[slot], ex._desc_np[slot]), slot
    finally:
        store.close()


def test_kernels_the_native_path_cannot_launch_as_triton_would_are_refused_with_the_reason():
    drv = FakeDriver()
    ok = FakeKernel(1, ["d"], {"d": "*i64"})
    for bad, reason in ((FakeKernel(1, ["d"], {"d": "*i64"}, num_ctas=2), "num_ctas = 2"),
                        (FakeKernel(1, ["d"], {"d": "*i64"}, launch_pdl=True), "launch_pdl"),
                        (FakeKernel(1, ["d"], {"d": "*i64"}, global_scratch_size=64), "global_scratch_size"),
                        (FakeKernel(1, ["d"], {"d": "*i64"}, shared=300 * 1024), "shared memory"),
                        (FakeKernel(1, ["d"], {"d": "fp32"}), "tensor argument d"),
                        (FakeKernel(1, ["x"], {"d": "*i64"}), "argument x is not in the kernel's signature")):
        built = _build(drv, kernels=(ok, bad))[0]
        assert isinstance(built, str) and reason in built, built
    not_compiled = _build(drv, kernels=(ok, None))[0]
    assert not_compiled == "launch 1 of slot 0 is not compiled"
    other = [FakeKernel(1, ["d"], {"d": "*i64"}), FakeKernel(3, ["d"], {"d": "*i64"})]
    desc = torch.zeros((2, DESC_WORDS), dtype=torch.int64)
    launches = [(FakeLaunch(other[s], (1,), (desc[s],)), FakeLaunch(ok, (1,), (desc[s],))) for s in range(2)]
    assert "another compiled kernel" in nc.NativeClaim.build(drv.api, launches, 0, desc, desc,
                                                             torch.zeros((2, 1), dtype=torch.int32), SparseConfig())


def test_parameters_are_checked_against_the_drivers_sizes(monkeypatch):
    kernel = FakeKernel(1, ["d", "n", "m"], {"d": "*i64", "n": "i32", "m": "i64"})
    args = (torch.zeros(2), 5, 6)
    monkeypatch.setattr(nc, "kernel_param_sizes", lambda f: [8, 4, 8, 8, 8])
    assert nc.kernel_parameters(kernel, args) == [args[0].data_ptr(), 5, 6]
    monkeypatch.setattr(nc, "kernel_param_sizes", lambda f: [8, 4, 8])  # a Triton without scratch pointers
    assert nc.kernel_parameters(kernel, args) == [args[0].data_ptr(), 5, 6]
    monkeypatch.setattr(nc, "kernel_param_sizes", lambda f: [8, 8, 8, 8, 8])
    assert "the driver reports parameter sizes" in nc.kernel_parameters(kernel, args)
    monkeypatch.setattr(nc, "kernel_param_sizes", lambda f: [8, 4])
    assert "the driver reports parameter sizes" in nc.kernel_parameters(kernel, args)
    assert "not a pointer or an integer" in nc.kernel_parameters(
        FakeKernel(1, ["x"], {"x": "fp32"}), (1.5,))


def test_elapsed_ms_passes_torch_events_through_and_driver_events_need_the_driver():
    class TorchLike:
        def elapsed_time(self, end):
            return 2.5

    assert elapsed_ms(TorchLike(), TorchLike()) == 2.5
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA driver unavailable"):
            DriverEvent()
