"""The GPU lane's block selection for the CPU lane's tasks (hybrid_runtime/gpu_picks.py).

Three layers, each against what it replaces: the selection kernel writing unions into rows of
another width with a ready stamp per task (against the claim path's own union); the CPU kernel
attending a union selected elsewhere (bit-equal to `run_task`, which selects the same union
itself); and the runtime's fluxion steps with native workers waiting for a selection that lands
late from another thread, failing cleanly when it cannot be launched.
"""

from __future__ import annotations

import os
import threading
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cpu_kernels.sparse_attention import Workspace, attend_picked, picked_union, run_task, select_task  # noqa: E402
from gpu_kernels.score_select import score_select  # noqa: E402
from gpu_kernels.uva import uva_view  # noqa: E402
from hybrid_runtime.config import ConfigError, config_from_dict, resolved, selects_cpu_tasks_on_gpu  # noqa: E402
from hybrid_runtime.executors.torch_ref import TorchRefExecutor  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402
from tests.helpers import random_kv  # noqa: E402
from tests.test_gpu_claims import Scratch, check_selection, upload  # noqa: E402
from tests.test_gpu_kernels import CUDA, DEV, make_case  # noqa: E402


# ---------------------------------------------------------------------------- the selection kernel
def pinned_rows(rows: int, width: int):
    """(host tensors, what the kernel writes through) for `rows` picks rows of `width` blocks."""
    host = (torch.zeros(rows, dtype=torch.int64, pin_memory=CUDA),
            torch.full((rows, width), -7, dtype=torch.int32, pin_memory=CUDA),
            torch.full((rows, width), -7, dtype=torch.int32, pin_memory=CUDA),
            torch.full((rows,), -7, dtype=torch.int32, pin_memory=CUDA))
    return host, tuple(uva_view(t) for t in host) if CUDA else host


# split: the selection for the CPU rows fused or with a program per head (its last head signals).
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_selection_for_cpu_rows_equals_the_claims_union_and_stamps_every_row(dtype, split):
    c = make_case(cpu_lens=[300, 129, 40], hkv=2, g=2, d=32, dtype=dtype, blks=(16, 32, 64, 128),
                  budget="random", streaming=True, seed=3)
    table = upload(c)
    n = len(c.tasks)
    nb = int(table.n_blocks.max())
    ref = Scratch(n, c.g, nb, 32)
    nb_max, _ = table.claim_shape(0, n)
    score_select(table.table, table.n_select, table.chunks, 0, n, nb_max, c.q, c.ar.arena, ref.scores,
                 ref.tickets[0], ref.ublocks, ref.uheads, ref.counts)
    check_selection(c, 0, n, ref)
    # Rows [1, n) into pinned rows wider than the scratch (their own stride), as the CPU lane's are.
    host, dev = pinned_rows(n, nb + 16)
    sc = Scratch(n, c.g, nb, 32)
    start = 1
    nb_max, _ = table.claim_shape(start, n)
    ready, blocks, heads, counts = dev
    score_select(table.table, table.n_select, table.chunks, start, n - start, nb_max, c.q, c.ar.arena, sc.scores,
                 sc.tickets[0], blocks[start:], heads[start:], counts[start:], counts[start:], ready=ready[start:],
                 stamp=41, split=split)
    if CUDA:
        torch.cuda.synchronize()
    h_ready, h_blocks, h_heads, h_counts = host
    assert h_ready[0] == 0 and (h_ready[start:] == 41).all(), "every selected row is stamped, no other"
    for i in range(start, n):
        cnt = int(ref.counts[i])
        assert int(h_counts[i]) == cnt
        assert torch.equal(h_blocks[i, :cnt], ref.ublocks[i, :cnt].cpu())
        assert torch.equal(h_heads[i, :cnt], ref.uheads[i, :cnt].cpu())
    assert (sc.tickets == 0).all()


# ---------------------------------------------------------------------------- the CPU kernel
def host_case(seed: int = 0, cpu_len: int = 1000, g: int = 4, d: int = 64):
    from tests.test_gpu_kernels import build_arena

    ar = build_arena([cpu_len], 1, d, torch.bfloat16, seed)
    arena = ar.host.view(torch.int16).numpy().view(np.uint16)
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((g, d)) / np.sqrt(d)).astype(np.float32)
    return arena, ar.chunks[(0, 0)].astype(np.int32), q


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_attend_picked_equals_run_task_on_the_same_union(block_size):
    g, d, cpu_len = 4, 64, 1000
    arena, chunks, q = host_case(block_size, cpu_len, g, d)
    nb = -(-cpu_len // block_size)
    n_select = np.array([3, 0, 5, nb], dtype=np.int32)  # a streaming head and one reading everything
    ws = Workspace(g, d, 256)
    want_out, want_lse = np.zeros((g, d), np.float32), np.zeros(g, np.float32)
    want_bytes = run_task(arena, chunks, cpu_len, block_size, q, n_select, want_out, want_lse, ws.scores, ws.selected,
                          ws.n_selected, ws.block_heads, ws.state, ws.topk_scratch)
    scratch_out, scratch_lse = np.zeros((g, d), np.float32), np.zeros(g, np.float32)
    meta_bytes, tokens = select_task(arena, chunks, cpu_len, block_size, q, n_select, scratch_out, scratch_lse,
                                     ws.scores, ws.selected, ws.n_selected, ws.block_heads, ws.state, ws.topk_scratch)
    ids = np.nonzero(ws.block_heads[:nb])[0].astype(np.int32)
    bits = ws.block_heads[ids].astype(np.int32)
    ws.block_heads[:] = 12345  # stale bits must not leak into the picked union
    out, lse = np.zeros((g, d), np.float32), np.zeros(g, np.float32)
    kv_bytes = attend_picked(arena, chunks, cpu_len, block_size, q, ids, bits, len(ids), out, lse, ws.block_heads,
                             ws.state)
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    assert kv_bytes == tokens * 2 * d * 2 and kv_bytes + meta_bytes == want_bytes, "K and V only, no metadata"
    assert lse[1] == -np.inf and (out[1] == 0).all()


def test_picked_union_refuses_entries_out_of_range():
    mask = np.zeros(64, np.uint32)
    ok = picked_union(100, 16, np.array([0, 6], np.int32), np.array([1, 3], np.int32), 2, mask)
    assert ok == 16 + 4 and mask[0] == 1 and mask[6] == 3  # the last block holds 4 tokens
    assert picked_union(100, 16, np.array([0, 7], np.int32), np.array([1, 1], np.int32), 2, mask) == -1
    assert picked_union(100, 16, np.array([-1], np.int32), np.array([1], np.int32), 1, mask) == -1
    assert picked_union(100, 16, np.arange(8, dtype=np.int32), np.ones(8, np.int32), 8, mask) == -1, "count > blocks"
    assert picked_union(100, 16, np.arange(7, dtype=np.int32), np.ones(7, np.int32), 7, np.zeros(3, np.uint32)) == -1


# ---------------------------------------------------------------------------- the runtime
GEOM = {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
LENGTHS = [2100, 900, 1500]


def picks_config(selection: str = "gpu", workers: int = 1, placement: str = "fluxion") -> dict:
    return config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 8192, "max_sequences": 4},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.1},
        "scheduler": {"placement": placement, "cpu_workers": workers, "gpu_worker": True, "step_timeout_s": 30.0,
                      "spin_us": 0, "cpu_task_selection": selection},
    })


class HostPickingGpu(TorchRefExecutor):
    """The reference GPU lane plus `pick`: the CPU kernels' own selection of the rows, written from
    another thread `delay_s` later (a GPU's selection lands while the workers already wait)."""

    def __init__(self, delay_s: float = 0.02):
        super().__init__(None)  # the runtime's store, set once it exists
        self.delay_s = delay_s
        self.fail = False
        self.picked_rows = 0
        self.threads: list[threading.Thread] = []

    def pick(self, plan, start, stop, step, ublocks, uheads, counts, ready, stamp, after=None) -> None:
        if self.fail:
            raise RuntimeError("selection launch failed (test)")
        tasks, q = list(plan[start:stop]), step.q.numpy()
        arrays = tuple(t.numpy() for t in (ublocks, uheads, counts, ready))
        store = self.store

        def land() -> None:
            time.sleep(self.delay_s)
            g = step.group_size
            ws = Workspace(g, store.head_dim, store.max_task_blocks)
            out, lse = np.zeros((g, store.head_dim), np.float32), np.zeros(g, np.float32)
            blocks, heads, cnts, rdy = arrays
            for t, task in enumerate(tasks):
                h0 = task.kv_head * g
                select_task(store.arena_numpy(task.layer), task.chunks, task.cpu_len, task.block_size,
                            q[task.batch_index, h0 : h0 + g], task.n_select, out, lse, ws.scores, ws.selected,
                            ws.n_selected, ws.block_heads, ws.state, ws.topk_scratch)
                nb = -(-task.cpu_len // task.block_size)
                ids = np.nonzero(ws.block_heads[:nb])[0]
                blocks[t, : len(ids)] = ids
                heads[t, : len(ids)] = ws.block_heads[ids].astype(np.int32)
                cnts[t] = len(ids)
            self.picked_rows += len(tasks)
            rdy[: len(tasks)] = stamp  # after the unions, as the kernel's release orders them

        th = threading.Thread(target=land, daemon=True)
        th.start()
        self.threads.append(th)


def decode_steps(rt, steps: int = 3, seed: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    outs = []
    b = len(LENGTHS)
    for _ in range(steps):
        for layer in range(GEOM["layers"]):
            q = torch.randn(b, GEOM["q_heads"], GEOM["head_dim"], generator=gen)
            k = torch.randn(b, GEOM["kv_heads"], GEOM["head_dim"], generator=gen)
            v = torch.randn(b, GEOM["kv_heads"], GEOM["head_dim"], generator=gen)
            outs.append(rt.decode(layer, list(range(b)), q, k, v))
    return outs


def prefilled(rt):
    for s, n in enumerate(LENGTHS):
        for layer in range(GEOM["layers"]):
            rt.prefill(s, layer, *random_kv(n, GEOM["kv_heads"], GEOM["head_dim"], seed=10 * s + layer))
    return rt


# The host-side protocol with a stand-in GPU lane on the host (its rows and queries are host tensors:
# without CUDA only; on CUDA the last test runs the real selection).
host_lane = pytest.mark.skipif(CUDA, reason="the stand-in GPU lane needs the lane's buffers on the host")


@host_lane
def test_cpu_tasks_attend_the_gpu_lanes_selection_and_match_host_selection():
    with prefilled(HybridRuntime(picks_config("host"))) as rt:
        want = decode_steps(rt)
        assert rt.scheduler.picks is None and rt.stats()["gpu_selection_launches"] == 0
    gpu = HostPickingGpu()
    with HybridRuntime(picks_config("gpu"), gpu_executor=gpu) as rt:
        gpu.store = rt.store
        # Scoring a block on the host modeled as slow: the workers wait for the late selection.
        rt.scheduler.picks.meta_block_bytes = 1 << 40
        prefilled(rt)
        got = decode_steps(rt)
        stats = rt.stats()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert stats["cpu_workers_native"]
    assert 0 < stats["gpu_selection_launches"] <= len(got)  # none when the GPU reserved every position
    assert stats["gpu_selection_host_us"] > 0 and stats["gpu_selection_skipped_steps"] == 0
    assert stats["cpu_tasks_gpu_selected"] > 0, "no CPU task ran on the GPU lane's selection"
    assert stats["gpu_selection_refused"] == 0


@host_lane
def test_steps_on_the_gpu_selection_size_and_teach_estimates_of_their_own():
    """A step whose CPU tasks attend the GPU's selection learns into the placement's selection set
    (`Scheduler.selection_rates`); one that selects on the host into the placement's own."""
    gpu = HostPickingGpu()
    with HybridRuntime(picks_config("gpu"), gpu_executor=gpu) as rt:
        gpu.store = rt.store
        sch = rt.scheduler
        prefilled(rt)
        plain, sel = sch.rates, sch.selection_rates()
        assert sel is not plain and sch.selection_rates() is sel

        def learned(r):
            return r.cpu_lane.bytes_per_s, r.cpu_start.seconds, r.balance

        plain0, sel0 = learned(plain), learned(sel)
        sch.picks.meta_block_bytes = 1 << 40  # every step uses the selection
        decode_steps(rt, steps=2)
        assert rt.stats()["cpu_tasks_gpu_selected"] > 0
        assert learned(plain) == plain0 and learned(sel) != sel0
        sel1 = learned(sel)
        sch.picks_always = False  # from here "auto"'s step-by-step rule ("gpu" selects on every step)
        sch.picks.meta_block_bytes = 0  # no step uses it (no exploring step within these)
        sch.picks.EXPLORE_AFTER = 10**6
        decode_steps(rt, steps=2)
        assert learned(sel) == sel1 and learned(plain) != plain0
        assert sch.rates is plain


@host_lane
def test_cpu_task_selection_gpu_selects_on_every_step_that_auto_would_not():
    """"gpu": every shared step gets the GPU's selection, whatever `pays` would say; "auto" asks it."""
    for mode, expect_all in (("gpu", True), ("auto", False)):
        gpu = HostPickingGpu(delay_s=0.0)
        with HybridRuntime(picks_config("gpu"), gpu_executor=gpu) as rt:
            gpu.store = rt.store
            sch = rt.scheduler
            sch.picks_always = mode == "gpu"  # "auto" itself needs CUDA: its rule, on this lane
            prefilled(rt)
            sch.picks.meta_block_bytes = 0  # the metadata costs the CPU lane nothing: `pays` says no
            sch.picks.EXPLORE_AFTER = 10**6
            issued = []
            real_issue = sch.lane._issue_picks

            def counting_issue(job, plan, _real=real_issue):
                issued.append(job.layer)
                _real(job, plan)

            sch.lane._issue_picks = counting_issue
            decode_steps(rt, steps=2)
            launches = rt.stats()["gpu_selection_launches"]
            # The decision is per step; a launch also needs positions the GPU's first claim left to the
            # CPU lane, which the lane rates decide (all of a step's 6 tasks now and then on a loaded host).
            assert len(issued) == (2 * GEOM["layers"] if expect_all else 0), (mode, issued)
            assert launches <= len(issued) if expect_all else launches == 0, (mode, launches)


@host_lane
def test_steps_on_the_selection_re_measure_a_gpu_lane_their_estimates_keep_out(monkeypatch):
    """Under "auto" a step selects on the host every few steps (`GpuPicks.HOST_EXPLORE_AFTER`) and
    is sized with the placement's own estimates, which may claim. Steps on the selection whose own
    estimates keep the GPU lane out must still re-measure it after `GpuLane.EXPLORE_AFTER` of them
    (at 864193a the host steps' claims reset one shared count: on Qwen2.5-7B at 2 x 96K the
    selection's balance stayed at -0.47 and the GPU lane took 8% of the bytes, 29% with the
    selection on every step)."""
    gpu = HostPickingGpu(delay_s=0.0)
    with HybridRuntime(picks_config("gpu"), gpu_executor=gpu) as rt:
        gpu.store = rt.store
        sch = rt.scheduler
        sch.picks_always = False  # "auto"'s step-by-step rule ("auto" itself needs CUDA)
        prefilled(rt)
        sch.picks.meta_block_bytes = 1 << 40  # the selection pays on every step ...
        sch.picks.host_explore_after = sch.picks.HOST_EXPLORE_MAX = 1  # ... and every second step selects on the host anyway
        sch.selection_rates().model.lat = 10.0  # the selection's estimates: g <= 0 on every step
        plain = sch.rates
        plain.cpu_lane.bytes_per_s = 1e6  # the placement's own: a slow CPU lane, the GPU lane claims
        monkeypatch.setattr(plain.cpu_lane, "update", lambda *args, **kwargs: None)
        firsts = []  # (the step is on the selection, the positions its GPU lane reserved)
        real = sch.lane.reserve_first

        def recording(job, launcher_slack_s=None, _real=real):
            _real(job, launcher_slack_s)
            firsts.append((job.picks, job.gpu_first))

        sch.lane.reserve_first = recording
        explore = sch.lane.EXPLORE_AFTER
        decode_steps(rt, steps=explore + 1)  # 2 layers a token: as many steps on the selection
        on_host = [first for picks, first in firsts if not picks]
        on_selection = [first for picks, first in firsts if picks]
        assert len(on_selection) >= explore + 1 and on_host
        assert all(first is not None for first in on_host)  # the placement's estimates claimed each time
        assert on_selection[:explore] == [None] * explore
        assert on_selection[explore] == (0, 1)  # one position re-measures the GPU lane


@host_lane
def test_workers_select_on_the_host_when_the_selection_is_expected_after_their_own_would_end():
    gpu = HostPickingGpu(delay_s=0.5)
    with HybridRuntime(picks_config("gpu"), gpu_executor=gpu) as rt:
        gpu.store = rt.store
        prefilled(rt)
        rt.scheduler.picks.EXPLORE_AFTER = 0  # every step uses the selection (`pays`)
        rt.scheduler.picks.latency.seconds = 0.5  # measured so, and a block's scoring takes microseconds
        t0 = time.perf_counter()
        got = decode_steps(rt, steps=1)
        assert time.perf_counter() - t0 < 0.5 * len(got), "a step waited for the late selection"
        assert rt.stats()["cpu_tasks_gpu_selected"] == 0
        for th in gpu.threads:  # the late selections land in rows no worker reads any more
            th.join()
    with prefilled(HybridRuntime(picks_config("host"))) as rt:
        want = decode_steps(rt, steps=1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_the_wait_for_a_selection_is_bounded_by_the_tasks_own_scoring_time():
    from hybrid_runtime import native_pool as npool

    ctrl = np.zeros(npool.CTRL_SIZE, np.int64)
    ready = np.zeros(4, np.int64)
    ready[1], ready[2] = 5, -5
    now = time.perf_counter_ns()
    assert npool._await_pick(ctrl, ready, 1, 5, now, 0) == npool.PICK_READY
    assert npool._await_pick(ctrl, ready, 2, 5, now, 0) == npool.PICK_HOST, "refused: the host selects"
    t0 = time.perf_counter()
    assert npool._await_pick(ctrl, ready, 0, 5, now + 10**9, 10**6) == npool.PICK_HOST  # expected in 1 s, 1 ms own
    assert time.perf_counter() - t0 < 0.5
    t0 = time.perf_counter()
    assert npool._await_pick(ctrl, ready, 0, 5, time.perf_counter_ns(), 20 * 10**6) == npool.PICK_HOST
    assert 0.015 < time.perf_counter() - t0 < 5.0, "waits its own scoring time past the expected landing, no more"
    threading.Timer(0.01, lambda: ready.__setitem__(3, 5)).start()
    assert npool._await_pick(ctrl, ready, 3, 5, time.perf_counter_ns(), 10**10) == npool.PICK_READY
    ctrl[npool.C_STOP] = 1
    assert npool._await_pick(ctrl, ready, 0, 5, time.perf_counter_ns(), 10**10) == npool.PICK_STOP


@host_lane
def test_a_failed_selection_launch_fails_its_step_and_the_workers_select_on_the_host():
    gpu = HostPickingGpu(delay_s=0.0)
    with HybridRuntime(picks_config("gpu"), gpu_executor=gpu) as rt:
        gpu.store = rt.store
        rt.scheduler.picks.meta_block_bytes = 1 << 40  # every step uses the selection (`pays`)
        prefilled(rt)
        decode_steps(rt, steps=1)
        gpu.fail = True
        # A step whose positions the GPU lane reserved all of launches no selection: steps until one does.
        with pytest.raises(RuntimeError, match="selection launch failed"):
            decode_steps(rt, steps=10)
        refused = rt.stats()["gpu_selection_refused"]
        assert refused > 0, "the failed launch's positions were not handed back to the host"
        gpu.fail = False
        out = decode_steps(rt, steps=1)  # the workers are not stuck waiting for the failed step's selection
        assert all(torch.isfinite(o).all() for o in out)
        rt.scheduler.picks.enabled = False  # benchmarks switch it off on one runtime
        before = rt.stats()["gpu_selection_launches"]
        decode_steps(rt, steps=1)
        assert rt.stats()["gpu_selection_launches"] == before


def test_cpu_task_selection_config():
    with pytest.raises(ConfigError, match="cpu_task_selection"):
        config_from_dict({"scheduler": {"cpu_task_selection": "cpu"}})
    if not CUDA:
        with pytest.raises(ConfigError, match="cpu_task_selection: 'gpu' needs"):
            HybridRuntime(picks_config("gpu"))  # the reference executor cannot select
    cfg = picks_config("auto")
    # "auto" needs the metadata on the GPU: CUDA, with the UVA executor.
    assert not selects_cpu_tasks_on_gpu(cfg, cuda=False)
    assert selects_cpu_tasks_on_gpu(cfg, cuda=True)
    assert resolved(cfg, cuda=True).scheduler.cpu_task_selection == "auto"  # decided step by step
    assert resolved(picks_config("gpu"), cuda=True).scheduler.cpu_task_selection == "gpu"
    assert resolved(cfg, cuda=False).scheduler.cpu_task_selection == "host"
    assert resolved(picks_config("auto", placement="cpu_only"), cuda=True).scheduler.cpu_task_selection == "host"
    assert not selects_cpu_tasks_on_gpu(picks_config("host"), cuda=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_runtime_cpu_tasks_on_the_gpu_selection_match_host_selection_on_cuda():
    cfg = picks_config("auto", workers=2)
    outs = {}
    for mode in ("gpu", "host"):
        with prefilled(HybridRuntime(cfg)) as rt:
            assert rt.scheduler.picks is not None
            rt.scheduler.picks.enabled = mode == "gpu"
            rt.scheduler.picks.EXPLORE_AFTER = 0  # tiny steps: the selection would not pay (`pays`)
            outs[mode] = decode_steps(rt, steps=4)
            stats = rt.stats()
            if mode == "gpu":
                assert stats["gpu_selection_launches"] > 0 and stats["gpu_selection_refused"] == 0
                assert stats["cpu_tasks_gpu_selected"] > 0
    for a, b in zip(outs["gpu"], outs["host"]):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_the_selection_latency_is_learned_from_its_end_events():
    from hybrid_runtime.gpu_picks import GpuPicks

    class Event:
        def __init__(self, t: float, done: bool = True):
            self.t, self.done = t, done

        def query(self) -> bool:
            return self.done

    class Clock:
        def to_host(self, ev: Event) -> float:
            return ev.t

    class Executor:
        def __init__(self):
            self.end = None

        def pick(self, *args) -> Event:
            self.end = Event(time.perf_counter() + 0.001, done=False)  # ends 1 ms after its launch
            return self.end

    picks = GpuPicks(4, 8, torch.device("cpu"), meta_block_bytes=512)
    ex = Executor()
    expected = picks.launch(ex, None, 0, 2, None, 1, clock=Clock())
    assert expected >= time.perf_counter() - 1.0 and picks.latency.seconds == GpuPicks.LATENCY_S
    picks.learn(Clock())  # not ended yet: nothing learned, still pending
    assert picks.latency.seconds == GpuPicks.LATENCY_S
    ex.end.done = True
    picks.launch(ex, None, 0, 2, None, 2, clock=Clock())  # learns the previous launch's latency first
    assert GpuPicks.LATENCY_S < picks.latency.seconds < 0.001
    assert picks.host_ns_per_block(512e9) == 1 and picks.host_ns_per_block(512e6) == 1000


def test_a_step_uses_the_selection_when_its_metadata_takes_the_cpu_lane_longer_than_the_selections_latency():
    from hybrid_runtime.gpu_picks import GpuPicks

    picks = GpuPicks(4, 8, torch.device("cpu"), meta_block_bytes=512)
    picks.latency.seconds = 100e-6
    # 2e4 blocks x 512 B at 100 GB/s: 102 us of the CPU lane's reading; 1e4: 51 us.
    assert picks.pays(20_000, 100e9)
    said = [picks.pays(10_000, 100e9) for _ in range(2 * (GpuPicks.EXPLORE_AFTER + 1))]
    assert said.count(True) == 2 and said[GpuPicks.EXPLORE_AFTER] and said[-1], "one exploring step in EXPLORE_AFTER + 1"


def test_steps_that_keep_paying_select_on_the_host_ever_less_often():
    """The CPU lane's own rate (what `pays` weighs the selection against) is learned only on steps
    that select on the host: after `HOST_EXPLORE_AFTER` steps on the selection one step is such, and
    the interval doubles (up to `HOST_EXPLORE_MAX`) while the step after it pays again."""
    from hybrid_runtime.gpu_picks import GpuPicks

    picks = GpuPicks(4, 8, torch.device("cpu"), meta_block_bytes=512)
    picks.latency.seconds = 100e-6
    first, cap = GpuPicks.HOST_EXPLORE_AFTER, GpuPicks.HOST_EXPLORE_MAX
    intervals = [min(first << i, cap) for i in range(8)]  # 8, 16, ..., 256, 256
    said = [picks.pays(20_000, 100e9) for _ in range(sum(intervals) + len(intervals))]
    on_host = [i for i, used in enumerate(said) if not used]
    assert np.diff([-1] + on_host).tolist() == [n + 1 for n in intervals]
    assert picks.skipped_steps == picks.host_explore_steps == len(intervals)
    assert picks.host_explore_after == cap


def test_a_step_that_does_not_pay_starts_the_host_steps_interval_over():
    from hybrid_runtime.gpu_picks import GpuPicks

    picks = GpuPicks(4, 8, torch.device("cpu"), meta_block_bytes=512)
    picks.latency.seconds = 100e-6
    n = GpuPicks.HOST_EXPLORE_AFTER
    said = [picks.pays(20_000, 100e9) for _ in range(n + 2)]  # a host step, then one that pays
    assert not said[n] and said[n + 1] and picks.host_explore_after == 2 * n
    assert not picks.pays(10_000, 100e9)  # 51 us of metadata against 100: no
    assert picks.host_explore_after == n
    said = [picks.pays(20_000, 100e9) for _ in range(n + 1)]
    assert said == [True] * n + [False]


def test_a_step_after_a_host_one_that_does_not_pay_keeps_the_interval_short():
    from hybrid_runtime.gpu_picks import GpuPicks

    picks = GpuPicks(4, 8, torch.device("cpu"), meta_block_bytes=512)
    picks.latency.seconds = 100e-6
    n = GpuPicks.HOST_EXPLORE_AFTER
    assert [picks.pays(20_000, 100e9) for _ in range(n + 1)][-1] is False
    # The host step measured a faster CPU lane: its metadata no longer outlasts the selection.
    assert not picks.pays(20_000, 400e9)
    assert picks.host_explore_after == n


def test_the_selection_is_weighed_against_the_later_start_it_costs_the_cpu_lane():
    from hybrid_runtime.gpu_picks import GpuPicks

    picks = GpuPicks(4, 8, torch.device("cpu"), meta_block_bytes=512)
    picks.latency.seconds = 1.0  # not what is weighed once the later start is known
    # 2e4 blocks x 512 B at 100 GB/s: 102 us of the CPU lane's reading.
    assert picks.pays(20_000, 100e9, later_start_s=50e-6)
    assert not picks.pays(20_000, 100e9, later_start_s=150e-6)
    assert picks.pays(20_000, 100e9, later_start_s=-30e-6), "a selection that starts the lane earlier pays"
