"""The direct claim launcher (`gpu_kernels/direct_claim.py`) against stand-in driver functions.

Without CUDA the numba launcher is compiled against ctypes callbacks that record their calls
(`tests/fake_driver.py`): which launches a claim makes in which order, their grids, and the
parameter values it hands `cuLaunchKernel` -- the step's values with the claim's own written over
them, at the same shape and selection form the planned path computes. That the positions the
planned path's argument lists name are the kernels' own parameters, never specialised by Triton,
is checked against the real kernels. On the GPU the claims themselves are compared with planned
launches (`test_gpu_claims.py`, run on the device)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpu_kernels import direct_claim as dc
from gpu_kernels import native_claim as nc
from gpu_kernels import score_select as ss
from gpu_kernels import sparse_attention as sa
from gpu_kernels.launch import (
    NOT_ON_ALIGNMENT, NOT_SPECIALISED, KernelCall, LaunchPlan, _specialization_rules, direct_launches_allowed,
)
from gpu_kernels.sparse_attention import SparseConfig
from tests.fake_driver import FakeDriver, FakeKernel, params_at

STREAM = 0x5EA


@pytest.fixture(autouse=True)
def _no_driver_queries(monkeypatch):
    """The stand-in kernels' handles are not the driver's: never ask it about them."""
    monkeypatch.setattr(nc, "kernel_param_sizes", lambda function: None)


class FakeCached:
    """What `KernelCall.compiled` asks of a `CachedLaunch`."""

    def __init__(self, kernel):
        self.kernel = kernel

    def compiled(self, args, variant, options):
        return self.kernel


def _calls(q, ring, missing: int | None = None, constant_row0: bool = False):
    """Stand-ins of the four kernels a claim may launch, in `DirectClaim.build`'s order."""
    fused = FakeKernel(0xF0, ["q", "counts_host", "row0", "one", "nb_cap"],
                       {"q": "*fp32", "counts_host": "*i32", "row0": "constexpr" if constant_row0 else "i32",
                        "one": "constexpr", "nb_cap": "i32"}, num_warps=8, shared=2048)
    score = FakeKernel(0x5C, ["q", "row0"], {"q": "*fp32", "row0": "i32"}, num_warps=4, shared=512)
    heads = FakeKernel(0x4E, ["table", "counts_host", "row0"], {"table": "*i32", "counts_host": "*i32", "row0": "i32"})
    attend = FakeKernel(0xA7, ["q", "row0", "hq", "tasks", "splits", "pps", "programs"],
                        {"q": "*fp32", "row0": "i32", "hq": "i32", "tasks": "i32", "splits": "i32", "pps": "i32",
                         "programs": "i32"}, num_warps=4, shared=4096)
    kernels = [fused, score, heads, attend]
    if missing is not None:
        kernels[missing] = None
    table = torch.zeros(8, dtype=torch.int32)
    return (
        KernelCall(FakeCached(kernels[0]), (q, ring[0], 0, 1, 256), {"G": 2, "BLOCK_B": ss.BLOCK_B}, {},
                   {"row0": 2, "counts_host": 1}),
        KernelCall(FakeCached(kernels[1]), (q, 0), {"BLOCK_B": 32}, {}, {"row0": 1}),
        KernelCall(FakeCached(kernels[2]), (table, ring[0], 0), {}, {}, {"row0": 2, "counts_host": 1}),
        KernelCall(FakeCached(kernels[3]), (q, 0, 28, 1, 1, 1, 1), {}, {},
                   {"row0": 1, "tasks": 3, "splits": 4, "pps": 5, "programs": 6}),
    ), table


def _build(drv: FakeDriver, config: SparseConfig = SparseConfig(), split_above: int = 100, **kw):
    q = torch.zeros(4)
    ring = torch.zeros((8, 6), dtype=torch.int32)
    calls, table = _calls(q, ring, **kw)
    return dc.DirectClaim.build(drv.api, calls, STREAM, ring, config, split_above), q, ring, table


def test_a_fused_claim_is_its_selection_and_attention_between_two_events():
    drv = FakeDriver()
    claim, q, ring, _ = _build(drv)
    n_blocks = np.array([3, 90, 17, 5], np.int64)
    union_pages = np.array([4, 90, 30, 2], np.int64)
    assert claim(n_blocks, union_pages, 1, 3, 5, 0xE0, 0xE1) == 0
    assert [c[0] for c in drv.calls] == ["record", "launch", "launch", "record"]
    assert drv.calls[0] == ("record", 0xE0, STREAM) and drv.calls[-1] == ("record", 0xE1, STREAM)
    sel, att = drv.calls[1], drv.calls[2]
    # Rows 1-2: 90 blocks at most (fused: one part of BLOCK_B), 90 union pages (12 splits of 8).
    assert sel[1:6] == (0xF0, (2, 1, 1), (256, 1, 1), 2048, STREAM) and sel[7] == 0
    assert att[1:6] == (0xA7, (24, 1, 1), (128, 1, 1), 4096, STREAM)
    slot5 = ring.data_ptr() + 5 * ring.stride(0) * 4
    # The constexpr `one` left out; then Triton's two scratch pointers (null).
    assert params_at(sel[6], 6) == [q.data_ptr(), slot5, 1, 256, 0, 0]
    assert params_at(att[6], 9) == [q.data_ptr(), 1, 28, 2, 12, 8, 24, 0, 0]


def test_a_claim_of_long_rows_selects_split():
    drv = FakeDriver()
    claim, q, ring, table = _build(drv, split_above=100)
    n_blocks = np.array([101, 7], np.int64)
    union_pages = np.array([600, 3], np.int64)
    assert claim(n_blocks, union_pages, 0, 2, 0, 1, 2) == 0
    assert [c[0] for c in drv.calls] == ["record", "launch", "launch", "launch", "record"]
    score, heads, att = drv.calls[1:4]
    assert score[1:4] == (0x5C, (2, 4, 1), (128, 1, 1))  # cdiv(101, 32) parts
    assert heads[1:3] == (0x4E, (2, 2, 1))  # a program per (task, head)
    assert params_at(score[6], 4) == [q.data_ptr(), 0, 0, 0]
    assert params_at(heads[6], 5) == [table.data_ptr(), ring.data_ptr(), 0, 0, 0]
    # 600 pages: 64 splits at most, so 10 pages a split and 60 splits; 120 items, a program each.
    assert att[2] == (120, 1, 1) and params_at(att[6], 7) == [q.data_ptr(), 0, 28, 2, 60, 10, 120]


@pytest.mark.parametrize("claim_programs", [0, 48])
def test_the_claims_shape_is_the_planned_paths(claim_programs):
    """Grids, selection form and attention words as the planned launches compute them
    (`score_select._grid`, `split_select`, `sparse_attention._claim_shape`), over random claims."""
    config = SparseConfig(claim_programs=claim_programs)
    split_above = ss.SEL_ELEMS // 2
    drv = FakeDriver()
    claim = _build(drv, config=config, split_above=split_above)[0]
    rng = np.random.default_rng(1)
    for _ in range(60):
        t = int(rng.integers(1, 12))
        n_blocks = rng.integers(0, 2 * split_above, t).astype(np.int64)
        union_pages = rng.integers(0, 5000, t).astype(np.int64)
        start = int(rng.integers(0, t))
        stop = int(rng.integers(start + 1, t + 1))
        drv.calls.clear()
        assert claim(n_blocks, union_pages, start, stop, 0, 0, 0) == 0
        n, nb_max, pages_max = stop - start, int(n_blocks[start:stop].max()), int(union_pages[start:stop].max())
        launches = [c for c in drv.calls if c[0] == "launch"]
        if ss.split_select(nb_max, 2):
            assert [c[1] for c in launches] == [0x5C, 0x4E, 0xA7]
            assert launches[0][2][:2] == ss._grid(n, nb_max, 32) and launches[1][2][:2] == (n, 2)
        else:
            assert [c[1] for c in launches] == [0xF0, 0xA7]
            assert launches[0][2][:2] == ss._grid(n, nb_max)
        n_splits, pps, programs = sa._claim_shape(n, pages_max, config)
        assert launches[-1][2] == (programs, 1, 1)
        assert params_at(launches[-1][6], 7)[1:] == [start, 28, n, n_splits, pps, programs]


def _selection_calls(missing: int | None = None):
    """Stand-ins of a signalling selection's three kernels (`DirectSelect`)."""
    fused = FakeKernel(0xF1, ["q", "ublocks", "uheads", "counts", "counts_host", "row0", "ready", "stamp"],
                       {"q": "*fp32", "ublocks": "*i32", "uheads": "*i32", "counts": "*i32", "counts_host": "*i32",
                        "row0": "i32", "ready": "*i64", "stamp": "i32"}, num_warps=8)
    score = FakeKernel(0x5D, ["q", "row0"], {"q": "*fp32", "row0": "i32"})
    heads = FakeKernel(0x4F, ["ublocks", "uheads", "counts", "counts_host", "row0", "ready", "stamp"],
                       {"ublocks": "*i32", "uheads": "*i32", "counts": "*i32", "counts_host": "*i32", "row0": "i32",
                        "ready": "*i64", "stamp": "i32"})
    kernels = [fused, score, heads]
    if missing is not None:
        kernels[missing] = None
    q, rows = torch.zeros(4), torch.zeros(8, dtype=torch.int32)
    words = {"ublocks": 1, "uheads": 2, "counts": 3, "counts_host": 4, "row0": 5, "ready": 6, "stamp": 7}
    return (
        KernelCall(FakeCached(kernels[0]), (q, rows, rows, rows, rows, 0, rows, 0), {"G": 4, "BLOCK_B": ss.BLOCK_B}, {},
                   dict(words)),
        KernelCall(FakeCached(kernels[1]), (q, 0), {"BLOCK_B": 32}, {}, {"row0": 1}),
        KernelCall(FakeCached(kernels[2]), (rows, rows, rows, rows, 0, rows, 0), {}, {},
                   {k: v - 1 for k, v in words.items()}),
    ), q


def test_a_selection_for_the_cpu_lane_waits_launches_with_its_rows_and_records_its_end():
    drv = FakeDriver()
    calls, q = _selection_calls()
    select = dc.DirectSelect.build(drv.api, calls, 0x9C, split_above=100)
    assert select.complete
    rows = np.array([0x1000, 0x2000, 0x3000, 0x4000], np.int64)
    n_blocks = np.array([5, 60, 70, 9], np.int64)
    assert select(n_blocks, 1, 3, 77, rows, 0xA1, 0, 0xE5) == 0
    # The second wait event is 0 (none): one wait.
    assert [c[0] for c in drv.calls] == ["wait", "launch", "record"]
    assert drv.calls[0] == ("wait", 0x9C, 0xA1, 0) and drv.calls[-1] == ("record", 0xE5, 0x9C)
    fused = drv.calls[1]
    assert fused[1:3] == (0xF1, (2, 1, 1)) and fused[5] == 0x9C
    assert params_at(fused[6], 8) == [q.data_ptr(), 0x1000, 0x2000, 0x3000, 0x3000, 1, 0x4000, 77]
    # Rows longer than `split_above`: scored, then selected with a program per head; both waits.
    drv.calls.clear()
    assert select(np.array([101, 7], np.int64), 0, 2, 78, rows, 0xA1, 0xA2, 0xE6) == 0
    assert [c[0] for c in drv.calls] == ["wait", "wait", "launch", "launch", "record"]
    score, heads = drv.calls[2], drv.calls[3]
    assert score[1:3] == (0x5D, (2, 4, 1)) and heads[1:3] == (0x4F, (2, 4, 1))  # G = 4 heads
    assert params_at(heads[6], 7) == [0x1000, 0x2000, 0x3000, 0x3000, 0, 0x4000, 78]


def test_a_selection_whose_kernel_is_not_compiled_issues_nothing():
    drv = FakeDriver()
    select = dc.DirectSelect.build(drv.api, _selection_calls(missing=dc.HEADS)[0], 0x9C, split_above=100)
    assert not select.complete
    rows = np.zeros(4, np.int64)
    assert select(np.array([500], np.int64), 0, 1, 1, rows, 0xA1, 0, 0xE5) == dc.MISSING
    assert drv.calls == []
    with pytest.raises(ValueError, match="a selection has 3"):
        dc.DirectSelect.build(drv.api, _selection_calls()[0][:2], 0x9C, 100)


def test_a_claim_whose_kernel_is_not_compiled_issues_nothing():
    drv = FakeDriver()
    claim = _build(drv, missing=dc.HEADS)[0]
    assert not claim.complete
    assert claim(np.array([500], np.int64), np.array([9], np.int64), 0, 1, 0, 1, 2) == dc.MISSING
    assert drv.calls == []
    assert claim(np.array([50], np.int64), np.array([9], np.int64), 0, 1, 0, 1, 2) == 0  # the fused form is there
    assert _build(FakeDriver())[0].complete


def test_a_failing_driver_call_stops_the_claim_and_returns_its_code():
    drv = FakeDriver(fail_launch=1)
    claim = _build(drv)[0]
    assert claim(np.array([5], np.int64), np.array([9], np.int64), 0, 1, 0, 1, 2) == 700
    assert [c[0] for c in drv.calls] == ["record", "launch"]


def test_a_claim_word_made_a_constant_is_refused_with_the_reason():
    built = _build(FakeDriver(), constant_row0=True)[0]
    assert isinstance(built, str) and "row0" in built and "constant" in built
    q, ring = torch.zeros(4), torch.zeros((2, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="a claim has 4"):
        dc.DirectClaim.build(FakeDriver().api, _calls(q, ring)[0][:3], STREAM, ring, SparseConfig(), 100)


def _parameter_names(launch) -> list[str]:
    fn = launch.fn
    names = getattr(fn, "arg_names", None)
    return list(names) if names is not None else list(inspect.signature(fn.fn).parameters)


def test_the_planned_paths_claim_words_are_the_kernels_parameters_triton_does_not_specialise():
    """The positions `claim_calls` / `claim_call` name are the real kernels' parameters of those
    names, declared so that Triton does not specialise on them (the union rows' addresses: not on
    their alignment): the step's compiled kernel is then the one every claim and selection runs."""
    t, g, d, nb = 4, 2, 32, 64
    scores = torch.zeros((t, g, nb))
    tickets = torch.zeros(t, dtype=torch.int32)
    sel = ss.ScoreSelectPlan(scores, tickets)
    i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32)  # noqa: E731
    q = torch.zeros((2, 4, d))
    arena = torch.zeros((4, 64, d), dtype=torch.bfloat16)
    fused, score, heads, split_above = sel.claim_calls(i32(t, 9), i32(t, g), i32(8), q, arena, i32(t, nb), i32(t, nb),
                                                       i32(t), i32(t))
    assert split_above == ss.SEL_ELEMS // 2
    signalling = sel.claim_calls(i32(t, 9), i32(t, g), i32(8), q, arena, i32(t, nb), i32(t, nb), i32(t), i32(t),
                                 ready=torch.zeros(t, dtype=torch.int64))
    assert signalling[0].constexprs["SIGNAL"] and "stamp" in signalling[2].claim_args
    attend = sa.SparseAttentionClaimPlan(i32(t, nb), i32(t, nb), i32(t), torch.zeros((t, 64, g, d)),
                                         torch.zeros((t, 64, g)), i32(t)).claim_call(i32(t, 9), i32(8), q, arena,
                                                                                     torch.zeros((2, 4, d)),
                                                                                     torch.zeros((2, 4)))
    names = {"row0": ("row0",), "counts_host": ("counts_host_ptr",), "tasks": ("N_TASKS",),
             "splits": ("N_SPLITS",), "pps": ("PAGES_PER_SPLIT",), "programs": ("N_PROGRAMS",),
             "ublocks": ("ublocks_ptr",), "uheads": ("uheads_ptr",), "counts": ("counts_ptr",),
             "ready": ("ready_ptr",), "stamp": ("stamp",)}
    pointers = ("counts_host", "ublocks", "uheads", "counts", "ready")
    for call in (fused, score, heads, attend, *signalling[:3]):
        params = _parameter_names(call.launch)
        rules = _specialization_rules(call.launch.fn)
        assert len(call.args) == len(rules)
        for word, position in call.claim_args.items():
            assert params[position] in names[word], (word, params[position])
            # Integers: never specialised; the landing slot's address: not on its alignment.
            assert rules[position] in ((NOT_SPECIALISED, NOT_ON_ALIGNMENT) if word in pointers else
                                       (NOT_SPECIALISED,)), (word, rules[position])


def test_a_profilers_launch_hook_sends_launches_through_triton():
    """Triton's launch hooks (a profiler) must see every launch: none is issued directly while one
    is set."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip("a Triton without knobs: launches always go through the JIT")
    assert direct_launches_allowed()
    saved = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = lambda metadata: None
    try:
        assert not direct_launches_allowed()
    finally:
        knobs.runtime.launch_enter_hook = saved
    assert direct_launches_allowed()


def test_parameter_indices_skip_arguments_triton_made_constants():
    kernel = SimpleNamespace(src=SimpleNamespace(signature={"a": "*fp32", "b": "constexpr", "c": "i32"},
                                                 fn=SimpleNamespace(arg_names=["a", "b", "c", "D"])))
    assert dc.parameter_indices(kernel, (torch.zeros(1), 1, 5)) == [0, None, 1]


def test_without_cuda_direct_claims_are_planned_launches():
    """On a machine without CUDA the executor's direct mode launches its claims as planned (the
    kernels under the interpreter), and says nothing is wrong."""
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
    from tests.helpers import make_store

    if torch.cuda.is_available():
        pytest.skip("on CUDA, test_gpu_claims.py compares direct claims with planned ones")
    store = make_store(max_sequences=2)
    try:
        ex = GpuUvaExecutor(store, claim_launch="direct")
        ex.compile_kernels()
        assert ex.claim_launch == "direct" and ex.direct_launches == 0 and ex.direct_error is None
        with pytest.raises(ValueError, match="allowed: plans, native, graphs, direct"):
            ex.claim_launch = "eager"
    finally:
        store.close()


def test_a_claim_whose_launcher_misses_a_kernel_launches_as_planned_until_the_launcher_gives_up(monkeypatch):
    """The executor's side of `MISSING` (its CUDA path, driven here with stand-ins for the driver's
    events and the launcher): the claim is handed back to the planned path (None) and the step's
    launcher rebuilt at the next claim; a launcher still missing a kernel after `DIRECT_REBUILDS`
    planned claims is dropped for good, with the reason in `direct_error`."""
    from hybrid_runtime.executors import gpu_uva
    from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
    from tests.helpers import make_store

    class Event:
        cuda_event = 0

    class Launcher:
        def __init__(self, code):
            self.code = code

        def __call__(self, *args):
            return self.code

    monkeypatch.setattr(gpu_uva, "DriverEvent", Event)
    store = make_store(max_sequences=2)
    try:
        ex = GpuUvaExecutor(store, claim_launch="direct")
        table = SimpleNamespace(n_blocks=np.ones(2, np.int64), union_pages=np.ones(2, np.int64))
        step = object()
        built = []

        def direct_step(t, s, code=dc.MISSING):
            def build():
                built.append(Launcher(code))
                return built[-1]

            return t, s, ex._direct.get("key", build), "key", False

        monkeypatch.setattr(ex, "_direct_step", direct_step)
        for i in range(ex.DIRECT_REBUILDS + 1):
            assert ex._launch_direct(table, 0, 2, step, 0) is None
            assert len(built) == i + 1
            assert (ex.direct_error is None) == (i < ex.DIRECT_REBUILDS)
        assert ex._direct.launchers["key"] is None and "uncompiled" in ex.direct_error
        assert ex._launch_direct(table, 0, 2, step, 0) is None and len(built) == ex.DIRECT_REBUILDS + 1
        assert ex.direct_launches == 0 and ex.launches == 0
        # A launcher that issues the claim: a handle on the landing slot, counted.
        ex._direct.clear()
        ex._direct_words, ex.direct_error = None, None
        monkeypatch.setattr(ex, "_direct_step", lambda t, s: direct_step(t, s, code=0))
        handle = ex._launch_direct(table, 0, 2, step, 3)
        assert handle is not None and handle.slot == 3 and handle.n_tasks == 2
        assert ex.direct_launches == 1 and ex.launches == 1 and ex._ring_users[3] is handle
        # Planned launches switched off (a diagnostic's JIT path): no direct launch either.
        monkeypatch.setattr(LaunchPlan, "enabled", False)
        assert ex._launch_direct(table, 0, 2, step, 4) is None and ex.direct_launches == 1
    finally:
        store.close()
