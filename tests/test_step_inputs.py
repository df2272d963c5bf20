"""gpu_kernels/step_inputs.py: one launch making a decode step's inputs ready (interpreted on CI)."""

from __future__ import annotations

import pytest
import torch

from gpu_kernels._checks import interpreted
from gpu_kernels.step_inputs import N_COUNTS, StepInputsPlan, count_columns, prepare_step_inputs

if not torch.cuda.is_available() and not interpreted():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def buffers(b, hq, d, cols=None):
    n = b * hq
    z = lambda m: torch.full((m,), 7.0, device=DEV)  # noqa: E731 -- not the values the kernel writes
    counts = torch.full((N_COUNTS, cols or count_columns(n)), -5, dtype=torch.int32, device=DEV)
    return dict(qs=z(n * d).view(b, hq, d), q_host=z(n * d), lane=(z(n * d), z(n * d), z(n)), counts=counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8, 32), (3, 9, 64), (5, 28, 128)])
def test_every_destination_equals_the_torch_ops_it_replaces(dtype, shape):
    b, hq, d = shape
    hkv = {8: 2, 9: 3, 28: 4}[hq]
    g = torch.Generator(device="cpu").manual_seed(b * hq)
    q = torch.randn(b, hq, d, generator=g).to(dtype).to(DEV)
    k = torch.randn(b, hkv, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(b, hkv, d, generator=g).to(dtype).to(DEV)
    scale = d ** -0.5
    buf = buffers(b, hq, d)
    prepare_step_inputs(q, k, v, scale, buf["qs"], q_host=buf["q_host"], lane=buf["lane"], counts=buf["counts"])
    ref = q.float()
    ref.mul_(scale)  # the runtime's former ops: a copy into fp32, then an in-place multiply
    assert torch.equal(buf["qs"], ref)
    assert torch.equal(buf["q_host"].view(b, hq, d), ref)
    gq, gout, glse = buf["lane"]
    assert torch.equal(gq.view(b, hq, d), ref)
    assert torch.equal(gout, torch.zeros_like(gout)) and bool((glse == float("-inf")).all())
    cols = count_columns(b * hq)
    assert buf["counts"][:, :cols].sum(dim=1).tolist() == [0, 0, 0]


def test_counts_name_each_tensor_and_strided_inputs_are_read_in_place():
    b, hq, hkv, d = 4, 8, 2, 32
    base = torch.randn(b, d, hq, device=DEV, dtype=torch.bfloat16)
    q = base.transpose(1, 2)  # [b, hq, d], not contiguous
    kv = torch.randn(b, hkv, 2, d, device=DEV, dtype=torch.bfloat16)
    k, v = kv[:, :, 0], kv[:, :, 1]  # strided views
    q[1, 3, 5] = float("nan")
    q[3, 7, 0] = float("inf")
    k[2, 1, 31] = float("-inf")
    v[0, 0, 0] = float("nan")
    v[3, 1, 7] = float("nan")
    v[3, 1, 8] = float("inf")
    buf = buffers(b, hq, d, cols=count_columns(b * hq) + 3)  # wider than needed: its extra columns are not written
    prepare_step_inputs(q, k, v, 0.5, buf["qs"], counts=buf["counts"])
    cols = count_columns(b * hq)
    assert buf["counts"][:, :cols].sum(dim=1).tolist() == [2, 1, 3]
    assert bool((buf["counts"][:, cols:] == -5).all())
    finite = torch.isfinite(q.float())
    assert torch.equal(buf["qs"][finite], (q.float() * 0.5)[finite])
    # Destinations not asked for are left alone.
    assert bool((buf["q_host"] == 7.0).all()) and bool((buf["lane"][1] == 7.0).all())


def test_the_planned_launch_writes_what_the_plain_one_does_as_its_inputs_change():
    """`StepInputsPlan` (decode's path): every call's q, k, v, batch, strides and destinations, one
    plan per variant; each call equals `prepare_step_inputs` on the same arguments."""
    plan = StepInputsPlan()
    hq, hkv, d = 8, 2, 32
    g = torch.Generator(device="cpu").manual_seed(3)
    for b, dtype, host, lane, count, strided in ((2, torch.bfloat16, True, True, True, False),
                                                  (3, torch.bfloat16, True, True, True, True),
                                                  (3, torch.float32, False, True, False, False),
                                                  (1, torch.bfloat16, True, False, True, False),
                                                  (2, torch.bfloat16, True, True, True, False)):
        q = torch.randn(b, hq, d, generator=g).to(dtype).to(DEV)
        kv = torch.randn(b, hkv, 2, d, generator=g).to(dtype).to(DEV)
        k, v = (kv[:, :, 0], kv[:, :, 1]) if strided else (kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous())
        k[0, 0, 1] = float("nan")
        got, want = buffers(b, hq, d), buffers(b, hq, d)
        for fn, buf in ((plan, got), (prepare_step_inputs, want)):
            fn(q, k, v, 0.25, buf["qs"], q_host=buf["q_host"] if host else None, lane=buf["lane"] if lane else None,
               counts=buf["counts"] if count else None)
        for name in ("qs", "q_host", "counts"):
            assert torch.equal(got[name], want[name]), name
        for a, w in zip(got["lane"], want["lane"]):
            assert torch.equal(a, w)
    assert len(plan._plans) == 3  # bf16 with every destination served three calls of other shapes


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's own fp32 cast of 1e300
def test_a_wide_float_counts_as_its_storage_says():
    """float64 beyond float32's range: k and v are finite in their own dtype; scaled q is inf in fp32."""
    q = torch.ones(1, 4, 16, dtype=torch.float64, device=DEV)
    k = torch.ones(1, 2, 16, dtype=torch.float64, device=DEV)
    v = k.clone()
    q[0, 0, 0] = 1e300
    k[0, 1, 3] = 1e300
    buf = buffers(1, 4, 16)
    prepare_step_inputs(q, k, v, 1.0, buf["qs"], counts=buf["counts"])
    assert buf["counts"][:, : count_columns(4)].sum(dim=1).tolist() == [1, 0, 0]


def test_bad_arguments_are_refused_before_the_launch():
    q = torch.randn(2, 8, 32, device=DEV)
    k = torch.randn(2, 2, 32, device=DEV)
    buf = buffers(2, 8, 32)
    with pytest.raises(ValueError, match="k has shape"):
        prepare_step_inputs(q, torch.randn(2, 3, 32, device=DEV), k, 1.0, buf["qs"])
    with pytest.raises(ValueError, match="q_host has shape"):
        prepare_step_inputs(q, k, k, 1.0, buf["qs"], q_host=torch.zeros(10, device=DEV))
    with pytest.raises(ValueError, match="counts has shape"):
        prepare_step_inputs(q, k, k, 1.0, buf["qs"], counts=torch.zeros(3, 1, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="q has shape"):
        prepare_step_inputs(q.to(torch.int32), k, k, 1.0, buf["qs"])
    assert bool((buf["qs"] == 7.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the runtime launches the kernel on CUDA steps only")
@pytest.mark.parametrize("placement", ["cpu_only", "fluxion", "gpu_only"])
def test_decode_with_device_inputs_equals_dense_and_refuses_nonfinite_before_any_change(placement):
    """`decode` on CUDA inputs (the step-inputs kernel's path): budget 1.0 equals dense attention for
    q in bf16 and fp32; NaN/inf in q, k or v is refused naming the tensor, nothing appended."""
    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.reference import dense_attention
    from hybrid_runtime.runtime import HybridRuntime

    geom = {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
    cfg = config_from_dict({
        "geometry": geom,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 8192, "max_sequences": 4},
        "selection": {"name": "full"},
        "scheduler": {"placement": placement, "cpu_workers": 2, "gpu_worker": True, "finite_check": "sync"},
    })
    g = torch.Generator(device="cpu").manual_seed(3)
    with HybridRuntime(cfg) as rt:
        for s, n in enumerate((300, 1000, 2500)):
            for layer in (0, 1):
                kv = torch.randn(2, n, 2, 32, generator=g).to(DEV)
                rt.prefill(s, layer, kv[0], kv[1])
        for layer in (0, 1, 0):
            for dtype in (torch.bfloat16, torch.float32):
                q = torch.randn(3, 8, 32, generator=g).to(DEV, dtype)
                k, v = torch.randn(2, 3, 2, 32, generator=g).to(DEV, dtype)
                out = rt.decode(layer, [0, 1, 2], q, k, v)
                ref = torch.stack([dense_attention(q[b].float().cpu(), *rt.store.full_kv(s, layer))[0]
                                   for b, s in enumerate((0, 1, 2))])
                assert out.dtype == dtype and out.device == q.device
                torch.testing.assert_close(out.float().cpu(), ref, atol=1e-2 if dtype == torch.bfloat16 else 2e-3,
                                           rtol=1e-2 if dtype == torch.bfloat16 else 2e-3)
        # Those steps took the kernel's path: inputs on "cuda:0" are on the runtime's "cuda" (a
        # device compared without its index kept every step on the separate ops, unnoticed).
        assert rt._step_inputs._plans, "no decode step made its inputs ready in the one launch"
        lens = [rt.store.seq_len(s, 0) for s in range(3)]
        for name in ("q", "k", "v"):
            q = torch.randn(3, 8, 32, device=DEV)
            k, v = torch.randn(2, 3, 2, 32, device=DEV)
            {"q": q, "k": k, "v": v}[name][1, 1, 3] = float("nan")
            with pytest.raises(ValueError, match=f"{name} has 1 NaN/inf value of"):
                rt.decode(0, [0, 1, 2], q, k, v)
            assert [rt.store.seq_len(s, 0) for s in range(3)] == lens
