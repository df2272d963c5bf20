"""The NaN/inf input check and when it reports (`scheduler.finite_check`, hybrid_runtime/input_check.py).

`deferred` reports a bad input by a later call, before that call changes anything, naming the
tensors and the step they came from; on the host the check is computed at once and reported the
same way, so the semantics are tested here without CUDA. The counting kernel runs under the
interpreter here and compiled on CUDA; the `gpu` tests run the runtime's default on CUDA (`auto`:
deferred for a GPU-only step) against the synchronous check.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gpu_kernels.nonfinite_counts import MAX_TENSORS, SPLITS, count_nonfinite
from hybrid_runtime.config import ConfigError, SchedulerConfig, config_from_dict
from hybrid_runtime.input_check import DeferredInputCheck, defers, finite_check_mode
from hybrid_runtime.runtime import HybridRuntime
from tests.helpers import DEV
from tests.test_bad_input import snapshot

GEOM = {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32}


def with_finite_check(cfg, mode: str):
    """`cfg` with `scheduler.finite_check: mode`."""
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, finite_check=mode))


def make_runtime(mode: str, placement: str = "fluxion", device: str = "cpu", **kv) -> HybridRuntime:
    cfg = config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 2048, "max_sequences": 2,
                     "device": device, **kv},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.25},
        "scheduler": {"placement": placement, "cpu_workers": 1 if placement != "gpu_only" else 0,
                      "gpu_worker": placement != "cpu_only", "pin_cores": False, "step_timeout_s": 30.0},
        "profiling": {"enabled": False},
    })
    rt = HybridRuntime(with_finite_check(cfg, mode))
    gen = torch.Generator().manual_seed(0)
    for s in (0, 1):
        for layer in range(GEOM["layers"]):
            rt.prefill(s, layer, *(x.to(device) for x in (torch.randn(200, 2, 32, generator=gen),
                                                           torch.randn(200, 2, 32, generator=gen))))
    return rt


def inputs(seed: int, device: str = "cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, h, 32, generator=gen).to(device=device, dtype=dtype) for h in (8, 2, 2))


# ---------------------------------------------------------------------------- the key
def test_the_key_defaults_to_auto_and_refuses_other_values():
    assert finite_check_mode(SchedulerConfig()) == "auto"
    assert finite_check_mode(SchedulerConfig(finite_check="deferred")) == "deferred"
    with pytest.raises(ConfigError, match=r"scheduler.finite_check: 'later' is not allowed; allowed: auto, sync, deferred"):
        finite_check_mode(SchedulerConfig(finite_check="later"))  # built without config_from_dict's checks
    with pytest.raises(ConfigError, match="finite_check"):
        config_from_dict({"scheduler": {"finite_check": "later"}})
    with pytest.raises(ConfigError, match="scheduler.finite_check"):
        make_runtime("never")
    # auto defers only where the check would wait for the GPU: CUDA steps without a CPU lane.
    assert defers("auto", cuda=True, cpu_lane=False)
    assert not defers("auto", cuda=True, cpu_lane=True) and not defers("auto", cuda=False, cpu_lane=False)
    assert defers("deferred", cuda=False, cpu_lane=True) and not defers("sync", cuda=True, cpu_lane=False)


@pytest.mark.parametrize("placement", ["fluxion", "gpu_only"])
@pytest.mark.parametrize("mode", ["auto", "sync"])
def test_on_the_host_the_default_refuses_at_once_and_changes_nothing(placement, mode):
    with make_runtime(mode, placement) as rt:
        q, k, v = inputs(1)
        v[0, 1, 3] = float("nan")
        before = snapshot(rt)
        with pytest.raises(ValueError, match="v has 1 NaN/inf value of 128; .*nothing was changed"):
            rt.decode(0, [0, 1], q, k, v)
        assert snapshot(rt) == before
        assert rt.stats()["deferred_input_checks"] == 0


# ---------------------------------------------------------------------------- deferred
@pytest.mark.parametrize("placement", ["fluxion", "gpu_only"])
def test_a_deferred_bad_input_is_raised_by_the_next_decode_naming_the_tensor_and_its_step(placement):
    with make_runtime("deferred", placement) as rt:
        q, k, v = inputs(1)
        k[1, 0, 2] = float("inf")
        lens = [rt.store.window_len(s, 0) for s in (0, 1)]
        rt.decode(0, [0, 1], q, k, v)  # returns: the check is read later
        assert [rt.store.window_len(s, 0) for s in (0, 1)] == [n + 1 for n in lens]  # the step ran
        before = snapshot(rt)
        with pytest.raises(ValueError) as info:
            rt.decode(1, [0, 1], *inputs(2))
        msg = str(info.value)
        for part in ("k has 1 NaN/inf value of 128", "the decode step at layer 0 for sequences [0, 1] (decode call 1)",
                     "deferred input check (scheduler.finite_check)", "its k and v are in the store"):
            assert part in msg, msg
        assert "q has" not in msg and "v has" not in msg
        assert snapshot(rt) == before  # the call that raised changed nothing
        out = rt.decode(1, [0, 1], *inputs(3))  # reported once; the runtime stays usable
        assert torch.isfinite(out).all()
        st = rt.stats()
        assert st["finite_check"] == "deferred" and st["deferred_input_checks"] == 2  # the raising call checked nothing


def test_a_deferred_check_names_every_bad_tensor():
    with make_runtime("deferred") as rt:
        q, k, v = inputs(1, dtype=torch.bfloat16)
        q[0, 0, :3] = float("nan")
        v[1, 1, 0] = float("-inf")
        rt.decode(0, [0, 1], q, k, v)
        with pytest.raises(ValueError, match="q has 3 NaN/inf values of 512; v has 1 NaN/inf value of 128 in the inputs "
                                             "of the decode step at layer 0"):
            rt.decode(0, [0, 1], *inputs(2))


@pytest.mark.parametrize("call", ["prefill", "release", "close"])
def test_a_deferred_bad_input_is_raised_before_a_prefill_or_release_and_by_close(call):
    rt = make_runtime("deferred")
    try:
        q, k, v = inputs(1)
        q[0, 0, 0] = float("nan")
        rt.decode(0, [0, 1], q, k, v)
        before = snapshot(rt)
        with pytest.raises(ValueError, match="q has 1 NaN/inf value of 512 in the inputs of the decode step at layer 0") as info:
            if call == "prefill":
                rt.prefill(1, 0, *(torch.randn(8, 2, 32) for _ in range(2)), extend=True)
            elif call == "release":
                rt.release(1)
            else:
                rt.close()
        if call == "close":
            assert "raised by close(), after the runtime was closed" in info.value.__notes__ and rt.store.closed
        else:
            assert snapshot(rt) == before
    finally:
        rt.close()


def test_the_ring_of_checks_is_read_in_order_and_never_overrun():
    check = DeferredInputCheck(torch.device("cpu"))
    good = {"q": torch.zeros(1, 2, 4), "k": torch.zeros(1, 1, 4)}
    bad = {"q": torch.zeros(1, 2, 4), "k": torch.full((1, 1, 4), float("nan"))}
    for i in range(3 * check.SLOTS):  # more checks than rows: each row is read before it is reused
        check.next_call()
        check.issue(good, layer=i, seq_ids=[0])
    assert check.pending <= check.SLOTS
    check.poll(block=True)
    assert check.pending == 0
    check.next_call()
    check.issue(bad, layer=5, seq_ids=[0])
    check.next_call()
    check.issue(good, layer=6, seq_ids=[0])
    with pytest.raises(ValueError, match="k has 4 NaN/inf values of 4 in the inputs of the decode step at layer 5"):
        check.poll()
    assert check.pending == 1  # the good one after it stays for the next poll
    check.poll()
    assert check.pending == 0


# ---------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_count_nonfinite_counts_each_tensor_exactly(dtype):
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(5, 3, 12, 32, generator=gen).to(dtype)
    q = base[:, 1]  # strided [5, 12, 32]
    k = torch.randn(5, 4, 32, generator=gen).to(dtype)
    v = torch.randn(4, 5, 32, generator=gen).to(dtype).transpose(0, 1)  # [5, 4, 32], strides of a transpose
    look = torch.randn(5, 4, 32, generator=gen, dtype=torch.float64)
    look[2, 1, 0] = 1e300  # finite in float64, inf in float32: not counted
    rng = np.random.default_rng(4)
    for x, n in ((q, 7), (k, 1), (v, 0)):
        flat = rng.choice(x.numel(), n, replace=False)
        for i, pos in enumerate(flat):
            idx = np.unravel_index(pos, tuple(x.shape))
            x[idx] = (float("nan"), float("inf"), float("-inf"))[i % 3]
    look[4, 3, 31] = float("nan")
    tensors = tuple(t.to(DEV) for t in (q, k, v, look))
    out = torch.full((MAX_TENSORS, SPLITS), 99, dtype=torch.int32, device=DEV)  # every cell is written
    count_nonfinite(tensors, out)
    assert out.sum(1).tolist() == [7, 1, 0, 1]
    out.fill_(99)
    count_nonfinite(tensors[:2], out)
    assert out.sum(1).tolist() == [7, 1, 0, 0]
    with pytest.raises(ValueError, match="expected"):
        count_nonfinite(tensors, out[:, :2])


def test_a_check_counted_by_another_kernel_sums_only_the_columns_it_wrote():
    """`fused_row` / `issue_counted`: the step-inputs kernel writes a step's counts into the ring's
    next row; columns past the step's own hold an older, larger batch's counts and are not read."""
    check = DeferredInputCheck(torch.device("cpu"), fused_columns=6)
    row = check.fused_row()
    assert tuple(row.shape) == (3, 8)  # padded to 16 bytes a row
    row[:] = 0
    row[2, 5] = 7  # an older step's v count, beyond this step's 4 columns
    check.next_call()
    check.issue_counted({"q": 64, "k": 16, "v": 16}, 4, layer=1, seq_ids=[0, 1], stream=None)
    check.next_call()
    check.poll(block=True)  # nothing in its columns: no error
    assert check.pending == 0 and check.fused_checks == 1 and check.deferred_checks == 1
    assert check.device_checks == 0  # on the host: no event recorded
    row = check.fused_row()
    row[:] = 0
    row[1, 3] = 2
    check.issue_counted({"q": 64, "k": 16, "v": 16}, 4, layer=0, seq_ids=[1], stream=None)
    check.next_call()
    with pytest.raises(ValueError, match=r"k has 2 NaN/inf values of 16 in the inputs of the decode step at layer 0 "
                                         r"for sequences \[1\] \(decode call 2\)"):
        check.poll()
    assert check.pending == 0
    with pytest.raises(RuntimeError, match="no fused rows"):
        DeferredInputCheck(torch.device("cpu")).fused_row()


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_gpu_only_step_defers_its_check_and_trails_and_equals_the_waiting_sync_path():
    outs = []
    for mode, trails in (("auto", True), ("sync", False)):
        rt = make_runtime(mode, "gpu_only", device="cuda")
        rt.gpu_only_trails = rt.gpu_only_trails and trails
        try:
            res = []
            for step in range(4):
                for layer in range(GEOM["layers"]):
                    res.append(rt.decode(layer, [0, 1], *inputs(10 * step + layer, "cuda")))
            outs.append(torch.stack(res).cpu())
            st = rt.stats()
            if trails:
                assert st["deferred_input_checks"] == 8 and st["gpu_trailed_steps"] == 4  # layer 0 of 2 trails
                assert rt._input_check.device_checks == 8  # counted by the kernel, not on the host
                assert st["fused_input_checks"] == 8  # ... by the step-inputs kernel: no launch of its own
            else:
                assert st["deferred_input_checks"] == 0 and st["gpu_trailed_steps"] == 0
        finally:
            rt.close()
    # A trailing step is one claim, a waiting one several: split-K sums may round differently.
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bad", ["q", "k", "v"])
def test_on_cuda_a_gpu_only_step_s_bad_input_is_raised_by_a_later_call_naming_it(bad):
    with make_runtime("auto", "gpu_only", device="cuda") as rt:
        q, k, v = inputs(1, "cuda", torch.bfloat16)
        {"q": q, "k": k, "v": v}[bad][1, 0, 2] = float("inf")
        rt.decode(0, [0, 1], q, k, v)
        with pytest.raises(ValueError, match=f"{bad} has 1 NaN/inf value of .* the decode step at layer 0"):
            for layer in (1, 0, 1):  # read at the latest two calls later
                rt.decode(layer, [0, 1], *inputs(2, "cuda", torch.bfloat16))
        out = rt.decode(1, [0, 1], *inputs(3, "cuda", torch.bfloat16))  # layer 1's KV was never bad
        assert torch.isfinite(out).all()
